"""The SSD tier's files: the directory layout, durable directories, the
quarantine and the unlinks of removed entries.

Every call here does file I/O through the `Disk` and none takes the index
lock around it: a quarantine counts itself and journals its event through
`SsdIndex`'s short critical sections, before and after the move; removals are
decided by the index and unlinked here afterwards.

Layout under the root directory:

    <root>/<fingerprint>/lock                 exclusive lock, names its holder
    <root>/<fingerprint>/journal.sqlite       the journal (events + projections)
    <root>/<fingerprint>/<ns-hash>/<uuid>.kvc one file per entry
    <root>/<fingerprint>/checkpoints/         in-flight generation checkpoints (`store.checkpoints`)
    <root>/<fingerprint>/quarantine/          corrupt or mismatched files, capped
    <root>/<fingerprint>/quarantine-sealed/   entries sealed under a key this server lacks, never purged
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from kvcellar.errors import DiskError
from kvcellar.store import events as ev
from kvcellar.store import kvfile
from kvcellar.store.disk import Disk
from kvcellar.store.ssd_index import SsdIndex

log = logging.getLogger("kvcellar.ssd")

QUARANTINE_DIR_NAME = "quarantine"
# Entries sealed under a key the server was not given (`KeyUnavailable`): kept
# whole and uncapped, since the key may come back; moving a file back to its
# namespace directory (the part of its name before the first "-" after the
# clock) makes it an entry again at the next start.
SEALED_QUARANTINE_DIR_NAME = "quarantine-sealed"
# In-flight generation checkpoints (`store.checkpoints`): never prefix entries.
CHECKPOINT_DIR_NAME = "checkpoints"
LOCK_FILE_NAME = "lock"
QUARANTINE_BYTES_MAX_DEFAULT = 1 << 30

_NS_HASH_HEX_CHARS = 16
# A startup scan checks every file's namespace against its directory: a pure
# function of a few distinct strings, so it is memoised.
_NS_DIR_NAMES_CACHED = 1024


@functools.lru_cache(maxsize=_NS_DIR_NAMES_CACHED)
def namespace_dir_name(namespace: str) -> str:
    """The directory of a namespace: a hash, so any adapter spec is a safe name."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:_NS_HASH_HEX_CHARS]


class TierFiles:
    """The files of the fingerprint directory `directory`."""

    def __init__(
        self,
        *,
        directory: Path,
        disk: Disk,
        index: SsdIndex,
        clock_ns: Callable[[], int],
        quarantine_bytes_max: int,
    ) -> None:
        self.directory = directory
        self.disk = disk
        self.quarantine_bytes_max = quarantine_bytes_max
        self._index = index
        self._clock_ns = clock_ns
        # Directories already made durable in this process. Add-only, each
        # path added after its directory is durable; two threads that both
        # miss it make and fsync it twice, which is harmless.
        self._durable_dirs: set[Path] = set()
        # Key ids already warned about: one WARNING per missing key, not one per file.
        self._missing_key_ids: set[str] = set()

    def entry_path(self, namespace: str, entry_id: str) -> Path:
        return self.directory / namespace_dir_name(namespace) / f"{entry_id}{kvfile.FILE_SUFFIX}"

    def relative(self, path: Path) -> str:
        """A path under the directory, as the journal names it."""
        return str(path.relative_to(self.directory))

    def make_durable_dirs(self, path: Path, top: Path) -> None:
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

    def make_durable_dir(self, path: Path) -> None:
        """Create a directory under the fingerprint directory, durably."""
        self.make_durable_dirs(path, self.directory)

    def unlink_removed(self, paths: list[Path]) -> None:
        """The files of entries the index removed. A restore that already
        opened one keeps reading it; one that opens it later finds it gone (a miss)."""
        for path in paths:
            try:
                self.disk.unlink(path)
            except DiskError as e:
                log.warning("cannot remove %s: %s", path, e)

    def quarantine(self, path: Path, entry_id: str, reason: str) -> None:
        """Move a bad file aside (kept for inspection), then keep quarantine
        under its cap. The file is no longer indexed (or never was)."""
        log.warning("quarantining %s: %s", path, reason)
        self._move_aside(path, entry_id, reason, QUARANTINE_DIR_NAME)
        self._purge_quarantine()

    def quarantine_sealed(self, path: Path, entry_id: str, key_id: str) -> None:
        """Move an entry sealed under key `key_id`, which this server lacks,
        to the uncapped sealed quarantine: never deleted. The first such
        entry of each key id logs one WARNING naming it; later ones log at INFO."""
        if key_id not in self._missing_key_ids:
            self._missing_key_ids.add(key_id)
            log.warning(
                "entries sealed under encryption key %s cannot be opened (no --encryption-key-file holds it): "
                "moving them to %s and serving their prompts cold",
                key_id,
                self.directory / SEALED_QUARANTINE_DIR_NAME,
            )
        else:
            log.info("quarantining %s: sealed under missing key %s", path, key_id)
        self._move_aside(path, entry_id, f"sealed under missing encryption key {key_id}", SEALED_QUARANTINE_DIR_NAME)

    def _move_aside(self, path: Path, entry_id: str, reason: str, dir_name: str) -> None:
        self._index.count_quarantined()
        quarantine_dir = self.directory / dir_name
        target = quarantine_dir / f"{self._clock_ns()}-{path.parent.name}-{path.name}"
        try:
            self.disk.makedirs(quarantine_dir)
            self.disk.rename(path, target)
            self._unlink_if_still_linked(path)
        except DiskError as e:
            log.warning("cannot quarantine %s (%s); removing it", path, e)
            with suppress(DiskError):
                self.disk.unlink(path)
            target = Path("")
        self._index.record(
            ev.EntryQuarantined(
                entry_id=entry_id, path=self.relative(path), quarantine_path=str(target.name), reason=reason
            )
        )

    def _unlink_if_still_linked(self, path: Path) -> None:
        """A rename onto another link to the same file does nothing (POSIX), and a crash can
        leave a quarantined file linked in both directories (the quarantine's addition
        durable, the source's removal not) under the same name when the clock repeats:
        the source link goes, or every later start would quarantine it again."""
        try:
            self.disk.stat(path)
        except DiskError:
            return
        self.disk.unlink(path)

    def quarantine_file(self, path: Path, reason: str) -> None:
        """Move a bad file that is not an indexed entry aside."""
        self.quarantine(path, "", reason)

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
            self._index.record(ev.QuarantinePurged(quarantine_path=item.name, bytes=item.size_bytes))
