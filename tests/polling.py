"""Waiting on observable state instead of the wall clock.

A test that must let something happen (a request reach a queue, a thread
reach a point) waits until a condition it can read says so, polling with a
deadline: the poll interval only bounds how soon the wait notices, it never
decides an order. The deadline turns a hang into a failure naming what never
happened.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

DEADLINE_S = 60.0
POLL_INTERVAL_S = 0.002


async def wait_until(condition: Callable[[], bool], *, what: str, deadline_s: float = DEADLINE_S) -> None:
    """Return once `condition()` holds; on a Trio clock (a MockClock's virtual
    time included), failing after `deadline_s`."""
    with trio.move_on_after(deadline_s):
        while not condition():
            await trio.sleep(POLL_INTERVAL_S)
        return
    raise AssertionError(f"waited {deadline_s} s until {what}, which never happened")


def wait_until_sync(condition: Callable[[], bool], *, what: str, deadline_s: float = DEADLINE_S) -> None:
    """`wait_until` for plain threads."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {deadline_s} s until {what}, which never happened")
        time.sleep(POLL_INTERVAL_S)
