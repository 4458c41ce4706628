"""A wipe's durable intent: one small file per unfinished wipe, under the fingerprint directory.

    <root>/<fingerprint>/wipes/<wipe_id>.wipe   the selector (canonical CBOR), fsynced, then renamed in

The files are the database here too: the intent is durable before anything is removed (the
journal's `wipe.begun` row is written beside it but commits on the journal's own thread, later),
and it is unlinked only when every tier holds nothing the wipe selects. `SsdStore.open` reads the
intents left by a crash, installs their tombstones and removes their SSD entries before the tier
serves; the system finishes the other tiers and then the intent (`actors/wipes.py`). All I/O goes
through the `Disk`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from kvcellar.errors import DiskError, StoreError
from kvcellar.serialization import from_cbor, to_cbor
from kvcellar.store.disk import Disk
from kvcellar.store.wipe import WipeSelector

log = logging.getLogger("kvcellar.ssd")

WIPE_DIR_NAME = "wipes"
WIPE_SUFFIX = ".wipe"
_TEMP_SUFFIX = ".tmp"
_INTENT_BYTES_MAX = 1 << 16


class WipeIntents:
    """The intent files of the fingerprint directory `directory`."""

    def __init__(self, *, directory: Path, disk: Disk) -> None:
        self.directory = directory / WIPE_DIR_NAME
        self.disk = disk

    def path(self, wipe_id: str) -> Path:
        return self.directory / f"{wipe_id}{WIPE_SUFFIX}"

    def write(self, wipe_id: str, selector: WipeSelector) -> None:
        """Make the intent durable: write a temp file, fsync it, rename it in, fsync the directory.
        Raises `DiskError`: a wipe whose intent is not durable must not begin."""
        self.disk.makedirs(self.directory)
        self.disk.fsync_dir(self.directory.parent)
        target = self.path(wipe_id)
        temp = target.with_name(target.name + _TEMP_SUFFIX)
        handle = self.disk.create_exclusive(temp)
        try:
            self.disk.write_at(handle, 0, to_cbor(selector))
            self.disk.fsync(handle)
        finally:
            self.disk.close(handle)
        self.disk.rename(temp, target)
        self.disk.fsync_dir(self.directory)

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
        handle = self.disk.open_read(path)
        try:
            size = self.disk.size(handle)
            if size > _INTENT_BYTES_MAX:
                raise StoreError(f"wipe intent {path} is {size} bytes: not one this server wrote")
            buffer = bytearray(size)
            read = self.disk.read_into(handle, 0, memoryview(buffer))
        finally:
            self.disk.close(handle)
        try:
            return from_cbor(bytes(buffer[:read]), WipeSelector)
        except Exception as e:
            raise StoreError(f"wipe intent {path} cannot be read: {e}") from e
