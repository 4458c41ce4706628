"""The Scheduler's core: batch rows admitted FIFO under a row cap and a KV budget."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcellar.actors.runtime import JournalEvent
from kvcellar.actors.scheduler_core import (
    AdmitRow,
    AwaitDrained,
    BatchEnded,
    BatchState,
    Cancel,
    CancelRow,
    Drained,
    EndBatch,
    Rejected,
    RowAborted,
    RowFinished,
    SchedulerCore,
    StartBatch,
    StopAdmission,
    Submit,
    WentIdle,
    Withdrawn,
)
from kvcellar.errors import IllegalTransition, UsageError


def _submit(core, request_id, kv_bytes=10):
    return core.handle(Submit(request_id=request_id, prompt_tokens=5, kv_bytes=kv_bytes), 0)


def _finish(core, request_id, outcome="completed"):
    return core.handle(RowFinished(request_id=request_id, outcome=outcome, completion_tokens=3), 0)


def _admitted(effects):
    return [e.request_id for e in effects if isinstance(e, AdmitRow)]


def _of(effects, kind):
    return [e for e in effects if isinstance(e, kind)]


def test_the_first_request_starts_a_batch_and_rows_join_it_up_to_the_row_cap():
    core = SchedulerCore(rows_max=2, kv_budget_bytes=1000)
    first = _submit(core, 1)
    assert _of(first, StartBatch) == [StartBatch(batch_id=1)] and _admitted(first) == [1]
    assert _admitted(_submit(core, 2)) == [2]
    assert _admitted(_submit(core, 3)) == [], "the row cap holds"
    assert core.state is BatchState.RUNNING and list(core.waiting) == [3]
    assert _admitted(_finish(core, 1)) == [3], "a finished row frees its place for the next"


def test_kv_budget_admission_keeps_fifo_order_and_never_overtakes_the_head():
    core = SchedulerCore(rows_max=8, kv_budget_bytes=100)
    assert _admitted(_submit(core, 1, 60)) == [1]
    assert _admitted(_submit(core, 2, 50)) == [], "60 + 50 > 100"
    assert _admitted(_submit(core, 3, 10)) == [], "a small row does not overtake the waiting head"
    assert core.kv_bytes_active == 60
    assert _admitted(_finish(core, 1)) == [2, 3], "2 rows padded to 50 fit 100"
    assert core.kv_bytes_active == 100 and core.kv_bytes_peak == 100


def test_a_short_row_beside_a_long_one_is_budgeted_as_long_as_the_long_one():
    # mlx-lm pads every row of the merged caches to the longest.
    core = SchedulerCore(rows_max=8, kv_budget_bytes=100)
    assert _admitted(_submit(core, 1, 40)) == [1]
    assert _admitted(_submit(core, 2, 10)) == [2]
    assert core.kv_bytes_active == 80, "two rows of 40 once padded"
    assert _admitted(_submit(core, 3, 10)) == [], "three rows of 40 exceed 100 although 40 + 10 + 10 do not"
    assert _admitted(_finish(core, 1)) == [3]
    assert core.kv_bytes_active == 20


def test_a_row_larger_than_the_whole_budget_runs_alone_once_nothing_else_is_active():
    core = SchedulerCore(rows_max=4, kv_budget_bytes=100)
    _submit(core, 1, 40)
    assert _admitted(_submit(core, 2, 500)) == []
    assert _admitted(_submit(core, 3, 10)) == []
    assert _admitted(_finish(core, 1)) == [2]
    assert _admitted(_finish(core, 2)) == [3]


def test_the_last_row_ends_the_batch_and_a_request_arriving_meanwhile_starts_the_next():
    core = SchedulerCore(rows_max=4, kv_budget_bytes=1000)
    _submit(core, 1)
    assert _of(_finish(core, 1), EndBatch) == [EndBatch(batch_id=1)]
    assert core.state is BatchState.ENDING and core.busy
    assert _of(_submit(core, 2), StartBatch) == [] and list(core.waiting) == [2]
    after = core.handle(BatchEnded(batch_id=1), 0)
    assert _of(after, StartBatch) == [StartBatch(batch_id=2)]
    assert _of(after, AdmitRow) == [AdmitRow(request_id=2, batch_id=2)]


def test_cancel_withdraws_a_waiting_request_asks_the_engine_for_an_active_row_and_ignores_an_ended_one():
    core = SchedulerCore(rows_max=1, kv_budget_bytes=1000)
    _submit(core, 1)
    _submit(core, 2)
    assert _of(core.handle(Cancel(request_id=2), 0), Withdrawn) == [Withdrawn(request_id=2)]
    assert core.handle(Cancel(request_id=1), 0) == [CancelRow(request_id=1)]
    assert 1 in core.active, "the row stays active until the engine reports its end"
    _finish(core, 1, "cancelled")
    assert core.handle(Cancel(request_id=1), 0) == []
    assert core.counts["cancelled"] == 2


def test_a_batch_that_ends_with_rows_active_aborts_them_and_waiting_rows_start_a_new_batch():
    core = SchedulerCore(rows_max=1, kv_budget_bytes=1000)
    _submit(core, 1)
    _submit(core, 2)
    effects = core.handle(BatchEnded(batch_id=1, error="boom"), 0)
    assert _of(effects, RowAborted) == [RowAborted(request_id=1, reason="boom")]
    assert _of(effects, StartBatch) == [StartBatch(batch_id=2)] and _admitted(effects) == [2]
    assert core.kv_bytes_active == 10 and core.counts["failed"] == 1


def test_stopped_admission_rejects_and_drain_waits_for_the_batch_job_to_end():
    core = SchedulerCore(rows_max=2, kv_budget_bytes=1000)
    _submit(core, 1)
    core.handle(StopAdmission(), 0)
    assert _of(_submit(core, 2), Rejected) == [Rejected(request_id=2, reason="the server is shutting down")]
    assert _of(core.handle(AwaitDrained(waiter_id=9), 0), Drained) == []
    assert _of(_finish(core, 1), Drained) == [], "the batch job has not ended yet"
    assert _of(core.handle(BatchEnded(batch_id=1), 0), Drained) == [Drained(waiter_id=9)]
    assert not core.busy


def test_admission_and_ends_are_journaled():
    core = SchedulerCore(rows_max=2, kv_budget_bytes=1000)
    kinds = [e.event.kind for e in _submit(core, 1) + _finish(core, 1) if isinstance(e, JournalEvent)]
    assert kinds == ["request.admitted", "request.finished"]


@pytest.mark.parametrize(
    "message",
    [
        RowFinished(request_id=1, outcome="completed", completion_tokens=1),
        BatchEnded(batch_id=1),
    ],
)
def test_results_in_the_idle_state_are_illegal_transitions(message):
    core = SchedulerCore(rows_max=2, kv_budget_bytes=1000)
    with pytest.raises(IllegalTransition, match="IDLE"):
        core.handle(message, 0)


def test_protocol_bugs_are_illegal_transitions_and_leave_the_core_unchanged():
    core = SchedulerCore(rows_max=2, kv_budget_bytes=1000)
    _submit(core, 1)
    before = core.stats()
    with pytest.raises(IllegalTransition, match="already held"):
        _submit(core, 1)
    with pytest.raises(IllegalTransition, match="not active"):
        _finish(core, 7)
    with pytest.raises(IllegalTransition, match="batch 3"):
        core.handle(BatchEnded(batch_id=3), 0)
    assert core.stats() == before


def test_a_bad_configuration_is_a_usage_error():
    with pytest.raises(UsageError):
        SchedulerCore(rows_max=0, kv_budget_bytes=10)
    with pytest.raises(UsageError):
        SchedulerCore(rows_max=2, kv_budget_bytes=-1)


class SchedulerMachine(RuleBasedStateMachine):
    """Drives the core as its shell and engine would, in any order they can."""

    def __init__(self) -> None:
        super().__init__()
        self.core = SchedulerCore(rows_max=3, kv_budget_bytes=100)
        self.next_id = 0
        self.submitted: list[int] = []
        self.kv_bytes: dict[int, int] = {}
        self.admission_order: list[int] = []
        self.ended: dict[int, int] = {}
        self.engine_rows: set[int] = set()
        self.end_sent: int | None = None

    def _apply(self, message) -> None:
        was_busy = self.core.busy
        effects = self.core.handle(message, 0)
        assert any(isinstance(e, WentIdle) for e in effects) == (was_busy and not self.core.busy), (
            "the Gateway hears exactly when the lane stops being busy, or its held-back steps never start"
        )
        for effect in effects:
            if isinstance(effect, AdmitRow):
                assert effect.batch_id == self.core.batch_id
                self.admission_order.append(effect.request_id)
                self.engine_rows.add(effect.request_id)
            elif isinstance(effect, EndBatch):
                assert not self.engine_rows, "a batch ended with rows on the engine"
                self.end_sent = effect.batch_id
            elif isinstance(effect, (Rejected, Withdrawn, RowAborted)):
                self.engine_rows.discard(effect.request_id)
                self._end(effect.request_id)

    def _end(self, request_id: int) -> None:
        self.ended[request_id] = self.ended.get(request_id, 0) + 1

    @rule(kv_bytes=st.sampled_from([10, 40, 70, 150]))
    def submit(self, kv_bytes):
        self.next_id += 1
        self.submitted.append(self.next_id)
        self.kv_bytes[self.next_id] = kv_bytes
        self._apply(Submit(request_id=self.next_id, prompt_tokens=1, kv_bytes=kv_bytes))

    @precondition(lambda self: self.engine_rows)
    @rule(data=st.data(), outcome=st.sampled_from(["completed", "cancelled", "failed"]))
    def a_row_finishes(self, data, outcome):
        request_id = data.draw(st.sampled_from(sorted(self.engine_rows)))
        self.engine_rows.discard(request_id)
        self._end(request_id)
        self._apply(RowFinished(request_id=request_id, outcome=outcome, completion_tokens=1))

    @precondition(lambda self: self.submitted)
    @rule(data=st.data())
    def a_client_leaves(self, data):
        self._apply(Cancel(request_id=data.draw(st.sampled_from(self.submitted))))

    @precondition(lambda self: self.end_sent is not None)
    @rule()
    def the_batch_job_ends(self):
        batch_id, self.end_sent = self.end_sent, None
        self._apply(BatchEnded(batch_id=batch_id))

    @precondition(lambda self: self.core.state is BatchState.RUNNING)
    @rule()
    def the_batch_job_fails(self):
        # Its rows are gone from the engine; rows admitted by the BatchEnded belong to the next batch.
        self.engine_rows.clear()
        self._apply(BatchEnded(batch_id=self.core.batch_id, error="engine error"))

    @rule()
    def stop_admission(self):
        self._apply(StopAdmission())

    @invariant()
    def the_padded_budget_holds_unless_one_oversize_row_runs_alone(self):
        active = self.core.active
        assert len(active) <= self.core.rows_max
        assert self.core.kv_bytes_active == len(active) * max((self.kv_bytes[i] for i in active), default=0)
        assert self.core.kv_bytes_active <= self.core.kv_budget_bytes or len(active) == 1

    @invariant()
    def rows_are_admitted_in_submission_order(self):
        assert self.admission_order == sorted(self.admission_order)

    @invariant()
    def admission_is_work_conserving(self):
        if self.core.waiting and self.core.state is BatchState.RUNNING:
            assert self.core.active, "requests wait while the batch is empty"

    @invariant()
    def nothing_ends_twice(self):
        assert all(count == 1 for count in self.ended.values()), self.ended

    def teardown(self):
        for _ in range(len(self.submitted) + 2):
            for request_id in sorted(self.engine_rows):
                self.engine_rows.discard(request_id)
                self._end(request_id)
                self._apply(RowFinished(request_id=request_id, outcome="completed", completion_tokens=1))
            if self.end_sent is not None:
                self.the_batch_job_ends()
        assert sorted(self.ended) == self.submitted, "every submitted request ends"
        self.nothing_ends_twice()
        assert self.core.state is BatchState.IDLE and not self.core.busy


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
