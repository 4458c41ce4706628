"""DurabilityCoordinator (spec §5.6): turns RAM puts into an explicit,
answerable durability boundary.

Every `PromptCache.put` becomes a *dirty record* keyed by the namespace and
the exact token sequence (two same-namespace, same-length conversations never
cancel each other). A record is attempted once its debounce (1 s) runs out; a
busy gateway re-arms it (5 s). An attempt checks SSD coverage under
`run_when_idle`, otherwise snapshots the RAM entry in that same engine turn and
submits it to the spill queue. Outcomes:

- stored / covered, for the record's current version: the record is clean;
  for an older version the record stays dirty (a replacement put during the
  write receives its own attempt);
- dropped / failed: the record stays dirty and is retried after a backoff; a
  failed write is never counted as stored, and the retry takes a fresh
  snapshot and writes a fresh file (nothing "retries the fsync");
- missing (gone from RAM and not covered by the committed index): the record
  stays, as missing, until a later put or a flush's re-check covers it.

`flush()` cancels the timers, waits for the attempts in flight and for the
spill queue to drain, forces each dirty version once, one at a time (so the
queue's byte cap cannot drop a boundary snapshot behind a large final one),
then re-checks the missing records against the committed index: a later
trimmable descendant may now cover a superseded RAM prefix. The verdict is
durable only when nothing in the flush's scope is pending, nothing was dropped
or failed during the flush, and no missing prefix is uncovered.

Decisions where the spec is open:

- Scope: a flush answers for every put made before it began. The keys dirty at
  its begin are its scope; a later put of a scope key (a replacement) is
  forced as well, each version once. A put of a *new* key during a flush is
  recorded but left to its debounce after the flush: it does not make the
  flush wait or fail, so a flush under load still terminates. (At shutdown
  admission has stopped, so nothing arrives.)
- A dropped or failed attempt settling while a flush runs counts against that
  flush even when it began before the flush, as the spec words it ("nothing
  dropped or failed during this flush").
- Missing records are not forced again (the entry is gone; a write cannot
  happen): the flush re-checks them against the committed index instead.
- A `Flush` arriving while one runs is queued; all queued flushes share the
  next run (its scope is taken after every one of them was asked), and each
  gets its own verdict.
- A flush always answers by its caller's deadline. Past it the shell answers
  with `timed_out_verdict` (not durable, reason "timeout", the evidence so
  far: a read, no transition) and tells the core `FlushTimedOut`: a queued
  flush is withdrawn; a running one goes on for its other callers and the
  journal (`flush.timeout` now, its `flush.verdict` when the run ends), but
  gets no second answer. A `FlushTimedOut` for a flush already answered
  (its verdict raced the deadline) is stale and ignored.
- The debounce does not extend: repeated puts of one key within the window
  coalesce into the attempt due 1 s after the first, so a key put over and
  over is still written.
- Dropped/failed retries back off exponentially from `retry_s` to
  `retry_max_s`: a full disk must not be hammered with multi-GB snapshots.

`DurabilityCore` (here, with the messages and effects; the journal events
are `store/actor_events.py`'s) is the sans-IO core (design §3), pure: it
imports attrs, the messages and `errors`, never Trio or MLX. Its transitions
are one table, `DURABILITY_TABLE`, looked up before any handler runs.
`DurabilityCoordinator` (`durability_shell`) is its Trio shell, which owns
the ports (`DurabilityPorts`) and the flush waiters.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable
from typing import Any

import attrs

from kvcellar.actors.effects import ArmTimer, CancelTimer, JournalEvent, TimerFired
from kvcellar.actors.transitions import TransitionTable, rows
from kvcellar.errors import IllegalTransition
from kvcellar.store.actor_events import (
    DurabilityAttempt,
    DurabilityDirty,
    DurabilitySettled,
    FlushBegun,
    FlushSkippedByAdmission,
    FlushTimedOutRecorded,
    FlushVerdictRecorded,
)
from kvcellar.store.events import tokens_digest as events_tokens_digest
from kvcellar.store.wipe import WipeSelector

DEBOUNCE_S_DEFAULT = 1.0
BUSY_REARM_S_DEFAULT = 5.0
RETRY_S_DEFAULT = 5.0
RETRY_MAX_S_DEFAULT = 300.0

OUTCOMES = ("stored", "covered", "dropped", "failed", "missing", "held", "skipped")
SUBMIT_OUTCOMES = ("stored", "dropped", "failed")
_TOKENS_HASH_HEX_CHARS = 16


def tokens_hash(tokens: Iterable[int]) -> str:
    """A short hash of a token sequence: the first 16 hex digits of the
    digest the SSD tier records (`entries.tokens_digest`), so journal lines
    can be matched to entries by prefix."""
    return events_tokens_digest(tuple(tokens))[:_TOKENS_HASH_HEX_CHARS]


@attrs.frozen(kw_only=True, cache_hash=True)
class RecordKey:
    """A dirty record's identity: the namespace and the exact tokens. The hash
    is cached because token tuples can be 100k long and the key is looked up
    on every message."""

    namespace: str
    tokens: tuple[int, ...]


# -- messages (received by the core) ------------------------------------------


def token_tuple(tokens: Iterable[int]) -> tuple[int, ...]:
    """A message's tokens as a tuple (hashable, immutable)."""
    return tuple(tokens)


