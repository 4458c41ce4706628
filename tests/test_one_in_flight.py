"""The one-in-flight FIFO's bookkeeping shared by the spill queue's and the checkpoint writer's cores."""

from __future__ import annotations

from kvcellar.actors.one_in_flight import OneInFlight


def test_items_run_oldest_first_one_at_a_time_and_a_wrong_finish_changes_nothing():
    fifo: OneInFlight[tuple[int, str]] = OneInFlight(lambda item: item[0])
    for item in [(1, "a"), (2, "b"), (3, "c")]:
        fifo.append(item)
    assert fifo.start_oldest() == (1, "a")
    assert fifo.holds(1) and fifo.holds(3) and not fifo.holds(4)
    assert fifo.finish(2) is None and fifo.in_flight == (1, "a") and len(fifo) == 2
    assert fifo.finish(1) == (1, "a") and fifo.in_flight is None and not fifo.holds(1)
    fifo.remove((2, "b"))
    assert list(fifo.queued()) == [(3, "c")]
    assert fifo.start_oldest() == (3, "c") and not fifo
    assert fifo.take_in_flight() == (3, "c") and fifo.take_in_flight() is None


def test_waiters_are_handed_back_once_in_arrival_order_and_clear_leaves_the_in_flight_item():
    fifo: OneInFlight[int] = OneInFlight(lambda item: item)
    fifo.add_waiter(7)
    fifo.add_waiter(5)
    assert fifo.take_waiters() == [7, 5] and fifo.take_waiters() == []
    for item in (1, 2, 3):
        fifo.append(item)
    fifo.start_oldest()
    assert fifo.clear() == [2, 3] and len(fifo) == 0 and fifo.in_flight == 1
