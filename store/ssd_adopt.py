"""Adoption: committing an entry file fetched from elsewhere (a shared-tier
download, `store.shared_transfer`) into the SSD tier as if it had been stored
here.

`SsdStore` owns one `EntryAdopter` and hands it what adoption needs of the
store (its fingerprint, disk, policy, entry paths, entry ids, durable directories,
quarantine and indexing) as explicit values and callables, so this module
knows nothing of the store's index and lock and `SsdStore.adopt` keeps its
callers. Blocking file I/O throughout: call it off the Trio thread.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Protocol

import attrs
import numpy as np

from kvcellar.errors import CorruptEntry, DiskError, KeyUnavailable, UnsupportedFormat
from kvcellar.store import kvfile
from kvcellar.store.disk import Disk
from kvcellar.store.keyring import KeyRing
from kvcellar.store.safeguards import Safeguards

# `fill(write)` streams a file's bytes through `write`.
Fill = Callable[[Callable[[memoryview | bytes], None]], None]


class IndexWritten(Protocol):
    """Indexes a committed entry file, supersedes, evicts; returns the entry id (`fetched_since`:
    the index's `wipe_seq` as the fetch began, for the wipes' tombstones)."""

    def __call__(
        self,
        entry_id: str,
        namespace: str,
        path: Path,
        tokens: np.ndarray,
        header: kvfile.Header,
        *,
        fetched_since: int | None = None,
    ) -> str: ...


@attrs.frozen(kw_only=True)
class EntryAdopter:
    """Adopts fetched entry files into the SSD tier of fingerprint `fingerprint`."""

    fingerprint: str
    disk: Disk
    safeguards: Safeguards
    new_entry_id: Callable[[], str]
    entry_path: Callable[[str, str], Path]  # (namespace, entry id) -> the entry's file
    make_durable_dir: Callable[[Path], None]
    quarantine_file: Callable[[Path, str], None]  # (path, reason): a file that is not an indexed entry
    index_written: IndexWritten
    keyring: KeyRing | None = None  # opens a sealed file to check it

    def adopt(
        self,
        namespace: str,
        tokens: np.ndarray,
        fill: Fill,
        *,
        verify_tensors: bool = True,
        fetched_since: int | None = None,
    ) -> str:
        """`fill(write)` streams the file's bytes through `write` into a temp
        file beside its place; then the whole file is verified (header and
        size, and every tensor checksum unless `verify_tensors` is false: a
        caller that checked a digest of the whole file against a trusted
        record, since `restore` checks them again) and must carry this
        fingerprint, `namespace` and `tokens`; it is fsynced, renamed into
        place, directory-fsynced and indexed (supersession, eviction,
        `entry.stored`).

        Returns the new entry id. A file that fails a check (or for which
        `fill` raises `CorruptEntry`) is quarantined and the error re-raised;
        anything else `fill` raises (a broken download), any `DiskError` and
        `KeyUnavailable` (sealed under a key the ring lacks) remove the temp
        file and propagate. `fetched_since`: the index's `wipe_seq` before
        the fetch began (a wipe not done by then refuses the entry)."""
        entry_id = self.new_entry_id()
        path = self.entry_path(namespace, entry_id)
        temp_path = path.with_name(f".{path.name}.{entry_id}{kvfile.TEMP_SUFFIX}")
        self.make_durable_dir(path.parent)
        self._fill_temp_file(temp_path, fill)
        header = self._verified(temp_path, namespace, tokens, verify_tensors)
        self.disk.rename(temp_path, path)
        self.disk.fsync_dir(path.parent)
        token_array = np.asarray(header.token_array, dtype=np.uint32)
        return self.index_written(entry_id, namespace, path, token_array, header, fetched_since=fetched_since)

    def _fill_temp_file(self, temp_path: Path, fill: Fill) -> None:
        handle = self.disk.create_exclusive(temp_path)
        try:
            written = 0

            def write(data: memoryview | bytes) -> None:
                nonlocal written
                self.disk.write_at(handle, written, data)
                written += len(data)

            fill(write)
            self.disk.fsync(handle)
        except BaseException as e:
            with suppress(DiskError):
                self.disk.close(handle)
            if isinstance(e, CorruptEntry):
                self.quarantine_file(temp_path, str(e))  # bytes that failed the fetcher's own check
            else:
                with suppress(DiskError):
                    self.disk.unlink(temp_path)
            raise
        self.disk.close(handle)

    def _verified(self, temp_path: Path, namespace: str, tokens: np.ndarray, verify_tensors: bool) -> kvfile.Header:
        try:
            if verify_tensors:
                header = kvfile.verify_file(temp_path, disk=self.disk, keyring=self.keyring)
            else:
                header = kvfile.read_header(temp_path, disk=self.disk, safeguards=self.safeguards, keyring=self.keyring)
            if header.fingerprint.get("digest") != self.fingerprint:
                raise CorruptEntry(f"{temp_path}: fingerprint is not this directory's", part="header")
            if header.namespace != namespace:
                raise CorruptEntry(f"{temp_path}: namespace {header.namespace!r} is not {namespace!r}", part="header")
            if not np.array_equal(header.token_array, np.asarray(tokens, dtype=np.uint32)):
                raise CorruptEntry(f"{temp_path}: tokens differ from the expected ones", part="header")
        except (CorruptEntry, UnsupportedFormat) as e:
            self.quarantine_file(temp_path, str(e))
            raise
        except (DiskError, KeyUnavailable):
            # A disk failure, or bytes sealed under a key this server lacks (not damaged): removed, not kept.
            with suppress(DiskError):
                self.disk.unlink(temp_path)
            raise
        return header
