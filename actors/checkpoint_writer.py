"""The checkpoint writer (spec §5.7): persists in-flight generation
checkpoints, one operation at a time, and removes completed ones.

A checkpoint reaches it as a `CheckpointSnapshot` the engine thread made at a
boundary: the writer planned and every tensor materialised into byte
segments there (bounded MLX work once per interval), so what is left is disk
work that never needs the engine. It runs on a worker thread while decoding
goes on: the idle gate the prompt entries' writes take would not open until
the generation ends, which is exactly what a checkpoint must not wait for.

The queue has its own byte cap, its share of the spill queue's budget (the
system splits it when checkpoints are on), and its own policy, which no
prefix-entry admission policy touches: a new snapshot of a request replaces
its queued older one (only the newest is worth writing); over the cap the
oldest queued snapshot is dropped, never the one just queued nor the one in
flight. A completed request's `Invalidate` drops its queued snapshots and
queues a removal behind anything in flight, so an in-flight write of that
attempt is renamed before its file is removed, and a removal never erases a
newer attempt (`CheckpointStore.remove`). Removals are never dropped.

`CheckpointQueueCore` is the sans-IO core; `CheckpointWriter` its Trio shell.
"""

from __future__ import annotations

import enum
import itertools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, assert_never

import attrs
import trio

from kvcellar.actors.one_in_flight import OneInFlight
from kvcellar.actors.runtime import ActorShell, JournalEvent, Reply
from kvcellar.errors import DiskError, IllegalTransition
from kvcellar.store.actor_events import CheckpointNotWritten
from kvcellar.store.checkpoints import CheckpointSnapshot, CheckpointStore

log = logging.getLogger("kvcellar.checkpoint_writer")

# The share of the spill queue's byte budget checkpoints get when they are on.
SPILL_QUEUE_SHARE = 0.25


# -- messages ---------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Enqueue:
    op_id: int
    request_key: str
    attempt: int
    emitted_tokens: int
    bytes: int = attrs.field(validator=attrs.validators.ge(0))


@attrs.frozen(kw_only=True)
class Invalidate:
    op_id: int
    request_key: str
    attempt: int


OP_OUTCOMES = ("stored", "stale", "failed", "removed")


@attrs.frozen(kw_only=True)
class OpDone:
    """`outcome`: stored, stale (its attempt completed meanwhile), failed, removed."""

    op_id: int
    outcome: str = attrs.field(validator=attrs.validators.in_(OP_OUTCOMES))
    detail: str = ""


@attrs.frozen(kw_only=True)
class AwaitIdle:
    waiter_id: int


@attrs.frozen(kw_only=True)
class Shutdown:
    pass


CheckpointMessage = Enqueue | Invalidate | OpDone | AwaitIdle | Shutdown

# -- effects ----------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class WriteCheckpoint:
    op_id: int


@attrs.frozen(kw_only=True)
class RemoveCheckpoint:
    op_id: int
    request_key: str
    attempt: int


@attrs.frozen(kw_only=True)
class Release:
    """Drop every reference to this snapshot now."""

    op_id: int


@attrs.frozen(kw_only=True)
class Wake:
    waiter_id: int


CheckpointEffect = WriteCheckpoint | RemoveCheckpoint | Release | Wake | JournalEvent


class QueueState(enum.Enum):
    IDLE = "idle"
    BUSY = "busy"
    CLOSED = "closed"


_ANY = frozenset(QueueState)
_ACCEPTS = {
    Enqueue: _ANY,
    Invalidate: _ANY,
    OpDone: frozenset({QueueState.BUSY}),
    AwaitIdle: _ANY,
    Shutdown: _ANY,
}
_MOVES = {
    QueueState.IDLE: {QueueState.BUSY, QueueState.CLOSED},
    QueueState.BUSY: {QueueState.BUSY, QueueState.IDLE, QueueState.CLOSED},
    QueueState.CLOSED: {QueueState.CLOSED},
}


