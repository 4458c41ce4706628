"""The OpenAI Responses API: `POST /v1/responses`, stateless.

Nothing is stored: `store: true` is accepted but the reply says `store:
false` and no response can be retrieved (`GET /v1/responses/{id}` is a 404
saying so); `previous_response_id`, `conversation`, `background` and
`item_reference` input items are 400s that say the server is stateless. A
client resends the whole conversation as `input` each turn, which is what
makes the tiers pay: the next turn's prompt starts with this turn's.

A request becomes the same job as an OpenAI chat request (`parse_job`), so
both APIs share one rendering, one sampling path and one reply splitter:

- `input` (a string, or items: messages whose content is a string or
  `input_text`/`output_text` parts, `function_call`, `function_call_output`
  and `reasoning` items) becomes template messages. A run of reasoning, an
  assistant message and function calls is one assistant turn (its
  `reasoning_content`, `content` and `tool_calls`); a function call output is
  a `tool` message. `instructions` and the system/developer messages that open
  the input become one leading system message (many templates take a system
  message only first). Reasoning items are handed to the template, which
  renders or drops them (Qwen3-style templates drop the reasoning of turns
  before the last user message).
- function `tools` (`{"type": "function", "name", "description",
  "parameters", "strict"}`), `tool_choice` (`auto`, `none`, `required`,
  `{"type": "function", "name"}`) and `parallel_tool_calls` become the chat
  tool plan; any other tool type is a 400 naming it.
- `max_output_tokens`, `temperature`, `top_p`, `text.format` (`text`,
  `json_object`, `json_schema`: the chat route's llguidance grammars), and the
  sampling extensions the chat route takes (`seed`, `top_k`, `min_p`, the
  penalties); `metadata`, `user`, `include`, `reasoning`, `truncation` and
  `store` are accepted and otherwise ignored. A bad field is a 400 naming it
  in the Responses spelling (`input[2].arguments`, `text.format`).

`ResponseShaper` turns the reply's pieces (reasoning, content, tool calls:
`ReplySplitter`) into output items (`reasoning`, `message`,
`function_call`) and the typed stream events the OpenAI SDK parses, each with
its `sequence_number`; the non-streaming reply is the same fold without the
events. A reply cut by `max_output_tokens` is `status: "incomplete"` with
`incomplete_details.reason: "max_output_tokens"`; a stream that fails after
it started ends with an `error` event and `response.failed`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvcellar.actors.system import System
from kvcellar.engine.engine import LoadedModel
from kvcellar.engine.generation import GenerationDone, TokenDelta
from kvcellar.errors import BadRequest, PromptTooLong
from kvcellar.http.cache_header import cache_header, stream_cache_header
from kvcellar.http.inbound import InboundPolicy, Intake
from kvcellar.http.parsing import CompletionJob, TokenizerLane, parse_job, positive_bound
from kvcellar.http.streaming import (
    KEEPALIVE_INTERVAL_S_DEFAULT,
    SSE_COMMENT_KEEPALIVE,
    KeepAliveStreamingResponse,
    unless_client_leaves,
)
from kvcellar.http.tenancy import body_namespace, request_tenant
from kvcellar.http.tool_grammar import ToolGrammarPolicy
from kvcellar.http.tools import TOOL_CHOICES, ContentText, Piece, ReasoningText, ReplySplitter, ToolCall

FailureBody = Callable[[Exception], tuple[int, dict[str, Any]]]

# Fields handed to the chat parser as they are: the Responses API's own and the
# sampling extensions local servers take.
_PASSED_FIELDS = (
    "model",
    "temperature",
    "top_p",
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "user",
    "stream",
)
# Fields that need state this server does not keep.
_STATEFUL_FIELDS = {
    "previous_response_id": "this server is stateless and stores no responses: send the whole conversation as "
    "'input' instead of 'previous_response_id'",
    "conversation": "this server is stateless and keeps no conversations: send the whole conversation as 'input'",
    "prompt": "this server stores no prompt templates: send 'instructions' and 'input'",
}
_NOT_TEXT_PARTS = ("input_image", "input_file", "input_audio")
_ASSISTANT_ITEMS = ("reasoning", "function_call")
# A chat parser's param -> the Responses request's.
_PARAMS = {"messages": "input", "response_format": "text.format", "max_tokens": "max_output_tokens"}


@attrs.frozen(kw_only=True)
class ResponsesJob:
    """A parsed request: the generation job and the request fields the
    response object echoes (`instructions`, `tools`, `tool_choice`, ...)."""

    job: CompletionJob
    echo: dict[str, Any]


# -- the request ---------------------------------------------------------------


def parse_responses_body(
    raw: bytes,
    loaded: LoadedModel,
    *,
    max_tokens_default: int,
    tool_grammar: ToolGrammarPolicy | None = None,
    inbound: InboundPolicy | None = None,
    namespace: str = "",
) -> ResponsesJob:
    """Decode and validate a Responses request, render and tokenize its
    input; raises `BadRequest` naming the field. `tool_grammar`: the
    server's tool-call grammar policy (None: none)."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise BadRequest("the request body is not valid UTF-8") from e
    except json.JSONDecodeError as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _refuse_state(body)
    intake = (inbound or InboundPolicy()).intake()
    tools, echoed_tools = _function_tools(body.get("tools"), intake)
    chat_body: dict[str, Any] = {name: body[name] for name in _PASSED_FIELDS if name in body}
    chat_body.update(
        messages=input_messages(body, intake),
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice")),
        parallel_tool_calls=body.get("parallel_tool_calls"),
        max_tokens=_max_output_tokens(body, max_tokens_default),
        response_format=_text_format(body.get("text")),
    )
    top_logprobs = body.get("top_logprobs")
    if top_logprobs not in (None, 0):
        raise BadRequest(
            "'top_logprobs' is not supported on /v1/responses (use /v1/chat/completions)", param="top_logprobs"
        )
    try:
        job = parse_job(
            chat_body,
            loaded,
            chat=True,
            max_tokens_default=max_tokens_default,
            tool_grammar=tool_grammar,
            intake=intake,
            api="responses",
            namespace=body_namespace(body, namespace),
        )
    except PromptTooLong as e:
        e.param = "input"
        raise
    except BadRequest as e:
        raise BadRequest(str(e), param=_responses_param(e.param)) from e
    metadata = body.get("metadata")
    echo = {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": metadata if isinstance(metadata, dict) else {},
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "temperature": job.request.params.temperature,
        "top_p": job.request.params.top_p,
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"),
        "tools": echoed_tools,
        "user": body.get("user"),
    }
    return ResponsesJob(job=job, echo=echo)


