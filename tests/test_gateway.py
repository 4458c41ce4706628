"""The gateway core: one lane, FIFO requests, background work only when idle."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcellar.actors.gateway_core import (
    LANE_BATCH,
    AwaitDrained,
    Drained,
    GatewayCore,
    Generate,
    GenerationFinished,
    Lane,
    OtherLaneIdle,
    Rejected,
    RunStep,
    RunWhenIdle,
    StartGeneration,
    StepFinished,
    StopAdmission,
    Withdraw,
)
from kvcellar.errors import IllegalTransition


def _starts(effects):
    return [e for e in effects if isinstance(e, (StartGeneration, RunStep))]


def test_requests_run_one_at_a_time_in_arrival_order():
    core = GatewayCore()
    assert _starts(core.handle(Generate(request_id=1, prompt_tokens=5), 0)) == [StartGeneration(request_id=1)]
    assert _starts(core.handle(Generate(request_id=2, prompt_tokens=5), 0)) == []
    assert _starts(core.handle(Generate(request_id=3, prompt_tokens=5), 0)) == []
    done = GenerationFinished(request_id=1, completion_tokens=3, outcome="completed")
    assert _starts(core.handle(done, 0)) == [StartGeneration(request_id=2)]


def test_background_step_waits_while_a_request_is_active_or_waiting():
    core = GatewayCore()
    core.handle(Generate(request_id=1, prompt_tokens=5), 0)
    core.handle(Generate(request_id=2, prompt_tokens=5), 0)
    assert _starts(core.handle(RunWhenIdle(step_id=10), 0)) == []
    assert core.busy
    after_first = core.handle(GenerationFinished(request_id=1, completion_tokens=1, outcome="completed"), 0)
    assert _starts(after_first) == [StartGeneration(request_id=2)], "a waiting request goes before background work"
    after_second = core.handle(GenerationFinished(request_id=2, completion_tokens=1, outcome="completed"), 0)
    assert _starts(after_second) == [RunStep(step_id=10)]
    assert not core.busy


def test_a_request_arriving_during_a_step_runs_before_the_next_step():
    core = GatewayCore()
    core.handle(RunWhenIdle(step_id=10), 0)
    core.handle(RunWhenIdle(step_id=11), 0)
    core.handle(Generate(request_id=1, prompt_tokens=5), 0)
    assert core.busy
    assert _starts(core.handle(StepFinished(step_id=10), 0)) == [StartGeneration(request_id=1)]
    done = core.handle(GenerationFinished(request_id=1, completion_tokens=1, outcome="completed"), 0)
    assert _starts(done) == [RunStep(step_id=11)]


def test_stopped_admission_rejects_and_drain_wakes_when_nothing_is_active():
    core = GatewayCore()
    core.handle(Generate(request_id=1, prompt_tokens=5), 0)
    core.handle(StopAdmission(), 0)
    assert core.handle(Generate(request_id=2, prompt_tokens=5), 0) == [
        Rejected(request_id=2, reason="the server is shutting down")
    ]
    assert not [e for e in core.handle(AwaitDrained(waiter_id=7), 0) if isinstance(e, Drained)]
    done = core.handle(GenerationFinished(request_id=1, completion_tokens=1, outcome="cancelled"), 0)
    assert Drained(waiter_id=7) in done


def test_the_batch_job_holds_the_lane_like_a_request_unjournaled_and_also_after_stop_admission():
    core = GatewayCore()
    core.handle(StopAdmission(), 0)
    started = core.handle(Generate(request_id=1, prompt_tokens=0, lane=LANE_BATCH), 0)
    assert started == [StartGeneration(request_id=1)], "no journal event: the Scheduler journals its rows"
    assert core.state is Lane.BATCHING and core.busy
    assert _starts(core.handle(RunWhenIdle(step_id=10), 0)) == [], "background work waits for the batch"
    after = core.handle(GenerationFinished(request_id=1, completion_tokens=7, outcome="completed"), 0)
    assert after == [RunStep(step_id=10)]


def test_a_step_waits_for_rows_the_other_lane_holds_before_their_batch_job_queues_here():
    scheduler_rows = {"busy": True}
    core = GatewayCore(other_lane_busy=lambda: scheduler_rows["busy"])
    assert _starts(core.handle(RunWhenIdle(step_id=10), 0)) == [], "a row waits for its batch job"
    assert _starts(core.handle(OtherLaneIdle(), 0)) == [], "a stale word changes nothing while rows remain"
    started = core.handle(Generate(request_id=1, prompt_tokens=0, lane=LANE_BATCH), 0)
    assert _starts(started) == [StartGeneration(request_id=1)]
    ended = core.handle(GenerationFinished(request_id=1, completion_tokens=3, outcome="completed"), 0)
    assert _starts(ended) == [], "a row arrived while the batch was ending: it waits for the next batch"
    scheduler_rows["busy"] = False
    assert _starts(core.handle(OtherLaneIdle(), 0)) == [RunStep(step_id=10)]


def test_a_withdrawn_request_leaves_the_queue_or_releases_the_lane_it_was_given():
    core = GatewayCore()
    core.handle(Generate(request_id=1, prompt_tokens=5), 0)
    core.handle(Generate(request_id=2, prompt_tokens=5), 0)
    core.handle(Generate(request_id=3, prompt_tokens=5), 0)
    # Queued: it leaves the queue, journaled as cancelled; the running request keeps the lane.
    assert _starts(core.handle(Withdraw(request_id=2), 0)) == []
    assert list(core.waiting) == [3] and core.running == 1
    done = GenerationFinished(request_id=1, completion_tokens=3, outcome="completed")
    assert _starts(core.handle(done, 0)) == [StartGeneration(request_id=3)]
    # Given the lane as its caller left: the lane is released at once, a drain wakes.
    core.handle(AwaitDrained(waiter_id=9), 0)
    assert Drained(waiter_id=9) in core.handle(Withdraw(request_id=3), 0)
    assert (core.state, core.running, core.busy) == (Lane.IDLE, None, False)
    # One it no longer holds: nothing.
    assert core.handle(Withdraw(request_id=1), 0) == []


def test_a_result_for_work_that_is_not_running_is_an_illegal_transition():
    core = GatewayCore()
    with pytest.raises(IllegalTransition, match="IDLE"):
        core.handle(StepFinished(step_id=3), 0)


@given(st.lists(st.sampled_from(["request", "step", "finish"]), max_size=40))
def test_the_lane_never_runs_two_things_and_steps_never_run_while_busy(actions):
    core = GatewayCore()
    running = None
    next_id = 0
    for action in actions:
        next_id += 1
        if action == "request":
            effects = core.handle(Generate(request_id=next_id, prompt_tokens=1), 0)
        elif action == "step":
            effects = core.handle(RunWhenIdle(step_id=next_id), 0)
        elif running is None:
            continue
        else:
            kind, ident = running
            message = (
                GenerationFinished(request_id=ident, completion_tokens=1, outcome="completed")
                if kind == "generate"
                else StepFinished(step_id=ident)
            )
            running = None
            effects = core.handle(message, 0)
        for effect in _starts(effects):
            assert running is None, "two things on the lane at once"
            if isinstance(effect, RunStep):
                assert not core.waiting, "background work while a request waits"
                running = ("step", effect.step_id)
            else:
                running = ("generate", effect.request_id)
