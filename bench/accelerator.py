"""Benchmark: restore vs recompute on an accelerator (issue 44 items 3 and 4).

One process, random-weight bf16 llamas built in-process in the shapes of
Llama-3.2-1B and Llama-3.1-8B (`--shapes gpu`, the default) or a tiny one
(`--shapes tiny`, seconds on a CPU: the fast test and the rehearsal). For
each (shape, context) cell, every figure from the same run and directory:

- `prefill`: warm chunked prefill of the prompt to its first token (a first
  prefill at the same length runs before, untimed: the first one at a new
  length pays kernel compilation once).
- `raw_hot` / `raw_cold`: `preadv` of the `.kvc` file into a preallocated host
  buffer, from the page cache and after dropping it.
- `restore_{hot,cold}`: `kvfile.load` (checksums on) plus the first decode
  step, with the path this device gets by default (staged `mx.load` windows on
  CUDA, reads into the arrays elsewhere); `alt_restore_*` the other path.
  "hot" is the RAM tier's figure (the file in host RAM), "cold" the SSD tier.
- `first_step_ratio`: the first decode step after the restore over the median
  of the next three.
- `mlx_lm_load`: mlx-lm's `load_prompt_cache` of the same cache (safetensors,
  hot) plus the first step.
- `split`: prefill `[0, k)` (queued asynchronously) while `[k, n)` is
  `mx.load`ed from the `.kvc` file on a stream of its own (no checksums),
  joined, plus the first step; k where the measured prefill and restore
  rates meet; one untimed run first, as for prefill.

Every measurement is wrapped: one that fails prints its error and the rest
still run. A time budget (`--budget-s`) skips cells that would not fit.
The last stdout line is the JSON object; the keys the issue names come from
the key cell (8B shape at 32k; the largest tiny cell with `--shapes tiny`):
`restore_vs_prefill` (hot restore + first token over warm prefill),
`split_vs_best_single`, `first_step_ratio`, `hot_load_vs_raw` (raw hot read
time over the hot load time). Full figures go to `$OUT/accelerator.json`
when `OUT` is set (and to `--out`).

    python -m kvcellar.bench.accelerator [--shapes gpu|tiny] [--smoke] [--json] [--budget-s 330] [--dir DIR]

It imports only MLX, mlx-lm's model and cache modules, numpy and kvcellar's
store (xxhash, attrs, cattrs, cbor2): nothing else a bare GPU machine lacks.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import importlib.metadata
import importlib.util
import io
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, cast

import mlx.core as mx
import numpy as np

GIB_BYTES = 1 << 30
PREFILL_CHUNK_TOKENS = 2048
STEP_ROWS = 256
READ_CHUNK_BYTES = 16 << 20
NORMAL_STEPS = 3

_LLAMA_COMMON: dict[str, Any] = {
    "model_type": "llama",
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "vocab_size": 128256,
}
SHAPES: dict[str, dict[str, Any]] = {
    "1b": _LLAMA_COMMON
    | {
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "tie_word_embeddings": True,
    },
    "8b": _LLAMA_COMMON
    | {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
    },
    "tiny": _LLAMA_COMMON
    | {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "tie_word_embeddings": True,
    },
}
# In order of importance: the key cell first, so a short budget still yields it.
PLANS: dict[str, list[tuple[str, int]]] = {
    "gpu": [("8b", 32768), ("8b", 8192), ("1b", 8192), ("1b", 32768), ("1b", 131072), ("8b", 131072)],
    "tiny": [("tiny", 1024), ("tiny", 256)],
}
KEY_CELLS = {"gpu": ("8b", 32768), "tiny": ("tiny", 1024)}


def _import_mlx_lm() -> tuple[Any, Any]:
    """mlx-lm's llama and cache modules. Its package `__init__` imports
    transformers (for `load`), which a bare GPU image may lack and this bench
    does not use: then the subpackages are imported under an empty parent."""
    try:
        from mlx_lm.models import cache, llama
    except Exception as e:  # ImportError, or whatever an incompatible transformers raises while importing
        for name in [m for m in sys.modules if m == "mlx_lm" or m.startswith("mlx_lm.")]:
            del sys.modules[name]
        spec = importlib.util.find_spec("mlx_lm")
        if spec is None or spec.submodule_search_locations is None:
            raise
        _say(f"note: importing mlx_lm failed ({e}); loading its model modules without the package __init__")
        parent = types.ModuleType("mlx_lm")
        parent.__path__ = list(spec.submodule_search_locations)
        sys.modules["mlx_lm"] = parent
        from mlx_lm.models import cache, llama
    return llama, cache


_START = time.perf_counter()


def _say(text: str) -> None:
    print(f"[{time.perf_counter() - _START:7.1f}s] {text}", flush=True)


def _attempt(figures: dict[str, Any], name: str, action: Callable[[], Any]) -> Any:
    """Run one measurement; a failure is printed and recorded, never raised."""
    started = time.perf_counter()
    try:
        result = action()
    except Exception as e:
        figures.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
        _say(f"  {name}: FAILED {type(e).__name__}: {e}")
        traceback.print_exc(limit=4, file=sys.stdout)
        return None
    _say(f"  {name}: done in {time.perf_counter() - started:.3f} s")
    return result


def _timed(action: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = action()
    return time.perf_counter() - started, result


def _timed_build(shape: str, llama: Any) -> tuple[float, Any]:
    return _timed(lambda: build_model(shape, llama))


def build_model(shape: str, llama: Any) -> Any:
    """A random-weight bf16 llama of `shape`, seeded, evaluated on the default device."""
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(SHAPES[shape]))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def prefill(model: Any, tokens: mx.array, caches: list[Any], *, asynchronous: bool = False) -> mx.array:
    """Chunked prefill as mlx-lm and the engine run it; returns the last position's logits."""
    logits = None
    for start in range(0, tokens.size, PREFILL_CHUNK_TOKENS):
        logits = model(tokens[None, start : start + PREFILL_CHUNK_TOKENS], cache=caches)[:, -1, :]
        (mx.async_eval if asynchronous else mx.eval)([logits, *[c.state for c in caches]])
    assert logits is not None
    return logits


