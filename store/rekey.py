"""`kvcellar cache rekey`: re-seal every SSD entry (and its journal row)
under the first key of a key ring.

Each fingerprint directory is opened as a server opens it (`SsdStore.open`:
its directory lock, so a live server's directory is refused with
`DirectoryLocked`; the startup scan; the journal's reconciliation, which
already seals plain rows under the first key). Then every entry that is not
sealed under the first key (plain, or under an older key of the ring) is
loaded with the ring and stored again through the store's own write path: a
new sealed file, committed atomically (temp file, fsync, rename, directory
fsync), journaled (`entry.stored`), which supersedes the old entry as its
exact duplicate (`entry.superseded`, the old file unlinked).

Crash safety: at every instant each entry has a committed file, sealed under
a key of the ring (the old one, the new one, or both for a moment); a kill -9
leaves at worst both files of one entry, and the next open (a rerun, or a
server) keeps one of them by its startup supersession. A rerun skips what is
done and finishes. Rows still sealed under another key are journaled afresh
at the end (`reconcile.updated`).

Generation checkpoints are sealed again in place: each is loaded with the
ring and written under the first key to a temp file renamed over it (the
old file stays valid until the rename, as when a generation writes its
next checkpoint). The journal's event history (every stored event carrying
an entry's token ids: `entry.stored`, `reconcile.added`, `reconcile.updated`)
is sealed again in one SQLite transaction (`Journal.rewrite_payloads`), so
the old key can be dropped afterwards: nothing the tier holds needs it. An
event whose token ids no key of the ring opens keeps its payload and is
counted in `history_failed`.

Not rekeyed: the sealed quarantine (entries whose key was missing; kept as
they are for the operator). A re-stored entry's mtime is the rekey's time,
so the eviction order of rekeyed entries starts afresh.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from kvcellar.errors import CorruptEntry, DiskError, KeyUnavailable, StoreError, UnsupportedFormat
from kvcellar.store import events as ev
from kvcellar.store import kvfile
from kvcellar.store.checkpoints import CheckpointStore
from kvcellar.store.disk import Disk, RealDisk
from kvcellar.store.keyring import KeyRing
from kvcellar.store.sealed_tokens import TOKEN_CARRYING_KINDS, resealed_event, sealed_key_id
from kvcellar.store.ssd import SsdStore
from kvcellar.store.ssd_files import CHECKPOINT_DIR_NAME, QUARANTINE_DIR_NAME, SEALED_QUARANTINE_DIR_NAME

_NOT_ENTRY_DIRS = frozenset((QUARANTINE_DIR_NAME, SEALED_QUARANTINE_DIR_NAME, CHECKPOINT_DIR_NAME))


@attrs.define(kw_only=True)
class RekeyReport:
    """What one fingerprint directory's rekey did."""

    fingerprint: str
    entries: int = 0  # indexed entries at the start
    rekeyed: int = 0  # files sealed again under the first key
    already: int = 0  # files under the first key already
    rows_resealed: int = 0  # journal rows sealed again under the first key
    checkpoints_rekeyed: int = 0  # generation checkpoints sealed again under the first key
    history_resealed: int = 0  # journal events whose token ids were sealed again under the first key
    history_failed: int = 0  # journal events no key of the ring opens (left as they were)
    failed: list[str] = attrs.Factory(list)  # "entry id: reason" for entries left as they were

    def as_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def fingerprint_dirs(root: Path, disk: Disk | None = None) -> list[str]:
    """The fingerprint directories under an SSD cache root (sorted)."""
    disk = disk or RealDisk()
    return sorted(entry.name for entry in disk.scandir(root) if entry.is_dir)


def rekey_directory(
    root: Path, fingerprint: str, keyring: KeyRing, progress: Callable[[str], None], disk: Disk | None = None
) -> RekeyReport:
    """Re-seal every entry of `root/fingerprint` under `keyring.sealing`;
    `progress` gets one line per entry, after its new file is committed.
    Raises `DirectoryLocked` when a server holds the directory."""
    disk = disk or RealDisk()
    fields = _fingerprint_fields(root / fingerprint, keyring, disk)
    store = SsdStore.open(root, fingerprint, disk=disk, fingerprint_fields=fields, keyring=keyring, verify=True)
    report = RekeyReport(fingerprint=fingerprint)
    try:
        entry_ids = store.entry_ids()
        report.entries = len(entry_ids)
        for number, entry_id in enumerate(entry_ids, start=1):
            outcome = _rekey_entry(store, entry_id, keyring, report)
            progress(f"{fingerprint} {number}/{len(entry_ids)} {entry_id} {outcome}")
        report.rows_resealed = _reseal_rows(store, keyring)
        _rekey_checkpoints(store, keyring, report, progress)
        _reseal_history(store, keyring, report)
    finally:
        store.close()
    return report


