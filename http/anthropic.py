"""The Anthropic Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

What Claude-Code-style agents speak. A body is parsed on the tokenizer lane
(`parse_messages_body`): `system` (a string or text blocks) and `messages`
(`user`/`assistant`, content as a string or blocks) become the chat-template
messages every API converts to (http/tools.py): `text` blocks join into the
turn's content, an assistant's `tool_use` blocks become its `tool_calls`
(input as the arguments object), its `thinking` blocks its
`reasoning_content` (which the template renders or drops; `redacted_thinking`
is dropped), and each `tool_result` block a `tool` message (`tool_call_id`,
its text; `is_error` prefixes "Error: "). `tools` (`name`, `description`,
`input_schema`) are function tools and `tool_choice` maps onto a `ToolPlan`
(`auto`, `any` → required, `tool` → one named function, `none`;
`disable_parallel_tool_use`), rendered by `render_prompt` through the
model's own template. `max_tokens` is required; `stop_sequences`,
`temperature` and `top_p` (0 to 1), `top_k`, `stream` and
`output_config.format` (a JSON schema, through the same llguidance grammar
as OpenAI's `response_format`) are honoured (the SDK's newest `create` has
no temperature/top_p/top_k arguments: pass them in `extra_body`);
`metadata`, `cache_control`, `anthropic-version`/`anthropic-beta` and fields
this server does not know are ignored; `thinking` is validated and accepted
(whether the model reasons is its template's choice). Any `model` name is
accepted (agents send their own, e.g. a small model for background calls)
and the reply names the served model. Image, document and server-tool
blocks are a 400 naming the block; so is a final assistant turn (prefill).

The reply (`MessageBlocks`, over one `ReplySplitter`) is `content` blocks
in order: `thinking` (with an empty `signature`), `text` and `tool_use`
(`toolu_…` ids, `input` the parsed arguments); `stop_reason` is `tool_use`
when the reply made a call and ended by itself, `max_tokens` at the limit,
`stop_sequence` (with `stop_sequence` set) when one of the request's ended
it, else `end_turn`. `usage` follows Anthropic's accounting: the prompt is
`input_tokens` (not served by a cache tier) + `cache_read_input_tokens` (what
a tier served, `GenerationDone.cached_tokens`) + `cache_creation_input_tokens`
(always 0: every prompt is cached without a `cache_control` breakpoint).

A stream is `message_start`, `ping`, then per block `content_block_start` /
`content_block_delta` (`thinking_delta`, `text_delta`, one
`input_json_delta` per tool call) / `content_block_stop`, then
`message_delta` (stop reason, the final usage: the SDK's accumulator
overwrites `message_start`'s estimate with it) and `message_stop`; a failure
after the headers went out is one `error` event ending the stream. Errors
are Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`,
classified once (http/failures.py): 400 `invalid_request_error`, 401
`authentication_error`, 529 `overloaded_error` (the server cannot take it
now; the SDK retries those), 500 `api_error`. With `--api-key` the routes
take `x-api-key: KEY` or `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvcellar.actors.system import System
from kvcellar.engine.engine import LoadedModel, SamplingParams
from kvcellar.engine.generation import GenerationDone, GenerationRequest
from kvcellar.engine.tool_calls import offered_tool_names
from kvcellar.errors import BadRequest, PromptRefused, PromptTooLong
from kvcellar.http.cache_header import cache_header, stream_cache_header
from kvcellar.http.failures import classify_failure
from kvcellar.http.inbound import InboundPolicy, Intake
from kvcellar.http.parsing import TokenizerLane, _number, positive_bound, reply_processors, sampling_fields
from kvcellar.http.refusals import refused_unread
from kvcellar.http.streaming import (
    ANTHROPIC_PING_KEEPALIVE,
    KEEPALIVE_INTERVAL_S_DEFAULT,
    KeepAliveStreamingResponse,
    unless_client_leaves,
)
from kvcellar.http.tenancy import Access, body_namespace, request_tenant
from kvcellar.http.tool_grammar import ToolGrammarPolicy
from kvcellar.http.tools import (
    ContentText,
    Piece,
    ReasoningText,
    RenderedPrompt,
    ReplySplitter,
    ToolCall,
    ToolPlan,
    render_prompt,
)

STOP_SEQUENCES_MAX = 64
_TOOL_CHOICE_TYPES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}
_THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")
_ERROR_TYPES = {
    "invalid_request": (400, "invalid_request_error"),
    "not_found": (404, "not_found_error"),
    "unavailable": (529, "overloaded_error"),
    "server": (500, "api_error"),
    "insufficient_memory": (503, "insufficient_memory"),
}


@attrs.frozen(kw_only=True)
class MessagesJob:
    request: GenerationRequest
    stream: bool
    tools: ToolPlan
    reply_in_reasoning: bool

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)


# -- errors and auth -----------------------------------------------------------


def anthropic_error(status: int, error_type: str, message: str) -> JSONResponse:
    return JSONResponse({"type": "error", "error": {"type": error_type, "message": message}}, status_code=status)


def failure_event_body(error: Exception) -> tuple[int, dict[str, Any]]:
    """The status and Anthropic error body for an error raised while serving."""
    failure = classify_failure(error)
    status, error_type = _ERROR_TYPES[failure.kind]
    # Anthropic's errors have no `param`: the message names the field, as Anthropic's own do ("field: why").
    message = failure.message
    if isinstance(error, PromptTooLong):
        message = error.anthropic_message
    elif failure.param and failure.param not in message:
        message = f"{failure.param}: {message}"
    return status, {"type": "error", "error": {"type": error_type, "message": message, **failure.details}}


def _failure_response(error: Exception) -> JSONResponse:
    status, body = failure_event_body(error)
    return JSONResponse(body, status_code=status)


def _key_ok(request: Request, access: Access) -> bool:
    """`x-api-key: KEY` (Anthropic's header) or `Authorization: Bearer KEY` names a tenant (http/tenancy.py)."""
    return access.tenant_for(request) is not None


# -- routes --------------------------------------------------------------------


def messages_routes(
    system: System,
    lane: TokenizerLane,
    access: Access,
    *,
    keepalive_interval_s: float = KEEPALIVE_INTERVAL_S_DEFAULT,
    model_id: str | None = None,
) -> list[Route]:
    """The two Messages API routes over a started system, parsing on `lane`;
    a stream silent for `keepalive_interval_s` gets a `ping` (http/streaming.py).
    `model_id`: the name replies give the model (None: its directory's name)."""
    loaded = system.loaded
    model_id = model_id or loaded.model_dir.name

    async def messages(request: Request) -> Response:
        if not _key_ok(request, access):
            return refused_unread(anthropic_error(401, "authentication_error", "missing or wrong x-api-key"))
        try:
            work = partial(
                parse_messages_body,
                await request.body(),
                loaded,
                tool_grammar=lane.tool_grammar,
                inbound=lane.inbound,
                namespace=request_tenant(request).namespace,
            )
            job = await lane.run(work)
        except Exception as e:
            return _failure_response(e)
        if not system.admitting:
            return anthropic_error(529, "overloaded_error", "the server is shutting down")
        try:
            # Before the stream's headers go out: a request larger than the memory budget is a 503.
            system.check_memory(job.request)
        except Exception as e:
            return _failure_response(e)
        if job.stream:
            return KeepAliveStreamingResponse(
                _stream(system, job, lane, model_id),
                keepalive=ANTHROPIC_PING_KEEPALIVE,
                interval_s=keepalive_interval_s,
                media_type="text/event-stream",
                headers=stream_cache_header(job.prompt_tokens),
            )

        async def reply() -> Response:
            try:
                body, done = await _complete(system, job, lane, model_id)
                return JSONResponse(body, headers=cache_header(done, job.prompt_tokens))
            except Exception as e:
                return _failure_response(e)

        return await unless_client_leaves(request, reply)

    async def count_tokens(request: Request) -> Response:
        if not _key_ok(request, access):
            return refused_unread(anthropic_error(401, "authentication_error", "missing or wrong x-api-key"))
        try:
            rendered = await lane.run(partial(parse_count_body, await request.body(), loaded, lane.inbound))
        except Exception as e:
            return _failure_response(e)
        return JSONResponse({"input_tokens": len(rendered.prompt_ids)})

    return [
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ]


# -- parsing (on the tokenizer lane) ----------------------------------------------


def _decode_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise BadRequest("the request body is not valid UTF-8") from e
    except json.JSONDecodeError as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def parse_count_body(raw: bytes, loaded: LoadedModel, inbound: InboundPolicy | None = None) -> RenderedPrompt:
    """A count_tokens body (the Messages body without its generation fields),
    rendered as a Messages request with it would be (normalised, hosted tools left out)."""
    body = _decode_body(raw)
    rendered, _ = _render(body, loaded.tokenizer, (inbound or InboundPolicy()).intake())
    return rendered


def parse_messages_body(
    raw: bytes,
    loaded: LoadedModel,
    *,
    tool_grammar: ToolGrammarPolicy | None = None,
    inbound: InboundPolicy | None = None,
    namespace: str = "",
) -> MessagesJob:
    """Validate a Messages body into a job; raises `BadRequest` naming the
    field. `tool_grammar`: the server's tool-call grammar policy (None: none);
    `inbound`: what the server accepts, clamps and rewrites (http/inbound.py)."""
    body = _decode_body(raw)
    request_namespace = body_namespace(body, namespace)
    if body.get("max_tokens") is None:
        raise BadRequest(
            "'max_tokens' is required: a positive integer (an upper bound; the reply gets at most what the "
            "context leaves after the prompt)",
            param="max_tokens",
        )
    max_tokens_asked = positive_bound(body["max_tokens"], "max_tokens")
    intake = (inbound or InboundPolicy()).intake()
    rendered, plan = _render(body, loaded.tokenizer, intake, probe=True)
    prompt_ids = rendered.prompt_ids
    max_tokens = intake.grant_max_tokens(
        max_tokens_asked,
        prompt_tokens=len(prompt_ids),
        context_tokens_max=loaded.context_tokens_max,
        field="max_tokens",
        prompt_param="messages",
    )
    _thinking(body.get("thinking"))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    params = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 1.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        max_tokens=max_tokens,
        stop_token_ids=frozenset(loaded.tokenizer.eos_token_ids),
        **_sampling_fields(body, loaded),
    )
    processors, relaxed = reply_processors(tool_grammar, loaded.tokenizer, plan, rendered)
    request = GenerationRequest(
        prompt_ids=prompt_ids,
        params=params,
        stop_strings=_stop_sequences(body),
        logits_processors=processors,
        snapshot_at_tokens=rendered.snapshot_at_tokens,
        notes=intake.notes("messages", schema_keywords_relaxed=relaxed),
        namespace=request_namespace,
    )
    return MessagesJob(request=request, stream=stream, tools=plan, reply_in_reasoning=rendered.in_reasoning)


