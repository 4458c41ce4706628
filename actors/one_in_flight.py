"""The bookkeeping of a FIFO that runs one item at a time, shared by the
spill queue's core and the checkpoint writer's core.

`OneInFlight` holds the queued items in arrival order by id, the one in
flight, and the ids of the waiters for the queue to go idle. It decides
nothing: each core keeps its own states, transition table, drop policy and
effects, and asks this class only to hold, pop and hand back.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

Item = TypeVar("Item")


class OneInFlight(Generic[Item]):
    """Queued items by id (oldest first), at most one in flight, idle waiters."""

    def __init__(self, item_id: Callable[[Item], int]) -> None:
        self._item_id = item_id
        self._queued: OrderedDict[int, Item] = OrderedDict()
        self.in_flight: Item | None = None
        self._waiters: list[int] = []

    def __len__(self) -> int:
        """How many items are queued (not counting the one in flight)."""
        return len(self._queued)

    def queued(self) -> Iterator[Item]:
        """The queued items, oldest first."""
        return iter(self._queued.values())

    def holds(self, item_id: int) -> bool:
        """Whether an item of this id is queued or in flight."""
        return item_id in self._queued or (self.in_flight is not None and self._item_id(self.in_flight) == item_id)

    def append(self, item: Item) -> None:
        self._queued[self._item_id(item)] = item

    def remove(self, item: Item) -> None:
        del self._queued[self._item_id(item)]

    def pop_oldest(self) -> Item:
        _, item = self._queued.popitem(last=False)
        return item

    def start_oldest(self) -> Item:
        """Put the oldest queued item in flight and return it."""
        self.in_flight = self.pop_oldest()
        return self.in_flight

    def finish(self, item_id: int) -> Item | None:
        """Take the in-flight item off, when it has this id; None (and nothing
        changed) when another item or none is in flight."""
        item = self.in_flight
        if item is None or self._item_id(item) != item_id:
            return None
        self.in_flight = None
        return item

    def take_in_flight(self) -> Item | None:
        """Take the in-flight item off, whatever it is (a shutdown); None when none is."""
        item, self.in_flight = self.in_flight, None
        return item

    def clear(self) -> list[Item]:
        """Empty the queue; returns what was queued, oldest first (the in-flight item stays)."""
        items = list(self._queued.values())
        self._queued.clear()
        return items

    def add_waiter(self, waiter_id: int) -> None:
        self._waiters.append(waiter_id)

    def take_waiters(self) -> list[int]:
        """The waiters, in arrival order; none are left."""
        waiters, self._waiters = self._waiters, []
        return waiters
