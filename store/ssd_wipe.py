"""A wipe's durable intent: one small file per unfinished wipe, under the fingerprint directory.

    <root>/<fingerprint>/wipes/<wipe_id>.wipe   the selector (canonical CBOR) || its xxh3-128 digest (16 bytes),
                                                fsynced, read back, then renamed in

The files are the database here too: the intent is durable before anything is removed (the
journal's `wipe.begun` row is written beside it but commits on the journal's own thread, later),
and it is unlinked only when every tier holds nothing the wipe selects. `SsdStore.open` reads the
intents left by a crash, installs their tombstones and removes their SSD entries before the tier
serves; the system finishes the other tiers and then the intent (`actors/wipes.py`). All I/O goes
through the `Disk`.

An intent must never decode to another selector, and a wipe must not begin on an intent that a
start cannot read: the digest catches a torn or flipped intent (a read that fails it is read
again: a flip on the way in is transient), and the temp file is read back before the rename, so
a write the device put in the wrong place (the simulator's misdirected writes) is written again
in a fresh file. The read-back goes through the page cache on a real disk, so it catches only
what the kernel saw; a misdirection below it leaves an intent that fails its digest at the next
start, which refuses to serve (`StoreError`, naming the file) rather than guess.
"""

from __future__ import annotations

import logging
from pathlib import Path

import xxhash

from kvcellar.errors import DiskError, StoreError
from kvcellar.serialization import from_cbor, to_cbor
from kvcellar.store.disk import Disk
from kvcellar.store.wipe import WipeSelector

log = logging.getLogger("kvcellar.ssd")

WIPE_DIR_NAME = "wipes"
WIPE_SUFFIX = ".wipe"
_TEMP_SUFFIX = ".tmp"
_INTENT_BYTES_MAX = 1 << 16
_DIGEST_BYTES = 16
# Writes of an intent before the wipe gives up (503), and reads before a start refuses.
_WRITE_TRIES = 3
_READ_TRIES = 3


def _sealed_intent(selector: WipeSelector) -> bytes:
    payload = to_cbor(selector)
    return payload + xxhash.xxh3_128_digest(payload)


def _opened_intent(data: bytes) -> bytes | None:
    """The intent's CBOR when its digest holds; None otherwise."""
    payload, digest = data[:-_DIGEST_BYTES], data[-_DIGEST_BYTES:]
    if len(data) <= _DIGEST_BYTES or xxhash.xxh3_128_digest(payload) != digest:
        return None
    return payload


class WipeIntents:
    """The intent files of the fingerprint directory `directory`."""

    def __init__(self, *, directory: Path, disk: Disk) -> None:
        self.directory = directory / WIPE_DIR_NAME
        self.disk = disk

    def path(self, wipe_id: str) -> Path:
        return self.directory / f"{wipe_id}{WIPE_SUFFIX}"

    def write(self, wipe_id: str, selector: WipeSelector) -> None:
        """Make the intent durable: write a temp file, fsync it, read it back, rename it in, fsync
        the directory. Raises `DiskError`: a wipe whose intent is not durable must not begin."""
        self.disk.makedirs(self.directory)
        self.disk.fsync_dir(self.directory.parent)
        target = self.path(wipe_id)
        temp = target.with_name(target.name + _TEMP_SUFFIX)
        data = _sealed_intent(selector)
        for attempt in range(1, _WRITE_TRIES + 1):
            if self._write_verified(temp, data):
                break
            log.warning("wipe intent %s did not read back as written (try %d of %d)", temp, attempt, _WRITE_TRIES)
            self.disk.unlink(temp)
        else:
            raise DiskError(f"wipe intent {target} did not read back as written after {_WRITE_TRIES} tries")
        self.disk.rename(temp, target)
        self.disk.fsync_dir(self.directory)

    def _write_verified(self, temp: Path, data: bytes) -> bool:
        handle = self.disk.create_exclusive(temp)
        try:
            self.disk.write_at(handle, 0, data)
            self.disk.fsync(handle)
        finally:
            self.disk.close(handle)
        return self._read_bytes(temp) == data

    def finish(self, wipe_id: str) -> None:
        """The wipe is done in every tier: its intent goes (durably, so a restart does not redo it;
        redoing it would only remove what was written since)."""
        self.disk.unlink(self.path(wipe_id))
        self.disk.fsync_dir(self.directory)

    def pending(self) -> list[tuple[str, WipeSelector]]:
        """The unfinished wipes, by id; temp files of intents never renamed in are reaped (that wipe
        never began). An unreadable intent is a `StoreError`: serving must not start with a wipe it
        cannot finish."""
        try:
            listing = self.disk.scandir(self.directory)
        except DiskError:
            return []
        pending: list[tuple[str, WipeSelector]] = []
        for item in sorted(listing, key=lambda d: d.name):
            path = self.directory / item.name
            if item.name.endswith(_TEMP_SUFFIX):
                self.disk.unlink(path)
            elif item.name.endswith(WIPE_SUFFIX):
                pending.append((item.name[: -len(WIPE_SUFFIX)], self._read(path)))
        return pending

    def _read(self, path: Path) -> WipeSelector:
        for _ in range(_READ_TRIES):
            payload = _opened_intent(self._read_bytes(path))
            if payload is not None:
                break
        else:
            raise StoreError(
                f"wipe intent {path} fails its digest {_READ_TRIES} times: it cannot be read, so the wipe it "
                "began cannot be finished; check the disk, then remove the file and wipe again through "
                "POST /admin/cache/wipe"
            )
        try:
            return from_cbor(payload, WipeSelector)
        except Exception as e:
            raise StoreError(f"wipe intent {path} cannot be read: {e}") from e

    def _read_bytes(self, path: Path) -> bytes:
        handle = self.disk.open_read(path)
        try:
            size = self.disk.size(handle)
            if size > _INTENT_BYTES_MAX:
                raise StoreError(f"wipe intent {path} is {size} bytes: not one this server wrote")
            buffer = bytearray(size)
            read = self.disk.read_into(handle, 0, memoryview(buffer))
        finally:
            self.disk.close(handle)
        return bytes(buffer[:read])
