"""Per-signature codecs of the `.kvc` format: which tensors and scalars of a
cache are persisted, and how a cache is rebuilt from them.

Every codec persists only rows up to `offset` (never slack), except a wrapped
rotating ring, which is persisted raw with its ring index because reordering
it into time order is not bit-exact. Rebuilt plain, quantized and chunked KV
land in a capacity of at least one 256-row step past `offset`, rounded to a
step, so the first decode steps after a restore update in place instead of
concatenating.
Each record carries its cache's minimum reusable offset; a rebuilt cache that
cannot derive that bound from its own state declares it again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache

from kvcellar.errors import CorruptEntry, RefusedCacheKind, UsageError
from kvcellar.store import signature as sig
from kvcellar.store.companion import CompanionState
from kvcellar.store.records import CacheRecord, TensorRecord

STEP_ROWS = 256

Producer = Callable[[], mx.array]

_DTYPE_NAMES: dict[Any, str] = {
    mx.float32: "float32",
    mx.float16: "float16",
    mx.bfloat16: "bfloat16",
    mx.uint32: "uint32",
    mx.int32: "int32",
    mx.uint16: "uint16",
    mx.int16: "int16",
    mx.uint8: "uint8",
    mx.int8: "int8",
    mx.int64: "int64",
    mx.uint64: "uint64",
    mx.bool_: "bool",
}
# bf16 has no numpy type: it travels as its uint16 bit pattern.
_HOST_DTYPES: dict[str, Any] = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,
    "uint32": np.uint32,
    "int32": np.int32,
    "uint16": np.uint16,
    "int16": np.int16,
    "uint8": np.uint8,
    "int8": np.int8,
    "int64": np.int64,
    "uint64": np.uint64,
    "bool": np.bool_,
}


def dtype_name(dtype: Any) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise UsageError(f"dtype {dtype} cannot be persisted") from None


def materialise(array: mx.array) -> list[memoryview]:
    """Evaluate one tensor and return its bytes in C order as contiguous segments.

    A row slice `[..., :offset, :]` of a capacity buffer is contiguous per
    leading index (one segment per batch row and head), so the segments are
    zero-copy views of the evaluated buffer; anything else falls back to one
    contiguous copy. The views alias the cache: write them out before the
    engine updates that cache again.
    """
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    mx.eval(array)
    host = np.asarray(memoryview(array))  # type: ignore[arg-type]  # stubs omit mx.array's buffer protocol
    if host.flags.c_contiguous:
        return [host.data.cast("B")]
    if host.ndim >= 2:
        segments = [host[index] for index in np.ndindex(host.shape[:-2])]
        if all(segment.flags.c_contiguous for segment in segments):
            return [segment.data.cast("B") for segment in segments]
    contiguous = mx.contiguous(array)
    mx.eval(contiguous)
    return [memoryview(contiguous).cast("B")]  # type: ignore[arg-type]  # stubs omit mx.array's buffer protocol


def host_dtype(dtype: str) -> Any:
    """The numpy type a persisted dtype travels as."""
    try:
        return _HOST_DTYPES[dtype]
    except KeyError:
        raise CorruptEntry(f"tensor dtype {dtype!r} is not one this build reads", part="header") from None


def host_to_mlx(typed: np.ndarray, dtype: str) -> mx.array:
    """Copy a typed host array into an MLX-owned array (bf16 from its bit pattern)."""
    array = mx.array(typed)
    if dtype == "bfloat16":
        array = array.view(mx.bfloat16)
    mx.eval(array)
    return array


class _Plan:
    """Collects tensor records and their producers in file order."""

    def __init__(self) -> None:
        self.producers: list[Producer] = []

    def tensor(self, name: str, array: mx.array) -> TensorRecord:
        self.producers.append(lambda: array)
        length = int(np.prod(array.shape, dtype=np.int64)) * array.dtype.size
        return TensorRecord(
            name=name,
            dtype=dtype_name(array.dtype),
            shape=tuple(int(d) for d in array.shape),
            file_offset=0,
            length=length,
            checksum=b"",
        )


def _rows(array: mx.array, count: int) -> mx.array:
    return array[..., :count, :]


def _check_offset(cache: Any, name: str, token_count: int) -> None:
    if cache.offset != token_count:
        raise UsageError(f"{name}: cache offset {cache.offset} does not match {token_count} tokens")


def _plan_one(cache: Any, name: str, token_count: int, plan: _Plan) -> CacheRecord:
    signature = sig.cache_signature(cache)
    if signature in sig.BATCH_SIGNATURES:
        raise RefusedCacheKind(f"{name}: {signature} holds a batch; extract one row per entry before persisting")
    sig.refuse_paged(signature, name)
    fields: dict[str, int] = {}
    tensors: list[TensorRecord] = []
    children: list[CacheRecord] = []
    offset = token_count
    kind = type(cache)
    if kind in (mlx_cache.CacheList, CompanionState):
        children = [_plan_one(child, f"{name}.{i}", token_count, plan) for i, child in enumerate(cache.caches)]
    elif kind is mlx_cache.ArraysCache:
        fields["slots"] = len(cache.cache)
        for i, slot in enumerate(cache.cache):
            if slot is not None:
                tensors.append(plan.tensor(f"{name}.slot{i}", slot))
        for extra in ("left_padding", "lengths"):
            if getattr(cache, extra, None) is not None:
                tensors.append(plan.tensor(f"{name}.{extra}", getattr(cache, extra)))
    else:
        _check_offset(cache, name, token_count)
        offset = cache.offset
        tensors = _plan_attention(cache, name, fields, plan)
    return CacheRecord(
        signature=signature,
        offset=offset,
        minimum_reusable_offset=sig.minimum_reusable_offset(cache, token_count),
        trimmable=sig.is_trimmable(cache),
        fields=fields,
        tensors=tuple(tensors),
        children=tuple(children),
    )


def _plan_attention(cache: Any, name: str, fields: dict[str, int], plan: _Plan) -> list[TensorRecord]:
    kind = type(cache)
    if kind is mlx_cache.QuantizedKVCache:
        fields.update(group_size=cache.group_size, bits=cache.bits)
        if cache.keys is None:
            return []
        return [
            plan.tensor(f"{name}.{part}.{i}", _rows(array, cache.offset))
            for part, triple in (("keys", cache.keys), ("values", cache.values))
            for i, array in enumerate(triple)
        ]
    if kind is mlx_cache.RotatingKVCache:
        return _plan_rotating(cache, name, fields, plan)
    rows = cache.offset
    if kind is mlx_cache.ChunkedKVCache:
        fields.update(chunk_size=cache.chunk_size, start_position=cache.start_position)
        rows = cache.offset - cache.start_position
    if cache.keys is None:
        return []
    return [
        plan.tensor(f"{name}.keys", _rows(cache.keys, rows)),
        plan.tensor(f"{name}.values", _rows(cache.values, rows)),
    ]


def _plan_rotating(cache: Any, name: str, fields: dict[str, int], plan: _Plan) -> list[TensorRecord]:
    wrapped = cache.offset >= cache.max_size
    fields.update(keep=cache.keep, max_size=cache.max_size, ring_index=cache._idx, wrapped=int(wrapped))
    if cache.keys is None:
        return []
    if wrapped:
        keys, values = cache.keys, cache.values
    else:
        # Before the wrap the ring is in time order and the write index is the offset.
        if cache._idx != cache.offset:
            raise UsageError(f"{name}: unwrapped ring with index {cache._idx} != offset {cache.offset}")
        keys, values = _rows(cache.keys, cache.offset), _rows(cache.values, cache.offset)
    return [plan.tensor(f"{name}.keys", keys), plan.tensor(f"{name}.values", values)]


def plan_caches(caches: Sequence[Any], token_count: int) -> tuple[list[CacheRecord], list[Producer]]:
    """Records (offsets unassigned, checksums empty) and tensor producers of
    an entry, both in file order. Materialises nothing."""
    plan = _Plan()
    records = [_plan_one(cache, f"c{i}", token_count, plan) for i, cache in enumerate(caches)]
    return records, plan.producers


def _step_capacity(rows: int) -> int:
    """Rows rounded up past `rows + STEP_ROWS` to a step: at least a step of
    slack, so neither the first step after a restore (the prompt's last
    tokens) nor the one mlx-lm's generators run ahead before handing out the
    first token grows the cache, which copies every row (a restore of
    2^k - 1 rows would otherwise have one row of slack)."""
    return (rows // STEP_ROWS + 2) * STEP_ROWS


TensorReader = Callable[..., mx.array]
"""`read(record, capacity_rows=None) -> mx.array`: the tensor, placed at the
start of a zero-filled buffer of `capacity_rows` rows (axis -2) when given."""


def _rebuild_one(record: CacheRecord, read: TensorReader) -> Any:
    signature = record.signature
    if signature.startswith(sig.LIST_PREFIX):
        # Each member keeps its own recorded bound; the list's is their maximum.
        return mlx_cache.CacheList(*(_rebuild_one(child, read) for child in record.children))
    if signature.startswith(sig.COMPANION_PREFIX):
        drafter = sig.companion_drafter_of(signature)
        return CompanionState(*(_rebuild_one(child, read) for child in record.children), drafter=drafter)
    return _keep_recorded_bound(record, _rebuild_member(record, read))


def _keep_recorded_bound(record: CacheRecord, cache: Any) -> Any:
    """Declare on the rebuilt cache the minimum reusable offset its record
    holds when the cache would not derive it itself (a bound declared after
    an irreversible transition); a moving front or an untrimmable cache
    derives its own from the rebuilt state."""
    if record.minimum_reusable_offset > sig.minimum_reusable_offset(cache, record.offset):
        cache.minimum_reusable_offset = record.minimum_reusable_offset
    return cache


def _rebuild_member(record: CacheRecord, read: TensorReader) -> Any:
    signature = record.signature
    if signature == sig.SIGNATURE_SSM:
        return _rebuild_arrays(record, read)
    if signature.startswith(sig.QUANT_PREFIX):
        return _rebuild_quantized(record, read)
    tensors = list(record.tensors)
    if signature == sig.SIGNATURE_PLAIN:
        cache = mlx_cache.KVCache()
        if tensors:
            capacity = _step_capacity(record.offset)
            cache.keys = read(tensors[0], capacity)
            cache.values = read(tensors[1], capacity)
        cache.offset = record.offset
        return cache
    if signature == sig.SIGNATURE_CHUNKED:
        return _rebuild_chunked(record, read)
    if signature == sig.SIGNATURE_ROTATING:
        return _rebuild_rotating(record, read)
    raise CorruptEntry(f"entry holds unknown cache signature {signature!r}", part="header")


def _rebuild_quantized(record: CacheRecord, read: TensorReader) -> Any:
    # Any: mlx-lm leaves its cache attributes unannotated, so mypy types `keys` as None.
    cache: Any = mlx_cache.QuantizedKVCache(group_size=record.fields["group_size"], bits=record.fields["bits"])
    if record.tensors:
        capacity = _step_capacity(record.offset)
        parts = [read(tensor, capacity) for tensor in record.tensors]
        cache.keys, cache.values = tuple(parts[:3]), tuple(parts[3:])
    cache.offset = record.offset
    return cache


def _rebuild_chunked(record: CacheRecord, read: TensorReader) -> Any:
    cache = mlx_cache.ChunkedKVCache(record.fields["chunk_size"])
    cache.start_position = record.fields["start_position"]
    if record.tensors:
        capacity = _step_capacity(record.offset - cache.start_position)
        cache.keys = read(record.tensors[0], capacity)
        cache.values = read(record.tensors[1], capacity)
    cache.offset = record.offset
    return cache


def _rebuild_rotating(record: CacheRecord, read: TensorReader) -> Any:
    fields = record.fields
    cache = mlx_cache.RotatingKVCache(max_size=fields["max_size"], keep=fields["keep"])
    cache.offset = record.offset
    cache._idx = fields["ring_index"]
    if record.tensors:
        # Unwrapped: the capacity the next in-place step would grow to, so it
        # does not concatenate. Wrapped: the raw ring exactly as it was.
        capacity = None if fields["wrapped"] else record.offset + min(STEP_ROWS, cache.max_size - record.offset)
        cache.keys, cache.values = read(record.tensors[0], capacity), read(record.tensors[1], capacity)
    return cache


def _rebuild_arrays(record: CacheRecord, read: TensorReader) -> Any:
    # Any: mlx-lm's unannotated `[None] * size` types the slots as None.
    cache: Any = mlx_cache.ArraysCache(record.fields["slots"])
    for tensor in record.tensors:
        label = tensor.name.rsplit(".", 1)[-1]
        if label.startswith("slot"):
            cache.cache[int(label[4:])] = read(tensor)
        elif label in ("left_padding", "lengths"):
            setattr(cache, label, read(tensor))
        else:
            raise CorruptEntry(f"ssm cache has unexpected tensor {tensor.name!r}", part="header")
    return cache


def rebuild_caches(records: Sequence[CacheRecord], read: TensorReader) -> list[Any]:
    """Fresh MLX-owned caches from an entry's records, reading tensors in order."""
    return [_rebuild_one(record, read) for record in records]