def _sampling_fields(body: dict[str, Any], loaded: LoadedModel) -> dict[str, Any]:
    """Of OpenAI's extra sampling fields the Messages API has `top_k`, and
    `output_config.format` (a JSON schema) is `response_format` json_schema,
    through the same grammar."""
    fields: dict[str, Any] = {"top_k": body.get("top_k")}
    output_config = body.get("output_config")
    if output_config is not None:
        if not isinstance(output_config, dict):
            raise BadRequest("'output_config' must be an object", param="output_config")
        output_format = output_config.get("format")
        if output_format is not None:
            if (
                not isinstance(output_format, dict)
                or output_format.get("type") != "json_schema"
                or not isinstance(output_format.get("schema"), dict)
            ):
                raise BadRequest(
                    "'output_config.format' must be {'type': 'json_schema', 'schema': {...}}",
                    param="output_config.format",
                )
            fields["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": output_format["schema"]},
            }
    try:
        return sampling_fields(fields, loaded, chat=True)
    except BadRequest as e:
        if e.param != "response_format":
            raise
        raise BadRequest(
            str(e).replace("'response_format'", "'output_config.format'"), param="output_config.format"
        ) from e


def _render(
    body: dict[str, Any], tokenizer: Any, intake: Intake, *, probe: bool = False
) -> tuple[RenderedPrompt, ToolPlan]:
    """Render the body's messages and tools; `probe` also finds the stable
    boundary the prompt-boundary snapshot goes to (count_tokens needs none)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required: a string (any name; this server serves one model)", param="model")
    plan = _tool_plan(body, intake)
    messages = _template_messages(body, intake)
    try:
        return render_prompt(tokenizer, messages, plan, probe=probe), plan
    except PromptRefused as e:
        raise BadRequest(str(e), param=e.param) from e


def _stop_sequences(body: dict[str, Any]) -> tuple[str, ...]:
    stops = body.get("stop_sequences")
    if stops is None:
        return ()
    if (
        not isinstance(stops, list)
        or not all(isinstance(s, str) and s for s in stops)
        or len(stops) > STOP_SEQUENCES_MAX
    ):
        raise BadRequest(
            f"'stop_sequences' must be a list of up to {STOP_SEQUENCES_MAX} non-empty strings", param="stop_sequences"
        )
    return tuple(stops)


def _thinking(thinking: Any) -> None:
    """Accepted and validated; the model's template decides whether it reasons."""
    if thinking is None:
        return
    if not isinstance(thinking, dict) or thinking.get("type") not in _THINKING_TYPES:
        raise BadRequest(
            f"'thinking' must be an object whose 'type' is one of {', '.join(_THINKING_TYPES)}", param="thinking"
        )
    budget = thinking.get("budget_tokens")
    if thinking["type"] == "enabled" and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise BadRequest("'thinking.budget_tokens' must be a positive integer", param="thinking.budget_tokens")


