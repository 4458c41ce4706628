"""Restore: loading a matched SSD entry into fresh caches (the engine thread).

The file is read outside the index lock (a multi-GB restore must not stall
`find`, `covers` or `stats` on the Trio thread); files are never rewritten in
place and an unlinked file stays readable through an open descriptor, so
what is read is a committed entry or nothing. Before the read and after it,
`SsdIndex`'s short critical sections check that the entry is still indexed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from kvcellar.errors import CorruptEntry, DiskError, KeyUnavailable, UnsupportedFormat
from kvcellar.store import kvfile
from kvcellar.store.disk import Disk
from kvcellar.store.keyring import KeyRing
from kvcellar.store.safeguards import Safeguards
from kvcellar.store.signature import caches_trimmable, entry_minimum_reusable_offset
from kvcellar.store.ssd_files import TierFiles
from kvcellar.store.ssd_index import IndexedEntry, SsdIndex, SsdMatch

log = logging.getLogger("kvcellar.ssd")

# Called with the match, the entry it read and the caches of each successful restore.
RestoreListener = Callable[[SsdMatch, IndexedEntry, list[Any]], None]


@attrs.frozen(kw_only=True)
class EntryRestorer:
    """Restores the entries of `index`, reading their files through `disk`."""

    index: SsdIndex
    files: TierFiles
    disk: Disk
    verify: bool  # check every tensor's checksum as it is read
    safeguards: Safeguards
    timer_ns: Callable[[], int]
    restore_listeners: Sequence[RestoreListener] = ()
    keyring: KeyRing | None = None  # opens sealed entries

    def restore(self, match: SsdMatch) -> list[Any] | None:
        """Load the matched entry into fresh caches trimmed to `usable_tokens`.

        Returns None ("no hit") when the entry is gone, unreadable or fails a
        check; a failing file is quarantined, one sealed under a key the ring
        lacks moved to the sealed quarantine. Touches the file's mtime (LRU)."""
        entry = self.index.entry(match.entry_id)
        if entry is None or match.usable_tokens > entry.tokens.size:
            return None
        started_ns = self.timer_ns()
        try:
            loaded = self._load(entry)
        except KeyUnavailable as e:
            if self.index.drop_bad_entry(entry.entry_id) is not None:
                self.files.quarantine_sealed(entry.path, entry.entry_id, e.key_id)
            return None
        except (CorruptEntry, UnsupportedFormat) as e:
            self._drop_bad_entry(entry, str(e))
            return None
        except DiskError as e:
            if self.index.count_restore_failure(entry.entry_id):
                log.warning("cannot restore %s: %s", entry.path, e)
            # else: evicted or superseded since find, a miss and not a failure
            return None
        if not np.array_equal(np.asarray(loaded.tokens, dtype=np.uint32), entry.tokens):
            self._drop_bad_entry(entry, "tokens differ from the indexed header")
            return None
        caches = _trimmed(loaded.caches, int(entry.tokens.size), match.usable_tokens)
        if caches is None:
            return None  # below what the entry can serve: a miss, never wrong rows
        entry = self.served(match, entry, (self.timer_ns() - started_ns) / 1e6)
        for listener in self.restore_listeners:
            listener(match, entry, caches)
        return caches

    def served(self, match: SsdMatch, entry: IndexedEntry, restore_ms: float) -> IndexedEntry:
        """Touch (LRU), count and journal a restore of `entry`, whole or its
        suffix in a split restore; returns the entry as indexed after the hit."""
        entry = self._touch(entry, match.usable_tokens)
        self.index.record_restore(entry.entry_id, match.usable_tokens, restore_ms)
        return entry

    def _load(self, entry: IndexedEntry) -> kvfile.Entry:
        # Only the restore-holds-index-lock mutation reads under the index lock.
        with self.index.held(not self.safeguards.restore_outside_index_lock):
            return kvfile.load(
                entry.path, verify=self.verify, disk=self.disk, safeguards=self.safeguards, keyring=self.keyring
            )

    def _drop_bad_entry(self, entry: IndexedEntry, reason: str) -> None:
        if self.index.drop_bad_entry(entry.entry_id) is not None:
            self.files.quarantine(entry.path, entry.entry_id, reason)

    def _touch(self, entry: IndexedEntry, usable_tokens: int) -> IndexedEntry:
        """Bump the file's mtime (a hit, for the LRU); returns the entry as
        indexed after the hit, or `entry` when there was none."""
        mtime_ns = self.index.hit_mtime_ns(entry.entry_id)
        if mtime_ns is None:
            return entry
        try:
            self.disk.utime(entry.path, mtime_ns)
        except DiskError as e:
            log.debug("cannot touch %s: %s", entry.path, e)
            return entry
        return self.index.record_hit(entry.entry_id, mtime_ns, usable_tokens) or entry


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
