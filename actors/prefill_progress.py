"""Prefill progress of the requests in flight (issue 38: a long prefill never
looks dead).

`PrefillProgress` is owned by the Trio thread (`System`): `System.generate`
opens a row per request (`begin`) and closes it at the request's first token
or end (`end`); the engine thread's reports reach it only through
`TrioPrefillObserver`, which hands each one to the Trio thread with
`run_sync_soon`, so the table needs no lock. `/stats` `prefill` and the
dashboard read `stats()` on the Trio thread.

A report that arrives after its row closed (the engine ran a chunk while
the request ended) is dropped; a cancellation still counts.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import attrs
import trio


@attrs.define(kw_only=True)
class _Row:
    tokens_done: int
    tokens_total: int
    started_s: float


class PrefillProgress:
    """Tokens done / total of every request still prefilling, and how many
    prefills a client's departure stopped (with the tokens kept for its retry)."""

    def __init__(self, clock_s: Callable[[], float]) -> None:
        self._clock_s = clock_s
        self._ids = itertools.count(1)
        self._rows: dict[int, _Row] = {}
        # Prefills stopped because the client left, and the prompt tokens they kept in the tiers.
        self.cancelled = 0
        self.kept_tokens = 0

    def begin(self, tokens_total: int) -> int:
        """Open a row for a request of `tokens_total` prompt tokens; returns its id."""
        row_id = next(self._ids)
        self._rows[row_id] = _Row(tokens_done=0, tokens_total=tokens_total, started_s=self._clock_s())
        return row_id

    def advanced(self, row_id: int, tokens_done: int, tokens_total: int) -> None:
        row = self._rows.get(row_id)
        if row is not None:
            row.tokens_done, row.tokens_total = tokens_done, tokens_total

    def stopped(self, row_id: int, tokens_kept: int) -> None:
        """The engine stopped the row's prefill (its client left), keeping `tokens_kept`."""
        self.cancelled += 1
        self.kept_tokens += tokens_kept
        self._rows.pop(row_id, None)

    def end(self, row_id: int) -> None:
        """The request's prefill is over (a first token) or the request ended."""
        self._rows.pop(row_id, None)

    def stats(self) -> dict[str, Any]:
        now_s = self._clock_s()
        in_flight = [
            {
                "id": row_id,
                "tokens_done": row.tokens_done,
                "tokens_total": row.tokens_total,
                "elapsed_s": round(now_s - row.started_s, 3),
            }
            for row_id, row in self._rows.items()
        ]
        return {"in_flight": in_flight, "cancelled": self.cancelled, "kept_tokens": self.kept_tokens}


# A test's seam (`SystemSeams.prefill_chunk_hook`): called on the engine thread with
# each progress report (tokens done, total), after it was handed over.
PrefillChunkHook = Callable[[int, int], None]


@attrs.frozen(kw_only=True)
class TrioPrefillObserver:
    """The engine's `PrefillObserver` for one request: hands each report to
    the Trio thread's `PrefillProgress` (engine/engine.py's protocol)."""

    table: PrefillProgress
    row_id: int
    trio_token: trio.lowlevel.TrioToken
    hook: PrefillChunkHook | None = None

    def progress(self, tokens_done: int, tokens_total: int) -> None:
        self.trio_token.run_sync_soon(self.table.advanced, self.row_id, tokens_done, tokens_total)
        if self.hook is not None:
            self.hook(tokens_done, tokens_total)

    def cancelled(self, tokens_kept: int, tokens_total: int) -> None:
        self.trio_token.run_sync_soon(self.table.stopped, self.row_id, tokens_kept)
