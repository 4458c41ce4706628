"""Commit: planning an entry's write, and indexing a committed entry file.

A store is planned on the engine thread (`prepare_store`: no I/O beyond the
namespace directory, no MLX work), written by the writer (`kvfile.write_entry`,
a worker thread, each tensor possibly its own engine turn), and committed by
`finish_store` or `fail_store` on that worker thread. `index_written` also
commits adoptions (`store/ssd_adopt.py`). The mtime and the unlinks of what a
commit supersedes or evicts happen outside the index lock: `SsdIndex.commit`
decides the removals in one critical section and returns their files.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from kvcellar.errors import DiskError
from kvcellar.store import kvfile
from kvcellar.store.disk import Disk
from kvcellar.store.keyring import KeyRing
from kvcellar.store.safeguards import Safeguards
from kvcellar.store.ssd_files import TierFiles
from kvcellar.store.ssd_index import IndexedEntry, SsdIndex

log = logging.getLogger("kvcellar.ssd")


@attrs.frozen(kw_only=True)
class PendingStore:
    """A planned write: run `writer`, then `SsdStore.finish_store` or `fail_store`."""

    entry_id: str
    namespace: str
    tokens: np.ndarray
    writer: kvfile.KvFileWriter
    captured_epoch: int | None = None  # the RAM tier's wipe epoch when its caches were taken


@attrs.frozen(kw_only=True)
class EntryCommitter:
    """Writes and commits the entries of `index` under the byte cap `bytes_max` (None: no cap)."""

    index: SsdIndex
    files: TierFiles
    disk: Disk
    bytes_max: int | None
    fingerprint_fields: dict[str, str]  # what each header records of the serving fingerprint
    safeguards: Safeguards
    clock_ns: Callable[[], int]
    new_entry_id: Callable[[], str]
    keyring: KeyRing | None = None  # seals every entry under its first key

    def store(
        self, tokens: Sequence[int] | np.ndarray, caches: Sequence[Any], namespace: str, *, tokenizer_hash: str
    ) -> str | None:
        """Plan, write and commit an entry on the calling thread (`SsdStore.store`)."""
        pending = self.prepare_store(tokens, caches, namespace, tokenizer_hash=tokenizer_hash)
        if pending is None:
            return None
        try:
            kvfile.write_entry(pending.writer)
        except DiskError as e:
            self.fail_store(pending, e)
            return None
        return self.finish_store(pending)

    def prepare_store(
        self,
        tokens: Sequence[int] | np.ndarray,
        caches: Sequence[Any],
        namespace: str,
        *,
        tokenizer_hash: str,
        captured_epoch: int | None = None,
    ) -> PendingStore | None:
        """Plan a write: None when the entry can never fit under the cap or its
        directory cannot be made."""
        token_array = np.asarray(tokens, dtype=np.uint32)
        entry_id = self.new_entry_id()
        path = self.files.entry_path(namespace, entry_id)
        meta = kvfile.EntryMeta(
            namespace=namespace,
            fingerprint=self.fingerprint_fields,
            tokenizer_hash=tokenizer_hash,
            created_at_ns=self.clock_ns(),
        )
        writer = kvfile.KvFileWriter(
            path,
            caches,
            token_array.tolist(),
            meta,
            self.disk,
            temp_id=entry_id,
            safeguards=self.safeguards,
            keyring=self.keyring,
        )
        planned = writer.planned_header.file_bytes
        if self.bytes_max is not None and planned > self.bytes_max:
            self._write_failed(namespace, token_array.size, f"entry of {planned} bytes exceeds the cap", None)
            return None
        try:
            self.files.make_durable_dir(path.parent)
        except DiskError as e:
            self._write_failed(namespace, token_array.size, str(e), e.errno)
            return None
        return PendingStore(
            entry_id=entry_id, namespace=namespace, tokens=token_array, writer=writer, captured_epoch=captured_epoch
        )

    def fail_store(self, pending: PendingStore, error: DiskError) -> None:
        """Record that a prepared write failed (its temp file already removed)."""
        self._write_failed(pending.namespace, pending.tokens.size, str(error), error.errno)

    def finish_store(self, pending: PendingStore) -> str:
        """Commit a written entry; returns its id."""
        return self.index_written(
            pending.entry_id,
            pending.namespace,
            pending.writer.path,
            pending.tokens,
            pending.writer.planned_header,
            captured_epoch=pending.captured_epoch,
        )

    def index_written(
        self,
        entry_id: str,
        namespace: str,
        path: Path,
        tokens: np.ndarray,
        header: kvfile.Header,
        *,
        captured_epoch: int | None = None,
        fetched_since: int | None = None,
    ) -> str:
        """Index a committed entry file (a store or an adoption), then
        supersede and evict; returns the entry id (a wipe's tombstone may
        refuse it: the file is then unlinked, `SsdIndex.commit`)."""
        # LRU order comes from the store's clock, not the file system's, so
        # it is the same in simulations and under coarse timestamps.
        mtime_ns = self.index.next_mtime_ns()
        try:
            self.disk.utime(path, mtime_ns)
        except DiskError as e:
            log.debug("cannot set the mtime of %s: %s", path, e)
        entry = IndexedEntry(
            entry_id=entry_id,
            namespace=namespace,
            directory=path.parent,
            file_name=path.name,
            tokens=tokens,
            bytes=header.file_bytes,
            mtime_ns=mtime_ns,
            trimmable=header.trimmable,
            minimum_reusable_offset=header.minimum_reusable_offset,
            companion_bytes=kvfile.companion_bytes(header, path),
        )
        self.files.unlink_removed(self.index.commit(entry, captured_epoch, fetched_since))
        if self.index.entry(entry_id) is None:
            # Refused by a wipe's tombstone (or evicted at once): a refused file's removal must
            # survive a power loss, like the wipe's own.
            try:
                self.disk.fsync_dir(path.parent)
            except DiskError as e:
                log.warning("the removal of %s may not be durable: %s", path, e)
        return entry_id

    def _write_failed(self, namespace: str, token_count: int, reason: str, errno: int | None) -> None:
        first = self.index.write_failed(namespace, int(token_count), reason, errno)
        level = logging.WARNING if first else logging.DEBUG
        log.log(level, "SSD cache entry not stored (serving continues): %s", reason)
