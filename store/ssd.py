"""The SSD cold tier: one `.kvc` file per prefix entry; the files are the database.

Only our own fingerprint directory is ever read or written (its layout:
`store/ssd_files.py`); a different model, tokenizer, KV scheme or MLX build
selects another directory and leaves the old one intact. Startup scans
headers only into an in-memory index (one `PrefixIndex` per namespace), reaps
`.tmp` orphans, quarantines what fails a check, and reconciles the journal
against the scan (each correction is an event). `find` is index-only. Every
failure degrades to "no hit" or "not stored": the tier never takes serving down.

`SsdStore` opens and closes the tier and is the one face its callers use; the
work is cut like the actors, around an I/O-free core:

- `SsdIndex` (`ssd_index.py`): the index, counters and LRU clock behind the one lock; short
  critical sections, no I/O; it queues the events about entries where it changes or checks them;
- `StartupScanner` (`ssd_scan.py`): the startup scan and the journal's reconciliation;
- `EntryRestorer` (`ssd_restore.py`): `restore`, reading outside the lock;
- `EntryCommitter` (`ssd_commit.py`): `store`, `prepare_store`, `finish_store`, `fail_store`;
- `EntryAdopter` (`ssd_adopt.py`): `adopt`, a fetched file verified and committed;
- `TierFiles` (`ssd_files.py`): the layout, durable directories, quarantine, unlinks.

Threads: the engine thread (`restore`, `prepare_store`), the Trio thread
(`find`, `covers`, `stats`) and the writer's worker thread (`finish_store`)
reach the index only through `SsdIndex`'s methods; the lock is never held
across file I/O.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np

from kvcellar.errors import DiskError, StoreError
from kvcellar.store.disk import Disk, RealDisk
from kvcellar.store.journal import JOURNAL_FILE_NAME, Journal, JournalThread
from kvcellar.store.keyring import KeyRing
from kvcellar.store.safeguards import SAFEGUARDS, Safeguards
from kvcellar.store.ssd_adopt import EntryAdopter, Fill
from kvcellar.store.ssd_commit import EntryCommitter, PendingStore
from kvcellar.store.ssd_files import (
    CHECKPOINT_DIR_NAME,
    LOCK_FILE_NAME,
    QUARANTINE_BYTES_MAX_DEFAULT,
    QUARANTINE_DIR_NAME,
    SEALED_QUARANTINE_DIR_NAME,
    TierFiles,
    namespace_dir_name,
)
from kvcellar.store.ssd_index import EventListener, IndexedEntry, SsdCounters, SsdIndex, SsdMatch
from kvcellar.store.ssd_restore import EntryRestorer, RestoreListener
from kvcellar.store.ssd_scan import JournalRows, StartupScanner, cyclic_gc_paused, reconciliation
from kvcellar.store.ssd_wipe import WIPE_DIR_NAME, WipeIntents
from kvcellar.store.wipe import WipeSelector

log = logging.getLogger("kvcellar.ssd")


class SsdStore:
    """The cold tier of one serving fingerprint; thread-safe: its state is `SsdIndex`'s, behind that core's lock."""

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
        keyring: KeyRing | None = None,
    ) -> None:
        self.root_dir = Path(root_dir)
        self.keyring = keyring
        self.fingerprint = fingerprint
        self.directory = self.root_dir / fingerprint
        self.bytes_max = bytes_max or None
        self.disk = disk
        self.verify = verify
        self.quarantine_bytes_max = quarantine_bytes_max
        self.safeguards = safeguards
        self.journal: Journal | None = None
        self._fingerprint_fields = {**fingerprint_fields, "digest": fingerprint}
        self._clock_ns = clock_ns
        self._lock_handle: Any = None
        self.index = SsdIndex(
            directory=self.directory,
            bytes_max=self.bytes_max,
            clock_ns=clock_ns,
            lock=index_lock,
            event_listeners=event_listeners,
            drop_wiped_commits=safeguards.wipe_tombstone_at_commit,
        )
        self.wipe_intents = WipeIntents(directory=self.directory, disk=disk)
        self.files = TierFiles(
            directory=self.directory,
            disk=disk,
            index=self.index,
            clock_ns=clock_ns,
            quarantine_bytes_max=quarantine_bytes_max,
        )
        self._committer = EntryCommitter(
            index=self.index,
            files=self.files,
            disk=disk,
            bytes_max=self.bytes_max,
            fingerprint_fields=self._fingerprint_fields,
            safeguards=safeguards,
            clock_ns=clock_ns,
            new_entry_id=new_entry_id or (lambda: uuid.uuid4().hex),
            keyring=keyring,
        )
        self._restorer = EntryRestorer(
            index=self.index,
            files=self.files,
            disk=disk,
            verify=verify,
            safeguards=safeguards,
            timer_ns=timer_ns,
            restore_listeners=tuple(restore_listeners),
            keyring=keyring,
        )
        self._adopter = self._new_adopter()

    def _new_adopter(self) -> EntryAdopter:
        return EntryAdopter(
            fingerprint=self.fingerprint,
            disk=self.disk,
            safeguards=self.safeguards,
            new_entry_id=self._committer.new_entry_id,
            entry_path=self.files.entry_path,
            make_durable_dir=self.files.make_durable_dir,
            quarantine_file=self.files.quarantine_file,
            index_written=self._committer.index_written,
            keyring=self.keyring,
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
        keyring: KeyRing | None = None,
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
        the lock (the simulator's observer uses both). With `keyring`, every
        entry is sealed under its first key and sealed entries open with any
        of its keys; one whose key it lacks is moved to the sealed quarantine.
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
            keyring=keyring,
        )
        store.files.make_durable_dirs(store.directory, store.root_dir.parent)
        owner = owner or f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%dT%H:%M:%S%z')}"
        store._lock_handle = store.disk.lock_exclusive(store.directory / LOCK_FILE_NAME, owner)
        try:
            if journal:
                store._open_journal(journal_opener, clock_ns)
            with cyclic_gc_paused():
                store._open_index()
        except BaseException:
            store.close()
            raise
        return store

    def _open_journal(self, journal_opener: Callable[[Path], Journal] | None, clock_ns: Callable[[], int]) -> None:
        journal_path = self.directory / JOURNAL_FILE_NAME
        self.journal = (
            journal_opener(journal_path)
            if journal_opener is not None
            else Journal.open(
                journal_path,
                clock_ns=clock_ns,
                runner=JournalThread(),
                safeguards=self.safeguards,
                keyring=self.keyring,
            )
        )
        self.index.attach_journal(self.journal)

    def _open_index(self) -> None:
        """Scan the directory into the index (`StartupScanner.scan`), bring the
        journal's projection in line with the files (the files are the truth:
        all corrections in one transaction), redo supersession, evict over the cap."""
        if self.keyring is not None:
            log.info(
                "sealing SSD entries under key %s; opening with %s", self.keyring.sealing.key_id, self.keyring.key_ids
            )
        scanned: list[IndexedEntry] = []
        scanner = StartupScanner(
            directory=self.directory,
            fingerprint=self.fingerprint,
            disk=self.disk,
            safeguards=self.safeguards,
            skipped_dir_names=frozenset(
                (QUARANTINE_DIR_NAME, SEALED_QUARANTINE_DIR_NAME, CHECKPOINT_DIR_NAME, WIPE_DIR_NAME)
            ),
            index=scanned.append,
            quarantine=self.files.quarantine,
            quarantine_sealed=self.files.quarantine_sealed,
            keyring=self.keyring,
            record_event=self.index.record,
            relative=self.files.relative,
        )
        journaled, trusted = scanner.scan(self.journal.entries_later() if self.journal else list)
        self.index.index_scanned(scanned)
        self._reconcile_journal(journaled, trusted)
        if self.safeguards.redo_startup_supersession:
            self._supersede_all()
        self.files.unlink_removed(self.index.evict_over_cap())
        self._resume_wipes()

    def _resume_wipes(self) -> None:
        """A crash left wipes unfinished: their tombstones go back up and their SSD entries go
        before the tier serves; the system finishes their other tiers (`unfinished_wipes`)."""
        for wipe_id, selector in self.wipe_intents.pending():
            log.warning("resuming wipe %s of %s left unfinished by the last run", wipe_id, selector.to_record())
            self.index.resume_wipe(wipe_id, selector)
            self.wipe_entries(selector)

    def _reconcile_journal(self, journaled: JournalRows, trusted: set[str]) -> None:
        if self.journal is not None:
            sealing_key_id = self.journal.keyring.sealing.key_id if self.journal.keyring is not None else None
            self.journal.append_many(
                reconciliation(self.index.entries(), journaled, trusted, self.index.fields, sealing_key_id)
            )

    def _supersede_all(self) -> None:
        """Redo supersession over the whole index at startup. Removals are not
        directory-fsynced (a lost one costs space, never correctness), so a
        power loss can bring a superseded file back."""
        for entry_id in self.index.supersession_order():
            self.files.unlink_removed(self.index.supersede(entry_id))

    def close(self) -> None:
        """Close the journal (applying what it has queued) and release the directory lock."""
        self.index.attach_journal(None)
        journal, self.journal = self.journal, None
        lock_handle, self._lock_handle = self._lock_handle, None
        if journal is not None:
            journal.close()
        if lock_handle is not None:
            self.disk.unlock(lock_handle)

    # -- find / restore (the Trio thread finds, the engine thread restores) --

    def find(self, tokens: Sequence[int] | np.ndarray, namespace: str = "") -> SsdMatch | None:
        """The entry giving the longest usable prefix of `tokens` in `namespace`
        (capped at `len(tokens) - 1`, untrimmable entries only for exact
        prefixes); index-only, no I/O. None when nothing is usable."""
        return self.index.find(tokens, namespace)

    def divergence(
        self, tokens: Sequence[int] | np.ndarray, namespace: str, next_tokens: int
    ) -> tuple[int, np.ndarray]:
        """`PrefixIndex.divergence` over the committed entries of `namespace`; index-only, no I/O."""
        return self.index.divergence(tokens, namespace, next_tokens)

    def covers(self, tokens: Sequence[int] | np.ndarray, namespace: str = "") -> bool:
        """Whether a committed entry can serve all of `tokens`: an exact entry,
        or a trimmable descendant whose minimum reusable offset reaches it."""
        return self.index.covers(tokens, namespace)

    def longest_entry_tokens(self) -> int:
        """The longest prefix any committed entry holds (the durability surface)."""
        return self.index.longest_entry_tokens()

    def restore(self, match: SsdMatch) -> list[Any] | None:
        """Load the matched entry into fresh caches trimmed to `usable_tokens`
        (`EntryRestorer.restore`); None ("no hit") when the entry is gone,
        unreadable or fails a check. The file is read outside the lock."""
        return self._restorer.restore(match)

    def served(self, match: SsdMatch, entry: IndexedEntry, restore_ms: float) -> None:
        """Count and journal a restore of `entry` made elsewhere (a split
        restore's suffix, engine/restore_policy.py) and touch it (LRU)."""
        self._restorer.served(match, entry, restore_ms)

    # -- store (the engine thread plans, the writer's worker thread commits) --

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
        return self._committer.store(tokens, caches, namespace, tokenizer_hash=tokenizer_hash)

    def prepare_store(
        self,
        tokens: Sequence[int] | np.ndarray,
        caches: Sequence[Any],
        namespace: str = "",
        *,
        tokenizer_hash: str = "",
        captured_epoch: int | None = None,
    ) -> PendingStore | None:
        """Plan a write (no I/O, no MLX work): None when the entry can never
        fit under the cap. The caller runs `pending.writer` (its tensors may
        each take their own engine turn), then `finish_store` or `fail_store`.
        `captured_epoch`: the RAM tier's wipe epoch when the caches were taken
        (a wipe's tombstone refuses an older one's commit; None: taken now)."""
        return self._committer.prepare_store(
            tokens, caches, namespace, tokenizer_hash=tokenizer_hash, captured_epoch=captured_epoch
        )

    def fail_store(self, pending: PendingStore, error: DiskError) -> None:
        """Record that a prepared write failed (its temp file already removed)."""
        self._committer.fail_store(pending, error)

    def finish_store(self, pending: PendingStore) -> str:
        """Index a committed write, then supersede and evict; returns the entry
        id. File I/O (the mtime, the unlinks of what it replaces) happens
        outside the lock, so call it off the Trio thread."""
        return self._committer.finish_store(pending)

    def adopt(
        self,
        namespace: str,
        tokens: np.ndarray,
        fill: Fill,
        *,
        verify_tensors: bool = True,
        fetched_since: int | None = None,
    ) -> str:
        """Commit an entry file fetched from elsewhere (a shared-tier download)
        as if it had been stored here, verified first (`EntryAdopter.adopt`,
        `store/ssd_adopt.py`); returns the new entry id. `fetched_since`:
        `wipe_seq()` taken before the fetch began. Blocking file I/O: call it
        off the Trio thread."""
        return self._adopter.adopt(namespace, tokens, fill, verify_tensors=verify_tensors, fetched_since=fetched_since)

    def wipe_seq(self) -> int:
        """Take it before fetching an entry to adopt (`adopt(fetched_since=...)`)."""
        return self.index.wipe_seq()

    # -- for the tier's other parts (store/checkpoints.py, the shared tier) ----

    def add_event_listener(self, listener: EventListener) -> None:
        """Add a listener after opening (the shared tier's uploader): same
        contract as `open`'s `event_listeners`."""
        self.index.add_event_listener(listener)

    @property
    def fingerprint_fields(self) -> dict[str, str]:
        return self._fingerprint_fields

    def clock_ns(self) -> int:
        return self._clock_ns()

    def make_durable_dir(self, path: Path) -> None:
        """Create a directory under the fingerprint directory, durably."""
        self.files.make_durable_dir(path)

    def quarantine_file(self, path: Path, reason: str) -> None:
        """Move a bad file that is not an indexed entry aside."""
        self.files.quarantine_file(path, reason)

    def quarantine_sealed_file(self, path: Path, key_id: str) -> None:
        """Move a file sealed under key `key_id`, which the ring lacks, to the sealed quarantine."""
        self.files.quarantine_sealed(path, "", key_id)

    def record_event(self, event: Any) -> None:
        """Journal an event of another part of the tier (the listeners see it too)."""
        self.index.record(event)

    # -- wipes (store/wipe.py; the system's `actors/wipes.py` runs them) ---------

    def begin_wipe(self, wipe_id: str, selector: WipeSelector) -> None:
        """Make the wipe's intent durable, then install its tombstone: from now on no commit it
        selects lands. Raises `DiskError` when the intent cannot be made durable (nothing removed)."""
        self.wipe_intents.write(wipe_id, selector)
        self.index.begin_wipe(wipe_id, selector)

    def wipe_entries(self, selector: WipeSelector) -> list[IndexedEntry]:
        """Remove every entry `selector` selects (unindexed and journaled under the lock, unlinked
        after); returns them. An unlink that fails leaves a file the next start's scan would index
        again: `wipe_left` reports it."""
        doomed = self.index.wipe(selector)
        self.remove_wiped_files([entry.path for entry in doomed])
        return doomed

    def remove_wiped_files(self, paths: Sequence[Path]) -> None:
        """Unlink a wipe's files and fsync their directories: unlike an eviction's, a wipe's
        removal must survive a power loss (a file whose unlink is lost would be indexed again at
        the next start). A failed unlink is logged (`wipe_left` reports the file); a failed fsync
        raises `DiskError`, which leaves the intent, so the wipe is not reported done."""
        self.files.unlink_removed(list(paths))
        for directory in sorted({path.parent for path in paths}):
            self.disk.fsync_dir(directory)

    def wipe_left(self, selector: WipeSelector, removed_paths: Sequence[Path] = ()) -> list[str]:
        """What is still there of the wipe: indexed entries it selects, and files of `removed_paths`
        that still exist (an unlink that failed), as paths relative to the directory."""
        left = [self.files.relative(entry.path) for entry in self.index.selected(selector)]
        for path in removed_paths:
            try:
                self.disk.stat(path)
            except DiskError:
                continue
            left.append(self.files.relative(path))
        return left

    def bound_wipe(self, wipe_id: str, ram_epoch: int) -> None:
        """The RAM tier dropped the wipe's entries at epoch `ram_epoch` (`Tombstone`)."""
        self.index.bound_wipe(wipe_id, ram_epoch)

    def finish_wipe(self, wipe_id: str, entries: int, bytes_removed: int) -> None:
        """Every tier is done: lift the tombstone, journal the wipe done, remove its intent."""
        self.index.end_wipe(wipe_id, entries, bytes_removed)
        self.wipe_intents.finish(wipe_id)

    def unfinished_wipes(self) -> dict[str, WipeSelector]:
        """The wipes begun and not finished (at open: those a crash left)."""
        return self.index.unfinished_wipes()

    # -- introspection: immutable snapshots ------------------------------------

    @property
    def counters(self) -> SsdCounters:
        """A copy of the counters."""
        return self.index.counters()

    def entry_ids(self) -> list[str]:
        return self.index.entry_ids()

    def entry(self, entry_id: str) -> IndexedEntry | None:
        return self.index.entry(entry_id)

    def stats(self) -> dict[str, Any]:
        journal = self.journal.state() if self.journal is not None else {"state": "off", "reason": "no journal"}
        return {**self.index.stats(), "journal": journal, "verify_tensors": self.verify}


__all__ = [
    "CHECKPOINT_DIR_NAME",
    "QUARANTINE_DIR_NAME",
    "SEALED_QUARANTINE_DIR_NAME",
    "IndexedEntry",
    "PendingStore",
    "SsdCounters",
    "SsdMatch",
    "SsdStore",
    "StoreError",
    "namespace_dir_name",
]
