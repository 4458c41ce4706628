"""What a power loss leaves: the inode model of `SimDisk` and its crash rules.

A file is a durable image plus an ordered list of pending writes; a directory
is durable plus volatile entries, with its changes queued as `DirOp`s until
its fsync. The functions here decide, from an `rng`, what of the pending state
reaches the platter (see `sim_disk` for the model as a whole).
"""

from __future__ import annotations

import random

import attrs

SECTOR_SIZES_BYTES = (512, 4096)
PERSIST_PROBABILITY = 0.5
"""The chance that one pending directory operation, or one single-sector torn
write, persists."""


@attrs.define(eq=False)
class PendingWrite:
    offset: int
    data: bytes
    lost: bool = False
    """An fsync failed while this write was pending: it never becomes durable."""


@attrs.define(eq=False, kw_only=True)
class FileInode:
    number: int
    durable: bytearray
    volatile: bytearray
    pending: list[PendingWrite]
    mtime_ns: int
    durable_mtime_ns: int
    nlink: int = 0
    opened: int = 0


@attrs.define(eq=False, kw_only=True)
class DirectoryInode:
    number: int
    durable: dict[str, int]
    volatile: dict[str, int]
    mtime_ns: int
    nlink: int = 0


Inode = FileInode | DirectoryInode


@attrs.frozen(kw_only=True)
class DirOp:
    """A pending change of one directory: removals (name, inode) apply only
    while the name still points to that inode; then additions (name, inode)."""

    directory: int
    removals: tuple[tuple[str, int], ...] = ()
    additions: tuple[tuple[str, int], ...] = ()


def apply_write(image: bytearray, offset: int, data: bytes) -> None:
    end = offset + len(data)
    if end > len(image):
        image.extend(bytes(end - len(image)))
    image[offset:end] = data


def sector_pieces(offset: int, data: bytes, sector_bytes: int) -> list[tuple[int, bytes]]:
    """Split a write at sector boundaries of the file (not of the write)."""
    pieces = []
    cursor = offset
    end = offset + len(data)
    while cursor < end:
        boundary = min(end, (cursor // sector_bytes + 1) * sector_bytes)
        pieces.append((cursor, data[cursor - offset : boundary - offset]))
        cursor = boundary
    return pieces


def torn_pieces(write: PendingWrite, rng: random.Random) -> list[tuple[int, bytes]]:
    """The sectors of a torn write that reach the platter: a strict prefix, or
    a subset that is neither empty nor whole."""
    pieces = sector_pieces(write.offset, write.data, rng.choice(SECTOR_SIZES_BYTES))
    if len(pieces) < 2:
        return pieces if rng.random() < PERSIST_PROBABILITY else []
    if rng.random() < 0.5:
        return pieces[: rng.randrange(1, len(pieces))]
    mask = [rng.random() < 0.5 for _ in pieces]
    if all(mask) or not any(mask):
        flipped = rng.randrange(len(pieces))
        mask[flipped] = not mask[flipped]
    return [piece for piece, kept in zip(pieces, mask, strict=True) if kept]


def crash_image(file: FileInode, rng: random.Random) -> bytearray:
    """What a power loss leaves of one file's data."""
    image = bytearray(file.durable)
    order = list(range(len(file.pending)))
    if rng.random() < 0.5:
        rng.shuffle(order)
    for index in order:
        write = file.pending[index]
        if write.lost:
            continue
        outcome = rng.randrange(3)
        if outcome == 0:
            pieces = [(write.offset, write.data)]
        elif outcome == 1:
            pieces = []
        else:
            pieces = torn_pieces(write, rng)
        for offset, data in pieces:
            apply_write(image, offset, data)
    return image


def crash_entries(
    directories: list[DirectoryInode], operations: list[DirOp], rng: random.Random
) -> dict[int, dict[str, int]]:
    """Each directory's entries after a power loss."""
    entries = {directory.number: dict(directory.durable) for directory in directories}
    for operation in operations:
        if rng.random() >= PERSIST_PROBABILITY:
            continue
        target = entries[operation.directory]
        if any(target.get(name) != number for name, number in operation.removals):
            continue
        for name, _ in operation.removals:
            del target[name]
        for name, number in operation.additions:
            target[name] = number
    return entries
