"""The whole system in one nursery: engine thread, gateway, batch-lane
scheduler, RAM and SSD tiers, spill queue, durability coordinator and SSD writer.

    async with open_system(SystemConfig(model_dir=...)) as system:
        async for event in system.generate(request): ...
        verdict = await system.flush()

`SystemConfig` holds what a user sets; `SystemSeams` what a test or the
simulator replaces of the world the system runs in (engine, clocks, blocking
I/O, the store and its disk, the durability safeguards), real by default.

The RAM tier lives on the engine thread (every take and put is MLX work);
its one events port, the write-behind pipeline (`actors/write_behind.py`),
hands takes, puts and spills to the Trio thread with `run_sync_soon`, so the
engine never waits on the queue or the coordinator.

Requests take the batch lane (the Scheduler) when `batch_rows_max` > 1 and
the model and KV scheme pass its gates, and the serial lane otherwise; the
reason is logged at start and shown in `stats()["scheduler"]`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

import attrs
import trio

from kvcellar.actors.admission import AdmissionGate
from kvcellar.actors.checkpoint_writer import SPILL_QUEUE_SHARE, CheckpointWriter
from kvcellar.actors.durability_shell import DurabilityCoordinator
from kvcellar.actors.gateway import Gateway
from kvcellar.actors.prefill_progress import PrefillProgress, TrioPrefillObserver
from kvcellar.actors.recent_requests import RecentRequests, recorded
from kvcellar.actors.scheduler import Scheduler, open_batch_lane
from kvcellar.actors.spill_queue import SpillQueue, bytes_max_from_env
from kvcellar.actors.ssd_writer import SsdWriter
from kvcellar.actors.system_config import (
    JOURNAL_CATCH_UP_S,
    WRITE_BEHIND_ENV,
    FlushResult,
    SystemConfig,
    SystemSeams,
    write_behind_from_env,
)
from kvcellar.actors.system_wiring import (
    admission_core,
    demote_idle_forever,
    give_guard_the_ssd_tier,
    load_model_beside_store,
    open_memory_guard,
    open_paged_kv,
    open_restore_policy,
    open_store,
    start_shared_tier,
)
from kvcellar.actors.uploader import SharedTier
from kvcellar.actors.wipes import Wipes
from kvcellar.actors.write_behind import WriteBehind
from kvcellar.actors.write_budget import BudgetedWrites
from kvcellar.engine.checkpointing import Checkpointing
from kvcellar.engine.compute_dtype import ComputeDtype
from kvcellar.engine.engine import MODEL_DTYPE, EngineThread, LoadedModel, resolve_compute_dtype
from kvcellar.engine.generation import GenerationDone, GenerationRequest, TokenDelta, run_generation
from kvcellar.engine.memory import MemoryGuard, MemoryMeter, MlxMemoryMeter
from kvcellar.engine.paged_kv import PagedKv
from kvcellar.engine.restore_policy import PolicyColdTier
from kvcellar.engine.speculative import Drafter, admission_draft_kv_bytes_per_token, open_drafter
from kvcellar.errors import EngineStopped, JournalError, UsageError
from kvcellar.store.checkpoints import CheckpointStore
from kvcellar.store.journal import JournalEvent
from kvcellar.store.prompt_cache import PromptCache
from kvcellar.store.scheme import KvScheme, resolve_kv_scheme
from kvcellar.store.ssd import SsdStore
from kvcellar.store.write_wear import WearMonitor

log = logging.getLogger("kvcellar.system")


class System:
    """Handles for a running system; made by `open_system`."""

    def __init__(
        self,
        config: SystemConfig,
        engine: EngineThread,
        loaded: LoadedModel,
        scheme: KvScheme,
        prompt_cache: PromptCache,
        store: SsdStore | None,
        *,
        seams: SystemSeams,
        write_behind: WriteBehind,
    ) -> None:
        self.config = config
        self.seams = seams
        self.engine = engine
        self.loaded = loaded
        self.scheme = scheme
        self.prompt_cache = prompt_cache
        self.store = store
        self.gateway: Gateway
        self.scheduler: Scheduler | None = None
        self.serial_reason = ""
        self.drafter: Drafter | None = None  # `--draft-model` (engine/speculative.py)
        self.queue: SpillQueue | None = None
        # The RAM tier's events port and the pipeline behind it (admission, coordinator, queue).
        self.write_behind = write_behind
        self.durability: DurabilityCoordinator | None = None
        self.admission: AdmissionGate | None = write_behind.admission
        self.wear: WearMonitor | None = None
        self.budgeted_writes: BudgetedWrites | None = None
        self.shared: SharedTier | None = None
        self.checkpointing: Checkpointing | None = None
        self.checkpoint_writer: CheckpointWriter | None = None
        self._shutdown_verdict: FlushResult | None = None
        self._shutdown_done: trio.Event | None = None
        # None when the budget is 0 (off). Owned by the engine thread but for
        # `check_memory`'s static check, whose refusals this Trio-side count holds.
        self.memory_guard: MemoryGuard | None = None
        # Paged KV's layout and pool ledger (engine/paged_kv.py); None when --paged-kv is off.
        self.paged_kv: PagedKv | None = None
        # The SSD tier's restore policy (issue 44); None without the tier.
        self.restore_policy: PolicyColdTier | None = None
        self.memory_meter: MemoryMeter = seams.memory_meter or MlxMemoryMeter()
        self._memory_refused_at_gate = 0
        # The cache wipes (`POST /admin/cache/wipe`; actors/wipes.py).
        self.wipes = Wipes(self)
        # Owned by the Trio thread: fed by `generate` and `flush`, read by `stats` and the routes.
        self.recent_requests = RecentRequests(config.recent_requests_max)
        # Owned by the Trio thread: the engine's reports reach it through `TrioPrefillObserver`.
        self.prefill_progress = PrefillProgress(trio.current_time)
        self.flushes = 0
        self.last_flush: tuple[float, FlushResult] | None = None

    @property
    def admitting(self) -> bool:
        return self.gateway.core.admitting and (self.scheduler is None or self.scheduler.core.admitting)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta | GenerationDone]:
        """Run one request as a batch row, or on the serial lane when the batch
        lane is off, streaming its tokens; when it ends (done, cancelled or
        failed) it is recorded in `recent_requests`. Until its first token its
        prefill's progress shows in `prefill_progress`."""
        progress_id = self.prefill_progress.begin(len(request.prompt_ids))
        observer = TrioPrefillObserver(
            table=self.prefill_progress,
            row_id=progress_id,
            trio_token=trio.lowlevel.current_trio_token(),
            hook=self.seams.prefill_chunk_hook,
        )
        items = recorded(
            self._generate_measured(attrs.evolve(request, prefill_observer=observer)),
            self.recent_requests,
            prompt_tokens=len(request.prompt_ids),
            clock_s=trio.current_time,
            wall_clock_s=self.seams.wall_clock_s,
            notes=request.notes,
            prompt_ids=request.prompt_ids,
        )
        try:
            async with aclosing(items) as stream:
                async for item in stream:
                    # The first item is the first token (or the end): the prefill is over.
                    self.prefill_progress.end(progress_id)
                    yield item
        finally:
            self.prefill_progress.end(progress_id)

    async def _generate_measured(self, request: GenerationRequest) -> AsyncGenerator[TokenDelta | GenerationDone, None]:
        """The request on its lane; under the cost admission policy its cold
        prefill rate is measured on the way."""
        if self.admission is None or not self.admission.measures_prefill:
            async with aclosing(self._generate_on_a_lane(request)) as items:
                async for item in items:
                    yield item
            return
        async with aclosing(self._generate_measuring_prefill(request, self.admission)) as items:
            async for item in items:
                yield item

    async def _generate_measuring_prefill(
        self, request: GenerationRequest, admission: AdmissionGate
    ) -> AsyncGenerator[TokenDelta | GenerationDone, None]:
        """The cost policy's prefill rate: a cold prefill's tokens over the
        time to the first token (which includes any wait for the lane, so the
        rate errs low and admission towards writing)."""
        started_s, first_token_s = trio.current_time(), None
        async with aclosing(self._generate_on_a_lane(request)) as items:
            async for item in items:
                if first_token_s is None:
                    first_token_s = trio.current_time()
                if isinstance(item, GenerationDone) and item.cache_tier != "ssd":
                    admission.prefill_measured(item.prompt_tokens - item.cached_tokens, first_token_s - started_s)
                yield item

    async def _generate_on_a_lane(
        self, request: GenerationRequest
    ) -> AsyncGenerator[TokenDelta | GenerationDone, None]:
        self.check_memory(request)
        if self.seams.logits_processors is not None:
            added = tuple(self.seams.logits_processors(request))
            request = attrs.evolve(request, logits_processors=request.logits_processors + added)
        if self.shared is not None:
            await self.shared.before_request(request.prompt_ids, self.prompt_cache.readable(request.namespace))
        if self.scheduler is not None and not (self.drafter is not None and self.drafter.serial_lane_wanted(request)):
            # aclosing: a consumer that stops early cancels its row now, not when collected.
            async with aclosing(self.scheduler.generate(request)) as items:
                async for item in items:
                    yield item
            return
        cancelled = threading.Event()

        def job(loaded: LoadedModel):
            return run_generation(
                loaded,
                self.prompt_cache,
                request,
                cancelled,
                scheme=self.scheme,
                prefill_step_tokens=self.config.prefill_step_tokens,
                memory_guard=self.memory_guard,
                checkpointing=self.checkpointing,
                paged_kv=self.paged_kv,
                drafter=self.drafter,
            )

        async for item in self.gateway.generate(job, prompt_tokens=len(request.prompt_ids), cancelled=cancelled):
            yield item

    async def flush(self, timeout_s: float | None = None) -> FlushResult:
        """Persist everything dirty and say whether all of it is on disk. It
        always answers, by `timeout_s` (None: no bound): past it with
        `reason="timeout"` and the evidence so far, while a begun flush goes
        on in the background (journaled). A flush admits every write and
        writes past the SSD write budget if it must, and says by how many
        bytes. The verdict is kept as `last_flush`."""
        verdict = await self._flush_within_budget(timeout_s)
        self.flushes += 1
        self.last_flush = (self.seams.wall_clock_s(), verdict)
        return verdict

    async def _flush_within_budget(self, timeout_s: float | None) -> FlushResult:
        with self.write_behind.flush_window():
            if self.budgeted_writes is None:
                return await self._flush_everything(timeout_s)
            with self.budgeted_writes.write_window() as over_budget_bytes:
                result = await self._flush_everything(timeout_s)
                return attrs.evolve(result, over_budget_bytes=over_budget_bytes())

    async def _flush_everything(self, timeout_s: float | None) -> FlushResult:
        """The generation checkpoints queued are written first and reported
        as evidence, then every dirty prefix."""
        started_s = trio.current_time()
        pending_checkpoints, failed_checkpoints = await self._drain_checkpoints(timeout_s)
        left_s = None if timeout_s is None else max(0.0, timeout_s - (trio.current_time() - started_s))
        verdict = await self._flush_prefixes(left_s)
        return attrs.evolve(verdict, pending_checkpoints=pending_checkpoints, failed_checkpoints=failed_checkpoints)

    async def _drain_checkpoints(self, timeout_s: float | None) -> tuple[int, int]:
        """Wait (bounded) for the checkpoint writer; (still pending, failed meanwhile)."""
        writer = self.checkpoint_writer
        if writer is None:
            return 0, 0
        failed_before = writer.stats()["failed"]
        with trio.move_on_after(math.inf if timeout_s is None else timeout_s):
            await writer.wait_idle()
        after = writer.stats()
        return after["held"], after["failed"] - failed_before

    async def _flush_prefixes(self, timeout_s: float | None) -> FlushResult:
        if self.store is None:
            return FlushResult(
                durable=False,
                reason="no SSD tier",
                pending=0,
                dropped=0,
                failed=0,
                missing=0,
                entries=0,
                longest_durable_prefix_tokens=0,
                note="no SSD tier (serve with --ssd-cache DIR): nothing survives a restart",
            )
        if self.durability is None:
            return await self._flush_spills_only(timeout_s)
        verdict = await self.durability.flush(timeout_s)
        if not verdict.timed_out:
            await self._journal_caught_up()
        note = "a flush that had begun goes on in the background (journaled)" if verdict.timed_out else ""
        return FlushResult(
            durable=verdict.durable,
            reason=verdict.reason,
            pending=verdict.pending,
            dropped=verdict.dropped,
            failed=verdict.failed,
            missing=verdict.missing,
            skipped_by_admission=verdict.skipped_by_admission,
            pending_spills=self._pending_spills(),
            entries=len(self.store.entry_ids()),
            longest_durable_prefix_tokens=self.store.longest_entry_tokens(),
            note=note,
        )

    async def flush_shared(self, timeout_s: float | None = None) -> tuple[FlushResult, dict[str, Any]]:
        """`flush`, then the shared tier's own verdict within what is left of
        `timeout_s`: every local entry committed to the shared store or not,
        with its evidence (`SharedTier.flush`)."""
        started_s = trio.current_time()
        verdict = await self.flush(timeout_s)
        if self.shared is None:
            return verdict, {"durable": False, "reason": "no shared tier"}
        left_s = None if timeout_s is None else max(0.0, timeout_s - (trio.current_time() - started_s))
        return verdict, await self.shared.flush(left_s)

    async def _flush_spills_only(self, timeout_s: float | None) -> FlushResult:
        """Write-behind off: drain what the spill queue holds (evictions,
        demotions), bounded by `timeout_s`, and say what became of it. Never
        durable: puts are not tracked, so RAM entries are not vouched for."""
        assert self.queue is not None and self.store is not None
        before = self.queue.stats()
        with trio.move_on_after(math.inf if timeout_s is None else timeout_s) as bound:
            await self.queue.wait_idle()
        after = self.queue.stats()
        stored, dropped, failed = (after[name] - before[name] for name in ("stored", "dropped", "failed"))
        pending = self._pending_spills()
        drain = "did not drain in time" if bound.cancelled_caught else "was drained"
        note = (
            f"write-behind is off ({WRITE_BEHIND_ENV}=0): RAM entries reach the SSD tier only when evicted "
            f"or demoted, so no put is tracked as dirty; the spill queue {drain}: {stored} stored, "
            f"{dropped} dropped, {failed} failed, {pending} pending"
        )
        return FlushResult(
            durable=False,
            reason="timeout" if bound.cancelled_caught else "write-behind off",
            pending=pending,
            dropped=dropped,
            failed=failed,
            missing=0,
            pending_spills=pending,
            entries=len(self.store.entry_ids()),
            longest_durable_prefix_tokens=self.store.longest_entry_tokens(),
            note=note,
        )

    async def _journal_caught_up(self) -> None:
        """Let the journal apply what is queued, so `kvcellar journal` beside
        the server sees what the verdict covers. The files are the truth: a
        journal that lags (or is degraded) changes no verdict."""
        journal = self.store.journal if self.store is not None else None
        if journal is None or journal.degraded:
            return
        try:
            await self.seams.run_blocking(journal.wait_applied, JOURNAL_CATCH_UP_S)
        except JournalError as e:
            log.warning("flush: %s", e)

    def _pending_spills(self) -> int:
        # `held` also counts snapshots whose Enqueue the queue's core has not read yet.
        return self.queue.stats()["held"] if self.queue is not None else 0

    async def shutdown(self) -> FlushResult | None:
        """Stop admission, drain active requests, flush, then write the spills
        still queued, all bounded by `shutdown_timeout_s`; the verdict always
        comes (reason "timeout" past the bound). Whatever is not durable by
        then is counted in one WARNING: its queued spills are dropped when the
        system closes. Once is enough: later (and concurrent) calls return the
        first verdict; None only if that first call was cancelled."""
        if self._shutdown_done is not None:
            await self._shutdown_done.wait()
            return self._shutdown_verdict
        self._shutdown_done = trio.Event()
        try:
            await self.gateway.stop_admission()
            if self.scheduler is not None:
                await self.scheduler.stop_admission()
            deadline = trio.current_time() + self.config.shutdown_timeout_s
            with trio.move_on_at(deadline):
                if self.scheduler is not None:
                    await self.scheduler.drain()
                await self.gateway.drain()
                # A request whose client left is over for the lanes at once, but its engine
                # job still ends its chunk and puts its prefix (issue 38): the lanes' jobs run
                # in order, so one more job returns after that put is recorded, within a chunk.
                with contextlib.suppress(EngineStopped):
                    await self.engine.call(lambda _: None, needs_model=False, label="drain")
            verdict = await self.flush(timeout_s=max(0.0, deadline - trio.current_time()))
            if self.queue is not None and self._pending_spills():
                # Spills queued after the flush's drain (an idle demotion) or left by a timeout.
                with trio.move_on_at(deadline), self._write_window():
                    await self.queue.wait_idle()
            self._warn_not_durable(verdict)
            if self.restore_policy is not None:
                # Inside the bound too; past it the copy written while serving (at most 10 s old) stands.
                with trio.move_on_at(deadline):
                    await self.seams.run_blocking(self.restore_policy.book.persist)
            self._shutdown_verdict = verdict
            return verdict
        finally:
            self._shutdown_done.set()

    def _write_window(self) -> contextlib.AbstractContextManager[Any]:
        """Shutdown's last writes do not wait for the write budget either."""
        return self.budgeted_writes.write_window() if self.budgeted_writes is not None else contextlib.nullcontext()

    def _warn_not_durable(self, verdict: FlushResult) -> None:
        if verdict.reason == "timeout":
            log.warning("shutdown flush did not finish within %g s", self.config.shutdown_timeout_s)
        dirty = self.durability.stats()["pending_snapshots"] if self.durability is not None else 0
        spills = self._pending_spills()
        if dirty or spills:
            spill_bytes = self.queue.stats()["pending_bytes"] if self.queue is not None else 0
            log.warning(
                "shutdown: %d prefixes were not made durable: %d write-behind records still dirty, "
                "%d queued spills (%d bytes) dropped unwritten",
                dirty + spills,
                dirty,
                spills,
                spill_bytes,
            )

    def stats(self) -> dict[str, Any]:
        ssd: dict[str, Any] = {}
        if self.store is not None:
            store_stats = self.store.stats()
            queue_stats = self.queue.stats() if self.queue else {}
            durability_stats = self.durability.stats() if self.durability else {}
            ssd = {
                "entries": store_stats["entries"],
                "bytes": store_stats["bytes"],
                "companion_bytes": store_stats["companion_bytes"],
                "max_bytes": store_stats["bytes_max"],
                "restores": store_stats["restores"],
                "spills": store_stats["entries_stored"],
                "restore_ms_last": store_stats["restore_ms_last"],
                "demotions": self.prompt_cache.stats()["demotions"],
                "pending_snapshots": durability_stats.get("pending_snapshots", 0),
                "pending_spills": queue_stats.get("pending", 0),
                "pending_spill_bytes": queue_stats.get("pending_bytes", 0),
                "dropped_spills": queue_stats.get("dropped", 0),
                "failed_spills": queue_stats.get("failed", 0),
                "longest_durable_prefix_tokens": self.store.longest_entry_tokens(),
                "quarantined": store_stats["quarantined"],
                "wiped": store_stats["wiped"],
                "wipe_dropped_commits": store_stats["wipe_dropped_commits"],
                "journal": store_stats["journal"],
                **self._wear_stats(),
                "verify_tensors": store_stats["verify_tensors"],
                "by_tenant": store_stats["by_tenant"],
            }
        return {
            "prompt_cache": self.prompt_cache.stats(),
            "gateway": self.gateway.stats(),
            "ssd_cache": ssd,
            "kv_scheme": self.scheme.cache_key,
            "compute_dtype": self.loaded.compute.as_stats(),
            "scheduler": self._scheduler_stats(),
            "shared_cache": self.shared.stats() if self.shared is not None else {},
            "memory": self.memory_stats(),
            "requests": self.recent_requests.stats(),
            "prefill": self.prefill_progress.stats(),
            "flush": self._flush_stats(),
            "wipes": self.wipes.stats(),
            "speculative": self.drafter.stats.snapshot() if self.drafter is not None else {},
            "checkpoints": self._checkpoint_stats(),
            "paged_kv": self.paged_kv.stats() if self.paged_kv is not None else {},
            "restore_policy": self.restore_policy.stats() if self.restore_policy is not None else {},
        }

    def check_memory(self, request: GenerationRequest) -> None:
        """On the Trio thread, before a request streams: raise
        `InsufficientMemory` when its worst-case footprint exceeds the whole
        budget less the weights (the engine checks again with what is live)."""
        guard = self.memory_guard
        if guard is None:
            return
        draft_bytes = admission_draft_kv_bytes_per_token(self.drafter, request)
        footprint = guard.footprint.request_bytes(len(request.prompt_ids), request.params.max_tokens, draft_bytes)
        refusal = guard.fits_budget(footprint)
        if refusal is not None:
            self._memory_refused_at_gate += 1
            raise refusal

    def memory_stats(self) -> dict[str, Any]:
        """/stats's `memory` (engine/memory.py's `MemoryGuard.stats`)."""
        if self.memory_guard is None:
            meter = self.memory_meter
            return {
                "budget_bytes": 0,
                "active_bytes": meter.active_bytes(),
                "peak_bytes": meter.peak_bytes(),
                "cache_bytes": meter.cache_bytes(),
            }
        stats = self.memory_guard.stats()
        stats["requests_refused"] += self._memory_refused_at_gate
        return stats

    def _wear_stats(self) -> dict[str, Any]:
        """Issue 21's `/stats` `ssd_cache` keys: the admission policy and its
        counts, the write budget (None when unlimited) and the write wear
        since this server started (`store/write_wear.py`)."""
        return {
            "admission": self.admission.stats() if self.admission is not None else {"policy": "always"},
            "write_budget": self.budgeted_writes.stats() if self.budgeted_writes is not None else None,
            "write_wear": self.wear.wear_stats() if self.wear is not None else None,
        }

    def _checkpoint_stats(self) -> dict[str, Any]:
        """/stats's `checkpoints` (empty when they are off)."""
        if self.checkpointing is None or self.checkpoint_writer is None:
            return {}
        stored = self.checkpointing.store.stats()
        queue = self.checkpoint_writer.stats()
        return {
            "interval_tokens": self.checkpointing.interval_tokens,
            "written": stored["written"],
            "written_bytes": stored["written_bytes"],
            "resumed": stored["resumed"],
            "tokens_saved": stored["tokens_saved"],
            "skipped": stored["skipped"],
            "pending": queue["pending"],
            "pending_bytes": queue["pending_bytes"],
            "failed": queue["failed"],
            "dropped": queue["dropped"],
            "invalidated": stored["invalidated"],
            "removed": stored["removed"],
            "quarantined": stored["quarantined"],
            "restore_failures": stored["restore_failures"],
            "files": stored["files"],
            "companion_bytes": stored["companion_bytes"],
            "queue_max_bytes": queue["queue_bytes_max"],
        }

    def _scheduler_stats(self) -> dict[str, Any]:
        if self.scheduler is not None:
            return self.scheduler.stats()
        gateway = self.gateway.stats()
        return {
            "lane": "serial",
            "reason": self.serial_reason,
            "batch_size": 1,
            "rows_active": int(gateway["lane"] == "generating"),
            "waiting": gateway["waiting"],
        }

    def _flush_stats(self) -> dict[str, Any]:
        """`/stats` `flush`: how many flushes answered and the last verdict
        (None before the first), stamped with when it answered."""
        last = None
        if self.last_flush is not None:
            answered_at_s, verdict = self.last_flush
            last = {"answered_at_s": answered_at_s, **attrs.asdict(verdict)}
        return {"flushes": self.flushes, "last": last}

    async def recent_journal_events(
        self, limit: int, timeout_s: float = JOURNAL_CATCH_UP_S
    ) -> list[JournalEvent] | None:
        """The journal's last `limit` events, oldest first, read on the
        journal's owner behind every queued append (off the Trio thread);
        None without a journal (no SSD tier)."""
        journal = self.store.journal if self.store is not None else None
        if journal is None:
            return None
        return await self.seams.run_blocking(lambda: journal.recent_events(limit, timeout_s=timeout_s))


