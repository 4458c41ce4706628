"""Tool calls and reasoning in a model's reply, for every API the server speaks.

API-neutral: it knows the model's tokenizer wrapper (mlx-lm's
`TokenizerWrapper`, which names the model's thinking markers and its tool
parser) and the generated text, never a request or response shape. The
OpenAI chat route shapes its pieces into `message`/`delta` fields; the
Anthropic Messages and Responses routes can shape the same pieces into their
blocks and items.

- `ToolPlan` is what a request asked of tools: the function tools to render
  through the model's own chat template, the choice (`auto`, `none`,
  `required`, or one named function) and whether parallel calls are allowed.
  `forced_prefix_text` is the text a `required` or named choice forces at the
  start of the reply (the tool-call start marker, and for mlx-lm's JSON tool
  format the function's name): the engine forces its tokens with a logits
  processor (`kvcellar.engine.forcing.ForcedTokens`), and what follows is
  still the model's; a reply that then does not parse as a call of the right
  function is returned as content with a logged warning.
- `ReplySplitter` consumes the reply's text deltas as they come and yields
  `ReasoningText`, `ContentText` and `ToolCall` pieces, incrementally, so a
  stream can send each as soon as it is known. The marker matching is
  mlx-lm's own `TextStateMachine` (text, not token ids, so a marker split
  across tokens is still found); a tool call's text is parsed with the
  tokenizer's `tool_parser` when its end marker arrives (or when the reply
  ends). Text a parser refuses is returned as content, markers included, with
  a WARNING: never an error.
- `render_prompt` renders template messages (the Hugging Face chat-template
  shape every API converts its messages to: `role`, `content` text,
  assistant `tool_calls` with arguments as objects and `reasoning_content`,
  `tool` messages with `tool_call_id`) with the plan's tools and tokenizes
  them; it refuses tools to a model whose tokenizer names no tool parser
  (`PromptRefused`, param `tools`).
- `stable_prefix_tokens` is the template probe (spec §4): how many leading
  tokens of a rendered prompt the same template renders identically once the
  conversation goes on, so a prompt-boundary snapshot put there is a prefix
  of the next turn's prompt even when the template re-renders earlier turns
  (e.g. drops the reasoning of turns before the last user message).

All of it runs wherever the HTTP side parses and shapes (a worker thread or
the Trio thread); none of it is MLX work.
"""

from __future__ import annotations

import bisect
import json
import logging
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
from mlx_lm.generate import TextStateMachine

from kvcellar.engine.tool_calls import offered_tool_names, parse_tool_calls
from kvcellar.errors import PromptRefused
from kvcellar.http.prompt_tokens import common_length, prompt_encoder

log = logging.getLogger("kvcellar.http.tools")

TOOL_CHOICES = ("auto", "none", "required")
_JSON_TOOLS_MODULE = "mlx_lm.tool_parsers.json_tools"
_NORMAL, _REASONING, _TOOL = "normal", "reasoning", "tool"
# The message the template probe appends: a turn that follows any reply.
_PROBE_MESSAGE = {"role": "user", "content": "kvcellar template probe"}


@attrs.frozen(kw_only=True)
class ToolPlan:
    """What a request asked of tools; `tools` is None when none are rendered
    (no tools given, or `tool_choice: "none"`)."""

    tools: tuple[dict[str, Any], ...] | None = None
    choice: str = "auto"
    function_name: str | None = None
    parallel: bool = True
    # A tool said `strict: true`: the tool-call grammar is on for this request (http/tool_grammar.py).
    strict: bool = False

    @property
    def parses_calls(self) -> bool:
        return bool(self.tools)

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [dict(tool) for tool in self.tools] if self.tools else None


NO_TOOLS = ToolPlan()


@attrs.frozen(kw_only=True)
class RenderedPrompt:
    """A chat prompt ready for the engine: its text and token ids, whether
    the reply starts inside a thinking block, the token ids a tool choice
    forces at the reply's start (`ForcedTokens`), and the template probe's
    stable boundary (`stable_prefix_tokens`; 0 when the probe did not run)."""

    text: str
    prompt_ids: tuple[int, ...]
    in_reasoning: bool
    forced_ids: tuple[int, ...]
    stable_prefix_tokens: int

    @property
    def snapshot_at_tokens(self) -> int | None:
        """The stable boundary as `GenerationRequest.snapshot_at_tokens`:
        None unless the probe found one strictly inside the prompt."""
        stable = self.stable_prefix_tokens
        return stable if 0 < stable < len(self.prompt_ids) else None