@attrs.frozen(kw_only=True)
class Dirty:
    """`PromptCache.on_put(namespace, tokens)`: an entry holding exactly `tokens` was put."""

    namespace: str
    tokens: tuple[int, ...] = attrs.field(converter=token_tuple)


@attrs.frozen(kw_only=True)
class Wiped:
    """The RAM tier dropped what `selector` selects (its port sends this after the puts before it):
    those puts are no longer owed to the SSD tier."""

    selector: WipeSelector


@attrs.frozen(kw_only=True)
class AttemptResult:
    """How the attempt for `key` at `version` settled."""

    key: RecordKey
    version: int
    outcome: str = attrs.field(validator=attrs.validators.in_(OUTCOMES))


@attrs.frozen(kw_only=True)
class AttemptDeferred:
    """The shell found the gateway busy and did not start a timed attempt."""

    key: RecordKey
    version: int


@attrs.frozen(kw_only=True)
class Flush:
    flush_id: int


@attrs.frozen(kw_only=True)
class FlushTimedOut:
    """The caller of flush `flush_id` stopped waiting (it was answered with
    `timed_out_verdict`)."""

    flush_id: int


@attrs.frozen(kw_only=True)
class QueueDrained:
    """The spill queue was idle once after `DrainQueue(flush_id)`."""

    flush_id: int


@attrs.frozen(kw_only=True)
class CoverageChecked:
    """The answer to `CheckCoverage`: which of its keys the committed index covers."""

    flush_id: int
    covered: frozenset[RecordKey]


@attrs.frozen(kw_only=True)
class AdmissionGranted:
    """SSD admission (`actors/admission.py`) now admits the write-behind
    snapshot of `key` it held back: a later take made it worth writing."""

    key: RecordKey


DurabilityMessage = (
    Dirty
    | TimerFired
    | AttemptResult
    | AttemptDeferred
    | Flush
    | FlushTimedOut
    | QueueDrained
    | CoverageChecked
    | AdmissionGranted
)


# -- effects (besides the runtime's ArmTimer, CancelTimer, JournalEvent) ------


@attrs.frozen(kw_only=True)
class StartAttempt:
    """Attempt `key` at `version`. Unless `forced`, the shell first asks the
    gateway and answers `AttemptDeferred` when it is busy; a forced attempt
    (a flush's) waits for its engine turn instead."""

    key: RecordKey
    version: int
    forced: bool


@attrs.frozen(kw_only=True)
class DrainQueue:
    """Answer `QueueDrained(flush_id)` once the spill queue is idle."""

    flush_id: int


@attrs.frozen(kw_only=True)
class CheckCoverage:
    """Answer `CoverageChecked(flush_id, covered)` from the committed SSD index."""

    flush_id: int
    keys: tuple[RecordKey, ...]


