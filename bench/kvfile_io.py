"""Benchmark: `.kvc` save and load against a raw write and read of the
same bytes, in the same run and the same directory.

Targets (issue 23): save >= 0.95x raw write+fsync throughput (the baseline
also fsyncs the directory, the minimum a durable new file needs, as save's
commit does); cold load with
verification on >= 0.9x raw cold-read throughput; warm load (file in the page
cache) >= 0.9x raw warm read; peak RSS growth of a load <= the restored arrays
plus the stated transient (none: reads land in the final arrays). The
verification cost is reported as a share of cold-load time.

The entry is real mlx-lm `KVCache` layers (float32) filled by
`update_and_fetch` like a chunked prefill plus one decode step, so each cache
carries slack past its offset as a live cache does. Throughput is MiB/s
(2^20 bytes) of persisted payload (rows up to offset) for every measurement.

    python -m kvcellar.bench.kvfile_io [--size-mib 256] [--repeats 3] [--dir DIR] [--json] [--write-docs]

With `--encrypt`, it times sealed against plain save and load instead
(`bench/kvfile_io_sealed.py`, its own docs section).
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import click
import mlx.core as mx
import numpy as np
import platformdirs
import xxhash
from mlx_lm.models.cache import KVCache
from rich.console import Console

from kvcellar.bench.common import (
    describe_machine,
    docs_markers,
    load_note,
    print_figures,
    publish,
    publish_options,
    scratch_dir_option,
)
from kvcellar.bench.kvfile_io_sealed import publish_sealed, run_sealed_benchmark
from kvcellar.store import codecs, kvfile
from kvcellar.store.disk import RealDisk, fsync_path

MIB_BYTES = 1 << 20
LAYER_COUNT = 16
KV_HEAD_COUNT = 8
HEAD_DIM = 128
CACHE_DTYPE = mx.float32
PREFILL_CHUNK_ROWS = 512
WRITE_CHUNK_BYTES = 64 * MIB_BYTES
EARLY_WRITEBACK_CHUNK_BYTES = 8 * MIB_BYTES
SAVE_TARGET_RATIO = 0.95
LOAD_TARGET_RATIO = 0.9
TARGET_OF = {"save": SAVE_TARGET_RATIO, "load": LOAD_TARGET_RATIO, "load_warm": LOAD_TARGET_RATIO}
VERIFY_BUDGET_PCT = 10.0
RSS_SAMPLE_SECONDS = 0.002
# In-memory component costs are the fastest of a few tries per repeat: in a VM the first
# touch of memory freed a moment ago can cost several times the copy itself, at random.
IN_MEMORY_TRIES = 3
DOCS_BEGIN, DOCS_END = docs_markers("kvfile_io")

# (key, label) in display order; every key is a median over repeats, in seconds.
MEASUREMENTS: tuple[tuple[str, str], ...] = (
    ("raw_write", "raw write + fsync + directory fsync (baseline)"),
    ("raw_write_early", "the same raw write, writeback started every 8 MiB (not a baseline)"),
    ("save", "kvfile.save"),
    ("raw_read", "raw cold read (baseline)"),
    ("load", "kvfile.load cold, verify on"),
    ("load_noverify", "kvfile.load cold, verify off"),
    ("raw_read_warm", "raw warm read (baseline)"),
    ("load_warm", "kvfile.load warm, verify on"),
    ("load_warm_noverify", "kvfile.load warm, verify off"),
    ("hash", "xxh3-64 of payload, in memory"),
    ("materialise", "materialise tensors into per-head segment views, in memory"),
    ("allocate", "allocate the restored arrays (mx.zeros, 256-row capacity), fresh memory"),
)
BASELINE_OF = {
    "raw_write_early": "raw_write",
    "save": "raw_write",
    "load": "raw_read",
    "load_noverify": "raw_read",
    "load_warm": "raw_read_warm",
    "load_warm_noverify": "raw_read_warm",
}


def build_entry(size_mib: int, seed: int = 0) -> tuple[list[KVCache], list[int]]:
    """KVCache layers whose persisted rows total at least `size_mib` MiB."""
    row_bytes = LAYER_COUNT * 2 * KV_HEAD_COUNT * HEAD_DIM * CACHE_DTYPE.size
    prefill_rows = max(1, -(-size_mib * MIB_BYTES // row_bytes))
    chunk_rows = [min(PREFILL_CHUNK_ROWS, prefill_rows - start) for start in range(0, prefill_rows, PREFILL_CHUNK_ROWS)]
    mx.random.seed(seed)
    caches = []
    for _ in range(LAYER_COUNT):
        cache = KVCache()
        for rows in [*chunk_rows, 1]:
            shape = (1, KV_HEAD_COUNT, rows, HEAD_DIM)
            cache.update_and_fetch(
                mx.random.normal(shape, dtype=CACHE_DTYPE), mx.random.normal(shape, dtype=CACHE_DTYPE)
            )
        mx.eval(cache.keys, cache.values)
        caches.append(cache)
    return caches, list(range(prefill_rows + 1))


def _cache_arrays(caches: Sequence[Any]) -> Iterator[mx.array]:
    for cache in caches:
        yield cache.keys
        yield cache.values


def resident_bytes(path: Path) -> int | None:
    """Bytes of `path` in the page cache per util-linux `fincore`, or None without it."""
    fincore = shutil.which("fincore")
    if fincore is None:
        return None
    completed = subprocess.run(
        [fincore, "--bytes", "--noheadings", "--output", "RES", str(path)], capture_output=True, text=True, check=False
    )
    try:
        return int(completed.stdout.strip())
    except ValueError:
        return None


def drop_page_cache(path: Path) -> int | None:
    """Evict the file's (clean, already fsynced) pages; returns what stayed resident."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return resident_bytes(path)


