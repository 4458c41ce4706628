"""What the SSD tier costs the drive (issue 21), from the journal's events.

`WearFold` folds the store's events, with the time each was journaled, into
the write-amplification figures `kvcellar journal stats` and `/stats`
`ssd_cache.write_wear` report, since the fold began and per UTC day:

- `bytes_written`, `entries_written`: every committed entry (`entry.stored`);
- `tokens_served_from_ssd`: the prefix tokens restores handed back
  (`entry.restored`), and `bytes_written_per_ssd_token` the ratio;
- `dead_writes`, `dead_write_bytes`: entries evicted without ever having been
  restored (the write bought nothing);
- `rewrites`, `rewritten_bytes`: entries superseded by a newer one, whose
  write rewrote their prefix (the bytes counted are the superseded entry's).

The same fold serves both: the CLI replays every event of the journal, the
server feeds it each event as the store journals it (`WearMonitor`, an
`SsdStore` event listener), so the server's figures equal a replay of the
events it journaled.

`WriteBudget` is the token bucket of `--ssd-write-budget GB/day`: it holds at
most one day's bytes and refills at that rate; every committed entry takes
its bytes out (a flush may take it below zero: it writes anyway and the
overdraft is counted). Its level is a function of the journal's
`entry.stored` events (full before the first write, then every write taken
out and refilled since), which is how it survives a restart:
`WriteBudget.from_history` replays them at startup. (The last day's writes
alone would not do: refill that a full bucket cannot hold is lost, so older
writes still change the level.)
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from kvcellar.store import events as ev

NS_PER_S = 10**9
DAY_NS = 86_400 * NS_PER_S


def utc_day(time_ns: int) -> str:
    return datetime.datetime.fromtimestamp(time_ns / NS_PER_S, tz=datetime.UTC).strftime("%Y-%m-%d")


@attrs.define(kw_only=True)
class WearTotals:
    bytes_written: int = 0
    entries_written: int = 0
    tokens_served_from_ssd: int = 0
    restores: int = 0
    dead_writes: int = 0
    dead_write_bytes: int = 0
    rewrites: int = 0
    rewritten_bytes: int = 0

    def as_json(self) -> dict[str, Any]:
        served = self.tokens_served_from_ssd
        return {
            **attrs.asdict(self),
            "bytes_written_per_ssd_token": self.bytes_written / served if served else None,
        }


@attrs.define(kw_only=True)
class _LiveEntry:
    bytes: int
    read: bool


class WearFold:
    """The figures above over the events fed to `apply` (not thread-safe:
    `WearMonitor` is the server's monitor around it). Entries that existed
    before the fold began are known only through `seed_entries`; one evicted
    without being known is not judged dead or alive."""

    def __init__(self) -> None:
        self.total = WearTotals()
        self.per_day: dict[str, WearTotals] = {}
        self._live: dict[str, _LiveEntry] = {}

    def seed_entries(self, rows: Iterable[dict[str, Any]]) -> None:
        """Entries already indexed (journal `entries` rows: bytes, restores)."""
        for row in rows:
            self._live[row["entry_id"]] = _LiveEntry(bytes=int(row["bytes"]), read=bool(row["restores"]))

    def apply(self, time_ns: int, event: Any) -> None:
        match event:
            case ev.EntryStored():
                self._live[event.entry.entry_id] = _LiveEntry(bytes=event.entry.bytes, read=False)
                self._count(time_ns, bytes_written=event.entry.bytes, entries_written=1)
            case ev.ReconcileAdded():
                # A file the journal did not know: tracked, but not a write this journal saw.
                self._live.setdefault(event.entry.entry_id, _LiveEntry(bytes=event.entry.bytes, read=False))
            case ev.EntryRestored():
                entry = self._live.get(event.entry_id)
                if entry is not None:
                    entry.read = True
                self._count(time_ns, tokens_served_from_ssd=event.usable_tokens, restores=1)
            case ev.EntryEvicted():
                entry = self._live.pop(event.entry_id, None)
                if entry is not None and not entry.read:
                    self._count(time_ns, dead_writes=1, dead_write_bytes=entry.bytes)
            case ev.EntrySuperseded():
                entry = self._live.pop(event.entry_id, None)
                self._count(time_ns, rewrites=1, rewritten_bytes=entry.bytes if entry is not None else 0)
            case ev.EntryQuarantined() | ev.ReconcileRemoved():
                self._live.pop(event.entry_id, None)
            case _:
                pass

    def _count(self, time_ns: int, **amounts: int) -> None:
        # A day appears once something is counted on it.
        day = self.per_day.setdefault(utc_day(time_ns), WearTotals())
        for totals in (self.total, day):
            for name, amount in amounts.items():
                setattr(totals, name, getattr(totals, name) + amount)

    def as_json(self) -> dict[str, Any]:
        return {
            "total": self.total.as_json(),
            "per_day": {name: totals.as_json() for name, totals in sorted(self.per_day.items())},
        }


def fold_journal(records: Iterable[Any]) -> WearFold:
    """The fold over journal records (`Journal.events()`), from the first."""
    fold = WearFold()
    for record in records:
        fold.apply(record.time_ns, record.event)
    return fold


class WriteBudget:
    """A token bucket of `bytes_per_day` bytes, refilled continuously (pure:
    every method takes the time)."""

    def __init__(self, bytes_per_day: int, *, now_ns: int) -> None:
        if bytes_per_day <= 0:
            raise ValueError(f"a write budget must be > 0 bytes a day, got {bytes_per_day}")
        self.bytes_per_day = bytes_per_day
        self.level_bytes = float(bytes_per_day)
        self.updated_ns = now_ns
        self.over_budget_bytes = 0  # bytes charged beyond what the bucket held

    @classmethod
    def from_history(cls, bytes_per_day: int, stored: Iterable[tuple[int, int]], *, now_ns: int) -> WriteBudget:
        """The bucket after the `(time_ns, bytes)` writes, full before the first."""
        writes = sorted(stored)
        budget = cls(bytes_per_day, now_ns=writes[0][0] if writes else now_ns)
        for time_ns, size_bytes in writes:
            budget.charge(size_bytes, now_ns=time_ns)
        budget.refill(now_ns)
        budget.over_budget_bytes = 0  # overdrafts of an earlier run were reported by that run
        return budget

    def _level_at(self, now_ns: int) -> float:
        elapsed_ns = max(0, now_ns - self.updated_ns)
        return min(float(self.bytes_per_day), self.level_bytes + self.bytes_per_day * elapsed_ns / DAY_NS)

    def refill(self, now_ns: int) -> None:
        self.level_bytes = self._level_at(now_ns)
        self.updated_ns = max(self.updated_ns, now_ns)

    def charge(self, size_bytes: int, *, now_ns: int) -> None:
        self.refill(now_ns)
        self.over_budget_bytes += int(max(0.0, size_bytes - max(self.level_bytes, 0.0)))
        self.level_bytes -= size_bytes

    def wait_s(self, size_bytes: int, *, now_ns: int) -> float:
        """How long a background write of `size_bytes` must wait: until the
        bucket holds it (or is full, for a write larger than a day's bytes)."""
        needed = min(float(size_bytes), float(self.bytes_per_day))
        missing = needed - self._level_at(now_ns)
        return max(0.0, missing) * DAY_NS / self.bytes_per_day / NS_PER_S

    def stats(self, now_ns: int) -> dict[str, Any]:
        return {
            "bytes_per_day": self.bytes_per_day,
            "level_bytes": int(self._level_at(now_ns)),
            "over_budget_bytes": self.over_budget_bytes,
        }


class WearMonitor:
    """The server's wear figures and write budget: an `SsdStore` event
    listener (called under the store's index lock on whichever thread
    journals) and a reader on the Trio thread. One lock over in-memory state
    only, never held across I/O."""

    def __init__(self, *, bytes_per_day: int | None, clock_ns: Callable[[], int]) -> None:
        self._clock_ns = clock_ns
        self._lock = threading.Lock()
        self._fold = WearFold()
        self._bytes_per_day = bytes_per_day
        self._budget = WriteBudget(bytes_per_day, now_ns=clock_ns()) if bytes_per_day else None

    @property
    def budgeted(self) -> bool:
        return self._budget is not None

    def seed(self, entry_rows: Iterable[dict[str, Any]], stored: Iterable[tuple[int, int]]) -> None:
        """What the journal knew at startup: live entries, and every write (the budget's bucket)."""
        rows, writes = list(entry_rows), list(stored)
        with self._lock:
            self._fold.seed_entries(rows)
            if self._bytes_per_day:
                self._budget = WriteBudget.from_history(self._bytes_per_day, writes, now_ns=self._clock_ns())

    def on_event(self, event: Any) -> None:
        with self._lock:
            now_ns = self._clock_ns()
            self._fold.apply(now_ns, event)
            if self._budget is not None and isinstance(event, ev.EntryStored):
                self._budget.charge(event.entry.bytes, now_ns=now_ns)

    def budget_wait_s(self, size_bytes: int) -> float:
        with self._lock:
            return 0.0 if self._budget is None else self._budget.wait_s(size_bytes, now_ns=self._clock_ns())

    def over_budget_bytes(self) -> int:
        with self._lock:
            return 0 if self._budget is None else self._budget.over_budget_bytes

    def wear_stats(self) -> dict[str, Any]:
        with self._lock:
            return self._fold.as_json()

    def budget_stats(self) -> dict[str, Any] | None:
        with self._lock:
            return None if self._budget is None else self._budget.stats(self._clock_ns())
