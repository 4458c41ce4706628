"""The memory-pressure guard (spec §5.4, last paragraph; §5.1 D5).

The RAM tier's byte cap bounds only what the cache bills; live generations,
batch rows, prefill workspace, lent views grown into fresh buffers and queued
spill snapshots come on top. The guard bounds what MLX holds live
(`mx.get_active_memory()`, the weights included) by `budget_bytes`:

- Admission: a request whose worst-case footprint (prompt + `max_tokens` KV
  at the scheme's bytes per token, plus one prefill chunk's workspace) cannot
  fit even after every reclaimable RAM-tier entry is released is refused with
  `InsufficientMemory` (HTTP 503, `type: "insufficient_memory"`), not an OOM.
- Relief: before each prefill chunk and every `DECODE_CHECK_TOKENS` decode
  tokens (both lanes) the engine asks `relieve(reserve_bytes, protected)`.
  While live allocation plus the reservation is over the budget, the
  least-recently-used RAM-tier entry that is not `protected` (the request's
  own cache, its own snapshots; a generation checkpoint adds its entry ids
  here too) is released: persisted synchronously first when there is an SSD
  tier (its own caches, no deferred clone), dropped and counted otherwise;
  then MLX's buffer cache is cleared. Nothing reclaimable left and still
  over: `InsufficientMemory`, for this request alone.

What is measured comes through the `MemoryMeter` seam (`MlxMemoryMeter` in
serving; tests inject deterministic ones). Snapshots the spill queue pins are
live MLX buffers, so the real meter counts them in `active`; the guard also
reads their byte count (`spill_pinned_bytes`) to show it and to keep them out
of what it calls reclaimable.

Owner: the engine thread. `admit` and `relieve` run there (MLX and the RAM
tier live there); counters are published as an immutable snapshot that
`stats()` reads from any thread. The meter's counters are process-wide
numbers read without MLX work, so `stats()` reads them live.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Collection, Mapping
from types import MappingProxyType
from typing import Any, Protocol

import attrs
import mlx.core as mx

from kvcellar.engine.engine import BeforeChunk, BufferCache, MlxBufferCache
from kvcellar.errors import InsufficientMemory, KvCellarError
from kvcellar.store.actor_events import MemoryRelieved
from kvcellar.store.prompt_cache import PromptCache, SpillSnapshot
from kvcellar.store.scheme import KvScheme, held_bytes

log = logging.getLogger("kvcellar.memory")

BUDGET_FRACTION_OF_PHYSICAL = 0.75
# cuBLAS/cuDNN workspaces and the CUDA context live outside MLX's allocator counters.
BUDGET_FRACTION_OF_CUDA = 0.90
DECODE_CHECK_TOKENS = 256
# mlx-lm's KVCache grows its buffers by this many tokens (`KVCache.step`).
KV_GROWTH_TOKENS = 256
# Element size assumed for activations and attention scores (float32 on the
# CPU backend, and an upper bound for half-precision models).
_WORKSPACE_ELEMENT_BYTES = 4


class MemoryMeter(BufferCache, Protocol):
    """What the guard measures (the buffer cache as the engine thread releases
    it, and the live memory); `MlxMemoryMeter` reads MLX's allocator."""

    def active_bytes(self) -> int: ...
    def peak_bytes(self) -> int: ...


class MlxMemoryMeter(MlxBufferCache):
    """MLX's allocator counters (they work on the CPU backend too)."""

    def active_bytes(self) -> int:
        return int(mx.get_active_memory())

    def peak_bytes(self) -> int:
        return int(mx.get_peak_memory())


def physical_memory_bytes() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def metal_working_set_bytes() -> int | None:
    """Metal's recommended working set on macOS, or None (Linux, no Metal)."""
    if sys.platform != "darwin":
        return None
    try:
        if not mx.metal.is_available():
            return None
        info = mx.metal.device_info()
    except (AttributeError, RuntimeError):
        return None
    size = info.get("max_recommended_working_set_size")
    return int(size) if size else None


