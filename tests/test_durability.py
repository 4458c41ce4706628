"""The DurabilityCoordinator (spec §5.6): the sans-IO core against a model of
the spec's rules, and the Trio shell with fake ports under a mock clock."""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcellar.actors.durability_core import (
    OUTCOMES,
    AdmissionGranted,
    AttemptDeferred,
    AttemptResult,
    CheckCoverage,
    CoverageChecked,
    Dirty,
    DrainQueue,
    DurabilityCore,
    DurabilitySettled,
    DurabilityState,
    Flush,
    FlushBegun,
    FlushTimedOut,
    FlushTimedOutRecorded,
    FlushVerdict,
    FlushVerdictRecorded,
    QueueDrained,
    RecordKey,
    RecordStatus,
    StartAttempt,
    tokens_hash,
)
from kvcellar.actors.durability_shell import DurabilityCoordinator
from kvcellar.actors.runtime import ArmTimer, CancelTimer, JournalEvent, TimerFired
from kvcellar.errors import IllegalTransition
from kvcellar.serialization import from_cbor, to_cbor
from kvcellar.store.events import EVENT_TYPES
from kvcellar.store.prompt_cache import SpillSnapshot

# -- the core against the spec's rules ----------------------------------------

KEYS = [
    RecordKey(namespace=namespace, tokens=tokens)
    for namespace, tokens in [("a", (1, 2, 3)), ("a", (1, 2, 4)), ("b", (1, 2, 3)), ("a", (1, 2))]
]
FLUSHING = {
    DurabilityState.FLUSH_SETTLING,
    DurabilityState.FLUSH_DRAINING,
    DurabilityState.FLUSH_FORCING,
    DurabilityState.FLUSH_RECHECK,
}