@attrs.frozen(kw_only=True)
class FlushVerdict:
    """The answer to one `Flush`. `pending`: scope records still dirty;
    `dropped`/`failed`: attempts that settled so during the flush;
    `missing_uncovered`: scope records gone from RAM and not covered;
    `dirty_keys_count`: every record not yet durable, in scope or not;
    `skipped_by_admission`: scope records gone from RAM unwritten because SSD
    admission refused their spill (never durable, like missing ones).
    `timed_out`: the answer of `timed_out_verdict`, for a flush whose caller
    stopped waiting; the evidence is what was known at that moment."""

    flush_id: int
    durable: bool
    pending: int
    dropped: int
    failed: int
    missing_uncovered: int
    dirty_keys_count: int
    forced: int
    rechecked_covered: int
    elapsed_s: float
    timed_out: bool = False
    skipped_by_admission: int = 0

    @property
    def missing(self) -> int:
        return self.missing_uncovered

    @property
    def reason(self) -> str:
        """Why it is not durable: "timeout", else the first of "failed",
        "dropped", "missing", "skipped_by_admission", "pending" that is not
        zero; "" when durable."""
        if self.durable:
            return ""
        if self.timed_out:
            return "timeout"
        counts = {
            "failed": self.failed,
            "dropped": self.dropped,
            "missing": self.missing_uncovered,
            "skipped_by_admission": self.skipped_by_admission,
            "pending": self.pending,
        }
        return next((name for name, count in counts.items() if count), "pending")


# -- the core -----------------------------------------------------------------


class DurabilityState(enum.Enum):
    RUNNING = "running"
    FLUSH_SETTLING = "flush_settling"  # awaiting the attempts in flight when the flush began
    FLUSH_DRAINING = "flush_draining"  # awaiting the spill queue's drain
    FLUSH_FORCING = "flush_forcing"  # one forced attempt in flight
    FLUSH_RECHECK = "flush_recheck"  # awaiting the committed index's answer for missing records


class RecordStatus(enum.Enum):
    DIRTY = "dirty"  # needs an attempt
    ATTEMPTING = "attempting"  # exactly one attempt in flight
    MISSING = "missing"  # gone from RAM and not covered by the committed index
    # SSD admission (`actors/admission.py`): a timed attempt's snapshot was refused; the
    # entry is still in RAM, no timer is armed, and a flush forces it like a dirty one.
    HELD = "held"
    SKIPPED = "skipped"  # gone from RAM unwritten: admission refused its spill (reported, never durable)


_S = DurabilityState
_FLUSHING = frozenset({_S.FLUSH_SETTLING, _S.FLUSH_DRAINING, _S.FLUSH_FORCING, _S.FLUSH_RECHECK})
# Records no timer moves on: a later put (or, for held ones, admission) does.
_WAITING_FOR_A_PUT = frozenset({RecordStatus.MISSING, RecordStatus.HELD, RecordStatus.SKIPPED})
# What a flush forces: everything still in RAM that is not durable, admission's refusals included.
_FORCED_BY_A_FLUSH = frozenset({RecordStatus.DIRTY, RecordStatus.HELD})
# Gone from RAM: a flush re-checks them against the committed index.
_RECHECKED = frozenset({RecordStatus.MISSING, RecordStatus.SKIPPED})

# A handler's answer: the state it leaves the core in, and the effects.
Step = tuple[DurabilityState, list[Any]]


@attrs.define(kw_only=True)
class _Record:
    key: RecordKey
    tokens_hash: str
    version: int
    status: RecordStatus = RecordStatus.DIRTY
    attempt_version: int | None = None
    attempt_forced: bool = False
    timer_armed: bool = False
    failures: int = 0  # consecutive dropped/failed attempts, for the retry backoff
    wiped_version: int | None = None  # a wipe dropped this version while its attempt was in flight


@attrs.frozen(kw_only=True)
class RecordView:
    """A read-only view of one record (stats, tests)."""

    key: RecordKey
    version: int
    status: RecordStatus
    attempt_version: int | None
    timer_armed: bool


@attrs.define(kw_only=True)
class _FlushRun:
    flush_ids: tuple[int, ...]
    began_s: float
    scope: frozenset[RecordKey]
    timed_out: set[int] = attrs.Factory(set)  # flush ids whose caller was answered "timeout"
    forced_versions: set[int] = attrs.Factory(set)
    rechecked_versions: set[int] = attrs.Factory(set)
    awaiting_recheck: dict[RecordKey, int] = attrs.Factory(dict)
    forced: int = 0
    dropped: int = 0
    failed: int = 0
    rechecked_covered: int = 0

    @property
    def flush_id(self) -> int:
        return self.flush_ids[0]


