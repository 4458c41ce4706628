"""The one queue core: a byte-capped FIFO that runs one item at a time, the
sans-IO core of both the spill queue (`actors/spill_queue_core.py`) and the
checkpoint writer (`actors/checkpoint_queue_core.py`).

`QueueCore` owns the states (IDLE, BUSY, CLOSED), the one transition table,
the guards and the bookkeeping: enqueue, the byte cap, dispatch, settle,
shutdown, idle waiters. A `QueuePolicy` says what is particular to each
queue and decides nothing about states: which queued items a new one
replaces, which items are writes (counted against the cap, droppable) and
which are not (a checkpoint removal), and the effects and counter names of
each step. The item just enqueued is never a victim of the cap (a soft cap),
nor is the item in flight.

Pure: it imports attrs, the messages and `errors`, never Trio or MLX.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any, Generic, Protocol, TypeVar

import attrs

from kvcellar.actors.one_in_flight import OneInFlight
from kvcellar.actors.transitions import TransitionTable, rows
from kvcellar.errors import IllegalTransition, UsageError

Item = TypeVar("Item")
Done = TypeVar("Done")
ItemIn = TypeVar("ItemIn", contravariant=True)
DoneIn = TypeVar("DoneIn", contravariant=True)


class QueueState(enum.Enum):
    IDLE = "idle"
    BUSY = "busy"  # one item in flight
    CLOSED = "closed"


@attrs.frozen(kw_only=True)
class AwaitIdle:
    """Answer `Wake(waiter_id)` once nothing is queued or in flight."""

    waiter_id: int


@attrs.frozen(kw_only=True)
class Shutdown:
    """The shell is stopping: drop everything held; later writes drop at once."""


@attrs.frozen(kw_only=True)
class Wake:
    """The answer to `AwaitIdle`: the queue is idle."""

    waiter_id: int


class QueuePolicy(Protocol[ItemIn, DoneIn]):
    """What is particular to one queue. Every method is a pure read: the core
    changes its state only after the policy answered."""

    @property
    def name(self) -> str:
        """The queue in errors: "the spill queue"."""
        ...

    @property
    def item_types(self) -> tuple[type, ...]:
        """The messages that enqueue an item."""
        ...

    @property
    def done_type(self) -> type:
        """The message that settles the item in flight."""
        ...

    @property
    def closed_reason(self) -> str:
        """The drop reason of a write enqueued after the shutdown."""
        ...

    def item_id(self, item: ItemIn) -> int: ...

    def done_id(self, done: DoneIn) -> int: ...

    def is_write(self, item: ItemIn) -> bool:
        """Counted against the cap, in `enqueued`, and droppable."""
        ...

    def write_bytes(self, item: ItemIn) -> int: ...

    def replaced_by(self, new: ItemIn, queued: ItemIn) -> str | None:
        """Why `new` drops the queued write `queued` (a reason), or None."""
        ...

    def accepted(self, item: ItemIn) -> list[Any]: ...

    def dispatched(self, item: ItemIn) -> list[Any]: ...

    def settled(self, item: ItemIn, done: DoneIn) -> tuple[str, list[Any]]:
        """The counter the settle adds to, and its effects."""
        ...

    def dropped(self, item: ItemIn, reason: str) -> list[Any]: ...

    def not_in_flight(self, done: DoneIn, state: QueueState, in_flight: int | None) -> str:
        """The error for a settle of an item that is not in flight."""
        ...

    def already_held(self, item: ItemIn, state: QueueState) -> str: ...


class QueueCore(Generic[Item, Done]):
    """A FIFO of items, at most one in flight (see the module doc). `handle`
    raises `IllegalTransition` for a message the state does not take, a
    settle of an item not in flight, or an enqueue of an id already held; the
    core is unchanged when it raises."""

    def __init__(self, policy: QueuePolicy[Item, Done], bytes_max: int) -> None:
        if bytes_max < 0:
            raise UsageError(f"{policy.name}'s bytes_max must be >= 0, got {bytes_max}")
        self.policy = policy
        self.bytes_max = bytes_max
        self.state = QueueState.IDLE
        self.items: OneInFlight[Item] = OneInFlight(policy.item_id)
        self.queued_write_bytes = 0
        self.counts: Counter[str] = Counter()
        self._table = _table_for(policy)

    def handle(self, msg: Any, now: float) -> list[Any]:
        return self._table.fire(self, msg, now)

    def queued(self) -> Iterator[Item]:
        return self.items.queued()

    @property
    def in_flight(self) -> Item | None:
        return self.items.in_flight

    def in_flight_write_bytes(self) -> int:
        in_flight = self.items.in_flight
        return self.policy.write_bytes(in_flight) if in_flight is not None and self.policy.is_write(in_flight) else 0

    # -- handlers: (core, message, now) -> (next state, effects) ----------------

    def _on_item(self, item: Item, now: float) -> tuple[QueueState, list[Any]]:
        policy = self.policy
        if self.items.holds(policy.item_id(item)):
            raise IllegalTransition(policy.already_held(item, self.state))
        write = policy.is_write(item)
        self.counts["enqueued"] += write
        if self.state is QueueState.CLOSED:
            # A producer racing the shutdown: a write is accepted and dropped at once.
            return self.state, self._drop(item, policy.closed_reason) if write else []
        effects: list[Any] = []
        for queued in [queued for queued in self.items.queued() if policy.is_write(queued)]:
            reason = policy.replaced_by(item, queued)
            if reason is not None:
                self._remove(queued)
                effects += self._drop(queued, reason)
        self.items.append(item)
        self.queued_write_bytes += policy.write_bytes(item) if write else 0
        effects += policy.accepted(item)
        while write and self.queued_write_bytes + self.in_flight_write_bytes() > self.bytes_max:
            oldest = next((q for q in self.items.queued() if policy.is_write(q) and q is not item), None)
            if oldest is None:
                break
            self._remove(oldest)
            effects += self._drop(oldest, "byte_cap")
        if self.state is QueueState.IDLE:
            return self._dispatch_next(effects)
        return self.state, effects

    def _on_done(self, done: Done, now: float) -> tuple[QueueState, list[Any]]:
        in_flight = self.items.in_flight
        item = self.items.finish(self.policy.done_id(done))
        if item is None:
            in_flight_id = self.policy.item_id(in_flight) if in_flight is not None else None
            raise IllegalTransition(self.policy.not_in_flight(done, self.state, in_flight_id))
        counter, effects = self.policy.settled(item, done)
        self.counts[counter] += 1
        if len(self.items):
            return self._dispatch_next(effects)
        return QueueState.IDLE, effects + self._wake_all()

    def _on_await_idle(self, msg: AwaitIdle, now: float) -> tuple[QueueState, list[Any]]:
        if self.state is QueueState.BUSY:
            self.items.add_waiter(msg.waiter_id)
            return self.state, []
        return self.state, [Wake(waiter_id=msg.waiter_id)]

    def _on_shutdown(self, msg: Shutdown, now: float) -> tuple[QueueState, list[Any]]:
        effects: list[Any] = []
        in_flight = self.items.take_in_flight()
        if in_flight is not None and self.policy.is_write(in_flight):
            # The shell cancelled the write; whether it reached the disk is unknown.
            effects += self._drop(in_flight, "shutdown")
        for queued in self.items.clear():
            if self.policy.is_write(queued):
                self.queued_write_bytes -= self.policy.write_bytes(queued)
                effects += self._drop(queued, "shutdown")
        return QueueState.CLOSED, effects + self._wake_all()

    # -- steps -----------------------------------------------------------------

    def _dispatch_next(self, effects: list[Any]) -> tuple[QueueState, list[Any]]:
        item = self.items.start_oldest()
        if self.policy.is_write(item):
            self.queued_write_bytes -= self.policy.write_bytes(item)
        return QueueState.BUSY, effects + self.policy.dispatched(item)

    def _remove(self, item: Item) -> None:
        self.items.remove(item)
        self.queued_write_bytes -= self.policy.write_bytes(item)

    def _drop(self, item: Item, reason: str) -> list[Any]:
        self.counts["dropped"] += 1
        return self.policy.dropped(item, reason)

    def _wake_all(self) -> list[Any]:
        return [Wake(waiter_id=w) for w in self.items.take_waiters()]


def _table_for(policy: QueuePolicy[Any, Any]) -> TransitionTable[QueueState]:
    """The queue's table; the item and settle message types are the policy's."""
    every = list(QueueState)
    return TransitionTable(
        policy.name,
        {
            **rows([QueueState.IDLE, QueueState.BUSY], policy.item_types, QueueCore._on_item, to={QueueState.BUSY}),
            **rows([QueueState.CLOSED], policy.item_types, QueueCore._on_item),
            **rows([QueueState.BUSY], [policy.done_type], QueueCore._on_done, to={QueueState.BUSY, QueueState.IDLE}),
            **rows(every, [AwaitIdle], QueueCore._on_await_idle),
            **rows(every, [Shutdown], QueueCore._on_shutdown, to={QueueState.CLOSED}),
        },
    )


def write_items(core: QueueCore[Any, Any]) -> Iterable[Any]:
    """The writes queued or in flight (stats)."""
    in_flight = core.in_flight
    queued = [item for item in core.queued() if core.policy.is_write(item)]
    return queued + ([in_flight] if in_flight is not None and core.policy.is_write(in_flight) else [])
