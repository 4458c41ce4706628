"""SpillQueue (spec §5.5): one serial, byte-capped queue for eviction spills,
idle demotions and write-behind snapshots.

Every queued snapshot pins its entry's (GPU) buffers until the SSD writer gets
to it, so the queue is bounded in bytes: over `bytes_max` the *oldest* item
that is not in flight is dropped and its snapshot released at once. The item
just enqueued is never its own victim (a soft cap), so `bytes_max=0` keeps
only the newest queued item plus the one in flight. A dropped spill is a
future cache miss, never a wrong result. Every item settles exactly once
("stored", "failed" or "dropped") with exactly one `Release`.

`SpillQueueCore` is the sans-IO core (design §3); `SpillQueue` is its Trio
shell, which holds the snapshots by item id, runs the writes one at a time and
drops its reference to a snapshot whenever the core says `Release`.
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
import os
import traceback
from collections.abc import Awaitable, Callable, Mapping
from typing import assert_never

import attrs
import trio

from kvcellar.actors.one_in_flight import OneInFlight
from kvcellar.actors.runtime import ActorShell, Journal, JournalEvent, Reply
from kvcellar.errors import IllegalTransition, UsageError
from kvcellar.store.actor_events import SpillDispatched, SpillDropped, SpillEnqueued, SpillSettled
from kvcellar.store.prompt_cache import SpillSnapshot

log = logging.getLogger("kvcellar.actors.spill_queue")

SPILL_QUEUE_ENV_VAR = "KVCELLAR_SSD_SPILL_QUEUE_GB"
GIB = 2**30
# "GB" in the variable's name is read as GiB, so the default is exactly 2 GiB.
BYTES_MAX_DEFAULT = 2 * GIB

KINDS = ("evict", "oversize", "demote", "write-behind")
WRITE_OUTCOMES = ("stored", "failed")
OUTCOMES = ("stored", "dropped", "failed")


# Messages (received by the core).


@attrs.frozen(kw_only=True)
class Enqueue:
    """A producer hands over one snapshot of `bytes`; `kind` says which producer."""

    item_id: int
    bytes: int = attrs.field(validator=attrs.validators.ge(0))
    kind: str = attrs.field(validator=attrs.validators.in_(KINDS))


@attrs.frozen(kw_only=True)
class WriteResult:
    """The writer finished the in-flight item ("stored" or "failed")."""

    item_id: int
    outcome: str = attrs.field(validator=attrs.validators.in_(WRITE_OUTCOMES))


@attrs.frozen(kw_only=True)
class AwaitIdle:
    """Answer `Wake(waiter_id)` once nothing is queued or in flight."""

    waiter_id: int


@attrs.frozen(kw_only=True)
class Shutdown:
    """The shell is stopping: drop everything held; later Enqueues drop at once."""


SpillMessage = Enqueue | WriteResult | AwaitIdle | Shutdown


# Effects (emitted by the core, carried out by the shell).


@attrs.frozen(kw_only=True)
class Dispatch:
    """Write this item's snapshot now (it is the only one in flight)."""

    item_id: int


@attrs.frozen(kw_only=True)
class Release:
    """Drop every reference to this item's snapshot now."""

    item_id: int


@attrs.frozen(kw_only=True)
class Settled:
    """The item's final outcome: "stored", "dropped" or "failed"."""

    item_id: int
    outcome: str = attrs.field(validator=attrs.validators.in_(OUTCOMES))


@attrs.frozen(kw_only=True)
class Wake:
    """The answer to `AwaitIdle`: the queue is idle."""

    waiter_id: int


SpillEffect = Dispatch | Release | Settled | Wake | JournalEvent


def bytes_max_from_env(environ: Mapping[str, str] = os.environ) -> int:
    """The queue's byte cap from `KVCELLAR_SSD_SPILL_QUEUE_GB` (GiB, a float;
    unset or empty: 2 GiB; `0`: keep only the newest and the in-flight item).
    Raises `UsageError` for a value that is not a finite number >= 0 (the
    operator's fault)."""
    raw = environ.get(SPILL_QUEUE_ENV_VAR, "").strip()
    if not raw:
        return BYTES_MAX_DEFAULT
    try:
        gib = float(raw)
    except ValueError:
        gib = math.nan
    if not math.isfinite(gib) or gib < 0:
        raise UsageError(f"{SPILL_QUEUE_ENV_VAR}={raw!r} is not a size in GiB (a finite number >= 0)")
    return int(gib * GIB)


