"""The OpenAI-compatible ASGI app (Starlette on hypercorn's Trio worker).

This first version serves the serial lane straight from the engine thread:
chat and text completions, streaming (SSE) and not, `/v1/models` and
`/health`. Bad input gets a 400 with an OpenAI-style error body naming the
field; it never reaches the engine.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import attrs
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from kvcellar.engine.engine import EngineThread, LoadedModel, SamplingParams, generate_tokens
from kvcellar.errors import KvCellarError

MAX_TOKENS_DEFAULT = 256
MAX_TOKENS_LIMIT = 32768


class BadRequest(KvCellarError):
    """Raised for a request body the API cannot serve. The client's fault; it
    becomes a 400 naming the offending field."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@attrs.frozen(kw_only=True)
class CompletionJob:
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stop_strings: tuple[str, ...]
    stream: bool
    include_usage: bool
    chat: bool


def error_response(status: int, message: str, *, param: str | None = None,
                   error_type: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": error_type, "param": param, "code": None}},
                        status_code=status)


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"'{name}' must be a number", param=name)
    if not low <= value <= high:
        raise BadRequest(f"'{name}' must be between {low} and {high}", param=name)
    return float(value)


def _max_tokens(body: dict[str, Any]) -> int:
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    value = body.get(name, MAX_TOKENS_DEFAULT)
    if value is None:
        return MAX_TOKENS_DEFAULT
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS_LIMIT:
        raise BadRequest(f"'{name}' must be an integer between 1 and {MAX_TOKENS_LIMIT}", param=name)
    return value


def _stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise BadRequest("'stop' must be a non-empty string or a list of up to 4 of them", param="stop")
    return tuple(stop)


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    parsed = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{index}] needs a string 'role'", param=f"messages[{index}].role")
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        if not isinstance(content, str):
            raise BadRequest(f"messages[{index}].content must be a string", param=f"messages[{index}].content")
        parsed.append({"role": message["role"], "content": content})
    return parsed