def cuda_memory_bytes(
    device: Any = None,
    *,
    cuda_available: Callable[[], bool] | None = None,
    device_info: Callable[[Any], Mapping[str, Any]] | None = None,
) -> int | None:
    """The CUDA GPU's total memory when the default device is one (MLX's
    CUDA backend: `mx.device_info`'s `total_memory`), else None (the CPU,
    or Metal, whose memory is the host's)."""
    device = device if device is not None else mx.default_device()
    try:
        if device.type != mx.DeviceType.gpu or not (cuda_available or mx.cuda.is_available)():
            return None
        total = (device_info or mx.device_info)(device).get("total_memory")
    except (AttributeError, RuntimeError):
        return None
    return int(total) if total else None


def cuda_device_info() -> Mapping[str, Any]:
    """`mx.device_info` of the default device when it is a CUDA GPU, else empty.
    Reads driver counters only (NVML, or `cudaMemGetInfo`); runs no kernel."""
    device = mx.default_device()
    try:
        if device.type != mx.DeviceType.gpu or not mx.cuda.is_available():
            return {}
        return dict(mx.device_info(device))
    except (AttributeError, RuntimeError):
        return {}


def default_memory_budget_bytes(
    physical_bytes: int | None = None, working_set_bytes: int | None = None, cuda_bytes: int | None = None
) -> int:
    """75 % of physical memory, and at most Metal's recommended working set when
    there is one. On a CUDA GPU, where MLX's live arrays (what the guard
    measures) are in the GPU's own memory, 90 % of that memory instead: the
    host's size says nothing about it. Pass 0 to say "none" to either."""
    gpu = cuda_memory_bytes() if cuda_bytes is None else cuda_bytes
    if gpu:
        return int(gpu * BUDGET_FRACTION_OF_CUDA)
    physical = physical_memory_bytes() if physical_bytes is None else physical_bytes
    budget = int(physical * BUDGET_FRACTION_OF_PHYSICAL)
    working_set = metal_working_set_bytes() if working_set_bytes is None else working_set_bytes
    return min(budget, working_set) if working_set else budget


