"""SpillQueue (spec §5.5): the core against the spec's rules under random
traffic, and the Trio shell with a mock clock and fake writers."""

from __future__ import annotations

import itertools
import logging
import weakref
from collections import Counter

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcellar.actors.runtime import JournalEvent
from kvcellar.actors.spill_queue import BYTES_MAX_DEFAULT, GIB, REFUSED, SpillQueue, bytes_max_from_env
from kvcellar.actors.spill_queue_core import (
    KINDS,
    AwaitIdle,
    Dispatch,
    Enqueue,
    QueueState,
    Release,
    Settled,
    Shutdown,
    SpillQueueCore,
    Wake,
    WriteResult,
)
from kvcellar.errors import IllegalTransition, UsageError
from kvcellar.serialization import from_cbor, to_cbor
from kvcellar.store.actor_events import SpillDispatched, SpillDropped, SpillEnqueued, SpillSettled
from kvcellar.store.events import EVENT_TYPES
from kvcellar.store.prompt_cache import SpillSnapshot


class SpillQueueRules(RuleBasedStateMachine):
    """Drives `SpillQueueCore` directly and checks every effect against a
    model of the spec: FIFO, one in flight, oldest-non-newest drops."""

    @initialize(bytes_max=st.sampled_from([0, 1, 100, 250, 1000]) | st.integers(0, 3000))
    def start(self, bytes_max: int) -> None:
        self.core = SpillQueueCore(bytes_max)
        self.bytes_max = bytes_max
        self.queue: list[Enqueue] = []  # the model's FIFO
        self.in_flight: Enqueue | None = None
        self.closed = False
        self.ids = itertools.count(1)
        self.waiter_ids = itertools.count(1)
        self.waiting: set[int] = set()
        self.enqueued: list[int] = []
        self.dispatched: list[int] = []
        self.released: set[int] = set()
        self.settled: dict[int, str] = {}

    def _total_bytes(self) -> int:
        return sum(i.bytes for i in self.queue) + (self.in_flight.bytes if self.in_flight else 0)

    def _take_settle(self, effects: list, at: int, newest: int | None) -> int:
        """Check one settle group (Release, Settled, journal) at `at`; return the next index."""
        release, settled, journal = effects[at : at + 3]
        assert isinstance(release, Release) and isinstance(settled, Settled) and isinstance(journal, JournalEvent)
        item_id = release.item_id
        assert settled.item_id == item_id and journal.event.item_id == item_id
        assert item_id not in self.released and item_id not in self.settled, "settled twice"
        self.released.add(item_id)
        self.settled[item_id] = settled.outcome
        if settled.outcome == "dropped":
            assert isinstance(journal.event, SpillDropped)
            self._model_drop(item_id, journal.event.reason, newest)
        else:
            assert isinstance(journal.event, SpillSettled) and journal.event.outcome == settled.outcome
            assert self.in_flight is not None and self.in_flight.item_id == item_id
            self.in_flight = None
        return at + 3

    def _model_drop(self, item_id: int, reason: str, newest: int | None) -> None:
        if reason == "byte_cap":
            assert self._total_bytes() > self.bytes_max, "dropped while under the cap"
            assert self.queue[0].item_id == item_id, "the victim is not the oldest queued item"
            assert item_id != newest, "the item just enqueued was its own victim"
            self.queue.pop(0)
        elif reason == "shutdown":
            if self.in_flight is not None and self.in_flight.item_id == item_id:
                self.in_flight = None
            else:
                assert self.queue[0].item_id == item_id
                self.queue.pop(0)
        else:
            assert reason == "closed" and self.closed and item_id == newest

    def _check(self, effects: list, newest: int | None = None) -> list[int]:
        """Walk the effects in order against the model; return the woken waiters."""
        woken, at = [], 0
        while at < len(effects):
            effect = effects[at]
            if isinstance(effect, Release):
                at = self._take_settle(effects, at, newest)
            elif isinstance(effect, JournalEvent) and isinstance(effect.event, SpillDispatched):
                dispatch = effects[at + 1]
                assert isinstance(dispatch, Dispatch) and dispatch.item_id == effect.event.item_id
                assert self.in_flight is None, "two items in flight"
                assert self.queue and self.queue[0].item_id == dispatch.item_id, "dispatch is not FIFO"
                self.in_flight = self.queue.pop(0)
                self.dispatched.append(dispatch.item_id)
                at += 2
            elif isinstance(effect, Wake):
                woken.append(effect.waiter_id)
                at += 1
            else:
                raise AssertionError(f"unexpected effect {effect!r} at {at}")
        if woken:
            assert self.in_flight is None and not self.queue, "Wake while not idle"
        return woken

    @rule(size=st.integers(0, 600), kind=st.sampled_from(KINDS))
    def enqueue(self, size: int, kind: str) -> None:
        msg = Enqueue(item_id=next(self.ids), bytes=size, kind=kind)
        effects = self.core.handle(msg, 0.0)
        self.enqueued.append(msg.item_id)
        if self.closed:
            assert self._check(effects, newest=msg.item_id) == []
            assert self.settled[msg.item_id] == "dropped"
            return
        assert effects[0] == JournalEvent(event=SpillEnqueued(item_id=msg.item_id, bytes=size, spill_kind=kind))
        self.queue.append(msg)
        assert self._check(effects[1:], newest=msg.item_id) == []
        assert self.in_flight is not None, "an enqueue left the queue without a write in flight"
        only_newest_queued = all(i.item_id == msg.item_id for i in self.queue)
        assert self._total_bytes() <= self.bytes_max or only_newest_queued

    @precondition(lambda self: self.in_flight is not None)
    @rule(outcome=st.sampled_from(["stored", "failed"]))
    def write_result(self, outcome: str) -> None:
        assert self.in_flight is not None
        had_queued = bool(self.queue)
        effects = self.core.handle(WriteResult(item_id=self.in_flight.item_id, outcome=outcome), 0.0)
        woken = self._check(effects)
        assert (self.in_flight is not None) == had_queued, "neither dispatched the next nor went idle"
        if self.in_flight is None:
            assert set(woken) == self.waiting, "idle but not every waiter woke"
            self.waiting.clear()

    @rule(item_id=st.integers(0, 50))
    def write_result_for_an_item_not_in_flight(self, item_id: int) -> None:
        if self.in_flight is not None and item_id == self.in_flight.item_id:
            item_id = -1
        before = self.core.stats()
        with pytest.raises(IllegalTransition, match=self.core.state.name):
            self.core.handle(WriteResult(item_id=item_id, outcome="stored"), 0.0)
        assert self.core.stats() == before

    @rule()
    def await_idle(self) -> None:
        waiter_id = next(self.waiter_ids)
        effects = self.core.handle(AwaitIdle(waiter_id=waiter_id), 0.0)
        if self.in_flight is None and not self.queue:
            assert effects == [Wake(waiter_id=waiter_id)]
        else:
            assert effects == []
            self.waiting.add(waiter_id)

    @precondition(lambda self: not self.closed)
    @rule()
    def shutdown(self) -> None:
        effects = self.core.handle(Shutdown(), 0.0)
        self.closed = True
        assert set(self._check(effects)) == self.waiting
        self.waiting.clear()
        assert self.core.state is QueueState.CLOSED

    @invariant()
    def at_most_one_in_flight_and_counters_agree(self) -> None:
        stats = self.core.stats()
        outcomes = Counter(self.settled.values())
        assert stats["in_flight"] == (self.in_flight is not None) <= 1
        assert stats["pending"] == len(self.queue) + stats["in_flight"]
        assert stats["pending_bytes"] == self._total_bytes()
        assert stats["enqueued"] == len(self.enqueued)
        assert (stats["stored"], stats["failed"], stats["dropped"]) == (
            outcomes["stored"],
            outcomes["failed"],
            outcomes["dropped"],
        )
        assert stats["enqueued"] == stats["stored"] + stats["failed"] + stats["dropped"] + stats["pending"]
        assert self.released == set(self.settled)
        assert (self.core.state is QueueState.BUSY) == (self.in_flight is not None)
        assert self.dispatched == sorted(self.dispatched), "dispatch order is not FIFO"

    def teardown(self) -> None:
        if not hasattr(self, "core"):
            return
        while self.in_flight is not None:
            self.write_result("stored")
        assert set(self.settled) == set(self.enqueued), "some item never settled"


