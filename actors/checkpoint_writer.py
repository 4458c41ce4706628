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

`CheckpointQueueCore` (`actors/checkpoint_queue_core.py`: the one queue core
with the checkpoint policy) is the sans-IO core; `CheckpointWriter` its Trio
shell.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, assert_never

import trio

from kvcellar.actors.checkpoint_queue_core import (
    AwaitIdle,
    CheckpointMessage,
    CheckpointQueueCore,
    Enqueue,
    Invalidate,
    OpDone,
    Release,
    RemoveCheckpoint,
    Shutdown,
    Wake,
    WriteCheckpoint,
)
from kvcellar.actors.runtime import ActorShell, Reply
from kvcellar.errors import DiskError
from kvcellar.store.checkpoints import CheckpointSnapshot, CheckpointStore

log = logging.getLogger("kvcellar.checkpoint_writer")

# The share of the spill queue's byte budget checkpoints get when they are on.
SPILL_QUEUE_SHARE = 0.25


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
