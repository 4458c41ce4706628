"""Restore for a GPU whose memory is not the host's (MLX's CUDA backend).

`tensor_io.TensorReadPipeline` reads each tensor straight into its final
array's memory through `memoryview(array)`. On Apple silicon and on the CPU
that memory is the host's, and nothing is copied. On CUDA it is not:
`memoryview` of an MLX array moves the array into managed memory, the host
writes land there, and the first kernel that reads them page-faults them into
the GPU at 8-11 GB/s, so the first decode step after a restore cost 10-90x a
normal one (shared/docs/mlx-notes.md, "MLX on CUDA").

`StagedTensorLoad` never writes into an MLX array from Python. Each tensor
becomes an `mx.load` of a `TensorWindow`, a file-like object that presents a
`.npy` header followed by the tensor's bytes, which it reads from the entry
file at the tensor's offset when MLX asks. MLX's `Load` primitive reads into
its own host buffer and copies it into device memory explicitly
(`cudaMemcpyAsync`), so the restored arrays are ordinary device arrays and
the first step costs what every step costs. On the CPU backend the same
primitive reads straight into the array, which is what the tests exercise.

Checksums: a window reads its tensor in `CHUNK_BYTES` chunks and hands each
chunk to a hasher thread while it reads the next one (`os.preadv` and xxh3
both run without the GIL for most of their time), and it returns to MLX only
once every chunk is hashed: MLX frees its host buffer right after. A failed or
short read is recorded in the window and answered with zeros, never raised
into MLX's reader (an exception there would surface as MLX's own error);
`finish()` raises it as `CorruptEntry` / `DiskError` after the evaluation.

Capacity: a tensor restored into step-rounded capacity is loaded at that
capacity, the window answering zeros for each slot's slack rows, so there is
no zero-fill pass and no padding copy. Arrays are evaluated in groups of
`EVAL_GROUP_BYTES` (on CUDA, MLX's host staging buffer of each is freed once
its copy is done). The entry's file pages are dropped from the page cache
once, after the last read (the host's transient is the entry's page-cache
copy; the GPU holds the arrays).

Threads: the caller (the engine thread) makes every MLX call; the windows'
reads run on whichever thread MLX evaluates `Load` on, and only move bytes
through `Disk` into the buffer MLX hands them.
"""

from __future__ import annotations

import io
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, cast

import mlx.core as mx
import numpy as np
import xxhash

from kvcellar.errors import CorruptEntry
from kvcellar.store import codecs
from kvcellar.store.disk import Disk
from kvcellar.store.records import TensorRecord

CHUNK_BYTES = 16 << 20
EVAL_GROUP_BYTES = 256 << 20

# The array-protocol type strings MLX's `.npy` reader parses (`dtype_from_array_protocol`):
# bf16 is "V2", its own spelling for a 2-byte opaque type.
_NPY_DESCR: dict[str, str] = {
    "float32": "<f4",
    "float16": "<f2",
    "bfloat16": "<V2",
    "uint32": "<u4",
    "int32": "<i4",
    "uint16": "<u2",
    "int16": "<i2",
    "uint8": "|u1",
    "int8": "|i1",
    "int64": "<i8",
    "uint64": "<u8",
    "bool": "|b1",
}


def npy_header(dtype: str, shape: tuple[int, ...]) -> bytes:
    """A version-1 `.npy` preamble and header, in the exact layout MLX's
    reader expects (it reads the type string at a fixed position), padded so
    the data starts at a multiple of 16."""
    dims = "".join(f"{dim}, " for dim in shape)
    text = f"{{'descr': '{_NPY_DESCR[dtype]}', 'fortran_order': False, 'shape': ({dims})}}"
    padding = (6 + 2 + 2 + len(text) + 1) % 16
    text = text + " " * ((16 - padding) % 16) + "\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text.encode("ascii")