def _rekey_entry(store: SsdStore, entry_id: str, keyring: KeyRing, report: RekeyReport) -> str:
    entry = store.entry(entry_id)
    if entry is None:
        return "gone"
    try:
        header = kvfile.read_header(entry.path, disk=store.disk, keyring=keyring)
        if header.seal is not None and header.seal.key_id == keyring.sealing.key_id:
            report.already += 1
            return "already"
        loaded = kvfile.load(entry.path, verify=True, disk=store.disk, keyring=keyring)
    except (CorruptEntry, UnsupportedFormat, KeyUnavailable, DiskError) as e:
        report.failed.append(f"{entry_id}: {e}")
        return f"failed: {e}"
    new_id = store.store(
        loaded.tokens, loaded.caches, loaded.header.namespace, tokenizer_hash=loaded.header.tokenizer_hash
    )
    if new_id is None:
        report.failed.append(f"{entry_id}: not stored again (disk full or an I/O error)")
        return "failed: not stored again"
    report.rekeyed += 1
    return f"rekeyed as {new_id}"


def _reseal_rows(store: SsdStore, keyring: KeyRing) -> int:
    """Journal afresh every row not sealed under the first key (the journal seals it)."""
    if store.journal is None:
        return 0
    store.journal.wait_applied()
    corrections: list[ev.Event] = []
    for row in store.journal.entries():
        entry = store.entry(row["entry_id"])
        if entry is None or sealed_key_id(row["token_ids"], row["token_count"]) == keyring.sealing.key_id:
            continue
        corrections.append(ev.ReconcileUpdated(entry=store.index.fields(entry)))
    store.journal.append_many(corrections)
    store.journal.wait_applied()
    return len(corrections)


def _rekey_checkpoints(store: SsdStore, keyring: KeyRing, report: RekeyReport, progress: Callable[[str], None]) -> None:
    """Seal every generation checkpoint not under the first key again, in place (atomic rename)."""
    checkpoints = CheckpointStore.open(store)
    for found in checkpoints.files():
        try:
            header = kvfile.read_header(found.path, disk=store.disk, keyring=keyring)
            if header.seal is not None and header.seal.key_id == keyring.sealing.key_id:
                continue
            loaded = kvfile.load(found.path, verify=True, disk=store.disk, keyring=keyring)
            checkpoint = loaded.header.generation_checkpoint
            assert checkpoint is not None  # the checkpoint store's scan indexed only checkpoints
            kvfile.write_entry(checkpoints.plan(checkpoint, loaded.tokens, loaded.caches))
        except (CorruptEntry, UnsupportedFormat, KeyUnavailable, DiskError) as e:
            report.failed.append(f"checkpoint {found.request_key}: {e}")
            progress(f"{report.fingerprint} checkpoint {found.request_key} failed: {e}")
            continue
        report.checkpoints_rekeyed += 1
        progress(f"{report.fingerprint} checkpoint {found.request_key} rekeyed")


def _reseal_history(store: SsdStore, keyring: KeyRing, report: RekeyReport) -> None:
    """Seal the token ids of every stored event under the first key (one transaction)."""
    if store.journal is None:
        return

    def reseal(event: ev.Event) -> ev.Event | None:
        try:
            return resealed_event(keyring, event)
        except (KeyUnavailable, CorruptEntry):
            report.history_failed += 1
            return None

    store.journal.wait_applied()
    report.history_resealed = store.journal.rewrite_payloads(TOKEN_CARRYING_KINDS, reseal)


def _fingerprint_fields(directory: Path, keyring: KeyRing, disk: Disk) -> dict[str, str]:
    """The serving fingerprint's fields as the entries record them (the first
    header that opens), so a re-stored entry keeps them; {} when none opens."""
    for ns_dir in sorted(disk.scandir(directory), key=lambda item: item.name):
        if not ns_dir.is_dir or ns_dir.name in _NOT_ENTRY_DIRS:
            continue
        for item in sorted(disk.scandir(directory / ns_dir.name), key=lambda item: item.name):
            if not item.name.endswith(kvfile.FILE_SUFFIX):
                continue
            try:
                header = kvfile.read_header(directory / ns_dir.name / item.name, disk=disk, keyring=keyring)
            except StoreError:
                continue
            return {key: value for key, value in header.fingerprint.items() if key != "digest"}
    return {}