def step(model: Any, caches: list[Any]) -> float:
    """One decode step of a fixed token, evaluated; its seconds."""
    started = time.perf_counter()
    mx.eval(model(mx.array([[1]]), cache=caches))
    return time.perf_counter() - started


def first_and_normal_steps(model: Any, caches: list[Any]) -> tuple[float, float]:
    first = step(model, caches)
    normal = statistics.median(step(model, caches) for _ in range(NORMAL_STEPS))
    return first, normal


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_read_s(path: Path, *, cold: bool) -> float:
    """`preadv` of the whole file in 16 MiB chunks into a preallocated, touched host buffer."""
    size = path.stat().st_size
    buffer = np.ones(size, dtype=np.uint8)
    view = buffer.data
    if cold:
        drop_page_cache(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        started = time.perf_counter()
        for offset in range(0, size, READ_CHUNK_BYTES):
            os.preadv(fd, [view[offset : offset + READ_CHUNK_BYTES]], offset)
        return time.perf_counter() - started
    finally:
        os.close(fd)


def _free(*_: Any) -> None:
    gc.collect()
    mx.clear_cache()


def _warm_page_cache(path: Path) -> None:
    raw_read_s(path, cold=False)


def raw_read_hot_s(path: Path) -> float:
    _warm_page_cache(path)
    return raw_read_s(path, cold=False)


def measure_restore(
    model: Any, path: Path, *, staged: bool, cold: bool, prefetch: Callable[[list[Any]], None] | None = None
) -> dict[str, float]:
    """`kvfile.load` (checksums on) plus the first decode step, then three normal steps.
    `prefetch`, timed with the load, runs on the restored caches before the first step."""
    from kvcellar.store import kvfile

    if cold:
        drop_page_cache(path)
    else:
        _warm_page_cache(path)
    started = time.perf_counter()
    entry = kvfile.load(path, staged=staged)
    if prefetch is not None:
        prefetch(entry.caches)
    load_s = time.perf_counter() - started
    first, normal = first_and_normal_steps(model, entry.caches)
    del entry
    _free()
    return {"load_s": load_s, "ttft_s": load_s + first, "first_step_s": first, "normal_step_s": normal}


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


def cuda_prefetcher() -> Callable[[list[Any]], None]:
    """An experiment, not kvcellar's path: move restored arrays that the direct
    path left in host-written managed memory into the GPU with
    `cudaMemPrefetchAsync` (CUDA 13's signature, a `cudaMemLocation` by value;
    CUDA 12 names it `_v2`), called through ctypes on the CUDA runtime MLX
    loaded. Raises where there is no CUDA runtime."""
    runtime = None
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            runtime = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if runtime is None:
        spec = importlib.util.find_spec("nvidia")
        roots = list(spec.submodule_search_locations or []) if spec is not None else []
        found = [p for root in roots for p in Path(root).rglob("libcudart.so*")]
        if not found:
            raise OSError("no CUDA runtime library (libcudart) found")
        runtime = ctypes.CDLL(str(found[0]))
    prefetch = getattr(runtime, "cudaMemPrefetchAsync_v2", None) or runtime.cudaMemPrefetchAsync
    prefetch.argtypes = [ctypes.c_void_p, ctypes.c_size_t, _MemLocation, ctypes.c_uint, ctypes.c_void_p]
    device = ctypes.c_int(0)
    runtime.cudaGetDevice(ctypes.byref(device))

    def run(caches: list[Any]) -> None:
        for cache in caches:
            for array in (cache.keys, cache.values):  # the whole buffers: `state` slices them
                host = np.asarray(memoryview(array))
                code = prefetch(host.ctypes.data, host.nbytes, _MemLocation(1, device.value), 0, None)
                if code != 0:
                    raise OSError(f"cudaMemPrefetchAsync returned {code}")
        if runtime.cudaDeviceSynchronize() != 0:
            raise OSError("cudaDeviceSynchronize failed")

    return run


def measure_mlx_lm_load(model: Any, path: Path, cache_module: Any) -> dict[str, float]:
    """mlx-lm's `load_prompt_cache` (hot), evaluated, plus the first decode step."""
    _warm_page_cache(path)
    started = time.perf_counter()
    caches = cache_module.load_prompt_cache(str(path))
    mx.eval([c.state for c in caches])
    load_s = time.perf_counter() - started
    first, normal = first_and_normal_steps(model, caches)
    del caches
    _free()
    return {"load_s": load_s, "ttft_s": load_s + first, "first_step_s": first, "normal_step_s": normal}


def split_point(tokens: int, prefill_s: float, restore_s: float) -> int:
    """The k where prefilling [0, k) and restoring [k, n) take as long, at the measured rates, in whole steps."""
    # Whole prefill chunks where the context allows, so the split's prefill runs shapes the warm-up compiled.
    unit = PREFILL_CHUNK_TOKENS if tokens >= 4 * PREFILL_CHUNK_TOKENS else STEP_ROWS
    k = round(tokens * restore_s / (prefill_s + restore_s) / unit) * unit
    return max(unit, min(tokens - unit, k))


class RowsWindow(io.RawIOBase):
    """Rows [k, n) of one `[..., n, D]` tensor of a `.kvc` file, seen as a `.npy` file by `mx.load`."""

    def __init__(self, fd: int, record: Any, first_row: int) -> None:
        from kvcellar.store.staged_load import npy_header

        *lead, rows, width = record.shape
        itemsize = record.length // int(np.prod(record.shape))
        self._fd = fd
        self._row_bytes = width * itemsize
        self._run_bytes = (rows - first_row) * self._row_bytes
        self._runs = [
            record.file_offset + (index * rows + first_row) * self._row_bytes for index in range(int(np.prod(lead)))
        ]
        super().__init__()
        self._header = npy_header(record.dtype, (*lead, rows - first_row, width))
        self._size = len(self._header) + self._run_bytes * len(self._runs)
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = 0) -> int:
        self._position = {0: 0, 1: self._position, 2: self._size}[whence] + offset
        return self._position

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        done = 0
        while done < len(target) and self._position < self._size:
            if self._position < len(self._header):
                part = self._header[self._position : self._position + len(target) - done]
                target[done : done + len(part)] = part
                got = len(part)
            else:
                data = self._position - len(self._header)
                run, within = divmod(data, self._run_bytes)
                length = min(self._run_bytes - within, len(target) - done)
                got = os.preadv(self._fd, [target[done : done + length]], self._runs[run] + within)
                if got <= 0:
                    raise OSError(f"short read at run {run}")
            done += got
            self._position += got
        return done