class SpillState(enum.Enum):
    IDLE = "idle"
    WRITING = "writing"
    CLOSED = "closed"


# Which messages each state takes, and the legal state changes: the one place
# where the queue's transitions are decided.
_ANY_STATE = frozenset(SpillState)
_ACCEPTS = {
    Enqueue: _ANY_STATE,
    WriteResult: frozenset({SpillState.WRITING}),
    AwaitIdle: _ANY_STATE,
    Shutdown: _ANY_STATE,
}
_MOVES = {
    SpillState.IDLE: {SpillState.WRITING, SpillState.CLOSED},
    SpillState.WRITING: {SpillState.WRITING, SpillState.IDLE, SpillState.CLOSED},
    SpillState.CLOSED: {SpillState.CLOSED},
}


class SpillQueueCore:
    """The sans-IO core: a FIFO of queued items, at most one in flight.

    `handle` raises `IllegalTransition` for a `WriteResult` that is not for
    the in-flight item, or an `Enqueue` of an id already held: a protocol bug
    between the shell, the writer and the producers (kvcellar's fault). The
    core is unchanged when it raises.
    """

    def __init__(self, bytes_max: int) -> None:
        if bytes_max < 0:
            raise UsageError(f"the spill queue's bytes_max must be >= 0, got {bytes_max}")
        self.bytes_max = bytes_max
        self.state = SpillState.IDLE
        self._items: OneInFlight[Enqueue] = OneInFlight(lambda item: item.item_id)
        self._queued_bytes = 0
        self._counts = {"enqueued": 0, "stored": 0, "failed": 0, "dropped": 0}

    def handle(self, msg: SpillMessage, now: float) -> list[SpillEffect]:
        accepted = _ACCEPTS.get(type(msg))
        if accepted is None or self.state not in accepted:
            raise IllegalTransition(f"the spill queue cannot take {type(msg).__name__} in state {self.state.name}")
        if isinstance(msg, Enqueue):
            return self._on_enqueue(msg)
        if isinstance(msg, WriteResult):
            return self._on_write_result(msg)
        if isinstance(msg, AwaitIdle):
            if self.state is SpillState.WRITING:
                self._items.add_waiter(msg.waiter_id)
                return []
            return [Wake(waiter_id=msg.waiter_id)]
        return self._on_shutdown()

    def stats(self) -> dict[str, int]:
        """Counters: `pending` items (queued + in flight) and their bytes,
        `queued`, `in_flight`, and the totals `enqueued`, `stored`, `failed`,
        `dropped` (enqueued == stored + failed + dropped + pending)."""
        in_flight = int(self._items.in_flight is not None)
        return {
            "pending": len(self._items) + in_flight,
            "pending_bytes": self._queued_bytes + self._in_flight_bytes(),
            "queued": len(self._items),
            "in_flight": in_flight,
            **self._counts,
            "bytes_max": self.bytes_max,
        }

    def _move(self, to: SpillState) -> None:
        if to not in _MOVES[self.state]:
            raise IllegalTransition(f"the spill queue cannot move from state {self.state.name} to {to.name}")
        self.state = to

    def _on_enqueue(self, item: Enqueue) -> list[SpillEffect]:
        if self._items.holds(item.item_id):
            raise IllegalTransition(f"item {item.item_id} is already held by the spill queue (state {self.state.name})")
        self._counts["enqueued"] += 1
        if self.state is SpillState.CLOSED:
            # A producer racing the shutdown: accepted, and dropped at once.
            return self._drop(item, "closed")
        self._items.append(item)
        self._queued_bytes += item.bytes
        effects: list[SpillEffect] = [
            JournalEvent(event=SpillEnqueued(item_id=item.item_id, bytes=item.bytes, spill_kind=item.kind))
        ]
        # The newest item is last in the FIFO, so with two or more queued the
        # head is the oldest item that is neither in flight nor just enqueued.
        while self._queued_bytes + self._in_flight_bytes() > self.bytes_max and len(self._items) > 1:
            oldest = self._items.pop_oldest()
            self._queued_bytes -= oldest.bytes
            effects += self._drop(oldest, "byte_cap")
        if self.state is SpillState.IDLE:
            effects += self._dispatch_next()
        return effects

    def _on_write_result(self, msg: WriteResult) -> list[SpillEffect]:
        item = self._items.finish(msg.item_id)
        if item is None:
            in_flight = self._items.in_flight.item_id if self._items.in_flight is not None else None
            raise IllegalTransition(
                f"WriteResult for item {msg.item_id}, which is not in flight "
                f"(state {self.state.name}, in flight: {in_flight})"
            )
        self._counts[msg.outcome] += 1
        effects: list[SpillEffect] = [
            Release(item_id=item.item_id),
            Settled(item_id=item.item_id, outcome=msg.outcome),
            JournalEvent(
                event=SpillSettled(item_id=item.item_id, bytes=item.bytes, spill_kind=item.kind, outcome=msg.outcome)
            ),
        ]
        if self._items:
            return effects + self._dispatch_next()
        self._move(SpillState.IDLE)
        return effects + self._wake_all()

    def _on_shutdown(self) -> list[SpillEffect]:
        effects: list[SpillEffect] = []
        in_flight = self._items.take_in_flight()
        if in_flight is not None:
            # The shell cancelled the write; whether it reached the disk is unknown.
            effects += self._drop(in_flight, "shutdown")
        for oldest in self._items.clear():
            self._queued_bytes -= oldest.bytes
            effects += self._drop(oldest, "shutdown")
        self._move(SpillState.CLOSED)
        return effects + self._wake_all()

    def _dispatch_next(self) -> list[SpillEffect]:
        item = self._items.start_oldest()
        self._queued_bytes -= item.bytes
        self._move(SpillState.WRITING)
        return [
            JournalEvent(event=SpillDispatched(item_id=item.item_id, bytes=item.bytes, spill_kind=item.kind)),
            Dispatch(item_id=item.item_id),
        ]

    def _drop(self, item: Enqueue, reason: str) -> list[SpillEffect]:
        self._counts["dropped"] += 1
        return [
            Release(item_id=item.item_id),
            Settled(item_id=item.item_id, outcome="dropped"),
            JournalEvent(
                event=SpillDropped(item_id=item.item_id, bytes=item.bytes, spill_kind=item.kind, reason=reason)
            ),
        ]

    def _wake_all(self) -> list[SpillEffect]:
        return [Wake(waiter_id=w) for w in self._items.take_waiters()]

    def _in_flight_bytes(self) -> int:
        return self._items.in_flight.bytes if self._items.in_flight is not None else 0