class CheckpointQueueCore:
    """A FIFO of writes and removals, one in flight (see the module doc)."""

    def __init__(self, bytes_max: int) -> None:
        self.bytes_max = bytes_max
        self.state = QueueState.IDLE
        self._ops: OneInFlight[Enqueue | Invalidate] = OneInFlight(lambda op: op.op_id)
        self.counts: Counter[str] = Counter()

    def handle(self, msg: CheckpointMessage, now: float) -> list[CheckpointEffect]:
        accepted = _ACCEPTS.get(type(msg))
        if accepted is None or self.state not in accepted:
            raise IllegalTransition(f"the checkpoint queue cannot take {type(msg).__name__} in state {self.state.name}")
        if isinstance(msg, Enqueue | Invalidate) and self._ops.holds(msg.op_id):
            raise IllegalTransition(f"operation {msg.op_id} is already held by the checkpoint queue")
        match msg:
            case Enqueue():
                return self._on_enqueue(msg)
            case Invalidate():
                return self._on_invalidate(msg)
            case OpDone():
                return self._on_done(msg)
            case AwaitIdle():
                if self.state is QueueState.BUSY:
                    self._ops.add_waiter(msg.waiter_id)
                    return []
                return [Wake(waiter_id=msg.waiter_id)]
            case Shutdown():
                return self._on_shutdown()
            case _:
                assert_never(msg)

    def stats(self) -> dict[str, int]:
        writes = [op for op in self._ops.queued() if isinstance(op, Enqueue)]
        in_flight = self._ops.in_flight if isinstance(self._ops.in_flight, Enqueue) else None
        pending = writes + ([in_flight] if in_flight is not None else [])
        return {
            "pending": len(pending),
            "pending_bytes": sum(op.bytes for op in pending),
            "pending_removals": sum(isinstance(op, Invalidate) for op in (*self._ops.queued(), self._ops.in_flight)),
            "queue_bytes_max": self.bytes_max,
            **{name: self.counts[name] for name in ("enqueued", "stored", "stale", "failed", "dropped", "removals")},
        }

    def _move(self, to: QueueState) -> None:
        if to not in _MOVES[self.state]:
            raise IllegalTransition(f"the checkpoint queue cannot move from {self.state.name} to {to.name}")
        self.state = to

    def _on_enqueue(self, msg: Enqueue) -> list[CheckpointEffect]:
        self.counts["enqueued"] += 1
        if self.state is QueueState.CLOSED:
            return self._drop(msg, "shutdown")
        effects: list[CheckpointEffect] = []
        for op in [op for op in self._ops.queued() if isinstance(op, Enqueue)]:
            if op.request_key == msg.request_key and op.attempt <= msg.attempt:
                self._ops.remove(op)
                effects += self._drop(op, "superseded")
        self._ops.append(msg)
        while self._write_bytes() > self.bytes_max:
            oldest = next((op for op in self._ops.queued() if isinstance(op, Enqueue) and op is not msg), None)
            if oldest is None:
                break
            self._ops.remove(oldest)
            effects += self._drop(oldest, "byte_cap")
        return effects + self._dispatch_if_idle()

    def _on_invalidate(self, msg: Invalidate) -> list[CheckpointEffect]:
        if self.state is QueueState.CLOSED:
            return []
        effects: list[CheckpointEffect] = []
        for op in [op for op in self._ops.queued() if isinstance(op, Enqueue)]:
            if op.request_key == msg.request_key and op.attempt <= msg.attempt:
                self._ops.remove(op)
                effects += self._drop(op, "invalidated")
        self._ops.append(msg)
        return effects + self._dispatch_if_idle()

    def _on_done(self, msg: OpDone) -> list[CheckpointEffect]:
        op = self._ops.finish(msg.op_id)
        if op is None:
            raise IllegalTransition(f"OpDone for {msg.op_id}, which is not in flight (state {self.state.name})")
        effects: list[CheckpointEffect] = []
        if isinstance(op, Enqueue):
            effects.append(Release(op_id=op.op_id))
            if msg.outcome == "failed":
                effects += self._not_written(op, "failed", msg.detail)
            self.counts[msg.outcome] += 1
        else:
            self.counts["removals"] += 1
        if self._ops:
            return effects + self._dispatch_next()
        self._move(QueueState.IDLE)
        return effects + self._wake_all()

    def _on_shutdown(self) -> list[CheckpointEffect]:
        effects: list[CheckpointEffect] = []
        in_flight = self._ops.take_in_flight()
        if isinstance(in_flight, Enqueue):
            effects += self._drop(in_flight, "shutdown")
        for op in self._ops.clear():
            if isinstance(op, Enqueue):
                effects += self._drop(op, "shutdown")
        self._move(QueueState.CLOSED)
        return effects + self._wake_all()

    def _dispatch_if_idle(self) -> list[CheckpointEffect]:
        return self._dispatch_next() if self.state is QueueState.IDLE and self._ops else []

    def _dispatch_next(self) -> list[CheckpointEffect]:
        op = self._ops.start_oldest()
        self._move(QueueState.BUSY)
        if isinstance(op, Enqueue):
            return [WriteCheckpoint(op_id=op.op_id)]
        return [RemoveCheckpoint(op_id=op.op_id, request_key=op.request_key, attempt=op.attempt)]

    def _drop(self, op: Enqueue, reason: str) -> list[CheckpointEffect]:
        self.counts["dropped"] += 1
        return [Release(op_id=op.op_id), *self._not_written(op, reason)]

    def _not_written(self, op: Enqueue, reason: str, detail: str = "") -> list[CheckpointEffect]:
        event = CheckpointNotWritten(
            request_key=op.request_key,
            attempt=op.attempt,
            emitted_tokens=op.emitted_tokens,
            reason=reason,
            detail=detail,
        )
        return [JournalEvent(event=event)]

    def _write_bytes(self) -> int:
        queued = sum(op.bytes for op in self._ops.queued() if isinstance(op, Enqueue))
        return queued + (self._ops.in_flight.bytes if isinstance(self._ops.in_flight, Enqueue) else 0)

    def _wake_all(self) -> list[CheckpointEffect]:
        return [Wake(waiter_id=w) for w in self._ops.take_waiters()]


