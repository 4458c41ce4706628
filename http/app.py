"""The OpenAI-compatible ASGI app over a running `System`.

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (SSE streaming
and not), `POST /v1/responses` (the stateless Responses API, http/responses.py;
`/v1/responses/{id}` is a 404: nothing is stored), `GET /v1/models`,
`GET /health`, `GET /stats`, `GET /metrics` (Prometheus text),
`POST /admin/cache/flush` (optional `timeout_s`, default 60, in the query or a
JSON body; 200 when durable, 503 with the reason and the evidence otherwise, a
timeout included; `?shared=true` also waits for the shared tier's uploads and
adds `shared_durable` with its evidence), `POST /admin/cache/wipe` (a JSON selector,
store/wipe.py, and optional `timeout_s`; 200 with what each tier removed when nothing selected is
left, 503 with what is left otherwise; actors/wipes.py). A client that goes away
mid-generation cancels it between two steps; its reusable cache is still put
back.

Failures are named, never a bare 500 (`failure_body`): a `BadRequest` is a
400 naming its field; a request the server cannot take now (shutting down, its
batch aborted, the engine stopped, the store's disk failing) is a 503; only an
error kvcellar cannot name is a 500, and it is logged with its traceback. A
stream that fails after its headers went out ends with one
`data: {"error": {...}}` event and then `data: [DONE]`.

The live dashboard (http/dashboard.py): `GET /dashboard` (a static page),
`GET /stats/requests` (the recent-requests ring) and `GET /stats/journal`
(the journal's last events), the last two behind the admin token.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import attrs
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvcellar.actors.system import System
from kvcellar.engine.generation import GenerationDone, TokenDelta
from kvcellar.engine.sampling import TokenLogprob
from kvcellar.errors import BadRequest
from kvcellar.http.anthropic import messages_routes
from kvcellar.http.cache_header import cache_header, stream_cache_header
from kvcellar.http.chat_reply import ChatReply
from kvcellar.http.dashboard import dashboard_routes
from kvcellar.http.failures import classify_failure
from kvcellar.http.inbound import HostedTools, InboundPolicy
from kvcellar.http.kv_events import kv_events_routes
from kvcellar.http.metrics import metrics_registry, render_metrics
from kvcellar.http.parsing import MAX_TOKENS_DEFAULT, CompletionJob, TokenizerLane
from kvcellar.http.refusals import refused_unread
from kvcellar.http.responses import ResponsesRoute
from kvcellar.http.streaming import (
    KEEPALIVE_INTERVAL_S_DEFAULT,
    SSE_COMMENT_KEEPALIVE,
    KeepAliveStreamingResponse,
    unless_client_leaves,
)
from kvcellar.http.tenancy import Access, request_tenant
from kvcellar.http.tool_grammar import ToolGrammarPolicy
from kvcellar.store.kv_events import BLOCK_SIZE_DEFAULT, KvEventLog
from kvcellar.store.tenants import Tenants
from kvcellar.store.wipe import selector_from_body

log = logging.getLogger("kvcellar.http")


@attrs.frozen(kw_only=True)
class HttpSettings:
    api_key: str | None = None
    # `--tenants FILE` (store/tenants.py): each key names a tenant and its cache namespace.
    tenants: Tenants | None = None
    admin_token: str | None = None
    max_tokens_default: int = MAX_TOKENS_DEFAULT
    # `--tool-call-grammar`: constrain tool calls to the offered tools (http/tool_grammar.py).
    tool_call_grammar: bool = True
    # `--keepalive-interval`: a stream silent this long gets a keep-alive (http/streaming.py).
    keepalive_interval_s: float = KEEPALIVE_INTERVAL_S_DEFAULT
    # `--hosted-tools`: leave out ("omit") or refuse ("reject") tools the server cannot run (http/inbound.py).
    hosted_tools: HostedTools = "omit"
    # `--prompt-normalize`: the prompt-normalisation rules (http/prompt_rules.py).
    prompt_normalize: bool = True
    # `--kv-events-block-size`: tokens per block of the KV events (http/kv_events.py, docs/cluster.md).
    kv_events_block_size: int = BLOCK_SIZE_DEFAULT
    # The name replies give the model (a pool's model name, http/pool_app.py); None: its directory's name.
    model_id: str | None = None


def error_body(
    message: str,
    *,
    param: str | None = None,
    error_type: str = "invalid_request_error",
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(
    status: int, message: str, *, param: str | None = None, error_type: str = "invalid_request_error"
) -> JSONResponse:
    return JSONResponse(error_body(message, param=param, error_type=error_type), status_code=status)


# OpenAI's error `type` for each kind of failure (http/failures.py classifies).
_OPENAI_ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "not_found": "invalid_request_error",
    "unavailable": "server_unavailable",
    "server": "server_error",
    "insufficient_memory": "insufficient_memory",
}


def failure_body(error: Exception) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI-style body for an error raised while serving."""
    failure = classify_failure(error)
    body = error_body(
        failure.message, param=failure.param, error_type=_OPENAI_ERROR_TYPES[failure.kind], code=failure.code
    )
    if failure.details:
        body["error"].update(failure.details, code=failure.kind)
    return failure.status, body


