"""`--ssd-write-budget GB/day` on the write path (issue 21).

`BudgetedWrites.wrap(write)` is the spill queue's writer behind the budget:
while the bucket (`store.write_wear.WriteBudget`, kept by the `WearMonitor`)
cannot pay for a background write, that write waits, and the spill queue
keeps taking newer snapshots and drops the oldest over its byte cap (counted
as `dropped_while_waiting`). A flush (and shutdown) opens a write window:
waiting and later writes go through at once, over budget if need be, and the
flush says how many bytes it wrote past the budget (`over_budget_bytes`).
Without a budget `wrap` returns the writer itself, so the write path is
unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import attrs
import trio

from kvcellar.store.prompt_cache import SpillSnapshot
from kvcellar.store.write_wear import WearMonitor

Writer = Callable[[SpillSnapshot], Awaitable[str]]


@attrs.define(kw_only=True)
class BudgetCounters:
    waits: int = 0  # background writes that waited for the bucket
    wait_s_total: float = 0.0
    dropped_while_waiting: int = 0  # spills the queue dropped (oldest first) while a write waited
    waiting: int = 0  # writes waiting now (0 or 1: the queue writes one at a time)


class BudgetedWrites:
    """Trio thread only. `dropped_spills()` reads the spill queue's drop count."""

    def __init__(self, monitor: WearMonitor, *, dropped_spills: Callable[[], int] = lambda: 0) -> None:
        self._monitor = monitor
        self._dropped_spills = dropped_spills
        self.counters = BudgetCounters()
        self._windows = 0
        self._window_opened = trio.Event()

    def wrap(self, write: Writer) -> Writer:
        if not self._monitor.budgeted:
            return write

        async def budgeted_write(snapshot: SpillSnapshot) -> str:
            await self._wait_for_budget(snapshot.bytes)
            return await write(snapshot)

        return budgeted_write

    async def _wait_for_budget(self, size_bytes: int) -> None:
        wait_s = self._monitor.budget_wait_s(size_bytes)
        if wait_s <= 0 or self._windows:
            return
        started_s, dropped_before = trio.current_time(), self._dropped_spills()
        self.counters.waits += 1
        self.counters.waiting += 1
        try:
            while wait_s > 0 and not self._windows:
                with trio.move_on_after(wait_s):
                    await self._window_opened.wait()
                wait_s = self._monitor.budget_wait_s(size_bytes)
        finally:
            self.counters.waiting -= 1
            self.counters.wait_s_total += trio.current_time() - started_s
            self.counters.dropped_while_waiting += self._dropped_spills() - dropped_before

    @contextlib.contextmanager
    def write_window(self) -> Iterator[Callable[[], int]]:
        """While open, no write waits for the budget; yields a function giving
        the bytes written past the budget since the window opened."""
        over_before = self._monitor.over_budget_bytes()
        self._windows += 1
        self._window_opened.set()
        self._window_opened = trio.Event()
        try:
            yield lambda: self._monitor.over_budget_bytes() - over_before
        finally:
            self._windows -= 1

    def stats(self) -> dict[str, Any]:
        budget = self._monitor.budget_stats()
        return {**(budget or {}), **attrs.asdict(self.counters)}
