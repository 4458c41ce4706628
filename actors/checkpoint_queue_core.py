"""The checkpoint writer's core (spec §5.7): the one queue core
(`actors/queue_core.py`) with the checkpoint queue's policy.

A new snapshot of a request replaces its queued older one (only the newest
is worth writing); over the cap the oldest queued snapshot is dropped, never
the one just queued nor the one in flight. A completed request's
`Invalidate` drops its queued snapshots and queues a removal behind anything
in flight, so an in-flight write of that attempt is renamed before its file
is removed. Removals are not writes: never dropped, never counted against
the cap, and ignored once the queue is closed.

Pure: attrs, the messages and `errors` (through the queue core); the Trio
shell is `actors/checkpoint_writer.py`.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvcellar.actors.effects import JournalEvent
from kvcellar.actors.queue_core import AwaitIdle, QueueCore, QueueState, Shutdown, Wake, write_items
from kvcellar.store.actor_events import CheckpointNotWritten

__all__ = [
    "OP_OUTCOMES",
    "AwaitIdle",
    "CheckpointEffect",
    "CheckpointMessage",
    "CheckpointQueueCore",
    "Enqueue",
    "Invalidate",
    "OpDone",
    "QueueState",
    "Release",
    "RemoveCheckpoint",
    "Shutdown",
    "Wake",
    "WriteCheckpoint",
]


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


CheckpointMessage = Enqueue | Invalidate | OpDone | AwaitIdle | Shutdown


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


CheckpointEffect = WriteCheckpoint | RemoveCheckpoint | Release | Wake | JournalEvent
Op = Enqueue | Invalidate


def _not_written(op: Enqueue, reason: str, detail: str = "") -> list[Any]:
    event = CheckpointNotWritten(
        request_key=op.request_key, attempt=op.attempt, emitted_tokens=op.emitted_tokens, reason=reason, detail=detail
    )
    return [JournalEvent(event=event)]


@attrs.frozen
class CheckpointPolicy:
    """The checkpoint queue's part of the queue core (see the module doc)."""

    name: str = "the checkpoint queue"
    item_types: tuple[type, ...] = (Enqueue, Invalidate)
    done_type: type = OpDone
    closed_reason: str = "shutdown"

    def item_id(self, item: Op) -> int:
        return item.op_id

    def done_id(self, done: OpDone) -> int:
        return done.op_id

    def is_write(self, item: Op) -> bool:
        return isinstance(item, Enqueue)

    def write_bytes(self, item: Op) -> int:
        return item.bytes if isinstance(item, Enqueue) else 0

    def replaced_by(self, new: Op, queued: Op) -> str | None:
        if queued.request_key != new.request_key or queued.attempt > new.attempt:
            return None
        return "superseded" if isinstance(new, Enqueue) else "invalidated"

    def accepted(self, item: Op) -> list[Any]:
        return []

    def dispatched(self, item: Op) -> list[Any]:
        if isinstance(item, Enqueue):
            return [WriteCheckpoint(op_id=item.op_id)]
        return [RemoveCheckpoint(op_id=item.op_id, request_key=item.request_key, attempt=item.attempt)]

    def settled(self, item: Op, done: OpDone) -> tuple[str, list[Any]]:
        if not isinstance(item, Enqueue):
            return "removals", []
        failed = _not_written(item, "failed", done.detail) if done.outcome == "failed" else []
        return done.outcome, [Release(op_id=item.op_id), *failed]

    def dropped(self, item: Op, reason: str) -> list[Any]:
        assert isinstance(item, Enqueue), "only writes are dropped"
        return [Release(op_id=item.op_id), *_not_written(item, reason)]

    def not_in_flight(self, done: OpDone, state: QueueState, in_flight: int | None) -> str:
        return f"OpDone for {done.op_id}, which is not in flight (state {state.name})"

    def already_held(self, item: Op, state: QueueState) -> str:
        return f"operation {item.op_id} is already held by the checkpoint queue"


CHECKPOINT_POLICY = CheckpointPolicy()


class CheckpointQueueCore(QueueCore[Op, OpDone]):
    """The queue core with the checkpoint queue's policy (see the module doc)."""

    def __init__(self, bytes_max: int) -> None:
        super().__init__(CHECKPOINT_POLICY, bytes_max)

    def stats(self) -> dict[str, int]:
        writes = list(write_items(self))
        removals = [op for op in (*self.queued(), self.in_flight) if isinstance(op, Invalidate)]
        return {
            "pending": len(writes),
            "pending_bytes": sum(op.bytes for op in writes),
            "pending_removals": len(removals),
            "queue_bytes_max": self.bytes_max,
            **{name: self.counts[name] for name in ("enqueued", "stored", "stale", "failed", "dropped", "removals")},
        }
