"""The Scheduler's core: admission of batch rows (the Trio shell, the batch
job's wiring and the account of the lane are `actors/scheduler.py`).

States, and which messages each takes:

    IDLE ──first Submit──▶ RUNNING ──last row finished, none waiting──▶ ENDING
      ▲                      │                                           │
      └── BatchEnded (the job failed or was cancelled) ◀─┘                │
      └──────────────────────────── BatchEnded ◀─────────────────────────┘

Pure: it imports attrs, the messages and `errors`, never Trio or MLX. Its
transitions are one table, `SCHEDULER_TABLE`, looked up before any handler
runs; each handler returns the state it leaves the core in.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from kvcellar.actors.effects import JournalEvent

# StopAdmission, AwaitDrained, Rejected and Drained mean for the Scheduler what they mean for the Gateway.
from kvcellar.actors.gateway_core import AwaitDrained, Drained, Rejected, StopAdmission
from kvcellar.actors.transitions import Handler, TransitionTable, rows
from kvcellar.errors import IllegalTransition, UsageError
from kvcellar.store.actor_events import RequestAdmitted, RequestFinished

ROWS_MAX_DEFAULT = 8
KV_BUDGET_BYTES_DEFAULT = 4 * 10**9
OUTCOMES = ("completed", "cancelled", "failed")

# -- messages -------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Submit:
    """A request asks for a row; `kv_bytes` is its projected KV footprint."""

    request_id: int
    prompt_tokens: int
    kv_bytes: int


@attrs.frozen(kw_only=True)
class Cancel:
    """The client went away. A no-op for a request that has already ended."""

    request_id: int


@attrs.frozen(kw_only=True)
class RowFinished:
    request_id: int
    outcome: str
    completion_tokens: int


@attrs.frozen(kw_only=True)
class BatchEnded:
    """The batch job is over; `error` says why when it ended with rows active."""

    batch_id: int
    error: str = ""


SchedulerMessage = Submit | Cancel | RowFinished | BatchEnded | StopAdmission | AwaitDrained

# -- effects --------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class StartBatch:
    """Open a new batch (its inbox) and queue its engine job on the Gateway's lane."""

    batch_id: int


@attrs.frozen(kw_only=True)
class AdmitRow:
    """Hand the request to the batch's engine job as a row."""

    request_id: int
    batch_id: int


@attrs.frozen(kw_only=True)
class CancelRow:
    """Ask the engine job to end the row between two steps (its caches are still put back)."""

    request_id: int


@attrs.frozen(kw_only=True)
class EndBatch:
    """Tell the engine job that no row will come: it ends once it has read this."""

    batch_id: int


@attrs.frozen(kw_only=True)
class Withdrawn:
    """A waiting request was cancelled before it got a row."""

    request_id: int


@attrs.frozen(kw_only=True)
class RowAborted:
    """The row's batch ended before the row did: fail the request."""

    request_id: int
    reason: str


@attrs.frozen(kw_only=True)
class WentIdle:
    """No row is active or waiting and no batch job is left: the Gateway may
    start the background steps it held back for this lane (its busy probe)."""


SchedulerEffect = (
    StartBatch | AdmitRow | CancelRow | EndBatch | Rejected | Withdrawn | RowAborted | Drained | WentIdle | JournalEvent
)

# -- core -----------------------------------------------------------------------


class BatchState(enum.Enum):
    IDLE = "idle"
    RUNNING = "running"
    ENDING = "ending"


def padded_kv_bytes(row_kv_bytes: Iterable[int]) -> int:
    """What rows with these projected KV bytes take once merged: every row is
    padded to the largest (mlx-lm's `BatchKVCache.extend` right-justifies the
    rows to the longest index; `filter` trims only padding common to all)."""
    sizes = list(row_kv_bytes)
    return len(sizes) * max(sizes, default=0)


def summed_kv_bytes(row_kv_bytes: Iterable[int]) -> int:
    """What paged rows take together (engine/paged_kv.py): each row its own
    blocks, no padding to the longest. Sliding-window rings and recurrent
    state stay unpaged and are billed here per row, not padded."""
    return sum(row_kv_bytes)


# A handler's answer: the state it leaves the core in, and the effects.
Step = tuple[BatchState, list[SchedulerEffect]]