SpillQueueRules.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_core_follows_the_spill_queue_rules = SpillQueueRules.TestCase


def test_write_result_when_idle_names_the_state() -> None:
    core = SpillQueueCore(100)
    with pytest.raises(IllegalTransition, match="IDLE"):
        core.handle(WriteResult(item_id=1, outcome="stored"), 0.0)


def test_enqueue_of_an_id_already_held_is_illegal() -> None:
    core = SpillQueueCore(100)
    core.handle(Enqueue(item_id=1, bytes=10, kind="evict"), 0.0)
    with pytest.raises(IllegalTransition, match="BUSY"):
        core.handle(Enqueue(item_id=1, bytes=10, kind="evict"), 0.0)


def test_messages_reject_unknown_kinds_and_outcomes() -> None:
    with pytest.raises(ValueError):
        Enqueue(item_id=1, bytes=1, kind="bogus")
    with pytest.raises(ValueError):
        Enqueue(item_id=1, bytes=-1, kind="evict")
    with pytest.raises(ValueError):
        WriteResult(item_id=1, outcome="dropped")


def test_spill_events_are_registered_and_round_trip_through_cbor() -> None:
    events = [
        SpillEnqueued(item_id=1, bytes=10, spill_kind="evict"),
        SpillDropped(item_id=1, bytes=10, spill_kind="demote", reason="byte_cap"),
        SpillDispatched(item_id=2, bytes=20, spill_kind="write-behind"),
        SpillSettled(item_id=2, bytes=20, spill_kind="oversize", outcome="failed"),
    ]
    for event in events:
        assert EVENT_TYPES[event.kind] is type(event)
        assert from_cbor(to_cbor(event), type(event)) == event
    assert [e.kind for e in events] == ["spill.enqueued", "spill.dropped", "spill.dispatched", "spill.settled"]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, 2 * GIB),
        ("", 2 * GIB),
        ("0", 0),
        ("1.5", 3 * GIB // 2),
        (" 4 ", 4 * GIB),
    ],
)
def test_bytes_max_from_env_reads_gib(raw: str | None, expected: int) -> None:
    environ = {} if raw is None else {"KVCELLAR_SSD_SPILL_QUEUE_GB": raw}
    assert bytes_max_from_env(environ) == expected
    assert BYTES_MAX_DEFAULT == 2 * 2**30