def _rss_bytes() -> int | None:
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


class PeakRssSampler:
    """Samples this process's resident set from a thread while a block runs.
    Used on an untimed load only: the sampler thread competes for the GIL."""

    def __init__(self) -> None:
        self.baseline_bytes = _rss_bytes()
        self.peak_bytes = self.baseline_bytes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(RSS_SAMPLE_SECONDS):
            self._record()

    def _record(self) -> None:
        current = _rss_bytes()
        if current is not None and self.peak_bytes is not None:
            self.peak_bytes = max(self.peak_bytes, current)

    def __enter__(self) -> PeakRssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._record()

    @property
    def growth_bytes(self) -> int | None:
        if self.baseline_bytes is None or self.peak_bytes is None:
            return None
        return self.peak_bytes - self.baseline_bytes


def _fresh_memory() -> None:
    # Freed arrays parked in MLX's buffer cache would make the next load's allocations free.
    gc.collect()
    mx.clear_cache()


def time_raw_write(path: Path, payload: bytes, *, early_writeback: bool = False) -> float:
    """Write the payload from memory it already occupies, 64 MiB per call,
    fsync it, and fsync the directory: the least a durable new file needs
    (save's commit does the same, plus a rename). With `early_writeback`, the
    writeback of every 8 MiB is started as soon as it is written, as save does
    per tensor (`Disk.start_writeback`): what a raw writer gains from it."""
    view = memoryview(payload)
    chunk_bytes = EARLY_WRITEBACK_CHUNK_BYTES if early_writeback else WRITE_CHUNK_BYTES
    disk = RealDisk()
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        written_bytes = 0
        while written_bytes < len(view):
            chunk_written = os.write(fd, view[written_bytes : written_bytes + chunk_bytes])
            if early_writeback:
                disk.start_writeback(fd, written_bytes, chunk_written)
            written_bytes += chunk_written
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(path.parent)
    return time.perf_counter() - started


def time_raw_cold_read(path: Path, bytes_total: int) -> tuple[float, int | None]:
    still_resident_bytes = drop_page_cache(path)
    return time_raw_read(path, bytes_total), still_resident_bytes


def time_raw_warm_read(path: Path, bytes_total: int) -> float:
    path.read_bytes()
    return time_raw_read(path, bytes_total)


