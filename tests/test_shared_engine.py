"""One engine thread for several models (engine/shared_engine.py): per-model FIFOs served round robin."""

from __future__ import annotations

import queue
import threading

from polling import wait_until_sync

from kvcellar.engine.batch import BatchLoop
from kvcellar.engine.engine import StreamTurns
from kvcellar.engine.shared_engine import SharedEngineThread


class NoBufferCache:
    def cache_bytes(self) -> int:
        return 0

    def clear_cache(self) -> None:
        pass


def test_models_with_waiting_work_take_turns_and_each_keeps_its_own_order():
    engine = SharedEngineThread(buffer_cache=NoBufferCache())
    ran: list[str] = []
    gate = threading.Event()

    # The first job holds the thread until every other job is queued, so the order is the scheduler's alone.
    def hold() -> None:
        gate.wait()

    engine.submit("a", hold)
    for i in range(6):
        engine.submit("a", lambda i=i: ran.append(f"a{i}"))
    for i in range(2):
        engine.submit("b", lambda i=i: ran.append(f"b{i}"))
    for i in range(2):
        engine.submit("c", lambda i=i: ran.append(f"c{i}"))
    engine.start()
    gate.set()
    engine.stop()
    assert not engine.thread.is_alive()
    # After a's gate job: b, c, a, b, c, a, then a's backlog; never two of a's while b or c waits.
    assert ran == ["b0", "c0", "a0", "b1", "c1", "a1", "a2", "a3", "a4", "a5"]
    assert engine.jobs_run == {"a": 7, "b": 2, "c": 2}


def test_stop_runs_what_is_queued_first():
    engine = SharedEngineThread(buffer_cache=NoBufferCache())
    ran: list[int] = []
    engine.start()
    for i in range(5):
        engine.submit("m", lambda i=i: ran.append(i))
    engine.stop()
    assert ran == [0, 1, 2, 3, 4]


class EndlessStream:
    """Model a's batch job as the engine thread drives it: a stream whose rows keep coming until `stop` is set,
    parking whenever the shared thread says another model waits."""

    def __init__(self, engine: SharedEngineThread) -> None:
        self.stop = threading.Event()
        self.delivered: list[tuple[str, object]] = []
        self.closed = False
        self.turns = StreamTurns(self._steps, threading.Event(), self._deliver, lambda: engine.others_waiting("a"))

    def _steps(self):
        step = 0
        try:
            while not self.stop.is_set():
                step += 1
                yield step
        finally:
            self.closed = True

    def _deliver(self, kind: str, value: object) -> None:
        self.delivered.append((kind, value))

    def steps(self) -> int:
        return sum(kind == "item" for kind, _ in self.delivered)


def test_a_never_ending_stream_gives_the_thread_to_another_models_job_between_two_steps():
    engine = SharedEngineThread(buffer_cache=NoBufferCache())
    stream = EndlessStream(engine)
    ran: list[str] = []
    engine.start()
    engine.submit("a", stream.turns.run)
    engine.submit("a", lambda: ran.append("a-after-stream"))
    wait_until_sync(lambda: stream.steps() >= 3, what="model a's stream stepped")
    b_ran = threading.Event()
    steps_before_b: list[int] = []

    def model_b_job() -> None:
        steps_before_b.append(stream.steps())
        ran.append("b")
        b_ran.set()

    engine.submit("b", model_b_job)
    assert b_ran.wait(30), "model b's job waited behind model a's endless stream"
    (steps_at_b,) = steps_before_b
    # a's stream goes on after b's job, from where it parked (its generator was neither closed nor restarted).
    wait_until_sync(lambda: stream.steps() >= steps_at_b + 3, what="model a's stream resumed")
    assert not stream.closed and [value for _, value in stream.delivered[:6]] == [1, 2, 3, 4, 5, 6]
    stream.stop.set()
    engine.stop()
    assert stream.closed and stream.delivered[-1] == ("end", None)
    # a's own later job waited for its stream's end: parking never reorders a model's jobs.
    assert ran == ["b", "a-after-stream"]
    assert engine.engine_yields == {"a": 1}
    assert engine.jobs_run == {"a": 2, "b": 1}


def test_a_stream_alone_on_the_thread_never_parks():
    engine = SharedEngineThread(buffer_cache=NoBufferCache())
    stream = EndlessStream(engine)
    engine.submit("a", stream.turns.run)
    engine.submit("a", stream.stop.set)  # a's own job waits behind its stream: no other model, no parking
    engine.start()
    wait_until_sync(lambda: stream.steps() >= 50, what="model a's stream stepped")
    assert engine.engine_yields == {}
    stream.stop.set()
    engine.stop()
    assert engine.jobs_run == {"a": 2}


def test_an_idle_batch_loop_stops_waiting_for_rows_while_another_model_waits():
    others_waiting = threading.Event()
    loop = BatchLoop(None, queue.Queue(), rows_max=4, cancelled=threading.Event(), turn_wanted=others_waiting.is_set)
    others_waiting.set()
    events: list = []
    # No row and an empty inbox: instead of waiting for rows it yields an (empty) step, where its stream parks.
    assert loop._take_rows(events) and events == []
    others_waiting.clear()
    loop.cancelled.set()
    assert not loop._take_rows(events)
