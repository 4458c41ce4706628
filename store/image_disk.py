"""A read-only `Disk` over one `.kvc` file's bytes held in memory.

A shared-tier download receives an entry's whole file before it is written
to the SSD tier; `kvfile.load_image` restores from those received bytes
through this disk (every check of a file restore: header checksum, size,
tensor checksums) while the SSD copy is persisted behind it
(`shared_transfer.persist_received`). It holds a view of the caller's buffer,
never a copy; the caller keeps the buffer unchanged while a load runs.
"""

from __future__ import annotations

import errno
from pathlib import Path

from kvcellar.errors import DiskError
from kvcellar.store.disk import DirEntry, FileHandle, FileStat

_HANDLE = 0


class ImageDisk:
    """The `Disk` of one image: `open_read` of any path opens it; everything that writes raises."""

    concurrent_io = True

    def __init__(self, image: bytes | bytearray | memoryview) -> None:
        self._image = memoryview(image).cast("B")

    def open_read(self, path: Path) -> FileHandle:
        return _HANDLE

    def read_into(self, handle: FileHandle, offset: int, buffer: memoryview) -> int:
        count = max(0, min(len(buffer), len(self._image) - offset))
        buffer[:count] = self._image[offset : offset + count]
        return count

    def size(self, handle: FileHandle) -> int:
        return len(self._image)

    def close(self, handle: FileHandle) -> None:
        return None

    def drop_cached(self, handle: FileHandle, offset: int, length: int) -> None:
        return None

    def start_writeback(self, handle: FileHandle, offset: int, length: int) -> None:
        return None

    def stat(self, path: Path) -> FileStat:
        return FileStat(size_bytes=len(self._image), mtime_ns=0, inode=0)

    def _read_only(self, *_: object) -> None:
        raise DiskError("an in-memory entry image is read-only", errno=errno.EROFS)

    def create_exclusive(self, path: Path) -> FileHandle:
        raise DiskError("an in-memory entry image is read-only", errno=errno.EROFS)

    def lock_exclusive(self, path: Path, owner: str) -> FileHandle:
        raise DiskError("an in-memory entry image is read-only", errno=errno.EROFS)

    def scandir(self, path: Path) -> list[DirEntry]:
        raise DiskError("an in-memory entry image has no directories", errno=errno.ENOTDIR)

    write_at = fsync = rename = fsync_dir = unlink = makedirs = utime = unlock = _read_only
