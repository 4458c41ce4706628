"""The ASGI app of a model pool (issue 41, `serve --model NAME=DIR ...` or `serve --models FILE`).

Every generation route (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/v1/messages`,
`/v1/messages/count_tokens`) is dispatched by its body's `model`: resolved once by
`ModelNames.resolve` (exact name, aliases in file order, the default), the model loaded when it is
not (`ModelPool.use`), and the request handed whole to that model's own app (http/app.py's
`build_app` over the model's `System`, exactly the single-model server), so parsing, streaming,
errors and caching are the single-model server's. A name no model serves is a 404 in the API's own
shape naming the served models. The model is held (not unloaded) until the response has ended.

Pool-level routes: `GET /v1/models` (names and aliases), `GET /health`, `GET /dashboard` (the pool's
page over `/stats`), `GET /stats` (the pool: each model's load state, RAM and SSD bytes, hits, last
drain), `GET /metrics`, `POST /admin/drain`
(`{"model": NAME, "timeout_s"?, "unload"?}`: the model's write-behind flushed, answered like
`/admin/cache/flush`: 200 durable with the evidence, 503 with what is left), `POST /admin/cache/flush`
(every loaded model), and `/models/{name}/...`: any route of a loaded model's own app (its full
`/stats`, `/metrics`, `/dashboard`, `/admin/cache/wipe`).

Parsing the body for its `model` (and rewriting an alias to the model's own name) runs on a worker
thread: a 100k-character prompt is not decoded on the Trio thread.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from kvcellar.actors.model_pool import DRAIN_TIMEOUT_S_DEFAULT, ModelPool
from kvcellar.actors.system_config import FlushResult
from kvcellar.errors import BadRequest, KvCellarError, UnknownModel
from kvcellar.http.anthropic import anthropic_error, failure_event_body
from kvcellar.http.app import HttpSettings, _guarded, build_app, error_response, failure_body, flush_timeout_s
from kvcellar.http.streaming import ANTHROPIC_PING_KEEPALIVE, SSE_COMMENT_KEEPALIVE
from kvcellar.http.tenancy import Access

log = logging.getLogger("kvcellar.http")

GENERATION_ROUTES = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"}
)
MODEL_PREFIX = "/models/"
POOL_DASHBOARD_PATH = Path(__file__).parent / "static" / "pool_dashboard.html"


def _model_field(raw: bytes) -> tuple[Any, bool]:
    """The body's `model` and whether it asks for a stream; (None, False) when the body is no JSON
    object (the model's app answers its 400)."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None, False
    if not isinstance(body, dict):
        return None, False
    return body.get("model"), body.get("stream") is True


def _with_model(raw: bytes, model: str) -> bytes:
    body = json.loads(raw.decode("utf-8"))
    body["model"] = model
    return json.dumps(body).encode("utf-8")


class PoolApp:
    """Dispatches generation routes to the model each names; everything else is the pool's own."""

    def __init__(self, pool: ModelPool, settings: HttpSettings) -> None:
        self.pool = pool
        self.settings = settings
        self.access = Access(api_key=settings.api_key, tenants=settings.tenants)
        # One app per loaded System (rebuilt after a reload): (the System's id, its app).
        self._apps: dict[str, tuple[int, Starlette]] = {}
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_PoolCollector(pool))
        admin = partial_guard(settings)
        self.info = Starlette(
            routes=[
                Route("/", self.index, methods=["GET", "HEAD"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/dashboard", self.dashboard, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/stats", admin(self.stats), methods=["GET"]),
                Route("/metrics", admin(self.metrics), methods=["GET"]),
                Route("/admin/drain", admin(self.drain), methods=["POST"]),
                Route("/admin/cache/flush", admin(self.flush), methods=["POST"]),
            ]
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and scope["method"] == "POST" and path in GENERATION_ROUTES:
            await self._dispatch(scope, receive, send)
        elif scope["type"] == "http" and path.startswith(MODEL_PREFIX):
            await self._forward_to_model_route(scope, receive, send)
        else:
            await self.info(scope, receive, send)

    # -- generation routes ---------------------------------------------------------

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        anthropic = scope["path"].startswith("/v1/messages")
        request = Request(scope, receive)
        if self.access.tenant_for(request) is None:
            await self._respond(scope, send, _unauthorized(anthropic))
            return
        raw = await request.body()
        requested, stream = await trio.to_thread.run_sync(_model_field, raw)
        try:
            name = self.pool.names.resolve(requested if isinstance(requested, str) else None)
        except UnknownModel as e:
            await self._respond(scope, send, _failure(e, anthropic))
            return
        if stream and self.pool.slots[name].state != "loaded":
            await LoadingStream(self, anthropic).run(name, scope, raw, requested, receive, send)
            return
        try:
            async with self.pool.use(name) as system:
                await self.forward(name, system, scope, raw, requested, receive, send)
        except KvCellarError as e:
            # Only before the model's app answered: a load that failed or found no room (503).
            await self._respond(scope, send, _failure(e, anthropic))

    async def forward(
        self, name: str, system: Any, scope: Scope, raw: bytes, requested: Any, receive: Receive, send: Send
    ):
        """Hand the request to the model's own app, an alias rewritten to the name that app accepts."""
        accepted = system.loaded.model_dir.name
        if isinstance(requested, str) and requested != accepted:
            raw = await trio.to_thread.run_sync(_with_model, raw, accepted)
        await _replay(self._app_for(name, system), scope, raw, receive, send)

    def _app_for(self, name: str, system: Any) -> Starlette:
        held = self._apps.get(name)
        if held is None or held[0] != id(system):
            held = (id(system), build_app(system, attrs.evolve(self.settings, model_id=name)))
            self._apps[name] = held
        return held[1]

    async def _forward_to_model_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        name, _, rest = scope["path"][len(MODEL_PREFIX) :].partition("/")
        slot = self.pool.slots.get(name)
        if slot is None or slot.system is None or slot.state != "loaded":
            message = f"model {name!r} is not loaded (GET /stats names each model's state)"
            await self._respond(scope, send, error_response(404, message, param="model"))
            return
        async with self.pool.use(name) as system:
            await self._app_for(name, system)(dict(scope, path="/" + rest, raw_path=None), receive, send)

    async def _respond(self, scope: Scope, send: Send, response: Response) -> None:
        async def nothing() -> Message:
            return {"type": "http.disconnect"}

        await response(scope, nothing, send)

    # -- the pool's own routes -----------------------------------------------------

    async def index(self, _: Request) -> Response:
        return JSONResponse(
            {
                "server": "kvcellar",
                "models": list(self.pool.names.names),
                "apis": sorted(GENERATION_ROUTES - {"/v1/messages/count_tokens"}),
                "health": "/health",
                "docs": "docs/models.md (the model pool), docs/api.md (the APIs) in the kvcellar sources",
            }
        )

    async def dashboard(self, _: Request) -> Response:
        # A static page (package data); its data comes from /stats, behind the admin token.
        return HTMLResponse(POOL_DASHBOARD_PATH.read_text(encoding="utf-8"))

    async def health(self, _: Request) -> Response:
        return JSONResponse({"status": "ok", "models": {n: s.state for n, s in self.pool.slots.items()}})

    async def models(self, request: Request) -> Response:
        if self.access.tenant_for(request) is None:
            return _unauthorized(anthropic=False)
        return JSONResponse({"object": "list", "data": self.pool.names.listing()})

    async def stats(self, _: Request) -> Response:
        return JSONResponse({"pool": self.pool.stats()})

    async def metrics(self, _: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def drain(self, request: Request) -> Response:
        try:
            body = _drain_body(await request.body())
            name = body["model"]
            if name not in self.pool.slots:
                raise UnknownModel(f"no model {name!r} in this pool", served=self.pool.names.names)
        except BadRequest as e:
            status, error = failure_body(e)
            return JSONResponse(error, status_code=status)
        slot = self.pool.slots[name]
        verdict: FlushResult | None
        try:
            if body["unload"]:
                verdict = await self.pool.unload(name, reason="POST /admin/drain", timeout_s=body["timeout_s"])
            else:
                verdict = await self.pool.drain(name, body["timeout_s"])
        except KvCellarError as e:
            return JSONResponse({"model": name, "durable": False, "reason": str(e)}, status_code=503)
        if verdict is None:
            return JSONResponse(
                {"model": name, "durable": True, "reason": "", "state": slot.state, "note": "not loaded"}
            )
        answer = {"model": name, "state": slot.state, **attrs.asdict(verdict)}
        return JSONResponse(answer, status_code=200 if verdict.durable else 503)

    async def flush(self, request: Request) -> Response:
        try:
            timeout_s = flush_timeout_s(request.query_params.get("timeout_s"), await request.body())
        except BadRequest as e:
            return error_response(400, str(e), param=e.param)
        verdicts = {}
        for system in self.pool.loaded_systems():
            name = next(n for n, s in self.pool.slots.items() if s.system is system)
            verdicts[name] = attrs.asdict(await system.flush(timeout_s=timeout_s))
        durable = all(v["durable"] for v in verdicts.values())
        return JSONResponse({"durable": durable, "models": verdicts}, status_code=200 if durable else 503)


class LoadingStream:
    """A streamed request for a model that is not loaded yet: the 200 and the event stream's headers go out
    at once, and the API's keep-alive (an SSE comment, Anthropic's `ping`) every `keepalive_interval_s`
    while the model loads, as during a long prefill (http/streaming.py); then the model's own stream
    follows. A load that fails, or an error the model's app answers, ends the stream with one error event."""

    def __init__(self, app: PoolApp, anthropic: bool) -> None:
        self.app = app
        self.anthropic = anthropic
        self.keepalive = (ANTHROPIC_PING_KEEPALIVE if anthropic else SSE_COMMENT_KEEPALIVE).encode()
        self._sending = trio.Lock()

    async def run(self, name: str, scope: Scope, raw: bytes, requested: Any, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        pinging = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._ping, pinging, send)
            try:
                async with self.app.pool.use(name) as system:
                    await self._stop(pinging)
                    await self.app.forward(name, system, scope, raw, requested, receive, self._into_stream(send))
            except KvCellarError as e:
                await self._stop(pinging)
                _, body = failure_event_body(e) if self.anthropic else failure_body(e)
                await self._error_event(send, body)

    async def _ping(self, pinging: trio.CancelScope, send: Send) -> None:
        with pinging:
            while True:
                await trio.sleep(self.app.settings.keepalive_interval_s)
                async with self._sending:
                    with trio.CancelScope(shield=True):
                        await send({"type": "http.response.body", "body": self.keepalive, "more_body": True})

    async def _stop(self, pinging: trio.CancelScope) -> None:
        pinging.cancel()
        async with self._sending:  # a keep-alive being sent ends before the model's stream begins
            pass

    def _into_stream(self, send: Send) -> Send:
        """The model's answer without its own response start; a non-200 JSON answer becomes an error event."""
        status = 200
        parts: list[bytes] = []

        async def forward(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif status == 200 or message["type"] != "http.response.body":
                await send(message)
            else:
                parts.append(message.get("body", b""))
                if not message.get("more_body"):
                    await self._error_event(send, json.loads(b"".join(parts) or b"{}"))

        return forward

    async def _error_event(self, send: Send, body: dict[str, Any]) -> None:
        if self.anthropic:
            text = f"event: error\ndata: {json.dumps(body)}\n\n"
        else:
            text = f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n"
        await send({"type": "http.response.body", "body": text.encode(), "more_body": False})


def partial_guard(settings: HttpSettings) -> Callable[[Callable[[Request], Awaitable[Response]]], Any]:
    return lambda handler: _guarded(lambda: settings.admin_token, handler)


def _drain_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw.decode("utf-8")) if raw.strip() else None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"the drain body is not valid JSON: {e}") from e
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        raise BadRequest('the drain body must be a JSON object naming a model: {"model": NAME}', param="model")
    timeout_s = body.get("timeout_s", DRAIN_TIMEOUT_S_DEFAULT)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 < timeout_s <= 3600:
        raise BadRequest("'timeout_s' must be a number of seconds in (0, 3600]", param="timeout_s")
    unload = body.get("unload", False)
    if not isinstance(unload, bool):
        raise BadRequest("'unload' must be true or false", param="unload")
    return {"model": body["model"], "timeout_s": float(timeout_s), "unload": unload}


def _failure(error: Exception, anthropic: bool) -> JSONResponse:
    status, body = failure_event_body(error) if anthropic else failure_body(error)
    if isinstance(error, UnknownModel):
        body["error"]["served"] = list(error.served)
    return JSONResponse(body, status_code=status)


def _unauthorized(anthropic: bool) -> Response:
    if anthropic:
        return anthropic_error(401, "authentication_error", "missing or wrong x-api-key")
    return error_response(401, "missing or wrong API key", error_type="authentication_error")


async def _replay(app: Any, scope: Scope, raw: bytes, receive: Receive, send: Send) -> None:
    """Run `app` on a request whose body was already read: it gets `raw` first, then the client's own
    messages (its disconnect, which cancels a generation between two steps)."""
    given = False

    async def replayed() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(raw)).encode()))
    await app(dict(scope, headers=headers), replayed, send)


