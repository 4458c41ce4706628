"""The gateway's core: the one engine lane, shared by requests and
background work (the Trio shell, its engine thread and the module's account
of the lane are `actors/gateway.py`).

Pure: it imports attrs, the messages and `errors`, never Trio or MLX. Its
transitions are one table, `GATEWAY_TABLE`, looked up before any handler
runs; each handler returns the lane state it leaves the core in.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable

import attrs

from kvcellar.actors.effects import JournalEvent
from kvcellar.actors.transitions import Handler, TransitionTable, rows
from kvcellar.errors import IllegalTransition
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
_HOLDING = frozenset(_HOLDER_LANES.values())

# A handler's answer: the lane state it leaves the core in, and the effects.
Step = tuple[Lane, list[GatewayEffect]]


class GatewayCore:
    """Sans-IO lane scheduler. Admission is open until `StopAdmission`.

    `other_lane_busy` says whether another lane holds rows this lane has not
    seen yet: the Scheduler's, from their admission until their batch job
    queues here, and while one waits for the next batch as the last one ends.
    A step waits for those as for a waiting request; `OtherLaneIdle` says
    when to look again.

    `handle` raises `IllegalTransition` for a message its lane state does not
    take (`GATEWAY_TABLE`), a `Generate` for an unknown lane or of an id
    already held, and a `GenerationFinished` or `StepFinished` for what is not
    running: protocol bugs between the shell and its callers (kvcellar's
    fault). The core is unchanged when it raises."""

    def __init__(self, other_lane_busy: Callable[[], bool] = lambda: False) -> None:
        self.other_lane_busy = other_lane_busy
        self.state = Lane.IDLE
        self.admitting = True
        self.running: int | None = None
        self.waiting: deque[int] = deque()
        # The lane each waiting or running holder asked for (LANE_SERIAL or LANE_BATCH).
        self.holder_lanes: dict[int, str] = {}
        self.steps: deque[int] = deque()
        self.drain_waiters: list[int] = []

    @property
    def busy(self) -> bool:
        return self._busy(self.state)

    def _busy(self, lane: Lane) -> bool:
        return lane in _HOLDING or bool(self.waiting)

    def handle(self, msg: GatewayMessage, now: float) -> list[GatewayEffect]:
        return GATEWAY_TABLE.fire(self, msg, now)

    # -- handlers: (core, message, now) -> (next lane state, effects) ----------

    def _on_generate(self, msg: Generate, now: float) -> Step:
        if msg.lane not in _HOLDER_LANES:
            raise IllegalTransition(f"gateway in lane state {self.state.name} got Generate for lane {msg.lane!r}")
        if msg.request_id in self.holder_lanes:
            raise IllegalTransition(
                f"gateway in lane state {self.state.name} got Generate for request "
                f"{msg.request_id}, which it holds already"
            )
        serial = msg.lane == LANE_SERIAL
        if serial and not self.admitting:
            return self._dispatch(
                self.state, [Rejected(request_id=msg.request_id, reason="the server is shutting down")]
            )
        self.waiting.append(msg.request_id)
        self.holder_lanes[msg.request_id] = msg.lane
        if not serial:
            return self._dispatch(self.state, [])
        admitted = RequestAdmitted(request_id=msg.request_id, prompt_tokens=msg.prompt_tokens)
        return self._dispatch(self.state, [JournalEvent(event=admitted)])

    def _on_generation_finished(self, msg: GenerationFinished, now: float) -> Step:
        holder_lane = self.holder_lanes.get(msg.request_id, LANE_SERIAL)
        self._check_running(_HOLDER_LANES[holder_lane], msg.request_id, msg)
        self.running = None
        del self.holder_lanes[msg.request_id]
        if holder_lane != LANE_SERIAL:
            return self._dispatch(Lane.IDLE, [])
        finished = RequestFinished(
            request_id=msg.request_id, completion_tokens=msg.completion_tokens, outcome=msg.outcome
        )
        return self._dispatch(Lane.IDLE, [JournalEvent(event=finished)])

    def _on_withdraw(self, msg: Withdraw, now: float) -> Step:
        holder_lane = self.holder_lanes.get(msg.request_id)
        if holder_lane is None:
            return self._dispatch(self.state, [])
        lane = self.state
        if msg.request_id in self.waiting:
            self.waiting.remove(msg.request_id)
        else:
            # Dispatched as its caller left: it holds the lane, which nobody will use.
            self._check_running(_HOLDER_LANES[holder_lane], msg.request_id, msg)
            lane, self.running = Lane.IDLE, None
        del self.holder_lanes[msg.request_id]
        if holder_lane != LANE_SERIAL:
            return self._dispatch(lane, [])
        finished = RequestFinished(request_id=msg.request_id, completion_tokens=0, outcome="cancelled")
        return self._dispatch(lane, [JournalEvent(event=finished)])

    def _on_run_when_idle(self, msg: RunWhenIdle, now: float) -> Step:
        self.steps.append(msg.step_id)
        return self._dispatch(self.state, [])

    def _on_step_finished(self, msg: StepFinished, now: float) -> Step:
        self._check_running(Lane.BACKGROUND, msg.step_id, msg)
        self.running = None
        return self._dispatch(Lane.IDLE, [])

    def _on_other_lane_idle(self, msg: OtherLaneIdle, now: float) -> Step:
        return self._dispatch(self.state, [])  # it looks at the other lane again

    def _on_stop_admission(self, msg: StopAdmission, now: float) -> Step:
        self.admitting = False
        return self._dispatch(self.state, [])

    def _on_await_drained(self, msg: AwaitDrained, now: float) -> Step:
        self.drain_waiters.append(msg.waiter_id)
        return self._dispatch(self.state, [])

    # -- steps -----------------------------------------------------------------

    def _check_running(self, expected: Lane, ident: int, msg: GatewayMessage) -> None:
        if self.state is not expected or self.running != ident:
            raise IllegalTransition(
                f"gateway in lane state {self.state.name} (running {self.running}) got {type(msg).__name__} for {ident}"
            )

    def _dispatch(self, lane: Lane, effects: list[GatewayEffect]) -> Step:
        """Give a free lane to the next waiting request, else to the next step
        when no other lane's row waits; answer the drain waiters once idle."""
        if lane is Lane.IDLE and self.waiting:
            running = self.waiting.popleft()
            lane = _HOLDER_LANES[self.holder_lanes[running]]
            self.running = running
            effects.append(StartGeneration(request_id=running))
        elif lane is Lane.IDLE and self.steps and not self.other_lane_busy():
            lane = Lane.BACKGROUND
            self.running = self.steps.popleft()
            effects.append(RunStep(step_id=self.running))
        if not self._busy(lane) and self.drain_waiters:
            effects.extend(Drained(waiter_id=w) for w in self.drain_waiters)
            self.drain_waiters.clear()
        return lane, effects


