"""The SSD tier's startup scan: index every entry file of a fingerprint
directory from headers only (or from the journal's projection where it
agrees with the file), reap `.tmp` orphans, quarantine what fails a check,
and work out the journal corrections the scan implies.

`SsdStore.open` runs one `StartupScanner` before the store serves anything
and hands it what the scan needs of the tier (its directory, fingerprint,
disk, policy, the directory names that hold no entries, and the index's
intake, the quarantine and the event queue) as explicit values and callables.
The index core (`store/ssd_index.py`) keeps owning the index, counters and
journal order: the scanner only calls `index`, and `reconciliation` returns
events for the store to journal.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from kvcellar.errors import CorruptEntry, DiskError, KeyUnavailable, UnsupportedFormat
from kvcellar.store import events as ev
from kvcellar.store import kvfile
from kvcellar.store.disk import DirEntry, Disk
from kvcellar.store.keyring import KeyRing
from kvcellar.store.safeguards import Safeguards
from kvcellar.store.sealed_tokens import open_token_ids, sealed_key_id
from kvcellar.store.ssd_files import namespace_dir_name
from kvcellar.store.ssd_index import IndexedEntry

log = logging.getLogger("kvcellar.ssd")

_ENTRY_ID = re.compile(r"[0-9a-f]{32}")

# The journal's projection: rows by entry id, as `Journal.entries_later` reads them.
JournalRows = dict[str, dict[str, Any]]


@attrs.frozen(kw_only=True)
class StartupScanner:
    """Scans the fingerprint directory `directory` of fingerprint `fingerprint` once, at startup."""

    directory: Path
    fingerprint: str
    disk: Disk
    safeguards: Safeguards
    skipped_dir_names: frozenset[str]  # directories beside the namespaces that hold no entries
    index: Callable[[IndexedEntry], None]
    quarantine: Callable[[Path, str, str], None]  # (path, entry id, reason): moves a bad file aside
    record_event: Callable[[ev.Event], None]
    relative: Callable[[Path], str]  # a path under `directory` -> its journaled form
    # (path, entry id, key id): moves aside an entry sealed under a key the ring lacks
    quarantine_sealed: Callable[[Path, str, str], None]
    keyring: KeyRing | None = None  # opens sealed headers' token ids

    def scan(self, rows_later: Callable[[], list[dict[str, Any]]]) -> tuple[JournalRows, set[str]]:
        """Index every entry file; returns the journal's projection by entry
        id and the ids indexed from it. A file whose path, size and mtime
        match the projection is indexed from the projection (its header was
        read and checked when it was journaled, and `restore` checks it
        again); any other file gets a full header read. `rows_later()` waits
        for the projection, which the journal thread reads while this one
        lists the first directories (the disk operations keep their order)."""
        journaled: JournalRows | None = None
        known: dict[str, dict[str, Any]] = {}
        trusted: set[str] = set()
        for entry in self.disk.scandir(self.directory):
            if not entry.is_dir or entry.name in self.skipped_dir_names:
                continue
            ns_dir = self.directory / entry.name
            items = self.disk.scandir(ns_dir)
            if journaled is None:
                journaled = {row["entry_id"]: row for row in rows_later()}
                known = {row["path"]: row for row in journaled.values()}
            for item in items:
                if item.name.endswith(kvfile.TEMP_SUFFIX):
                    self._reap(ns_dir / item.name)
                elif item.name.endswith(kvfile.FILE_SUFFIX) and not item.is_dir:
                    row = known.get(f"{entry.name}/{item.name}")
                    indexed = self._entry_from_row(row, ns_dir, item) if row is not None else None
                    if indexed is not None:
                        self.index(indexed)
                        trusted.add(indexed.entry_id)
                    else:
                        self._scan_file(ns_dir, entry.name, item)
        if journaled is None:
            journaled = {row["entry_id"]: row for row in rows_later()}
        return journaled, trusted

    def _entry_from_row(self, row: dict[str, Any], ns_dir: Path, item: DirEntry) -> IndexedEntry | None:
        """The entry as the journal's row has it, when the row matches the
        file's size and mtime and its token ids open; None sends the file to a
        header read (which quarantines a sealed file whose key the ring lacks,
        and journals a row sealed under an unknown key, or left plain while the
        ring seals, afresh)."""
        if row["bytes"] != item.size_bytes or row["mtime_ns"] != item.mtime_ns:
            return None
        if row["companion_bytes"] is None:
            return None  # journaled before its companion bytes were (schema 1): read once from its header
        if self.keyring is not None and sealed_key_id(row["token_ids"], row["token_count"]) is None:
            return None
        try:
            token_ids = open_token_ids(self.keyring, row["entry_id"], row["token_ids"], row["token_count"])
        except (KeyUnavailable, CorruptEntry) as e:
            log.info("journal row of %s not used (%s): reading its header", item.name, e)
            return None
        return IndexedEntry(
            entry_id=row["entry_id"],
            namespace=row["namespace"],
            directory=ns_dir,
            file_name=item.name,
            tokens=np.frombuffer(token_ids, dtype="<u4"),
            bytes=row["bytes"],
            mtime_ns=row["mtime_ns"],
            trimmable=bool(row["trimmable"]),
            minimum_reusable_offset=row["minimum_reusable_offset"],
            companion_bytes=row["companion_bytes"],
        )

    def _reap(self, path: Path) -> None:
        try:
            self.disk.unlink(path)
        except DiskError as e:
            log.warning("cannot reap %s: %s", path, e)
            return
        self.record_event(ev.TempReaped(path=self.relative(path)))

    def _scan_file(self, ns_dir: Path, ns_dir_name: str, item: DirEntry) -> None:
        path = ns_dir / item.name
        try:
            header = kvfile.read_header_summary(
                path, disk=self.disk, size_bytes=item.size_bytes, safeguards=self.safeguards, keyring=self.keyring
            )
            companion_bytes = kvfile.companion_bytes(header, path)
        except KeyUnavailable as e:
            self.quarantine_sealed(path, "", e.key_id)
            return
        except (UnsupportedFormat, CorruptEntry) as e:
            self.quarantine(path, "", str(e))
            return
        except DiskError as e:
            log.warning("skipping unreadable %s: %s", path, e)
            return
        # The name ends with FILE_SUFFIX (the caller checked): the stem without a Path's parsing.
        entry_id = item.name[: -len(kvfile.FILE_SUFFIX)]
        problem = self._mismatch(header, ns_dir_name, entry_id)
        if problem:
            self.quarantine(path, "", problem)
            return
        self.index(
            IndexedEntry(
                entry_id=entry_id,
                namespace=header.namespace,
                directory=ns_dir,
                file_name=item.name,
                tokens=header.token_array,
                bytes=item.size_bytes,
                mtime_ns=item.mtime_ns,
                trimmable=header.trimmable,
                minimum_reusable_offset=header.minimum_reusable_offset,
                companion_bytes=companion_bytes,
            )
        )

    def _mismatch(self, header: kvfile.HeaderSummary, ns_dir_name: str, entry_id: str) -> str:
        if header.fingerprint.get("digest") != self.fingerprint:
            return f"fingerprint {header.fingerprint.get('digest')!r} is not this directory's {self.fingerprint!r}"
        if namespace_dir_name(header.namespace) != ns_dir_name:
            return f"namespace {header.namespace!r} does not belong in directory {ns_dir_name}"
        if not _is_entry_id(entry_id):
            return "file name is not an entry id"
        if header.generation_checkpoint is not None:
            return "a generation checkpoint outside the checkpoints directory"
        return ""


def reconciliation(
    entries: Mapping[str, IndexedEntry],
    journaled: JournalRows,
    trusted: set[str],
    fields: Callable[[IndexedEntry], ev.EntryFields],
    sealing_key_id: str | None = None,
) -> list[ev.Event]:
    """The files are the truth: the events that bring the journal's
    projection `journaled` in line with the scanned `entries`, one per
    correction, in entry-id order. Entries indexed from the projection
    (`trusted`) agree with it by construction. `sealing_key_id`: the key the
    journal seals token ids under (None: it stores them plain)."""
    corrections: list[ev.Event] = []
    # Only the entries indexed from their headers can disagree with the projection.
    for entry_id in sorted(entries.keys() - trusted):
        row = journaled.get(entry_id)
        entry_fields = fields(entries[entry_id])
        if row is None:
            corrections.append(ev.ReconcileAdded(entry=entry_fields))
        elif not _row_agrees(row, entry_fields, sealing_key_id):
            corrections.append(ev.ReconcileUpdated(entry=entry_fields))
    gone = sorted(set(journaled) - set(entries))
    corrections.extend(ev.ReconcileRemoved(entry_id=entry_id) for entry_id in gone)
    return corrections


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector over the startup scan, then
    restore its previous state. The scan allocates tens of thousands of
    long-lived containers (trie nodes, entries, frontier tuples), and every
    automatic collection traverses all those built so far: measured at 60-110
    us per entry at 3,000 entries, a third of the scan. The scan makes no
    cyclic garbage of note; reference counting frees the rest as before, and
    the first collection after the scan finds whatever cycles there are."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _is_entry_id(name: str) -> bool:
    return _ENTRY_ID.fullmatch(name) is not None


def _row_agrees(row: dict[str, Any], entry_fields: ev.EntryFields, sealing_key_id: str | None) -> bool:
    """Whether the journal's row records `entry_fields` (plain token ids, as
    the index has them) as the journal would store them now: a sealed row is
    compared by its digest and sealing key (a fresh seal draws a new nonce)."""
    row_key_id = sealed_key_id(row["token_ids"], row["token_count"])
    if row_key_id != sealing_key_id:
        return False
    stored = ev.EntryFields(**{field.name: row[field.name] for field in attrs.fields(ev.EntryFields)})
    if row_key_id is not None:
        stored = attrs.evolve(stored, token_ids=entry_fields.token_ids)
    return stored == entry_fields
