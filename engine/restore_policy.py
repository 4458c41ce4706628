"""Per-request restore, recompute or split, on the engine thread (issue 44).

`PolicyColdTier` stands between the RAM tier (`PromptCache`) and the SSD tier
(`SsdStore`) as the RAM tier's `ColdTier`: `find` is the store's; `restore`
asks the sans-IO core (`store.restore_plan.plan_restore`) which plan is
fastest for this request with the current `CostModel`, then

- restore: the store's own restore (whole entry);
- recompute: answers "no hit", so the request prefills from what RAM lent;
- split: `engine.split_restore.run_split` prefills `[0, k)` here while a
  worker thread reads rows `[k, n)` (`store.suffix_rows`).

and journals the decision with its predicted and actual times
(`RestoreDecided`). Measured restores and split prefills refresh the model
(EWMA); `CostBook` owns it and publishes each new model as an immutable
value, so `/stats` (Trio) reads a snapshot without a lock.

State and threads: everything here runs on the engine thread (the RAM tier
calls `find` then `restore` within one `take`), except `stats()`, which
reads published immutable values; persistence writes a small file from the
engine thread at most every `PERSIST_INTERVAL_S`.

`calibrate` measures the model's prefill curve and the tiers' rates: quick at
start (about a second, only when no persisted model matches) and longer in
`kvcellar calibrate`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from kvcellar.engine.engine import PREFILL_STEP_TOKENS
from kvcellar.engine.split_restore import prefill_rows, run_split, split_refusal
from kvcellar.errors import CorruptEntry, DiskError, RefusedCacheKind, UnsupportedFormat
from kvcellar.store import events as ev
from kvcellar.store.cost_memo import CostKey, save_costs
from kvcellar.store.disk import Disk
from kvcellar.store.restore_plan import (
    PLAN_RECOMPUTE,
    PLAN_RESTORE,
    PLAN_SPLIT,
    CostModel,
    RestorePlan,
    RestoreQuery,
    TierRate,
    observe_prefill,
    observe_restore,
    plan_restore,
)
from kvcellar.store.suffix_rows import SuffixRows, read_suffix_rows

log = logging.getLogger(__name__)

PERSIST_INTERVAL_S = 10.0
DECISIONS_KEPT = 32
# The shared tier is not probed (an object store's GET costs money): until a
# download is observed it is assumed this slow.
SHARED_DEFAULT = TierRate(fixed_s=0.2, bytes_per_s=100e6)
PROBE_FILE_NAME = ".restore-probe.tmp"
# The disk probe writes and reads pieces of this size (at least one, however slow the disk).
PROBE_PIECE_BYTES = 64 << 10


class CostBook:
    """The current `CostModel` (engine thread writes, anyone reads the published value) and its persistence."""

    def __init__(self, model: CostModel, *, key: CostKey | None, memo_dir: Path | None, clock_s=time.monotonic) -> None:
        self.model = model
        self.key = key
        self.memo_dir = memo_dir
        self._clock_s = clock_s
        self._persisted_at_s = clock_s()
        self._dirty = False

    def update(self, model: CostModel) -> None:
        self.model = model
        self._dirty = True
        if self._clock_s() - self._persisted_at_s >= PERSIST_INTERVAL_S:
            self.persist()

    def persist(self) -> None:
        if self._dirty and self.key is not None and self.memo_dir is not None:
            save_costs(self.memo_dir, self.key, self.model)
        self._dirty = False
        self._persisted_at_s = self._clock_s()


@attrs.frozen(kw_only=True)
class Decision:
    """One decision, as `/stats` and `/stats/requests` show it."""

    entry_id: str
    plan: str
    reason: str
    prompt_tokens: int
    cached_tokens: int
    split_at_tokens: int
    predicted_ms: dict[str, float]
    actual_ms: float


class PolicyColdTier:
    """The RAM tier's cold tier: the SSD store, served by the fastest predicted plan."""

    def __init__(
        self,
        store: Any,
        book: CostBook,
        *,
        model: Any,
        policy: str = "auto",
        step_tokens: int = PREFILL_STEP_TOKENS,
        quantized_kv: bool = False,
    ) -> None:
        self.store = store
        self.book = book
        self.policy = policy
        self._model = model
        self._step_tokens = step_tokens
        # Entries under a quantizing KV scheme hold quantized rows, which a prefill's plain rows cannot join.
        self.refusal = "quantized KV (--kv-quant)" if quantized_kv else split_refusal(make_prompt_cache(model))
        self._prompt_tokens = 0  # the last `find`'s prompt length; engine thread only
        # The plan of the take in progress (`PromptCache` reads it after `restore`); engine thread only.
        self.last_plan = ""
        # Published as immutable values after each decision: `stats()` (Trio) reads them without a lock.
        self.decisions: tuple[Decision, ...] = ()
        self.plan_counts: dict[str, int] = {PLAN_RESTORE: 0, PLAN_RECOMPUTE: 0, PLAN_SPLIT: 0}

    def find(self, tokens: Any, namespace: str = "") -> Any:
        self._prompt_tokens = len(tokens)
        self.last_plan = ""
        return self.store.find(tokens, namespace)

    def restore(self, match: Any) -> list[Any] | None:
        entry = self.store.entry(match.entry_id)
        if entry is None:
            return None
        n = match.usable_tokens
        entry_bytes = int(entry.bytes) * n // max(int(entry.tokens.size), 1)
        query = RestoreQuery(
            tier="ssd",
            prompt_tokens=max(self._prompt_tokens, n + 1),
            cached_tokens=n,
            entry_bytes=entry_bytes,
            split_refusal=self.refusal,
            policy=self.policy,
        )
        plan = plan_restore(self.book.model, query)
        self.last_plan = plan.kind
        started = time.perf_counter()
        caches = self._run(plan, match, entry, entry_bytes)
        actual_s = time.perf_counter() - started if plan.kind != PLAN_RECOMPUTE else 0.0
        self._record(plan, match, query, actual_s)
        return caches

    def _run(self, plan: RestorePlan, match: Any, entry: Any, entry_bytes: int) -> list[Any] | None:
        if plan.kind == PLAN_RECOMPUTE:
            return None
        if plan.kind == PLAN_RESTORE:
            started = time.perf_counter()
            caches = self.store.restore(match)
            if caches is not None:
                self.book.update(observe_restore(self.book.model, "ssd", entry_bytes, time.perf_counter() - started))
            return caches
        return self._split(plan.split_at_tokens, match, entry, entry_bytes)

    def _split(self, k: int, match: Any, entry: Any, entry_bytes: int) -> list[Any] | None:
        n = match.usable_tokens
        loaded: list[float] = []

        def load() -> SuffixRows | None:
            started = time.perf_counter()
            try:
                rows = read_suffix_rows(self.store.disk, entry.path, k, n, expected_tokens=entry.tokens[:n])
            except (CorruptEntry, UnsupportedFormat, DiskError, RefusedCacheKind) as e:
                log.warning("split restore of %s fell back to a recompute: %s", entry.path, e)
                return None
            loaded.append(time.perf_counter() - started)
            return rows

        prefix = [int(t) for t in entry.tokens[:k]]
        prefill_s: list[float] = []
        caches = run_split(self._model, prefix, load, step_tokens=self._step_tokens, on_prefilled=prefill_s.append)
        model = self.book.model
        if prefill_s:
            model = observe_prefill(model, 0, k, prefill_s[0])
        if loaded and n > k:
            model = observe_restore(model, "ssd", entry_bytes * (n - k) // max(n, 1), loaded[0])
            self.store.served(match, entry, loaded[0] * 1e3)
        self.book.update(model)
        return caches

    def _record(self, plan: RestorePlan, match: Any, query: RestoreQuery, actual_s: float) -> None:
        predicted_ms = {kind: round(seconds * 1e3, 3) for kind, seconds in plan.predicted_s.items()}
        decision = Decision(
            entry_id=match.entry_id,
            plan=plan.kind,
            reason=plan.reason,
            prompt_tokens=query.prompt_tokens,
            cached_tokens=query.cached_tokens,
            split_at_tokens=plan.split_at_tokens,
            predicted_ms=predicted_ms,
            actual_ms=round(actual_s * 1e3, 3),
        )
        self.decisions = (*self.decisions[-(DECISIONS_KEPT - 1) :], decision)
        self.plan_counts = {**self.plan_counts, plan.kind: self.plan_counts[plan.kind] + 1}
        self.store.record_event(ev.RestoreDecided(tier="ssd", **attrs.asdict(decision)))

    def observe_prefill(self, start_tokens: int, end_tokens: int, seconds: float) -> None:
        """A request's measured prefill (engine thread): refreshes the curve."""
        self.book.update(observe_prefill(self.book.model, start_tokens, end_tokens, seconds))

    def stats(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "split": "allowed" if not self.refusal else f"refused: {self.refusal}",
            "plans": dict(self.plan_counts),
            "costs": cost_model_stats(self.book.model),
            "recent_decisions": [attrs.asdict(d) for d in self.decisions[-8:]],
        }


def cost_model_stats(model: CostModel) -> dict[str, Any]:
    """The model as `/stats` and `kvcellar calibrate` show it: each tier's fixed cost and MB/s, the prefill curve."""
    return {
        "tiers": {
            name: {"fixed_ms": round(rate.fixed_s * 1e3, 3), "mb_per_s": round(rate.bytes_per_s / 1e6, 1)}
            for name, rate in model.tiers.items()
        },
        "prefill": [
            {"context_tokens": round(p.context_tokens), "tokens_per_s": round(p.tokens_per_s, 1), "samples": p.samples}
            for p in model.prefill
        ],
        "join_mb_per_s": round(model.join_bytes_per_s / 1e6, 1),
    }


# -- calibration -------------------------------------------------------------------


def measure_prefill(
    model: Any, vocab_size: int, *, context_tokens_max: int, budget_s: float, step_tokens: int = PREFILL_STEP_TOKENS
) -> list[tuple[int, int, float]]:
    """Prefill random tokens chunk by chunk up to `context_tokens_max` or
    until `budget_s` passed; returns each chunk's (start, end, seconds).
    A short first chunk warms the kernels and is not reported."""
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(3, max(vocab_size, 4), size=context_tokens_max)]
    cache = make_prompt_cache(model)
    prefill_rows(model, tokens[:16], make_prompt_cache(model), step_tokens)
    chunks: list[tuple[int, int, float]] = []
    started = time.perf_counter()
    for start in range(0, context_tokens_max, step_tokens):
        end = min(start + step_tokens, context_tokens_max)
        chunk_started = time.perf_counter()
        prefill_rows(model, tokens[start:end], cache, step_tokens)
        chunks.append((start, end, time.perf_counter() - chunk_started))
        if time.perf_counter() - started >= budget_s:
            break
    return chunks