@asynccontextmanager
async def open_system(config: SystemConfig, seams: SystemSeams | None = None) -> AsyncIterator[System]:
    """Start everything in one nursery; on exit shut down gracefully (stop
    admission, drain, flush bounded by `shutdown_timeout_s`) and close.
    `seams`: what a test or the simulator replaces (None: the real world)."""
    seams = seams or SystemSeams()
    engine = seams.engine or EngineThread(
        config.model_dir,
        turn_log=seams.turn_log,
        compute=await seams.run_blocking(lambda: resolve_compute_dtype(config.compute_dtype, config.model_dir)),
    )
    # A seam's engine (tests, the simulator) loads as it was built: the weights' own dtype unless it says otherwise.
    compute: ComputeDtype = getattr(engine, "compute", MODEL_DTYPE)
    log.info("compute dtype: %s (%s)", compute.cast_to or "the weights' own", compute.reason)
    store: SsdStore | None = None
    try:
        scheme = resolve_kv_scheme(config.kv_quant, config.model_dir)
        # The simulator's store (`store_opener`) has no wear monitor: it models no drive wear.
        wear: WearMonitor | None = None
        if seams.store_opener is not None:
            # After the model, in one order: the simulator's seams run deterministically.
            loaded = await engine.start()
            store, tokenizer_hash = seams.store_opener(config, scheme), ""
        else:
            wear = monitor = WearMonitor(bytes_per_day=config.ssd_write_budget_bytes_per_day, clock_ns=time.time_ns)
            loaded, store, tokenizer_hash = await load_model_beside_store(
                engine, lambda: open_store(config, seams, scheme, monitor, compute)
            )
        paged_kv = await open_paged_kv(engine, config.paged_kv_block_size, scheme)
        # Before the actors: the memory guard measures what MLX holds, the draft's weights included.
        drafter = seams.drafter or await open_drafter(engine, config)
        async with trio.open_nursery() as nursery:
            system = await _start_actors(
                nursery, config, seams, engine, loaded, scheme, store, tokenizer_hash, wear, paged_kv
            )
            system.drafter = drafter
            try:
                # Before anything is served: the wipes a crash left unfinished (their SSD part ran at open).
                await system.wipes.resume()
                yield system
                await system.shutdown()
            finally:
                nursery.cancel_scope.cancel()
    finally:
        if store is not None:
            store.close()
        engine.stop()


