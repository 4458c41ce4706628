"""`SimDisk`: an in-memory `Disk` that promises what Linux promises and no more.

Files are inodes with a durable image and an ordered list of pending
(unsynced) writes; reads see the volatile view (the page cache). Directories
hold durable and volatile entries; create, rename, unlink and makedirs are
pending directory operations until `fsync_dir` of that directory. `fsync`
makes one file's data durable, never its name; `close` syncs nothing.

`crash(rng)` is a power loss. Per file, pending writes are applied in order or
shuffled; each is kept, dropped or torn at 512- or 4096-byte sectors aligned to
file offsets (a prefix or a subset of its sectors; an unwritten gap reads as
zeros). Then each pending directory operation persists or reverts on its own,
in order, skipping one whose removal no longer finds the inode it removed; an
inode no directory reaches afterwards is gone. A rename within one directory
is one operation (it persists whole); across directories it is a removal in
the source and an addition in the target, each durable through its own
directory. Afterwards the durable image equals the volatile one, every handle
is invalid (EBADF) and every lock released. `crash_clean()` is a kill -9:
nothing is lost, pending stays pending, handles and locks drop.

Metadata: an mtime set by a write or `utime` is durable after `fsync` of the
file; otherwise a crash keeps it or reverts it. Directory mtimes are not
modelled for durability (a crash keeps them). Truncating the lock file (as
`RealDisk.lock_exclusive` does) is durable at once; the owner text is a
pending write.

Faults (`FaultConfig`, `simulations/sim_faults.py`, drawn from the disk's own `random.Random`):
- fsync EIO: the file's pending writes are marked lost ("fsyncgate"): still
  readable, a later successful fsync skips them, a crash drops them.
- write ENOSPC / EIO: a random 512-byte-aligned prefix (maybe empty) of the
  data is written, then `DiskError`. `bytes_max` likewise writes what fits,
  then raises ENOSPC (a short pwrite, then the retry fails).
- read bit flip: one bit of the returned bytes flips; the file is unchanged.
- misdirected write: the data lands one 512- or 4096-byte sector away, silently.

Crash points: every `Disk` call is op number `ops_done + 1`; when it equals
`crash_at_op` the call raises `SimulatedCrash` before doing anything, and every
later call raises it again until `crash()` or `crash_clean()`. `crash_point()`
adds a counted crash point for work outside the disk (a journal commit).

Paths (str or Path) are normalised to `PurePosixPath`; relative ones are taken
under `root`, and paths outside `root` do not exist (ENOENT), except that
`makedirs` and `fsync_dir` of an ancestor of `root` succeed and do nothing. All iteration is
over insertion-ordered dicts or sorted names, so the same seed and the same
calls give the same state.
"""

from __future__ import annotations

import errno as errno_codes
import functools
import hashlib
import os
import posixpath
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any, Concatenate, ParamSpec, TypeVar

import attrs

from kvcellar.errors import DirectoryLocked, DiskError, SimulatedCrash
from kvcellar.simulations.sim_faults import FaultConfig, TickClock
from kvcellar.simulations.sim_platter import (
    PERSIST_PROBABILITY,
    SECTOR_SIZES_BYTES,
    DirectoryInode,
    DirOp,
    FileInode,
    Inode,
    PendingWrite,
    apply_write,
    crash_entries,
    crash_image,
)
from kvcellar.store.disk import DirEntry, FileStat

ROOT_DEFAULT = PurePosixPath("/sim")
_ROOT_INODE = 1
# Calls after which a power loss leaves what it would have left before them: they
# change only handles, open counts and locks, which a crash resets anyway.
CRASH_NEUTRAL_OPERATIONS = frozenset(
    {"open_read", "read_into", "size", "scandir", "stat", "close", "unlock", "crash_point"}
)