@attrs.frozen(kw_only=True)
class ReasoningText:
    text: str


@attrs.frozen(kw_only=True)
class ContentText:
    text: str


@attrs.frozen(kw_only=True)
class ToolCall:
    """One parsed call: `arguments` is a JSON object as a string (what
    OpenAI's `function.arguments` carries); `index` counts calls in the reply."""

    index: int
    call_id: str
    name: str
    arguments: str

    @property
    def arguments_object(self) -> Any:
        return json.loads(self.arguments)


Piece = ReasoningText | ContentText | ToolCall


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def supports_tools(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "has_tool_calling", False)) and getattr(tokenizer, "tool_parser", None) is not None


def supports_thinking(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "has_thinking", False))


def forced_prefix_text(tokenizer: Any, plan: ToolPlan) -> str:
    """The text a `required` or named choice forces the reply to start with:
    the tool-call start marker, then, for mlx-lm's JSON tool format
    (`{"name": ..., "arguments": ...}` inside the markers), the named
    function's name up to its arguments. "" for `auto` and `none`."""
    if not plan.parses_calls or plan.choice not in ("required", "function"):
        return ""
    start = tokenizer.tool_call_start
    parser = tokenizer.tool_parser
    if plan.function_name is not None and getattr(parser, "__module__", "") == _JSON_TOOLS_MODULE:
        return f'{start}\n{{"name": {json.dumps(plan.function_name)}, "arguments": '
    return start


def starts_in_reasoning(tokenizer: Any, prompt_ids: Sequence[int]) -> bool:
    """Whether the rendered prompt leaves a thinking block open (a template
    whose generation prompt ends in the think-start marker), so the reply
    begins as reasoning."""
    if not supports_thinking(tokenizer) or not tokenizer.think_start_tokens:
        return False
    ids = list(prompt_ids)
    return tokenizer.rfind_think_start(ids) > tokenizer.rfind_think_end(ids)


def render_prompt(
    tokenizer: Any, messages: list[dict[str, Any]], plan: ToolPlan = NO_TOOLS, *, probe: bool = False
) -> RenderedPrompt:
    """Render and tokenize a chat for the model; raises `PromptRefused`. With
    `probe`, also run the template probe (one more render; with a fast
    tokenizer the prompt's token offsets spare it a second encode whenever
    the renderings part right after an added token such as a turn marker)."""
    if plan.parses_calls and not supports_tools(tokenizer):
        raise PromptRefused(
            "this model does not support tool calling (its tokenizer names no tool parser); "
            "send no 'tools', or tool_choice 'none'",
            param="tools",
        )
    tools = plan.template_tools()
    text, messages = _render_text(tokenizer, messages, tools)
    encoded = prompt_encoder(tokenizer).encode(text)
    prompt_ids = encoded.ids
    forced = forced_prefix_text(tokenizer, plan)
    forced_ids = tuple(tokenizer.encode(forced, add_special_tokens=False)) if forced else ()
    stable = 0
    if probe:
        try:
            stable = stable_prefix_tokens(
                tokenizer, messages, prompt_ids, tools=tools, rendered=text, added_marks=encoded.marks
            )
        except Exception as e:  # a template that refuses the probe turn: no stable boundary known
            log.info("template probe refused (%s: %s); no stable boundary", type(e).__name__, e)
    return RenderedPrompt(
        text=text,
        prompt_ids=prompt_ids,
        in_reasoning=starts_in_reasoning(tokenizer, prompt_ids),
        forced_ids=forced_ids,
        stable_prefix_tokens=stable,
    )