async def _start_actors(
    nursery: trio.Nursery,
    config: SystemConfig,
    seams: SystemSeams,
    engine: EngineThread,
    loaded: LoadedModel,
    scheme: KvScheme,
    store: SsdStore | None,
    tokenizer_hash: str,
    wear: WearMonitor | None = None,
    paged_kv: PagedKv | None = None,
) -> System:
    """Start the actors tier by tier, each tier on the ones before it: the
    gateway and the RAM tier, the lanes (with the checkpoint writer), the SSD
    tier's writers, the shared tier."""
    token = trio.lowlevel.current_trio_token()
    system = await _start_ram_tier(nursery, config, seams, engine, loaded, scheme, store)
    system.paged_kv = paged_kv
    queue_bytes = await _start_lanes(nursery, system, token)
    if store is None:
        if config.shared_cache is not None:
            raise UsageError("the shared cache needs the SSD tier (--ssd-cache): downloads land there")
        return system
    await _start_ssd_tier(nursery, system, store, tokenizer_hash, wear, queue_bytes)
    if config.shared_cache is not None:
        system.shared = await start_shared_tier(nursery, config.shared_cache, seams, store, system.gateway)
    return system


async def _start_ram_tier(
    nursery: trio.Nursery,
    config: SystemConfig,
    seams: SystemSeams,
    engine: EngineThread,
    loaded: LoadedModel,
    scheme: KvScheme,
    store: SsdStore | None,
) -> System:
    """Start the gateway (the one engine lane) and make the RAM tier and its memory guard."""
    journal = store.journal if store is not None else None
    gateway = Gateway(engine, journal=journal)
    await nursery.start(gateway.run)
    # A forced restore is the tier as it was before the policy: nothing measured, nothing predicted.
    measured = config.restore_policy != "restore"
    policy = await open_restore_policy(engine, config, store, scheme) if store is not None and measured else None
    cold_tier = policy if policy is not None else store
    write_behind = WriteBehind(
        trio.lowlevel.current_trio_token(),
        store=store,
        admission=admission_core(config),
        durable_puts=config.write_behind if config.write_behind is not None else write_behind_from_env(),
    )
    tenants = config.tenants
    prompt_cache = PromptCache(
        config.prompt_cache_bytes,
        cold_tier=cold_tier,
        events=write_behind,
        clock_s=seams.clock_s,
        owner_bytes_max=tenants.ram_quotas() if tenants else None,
        shared_namespaces=tenants.shared_namespaces() if tenants else (),
    )
    system = System(config, engine, loaded, scheme, prompt_cache, store, seams=seams, write_behind=write_behind)
    system.restore_policy = policy
    system.gateway = gateway
    system.memory_guard = await open_memory_guard(engine, config, system.memory_meter, scheme, prompt_cache, journal)
    return system


