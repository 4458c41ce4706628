"""The whole system in one nursery: engine thread, gateway, batch-lane
scheduler, RAM and SSD tiers, spill queue, durability coordinator and SSD writer.

    async with open_system(SystemConfig(model_dir=...)) as system:
        async for event in system.generate(request): ...
        verdict = await system.flush()

`SystemConfig` holds what a user sets; `SystemSeams` what a test or the
simulator replaces of the world the system runs in (engine, clocks, blocking
I/O, the store and its disk, the durability safeguards), real by default.

The RAM tier lives on the engine thread (every take and put is MLX work);
its spill sink and `on_put` hook hand their work to the Trio thread with
`run_sync_soon`, so the engine never waits on the queue or the coordinator.

Requests take the batch lane (the Scheduler) when `batch_rows_max` > 1 and
the model and KV scheme pass its gates, and the serial lane otherwise; the
reason is logged at start and shown in `stats()["scheduler"]`.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from kvcellar.actors.durability_shell import DurabilityCoordinator
from kvcellar.actors.gateway import Gateway
from kvcellar.actors.recent_requests import RECENT_REQUESTS_MAX_DEFAULT, RecentRequests, recorded
from kvcellar.actors.scheduler import KV_BUDGET_BYTES_DEFAULT, Scheduler, open_batch_lane
from kvcellar.actors.spill_queue import SpillQueue, bytes_max_from_env
from kvcellar.actors.ssd_writer import SsdWriter
from kvcellar.engine.engine import PREFILL_STEP_TOKENS, EngineThread, LoadedModel
from kvcellar.engine.generation import GenerationDone, GenerationRequest, TokenDelta, run_generation
from kvcellar.errors import UsageError
from kvcellar.store.disk import Disk
from kvcellar.store.fingerprint import ShardDigestMemo, compute_fingerprint
from kvcellar.store.journal import JournalError, JournalEvent
from kvcellar.store.prompt_cache import BYTES_MAX_DEFAULT, PromptCache, SpillSnapshot
from kvcellar.store.safeguards import SAFEGUARDS, Safeguards
from kvcellar.store.scheme import KvScheme, resolve_kv_scheme
from kvcellar.store.ssd import SsdStore

log = logging.getLogger("kvcellar.system")

WRITE_BEHIND_ENV = "KVCELLAR_SSD_WRITEBEHIND"
# How long a flush waits for the journal thread to apply what is queued.
JOURNAL_CATCH_UP_S = 5.0


def write_behind_from_env(environ: Any = os.environ) -> bool:
    return environ.get(WRITE_BEHIND_ENV, "1").strip() != "0"


@attrs.frozen(kw_only=True)
class SystemConfig:
    model_dir: Path
    ssd_dir: Path | None = None
    ssd_bytes_max: int | None = None
    ssd_verify: bool = True
    prompt_cache_bytes: int = BYTES_MAX_DEFAULT
    spill_queue_bytes: int | None = None
    write_behind: bool | None = None
    demote_idle_s: float = 300.0
    kv_quant: str = "bf16"
    debounce_s: float = 1.0
    busy_rearm_s: float = 5.0
    prefill_step_tokens: int = PREFILL_STEP_TOKENS
    shutdown_timeout_s: float = 120.0
    # Digests of weight and tokenizer files kept across starts (`serve` passes
    # one persisted under the user cache); None hashes every file each start.
    shard_digest_memo: ShardDigestMemo | None = attrs.field(default=None, eq=False)
    # Rows of the batch lane; 1 keeps every request on the serial lane.
    batch_rows_max: int = 1
    kv_budget_bytes: int = KV_BUDGET_BYTES_DEFAULT
    # Requests the `/stats/requests` ring keeps (the oldest goes first).
    recent_requests_max: int = RECENT_REQUESTS_MAX_DEFAULT


StoreOpener = Callable[[SystemConfig, KvScheme], SsdStore | None]


@attrs.frozen(kw_only=True, eq=False)
class SystemSeams:
    """What a test or the simulator replaces; every default is the real thing.

    `engine`: an object with EngineThread's start/call/stream/stop (the
    simulator's runs inline; None starts an `EngineThread` on the model,
    recording each engine turn in `turn_log` when given). `clock_s`: the RAM
    tier's clock (idle demotion). `run_blocking`: how blocking file I/O runs
    off the Trio thread (fingerprint hashing, store open, writes, the journal
    catch-up). `store_opener(config, scheme)`: opens the SSD tier instead of
    `SsdStore.open` (the simulator's SimDisk and in-memory journal); else the
    tier opens on `disk` (None: the real one). `safeguards`: the store's and
    the writer's durability policy (the simulator's mutations turn some off).
    `logits_processors(request)`: logits-processor factories added to each
    request after its own (a test's `ForcedTokens` scripting a reply through
    the real engine, sampler and parsers); None adds none.
    """

    engine: Any = None
    turn_log: list[tuple[str, float, float]] | None = None
    clock_s: Callable[[], float] = time.monotonic
    run_blocking: Callable[..., Awaitable[Any]] = trio.to_thread.run_sync
    store_opener: StoreOpener | None = None
    disk: Disk | None = None
    safeguards: Safeguards = SAFEGUARDS
    logits_processors: Callable[[GenerationRequest], Sequence[Callable[[], Any]]] | None = None
    # Stamps when a request ended and when a flush answered (`/stats/requests`, `/stats` `flush`).
    wall_clock_s: Callable[[], float] = time.time


@attrs.frozen(kw_only=True)
class FlushResult:
    """The flush verdict with its evidence (spec §5.6). `reason` says why it
    is not durable ("" when it is): "timeout" (the bound passed; the evidence
    is what was known then), "no SSD tier", "write-behind off" (puts are not
    tracked, so no put can be vouched for; the spill queue was drained), or
    the first of "failed", "dropped", "missing", "pending" that is not zero.
    `pending`: records of the flush's scope still dirty (with write-behind
    off: spills still queued); `dropped`/`failed`: writes that settled so
    during the flush; `missing`: prefixes gone from RAM and not covered on
    SSD; `pending_spills`: snapshots queued or being written at the answer."""

    durable: bool
    reason: str = ""
    pending: int
    dropped: int
    failed: int
    missing: int
    pending_spills: int = 0
    entries: int
    longest_durable_prefix_tokens: int
    note: str = ""


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
        self.queue: SpillQueue | None = None
        self.durability: DurabilityCoordinator | None = None
        self._shutdown_verdict: FlushResult | None = None
        self._shutdown_done: trio.Event | None = None
        # Owned by the Trio thread: fed by `generate` and `flush`, read by `stats` and the routes.
        self.recent_requests = RecentRequests(config.recent_requests_max)
        self.flushes = 0
        self.last_flush: tuple[float, FlushResult] | None = None

    @property
    def admitting(self) -> bool:
        return self.gateway.core.admitting and (self.scheduler is None or self.scheduler.core.admitting)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta | GenerationDone]:
        """Run one request as a batch row, or on the serial lane when the batch
        lane is off, streaming its tokens; when it ends (done, cancelled or
        failed) it is recorded in `recent_requests`."""
        items = recorded(
            self._generate_on_lane(request),
            self.recent_requests,
            prompt_tokens=len(request.prompt_ids),
            clock_s=trio.current_time,
            wall_clock_s=self.seams.wall_clock_s,
        )
        async with aclosing(items) as stream:
            async for item in stream:
                yield item

    async def _generate_on_lane(self, request: GenerationRequest) -> AsyncGenerator[TokenDelta | GenerationDone, None]:
        if self.seams.logits_processors is not None:
            added = tuple(self.seams.logits_processors(request))
            request = attrs.evolve(request, logits_processors=request.logits_processors + added)
        if self.scheduler is not None:
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
            )

        async for item in self.gateway.generate(job, prompt_tokens=len(request.prompt_ids), cancelled=cancelled):
            yield item

    async def flush(self, timeout_s: float | None = None) -> FlushResult:
        """Persist everything dirty and say whether all of it is on disk. It
        always answers, by `timeout_s` (None: no bound): past it with
        `reason="timeout"` and the evidence so far, while a begun flush goes
        on in the background (journaled). The verdict is kept as `last_flush`."""
        verdict = await self._flush(timeout_s)
        self.flushes += 1
        self.last_flush = (self.seams.wall_clock_s(), verdict)
        return verdict

    async def _flush(self, timeout_s: float | None) -> FlushResult:
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
            pending_spills=self._pending_spills(),
            entries=len(self.store.entry_ids()),
            longest_durable_prefix_tokens=self.store.longest_entry_tokens(),
            note=note,
        )

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
            verdict = await self.flush(timeout_s=max(0.0, deadline - trio.current_time()))
            if self.queue is not None and self._pending_spills():
                # Spills queued after the flush's drain (an idle demotion) or left by a timeout.
                with trio.move_on_at(deadline):
                    await self.queue.wait_idle()
            self._warn_not_durable(verdict)
            self._shutdown_verdict = verdict
            return verdict
        finally:
            self._shutdown_done.set()

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
                "journal": store_stats["journal"],
                "verify_tensors": store_stats["verify_tensors"],
            }
        return {
            "prompt_cache": self.prompt_cache.stats(),
            "gateway": self.gateway.stats(),
            "ssd_cache": ssd,
            "kv_scheme": self.scheme.cache_key,
            "scheduler": self._scheduler_stats(),
            "requests": self.recent_requests.stats(),
            "flush": self._flush_stats(),
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


async def _open_store(config: SystemConfig, seams: SystemSeams, scheme: KvScheme) -> tuple[SsdStore | None, str]:
    """The SSD tier of this serving fingerprint and the tokenizer hash its
    entries' headers carry; (None, "") without the tier."""
    if config.ssd_dir is None:
        return None, ""
    if config.prompt_cache_bytes <= 0:
        raise UsageError("the SSD tier needs the RAM tier: a prompt-cache size of 0 cannot be combined with it")
    memo = config.shard_digest_memo if config.shard_digest_memo is not None else ShardDigestMemo(None)
    bytes_hashed_before, started_s = memo.bytes_hashed, time.perf_counter()
    # Hashing reads every weight byte on a cold memo: a worker thread's job, not the Trio thread's.
    run_blocking = seams.run_blocking
    fingerprint = await run_blocking(
        lambda: compute_fingerprint(config.model_dir, kv_scheme_key=scheme.cache_key, memo=memo)
    )
    log.info(
        "serving fingerprint %s in %.2f s: %d bytes hashed, the rest from the digest memo %s",
        fingerprint.digest,
        time.perf_counter() - started_s,
        memo.bytes_hashed - bytes_hashed_before,
        memo.path or "(in RAM only)",
    )
    # The scan, the reconciliation and the startup supersession are disk work too.
    store = await run_blocking(
        lambda: SsdStore.open(
            config.ssd_dir,
            fingerprint.digest,
            config.ssd_bytes_max,
            seams.disk,
            fingerprint_fields=fingerprint.as_dict(),
            verify=config.ssd_verify,
            safeguards=seams.safeguards,
        )
    )
    return store, fingerprint.tokenizer_sha256