def measure_copy_bytes_per_s(size_bytes: int = 64 << 20) -> float:
    """Host memory copy bandwidth (a split's join, the RAM tier's lend)."""
    source = np.ones(size_bytes, dtype=np.uint8)
    target = np.empty_like(source)
    np.copyto(target, source)
    started = time.perf_counter()
    np.copyto(target, source)
    return size_bytes / max(time.perf_counter() - started, 1e-9)


def measure_disk(disk: Disk, directory: Path, *, bytes_max: int = 8 << 20, budget_s: float = 0.5) -> TierRate:
    """The store disk's read rate, through the same `Disk` the tier reads
    with: write a probe file (up to `bytes_max`, stopping after `budget_s`),
    fsync, drop it from the page cache, time reading it back; the fixed cost
    is the open plus the first 4 KiB."""
    path = directory / PROBE_FILE_NAME
    piece = np.full(PROBE_PIECE_BYTES, 7, dtype=np.uint8)
    with _probe_file(disk, path) as handle:
        written, started = 0, time.perf_counter()
        while written < bytes_max and (written == 0 or time.perf_counter() - started < budget_s):
            disk.write_at(handle, written, piece.data)
            written += piece.nbytes
        disk.fsync(handle)
        disk.drop_cached(handle, 0, written)
    opened = time.perf_counter()
    handle = disk.open_read(path)
    try:
        first = bytearray(4096)
        disk.read_into(handle, 0, memoryview(first))
        fixed_s = time.perf_counter() - opened
        buffer = np.empty(piece.nbytes, dtype=np.uint8)
        read_started = time.perf_counter()
        for offset in range(0, written, piece.nbytes):
            disk.read_into(handle, offset, buffer.data)
        read_s = time.perf_counter() - read_started
        disk.drop_cached(handle, 0, written)
    finally:
        disk.close(handle)
        disk.unlink(path)
    return TierRate(fixed_s=fixed_s, bytes_per_s=written / max(read_s, 1e-9))


