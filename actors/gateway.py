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
import enum
import itertools
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, assert_never

import attrs
import outcome
import trio

from kvcellar.actors.runtime import ActorShell, JournalEvent, Reply
from kvcellar.engine.engine import EngineThread
from kvcellar.engine.generation import GenerationDone, TokenDelta
from kvcellar.errors import AdmissionClosed, IllegalTransition
from kvcellar.store.actor_events import RequestAdmitted, RequestFinished

# -- messages -------------------------------------------------------------------


LANE_SERIAL = "serial"
LANE_BATCH = "batch"


@attrs.frozen(kw_only=True)
class Generate:
    request_id: int
    prompt_tokens: int
    lane: str = LANE_SERIAL


@attrs.frozen(kw_only=True)
class GenerationFinished:
    request_id: int
    completion_tokens: int
    outcome: str


@attrs.frozen(kw_only=True)
class Withdraw:
    """The caller of `Generate` stopped waiting for its decision (its client
    left): take the request off the queue, or release the lane it was given.
    A no-op for a request the gateway no longer holds (rejected, finished)."""

    request_id: int


@attrs.frozen(kw_only=True)
class RunWhenIdle:
    step_id: int


@attrs.frozen(kw_only=True)
class StepFinished:
    step_id: int


@attrs.frozen(kw_only=True)
class OtherLaneIdle:
    """Another lane (the Scheduler) has no row active or waiting any more: the
    steps held back for its rows may run."""


@attrs.frozen(kw_only=True)
class StopAdmission:
    pass


@attrs.frozen(kw_only=True)
class AwaitDrained:
    waiter_id: int


GatewayMessage = (
    Generate | GenerationFinished | Withdraw | RunWhenIdle | StepFinished | OtherLaneIdle | StopAdmission | AwaitDrained
)

# -- effects --------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class StartGeneration:
    request_id: int


@attrs.frozen(kw_only=True)
class RunStep:
    step_id: int


@attrs.frozen(kw_only=True)
class Rejected:
    request_id: int
    reason: str


@attrs.frozen(kw_only=True)
class Drained:
    waiter_id: int


GatewayEffect = StartGeneration | RunStep | Rejected | Drained | JournalEvent

# -- core -----------------------------------------------------------------------


class Lane(enum.Enum):
    IDLE = "idle"
    GENERATING = "generating"
    BATCHING = "batching"
    BACKGROUND = "background"


_HOLDER_LANES = {LANE_SERIAL: Lane.GENERATING, LANE_BATCH: Lane.BATCHING}

# Which messages each lane state takes, and the legal state changes: the one
# place where the gateway's transitions are decided.
_ANY_LANE = frozenset(Lane)
_ACCEPTS: dict[type, frozenset[Lane]] = {
    Generate: _ANY_LANE,
    RunWhenIdle: _ANY_LANE,
    OtherLaneIdle: _ANY_LANE,
    StopAdmission: _ANY_LANE,
    AwaitDrained: _ANY_LANE,
    GenerationFinished: frozenset({Lane.GENERATING, Lane.BATCHING}),
    Withdraw: _ANY_LANE,
    StepFinished: frozenset({Lane.BACKGROUND}),
}
_MOVES = {
    Lane.IDLE: {Lane.GENERATING, Lane.BATCHING, Lane.BACKGROUND},
    Lane.GENERATING: {Lane.IDLE},
    Lane.BATCHING: {Lane.IDLE},
    Lane.BACKGROUND: {Lane.IDLE},
}


