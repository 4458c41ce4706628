"""Moving a `.kvc` entry's tensor bytes between the file and MLX, overlapped.

Restore (`TensorReadPipeline`): each tensor is allocated as its final MLX
array (step-rounded capacity, `mx.zeros`: MLX has no uninitialised
allocation, its `mx.empty` is `mx.zeros`), and a reader thread `preadv`s the
tensor's rows from the file straight into that array's memory while the
calling thread checksums the tensors already read. There is no host staging
buffer and no host-to-MLX copy, so the peak transient beyond the restored
entry itself is nothing but the page cache, whose pages the reader drops
(`Disk.drop_cached`) once read, in batches of `DROP_BATCH_BYTES`: each drop
call has a fixed cost (the kernel drains every CPU's page lists when a
just-read page is still on one), about 1-2 ms, which per 8 MiB tensor was a
third of a warm load. The zero-fill runs on the calling thread, so its page
faults overlap the reader's copies; the slack rows are zero from it.

Save (`write_and_hash`): one tensor's segments are written by a helper thread
while the calling thread checksums them, and the written range's writeback
is started at once (`Disk.start_writeback`), so the device writes while the
next tensor is copied in instead of all at the commit's fsync; the commit
protocol around it is the caller's (`kvfile.KvFileWriter`).

Threads: the caller (the engine thread) does every MLX call, allocation
included; the reader and writer threads only move bytes through `Disk` into or
out of memory that the caller owns and does not touch until they are done.
Disk calls keep the sequential order (one thread issues them), and a load
whose checksum fails still lets the reader finish its reads before it raises,
so the sequence of disk calls does not depend on thread timing.

A sealed entry (`store.sealing`) reads the same way: the reader reads each
tensor's ciphertext into the array and its tag beside it; the calling thread
opens it in place (`TensorOpener`) while the next is read, so a sealed load
needs no buffer either, and its GCM tag stands in for the checksum.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
import xxhash

from kvcellar.errors import CorruptEntry
from kvcellar.store import codecs, sealing
from kvcellar.store.disk import Disk
from kvcellar.store.keyring import EncryptionKey
from kvcellar.store.records import SealRecord, TensorRecord

_MLX_DTYPES: dict[str, Any] = {
    "float32": mx.float32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "uint32": mx.uint32,
    "int32": mx.int32,
    "uint16": mx.uint16,
    "int16": mx.int16,
    "uint8": mx.uint8,
    "int8": mx.int8,
    "int64": mx.int64,
    "uint64": mx.uint64,
    "bool": mx.bool_,
}


@attrs.frozen(kw_only=True)
class _ReadJob:
    """One tensor: where its bytes go (`(file offset, destination)` per
    contiguous run, in file order) and the array that owns the memory."""

    record: TensorRecord
    runs: tuple[tuple[int, memoryview], ...]
    # A sealed tensor's GCM tag, read right after its ciphertext (None: not sealed).
    tag: bytearray | None = None


@attrs.frozen(kw_only=True)
class TensorOpener:
    """Opens a sealed entry's tensors: its key, seal and header binding, and
    each tensor's segment number by name (tensor i of the file is segment i + 1)."""

    key: EncryptionKey
    seal: SealRecord
    binding: bytes
    segments: Mapping[str, int]

    def open(self, record: TensorRecord, runs: Sequence[memoryview], tag: bytes | bytearray) -> bool:
        """Decrypt the tensor's ciphertext in place; False when its tag fails."""
        segment = self.segments[record.name]
        return sealing.open_in_place(self.key, self.seal, self.binding, segment, runs, bytes(tag))


_FINISHED = object()
OVERLAP_BYTES_MIN = 1 << 20
# Read bytes whose pages may wait in the page cache before one drop call: bounds
# the cache's copy of an entry being loaded to this plus one tensor.
DROP_BATCH_BYTES = 64 << 20


def _mlx_dtype(record: TensorRecord) -> Any:
    codecs.host_dtype(record.dtype)  # raises CorruptEntry for a dtype this build does not read
    return _MLX_DTYPES[record.dtype]


