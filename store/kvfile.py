"""The `.kvc` file format: one prefix entry (tokens + caches) per file.
Version 1 is an ordinary entry; version 2 an in-flight generation checkpoint
(spec §5.7), whose header adds `generation_checkpoint` (the request key, the
pending token, the sampler state). A build that reads only version 1 refuses
a checkpoint as an unsupported version rather than restore half of it, and
this build refuses a header whose version and checkpoint part disagree.
Version 3 is an ordinary entry sealed with AES-256-GCM (`store.sealing`):
its header adds `seal` (key id, nonce), its `token_ids` are their ciphertext
and tag, and each tensor's ciphertext is followed by its 16-byte tag. Reading
one needs a `KeyRing` holding its key (`KeyUnavailable` otherwise); a failed
tag is a `CorruptEntry` like a failed checksum. Version 4 is a generation
checkpoint sealed the same way (both parts): a build that knows version 3 but
not sealed checkpoints refuses it as unsupported, as version 2 is refused.

Layout (all integers little-endian):

    0      preamble, 32 bytes: magic (8) | format version u32 | header length u32 |
           header checksum u64 | payload offset u64
    32     header: canonical CBOR of `Header` (exactly `header length` bytes)
    P      payload: tensors at 16 KiB-aligned offsets, P = align(32 + header length)

The header checksum is xxh3-64 over the preamble (checksum field zeroed) and
the header, so the version, lengths and payload offset are covered too. Each
tensor carries its own xxh3-64 checksum in a fixed-width 8-byte slot: the header
is encoded once with zeroed slots to size it, the tensors are materialised and
written one at a time (peak transient = one tensor), then the header is
patched with the real checksums (same length, canonical CBOR) and written last.

Only rows up to each cache's `offset` are persisted, never the 256-step slack.
A wrapped rotating ring is written raw with its ring index: reordering it into
time order is not bit-exact. bf16 travels as a uint16 view.

Writes are atomic: a temp file created exclusively in the target directory,
fsync, rename over the target, fsync of the directory. All file access goes
through `Disk`.
"""

from __future__ import annotations

import contextlib
import struct
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import cbor2
import mlx.core as mx
import numpy as np
import xxhash

from kvcellar.errors import CorruptEntry, DecodeError, DiskError, KeyUnavailable, UnsupportedFormat, UsageError
from kvcellar.serialization import converter, from_cbor, to_cbor
from kvcellar.store import codecs, sealing, staged_load, tensor_io
from kvcellar.store.companion import companion_drafter
from kvcellar.store.disk import Disk, RealDisk
from kvcellar.store.image_disk import ImageDisk
from kvcellar.store.keyring import EncryptionKey, KeyRing
from kvcellar.store.records import (
    CacheRecord,
    GenerationCheckpoint,
    Header,
    HeaderSummary,
    SealRecord,
    TensorRecord,
    record_bytes,
)
from kvcellar.store.safeguards import SAFEGUARDS, Safeguards
from kvcellar.store.signature import COMPANION_PREFIX, caches_trimmable, entry_minimum_reusable_offset