# The one table: (lane state, message type) -> (the lane states the handler may
# leave the core in, the handler). A free lane may be given to anyone; a held
# one changes only when its holder finishes or withdraws (then it is given on
# at once), so every other message leaves a held lane as it was.
_EVERY_LANE = frozenset(Lane)
_HELD = [Lane.GENERATING, Lane.BATCHING, Lane.BACKGROUND]
_ANYTIME: dict[type, Handler] = {
    Generate: GatewayCore._on_generate,
    RunWhenIdle: GatewayCore._on_run_when_idle,
    OtherLaneIdle: GatewayCore._on_other_lane_idle,
    StopAdmission: GatewayCore._on_stop_admission,
    AwaitDrained: GatewayCore._on_await_drained,
}
GATEWAY_TABLE: TransitionTable[Lane] = TransitionTable(
    "the gateway",
    {
        **{row: t for m, h in _ANYTIME.items() for row, t in rows([Lane.IDLE], [m], h, to=_EVERY_LANE).items()},
        **{row: t for m, h in _ANYTIME.items() for row, t in rows(_HELD, [m], h).items()},
        **rows([Lane.IDLE, *_HOLDING], [Withdraw], GatewayCore._on_withdraw, to=_EVERY_LANE),
        **rows([Lane.BACKGROUND], [Withdraw], GatewayCore._on_withdraw),
        **rows(_HOLDING, [GenerationFinished], GatewayCore._on_generation_finished, to=_EVERY_LANE),
        **rows([Lane.BACKGROUND], [StepFinished], GatewayCore._on_step_finished, to=_EVERY_LANE),
    },
)