@asynccontextmanager
async def open_system(config: SystemConfig, seams: SystemSeams | None = None) -> AsyncIterator[System]:
    """Start everything in one nursery; on exit shut down gracefully (stop
    admission, drain, flush bounded by `shutdown_timeout_s`) and close.
    `seams`: what a test or the simulator replaces (None: the real world)."""
    seams = seams or SystemSeams()
    engine = seams.engine or EngineThread(config.model_dir, turn_log=seams.turn_log)
    try:
        loaded = await engine.start()
        scheme = resolve_kv_scheme(config.kv_quant, config.model_dir)
        if seams.store_opener is not None:
            store, tokenizer_hash = seams.store_opener(config, scheme), ""
        else:
            store, tokenizer_hash = await _open_store(config, seams, scheme)
        try:
            async with trio.open_nursery() as nursery:
                system = await _start_actors(nursery, config, seams, engine, loaded, scheme, store, tokenizer_hash)
                try:
                    yield system
                    await system.shutdown()
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            if store is not None:
                store.close()
    finally:
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
) -> System:
    journal = store.journal if store is not None else None
    token = trio.lowlevel.current_trio_token()
    gateway = Gateway(engine, journal=journal)
    await nursery.start(gateway.run)
    prompt_cache = PromptCache(config.prompt_cache_bytes, cold_tier=store, clock_s=seams.clock_s)
    system = System(config, engine, loaded, scheme, prompt_cache, store, seams=seams)
    system.gateway = gateway
    system.scheduler, system.serial_reason = await open_batch_lane(
        nursery,
        engine=engine,
        gateway=gateway,
        prompt_cache=prompt_cache,
        scheme=scheme,
        rows_max=config.batch_rows_max,
        kv_budget_bytes=config.kv_budget_bytes,
        prefill_step_tokens=config.prefill_step_tokens,
        journal=journal,
    )
    if store is None:
        return system
    writer = SsdWriter(
        store,
        gateway.run_when_idle,
        journal=journal,
        tokenizer_hash=tokenizer_hash,
        run_blocking=seams.run_blocking,
        safeguards=seams.safeguards,
    )
    queue_bytes = config.spill_queue_bytes if config.spill_queue_bytes is not None else bytes_max_from_env()
    queue = SpillQueue(writer.write, bytes_max=queue_bytes, journal=journal)
    await nursery.start(queue.run)
    system.queue = queue

    def submit(snapshot: SpillSnapshot) -> None:
        # Runs inside run_sync_soon, where an exception would end the whole Trio run.
        try:
            queue.submit_nowait(snapshot)
        except Exception as e:
            log.warning("spill of %d tokens refused: %s", len(snapshot.tokens), e)

    def spill_sink(snapshot: SpillSnapshot) -> None:
        token.run_sync_soon(submit, snapshot)

    prompt_cache.spill_sink = spill_sink
    write_behind = config.write_behind if config.write_behind is not None else write_behind_from_env()
    if write_behind:
        durability = DurabilityCoordinator(
            _DurabilityPorts(gateway, prompt_cache, store, queue),
            debounce_s=config.debounce_s,
            busy_rearm_s=config.busy_rearm_s,
            journal=journal,
        )
        await nursery.start(durability.run)
        system.durability = durability
        prompt_cache.on_put = lambda namespace, tokens: token.run_sync_soon(durability.dirty, namespace, tokens)
    if config.demote_idle_s > 0:
        nursery.start_soon(_demote_idle_forever, gateway, prompt_cache, config.demote_idle_s)
    return system


