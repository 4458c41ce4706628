"""The split restore on the engine thread: prefill the front of a cached prefix while a loader reads its back.

`run_split(model, prefix_tokens, load_suffix)` starts `load_suffix` (a
blocking callable returning host rows, `store.suffix_rows.SuffixRows`) on a
worker thread, prefills `prefix_tokens` (positions `[0, k)`) into fresh
caches here, waits for the loader, and joins each layer's recomputed rows
`[0, k)` with the loaded rows `[k, n)` into one `KVCache` per layer holding
`n` tokens, with a step of slack like a restore's (store/codecs.py). The
loader touches no MLX (it fills numpy buffers it owns); every MLX call,
allocation included, stays on this thread, which made the model.

Valid only for models whose every cache is a plain `KVCache` (full causal
attention: the rows at `[k, n)` depend on the tokens before them alone, so a
stored entry's rows are what a prefill of the same tokens writes, up to the
kernels' rounding). `split_refusal(caches)` names why anything else is
refused: a rotating window (its ring drops rows and holds no absolute row
order), a chunked cache (a moving front), recurrent state (`ArraysCache`:
one state for the whole prefix, no rows to split), quantized KV (the stored
rows are quantized, a prefill's are not until the scheme converts them), a
`CacheList`, or anything else.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from kvcellar.engine.engine import PREFILL_STEP_TOKENS
from kvcellar.errors import RefusedCacheKind, UsageError
from kvcellar.store import codecs
from kvcellar.store.suffix_rows import HostRows, SuffixRows

SuffixLoader = Callable[[], SuffixRows | None]


def split_refusal(caches: Sequence[Any]) -> str:
    """Why a split cannot build these caches ("" when it can): every one must be exactly a `KVCache`."""
    for cache in caches:
        if type(cache) is not KVCache:
            return f"{type(cache).__name__} is not plain full attention"
    return ""


def prefill_rows(model: Any, tokens: Sequence[int], cache: list[Any], step_tokens: int) -> None:
    """Run every one of `tokens` through the model into `cache` (no logits kept), evaluating each chunk."""
    for start in range(0, len(tokens), step_tokens):
        model(mx.array([list(tokens[start : start + step_tokens])]), cache=cache)
        mx.eval([c.state for c in cache])


def _to_mlx(rows: HostRows) -> mx.array:
    typed = rows.data.view(codecs.host_dtype(rows.dtype)).reshape(rows.shape)
    return codecs.host_to_mlx(typed, rows.dtype)


def _joined(front: mx.array | None, back: HostRows, total_rows: int) -> mx.array:
    """`front` (rows `[0, k)`, possibly with slack) and `back` (rows `[k, n)`)
    in one buffer of `codecs._step_capacity(n)` rows, zero beyond `n`."""
    back_array = _to_mlx(back)
    if front is not None and front.dtype != back_array.dtype:
        back_array = back_array.astype(front.dtype)
    batch, heads, _, dim = back_array.shape
    capacity = codecs._step_capacity(total_rows)
    parts = [] if front is None else [front]
    parts.append(back_array)
    parts.append(mx.zeros((batch, heads, capacity - total_rows, dim), dtype=back_array.dtype))
    joined = mx.concatenate(parts, axis=2)
    mx.eval(joined)
    return joined


def _load_in_thread(load_suffix: SuffixLoader) -> tuple[threading.Thread, list[Any]]:
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(load_suffix())
        except BaseException as e:  # re-raised on the engine thread after the join
            outcome.append(e)

    thread = threading.Thread(target=run, name="kvc-split-loader", daemon=True)
    thread.start()
    return thread, outcome


def run_split(
    model: Any,
    prefix_tokens: Sequence[int],
    load_suffix: SuffixLoader,
    *,
    step_tokens: int = PREFILL_STEP_TOKENS,
    on_prefilled: Callable[[float], None] | None = None,
) -> list[Any] | None:
    """Caches holding the first `n` tokens of a prompt, `n` being the
    loader's `end_tokens`: `prefix_tokens` (the first `k`) prefilled here
    while `load_suffix` reads rows `[k, n)` on a worker thread. Returns None
    when the loader returns None (the entry went away: the caller recomputes);
    re-raises what the loader raised; `RefusedCacheKind` for a model
    `split_refusal` refuses. `on_prefilled(seconds)` hears how long
    the front's prefill took (the cost model's online refresh)."""
    cache = make_prompt_cache(model)
    refusal = split_refusal(cache)
    if refusal:
        raise RefusedCacheKind(f"split restore refused: {refusal}")
    thread, outcome = _load_in_thread(load_suffix)
    started = time.perf_counter()
    try:
        prefill_rows(model, prefix_tokens, cache, step_tokens)
        prefill_s = time.perf_counter() - started  # the front alone, before waiting on the loader
    finally:
        thread.join()
    if on_prefilled is not None and prefix_tokens:
        on_prefilled(prefill_s)
    loaded = outcome[0]
    if isinstance(loaded, BaseException):
        raise loaded
    if loaded is None:
        return None
    if loaded.start_tokens != len(prefix_tokens) or len(loaded.layers) != len(cache):
        raise UsageError("the loaded suffix does not continue the prefilled prefix")
    joined = []
    for layer, (keys, values) in zip(cache, loaded.layers, strict=True):
        k = len(prefix_tokens)
        fresh = KVCache()
        front_keys = layer.keys[..., :k, :] if k else None
        front_values = layer.values[..., :k, :] if k else None
        fresh.keys = _joined(front_keys, keys, loaded.end_tokens)
        fresh.values = _joined(front_values, values, loaded.end_tokens)
        fresh.offset = loaded.end_tokens
        joined.append(fresh)
    return joined