def _failure_response(error: Exception) -> JSONResponse:
    status, body = failure_body(error)
    return JSONResponse(body, status_code=status)


FLUSH_TIMEOUT_S_DEFAULT = 60.0


def flush_timeout_s(query_value: str | None, body: bytes) -> float:
    """The flush route's `timeout_s`, from the query string or a JSON body
    `{"timeout_s": ...}` (not both); 60 s when neither has it. Raises
    `BadRequest` naming `timeout_s` (or the body) for anything else than one
    finite number of seconds > 0."""
    values = _query_timeout_s(query_value)
    if body.strip():
        try:
            parsed = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadRequest(f"the flush body is not valid JSON: {e}") from e
        if not isinstance(parsed, dict):
            raise BadRequest('the flush body must be a JSON object such as {"timeout_s": 5}')
        unknown = sorted(set(parsed) - {"timeout_s"})
        if unknown:
            raise BadRequest(f"the flush body has no field {unknown[0]!r}", param=unknown[0])
        if "timeout_s" in parsed:
            values.append(parsed["timeout_s"])
    return _one_timeout_s(values)


def _query_timeout_s(query_value: str | None) -> list[Any]:
    """The query string's `timeout_s`, as a list of zero or one value."""
    if query_value is None:
        return []
    try:
        return [float(query_value)]
    except ValueError:
        raise BadRequest(f"timeout_s={query_value!r} is not a number of seconds", param="timeout_s") from None


def _one_timeout_s(values: list[Any]) -> float:
    """The one `timeout_s` the query and the body gave (the default when neither did), checked."""
    if len(values) > 1:
        raise BadRequest("timeout_s is given both in the query string and in the body", param="timeout_s")
    timeout_s = values[0] if values else FLUSH_TIMEOUT_S_DEFAULT
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, int | float)
        or not math.isfinite(timeout_s)
        or timeout_s <= 0
    ):
        raise BadRequest(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}", param="timeout_s")
    return float(timeout_s)


def _bearer_ok(request: Request, secret: str | None) -> bool:
    if not secret:
        return True
    supplied = request.headers.get("authorization", "")
    return hmac.compare_digest(supplied.encode(), f"Bearer {secret}".encode())


def _refused() -> Response:
    body = error_body("missing or wrong API key", error_type="authentication_error", code="invalid_api_key")
    return refused_unread(JSONResponse(body, status_code=401))


def _guarded(
    secret: Callable[[], str | None], handler: Callable[[Request], Awaitable[Response]], *, required: bool = False
):
    """`handler` behind the admin token (a bearer); open when there is none, unless `required`
    (then refused to everyone without one)."""
    message = "this route needs the admin token (--admin-token)" if required else "missing or wrong bearer token"

    async def guarded(request: Request) -> Response:
        token = secret()
        if (required and not token) or not _bearer_ok(request, token):
            return refused_unread(error_response(401, message, error_type="authentication_error"))
        return await handler(request)

    return guarded


def _for_tenants(access: Access, handler: Callable[[Request], Awaitable[Response]]):
    """`handler` for a request whose key names a tenant (http/tenancy.py); others get a 401."""

    async def guarded(request: Request) -> Response:
        if access.tenant_for(request) is None:
            return _refused()
        return await handler(request)

    return guarded