def _tool_plan(body: dict[str, Any], intake: Intake) -> ToolPlan:
    tools = _function_tools(body.get("tools"), intake)
    choice = body.get("tool_choice")
    if choice is None:
        choice = {"type": "auto"}
    if not isinstance(choice, dict) or choice.get("type") not in _TOOL_CHOICE_TYPES:
        raise BadRequest(
            f"'tool_choice' must be an object whose 'type' is one of {', '.join(_TOOL_CHOICE_TYPES)}",
            param="tool_choice",
        )
    kind = _TOOL_CHOICE_TYPES[choice["type"]]
    name = None
    if kind == "function":
        name = choice.get("name")
        if name not in offered_tool_names(tools):
            raise BadRequest(f"tool_choice names {name!r}, which is not one of 'tools'", param="tool_choice.name")
    elif kind == "required" and not tools:
        raise BadRequest("tool_choice 'any' needs 'tools'", param="tool_choice")
    disable_parallel = choice.get("disable_parallel_tool_use", False)
    if not isinstance(disable_parallel, bool):
        raise BadRequest(
            "'tool_choice.disable_parallel_tool_use' must be a boolean", param="tool_choice.disable_parallel_tool_use"
        )
    if not tools or kind == "none":
        return ToolPlan(choice="none")
    # Anthropic's strict tool use (`strict: true` on a tool) forces the tool-call grammar on.
    strict = any(isinstance(tool, dict) and tool.get("strict") is True for tool in body.get("tools") or ())
    return ToolPlan(tools=tools, choice=kind, function_name=name, parallel=not disable_parallel, strict=strict)


