"""One engine thread for several models (engine/shared_engine.py): per-model FIFOs served round robin."""

from __future__ import annotations

import threading

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
    engine.submit("a", gate.wait)
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
