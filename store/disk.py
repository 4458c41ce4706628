"""The `Disk` interface: every file-system call of the store goes through it.

The real implementation calls `os`; the simulator swaps in an in-memory disk
that loses, tears and reorders what was not synced, and injects faults. The
interface is deliberately small and positional (write/read at an offset), so a
simulated disk can model durability per byte range.

Crash-safety contract of an atomic file write, as kvcellar performs it:
create exclusively -> write -> fsync(file) -> rename -> fsync(directory).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno as errno_codes
import fcntl
import os
from pathlib import Path
from typing import Any, Protocol

import attrs

from kvcellar.errors import DirectoryLocked, DiskError

FileHandle = Any
"""An opaque handle returned by `create_exclusive` / `open_read`."""


@attrs.frozen(kw_only=True)
class FileStat:
    size_bytes: int
    mtime_ns: int
    inode: int


@attrs.frozen(kw_only=True)
class DirEntry:
    name: str
    is_dir: bool
    size_bytes: int
    mtime_ns: int


class Disk(Protocol):
    """What the store may ask of a file system. Every method raises
    `DiskError` (carrying the errno) when the operation fails, except
    `drop_cached` and `start_writeback`, which are advice and never raise. `concurrent_io`: whether
    the store may overlap this disk's calls with its own work on a helper
    thread (store/tensor_io.py); a disk that says no gets every call inline,
    in the same order (the simulator's, which runs on one thread)."""

    concurrent_io: bool

    def create_exclusive(self, path: Path) -> FileHandle: ...
    def open_read(self, path: Path) -> FileHandle: ...
    def write_at(self, handle: FileHandle, offset: int, data: bytes | memoryview) -> None: ...
    def read_into(self, handle: FileHandle, offset: int, buffer: memoryview) -> int: ...
    def size(self, handle: FileHandle) -> int: ...
    def fsync(self, handle: FileHandle) -> None: ...
    def close(self, handle: FileHandle) -> None: ...
    def rename(self, source: Path, target: Path) -> None: ...
    def fsync_dir(self, path: Path) -> None: ...
    def unlink(self, path: Path) -> None: ...
    def makedirs(self, path: Path) -> None: ...
    def scandir(self, path: Path) -> list[DirEntry]: ...
    def stat(self, path: Path) -> FileStat: ...
    def utime(self, path: Path, mtime_ns: int) -> None: ...
    def lock_exclusive(self, path: Path, owner: str) -> FileHandle: ...
    def unlock(self, handle: FileHandle) -> None: ...
    def drop_cached(self, handle: FileHandle, offset: int, length: int) -> None: ...
    def start_writeback(self, handle: FileHandle, offset: int, length: int) -> None: ...


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (so a rename or create inside it is durable);
    raises `OSError`. Also used for files outside the KV store's `Disk` domain
    (demo models, the shard digest memo)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _libc_sync_file_range() -> Any:
    """libc's `sync_file_range(fd, offset, nbytes, flags)` (Linux), or None
    where there is none; `os` does not wrap it."""
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).sync_file_range
    except (OSError, AttributeError, TypeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    function.restype = ctypes.c_int
    return function


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start writeback of the range's dirty pages, do not wait


def _disk_error(operation: str, path: object, e: OSError) -> DiskError:
    reason = os.strerror(e.errno) if e.errno else str(e)
    return DiskError(f"{operation} {path}: {reason}", errno=e.errno)


class RealDisk:
    """`Disk` on the real file system through `os` file descriptors."""

    concurrent_io = True

    def create_exclusive(self, path: Path) -> int:
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise _disk_error("create", path, e) from e

    def open_read(self, path: Path) -> int:
        try:
            return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise _disk_error("open", path, e) from e

    def write_at(self, handle: int, offset: int, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        try:
            while view:
                written = os.pwrite(handle, view, offset)
                if written == 0:
                    raise OSError(errno_codes.EIO, "pwrite wrote 0 bytes")
                view = view[written:]
                offset += written
        except OSError as e:
            raise _disk_error("write", f"fd {handle}", e) from e

    def read_into(self, handle: int, offset: int, buffer: memoryview) -> int:
        view = memoryview(buffer).cast("B")
        total = 0
        try:
            while total < len(view):
                got = os.preadv(handle, [view[total:]], offset + total)
                if got == 0:
                    break
                total += got
        except OSError as e:
            raise _disk_error("read", f"fd {handle}", e) from e
        return total

    def drop_cached(self, handle: int, offset: int, length: int) -> None:
        """Advise the kernel to drop the range's clean pages from the page
        cache (the bytes were just copied into memory the caller owns). Advice
        only: a file system that refuses it loses nothing, so nothing raises."""
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(handle, offset, length, os.POSIX_FADV_DONTNEED)

    def start_writeback(self, handle: int, offset: int, length: int) -> None:
        """Advise the kernel to start writing the range's dirty pages to the
        device now, without waiting (`sync_file_range(SYNC_FILE_RANGE_WRITE)`),
        so the device writes one tensor while the next is copied in and the
        commit's fsync waits for less. Durability is unchanged: only the fsync
        makes the bytes durable. Advice only: nothing raises, and a system
        without the call (not Linux) just writes back at the fsync."""
        if _SYNC_FILE_RANGE is not None:
            _SYNC_FILE_RANGE(handle, offset, length, _SYNC_FILE_RANGE_WRITE)

    def size(self, handle: int) -> int:
        try:
            return os.fstat(handle).st_size
        except OSError as e:
            raise _disk_error("stat", f"fd {handle}", e) from e

    def fsync(self, handle: int) -> None:
        try:
            os.fsync(handle)
        except OSError as e:
            raise _disk_error("fsync", f"fd {handle}", e) from e

    def close(self, handle: int) -> None:
        try:
            os.close(handle)
        except OSError as e:
            raise _disk_error("close", f"fd {handle}", e) from e

    def rename(self, source: Path, target: Path) -> None:
        try:
            os.replace(source, target)
        except OSError as e:
            raise _disk_error("rename", f"{source} -> {target}", e) from e

    def fsync_dir(self, path: Path) -> None:
        try:
            fsync_path(path)
        except OSError as e:
            raise _disk_error("fsync directory", path, e) from e

    def unlink(self, path: Path) -> None:
        try:
            os.unlink(path)
        except OSError as e:
            raise _disk_error("unlink", path, e) from e

    def makedirs(self, path: Path) -> None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise _disk_error("mkdir", path, e) from e

    def scandir(self, path: Path) -> list[DirEntry]:
        try:
            with os.scandir(path) as it:
                entries = []
                for entry in it:
                    st = entry.stat(follow_symlinks=False)
                    entries.append(
                        DirEntry(
                            name=entry.name,
                            is_dir=entry.is_dir(follow_symlinks=False),
                            size_bytes=st.st_size,
                            mtime_ns=st.st_mtime_ns,
                        )
                    )
                return entries
        except OSError as e:
            raise _disk_error("scandir", path, e) from e

    def stat(self, path: Path) -> FileStat:
        try:
            st = os.stat(path)
        except OSError as e:
            raise _disk_error("stat", path, e) from e
        return FileStat(size_bytes=st.st_size, mtime_ns=st.st_mtime_ns, inode=st.st_ino)

    def utime(self, path: Path, mtime_ns: int) -> None:
        try:
            os.utime(path, ns=(mtime_ns, mtime_ns))
        except OSError as e:
            raise _disk_error("utime", path, e) from e

    def lock_exclusive(self, path: Path, owner: str) -> int:
        """Take an exclusive advisory lock on `path` (created if needed) and
        record `owner` in it; raises `DirectoryLocked` naming the holder when
        another process has it. The lock dies with the process."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise _disk_error("open lock", path, e) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "an unknown process"
            os.close(fd)
            raise DirectoryLocked(f"{path.parent} is in use by {holder}") from None
        except OSError as e:
            os.close(fd)
            raise _disk_error("lock", path, e) from e
        os.ftruncate(fd, 0)
        os.pwrite(fd, owner.encode(), 0)
        return fd

    def unlock(self, handle: int) -> None:
        try:
            fcntl.flock(handle, fcntl.LOCK_UN)
        finally:
            os.close(handle)


@attrs.frozen(kw_only=True)
class DiskCall:
    operation: str
    path: str | None


class TracingDisk:
    """Wraps a `Disk` and records each call (operation and path), so tests and
    simulations can check the order of a crash-safety sequence."""

    _PATH_OPERATIONS = frozenset(
        {
            "create_exclusive",
            "open_read",
            "rename",
            "fsync_dir",
            "unlink",
            "makedirs",
            "scandir",
            "stat",
            "utime",
            "lock_exclusive",
        }
    )

    def __init__(self, inner: Disk) -> None:
        self.inner = inner
        self.concurrent_io = inner.concurrent_io
        self.calls: list[DiskCall] = []
        self._handle_paths: dict[int, str] = {}

    def __getattr__(self, operation: str) -> Any:
        method = getattr(self.inner, operation)

        def traced(*args: Any, **kwargs: Any) -> Any:
            path = self._describe(operation, args)
            self.calls.append(DiskCall(operation=operation, path=path))
            result = method(*args, **kwargs)
            if operation in ("create_exclusive", "open_read"):
                self._handle_paths[id(result) if not isinstance(result, int) else result] = str(args[0])
            return result

        return traced

    def _describe(self, operation: str, args: tuple[Any, ...]) -> str | None:
        if not args:
            return None
        if operation == "rename":
            return f"{args[0]} -> {args[1]}"
        if operation in self._PATH_OPERATIONS:
            return str(args[0])
        handle = args[0]
        return self._handle_paths.get(handle if isinstance(handle, int) else id(handle))


class ThrottledDisk:
    """Wraps a `Disk` so its reads and writes together move at most
    `bytes_per_s` (a slower disk, emulated: `serve --disk-throttle-mbps`, the
    restore-policy bench and tests). A token bucket with no burst: each
    read or write waits until the bytes before it would have passed at that
    rate, then runs; the wait happens on the calling thread, never under a
    lock, so concurrent callers share the rate. Every other call passes
    through. `bytes_per_s` may be changed between calls (a bench's sweep)."""

    def __init__(
        self,
        inner: Disk,
        bytes_per_s: float,
        *,
        clock_s: Any = None,
        sleep_s: Any = None,
    ) -> None:
        import threading
        import time

        if bytes_per_s <= 0:
            raise ValueError(f"a disk throttle needs a positive rate, not {bytes_per_s} bytes/s")
        self.inner = inner
        self.concurrent_io = inner.concurrent_io
        self.bytes_per_s = float(bytes_per_s)
        self._clock_s = clock_s if clock_s is not None else time.monotonic
        self._sleep_s = sleep_s if sleep_s is not None else time.sleep
        self._lock = threading.Lock()  # guards `_free_at_s` only, never held across I/O or a sleep
        self._free_at_s = 0.0

    def __getattr__(self, operation: str) -> Any:
        return getattr(self.inner, operation)

    def _wait_for(self, size_bytes: int) -> None:
        with self._lock:
            now = self._clock_s()
            start = max(now, self._free_at_s)
            self._free_at_s = start + size_bytes / self.bytes_per_s
            wait_s = self._free_at_s - now
        if wait_s > 0:
            self._sleep_s(wait_s)

    def read_into(self, handle: FileHandle, offset: int, buffer: memoryview) -> int:
        self._wait_for(buffer.nbytes)
        return self.inner.read_into(handle, offset, buffer)

    def write_at(self, handle: FileHandle, offset: int, data: bytes | memoryview) -> None:
        self._wait_for(len(data) if isinstance(data, bytes) else data.nbytes)
        self.inner.write_at(handle, offset, data)
