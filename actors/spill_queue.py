"""SpillQueue (spec §5.5): one serial, byte-capped queue for eviction spills,
idle demotions and write-behind snapshots.

Every queued snapshot pins its entry's (GPU) buffers until the SSD writer gets
to it, so the queue is bounded in bytes: over `bytes_max` the *oldest* item
that is not in flight is dropped and its snapshot released at once. The item
just enqueued is never its own victim (a soft cap), so `bytes_max=0` keeps
only the newest queued item plus the one in flight. A dropped spill is a
future cache miss, never a wrong result. Every item settles exactly once
("stored", "failed" or "dropped") with exactly one `Release`.

`SpillQueueCore` (`actors/spill_queue_core.py`: the one queue core with the
spill policy) is the sans-IO core (design §3); `SpillQueue` is its Trio
shell, which holds the snapshots by item id, runs the writes one at a time
and drops its reference to a snapshot whenever the core says `Release`.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import traceback
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol, assert_never

import trio

from kvcellar.actors.runtime import ActorShell, Journal, Reply
from kvcellar.actors.spill_queue_core import (
    WRITE_OUTCOMES,
    AwaitIdle,
    Dispatch,
    Enqueue,
    Release,
    Settled,
    Shutdown,
    SpillQueueCore,
    Wake,
    WriteResult,
)
from kvcellar.errors import UsageError
from kvcellar.store.prompt_cache import SpillSnapshot

log = logging.getLogger("kvcellar.actors.spill_queue")

SPILL_QUEUE_ENV_VAR = "KVCELLAR_SSD_SPILL_QUEUE_GB"
GIB = 2**30
# "GB" in the variable's name is read as GiB, so the default is exactly 2 GiB.
BYTES_MAX_DEFAULT = 2 * GIB


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


Writer = Callable[[SpillSnapshot], Awaitable[str]]
# What `submit` answers for a snapshot admission refused (never queued, never counted).
REFUSED = "refused"


class SpillAdmission(Protocol):
    """SSD write admission as the spill queue's entrance sees it (`AdmissionGate`)."""

    def admits(self, snapshot: SpillSnapshot, *, forced: bool, covered: bool = False) -> bool: ...


def _never_covered() -> bool:
    return False


class SpillQueue:
    """The Trio shell. Start it with `await nursery.start(queue.run)`; stop it
    by cancelling that nursery or with `close()`. On stop every snapshot still
    held (queued, in flight, or not yet seen by the core) is released and its
    submitter gets "dropped".

    `write(snapshot)` is the SSD writer: it returns "stored" or "failed"; if it
    raises (or returns anything else) the item is "failed" and the error is
    logged. Call the methods from the Trio thread only.

    `submit` and `submit_nowait` are the one way in, for spills leaving RAM
    and write-behind snapshots alike, and `admission` (SSD write admission;
    None admits everything without looking) is asked once there.
    """

    def __init__(
        self,
        write: Writer,
        *,
        bytes_max: int | None = None,
        journal: Journal | None = None,
        name: str = "spill_queue",
        admission: SpillAdmission | None = None,
    ) -> None:
        self.core = SpillQueueCore(bytes_max_from_env() if bytes_max is None else bytes_max)
        self._write = write
        self._admission = admission
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

    def submit_nowait(
        self, snapshot: SpillSnapshot, *, forced: bool = False, covered: Callable[[], bool] = _never_covered
    ) -> int | None:
        """Hand a snapshot over without waiting; returns its item id, or None
        when admission refused it (it leaves unwritten with this frame).
        `forced`: a flush's write, always admitted; `covered()`, asked only
        when admission looks, says whether the SSD tier already serves it.
        Raises `UsageError` (the caller's fault) only before taking
        ownership, for a snapshot whose `reason` is not a spill kind or whose
        `bytes` < 0; once accepted it never raises."""
        if not self._admits(snapshot, forced=forced, covered=covered):
            return None
        item_id, _ = self._accept(snapshot)
        return item_id

    async def submit(self, snapshot: SpillSnapshot, *, forced: bool = False) -> str:
        """Hand a snapshot over and wait for its outcome: "stored", "dropped"
        or "failed"; `REFUSED` at once when admission refused it. Cancelling
        the wait does not withdraw the snapshot."""
        if not self._admits(snapshot, forced=forced, covered=_never_covered):
            return REFUSED
        _, settled = self._accept(snapshot)
        del snapshot  # a waiting submitter must not pin the snapshot past its Release
        return await settled.wait()

    def _admits(self, snapshot: SpillSnapshot, *, forced: bool, covered: Callable[[], bool]) -> bool:
        """The entrance's one admission check."""
        if self._admission is None:
            return True
        return self._admission.admits(snapshot, forced=forced, covered=covered())

    async def wait_idle(self) -> None:
        """Return once nothing is queued or in flight (at once when stopped)."""
        if self._closed:
            return
        waiter_id = next(self._waiter_ids)
        idle = self._idle_waiters[waiter_id] = Reply[None]()
        self._shell.send_nowait(AwaitIdle(waiter_id=waiter_id))
        await idle.wait()

    def holds_snapshots_before(self, wipe_epoch: int) -> int:
        """How many snapshots this queue still holds (queued or being written) that were taken
        before the RAM tier's wipe epoch `wipe_epoch`: a wipe keeps its intent until none is left."""
        return sum(1 for snapshot in self._snapshots.values() if snapshot.wipe_epoch < wipe_epoch)

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