def build_app(system: System, settings: HttpSettings | None = None) -> Starlette:
    """The ASGI app over a started system."""
    settings = settings or HttpSettings()
    model_id = settings.model_id or system.loaded.model_dir.name
    tool_grammar = ToolGrammarPolicy(enabled=settings.tool_call_grammar)
    inbound = InboundPolicy(hosted_tools=settings.hosted_tools, prompt_normalize=settings.prompt_normalize)
    access = Access(api_key=settings.api_key, tenants=settings.tenants)
    # The KV events name every namespace's blocks (a namespace's root is computable from its tenant's
    # name): with tenants they are the operator's alone, behind the admin token, and off without one.
    kv_guard = (
        partial(_guarded, lambda: settings.admin_token, required=True)
        if settings.tenants
        else partial(_for_tenants, access)
    )
    kv_routes, kv_log = kv_events_routes(system, settings.kv_events_block_size, kv_guard)
    stats_snapshot = partial(http_stats, system, tool_grammar, inbound, kv_log)
    tokenizer_lane = TokenizerLane(tool_grammar, inbound)
    completions = CompletionsRoute(system, tokenizer_lane, settings, model_id)

    def admin_token() -> str | None:
        return settings.admin_token

    responses = ResponsesRoute(
        system,
        tokenizer_lane,
        model_id=model_id,
        max_tokens_default=settings.max_tokens_default,
        failure_body=failure_body,
        keepalive_interval_s=settings.keepalive_interval_s,
    )
    info = InfoRoutes(system, model_id, stats_snapshot)
    routes = [
        Route("/", info.index, methods=["GET", "HEAD"]),
        Route("/health", info.health, methods=["GET"]),
        Route("/v1/models", _for_tenants(access, info.models), methods=["GET"]),
        Route("/v1/chat/completions", _for_tenants(access, completions.chat), methods=["POST"]),
        Route("/v1/completions", _for_tenants(access, completions.text), methods=["POST"]),
        *messages_routes(
            system, tokenizer_lane, access, keepalive_interval_s=settings.keepalive_interval_s, model_id=model_id
        ),
        Route("/v1/responses", _for_tenants(access, responses.create), methods=["POST"]),
        Route(
            "/v1/responses/{response_id:path}",
            _for_tenants(access, responses.not_stored),
            methods=["GET", "DELETE", "POST"],
        ),
        Route("/stats", _guarded(admin_token, info.stats), methods=["GET"]),
        Route("/metrics", _guarded(admin_token, info.metrics), methods=["GET"]),
        Route("/admin/cache/flush", _guarded(admin_token, partial(_flush, system)), methods=["POST"]),
        Route("/admin/cache/wipe", _guarded(admin_token, partial(_wipe, system)), methods=["POST"]),
        *kv_routes,
        *dashboard_routes(
            system,
            lambda handler: _guarded(admin_token, handler),
            lambda: bool(admin_token()),
            error_response,
            _failure_response,
        ),
    ]
    return Starlette(routes=routes)


class InfoRoutes:
    """The routes that describe the server: the index, health, models, stats and metrics."""

    def __init__(self, system: System, model_id: str, stats_snapshot: Callable[[], dict[str, Any]]) -> None:
        self.system = system
        self.model_id = model_id
        self.stats_snapshot = stats_snapshot
        self.registry = metrics_registry(stats_snapshot)

    async def health(self, _: Request) -> Response:
        admitting = self.system.admitting
        return JSONResponse(
            {"status": "ok" if admitting else "shutting down", "model": self.model_id},
            status_code=200 if admitting else 503,
        )

    async def index(self, _: Request) -> Response:
        # HEAD / and GET /: clients and proxies probe the root before their first request.
        return JSONResponse(
            {
                "server": "kvcellar",
                "model": self.model_id,
                "apis": ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"],
                "dashboard": "/dashboard",
                "health": "/health",
                "docs": "docs/agents.md (agents), docs/api.md (the APIs) in the kvcellar sources",
            }
        )

    async def models(self, _: Request) -> Response:
        model = {"id": self.model_id, "object": "model", "owned_by": "kvcellar"}
        return JSONResponse({"object": "list", "data": [model]})

    async def stats(self, _: Request) -> Response:
        return JSONResponse(self.stats_snapshot())

    async def metrics(self, _: Request) -> Response:
        return Response(render_metrics(self.registry), media_type=CONTENT_TYPE_LATEST)


async def _flush(system: System, request: Request) -> Response:
    # 200 only when durable; every other verdict ("timeout", "no SSD tier",
    # "write-behind off", faults) is a 503 carrying its reason and evidence.
    try:
        timeout_s = flush_timeout_s(request.query_params.get("timeout_s"), await request.body())
        shared = shared_flush_flag(request.query_params.get("shared"))
    except BadRequest as e:
        return error_response(400, str(e), param=e.param)
    if shared:
        return await _shared_flush(system, timeout_s)
    verdict = attrs.asdict(await system.flush(timeout_s=timeout_s))
    return JSONResponse(verdict, status_code=200 if verdict["durable"] else 503)