async def _start_lanes(nursery: trio.Nursery, system: System, token: trio.lowlevel.TrioToken) -> int:
    """Start the checkpoint writer (when on) and the batch lane; returns the
    spill queue's byte budget, less the checkpoints' share."""
    config, store = system.config, system.store
    journal = store.journal if store is not None else None
    kv_budget_bytes = config.kv_budget_bytes
    if system.memory_guard is not None:
        # The batch lane's KV budget is bounded by the memory budget's headroom after the weights.
        headroom = system.memory_guard.budget_bytes - system.memory_guard.weights_bytes
        kv_budget_bytes = max(0, min(kv_budget_bytes, headroom))
    queue_bytes = 0
    if store is not None:
        queue_bytes = config.spill_queue_bytes if config.spill_queue_bytes is not None else bytes_max_from_env()
    if config.generation_checkpoint_tokens > 0:
        queue_bytes = await _start_checkpoints(nursery, system, store, queue_bytes, token)
    system.scheduler, system.serial_reason = await open_batch_lane(
        nursery,
        engine=system.engine,
        gateway=system.gateway,
        prompt_cache=system.prompt_cache,
        scheme=system.scheme,
        rows_max=config.batch_rows_max,
        kv_budget_bytes=kv_budget_bytes,
        prefill_step_tokens=config.prefill_step_tokens,
        journal=journal,
        memory_guard=system.memory_guard,
        checkpointing=system.checkpointing,
        paged_kv=system.paged_kv,
    )
    return queue_bytes