@attrs.frozen(kw_only=True)
class WorkspaceModel:
    """An upper bound of the transient bytes one forward step of `step_tokens`
    over `context_tokens` allocates beyond the KV it appends: the attention
    scores of every head, the residual stream and MLP activations, and the
    logits of every position of the step, with a quarter more for what this
    leaves out. Measured on the CPU backend with the demo llamas, a 512-token
    chunk at 1024 tokens of context peaks 11.6 MB (tiny) and 44 MB (medium)
    above what was live; this says 20 MB and 54 MB."""

    heads: int
    hidden: int
    intermediate: int
    vocab: int

    @classmethod
    def from_model(cls, model: Any) -> WorkspaceModel:
        args = getattr(model, "args", None)

        def arg(name: str, default: int) -> int:
            value = getattr(args, name, None)
            return int(value) if isinstance(value, int) and value > 0 else default

        hidden = arg("hidden_size", 4096)
        return cls(
            heads=arg("num_attention_heads", 32),
            hidden=hidden,
            intermediate=arg("intermediate_size", 4 * hidden),
            vocab=arg("vocab_size", 32000),
        )

    def step_bytes(self, step_tokens: int, context_tokens: int, rows: int = 1) -> int:
        """`rows` rows of a batch step, each of `step_tokens` over its own `context_tokens`."""
        scores = rows * self.heads * step_tokens * (context_tokens + step_tokens)
        activations = rows * step_tokens * (6 * self.hidden + 3 * self.intermediate)
        logits = rows * step_tokens * self.vocab
        elements = scores + activations + logits
        return (elements + elements // 4) * _WORKSPACE_ELEMENT_BYTES


@attrs.frozen(kw_only=True, eq=False)
class Footprint:
    """What a request or its next step may allocate, from the scheme's bytes
    per token (`KvScheme.projected_bytes` over warmed-up prototype caches)
    and the workspace model. A reservation counts one layer's live KV once
    more: mlx-lm's KVCache grows by concatenating into a new buffer, so while
    a layer grows its old and new buffers are both live (the layers of one
    step grow one after the other)."""

    scheme: KvScheme
    prototypes: list
    workspace: WorkspaceModel
    prefill_step_tokens: int

    def kv_bytes(self, tokens: int) -> int:
        return self.scheme.projected_bytes(self.prototypes, tokens)

    def _growth_bytes(self, live_kv_bytes: int) -> int:
        return live_kv_bytes // max(1, len(self.prototypes))

    def request_bytes(self, prompt_tokens: int, max_tokens: int, draft_kv_bytes_per_token: int = 0) -> int:
        """The admission footprint: prompt + `max_tokens` KV (rounded up to the
        cache's growth step, which is what its buffers hold), the draft model's
        over as many tokens when a draft serves the request (its bytes per
        token, `Drafter.kv_bytes_per_token`; 0 without), and one prefill chunk's
        workspace."""
        total_tokens = prompt_tokens + max_tokens
        allocated_tokens = -(-total_tokens // KV_GROWTH_TOKENS) * KV_GROWTH_TOKENS
        chunk_tokens = max(1, min(self.prefill_step_tokens, prompt_tokens))
        draft_bytes = draft_kv_bytes_per_token * allocated_tokens
        return self.kv_bytes(allocated_tokens) + draft_bytes + self.workspace.step_bytes(chunk_tokens, total_tokens)

    def prefill_reserve_bytes(self, chunk_tokens: int, context_tokens: int, live_kv_bytes: int, rows: int = 1) -> int:
        """Before a prefill chunk of `chunk_tokens` per row (its KV rounded up
        to the cache's growth step)."""
        appended = rows * self.kv_bytes(chunk_tokens + KV_GROWTH_TOKENS)
        workspace = self.workspace.step_bytes(chunk_tokens, context_tokens, rows)
        return self._growth_bytes(live_kv_bytes) + appended + workspace

    def decode_reserve_bytes(self, context_tokens: int, live_kv_bytes: int, rows: int = 1) -> int:
        """Before the next `DECODE_CHECK_TOKENS` decode steps."""
        appended = rows * self.kv_bytes(DECODE_CHECK_TOKENS + KV_GROWTH_TOKENS)
        workspace = self.workspace.step_bytes(1, context_tokens + DECODE_CHECK_TOKENS, rows)
        return self._growth_bytes(live_kv_bytes) + appended + workspace


# Persists a released entry synchronously: "stored" (written now), "covered"
# (the SSD tier already held it) or "failed" (not written: the entry is lost).
SyncPersist = Callable[[SpillSnapshot], str]


@attrs.define(kw_only=True)
class MemoryCounters:
    # Published under these names in /stats's `memory`.
    relief_events: int = 0  # relief checks that released entries or cleared the cache
    relief_persisted_entries: int = 0  # entries relief wrote to the SSD tier before dropping them
    relief_persisted_bytes: int = 0
    relief_covered_entries: int = 0  # entries relief dropped because the SSD tier already held them
    relief_dropped_entries: int = 0  # entries relief dropped without an SSD copy
    relief_dropped_bytes: int = 0
    relief_failures: int = 0  # relief checks that could not get under the budget (a request failed)
    requests_refused: int = 0  # requests refused at admission


class MemoryGuard:
    """The guard of one serving process. `budget_bytes` 0 turns it off."""

    def __init__(
        self,
        budget_bytes: int,
        meter: MemoryMeter,
        *,
        footprint: Footprint,
        weights_bytes: int,
        prompt_cache: PromptCache | None,
        persist: SyncPersist | None = None,
        journal: Any = None,
        spill_pinned_bytes: Callable[[], int] = lambda: 0,
        device_info: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.device_info = device_info or cuda_device_info
        self.meter = meter
        self.footprint = footprint
        # What MLX held once the model was loaded: never reclaimable.
        self.weights_bytes = weights_bytes
        self.prompt_cache = prompt_cache
        self.persist = persist
        self.journal = journal
        self.spill_pinned_bytes = spill_pinned_bytes
        self.counters = MemoryCounters()
        self._published: Mapping[str, int] = MappingProxyType(attrs.asdict(self.counters))

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    # -- admission -------------------------------------------------------------

    def fits_budget(self, footprint_bytes: int) -> InsufficientMemory | None:
        """The static check (any thread): the error for a footprint larger
        than the budget less the weights, or None."""
        if not self.enabled:
            return None
        available = self.budget_bytes - self.weights_bytes
        if footprint_bytes <= available:
            return None
        return InsufficientMemory(
            f"the request needs up to {footprint_bytes} bytes of KV and workspace, more than the "
            f"{available} bytes the memory budget of {self.budget_bytes} bytes leaves after the weights",
            needed_bytes=footprint_bytes,
            available_bytes=available,
            budget_bytes=self.budget_bytes,
        )

    def admit(self, footprint_bytes: int, protected: Collection[str] = ()) -> None:
        """On the engine thread: raise `InsufficientMemory` when the footprint
        cannot fit even after every reclaimable entry is released."""
        if not self.enabled:
            return
        available = self.budget_bytes - self.meter.active_bytes() + self._reclaimable_bytes(protected)
        if footprint_bytes <= available:
            return
        self.counters.requests_refused += 1
        self._publish()
        raise InsufficientMemory(
            f"the request needs up to {footprint_bytes} bytes of KV and workspace; the memory budget of "
            f"{self.budget_bytes} bytes has {available} left even with every reclaimable cache entry released",
            needed_bytes=footprint_bytes,
            available_bytes=available,
            budget_bytes=self.budget_bytes,
        )

    # -- relief ----------------------------------------------------------------

    def relieve(self, reserve_bytes: int, protected: Collection[str] = (), *, phase: str) -> None:
        """On the engine thread, before a step that may allocate
        `reserve_bytes`: release LRU entries (not `protected`) until live
        allocation plus the reservation fits, then clear MLX's buffer cache.
        Raises `InsufficientMemory` when it cannot get under the budget."""
        if not self.enabled:
            return
        active_before = self.meter.active_bytes()
        if active_before + reserve_bytes <= self.budget_bytes:
            return
        released = _Released()
        active = active_before
        while active + reserve_bytes > self.budget_bytes:
            snapshot = self.prompt_cache.release_lru(protected) if self.prompt_cache is not None else None
            if snapshot is None:
                break
            self._settle(snapshot, released)
            del snapshot  # its caches are freed here, before the next measurement
            active = self.meter.active_bytes()
        self.meter.clear_cache()
        active = self.meter.active_bytes()
        satisfied = active + reserve_bytes <= self.budget_bytes
        self.counters.relief_events += 1
        if not satisfied:
            self.counters.relief_failures += 1
        self._journal(phase, reserve_bytes, active_before, active, released, satisfied)
        self._publish()
        if not satisfied:
            raise InsufficientMemory(
                f"the memory budget of {self.budget_bytes} bytes cannot take the next {phase} step: "
                f"{active} bytes are live and the step needs up to {reserve_bytes} more, with no "
                "reclaimable cache entry left",
                needed_bytes=reserve_bytes,
                available_bytes=max(0, self.budget_bytes - active),
                budget_bytes=self.budget_bytes,
            )

    def _settle(self, snapshot: SpillSnapshot, released: _Released) -> None:
        outcome = "failed"
        if self.persist is not None:
            try:
                outcome = self.persist(snapshot)
            except KvCellarError as e:
                log.warning("relief could not persist %d tokens (%s); dropped", len(snapshot.tokens), e)
        if outcome == "covered":
            self.counters.relief_covered_entries += 1
        elif outcome == "stored":
            released.persisted_entries += 1
            released.persisted_bytes += snapshot.bytes
            self.counters.relief_persisted_entries += 1
            self.counters.relief_persisted_bytes += snapshot.bytes
        else:
            released.dropped_entries += 1
            released.dropped_bytes += snapshot.bytes
            self.counters.relief_dropped_entries += 1
            self.counters.relief_dropped_bytes += snapshot.bytes

    def _reclaimable_bytes(self, protected: Collection[str]) -> int:
        if self.prompt_cache is None:
            return 0
        return self.prompt_cache.reclaimable_bytes(protected)

    def _journal(
        self, phase: str, reserve: int, active_before: int, active_after: int, released: _Released, satisfied: bool
    ) -> None:
        log.info(
            "memory relief before a %s step: %d entries persisted (%d bytes), %d dropped (%d bytes); "
            "active %d -> %d bytes, budget %d",
            phase,
            released.persisted_entries,
            released.persisted_bytes,
            released.dropped_entries,
            released.dropped_bytes,
            active_before,
            active_after,
            self.budget_bytes,
        )
        if self.journal is None:
            return
        self.journal.append(
            MemoryRelieved(
                phase=phase,
                budget_bytes=self.budget_bytes,
                reserve_bytes=reserve,
                active_before_bytes=active_before,
                active_after_bytes=active_after,
                persisted_entries=released.persisted_entries,
                persisted_bytes=released.persisted_bytes,
                dropped_entries=released.dropped_entries,
                dropped_bytes=released.dropped_bytes,
                satisfied=satisfied,
            ),
            actor="memory",
        )

    # -- stats -----------------------------------------------------------------

    def _publish(self) -> None:
        self._published = MappingProxyType(attrs.asdict(self.counters))

    def stats(self) -> dict[str, Any]:
        """/stats's `memory`: safe from any thread. On a CUDA GPU it adds the
        device's total and free memory (free as the driver counts it, other
        processes included)."""
        return {
            **self.device_memory(),
            "budget_bytes": self.budget_bytes,
            "weights_bytes": self.weights_bytes,
            "headroom_bytes": max(0, self.budget_bytes - self.weights_bytes) if self.enabled else 0,
            "active_bytes": self.meter.active_bytes(),
            "peak_bytes": self.meter.peak_bytes(),
            "cache_bytes": self.meter.cache_bytes(),
            "spill_pinned_bytes": self.spill_pinned_bytes(),
            **self._published,
        }

    def device_memory(self) -> dict[str, int]:
        """The CUDA GPU's `total_memory` and `free_memory` (empty elsewhere)."""
        info = self.device_info()
        return {
            f"device_{key}_bytes": int(info[f"{key}_memory"]) for key in ("total", "free") if f"{key}_memory" in info
        }


@attrs.define
class _Released:
    persisted_entries: int = 0
    persisted_bytes: int = 0
    dropped_entries: int = 0
    dropped_bytes: int = 0


class GuardedRequest:
    """One serial-lane generation's side of the guard: the entry ids that are
    its own (the entry it was lent from, the snapshots it put; never relief
    victims) and its admission and relief checks. Without an enabled guard
    every check is a no-op."""

    def __init__(self, guard: MemoryGuard | None, own_entry_ids: Collection[str] = ()) -> None:
        self._guard = guard if guard is not None and guard.enabled else None
        self.own_entry_ids: set[str] = {entry_id for entry_id in own_entry_ids if entry_id}

    def keep(self, entry_id: str | None) -> None:
        """Protect an entry this generation put (its caches share buffers with the live ones)."""
        if entry_id:
            self.own_entry_ids.add(entry_id)

    def admit(self, prompt_tokens: int, max_tokens: int, draft_kv_bytes_per_token: int = 0) -> None:
        """Before the prefill; `draft_kv_bytes_per_token`: the draft's, when one may serve the request."""
        guard = self._guard
        if guard is not None:
            footprint = guard.footprint.request_bytes(prompt_tokens, max_tokens, draft_kv_bytes_per_token)
            guard.admit(footprint, self.own_entry_ids)

    def prefill_check(self, base_tokens: int) -> BeforeChunk | None:
        """The `prefill` hook for tokens that start after `base_tokens` cached ones."""
        guard = self._guard
        if guard is None:
            return None

        def check(chunk_tokens: int, position: int, caches: list[Any]) -> None:
            context_tokens = base_tokens + position + chunk_tokens
            reserve = guard.footprint.prefill_reserve_bytes(chunk_tokens, context_tokens, held_bytes(caches))
            guard.relieve(reserve, self.own_entry_ids, phase="prefill")

        return check

    def decode_check(self, produced: int, context_tokens: int, caches: list[Any]) -> None:
        """Every `DECODE_CHECK_TOKENS` sampled tokens, before the next step."""
        guard = self._guard
        if guard is None or produced == 0 or produced % DECODE_CHECK_TOKENS:
            return
        reserve = guard.footprint.decode_reserve_bytes(context_tokens, held_bytes(caches))
        guard.relieve(reserve, self.own_entry_ids, phase="decode")
