"""Quantized KV in batch rows (spec §2.3): a batched affine-quantized cache
and the batch lane's conversion points, so `--kv-quant 4|8|config` batches.

`BatchQuantizedKVCache` is to mlx-lm's `QuantizedKVCache` what `BatchKVCache`
is to `KVCache`: rows left-padded to a common length, per-row `offset` and
`left_padding`, and the operations the batch lane needs (`merge`, `extend`,
`filter`, `extract`, `prepare`/`finalize`, `make_mask`, `trim`). Its `bits`
attribute routes attention to mlx-lm's quantized SDPA
(`models/base.py: scaled_dot_product_attention`), exactly as for one row.

The invariant that makes this byte-safe: `mx.quantize` groups run along the
last axis (head_dim) only, so every token row's packed words, scales and
biases depend on that row's values alone. Slicing, padding, rolling and
concatenating the three arrays on the token axis (axis -2) therefore moves
whole quantized rows and never re-quantizes or splits a group, and
`quantize(x)[..., a:b, :] == quantize(x[..., a:b, :])` bit for bit. A row
extracted from a batch is byte-identical to the same row quantized alone.

Where a row converts (`QuantizedRows`) mirrors the serial lane
(engine/generation.py), so a row's tokens and log-probabilities are the
serial lane's:

- a cold row prefills its whole prompt unquantized, the last token included
  (mlx-lm runs it in the new generation batch's first step, on the prompt
  batch's `BatchKVCache`), and converts when it joins the running batch
  (`extend`) or, joining an empty one, right after that step;
- a row the tiers lent quantized caches prefills its remainder quantized
  (its lent `QuantizedKVCache` layers are wrapped as one-row batches);
- a row with a stable boundary converts when its first segment ends, before
  the boundary snapshot is extracted, and prefills the rest quantized.

Those three differ in how the prompt is prefilled, so they cannot share one
prompt batch: under a quantized scheme the batch lane prefills one row at a
time (`PREFILL_ROWS`) and batches the decode. A prefill of one row also has
no padding at all, so its arithmetic is the serial lane's. The decode's left
padding is masked to the dtype's minimum before a precise softmax, whose
exponent is then exactly 0, so padded keys add exact zeros; that the sums
also round alike whatever the padded length is a property of the backend's
kernels, which tests/test_quant_batch.py checks at tolerance 0 (MLX 0.32.4,
CPU: a padded row's quantized attention is bit-identical to the row alone).

All of this runs on the engine thread (docs/mlx-notes.md, "Threads").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.base import create_causal_mask

from kvcellar.engine.scalars import item_int
from kvcellar.errors import KvCellarError
from kvcellar.store.scheme import KvScheme, warm_up_prototype_caches

# Rows a quantized batch prefills together (see the module docstring).
PREFILL_ROWS = 1

QuantizedArrays = tuple[mx.array, mx.array, mx.array]


def _each(function: Callable[[mx.array], mx.array], arrays: QuantizedArrays) -> QuantizedArrays:
    """`function` of the packed words, the scales and the biases alike."""
    words, scales, biases = arrays
    return function(words), function(scales), function(biases)


def _joined(first: QuantizedArrays, second: QuantizedArrays) -> QuantizedArrays:
    """The rows (batch axis) of `first`, then those of `second`."""
    words, scales, biases = (mx.concatenate([a, b]) for a, b in zip(first, second, strict=True))
    return words, scales, biases


def _rows(arrays: QuantizedArrays, start: int | None, stop: int | None) -> QuantizedArrays:
    """Token rows `[start, stop)` of packed words, scales and biases (axis -2)."""
    return _each(lambda array: array[..., start:stop, :], arrays)


def _quantize(array: mx.array, group_size: int, bits: int) -> QuantizedArrays:
    words, scales, biases = mx.quantize(array, group_size=group_size, bits=bits)
    return words, scales, biases


def _pad_rows(arrays: QuantizedArrays, left: int, right: int) -> QuantizedArrays:
    if not left and not right:
        return arrays
    widths = [(0, 0)] * (arrays[0].ndim - 2) + [(left, right), (0, 0)]
    return _each(lambda array: mx.pad(array, widths), arrays)


class BatchQuantizedKVCache(mlx_cache._BaseCache):
    """Affine-quantized KV for several left-padded rows (module docstring)."""

    step = 256

    def __init__(self, left_padding: Sequence[int], *, group_size: int, bits: int) -> None:
        self.keys: QuantizedArrays | None = None
        self.values: QuantizedArrays | None = None
        self.left_padding = mx.array(list(left_padding), dtype=mx.int32)
        self.offset = mx.array([-pad for pad in left_padding], dtype=mx.int32)
        self.group_size = group_size
        self.bits = bits
        self._idx = 0
        self._right_padding: mx.array | None = None

    # -- construction --------------------------------------------------------

    @classmethod
    def from_plain_batch(cls, cache: mlx_cache.BatchKVCache, *, group_size: int, bits: int) -> BatchQuantizedKVCache:
        """The conversion of an unquantized batch: each token row quantized
        alone, as `KVCache.to_quantized` quantizes a serial row."""
        if cache._right_padding is not None:
            raise KvCellarError("a batch converts only after its prefill is finalized")
        converted = cls([], group_size=group_size, bits=bits)
        converted.left_padding, converted.offset, converted._idx = cache.left_padding, cache.offset, cache._idx
        if cache.keys is not None:
            converted.keys = _quantize(cache.keys[..., : cache._idx, :], group_size, bits)
            converted.values = _quantize(cache.values[..., : cache._idx, :], group_size, bits)
        return converted

    @classmethod
    def from_row(cls, cache: mlx_cache.QuantizedKVCache) -> BatchQuantizedKVCache:
        """One row over views of a per-request cache's live rows (new array
        objects, so writes never reach the lender: store/lending.py)."""
        row = cls([0], group_size=cache.group_size, bits=cache.bits)
        if cache.keys is not None:
            row.keys, row.values = _rows(cache.keys, None, cache.offset), _rows(cache.values, None, cache.offset)
            row.offset = mx.array([cache.offset], dtype=mx.int32)
            row._idx = cache.offset
        return row

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> BatchQuantizedKVCache:
        """One batch of `caches` (one-row batches or per-request caches), in order."""
        rows = [cache if type(cache) is cls else cls.from_row(cache) for cache in caches]
        merged = cls([], group_size=rows[0].group_size, bits=rows[0].bits)
        for row in rows:
            merged.extend(row)
        return merged

    # -- what attention calls --------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[QuantizedArrays, QuantizedArrays]:
        rows, steps = keys.shape[0], keys.shape[2]
        previous = self._idx
        if self.keys is None or self.values is None or previous + steps > self.keys[0].shape[-2]:
            self._grow(rows, keys.shape[1], keys.shape[-1], values.shape[-1], steps, keys.dtype)
        assert self.keys is not None and self.values is not None
        self.offset = self.offset + steps
        self._idx += steps
        for stored, new in (
            (self.keys, _quantize(keys, self.group_size, self.bits)),
            (self.values, _quantize(values, self.group_size, self.bits)),
        ):
            for array, part in zip(stored, new, strict=True):
                array[..., previous : self._idx, :] = part
        return self.keys_and_values()

    def _grow(self, rows: int, heads: int, key_dim: int, value_dim: int, steps: int, dtype: mx.Dtype) -> None:
        """Room for `steps` more rows, in whole `step`s, like `QuantizedKVCache`."""
        shape = (rows, heads, (self.step + steps - 1) // self.step * self.step)
        values_per_word = 32 // self.bits

        def zeros(dim: int) -> QuantizedArrays:
            groups = dim // self.group_size
            return (
                mx.zeros((*shape, dim // values_per_word), dtype=mx.uint32),
                mx.zeros((*shape, groups), dtype=dtype),
                mx.zeros((*shape, groups), dtype=dtype),
            )

        if self.keys is None or self.values is None:
            self.keys, self.values = zeros(key_dim), zeros(value_dim)
            return
        grown = []
        for stored, dim in ((self.keys, key_dim), (self.values, value_dim)):
            live = _rows(stored, None, self._idx)
            words, scales, biases = (mx.concatenate([a, b], axis=-2) for a, b in zip(live, zeros(dim), strict=True))
            grown.append((words, scales, biases))
        self.keys, self.values = grown

    def keys_and_values(self) -> tuple[QuantizedArrays, QuantizedArrays]:
        assert self.keys is not None and self.values is not None
        return _rows(self.keys, None, self._idx), _rows(self.values, None, self._idx)

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    # -- what the batch generator calls ------------------------------------------

    def prepare(self, *, left_padding: Any = None, lengths: Any = None, right_padding: Any = None) -> None:
        if left_padding is not None:
            if self.keys is not None:
                raise KvCellarError("left padding can only be added to an empty batch")
            padding = mx.array(left_padding)
            self.left_padding = self.left_padding + padding
            self.offset = self.offset - padding
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        """After a right-padded prefill: roll each row's padding to its left."""
        if self._right_padding is None:
            return
        padding, self._right_padding = self._right_padding, None
        if self.keys is not None and self.values is not None:

            def roll(array: mx.array) -> mx.array:
                return mlx_cache.dynamic_roll(array, padding[:, None], axis=2)

            self.keys, self.values = _each(roll, self.keys), _each(roll, self.values)
        self.offset = self.offset - padding
        self.left_padding = self.left_padding + padding

    def filter(self, batch_indices: Sequence[int]) -> None:
        """Keep the rows `batch_indices`, then drop the padding every row has."""
        indices = mx.array(list(batch_indices))
        if self.keys is not None and self.values is not None:
            self.keys = _each(lambda array: array[indices], self.keys)
            self.values = _each(lambda array: array[indices], self.values)
        self.offset = self.offset[indices]
        self.left_padding = self.left_padding[indices]
        shared_padding = item_int(mx.min(self.left_padding))
        if shared_padding > 0:
            if self.keys is not None and self.values is not None:
                self.keys = _rows(self.keys, shared_padding, None)
                self.values = _rows(self.values, shared_padding, None)
            self._idx -= shared_padding
            self.left_padding = self.left_padding - shared_padding

    def extend(self, other: Any) -> None:
        """Append `other`'s rows; an unquantized batch (a cold row's prefill)
        converts first. Both sides are right-justified at the longer `_idx`."""
        if type(other) is mlx_cache.BatchKVCache:
            other = BatchQuantizedKVCache.from_plain_batch(other, group_size=self.group_size, bits=self.bits)
        if (other.bits, other.group_size) != (self.bits, self.group_size):
            raise KvCellarError(
                f"cannot batch {other.bits}-bit/{other.group_size} KV with {self.bits}-bit/{self.group_size} KV"
            )
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        template = self if self.keys is not None else other
        longest_idx = max(self._idx, other._idx)
        size = max(part.keys[0].shape[-2] for part in (self, other) if part.keys is not None)
        parts = [self._justified(part, template, longest_idx, size) for part in (self, other)]
        self.keys, self.values = _joined(parts[0][0], parts[1][0]), _joined(parts[0][1], parts[1][1])
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate([parts[0][2], parts[1][2]])
        self._idx = longest_idx

    @staticmethod
    def _justified(
        part: BatchQuantizedKVCache, template: BatchQuantizedKVCache, longest_idx: int, size: int
    ) -> tuple[QuantizedArrays, QuantizedArrays, mx.array]:
        """`part`'s arrays padded to `size` rows with `_idx` at `longest_idx`."""
        keys, values = part.keys, part.values
        if keys is None or values is None:
            assert template.keys is not None and template.values is not None
            rows = part.offset.shape[0]

            def empty(array: mx.array) -> mx.array:
                return mx.zeros((rows, *array.shape[1:-2], 0, array.shape[-1]), dtype=array.dtype)

            keys, values = _each(empty, template.keys), _each(empty, template.values)
        left = longest_idx - part._idx
        right = size - keys[0].shape[-2] - left
        if right < 0:
            keys, values, right = _rows(keys, None, right), _rows(values, None, right), 0
        return _pad_rows(keys, left, right), _pad_rows(values, left, right), part.left_padding + left

    def extract(self, idx: int) -> Any:
        """Row `idx` as the plain per-request cache the tiers persist."""
        assert self.keys is not None and self.values is not None
        padding = item_int(self.left_padding[idx])
        # Any: mlx-lm leaves its cache attributes unannotated (mypy types `keys` as None).
        row: Any = mlx_cache.QuantizedKVCache(group_size=self.group_size, bits=self.bits)

        def own_row(array: mx.array) -> mx.array:
            return mx.contiguous(array[idx : idx + 1, :, padding : self._idx])

        row.keys, row.values = _each(own_row, self.keys), _each(own_row, self.values)
        row.offset = self._idx - padding
        return row

    # -- the rest of the cache protocol ---------------------------------------------

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, value: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = value

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return sum(array.nbytes for array in (*self.keys, *self.values))