def _load_window(window: io.RawIOBase, stream: Any) -> mx.array:
    array = mx.load(cast(BinaryIO, window), format="npy", stream=stream)
    assert isinstance(array, mx.array)
    return array


def measure_split(model: Any, tokens: mx.array, path: Path, k: int, cache_module: Any) -> dict[str, float]:
    """Prefill [0, k) queued asynchronously while [k, n) loads on its own stream; joined; first step."""
    from kvcellar.store import kvfile

    header = kvfile.read_header(path)
    records = list(header.tensor_records())
    n = tokens.size
    capacity = -(-(n + 1) // STEP_ROWS) * STEP_ROWS
    _warm_page_cache(path)
    load_stream = mx.new_stream(mx.default_device())
    fd = os.open(path, os.O_RDONLY)
    try:
        started = time.perf_counter()
        caches = cache_module.make_prompt_cache(model)
        prefill(model, tokens[:k], caches, asynchronous=True)
        suffixes = [_load_window(RowsWindow(fd, record, k), load_stream) for record in records]
        mx.eval(suffixes)
        loaded_s = time.perf_counter() - started
        for index, cache in enumerate(caches):
            joined = []
            for prefix, suffix in ((cache.keys, suffixes[2 * index]), (cache.values, suffixes[2 * index + 1])):
                pad = mx.zeros((*suffix.shape[:-2], capacity - n, suffix.shape[-1]), dtype=suffix.dtype)
                joined.append(mx.concatenate([prefix[..., :k, :], suffix, pad], axis=-2))
            cache.keys, cache.values = joined
            cache.offset = n
        mx.eval([c.state for c in caches])
        first = step(model, caches)
        split_s = time.perf_counter() - started
        normal = statistics.median(step(model, caches) for _ in range(NORMAL_STEPS))
    finally:
        os.close(fd)
    del caches, suffixes
    _free()
    return {"k": k, "ttft_s": split_s, "both_loaded_s": loaded_s, "first_step_s": first, "normal_step_s": normal}


def _save_entries(
    cell: dict[str, Any], model: Any, tokens: mx.array, token_ids: list[int], workdir: Path, cache_module: Any
) -> bool:
    """Warm-up and timed prefill, then the `.kvc` and mlx-lm files of its cache; False when prefill failed."""
    from kvcellar.store import kvfile

    _attempt(cell, "prefill warm-up", lambda: prefill(model, tokens, cache_module.make_prompt_cache(model)))
    _free()
    caches = cache_module.make_prompt_cache(model)
    timed = _attempt(cell, "prefill", lambda: _timed(lambda: prefill(model, tokens, caches)))
    if timed is None:
        return False
    cell["prefill_s"] = timed[0]
    header = _attempt(cell, "save .kvc", lambda: kvfile.save(workdir / "entry.kvc", caches, token_ids))
    if header is None:
        return False
    cell["kv_bytes"] = header.file_bytes
    _attempt(cell, "save mlx-lm", lambda: cache_module.save_prompt_cache(str(workdir / "entry.safetensors"), caches))
    return True


def measure_cell(shape: str, n: int, model: Any, workdir: Path, cache_module: Any) -> dict[str, Any]:
    from kvcellar.store import kvfile

    cell: dict[str, Any] = {"shape": shape, "tokens": n}
    token_ids = np.random.default_rng(n).integers(0, SHAPES[shape]["vocab_size"], n).tolist()
    tokens = mx.array(token_ids)
    if not _save_entries(cell, model, tokens, token_ids, workdir, cache_module):
        return cell
    path = workdir / "entry.kvc"
    cell["raw_hot_s"] = _attempt(cell, "raw read hot", functools.partial(raw_read_hot_s, path))
    cell["raw_cold_s"] = _attempt(cell, "raw read cold", lambda: raw_read_s(path, cold=True))
    default_staged = kvfile.staged_load_wanted()
    cell["default_path"] = "staged" if default_staged else "direct"
    for prefix, staged in (("restore", default_staged), ("alt_restore", not default_staged)):
        for tier, cold in (("hot", False), ("cold", True)):
            name = f"{prefix}_{tier}"
            cell[name] = _attempt(cell, name, functools.partial(measure_restore, model, path, staged=staged, cold=cold))
    if mx.cuda.is_available():
        prefetcher = _attempt(cell, "find cudaMemPrefetchAsync", cuda_prefetcher)
        if prefetcher is not None:
            measure = functools.partial(measure_restore, model, path, staged=False, cold=False, prefetch=prefetcher)
            cell["direct_prefetch_hot"] = _attempt(cell, "direct_prefetch_hot", measure)
    st_path = workdir / "entry.safetensors"
    if st_path.exists():
        cell["mlx_lm_load"] = _attempt(cell, "mlx-lm load", lambda: measure_mlx_lm_load(model, st_path, cache_module))
        st_path.unlink()
    restore = cell.get("restore_hot")
    if restore is not None:
        k = split_point(n, cell["prefill_s"], restore["ttft_s"])
        _attempt(cell, "split warm-up", lambda: measure_split(model, tokens, path, k, cache_module))
        cell["split"] = _attempt(cell, f"split k={k}", lambda: measure_split(model, tokens, path, k, cache_module))
    path.unlink(missing_ok=True)
    _derive(cell)
    return cell


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _derive(cell: dict[str, Any]) -> None:
    """The cell's ratios, None where an input is missing."""
    restore = cell.get("restore_hot") or {}
    split = cell.get("split") or {}
    best_single = min(x for x in (cell.get("prefill_s"), restore.get("ttft_s")) if x is not None) if restore else None
    cell["restore_vs_prefill"] = _ratio(restore.get("ttft_s"), cell.get("prefill_s"))
    cell["restore_cold_vs_prefill"] = _ratio((cell.get("restore_cold") or {}).get("ttft_s"), cell.get("prefill_s"))
    cell["split_vs_best_single"] = _ratio(split.get("ttft_s"), best_single)
    cell["first_step_ratio"] = _ratio(restore.get("first_step_s"), restore.get("normal_step_s"))
    cell["alt_first_step_ratio"] = _ratio(
        (cell.get("alt_restore_hot") or {}).get("first_step_s"),
        (cell.get("alt_restore_hot") or {}).get("normal_step_s"),
    )
    cell["hot_load_vs_raw"] = _ratio(cell.get("raw_hot_s"), restore.get("load_s"))
    cell["mlx_lm_vs_restore"] = _ratio((cell.get("mlx_lm_load") or {}).get("ttft_s"), restore.get("ttft_s"))


def _fits(shape: str, n: int, done: list[dict[str, Any]], elapsed_s: float, budget_s: float, workdir: Path) -> str:
    """Why a cell is skipped ("" when it runs): too little time left at the rate of the cells done, or disk."""
    per_token = SHAPES[shape]
    kv_bytes = 2 * per_token["num_hidden_layers"] * per_token["num_key_value_heads"] * per_token["head_dim"] * 2 * n
    free_bytes = shutil.disk_usage(workdir).free
    if free_bytes < 2.2 * kv_bytes + GIB_BYTES:
        return f"needs {2.2 * kv_bytes / GIB_BYTES:.1f} GiB of disk, {free_bytes / GIB_BYTES:.1f} free"
    measured = [c for c in done if c.get("seconds") and c.get("kv_bytes")]
    if measured:
        seconds_per_byte = max(c["seconds"] / c["kv_bytes"] for c in measured)
        estimate_s = 1.3 * seconds_per_byte * kv_bytes * max(1.0, n / max(c["tokens"] for c in measured)) ** 0.5
        if elapsed_s + estimate_s > budget_s:
            return f"estimated {estimate_s:.0f} s, {budget_s - elapsed_s:.0f} s of budget left"
    return ""


def describe_machine() -> dict[str, Any]:
    device = mx.default_device()
    info: dict[str, Any] = {"device": str(device), "mlx": importlib.metadata.version("mlx")}
    info["python"] = platform.python_version()
    try:
        info["device_info"] = {k: v for k, v in mx.device_info(device).items() if isinstance(v, str | int)}
    except Exception as e:  # a backend without device_info still benchmarks
        info["device_info"] = f"unavailable: {e}"
    info["cuda"] = bool(mx.cuda.is_available())
    return info


def run(
    plan_name: str, budget_s: float, workdir: Path, after_cell: Callable[[dict[str, Any]], None] = lambda _: None
) -> dict[str, Any]:
    """Every cell of the plan that fits; `after_cell(report so far)` runs after each one, so a process
    that dies in a later cell (a CUDA abort is not an exception) still leaves the earlier figures."""
    llama, cache_module = _import_mlx_lm()
    machine = describe_machine()
    _say(f"machine: {machine}")
    report: dict[str, Any] = {"machine": machine, "plan": plan_name, "cells": []}
    cells: list[dict[str, Any]] = report["cells"]
    model_shape, model = None, None
    build_s: dict[str, float] = {}
    for shape, n in PLANS[plan_name]:
        rebuild_s = build_s.get(shape, 0.0) if model_shape != shape else 0.0
        elapsed = time.perf_counter() - _START + rebuild_s
        reason = _fits(shape, n, cells, elapsed, budget_s, workdir)
        if reason:
            _say(f"{shape} {n}: skipped ({reason})")
            cells.append({"shape": shape, "tokens": n, "skipped": reason})
            continue
        if model_shape != shape:
            model = None
            _free()
            built = _attempt({}, f"build {shape} model", functools.partial(_timed_build, shape, llama))
            if built is None:
                cells.append({"shape": shape, "tokens": n, "skipped": "model build failed"})
                continue
            build_s[shape], model = built
            model_shape = shape
        _say(f"{shape} {n}: start")
        started = time.perf_counter()
        try:
            cell = measure_cell(shape, n, model, workdir, cache_module)
        except Exception as e:  # a failure outside the wrapped measurements: keep the other cells
            cell = {"shape": shape, "tokens": n, "errors": {"cell": f"{type(e).__name__}: {e}"}}
            traceback.print_exc(limit=6, file=sys.stdout)
        cell["seconds"] = time.perf_counter() - started
        _say(f"{shape} {n}: finished in {cell['seconds']:.1f} s")
        cells.append(cell)
        for leftover in workdir.iterdir():
            leftover.unlink()
        after_cell(report)
    return report


def key_figures(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's keys from the key cell, or from the largest measured cell when it is missing."""
    measured = [c for c in report["cells"] if c.get("restore_vs_prefill") is not None]
    wanted = KEY_CELLS[report["plan"]]
    chosen = next((c for c in measured if (c["shape"], c["tokens"]) == wanted), None)
    if chosen is None and measured:
        chosen = max(measured, key=lambda c: c.get("kv_bytes", 0))
    keys = ("restore_vs_prefill", "split_vs_best_single", "first_step_ratio", "hot_load_vs_raw")
    figures: dict[str, Any] = {key: (chosen or {}).get(key) for key in keys}
    figures["key_cell"] = f"{chosen['shape']}@{chosen['tokens']}" if chosen else None
    figures["restore_cold_vs_prefill"] = (chosen or {}).get("restore_cold_vs_prefill")
    figures["alt_first_step_ratio"] = (chosen or {}).get("alt_first_step_ratio")
    figures["device"] = report["machine"]["device"]
    figures["errors"] = sum(len(c.get("errors", {})) for c in report["cells"])
    return figures


def _fmt(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(report: dict[str, Any]) -> str:
    head = (
        "| shape, tokens | KV MiB | prefill s | restore hot s | restore cold s | other path hot s | mlx-lm hot s "
        "| split s (k) | raw hot GB/s | raw cold GB/s | hot load/raw | first step ratio (other path) "
        "| direct+prefetch hot s (first step ratio) |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for cell in report["cells"]:
        label = f"{cell['shape']}, {cell['tokens']}"
        if "skipped" in cell:
            lines.append(f"| {label} | skipped: {cell['skipped']} |")
            continue
        kv = cell.get("kv_bytes")

        def ttft(name: str, c: dict[str, Any] = cell) -> str:
            return _fmt((c.get(name) or {}).get("ttft_s"))

        def rate(seconds: float | None, kv_bytes: int | None = kv) -> str:
            return "-" if not seconds or not kv_bytes else f"{kv_bytes / seconds / 1e9:.2f}"

        split = cell.get("split") or {}
        prefetched = cell.get("direct_prefetch_hot") or {}
        prefetch_ratio = _ratio(prefetched.get("first_step_s"), prefetched.get("normal_step_s"))
        lines.append(
            f"| {label} | {_fmt(kv and kv / (1 << 20), 0)} | {_fmt(cell.get('prefill_s'))} | {ttft('restore_hot')} "
            f"| {ttft('restore_cold')} | {ttft('alt_restore_hot')} | {ttft('mlx_lm_load')} "
            f"| {_fmt(split.get('ttft_s'))} ({split.get('k', '-')}) | {rate(cell.get('raw_hot_s'))} "
            f"| {rate(cell.get('raw_cold_s'))} | {_fmt(cell.get('hot_load_vs_raw'), 2)} "
            f"| {_fmt(cell.get('first_step_ratio'), 2)} ({_fmt(cell.get('alt_first_step_ratio'), 2)}) "
            f"| {ttft('direct_prefetch_hot')} ({_fmt(prefetch_ratio, 2)}) |"
        )
    return "\n".join(lines)


def _write_outputs(report: dict[str, Any], text: str, out_dirs: list[str]) -> None:
    for directory in out_dirs:
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            (Path(directory) / "accelerator.json").write_text(json.dumps(report, indent=2, default=str))
            (Path(directory) / "accelerator.md").write_text(text + "\n")
        except OSError as e:
            _say(f"could not write figures to {directory}: {e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcellar.bench.accelerator", description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", choices=sorted(PLANS), default="gpu", help="cell plan (tiny: seconds on a CPU)")
    parser.add_argument("--smoke", action="store_true", help="the same as --shapes tiny")
    parser.add_argument("--json", action="store_true", help="print the key figures as JSON on the last line")
    parser.add_argument("--budget-s", type=float, default=330.0, help="skip cells that would end past this")
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--out", default=None, help="also write full figures here (besides $OUT)")
    args = parser.parse_args(argv)
    plan = "tiny" if args.smoke else args.shapes
    base = args.dir if args.dir is not None else Path(tempfile.gettempdir())
    out_dirs = [d for d in (os.environ.get("OUT"), args.out) if d]

    def save_so_far(report: dict[str, Any]) -> None:
        report["figures"] = key_figures(report)
        _write_outputs(report, table(report), out_dirs)
        _say(f"figures so far: {json.dumps(report['figures'])}")

    with tempfile.TemporaryDirectory(prefix="kvc-accel-", dir=base) as scratch:
        report = run(plan, args.budget_s, Path(scratch), save_so_far)
    figures = key_figures(report)
    report["figures"] = figures
    text = table(report)
    print(text, flush=True)
    _write_outputs(report, text, out_dirs)
    if args.json:
        print(json.dumps(figures), flush=True)
    else:
        print(json.dumps(figures, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
