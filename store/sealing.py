"""AES-256-GCM sealing of a `.kvc` entry's payload (format version 3).

An entry is sealed as segments, each its own GCM message with its own tag:
segment 0 is the token ids (the header's `token_ids` field holds their
ciphertext and tag), segment i + 1 is tensor i (its ciphertext at the tensor's
offset, its 16-byte tag right after it). So the write path stays streaming:
one tensor is sealed and written at a time, and a load opens each tensor as
it is read, in place, with no second copy.

Nonces: the entry draws a random 96-bit nonce; segment i uses (nonce + i) mod
2**96. Within an entry they differ; across entries a collision needs two
random 96-bit draws within a few thousand of each other.

AAD: every segment authenticates `sha256(canonical CBOR of the header with
token_ids emptied and every tensor checksum zeroed) || u32 segment index`.
The header is thereby bound to its payload: a header swapped onto another
entry's payload, a field edited (shape, offset, namespace, fingerprint), or
segments reordered all fail their tag. The two fields left out cannot be in
it: the token ids are the sealed segment 0 itself, and the checksums (xxh3 of
the ciphertext, so a file can be checked without a key) are known only after
sealing; the tags cover both.
"""

from __future__ import annotations

import copy
import hashlib
import secrets
import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import cbor2
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from kvcellar.store.keyring import EncryptionKey
from kvcellar.store.records import SealRecord

ALGORITHM = "AES-256-GCM"
NONCE_BYTES = 12
TAG_BYTES = 16
_NONCE_SPACE = 1 << (8 * NONCE_BYTES)
_SEGMENT_INDEX = struct.Struct("<I")
# The piece a sealed write hands its writer thread: small enough that the
# writer starts early and memory stays bounded, large enough to amortise a call.
SEAL_PIECE_BYTES = 1 << 20


def new_seal(key: EncryptionKey) -> SealRecord:
    """A fresh seal for one entry under `key`: a random nonce of its own."""
    return SealRecord(algorithm=ALGORITHM, key_id=key.key_id, nonce=secrets.token_bytes(NONCE_BYTES))


def segment_nonce(seal: SealRecord, segment: int) -> bytes:
    return ((int.from_bytes(seal.nonce, "big") + segment) % _NONCE_SPACE).to_bytes(NONCE_BYTES, "big")


def header_binding(unstructured_header: Mapping[str, Any]) -> bytes:
    """The 32-byte digest of the header every segment's AAD carries, from the
    header as plain data (the writer's unstructured `Header`, or a read
    header's decoded CBOR map: both encode to the same canonical bytes)."""
    bound = dict(unstructured_header)
    bound["token_ids"] = b""
    bound["caches"] = [_zero_checksums(record) for record in bound["caches"]]
    return hashlib.sha256(cbor2.dumps(bound, canonical=True)).digest()


def _zero_checksums(record: Mapping[str, Any]) -> dict[str, Any]:
    zeroed = copy.copy(dict(record))
    zeroed["tensors"] = [{**tensor, "checksum": bytes(len(tensor["checksum"]))} for tensor in record["tensors"]]
    zeroed["children"] = [_zero_checksums(child) for child in record["children"]]
    return zeroed


def _aad(binding: bytes, segment: int) -> bytes:
    return binding + _SEGMENT_INDEX.pack(segment)


def seal_segments(
    key: EncryptionKey,
    seal: SealRecord,
    binding: bytes,
    segment: int,
    plaintext: Iterable[memoryview | bytes],
    piece_bytes: int = SEAL_PIECE_BYTES,
) -> Iterator[bytes]:
    """One segment's ciphertext, at most `piece_bytes` at a time as it is
    sealed (lazily: the caller writes each piece while the next is sealed),
    then its tag: back to back they are the segment's `length + TAG_BYTES` bytes."""
    encryptor = Cipher(algorithms.AES(key.key), modes.GCM(segment_nonce(seal, segment))).encryptor()
    encryptor.authenticate_additional_data(_aad(binding, segment))
    for part in plaintext:
        view = memoryview(part).cast("B")
        for start in range(0, len(view), piece_bytes):
            yield encryptor.update(view[start : start + piece_bytes])
    last = encryptor.finalize()  # GCM is a stream mode: nothing is held back, but the API asks for the call
    if last:
        yield last
    yield encryptor.tag


def seal_bytes(key: EncryptionKey, seal: SealRecord, binding: bytes, segment: int, plaintext: bytes) -> bytes:
    return b"".join(seal_segments(key, seal, binding, segment, [plaintext]))


def open_in_place(
    key: EncryptionKey, seal: SealRecord, binding: bytes, segment: int, runs: Iterable[memoryview], tag: bytes
) -> bool:
    """Decrypt a segment's ciphertext in place, run by run in file order;
    False when its tag fails (the runs then hold garbage the caller discards)."""
    decryptor = Cipher(algorithms.AES(key.key), modes.GCM(segment_nonce(seal, segment), tag)).decryptor()
    decryptor.authenticate_additional_data(_aad(binding, segment))
    for run in runs:
        decryptor.update_into(run, run)
    try:
        decryptor.finalize()
    except InvalidTag:
        return False
    return True


def open_bytes(key: EncryptionKey, seal: SealRecord, binding: bytes, segment: int, sealed: bytes) -> bytes | None:
    """A sealed byte string's plaintext, or None when its tag fails (or it is too short to hold one)."""
    if len(sealed) < TAG_BYTES:
        return None
    plaintext = bytearray(sealed[:-TAG_BYTES])
    if not open_in_place(key, seal, binding, segment, [memoryview(plaintext)], bytes(sealed[-TAG_BYTES:])):
        return None
    return bytes(plaintext)
