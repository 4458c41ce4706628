"""The records of a `.kvc` file's header: the entry (`Header`), each cache
(`CacheRecord`) and each tensor (`TensorRecord`), encoded as canonical CBOR.

Their own module because both the file format (`store.kvfile`) and the
per-signature codecs (`store.codecs`) build them, and the format calls the
codecs: the records sit below both, so neither imports the other back.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import attrs
import numpy as np


@attrs.frozen(kw_only=True)
class TensorRecord:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file_offset: int
    length: int
    checksum: bytes


@attrs.frozen(kw_only=True)
class CacheRecord:
    """One cache of an entry. `fields` holds the codec's scalars (ring index,
    max size, keep, group size, bits, chunk size, start position, slots)."""

    signature: str
    offset: int
    minimum_reusable_offset: int
    trimmable: bool
    fields: dict[str, int]
    tensors: tuple[TensorRecord, ...]
    children: tuple[CacheRecord, ...] = ()


@attrs.frozen(kw_only=True)
class Header:
    format_version: int
    fingerprint: dict[str, str]
    namespace: str
    tokenizer_hash: str
    created_at_ns: int
    token_ids: bytes
    minimum_reusable_offset: int
    trimmable: bool
    caches: tuple[CacheRecord, ...]
    payload_offset: int
    file_bytes: int

    @property
    def token_array(self) -> np.ndarray:
        """The token ids as a read-only uint32 array (no copy)."""
        return np.frombuffer(self.token_ids, dtype="<u4")

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self.token_array.tolist())

    def tensor_records(self) -> Iterator[TensorRecord]:
        """Every tensor of the entry in file order."""
        yield from _walk_tensors(self.caches)

    @property
    def payload_bytes(self) -> int:
        return sum(tensor.length for tensor in self.tensor_records())


def _walk_tensors(records: Sequence[CacheRecord]) -> Iterator[TensorRecord]:
    for record in records:
        yield from record.tensors
        yield from _walk_tensors(record.children)