class QuantizedRows:
    """The batch lane's conversion points for a quantized scheme (module docstring)."""

    def __init__(self, scheme: KvScheme) -> None:
        self.scheme = scheme

    def row_caches(self, caches: list | None) -> list | None:
        """A row's caches as the batch generator merges them: quantized
        layers become one-row batches (mlx-lm's `QuantizedKVCache` cannot
        merge); the rest are left as they are. None (a cold row) stays None."""
        if caches is None:
            return None
        return [_mergeable(cache) for cache in caches]

    def convert(self, caches: list) -> None:
        """Quantize, in place, every populated unquantized batch of a layer the scheme quantizes."""
        for index, cache in enumerate(caches):
            bits = self.scheme.bits_for_layer(index)
            if bits is not None:
                caches[index] = self._convert_layer(cache, bits)

    def _convert_layer(self, cache: Any, bits: int) -> Any:
        if type(cache) is mlx_cache.BatchKVCache and cache.keys is not None:
            converted = BatchQuantizedKVCache.from_plain_batch(cache, group_size=self.scheme.group_size, bits=bits)
            mx.eval(converted.keys, converted.values)
            return converted
        if type(cache) is mlx_cache.CacheList:
            cache.caches = tuple(self._convert_layer(member, bits) for member in cache.caches)
        # Sliding rings stay unquantized, as on the serial lane (store/scheme.py).
        return cache

    def convert_decoding(self, generator: Any) -> None:
        """After a generator step: rows that joined the decode convert."""
        self.convert(generator._generation_batch.prompt_cache)

    def convert_prefilling(self, generator: Any) -> None:
        """At a row's stable boundary: the rest of its prompt prefills quantized."""
        self.convert(generator._prompt_batch.prompt_cache)


def _mergeable(cache: Any) -> Any:
    if type(cache) is mlx_cache.QuantizedKVCache:
        return BatchQuantizedKVCache.from_row(cache)
    if type(cache) is mlx_cache.CacheList:
        return mlx_cache.CacheList(*(_mergeable(member) for member in cache.caches))
    return cache


def quantized_batch_refusal(model: Any, scheme: KvScheme) -> str | None:
    """Why a quantized scheme cannot batch on `model`, or None: a per-layer
    config or group size that does not fit its caches fails every request
    on the serial lane with the scheme's error, so the batch lane stays off."""
    if not scheme.quantized:
        return None
    try:
        scheme.convert(warm_up_prototype_caches(model))
    except KvCellarError as e:
        return f"KV scheme {scheme.cache_key} cannot convert this model's caches ({e})"
    return None