def _function_tools(tools: Any, intake: Intake) -> tuple[dict[str, Any], ...]:
    """Anthropic client tools as the template's function tools (OpenAI's
    shape); a server tool (`web_search_…`, `bash_…`, ...) goes to `intake.hosted_tool`."""
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list of tools", param="tools")
    parsed = []
    for index, tool in enumerate(tools):
        param = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise BadRequest(f"{param} must be an object", param=param)
        kind = tool.get("type") or "custom"
        if kind != "custom":
            intake.hosted_tool(str(kind), str(tool.get("name") or kind), param=f"{param}.type")
            continue
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise BadRequest(f"{param} needs a non-empty string 'name'", param=f"{param}.name")
        if not isinstance(tool.get("input_schema"), dict):
            raise BadRequest(f"{param} needs an 'input_schema' JSON schema object", param=f"{param}.input_schema")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise BadRequest(f"{param}.description must be a string", param=f"{param}.description")
        function = {"name": tool["name"], "description": description or "", "parameters": tool["input_schema"]}
        parsed.append({"type": "function", "function": function})
    return tuple(parsed)


def _template_messages(body: dict[str, Any], intake: Intake) -> list[dict[str, Any]]:
    """`system` and `messages` in the chat-template shape (http/tools.py).
    System text is normalised block by block (http/prompt_rules.py); a
    `system` message inside `messages` (Claude Code sends them) becomes a
    system turn where it stands (render_prompt places it)."""
    template: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = _system_text(system, "system", intake)
        if text:
            template.append({"role": "system", "content": text})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    tool_names: dict[str, str] = {}
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            raise BadRequest(f"{where}.role must be 'user', 'assistant' or 'system'", param=f"{where}.role")
        if message["role"] == "system":
            text = _system_text(message.get("content"), f"{where}.content", intake)
            if text:
                template.append({"role": "system", "content": text})
            continue
        content = message.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise BadRequest(f"{where}.content must be a string or a list of content blocks", param=f"{where}.content")
        if message["role"] == "assistant":
            if index == len(messages) - 1:
                raise BadRequest(
                    f"{where} is a final assistant turn (prefill), which this server does not "
                    "continue; end with a user turn",
                    param=where,
                )
            template.append(_assistant_turn(content, where, tool_names))
        else:
            template.extend(_user_turns(content, where, tool_names))
    return template