def time_raw_read(path: Path, bytes_total: int) -> float:
    """One read of the whole file into a buffer allocated (and zero-filled, so
    its pages exist) before the clock starts: the floor of any read."""
    buffer = bytearray(bytes_total)
    view = memoryview(buffer)
    started = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        read_bytes = 0
        while read_bytes < bytes_total:
            got = os.readv(fd, [view[read_bytes:]])
            if got == 0:
                raise RuntimeError(f"{path}: short read ({read_bytes} of {bytes_total} bytes)")
            read_bytes += got
    finally:
        os.close(fd)
    return time.perf_counter() - started


def time_save(path: Path, caches: Sequence[Any], tokens: Sequence[int]) -> float:
    started = time.perf_counter()
    kvfile.save(path, caches, tokens)
    return time.perf_counter() - started


def time_load(path: Path, *, verify: bool, cold: bool) -> tuple[float, int | None]:
    # A load drops the pages it read, so a warm one reads the file into the page cache first.
    still_resident_bytes = None
    if cold:
        still_resident_bytes = drop_page_cache(path)
    else:
        path.read_bytes()
    _fresh_memory()
    started = time.perf_counter()
    entry = kvfile.load(path, verify=verify)
    mx.eval(*_cache_arrays(entry.caches))
    return time.perf_counter() - started, still_resident_bytes


def time_hash(payload: bytes, tensor_lengths: Sequence[int]) -> float:
    """One xxh3-64 per tensor over in-memory bytes: the work `verify` adds to a load."""
    view = memoryview(payload)
    started = time.perf_counter()
    offset = 0
    for length in tensor_lengths:
        xxhash.xxh3_64_digest(view[offset : offset + length])
        offset += length
    return time.perf_counter() - started


def time_materialise(caches: Sequence[Any]) -> float:
    """The contiguous copy `save` makes of each tensor's rows up to offset."""
    started = time.perf_counter()
    for cache in caches:
        for array in (cache.keys, cache.values):
            codecs.materialise(array[..., : cache.offset, :])
    return time.perf_counter() - started


def time_allocate(path: Path) -> float:
    """What `load` spends obtaining the restored arrays' memory: one `mx.zeros`
    per tensor at its 256-row capacity, evaluated, in memory the process has
    to fault in (MLX's buffer cache cleared first, as before every load)."""
    header = kvfile.read_header(path)
    _fresh_memory()
    started = time.perf_counter()

    def allocate(record: kvfile.TensorRecord, capacity_rows: int | None = None) -> mx.array:
        shape = list(record.shape)
        if capacity_rows is not None and capacity_rows > shape[-2]:
            shape[-2] = capacity_rows
        array = mx.zeros(shape, dtype=mx.float32 if record.dtype == "float32" else mx.uint16)
        mx.eval(array)
        return array

    caches = codecs.rebuild_caches(header.caches, allocate)
    seconds = time.perf_counter() - started
    del caches
    return seconds


def measure_load_memory(path: Path) -> dict[str, int | None]:
    """Peak RSS growth over an untimed cold load, and the restored arrays' own size."""
    drop_page_cache(path)
    _fresh_memory()
    with PeakRssSampler() as sampler:
        entry = kvfile.load(path, verify=True)
        mx.eval(*_cache_arrays(entry.caches))
    restored_bytes = sum(array.nbytes for array in _cache_arrays(entry.caches))
    return {"peak_rss_growth_bytes": sampler.growth_bytes, "restored_arrays_bytes": restored_bytes}


def _in_alternating_order(steps: list[Callable[[], None]], index: int) -> None:
    for step in steps if index % 2 == 0 else reversed(steps):
        step()


def _fastest_of_tries(measure: Callable[[], dict[str, float]]) -> dict[str, float]:
    tries = [measure() for _ in range(IN_MEMORY_TRIES)]
    return {key: min(attempt[key] for attempt in tries) for key in tries[0]}