RunBlocking = Callable[..., Awaitable[Any]]


class CheckpointWriter:
    """The Trio shell. Start it with `await nursery.start(writer.run)`. Call
    `submit_nowait`, `invalidate_nowait`, `wait_idle` and `stats` from the
    Trio thread; the file work runs through `run_blocking` (a worker thread;
    inline in the simulator)."""

    def __init__(
        self, store: CheckpointStore, *, bytes_max: int, run_blocking: RunBlocking | None = None, journal: Any = None
    ) -> None:
        self.store = store
        self.core = CheckpointQueueCore(bytes_max)
        self._run_blocking: RunBlocking = run_blocking or trio.to_thread.run_sync
        self._shell = ActorShell("checkpoint_writer", self.core, self._perform, journal=journal)
        self._snapshots: dict[int, CheckpointSnapshot] = {}
        self._idle_waiters: dict[int, Reply[None]] = {}
        self._op_ids = itertools.count(1)
        self._closed = False

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await self._shell.run(task_status=task_status)
        finally:
            self._closed = True
            self._shell.close()
            with trio.CancelScope(shield=True):
                await self._shell.deliver(Shutdown())
            self._snapshots.clear()
            for idle in self._idle_waiters.values():
                idle.set(None)

    def submit_nowait(self, snapshot: CheckpointSnapshot) -> None:
        """Take ownership of a snapshot (dropped at once after shutdown)."""
        if self._closed:
            return
        checkpoint = snapshot.checkpoint
        msg = Enqueue(
            op_id=next(self._op_ids),
            request_key=checkpoint.request_key,
            attempt=checkpoint.attempt,
            emitted_tokens=checkpoint.emitted_tokens,
            bytes=snapshot.bytes,
        )
        self._snapshots[msg.op_id] = snapshot
        if not self._send(msg):
            del self._snapshots[msg.op_id]

    def invalidate_nowait(self, request_key: str, attempt: int) -> None:
        """A completed attempt: drop its queued snapshots, queue its file's removal."""
        if not self._closed:
            self._send(Invalidate(op_id=next(self._op_ids), request_key=request_key, attempt=attempt))

    def _send(self, msg: CheckpointMessage) -> bool:
        # Called from `run_sync_soon`, where an exception would end the whole Trio run.
        try:
            self._shell.send_nowait(msg)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            log.debug("checkpoint %s after the writer stopped: dropped", type(msg).__name__)
            return False
        return True

    async def wait_idle(self) -> None:
        """Return once nothing is queued or in flight (at once when stopped)."""
        if self._closed:
            return
        waiter_id = next(self._op_ids)
        idle = self._idle_waiters[waiter_id] = Reply[None]()
        self._shell.send_nowait(AwaitIdle(waiter_id=waiter_id))
        await idle.wait()

    def stats(self) -> dict[str, int]:
        # `held` counts snapshots whose Enqueue the core has not read yet too.
        return {**self.core.stats(), "held": len(self._snapshots)}

    def _perform(self, effect: WriteCheckpoint | RemoveCheckpoint | Release | Wake) -> None:
        match effect:
            case WriteCheckpoint():
                self._shell.start_soon(self._write_one, effect.op_id)
            case RemoveCheckpoint():
                self._shell.start_soon(self._remove_one, effect)
            case Release():
                self._snapshots.pop(effect.op_id, None)
            case Wake():
                idle = self._idle_waiters.pop(effect.waiter_id, None)
                if idle is not None:
                    idle.set(None)
            case _:
                assert_never(effect)

    async def _write_one(self, op_id: int) -> None:
        snapshot = self._snapshots[op_id]
        try:
            outcome, detail = await self._run_blocking(self._write_file, snapshot)
        except Exception as e:  # a checkpoint that cannot be written never takes the server down
            log.error("checkpoint write of %s failed: %s", snapshot.checkpoint.request_key, e)
            outcome, detail = "failed", str(e)
        del snapshot  # released by the core's Release, not pinned by this task
        self._shell.send_nowait(OpDone(op_id=op_id, outcome=outcome, detail=detail))

    def _write_file(self, snapshot: CheckpointSnapshot) -> tuple[str, str]:
        """Write, fsync, rename, fsync the directory, index (worker thread)."""
        writer = snapshot.writer
        try:
            writer.open()
            for index, segments in enumerate(snapshot.segments):
                writer.write_segments(index, segments)
            writer.commit()
        except Exception as e:
            writer.abort()
            level = logging.WARNING if isinstance(e, DiskError) else logging.ERROR
            log.log(level, "checkpoint of %s not written: %s", snapshot.checkpoint.request_key, e)
            return "failed", str(e)
        return ("stored" if self.store.commit(writer) else "stale"), ""

    async def _remove_one(self, effect: RemoveCheckpoint) -> None:
        try:
            await self._run_blocking(self.store.remove, effect.request_key, effect.attempt)
        except Exception as e:
            log.error("removing the checkpoint of %s failed: %s", effect.request_key, e)
        self._shell.send_nowait(OpDone(op_id=effect.op_id, outcome="removed"))