class CoreMachine(RuleBasedStateMachine):
    """Drives `DurabilityCore` with random puts, timer fires (stale ones too),
    attempt outcomes, flushes, flush timeouts (stale ones too) and coverage
    answers, playing the runtime and the shell, and checks every effect
    against the spec's rules."""

    def __init__(self) -> None:
        super().__init__()
        self.core = DurabilityCore(debounce_s=1.0, busy_rearm_s=5.0)
        self.now = 0.0
        self.timers: set[RecordKey] = set()
        self.attempts: dict[RecordKey, StartAttempt] = {}
        self.drain: int | None = None
        self.coverage: CheckCoverage | None = None
        self.flush_ids = itertools.count(1)
        self.asked: set[int] = set()
        self.verdicts: dict[int, FlushVerdict] = {}
        self.latest: dict[RecordKey, int] = {}  # the latest put version of each key
        self.satisfied: dict[RecordKey, int] = {}  # the highest version a stored/covered answer was for
        self.running: tuple[int, ...] = ()  # the flush ids of the run in progress
        self.owed: dict[int, dict[RecordKey, int]] = {}  # per flush: the latest versions put before its run began
        self.faults: dict[int, dict[str, int]] = {}  # per flush: dropped/failed answers since its run began
        self.scope: dict[int, frozenset[RecordKey]] = {}  # per flush: the keys with a record at its run's begin
        self.timed_out: set[int] = set()  # flushes answered "timeout" (never answered again)
        self.withdrawn: set[int] = set()  # timed out while queued: their run never begins
        self.late: dict[int, FlushVerdictRecorded] = {}  # the journaled outcomes of timed-out begun flushes

    # -- playing the runtime and the shell ----------------------------------------

    def deliver(self, msg: Any) -> None:
        for effect in self.core.handle(msg, self.now):
            self.carry_out(effect)

    def carry_out(self, effect: Any) -> None:
        state = self.core.state
        if isinstance(effect, ArmTimer):
            assert state is DurabilityState.RUNNING, "a flush arms no timer"
            self.timers.add(effect.key)
        elif isinstance(effect, CancelTimer):
            self.timers.discard(effect.key)
        elif isinstance(effect, StartAttempt):
            self.start_attempt(effect, state)
        elif isinstance(effect, DrainQueue):
            assert self.drain is None
            self.drain = effect.flush_id
        elif isinstance(effect, CheckCoverage):
            assert self.coverage is None and not self.attempts
            self.coverage = effect
        elif isinstance(effect, FlushVerdict):
            self.check_verdict(effect)
        elif isinstance(effect, JournalEvent) and isinstance(effect.event, DurabilitySettled):
            self.settled(effect.event)
        elif isinstance(effect, JournalEvent) and isinstance(effect.event, FlushVerdictRecorded):
            self.recorded(effect.event)
        elif isinstance(effect, JournalEvent) and isinstance(effect.event, FlushBegun):
            assert not set(effect.event.flush_ids) & self.withdrawn, "a withdrawn flush never begins"
            self.running = effect.event.flush_ids
            scope = frozenset(view.key for view in self.core.records())
            for flush_id in self.running:
                self.scope[flush_id] = scope
                self.owed[flush_id] = dict(self.latest)
                self.faults[flush_id] = {"dropped": 0, "failed": 0}
        else:
            assert isinstance(effect, JournalEvent), effect

    def settled(self, event: DurabilitySettled) -> None:
        """A flush's re-check found a missing record covered: its version is durable."""
        if event.outcome == "recheck_covered":
            key = next(k for k in KEYS if k.namespace == event.namespace and tokens_hash(k.tokens) == event.tokens_hash)
            self.satisfied[key] = max(self.satisfied.get(key, 0), event.version)

    def recorded(self, event: FlushVerdictRecorded) -> None:
        """Every flush of a run journals its outcome, a timed-out one included
        (it went on in the background): a durable one keeps its promise."""
        flush_id = event.flush_id
        assert flush_id in self.running
        if flush_id in self.timed_out:
            assert flush_id not in self.late
            self.late[flush_id] = event
            if event.durable:
                for key, version in self.owed[flush_id].items():
                    assert self.satisfied.get(key, 0) >= version, f"late durable, but {key} v{version} unstored"
        else:
            assert flush_id in self.verdicts, "the answer precedes the journaled outcome"
            assert event.durable == self.verdicts[flush_id].durable
        if flush_id == self.running[-1]:
            self.running = ()

    def start_attempt(self, effect: StartAttempt, state: DurabilityState) -> None:
        assert effect.key not in self.attempts, "at most one attempt in flight per key"
        if effect.forced:
            assert state is DurabilityState.FLUSH_FORCING
            assert not self.attempts, "a flush forces one record at a time"
        else:
            assert state is DurabilityState.RUNNING, "timers start no attempt during a flush"
        self.attempts[effect.key] = effect

    def check_verdict(self, verdict: FlushVerdict) -> None:
        flush_id = verdict.flush_id
        assert flush_id in self.asked and flush_id not in self.verdicts, "one verdict per flush"
        assert flush_id not in self.timed_out, "a flush answered 'timeout' is not answered again"
        self.verdicts[flush_id] = verdict
        faults = self.faults[flush_id]
        assert (verdict.dropped, verdict.failed) == (faults["dropped"], faults["failed"])
        assert not verdict.timed_out
        left = [view for view in self.core.records() if view.key in self.scope[flush_id]]
        missing = sum(view.status is RecordStatus.MISSING for view in left)
        skipped = sum(view.status is RecordStatus.SKIPPED for view in left)
        assert (verdict.pending, verdict.missing_uncovered) == (len(left) - missing - skipped, missing)
        assert verdict.skipped_by_admission == skipped
        assert not any(view.status is RecordStatus.HELD for view in left), "a flush forces held records"
        if verdict.durable:
            assert verdict.pending == verdict.dropped == verdict.failed == verdict.missing_uncovered == 0
            assert verdict.skipped_by_admission == 0
            assert verdict.reason == ""
            for key, version in self.owed[flush_id].items():
                assert self.satisfied.get(key, 0) >= version, f"durable, but {key} v{version} was never stored"
        else:
            assert verdict.reason in ("failed", "dropped", "missing", "skipped_by_admission", "pending")
            assert getattr(verdict, verdict.reason) > 0

    # -- rules -----------------------------------------------------------------

    @rule(key=st.sampled_from(KEYS))
    def put(self, key: RecordKey) -> None:
        self.deliver(Dirty(namespace=key.namespace, tokens=key.tokens))
        self.latest[key] = self.view(key).version

    @rule(key=st.sampled_from(KEYS))
    def fire_timer(self, key: RecordKey) -> None:
        """A due timer, or a stale fire queued before its cancel: both must be safe."""
        self.timers.discard(key)
        self.deliver(TimerFired(key=key))

    @precondition(lambda self: self.attempts)
    @rule(data=st.data(), outcome=st.sampled_from([*OUTCOMES, "deferred"]))
    def settle_attempt(self, data: st.DataObject, outcome: str) -> None:
        key = data.draw(st.sampled_from(sorted(self.attempts, key=repr)))
        attempt = self.attempts.pop(key)
        if outcome in ("deferred", "held") and attempt.forced:
            outcome = "failed"  # a flush's attempt is neither deferred nor held back
        if outcome == "deferred":
            self.deliver(AttemptDeferred(key=key, version=attempt.version))
            return
        if outcome in ("dropped", "failed"):
            for flush_id in self.running:
                self.faults[flush_id][outcome] += 1
        if outcome in ("stored", "covered"):
            self.satisfied[key] = max(self.satisfied.get(key, 0), attempt.version)
        was_current = self.latest[key] == attempt.version
        self.deliver(AttemptResult(key=key, version=attempt.version, outcome=outcome))
        view = self.view(key)
        if outcome in ("stored", "covered"):
            assert (view is None) == was_current, "only the current version's store cleans the record"
        else:
            assert view is not None, "a dropped, failed or missing attempt leaves the record"
        if outcome == "missing" and was_current:
            assert view.status is RecordStatus.MISSING
        if outcome in ("held", "skipped") and was_current:
            assert view.status is (RecordStatus.HELD if outcome == "held" else RecordStatus.SKIPPED)
            assert not view.timer_armed, "a record admission refused waits for a flush, a put or a hit"

    def unanswered(self) -> list[int]:
        return sorted(self.asked - set(self.verdicts) - self.timed_out)

    @precondition(lambda self: len(self.unanswered()) < 2)  # room for the other rules
    @rule()
    def flush(self) -> None:
        flush_id = next(self.flush_ids)
        self.asked.add(flush_id)
        self.deliver(Flush(flush_id=flush_id))

    @precondition(lambda self: self.unanswered())
    @rule(data=st.data())
    def time_out(self, data: st.DataObject) -> None:
        """A caller's deadline passes: answered at once from the evidence, then
        the core is told; a queued flush is withdrawn, a begun one goes on."""
        flush_id = data.draw(st.sampled_from(self.unanswered()))
        begun = flush_id in self.running
        answer = self.core.timed_out_verdict(flush_id, self.now)
        assert answer.timed_out and not answer.durable and answer.reason == "timeout"
        scope = self.scope[flush_id] if begun else frozenset(view.key for view in self.core.records())
        left = [view for view in self.core.records() if view.key in scope]
        missing = sum(view.status is RecordStatus.MISSING for view in left)
        skipped = sum(view.status is RecordStatus.SKIPPED for view in left)
        assert (answer.pending, answer.missing_uncovered) == (len(left) - missing - skipped, missing)
        if begun:
            faults = self.faults[flush_id]
            assert (answer.dropped, answer.failed) == (faults["dropped"], faults["failed"])
        state, records = self.core.state, self.core.records()
        effects = self.core.handle(FlushTimedOut(flush_id=flush_id), self.now)
        assert (self.core.state, self.core.records()) == (state, records), "a timeout changes no record or state"
        events = [e.event for e in effects]
        assert len(events) == 1 and isinstance(events[0], FlushTimedOutRecorded), effects
        assert events[0].begun == begun and events[0].pending == answer.pending
        self.timed_out.add(flush_id)
        if not begun:
            self.withdrawn.add(flush_id)

    @precondition(lambda self: self.verdicts or self.timed_out)
    @rule(data=st.data())
    def stale_time_out(self, data: st.DataObject) -> None:
        """A deadline that passed as the verdict came, or a second timeout: ignored."""
        flush_id = data.draw(st.sampled_from(sorted(set(self.verdicts) | self.timed_out)))
        stats = self.core.stats()
        assert self.core.handle(FlushTimedOut(flush_id=flush_id), self.now) == []
        assert self.core.stats() == stats

    @precondition(lambda self: self.drain is not None)
    @rule()
    def queue_drained(self) -> None:
        flush_id, self.drain = self.drain, None
        self.deliver(QueueDrained(flush_id=flush_id))

    @precondition(lambda self: self.coverage is not None)
    @rule(data=st.data())
    def coverage_checked(self, data: st.DataObject) -> None:
        check, self.coverage = self.coverage, None
        covered = data.draw(st.frozensets(st.sampled_from(check.keys)))
        self.deliver(CoverageChecked(flush_id=check.flush_id, covered=covered))
        for key in covered:
            assert self.view(key) is None or self.view(key).status not in (RecordStatus.MISSING, RecordStatus.SKIPPED)

    @rule(key=st.sampled_from(KEYS))
    def admission_granted(self, key: RecordKey) -> None:
        """SSD admission lets a held record go (or a stale grant: safe either way)."""
        before = self.view(key)
        self.deliver(AdmissionGranted(key=key))
        after = self.view(key)
        if before is not None and before.status is RecordStatus.HELD:
            assert after.status is RecordStatus.DIRTY
        else:
            assert after == before, "a grant for a record that is not held changes nothing"

    @rule(dt=st.sampled_from([0.1, 1.0, 5.0]))
    def tick(self, dt: float) -> None:
        self.now += dt

    # -- invariants ------------------------------------------------------------

    def view(self, key: RecordKey) -> Any:
        return next((view for view in self.core.records() if view.key == key), None)

    @invariant()
    def attempts_match(self) -> None:
        assert self.core.in_flight == len(self.attempts)
        attempting = {view.key for view in self.core.records() if view.status is RecordStatus.ATTEMPTING}
        assert attempting == set(self.attempts)

    @invariant()
    def timers_match(self) -> None:
        armed = {view.key for view in self.core.records() if view.timer_armed}
        assert armed <= self.timers
        if self.core.state in FLUSHING:
            assert not armed and not self.timers, "a flush cancels every timer"
        else:
            dirty = {view.key for view in self.core.records() if view.status is RecordStatus.DIRTY}
            assert dirty <= armed, "every dirty record waits on a timer in normal operation"

    @invariant()
    def forcing_one_at_a_time(self) -> None:
        if self.core.state is DurabilityState.FLUSH_FORCING:
            assert len(self.attempts) == 1
        if self.core.state in (DurabilityState.FLUSH_DRAINING, DurabilityState.FLUSH_RECHECK):
            assert not self.attempts

    def teardown(self) -> None:
        """Settle everything outstanding: every flush must get its verdict."""
        for _ in range(200):
            if self.attempts:
                key, attempt = next(iter(self.attempts.items()))
                del self.attempts[key]
                self.satisfied[key] = max(self.satisfied.get(key, 0), attempt.version)
                self.deliver(AttemptResult(key=key, version=attempt.version, outcome="stored"))
            elif self.drain is not None:
                self.queue_drained()
            elif self.coverage is not None:
                check, self.coverage = self.coverage, None
                self.deliver(CoverageChecked(flush_id=check.flush_id, covered=frozenset()))
            else:
                break
        assert self.core.state is DurabilityState.RUNNING
        assert set(self.verdicts) | self.timed_out == self.asked, "every flush is answered"
        assert not set(self.verdicts) & self.timed_out, "and only once"
        assert set(self.late) == self.timed_out - self.withdrawn, "a begun flush that timed out still ends"