Writer = Callable[[SpillSnapshot], Awaitable[str]]


class SpillQueue:
    """The Trio shell. Start it with `await nursery.start(queue.run)`; stop it
    by cancelling that nursery or with `close()`. On stop every snapshot still
    held (queued, in flight, or not yet seen by the core) is released and its
    submitter gets "dropped".

    `write(snapshot)` is the SSD writer: it returns "stored" or "failed"; if it
    raises (or returns anything else) the item is "failed" and the error is
    logged. Call the methods from the Trio thread only.
    """

    def __init__(
        self, write: Writer, *, bytes_max: int | None = None, journal: Journal | None = None, name: str = "spill_queue"
    ) -> None:
        self.core = SpillQueueCore(bytes_max_from_env() if bytes_max is None else bytes_max)
        self._write = write
        self._shell = ActorShell(name, self.core, self._perform, journal=journal)
        self._snapshots: dict[int, SpillSnapshot] = {}
        # Each submitter's outcome, by item id, and each `wait_idle` caller's wake-up, by waiter id.
        self._outcomes: dict[int, Reply[str]] = {}
        self._idle_waiters: dict[int, Reply[None]] = {}
        self._item_ids = itertools.count(1)
        self._waiter_ids = itertools.count(1)
        self._closed = False

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled or `close()`d; a queue runs once."""
        try:
            if not self._closed:
                await self._shell.run(task_status=task_status)
            else:
                task_status.started()
        finally:
            self._closed = True
            self._shell.close()
            with trio.CancelScope(shield=True):
                await self._release_all()

    def close(self) -> None:
        """Stop serving: held snapshots are released and settle "dropped"."""
        self._closed = True
        self._shell.cancel()

    def submit_nowait(self, snapshot: SpillSnapshot) -> int:
        """Hand a snapshot over without waiting; returns its item id. Raises
        `UsageError` (the caller's fault) only before taking ownership, for a
        snapshot whose `reason` is not a spill kind or whose `bytes` < 0;
        once accepted it never raises."""
        item_id, _ = self._accept(snapshot)
        return item_id

    async def submit(self, snapshot: SpillSnapshot) -> str:
        """Hand a snapshot over and wait for its outcome: "stored", "dropped"
        or "failed". Cancelling the wait does not withdraw the snapshot."""
        _, settled = self._accept(snapshot)
        del snapshot  # a waiting submitter must not pin the snapshot past its Release
        return await settled.wait()

    async def wait_idle(self) -> None:
        """Return once nothing is queued or in flight (at once when stopped)."""
        if self._closed:
            return
        waiter_id = next(self._waiter_ids)
        idle = self._idle_waiters[waiter_id] = Reply[None]()
        self._shell.send_nowait(AwaitIdle(waiter_id=waiter_id))
        await idle.wait()

    def stats(self) -> dict[str, int]:
        """The core's counters plus `held`, the snapshots this shell still holds."""
        return {**self.core.stats(), "held": len(self._snapshots)}

    def _accept(self, snapshot: SpillSnapshot) -> tuple[int, Reply[str]]:
        try:
            msg = Enqueue(item_id=next(self._item_ids), bytes=snapshot.bytes, kind=snapshot.reason)
        except (ValueError, TypeError) as e:
            raise UsageError(f"cannot spill snapshot (reason {snapshot.reason!r}, bytes {snapshot.bytes}): {e}") from e
        settled = Reply[str]()
        if not self._closed:
            self._snapshots[msg.item_id], self._outcomes[msg.item_id] = snapshot, settled
            try:
                self._shell.send_nowait(msg)
                return msg.item_id, settled
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                del self._snapshots[msg.item_id], self._outcomes[msg.item_id]
        # The queue has stopped: never seen by the core (nor in its counters), dropped at once.
        log.debug("spill item %d submitted after the queue stopped: dropped", msg.item_id)
        settled.set("dropped")
        return msg.item_id, settled

    def _perform(self, effect: Dispatch | Release | Settled | Wake) -> None:
        # All synchronous, so one message's effects run without a checkpoint.
        match effect:
            case Dispatch():
                self._shell.start_soon(self._write_one, effect.item_id)
            case Release():
                self._snapshots.pop(effect.item_id, None)
            case Settled():
                settled = self._outcomes.pop(effect.item_id, None)
                if settled is not None:
                    settled.set(effect.outcome)
            case Wake():
                idle = self._idle_waiters.pop(effect.waiter_id, None)
                if idle is not None:
                    idle.set(None)
            case _:
                assert_never(effect)

    async def _write_one(self, item_id: int) -> None:
        snapshot = self._snapshots[item_id]
        try:
            outcome = await self._write(snapshot)
        except Exception as e:
            # The traceback goes out as text: a LogRecord holding exc_info would
            # pin the snapshot (through the writer's frame) while a handler kept it.
            log.error(
                "spill write of item %d (%s, %d bytes) failed:\n%s",
                item_id,
                snapshot.reason,
                snapshot.bytes,
                "".join(traceback.format_exception(e)).rstrip(),
            )
            outcome = "failed"
        else:
            if outcome not in WRITE_OUTCOMES:
                log.error("spill writer returned %r for item %d; counting it as failed", outcome, item_id)
                outcome = "failed"
        # This task must not outlive the snapshot's Release with a reference.
        del snapshot
        self._shell.send_nowait(WriteResult(item_id=item_id, outcome=outcome))

    async def _release_all(self) -> None:
        await self._shell.deliver(Shutdown())
        # Snapshots whose Enqueue was still in the channel: the closed core
        # drops them, so the counters include them too.
        for item_id, snapshot in list(self._snapshots.items()):
            await self._shell.deliver(Enqueue(item_id=item_id, bytes=snapshot.bytes, kind=snapshot.reason))
        for idle in self._idle_waiters.values():
            idle.set(None)
        self._idle_waiters.clear()
