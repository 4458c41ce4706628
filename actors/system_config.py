"""The system's configuration, its seams (what a test or the simulator
replaces) and the flush verdict: plain frozen values, shared by the
system (actors/system.py) and its wiring (actors/system_wiring.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from kvcellar.actors.admission_core import ADMISSION_POLICY_DEFAULT, COST_THRESHOLD_S_PER_GB_DEFAULT
from kvcellar.actors.recent_requests import RECENT_REQUESTS_MAX_DEFAULT
from kvcellar.actors.scheduler_core import KV_BUDGET_BYTES_DEFAULT
from kvcellar.actors.uploader import SharedCacheConfig
from kvcellar.engine.checkpointing import CheckpointListener
from kvcellar.engine.compute_dtype import COMPUTE_DTYPE_DEFAULT
from kvcellar.engine.engine import PREFILL_STEP_TOKENS
from kvcellar.engine.generation import GenerationRequest
from kvcellar.engine.memory import MemoryMeter
from kvcellar.engine.speculative import Drafter
from kvcellar.store.disk import Disk
from kvcellar.store.fingerprint import ShardDigestMemo
from kvcellar.store.keyring import KeyRing
from kvcellar.store.prompt_cache import BYTES_MAX_DEFAULT
from kvcellar.store.s3_objects import ObjectStore
from kvcellar.store.safeguards import SAFEGUARDS, Safeguards
from kvcellar.store.scheme import KvScheme
from kvcellar.store.ssd import SsdStore
from kvcellar.store.tenants import Tenants

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
    # `serve --draft-model`/`--num-draft-tokens` (issue 42): speculative decoding on the serial lane.
    draft_model_dir: Path | None = None
    num_draft_tokens: int = 3
    kv_budget_bytes: int = KV_BUDGET_BYTES_DEFAULT
    # What MLX may hold live, weights included (engine/memory.py): None is the
    # default (75 % of physical memory, at most Metal's working set), 0 is off.
    memory_budget_bytes: int | None = None
    # Requests the `/stats/requests` ring keeps (the oldest goes first).
    recent_requests_max: int = RECENT_REQUESTS_MAX_DEFAULT
    # Which background writes reach the SSD tier (`actors/admission.py`), and the
    # tier's write budget in bytes a day (None: unlimited; `actors/write_budget.py`).
    ssd_admission: str = ADMISSION_POLICY_DEFAULT
    ssd_cost_threshold_s_per_gb: float = COST_THRESHOLD_S_PER_GB_DEFAULT
    ssd_write_budget_bytes_per_day: int | None = None
    # The shared cold tier on an object store (needs the SSD tier); None: off.
    shared_cache: SharedCacheConfig | None = None
    # In-flight generation checkpoints every this many emitted tokens (spec §5.7); 0: off. Needs `ssd_dir`.
    generation_checkpoint_tokens: int = 0
    # Paged KV (spec §6, engine/paged_kv.py): the block size in tokens; None: off (no paged code runs).
    paged_kv_block_size: int | None = None
    # Issue 44: how a request with a prefix on the SSD tier is served ("auto":
    # the fastest predicted of restore, recompute and split; or one forced),
    # and an emulated slower SSD (every read and write of the tier at this
    # rate; None: the disk as it is).
    restore_policy: str = "auto"
    disk_throttle_bytes_per_s: float | None = None
    # `serve --compute-dtype` (engine/compute_dtype.py): `auto` computes small 16-bit models in float32 on the CPU.
    compute_dtype: str = COMPUTE_DTYPE_DEFAULT
    # `serve --encryption-key-file` (docs/security.md): the SSD tier seals its entries under the first key
    # and opens them with any; None: entries are written in the clear. Needs `ssd_dir`.
    ssd_keyring: KeyRing | None = None
    # `serve --tenants` (store/tenants.py, docs/security.md): the RAM tier's per-tenant quotas and the
    # namespaces every tenant may read; None: one default namespace, no quotas.
    tenants: Tenants | None = None


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
    the real engine, sampler and parsers); None adds none. `memory_meter`:
    what the memory guard measures (None: MLX's allocator counters).
    `checkpoint_listeners`: see what generation checkpoints are offered and
    resumed, with their requests (the simulator's checkpoint invariants).
    `prefill_chunk_hook(tokens_done, tokens_total)`: called on the engine
    thread with each prefill progress report, before the prefill goes on (a
    test holds a prefill between two chunks there); None: nothing.
    `drafter`: the draft model serving beside the target instead of loading
    `config.draft_model_dir` (the simulator's fake draft); None: that.
    """

    engine: Any = None
    turn_log: list[tuple[str, float, float]] | None = None
    clock_s: Callable[[], float] = time.monotonic
    run_blocking: Callable[..., Awaitable[Any]] = trio.to_thread.run_sync
    store_opener: StoreOpener | None = None
    disk: Disk | None = None
    safeguards: Safeguards = SAFEGUARDS
    logits_processors: Callable[[GenerationRequest], Sequence[Callable[[], Any]]] | None = None
    memory_meter: MemoryMeter | None = None
    # Stamps when a request ended and when a flush answered (`/stats/requests`, `/stats` `flush`).
    wall_clock_s: Callable[[], float] = time.time
    # The shared tier's object store instead of S3 at `config.shared_cache.url` (the simulator's model).
    shared_objects: ObjectStore | None = None
    # Listeners of generation checkpoints (`Checkpointing.listeners`: the simulator's checks).
    checkpoint_listeners: tuple[CheckpointListener, ...] = ()
    prefill_chunk_hook: Callable[[int, int], None] | None = None
    drafter: Drafter | None = None


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
    # Issue 21: prefixes that left RAM unwritten by SSD admission's choice (never
    # durable), and the bytes this flush wrote past the write budget.
    skipped_by_admission: int = 0
    over_budget_bytes: int = 0
    # Generation checkpoints (spec §5.7) still queued or being written at the
    # answer, and those whose write failed during the flush. Evidence only:
    # a checkpoint is a restart point, not a prefix the verdict vouches for.
    pending_checkpoints: int = 0
    failed_checkpoints: int = 0