@pytest.mark.parametrize("raw", ["two", "-1", "nan", "inf"])
def test_bytes_max_from_env_rejects_bad_values(raw: str) -> None:
    with pytest.raises(UsageError, match="KVCELLAR_SSD_SPILL_QUEUE_GB"):
        bytes_max_from_env({"KVCELLAR_SSD_SPILL_QUEUE_GB": raw})


# The Trio shell.


class Dummy:
    """Stands in for an MLX array view: weakref-able, so release is provable."""


def make_snapshot(size: int, refs: dict[str, weakref.ref], name: str, reason: str = "evict") -> SpillSnapshot:
    """A snapshot whose only strong reference is the one returned."""
    dummy = Dummy()
    refs[name] = weakref.ref(dummy)
    return SpillSnapshot(namespace="", tokens=(len(refs),), caches=[dummy], bytes=size, reason=reason)


class FakeWriter:
    """Sleeps `delay_s` per write and records concurrency and order (by tokens,
    never by holding the snapshot)."""

    def __init__(self, delay_s: float = 1.0, outcome: str = "stored", raise_for: tuple[int, ...] = ()) -> None:
        self.delay_s, self.outcome, self.raise_for = delay_s, outcome, raise_for
        self.active = self.max_active = 0
        self.written: list[tuple[int, ...]] = []

    async def __call__(self, snapshot: SpillSnapshot) -> str:
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await trio.sleep(self.delay_s)
        finally:
            self.active -= 1
        self.written.append(snapshot.tokens)
        if snapshot.tokens in self.raise_for:
            raise OSError(28, "No space left on device")
        return self.outcome


def run_with_mock_clock(main) -> None:
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def submit_into(queue: SpillQueue, outcomes: dict[str, str], refs: dict, name: str, size: int) -> None:
    outcomes[name] = await queue.submit(make_snapshot(size, refs, name))


def test_writes_run_one_at_a_time_in_submission_order() -> None:
    writer, outcomes, refs = FakeWriter(delay_s=1.0), {}, {}

    async def main() -> None:
        queue = SpillQueue(writer, bytes_max=10_000)
        async with trio.open_nursery() as nursery:
            await nursery.start(queue.run)
            for name in "abcde":
                nursery.start_soon(submit_into, queue, outcomes, refs, name, 100)
                await trio.sleep(0.01)
            await queue.wait_idle()
            assert trio.current_time() == pytest.approx(5.0, abs=0.1)
            assert queue.stats()["stored"] == 5 and queue.stats()["held"] == 0
            nursery.cancel_scope.cancel()

    run_with_mock_clock(main)
    assert writer.max_active == 1
    assert writer.written == [(1,), (2,), (3,), (4,), (5,)]
    assert outcomes == dict.fromkeys("abcde", "stored")
    assert all(ref() is None for ref in refs.values())