# The pool's per-model counters (`/stats` field, HELP); prometheus_client appends `_total`.
_MODEL_COUNTERS = (
    ("engine_jobs", "engine jobs of the model run to their end"),
    ("engine_yields", "times one of the model's generations gave the engine thread to another model's job"),
)
# A drafted model's speculative counters (its own `/metrics` has them as `kvcellar_speculative_*`), since its load.
_SPECULATIVE_COUNTERS = (
    ("requests", "requests decoded with the model's draft, since its load"),
    ("rounds", "draft-and-verify rounds run, since its load"),
    ("proposed_tokens", "tokens the model's draft proposed, since its load"),
    ("accepted_tokens", "proposed tokens the model accepted, since its load"),
)


class _PoolCollector:
    """`/metrics` of the pool: per model, its load state, tier figures, engine turns and (with a draft) its
    speculative counters, read afresh per scrape."""

    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool

    def collect(self) -> Any:
        stats = self.pool.stats()
        yield from _model_gauges(stats["models"])
        yield from _model_counters(stats["models"])
        yield GaugeMetricFamily("kvcellar_pool_budget_bytes", "the models memory budget", value=stats["budget_bytes"])
        yield GaugeMetricFamily(
            "kvcellar_pool_resident_bytes", "the loaded models' weights bytes", value=stats["resident_bytes"]
        )