async def _wipe(system: System, request: Request) -> Response:
    # 200 only when every tier holds nothing the selector selects; 503 with what is left otherwise.
    try:
        body = _json_object(await request.body(), "wipe")
        values = _query_timeout_s(request.query_params.get("timeout_s"))
        timeout_s = _one_timeout_s([*values, body.pop("timeout_s")] if "timeout_s" in body else values)
        selector = selector_from_body(body)
    except BadRequest as e:
        return error_response(400, str(e), param=e.param)
    result = await system.wipes.wipe(selector, timeout_s=timeout_s)
    return JSONResponse(result.to_json(), status_code=200 if result.done else 503)


def _json_object(body: bytes, what: str) -> dict[str, Any]:
    try:
        parsed = json.loads(body.decode("utf-8")) if body.strip() else None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"the {what} body is not valid JSON: {e}") from e
    if not isinstance(parsed, dict):
        raise BadRequest(f'the {what} body must be a JSON object such as {{"tenant": "alice"}}')
    return parsed


class CompletionsRoute:
    """`/v1/chat/completions` and `/v1/completions`: parse on the tokenizer
    lane, check admission and memory before any header goes out, then stream
    or answer once (a client that leaves cancels its generation)."""

    def __init__(self, system: System, tokenizer_lane: TokenizerLane, settings: HttpSettings, model_id: str) -> None:
        self.system = system
        self.tokenizer_lane = tokenizer_lane
        self.settings = settings
        self.model_id = model_id

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def text(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def _serve(self, request: Request, *, chat: bool) -> Response:
        system, settings = self.system, self.settings
        try:
            job = await self.tokenizer_lane.parse_body(
                await request.body(),
                system.loaded,
                chat=chat,
                max_tokens_default=settings.max_tokens_default,
                namespace=request_tenant(request).namespace,
            )
        except BadRequest as e:
            return error_response(400, str(e), param=e.param)
        except Exception as e:
            return _failure_response(e)
        if not system.admitting:
            return error_response(503, "the server is shutting down", error_type="server_unavailable")
        try:
            # Before the stream's headers go out: a request larger than the memory budget is a 503.
            system.check_memory(job.request)
        except Exception as e:
            return _failure_response(e)
        if job.stream:
            return KeepAliveStreamingResponse(
                _sse(system, job, self.model_id),
                keepalive=SSE_COMMENT_KEEPALIVE,
                interval_s=settings.keepalive_interval_s,
                media_type="text/event-stream",
                headers=stream_cache_header(job.prompt_tokens),
            )

        async def reply() -> Response:
            try:
                body, done = await _complete(system, job, self.model_id)
                return JSONResponse(body, headers=cache_header(done, job.prompt_tokens))
            except Exception as e:
                return _failure_response(e)

        return await unless_client_leaves(request, reply)


def _usage(job: CompletionJob, done: GenerationDone | None, completion_tokens: int) -> dict[str, Any]:
    cached = done.cached_tokens if done else 0
    return {
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": job.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": completion_details(done),
    }


def completion_details(done: GenerationDone | None) -> dict[str, int]:
    """`usage.completion_tokens_details`: `resumed_tokens`, the completion
    tokens an in-flight checkpoint restored (spec §5.7) and replayed instead
    of generating them again (counted in `completion_tokens` too)."""
    return {"resumed_tokens": done.resumed_tokens if done else 0}


def _chat_logprob(entry: TokenLogprob) -> dict[str, Any]:
    """One `choices[].logprobs.content[]` item, OpenAI's chat shape."""
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": list(entry.token_bytes),
        "top_logprobs": [
            {"token": top.token, "logprob": top.logprob, "bytes": list(top.token_bytes)} for top in entry.top
        ],
    }


def _completion_logprobs(entries: list[TokenLogprob], text_offset: int) -> dict[str, Any]:
    """`choices[].logprobs` of the legacy completions API; offsets count from
    `text_offset` characters into the completion."""
    offsets = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry.token)
    return {
        "tokens": [entry.token for entry in entries],
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [{top.token: top.logprob for top in entry.top} for entry in entries],
        "text_offset": offsets,
    }


def _choice_logprobs(job: CompletionJob, entries: list[TokenLogprob], text_offset: int = 0) -> dict[str, Any] | None:
    if not job.request.params.logprobs:
        return None
    if job.chat:
        return {"content": [_chat_logprob(entry) for entry in entries]}
    return _completion_logprobs(entries, text_offset)


