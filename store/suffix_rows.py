"""Read the rows `[start, end)` of an entry's plain KV tensors into host memory: the load half of a split restore.

A split restore (store/restore_plan.py, engine/split_restore.py) prefills a
prompt's first `start` tokens on the engine thread while this runs on a
worker thread: it reads only the suffix rows of each layer's keys and values
(a `.kvc` tensor is `(batch, heads, rows, dim)` in C order, so each
`(batch, head)` slot's suffix is one contiguous run) into numpy buffers it
owns, touching no MLX; the engine thread turns them into MLX arrays after
the join, as a restore does with its reader thread's bytes.

Only entries whose every cache is a plain `KVCache` (`kv:plain`) split: the
rows at positions `[start, end)` of plain causal attention depend on the
tokens before them alone, so they are the rows a prefill of the whole prompt
would write. `split_refusal_for_records` names why anything else is refused.

Checksums: a tensor's xxh3 covers all its rows, so a suffix read cannot check
it (the header's checksum and the token ids still are); see docs/restore-policy.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import attrs
import numpy as np

from kvcellar.errors import CorruptEntry, KeyUnavailable, RefusedCacheKind
from kvcellar.store import signature as sig
from kvcellar.store.disk import Disk
from kvcellar.store.kvfile import _read_header_from
from kvcellar.store.records import CacheRecord, Header, TensorRecord

_ITEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@attrs.frozen(kw_only=True, eq=False)
class HostRows:
    """One tensor's suffix: `data` holds `shape` (rows on axis -2) of `dtype` as raw bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray


@attrs.frozen(kw_only=True, eq=False)
class SuffixRows:
    """Rows `[start_tokens, end_tokens)` of each cache's keys and values, in the entry's cache order."""

    start_tokens: int
    end_tokens: int
    layers: tuple[tuple[HostRows, HostRows], ...]

    @property
    def bytes(self) -> int:
        return sum(keys.data.nbytes + values.data.nbytes for keys, values in self.layers)


def split_refusal_for_records(records: Sequence[CacheRecord]) -> str:
    """Why an entry with these cache records cannot be split ("" when it can)."""
    for record in records:
        if record.signature != sig.SIGNATURE_PLAIN:
            return f"cache {record.signature} is not plain attention"
        if len(record.tensors) != 2:
            return "an empty plain cache"
        if any(t.dtype not in _ITEM_BYTES or len(t.shape) != 4 for t in record.tensors):
            return "a plain cache with tensors other than (batch, heads, rows, dim) floats"
    return ""


def _read_rows(disk: Disk, handle: object, path: Path, record: TensorRecord, start: int, end: int) -> HostRows:
    batch, heads, rows, dim = record.shape
    if not 0 <= start <= end <= rows:
        raise CorruptEntry(f"{path}: tensor {record.name} has {rows} rows, not [{start}, {end})", part="header")
    row_bytes = dim * _ITEM_BYTES[record.dtype]
    run_bytes = (end - start) * row_bytes
    data = np.empty(batch * heads * run_bytes, dtype=np.uint8)
    view = data.data
    for slot in range(batch * heads):
        offset = record.file_offset + slot * rows * row_bytes + start * row_bytes
        destination = view[slot * run_bytes : (slot + 1) * run_bytes]
        if disk.read_into(handle, offset, destination) != run_bytes:
            raise CorruptEntry(f"{path}: truncated tensor {record.name}", part=f"tensor {record.name}")
    return HostRows(dtype=record.dtype, shape=(batch, heads, end - start, dim), data=data)


def read_suffix_rows(
    disk: Disk, path: Path, start_tokens: int, end_tokens: int, *, expected_tokens: np.ndarray | None = None
) -> SuffixRows:
    """Rows `[start_tokens, end_tokens)` of every layer of the entry at `path`.

    Checks the header (checksum, size) and, when given, that its token ids
    begin with `expected_tokens`. Raises `CorruptEntry`/`UnsupportedFormat`
    for a damaged or foreign file, `DiskError` when it cannot be read, and
    `RefusedCacheKind` for an entry `split_refusal_for_records` refuses or a
    sealed one (its row ranges are not separately authenticated: a sealed
    entry restores whole)."""
    handle = disk.open_read(path)
    try:
        try:
            header: Header = _read_header_from(disk, handle, path)
        except KeyUnavailable as e:
            raise RefusedCacheKind(f"{path}: cannot split a sealed entry") from e
        if expected_tokens is not None and not np.array_equal(
            header.token_array[: expected_tokens.size], expected_tokens
        ):
            raise CorruptEntry(f"{path}: tokens differ from the indexed header", part="header")
        refusal = split_refusal_for_records(header.caches)
        if refusal:
            raise RefusedCacheKind(f"{path}: cannot split: {refusal}")
        layers = tuple(
            (
                _read_rows(disk, handle, path, record.tensors[0], start_tokens, end_tokens),
                _read_rows(disk, handle, path, record.tensors[1], start_tokens, end_tokens),
            )
            for record in header.caches
        )
        disk.drop_cached(handle, header.payload_offset, header.file_bytes - header.payload_offset)
    finally:
        disk.close(handle)
    return SuffixRows(start_tokens=start_tokens, end_tokens=end_tokens, layers=layers)