def run_repeat(
    index: int,
    workdir: Path,
    caches: Sequence[Any],
    tokens: Sequence[int],
    payload: bytes,
    tensor_lengths: Sequence[int],
) -> tuple[dict[str, float], list[int | None]]:
    """Every measurement once; baseline and kvfile swap order on odd repeats."""
    raw_path = workdir / f"raw-{index}.bin"
    early_path = workdir / f"raw-early-{index}.bin"
    entry_path = workdir / f"entry-{index}{kvfile.FILE_SUFFIX}"
    seconds: dict[str, float] = {}
    still_resident: list[int | None] = []

    def cold_load(key: str, verify: bool) -> Callable[[], None]:
        def step() -> None:
            seconds[key], resident = time_load(entry_path, verify=verify, cold=True)
            still_resident.append(resident)

        return step

    def raw_read() -> None:
        seconds["raw_read"], resident = time_raw_cold_read(raw_path, len(payload))
        still_resident.append(resident)

    def warm_load(key: str, verify: bool) -> Callable[[], None]:
        def step() -> None:
            seconds[key], _ = time_load(entry_path, verify=verify, cold=False)

        return step

    def raw_read_warm() -> None:
        seconds["raw_read_warm"] = time_raw_warm_read(raw_path, len(payload))

    def raw_write() -> None:
        seconds["raw_write"] = time_raw_write(raw_path, payload)

    def raw_write_early() -> None:
        seconds["raw_write_early"] = time_raw_write(early_path, payload, early_writeback=True)
        early_path.unlink()

    def save() -> None:
        seconds["save"] = time_save(entry_path, caches, tokens)

    try:
        _in_alternating_order([raw_write, save, raw_write_early], index)
        _in_alternating_order([raw_read, cold_load("load", True), cold_load("load_noverify", False)], index)
        _in_alternating_order(
            [raw_read_warm, warm_load("load_warm", True), warm_load("load_warm_noverify", False)], index
        )
        seconds.update(
            _fastest_of_tries(
                lambda: {
                    "hash": time_hash(payload, tensor_lengths),
                    "materialise": time_materialise(caches),
                    "allocate": time_allocate(entry_path),
                }
            )
        )
    finally:
        for path in (raw_path, early_path, entry_path):
            path.unlink(missing_ok=True)
        _fresh_memory()
    return seconds, still_resident


def run_benchmark(size_mib: int, repeats: int, workdir: Path, progress: Console) -> dict[str, Any]:
    """Build the entry, run every repeat, return the figures (medians) as plain data."""
    progress.print(f"building a {size_mib} MiB entry ({LAYER_COUNT} layers of KVCache, float32)")
    caches, tokens = build_entry(size_mib)
    planned = kvfile.KvFileWriter(workdir / "planned.kvc", caches, tokens).planned_header
    tensor_lengths = [record.length for record in planned.tensor_records()]
    payload = np.random.default_rng(1).bytes(planned.payload_bytes)
    runs: list[dict[str, float]] = []
    still_resident: list[int | None] = []
    for index in range(repeats):
        progress.print(f"repeat {index + 1}/{repeats}")
        seconds, resident = run_repeat(index, workdir, caches, tokens, payload, tensor_lengths)
        runs.append(seconds)
        still_resident.extend(resident)
    memory_path = workdir / f"memory{kvfile.FILE_SUFFIX}"
    kvfile.save(memory_path, caches, tokens)
    try:
        memory = measure_load_memory(memory_path)
    finally:
        memory_path.unlink(missing_ok=True)
    known_resident = [value for value in still_resident if value is not None]
    return summarise(runs, planned, len(tokens), repeats, memory, max(known_resident) if known_resident else None)


