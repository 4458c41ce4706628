"""What `kvcellar journal stats` and `kvcellar journal verify` compute, apart
from how the command prints it: the journal's traffic figures, and the
three-way check of the stored projection, a replay of the events and a fresh
header scan of the files. Read-only; the files are read through `Disk`.
"""

from __future__ import annotations

import collections
import errno
from pathlib import Path
from typing import Any

from kvcellar.errors import CorruptEntry, DiskError, KeyUnavailable, UnsupportedFormat
from kvcellar.store import events as ev
from kvcellar.store import kvfile
from kvcellar.store.disk import DirEntry, Disk, RealDisk
from kvcellar.store.journal import ENTRY_COLUMNS, Journal
from kvcellar.store.keyring import KeyRing
from kvcellar.store.sealed_tokens import open_token_ids
from kvcellar.store.write_wear import fold_journal

# The SSD tier's quarantine directory (store/ssd.py names it the same).
QUARANTINE_DIR_NAME = "quarantine"
SEALED_QUARANTINE_DIR_NAME = "quarantine-sealed"  # store/ssd_files.py's, as QUARANTINE_DIR_NAME
# Fields a fresh header scan can vouch for; hit and restore counters live only in the journal.
FILE_CHECKED_FIELDS = tuple(column for column in ENTRY_COLUMNS if column not in ("hits", "restores"))


def journal_stats(root: Path, journal: Journal, disk: Disk | None = None) -> dict[str, Any]:
    """Counts by kind and the tier's traffic, from the events alone, plus the
    current index and quarantine sizes.

    Lookup misses are not journaled, so `hit_rate` is the share of stored
    entries that served at least one restore; `write_amplification` is the
    bytes written per byte restored.
    """
    counts: collections.Counter[str] = collections.Counter()
    entry_bytes: dict[str, int] = {}
    stored_ids: set[str] = set()
    restored_ids: set[str] = set()
    bytes_written = bytes_restored = 0
    for record in journal.events():
        counts[record.kind] += 1
        entry = getattr(record.event, "entry", None)
        if entry is not None:
            entry_bytes[entry.entry_id] = entry.bytes
        if isinstance(record.event, ev.EntryStored):
            stored_ids.add(record.entry_id)
            bytes_written += record.event.entry.bytes
        elif isinstance(record.event, ev.EntryRestored):
            restored_ids.add(record.entry_id)
            bytes_restored += entry_bytes.get(record.entry_id, 0)
    rows = journal.entries()
    quarantine_files = _listing(disk or RealDisk(), root / QUARANTINE_DIR_NAME)
    return {
        "events": sum(counts.values()),
        "counts_by_kind": dict(sorted(counts.items())),
        "entries": len(rows),
        "entry_bytes": sum(row["bytes"] for row in rows),
        "bytes_written": bytes_written,
        "bytes_restored": bytes_restored,
        "hits": counts[ev.EntryHit.kind],
        "restores": counts[ev.EntryRestored.kind],
        "hit_rate": len(stored_ids & restored_ids) / len(stored_ids) if stored_ids else None,
        "write_amplification": bytes_written / bytes_restored if bytes_restored else None,
        "quarantined": counts[ev.EntryQuarantined.kind],
        "quarantine_files": len(quarantine_files),
        "quarantine_bytes": sum(entry.size_bytes for entry in quarantine_files if not entry.is_dir),
        "write_wear": fold_journal(journal.events()).as_json(),
    }


def _listing(disk: Disk, directory: Path) -> list[DirEntry]:
    """A directory's entries; none when it does not exist (a tier that never quarantined)."""
    try:
        return disk.scandir(directory)
    except DiskError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return []
        raise