def with_disk_probed(model: CostModel, disk: Disk, directory: Path) -> CostModel:
    """`model` with the SSD tier's rate measured now on `disk`."""
    return attrs.evolve(model, tiers={**model.tiers, "ssd": measure_disk(disk, directory)})


class _probe_file:
    def __init__(self, disk: Disk, path: Path) -> None:
        self.disk, self.path = disk, path

    def __enter__(self) -> Any:
        with contextlib.suppress(DiskError):
            self.disk.unlink(self.path)
        self.handle = self.disk.create_exclusive(self.path)
        return self.handle

    def __exit__(self, *exc: object) -> None:
        self.disk.close(self.handle)


def calibrate(
    model: Any,
    vocab_size: int,
    *,
    disk: Disk | None,
    directory: Path | None,
    context_tokens_max: int,
    budget_s: float,
    step_tokens: int = PREFILL_STEP_TOKENS,
    base: CostModel | None = None,
) -> CostModel:
    """A cost model measured now: the prefill curve (most of `budget_s`), the
    RAM copy rate, and the SSD tier's read rate when `disk` and `directory` are given."""
    copy_bytes_per_s = measure_copy_bytes_per_s()
    tiers = dict(base.tiers) if base is not None else {}
    tiers["ram"] = TierRate(fixed_s=1e-4, bytes_per_s=copy_bytes_per_s)
    tiers.setdefault("shared", SHARED_DEFAULT)
    if disk is not None and directory is not None:
        tiers["ssd"] = measure_disk(disk, directory, budget_s=min(0.5, budget_s / 4))
    tiers.setdefault("ssd", TierRate(fixed_s=1e-3, bytes_per_s=1e9))
    chunks = measure_prefill(
        model, vocab_size, context_tokens_max=context_tokens_max, budget_s=budget_s, step_tokens=step_tokens
    )
    start, end, seconds = chunks[0]
    fitted = CostModel(tiers=tiers, prefill=(), join_bytes_per_s=copy_bytes_per_s)
    fitted = observe_prefill(fitted, start, end, seconds)
    for start, end, seconds in chunks[1:]:
        fitted = observe_prefill(fitted, start, end, seconds)
    return fitted


def prefill_curve_lines(model: CostModel) -> Sequence[str]:
    """The curve and tiers as `kvcellar calibrate` prints them."""
    lines = ["context_tokens  tokens_per_s  samples"]
    lines += [f"{round(p.context_tokens):>14}  {p.tokens_per_s:>12.1f}  {p.samples:>7}" for p in model.prefill]
    lines.append("tier    fixed_ms    MB/s")
    lines += [
        f"{name:<6}  {rate.fixed_s * 1e3:>8.3f}  {rate.bytes_per_s / 1e6:>8.1f}" for name, rate in model.tiers.items()
    ]
    return lines