def test_cap_overflow_drops_the_oldest_queued_and_releases_it_at_once() -> None:
    writer, outcomes, refs = FakeWriter(delay_s=10.0), {}, {}

    async def main() -> None:
        queue = SpillQueue(writer, bytes_max=250)
        async with trio.open_nursery() as nursery:
            await nursery.start(queue.run)
            for name in "abc":  # a goes in flight; c's arrival puts 300 bytes over 250
                nursery.start_soon(submit_into, queue, outcomes, refs, name, 100)
                await trio.sleep(0.01)
            await trio.sleep(1.0)
            assert trio.current_time() < 10.0, "a's write is still in flight"
            assert outcomes == {"b": "dropped"}
            assert refs["b"]() is None, "the dropped snapshot is still referenced"
            assert refs["a"]() is not None and refs["c"]() is not None
            assert queue.stats()["pending_bytes"] == 200
            await queue.wait_idle()
            nursery.cancel_scope.cancel()

    run_with_mock_clock(main)
    assert outcomes == {"a": "stored", "b": "dropped", "c": "stored"}
    assert writer.written == [(1,), (3,)]


def test_zero_cap_keeps_only_the_newest_and_the_in_flight_item() -> None:
    writer, refs, ids = FakeWriter(delay_s=5.0), {}, {}

    async def main() -> None:
        queue = SpillQueue(writer, bytes_max=0)
        async with trio.open_nursery() as nursery:
            await nursery.start(queue.run)
            for name in "abcd":
                ids[name] = queue.submit_nowait(make_snapshot(10, refs, name))
                await trio.sleep(0.01)
            assert [name for name, ref in refs.items() if ref() is not None] == ["a", "d"]
            assert queue.stats()["dropped"] == 2 and queue.stats()["pending"] == 2
            await queue.wait_idle()
            nursery.cancel_scope.cancel()

    run_with_mock_clock(main)
    assert writer.written == [(1,), (4,)]


def test_a_raising_writer_settles_failed_logs_and_the_queue_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    writer, outcomes, refs = FakeWriter(delay_s=1.0, raise_for=((1,),)), {}, {}

    async def main() -> None:
        queue = SpillQueue(writer, bytes_max=10_000)
        async with trio.open_nursery() as nursery:
            await nursery.start(queue.run)
            await submit_into(queue, outcomes, refs, "a", 100)
            await submit_into(queue, outcomes, refs, "b", 100)
            stats = queue.stats()
            assert (stats["failed"], stats["stored"], stats["held"]) == (1, 1, 0)
            nursery.cancel_scope.cancel()

    with caplog.at_level(logging.ERROR, logger="kvcellar.actors.spill_queue"):
        run_with_mock_clock(main)
    assert outcomes == {"a": "failed", "b": "stored"}
    assert refs["a"]() is None and refs["b"]() is None
    assert "No space left on device" in caplog.text


def test_a_writer_returning_nonsense_counts_as_failed() -> None:
    outcomes, refs = {}, {}

    async def main() -> None:
        queue = SpillQueue(FakeWriter(outcome="maybe"), bytes_max=10_000)
        async with trio.open_nursery() as nursery:
            await nursery.start(queue.run)
            await submit_into(queue, outcomes, refs, "a", 100)
            nursery.cancel_scope.cancel()

    run_with_mock_clock(main)
    assert outcomes == {"a": "failed"}


def test_wait_idle_returns_at_once_when_idle_and_after_the_last_write_otherwise() -> None:
    async def main() -> None:
        queue = SpillQueue(FakeWriter(delay_s=2.0), bytes_max=10_000)
        async with trio.open_nursery() as nursery:
            await nursery.start(queue.run)
            await queue.wait_idle()
            assert trio.current_time() == 0.0
            refs: dict = {}
            for name in "abc":
                queue.submit_nowait(make_snapshot(100, refs, name))
            await queue.wait_idle()
            assert trio.current_time() == pytest.approx(6.0)
            assert queue.stats()["pending"] == 0 and queue.stats()["stored"] == 3
            nursery.cancel_scope.cancel()

    run_with_mock_clock(main)


def test_shutdown_releases_queued_and_in_flight_snapshots_as_dropped() -> None:
    outcomes, refs = {}, {}
    queue = SpillQueue(FakeWriter(delay_s=100.0), bytes_max=10_000)

    async def main() -> None:
        async with trio.open_nursery() as outer:
            async with trio.open_nursery() as nursery:
                await nursery.start(queue.run)
                outer.start_soon(submit_into, queue, outcomes, refs, "a", 100)
                await trio.sleep(0.01)
                queue.submit_nowait(make_snapshot(100, refs, "b"))
                await trio.sleep(1.0)
                queue.submit_nowait(make_snapshot(100, refs, "c"))  # still in the channel at the cancel
                nursery.cancel_scope.cancel()
            assert queue.stats()["held"] == 0
            await queue.wait_idle()  # returns at once once stopped

    run_with_mock_clock(main)
    assert outcomes == {"a": "dropped"}
    assert all(ref() is None for ref in refs.values())
    stats = queue.stats()
    assert (stats["enqueued"], stats["dropped"], stats["pending"], stats["held"]) == (3, 3, 0, 0)