@attrs.define(kw_only=True)
class DurabilityCounters:
    # Running counts, published with a `_total` suffix by `stats`.
    puts: int = 0  # `Dirty` notifications (RAM puts)
    attempts: int = 0  # write-behind attempts started, forced ones included
    forced_attempts: int = 0
    deferred: int = 0  # timed attempts not started: the gateway was busy
    # Settled attempts, one counter per outcome (named as in OUTCOMES).
    stored: int = 0
    covered: int = 0
    dropped: int = 0
    failed: int = 0
    missing: int = 0
    held: int = 0  # timed attempts whose snapshot SSD admission refused
    skipped: int = 0  # attempts that found the entry gone, its spill refused by admission
    admission_granted: int = 0  # held records admission let go later
    rechecked_covered: int = 0
    flushes: int = 0
    durable_flushes: int = 0
    timed_out_flushes: int = 0


class DurabilityCore:
    """The sans-IO DurabilityCoordinator: `handle(msg, now) -> effects`."""

    def __init__(
        self,
        debounce_s: float = DEBOUNCE_S_DEFAULT,
        busy_rearm_s: float = BUSY_REARM_S_DEFAULT,
        *,
        retry_s: float = RETRY_S_DEFAULT,
        retry_max_s: float = RETRY_MAX_S_DEFAULT,
    ) -> None:
        self.debounce_s = debounce_s
        self.busy_rearm_s = busy_rearm_s
        self.retry_s = retry_s
        self.retry_max_s = retry_max_s
        self.state = DurabilityState.RUNNING
        self.counters = DurabilityCounters()
        self._records: dict[RecordKey, _Record] = {}
        # Versions are global, so a key made clean and put again never reuses one.
        self._versions = itertools.count(1)
        self._in_flight = 0
        self._run: _FlushRun | None = None
        self._queued_flushes: list[int] = []
        self._known_flushes: set[int] = set()  # asked and not yet answered
        self._asked_s: dict[int, float] = {}

    # -- dispatch and transitions ----------------------------------------------

    def handle(self, msg: Any, now: float) -> list[Any]:
        return DURABILITY_TABLE.fire(self, msg, now)

    def _check_run(self, flush_id: int) -> _FlushRun:
        run = self._run
        if run is None or run.flush_id != flush_id:
            raise IllegalTransition(f"durability: answer for flush {flush_id} in state {self.state.name}")
        return run

    # -- normal operation ------------------------------------------------------

    def _on_dirty(self, msg: Dirty, now: float) -> Step:
        key = RecordKey(namespace=msg.namespace, tokens=msg.tokens)
        version = next(self._versions)
        self.counters.puts += 1
        record = self._records.get(key)
        replaced = record is not None
        retrying = False
        if record is None:
            record = self._records[key] = _Record(key=key, tokens_hash=tokens_hash(key.tokens), version=version)
        else:
            record.version = version
            # A fresh put is not held back by the backoff of an earlier version's faults.
            retrying, record.failures = record.failures > 0, 0
            if record.status in _WAITING_FOR_A_PUT:
                record.status = RecordStatus.DIRTY
        effects: list[Any] = [JournalEvent(event=DurabilityDirty(**self._fields(record), replaced=replaced))]
        # An attempting record is re-armed when its attempt settles; a flush
        # arms nothing (it forces scope records, and re-arms the rest after).
        if self.state is _S.RUNNING and record.status is RecordStatus.DIRTY and (retrying or not record.timer_armed):
            effects.append(self._arm(record, self.debounce_s))
        return self.state, effects

    def _on_timer(self, msg: TimerFired, now: float) -> Step:
        record = self._records.get(msg.key) if isinstance(msg.key, RecordKey) else None
        if record is None or not record.timer_armed:
            return self.state, []  # stale: the timer was cancelled after its message was queued
        record.timer_armed = False
        if self.state is not _S.RUNNING or record.status is not RecordStatus.DIRTY:
            return self.state, []
        # Cancelling kills a replacement timer should this fire have been a stale one.
        return self.state, [CancelTimer(key=record.key), *self._start(record, forced=False)]

    def _start(self, record: _Record, *, forced: bool) -> list[Any]:
        record.status = RecordStatus.ATTEMPTING
        record.attempt_version = record.version
        record.attempt_forced = forced
        self._in_flight += 1
        self.counters.attempts += 1
        self.counters.forced_attempts += forced
        event = DurabilityAttempt(**self._fields(record), forced=forced)
        return [StartAttempt(key=record.key, version=record.version, forced=forced), JournalEvent(event=event)]

    def _attempting(self, key: RecordKey, version: int) -> _Record:
        """The record whose attempt at `version` is in flight; anything else is a protocol bug."""
        record = self._records.get(key)
        if record is None or record.status is not RecordStatus.ATTEMPTING or record.attempt_version != version:
            raise IllegalTransition(
                f"durability: no attempt at version {version} in flight for this key (state {self.state.name})"
            )
        return record

    def _settle(self, record: _Record) -> _Record:
        """The attempt of `record` (checked by `_attempting`) settles now."""
        record.attempt_version = None
        self._in_flight -= 1
        return record

    def _on_deferred(self, msg: AttemptDeferred, now: float) -> Step:
        record = self._attempting(msg.key, msg.version)
        # Checked before anything changes: a core that raises is unchanged.
        if record.attempt_forced:
            raise IllegalTransition(f"durability: a forced attempt cannot be deferred (state {self.state.name})")
        self._settle(record)
        record.status = RecordStatus.DIRTY
        self.counters.deferred += 1
        effects: list[Any] = [self._settled_event(record, msg.version, "deferred", clean=False)]
        if self.state is _S.RUNNING:
            return self.state, [*effects, self._arm(record, self.busy_rearm_s)]
        return self._progress(self.state, now, effects)

    def _on_admission_granted(self, msg: AdmissionGranted, now: float) -> Step:
        record = self._records.get(msg.key)
        if record is None or record.status is not RecordStatus.HELD:
            return self.state, []  # stale: put again, forced by a flush, or clean meanwhile
        record.status = RecordStatus.DIRTY
        self.counters.admission_granted += 1
        # While a flush runs nothing is armed: it forces its scope and re-arms the rest after.
        return self.state, [self._arm(record, self.debounce_s)] if self.state is _S.RUNNING else []

    def _on_result(self, msg: AttemptResult, now: float) -> Step:
        attempting = self._attempting(msg.key, msg.version)
        if msg.outcome == "held" and attempting.attempt_forced:
            raise IllegalTransition(f"durability: a forced attempt cannot be held back (state {self.state.name})")
        record = self._settle(attempting)
        outcome = msg.outcome
        setattr(self.counters, outcome, getattr(self.counters, outcome) + 1)
        fault = outcome in ("dropped", "failed")
        if self._run is not None and fault:
            setattr(self._run, outcome, getattr(self._run, outcome) + 1)
        current = msg.version == record.version
        clean = current and (outcome in ("stored", "covered") or record.wiped_version == record.version)
        if clean:
            del self._records[record.key]
        elif current and outcome == "missing":
            record.status = RecordStatus.MISSING
        elif current and outcome in ("held", "skipped"):
            record.status = RecordStatus.HELD if outcome == "held" else RecordStatus.SKIPPED
        else:
            # Faults and replacements stay dirty; a fault is never counted as stored.
            record.status = RecordStatus.DIRTY
        record.failures = record.failures + 1 if fault else 0
        effects: list[Any] = [self._settled_event(record, msg.version, outcome, clean=clean)]
        if self.state is not _S.RUNNING:
            return self._progress(self.state, now, effects)
        if record.status is RecordStatus.DIRTY:
            effects.append(self._arm(record, self._rearm_delay(record)))
        return self.state, effects

    def _on_wiped(self, msg: Wiped, now: float) -> Step:
        """Forget the records the wipe selects: every one is a put made before it (the port's
        order). One in flight is forgotten when its attempt settles, unless put again meanwhile.
        A flush's scope looks its records up, so one forgotten is simply no longer owed."""
        for key, record in list(self._records.items()):
            if not msg.selector.matches(key.namespace, key.tokens):
                continue
            if record.status is RecordStatus.ATTEMPTING:
                record.wiped_version = record.version
            else:
                del self._records[key]  # a timer still armed for it fires stale and is ignored
        return self.state, []

    def _rearm_delay(self, record: _Record) -> float:
        if record.failures == 0:
            return self.debounce_s
        return min(self.retry_s * 2.0 ** (record.failures - 1), self.retry_max_s)

    def _arm(self, record: _Record, delay_s: float) -> ArmTimer:
        record.timer_armed = True
        return ArmTimer(key=record.key, delay_s=delay_s)

    # -- flush -----------------------------------------------------------------

    def _on_flush(self, msg: Flush, now: float) -> Step:
        if msg.flush_id in self._known_flushes:
            raise IllegalTransition(f"durability: flush {msg.flush_id} asked twice (state {self.state.name})")
        self._known_flushes.add(msg.flush_id)
        self._asked_s[msg.flush_id] = now
        if self._run is not None:
            self._queued_flushes.append(msg.flush_id)
            return self.state, []
        return self._begin((msg.flush_id,), now)

    def _begin(self, flush_ids: tuple[int, ...], now: float) -> Step:
        effects: list[Any] = []
        for record in self._records.values():
            if record.timer_armed:
                record.timer_armed = False
                effects.append(CancelTimer(key=record.key))
        self._run = _FlushRun(flush_ids=flush_ids, began_s=now, scope=frozenset(self._records))
        self.counters.flushes += len(flush_ids)
        begun = FlushBegun(flush_ids=flush_ids, scope_records=len(self._records), in_flight=self._in_flight)
        return self._progress(_S.FLUSH_SETTLING, now, [*effects, JournalEvent(event=begun)])

    def _progress(self, state: DurabilityState, now: float, effects: list[Any]) -> Step:
        """Move a flush in `state` on after something settled; `effects` come first."""
        if state is _S.FLUSH_SETTLING:
            if self._in_flight:
                return state, effects
            assert self._run is not None
            return _S.FLUSH_DRAINING, [*effects, DrainQueue(flush_id=self._run.flush_id)]
        if state is _S.FLUSH_FORCING:
            return self._force_next(state, now, effects)
        return state, effects

    def _on_queue_drained(self, msg: QueueDrained, now: float) -> Step:
        self._check_run(msg.flush_id)
        return self._force_next(self.state, now, [])

    def _force_next(self, state: DurabilityState, now: float, effects: list[Any]) -> Step:
        """Force the next unforced dirty version in scope, one at a time; when
        none is left, re-check the missing ones; then answer."""
        run = self._run
        assert run is not None
        if self._in_flight:
            return state, effects
        in_scope = [r for r in self._records.values() if r.key in run.scope]
        for record in in_scope:
            if record.status in _FORCED_BY_A_FLUSH and record.version not in run.forced_versions:
                run.forced_versions.add(record.version)
                run.forced += 1
                return _S.FLUSH_FORCING, [*effects, *self._start(record, forced=True)]
        recheck = {
            r.key: r.version for r in in_scope if r.status in _RECHECKED and r.version not in run.rechecked_versions
        }
        if recheck:
            run.rechecked_versions.update(recheck.values())
            run.awaiting_recheck = recheck
            return _S.FLUSH_RECHECK, [*effects, CheckCoverage(flush_id=run.flush_id, keys=tuple(recheck))]
        return self._finish(now, effects)

    def _on_coverage(self, msg: CoverageChecked, now: float) -> Step:
        run = self._check_run(msg.flush_id)
        effects: list[Any] = []
        for key, version in run.awaiting_recheck.items():
            record = self._records.get(key)
            # A put since the question was asked has its own version and attempt.
            if key in msg.covered and record is not None and record.status in _RECHECKED and record.version == version:
                del self._records[key]
                run.rechecked_covered += 1
                self.counters.rechecked_covered += 1
                effects.append(self._settled_event(record, version, "recheck_covered", clean=True))
        run.awaiting_recheck = {}
        return self._force_next(self.state, now, effects)

    def _finish(self, now: float, effects: list[Any]) -> Step:
        run = self._run
        assert run is not None
        for flush_id in run.flush_ids:
            verdict = self._verdict(run, flush_id, now)
            self.counters.durable_flushes += verdict.durable
            self._known_flushes.discard(flush_id)
            self._asked_s.pop(flush_id, None)
            fields = attrs.asdict(verdict)
            del fields["timed_out"]
            skipped = fields.pop("skipped_by_admission")
            # A timed-out flush was answered already: its outcome is journaled only.
            answer = [] if flush_id in run.timed_out else [verdict]
            effects += [*answer, JournalEvent(event=FlushVerdictRecorded(**fields))]
            if skipped:
                # Its own event, so a journal without admission refusals reads as before.
                effects.append(JournalEvent(event=FlushSkippedByAdmission(flush_id=flush_id, records=skipped)))
        self._run = None
        if self._queued_flushes:
            queued, self._queued_flushes = tuple(self._queued_flushes), []
            state, begun = self._begin(queued, now)
            return state, [*effects, *begun]
        for record in self._records.values():
            if record.status is RecordStatus.DIRTY:
                effects.append(self._arm(record, self._rearm_delay(record)))
        return _S.RUNNING, effects

    def _verdict(self, run: _FlushRun, flush_id: int, now: float, *, timed_out: bool = False) -> FlushVerdict:
        in_scope = [r for r in self._records.values() if r.key in run.scope]
        missing = sum(r.status is RecordStatus.MISSING for r in in_scope)
        skipped = sum(r.status is RecordStatus.SKIPPED for r in in_scope)
        pending = len(in_scope) - missing - skipped
        durable = (
            not timed_out and pending == 0 and missing == 0 and skipped == 0 and run.dropped == 0 and run.failed == 0
        )
        return FlushVerdict(
            flush_id=flush_id,
            durable=durable,
            pending=pending,
            dropped=run.dropped,
            failed=run.failed,
            missing_uncovered=missing,
            dirty_keys_count=len(self._records),
            forced=run.forced,
            rechecked_covered=run.rechecked_covered,
            elapsed_s=now - run.began_s,
            timed_out=timed_out,
            skipped_by_admission=skipped,
        )

    def timed_out_verdict(self, flush_id: int, now: float) -> FlushVerdict:
        """The answer for a flush whose caller stops waiting now: not durable,
        with the evidence so far (a read; the core is unchanged). A flush not
        begun (queued, or not yet received) is judged on every record."""
        run = self._run if self._run is not None and flush_id in self._run.flush_ids else None
        if run is None:
            run = _FlushRun(flush_ids=(flush_id,), began_s=now, scope=frozenset(self._records))
        return attrs.evolve(
            self._verdict(run, flush_id, now, timed_out=True), elapsed_s=now - self._asked_s.get(flush_id, now)
        )

    def _on_flush_timed_out(self, msg: FlushTimedOut, now: float) -> Step:
        flush_id = msg.flush_id
        if flush_id not in self._known_flushes:
            return self.state, []  # stale: its verdict was produced before the caller's deadline passed
        run = self._run if self._run is not None and flush_id in self._run.flush_ids else None
        if run is not None and flush_id in run.timed_out:
            return self.state, []
        verdict = self.timed_out_verdict(flush_id, now)
        if run is not None:
            run.timed_out.add(flush_id)
        else:
            # Asked, unanswered and not in the run: queued. Withdrawn, so no run starts for nobody.
            self._queued_flushes.remove(flush_id)
            self._known_flushes.discard(flush_id)
            self._asked_s.pop(flush_id, None)
        self.counters.timed_out_flushes += 1
        event = FlushTimedOutRecorded(
            flush_id=flush_id,
            begun=run is not None,
            pending=verdict.pending,
            dropped=verdict.dropped,
            failed=verdict.failed,
            missing_uncovered=verdict.missing_uncovered,
            dirty_keys_count=verdict.dirty_keys_count,
            forced=verdict.forced,
            elapsed_s=verdict.elapsed_s,
        )
        return self.state, [JournalEvent(event=event)]

    # -- views -----------------------------------------------------------------

    def _fields(self, record: _Record) -> dict[str, Any]:
        return {
            "namespace": record.key.namespace,
            "token_count": len(record.key.tokens),
            "tokens_hash": record.tokens_hash,
            "version": record.version,
        }

    def _settled_event(self, record: _Record, version: int, outcome: str, *, clean: bool) -> JournalEvent:
        fields = {**self._fields(record), "version": version}
        return JournalEvent(
            event=DurabilitySettled(**fields, outcome=outcome, current=version == record.version, clean=clean)
        )

    def records(self) -> list[RecordView]:
        return [
            RecordView(
                key=r.key,
                version=r.version,
                status=r.status,
                attempt_version=r.attempt_version,
                timer_armed=r.timer_armed,
            )
            for r in self._records.values()
        ]

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def stats(self) -> dict[str, Any]:
        """`pending_snapshots`: every record not yet durable (armed debounce and
        re-arm timers, attempts in flight, missing), as `/stats` reports it."""
        statuses = [r.status for r in self._records.values()]
        return {
            "state": self.state.value,
            "pending_snapshots": len(statuses),
            "dirty": statuses.count(RecordStatus.DIRTY),
            "attempting": self._in_flight,
            "missing_records": statuses.count(RecordStatus.MISSING),
            "held_records": statuses.count(RecordStatus.HELD),
            "skipped_records": statuses.count(RecordStatus.SKIPPED),
            "armed_timers": sum(r.timer_armed for r in self._records.values()),
            "queued_flushes": len(self._queued_flushes),
            # Running totals; `missing_records` above is the current count.
            **{f"{name}_total": value for name, value in attrs.asdict(self.counters).items()},
        }