def _system_text(system: Any, where: str, intake: Intake) -> str:
    """A system prompt (a string or text blocks), each block normalised before they are joined."""
    if isinstance(system, str):
        return intake.normalize_system(system)
    if not isinstance(system, list):
        raise BadRequest(f"'{where}' must be a string or a list of text blocks", param=where)
    texts = []
    for index, block in enumerate(system):
        at = f"{where}[{index}]"
        if _block(block, at) != "text":
            raise BadRequest(f"{at} is a {block['type']!r} block; only 'text' blocks are accepted here", param=at)
        texts.append(intake.normalize_system(_text_of(block, at)))
    return "".join(texts)


def _block(block: Any, where: str) -> str:
    """The block's type, refusing blocks a text-only server cannot take."""
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise BadRequest(f"{where} must be a content block with a string 'type'", param=where)
    kind = block["type"]
    if kind in ("image", "document"):
        raise BadRequest(f"{where} is an {kind!r} block; this server serves a text-only model", param=where)
    return kind


def _text_of(block: dict[str, Any], where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise BadRequest(f"{where} is a text block and needs a string 'text'", param=f"{where}.text")
    return block["text"]


def _text_blocks(blocks: Any, where: str) -> str:
    if not isinstance(blocks, list):
        raise BadRequest(f"'{where}' must be a string or a list of text blocks", param=where)
    texts = []
    for index, block in enumerate(blocks):
        at = f"{where}[{index}]"
        if _block(block, at) != "text":
            raise BadRequest(f"{at} is a {block['type']!r} block; only 'text' blocks are accepted here", param=at)
        texts.append(_text_of(block, at))
    return "".join(texts)


def _assistant_turn(blocks: list[Any], where: str, tool_names: dict[str, str]) -> dict[str, Any]:
    texts, reasoning, calls = [], [], []
    for index, block in enumerate(blocks):
        at = f"{where}.content[{index}]"
        kind = _block(block, at)
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise BadRequest(f"{at} is a thinking block and needs a string 'thinking'", param=f"{at}.thinking")
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            calls.append(_tool_use(block, at, tool_names))
        elif kind != "redacted_thinking":
            raise BadRequest(
                f"{at} is a {kind!r} block; an assistant turn here takes text, thinking and tool_use blocks", param=at
            )
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        turn["tool_calls"] = calls
    if reasoning:
        turn["reasoning_content"] = "\n".join(reasoning)
    return turn


def _tool_use(block: dict[str, Any], at: str, tool_names: dict[str, str]) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not call_id:
        raise BadRequest(f"{at} is a tool_use block and needs a string 'id'", param=f"{at}.id")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{at} is a tool_use block and needs a string 'name'", param=f"{at}.name")
    if not isinstance(arguments, dict):
        raise BadRequest(f"{at}.input must be an object", param=f"{at}.input")
    tool_names[call_id] = name
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _user_turns(blocks: list[Any], where: str, tool_names: dict[str, str]) -> list[dict[str, Any]]:
    """A user message's blocks in order: each run of text one user turn, each tool_result a tool turn."""
    turns: list[dict[str, Any]] = []
    texts: list[str] = []
    for index, block in enumerate(blocks):
        at = f"{where}.content[{index}]"
        kind = _block(block, at)
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "tool_result":
            if texts:
                turns.append({"role": "user", "content": "".join(texts)})
                texts = []
            turns.append(_tool_result(block, at, tool_names))
        else:
            raise BadRequest(f"{at} is a {kind!r} block; a user turn here takes text and tool_result blocks", param=at)
    if texts or not turns:
        turns.append({"role": "user", "content": "".join(texts)})
    return turns


def _tool_result(block: dict[str, Any], at: str, tool_names: dict[str, str]) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise BadRequest(f"{at} is a tool_result block and needs a string 'tool_use_id'", param=f"{at}.tool_use_id")
    content = block.get("content", "")
    text = content if isinstance(content, str) else _text_blocks(content, f"{at}.content")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise BadRequest(f"{at}.is_error must be a boolean", param=f"{at}.is_error")
    turn = {"role": "tool", "tool_call_id": call_id, "content": f"Error: {text}" if is_error else text}
    if call_id in tool_names:
        turn["name"] = tool_names[call_id]
    return turn


# -- the reply -----------------------------------------------------------------


def tool_use_id(call: ToolCall) -> str:
    return f"toolu_{call.call_id.removeprefix('call_')}"


class MessageBlocks:
    """One reply's content blocks, built piece by piece; each step also says
    the stream events it makes (a non-streaming reply ignores them)."""

    def __init__(self, tokenizer: Any, plan: ToolPlan, *, in_reasoning: bool) -> None:
        self.splitter = ReplySplitter(tokenizer, plan, in_reasoning=in_reasoning)
        self.content: list[dict[str, Any]] = []
        self._open: str | None = None

    def feed(self, text: str) -> list[dict[str, Any]]:
        return [event for piece in self.splitter.feed(text) for event in self._piece_events(piece)]

    def finish(self) -> list[dict[str, Any]]:
        events = [event for piece in self.splitter.finish() for event in self._piece_events(piece)]
        return events + self._close()

    def _piece_events(self, piece: Piece) -> list[dict[str, Any]]:
        if isinstance(piece, ToolCall):
            events = self._close()
            block = {"type": "tool_use", "id": tool_use_id(piece), "name": piece.name, "input": piece.arguments_object}
            self.content.append(block)
            index = len(self.content) - 1
            return [
                *events,
                _block_start(index, {**block, "input": {}}),
                _block_delta(index, {"type": "input_json_delta", "partial_json": piece.arguments}),
                {"type": "content_block_stop", "index": index},
            ]
        assert isinstance(piece, ReasoningText | ContentText)
        kind = "thinking" if isinstance(piece, ReasoningText) else "text"
        delta_type = f"{kind}_delta"
        events = []
        if self._open != kind:
            events = self._close()
            self.content.append(
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
            self._open = kind
            events.append(_block_start(len(self.content) - 1, dict(self.content[-1])))
        self.content[-1][kind] += piece.text
        events.append(_block_delta(len(self.content) - 1, {"type": delta_type, kind: piece.text}))
        return events

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]


def _block_start(index: int, block: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_start", "index": index, "content_block": block}


def _block_delta(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": delta}


@attrs.define
class _Outcome:
    """What the generation told us, for `stop_reason` and `usage`."""

    done: GenerationDone | None = None
    raw_text: str = ""
    sampled_ids: list[int] = attrs.Factory(list)

    def add(self, item: Any) -> str:
        """Records an item; the text it carries ("" for the done item)."""
        if isinstance(item, GenerationDone):
            self.done = item
            return ""
        self.raw_text += item.text
        if item.token_id >= 0:
            self.sampled_ids.append(item.token_id)
        return item.text


async def _stop(
    outcome: _Outcome, job: MessagesJob, blocks: MessageBlocks, tokenizer: Any, lane: TokenizerLane
) -> tuple[str, str | None]:
    """(`stop_reason`, `stop_sequence`)."""
    done = outcome.done
    if done is None or done.finish_reason == "length":
        return "max_tokens", None
    stop_ids = job.request.params.stop_token_ids
    if not outcome.sampled_ids or outcome.sampled_ids[-1] in stop_ids or not job.request.stop_strings:
        return ("tool_use" if blocks.splitter.tool_calls else "end_turn"), None
    stops = job.request.stop_strings
    if len(stops) == 1:
        return "stop_sequence", stops[0]
    # Which one: the text the sampled tokens decode to holds it right after what was emitted.
    decoded = await lane.run(partial(tokenizer.decode, outcome.sampled_ids))
    at = len(outcome.raw_text)
    matched = next((stop for stop in stops if decoded.startswith(stop, at)), None)
    return "stop_sequence", matched or next((stop for stop in stops if stop in decoded[at:]), stops[0])


def _usage(job: MessagesJob, done: GenerationDone | None) -> dict[str, int]:
    cached = done.cached_tokens if done else 0
    return {
        "input_tokens": job.prompt_tokens - cached,
        "output_tokens": done.completion_tokens if done else 0,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _message(
    ident: str, model_id: str, content: list[dict[str, Any]], usage: dict[str, int], stop: tuple[str | None, str | None]
) -> dict[str, Any]:
    return {
        "id": ident,
        "type": "message",
        "role": "assistant",
        "model": model_id,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage,
    }


async def _complete(
    system: System, job: MessagesJob, lane: TokenizerLane, model_id: str
) -> tuple[dict[str, Any], GenerationDone | None]:
    """The reply's body, and how its generation ended (None: no end came)."""
    tokenizer = system.loaded.tokenizer
    blocks = MessageBlocks(tokenizer, job.tools, in_reasoning=job.reply_in_reasoning)
    outcome = _Outcome()
    async for item in system.generate(job.request):
        blocks.feed(outcome.add(item))
    blocks.finish()
    stop = await _stop(outcome, job, blocks, tokenizer, lane)
    return _message(_message_id(), model_id, blocks.content, _usage(job, outcome.done), stop), outcome.done


def _message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


async def _stream(system: System, job: MessagesJob, lane: TokenizerLane, model_id: str) -> AsyncIterator[str]:
    tokenizer = system.loaded.tokenizer
    blocks = MessageBlocks(tokenizer, job.tools, in_reasoning=job.reply_in_reasoning)
    outcome = _Outcome()
    # The cached share is known only at the end: message_delta carries the final usage.
    start_usage = {
        "input_tokens": job.prompt_tokens,
        "output_tokens": 0,
        "cache_read_input_tokens": 0,
        "cache_creation_input_tokens": 0,
    }
    yield _sse({"type": "message_start", "message": _message(_message_id(), model_id, [], start_usage, (None, None))})
    yield _sse({"type": "ping"})
    try:
        async for item in system.generate(job.request):
            for event in blocks.feed(outcome.add(item)):
                yield _sse(event)
        for event in blocks.finish():
            yield _sse(event)
        stop_reason, stop_sequence = await _stop(outcome, job, blocks, tokenizer, lane)
    except Exception as e:
        # The headers went out with 200: the failure is the stream's last event.
        _, body = failure_event_body(e)
        yield _sse(body)
        return
    yield _sse(
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": _usage(job, outcome.done),
        }
    )
    yield _sse({"type": "message_stop"})