def summarise(
    runs: list[dict[str, float]],
    planned: kvfile.Header,
    token_count: int,
    repeats: int,
    memory: dict[str, int | None],
    resident_after_drop_bytes_max: int | None,
) -> dict[str, Any]:
    payload_mib = planned.payload_bytes / MIB_BYTES
    medians = {key: statistics.median(run[key] for run in runs) for key, _ in MEASUREMENTS}
    rates = {key: payload_mib / value for key, value in medians.items()}
    verify_delta_seconds = statistics.median(run["load"] - run["load_noverify"] for run in runs)
    result: dict[str, Any] = {
        "save_ratio": rates["save"] / rates["raw_write"],
        "save_vs_early_writeback_ratio": rates["save"] / rates["raw_write_early"],
        "raw_write_early_mb_s": rates["raw_write_early"],
        "load_ratio": rates["load"] / rates["raw_read"],
        "load_noverify_ratio": rates["load_noverify"] / rates["raw_read"],
        "raw_write_mb_s": rates["raw_write"],
        "save_mb_s": rates["save"],
        "raw_read_mb_s": rates["raw_read"],
        "load_mb_s": rates["load"],
        "load_noverify_mb_s": rates["load_noverify"],
        "warm_load_ratio": rates["load_warm"] / rates["raw_read_warm"],
        "raw_read_warm_mb_s": rates["raw_read_warm"],
        "load_warm_mb_s": rates["load_warm"],
        "load_warm_noverify_mb_s": rates["load_warm_noverify"],
        "hash_mb_s": rates["hash"],
        "verify_cost_seconds": medians["hash"],
        "verify_cost_pct": 100 * medians["hash"] / medians["load"],
        "verify_delta_seconds": verify_delta_seconds,
        "verify_delta_pct": 100 * verify_delta_seconds / medians["load"],
        "median_seconds": medians,
        "runs_seconds": runs,
        "payload_bytes": planned.payload_bytes,
        "file_bytes": planned.file_bytes,
        "tensor_count": len(list(planned.tensor_records())),
        "token_count": token_count,
        "cache_shape": f"{LAYER_COUNT} x KVCache, keys/values [1, {KV_HEAD_COUNT}, {token_count}, {HEAD_DIM}] float32",
        "mb_unit": "MiB (2^20 bytes) of payload per second",
        "repeats": repeats,
        "resident_after_drop_bytes_max": resident_after_drop_bytes_max,
        "transient_bound_bytes": max(record.length for record in planned.tensor_records()),
        # `kvcellar serve` runs with glibc.malloc.hugetlb=1 (kvcellar.huge_pages); run the benchmark
        # with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 to measure what the server does.
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        **memory,
    }
    growth, restored = result["peak_rss_growth_bytes"], result["restored_arrays_bytes"]
    result["targets_met"] = {
        f"save_ratio_ge_{SAVE_TARGET_RATIO}": result["save_ratio"] >= SAVE_TARGET_RATIO,
        f"load_ratio_ge_{LOAD_TARGET_RATIO}": result["load_ratio"] >= LOAD_TARGET_RATIO,
        f"warm_load_ratio_ge_{LOAD_TARGET_RATIO}": result["warm_load_ratio"] >= LOAD_TARGET_RATIO,
        "peak_rss_le_entry_plus_transient": growth is not None and growth <= restored + result["transient_bound_bytes"],
        "verify_cost_le_10_pct": result["verify_cost_pct"] <= VERIFY_BUDGET_PCT,
    }
    return result


def _ratio_note(result: dict[str, Any], key: str) -> str:
    baseline = BASELINE_OF.get(key)
    if baseline is None:
        return "baseline" if key in BASELINE_OF.values() else ""
    ratio = result["median_seconds"][baseline] / result["median_seconds"][key]
    target = TARGET_OF.get(key)
    if target is not None:
        verdict = "met" if ratio >= target else "MISSED"
        return f"{ratio:.2f}x (target >= {target}x: {verdict})"
    return f"{ratio:.2f}x"


FIGURE_COLUMNS = ("measurement", "median s", "range s", "MiB/s", "vs baseline")