# The one table: (state, message type) -> (the states the handler may leave the
# core in, the handler). A forced attempt settles only while FLUSH_FORCING and
# none is in flight while draining or re-checking, so those states take no
# attempt answer; a flush asked during a flush is queued for the next run.
_EVERY_STATE = list(DurabilityState)
# Where a flush goes once something settled: the next forced attempt, the
# re-check, the verdict (back to RUNNING, or the next queued run's first steps).
_AFTER_A_STEP = frozenset({_S.FLUSH_FORCING, _S.FLUSH_RECHECK, _S.RUNNING, _S.FLUSH_SETTLING, _S.FLUSH_DRAINING})
_BEGUN = frozenset({_S.FLUSH_SETTLING, _S.FLUSH_DRAINING})
DURABILITY_TABLE: TransitionTable[DurabilityState] = TransitionTable(
    "durability",
    {
        **rows(_EVERY_STATE, [Dirty], DurabilityCore._on_dirty),
        **rows(_EVERY_STATE, [TimerFired], DurabilityCore._on_timer),
        **rows(_EVERY_STATE, [AdmissionGranted], DurabilityCore._on_admission_granted),
        **rows(_EVERY_STATE, [FlushTimedOut], DurabilityCore._on_flush_timed_out),
        **rows(_EVERY_STATE, [Wiped], DurabilityCore._on_wiped),
        **rows([_S.RUNNING], [Flush], DurabilityCore._on_flush, to=_BEGUN),
        **rows(_FLUSHING, [Flush], DurabilityCore._on_flush),
        **rows([_S.RUNNING], [AttemptResult], DurabilityCore._on_result),
        **rows([_S.RUNNING], [AttemptDeferred], DurabilityCore._on_deferred),
        **rows([_S.FLUSH_SETTLING], [AttemptResult], DurabilityCore._on_result, to=_BEGUN),
        **rows([_S.FLUSH_SETTLING], [AttemptDeferred], DurabilityCore._on_deferred, to=_BEGUN),
        **rows([_S.FLUSH_FORCING], [AttemptResult], DurabilityCore._on_result, to=_AFTER_A_STEP),
        **rows([_S.FLUSH_DRAINING], [QueueDrained], DurabilityCore._on_queue_drained, to=_AFTER_A_STEP),
        **rows([_S.FLUSH_RECHECK], [CoverageChecked], DurabilityCore._on_coverage, to=_AFTER_A_STEP),
    },
)