class SchedulerCore:
    """Sans-IO admission of batch rows under `rows_max` and `kv_budget_bytes`.

    `handle` raises `IllegalTransition` for a message its state does not take
    (`SCHEDULER_TABLE`), a duplicate request id, a `RowFinished` for a row
    that is not active or a `BatchEnded` for another batch: protocol bugs
    between the shell and the engine job (kvcellar's fault). The core is
    unchanged when it raises.
    """

    def __init__(
        self, *, rows_max: int, kv_budget_bytes: int, billing: Callable[[Iterable[int]], int] = padded_kv_bytes
    ) -> None:
        if rows_max < 1:
            raise UsageError(f"a batch needs at least 1 row, got {rows_max}")
        if kv_budget_bytes < 0:
            raise UsageError(f"the KV budget must be >= 0 bytes, got {kv_budget_bytes}")
        self.rows_max = rows_max
        self.kv_budget_bytes = kv_budget_bytes
        # What admitted rows cost together: padded (the default) or, with paged KV, `summed_kv_bytes`.
        self.billing = billing
        self.state = BatchState.IDLE
        self.admitting = True
        self.batch_id = 0
        self.waiting: OrderedDict[int, Submit] = OrderedDict()
        self.active: dict[int, int] = {}
        self.kv_bytes_peak = 0
        self.drain_waiters: list[int] = []
        self.counts = {"batches": 0, "admitted": 0, "rejected": 0, **{outcome: 0 for outcome in OUTCOMES}}

    @property
    def kv_bytes_active(self) -> int:
        """The active rows' padded projection (see the module docstring)."""
        return self.billing(self.active.values())

    @property
    def busy(self) -> bool:
        """A batch job exists (running, queued for the lane or ending) or a request waits."""
        return self._busy(self.state)

    def _busy(self, state: BatchState) -> bool:
        return state is not BatchState.IDLE or bool(self.waiting)

    def handle(self, msg: SchedulerMessage, now: float) -> list[SchedulerEffect]:
        return SCHEDULER_TABLE.fire(self, msg, now)

    def stats(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "rows_active": len(self.active),
            "waiting": len(self.waiting),
            "kv_bytes_active": self.kv_bytes_active,
            "kv_bytes_peak": self.kv_bytes_peak,
            "admitting": self.admitting,
            **self.counts,
        }

    # -- handlers: (core, message, now) -> (next state, effects) ---------------

    def _on_submit(self, msg: Submit, now: float) -> Step:
        if msg.request_id in self.waiting or msg.request_id in self.active:
            raise IllegalTransition(
                f"request {msg.request_id} is already held by the scheduler (state {self.state.name})"
            )
        was_busy = self.busy
        if not self.admitting:
            self.counts["rejected"] += 1
            rejected = Rejected(request_id=msg.request_id, reason="the server is shutting down")
            return self._settle(was_busy, self.state, [rejected])
        self.waiting[msg.request_id] = msg
        admitted = RequestAdmitted(request_id=msg.request_id, prompt_tokens=msg.prompt_tokens)
        return self._settle(was_busy, self.state, [JournalEvent(event=admitted)])

    def _on_cancel(self, msg: Cancel, now: float) -> Step:
        was_busy = self.busy
        if msg.request_id in self.active:
            return self._settle(was_busy, self.state, [CancelRow(request_id=msg.request_id)])
        if self.waiting.pop(msg.request_id, None) is None:
            return self._settle(was_busy, self.state, [])
        effects = [Withdrawn(request_id=msg.request_id), *self._finished(msg.request_id, "cancelled", 0)]
        return self._settle(was_busy, self.state, effects)

    def _on_row_finished(self, msg: RowFinished, now: float) -> Step:
        if msg.request_id not in self.active or msg.outcome not in OUTCOMES:
            raise IllegalTransition(
                f"RowFinished({msg.request_id}, {msg.outcome!r}) for a row that is not active "
                f"(state {self.state.name}, active {sorted(self.active)})"
            )
        was_busy = self.busy
        del self.active[msg.request_id]
        return self._settle(was_busy, self.state, self._finished(msg.request_id, msg.outcome, msg.completion_tokens))

    def _on_batch_ended(self, msg: BatchEnded, now: float) -> Step:
        if msg.batch_id != self.batch_id:
            raise IllegalTransition(
                f"BatchEnded for batch {msg.batch_id} while batch {self.batch_id} is current (state {self.state.name})"
            )
        was_busy = self.busy
        effects: list[SchedulerEffect] = []
        reason = msg.error or "the batch ended before the row did"
        for request_id in list(self.active):
            del self.active[request_id]
            effects += [RowAborted(request_id=request_id, reason=reason), *self._finished(request_id, "failed", 0)]
        return self._settle(was_busy, BatchState.IDLE, effects)

    def _on_stop_admission(self, msg: StopAdmission, now: float) -> Step:
        was_busy = self.busy
        self.admitting = False
        return self._settle(was_busy, self.state, [])

    def _on_await_drained(self, msg: AwaitDrained, now: float) -> Step:
        was_busy = self.busy
        self.drain_waiters.append(msg.waiter_id)
        return self._settle(was_busy, self.state, [])

    # -- steps -----------------------------------------------------------------

    def _finished(self, request_id: int, outcome: str, completion_tokens: int) -> list[SchedulerEffect]:
        self.counts[outcome] += 1
        return [
            JournalEvent(
                event=RequestFinished(request_id=request_id, completion_tokens=completion_tokens, outcome=outcome)
            )
        ]

    def _settle(self, was_busy: bool, state: BatchState, effects: list[SchedulerEffect]) -> Step:
        """From `state`: start a batch for waiting work, admit what fits, end
        an empty batch; wake the drain waiters, and the Gateway once idle."""
        if state is BatchState.IDLE and self.waiting:
            state = BatchState.RUNNING
            self.batch_id += 1
            self.counts["batches"] += 1
            effects.append(StartBatch(batch_id=self.batch_id))
        if state is BatchState.RUNNING:
            effects += self._admit_waiting()
            if not self.active and not self.waiting:
                state = BatchState.ENDING
                effects.append(EndBatch(batch_id=self.batch_id))
        if not self._busy(state) and self.drain_waiters:
            effects += [Drained(waiter_id=w) for w in self.drain_waiters]
            self.drain_waiters.clear()
        if was_busy and not self._busy(state):
            effects.append(WentIdle())
        return state, effects

    def _admit_waiting(self) -> list[SchedulerEffect]:
        effects: list[SchedulerEffect] = []
        while self.waiting and len(self.active) < self.rows_max:
            head = next(iter(self.waiting.values()))
            if self.active and self.billing([*self.active.values(), head.kv_bytes]) > self.kv_budget_bytes:
                break
            del self.waiting[head.request_id]
            self.active[head.request_id] = head.kv_bytes
            self.kv_bytes_peak = max(self.kv_bytes_peak, self.kv_bytes_active)
            self.counts["admitted"] += 1
            effects.append(AdmitRow(request_id=head.request_id, batch_id=self.batch_id))
        return effects


