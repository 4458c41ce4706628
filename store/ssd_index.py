"""The SSD tier's index core: the entries the tier holds, one `PrefixIndex`
per namespace, the byte total, the LRU clock and the counters, behind the one
lock that guards them.

I/O-free, like `store/prefix_index.py`: this module imports no `Disk`, opens
no file and never waits. Each method is one short critical section over
in-memory structures; a method that removes entries unindexes them and
returns the files for its caller to unlink after the lock is released (a
restore that already opened one keeps reading it). Every journal event about
an indexed entry is queued (`EventQueue.append`, which never waits: the
journal's own thread commits) inside the critical section that changed or
checked the entry, so the journal's order is the index's order.

What leaves the core is immutable: frozen `IndexedEntry` and `SsdMatch`
values, stats dicts and counter copies. A hit replaces its entry by a copy
with the new mtime rather than changing the one a reader may hold.

The threads that reach it (see docs/architecture.md, owners): the engine
thread (a restore's checks and its hit), the Trio thread (`find`, `covers`,
`stats`), the writer's worker thread (`commit`) and, at open, the opening
thread. The restore, commit, adoption and scan modules around it do the file
I/O, outside the lock.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import attrs
import numpy as np

from kvcellar.store import events as ev
from kvcellar.store.namespaces import owner_of
from kvcellar.store.prefix_index import PrefixIndex
from kvcellar.store.wipe import WipeSelector

EventListener = Callable[[ev.Event], None]
# The `EntryEvicted.reason` of a wipe's removals: the projection and the KV events treat them as evictions.
WIPE_REASON = "wipe"
Tokens = Sequence[int] | np.ndarray


class EventQueue(Protocol):
    """Where the core queues its events (the journal): `append` never waits."""

    def append(self, event: ev.Event) -> None: ...


@attrs.frozen(kw_only=True)
class IndexedEntry:
    """One committed entry as the index knows it; immutable (a hit indexes a copy)."""

    entry_id: str
    namespace: str
    # The file is `directory / file_name`, joined only when asked for: a scan
    # indexes thousands of entries and reads few of their paths.
    directory: Path
    file_name: str
    tokens: np.ndarray
    bytes: int
    mtime_ns: int
    trimmable: bool
    minimum_reusable_offset: int
    # Of `bytes`, the companion section's payload (the draft model's KV, store/companion.py).
    companion_bytes: int = 0

    @property
    def path(self) -> Path:
        return self.directory / self.file_name


@attrs.frozen(kw_only=True)
class SsdMatch:
    """What `find` returns: restore `usable_tokens` of the entry."""

    entry_id: str
    namespace: str
    usable_tokens: int
    entry_tokens: int


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
    wiped: int = 0  # entries removed by a wipe
    wipe_dropped_commits: int = 0  # commits a wipe's tombstone refused (their files unlinked, never indexed)


@attrs.define(kw_only=True)
class OwnerUsage:
    """One tenant's share of the tier (`ssd_cache.by_tenant.<name>` in /stats)."""

    entries: int = 0
    bytes: int = 0
    hits: int = 0