class GatewayCore:
    """Sans-IO lane scheduler. Admission is open until `StopAdmission`.

    `other_lane_busy` says whether another lane holds rows this lane has not
    seen yet: the Scheduler's, from their admission until their batch job
    queues here, and while one waits for the next batch as the last one ends.
    A step waits for those as for a waiting request; `OtherLaneIdle` says
    when to look again.

    `handle` raises `IllegalTransition` for a message its lane state does not
    take, a `Generate` for an unknown lane or of an id already held, and a
    `GenerationFinished` or `StepFinished` for what is not running: protocol
    bugs between the shell and its callers (kvcellar's fault). The core is
    unchanged when it raises."""

    def __init__(self, other_lane_busy: Callable[[], bool] = lambda: False) -> None:
        self.other_lane_busy = other_lane_busy
        self.lane = Lane.IDLE
        self.admitting = True
        self.running: int | None = None
        self.waiting: deque[int] = deque()
        # The lane each waiting or running holder asked for (LANE_SERIAL or LANE_BATCH).
        self.holder_lanes: dict[int, str] = {}
        self.steps: deque[int] = deque()
        self.drain_waiters: list[int] = []

    @property
    def busy(self) -> bool:
        return self.lane in (Lane.GENERATING, Lane.BATCHING) or bool(self.waiting)

    def handle(self, msg: GatewayMessage, now: float) -> list[GatewayEffect]:
        accepted = _ACCEPTS.get(type(msg))
        if accepted is None or self.lane not in accepted:
            raise IllegalTransition(f"gateway in lane state {self.lane.value} got {type(msg).__name__}")
        effects: list[GatewayEffect]
        match msg:
            case Generate():
                effects = self._on_generate(msg)
            case GenerationFinished():
                effects = self._on_generation_finished(msg)
            case Withdraw():
                effects = self._on_withdraw(msg)
            case RunWhenIdle():
                self.steps.append(msg.step_id)
                effects = []
            case StepFinished():
                self._release(Lane.BACKGROUND, msg.step_id, msg)
                effects = []
            case OtherLaneIdle():
                effects = []  # dispatch below looks at the other lane again
            case StopAdmission():
                self.admitting, effects = False, []
            case AwaitDrained():
                self.drain_waiters.append(msg.waiter_id)
                effects = []
            case _:
                assert_never(msg)
        return effects + self._dispatch()

    def _on_generate(self, msg: Generate) -> list[GatewayEffect]:
        if msg.lane not in _HOLDER_LANES:
            raise IllegalTransition(f"gateway in lane state {self.lane.value} got Generate for lane {msg.lane!r}")
        if msg.request_id in self.holder_lanes:
            raise IllegalTransition(
                f"gateway in lane state {self.lane.value} got Generate for request "
                f"{msg.request_id}, which it holds already"
            )
        serial = msg.lane == LANE_SERIAL
        if serial and not self.admitting:
            return [Rejected(request_id=msg.request_id, reason="the server is shutting down")]
        self.waiting.append(msg.request_id)
        self.holder_lanes[msg.request_id] = msg.lane
        if not serial:
            return []
        return [JournalEvent(event=RequestAdmitted(request_id=msg.request_id, prompt_tokens=msg.prompt_tokens))]

    def _on_generation_finished(self, msg: GenerationFinished) -> list[GatewayEffect]:
        holder_lane = self.holder_lanes.get(msg.request_id, LANE_SERIAL)
        self._release(_HOLDER_LANES[holder_lane], msg.request_id, msg)
        del self.holder_lanes[msg.request_id]
        if holder_lane != LANE_SERIAL:
            return []
        return [
            JournalEvent(
                event=RequestFinished(
                    request_id=msg.request_id, completion_tokens=msg.completion_tokens, outcome=msg.outcome
                )
            )
        ]

    def _on_withdraw(self, msg: Withdraw) -> list[GatewayEffect]:
        holder_lane = self.holder_lanes.get(msg.request_id)
        if holder_lane is None:
            return []
        if msg.request_id in self.waiting:
            self.waiting.remove(msg.request_id)
        else:
            # Dispatched as its caller left: it holds the lane, which nobody will use.
            self._release(_HOLDER_LANES[holder_lane], msg.request_id, msg)
        del self.holder_lanes[msg.request_id]
        if holder_lane != LANE_SERIAL:
            return []
        finished = RequestFinished(request_id=msg.request_id, completion_tokens=0, outcome="cancelled")
        return [JournalEvent(event=finished)]

    def _release(self, expected: Lane, ident: int, msg: GatewayMessage) -> None:
        if self.lane is not expected or self.running != ident:
            raise IllegalTransition(
                f"gateway in lane state {self.lane.value} (running {self.running}) got {type(msg).__name__} for {ident}"
            )
        self._move(Lane.IDLE)
        self.running = None

    def _move(self, to: Lane) -> None:
        if to not in _MOVES[self.lane]:
            raise IllegalTransition(f"gateway cannot move from lane state {self.lane.value} to {to.value}")
        self.lane = to

    def _dispatch(self) -> list[GatewayEffect]:
        effects: list[GatewayEffect] = []
        if self.lane is Lane.IDLE and self.waiting:
            running = self.waiting.popleft()
            self._move(_HOLDER_LANES[self.holder_lanes[running]])
            self.running = running
            effects.append(StartGeneration(request_id=running))
        elif self.lane is Lane.IDLE and self.steps and not self.other_lane_busy():
            self._move(Lane.BACKGROUND)
            self.running = self.steps.popleft()
            effects.append(RunStep(step_id=self.running))
        if not self.busy and self.drain_waiters:
            effects.extend(Drained(waiter_id=w) for w in self.drain_waiters)
            self.drain_waiters.clear()
        return effects


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
            "lane": self.core.lane.value,
            "waiting": len(self.core.waiting),
            "background_waiting": len(self.core.steps),
            "admitting": self.core.admitting,
        }
