"""The simulator's model of the thread boundary.

In a server three kinds of thread meet at the store: the Trio thread (actors,
`find`, `covers`, `stats`), the engine thread (generation, `restore`, write
plans) and worker threads (`trio.to_thread`: the writer's file I/O and
`finish_store`), with the journal's own thread behind them. The simulator
runs all of them on one thread so that a seed replays byte for byte, and
models the boundary in two ways:

- **Where work completes.** Every call that crosses a thread in production
  crosses the same seam here (`EngineThread.call`/`stream` → `InlineEngine`,
  `trio.to_thread.run_sync` → `SeededBlocking`, `JournalThread` →
  `OwnedJournalRunner`), and `BoundarySchedule` draws from the seed how much
  virtual time each engine job, stream step and blocking call takes, so
  engine jobs, background steps, restores and commits complete at points of
  the Trio schedule that the seed chooses (a job itself runs without
  interruption, as a Python call on another thread does between the points
  where it touches shared state).
- **The ownership rules**, checked on every operation: no disk operation while
  the store's index lock is held (`no_io_under_index_lock`: a lock held across
  a restore would stall the Trio thread's `find`/`stats` for the whole read),
  and no journal transaction outside the journal's owner
  (`journal_has_one_owner`: two threads' transactions on one connection is
  the race that degraded the journal under load). The mutations
  `restore-holds-index-lock` and `journal-unowned-append` reintroduce each
  bug, and the default sweep catches both.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")

# Virtual seconds a crossing may take; zero often, so completions also land
# on the same tick as the Trio work around them.
CROSSING_DELAYS_S = (0.0, 0.0, 0.0, 0.001, 0.004, 0.02)


class BoundarySchedule:
    """The seed's choice of how long each crossing takes (its own stream, so
    drawing it never shifts the workload's or the disk's choices)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def delay_s(self) -> float:
        return self._rng.choice(CROSSING_DELAYS_S)


class SeededBlocking:
    """`trio.to_thread.run_sync`'s seam: the call runs inline and its result
    arrives after a seeded virtual delay, as a worker thread's would."""

    def __init__(self, schedule: BoundarySchedule) -> None:
        self._schedule = schedule

    async def __call__(self, fn: Callable[..., T], *args: Any) -> T:
        await trio.sleep(self._schedule.delay_s())
        result = fn(*args)
        await trio.sleep(self._schedule.delay_s())
        return result


class OwnedJournalRunner:
    """`JournalThread`'s seam: runs work inline, and knows while it does, so a
    transaction that runs anywhere else is seen (`running_owner_work`)."""

    def __init__(self) -> None:
        self.running_owner_work = False

    def submit(self, work: Callable[[], None]) -> None:
        self.call(work)

    def call(self, work: Callable[[], T], timeout_s: float | None = None) -> T:
        outer, self.running_owner_work = self.running_owner_work, True
        try:
            return work()
        finally:
            self.running_owner_work = outer

    def call_later(self, work: Callable[[], T]) -> Callable[[], T]:
        result = self.call(work)
        return lambda: result

    def close(self) -> None:
        pass


class TrackedLock:
    """A re-entrant lock that knows whether it is held (the store's index lock)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.depth = 0

    def __enter__(self) -> TrackedLock:
        self._lock.acquire()
        self.depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1
        self._lock.release()


class BoundaryChecks:
    """Checks the ownership rules on each disk operation and journal transaction."""

    def __init__(self, violate: Callable[[str, str], None]) -> None:
        self._violate = violate
        self.index_lock = TrackedLock()
        self.journal_runner = OwnedJournalRunner()

    def new_store_seams(self) -> tuple[TrackedLock, OwnedJournalRunner]:
        """A fresh lock and runner for each store a run opens."""
        self.index_lock = TrackedLock()
        self.journal_runner = OwnedJournalRunner()
        return self.index_lock, self.journal_runner

    def disk_operation(self, name: str, subject: str | None) -> None:
        if self.index_lock.depth:
            self._violate("no_io_under_index_lock", f"{name} {subject or ''} while the store's index lock is held")

    def journal_transaction(self) -> None:
        if not self.journal_runner.running_owner_work:
            self._violate("journal_has_one_owner", "a journal transaction ran outside the journal's owner")
