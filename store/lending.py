"""Lending caches without aliasing (mlx-notes, "Aliasing").

Two caches holding the same MLX array *objects* write into each other,
because cache updates are slice assignments on those objects. A slice
(`keys[..., :n, :]`) is a new array object over the same buffer: a write to
either side replaces only that side's object and copies the shared buffer
(MLX never donates a buffer something else still references). So a borrower
gets fresh cache objects holding views of exactly the rows it reuses: zero
copies up front; its first decode step grows the view into a fresh buffer
(copying only those rows), and the donor stays byte-identical however the
borrower decodes.

A snapshot is the same views, evaluated, and safe to hand to another thread
while the engine keeps decoding (mlx-notes, "Threads").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from kvcellar.errors import UsageError
from kvcellar.store.companion import CompanionState
from kvcellar.store.signature import (
    cache_signature,
    declared_minimum_reusable_offset,
    minimum_reusable_offset,
    refuse_paged,
)


def _rows_view(array: mx.array | None, rows: int) -> mx.array | None:
    """A new array object over the first `rows` rows (axis -2). Lending only
    the rows in use keeps the borrower's first write from copying the donor's
    slack: it grows from exactly what it needs."""
    if array is None:
        return None
    return array[..., :rows, :]


def _lend_attention(cache: Any, drop_tokens: int) -> Any:
    kind = type(cache)
    offset = cache.offset - drop_tokens
    # Any: mlx-lm leaves its cache attributes unannotated, so mypy types
    # QuantizedKVCache.keys as None, and one variable holds every kind here.
    lent: Any
    if kind is mlx_cache.QuantizedKVCache:
        lent = mlx_cache.QuantizedKVCache(group_size=cache.group_size, bits=cache.bits)
        if cache.keys is not None:
            lent.keys = tuple(_rows_view(a, offset) for a in cache.keys)
            lent.values = tuple(_rows_view(a, offset) for a in cache.values)
    elif kind is mlx_cache.RotatingKVCache:
        lent = mlx_cache.RotatingKVCache(max_size=cache.max_size, keep=cache.keep)
        # A wrapped ring is lent whole (never trimmed); before the wrap its rows are in time order.
        rows = cache.keys.shape[-2] if cache.keys is not None and cache.offset >= cache.max_size else offset
        lent.keys, lent.values = _rows_view(cache.keys, rows), _rows_view(cache.values, rows)
        lent._idx = cache._idx - drop_tokens
    elif kind is mlx_cache.ChunkedKVCache:
        lent = mlx_cache.ChunkedKVCache(cache.chunk_size)
        lent.start_position = cache.start_position
        rows = offset - cache.start_position
        lent.keys, lent.values = _rows_view(cache.keys, rows), _rows_view(cache.values, rows)
    else:
        lent = mlx_cache.KVCache()
        lent.keys, lent.values = _rows_view(cache.keys, offset), _rows_view(cache.values, offset)
    lent.offset = offset
    return lent


def _keep_declared_bound(cache: Any, lent: Any) -> Any:
    """Carry a declared minimum reusable offset over to the borrower: the
    transition that raised it happened to the rows the borrower now holds."""
    declared = declared_minimum_reusable_offset(cache)
    if declared is not None:
        lent.minimum_reusable_offset = declared
    return lent


def _refuse_trim_below_bound(cache: Any, signature: str, drop_tokens: int) -> None:
    if not drop_tokens:
        return
    if not cache.is_trimmable():
        raise UsageError(f"{signature} cache cannot drop {drop_tokens} tokens")
    bound = minimum_reusable_offset(cache, cache.offset)
    if cache.offset - drop_tokens < bound:
        raise UsageError(
            f"{signature} cache cannot drop {drop_tokens} of {cache.offset} tokens: "
            f"it serves no prefix shorter than {bound}"
        )


def lend_cache(cache: Any, drop_tokens: int = 0) -> Any:
    """A new cache object over views of `cache`'s arrays, its last
    `drop_tokens` tokens trimmed, keeping any declared minimum reusable
    offset. Raises `UsageError` when asked to trim a cache that cannot be
    trimmed, or below its minimum reusable offset (the caller's bug: the
    usable-prefix rule never asks for it)."""
    signature = cache_signature(cache)
    refuse_paged(signature, "lend")
    if type(cache) is mlx_cache.CacheList:
        return mlx_cache.CacheList(*(lend_cache(child, drop_tokens) for child in cache.caches))
    if type(cache) is CompanionState:
        return CompanionState(*(lend_cache(child, drop_tokens) for child in cache.caches), drafter=cache.drafter)
    if type(cache) is mlx_cache.ArraysCache:
        if drop_tokens:
            raise UsageError("recurrent state cannot be trimmed")
        lent = mlx_cache.ArraysCache(len(cache.cache))
        # Recurrent layers replace their slots instead of writing into them, so
        # sharing the slot arrays in a new list cannot alias.
        lent.cache = list(cache.cache)
        return _keep_declared_bound(cache, lent)
    _refuse_trim_below_bound(cache, signature, drop_tokens)
    return _keep_declared_bound(cache, _lend_attention(cache, drop_tokens))


def lend_caches(caches: Sequence[Any], drop_tokens: int = 0) -> list[Any]:
    """`lend_cache` for every layer of an entry."""
    return [lend_cache(cache, drop_tokens) for cache in caches]


def cache_arrays(caches: Sequence[Any]) -> list[mx.array]:
    """Every array an entry's caches hold (for evaluation or freeing)."""
    arrays: list[mx.array] = []
    for cache in caches:
        if type(cache) in (mlx_cache.CacheList, CompanionState):
            arrays.extend(cache_arrays(cache.caches))
        elif type(cache) is mlx_cache.ArraysCache:
            # list[Any]: mlx-lm's unannotated `[None] * size` types the slots as None.
            slots: list[Any] = cache.cache
            arrays.extend(a for a in slots if a is not None)
        elif getattr(cache, "keys", None) is not None:
            for part in (cache.keys, cache.values):
                arrays.extend(part if isinstance(part, tuple) else (part,))
    return arrays


def snapshot_caches(caches: Sequence[Any]) -> list[Any]:
    """Evaluated views of an entry: safe to read on another thread while the
    engine decodes, and independent of whatever happens to the donor."""
    lent = lend_caches(caches)
    mx.eval(cache_arrays(lent))
    return lent
