"""How `open_system` wires the tiers to the actors: the SSD tier's open,
SSD write admission's policy, the shared tier, the memory guard. Functions
of the parts they wire, none of `System` (the write-behind pipeline is
`actors/write_behind.py`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from mlx_lm.models.cache import make_prompt_cache

from kvcellar.actors.admission import AdmissionCore
from kvcellar.actors.gateway import Gateway
from kvcellar.actors.spill_queue import SpillQueue
from kvcellar.actors.system_config import SystemConfig, SystemSeams
from kvcellar.actors.uploader import SharedCacheConfig, SharedTier
from kvcellar.engine.compute_dtype import ComputeDtype, fingerprint_kv_key
from kvcellar.engine.engine import MODEL_DTYPE, LoadedModel
from kvcellar.engine.memory import (
    Footprint,
    MemoryGuard,
    MemoryMeter,
    WorkspaceModel,
    default_memory_budget_bytes,
)
from kvcellar.engine.paged_kv import PagedKv, paged_model_refusal
from kvcellar.engine.restore_policy import CostBook, PolicyColdTier, calibrate, with_disk_probed
from kvcellar.errors import UsageError
from kvcellar.store.cost_memo import CostKey, load_costs
from kvcellar.store.disk import RealDisk, ThrottledDisk
from kvcellar.store.fingerprint import ShardDigestMemo, compute_fingerprint
from kvcellar.store.prompt_cache import PromptCache, SpillSnapshot
from kvcellar.store.s3_objects import S3ObjectStore
from kvcellar.store.scheme import KvScheme, warm_up_prototype_caches
from kvcellar.store.shared_tier import SharedKeys, SharedLocation
from kvcellar.store.ssd import SsdStore
from kvcellar.store.write_wear import WearMonitor

log = logging.getLogger("kvcellar.system")

# The `entries` columns the wear monitor is seeded from (`WearFold.seed_entries`).
WEAR_SEED_COLUMNS = ("entry_id", "bytes", "restores")


async def open_store(
    config: SystemConfig, seams: SystemSeams, scheme: KvScheme, wear: WearMonitor, compute: ComputeDtype = MODEL_DTYPE
) -> tuple[SsdStore | None, str]:
    """The SSD tier of this serving fingerprint and the tokenizer hash its
    entries' headers carry; (None, "") without the tier. `compute`: the engine's
    dtype policy, whose cast the fingerprint names (float32 KV never meets bfloat16 KV)."""
    if config.ssd_dir is None:
        return None, ""
    if config.prompt_cache_bytes <= 0:
        raise UsageError("the SSD tier needs the RAM tier: a prompt-cache size of 0 cannot be combined with it")
    memo = config.shard_digest_memo if config.shard_digest_memo is not None else ShardDigestMemo(None)
    bytes_hashed_before, started_s = memo.bytes_hashed, time.perf_counter()
    # Hashing reads every weight byte on a cold memo: a worker thread's job, not the Trio thread's.
    run_blocking = seams.run_blocking
    fingerprint = await run_blocking(
        lambda: compute_fingerprint(
            config.model_dir, kv_scheme_key=fingerprint_kv_key(scheme.cache_key, compute), memo=memo
        )
    )
    log.info(
        "serving fingerprint %s in %.2f s: %d bytes hashed, the rest from the digest memo %s",
        fingerprint.digest,
        time.perf_counter() - started_s,
        memo.bytes_hashed - bytes_hashed_before,
        memo.path or "(in RAM only)",
    )
    # The scan, the reconciliation and the startup supersession are disk work too.
    started_s = time.perf_counter()
    disk = seams.disk
    if config.disk_throttle_bytes_per_s is not None:
        disk = ThrottledDisk(disk if disk is not None else RealDisk(), config.disk_throttle_bytes_per_s)
    store = await run_blocking(
        lambda: SsdStore.open(
            config.ssd_dir,
            fingerprint.digest,
            config.ssd_bytes_max,
            disk,
            fingerprint_fields=fingerprint.as_dict(),
            verify=config.ssd_verify,
            safeguards=seams.safeguards,
            event_listeners=(wear.on_event,),
            keyring=config.ssd_keyring,
        )
    )
    try:
        if config.tenants is not None and config.tenants.ssd_quotas():
            # Entries already over a tenant's quota (a quota lowered since) go now, not at the next put.
            quotas = dict(config.tenants.ssd_quotas())
            await run_blocking(lambda: store.files.unlink_removed(store.index.set_owner_quotas(quotas)))
        await run_blocking(lambda: _seed_wear(wear, store))
    except BaseException:
        store.close()
        raise
    stats = store.stats()
    log.info(
        "SSD tier opened in %.2f s: %d entries, %d bytes",
        time.perf_counter() - started_s,
        stats["entries"],
        stats["bytes"],
    )
    return store, fingerprint.tokenizer_sha256


async def load_model_beside_store(
    engine: Any, open_tier: Callable[[], Awaitable[tuple[SsdStore | None, str]]]
) -> tuple[LoadedModel, SsdStore | None, str]:
    """Load the model (`engine.start()`, on the engine thread) while `open_tier()` opens
    the SSD tier (worker threads: the fingerprint, the scan): neither needs the other, so
    serve is ready after the longer of the two, not their sum. Returns the loaded model,
    the store and its tokenizer hash. When either fails it raises that failure itself (the
    model's first), not a group, and leaves no store open: a failed model cancels the tier's
    open at its next step, and a store that opened anyway is closed."""
    opened: list[tuple[SsdStore | None, str]] = []
    failures: list[Exception] = []

    async def open_beside() -> None:
        try:
            opened.append(await open_tier())
        except Exception as e:  # raised below, in the caller's task
            failures.append(e)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(open_beside)
        try:
            loaded = await engine.start()
        except Exception as e:
            failures.insert(0, e)
            # No model, no server: the tier stops at its next step (`open_store` closes a store it opened).
            nursery.cancel_scope.cancel()
    if failures:
        if opened and opened[0][0] is not None:
            opened[0][0].close()
        raise failures[0]
    store, tokenizer_hash = opened[0]
    return loaded, store, tokenizer_hash


def _seed_wear(wear: WearMonitor, store: SsdStore) -> None:
    """What the journal knows at startup: the live entries (for dead writes),
    and every write when there is a write budget (its bucket)."""
    journal = store.journal
    if journal is None or journal.degraded:
        return
    stored = (
        [(record.time_ns, record.event.entry.bytes) for record in journal.events(kind="entry.stored")]
        if wear.budgeted
        else []
    )
    # Only what the wear fold keeps: the token ids would be most of the rows' bytes.
    wear.seed(journal.entries(WEAR_SEED_COLUMNS), stored)


def admission_core(config: SystemConfig) -> AdmissionCore | None:
    """SSD write admission's policy; None for `always`, which admits every write without looking."""
    if config.ssd_admission == "always":
        return None
    return AdmissionCore(config.ssd_admission, cost_threshold_s_per_gb=config.ssd_cost_threshold_s_per_gb)


async def start_shared_tier(
    nursery: trio.Nursery, shared: SharedCacheConfig, seams: SystemSeams, store: SsdStore, gateway: Gateway
) -> SharedTier:
    """The shared cold tier over the SSD tier; its client reads the AWS config files, off the Trio thread."""
    location = SharedLocation.parse(shared.url)
    objects = seams.shared_objects
    if objects is None:
        objects = await seams.run_blocking(
            lambda: S3ObjectStore.open(
                location.bucket,
                endpoint_url=shared.endpoint_url,
                connect_timeout_s=shared.connect_timeout_s,
                read_timeout_s=shared.read_timeout_s,
                max_attempts=shared.max_attempts,
            )
        )
    tier = SharedTier(
        store,
        objects,
        SharedKeys(location.prefix, store.fingerprint),
        shared,
        gateway_busy=lambda: gateway.busy,
        journal=store.journal,
        run_blocking=seams.run_blocking,
    )
    await nursery.start(tier.run)
    return tier


async def demote_idle_forever(gateway: Gateway, prompt_cache: PromptCache, threshold_s: float) -> None:
    """Idle demotion (spec §4): entries unused past the threshold spill to SSD."""
    while True:
        await trio.sleep(max(threshold_s / 4, 1.0))
        await gateway.run_when_idle(lambda _: prompt_cache.demote_idle(threshold_s))


async def open_memory_guard(
    engine: Any,
    config: SystemConfig,
    meter: MemoryMeter,
    scheme: KvScheme,
    prompt_cache: PromptCache,
    journal: Any,
) -> MemoryGuard | None:
    """The memory guard (engine/memory.py), or None with a budget of 0. One
    engine turn measures the weights (what MLX holds once the model is
    loaded) and warms up the prototype caches the footprints are projected from."""
    budget_bytes = default_memory_budget_bytes() if config.memory_budget_bytes is None else config.memory_budget_bytes
    if budget_bytes <= 0:
        log.info("memory guard off (--memory-budget 0)")
        return None

    def probe(loaded: LoadedModel) -> tuple[int, list, WorkspaceModel]:
        weights_bytes = meter.active_bytes()
        return weights_bytes, warm_up_prototype_caches(loaded.model), WorkspaceModel.from_model(loaded.model)

    weights_bytes, prototypes, workspace = await engine.call(probe, label="memory-probe")
    footprint = Footprint(
        scheme=scheme, prototypes=prototypes, workspace=workspace, prefill_step_tokens=config.prefill_step_tokens
    )
    guard = MemoryGuard(
        budget_bytes,
        meter,
        footprint=footprint,
        weights_bytes=weights_bytes,
        prompt_cache=prompt_cache,
        journal=journal,
    )
    if weights_bytes >= budget_bytes:
        log.warning("memory budget %.3g GB is below the weights' %.3g GB", budget_bytes / 1e9, weights_bytes / 1e9)
    log.info(
        "memory budget %.3g GB: %.3g GB of weights, %.3g GB of headroom",
        budget_bytes / 1e9,
        weights_bytes / 1e9,
        max(0, budget_bytes - weights_bytes) / 1e9,
    )
    return guard


def give_guard_the_ssd_tier(guard: MemoryGuard, store: SsdStore, queue: SpillQueue, tokenizer_hash: str) -> None:
    """Relief persists synchronously into the SSD tier, on the engine thread:
    the released entry's own caches are written and then freed, never handed
    to the spill queue as a deferred clone that keeps them resident."""

    def persist(snapshot: SpillSnapshot) -> str:
        if store.covers(snapshot.tokens, snapshot.namespace):
            return "covered"
        stored = store.store(snapshot.tokens, snapshot.caches, snapshot.namespace, tokenizer_hash=tokenizer_hash)
        return "stored" if stored is not None else "failed"

    guard.persist = persist
    # Read by `stats()` on the Trio thread, the queue's owner.
    guard.spill_pinned_bytes = lambda: queue.stats()["pending_bytes"]


# The start-up calibration when no persisted cost model matches: about this
# long on the prefill, up to this context (`kvcellar calibrate` measures longer).
START_CALIBRATION_S = 1.0
START_CALIBRATION_TOKENS_MAX = 4096


async def open_restore_policy(engine: Any, config: SystemConfig, store: SsdStore, scheme: KvScheme) -> PolicyColdTier:
    """The SSD tier behind the restore policy (issue 44): the persisted cost
    model of this model and device when there is one, else a short
    calibration on the engine thread (prefill curve, copy rate, the tier's
    disk read rate), persisted beside the digest memo. The SSD tier's disk
    is probed at every start either way."""
    memo = config.shard_digest_memo
    memo_dir = memo.path.parent if memo is not None and memo.path is not None else None
    key = CostKey.of_fields(store.fingerprint_fields)
    persisted = load_costs(memo_dir, key) if memo_dir is not None else None

    def build(loaded: LoadedModel) -> PolicyColdTier:
        model = persisted
        if model is not None:
            # The disk belongs to the directory, not to the model: probed every start (milliseconds on an SSD).
            model = with_disk_probed(model, store.disk, store.directory)
        else:
            model = calibrate(
                loaded.model,
                int(loaded.tokenizer.vocab_size),
                disk=store.disk,
                directory=store.directory,
                context_tokens_max=min(START_CALIBRATION_TOKENS_MAX, loaded.context_tokens_max),
                budget_s=START_CALIBRATION_S,
                step_tokens=config.prefill_step_tokens,
            )
        book = CostBook(model, key=key, memo_dir=memo_dir)
        if persisted is None:
            book.update(model)
            book.persist()
        return PolicyColdTier(
            store,
            book,
            model=loaded.model,
            policy=config.restore_policy,
            step_tokens=config.prefill_step_tokens,
            quantized_kv=scheme.quantized,
        )

    return await engine.call(build, label="restore-policy")


async def open_paged_kv(engine: Any, block_size: int | None, scheme: KvScheme) -> PagedKv | None:
    """Paged KV's start-up gates (spec §6.3), before anything else starts:
    refuse a quantized KV scheme and a model whose caches paging cannot take,
    with `UsageError`. None when paged KV is off."""
    if block_size is None:
        return None
    if scheme.quantized:
        raise UsageError(
            f"--paged-kv cannot run with --kv-quant ({scheme.cache_key}): paged blocks hold unquantized KV only"
        )
    paged_kv = PagedKv.with_block_size(block_size)
    refusal = await engine.call(lambda loaded: paged_model_refusal(make_prompt_cache(loaded.model)), label="probe")
    if refusal is not None:
        raise UsageError(f"--paged-kv refused for this model: {refusal}")
    log.info("paged KV on: blocks of %d tokens", block_size)
    return paged_kv
