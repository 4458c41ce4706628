"""The Gateway: the one engine lane, shared by requests and background work.

The core owns the lane. Requests are admitted FIFO and run one at a time
(the serial lane); a background step (`run_when_idle`) is dispatched only
when no request is active or waiting, and the lane stays taken until the step
reports back, so the idle decision and the work are one atomic engine turn.
A request arriving during background work waits for that one step only,
never for the rest of a flush; background work never lands between two
decode steps, because a generation holds the lane from its first step to
its last. `busy` is true while any request is active or waiting.

The lane has two kinds of holder: a serial request (`LANE_SERIAL`), and the
Scheduler's batch job (`LANE_BATCH`, `actors/scheduler.py`), one engine job
that runs every batch row from the first admitted one until none remain. The
batch job queues FIFO like a request and keeps the lane just as long, so
background work never lands between two decode steps of any row either. It is
not journaled here (the Scheduler journals each row), and it is accepted after
`StopAdmission`: it only serves rows admitted before shutdown began. A row
counts as waiting from its admission by the Scheduler (the busy probe), before
its batch job reaches this lane and while it waits for the next batch as the
last one ends, so no step starts in either gap; the Scheduler says when it
has nothing left (`OtherLaneIdle`).

A caller that stops waiting for its turn (a serial request whose client
left while it was queued, issue 38) sends `Withdraw`: the request leaves the
queue, or, when the lane was given to it as it left, the lane is released
at once. Nothing is ever left queued or holding the lane for nobody, so the
next request runs and a shutdown's drain never waits on such an orphan.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, assert_never

import outcome
import trio

from kvcellar.actors.gateway_core import (
    LANE_SERIAL,
    AwaitDrained,
    Drained,
    GatewayCore,
    Generate,
    GenerationFinished,
    OtherLaneIdle,
    Rejected,
    RunStep,
    RunWhenIdle,
    StartGeneration,
    StepFinished,
    StopAdmission,
    Withdraw,
)
from kvcellar.actors.runtime import ActorShell, Reply
from kvcellar.engine.engine import EngineThread
from kvcellar.engine.generation import GenerationDone, TokenDelta
from kvcellar.errors import AdmissionClosed

# -- shell ----------------------------------------------------------------------


def _completion_tokens(counted: int, item: Any) -> int:
    """The sampled tokens so far: a `TokenDelta` of a real token counts one (the
    closing text, `token_id` -1, counts none) and the `GenerationDone` states
    the total. Other items (the batch job's steps) count nothing here: the
    Scheduler journals each row's own count."""
    if isinstance(item, GenerationDone):
        return item.completion_tokens
    if isinstance(item, TokenDelta) and item.token_id >= 0:
        return counted + 1
    return counted


class Gateway:
    """The Trio shell around `GatewayCore`, owning the engine thread."""

    def __init__(self, engine: EngineThread, *, journal: Any = None) -> None:
        self.engine = engine
        self.core = GatewayCore(other_lane_busy=self._other_lane_busy)
        self.shell = ActorShell("gateway", self.core, self._perform, journal=journal)
        self._ids = itertools.count(1)
        # The replies the core's effects answer, by request, step or waiter id.
        self._decisions: dict[int, Reply[StartGeneration | Rejected]] = {}
        self._steps: dict[int, tuple[Callable[[Any], Any], Reply[Any]]] = {}
        self._drains: dict[int, Reply[None]] = {}
        self._busy_probes: list[Callable[[], bool]] = []

    @property
    def busy(self) -> bool:
        """Whether a request or batch row is active or waiting, on either lane."""
        return self.core.busy or self._other_lane_busy()

    def _other_lane_busy(self) -> bool:
        return any(probe() for probe in self._busy_probes)

    def add_busy_probe(self, probe: Callable[[], bool]) -> None:
        """Count another lane's work as busy: the Scheduler's rows, also in the
        moments between their admission and the batch job reaching this lane."""
        self._busy_probes.append(probe)

    def other_lane_idle(self) -> None:
        """Told by the lane behind a busy probe once the probe turns false."""
        # The gateway may have shut down: then no step is left to start.
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            self.shell.send_nowait(OtherLaneIdle())

    def new_id(self) -> int:
        """An id unique among this gateway's requests, steps and waiters (the
        Scheduler takes its request ids here, so the journal never sees one twice)."""
        return next(self._ids)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until `close()`; a step still running then finishes first."""
        await self.shell.run(task_status=task_status)

    def close(self) -> None:
        self.shell.close()

    def _perform(self, effect: StartGeneration | RunStep | Rejected | Drained) -> None:
        match effect:
            case StartGeneration() | Rejected():
                # A caller that withdrew is no longer waiting: its `Withdraw` follows in the mailbox.
                if (decision := self._decisions.pop(effect.request_id, None)) is not None:
                    decision.set(effect)
            case RunStep():
                step, reply = self._steps.pop(effect.step_id)
                self.shell.start_soon(self._run_step, effect.step_id, step, reply)
            case Drained():
                self._drains.pop(effect.waiter_id).set(None)
            case _:
                assert_never(effect)

    async def _run_step(self, step_id: int, step: Callable[[Any], Any], reply: Reply[Any]) -> None:
        # Whatever the step raises (a cancellation too) is carried to the awaiting caller.
        result = await outcome.acapture(self.engine.call, step, label="step")
        await self.shell.send(StepFinished(step_id=step_id))
        reply.settle(result)

    async def run_when_idle(self, step: Callable[[Any], Any]) -> Any:
        """Run `step(loaded_model)` on the engine thread as one turn taken
        only when no request is active or waiting; returns its result."""
        step_id = next(self._ids)
        reply: Reply[Any] = Reply()
        self._steps[step_id] = (step, reply)
        await self.shell.send(RunWhenIdle(step_id=step_id))
        return await reply.wait()

    async def generate(
        self, job: Callable[[Any], Any], *, prompt_tokens: int, cancelled: threading.Event, lane: str = LANE_SERIAL
    ) -> AsyncIterator[Any]:
        """Admit a generation (FIFO), then stream what `job(loaded_model)`
        yields on the engine thread. Raises `AdmissionClosed` after shutdown
        began (serial lane only; see the module docstring)."""
        request_id = next(self._ids)
        admission: Reply[StartGeneration | Rejected] = Reply()
        self._decisions[request_id] = admission
        await self.shell.send(Generate(request_id=request_id, prompt_tokens=prompt_tokens, lane=lane))
        try:
            decision = await admission.wait()
        except BaseException:
            # The caller left while queued (its client went away): never leave the request
            # queued, nor the lane held for nobody if it was given to it meanwhile.
            self._decisions.pop(request_id, None)
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                self.shell.send_nowait(Withdraw(request_id=request_id))
            raise
        if isinstance(decision, Rejected):
            raise AdmissionClosed(decision.reason)
        produced, outcome = 0, "cancelled"
        label = "generate" if lane == LANE_SERIAL else lane
        try:
            async for item in self.engine.stream(job, cancelled, label=label):
                produced = _completion_tokens(produced, item)
                yield item
            outcome = "completed"
        finally:
            with trio.CancelScope(shield=True):
                await self.shell.send(
                    GenerationFinished(request_id=request_id, completion_tokens=produced, outcome=outcome)
                )

    async def stop_admission(self) -> None:
        await self.shell.send(StopAdmission())

    async def drain(self) -> None:
        """Wait until no request is active or waiting."""
        waiter_id = next(self._ids)
        drained: Reply[None] = Reply()
        self._drains[waiter_id] = drained
        await self.shell.send(AwaitDrained(waiter_id=waiter_id))
        await drained.wait()

    def stats(self) -> dict[str, Any]:
        return {
            "busy": self.core.busy,
            "lane": self.core.state.value,
            "waiting": len(self.core.waiting),
            "background_waiting": len(self.core.steps),
            "admitting": self.core.admitting,
        }
