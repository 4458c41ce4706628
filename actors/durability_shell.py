"""The Trio shell of the DurabilityCoordinator (spec §5.6; the core, its
messages and events are in `kvcellar.actors.durability`).

The shell owns the ports and the flush waiters and carries out the core's
effects: a `StartAttempt` becomes a task that checks coverage and snapshots
the RAM entry in one `run_when_idle` engine turn, then submits the snapshot to
the spill queue outside that turn; `DrainQueue` waits for the queue to go
idle; `CheckCoverage` asks the committed SSD index; a `FlushVerdict` wakes the
`flush()` caller it answers. A caller whose deadline passes is answered at
once from the core's evidence (`timed_out_verdict`), then the core is told
(`FlushTimedOut`), so the answer never waits on the actor's mailbox.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar, assert_never

import attrs
import trio

from kvcellar.actors.durability_core import (
    BUSY_REARM_S_DEFAULT,
    DEBOUNCE_S_DEFAULT,
    RETRY_MAX_S_DEFAULT,
    RETRY_S_DEFAULT,
    SUBMIT_OUTCOMES,
    AdmissionGranted,
    AttemptDeferred,
    AttemptResult,
    CheckCoverage,
    CoverageChecked,
    Dirty,
    DrainQueue,
    DurabilityCore,
    Flush,
    FlushTimedOut,
    FlushVerdict,
    QueueDrained,
    RecordKey,
    StartAttempt,
    Wiped,
)
from kvcellar.actors.runtime import ActorShell, Journal, Reply
from kvcellar.actors.spill_queue import REFUSED
from kvcellar.store.prompt_cache import SpillSnapshot
from kvcellar.store.wipe import WipeSelector

log = logging.getLogger("kvcellar.actors.durability")

T = TypeVar("T")


class DurabilityPorts(Protocol):
    """What the coordinator needs of the rest of the system."""

    def gateway_busy(self) -> bool: ...

    async def run_when_idle(self, step: Callable[[], T]) -> T:
        """Run `step` on the engine thread as one turn taken only when idle."""
        ...

    def snapshot_exact(self, tokens: tuple[int, ...], namespace: str) -> SpillSnapshot | None:
        """The RAM entry holding exactly `tokens`; MLX work, only inside `run_when_idle`."""
        ...

    def covers(self, tokens: tuple[int, ...], namespace: str) -> bool:
        """Whether a committed SSD entry serves all of `tokens` (cheap, no I/O)."""
        ...

    async def submit(self, snapshot: SpillSnapshot, *, forced: bool) -> str:
        """Hand a snapshot to the spill queue's one entrance (`SpillQueue.submit`):
        "stored", "dropped" or "failed" once settled, `REFUSED` at once when SSD
        admission refused it (never for a `forced` one, a flush's)."""
        ...

    async def wait_queue_idle(self) -> None: ...


class AdmissionPort(Protocol):
    """SSD write admission as the coordinator sees it (`actors/admission.py`;
    Trio thread only). Its decisions are the spill queue's entrance's; the
    coordinator only asks what became of a spill."""

    def was_skipped(self, key: RecordKey) -> bool:
        """Whether `key` left RAM unwritten because admission refused its spill."""
        ...


class DurabilityCoordinator:
    """The Trio shell of `DurabilityCore`. Start with `nursery.start(run)`.

    `dirty` must be called on the Trio thread: the RAM cache's `on_put` runs on
    the engine thread, so the wiring forwards it with
    `trio_token.run_sync_soon(coordinator.dirty, namespace, tokens)` (FIFO, so a put
    is recorded before the reply of the request that made it)."""

    def __init__(
        self,
        ports: DurabilityPorts,
        *,
        debounce_s: float = DEBOUNCE_S_DEFAULT,
        busy_rearm_s: float = BUSY_REARM_S_DEFAULT,
        retry_s: float = RETRY_S_DEFAULT,
        retry_max_s: float = RETRY_MAX_S_DEFAULT,
        journal: Journal | None = None,
        admission: AdmissionPort | None = None,
    ) -> None:
        self.core = DurabilityCore(debounce_s, busy_rearm_s, retry_s=retry_s, retry_max_s=retry_max_s)
        self._ports = ports
        self._admission = admission
        # Closed, the attempts still in flight have nobody to report to: they are cancelled.
        self._actor = ActorShell("durability", self.core, self._perform, journal=journal, cancel_tasks_on_close=True)
        self._flush_ids = itertools.count(1)
        self._verdicts: dict[int, Reply[FlushVerdict]] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self._actor.run(task_status=task_status)

    def close(self) -> None:
        """Stop: `run` returns, cancelling the attempts in flight."""
        self._actor.close()

    def dirty(self, namespace: str, tokens: Iterable[int]) -> None:
        """Record a put (Trio thread only; never blocks)."""
        # `on_put` hands a tuple of ints already: no second pass over a long prompt.
        token_tuple: tuple[int, ...] = tokens if isinstance(tokens, tuple) else tuple(int(t) for t in tokens)
        self._send(Dirty(namespace=namespace, tokens=token_tuple))

    def wiped(self, selector: WipeSelector) -> None:
        """A wipe is done: forget the records it selects (Trio thread only)."""
        self._send(Wiped(selector=selector))

    def admission_granted(self, key: RecordKey) -> None:
        """Admission now admits the snapshot it held back for `key` (Trio thread only)."""
        self._send(AdmissionGranted(key=key))

    async def flush(self, timeout_s: float | None = None) -> FlushVerdict:
        """Force every put made before this call to the SSD tier and say whether
        it is durable (spec §5.6). A flush asked while one runs is answered
        after it, by the next run. Past `timeout_s` (None: no bound) the answer
        is a not-durable verdict with `timed_out` and the evidence so far; a
        flush that had begun goes on, and its outcome is journaled."""
        flush_id = next(self._flush_ids)
        answered = self._verdicts[flush_id] = Reply[FlushVerdict]()
        asked_s = trio.current_time()
        try:
            await self._actor.send(Flush(flush_id=flush_id))
            with trio.move_on_after(math.inf if timeout_s is None else timeout_s):
                await answered.settled()
        finally:
            self._verdicts.pop(flush_id, None)
        if answered.is_set:  # also when the verdict came as the deadline passed
            return answered.result()
        # Answered from the core's state as it is now, without a checkpoint in
        # between; the message then withdraws a queued flush and journals the
        # timeout. Sent through the mailbox, so it follows our `Flush`.
        now = trio.current_time()
        verdict = attrs.evolve(self.core.timed_out_verdict(flush_id, now), elapsed_s=now - asked_s)
        self._send(FlushTimedOut(flush_id=flush_id))
        log.warning(
            "flush %d not answered within %s s: not durable (%d pending, %d dropped, %d failed, "
            "%d missing, %d dirty in all); begun, it goes on in the background",
            flush_id,
            timeout_s,
            verdict.pending,
            verdict.dropped,
            verdict.failed,
            verdict.missing_uncovered,
            verdict.dirty_keys_count,
        )
        return verdict

    def stats(self) -> dict[str, Any]:
        return self.core.stats()

    def _send(self, msg: Any) -> None:
        try:
            self._actor.send_nowait(msg)
        except trio.ClosedResourceError:
            log.debug("durability coordinator closed; %s ignored", type(msg).__name__)

    def _perform(self, effect: StartAttempt | DrainQueue | CheckCoverage | FlushVerdict) -> None:
        match effect:
            case StartAttempt():
                # A timed attempt never waits behind requests: a busy gateway re-arms (spec §5.5).
                if not effect.forced and self._ports.gateway_busy():
                    self._send(AttemptDeferred(key=effect.key, version=effect.version))
                else:
                    self._actor.start_soon(self._attempt, effect)
            case DrainQueue():
                self._actor.start_soon(self._drain, effect.flush_id)
            case CheckCoverage():
                covered = frozenset(key for key in effect.keys if self._covers(key))
                self._send(CoverageChecked(flush_id=effect.flush_id, covered=covered))
            case FlushVerdict():
                self._answer(effect)
            case _:
                assert_never(effect)

    def _answer(self, verdict: FlushVerdict) -> None:
        log.info(
            "flush %d: durable=%s pending=%d dropped=%d failed=%d missing=%d (%.3f s)",
            verdict.flush_id,
            verdict.durable,
            verdict.pending,
            verdict.dropped,
            verdict.failed,
            verdict.missing_uncovered,
            verdict.elapsed_s,
        )
        answered = self._verdicts.get(verdict.flush_id)
        if answered is not None:
            answered.set(verdict)

    def _why_missing(self, key: RecordKey) -> str:
        """ "skipped" when admission refused the entry's spill, else "missing"."""
        if self._admission is not None and self._admission.was_skipped(key):
            return "skipped"
        return "missing"

    def _covers(self, key: RecordKey) -> bool:
        try:
            return self._ports.covers(key.tokens, key.namespace)
        except Exception:
            log.exception("coverage check failed; counted as not covered")
            return False

    async def _drain(self, flush_id: int) -> None:
        try:
            await self._ports.wait_queue_idle()
        except Exception:
            # The forced attempts still report their own outcomes; a broken drain only loses the wait.
            log.exception("waiting for the spill queue to drain failed")
        self._send(QueueDrained(flush_id=flush_id))

    async def _attempt(self, start: StartAttempt) -> None:
        outcome = await self._attempt_outcome(start.key, forced=start.forced)
        self._send(AttemptResult(key=start.key, version=start.version, outcome=outcome))

    async def _attempt_outcome(self, key: RecordKey, *, forced: bool) -> str:
        ports, tokens, namespace = self._ports, key.tokens, key.namespace

        def engine_turn() -> str | SpillSnapshot:
            # Coverage first: an entry already durable costs no clone.
            if ports.covers(tokens, namespace):
                return "covered"
            snapshot = ports.snapshot_exact(tokens, namespace)
            if snapshot is not None:
                return snapshot
            # Gone from RAM: "stored" only if the committed index already covers it.
            return "covered" if ports.covers(tokens, namespace) else "missing"

        try:
            found = await ports.run_when_idle(engine_turn)
        except Exception:
            log.exception("durability snapshot of %d tokens failed", len(tokens))
            return "failed"
        if isinstance(found, str):
            return self._why_missing(key) if found == "missing" else found
        try:
            outcome = await ports.submit(found, forced=forced)
        except Exception:
            log.exception("submitting a snapshot of %d tokens failed", len(tokens))
            return "failed"
        if outcome == REFUSED and not forced:
            # Held back by admission: the snapshot's views went with the refusal; a flush forces the record.
            return "held"
        if outcome not in SUBMIT_OUTCOMES:
            log.error("spill queue answered %r; counted as failed", outcome)
            return "failed"
        return outcome