async def _complete(system: System, job: CompletionJob, model_id: str) -> tuple[dict[str, Any], GenerationDone | None]:
    """The reply's body, and how its generation ended (None: no end came)."""
    text, done = "", None
    entries: list[TokenLogprob] = []
    async for item in system.generate(job.request):
        if isinstance(item, GenerationDone):
            done = item
        else:
            text += item.text
            if item.logprob is not None:
                entries.append(item.logprob)
    completion_tokens = done.completion_tokens if done else 0
    choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": done.finish_reason if done else "length",
        "logprobs": _choice_logprobs(job, entries),
    }
    if job.chat:
        reply = ChatReply(system.loaded.tokenizer, job.tools, in_reasoning=job.reply_in_reasoning)
        choice["message"] = reply.message(text)
        choice["finish_reason"] = reply.finish_reason(choice["finish_reason"])
    else:
        choice["text"] = text
    return {
        "id": f"{'chatcmpl' if job.chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if job.chat else "text_completion",
        "created": int(time.time()),
        "model": model_id,
        "choices": [choice],
        "usage": _usage(job, done, completion_tokens),
    }, done


async def _sse(system: System, job: CompletionJob, model_id: str) -> AsyncIterator[str]:
    ident = f"{'chatcmpl' if job.chat else 'cmpl'}-{uuid.uuid4().hex}"
    kind = "chat.completion.chunk" if job.chat else "text_completion"
    created = int(time.time())

    def event(choices: list[dict[str, Any]], **extra: Any) -> str:
        payload = {"id": ident, "object": kind, "created": created, "model": model_id, "choices": choices, **extra}
        return f"data: {json.dumps(payload)}\n\n"

    text_offset = 0

    # Chat text goes through the reply splitter: reasoning, content and tool-call deltas.
    reply = ChatReply(system.loaded.tokenizer, job.tools, in_reasoning=job.reply_in_reasoning) if job.chat else None

    def choice(
        delta: dict[str, Any] | str | None, finish: str | None, item: TokenDelta | None = None
    ) -> dict[str, Any]:
        nonlocal text_offset
        logprobs = None
        if item is not None and item.logprob is not None:
            logprobs = _choice_logprobs(job, [item.logprob], text_offset)
            text_offset += len(item.logprob.token)
        if job.chat:
            return {"index": 0, "delta": delta or {}, "logprobs": logprobs, "finish_reason": finish}
        return {"index": 0, "text": delta or "", "logprobs": logprobs, "finish_reason": finish}

    try:
        async for item in system.generate(job.request):
            if isinstance(item, GenerationDone):
                finish = item.finish_reason
                if reply is not None:
                    for delta in reply.closing_deltas():
                        yield event([choice(delta, None)])
                    finish = reply.finish_reason(finish)
                yield event([choice(None, finish)])
                if job.include_usage:
                    yield event([], usage=_usage(job, item, item.completion_tokens))
            elif reply is not None:
                # A token whose text is held back still sends its log-probability.
                deltas = reply.deltas(item.text) or ([{}] if item.logprob is not None else [])
                for position, delta in enumerate(deltas):
                    yield event([choice(delta, None, item if position == 0 else None)])
            elif item.text or item.logprob is not None:
                # A token whose text is held back still sends its log-probability.
                yield event([choice(item.text, None, item)])
    except Exception as e:
        # The headers went out with 200: the failure is the stream's last event.
        _, body = failure_body(e)
        yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"


def shared_flush_flag(query_value: str | None) -> bool:
    """The flush route's `shared` (true/false, 1/0; absent: false). Raises
    `BadRequest` naming `shared` for anything else."""
    if query_value is None:
        return False
    value = query_value.strip().lower()
    if value in ("true", "1"):
        return True
    if value in ("false", "0"):
        return False
    raise BadRequest(f"shared={query_value!r}: expected true or false", param="shared")


async def _shared_flush(system: System, timeout_s: float) -> Response:
    """`?shared=true`: the local verdict as always, plus `shared_durable` and
    the shared tier's evidence under `shared`; 200 only when both are durable."""
    local, shared = await system.flush_shared(timeout_s=timeout_s)
    verdict = {**attrs.asdict(local), "shared_durable": shared["durable"], "shared": shared}
    return JSONResponse(verdict, status_code=200 if local.durable and shared["durable"] else 503)


def http_stats(
    system: System, tool_grammar: ToolGrammarPolicy, inbound: InboundPolicy, kv_log: KvEventLog
) -> dict[str, Any]:
    """`/stats`: the system's figures and the HTTP side's counts: the
    tool-call grammar's, what requests had clamped, left out and rewritten,
    and the KV events' resident set (what replaying `/v1/kv_events` yields)."""
    return {
        **system.stats(),
        "tool_call_grammar": tool_grammar.counts.snapshot(),
        "inbound": inbound.counts.snapshot(),
        "kv_events": kv_log.stats(),
    }