TestCoreMachine = CoreMachine.TestCase
TestCoreMachine.settings = settings(
    max_examples=300, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_illegal_messages_name_the_state() -> None:
    core = DurabilityCore()
    with pytest.raises(IllegalTransition, match="RUNNING"):
        core.handle(QueueDrained(flush_id=1), 0.0)
    with pytest.raises(IllegalTransition, match="no attempt"):
        core.handle(AttemptResult(key=KEYS[0], version=1, outcome="stored"), 0.0)


def test_forced_attempts_are_never_deferred() -> None:
    core = DurabilityCore()
    core.handle(Dirty(namespace="a", tokens=(1, 2)), 0.0)
    effects = core.handle(Flush(flush_id=1), 0.0)
    assert any(isinstance(e, DrainQueue) for e in effects)
    effects = core.handle(QueueDrained(flush_id=1), 0.0)
    start = next(e for e in effects if isinstance(e, StartAttempt))
    assert start.forced
    with pytest.raises(IllegalTransition, match="FLUSH_FORCING"):
        core.handle(AttemptDeferred(key=start.key, version=start.version), 0.0)


def test_fault_retries_back_off_and_a_new_put_restarts_the_debounce() -> None:
    core = DurabilityCore(debounce_s=1.0, retry_s=5.0, retry_max_s=12.0)
    key = RecordKey(namespace="", tokens=(7, 8))
    core.handle(Dirty(namespace="", tokens=key.tokens), 0.0)
    delays = []
    for outcome in ("failed", "dropped", "failed"):
        start = next(e for e in core.handle(TimerFired(key=key), 0.0) if isinstance(e, StartAttempt))
        effects = core.handle(AttemptResult(key=key, version=start.version, outcome=outcome), 0.0)
        delays += [e.delay_s for e in effects if isinstance(e, ArmTimer)]
    assert delays == [5.0, 10.0, 12.0]
    effects = core.handle(Dirty(namespace="", tokens=key.tokens), 0.0)
    assert [e.delay_s for e in effects if isinstance(e, ArmTimer)] == [1.0]


# -- the shell with fake ports under a mock clock -----------------------------

A = ("a", (1, 2, 3))
B = ("a", (1, 2, 4))


@attrs.define
class FakePorts:
    """The gateway, RAM cache, SSD index and spill queue, as far as the coordinator sees them."""

    busy: bool = False
    ram: set[tuple[str, tuple[int, ...]]] = attrs.Factory(set)
    ssd: set[tuple[str, tuple[int, ...]]] = attrs.Factory(set)  # committed; every entry trimmable
    outcome: str = "stored"
    write_s: float = 0.0
    turns: list[float] = attrs.Factory(list)
    submits: list[tuple[float, str, tuple[int, ...]]] = attrs.Factory(list)
    in_turn: bool = False

    def gateway_busy(self) -> bool:
        return self.busy

    async def run_when_idle(self, step: Callable[[], Any]) -> Any:
        await trio.sleep(0)
        self.turns.append(trio.current_time())
        self.in_turn = True
        try:
            return step()
        finally:
            self.in_turn = False

    def snapshot_exact(self, tokens: tuple[int, ...], namespace: str) -> SpillSnapshot | None:
        assert self.in_turn, "snapshot_exact is MLX work: only inside run_when_idle"
        if (namespace, tokens) not in self.ram:
            return None
        return SpillSnapshot(namespace=namespace, tokens=tokens, caches=[], bytes=len(tokens), reason="write-behind")

    def covers(self, tokens: tuple[int, ...], namespace: str) -> bool:
        return any(n == namespace and t[: len(tokens)] == tokens for n, t in self.ssd)

    async def submit(self, snapshot: SpillSnapshot, *, forced: bool) -> str:
        assert not self.in_turn, "the write waits outside the engine turn"
        self.submits.append((trio.current_time(), snapshot.namespace, snapshot.tokens))
        await trio.sleep(self.write_s)
        outcome = self.outcome
        if outcome == "stored":
            self.ssd.add((snapshot.namespace, snapshot.tokens))
        return outcome

    async def wait_queue_idle(self) -> None:
        await trio.sleep(0)


@attrs.define
class FakeJournal:
    events: list[Any] = attrs.Factory(list)

    def append(self, event: Any, *, actor: str = "ssd") -> int | None:
        assert actor == "durability"
        self.events.append(event)
        return len(self.events)

    def kinds(self) -> list[str]:
        return [event.kind for event in self.events]


Body = Callable[[DurabilityCoordinator, FakePorts], Awaitable[None]]


def run_shell(body: Body, ports: FakePorts | None = None, **kwargs: Any) -> tuple[FakePorts, FakeJournal]:
    """Run `body` beside a started coordinator, on a mock clock that starts at 0."""
    ports = ports if ports is not None else FakePorts()
    journal = FakeJournal()

    async def main() -> None:
        coordinator = DurabilityCoordinator(ports, journal=journal, **kwargs)
        async with trio.open_nursery() as nursery:
            await nursery.start(coordinator.run)
            await body(coordinator, ports)
            coordinator.close()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return ports, journal


async def sleep_until(t: float) -> None:
    await trio.sleep_until(t)


def test_debounce_waits_a_second_and_coalesces_repeated_puts() -> None:
    async def body(coordinator: DurabilityCoordinator, ports: FakePorts) -> None:
        ports.ram.add(A)
        coordinator.dirty(*A)
        await sleep_until(0.5)
        coordinator.dirty(*A)
        await sleep_until(0.99)
        assert ports.turns == [] and coordinator.stats()["pending_snapshots"] == 1
        await sleep_until(1.01)
        assert ports.turns == [pytest.approx(1.0)] and len(ports.submits) == 1
        await sleep_until(10.0)
        assert len(ports.turns) == 1
        assert coordinator.stats()["pending_snapshots"] == 0

    run_shell(body)


def test_busy_gateway_rearms_after_five_seconds() -> None:
    async def body(coordinator: DurabilityCoordinator, ports: FakePorts) -> None:
        ports.ram.add(A)
        ports.busy = True
        coordinator.dirty(*A)
        await sleep_until(3.0)
        assert ports.turns == [] and coordinator.stats()["deferred_total"] == 1
        ports.busy = False
        await sleep_until(5.99)
        assert ports.turns == []
        await sleep_until(6.01)
        assert ports.turns == [pytest.approx(6.0)]
        assert coordinator.stats()["pending_snapshots"] == 0

    run_shell(body)


def test_flush_awaits_the_write_in_flight() -> None:
    async def body(coordinator: DurabilityCoordinator, ports: FakePorts) -> None:
        ports.ram.add(A)
        coordinator.dirty(*A)
        await sleep_until(1.5)
        assert len(ports.submits) == 1  # writing from 1.0 until 11.0
        verdict = await coordinator.flush()
        assert trio.current_time() == pytest.approx(11.0)
        assert verdict.durable and verdict.pending == verdict.forced == 0
        assert len(ports.submits) == 1

    run_shell(body, FakePorts(write_s=10.0))


def test_a_replacement_during_a_write_gets_its_own_attempt() -> None:
    async def body(coordinator: DurabilityCoordinator, ports: FakePorts) -> None:
        ports.ram.add(A)
        coordinator.dirty(*A)
        await sleep_until(2.0)
        coordinator.dirty(*A)  # the first write (1.0 to 11.0) carries the older version
        await sleep_until(11.5)
        assert coordinator.stats()["pending_snapshots"] == 1
        await sleep_until(13.0)
        # Its own attempt at 12.0 finds the committed entry: no duplicate write.
        assert ports.turns == [pytest.approx(1.0), pytest.approx(12.0)]
        assert len(ports.submits) == 1
        assert coordinator.stats()["pending_snapshots"] == 0

    _, journal = run_shell(body, FakePorts(write_s=10.0))
    settled = [(e.version, e.outcome, e.current, e.clean) for e in journal.events if e.kind == "durability.settled"]
    assert settled == [(1, "stored", False, False), (2, "covered", True, True)]


def test_a_replacement_during_a_flush_is_forced_in_that_flush() -> None:
    async def body(coordinator: DurabilityCoordinator, ports: FakePorts) -> None:
        ports.ram.add(A)
        coordinator.dirty(*A)
        await sleep_until(2.0)
        async with trio.open_nursery() as nursery:
            verdicts: list[FlushVerdict] = []

            async def flush() -> None:
                verdicts.append(await coordinator.flush())

            nursery.start_soon(flush)
            await sleep_until(3.0)
            coordinator.dirty(*A)
        assert verdicts[0].durable and verdicts[0].forced == 1
        assert len(ports.turns) == 2

    _, journal = run_shell(body, FakePorts(write_s=10.0))
    attempts = [(e.version, e.forced) for e in journal.events if e.kind == "durability.attempt"]
    assert attempts == [(1, False), (2, True)]


def test_dropped_is_not_durable_until_a_flush_after_the_fault_clears() -> None:
    async def body(coordinator: DurabilityCoordinator, ports: FakePorts) -> None:
        ports.ram.add(A)
        ports.outcome = "dropped"
        coordinator.dirty(*A)
        first = await coordinator.flush()
        assert not first.durable and (first.dropped, first.pending, first.forced) == (1, 1, 1)
        assert coordinator.stats()["pending_snapshots"] == 1
        ports.outcome = "stored"
        second = await coordinator.flush()
        assert second.durable and second.dropped == 0
        assert coordinator.stats()["pending_snapshots"] == 0

    ports, _ = run_shell(body)
    assert len(ports.submits) == 2


def test_a_failed_write_is_retried_with_a_fresh_snapshot_never_counted_stored() -> None:
    async def body(coordinator: DurabilityCoordinator, ports: FakePorts) -> None:
        ports.ram.add(A)
        ports.outcome = "failed"
        coordinator.dirty(*A)
        await sleep_until(15.0)
        assert coordinator.stats()["pending_snapshots"] == 1
        ports.outcome = "stored"
        await sleep_until(30.0)
        assert coordinator.stats()["pending_snapshots"] == 0

    ports, _ = run_shell(body)
    # Debounce at 1, then the backoff: 5 s, 10 s.
    assert ports.turns == [pytest.approx(t) for t in (1.0, 6.0, 16.0)]
    assert len(ports.submits) == 3


def test_gone_from_ram_but_covered_is_durable() -> None:
    async def body(coordinator: DurabilityCoordinator, ports: FakePorts) -> None:
        ports.ssd.add(("a", (1, 2, 3, 9)))  # a committed trimmable descendant
        coordinator.dirty(*A)
        verdict = await coordinator.flush()
        assert verdict.durable and verdict.missing == 0

    ports, _ = run_shell(body)
    assert ports.submits == []


def test_gone_from_ram_and_uncovered_is_missing_and_stays_so() -> None:
    async def body(coordinator: DurabilityCoordinator, ports: FakePorts) -> None:
        ports.ssd.add(("b", (1, 2, 3)))  # another namespace never covers
        coordinator.dirty(*A)
        first = await coordinator.flush()
        assert not first.durable and first.missing_uncovered == 1 and first.pending == 0
        second = await coordinator.flush()
        assert not second.durable and second.missing == 1
        assert coordinator.stats()["missing_records"] == 1

    run_shell(body)


def test_flush_recheck_finds_a_missing_ancestor_covered_by_a_later_descendant() -> None:
    ancestor, descendant = ("a", (1, 2, 3)), ("a", (1, 2, 3, 4, 5))

    async def body(coordinator: DurabilityCoordinator, ports: FakePorts) -> None:
        ports.ram.add(descendant)  # the ancestor was superseded in RAM
        coordinator.dirty(*ancestor)
        coordinator.dirty(*descendant)
        verdict = await coordinator.flush()
        assert verdict.durable
        assert (verdict.forced, verdict.rechecked_covered, verdict.missing) == (2, 1, 0)

    ports, journal = run_shell(body)
    assert [tokens for _, _, tokens in ports.submits] == [descendant[1]]
    outcomes = [e.outcome for e in journal.events if e.kind == "durability.settled"]
    assert outcomes == ["missing", "stored", "recheck_covered"]


def test_a_put_of_a_new_key_during_a_flush_waits_for_its_debounce_after() -> None:
    async def body(coordinator: DurabilityCoordinator, ports: FakePorts) -> None:
        ports.ram.update({A, B})
        coordinator.dirty(*A)
        async with trio.open_nursery() as nursery:
            verdicts: list[FlushVerdict] = []

            async def flush() -> None:
                verdicts.append(await coordinator.flush())

            nursery.start_soon(flush)
            await sleep_until(5.0)
            coordinator.dirty(*B)
        assert trio.current_time() == pytest.approx(10.0)
        assert verdicts[0].durable and verdicts[0].dirty_keys_count == 1
        await sleep_until(30.0)
        assert coordinator.stats()["pending_snapshots"] == 0

    ports, _ = run_shell(body, FakePorts(write_s=10.0))
    assert [(t, tokens) for t, _, tokens in ports.submits] == [(0.0, A[1]), (pytest.approx(11.0), B[1])]


def test_concurrent_flushes_each_get_a_verdict() -> None:
    async def body(coordinator: DurabilityCoordinator, ports: FakePorts) -> None:
        ports.ram.add(A)
        coordinator.dirty(*A)
        verdicts: list[FlushVerdict] = []

        async def flush() -> None:
            verdicts.append(await coordinator.flush())

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(flush)
        assert len(verdicts) == 3 and all(v.durable for v in verdicts)
        assert sorted(v.flush_id for v in verdicts) == [1, 2, 3]

    _, journal = run_shell(body, FakePorts(write_s=2.0))
    begun = [e.flush_ids for e in journal.events if e.kind == "flush.begin"]
    assert len(begun) == 2 and sorted(itertools.chain(*begun)) == [1, 2, 3]


def test_flush_timeout_answers_not_durable_with_evidence() -> None:
    async def body(coordinator: DurabilityCoordinator, ports: FakePorts) -> None:
        ports.ram.add(A)
        coordinator.dirty(*A)
        verdict = await coordinator.flush(timeout_s=3.0)
        assert verdict.timed_out and not verdict.durable and verdict.reason == "timeout"
        assert (verdict.pending, verdict.forced, verdict.dirty_keys_count) == (1, 1, 1)
        assert verdict.elapsed_s == pytest.approx(3.0)
        assert trio.current_time() == pytest.approx(3.0)

    run_shell(body, FakePorts(write_s=100.0))


def test_a_timed_out_flush_goes_on_in_the_background_and_journals_its_outcome() -> None:
    async def body(coordinator: DurabilityCoordinator, ports: FakePorts) -> None:
        ports.ram.add(A)
        coordinator.dirty(*A)
        await sleep_until(1.5)  # the debounced write runs from 1.0 to 11.0
        verdict = await coordinator.flush(timeout_s=0.001)
        assert verdict.reason == "timeout" and verdict.pending == 1 and verdict.forced == 0
        await sleep_until(12.0)
        stats = coordinator.stats()
        assert (stats["state"], stats["pending_snapshots"], stats["timed_out_flushes_total"]) == ("running", 0, 1)
        again = await coordinator.flush(timeout_s=0.001)
        assert again.durable and again.reason == ""

    ports, journal = run_shell(body, FakePorts(write_s=10.0))
    assert len(ports.submits) == 1
    flushes = [(e.kind, e.flush_id) for e in journal.events if e.kind in ("flush.timeout", "flush.verdict")]
    assert flushes == [("flush.timeout", 1), ("flush.verdict", 1), ("flush.verdict", 2)]
    timeout = next(e for e in journal.events if e.kind == "flush.timeout")
    assert timeout.begun and timeout.pending == 1
    assert next(e for e in journal.events if e.kind == "flush.verdict").durable


def test_a_queued_flush_that_times_out_is_withdrawn() -> None:
    async def body(coordinator: DurabilityCoordinator, ports: FakePorts) -> None:
        ports.ram.add(A)
        coordinator.dirty(*A)
        verdicts: list[FlushVerdict] = []

        async def flush(timeout_s: float | None) -> None:
            verdicts.append(await coordinator.flush(timeout_s=timeout_s))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flush, None)  # forces A: writing from 0 until 10
            await sleep_until(1.0)
            coordinator.dirty(*B)
            nursery.start_soon(flush, 2.0)  # queued behind the first; gives up at 3.0
        first, second = sorted(verdicts, key=lambda v: v.flush_id)
        assert first.durable and not second.durable and second.reason == "timeout"
        assert second.elapsed_s == pytest.approx(2.0) and second.pending == 2  # A writing and B: every record
        assert coordinator.stats()["queued_flushes"] == 0

    _, journal = run_shell(body, FakePorts(write_s=10.0))
    assert [e.flush_ids for e in journal.events if e.kind == "flush.begin"] == [(1,)]
    timeout = next(e for e in journal.events if e.kind == "flush.timeout")
    assert (timeout.flush_id, timeout.begun) == (2, False)


