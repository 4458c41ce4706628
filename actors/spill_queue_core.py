"""The spill queue's core (spec §5.5): the one queue core
(`actors/queue_core.py`) with the spill queue's policy.

Every queued snapshot pins its entry's (GPU) buffers until the SSD writer gets
to it, so the queue is bounded in bytes: over `bytes_max` the *oldest* item
that is not in flight is dropped and its snapshot released at once. The item
just enqueued is never its own victim (a soft cap), so `bytes_max=0` keeps
only the newest queued item plus the one in flight. A dropped spill is a
future cache miss, never a wrong result. Every item settles exactly once
("stored", "failed" or "dropped") with exactly one `Release`.

Pure: attrs, the messages and `errors` (through the queue core); the Trio
shell is `actors/spill_queue.py`.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvcellar.actors.effects import JournalEvent
from kvcellar.actors.queue_core import AwaitIdle, QueueCore, QueueState, Shutdown, Wake
from kvcellar.store.actor_events import SpillDispatched, SpillDropped, SpillEnqueued, SpillSettled

__all__ = [
    "KINDS",
    "OUTCOMES",
    "WRITE_OUTCOMES",
    "AwaitIdle",
    "Dispatch",
    "Enqueue",
    "QueueState",
    "Release",
    "Settled",
    "Shutdown",
    "SpillEffect",
    "SpillMessage",
    "SpillQueueCore",
    "Wake",
    "WriteResult",
]

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


SpillEffect = Dispatch | Release | Settled | Wake | JournalEvent


@attrs.frozen
class SpillPolicy:
    """The spill queue's part of the queue core: every item is a write, none
    replaces another, and each settle and drop releases and answers."""

    name: str = "the spill queue"
    item_types: tuple[type, ...] = (Enqueue,)
    done_type: type = WriteResult
    closed_reason: str = "closed"

    def item_id(self, item: Enqueue) -> int:
        return item.item_id

    def done_id(self, done: WriteResult) -> int:
        return done.item_id

    def is_write(self, item: Enqueue) -> bool:
        return True

    def write_bytes(self, item: Enqueue) -> int:
        return item.bytes

    def replaced_by(self, new: Enqueue, queued: Enqueue) -> str | None:
        return None

    def accepted(self, item: Enqueue) -> list[Any]:
        return [JournalEvent(event=SpillEnqueued(item_id=item.item_id, bytes=item.bytes, spill_kind=item.kind))]

    def dispatched(self, item: Enqueue) -> list[Any]:
        return [
            JournalEvent(event=SpillDispatched(item_id=item.item_id, bytes=item.bytes, spill_kind=item.kind)),
            Dispatch(item_id=item.item_id),
        ]

    def settled(self, item: Enqueue, done: WriteResult) -> tuple[str, list[Any]]:
        event = SpillSettled(item_id=item.item_id, bytes=item.bytes, spill_kind=item.kind, outcome=done.outcome)
        return done.outcome, [
            Release(item_id=item.item_id),
            Settled(item_id=item.item_id, outcome=done.outcome),
            JournalEvent(event=event),
        ]

    def dropped(self, item: Enqueue, reason: str) -> list[Any]:
        return [
            Release(item_id=item.item_id),
            Settled(item_id=item.item_id, outcome="dropped"),
            JournalEvent(
                event=SpillDropped(item_id=item.item_id, bytes=item.bytes, spill_kind=item.kind, reason=reason)
            ),
        ]

    def not_in_flight(self, done: WriteResult, state: QueueState, in_flight: int | None) -> str:
        return (
            f"WriteResult for item {done.item_id}, which is not in flight (state {state.name}, in flight: {in_flight})"
        )

    def already_held(self, item: Enqueue, state: QueueState) -> str:
        return f"item {item.item_id} is already held by the spill queue (state {state.name})"


SPILL_POLICY = SpillPolicy()


class SpillQueueCore(QueueCore[Enqueue, WriteResult]):
    """The queue core with the spill queue's policy. `handle` raises
    `IllegalTransition` for a `WriteResult` that is not for the in-flight
    item, or an `Enqueue` of an id already held: a protocol bug between the
    shell, the writer and the producers (kvcellar's fault). The core is
    unchanged when it raises."""

    def __init__(self, bytes_max: int) -> None:
        super().__init__(SPILL_POLICY, bytes_max)

    def stats(self) -> dict[str, int]:
        """Counters: `pending` items (queued + in flight) and their bytes,
        `queued`, `in_flight`, and the totals `enqueued`, `stored`, `failed`,
        `dropped` (enqueued == stored + failed + dropped + pending)."""
        in_flight = int(self.in_flight is not None)
        queued = len(self.items)
        return {
            "pending": queued + in_flight,
            "pending_bytes": self.queued_write_bytes + self.in_flight_write_bytes(),
            "queued": queued,
            "in_flight": in_flight,
            **{name: self.counts[name] for name in ("enqueued", "stored", "failed", "dropped")},
            "bytes_max": self.bytes_max,
        }