def test_submit_after_close_is_dropped_without_being_held() -> None:
    outcomes, refs = {}, {}

    async def main() -> None:
        queue = SpillQueue(FakeWriter(), bytes_max=10_000)
        async with trio.open_nursery() as nursery:
            await nursery.start(queue.run)
            queue.close()
        queue.submit_nowait(make_snapshot(100, refs, "a"))
        await submit_into(queue, outcomes, refs, "b", 100)
        assert queue.stats()["held"] == 0

    run_with_mock_clock(main)
    assert outcomes == {"b": "dropped"}
    assert refs["a"]() is None and refs["b"]() is None


def test_submit_nowait_refuses_an_unknown_reason_before_taking_ownership() -> None:
    queue = SpillQueue(FakeWriter(), bytes_max=10_000)
    with pytest.raises(UsageError, match="bogus"):
        queue.submit_nowait(make_snapshot(100, {}, "a", reason="bogus"))
    assert queue.stats()["held"] == 0 and queue.stats()["enqueued"] == 0


def test_the_shell_journals_each_step_of_an_item() -> None:
    class ListJournal:
        def __init__(self) -> None:
            self.kinds: list[tuple[str, str]] = []

        def append(self, event, *, actor: str = "") -> int:
            self.kinds.append((actor, event.kind))
            return len(self.kinds)

    journal = ListJournal()

    async def main() -> None:
        queue = SpillQueue(FakeWriter(), bytes_max=10_000, journal=journal, name="spill")
        async with trio.open_nursery() as nursery:
            await nursery.start(queue.run)
            await queue.submit(make_snapshot(100, {}, "a", reason="write-behind"))
            nursery.cancel_scope.cancel()

    run_with_mock_clock(main)
    assert journal.kinds == [("spill", "spill.enqueued"), ("spill", "spill.dispatched"), ("spill", "spill.settled")]


def test_the_one_entrance_asks_admission_once_per_snapshot_and_refused_ones_never_enter() -> None:
    class Admission:
        def __init__(self) -> None:
            self.asked: list[tuple[tuple[int, ...], bool, bool]] = []

        def admits(self, snapshot: SpillSnapshot, *, forced: bool, covered: bool = False) -> bool:
            self.asked.append((snapshot.tokens, forced, covered))
            return forced

    admission, writer, refs = Admission(), FakeWriter(), {}
    covered_asked: list[str] = []

    def covered() -> bool:
        covered_asked.append("asked")
        return True

    async def main() -> None:
        queue = SpillQueue(writer, bytes_max=10_000, admission=admission)
        async with trio.open_nursery() as nursery:
            await nursery.start(queue.run)
            assert await queue.submit(make_snapshot(10, refs, "a", reason="write-behind")) == REFUSED
            assert queue.submit_nowait(make_snapshot(10, refs, "b"), covered=covered) is None
            assert await queue.submit(make_snapshot(10, refs, "c", reason="write-behind"), forced=True) == "stored"
            assert queue.stats()["enqueued"] == 1 and queue.stats()["held"] == 0
            nursery.cancel_scope.cancel()

    run_with_mock_clock(main)
    tokens = {"a": (1,), "b": (2,), "c": (3,)}  # make_snapshot's tokens: the refs made so far
    assert admission.asked == [(tokens["a"], False, False), (tokens["b"], False, True), (tokens["c"], True, False)]
    assert covered_asked == ["asked"]
    assert writer.written == [tokens["c"]]
    assert refs["a"]() is None and refs["b"]() is None, "a refused snapshot is not held"


def test_without_admission_the_entrance_never_asks_whether_a_spill_is_covered() -> None:
    def covered() -> bool:
        raise AssertionError("covered() asked without admission")

    async def main() -> None:
        queue = SpillQueue(FakeWriter(), bytes_max=10_000)
        async with trio.open_nursery() as nursery:
            await nursery.start(queue.run)
            assert queue.submit_nowait(make_snapshot(10, {}, "a"), covered=covered) == 1
            await queue.wait_idle()
            nursery.cancel_scope.cancel()

    run_with_mock_clock(main)
