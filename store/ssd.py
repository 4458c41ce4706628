"""The SSD cold tier: one `.kvc` file per prefix entry; the files are the database.

Layout under the root directory:

    <root>/<fingerprint>/lock                 exclusive lock, names its holder
    <root>/<fingerprint>/journal.sqlite       the journal (events + projections)
    <root>/<fingerprint>/<ns-hash>/<uuid>.kvc one file per entry
    <root>/<fingerprint>/quarantine/          corrupt or mismatched files, capped

Only our own fingerprint directory is ever read or written; a different
model, tokenizer, KV scheme or MLX build selects another directory and leaves
the old one intact. Startup scans headers only into an in-memory index (one
`PrefixIndex` per namespace), reaps `.tmp` orphans, quarantines what fails a
check, and reconciles the journal against the scan (each correction is an
event). `find` is index-only. Every failure degrades to "no hit" or "not
stored": the tier never takes serving down.

Threads: the store is called from the engine thread (`restore`, `prepare_store`),
the Trio thread (`find`, `covers`, `stats`) and the writer's worker thread
(`finish_store`). Its lock guards the in-memory index and counters only and is
never held across file I/O: a restore reads its file outside the lock and
re-checks under it that the entry is still indexed; removals are decided
under the lock and unlinked after it. Every journal event about an indexed
entry is queued in the same critical section as the index change or check it
describes, so the journal's order is the index's order (queuing never waits:
the journal's own thread commits).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, suppress
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from kvcellar.errors import CorruptEntry, DiskError, StoreError, UnsupportedFormat
from kvcellar.store import events as ev
from kvcellar.store import kvfile
from kvcellar.store.disk import Disk, RealDisk
from kvcellar.store.journal import JOURNAL_FILE_NAME, Journal, JournalThread
from kvcellar.store.prefix_index import PrefixIndex
from kvcellar.store.safeguards import SAFEGUARDS, Safeguards
from kvcellar.store.signature import caches_trimmable, entry_minimum_reusable_offset
from kvcellar.store.ssd_adopt import EntryAdopter
from kvcellar.store.ssd_scan import (
    IndexedEntry,
    JournalRows,
    StartupScanner,
    cyclic_gc_paused,
    namespace_dir_name,
    reconciliation,
)

log = logging.getLogger("kvcellar.ssd")

QUARANTINE_DIR_NAME = "quarantine"
# In-flight generation checkpoints (`store.checkpoints`): never prefix entries.
CHECKPOINT_DIR_NAME = "checkpoints"
LOCK_FILE_NAME = "lock"
QUARANTINE_BYTES_MAX_DEFAULT = 1 << 30


@attrs.frozen(kw_only=True)
class SsdMatch:
    """What `find` returns: restore `usable_tokens` of the entry."""

    entry_id: str
    namespace: str
    usable_tokens: int
    entry_tokens: int


@attrs.frozen(kw_only=True)
class PendingStore:
    """A planned write: run `writer`, then `SsdStore.finish_store` or `fail_store`."""

    entry_id: str
    namespace: str
    tokens: np.ndarray
    writer: kvfile.KvFileWriter


EventListener = Callable[[ev.Event], None]
# Called with the match, the entry it read and the caches of each successful restore.
RestoreListener = Callable[[SsdMatch, IndexedEntry, list[Any]], None]


@attrs.define(kw_only=True)
class SsdCounters:
    # Running counts (and one latency); /stats names some differently
    # (`System.stats` maps them): `entries_stored` is `ssd_cache.spills` there.
    restores: int = 0  # caches handed back by `restore`
    entries_stored: int = 0  # entries written and indexed, whatever sent them (spill, demotion, write-behind)
    hits: int = 0  # restored entries still indexed afterwards, whose mtime was bumped (`entry.hit`)
    restore_ms_last: float = 0.0
    quarantined: int = 0  # files moved to quarantine/
    evictions: int = 0  # entries removed over the byte cap
    supersessions: int = 0  # entries removed because a newer one stands in for them
    write_failures: int = 0  # stores that wrote nothing (a DiskError, or larger than the cap)
    restore_failures: int = 0  # restores that failed on a bad file or an I/O error


class SsdStore:
    """The cold tier of one serving fingerprint. Thread-safe: one lock over
    the in-memory index, never held across file I/O (see the module doc)."""

    def __init__(
        self,
        root_dir: Path,
        fingerprint: str,
        *,
        bytes_max: int | None,
        disk: Disk,
        fingerprint_fields: dict[str, str],
        quarantine_bytes_max: int,
        verify: bool,
        clock_ns: Callable[[], int],
        new_entry_id: Callable[[], str] | None = None,
        timer_ns: Callable[[], int] = time.perf_counter_ns,
        index_lock: AbstractContextManager[Any] | None = None,
        safeguards: Safeguards = SAFEGUARDS,
        event_listeners: Sequence[EventListener] = (),
        restore_listeners: Sequence[RestoreListener] = (),
    ) -> None:
        self.root_dir = Path(root_dir)
        self.fingerprint = fingerprint
        self.directory = self.root_dir / fingerprint
        self.bytes_max = bytes_max or None
        self.disk = disk
        self.verify = verify
        self.quarantine_bytes_max = quarantine_bytes_max
        self._fingerprint_fields = {**fingerprint_fields, "digest": fingerprint}
        self._clock_ns = clock_ns
        # Guards the index and counters only; never held across file I/O.
        self._lock: AbstractContextManager[Any] = index_lock or threading.RLock()
        self._entries: dict[str, IndexedEntry] = {}
        self._indexes: dict[str, PrefixIndex] = {}
        self._bytes_total = 0
        self._mtime_max_ns = 0
        self.counters = SsdCounters()
        self._warned_write_failure = False
        self._lock_handle: Any = None
        self.journal: Journal | None = None
        self._new_entry_id: Callable[[], str] = new_entry_id or (lambda: uuid.uuid4().hex)
        self._timer_ns = timer_ns
        self._durable_dirs: set[Path] = set()
        self.safeguards = safeguards
        self._event_listeners = tuple(event_listeners)
        self._restore_listeners = tuple(restore_listeners)
        self._adopter = EntryAdopter(
            fingerprint=fingerprint,
            disk=disk,
            safeguards=safeguards,
            new_entry_id=self._new_entry_id,
            entry_path=self._entry_path,
            make_durable_dir=self.make_durable_dir,
            quarantine_file=self.quarantine_file,
            index_written=self._index_written,
        )

    @classmethod
    def open(
        cls,
        root_dir: Path | str,
        fingerprint: str,
        bytes_max: int | None = None,
        disk: Disk | None = None,
        *,
        fingerprint_fields: dict[str, str] | None = None,
        quarantine_bytes_max: int = QUARANTINE_BYTES_MAX_DEFAULT,
        verify: bool = True,
        journal: bool = True,
        clock_ns: Callable[[], int] = time.time_ns,
        journal_opener: Callable[[Path], Journal] | None = None,
        new_entry_id: Callable[[], str] | None = None,
        timer_ns: Callable[[], int] = time.perf_counter_ns,
        owner: str | None = None,
        index_lock: AbstractContextManager[Any] | None = None,
        safeguards: Safeguards = SAFEGUARDS,
        event_listeners: Sequence[EventListener] = (),
        restore_listeners: Sequence[RestoreListener] = (),
    ) -> SsdStore:
        """Lock the fingerprint directory, scan it and reconcile the journal.

        Raises `DirectoryLocked` when another process holds the directory and
        `DiskError` when the directory cannot be created or locked.
        `journal_opener(path)` replaces `Journal.open` (the simulator's
        in-memory journal); `new_entry_id` and `timer_ns` replace uuid4 and
        the restore timer, `owner` the lock file's text (its determinism),
        `index_lock` the index's lock (the simulator's, which checks that no
        disk operation happens while it is held). `safeguards` is the
        durability policy (all on by default; the simulator's mutations turn
        some off). Each of `event_listeners` sees every event the store
        journals one at a time, before it is queued (not the startup
        reconciliation's batch: the journal's commits carry those), under
        the index lock: it must be quick, do no I/O and not call the store.
        Each of `restore_listeners` sees every successful restore, outside
        the lock (the simulator's observer uses both).
        """
        store = cls(
            Path(root_dir),
            fingerprint,
            bytes_max=bytes_max,
            disk=disk or RealDisk(),
            fingerprint_fields=fingerprint_fields or {},
            quarantine_bytes_max=quarantine_bytes_max,
            verify=verify,
            clock_ns=clock_ns,
            new_entry_id=new_entry_id,
            timer_ns=timer_ns,
            index_lock=index_lock,
            safeguards=safeguards,
            event_listeners=event_listeners,
            restore_listeners=restore_listeners,
        )
        store._make_durable_dirs(store.directory, store.root_dir.parent)
        owner = owner or f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%dT%H:%M:%S%z')}"
        store._lock_handle = store.disk.lock_exclusive(store.directory / LOCK_FILE_NAME, owner)
        try:
            if journal:
                journal_path = store.directory / JOURNAL_FILE_NAME
                store.journal = (
                    journal_opener(journal_path)
                    if journal_opener is not None
                    else Journal.open(journal_path, clock_ns=clock_ns, runner=JournalThread(), safeguards=safeguards)
                )
            with cyclic_gc_paused():
                journaled, trusted = store._scan(store.journal.entries_later() if store.journal else list)
                store._reconcile_journal(journaled, trusted)
                if store.safeguards.redo_startup_supersession:
                    store._supersede_all()
                store._unlink_removed(store._evict_over_cap())
        except BaseException:
            store.close()
            raise
        return store

    def _make_durable_dirs(self, path: Path, top: Path) -> None:
        """Create `path` and make its name durable: fsync every directory from
        its parent up to `top`, because a new directory's entry lives in its
        parent and survives a power loss only once the parent is synced (the
        simulator found namespace directories vanishing without this). Once
        per directory per process."""
        if path in self._durable_dirs:
            return
        self.disk.makedirs(path)
        parent = path.parent
        while True:
            self.disk.fsync_dir(parent)
            if parent == top or parent == parent.parent:
                break
            parent = parent.parent
        self._durable_dirs.add(path)

    def close(self) -> None:
        """Close the journal (applying what it has queued) and release the directory lock."""
        with self._lock:
            journal, self.journal = self.journal, None
            lock_handle, self._lock_handle = self._lock_handle, None
        if journal is not None:
            journal.close()
        if lock_handle is not None:
            self.disk.unlock(lock_handle)

    def _event(self, event: ev.Event) -> None:
        for listener in self._event_listeners:
            listener(event)
        if self.journal is not None:
            self.journal.append(event)

    # -- startup -----------------------------------------------------------

    def _scan(self, rows_later: Callable[[], list[dict[str, Any]]]) -> tuple[JournalRows, set[str]]:
        """Index every entry file (`StartupScanner.scan`, `store/ssd_scan.py`);
        returns the journal's projection by entry id and the ids indexed from it."""
        scanned: list[IndexedEntry] = []
        scanner = StartupScanner(
            directory=self.directory,
            fingerprint=self.fingerprint,
            disk=self.disk,
            safeguards=self.safeguards,
            skipped_dir_names=frozenset((QUARANTINE_DIR_NAME, CHECKPOINT_DIR_NAME)),
            index=scanned.append,
            quarantine=self._quarantine,
            record_event=self._event,
            relative=self._relative,
        )
        found = scanner.scan(rows_later)
        self._index_scanned(scanned)
        return found

    def _reconcile_journal(self, journaled: JournalRows, trusted: set[str]) -> None:
        """The files are the truth: bring the journal's projection in line with
        the scan (`reconciliation`), all corrections in one transaction."""
        if self.journal is None:
            return
        self.journal.append_many(reconciliation(self._entries, journaled, trusted, self._fields))

    # -- index -------------------------------------------------------------

    def _index(self, entry: IndexedEntry) -> None:
        self._entries[entry.entry_id] = entry
        index = self._indexes.get(entry.namespace)
        if index is None:
            # Not `setdefault(namespace, PrefixIndex())`: that built a throwaway index per entry scanned.
            index = self._indexes[entry.namespace] = PrefixIndex()
        index.add(
            entry.entry_id,
            entry.tokens,
            trimmable=entry.trimmable,
            minimum_reusable_offset=entry.minimum_reusable_offset,
        )
        self._bytes_total += entry.bytes
        self._mtime_max_ns = max(self._mtime_max_ns, entry.mtime_ns)

    def _index_scanned(self, scanned: list[IndexedEntry]) -> None:
        """Index what the startup scan found, into the still empty index: one bulk
        trie build per namespace (`PrefixIndex.from_entries`, the trie `_index` per
        entry builds, at a cost that does not grow with its depth); of an id found twice, the last wins."""
        for entry in scanned:
            self._entries[entry.entry_id] = entry
        by_namespace: dict[str, list[IndexedEntry]] = {}
        for entry in self._entries.values():
            by_namespace.setdefault(entry.namespace, []).append(entry)
            self._bytes_total += entry.bytes
            self._mtime_max_ns = max(self._mtime_max_ns, entry.mtime_ns)
        for namespace, entries in by_namespace.items():
            self._indexes[namespace] = PrefixIndex.from_entries(entries)

    def _unindex(self, entry_id: str) -> IndexedEntry | None:
        entry = self._entries.pop(entry_id, None)
        if entry is not None:
            self._indexes[entry.namespace].remove(entry_id)
            self._bytes_total -= entry.bytes
        return entry

    def _fields(self, entry: IndexedEntry) -> ev.EntryFields:
        return ev.EntryFields(
            entry_id=entry.entry_id,
            namespace=entry.namespace,
            path=self._relative(entry.path),
            token_count=int(entry.tokens.size),
            tokens_digest=ev.tokens_digest(entry.tokens),
            token_ids=np.ascontiguousarray(entry.tokens, dtype="<u4").tobytes(),
            bytes=entry.bytes,
            mtime_ns=entry.mtime_ns,
            trimmable=entry.trimmable,
            minimum_reusable_offset=entry.minimum_reusable_offset,
        )

    def _entry_path(self, namespace: str, entry_id: str) -> Path:
        return self.directory / namespace_dir_name(namespace) / f"{entry_id}{kvfile.FILE_SUFFIX}"

    def _relative(self, path: Path) -> str:
        return str(path.relative_to(self.directory))

    # -- quarantine ----------------------------------------------------------

    def _quarantine(self, path: Path, entry_id: str, reason: str) -> None:
        """Move a bad file aside (kept for inspection), then keep quarantine under
        its cap. Called without the lock: the file is no longer indexed."""
        with self._lock:
            self.counters.quarantined += 1
        log.warning("quarantining %s: %s", path, reason)
        quarantine_dir = self.directory / QUARANTINE_DIR_NAME
        target = quarantine_dir / f"{self._clock_ns()}-{path.parent.name}-{path.name}"
        try:
            self.disk.makedirs(quarantine_dir)
            self.disk.rename(path, target)
        except DiskError as e:
            log.warning("cannot quarantine %s (%s); removing it", path, e)
            with suppress(DiskError):
                self.disk.unlink(path)
            target = Path("")
        self._event(
            ev.EntryQuarantined(
                entry_id=entry_id, path=self._relative(path), quarantine_path=str(target.name), reason=reason
            )
        )
        self._purge_quarantine()

    def _purge_quarantine(self) -> None:
        quarantine_dir = self.directory / QUARANTINE_DIR_NAME
        try:
            items = sorted(self.disk.scandir(quarantine_dir), key=lambda item: (item.mtime_ns, item.name))
        except DiskError:
            return
        total = sum(item.size_bytes for item in items)
        for item in items:
            if total <= self.quarantine_bytes_max:
                break
            try:
                self.disk.unlink(quarantine_dir / item.name)
            except DiskError:
                continue
            total -= item.size_bytes
            self._event(ev.QuarantinePurged(quarantine_path=item.name, bytes=item.size_bytes))

    # -- find / restore ------------------------------------------------------

    def find(self, tokens: Sequence[int] | np.ndarray, namespace: str = "") -> SsdMatch | None:
        """The entry giving the longest usable prefix of `tokens` in `namespace`
        (capped at `len(tokens) - 1`, untrimmable entries only for exact
        prefixes); index-only, no I/O. None when nothing is usable."""
        with self._lock:
            index = self._indexes.get(namespace)
            if index is None or len(tokens) < 2:
                return None
            match = index.best(np.asarray(tokens, dtype=np.uint32))
            if match is None:
                return None
            return SsdMatch(
                entry_id=match.entry_id,
                namespace=namespace,
                usable_tokens=match.usable_tokens,
                entry_tokens=match.entry_tokens,
            )

    def divergence(
        self, tokens: Sequence[int] | np.ndarray, namespace: str, next_tokens: int
    ) -> tuple[int, np.ndarray]:
        """`PrefixIndex.divergence` over the committed entries of `namespace`; index-only, no I/O."""
        with self._lock:
            index = self._indexes.get(namespace)
            if index is None:
                return 0, np.empty(0, dtype=np.uint32)
            return index.divergence(np.asarray(tokens, dtype=np.uint32), next_tokens)

    def covers(self, tokens: Sequence[int] | np.ndarray, namespace: str = "") -> bool:
        """Whether a committed entry can serve all of `tokens`: an exact entry,
        or a trimmable descendant whose minimum reusable offset reaches it."""
        token_array = np.asarray(tokens, dtype=np.uint32)
        if token_array.size == 0:
            return True
        with self._lock:
            index = self._indexes.get(namespace)
            if index is None:
                return False
            if index.exact(token_array):
                return True
            # A sentinel no tokenizer emits: the match cannot extend past `tokens`.
            probe = np.append(token_array, np.uint32(0xFFFFFFFF))
            match = index.best(probe)
            return match is not None and match.usable_tokens == token_array.size

    def longest_entry_tokens(self) -> int:
        """The longest prefix any committed entry holds (the durability surface)."""
        with self._lock:
            return max((int(entry.tokens.size) for entry in self._entries.values()), default=0)

    def restore(self, match: SsdMatch) -> list[Any] | None:
        """Load the matched entry into fresh caches trimmed to `usable_tokens`.

        Returns None ("no hit") when the entry is gone, unreadable or fails a
        check; a failing file is quarantined. Touches the file's mtime (LRU).
        The file is read outside the lock (a multi-GB restore must not stall
        `find`, `covers` or `stats` on the Trio thread); files are never
        rewritten in place and an unlinked file stays readable through an open
        descriptor, so what is read is a committed entry or nothing.
        """
        with self._lock:
            entry = self._entries.get(match.entry_id)
        if entry is None or match.usable_tokens > entry.tokens.size:
            return None
        started_ns = self._timer_ns()
        try:
            loaded = self._load(entry)
        except (CorruptEntry, UnsupportedFormat) as e:
            self._drop_bad_entry(entry, str(e))
            return None
        except DiskError as e:
            with self._lock:
                if entry.entry_id not in self._entries:
                    return None  # evicted or superseded since find: a miss, not a failure
                self.counters.restore_failures += 1
            log.warning("cannot restore %s: %s", entry.path, e)
            return None
        if not np.array_equal(np.asarray(loaded.tokens, dtype=np.uint32), entry.tokens):
            self._drop_bad_entry(entry, "tokens differ from the indexed header")
            return None
        caches = _trimmed(loaded.caches, int(entry.tokens.size), match.usable_tokens)
        if caches is None:
            return None  # below what the entry can serve: a miss, never wrong rows
        self.served(match, entry, (self._timer_ns() - started_ns) / 1e6)
        for listener in self._restore_listeners:
            listener(match, entry, caches)
        return caches

    def served(self, match: SsdMatch, entry: IndexedEntry, restore_ms: float) -> None:
        """Count and journal a restore of `entry` (whole, or its suffix in a split restore) and touch it (LRU)."""
        self._touch(entry, match.usable_tokens)
        with self._lock:
            self.counters.restores += 1
            self.counters.restore_ms_last = restore_ms
            if entry.entry_id in self._entries:
                self._event(
                    ev.EntryRestored(
                        entry_id=entry.entry_id, usable_tokens=match.usable_tokens, restore_ms=round(restore_ms, 3)
                    )
                )

    def _load(self, entry: IndexedEntry) -> kvfile.Entry:
        # Only the restore-holds-index-lock mutation reads under the index lock.
        guard = contextlib.nullcontext() if self.safeguards.restore_outside_index_lock else self._lock
        with guard:
            return kvfile.load(entry.path, verify=self.verify, disk=self.disk, safeguards=self.safeguards)

    def _drop_bad_entry(self, entry: IndexedEntry, reason: str) -> None:
        with self._lock:
            if self._unindex(entry.entry_id) is None:
                return  # already removed by another thread
            self.counters.restore_failures += 1
        self._quarantine(entry.path, entry.entry_id, reason)

    def _newest_mtime_ns(self) -> int:
        """Now by the store's clock, but never older than any entry, so the
        most recent store or hit is always the last to be evicted. Under the lock."""
        self._mtime_max_ns = max(self._clock_ns(), self._mtime_max_ns + 1)
        return self._mtime_max_ns

    def _touch(self, entry: IndexedEntry, usable_tokens: int) -> None:
        with self._lock:
            if entry.entry_id not in self._entries:
                return
            mtime_ns = self._newest_mtime_ns()
        try:
            self.disk.utime(entry.path, mtime_ns)
        except DiskError as e:
            log.debug("cannot touch %s: %s", entry.path, e)
            return
        with self._lock:
            if entry.entry_id not in self._entries:
                return
            entry.mtime_ns = max(entry.mtime_ns, mtime_ns)
            self.counters.hits += 1
            self._event(ev.EntryHit(entry_id=entry.entry_id, mtime_ns=mtime_ns, usable_tokens=usable_tokens))

    # -- store ---------------------------------------------------------------

    def store(
        self,
        tokens: Sequence[int] | np.ndarray,
        caches: Sequence[Any],
        namespace: str = "",
        *,
        tokenizer_hash: str = "",
    ) -> str | None:
        """Persist an entry atomically; returns its id, or None when it was not
        stored (disk full, I/O error, larger than the cap). Supersedes exact
        duplicates, and strict prefix ancestors when the new entry is trimmable
        and can serve them; then evicts the oldest entries until under the cap.

        Raises `UnknownCacheKind`, `RefusedCacheKind` or `UsageError` for
        caches that cannot be persisted at all (the caller's bug).
        """
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
        namespace: str = "",
        *,
        tokenizer_hash: str = "",
    ) -> PendingStore | None:
        """Plan a write (no I/O, no MLX work): None when the entry can never
        fit under the cap. The caller runs `pending.writer` (its tensors may
        each take their own engine turn), then `finish_store` or `fail_store`."""
        token_array = np.asarray(tokens, dtype=np.uint32)
        entry_id = self._new_entry_id()
        path = self._entry_path(namespace, entry_id)
        meta = kvfile.EntryMeta(
            namespace=namespace,
            fingerprint=self._fingerprint_fields,
            tokenizer_hash=tokenizer_hash,
            created_at_ns=self._clock_ns(),
        )
        writer = kvfile.KvFileWriter(
            path, caches, token_array.tolist(), meta, self.disk, temp_id=entry_id, safeguards=self.safeguards
        )
        planned = writer.planned_header.file_bytes
        if self.bytes_max is not None and planned > self.bytes_max:
            with self._lock:
                self._write_failed(namespace, token_array.size, f"entry of {planned} bytes exceeds the cap", None)
            return None
        try:
            self._make_durable_dirs(path.parent, self.directory)
        except DiskError as e:
            with self._lock:
                self._write_failed(namespace, token_array.size, str(e), e.errno)
            return None
        return PendingStore(entry_id=entry_id, namespace=namespace, tokens=token_array, writer=writer)

    def fail_store(self, pending: PendingStore, error: DiskError) -> None:
        """Record that a prepared write failed (its temp file already removed)."""
        with self._lock:
            self._write_failed(pending.namespace, pending.tokens.size, str(error), error.errno)

    def finish_store(self, pending: PendingStore) -> str:
        """Index a committed write, then supersede and evict; returns the entry
        id. File I/O (the mtime, the unlinks of what it replaces) happens
        outside the lock, so call it off the Trio thread."""
        return self._index_written(
            pending.entry_id, pending.namespace, pending.writer.path, pending.tokens, pending.writer.planned_header
        )

    def _index_written(
        self, entry_id: str, namespace: str, path: Path, tokens: np.ndarray, header: kvfile.Header
    ) -> str:
        """Index a committed entry file (a store or an adoption), then
        supersede and evict; returns the entry id. The mtime and the unlinks
        happen outside the lock."""
        # LRU order comes from the store's clock, not the file system's, so
        # it is the same in simulations and under coarse timestamps.
        with self._lock:
            mtime_ns = self._newest_mtime_ns()
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
        )
        with self._lock:
            self._index(entry)
            self.counters.entries_stored += 1
            self._event(ev.EntryStored(entry=self._fields(entry)))
            removed = self._supersede(entry) + self._evict_over_cap()
        self._unlink_removed(removed)
        return entry_id

    def _write_failed(self, namespace: str, token_count: int, reason: str, errno: int | None) -> None:
        self.counters.write_failures += 1
        level = logging.DEBUG if self._warned_write_failure else logging.WARNING
        log.log(level, "SSD cache entry not stored (serving continues): %s", reason)
        self._warned_write_failure = True
        self._event(ev.EntryWriteFailed(namespace=namespace, token_count=token_count, reason=reason, errno=errno))

    def _supersede_all(self) -> None:
        """Redo supersession over the whole index at startup. Removals are not
        directory-fsynced (a lost one costs space, never correctness), so a
        power loss can bring a superseded file back; newest first, so of exact
        duplicates the newest stays, as when it was stored. Only entries on a
        path shared with another entry can supersede anything, and removals
        make no new ones, so the pass visits those alone (at 10,000 entries
        of which none shared a path it cost 21 ms, a third of the walk)."""
        sharing = [
            self._entries[entry_id] for index in self._indexes.values() for entry_id in index.entries_on_shared_paths()
        ]
        for entry in sorted(sharing, key=lambda e: (e.mtime_ns, e.entry_id), reverse=True):
            if entry.entry_id in self._entries:
                self._unlink_removed(self._supersede(entry))

    def _supersede(self, entry: IndexedEntry) -> list[Path]:
        """Unindex what `entry` replaces (under the lock); returns the files to unlink."""
        index = self._indexes[entry.namespace]
        removed: list[Path] = []
        # `entry` is indexed (both callers index it first): its trie node names both lists without a walk.
        for other_id in index.same_tokens(entry.entry_id):
            if other_id != entry.entry_id:
                removed += self._remove(
                    other_id, ev.EntrySuperseded(entry_id=other_id, by_entry_id=entry.entry_id, reason="duplicate")
                )
        if not entry.trimmable:
            return removed
        for ancestor_id in index.strict_prefix_ancestors_of(entry.entry_id):
            ancestor = self._entries[ancestor_id]
            # A descendant can stand in for an ancestor only if it can be trimmed that far.
            if entry.minimum_reusable_offset <= ancestor.tokens.size:
                removed += self._remove(
                    ancestor_id, ev.EntrySuperseded(entry_id=ancestor_id, by_entry_id=entry.entry_id, reason="prefix")
                )
        return removed

    def _remove(self, entry_id: str, event: ev.Event) -> list[Path]:
        """Unindex and journal a removal (under the lock); the caller unlinks the path."""
        entry = self._unindex(entry_id)
        if entry is None:
            return []
        if isinstance(event, ev.EntrySuperseded):
            self.counters.supersessions += 1
        else:
            self.counters.evictions += 1
        self._event(event)
        return [entry.path]

    def _unlink_removed(self, paths: list[Path]) -> None:
        """Outside the lock. A restore that already opened one of these files
        keeps reading it; one that opens it later finds it gone (a miss)."""
        for path in paths:
            try:
                self.disk.unlink(path)
            except DiskError as e:
                log.warning("cannot remove %s: %s", path, e)

    def _evict_over_cap(self) -> list[Path]:
        """Unindex the oldest entries until under the cap (under the lock); returns the files to unlink."""
        removed: list[Path] = []
        if self.bytes_max is None:
            return removed
        while self._bytes_total > self.bytes_max and self._entries:
            oldest = min(self._entries.values(), key=lambda e: (e.mtime_ns, e.entry_id))
            removed += self._remove(oldest.entry_id, ev.EntryEvicted(entry_id=oldest.entry_id, bytes=oldest.bytes))
        return removed

    # -- adoption (entries fetched from elsewhere: the shared tier) ----------

    def adopt(
        self,
        namespace: str,
        tokens: np.ndarray,
        fill: Callable[[Callable[[memoryview | bytes], None]], None],
        *,
        verify_tensors: bool = True,
    ) -> str:
        """Commit an entry file fetched from elsewhere (a shared-tier download)
        as if it had been stored here, verified first (`EntryAdopter.adopt`,
        `store/ssd_adopt.py`); returns the new entry id. Blocking file I/O:
        call it off the Trio thread."""
        return self._adopter.adopt(namespace, tokens, fill, verify_tensors=verify_tensors)

    def add_event_listener(self, listener: EventListener) -> None:
        """Add a listener after opening (the shared tier's uploader): same
        contract as `open`'s `event_listeners`."""
        with self._lock:
            self._event_listeners = (*self._event_listeners, listener)

    # -- for the tier's other parts (store/checkpoints.py, store/ssd_adopt.py) --

    @property
    def fingerprint_fields(self) -> dict[str, str]:
        return self._fingerprint_fields

    def clock_ns(self) -> int:
        return self._clock_ns()

    def make_durable_dir(self, path: Path) -> None:
        """Create a directory under the fingerprint directory, durably."""
        self._make_durable_dirs(path, self.directory)

    def quarantine_file(self, path: Path, reason: str) -> None:
        """Move a bad file that is not an indexed entry aside."""
        self._quarantine(path, "", reason)

    def record_event(self, event: Any) -> None:
        """Journal an event of another part of the tier (the listeners see it too)."""
        with self._lock:
            self._event(event)

    # -- introspection -------------------------------------------------------

    def entry_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    def entry(self, entry_id: str) -> IndexedEntry | None:
        with self._lock:
            return self._entries.get(entry_id)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counters = attrs.asdict(self.counters)
            journal = self.journal.state() if self.journal is not None else {"state": "off", "reason": "no journal"}
            return {
                "entries": len(self._entries),
                "bytes": self._bytes_total,
                "bytes_max": self.bytes_max,
                **counters,
                "journal": journal,
                "verify_tensors": self.verify,
            }


def _trimmed(caches: list[Any], entry_tokens: int, usable_tokens: int) -> list[Any] | None:
    """The loaded caches trimmed to `usable_tokens`, or None when they cannot
    serve that prefix: untrimmable, or below the minimum reusable offset their
    own state shows (a moving front; a header from before that bound was
    recorded understates it, and `cache.trim` would clamp or keep stale rows)."""
    if usable_tokens >= entry_tokens:
        return caches
    bound = entry_minimum_reusable_offset(caches, entry_tokens)
    if not caches_trimmable(caches) or usable_tokens < bound:
        log.warning(
            "entry of %d tokens cannot serve a %d-token prefix (minimum reusable offset %d)",
            entry_tokens,
            usable_tokens,
            bound,
        )
        return None
    for cache in caches:
        cache.trim(entry_tokens - usable_tokens)
    return caches


__all__ = ["IndexedEntry", "SsdMatch", "SsdStore", "StoreError", "namespace_dir_name"]
