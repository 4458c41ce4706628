"""The actor runtime: sans-IO cores driven by thin Trio shells.

A core is a plain object with `handle(msg, now) -> list[Effect]`: no awaits,
no clock reads, no I/O. Its states are an Enum and its transitions live in
one place; an illegal transition raises `IllegalTransition` naming the state.
The simulator and the unit tests drive cores directly.

A shell (`ActorShell`) is a Trio task that reads the actor's memory channel,
calls the core with `trio.current_time()`, and carries out the effects: the
generic ones here (timers, journal events) itself, the actor's own through a
`perform` callback. Timers run in the shell's nursery and come back to the
core as `TimerFired` messages, so they too are just messages.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, Protocol

import attrs
import trio

from kvcellar.errors import KvCellarError

log = logging.getLogger("kvcellar.actors")


class IllegalTransition(KvCellarError):
    """Raised by a core when a message arrives in a state that does not
    accept it. kvcellar's fault (a protocol bug between actors)."""


@attrs.frozen(kw_only=True)
class ArmTimer:
    """Send `TimerFired(key)` to this actor after `delay_s` (re-arming replaces)."""

    key: Hashable
    delay_s: float


@attrs.frozen(kw_only=True)
class CancelTimer:
    key: Hashable


@attrs.frozen(kw_only=True)
class TimerFired:
    key: Hashable


@attrs.frozen(kw_only=True)
class JournalEvent:
    """Append `event` (an attrs event registered in `store.events`) to the journal."""

    event: Any


class Core(Protocol):
    def handle(self, msg: Any, now: float) -> list[Any]: ...


class Journal(Protocol):
    def append(self, event: Any, *, actor: str = ...) -> int | None: ...


Perform = Callable[[Any], Awaitable[None] | None]


class ActorShell:
    """Runs one core inside a nursery. `send`/`send_nowait` deliver messages;
    `perform(effect)` handles the effects that are not generic."""

    def __init__(self, name: str, core: Core, perform: Perform, *, journal: Journal | None = None,
                 buffer_messages: float = math.inf) -> None:
        self.name = name
        self.core = core
        self._perform = perform
        self._journal = journal
        self._send, self._receive = trio.open_memory_channel[Any](buffer_messages)
        self._timers: dict[Hashable, trio.CancelScope] = {}
        self._nursery: trio.Nursery | None = None

    def send_nowait(self, msg: Any) -> None:
        self._send.send_nowait(msg)

    async def send(self, msg: Any) -> None:
        await self._send.send(msg)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            async for msg in self._receive:
                await self.deliver(msg)
            nursery.cancel_scope.cancel()

    async def deliver(self, msg: Any) -> None:
        """Run the core on one message and carry out its effects in order."""
        for effect in self.core.handle(msg, trio.current_time()):
            await self._carry_out(effect)

    async def _carry_out(self, effect: Any) -> None:
        if isinstance(effect, ArmTimer):
            self._arm(effect)
        elif isinstance(effect, CancelTimer):
            scope = self._timers.pop(effect.key, None)
            if scope is not None:
                scope.cancel()
        elif isinstance(effect, JournalEvent):
            if self._journal is not None:
                self._journal.append(effect.event, actor=self.name)
        else:
            result = self._perform(effect)
            if result is not None:
                await result

    def _arm(self, effect: ArmTimer) -> None:
        previous = self._timers.pop(effect.key, None)
        if previous is not None:
            previous.cancel()
        scope = trio.CancelScope()
        self._timers[effect.key] = scope
        assert self._nursery is not None, "the shell is not running"
        self._nursery.start_soon(self._timer, effect.key, effect.delay_s, scope)

    async def _timer(self, key: Hashable, delay_s: float, scope: trio.CancelScope) -> None:
        with scope:
            await trio.sleep(delay_s)
            if self._timers.get(key) is scope:
                del self._timers[key]
                await self._send.send(TimerFired(key=key))

    def close(self) -> None:
        self._send.close()