def scan_files(
    root: Path, disk: Disk | None = None, keyring: KeyRing | None = None
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Rows for every entry file from a fresh header read (a sealed one opened
    with `keyring`), and a mismatch for every file whose header cannot be
    read. Temp files and both quarantines are skipped."""
    disk = disk or RealDisk()
    rows: dict[str, dict[str, Any]] = {}
    problems: list[dict[str, Any]] = []
    for ns_dir in sorted(disk.scandir(root), key=lambda entry: entry.name):
        if not ns_dir.is_dir or ns_dir.name in (QUARANTINE_DIR_NAME, SEALED_QUARANTINE_DIR_NAME):
            continue
        files = [entry for entry in disk.scandir(root / ns_dir.name) if entry.name.endswith(kvfile.FILE_SUFFIX)]
        for file in sorted(files, key=lambda entry: entry.name):
            path = root / ns_dir.name / file.name
            relative = f"{ns_dir.name}/{file.name}"
            try:
                header = kvfile.read_header(path, disk=disk, size_bytes=file.size_bytes, keyring=keyring)
            except (CorruptEntry, UnsupportedFormat, DiskError, KeyUnavailable) as e:
                problems.append(_mismatch("files", path.stem, "header", relative, f"unreadable: {e}"))
                continue
            rows[path.stem] = {
                "entry_id": path.stem,
                "namespace": header.namespace,
                "path": relative,
                "token_count": len(header.token_array),
                "tokens_digest": ev.tokens_digest(header.token_array),
                "token_ids": header.token_ids,
                "bytes": file.size_bytes,
                "mtime_ns": file.mtime_ns,
                "trimmable": int(header.trimmable),
                "minimum_reusable_offset": header.minimum_reusable_offset,
                "companion_bytes": kvfile.companion_bytes(header, path),
            }
    return rows, problems


def _shown(value: Any) -> Any:
    if isinstance(value, bytes):
        text = value.hex()
        return text if len(text) <= 24 else f"{text[:24]}… ({len(value)} bytes)"
    return value


def _mismatch(check: str, entry_id: str, field: str, left: Any, right: Any) -> dict[str, Any]:
    return {"check": check, "entry_id": entry_id, "field": field, "left": _shown(left), "right": _shown(right)}


def compare_rows(
    check: str, left: dict[str, dict[str, Any]], right: dict[str, dict[str, Any]], fields: tuple[str, ...]
) -> list[dict[str, Any]]:
    """Every difference between two sets of rows keyed by entry id."""
    mismatches = []
    for entry_id in sorted(left.keys() | right.keys()):
        if entry_id not in right or entry_id not in left:
            presence = ("present", "missing") if entry_id in left else ("missing", "present")
            mismatches.append(_mismatch(check, entry_id, "entry", *presence))
            continue
        for field in fields:
            if left[entry_id][field] != right[entry_id][field]:
                mismatches.append(_mismatch(check, entry_id, field, left[entry_id][field], right[entry_id][field]))
    return mismatches


def verify_journal(
    root: Path, journal: Journal, disk: Disk | None = None, keyring: KeyRing | None = None
) -> tuple[int, list[dict[str, Any]]]:
    """The number of indexed entries and every disagreement between the stored
    projection, a replay of the events, and the files on disk."""
    stored = {row["entry_id"]: row for row in journal.entries()}
    replayed = {row["entry_id"]: row for row in journal.replay()}
    files, problems = scan_files(root, disk, keyring)
    mismatches = compare_rows("projection vs replay", stored, replayed, ENTRY_COLUMNS)
    opened, unopened = _opened_rows(stored, keyring)
    mismatches += compare_rows("projection vs files", opened, files, FILE_CHECKED_FIELDS)
    return len(stored), mismatches + unopened + problems


def _opened_rows(
    rows: dict[str, dict[str, Any]], keyring: KeyRing | None
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """The rows with their sealed token ids opened, and a mismatch for each
    that cannot be (its key missing, or its tag failing): such a row is then
    compared as stored."""
    opened: dict[str, dict[str, Any]] = {}
    problems: list[dict[str, Any]] = []
    for entry_id, row in rows.items():
        try:
            token_ids = open_token_ids(keyring, entry_id, row["token_ids"], row["token_count"])
        except (KeyUnavailable, CorruptEntry) as e:
            problems.append(_mismatch("projection", entry_id, "token_ids", "sealed", f"cannot be opened: {e}"))
            token_ids = row["token_ids"]
        opened[entry_id] = {**row, "token_ids": token_ids}
    return opened, problems