def _allocate(record: TensorRecord, capacity_rows: int | None, path: Path) -> tuple[mx.array, _ReadJob]:
    """The final MLX array of one tensor (zero-filled, so its slack rows are
    zero) and the runs the reader fills: with a capacity, each leading slot's
    rows are contiguous in the file and land at the start of its slot."""
    part = f"tensor {record.name}"
    shape = tuple(record.shape)
    dtype = _mlx_dtype(record)
    if int(np.prod(shape, dtype=np.int64)) * dtype.size != record.length:
        raise CorruptEntry(f"{path}: {part} shape {shape} does not match its {record.length} bytes", part="header")
    padded = capacity_rows is not None and len(shape) >= 2 and capacity_rows > shape[-2]
    full_shape = (*shape[:-2], capacity_rows, shape[-1]) if padded and capacity_rows else shape
    array = mx.zeros(full_shape, dtype=dtype)
    mx.eval(array)
    flat = memoryview(array).cast("B")  # type: ignore[arg-type]  # stubs omit mx.array's buffer protocol
    if not padded:
        return array, _ReadJob(record=record, runs=((record.file_offset, flat),))
    row_bytes = shape[-1] * dtype.size
    slot_bytes = full_shape[-2] * row_bytes
    kept_bytes = shape[-2] * row_bytes
    runs = tuple(
        (record.file_offset + slot * kept_bytes, flat[slot * slot_bytes : slot * slot_bytes + kept_bytes])
        for slot in range(len(flat) // slot_bytes)
    )
    return array, _ReadJob(record=record, runs=runs)


class TensorReadPipeline:
    """Reads one entry's tensors on a reader thread while the caller verifies.

    `allocate(record, capacity_rows)` (the codecs' `TensorReader`) returns the
    tensor's final array at once and queues its read; `finish()` checksums each
    tensor as its read completes, waits for the reader and raises the first
    failure; `abandon()` stops it after a failure elsewhere. Arrays handed out
    hold their bytes only once `finish()` returned.
    """

    def __init__(
        self,
        disk: Disk,
        handle: Any,
        path: Path,
        *,
        verify: bool,
        drop_batch_bytes: int = DROP_BATCH_BYTES,
        opener: TensorOpener | None = None,
    ) -> None:
        self._disk = disk
        self._opener = opener
        self._handle = handle
        self._path = path
        self._verify = verify
        self._drop_batch_bytes = drop_batch_bytes
        # The file range read but not yet dropped from the page cache: [start, end). Reader's only.
        self._undropped: tuple[int, int] | None = None
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._failed = False
        # A disk without concurrent I/O (the simulator's) reads each tensor inline in `allocate`.
        self._thread: threading.Thread | None = None
        if disk.concurrent_io:
            self._thread = threading.Thread(target=self._read_all, name="kvc-reader", daemon=True)
            self._thread.start()

    def allocate(self, record: TensorRecord, capacity_rows: int | None = None) -> mx.array:
        array, job = _allocate(record, capacity_rows, self._path)
        if self._opener is not None:
            job = attrs.evolve(job, tag=bytearray(sealing.TAG_BYTES))
        if self._thread is None:
            self._read_one(job)
        else:
            self._jobs.put(job)
        return array

    def _read_all(self) -> None:
        while (job := self._jobs.get()) is not _FINISHED:
            self._read_one(job)
        self._drop_undropped()
        self._done.put(_FINISHED)

    def _read_one(self, job: _ReadJob) -> None:
        if self._failed:
            return  # after a failed read nothing more is read: the order of disk calls stays fixed
        try:
            self._read(job)
        except BaseException as e:  # handed to the caller, who re-raises it
            self._failed = True
            self._done.put((job, e))
            return
        self._done.put((job, None))

    def _stop_reader(self) -> None:
        """Tell the reader (or, inline, the result queue) that no job follows."""
        if self._thread is None:
            self._drop_undropped()
            self._done.put(_FINISHED)
        else:
            self._jobs.put(_FINISHED)

    def _read(self, job: _ReadJob) -> None:
        record = job.record
        for offset, destination in job.runs:
            got = self._disk.read_into(self._handle, offset, destination)
            if got != len(destination):
                raise CorruptEntry(f"{self._path}: truncated tensor {record.name}", part=f"tensor {record.name}")
        end = record.file_offset + record.length
        if job.tag is not None:
            if self._disk.read_into(self._handle, end, memoryview(job.tag)) != len(job.tag):
                raise CorruptEntry(f"{self._path}: truncated tensor {record.name}", part=f"tensor {record.name}")
            end += len(job.tag)
        # The bytes now live in the MLX array: the page cache's copy would only double the entry.
        start = record.file_offset if self._undropped is None else self._undropped[0]
        self._undropped = (start, end)
        if self._undropped[1] - start >= self._drop_batch_bytes:
            self._drop_undropped()

    def _drop_undropped(self) -> None:
        if self._undropped is not None:
            start, end = self._undropped
            self._disk.drop_cached(self._handle, start, end - start)
            self._undropped = None

    def finish(self) -> None:
        """Verify every tensor as it arrives; raise the first failure once the reader stopped."""
        self._stop_reader()
        first_error: BaseException | None = None
        while (item := self._done.get()) is not _FINISHED:
            job, error = item
            if first_error is None:
                first_error = error if error is not None else self._check(job)
        if self._thread is not None:
            self._thread.join()
        if first_error is not None:
            raise first_error

    def _check(self, job: _ReadJob) -> CorruptEntry | None:
        """Checksum a plain tensor; open a sealed one in place, its GCM tag
        being its check (always: unauthenticated plaintext is never handed
        out, and its xxh3 over the ciphertext would only check the same bytes
        twice; `verify_file` still checks both)."""
        part = f"tensor {job.record.name}"
        if self._opener is not None and job.tag is not None:
            runs = [destination for _, destination in job.runs]
            if not self._opener.open(job.record, runs, job.tag):
                return CorruptEntry(f"{self._path}: {part} fails its tag", part=part)
            return None
        if not self._verify:
            return None
        hasher = xxhash.xxh3_64()
        for _, destination in job.runs:
            hasher.update(destination)
        if hasher.digest() == job.record.checksum:
            return None
        return CorruptEntry(f"{self._path}: checksum mismatch in {part}", part=part)

    def abandon(self) -> None:
        """Stop after a failure outside the pipeline; swallows the reader's own errors."""
        self._stop_reader()
        while self._done.get() is not _FINISHED:
            pass
        if self._thread is not None:
            self._thread.join()


def write_and_hash(disk: Disk, handle: Any, offset: int, segments: Sequence[memoryview]) -> bytes:
    """Write `segments` back to back from `offset` on a helper thread while
    this thread checksums them, then start the range's writeback; returns the
    xxh3-64 digest of their bytes.
    Raises the write's error (after the helper stopped) when it fails.
    A tensor under `OVERLAP_BYTES_MIN` is written and hashed inline: a thread
    start would cost more than the overlap saves; so is every tensor on a disk
    without `concurrent_io`."""
    total_bytes = sum(segment.nbytes for segment in segments)
    if not disk.concurrent_io or total_bytes < OVERLAP_BYTES_MIN:
        hasher = xxhash.xxh3_64()
        cursor = offset
        for segment in segments:
            hasher.update(segment)
            disk.write_at(handle, cursor, segment)
            cursor += segment.nbytes
        disk.start_writeback(handle, offset, total_bytes)
        return hasher.digest()
    failure: list[BaseException] = []

    def write_all() -> None:
        cursor = offset
        try:
            for segment in segments:
                disk.write_at(handle, cursor, segment)
                cursor += segment.nbytes
            disk.start_writeback(handle, offset, total_bytes)
        except BaseException as e:  # re-raised on the calling thread below
            failure.append(e)

    writer = threading.Thread(target=write_all, name="kvc-writer", daemon=True)
    writer.start()
    hasher = xxhash.xxh3_64()
    try:
        for segment in segments:
            hasher.update(segment)
    finally:
        writer.join()
    if failure:
        raise failure[0]
    return hasher.digest()


# Pieces a streamed write may hold queued for its writer thread: bounds its memory to this many pieces.
STREAM_QUEUE_PIECES = 4


def write_stream_and_hash(
    disk: Disk, handle: Any, offset: int, pieces: Iterable[bytes], writer: StreamWriter | None = None
) -> bytes:
    """`write_and_hash` for bytes made while they are written (a sealed
    tensor's ciphertext, `sealing.seal_segments`): this thread makes and
    hashes each piece and queues it, a helper thread writes them back to back
    from `offset`, so sealing overlaps writing and at most
    `STREAM_QUEUE_PIECES` pieces wait. Returns the xxh3-64 digest; raises the
    write's error (after the helper stopped). Inline on a disk without
    `concurrent_io`. With `writer` (the file's one `StreamWriter`) the pieces
    join its queue and this returns without waiting for them: the next
    tensor is sealed while this one's last pieces are written, and the
    writer's `finish` raises any error."""
    hasher = xxhash.xxh3_64()
    if not disk.concurrent_io:
        cursor = offset
        for piece in pieces:
            hasher.update(piece)
            disk.write_at(handle, cursor, piece)
            cursor += len(piece)
        disk.start_writeback(handle, offset, cursor - offset)
        return hasher.digest()
    own = writer is None
    stream = StreamWriter(disk, handle) if writer is None else writer
    cursor = offset
    try:
        for piece in pieces:
            hasher.update(piece)
            stream.write(cursor, piece)
            cursor += len(piece)
        stream.written(offset, cursor - offset)
    finally:
        if own:
            stream.finish()
    return hasher.digest()


class StreamWriter:
    """One helper thread writing a file's queued pieces at their offsets, in
    order (at most `STREAM_QUEUE_PIECES` wait). `finish` waits for them and
    raises the first write error; after an error the rest are drained
    unwritten, so a producer never blocks on a full queue. Owned by the
    thread that makes the pieces (`KvFileWriter`'s writing thread)."""

    def __init__(self, disk: Disk, handle: Any) -> None:
        self._disk = disk
        self._handle = handle
        self._queued: queue.Queue[Any] = queue.Queue(maxsize=STREAM_QUEUE_PIECES)
        self._failure: list[BaseException] = []
        self._thread = threading.Thread(target=self._write_all, name="kvc-writer", daemon=True)
        self._thread.start()
        self._finished = False

    def write(self, offset: int, piece: bytes) -> None:
        self._queued.put((offset, piece))

    def written(self, offset: int, length: int) -> None:
        """A tensor's bytes are all queued: start their writeback after them."""
        self._queued.put((offset, length))

    def finish(self) -> None:
        if not self._finished:
            self._finished = True
            self._queued.put(_FINISHED)
            self._thread.join()
        if self._failure:
            raise self._failure[0]

    def _write_all(self) -> None:
        while (item := self._queued.get()) is not _FINISHED:
            if self._failure:
                continue
            offset, data = item
            try:
                if isinstance(data, int):
                    self._disk.start_writeback(self._handle, offset, data)
                else:
                    self._disk.write_at(self._handle, offset, data)
            except BaseException as e:  # re-raised on the producing thread by `finish`
                self._failure.append(e)