async def _start_ssd_tier(
    nursery: trio.Nursery,
    system: System,
    store: SsdStore,
    tokenizer_hash: str,
    wear: WearMonitor | None,
    queue_bytes: int,
) -> None:
    """Start the SSD writer behind the spill queue (and the write budget), the
    write-behind pipeline over them (the RAM tier's spills through admission
    into the queue; the durability coordinator when write-behind is on), and
    idle demotion."""
    config, seams, gateway, prompt_cache = system.config, system.seams, system.gateway, system.prompt_cache
    writer = SsdWriter(
        store,
        gateway.run_when_idle,
        journal=store.journal,
        tokenizer_hash=tokenizer_hash,
        run_blocking=seams.run_blocking,
        safeguards=seams.safeguards,
    )
    system.wear = wear
    if wear is not None and wear.budgeted:
        system.budgeted_writes = BudgetedWrites(wear, dropped_spills=lambda: queue.stats()["dropped"])
    write = system.budgeted_writes.wrap(writer.write) if system.budgeted_writes is not None else writer.write
    # The spill queue's one entrance asks SSD write admission (the gate the write-behind port made).
    queue = SpillQueue(write, bytes_max=queue_bytes, journal=store.journal, admission=system.admission)
    await nursery.start(queue.run)
    system.queue = queue
    if system.memory_guard is not None:
        give_guard_the_ssd_tier(system.memory_guard, store, queue, tokenizer_hash)
    await system.write_behind.start(
        nursery, config=config, gateway=gateway, prompt_cache=prompt_cache, queue=queue, writer=writer
    )
    system.durability = system.write_behind.durability
    if config.demote_idle_s > 0:
        nursery.start_soon(demote_idle_forever, gateway, prompt_cache, config.demote_idle_s)