MAGIC = b"\x89KVC\r\n\x1a\n"
FORMAT_VERSION = 1
CHECKPOINT_FORMAT_VERSION = 2
SEALED_FORMAT_VERSION = 3
SEALED_CHECKPOINT_FORMAT_VERSION = 4
# Versions 5-8: versions 1-4 with a method companion section (store/companion.py, issue 42).
COMPANION_FORMAT_VERSION = 5
COMPANION_CHECKPOINT_FORMAT_VERSION = 6
SEALED_COMPANION_FORMAT_VERSION = 7
SEALED_COMPANION_CHECKPOINT_FORMAT_VERSION = 8
# The versions before companion state: what a build without it reads (its refusal of 5-8 is tested).
PRE_COMPANION_FORMAT_VERSIONS = frozenset(
    {FORMAT_VERSION, CHECKPOINT_FORMAT_VERSION, SEALED_FORMAT_VERSION, SEALED_CHECKPOINT_FORMAT_VERSION}
)
READABLE_FORMAT_VERSIONS = PRE_COMPANION_FORMAT_VERSIONS | {
    COMPANION_FORMAT_VERSION,
    COMPANION_CHECKPOINT_FORMAT_VERSION,
    SEALED_COMPANION_FORMAT_VERSION,
    SEALED_COMPANION_CHECKPOINT_FORMAT_VERSION,
}
# The format version of each (is a checkpoint, is sealed, has companion state) triple, and back.
_FORMAT_VERSIONS = {
    (False, False, False): FORMAT_VERSION,
    (True, False, False): CHECKPOINT_FORMAT_VERSION,
    (False, True, False): SEALED_FORMAT_VERSION,
    (True, True, False): SEALED_CHECKPOINT_FORMAT_VERSION,
    (False, False, True): COMPANION_FORMAT_VERSION,
    (True, False, True): COMPANION_CHECKPOINT_FORMAT_VERSION,
    (False, True, True): SEALED_COMPANION_FORMAT_VERSION,
    (True, True, True): SEALED_COMPANION_CHECKPOINT_FORMAT_VERSION,
}
_FORMAT_PARTS = {version: parts for parts, version in _FORMAT_VERSIONS.items()}
ALIGNMENT_BYTES = 16 * 1024
FILE_SUFFIX = ".kvc"
TEMP_SUFFIX = ".tmp"
_PREAMBLE = struct.Struct("<8sIIQQ")
PREAMBLE_BYTES = _PREAMBLE.size
CHECKSUM_BYTES = 8
_ZERO_CHECKSUM = bytes(CHECKSUM_BYTES)
_HEADER_BYTES_MAX = 256 * 1024 * 1024