class TensorWindow(io.RawIOBase):
    """One tensor of an entry file seen as a `.npy` file (see the module
    docstring). With `capacity_rows` past the persisted rows, the array it
    describes has that many rows: each leading slot's persisted rows come from
    the file (they are contiguous there) and its slack rows are zeros, so the
    restored array needs neither a zero-fill pass nor a padding copy."""

    def __init__(
        self,
        disk: Disk,
        handle: Any,
        record: TensorRecord,
        hasher: ThreadPoolExecutor | None,
        capacity_rows: int | None = None,
    ) -> None:
        super().__init__()
        self._disk = disk
        self._handle = handle
        self.record = record
        shape = tuple(record.shape)
        padded = capacity_rows is not None and len(shape) >= 2 and capacity_rows > shape[-2]
        full_shape = (*shape[:-2], capacity_rows, shape[-1]) if padded and capacity_rows else shape
        # Bytes of one leading slot in the array and, of those, the ones the file holds.
        self._kept_bytes = record.length // max(1, int(np.prod(shape[:-2], dtype=np.int64))) if padded else 0
        self._slot_bytes = self._kept_bytes * full_shape[-2] // shape[-2] if padded else 0
        self._header = npy_header(record.dtype, full_shape)
        data_bytes = record.length + (record.length // shape[-2] * (full_shape[-2] - shape[-2]) if padded else 0)
        self._size = len(self._header) + data_bytes
        self._position = 0
        self._hasher = hasher
        self._hash = xxhash.xxh3_64()
        self.error: BaseException | None = None
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = base + offset
        return self._position

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        count = min(len(target), max(0, self._size - self._position))
        header_part = max(0, min(count, len(self._header) - self._position))
        if header_part:
            target[:header_part] = self._header[self._position : self._position + header_part]
        if count > header_part:
            data_start = self._position + header_part - len(self._header)
            self._fill(target[header_part:count], data_start)
        self._position += count
        return count

    def _pieces(self, data_start: int, length: int) -> list[tuple[int, int, int | None]]:
        """(target offset, length, file offset or None for slack zeros) covering the array's bytes
        [data_start, data_start + length), each file piece at most `CHUNK_BYTES`."""
        pieces: list[tuple[int, int, int | None]] = []
        position, end = data_start, data_start + length
        while position < end:
            if not self._slot_bytes:
                file_at: int | None = position
                size = min(CHUNK_BYTES, end - position)
            else:
                slot, within = divmod(position, self._slot_bytes)
                if within < self._kept_bytes:
                    file_at = slot * self._kept_bytes + within
                    size = min(CHUNK_BYTES, self._kept_bytes - within, end - position)
                else:
                    file_at, size = None, min(self._slot_bytes - within, end - position)
            pieces.append((position - data_start, size, file_at))
            position += size
        return pieces

    def _fill(self, target: memoryview, data_start: int) -> None:
        """Fill `target` with the array's bytes from `data_start`, hashing file piece i while reading piece i+1."""
        pending: Future[None] | None = None
        try:
            for at, size, file_at in self._pieces(data_start, len(target)):
                chunk = target[at : at + size]
                if file_at is None:
                    chunk[:] = bytes(size)
                    continue
                if self.error is None:
                    self._read_chunk(chunk, file_at)
                else:
                    chunk[:] = bytes(size)
                if pending is not None:
                    pending.result()
                pending = self._hash_chunk(chunk)
        finally:
            if pending is not None:
                pending.result()

    def _read_chunk(self, chunk: memoryview, data_offset: int) -> None:
        name = self.record.name
        try:
            got = self._disk.read_into(self._handle, self.record.file_offset + data_offset, chunk)
        except BaseException as e:  # raised by `finish` on the engine thread, never into MLX's reader
            self.error = e
            got = 0
        if got != len(chunk):
            chunk[got:] = bytes(len(chunk) - got)
            if self.error is None:
                self.error = CorruptEntry(f"truncated tensor {name}", part=f"tensor {name}")
        self.bytes_read += got

    def _hash_chunk(self, chunk: memoryview) -> Future[None] | None:
        if self._hasher is None:
            return None
        return self._hasher.submit(self._hash.update, chunk)

    def digest(self) -> bytes:
        return self._hash.digest()


class StagedTensorLoad:
    """The `TensorReader` of a restore on a GPU with its own memory: the same
    `allocate` / `finish` / `abandon` surface as `tensor_io.TensorReadPipeline`."""

    def __init__(self, disk: Disk, handle: Any, path: Path, *, verify: bool) -> None:
        self._disk = disk
        self._handle = handle
        self._path = path
        self._verify = verify
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvc-hash") if verify else None
        self._windows: list[TensorWindow] = []
        self._pending: list[mx.array] = []
        self._pending_bytes = 0

    def allocate(self, record: TensorRecord, capacity_rows: int | None = None) -> mx.array:
        shape = tuple(record.shape)
        dtype_size = np.dtype(codecs.host_dtype(record.dtype)).itemsize
        if int(np.prod(shape, dtype=np.int64)) * dtype_size != record.length:
            part = f"tensor {record.name}"
            raise CorruptEntry(
                f"{self._path}: {part} shape {shape} does not match its {record.length} bytes", part="header"
            )
        window = TensorWindow(self._disk, self._handle, record, self._hasher, capacity_rows)
        self._windows.append(window)
        array = mx.load(cast(BinaryIO, window), format="npy")
        assert isinstance(array, mx.array)
        self._pending.append(array)
        self._pending_bytes += record.length
        if self._pending_bytes >= EVAL_GROUP_BYTES:
            self._evaluate_pending()
        return array

    def _evaluate_pending(self) -> None:
        mx.eval(self._pending)
        self._pending = []
        self._pending_bytes = 0

    def finish(self) -> None:
        """Evaluate what is left, then raise the first read failure or checksum mismatch."""
        try:
            self._evaluate_pending()
        finally:
            self._close()
        for window in self._windows:
            if window.error is not None:
                raise _as_entry_error(window.error, self._path)
            if self._verify and window.digest() != window.record.checksum:
                part = f"tensor {window.record.name}"
                raise CorruptEntry(f"{self._path}: checksum mismatch in {part}", part=part)

    def abandon(self) -> None:
        """Drop the unevaluated loads after a failure elsewhere (nothing was read for them)."""
        self._pending = []
        self._close()

    def _close(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)
        read = [window.record for window in self._windows if window.bytes_read]
        if read:
            start = min(record.file_offset for record in read)
            end = max(record.file_offset + record.length for record in read)
            self._disk.drop_cached(self._handle, start, end - start)


def _as_entry_error(error: BaseException, path: Path) -> BaseException:
    """A window's recorded failure as the restore raises it: a short read names the file; a
    `DiskError` (or anything else) is raised as it was."""
    if isinstance(error, CorruptEntry):
        return CorruptEntry(f"{path}: {error}", part=error.part)
    return error