async def _start_checkpoints(
    nursery: trio.Nursery, system: System, store: SsdStore | None, queue_bytes: int, token: trio.lowlevel.TrioToken
) -> int:
    """Open the checkpoint store and start its writer with its share of the
    spill queue's budget (spec §5.7); returns what is left for the spill queue."""
    config, seams = system.config, system.seams
    if store is None:
        raise UsageError("generation checkpoints need the SSD tier (serve --generation-checkpoint needs --ssd-cache)")
    checkpoint_store = await seams.run_blocking(CheckpointStore.open, store)
    share_bytes = int(queue_bytes * SPILL_QUEUE_SHARE)
    writer = CheckpointWriter(
        checkpoint_store, bytes_max=share_bytes, run_blocking=seams.run_blocking, journal=store.journal
    )
    await nursery.start(writer.run)
    system.checkpoint_writer = writer
    system.checkpointing = Checkpointing(
        interval_tokens=config.generation_checkpoint_tokens,
        store=checkpoint_store,
        submit=lambda snapshot: token.run_sync_soon(writer.submit_nowait, snapshot),
        invalidate=lambda key, attempt: token.run_sync_soon(writer.invalidate_nowait, key, attempt),
        kv_scheme_key=system.scheme.cache_key,
        safeguards=seams.safeguards,
        listeners=seams.checkpoint_listeners,
    )
    return queue_bytes - share_bytes
