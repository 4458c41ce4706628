"""The OpenAI-compatible ASGI app over a running `System`.

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (SSE streaming
and not), `GET /v1/models`, `GET /health`, `GET /stats`, `GET /metrics`
(Prometheus text), `POST /admin/cache/flush` (200 when durable, 503 with
the evidence otherwise). A client that goes away mid-generation cancels it
between two steps; its reusable cache is still put back.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import attrs
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvcellar.actors.gateway import AdmissionClosed
from kvcellar.actors.system import System
from kvcellar.engine.generation import GenerationDone
from kvcellar.http.metrics import metrics_registry, render_metrics
from kvcellar.http.parsing import MAX_TOKENS_DEFAULT, BadRequest, CompletionJob, parse_job

log = logging.getLogger("kvcellar.http")


@attrs.frozen(kw_only=True)
class HttpSettings:
    api_key: str | None = None
    admin_token: str | None = None
    max_tokens_default: int = MAX_TOKENS_DEFAULT


def error_response(status: int, message: str, *, param: str | None = None,
                   error_type: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": error_type, "param": param, "code": None}},
                        status_code=status)


def _bearer_ok(request: Request, secret: str | None) -> bool:
    if not secret:
        return True
    supplied = request.headers.get("authorization", "")
    return hmac.compare_digest(supplied.encode(), f"Bearer {secret}".encode())


def _guarded(secret: Callable[[], str | None], handler: Callable[[Request], Awaitable[Response]]):
    async def guarded(request: Request) -> Response:
        if not _bearer_ok(request, secret()):
            return error_response(401, "missing or wrong bearer token", error_type="authentication_error")
        return await handler(request)

    return guarded


def build_app(system: System, settings: HttpSettings | None = None) -> Starlette:
    """The ASGI app over a started system."""
    settings = settings or HttpSettings()
    loaded = system.loaded
    model_id = loaded.model_dir.name

    async def health(_: Request) -> Response:
        admitting = system.admitting
        return JSONResponse({"status": "ok" if admitting else "shutting down", "model": model_id},
                            status_code=200 if admitting else 503)

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model_id, "object": "model", "owned_by": "kvcellar"}]})

    async def stats(_: Request) -> Response:
        return JSONResponse(system.stats())

    registry = metrics_registry(system.stats)

    async def metrics(_: Request) -> Response:
        return Response(render_metrics(registry), media_type=CONTENT_TYPE_LATEST)

    async def flush(_: Request) -> Response:
        verdict = attrs.asdict(await system.flush())
        return JSONResponse(verdict, status_code=200 if verdict["durable"] else 503)

    async def completions(request: Request, *, chat: bool) -> Response:
        try:
            body = json.loads((await request.body()).decode("utf-8"))
            job = parse_job(body, loaded, chat=chat, max_tokens_default=settings.max_tokens_default)
        except UnicodeDecodeError:
            return error_response(400, "the request body is not valid UTF-8")
        except json.JSONDecodeError as e:
            return error_response(400, f"the request body is not valid JSON: {e}")
        except BadRequest as e:
            return error_response(400, str(e), param=e.param)
        if not system.admitting:
            return error_response(503, "the server is shutting down", error_type="server_unavailable")
        if job.stream:
            return StreamingResponse(_sse(system, job, model_id), media_type="text/event-stream")
        try:
            return JSONResponse(await _complete(system, job, model_id))
        except AdmissionClosed as e:
            return error_response(503, str(e), error_type="server_unavailable")

    async def chat_completions(request: Request) -> Response:
        return await completions(request, chat=True)

    async def text_completions(request: Request) -> Response:
        return await completions(request, chat=False)

    def api_key() -> str | None:
        return settings.api_key

    def admin_token() -> str | None:
        return settings.admin_token

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", _guarded(api_key, models), methods=["GET"]),
        Route("/v1/chat/completions", _guarded(api_key, chat_completions), methods=["POST"]),
        Route("/v1/completions", _guarded(api_key, text_completions), methods=["POST"]),
        Route("/stats", _guarded(admin_token, stats), methods=["GET"]),
        Route("/metrics", _guarded(admin_token, metrics), methods=["GET"]),
        Route("/admin/cache/flush", _guarded(admin_token, flush), methods=["POST"]),
    ]
    return Starlette(routes=routes)


def _usage(job: CompletionJob, done: GenerationDone | None, completion_tokens: int) -> dict[str, Any]:
    cached = done.cached_tokens if done else 0
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": job.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _complete(system: System, job: CompletionJob, model_id: str) -> dict[str, Any]:
    text, done = "", None
    async for item in system.generate(job.request):
        if isinstance(item, GenerationDone):
            done = item
        else:
            text += item.text
    completion_tokens = done.completion_tokens if done else 0
    choice: dict[str, Any] = {"index": 0, "finish_reason": done.finish_reason if done else "length"}
    if job.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": f"{'chatcmpl' if job.chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if job.chat else "text_completion",
            "created": int(time.time()), "model": model_id, "choices": [choice],
            "usage": _usage(job, done, completion_tokens)}


async def _sse(system: System, job: CompletionJob, model_id: str) -> AsyncIterator[str]:
    ident = f"{'chatcmpl' if job.chat else 'cmpl'}-{uuid.uuid4().hex}"
    kind = "chat.completion.chunk" if job.chat else "text_completion"
    created = int(time.time())

    def event(choices: list[dict[str, Any]], **extra: Any) -> str:
        payload = {"id": ident, "object": kind, "created": created, "model": model_id, "choices": choices, **extra}
        return f"data: {json.dumps(payload)}\n\n"

    def choice(delta: str | None, finish: str | None) -> dict[str, Any]:
        if job.chat:
            return {"index": 0, "delta": {} if delta is None else {"content": delta}, "finish_reason": finish}
        return {"index": 0, "text": delta or "", "finish_reason": finish}

    try:
        async for item in system.generate(job.request):
            if isinstance(item, GenerationDone):
                yield event([choice(None, item.finish_reason)])
                if job.include_usage:
                    yield event([], usage=_usage(job, item, item.completion_tokens))
            elif item.text:
                yield event([choice(item.text, None)])
    except AdmissionClosed as e:
        yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_unavailable'}})}\n\n"
    yield "data: [DONE]\n\n"