def test_a_timeout_of_zero_answers_at_once() -> None:
    async def body(coordinator: DurabilityCoordinator, ports: FakePorts) -> None:
        ports.ram.add(A)
        coordinator.dirty(*A)
        verdict = await coordinator.flush(timeout_s=0)
        assert verdict.reason == "timeout" and verdict.pending == 1 and trio.current_time() == 0.0

    run_shell(body, FakePorts(write_s=10.0))


def test_a_timeout_arriving_after_the_verdict_is_stale() -> None:
    core = DurabilityCore()
    core.handle(Flush(flush_id=1), 0.0)
    effects = core.handle(QueueDrained(flush_id=1), 0.0)
    assert next(e for e in effects if isinstance(e, FlushVerdict)).durable
    stats = core.stats()
    assert core.handle(FlushTimedOut(flush_id=1), 1.0) == [] and core.stats() == stats


def test_journal_events_are_registered_and_round_trip() -> None:
    async def body(coordinator: DurabilityCoordinator, ports: FakePorts) -> None:
        ports.ram.add(A)
        coordinator.dirty(*A)
        await coordinator.flush()

    _, journal = run_shell(body)
    assert set(journal.kinds()) == {
        "durability.dirty",
        "durability.attempt",
        "durability.settled",
        "flush.begin",
        "flush.verdict",
    }
    timeout = FlushTimedOutRecorded(
        flush_id=1,
        begun=True,
        pending=1,
        dropped=0,
        failed=0,
        missing_uncovered=0,
        dirty_keys_count=1,
        forced=0,
        elapsed_s=0.5,
    )
    assert EVENT_TYPES["flush.timeout"] is FlushTimedOutRecorded
    assert from_cbor(to_cbor(timeout), FlushTimedOutRecorded) == timeout
    for event in journal.events:
        assert EVENT_TYPES[event.kind] is type(event)
        assert from_cbor(to_cbor(event), type(event)) == event
    dirty = journal.events[0]
    assert (dirty.namespace, dirty.token_count, dirty.tokens_hash) == ("a", 3, tokens_hash(A[1]))