async def _demote_idle_forever(gateway: Gateway, prompt_cache: PromptCache, threshold_s: float) -> None:
    """Idle demotion (spec §4): entries unused past the threshold spill to SSD."""
    while True:
        await trio.sleep(max(threshold_s / 4, 1.0))
        await gateway.run_when_idle(lambda _: prompt_cache.demote_idle(threshold_s))


class _DurabilityPorts:
    """What the durability coordinator needs of the rest of the system."""

    def __init__(self, gateway: Gateway, prompt_cache: PromptCache, store: SsdStore, queue: SpillQueue) -> None:
        self._gateway = gateway
        self._prompt_cache = prompt_cache
        self._store = store
        self._queue = queue

    def gateway_busy(self) -> bool:
        return self._gateway.busy

    async def run_when_idle(self, step: Any) -> Any:
        return await self._gateway.run_when_idle(lambda _: step())

    def snapshot_exact(self, tokens: Any, namespace: str) -> SpillSnapshot | None:
        return self._prompt_cache.snapshot_exact(tokens, namespace)

    def covers(self, tokens: Any, namespace: str) -> bool:
        return self._store.covers(tokens, namespace)

    async def submit(self, snapshot: SpillSnapshot) -> str:
        return await self._queue.submit(snapshot)

    async def wait_queue_idle(self) -> None:
        await self._queue.wait_idle()