@attrs.define(eq=False)
class SimHandle:
    """An open file of a `SimDisk`; invalid after a crash."""

    disk: SimDisk = attrs.field(repr=False)
    inode: int
    path: PurePosixPath
    readable: bool
    writable: bool
    generation: int
    is_lock: bool = False
    closed: bool = False


def _error(operation: str, subject: object, code: int) -> DiskError:
    return DiskError(f"{operation} {subject}: {os.strerror(code)}", errno=code)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _operation(method: Callable[Concatenate[SimDisk, _P], _R]) -> Callable[Concatenate[SimDisk, _P], _R]:
    """A `Disk` call: counted, traced, and a possible crash point."""
    name = method.__name__

    @functools.wraps(method)
    def run(self: SimDisk, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._mutex:
            self._enter(name, args)
            return method(self, *args, **kwargs)

    return run


def _copy_inode(inode: Inode) -> Inode:
    """An inode sharing nothing a crash or a later call changes (pending
    writes are only read by a crash, and replaced whole)."""
    if isinstance(inode, DirectoryInode):
        return attrs.evolve(inode, durable=dict(inode.durable), volatile=dict(inode.volatile))
    return attrs.evolve(
        inode, durable=bytearray(inode.durable), volatile=bytearray(inode.volatile), pending=list(inode.pending)
    )


class SimDisk:
    """An in-memory `Disk` with crash and fault simulation (see the module
    docstring for the model). Thread-safe: one mutex serialises all calls.
    `concurrent_io` is off: a simulated run starts no thread, so the store's
    pipelined reads and writes run inline, in the same order of calls."""

    concurrent_io = False

    def __init__(
        self,
        *,
        rng: random.Random | None = None,
        root: PurePosixPath | str = ROOT_DEFAULT,
        clock_ns: Callable[[], int] | None = None,
        faults: FaultConfig | None = None,
        bytes_max: int | None = None,
        trace: bool = False,
    ) -> None:
        self.rng = rng if rng is not None else random.Random(0)
        self.root = PurePosixPath(posixpath.normpath(str(root)))
        if not self.root.is_absolute():
            raise ValueError(f"root must be absolute, got {root}")
        self.clock_ns = clock_ns if clock_ns is not None else TickClock()
        self.faults = faults if faults is not None else FaultConfig()
        self.bytes_max = bytes_max
        self.crash_at_op: int | None = None
        self.ops_done = 0
        self.trace: list[tuple[str, str | None]] | None = [] if trace else None
        # Told of every `Disk` call (not crash points): the simulator's ownership checks.
        self.on_operation: Callable[[str, str | None], None] | None = None
        # Told of each crash point (`ops_done + 1`, the call's name) before it runs, unless it is the one
        # `crash_at_op` fires at (the run crashes there itself): the crash images.
        self.before_operation: Callable[[int, str], None] | None = None
        self.crashes = 0
        # Calls so far that may have changed what a power loss leaves (all but the crash-neutral ones), and crashes.
        self.changes = 0
        self._mutex = threading.RLock()
        self._parts_by_path: dict[str, tuple[str, ...]] = {}
        self._above_root_by_path: dict[str, bool] = {}
        self._crashed = False
        self._generation = 0
        self._next_inode = _ROOT_INODE
        now_ns = self.clock_ns()
        self._inodes: dict[int, Inode] = {}
        self._new_directory(now_ns).nlink = 1
        self._dir_ops: list[DirOp] = []
        self._locks: dict[int, str] = {}

    # -- crash points and faults ---------------------------------------------

    def _enter(self, name: str, args: tuple[Any, ...]) -> None:
        subject = self._describe(name, args)
        if self._crashed:
            raise SimulatedCrash(f"the disk crashed; call crash() or crash_clean() before {name} {subject}")
        number = self.ops_done + 1
        if self.before_operation is not None and self.crash_at_op != number:
            self.before_operation(number, name)
        if self.crash_at_op == number:
            self._crashed = True
            self.crash_at_op = None
            raise SimulatedCrash(f"crash point at op {number}: {name} {subject}")
        self.ops_done = number
        if name not in CRASH_NEUTRAL_OPERATIONS:
            self.changes += 1
        if self.trace is not None:
            self.trace.append((name, subject))
        if self.on_operation is not None and name != "crash_point":
            self.on_operation(name, subject)

    @staticmethod
    def _describe(name: str, args: tuple[Any, ...]) -> str | None:
        if not args:
            return None
        if name == "rename" and len(args) >= 2:
            return f"{args[0]} -> {args[1]}"
        if isinstance(args[0], SimHandle):
            return str(args[0].path)
        return str(args[0]) if isinstance(args[0], (str, os.PathLike)) else None

    def crash_point(self, label: str) -> None:
        """A crash point outside the `Disk` interface (a journal commit, say):
        counted and traced like a `Disk` call; changes nothing."""
        with self._mutex:
            self._enter("crash_point", (label,))

    @property
    def crashed(self) -> bool:
        """Whether a crash point fired and `crash()`/`crash_clean()` is due."""
        return self._crashed

    def faults_off(self) -> None:
        self.faults = FaultConfig()

    def _roll(self, rate: float) -> bool:
        return rate > 0.0 and self.rng.random() < rate

    # -- inodes and paths ------------------------------------------------------

    def _new_inode_number(self) -> int:
        number = self._next_inode
        self._next_inode += 1
        return number

    def _new_directory(self, now_ns: int) -> DirectoryInode:
        directory = DirectoryInode(number=self._new_inode_number(), durable={}, volatile={}, mtime_ns=now_ns)
        self._inodes[directory.number] = directory
        return directory

    def _new_file(self, now_ns: int) -> FileInode:
        file = FileInode(
            number=self._new_inode_number(),
            durable=bytearray(),
            volatile=bytearray(),
            pending=[],
            mtime_ns=now_ns,
            durable_mtime_ns=now_ns,
        )
        self._inodes[file.number] = file
        return file

    def _parts(self, path: PurePosixPath | Path | str, operation: str) -> tuple[str, ...]:
        # Remembered per path text: a run names the same few hundred paths over and
        # over, and parsing them was a tenth of a crash image's time.
        text = path if isinstance(path, str) else str(path)
        parts = self._parts_by_path.get(text)
        if parts is None:
            pure = PurePosixPath(posixpath.normpath(str(self.root / PurePosixPath(text))))
            try:
                parts = pure.relative_to(self.root).parts
            except ValueError:
                raise _error(operation, path, errno_codes.ENOENT) from None
            self._parts_by_path[text] = parts
        return parts

    def _is_above_root(self, path: PurePosixPath | Path | str) -> bool:
        """Whether `path` is a strict ancestor of the root: those exist durably
        for `makedirs` and `fsync_dir` (a caller syncing up the tree), and for
        nothing else."""
        text = path if isinstance(path, str) else str(path)
        above = self._above_root_by_path.get(text)
        if above is None:
            pure = PurePosixPath(posixpath.normpath(str(self.root / PurePosixPath(text))))
            above = self._above_root_by_path[text] = pure in self.root.parents
        return above

    def _directory_at(self, parts: tuple[str, ...], operation: str, path: object) -> DirectoryInode:
        directory = self._inodes[_ROOT_INODE]
        for name in parts:
            assert isinstance(directory, DirectoryInode)
            number = directory.volatile.get(name)
            if number is None:
                raise _error(operation, path, errno_codes.ENOENT)
            directory = self._inodes[number]
            if isinstance(directory, FileInode):
                raise _error(operation, path, errno_codes.ENOTDIR)
        assert isinstance(directory, DirectoryInode)
        return directory

    def _parent(self, path: PurePosixPath | Path | str, operation: str) -> tuple[DirectoryInode, str]:
        parts = self._parts(path, operation)
        if not parts:
            raise _error(operation, path, errno_codes.EBUSY)
        return self._directory_at(parts[:-1], operation, path), parts[-1]

    def _lookup(self, path: PurePosixPath | Path | str, operation: str) -> Inode:
        parts = self._parts(path, operation)
        if not parts:
            return self._inodes[_ROOT_INODE]
        parent = self._directory_at(parts[:-1], operation, path)
        number = parent.volatile.get(parts[-1])
        if number is None:
            raise _error(operation, path, errno_codes.ENOENT)
        return self._inodes[number]

    def _change(
        self,
        directory: DirectoryInode,
        *,
        removals: tuple[tuple[str, int], ...] = (),
        additions: tuple[tuple[str, int], ...] = (),
    ) -> None:
        """Apply a directory change to the volatile view and queue it for a crash."""
        for name, number in removals:
            del directory.volatile[name]
            self._inodes[number].nlink -= 1
        for name, number in additions:
            replaced = directory.volatile.get(name)
            if replaced is not None:
                self._inodes[replaced].nlink -= 1
            directory.volatile[name] = number
            self._inodes[number].nlink += 1
        directory.mtime_ns = self.clock_ns()
        self._dir_ops.append(DirOp(directory=directory.number, removals=removals, additions=additions))

    def _open(
        self, file: FileInode, path: object, *, readable: bool, writable: bool, is_lock: bool = False
    ) -> SimHandle:
        file.opened += 1
        return SimHandle(
            disk=self,
            inode=file.number,
            path=PurePosixPath(str(path)),
            readable=readable,
            writable=writable,
            generation=self._generation,
            is_lock=is_lock,
        )

    def _file_of(self, handle: SimHandle, operation: str, *, reading: bool = False, writing: bool = False) -> FileInode:
        valid = (
            isinstance(handle, SimHandle)
            and handle.disk is self
            and not handle.closed
            and handle.generation == self._generation
        )
        if not valid or (reading and not handle.readable) or (writing and not handle.writable):
            raise _error(operation, getattr(handle, "path", handle), errno_codes.EBADF)
        file = self._inodes[handle.inode]
        assert isinstance(file, FileInode)
        return file

    # -- the Disk interface: files ---------------------------------------------

    @_operation
    def create_exclusive(self, path: PurePosixPath | Path | str) -> SimHandle:
        parent, name = self._parent(path, "create")
        if name in parent.volatile:
            raise _error("create", path, errno_codes.EEXIST)
        file = self._new_file(self.clock_ns())
        self._change(parent, additions=((name, file.number),))
        return self._open(file, path, readable=False, writable=True)

    @_operation
    def open_read(self, path: PurePosixPath | Path | str) -> SimHandle:
        inode = self._lookup(path, "open")
        if isinstance(inode, DirectoryInode):
            raise _error("open", path, errno_codes.EISDIR)
        return self._open(inode, path, readable=True, writable=False)

    @_operation
    def write_at(self, handle: SimHandle, offset: int, data: bytes | memoryview) -> None:
        file = self._file_of(handle, "write", writing=True)
        if offset < 0:
            raise _error("write", handle.path, errno_codes.EINVAL)
        payload = bytes(memoryview(data).cast("B"))
        failure = None
        if self._roll(self.faults.write_enospc_rate):
            failure = errno_codes.ENOSPC
        elif self._roll(self.faults.write_eio_rate):
            failure = errno_codes.EIO
        elif self._roll(self.faults.misdirected_write_rate):
            offset = self._misdirected(offset)
        length = len(payload)
        if failure is not None:
            length = min(length, self.rng.randrange(length // 512 + 1) * 512)
        fitting = self._bytes_fitting(file, offset, len(payload))
        if fitting < length:
            length, failure = fitting, errno_codes.ENOSPC
        if length:
            self._write(file, offset, payload[:length])
        if failure is not None:
            raise _error("write", handle.path, failure)

    def _misdirected(self, offset: int) -> int:
        shift_bytes = self.rng.choice(SECTOR_SIZES_BYTES)
        if offset >= shift_bytes and self.rng.random() < 0.5:
            return offset - shift_bytes
        return offset + shift_bytes

    def _bytes_fitting(self, file: FileInode, offset: int, length: int) -> int:
        """How many bytes of a write at `offset` fit under `bytes_max`."""
        if self.bytes_max is None:
            return length
        room = self.bytes_max - self.bytes_used()
        return max(0, min(length, len(file.volatile) + room - offset))

    def _write(self, file: FileInode, offset: int, data: bytes) -> None:
        apply_write(file.volatile, offset, data)
        file.pending.append(PendingWrite(offset, data))
        file.mtime_ns = self.clock_ns()

    @_operation
    def read_into(self, handle: SimHandle, offset: int, buffer: memoryview) -> int:
        file = self._file_of(handle, "read", reading=True)
        if offset < 0:
            raise _error("read", handle.path, errno_codes.EINVAL)
        view = memoryview(buffer).cast("B")
        chunk = file.volatile[offset : offset + len(view)]
        view[: len(chunk)] = chunk
        if chunk and self._roll(self.faults.read_bitflip_rate):
            bit = self.rng.randrange(len(chunk) * 8)
            view[bit // 8] ^= 1 << (bit % 8)
        return len(chunk)

    def drop_cached(self, handle: SimHandle, offset: int, length: int) -> None:
        """Page-cache advice: a simulated disk has no page cache, and advice
        is no operation (no fault roll, no clock step), so it changes nothing."""

    def start_writeback(self, handle: SimHandle, offset: int, length: int) -> None:
        """Writeback advice: a simulated disk makes bytes durable only at an
        fsync, and advice is no operation (no fault roll, no clock step)."""

    @_operation
    def size(self, handle: SimHandle) -> int:
        return len(self._file_of(handle, "stat").volatile)

    @_operation
    def fsync(self, handle: SimHandle) -> None:
        self._sync(self._file_of(handle, "fsync"), handle.path)

    def _sync(self, file: FileInode, subject: object) -> None:
        if self._roll(self.faults.fsync_eio_rate):
            for write in file.pending:
                write.lost = True
            raise _error("fsync", subject, errno_codes.EIO)
        for write in file.pending:
            if not write.lost:
                apply_write(file.durable, write.offset, write.data)
        file.pending.clear()
        file.durable_mtime_ns = file.mtime_ns

    @_operation
    def close(self, handle: SimHandle) -> None:
        file = self._file_of(handle, "close")
        self._release(handle, file)

    def _release(self, handle: SimHandle, file: FileInode) -> None:
        handle.closed = True
        file.opened -= 1
        if handle.is_lock:
            self._locks.pop(file.number, None)

    # -- the Disk interface: names ---------------------------------------------

    @_operation
    def rename(self, source: PurePosixPath | Path | str, target: PurePosixPath | Path | str) -> None:
        subject = f"{source} -> {target}"
        source_parent, source_name = self._parent(source, "rename")
        number = source_parent.volatile.get(source_name)
        if number is None:
            raise _error("rename", subject, errno_codes.ENOENT)
        target_parent, target_name = self._parent(target, "rename")
        replaced = target_parent.volatile.get(target_name)
        if replaced == number:
            return
        self._check_rename(number, replaced, source, target, subject)
        if source_parent is target_parent:
            self._change(source_parent, removals=((source_name, number),), additions=((target_name, number),))
        else:
            self._change(source_parent, removals=((source_name, number),))
            self._change(target_parent, additions=((target_name, number),))

    def _check_rename(
        self,
        number: int,
        replaced: int | None,
        source: PurePosixPath | Path | str,
        target: PurePosixPath | Path | str,
        subject: str,
    ) -> None:
        moving_dir = isinstance(self._inodes[number], DirectoryInode)
        if replaced is not None:
            onto = self._inodes[replaced]
            if isinstance(onto, DirectoryInode) and not moving_dir:
                raise _error("rename", subject, errno_codes.EISDIR)
            if isinstance(onto, FileInode) and moving_dir:
                raise _error("rename", subject, errno_codes.ENOTDIR)
            if isinstance(onto, DirectoryInode) and onto.volatile:
                raise _error("rename", subject, errno_codes.ENOTEMPTY)
        source_parts = self._parts(source, "rename")
        if moving_dir and self._parts(target, "rename")[: len(source_parts)] == source_parts:
            raise _error("rename", subject, errno_codes.EINVAL)

    @_operation
    def fsync_dir(self, path: PurePosixPath | Path | str) -> None:
        if self._is_above_root(path):
            return
        inode = self._lookup(path, "fsync directory")
        if isinstance(inode, FileInode):
            self._sync(inode, path)
            return
        inode.durable = dict(inode.volatile)
        self._dir_ops = [op for op in self._dir_ops if op.directory != inode.number]

    @_operation
    def unlink(self, path: PurePosixPath | Path | str) -> None:
        parent, name = self._parent(path, "unlink")
        number = parent.volatile.get(name)
        if number is None:
            raise _error("unlink", path, errno_codes.ENOENT)
        if isinstance(self._inodes[number], DirectoryInode):
            raise _error("unlink", path, errno_codes.EISDIR)
        self._change(parent, removals=((name, number),))

    @_operation
    def makedirs(self, path: PurePosixPath | Path | str) -> None:
        if self._is_above_root(path):
            return
        parts = self._parts(path, "mkdir")
        directory = self._inodes[_ROOT_INODE]
        for depth, name in enumerate(parts, start=1):
            assert isinstance(directory, DirectoryInode)
            number = directory.volatile.get(name)
            if number is None:
                child = self._new_directory(self.clock_ns())
                self._change(directory, additions=((name, child.number),))
                directory = child
                continue
            directory = self._inodes[number]
            if isinstance(directory, FileInode):
                raise _error("mkdir", path, errno_codes.EEXIST if depth == len(parts) else errno_codes.ENOTDIR)

    @_operation
    def scandir(self, path: PurePosixPath | Path | str) -> list[DirEntry]:
        inode = self._lookup(path, "scandir")
        if isinstance(inode, FileInode):
            raise _error("scandir", path, errno_codes.ENOTDIR)
        entries = []
        for name in sorted(inode.volatile):
            child = self._inodes[inode.volatile[name]]
            size_bytes = len(child.volatile) if isinstance(child, FileInode) else 0
            entries.append(
                DirEntry(
                    name=name, is_dir=isinstance(child, DirectoryInode), size_bytes=size_bytes, mtime_ns=child.mtime_ns
                )
            )
        return entries

    @_operation
    def stat(self, path: PurePosixPath | Path | str) -> FileStat:
        inode = self._lookup(path, "stat")
        size_bytes = len(inode.volatile) if isinstance(inode, FileInode) else 0
        return FileStat(size_bytes=size_bytes, mtime_ns=inode.mtime_ns, inode=inode.number)

    @_operation
    def utime(self, path: PurePosixPath | Path | str, mtime_ns: int) -> None:
        self._lookup(path, "utime").mtime_ns = mtime_ns

    @_operation
    def lock_exclusive(self, path: PurePosixPath | Path | str, owner: str) -> SimHandle:
        """Like `RealDisk.lock_exclusive`: one lock table per `SimDisk`, so a
        second holder (any caller) gets `DirectoryLocked` naming the first."""
        parent, name = self._parent(path, "open lock")
        number = parent.volatile.get(name)
        if number is None:
            file = self._new_file(self.clock_ns())
            self._change(parent, additions=((name, file.number),))
        else:
            found = self._inodes[number]
            if isinstance(found, DirectoryInode):
                raise _error("open lock", path, errno_codes.EISDIR)
            file = found
        holder = self._locks.get(file.number)
        if holder is not None:
            raise DirectoryLocked(f"{PurePosixPath(str(path)).parent} is in use by {holder}")
        self._locks[file.number] = owner
        file.durable.clear()
        file.volatile.clear()
        file.pending.clear()
        self._write(file, 0, owner.encode())
        return self._open(file, path, readable=True, writable=True, is_lock=True)

    @_operation
    def unlock(self, handle: SimHandle) -> None:
        file = self._file_of(handle, "unlock")
        self._release(handle, file)

    # -- crashes ----------------------------------------------------------------

    def crash(self, rng: random.Random) -> None:
        """Power loss: install what the platter holds (see the module docstring)."""
        with self._mutex:
            files = [inode for inode in self._inodes.values() if isinstance(inode, FileInode)]
            images = {file.number: crash_image(file, rng) for file in files}
            directories = [inode for inode in self._inodes.values() if isinstance(inode, DirectoryInode)]
            entries = crash_entries(directories, self._dir_ops, rng)
            survivors = self._reachable(entries)
            self._inodes = {number: self._inodes[number] for number in survivors}
            for number in survivors:
                self._install(self._inodes[number], images, entries, rng)
            for inode in self._inodes.values():
                if isinstance(inode, DirectoryInode):
                    for child in inode.volatile.values():
                        self._inodes[child].nlink += 1
            self._inodes[_ROOT_INODE].nlink = 1
            self._dir_ops = []
            self._process_died()
            self.crashes += 1
            self.changes += 1

    @staticmethod
    def _reachable(entries: dict[int, dict[str, int]]) -> list[int]:
        """Inode numbers reachable from the root, in ascending order."""
        seen = {_ROOT_INODE}
        frontier = [_ROOT_INODE]
        while frontier:
            number = frontier.pop()
            for child in entries.get(number, {}).values():
                if child not in seen:
                    seen.add(child)
                    frontier.append(child)
        return sorted(seen)

    @staticmethod
    def _install(
        inode: Inode, images: dict[int, bytearray], entries: dict[int, dict[str, int]], rng: random.Random
    ) -> None:
        inode.nlink = 0
        if isinstance(inode, DirectoryInode):
            inode.durable = entries[inode.number]
            inode.volatile = dict(inode.durable)
            return
        inode.durable = images[inode.number]
        inode.volatile = bytearray(inode.durable)
        inode.pending = []
        inode.opened = 0
        if inode.mtime_ns != inode.durable_mtime_ns and rng.random() >= PERSIST_PROBABILITY:
            inode.mtime_ns = inode.durable_mtime_ns
        inode.durable_mtime_ns = inode.mtime_ns

    def crashed_copy(self, rng: random.Random) -> SimDisk:
        """A new disk holding what a power loss now would leave (`crash(rng)`
        on a deep copy); this disk is unchanged. No faults, no trace."""
        with self._mutex:
            copied = SimDisk(rng=rng, root=self.root, clock_ns=self.clock_ns, bytes_max=self.bytes_max)
            copied._inodes = {number: _copy_inode(inode) for number, inode in self._inodes.items()}
            copied._dir_ops = list(self._dir_ops)
            copied._parts_by_path = self._parts_by_path
            copied._above_root_by_path = self._above_root_by_path
            copied._next_inode = self._next_inode
            copied._generation = self._generation
        copied.crash(rng)
        return copied

    def crash_clean(self) -> None:
        """The process died (kill -9) but the machine did not: nothing written
        is lost and pending stays pending; handles and locks drop."""
        with self._mutex:
            for inode in self._inodes.values():
                if isinstance(inode, FileInode):
                    inode.opened = 0
            self._process_died()

    def _process_died(self) -> None:
        self._generation += 1
        self._locks = {}
        self._crashed = False

    # -- inspection (not Disk calls: not counted, never crash points) ------------

    def _walk(self, durable: bool) -> Iterator[tuple[PurePosixPath, Inode]]:
        """(path relative to the root, inode) for every reachable name, depth
        first in name order; a directory cycle a crash left is not followed."""
        stack: list[tuple[PurePosixPath, int, tuple[int, ...]]] = [(PurePosixPath(), _ROOT_INODE, ())]
        while stack:
            relative, number, ancestors = stack.pop()
            inode = self._inodes.get(number)
            if inode is None:
                continue
            if relative.parts:
                yield relative, inode
            if isinstance(inode, DirectoryInode) and number not in ancestors:
                entries = inode.durable if durable else inode.volatile
                for name in sorted(entries, reverse=True):
                    stack.append((relative / name, entries[name], (*ancestors, number)))

    def files(self, *, durable: bool = False) -> dict[PurePosixPath, bytes]:
        """Every reachable file (relative path -> bytes) of the volatile view, or
        with `durable`, what a crash that loses everything pending would leave:
        durable entries and durable data."""
        with self._mutex:
            return {
                relative: bytes(inode.durable if durable else inode.volatile)
                for relative, inode in self._walk(durable)
                if isinstance(inode, FileInode)
            }

    def directories(self, *, durable: bool = False) -> list[PurePosixPath]:
        with self._mutex:
            return [relative for relative, inode in self._walk(durable) if isinstance(inode, DirectoryInode)]

    def read_bytes(self, path: PurePosixPath | Path | str) -> bytes:
        """The volatile content of a file; raises `DiskError` like `open_read`."""
        with self._mutex:
            inode = self._lookup(path, "open")
            if isinstance(inode, DirectoryInode):
                raise _error("open", path, errno_codes.EISDIR)
            return bytes(inode.volatile)

    def exists(self, path: PurePosixPath | Path | str) -> bool:
        with self._mutex:
            try:
                self._lookup(path, "stat")
            except DiskError:
                return False
            return True

    def pending_counts(self) -> tuple[int, int]:
        """(pending data writes over all files, pending directory operations)."""
        with self._mutex:
            writes = sum(len(inode.pending) for inode in self._inodes.values() if isinstance(inode, FileInode))
            return writes, len(self._dir_ops)

    def bytes_used(self) -> int:
        """Bytes of files that have a name or an open handle (volatile sizes)."""
        with self._mutex:
            return sum(
                len(inode.volatile)
                for inode in self._inodes.values()
                if isinstance(inode, FileInode) and (inode.nlink > 0 or inode.opened > 0)
            )

    def image_digest(self, *, durable: bool = False) -> str:
        """sha256 over the sorted paths, kinds and contents of the image."""
        digest = hashlib.sha256()
        with self._mutex:
            for relative, inode in sorted(self._walk(durable), key=lambda item: item[0].parts):
                kind = b"F" if isinstance(inode, FileInode) else b"D"
                digest.update(kind + str(relative).encode() + b"\0")
                if isinstance(inode, FileInode):
                    content = inode.durable if durable else inode.volatile
                    digest.update(len(content).to_bytes(8, "little") + bytes(content))
        return digest.hexdigest()

    def export_to(self, real_dir: Path, *, durable: bool = False) -> None:
        """Write the image (relative to the sim root) under `real_dir` on the
        real file system, with mtimes, for `kvcellar kv` / `kvcellar journal`."""
        real_dir = Path(real_dir)
        real_dir.mkdir(parents=True, exist_ok=True)
        with self._mutex:
            for relative, inode in list(self._walk(durable)):
                target = real_dir / relative
                if isinstance(inode, DirectoryInode):
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(bytes(inode.durable if durable else inode.volatile))
                mtime_ns = inode.durable_mtime_ns if durable else inode.mtime_ns
                os.utime(target, ns=(mtime_ns, mtime_ns))


__all__ = ["SECTOR_SIZES_BYTES", "FaultConfig", "SimDisk", "SimHandle", "SimulatedCrash", "TickClock"]
