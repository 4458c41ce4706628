"""The records of a `.kvc` file's header: the entry (`Header`), each cache
(`CacheRecord`) and each tensor (`TensorRecord`), encoded as canonical CBOR.

Their own module because both the file format (`store.kvfile`) and the
per-signature codecs (`store.codecs`) build them, and the format calls the
codecs: the records sit below both, so neither imports the other back.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import numpy as np
from cattrs.gen import make_dict_unstructure_fn, override

from kvcellar.serialization import converter


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
class SamplerState:
    """What a sampler needs to go on exactly where it stopped (spec §5.7):
    `sample_index` draws made so far (the emitted tokens and the pending one),
    and, for a seeded sampler, the key its chain holds after them (the
    uint32 words of `mx.random.key`; empty for greedy and unseeded sampling).
    History-dependent processors (the penalties) need only the token history,
    which the entry's tokens and the pending token are."""

    seed: int | None
    sample_index: int
    rng_key: tuple[int, ...] = ()


@attrs.frozen(kw_only=True)
class GenerationCheckpoint:
    """The header part of an in-flight generation checkpoint (format version
    2): the entry's tokens are the prompt and the `emitted_tokens` emitted
    after it; the caches cover all of them; `pending_token` was sampled and
    not yet emitted. `request_key` names the request (`store.checkpoints.
    request_key`); `attempt` orders the attempts of one process."""

    request_key: str
    prompt_tokens: int
    emitted_tokens: int
    namespace: str
    pending_token: int
    sampler: SamplerState
    attempt: int = 0


@attrs.frozen(kw_only=True)
class SealRecord:
    """The header part of a sealed entry (format version 3, `store.sealing`):
    the cipher, the id of the key that sealed it and the entry's random
    96-bit nonce (segment i uses nonce + i)."""

    algorithm: str
    key_id: str
    nonce: bytes


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
    # Only a checkpoint entry has it (and only it is format version 2); an
    # ordinary header encodes without the key, byte for byte as before.
    generation_checkpoint: GenerationCheckpoint | None = None
    # Only a sealed entry has it (format version 3). On disk its `token_ids`
    # are then their ciphertext and tag; a header read with the key (or
    # returned by a writer) holds the plaintext ids.
    seal: SealRecord | None = None
    # Only an entry with method companion state has it (format versions 5-8,
    # store/companion.py): the drafter's fingerprint digest. The companion
    # section is the last cache record (`companion:<drafter>:list(...)`), its
    # tensors in the same payload under the same checksums and seal.
    companion: str | None = None

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


@attrs.frozen(kw_only=True)
class HeaderSummary:
    """The fields of a `Header` a startup scan needs, decoded from the same
    CBOR map by the same converter (so each field is accepted or refused as
    `Header` would), the other fields ignored: the cache and tensor records
    stay undecoded until `kvfile.load` structures the whole `Header`. The
    checkpoint part is kept raw, since a scan only asks whether it is there."""

    format_version: int
    fingerprint: dict[str, str]
    namespace: str
    token_ids: bytes
    minimum_reusable_offset: int
    trimmable: bool
    payload_offset: int
    file_bytes: int
    generation_checkpoint: dict[str, Any] | None = None
    seal: SealRecord | None = None
    companion: str | None = None
    # The cache records as decoded CBOR (undecoded into `CacheRecord`s: see above).
    caches: Any = ()

    @property
    def token_array(self) -> np.ndarray:
        """The token ids as a read-only uint32 array (no copy)."""
        return np.frombuffer(self.token_ids, dtype="<u4")


def record_bytes(record: CacheRecord) -> int:
    """The payload bytes of one cache record's tensors, its children's included."""
    return sum(tensor.length for tensor in _walk_tensors((record,)))


def _walk_tensors(records: Sequence[CacheRecord]) -> Iterator[TensorRecord]:
    for record in records:
        yield from record.tensors
        yield from _walk_tensors(record.children)


converter.register_unstructure_hook(
    Header,
    make_dict_unstructure_fn(
        Header,
        converter,
        generation_checkpoint=override(omit_if_default=True),
        seal=override(omit_if_default=True),
        companion=override(omit_if_default=True),
    ),
)
