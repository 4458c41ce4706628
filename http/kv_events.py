"""`GET /v1/kv_events`: the tiers' KV events as server-sent events (store/kv_events.py).

`attach_kv_events` connects a `KvEventLog` to a started system: a residency
listener on the RAM tier's events port (`WriteBehind`, engine thread) and the
SSD tier's event listener (its writer's thread), both relayed to the Trio
thread, after which the SSD tier's current entries are reported (an entry
stored in between is reported twice, which the log ignores). The route sends
each event as `id: <sequence>`, `event: <type>`, `data: <json>`; a reader resumes
with `?since=N` or the `Last-Event-ID` header, and without either starts from a
reset (`AllBlocksCleared` per tier, then the resident chains). `?follow=false`
ends the stream after the backlog (a poll); otherwise it waits for more, woken
through the Trio token (no polling), with a keep-alive comment while silent.
Schema and the mapping to vLLM's events: docs/cluster.md.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import suppress
from typing import Any

import numpy as np
import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvcellar.store import events as ev
from kvcellar.store.kv_events import KvEvent, KvEventLog

KEEPALIVE_S = 15.0
# The SSD tier's events that take an indexed entry away.
SSD_REMOVALS = (ev.EntrySuperseded, ev.EntryEvicted, ev.ReconcileRemoved, ev.EntryQuarantined)


class _OnTrioThread:
    """Runs the log's updates on the Trio thread, in the order the tiers reported them
    (`run_sync_soon` is FIFO): the block digests are hashed there, never on the engine
    thread (the RAM tier's puts) or under the SSD tier's lock (its writer's events)."""

    def __init__(self, log: KvEventLog, token: trio.lowlevel.TrioToken) -> None:
        self._log, self._token = log, token

    def later(self, update: Any, *args: Any) -> None:
        with suppress(trio.RunFinishedError):
            self._token.run_sync_soon(update, *args)

    def resident(self, entry_id: str, namespace: str, tokens: np.ndarray) -> None:
        self.later(self._log.entry_stored, "RAM", entry_id, tokens, namespace)

    def gone(self, entry_id: str) -> None:
        self.later(self._log.entry_removed, "RAM", entry_id)

    def ssd_event(self, event: Any) -> None:
        if isinstance(event, ev.EntryStored | ev.ReconcileAdded):
            tokens = np.frombuffer(event.entry.token_ids, dtype="<u4")
            self.later(self._log.entry_stored, "SSD", event.entry.entry_id, tokens, event.entry.namespace)
        elif isinstance(event, SSD_REMOVALS) and event.entry_id:
            # A quarantined file that was never indexed has no entry id, and was never published.
            self.later(self._log.entry_removed, "SSD", event.entry_id)


def attach_kv_events(system: Any, log: KvEventLog) -> None:
    """Report the system's RAM and SSD tiers into `log` from now on (call on the Trio thread)."""
    relay = _OnTrioThread(log, trio.lowlevel.current_trio_token())
    system.write_behind.add_residency_listener(relay)
    store = system.store
    if store is None:
        return
    store.add_event_listener(relay.ssd_event)
    for entry_id in store.entry_ids():
        entry = store.entry(entry_id)
        if entry is not None:
            log.entry_stored("SSD", entry_id, entry.tokens, entry.namespace)


class KvEventsRoute:
    """The SSE route over one log; wakes its streams through the Trio token."""

    def __init__(self, log: KvEventLog) -> None:
        self.log = log
        self._token = trio.lowlevel.current_trio_token()
        self._changed = trio.Event()
        log.add_listener(lambda _sequence: self._token.run_sync_soon(self._wake))

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def handle(self, request: Request) -> Response:
        raw = request.query_params.get("since", request.headers.get("last-event-id"))
        try:
            since = int(raw) if raw is not None else -1
        except ValueError:
            return JSONResponse(
                {"error": {"message": "since must be an integer", "type": "invalid_request_error", "param": "since"}},
                status_code=400,
            )
        follow = request.query_params.get("follow", "true").lower() not in ("false", "0", "no")
        return StreamingResponse(self._stream(since, follow), media_type="text/event-stream")

    async def _stream(self, since: int, follow: bool) -> AsyncIterator[str]:
        while True:
            changed = self._changed
            events, _reset = self.log.since(since)
            for event in events:
                yield _sse(event)
            if events:
                since = max(since, events[-1].sequence)
            if not follow:
                return
            with trio.move_on_after(KEEPALIVE_S):
                await changed.wait()
                continue
            yield ": keep-alive\n\n"


def _sse(event: KvEvent) -> str:
    return f"id: {event.sequence}\nevent: {event.type}\ndata: {json.dumps(event.as_json())}\n\n"


def kv_events_routes(system: Any, block_size: int, guard: Any) -> tuple[list[Route], KvEventLog]:
    """The route and its log, attached to `system` (call on the Trio thread, after the system started)."""
    log = KvEventLog(block_size=block_size)
    attach_kv_events(system, log)
    route = KvEventsRoute(log)
    return [Route("/v1/kv_events", guard(route.handle), methods=["GET"])], log