def parse_job(body: Any, loaded: LoadedModel, *, chat: bool) -> CompletionJob:
    """Validate a request body into a job; raises `BadRequest` naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model_name = body.get("model")
    if model_name is not None and model_name not in _model_names(loaded):
        raise BadRequest(f"model {model_name!r} is not served here; see GET /v1/models", param="model")
    if body.get("n", 1) != 1:
        raise BadRequest("only 'n' = 1 is supported", param="n")
    tokenizer = loaded.tokenizer
    if chat:
        text = tokenizer.apply_chat_template(_messages(body), add_generation_prompt=True, tokenize=False)
    else:
        text = body.get("prompt")
        if not isinstance(text, str) or not text:
            raise BadRequest("'prompt' must be a non-empty string", param="prompt")
    prompt_ids = tuple(tokenizer.encode(text, add_special_tokens=False))
    max_tokens = _max_tokens(body)
    if len(prompt_ids) + max_tokens > loaded.context_tokens_max:
        raise BadRequest(f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                         f"model's context of {loaded.context_tokens_max} tokens", param="messages" if chat else "prompt")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("'seed' must be an integer", param="seed")
    params = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        seed=seed,
        max_tokens=max_tokens,
        stop_token_ids=frozenset(tokenizer.eos_token_ids),
    )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    return CompletionJob(prompt_ids=prompt_ids, params=params, stop_strings=_stop_strings(body), stream=stream,
                         include_usage=bool(stream_options.get("include_usage")), chat=chat)


def _model_names(loaded: LoadedModel) -> set[str]:
    return {loaded.model_dir.name, str(loaded.model_dir)}


class _TextAssembler:
    """Turns token ids into text deltas, holding back an incomplete UTF-8
    sequence and anything that could still become a stop string."""

    def __init__(self, tokenizer: Any, stop_token_ids: frozenset[int], stop_strings: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop_token_ids = stop_token_ids
        self.stop_strings = stop_strings
        self.ids: list[int] = []
        self.emitted = 0
        self.finished_by_stop = False

    def add(self, token_id: int) -> str:
        if token_id in self.stop_token_ids:
            self.finished_by_stop = True
            return self.flush()
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        for stop in self.stop_strings:
            at = text.find(stop)
            if at != -1:
                self.finished_by_stop = True
                return self._emit_until(text, at)
        if text.endswith("\ufffd"):
            return ""
        hold = max((len(s) - 1 for s in self.stop_strings), default=0)
        return self._emit_until(text, max(self.emitted, len(text) - hold))

    def flush(self) -> str:
        return self._emit_until(self.tokenizer.decode(self.ids), None)

    def _emit_until(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else end
        delta = text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return delta


def build_app(engine: EngineThread, loaded: LoadedModel) -> Starlette:
    """The ASGI app over a started engine."""
    model_id = loaded.model_dir.name

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "model": model_id})

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": model_id, "object": "model", "owned_by": "kvcellar"}]})

    async def completions(request: Request, *, chat: bool) -> Any:
        try:
            raw = await request.body()
            body = json.loads(raw.decode("utf-8"))
            job = parse_job(body, loaded, chat=chat)
        except UnicodeDecodeError:
            return error_response(400, "the request body is not valid UTF-8")
        except json.JSONDecodeError as e:
            return error_response(400, f"the request body is not valid JSON: {e}")
        except BadRequest as e:
            return error_response(400, str(e), param=e.param)
        if job.stream:
            return StreamingResponse(_sse(engine, loaded, job, model_id), media_type="text/event-stream")
        return JSONResponse(await _complete(engine, loaded, job, model_id))

    async def chat_completions(request: Request) -> Any:
        return await completions(request, chat=True)

    async def text_completions(request: Request) -> Any:
        return await completions(request, chat=False)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", text_completions, methods=["POST"]),
    ]
    return Starlette(routes=routes)


async def _generate(engine: EngineThread, loaded: LoadedModel,
                    job: CompletionJob) -> AsyncIterator[tuple[str, int, str | None]]:
    """Yield (text delta, completion tokens so far, None); the last item is
    ("", completion tokens, finish reason)."""
    assembler = _TextAssembler(loaded.tokenizer, job.params.stop_token_ids, job.stop_strings)
    cancelled = threading.Event()
    produced = 0
    async for token_id in engine.stream(lambda lm: generate_tokens(lm.model, job.prompt_ids, job.params), cancelled):
        produced += 1
        delta = assembler.add(token_id)
        if delta:
            yield delta, produced, None
        if assembler.finished_by_stop:
            cancelled.set()
            break
    if not assembler.finished_by_stop:
        tail = assembler.flush()
        if tail:
            yield tail, produced, None
    yield "", produced, "stop" if assembler.finished_by_stop else "length"


def _usage(job: CompletionJob, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": completion_tokens,
            "total_tokens": len(job.prompt_ids) + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": 0}}


async def _complete(engine: EngineThread, loaded: LoadedModel, job: CompletionJob, model_id: str) -> dict[str, Any]:
    text, completion_tokens, finish = "", 0, "length"
    async for delta, completion_tokens, reason in _generate(engine, loaded, job):
        text += delta
        finish = reason or finish
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if job.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": f"{'chatcmpl' if job.chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if job.chat else "text_completion",
            "created": int(time.time()), "model": model_id, "choices": [choice],
            "usage": _usage(job, completion_tokens)}


async def _sse(engine: EngineThread, loaded: LoadedModel, job: CompletionJob, model_id: str) -> AsyncIterator[str]:
    ident = f"{'chatcmpl' if job.chat else 'cmpl'}-{uuid.uuid4().hex}"
    kind = "chat.completion.chunk" if job.chat else "text_completion"
    created = int(time.time())

    def chunk(delta: str | None, finish: str | None) -> str:
        if job.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {} if delta is None else {"content": delta}}
        else:
            choice = {"index": 0, "text": delta or ""}
        choice["finish_reason"] = finish
        payload = {"id": ident, "object": kind, "created": created, "model": model_id, "choices": [choice]}
        return f"data: {json.dumps(payload)}\n\n"

    async for delta, completion_tokens, reason in _generate(engine, loaded, job):
        if delta:
            yield chunk(delta, None)
        if reason is not None:
            yield chunk(None, reason)
            if job.include_usage:
                usage = {"id": ident, "object": kind, "created": created, "model": model_id,
                         "choices": [], "usage": _usage(job, completion_tokens)}
                yield f"data: {json.dumps(usage)}\n\n"
    yield "data: [DONE]\n\n"