def _render_text(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> tuple[str, list[dict[str, Any]]]:
    """The rendered text, and the messages it was rendered from. System
    messages past the first message (agents put them anywhere) go through the
    template where it renders them; a template that refuses them or drops
    their text gets them merged (`merge_inner_system`)."""
    inner = _inner_system(messages)
    try:
        text = _apply_template(tokenizer, messages, tools)
    except PromptRefused:
        if not inner:
            raise
        text = None
    if text is not None and all(message["content"] in text for message in inner):
        return text, messages
    merged = merge_inner_system(messages)
    return _apply_template(tokenizer, merged, tools), merged


def _apply_template(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # the template's own refusal (raise_exception) or failure: the messages' fault
        raise PromptRefused(f"the model's chat template cannot render these messages: {e}", param="messages") from e
    if not isinstance(text, str):
        raise PromptRefused("the model's chat template did not render text", param="messages")
    return text


def _inner_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The system messages with text other than the first message."""
    return [message for message in messages[1:] if message["role"] == "system" and message["content"]]


def merge_inner_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with one system message at most, first: the system
    messages that open the chat join into it; each later one is put before
    the next user turn's text (a blank line between), or, when no user turn
    follows, appended to the opening system message."""
    opening = []
    rest = list(messages)
    while rest and rest[0]["role"] == "system":
        opening.append(rest.pop(0)["content"])
    merged: list[dict[str, Any]] = []
    pending: list[str] = []
    for message in rest:
        if message["role"] == "system":
            pending.append(message["content"])
            continue
        if message["role"] == "user" and pending:
            message = {**message, "content": "\n\n".join([*pending, message["content"]])}
            pending = []
        merged.append(message)
    opening.extend(pending)
    opening = [text for text in opening if text]
    if opening:
        merged.insert(0, {"role": "system", "content": "\n\n".join(opening)})
    return merged


def _transitions(tokenizer: Any, plan: ToolPlan) -> dict[str, list[tuple[str, str]]]:
    """mlx-lm's reasoning and tool transitions (`make_text_state_machine`),
    the tool ones only when the request parses tool calls."""
    transitions: dict[str, list[tuple[str, str]]] = {}
    if supports_thinking(tokenizer):
        transitions[_NORMAL] = [(tokenizer.think_start, _REASONING)]
        transitions[_REASONING] = [(tokenizer.think_end, _NORMAL)]
    if plan.parses_calls and supports_tools(tokenizer):
        transitions.setdefault(_NORMAL, []).append((tokenizer.tool_call_start, _TOOL))
        if _REASONING in transitions:
            transitions[_REASONING].append((tokenizer.tool_call_start, _TOOL))
        end = tokenizer.tool_call_end
        transitions[_TOOL] = [(end, _NORMAL)] if end else []
    return transitions


class ReplySplitter:
    """Splits one reply's text into reasoning, content and tool calls as it
    streams. `feed(text)` and then `finish()` yield the pieces in order; after
    `finish`, `tool_calls` holds every call and `finish_reason(engine_reason)`
    says `tool_calls` when the reply made one.

    Whitespace around markers is formatting, not text: after a marker the
    next piece's leading whitespace is dropped, and the whitespace before a
    marker is held back and dropped when the marker comes (emitted when more
    text of the same kind follows, or when the reply ends without a marker)."""

    def __init__(self, tokenizer: Any, plan: ToolPlan = NO_TOOLS, *, in_reasoning: bool = False) -> None:
        self._tokenizer = tokenizer
        self._plan = plan
        transitions = _transitions(tokenizer, plan)
        self._machine = TextStateMachine(transitions or None) if transitions else None
        initial = _REASONING if in_reasoning and _REASONING in transitions else _NORMAL
        self._state = self._machine.make_state(initial) if self._machine is not None else None
        self._current = initial
        self._held = ""
        self._strip_leading = initial == _REASONING
        self._tool_text = ""
        self._finished = False
        self.tool_calls: list[ToolCall] = []
        self.content_text = ""
        self.reasoning_text = ""

    @property
    def active(self) -> bool:
        """False when the model marks neither thinking nor (for this request) tool calls."""
        return self._machine is not None

    def feed(self, text: str) -> Iterator[Piece]:
        if not text:
            return
        if self._machine is None:
            yield from self._emit(_NORMAL, text)
            return
        self._state, segments = TextStateMachine.split(self._state, text)
        for state_name, segment in segments:
            yield from self._segment(state_name, segment)

    def finish(self) -> Iterator[Piece]:
        """The rest of the reply: the text a possible marker held back, the
        held whitespace, and an unterminated tool call (parsed if it can be)."""
        if self._finished:
            return
        self._finished = True
        if self._machine is not None:
            self._state, rest, state_name = TextStateMachine.flush(self._state)
            yield from self._segment(state_name, rest)
        if self._current == _TOOL:
            yield from self._close_tool_call(terminated=False)
        elif self._held:
            held, self._held = self._held, ""
            yield from self._emit(self._current, held, raw=True)

    def finish_reason(self, engine_reason: str) -> str:
        """`tool_calls` when the reply made a call and ended by itself (not by length)."""
        return "tool_calls" if self.tool_calls and engine_reason == "stop" else engine_reason

    def _segment(self, state_name: str | None, text: str) -> Iterator[Piece]:
        state_name = state_name or _NORMAL
        if state_name != self._current:
            yield from self._transition(state_name)
        if state_name == _TOOL:
            self._tool_text += text
        elif text:
            yield from self._emit(state_name, text)

    def _transition(self, new_state: str) -> Iterator[Piece]:
        if self._current == _TOOL:
            yield from self._close_tool_call(terminated=True)
        self._held = ""
        self._current = new_state
        self._strip_leading = True

    def _emit(self, state_name: str, text: str, *, raw: bool = False) -> Iterator[Piece]:
        if not raw and self._machine is not None:
            if self._strip_leading:
                text = text.lstrip()
                if not text:
                    return
                self._strip_leading = False
            text = self._held + text
            body = text.rstrip()
            self._held = text[len(body) :]
            text = body
        if not text:
            return
        if state_name == _REASONING:
            self.reasoning_text += text
            yield ReasoningText(text=text)
        else:
            self.content_text += text
            yield ContentText(text=text)

    def _close_tool_call(self, *, terminated: bool) -> Iterator[Piece]:
        tool_text, self._tool_text = self._tool_text, ""
        calls = self._parse(tool_text)
        if calls is None:
            end = self._tokenizer.tool_call_end if terminated else ""
            raw = f"{self._tokenizer.tool_call_start}{tool_text}{end or ''}"
            yield from self._emit(_NORMAL, raw, raw=True)
            return
        for name, arguments in calls:
            if not self._plan.parallel and self.tool_calls:
                log.warning(
                    "the reply made more than one tool call with parallel_tool_calls false; the call of %r is dropped",
                    name,
                )
                continue
            call = ToolCall(index=len(self.tool_calls), call_id=new_call_id(), name=name, arguments=arguments)
            self.tool_calls.append(call)
            yield call

    def _parse(self, tool_text: str) -> list[tuple[str, str]] | None:
        """The (name, arguments JSON) of each call in one tool block, or None
        when the model's parser refuses the text or it names no known tool."""
        try:
            calls = parse_tool_calls(self._tokenizer.tool_parser, tool_text, self._plan.template_tools())
        except Exception as e:  # a third-party parser over model output: any failure is the text's
            log.warning(
                "generated tool-call text does not parse (%s: %s); returned as content: %r",
                type(e).__name__,
                e,
                tool_text[:200],
            )
            return None
        known = offered_tool_names(self._plan.tools)
        unknown = [name for name, _ in calls if name not in known]
        wanted = self._plan.function_name
        if unknown or (wanted is not None and any(name != wanted for name, _ in calls)):
            log.warning(
                "generated tool call names %s, not %s; returned as content",
                ", ".join(repr(name) for name, _ in calls),
                repr(wanted) if wanted else "a tool of the request",
            )
            return None
        return calls


def stable_prefix_tokens(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    prompt_ids: Sequence[int],
    *,
    tools: list[dict[str, Any]] | None,
    rendered: str,
    added_marks: Sequence[tuple[int, int, int]] = (),
) -> int:
    """The template probe: render the same messages followed by one more user
    turn and count the leading tokens of `prompt_ids` (the rendering of
    `messages` with the generation prompt, `rendered` as text) that this
    continuation keeps. A template that renders every turn the same way keeps
    all of them but the generation prompt; one that re-renders earlier turns
    once a new user turn follows keeps fewer. `added_marks` are the prompt's
    plain added tokens (`EncodedPrompt.marks`): when the common text ends
    right after one of them (the usual case: the renderings part at the role
    after a turn marker), the count is its position, equal to what encoding
    the common text again would give (http/prompt_tokens.py: cutting the text
    right after such a token leaves every piece and token before it as it
    was, and nothing after it); otherwise the common text is encoded again.
    Raises whatever the template raises (the caller decides what a refusal
    means)."""
    continued = tokenizer.apply_chat_template(
        messages + [_PROBE_MESSAGE], tools=tools, add_generation_prompt=False, tokenize=False
    )
    common_chars = common_length(rendered, continued)
    position = bisect.bisect_left(added_marks, common_chars, key=lambda mark: mark[1])
    if position < len(added_marks) and added_marks[position][1] == common_chars:
        return added_marks[position][2] + 1
    common_ids = tokenizer.encode(rendered[:common_chars], add_special_tokens=False)
    # The text's last token may merge differently once cut: count only tokens both agree on.
    return common_length(prompt_ids, common_ids)