def _responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    if param.startswith("messages["):
        return "input"
    return _PARAMS.get(param, param)


def _refuse_state(body: dict[str, Any]) -> None:
    for name, message in _STATEFUL_FIELDS.items():
        if body.get(name) is not None:
            raise BadRequest(message, param=name)
    if body.get("background") not in (None, False):
        raise BadRequest(
            "'background' responses need stored state; this server is stateless: send "
            "'background': false or leave it out",
            param="background",
        )
    for name in ("store", "stream", "parallel_tool_calls"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise BadRequest(f"'{name}' must be a boolean", param=name)


def _max_output_tokens(body: dict[str, Any], default: int) -> int:
    value = body.get("max_output_tokens")
    if value is None:
        return default
    return positive_bound(value, "max_output_tokens")


def _text_format(text: Any) -> dict[str, Any] | None:
    """`text.format` as the chat parser's `response_format`."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise BadRequest("'text' must be an object such as {'format': {'type': 'text'}}", param="text")
    spec = text.get("format")
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise BadRequest("'text.format.type' must be one of 'text', 'json_object', 'json_schema'", param="text.format")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise BadRequest("'text.format.name' must be a non-empty string", param="text.format.name")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise BadRequest("'text.format.schema' must be a JSON schema object", param="text.format.schema")
    return {
        "type": "json_schema",
        "json_schema": {"name": spec["name"], "schema": schema, "strict": spec.get("strict")},
    }


def _function_tools(tools: Any, intake: Intake) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The tools as the chat parser takes them, and as the response echoes
    them; a hosted tool (`web_search`, `namespace`, ...) goes to `intake.hosted_tool`."""
    if tools is None:
        return [], []
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list of function tools", param="tools")
    chat_tools, echoed = [], []
    for index, tool in enumerate(tools):
        param = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise BadRequest(f"{param} must be an object", param=param)
        kind = tool.get("type")
        if kind != "function":
            intake.hosted_tool(str(kind), str(tool.get("name") or kind), param=param)
            continue
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise BadRequest(f"{param} needs a non-empty string 'name'", param=f"{param}.name")
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise BadRequest(f"{param}.parameters must be a JSON schema object", param=f"{param}.parameters")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise BadRequest(f"{param}.description must be a string", param=f"{param}.description")
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise BadRequest(f"{param}.strict must be a boolean", param=f"{param}.strict")
        function: dict[str, Any] = {"name": name}
        if description is not None:
            function["description"] = description
        if parameters is not None:
            function["parameters"] = parameters
        if tool.get("strict") is True:
            # Chat's `function.strict`: the tool-call grammar is on for this request.
            function["strict"] = True
        chat_tools.append({"type": "function", "function": function})
        echoed.append({"type": "function", **function, "parameters": parameters, "strict": tool.get("strict")})
    return chat_tools, echoed


def _tool_choice(choice: Any) -> Any:
    """`tool_choice` as the chat parser takes it (which checks the name against the tools)."""
    if choice is None or (isinstance(choice, str) and choice in TOOL_CHOICES):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise BadRequest(
        f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or {{'type': 'function', 'name': ...}}",
        param="tool_choice",
    )


# -- input items -> template messages -------------------------------------------


def input_messages(body: dict[str, Any], intake: Intake) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat-template messages."""
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string", param="instructions")
    items = body.get("input")
    if isinstance(items, str) and items:
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("'input' must be a non-empty string or a non-empty list of items", param="input")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        if isinstance(item, dict) and item.get("type") == "additional_tools":
            _additional_tools(item, f"input[{index}]", intake)
            continue
        _add_item(messages, item, f"input[{index}]")
    return _leading_system(instructions, messages)


def _leading_system(instructions: str | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`instructions` and the system messages that open the input, joined into one."""
    opening = [instructions] if instructions else []
    while messages and messages[0]["role"] == "system":
        opening.append(messages.pop(0)["content"])
    if opening:
        messages.insert(0, {"role": "system", "content": "\n\n".join(opening)})
    return messages


def _additional_tools(item: dict[str, Any], param: str, intake: Intake) -> None:
    """Codex's `additional_tools` input item (sent when it does not know the
    model): a `namespace` of tools that run inside Codex's own sandbox, which
    this server cannot offer as function tools; each goes to `intake.hosted_tool`."""
    tools = item.get("tools")
    if not isinstance(tools, list):
        raise BadRequest(f"{param}.tools must be a list", param=f"{param}.tools")
    for index, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        name = tool.get("name") if isinstance(tool, dict) else None
        intake.hosted_tool(str(kind or "namespace"), str(name or kind), param=f"{param}.tools[{index}]")


def _add_item(messages: list[dict[str, Any]], item: Any, param: str) -> None:
    if not isinstance(item, dict):
        raise BadRequest(f"{param} must be an object", param=param)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise BadRequest(
                f"{param}.role must be one of 'user', 'assistant', 'system', 'developer'", param=f"{param}.role"
            )
        content = _content_text(item.get("content"), param)
        if role == "assistant":
            turn = _assistant_turn(messages, starts_new=False)
            turn["content"] += content
        else:
            messages.append({"role": "system" if role == "developer" else role, "content": content})
    elif kind == "function_call":
        turn = _assistant_turn(messages, starts_new=False)
        turn.setdefault("tool_calls", []).append(_function_call(item, param))
    elif kind == "function_call_output":
        messages.append(
            {
                "role": "tool",
                "tool_call_id": _output_call_id(messages, item, param),
                "content": _call_output(item.get("output"), param),
            }
        )
    elif kind == "reasoning":
        text = _reasoning_text(item, param)
        turn = _assistant_turn(messages, starts_new=True)
        if text:
            turn["reasoning_content"] = turn.get("reasoning_content", "") + text
    elif kind == "item_reference":
        raise BadRequest(
            f"{param} is an 'item_reference'; this server is stateless and stores no items: send the item itself",
            param=param,
        )
    else:
        raise BadRequest(
            f"{param} is a {kind!r} item; this server takes 'message', 'function_call', "
            "'function_call_output' and 'reasoning' items",
            param=f"{param}.type",
        )


def _assistant_turn(messages: list[dict[str, Any]], *, starts_new: bool) -> dict[str, Any]:
    """The assistant turn an assistant item belongs to: the last message when
    it is one (a reasoning item after its content or calls opens the next)."""
    if messages and messages[-1]["role"] == "assistant":
        last = messages[-1]
        if not starts_new or not (last["content"] or last.get("tool_calls")):
            return last
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    messages.append(turn)
    return turn


def _string(item: dict[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{param} needs a non-empty string '{name}'", param=f"{param}.{name}")
    return value


def _call_id(item: dict[str, Any], param: str) -> str:
    """A `function_call`'s `call_id`; one without (a client replaying its history may drop it)
    gets its item `id`, else one named after its place, so the turn still renders."""
    for name in ("call_id", "id"):
        value = item.get(name)
        if isinstance(value, str) and value:
            return value
    return "call_" + "".join(ch if ch.isalnum() else "_" for ch in param).strip("_")


def _output_call_id(messages: list[dict[str, Any]], item: dict[str, Any], param: str) -> str:
    """A `function_call_output`'s `call_id`. One without, but named, is context the client adds
    itself (Codex sends `{"name": "goal_objective", "namespace": "agent", "output": …}` after its
    `create_goal` call's own output): it answers no call, and gets an id from its name. An unnamed
    one answers the latest call no output answered yet."""
    value = item.get("call_id")
    if isinstance(value, str) and value:
        return value
    name = item.get("name")
    if isinstance(name, str) and name:
        namespace = item.get("namespace")
        return f"{namespace}.{name}" if isinstance(namespace, str) and namespace else name
    answered = {message.get("tool_call_id") for message in messages if message["role"] == "tool"}
    for message in reversed(messages):
        for call in reversed(message.get("tool_calls", [])):
            if call["id"] not in answered:
                return str(call["id"])
    raise BadRequest(
        f"{param} is a 'function_call_output' without a 'call_id', and no earlier function_call is left "
        "for it to answer: send the call_id of the function_call it answers",
        param=f"{param}.call_id",
    )


def _function_call(item: dict[str, Any], param: str) -> dict[str, Any]:
    """A `function_call` item as a template tool call, its arguments an object (templates apply `tojson`)."""
    call_id, name = _call_id(item, param), _string(item, "name", param)
    arguments = item.get("arguments", "{}")
    try:
        parsed = json.loads(arguments or "{}") if isinstance(arguments, str) else None
    except json.JSONDecodeError as e:
        raise BadRequest(f"{param}.arguments is not valid JSON: {e}", param=f"{param}.arguments") from e
    if not isinstance(parsed, dict):
        raise BadRequest(f"{param}.arguments must be a JSON object as a string", param=f"{param}.arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}}


def _content_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{param}.content must be a string or a list of text parts", param=f"{param}.content")
    return "".join(_part_text(part, f"{param}.content[{index}]") for index, part in enumerate(content))


def _part_text(part: Any, param: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in _NOT_TEXT_PARTS:
        raise BadRequest(
            f"{param} is an {kind!r} part; this server serves a text-only model and takes only "
            "'input_text' and 'output_text' parts",
            param=param,
        )
    if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
        raise BadRequest(f"{param} must be an 'input_text' or 'output_text' part with a string 'text'", param=param)
    return part["text"]


def _call_output(output: Any, param: str) -> str:
    """A function call's output: a string, or a list of text parts."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "".join(_part_text(part, f"{param}.output[{index}]") for index, part in enumerate(output))
    raise BadRequest(f"{param}.output must be a string or a list of 'input_text' parts", param=f"{param}.output")


def _reasoning_text(item: dict[str, Any], param: str) -> str:
    """A reasoning item's text: its `reasoning_text` content, else its summary
    (`encrypted_content` is opaque to this server and dropped)."""
    for field, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(field)
        if parts is None:
            continue
        if not isinstance(parts, list) or not all(
            isinstance(part, dict) and isinstance(part.get("text"), str) for part in parts
        ):
            raise BadRequest(f"{param}.{field} must be a list of {part_type!r} parts", param=f"{param}.{field}")
        if parts:
            return "\n".join(part["text"] for part in parts)
    return ""


# -- the reply -------------------------------------------------------------------


@attrs.define
class _OpenItem:
    """The reasoning or message item text is streaming into."""

    kind: str
    item_id: str
    output_index: int
    text: str = ""


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseShaper:
    """One reply as Responses output items and stream events. `start()`, a
    `feed(delta)` per sampled token and `finish(done)` return the events in
    order (dicts with `type` and `sequence_number`); `response` is the
    response object so far (the whole reply after `finish`)."""

    def __init__(self, tokenizer: Any, job: ResponsesJob, model_id: str) -> None:
        self._job = job
        self._splitter = ReplySplitter(tokenizer, job.job.tools, in_reasoning=job.job.reply_in_reasoning)
        self._model_id = model_id
        self._id = _new_id("resp")
        self._created_at = int(time.time())
        self._sequence = 0
        self._output: list[dict[str, Any]] = []
        self._open: _OpenItem | None = None
        self._reasoning_tokens = 0
        self.response = self._response("in_progress")

    def start(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self.response),
            self._event("response.in_progress", response=self.response),
        ]

    def feed(self, delta: TokenDelta) -> list[dict[str, Any]]:
        pieces = list(self._splitter.feed(delta.text))
        if any(isinstance(piece, ReasoningText) for piece in pieces):
            self._reasoning_tokens += 1
        return [event for piece in pieces for event in self._piece_events(piece)]

    def finish(self, done: GenerationDone) -> list[dict[str, Any]]:
        events = [event for piece in self._splitter.finish() for event in self._piece_events(piece)]
        cut = done.finish_reason == "length"
        if not self._output:
            events += self._open_item("message")  # a reply with no text still has its message
        events += self._close_open("incomplete" if cut else "completed")
        usage = {
            "input_tokens": done.prompt_tokens,
            "input_tokens_details": {"cached_tokens": done.cached_tokens},
            "output_tokens": done.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens},
            "total_tokens": done.prompt_tokens + done.completion_tokens,
        }
        status = "incomplete" if cut else "completed"
        self.response = self._response(
            status, usage=usage, incomplete_details={"reason": "max_output_tokens"} if cut else None
        )
        return events + [self._event(f"response.{status}", response=self.response)]

    def fail(self, status: int, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The stream's last events after a failure: `error` (the OpenAI
        error's message, code and param) and `response.failed`."""
        error = body["error"]
        code = "invalid_prompt" if status < 500 else "server_error"
        self.response = self._response("failed", error={"code": code, "message": error["message"]})
        return [
            self._event("error", code=error.get("code") or code, message=error["message"], param=error.get("param")),
            self._event("response.failed", response=self.response),
        ]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _response(
        self,
        status: str,
        *,
        usage: dict[str, Any] | None = None,
        incomplete_details: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return {
            "id": self._id,
            "object": "response",
            "created_at": self._created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": incomplete_details,
            "model": self._model_id,
            "output": list(self._output),
            "previous_response_id": None,
            "reasoning": {"effort": None},
            "store": False,
            "truncation": "disabled",
            "usage": usage,
            **self._job.echo,
        }

    def _piece_events(self, piece: Piece) -> list[dict[str, Any]]:
        if isinstance(piece, ToolCall):
            return self._close_open("completed") + self._call_events(piece)
        kind = "reasoning" if isinstance(piece, ReasoningText) else "message"
        events = []
        if self._open is None or self._open.kind != kind:
            events = self._close_open("completed") + self._open_item(kind)
        assert self._open is not None
        self._open.text += piece.text
        where = {"item_id": self._open.item_id, "output_index": self._open.output_index, "content_index": 0}
        if isinstance(piece, ContentText):
            return events + [self._event("response.output_text.delta", **where, delta=piece.text, logprobs=[])]
        return events + [self._event("response.reasoning_text.delta", **where, delta=piece.text)]

    def _open_item(self, kind: str) -> list[dict[str, Any]]:
        item = _OpenItem(
            kind=kind, item_id=_new_id("rs" if kind == "reasoning" else "msg"), output_index=len(self._output)
        )
        self._open = item
        self._output.append(_item_body(item, "in_progress"))
        where = {"item_id": item.item_id, "output_index": item.output_index}
        return [
            self._event("response.output_item.added", output_index=item.output_index, item=self._output[-1]),
            self._event("response.content_part.added", **where, content_index=0, part=_part(item)),
        ]

    def _close_open(self, status: str) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        where = {"item_id": item.item_id, "output_index": item.output_index, "content_index": 0}
        if item.kind == "message":
            done = self._event("response.output_text.done", **where, text=item.text, logprobs=[])
        else:
            done = self._event("response.reasoning_text.done", **where, text=item.text)
        self._output[item.output_index] = _item_body(item, status)
        return [
            done,
            self._event("response.content_part.done", **where, part=_part(item)),
            self._event(
                "response.output_item.done", output_index=item.output_index, item=self._output[item.output_index]
            ),
        ]

    def _call_events(self, call: ToolCall) -> list[dict[str, Any]]:
        item_id, output_index = _new_id("fc"), len(self._output)
        body = {"type": "function_call", "id": item_id, "call_id": call.call_id, "name": call.name}
        self._output.append({**body, "arguments": call.arguments, "status": "completed"})
        where = {"item_id": item_id, "output_index": output_index}
        return [
            self._event(
                "response.output_item.added",
                output_index=output_index,
                item={**body, "arguments": "", "status": "in_progress"},
            ),
            self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
            self._event("response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments),
            self._event("response.output_item.done", output_index=output_index, item=self._output[-1]),
        ]


def _part(item: _OpenItem) -> dict[str, Any]:
    if item.kind == "message":
        return {"type": "output_text", "text": item.text, "annotations": []}
    return {"type": "reasoning_text", "text": item.text}


def _item_body(item: _OpenItem, status: str) -> dict[str, Any]:
    """The output item; its content is empty while it is in progress, as OpenAI streams it."""
    content = [_part(item)] if status != "in_progress" else []
    if item.kind == "message":
        return {"type": "message", "id": item.item_id, "role": "assistant", "status": status, "content": content}
    return {"type": "reasoning", "id": item.item_id, "summary": [], "content": content, "status": status}


# -- the route -------------------------------------------------------------------


class ResponsesRoute:
    """The `/v1/responses` handlers over a running system; `failure_body`
    maps an error to its status and OpenAI error body (http/app.py's)."""

    def __init__(
        self,
        system: System,
        lane: TokenizerLane,
        *,
        model_id: str,
        max_tokens_default: int,
        failure_body: FailureBody,
        keepalive_interval_s: float = KEEPALIVE_INTERVAL_S_DEFAULT,
    ) -> None:
        self._system = system
        # A stream silent this long gets an SSE comment (http/streaming.py).
        self._keepalive_interval_s = keepalive_interval_s
        self._lane = lane
        self._model_id = model_id
        self._max_tokens_default = max_tokens_default
        self._failure_body = failure_body

    async def create(self, request: Request) -> Response:
        work = partial(
            parse_responses_body,
            await request.body(),
            self._system.loaded,
            max_tokens_default=self._max_tokens_default,
            tool_grammar=self._lane.tool_grammar,
            inbound=self._lane.inbound,
            namespace=request_tenant(request).namespace,
        )
        try:
            job = await self._lane.run(work)
        except Exception as e:
            return self._failure(e)
        if not self._system.admitting:
            return JSONResponse(
                {
                    "error": {
                        "message": "the server is shutting down",
                        "type": "server_unavailable",
                        "param": None,
                        "code": None,
                    }
                },
                status_code=503,
            )
        try:
            # Before the stream's headers go out: a request larger than the memory budget is a 503.
            self._system.check_memory(job.job.request)
        except Exception as e:
            return self._failure(e)
        shaper = ResponseShaper(self._system.loaded.tokenizer, job, self._model_id)
        prompt_tokens = job.job.prompt_tokens
        if job.job.stream:
            return KeepAliveStreamingResponse(
                self._events(job, shaper),
                keepalive=SSE_COMMENT_KEEPALIVE,
                interval_s=self._keepalive_interval_s,
                media_type="text/event-stream",
                headers=stream_cache_header(prompt_tokens),
            )
        return await unless_client_leaves(request, partial(self._reply, job, shaper))

    async def _reply(self, job: ResponsesJob, shaper: ResponseShaper) -> Response:
        """The whole response at once (not streamed)."""
        prompt_tokens = job.job.prompt_tokens
        done = None
        try:
            async for item in self._system.generate(job.job.request):
                if isinstance(item, GenerationDone):
                    done = item
                    shaper.finish(item)
                else:
                    shaper.feed(item)
        except Exception as e:
            return self._failure(e)
        return JSONResponse(shaper.response, headers=cache_header(done, prompt_tokens))

    async def not_stored(self, request: Request) -> Response:
        """Every read of a stored response: none is stored."""
        return JSONResponse(
            {
                "error": {
                    "message": f"no response {request.path_params['response_id']!r}: "
                    "this server is stateless and stores no responses",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "not_found",
                }
            },
            status_code=404,
        )

    async def _events(self, job: ResponsesJob, shaper: ResponseShaper) -> AsyncIterator[str]:
        for event in shaper.start():
            yield _sse(event)
        try:
            async for item in self._system.generate(job.job.request):
                events = shaper.finish(item) if isinstance(item, GenerationDone) else shaper.feed(item)
                for event in events:
                    yield _sse(event)
        except Exception as e:
            # The headers went out with 200: the failure is the stream's last events.
            for event in shaper.fail(*self._failure_body(e)):
                yield _sse(event)

    def _failure(self, error: Exception) -> JSONResponse:
        status, body = self._failure_body(error)
        return JSONResponse(body, status_code=status)


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