def _model_gauges(models: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    families = {
        "loaded": GaugeMetricFamily("kvcellar_pool_model_loaded", "1 when the model is loaded", labels=["model"]),
        "ram_bytes": GaugeMetricFamily(
            "kvcellar_pool_model_ram_bytes", "the model's RAM prompt cache bytes", labels=["model"]
        ),
        "ssd_bytes": GaugeMetricFamily("kvcellar_pool_model_ssd_bytes", "the model's SSD tier bytes", labels=["model"]),
        "ram_hits": GaugeMetricFamily("kvcellar_pool_model_ram_hits", "RAM tier hits while loaded", labels=["model"]),
        "requests": GaugeMetricFamily("kvcellar_pool_model_requests", "requests routed to the model", labels=["model"]),
        "loads": GaugeMetricFamily("kvcellar_pool_model_loads", "times the model was loaded", labels=["model"]),
        "unloads": GaugeMetricFamily("kvcellar_pool_model_unloads", "times the model was unloaded", labels=["model"]),
        "drain": GaugeMetricFamily(
            "kvcellar_pool_model_last_drain_durable", "1 when its last drain was durable", labels=["model"]
        ),
    }
    for name, model in models.items():
        families["loaded"].add_metric([name], 1.0 if model["state"] == "loaded" else 0.0)
        for key in ("ram_bytes", "ssd_bytes", "ram_hits", "requests", "loads", "unloads"):
            families[key].add_metric([name], float(model[key]))
        if model["last_drain"] is not None:
            families["drain"].add_metric([name], 1.0 if model["last_drain"]["durable"] else 0.0)
    yield from families.values()


def _model_counters(models: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """Every model's engine turns; a loaded model with a draft, its speculative counters."""
    for field, help in _MODEL_COUNTERS:
        family = CounterMetricFamily(f"kvcellar_pool_model_{field}", help, labels=["model"])
        for name, model in models.items():
            family.add_metric([name], float(model[field]))
        yield family
    for field, help in _SPECULATIVE_COUNTERS:
        family = CounterMetricFamily(f"kvcellar_pool_model_speculative_{field}", help, labels=["model"])
        for name, model in models.items():
            if field in model["speculative"]:
                family.add_metric([name], float(model["speculative"][field]))
        yield family