class SsdIndex:
    """The index and counters of one fingerprint directory `directory`, over
    entries of at most `bytes_max` bytes in all (None: no cap)."""

    def __init__(
        self,
        *,
        directory: Path,
        bytes_max: int | None,
        clock_ns: Callable[[], int],
        lock: AbstractContextManager[Any] | None = None,
        event_listeners: Sequence[EventListener] = (),
        drop_wiped_commits: bool = True,
    ) -> None:
        self.directory = directory
        self.bytes_max = bytes_max
        self._clock_ns = clock_ns
        # Re-entrant by default; the simulator's `TrackedLock` checks that no disk operation runs while held.
        self._lock: AbstractContextManager[Any] = lock or threading.RLock()
        self._entries: dict[str, IndexedEntry] = {}
        self._indexes: dict[str, PrefixIndex] = {}
        self._bytes_total = 0
        self._companion_bytes_total = 0  # of `_bytes_total`, the entries' companion sections
        self._mtime_max_ns = 0
        self._counters = SsdCounters()
        self._event_listeners = tuple(event_listeners)
        self._events: EventQueue | None = None
        self._warned_write_failure = False
        self._usage: dict[str, OwnerUsage] = {}
        # Tenant quotas (`serve --tenants`): an owner over its own quota loses its oldest entries first.
        self._owner_bytes_max: dict[str, int] = {}
        # The wipes of this process by id (`Tombstone`); a commit one refuses is dropped
        # (`drop_wiped_commits`; off only for the simulator's `wipe-skips-tombstone`).
        self._wipe_seq = 0  # wipe begins and ends so far (`wipe_seq`)
        self._tombstones: dict[str, Tombstone] = {}
        self._drop_wiped_commits = drop_wiped_commits

    def set_owner_quotas(self, owner_bytes_max: dict[str, int]) -> list[Path]:
        """Set the tenants' byte quotas and evict what is over them now; returns the files to unlink."""
        with self._lock:
            self._owner_bytes_max = dict(owner_bytes_max)
            return self._evict_over_cap()

    # -- events ----------------------------------------------------------------

    def attach_journal(self, events: EventQueue | None) -> None:
        """Queue events to `events` from now on (None: to no journal, as after a close)."""
        with self._lock:
            self._events = events

    def add_event_listener(self, listener: EventListener) -> None:
        """Each listener sees every event queued, one at a time, under the
        lock: it must be quick, do no I/O and not call the store."""
        with self._lock:
            self._event_listeners = (*self._event_listeners, listener)

    def record(self, event: ev.Event) -> None:
        """Queue an event that changes no entry (a quarantine, a reaped temp
        file, another part of the tier's)."""
        with self._lock:
            self._event(event)

    def _event(self, event: ev.Event) -> None:
        for listener in self._event_listeners:
            listener(event)
        if self._events is not None:
            self._events.append(event)

    def fields(self, entry: IndexedEntry) -> ev.EntryFields:
        """The journal's record of `entry` (pure)."""
        return ev.EntryFields(
            entry_id=entry.entry_id,
            namespace=entry.namespace,
            path=str(entry.path.relative_to(self.directory)),
            token_count=int(entry.tokens.size),
            tokens_digest=ev.tokens_digest(entry.tokens),
            token_ids=np.ascontiguousarray(entry.tokens, dtype="<u4").tobytes(),
            bytes=entry.bytes,
            mtime_ns=entry.mtime_ns,
            trimmable=entry.trimmable,
            minimum_reusable_offset=entry.minimum_reusable_offset,
            companion_bytes=entry.companion_bytes,
        )

    # -- reads -----------------------------------------------------------------

    def find(self, tokens: Tokens, namespace: str) -> SsdMatch | None:
        """The entry giving the longest usable prefix of `tokens` in `namespace`."""
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

    def divergence(self, tokens: Tokens, namespace: str, next_tokens: int) -> tuple[int, np.ndarray]:
        with self._lock:
            index = self._indexes.get(namespace)
            if index is None:
                return 0, np.empty(0, dtype=np.uint32)
            return index.divergence(np.asarray(tokens, dtype=np.uint32), next_tokens)

    def covers(self, tokens: Tokens, namespace: str) -> bool:
        token_array = np.asarray(tokens, dtype=np.uint32)
        if token_array.size == 0:
            return True
        # A sentinel no tokenizer emits: the match cannot extend past `tokens`.
        probe = np.append(token_array, np.uint32(0xFFFFFFFF))
        with self._lock:
            index = self._indexes.get(namespace)
            if index is None:
                return False
            if index.exact(token_array):
                return True
            match = index.best(probe)
        return match is not None and match.usable_tokens == token_array.size

    def longest_entry_tokens(self) -> int:
        with self._lock:
            return max((int(entry.tokens.size) for entry in self._entries.values()), default=0)

    def entry(self, entry_id: str) -> IndexedEntry | None:
        with self._lock:
            return self._entries.get(entry_id)

    def entry_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    def entries(self) -> dict[str, IndexedEntry]:
        """A copy of the index by entry id (the startup reconciliation's input)."""
        with self._lock:
            return dict(self._entries)

    def counters(self) -> SsdCounters:
        with self._lock:
            return attrs.evolve(self._counters)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "entries": len(self._entries),
                "bytes": self._bytes_total,
                "companion_bytes": self._companion_bytes_total,
                "bytes_max": self.bytes_max,
                **attrs.asdict(self._counters),
                # Tenant names only, never keys; the default namespace is the totals above.
                "by_tenant": {
                    owner: {**attrs.asdict(usage), "max_bytes": self._owner_bytes_max.get(owner)}
                    for owner, usage in sorted(self._usage.items())
                    if owner
                },
            }

    # -- the startup scan --------------------------------------------------------

    def index_scanned(self, scanned: Iterable[IndexedEntry]) -> None:
        """Index what the startup scan found, into the still empty index: one bulk
        trie build per namespace (`PrefixIndex.from_entries`, the trie repeated
        `add` builds, at a cost that does not grow with its depth); of an id found twice, the last wins."""
        with self._lock:
            for entry in scanned:
                self._entries[entry.entry_id] = entry
            by_namespace: dict[str, list[IndexedEntry]] = {}
            for entry in self._entries.values():
                by_namespace.setdefault(entry.namespace, []).append(entry)
                self._bill(entry, +1)
                self._mtime_max_ns = max(self._mtime_max_ns, entry.mtime_ns)
            for namespace, entries in by_namespace.items():
                self._indexes[namespace] = PrefixIndex.from_entries(entries)

    def supersession_order(self) -> list[str]:
        """The entries that can supersede another, newest first (of exact
        duplicates the newest stays, as when it was stored). Only entries on
        a path shared with another entry can supersede anything, and removals
        make no new ones (at 10,000 entries of which none shared a path,
        visiting them all cost 21 ms, a third of the walk)."""
        with self._lock:
            sharing = [
                self._entries[entry_id]
                for index in self._indexes.values()
                for entry_id in index.entries_on_shared_paths()
            ]
        sharing.sort(key=lambda e: (e.mtime_ns, e.entry_id), reverse=True)
        return [entry.entry_id for entry in sharing]

    # -- commits -----------------------------------------------------------------

    def next_mtime_ns(self) -> int:
        """Now by the store's clock, but never older than any entry, so the
        most recent store or hit is always the last to be evicted."""
        with self._lock:
            return self._next_mtime_ns()

    def _next_mtime_ns(self) -> int:
        self._mtime_max_ns = max(self._clock_ns(), self._mtime_max_ns + 1)
        return self._mtime_max_ns

    def commit(
        self, entry: IndexedEntry, captured_epoch: int | None = None, fetched_since: int | None = None
    ) -> list[Path]:
        """Index a committed entry file, journal it, then supersede and evict;
        returns the files to unlink. A commit a wipe's tombstone refuses
        (`Tombstone.refuses`; `captured_epoch`: the RAM tier's wipe epoch when
        the caches were taken; `fetched_since`: for an adoption, `wipe_seq()`
        when its fetch began) is not indexed: its own file is returned."""
        with self._lock:
            if self._drop_wiped_commits and self._tombstoned(
                entry.namespace, entry.tokens, captured_epoch, fetched_since
            ):
                # A write that began before a wipe (a spill of a wiped RAM entry) lands after
                # its removal: it must not resurrect the entry.
                self._counters.wipe_dropped_commits += 1
                return [entry.path]
            self._index(entry)
            self._counters.entries_stored += 1
            self._event(ev.EntryStored(entry=self.fields(entry)))
            return self._supersede(entry) + self._evict_over_cap()

    def supersede(self, entry_id: str) -> list[Path]:
        """Remove what the indexed entry `entry_id` stands in for (none when it
        is gone); returns the files to unlink."""
        with self._lock:
            entry = self._entries.get(entry_id)
            return [] if entry is None else self._supersede(entry)

    def evict_over_cap(self) -> list[Path]:
        """Remove the oldest entries until under the cap; returns the files to unlink."""
        with self._lock:
            return self._evict_over_cap()

    def remove(self, entry_id: str, event: ev.EntrySuperseded | ev.EntryEvicted) -> list[Path]:
        """Unindex and journal one removal; returns the file to unlink (none when already gone)."""
        with self._lock:
            return self._remove(entry_id, event)

    def write_failed(self, namespace: str, token_count: int, reason: str, errno: int | None) -> bool:
        """Count and journal a store that wrote nothing; True the first time
        (the caller warns once, then logs at debug)."""
        with self._lock:
            self._counters.write_failures += 1
            first, self._warned_write_failure = not self._warned_write_failure, True
            self._event(ev.EntryWriteFailed(namespace=namespace, token_count=token_count, reason=reason, errno=errno))
            return first

    def _index(self, entry: IndexedEntry) -> None:
        self._entries[entry.entry_id] = entry
        index = self._indexes.get(entry.namespace)
        if index is None:
            # Not `setdefault(namespace, PrefixIndex())`: that built a throwaway index per entry.
            index = self._indexes[entry.namespace] = PrefixIndex()
        index.add(
            entry.entry_id,
            entry.tokens,
            trimmable=entry.trimmable,
            minimum_reusable_offset=entry.minimum_reusable_offset,
        )
        self._bill(entry, +1)
        self._mtime_max_ns = max(self._mtime_max_ns, entry.mtime_ns)

    def _bill(self, entry: IndexedEntry, sign: int) -> None:
        self._bytes_total += sign * entry.bytes
        self._companion_bytes_total += sign * entry.companion_bytes
        usage = self._usage.setdefault(owner_of(entry.namespace), OwnerUsage())
        usage.entries += sign
        usage.bytes += sign * entry.bytes

    def _unindex(self, entry_id: str) -> IndexedEntry | None:
        entry = self._entries.pop(entry_id, None)
        if entry is not None:
            self._indexes[entry.namespace].remove(entry_id)
            self._bill(entry, -1)
        return entry

    def _supersede(self, entry: IndexedEntry) -> list[Path]:
        index = self._indexes[entry.namespace]
        removed: list[Path] = []
        # `entry` is indexed (every caller indexed it first): its trie node names both lists without a walk.
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

    def _evict_over_cap(self) -> list[Path]:
        """Evict the oldest entries of tenants over their own quota, then the oldest of
        all while over the cap: a tenant inside its quota loses entries only to the cap."""
        removed: list[Path] = []
        while self._entries:
            over = {owner for owner, quota in self._owner_bytes_max.items() if self._usage_bytes(owner) > quota}
            over_cap = self.bytes_max is not None and self._bytes_total > self.bytes_max
            if not over and not over_cap:
                break
            candidates = [e for e in self._entries.values() if owner_of(e.namespace) in over]
            if not candidates:
                candidates = list(self._entries.values())
            oldest = min(candidates, key=lambda e: (e.mtime_ns, e.entry_id))
            removed += self._remove(oldest.entry_id, ev.EntryEvicted(entry_id=oldest.entry_id, bytes=oldest.bytes))
        return removed

    def _usage_bytes(self, owner: str) -> int:
        usage = self._usage.get(owner)
        return usage.bytes if usage is not None else 0

    def _remove(self, entry_id: str, event: ev.EntrySuperseded | ev.EntryEvicted) -> list[Path]:
        entry = self._unindex(entry_id)
        if entry is None:
            return []
        if isinstance(event, ev.EntrySuperseded):
            self._counters.supersessions += 1
        elif event.reason == WIPE_REASON:
            self._counters.wiped += 1
        else:
            self._counters.evictions += 1
        self._event(event)
        return [entry.path]

    # -- restores and quarantine ---------------------------------------------

    def drop_bad_entry(self, entry_id: str) -> IndexedEntry | None:
        """Unindex an entry whose file failed a restore's check and count the
        failure; returns it (to quarantine), or None when another thread
        removed it first."""
        with self._lock:
            entry = self._unindex(entry_id)
            if entry is not None:
                self._counters.restore_failures += 1
            return entry

    def count_restore_failure(self, entry_id: str) -> bool:
        """Count a restore's I/O error, unless the entry was removed since the
        restore looked it up (then it is a miss, not a failure)."""
        with self._lock:
            if entry_id not in self._entries:
                return False
            self._counters.restore_failures += 1
            return True

    def hit_mtime_ns(self, entry_id: str) -> int | None:
        """The mtime a hit on `entry_id` sets, or None when it is gone."""
        with self._lock:
            return self._next_mtime_ns() if entry_id in self._entries else None

    def record_hit(self, entry_id: str, mtime_ns: int, usable_tokens: int) -> IndexedEntry | None:
        """The hit's mtime landed on the file: index a copy of the entry with
        it; returns that copy (None when the entry is gone)."""
        with self._lock:
            entry = self._entries.get(entry_id)
            if entry is None:
                return None
            entry = self._entries[entry_id] = attrs.evolve(entry, mtime_ns=max(entry.mtime_ns, mtime_ns))
            self._counters.hits += 1
            self._usage.setdefault(owner_of(entry.namespace), OwnerUsage()).hits += 1
            self._event(ev.EntryHit(entry_id=entry_id, mtime_ns=mtime_ns, usable_tokens=usable_tokens))
            return entry

    def record_restore(self, entry_id: str, usable_tokens: int, restore_ms: float) -> None:
        with self._lock:
            self._counters.restores += 1
            self._counters.restore_ms_last = restore_ms
            if entry_id in self._entries:
                self._event(
                    ev.EntryRestored(entry_id=entry_id, usable_tokens=usable_tokens, restore_ms=round(restore_ms, 3))
                )

    def count_quarantined(self) -> None:
        with self._lock:
            self._counters.quarantined += 1

    def held(self, hold: bool) -> AbstractContextManager[Any]:
        """The lock when `hold`, else nothing: for the restore-holds-index-lock
        mutation only (`Safeguards.restore_outside_index_lock` off), which
        reads a file under it."""
        return self._lock if hold else contextlib.nullcontext()

    # -- wipes (store/wipe.py; the system's wipe runs them in order: begin, wipe, end) ----

    def wipe_seq(self) -> int:
        """How many wipe begins and ends this process has seen: an adoption takes it when its fetch
        begins, so a wipe not done by then refuses the adopted entry even after it is done."""
        with self._lock:
            return self._wipe_seq

    def begin_wipe(self, wipe_id: str, selector: WipeSelector) -> None:
        """Install the wipe's tombstone (from now on a commit it selects is refused) and journal it."""
        with self._lock:
            self._wipe_seq += 1
            self._tombstones[wipe_id] = Tombstone(selector=selector)
            self._event(ev.WipeBegun(wipe_id=wipe_id, selector=selector))

    def resume_wipe(self, wipe_id: str, selector: WipeSelector) -> None:
        """Put back the tombstone of a wipe a crash left unfinished (its `wipe.begun` is journaled
        already: a recovery journals nothing twice)."""
        with self._lock:
            self._tombstones[wipe_id] = Tombstone(selector=selector)

    def bound_wipe(self, wipe_id: str, ram_epoch: int) -> None:
        """The RAM tier dropped the wipe's entries and began epoch `ram_epoch`: from now on the
        tombstone refuses only caches taken before it (and, until the wipe is done, uncounted ones)."""
        with self._lock:
            tombstone = self._tombstones.get(wipe_id)
            if tombstone is not None:
                self._tombstones[wipe_id] = attrs.evolve(tombstone, ram_epoch=ram_epoch)

    def wipe(self, selector: WipeSelector) -> list[IndexedEntry]:
        """Unindex and journal every entry `selector` selects; returns them (their files to unlink)."""
        with self._lock:
            doomed = [e for e in self._entries.values() if selector.matches(e.namespace, e.tokens)]
            for entry in doomed:
                event = ev.EntryEvicted(entry_id=entry.entry_id, bytes=entry.bytes, reason=WIPE_REASON)
                self._remove(entry.entry_id, event)
            return doomed

    def selected(self, selector: WipeSelector) -> list[IndexedEntry]:
        """The indexed entries `selector` selects (what a wipe has left)."""
        with self._lock:
            return [e for e in self._entries.values() if selector.matches(e.namespace, e.tokens)]

    def end_wipe(self, wipe_id: str, entries: int, bytes_removed: int) -> None:
        """The wipe is done in every tier: journal it. Its tombstone stays for the process's life
        if it has a RAM epoch (a snapshot taken before may still be in the spill queue), else goes."""
        with self._lock:
            self._wipe_seq += 1
            tombstone = self._tombstones.pop(wipe_id, None)
            if tombstone is not None and tombstone.ram_epoch is not None:
                self._tombstones[wipe_id] = attrs.evolve(tombstone, done=True, done_seq=self._wipe_seq)
            self._event(ev.WipeDone(wipe_id=wipe_id, entries=entries, bytes=bytes_removed))

    def unfinished_wipes(self) -> dict[str, WipeSelector]:
        with self._lock:
            return {wipe_id: t.selector for wipe_id, t in self._tombstones.items() if not t.done}

    def _tombstoned(
        self, namespace: str, tokens: np.ndarray, captured_epoch: int | None, fetched_since: int | None
    ) -> bool:
        return any(t.refuses(namespace, tokens, captured_epoch, fetched_since) for t in self._tombstones.values())


@attrs.frozen(kw_only=True)
class Tombstone:
    """What a wipe refuses to let commit. Until the RAM tier dropped the wipe's entries
    (`ram_epoch` None), every commit it selects; then, a commit it selects of caches taken
    before that epoch (a spill or write-behind snapshot in flight), and, until the wipe is
    `done`, one whose epoch is unknown (a direct store). An adoption of a shared download is
    refused when the wipe was not done as its fetch began (`fetched_since`, the index's
    `wipe_seq` then; `done_seq`, the sequence at the wipe's end): its bytes may predate the wipe's
    removal from the shared tier. Caches taken later are new puts: a wipe does not refuse what
    was put after it."""

    selector: WipeSelector
    ram_epoch: int | None = None
    done: bool = False
    done_seq: int | None = None

    def refuses(
        self, namespace: str, tokens: np.ndarray, captured_epoch: int | None, fetched_since: int | None = None
    ) -> bool:
        if not self.selector.matches(namespace, tokens):
            return False
        if fetched_since is not None:
            return self.done_seq is None or self.done_seq > fetched_since
        if self.ram_epoch is None:
            return True
        if captured_epoch is None:
            return not self.done
        return captured_epoch < self.ram_epoch