def _align(offset: int) -> int:
    return -(-offset // ALIGNMENT_BYTES) * ALIGNMENT_BYTES


def _checksum(data: bytes | bytearray | memoryview) -> bytes:
    return xxhash.xxh3_64_digest(data)


@attrs.frozen(kw_only=True)
class EntryMeta:
    """What an entry says about where it came from (all optional)."""

    namespace: str = ""
    fingerprint: dict[str, str] = attrs.field(factory=dict)
    tokenizer_hash: str = ""
    created_at_ns: int | None = None


@attrs.define(kw_only=True)
class Entry:
    """A loaded entry: MLX-owned caches ready to continue decoding."""

    caches: list[Any]
    tokens: tuple[int, ...]
    header: Header


def _coerce_meta(meta: EntryMeta | Mapping[str, Any] | None) -> EntryMeta:
    if meta is None:
        return EntryMeta()
    if isinstance(meta, EntryMeta):
        return meta
    unknown = set(meta) - {"namespace", "fingerprint", "tokenizer_hash", "created_at_ns"}
    if unknown:
        raise UsageError(f"unknown meta keys {sorted(unknown)}")
    return EntryMeta(**meta)


class KvFileWriter:
    """Writes one entry step by step, so a caller can give each tensor its own
    engine turn: `open()`, `write_tensor(i)` (or `materialise_tensor(i)` on the
    engine thread and `write_segments(i, …)` elsewhere) for i in
    range(`tensor_count`), `commit()`; `abort()` on any failure. `save()` runs
    the whole sequence.

    Planning (constructor) does no I/O and materialises nothing.
    """

    def __init__(
        self,
        path: Path,
        caches: Sequence[Any],
        tokens: Sequence[int],
        meta: EntryMeta | Mapping[str, Any] | None = None,
        disk: Disk | None = None,
        *,
        temp_id: str | None = None,
        safeguards: Safeguards = SAFEGUARDS,
        generation_checkpoint: GenerationCheckpoint | None = None,
        keyring: KeyRing | None = None,
    ) -> None:
        self.path = Path(path)
        self.disk = disk or RealDisk()
        self.safeguards = safeguards
        # A unique entry path needs no random part in its temp name (the simulator's determinism).
        temp_id = temp_id if temp_id is not None else uuid.uuid4().hex
        self.temp_path = self.path.with_name(f".{self.path.name}.{temp_id}{TEMP_SUFFIX}")
        token_ids = _packed_token_ids(tokens)
        token_count = len(token_ids) // 4
        records, self._producers = codecs.plan_caches(caches, token_count)
        info = _coerce_meta(meta)
        self._sealing_key = keyring.sealing if keyring is not None else None
        seal = sealing.new_seal(self._sealing_key) if self._sealing_key is not None else None
        drafter = companion_drafter(caches)
        planned = Header(
            format_version=_FORMAT_VERSIONS[(generation_checkpoint is not None, seal is not None, drafter is not None)],
            fingerprint=dict(info.fingerprint),
            namespace=info.namespace,
            tokenizer_hash=info.tokenizer_hash,
            created_at_ns=info.created_at_ns if info.created_at_ns is not None else time.time_ns(),
            token_ids=token_ids,
            minimum_reusable_offset=entry_minimum_reusable_offset(caches, token_count),
            trimmable=caches_trimmable(caches),
            caches=tuple(records),
            payload_offset=0,
            file_bytes=0,
            generation_checkpoint=generation_checkpoint,
            seal=seal,
            companion=drafter,
        )
        self._header, self._on_disk = _plan_header(planned, self._sealing_key)
        self._binding = _binding(self._on_disk) if seal is not None else b""
        self._tensors = list(self._header.tensor_records())
        self._checksums: dict[str, bytes] = {}
        self._handle: Any = None
        self._stream: tensor_io.StreamWriter | None = None  # sealed writes, one helper thread per file

    @property
    def tensor_count(self) -> int:
        return len(self._tensors)

    @property
    def planned_header(self) -> Header:
        return self._header

    def open(self) -> None:
        """Create the temp file exclusively beside the target."""
        self._handle = self.disk.create_exclusive(self.temp_path)

    def materialise_tensor(self, index: int) -> list[memoryview]:
        """Evaluate tensor `index` into byte segments. MLX work: run it on the
        engine thread. The segments are views of evaluated arrays, safe to
        write from another thread while decoding goes on."""
        record = self._tensors[index]
        segments = codecs.materialise(self._producers[index]())
        produced_bytes = sum(segment.nbytes for segment in segments)
        if produced_bytes != record.length:
            raise UsageError(f"tensor {record.name}: planned {record.length} bytes, got {produced_bytes}")
        return segments

    def write_segments(self, index: int, segments: list[memoryview]) -> None:
        """Write one materialised tensor at its aligned offset while checksumming it (no MLX)."""
        record = self._tensors[index]
        if self._sealing_key is not None and self._on_disk.seal is not None:
            # Segment 0 is the token ids; tensor i is segment i + 1. The tag lands right after the ciphertext.
            sealed = sealing.seal_segments(self._sealing_key, self._on_disk.seal, self._binding, index + 1, segments)
            if self._stream is None and self.disk.concurrent_io:
                # One writer thread for the file: the next tensor is sealed while this one is written.
                self._stream = tensor_io.StreamWriter(self.disk, self._handle)
            self._checksums[record.name] = tensor_io.write_stream_and_hash(
                self.disk, self._handle, record.file_offset, sealed, self._stream
            )
            return
        self._checksums[record.name] = tensor_io.write_and_hash(self.disk, self._handle, record.file_offset, segments)

    def write_tensor(self, index: int) -> None:
        """`materialise_tensor` then `write_segments`, on the calling thread."""
        self.write_segments(index, self.materialise_tensor(index))

    def commit(self) -> Header:
        """Patch the header with the checksums, write it, fsync, rename over
        the target and fsync the directory (the commit point)."""
        header = self.commit_data()
        self.publish()
        return header

    def commit_data(self) -> Header:
        """The first half of `commit`: header written, data fsynced, file closed."""
        self._finish_stream()
        header = _with_checksums(self._on_disk, self._checksums)
        header_bytes = to_cbor(header)
        planned_bytes = to_cbor(self._on_disk)
        if len(header_bytes) != len(planned_bytes):
            raise AssertionError("patched header changed length: checksum slots must be fixed-width")
        preamble = _preamble(header_bytes, header.payload_offset, header.format_version)
        self.disk.write_at(self._handle, 0, preamble + header_bytes)
        self._fsync_data()
        self.disk.close(self._handle)
        self._handle = None
        return attrs.evolve(header, token_ids=self._header.token_ids)

    def _fsync_data(self) -> None:
        if not self.safeguards.fsync_entry_file:
            return
        try:
            self.disk.fsync(self._handle)
        except DiskError:
            if self.safeguards.fail_on_failed_fsync:
                raise

    def publish(self) -> None:
        """The second half of `commit`: rename into place, fsync the directory."""
        self.disk.rename(self.temp_path, self.path)
        if self.safeguards.fsync_entry_dir:
            self.disk.fsync_dir(self.path.parent)

    def _finish_stream(self) -> None:
        """Wait for the sealed tensors' queued writes; raises the first write error."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.finish()

    def abort(self) -> None:
        """Close and remove the temp file; never raises."""
        with contextlib.suppress(Exception):
            self._finish_stream()
        if self._handle is not None:
            with contextlib.suppress(DiskError):
                self.disk.close(self._handle)
            self._handle = None
        with contextlib.suppress(DiskError):
            self.disk.unlink(self.temp_path)


def _packed_token_ids(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32: compact, and decoded without a
    per-token cost at startup scans. Raises `UsageError` for ids out of range."""
    wide = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if wide.size and (wide.min() < 0 or wide.max() > 0xFFFFFFFF):
        raise UsageError("token ids must be in 0 .. 2**32 - 1")
    return wide.astype("<u4").tobytes()


def _plan_header(planned: Header, key: EncryptionKey | None) -> tuple[Header, Header]:
    """The placed header as callers see it (plaintext token ids) and as it
    goes on disk (a sealed entry's token ids sealed under `key`, bound to
    every other field of the placed header)."""
    if planned.seal is None or key is None:
        placed = _place_tensors(planned)
        return placed, placed
    # Placement sees the sealed ids' length (ciphertext + tag); the binding never sees their bytes.
    placeholder = bytes(len(planned.token_ids) + sealing.TAG_BYTES)
    placed = _place_tensors(attrs.evolve(planned, token_ids=placeholder))
    sealed_ids = sealing.seal_bytes(key, planned.seal, _binding(placed), 0, planned.token_ids)
    return attrs.evolve(placed, token_ids=planned.token_ids), attrs.evolve(placed, token_ids=sealed_ids)


def _binding(header: Header) -> bytes:
    return sealing.header_binding(converter.unstructure(header))


def _place_tensors(header: Header) -> Header:
    """Assign aligned file offsets. Offsets are CBOR integers whose width can
    change the header length, so iterate to the fixed point (2-3 rounds)."""
    payload_offset = _align(PREAMBLE_BYTES)
    for _ in range(8):
        placed = _assign_offsets(header, payload_offset)
        needed = _align(PREAMBLE_BYTES + len(to_cbor(placed)))
        if needed == payload_offset:
            return placed
        payload_offset = needed
    raise AssertionError("header placement did not converge")


def _assign_offsets(header: Header, payload_offset: int) -> Header:
    cursor = payload_offset
    end = payload_offset
    tag_bytes = sealing.TAG_BYTES if header.seal is not None else 0

    def place(record: CacheRecord) -> CacheRecord:
        nonlocal cursor, end
        tensors = []
        for tensor in record.tensors:
            tensors.append(attrs.evolve(tensor, file_offset=cursor, checksum=_ZERO_CHECKSUM))
            end = cursor + tensor.length + tag_bytes
            cursor = _align(end)
        children = tuple(place(child) for child in record.children)
        return attrs.evolve(record, tensors=tuple(tensors), children=children)

    caches = tuple(place(record) for record in header.caches)
    return attrs.evolve(header, caches=caches, payload_offset=payload_offset, file_bytes=end)


def _with_checksums(header: Header, checksums: Mapping[str, bytes]) -> Header:
    def patch(record: CacheRecord) -> CacheRecord:
        tensors = tuple(attrs.evolve(t, checksum=checksums[t.name]) for t in record.tensors)
        return attrs.evolve(record, tensors=tensors, children=tuple(patch(c) for c in record.children))

    return attrs.evolve(header, caches=tuple(patch(record) for record in header.caches))


def _preamble(header_bytes: bytes, payload_offset: int, version: int = FORMAT_VERSION) -> bytes:
    unsigned = _PREAMBLE.pack(MAGIC, version, len(header_bytes), 0, payload_offset)
    digest = xxhash.xxh3_64_intdigest(unsigned + header_bytes)
    return _PREAMBLE.pack(MAGIC, version, len(header_bytes), digest, payload_offset)


def write_entry(writer: KvFileWriter) -> Header:
    """Run a writer's whole sequence; on any failure the temp file is removed."""
    writer.open()
    try:
        for index in range(writer.tensor_count):
            writer.write_tensor(index)
        return writer.commit()
    except BaseException:
        writer.abort()
        raise


def save(
    path: Path | str,
    caches: Sequence[Any],
    tokens: Sequence[int],
    meta: EntryMeta | Mapping[str, Any] | None = None,
    *,
    disk: Disk | None = None,
    keyring: KeyRing | None = None,
) -> Header:
    """Write an entry atomically to `path` and return its header; sealed
    under the ring's first key when `keyring` is given.

    Raises `UnknownCacheKind` / `RefusedCacheKind` for caches without a codec,
    `UsageError` when the caches' offsets disagree with `tokens`, and
    `DiskError` when the file system fails (the temp file is removed).
    """
    return write_entry(KvFileWriter(Path(path), caches, tokens, meta, disk, keyring=keyring))


def _read_exact(disk: Disk, handle: Any, offset: int, length: int, part: str, path: Path) -> bytearray:
    buffer = bytearray(length)
    got = disk.read_into(handle, offset, memoryview(buffer))
    if got != length:
        raise CorruptEntry(f"{path}: truncated {part} ({got} of {length} bytes)", part=part)
    return buffer


# One page: a longer first read runs into the payload (the header ends before
# the first 16 KiB boundary past it), and a startup scan paid for those pages,
# often read from disk, at every file. A longer header takes a second read.
_FIRST_READ_BYTES = 4 * 1024


_HeaderRecord = TypeVar("_HeaderRecord", Header, HeaderSummary)


def _read_header_from(
    disk: Disk,
    handle: Any,
    path: Path,
    size_bytes: int | None = None,
    safeguards: Safeguards = SAFEGUARDS,
    keyring: KeyRing | None = None,
) -> Header:
    """Parse and check the preamble and header, every record structured."""
    return _read_checked_header(disk, handle, path, size_bytes, safeguards, Header, keyring)


def _read_checked_header(
    disk: Disk,
    handle: Any,
    path: Path,
    size_bytes: int | None,
    safeguards: Safeguards,
    record: type[_HeaderRecord],
    keyring: KeyRing | None = None,
) -> _HeaderRecord:
    """Parse and check the preamble and header into `record` (`Header`, or
    `HeaderSummary` for a scan). One read covers both for headers up to
    ~4 KiB, two for longer ones, never a payload byte (a startup scan reads
    thousands of them); `size_bytes`, when the caller already knows it,
    saves an fstat. Every check but the structure of the cache records runs
    for either record. A sealed header comes back with its token ids opened
    (`_open_token_ids`)."""
    first = bytearray(_FIRST_READ_BYTES)
    got = disk.read_into(handle, 0, memoryview(first))
    if got == 0 or first[: min(got, len(MAGIC))] != MAGIC[: min(got, len(MAGIC))]:
        raise UnsupportedFormat(f"{path}: not a .kvc file (bad magic)")
    if got < PREAMBLE_BYTES:
        raise CorruptEntry(f"{path}: truncated preamble ({got} of {PREAMBLE_BYTES} bytes)", part="preamble")
    _, version, header_length, header_digest, payload_offset = _PREAMBLE.unpack_from(first)
    if version not in READABLE_FORMAT_VERSIONS:
        readable = ", ".join(str(v) for v in sorted(READABLE_FORMAT_VERSIONS))
        raise UnsupportedFormat(f"{path}: format version {version}; this build reads versions {readable}")
    if header_length > _HEADER_BYTES_MAX:
        raise CorruptEntry(f"{path}: header length {header_length} is implausible", part="header")
    header_end = PREAMBLE_BYTES + header_length
    if header_end <= got:
        header_bytes = memoryview(first)[PREAMBLE_BYTES:header_end]
    else:
        header_bytes = memoryview(_read_exact(disk, handle, PREAMBLE_BYTES, header_length, "header", path))
    hasher = xxhash.xxh3_64(_PREAMBLE.pack(MAGIC, version, header_length, 0, payload_offset))
    hasher.update(header_bytes)
    if hasher.intdigest() != header_digest and safeguards.verify_checksums:
        raise CorruptEntry(f"{path}: header checksum mismatch", part="header")
    try:
        # The decoder reads the buffer in place: no copy of a header of 16 KB of token ids.
        header = from_cbor(header_bytes, record)
    except DecodeError as e:
        raise CorruptEntry(f"{path}: header checksum matches but it does not decode: {e}", part="header") from e
    if header.format_version != version or header.payload_offset != payload_offset:
        raise CorruptEntry(f"{path}: header disagrees with the preamble", part="header")
    is_checkpoint, is_sealed, has_companion = _FORMAT_PARTS[version]
    if (header.generation_checkpoint is not None) != is_checkpoint:
        raise CorruptEntry(f"{path}: a version {version} header with the wrong checkpoint part", part="header")
    if (header.seal is not None) != is_sealed:
        raise CorruptEntry(f"{path}: a version {version} header with the wrong seal part", part="header")
    if (header.companion is not None) != has_companion:
        raise CorruptEntry(f"{path}: a version {version} header with the wrong companion part", part="header")
    if isinstance(header, Header) and header.companion is not None:
        _check_companion_section(header, path)
    actual_bytes = size_bytes if size_bytes is not None else disk.size(handle)
    if actual_bytes < header.file_bytes:
        raise CorruptEntry(f"{path}: truncated ({actual_bytes} of {header.file_bytes} bytes)", part="size")
    if header.seal is not None:
        return attrs.evolve(
            header, token_ids=_open_token_ids(header_bytes, header.seal, header.token_ids, keyring, path)
        )
    return header


def _check_companion_section(header: Header, path: Path) -> None:
    """The companion section is the last cache record, and names the header's drafter."""
    last = header.caches[-1].signature if header.caches else ""
    if not last.startswith(f"{COMPANION_PREFIX}{header.companion}:"):
        raise CorruptEntry(f"{path}: the companion part names no companion section of its drafter", part="header")


def companion_bytes(header: Header | HeaderSummary, path: Path) -> int:
    """The payload bytes of an entry's companion section (the draft model's KV), 0
    without one; a summary's raw last record is decoded for it alone. Raises
    `CorruptEntry` for a companion part without a decodable last record."""
    if header.companion is None:
        return 0
    last = header.caches[-1] if header.caches else None
    try:
        record = last if isinstance(last, CacheRecord) else converter.structure(last, CacheRecord)
    except Exception as e:  # cattrs raises its own validation errors, TypeError and KeyError alike
        raise CorruptEntry(f"{path}: the companion section's record does not decode: {e}", part="header") from e
    return record_bytes(record)


def _open_token_ids(
    header_bytes: memoryview, seal: SealRecord, sealed_ids: bytes, keyring: KeyRing | None, path: Path
) -> bytes:
    """A sealed header's token ids. Their tag also authenticates every other
    header field (`sealing.header_binding`), so a header that opens is the
    one sealed with its payload. Raises `KeyUnavailable` without the key,
    `CorruptEntry(part="header")` when the tag fails."""
    if seal.algorithm != sealing.ALGORITHM:
        raise UnsupportedFormat(f"{path}: sealed with {seal.algorithm}; this build opens {sealing.ALGORITHM}")
    if keyring is None:
        raise KeyUnavailable(f"{path}: sealed under key {seal.key_id} and no encryption key given", key_id=seal.key_id)
    key = keyring.opening(seal.key_id)
    token_ids = sealing.open_bytes(key, seal, _binding_of_bytes(header_bytes), 0, sealed_ids)
    if token_ids is None:
        raise CorruptEntry(f"{path}: sealed header fails its tag (key {seal.key_id})", part="header")
    return token_ids


def _binding_of_bytes(header_bytes: memoryview) -> bytes:
    try:
        return sealing.header_binding(cbor2.loads(header_bytes))
    except (cbor2.CBORDecodeError, KeyError, TypeError, ValueError) as e:
        raise CorruptEntry(f"a sealed header does not decode: {e}", part="header") from e


def read_header(
    path: Path | str,
    *,
    disk: Disk | None = None,
    size_bytes: int | None = None,
    safeguards: Safeguards = SAFEGUARDS,
    keyring: KeyRing | None = None,
) -> Header:
    """Read and verify only the header (and that the file is long enough;
    pass `size_bytes` when a directory scan already knows the file's size).

    Raises `UnsupportedFormat` for a foreign file or another format version,
    `CorruptEntry` for a damaged header or a truncated file, `DiskError` when
    the file cannot be read, `KeyUnavailable` for a sealed entry whose key
    `keyring` lacks.
    """
    disk = disk or RealDisk()
    # A scan passes thousands of Paths: re-parsing each (`Path(path)`) cost about as much as building it.
    path = path if isinstance(path, Path) else Path(path)
    handle = disk.open_read(path)
    try:
        return _read_header_from(disk, handle, path, size_bytes, safeguards, keyring)
    finally:
        disk.close(handle)


def read_header_summary(
    path: Path,
    *,
    disk: Disk,
    size_bytes: int | None = None,
    safeguards: Safeguards = SAFEGUARDS,
    keyring: KeyRing | None = None,
) -> HeaderSummary:
    """`read_header` for a startup scan: the same reads and checks (magic,
    format version, header checksum, the header's agreement with the
    preamble, the file's length), decoded into `HeaderSummary`, which
    leaves the cache and tensor records unstructured: `load` structures
    and checks them when the entry is restored (measured: structuring them
    cost more than the CBOR parse of the whole header). Raises like
    `read_header`."""
    handle = disk.open_read(path)
    try:
        return _read_checked_header(disk, handle, path, size_bytes, safeguards, HeaderSummary, keyring)
    finally:
        disk.close(handle)


def load(
    path: Path | str,
    verify: bool = True,
    *,
    disk: Disk | None = None,
    safeguards: Safeguards = SAFEGUARDS,
    staged: bool | None = None,
    keyring: KeyRing | None = None,
) -> Entry:
    """Load an entry into fresh MLX-owned caches (a sealed one opened with `keyring`).

    The header checksum is always verified; tensor checksums when `verify`.
    Pipelined (`tensor_io.TensorReadPipeline`): each tensor is read straight
    into its final MLX array on a reader thread while this thread checksums
    the tensors already read; no host staging buffer, so the peak transient
    beyond the entry is nothing, and the file's pages are dropped once read.
    On a GPU with memory of its own (CUDA), or with `staged=True`, each
    tensor is instead `mx.load`ed through a file window
    (`staged_load.StagedTensorLoad`) so that no host write lands in the
    GPU's managed memory; `staged=None` asks `staged_load_wanted()`.
    Raises like `read_header`, plus `CorruptEntry(part="tensor <name>")` when
    a tensor fails its checksum or is cut short.
    """
    disk = disk or RealDisk()
    path = Path(path)
    handle = disk.open_read(path)
    try:
        header = _read_header_from(disk, handle, path, safeguards=safeguards, keyring=keyring)
        # A policy without checksum checks reads the tensors unchecked too.
        checked = verify and safeguards.verify_checksums
        use_staged = (staged if staged is not None else staged_load_wanted()) and disk.concurrent_io
        opener = _tensor_opener(header, keyring)
        # A sealed entry opens in place in the read pipeline: the staged GPU path does not open yet.
        caches = _read_caches(
            disk, handle, path, header, verify=checked, staged=use_staged and opener is None, opener=opener
        )
    finally:
        disk.close(handle)
    return Entry(caches=caches, tokens=header.tokens, header=header)


def load_image(
    image: bytes | bytearray | memoryview,
    verify: bool = True,
    *,
    name: str = "<received entry>",
    safeguards: Safeguards = SAFEGUARDS,
    staged: bool | None = None,
    keyring: KeyRing | None = None,
) -> Entry:
    """`load` of a `.kvc` file's bytes held in memory (a shared-tier
    download, restored before its SSD copy lands): the same checks and the
    same restore paths, through `image_disk.ImageDisk`; `name` only labels
    errors. The caller keeps `image` unchanged until this returns."""
    return load(Path(name), verify, disk=ImageDisk(image), safeguards=safeguards, staged=staged, keyring=keyring)


def staged_load_wanted(device: Any = None, cuda_available: Callable[[], bool] | None = None) -> bool:
    """Whether restores should stage through `mx.load` (`staged_load`): only
    where the default device is a GPU whose memory is not the host's, i.e.
    MLX's CUDA backend. Metal's memory is the host's and the CPU's is too;
    there, reading into the array's own memory copies nothing."""
    device = device if device is not None else mx.default_device()
    if device.type != mx.DeviceType.gpu:
        return False
    return bool((cuda_available or mx.cuda.is_available)())


def _tensor_opener(header: Header, keyring: KeyRing | None) -> tensor_io.TensorOpener | None:
    """What opens a sealed entry's tensors (the header already opened, so the key is in the ring)."""
    if header.seal is None or keyring is None:
        return None
    segments = {record.name: index + 1 for index, record in enumerate(header.tensor_records())}
    # The binding leaves out the token ids and checksums: the opened header gives the sealed one's.
    return tensor_io.TensorOpener(
        key=keyring.opening(header.seal.key_id), seal=header.seal, binding=_binding(header), segments=segments
    )


def _read_caches(
    disk: Disk,
    handle: Any,
    path: Path,
    header: Header,
    *,
    verify: bool,
    staged: bool,
    opener: tensor_io.TensorOpener | None = None,
) -> list[Any]:
    pipeline: tensor_io.TensorReadPipeline | staged_load.StagedTensorLoad
    if staged:
        pipeline = staged_load.StagedTensorLoad(disk, handle, path, verify=verify)
    else:
        pipeline = tensor_io.TensorReadPipeline(disk, handle, path, verify=verify, opener=opener)
    try:
        caches = codecs.rebuild_caches(header.caches, pipeline.allocate)
    except BaseException:
        pipeline.abandon()
        raise
    pipeline.finish()
    return caches


def verify_file(path: Path | str, *, disk: Disk | None = None, keyring: KeyRing | None = None) -> Header:
    """Check every byte of an entry without building caches: header checksum,
    size, every tensor checksum and, for a sealed entry, every tag (which
    needs its key in `keyring`). Raises like `load`."""
    disk = disk or RealDisk()
    path = Path(path)
    handle = disk.open_read(path)
    try:
        header = _read_header_from(disk, handle, path, keyring=keyring)
        opener = _tensor_opener(header, keyring)
        tag_bytes = sealing.TAG_BYTES if opener is not None else 0
        for record in header.tensor_records():
            part = f"tensor {record.name}"
            data = _read_exact(disk, handle, record.file_offset, record.length + tag_bytes, part, path)
            if _checksum(data) != record.checksum:
                raise CorruptEntry(f"{path}: checksum mismatch in {part}", part=part)
            ciphertext, tag = memoryview(data)[: record.length], data[record.length :]
            if opener is not None and not opener.open(record, [ciphertext], tag):
                raise CorruptEntry(f"{path}: {part} fails its tag", part=part)
    finally:
        disk.close(handle)
    return header


TensorReader = Callable[[TensorRecord], mx.array]