def figure_rows(result: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row of FIGURE_COLUMNS per measurement; MiB/s is from the median."""
    payload_mib = result["payload_bytes"] / MIB_BYTES
    rows: list[tuple[str, ...]] = []
    for key, label in MEASUREMENTS:
        seconds = result["median_seconds"][key]
        runs = [run[key] for run in result["runs_seconds"]]
        rows.append(
            (
                label,
                f"{seconds:.3f}",
                f"{min(runs):.3f}-{max(runs):.3f}",
                f"{payload_mib / seconds:,.0f}",
                _ratio_note(result, key),
            )
        )
    return rows


def summary_lines(result: dict[str, Any]) -> list[str]:
    lines = [
        f"payload: {result['payload_bytes']:,} bytes ({result['payload_bytes'] / MIB_BYTES:.2f} MiB) in "
        f"{result['tensor_count']} tensors; file {result['file_bytes']:,} bytes; {result['cache_shape']}",
        f"verification cost: {result['verify_cost_seconds'] * 1000:.1f} ms of xxh3-64 over the payload "
        f"({result['verify_cost_pct']:.1f}% of the median cold load); end to end, cold verify on minus off: "
        f"{result['verify_delta_seconds'] * 1000:+.1f} ms ({result['verify_delta_pct']:+.1f}%, median of paired "
        f"per-repeat differences, within cold-read noise)",
        f"in-memory rows are the fastest of {IN_MEMORY_TRIES} tries per repeat; every other row is one try per repeat",
        f"GLIBC_TUNABLES={result['glibc_tunables'] or '(unset)'} "
        f"(kvcellar serve sets glibc.malloc.hugetlb=1 for itself: huge pages for fresh memory)",
    ]
    if result["peak_rss_growth_bytes"] is not None:
        met = result["targets_met"]["peak_rss_le_entry_plus_transient"]
        lines.append(
            f"peak RSS growth over a cold load: {result['peak_rss_growth_bytes'] / MIB_BYTES:.0f} MiB, "
            f"of which the restored arrays (256-row capacity) hold "
            f"{result['restored_arrays_bytes'] / MIB_BYTES:.0f} MiB; stated transient: none by design (each "
            f"tensor is read straight into its final array), bounded here by the largest tensor, "
            f"{result['transient_bound_bytes'] / MIB_BYTES:.1f} MiB (target: {'met' if met else 'MISSED'})"
        )
    if result["resident_after_drop_bytes_max"] is not None:
        lines.append(
            f"page cache after DONTNEED (fincore): at most {result['resident_after_drop_bytes_max']:,} "
            f"bytes still resident"
        )
    return lines


def print_table(result: dict[str, Any], console: Console) -> None:
    title = f"kvfile I/O, median of {result['repeats']} (MiB/s = 2^20 bytes of payload per second)"
    print_figures(
        title, FIGURE_COLUMNS, figure_rows(result), summary_lines(result), console, text_columns=("measurement",)
    )


def _verdict(result: dict[str, Any], key: str) -> str:
    return "meets" if result["targets_met"][key] else "misses"


def _save_prose(result: dict[str, Any]) -> str:
    """Save against the raw write: what each does, and where save's extra time went (profiled)."""
    medians = result["median_seconds"]
    return (
        f"Save runs at {result['save_ratio']:.2f}x the raw write+fsync throughput and "
        f"{_verdict(result, f'save_ratio_ge_{SAVE_TARGET_RATIO}')} the {SAVE_TARGET_RATIO}x target "
        f"({medians['save'] - medians['raw_write']:+.3f} s). The baseline writes the payload from memory it "
        f"already occupies, 64 MiB per write call, fsyncs the file and then the directory (the least a durable "
        f"new file needs; save's commit does the same, so the baseline now does too). Save does beyond it: "
        f"planning the header (a few ms of CBOR), one zero-copy view per head of each tensor "
        f"({medians['materialise']:.3f} s in memory: `memoryview` of an evaluated MLX array and `np.asarray` of "
        f"that view alias the buffer, nothing is copied), one 1 MiB pwrite per head on a helper thread while "
        f"the calling thread hashes the same bytes ({medians['hash']:.3f} s of xxh3-64 in memory), the header "
        f"write, the fsync, a rename and the directory fsync (`strace` of a 256 MiB save: 32 thread starts, "
        f"256 pwrites of 1,049,088 bytes and one of the header, 32 `sync_file_range`, 2 fsyncs, 1 rename; of "
        f"the baseline: 5 writes, 4 of them 64 MiB, 2 fsyncs; the syscall counts themselves cost well under a "
        f"millisecond, so fewer, larger writes were not pursued). Profiled in one process before this change "
        f"(2026-12-01, five alternations, timers around every `Disk` call): the baseline took "
        f"0.249 s (writes 0.112 s, fsync 0.136 s), save 0.309 s (the tensors' writes with their hashing "
        f"0.164 s, of which the pwrites 0.126 s; fsync 0.135 s; planning and views 0.015 s; rename and "
        f"directory fsync under 0.005 s): the fsync cost the same, and the gap was the copies into the page "
        f"cache competing with the hash, 32 thread hand-offs and the other agents for the 2 cores. Save now "
        f"starts each tensor's writeback as soon as its bytes are written (`Disk.start_writeback`, "
        f"`sync_file_range(SYNC_FILE_RANGE_WRITE)`), so the device writes while the next tensor is copied in "
        f"and the commit's fsync waits only for the rest; the durability contract is unchanged (only the "
        f"fsync makes bytes durable). A raw write doing the same every 8 MiB (the row marked not a baseline) "
        f"runs at {medians['raw_write'] / medians['raw_write_early']:.2f}x the baseline, and save at "
        f"{result['save_vs_early_writeback_ratio']:.2f}x that."
    )


def _load_prose(result: dict[str, Any]) -> str:
    """The loads against the raw reads, and where the warm load's extra time went (profiled)."""
    medians = result["median_seconds"]
    return (
        f"Cold load with verification runs at {result['load_ratio']:.2f}x raw cold-read throughput "
        f"({result['load_noverify_ratio']:.2f}x without) and {_verdict(result, f'load_ratio_ge_{LOAD_TARGET_RATIO}')} "
        f"the {LOAD_TARGET_RATIO}x target ({medians['load'] - medians['raw_read']:+.3f} s); warm, it runs at "
        f"{result['warm_load_ratio']:.2f}x the raw warm read and "
        f"{_verdict(result, f'warm_load_ratio_ge_{LOAD_TARGET_RATIO}')} that target "
        f"({medians['load_warm'] - medians['raw_read_warm']:+.3f} s). The load reads each tensor on a reader "
        f"thread straight into its final MLX array while the engine thread hashes the ones already read, with "
        f"no host copy. A `perf` profile of warm loads before this change put the time beyond the read in "
        f"three places. Dropping the file's pages after each tensor: 32 `posix_fadvise(DONTNEED)` calls took "
        f"0.09-0.17 s per load (1-2 ms each, up to 15 ms: a call that finds a just-read page still on a "
        f"CPU's page list drains every CPU's lists), so the reader now drops once per 64 MiB read (one call "
        f"of 6-10 ms for this entry; the page cache holds at most 64 MiB plus a tensor of it meanwhile). The "
        f"kernel zeroing the restored arrays' fresh pages at first touch (`clear_page`, the largest item; the "
        f"raw baseline reads into a buffer faulted in before its clock starts): MLX's `mx.empty` is "
        f"`mx.zeros`, so the arrays were always zero-filled on the engine thread, where those faults overlap "
        f"the reader's copies, and the separate memset of the slack rows was redundant and is gone; "
        f"allocating the arrays alone takes {medians['allocate']:.3f} s, "
        f"{medians['allocate'] / medians['raw_read_warm']:.2f}x the whole raw warm read, so while a load faults "
        f"in fresh memory the warm ratio cannot exceed {medians['raw_read_warm'] / medians['allocate']:.2f}x "
        f"(a server's MLX buffer cache hands back pages already faulted in; this benchmark does not). And the hash, "
        f"{result['verify_cost_seconds']:.3f} s in memory ({result['verify_cost_pct']:.1f}% of the median cold "
        f"load), on the engine thread while the reader reads the next tensor; cold verify on minus off was "
        f"{result['verify_delta_seconds']:+.3f} s end to end (median of paired per-repeat differences)."
    )


def interpretation(result: dict[str, Any]) -> str:
    """One paragraph, built from the figures: which targets hold, and where the time goes."""
    return (
        f"{_save_prose(result)} {_load_prose(result)}{_spread_sentence(result)} "
        f'"Cold" means this machine\'s page cache for the file was dropped with posix_fadvise(DONTNEED); caching '
        f"beneath a virtual disk, if any, is outside the benchmark's reach. {load_note()} "
        f"Absolute rates vary between machines and runs; the ratios compare measurements interleaved in the "
        f"same repeats."
    )


def _spread_sentence(result: dict[str, Any]) -> str:
    """Names the headline measurements whose slowest run took over 1.5x their fastest."""
    labels = dict(MEASUREMENTS)
    wide = []
    for key in ("raw_write", "save", "raw_read", "load", "load_noverify", "raw_read_warm", "load_warm"):
        runs = [run[key] for run in result["runs_seconds"]]
        if max(runs) > 1.5 * min(runs):
            wide.append(f"{labels[key]} {min(runs):.3f}-{max(runs):.3f} s")
    if not wide:
        return ""
    return f" Runs varied widely ({'; '.join(wide)}), so the medians of {result['repeats']} repeats carry that noise."


def markdown_section(result: dict[str, Any], machine: dict[str, str], command: str, run_date: str) -> str:
    lines = [
        "## kvfile save and load against raw I/O",
        "",
        f"Run {run_date} with `{command}` (median of {result['repeats']} repeats; MiB/s = 2^20 bytes of "
        f"payload per second).",
        "",
        f"Machine: {machine['cpus']} CPUs ({machine['cpu_model']}), {machine['memory_total']} RAM, "
        f"{machine['platform']}, Python {machine['python']}, MLX {machine['mlx']}; files on "
        f"{machine['filesystem']}.",
        "",
        f"| {' | '.join(FIGURE_COLUMNS)} |",
        "|---|" + "---:|" * (len(FIGURE_COLUMNS) - 1),
        *(f"| {' | '.join(row)} |" for row in figure_rows(result)),
        "",
        *(f"- {line}" for line in summary_lines(result)),
        "",
        interpretation(result),
    ]
    return "\n".join(lines)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--size-mib",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Persisted payload of the entry, in MiB (2^20 bytes): rounded up to whole token rows, "
    "plus one decode row so each cache carries slack as a live one does.",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Times each measurement runs; figures are medians.",
)
@click.option(
    "--encrypt",
    is_flag=True,
    help="Time sealed (AES-256-GCM) against plain save and load of the same entry instead; "
    "--write-docs then rewrites its own section (kvfile_io_sealed).",
)
@scratch_dir_option("the benchmark's files")
@publish_options(DOCS_BEGIN, DOCS_END)
def main(size_mib: int, repeats: int, encrypt: bool, directory: Path | None, as_json: bool, write_docs: bool) -> None:
    """Time .kvc save and cold load against a raw write and read of the same bytes."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    progress = Console(stderr=True)
    base = directory if directory is not None else platformdirs.user_cache_path("kvcellar") / "bench"
    base.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="kvfile_io-", dir=base))
    if encrypt:
        try:
            sealed = run_sealed_benchmark(size_mib, repeats, workdir, progress, build_entry, drop_page_cache)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        sealed["machine"] = describe_machine(base)
        publish_sealed(sealed, sealed["machine"], write_docs=write_docs, as_json=as_json, console=console)
        return
    try:
        result = run_benchmark(size_mib, repeats, workdir, progress)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    machine = describe_machine(base)
    result["machine"] = machine
    print_table(result, console)
    publish(
        "kvfile_io",
        result,
        lambda command, run_date: markdown_section(result, machine, command, run_date),
        write_docs=write_docs,
        as_json=as_json,
        console=console,
        progress=progress,
    )


if __name__ == "__main__":
    main()
