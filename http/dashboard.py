"""The live dashboard: `GET /dashboard` (one static page) and the two
`/stats`-adjacent reads it polls besides `/stats`.

- `GET /dashboard`: `static/dashboard.html`, inline JS, CSS and SVG charts,
  no build step and no CDN (the machine may be offline). The page itself is
  public because it holds no data: everything it shows comes from the
  admin-token routes, and it asks for the token once (kept in the tab's
  session storage) when `GET /dashboard/auth` says one is needed, or when a
  read answers 401 (a wrong token).
- `GET /dashboard/auth` (public): `{"admin_token_required": bool}`, so the
  page can ask before its first read instead of provoking a 401.
- `GET /stats/requests` (admin token): the recent-requests ring,
  `System.recent_requests` (`actors/recent_requests.py`); `after_seq=N` keeps
  only newer records. Each record's `cache_divergence` says where the prompt
  left the longest cached prefix (`at_tokens`, `tier`); its excerpts (the
  shared text just before, the prompt's and the cached entry's text just
  after, decoded on a worker thread) are prompt text, so they are shown only
  when the server has an admin token (which the caller then presented);
  on a server without one the token ids are dropped and `excerpts` says why.
- `GET /stats/journal` (admin token): the journal's last `limit` events
  (default 50, at most 1000), read on the journal's own thread behind the
  queued appends; `{"journal": "off"}` without an SSD tier.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from kvcellar.actors.system import System
from kvcellar.errors import BadQuery
from kvcellar.serialization import converter

DASHBOARD_PATH = Path(__file__).parent / "static" / "dashboard.html"
JOURNAL_EVENTS_DEFAULT = 50
JOURNAL_EVENTS_MAX = 1000
# A list in an event longer than this is summarised by its length (token ids, say).
_LIST_ITEMS_SHOWN = 8

Handler = Callable[[Request], Awaitable[Response]]
ErrorResponse = Callable[..., Response]


def query_count(raw: str | None, *, param: str, default: int, lowest: int, highest: int) -> int:
    """An integer query parameter in [lowest, highest]; `BadQuery` naming it otherwise."""
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadQuery(f"{param}={raw!r} is not an integer", param=param) from None
    if not lowest <= value <= highest:
        raise BadQuery(f"{param} must be between {lowest} and {highest}, got {value}", param=param)
    return value


def json_safe(value: Any) -> Any:
    """An unstructured event made fit for JSON and a page: bytes and long
    lists become a short description, non-finite floats text."""
    if isinstance(value, dict):
        return {str(key): json_safe(inner) for key, inner in value.items()}
    if isinstance(value, bytes | bytearray):
        return f"<{len(value)} bytes>"
    if isinstance(value, list | tuple):
        if len(value) > _LIST_ITEMS_SHOWN:
            return f"<{len(value)} items>"
        return [json_safe(inner) for inner in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


_EXCERPT_IDS = {
    "shared_before_ids": "shared_before",
    "prompt_next_ids": "prompt_next",
    "cached_next_ids": "cached_next",
}


def decode_excerpts(tokenizer: Any, records: list[dict[str, Any]]) -> None:
    """Each record's divergence token ids replaced by their text, in place."""
    for record in records:
        divergence = record.get("cache_divergence")
        if divergence is None:
            continue
        for ids_field, text_field in _EXCERPT_IDS.items():
            divergence[text_field] = tokenizer.decode(list(divergence.pop(ids_field)))


def withhold_excerpts(divergence: dict[str, Any] | None) -> None:
    """The divergence's position kept, its prompt text (token ids) dropped, in place."""
    if divergence is None:
        return
    for ids_field in _EXCERPT_IDS:
        divergence.pop(ids_field, None)
    divergence["excerpts"] = "prompt text: shown only on a server started with --admin-token"


def journal_event_json(record: Any) -> dict[str, Any]:
    """One `JournalEvent` for `/stats/journal`; `data` is the event's own fields."""
    return {
        "seq": record.seq,
        "time_ns": record.time_ns,
        "actor": record.actor,
        "kind": record.kind,
        "entry_id": record.entry_id,
        "data": json_safe(converter.unstructure(record.event)),
    }


def dashboard_routes(
    system: System,
    guarded: Callable[[Handler], Handler],
    admin_token_required: Callable[[], bool],
    error_response: ErrorResponse,
    failure_response: Callable[[Exception], Response],
) -> list[Route]:
    """The page, its auth probe and its two reads; `guarded` wraps a handler in
    the admin-token check."""
    page: list[bytes] = []

    async def dashboard(_: Request) -> Response:
        if not page:
            # Read once, off the Trio thread; the file ships as package data.
            try:
                page.append(await trio.to_thread.run_sync(DASHBOARD_PATH.read_bytes))
            except OSError as e:
                message = f"the dashboard page cannot be read from this install ({DASHBOARD_PATH}): {e.strerror}"
                return error_response(503, message, error_type="server_unavailable")
        return HTMLResponse(page[0], headers={"Cache-Control": "no-store"})

    async def auth(_: Request) -> Response:
        return JSONResponse({"admin_token_required": admin_token_required()})

    async def recent_requests(request: Request) -> Response:
        try:
            after_seq = query_count(
                request.query_params.get("after_seq"), param="after_seq", default=0, lowest=0, highest=2**62
            )
        except BadQuery as e:
            return error_response(400, str(e), param=e.param)
        snapshot = system.recent_requests.snapshot(after_seq=after_seq)
        if admin_token_required():
            # A fast tokenizer's decode is safe beside the tokenizer lane's encodes (Rust, no shared state).
            await trio.to_thread.run_sync(decode_excerpts, system.loaded.tokenizer, snapshot["requests"])
        else:
            for record in snapshot["requests"]:
                withhold_excerpts(record.get("cache_divergence"))
        return JSONResponse(snapshot)

    async def journal_events(request: Request) -> Response:
        try:
            limit = query_count(
                request.query_params.get("limit"),
                param="limit",
                default=JOURNAL_EVENTS_DEFAULT,
                lowest=1,
                highest=JOURNAL_EVENTS_MAX,
            )
        except BadQuery as e:
            return error_response(400, str(e), param=e.param)
        try:
            records = await system.recent_journal_events(limit)
        except Exception as e:
            return failure_response(e)
        if records is None:
            return JSONResponse({"journal": "off", "events": []})
        state = system.store.journal.state() if system.store is not None and system.store.journal else {}
        return JSONResponse({"journal": state.get("state", "off"), "events": [journal_event_json(r) for r in records]})

    return [
        Route("/dashboard", dashboard, methods=["GET"]),
        Route("/dashboard/auth", auth, methods=["GET"]),
        Route("/stats/requests", guarded(recent_requests), methods=["GET"]),
        Route("/stats/journal", guarded(journal_events), methods=["GET"]),
    ]


__all__ = [
    "DASHBOARD_PATH",
    "JOURNAL_EVENTS_DEFAULT",
    "JOURNAL_EVENTS_MAX",
    "dashboard_routes",
    "journal_event_json",
    "json_safe",
    "query_count",
]
