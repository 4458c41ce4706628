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

`ActorShell.run` is every actor's one lifetime: a nursery for the actor's own
tasks (`start_soon`: a gateway step, a batch job, a spill write, a durability
attempt), and in it the mailbox loop with the timers. When the mailbox is
closed, the loop ends and the timers with it; the actor's tasks either finish
(the default: a step or a batch job reports back) or are cancelled
(`cancel_tasks_on_close`: nobody is left to hear them). `drive(msg)` is the
other way to run a core: in the caller's task, without a mailbox, feeding the
messages that `perform` returns back in until none is left (the SsdWriter,
whose one caller waits for each write).

Every request/response pair is a `Reply` (re-exported here from
`kvcellar.engine.reply`, the lowest layer that runs Trio, because the engine
thread answers with its cross-thread twin `CrossThreadReply`).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, Protocol

import trio

from kvcellar.actors.effects import ArmTimer, CancelTimer, JournalEvent, TimerFired
from kvcellar.engine.reply import CrossThreadReply, Reply

__all__ = [
    "ActorShell",
    "ArmTimer",
    "CancelTimer",
    "Core",
    "CrossThreadReply",
    "Journal",
    "JournalEvent",
    "Perform",
    "Reply",
    "TimerFired",
]

log = logging.getLogger("kvcellar.actors")


class Core(Protocol):
    def handle(self, msg: Any, now: float) -> list[Any]: ...


class Journal(Protocol):
    def append(self, event: Any, *, actor: str = ...) -> int | None: ...


# What `perform` does with an effect: nothing more to say (None, or an awaitable
# of None), or, awaited, the message the effect's work answers (for `drive`).
Perform = Callable[[Any], Awaitable[Any] | None]


class ActorShell:
    """Runs one core. `send`/`send_nowait` deliver messages to its mailbox;
    `perform(effect)` handles the effects that are not generic;
    `start_soon` runs one of the actor's tasks in its nursery."""

    def __init__(
        self,
        name: str,
        core: Core,
        perform: Perform,
        *,
        journal: Journal | None = None,
        buffer_messages: float = math.inf,
        cancel_tasks_on_close: bool = False,
    ) -> None:
        self.name = name
        self.core = core
        self._perform = perform
        self._journal = journal
        self._cancel_tasks_on_close = cancel_tasks_on_close
        self._send, self._receive = trio.open_memory_channel[Any](buffer_messages)
        self._timers: dict[Hashable, trio.CancelScope] = {}
        self._nursery: trio.Nursery | None = None  # the timers'
        self._tasks: trio.Nursery | None = None

    def send_nowait(self, msg: Any) -> None:
        self._send.send_nowait(msg)

    async def send(self, msg: Any) -> None:
        await self._send.send(msg)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until the mailbox is closed and the actor's tasks are done
        (or, with `cancel_tasks_on_close`, cancelled) or `cancel()` is called."""
        try:
            async with trio.open_nursery() as tasks:
                self._tasks = tasks
                await tasks.start(self._serve_mailbox)
                task_status.started()
        finally:
            self._tasks = None

    def start_soon(self, task: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run one of the actor's tasks; it lives no longer than `run`."""
        assert self._tasks is not None, f"the {self.name} shell is not running"
        self._tasks.start_soon(task, *args)

    def cancel(self) -> None:
        """Stop now: the mailbox loop, the timers and the actor's tasks."""
        if self._tasks is not None:
            self._tasks.cancel_scope.cancel()

    async def _serve_mailbox(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            async for msg in self._receive:
                await self.deliver(msg)
            nursery.cancel_scope.cancel()
        if self._cancel_tasks_on_close and self._tasks is not None:
            self._tasks.cancel_scope.cancel()

    async def deliver(self, msg: Any) -> list[Any]:
        """Run the core on one message and carry out its effects in order;
        returns the messages their work answered (see `drive`)."""
        answers = []
        for effect in self.core.handle(msg, trio.current_time()):
            answer = await self._carry_out(effect)
            if answer is not None:
                answers.append(answer)
        return answers

    async def drive(self, msg: Any) -> None:
        """Deliver `msg`, then every message the effects' work answers, in
        order, in this task, until no answer is left."""
        pending = deque([msg])
        while pending:
            pending.extend(await self.deliver(pending.popleft()))

    async def _carry_out(self, effect: Any) -> Any:
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
                return await result
        return None

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