# The one table: (state, message type) -> (the states the handler may leave the
# core in, the handler). Rows finish only while RUNNING; a batch ends while
# RUNNING (the job failed) or ENDING, and waiting work starts the next at once.
_S = BatchState
_ANYTIME: dict[type, Handler] = {
    Submit: SchedulerCore._on_submit,
    Cancel: SchedulerCore._on_cancel,
    StopAdmission: SchedulerCore._on_stop_admission,
    AwaitDrained: SchedulerCore._on_await_drained,
}
_ANYTIME_TARGETS = {_S.IDLE: {_S.IDLE, _S.RUNNING}, _S.RUNNING: {_S.RUNNING, _S.ENDING}, _S.ENDING: {_S.ENDING}}
SCHEDULER_TABLE: TransitionTable[BatchState] = TransitionTable(
    "the scheduler",
    {
        **{
            row: transition
            for state, targets in _ANYTIME_TARGETS.items()
            for message_type, handler in _ANYTIME.items()
            for row, transition in rows([state], [message_type], handler, to=targets).items()
        },
        **rows([_S.RUNNING], [RowFinished], SchedulerCore._on_row_finished, to={_S.RUNNING, _S.ENDING}),
        **rows([_S.RUNNING, _S.ENDING], [BatchEnded], SchedulerCore._on_batch_ended, to={_S.IDLE, _S.RUNNING}),
    },
)
