"""In-flight generation checkpoints on the SSD tier (spec §5.1 D6, §5.7).

One file per request key, `<root>/<fingerprint>/checkpoints/<key>.kvc`, a
format-version-2 `.kvc` entry (`store.kvfile`; version 4, sealed, when the
SSD store has a key ring: a checkpoint sealed under a key the ring lacks
goes to the sealed quarantine, like an entry): tokens and caches encode the
prompt and the emitted prefix, `Header.generation_checkpoint` the pending
token and the sampler state. Checkpoints live beside the prefix entries, not
among them: they are never a prefix match, never superseded or evicted by
the prefix policy, and no admission policy of the prefix entries applies to
them (their own queue, `actors.checkpoint_writer`, decides what is written).

Only the newest checkpoint of a request is kept, and the name makes that
atomic: a new one is written to a temp file and renamed over the old one,
which stays valid until that rename and the directory fsync complete.

Attempts: each generation that may checkpoint gets an attempt number, rising
within the process; files found at startup belong to an earlier process and
are older than any attempt of this one. Completion `invalidate`s its attempt
at once (no later lookup resumes it, and a write of that attempt still in
the queue is not indexed) and queues `remove`, which unlinks the file unless
a newer attempt of the same request owns it: an older cleanup never erases
a newer attempt.

Threads: `lookup`/`restore`/`plan`/`invalidate` run on the engine thread,
`commit`/`remove` on the checkpoint writer's worker thread, `stats` on the
Trio thread. One lock guards the index and counters, never held across file
I/O. Events go to the SSD store's journal (and its listeners).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from kvcellar.errors import CorruptEntry, DiskError, KeyUnavailable, UnsupportedFormat
from kvcellar.store import kvfile
from kvcellar.store.actor_events import (
    CheckpointInvalidated,
    CheckpointRemoved,
    CheckpointResumed,
    CheckpointWritten,
)
from kvcellar.store.records import GenerationCheckpoint
from kvcellar.store.ssd import CHECKPOINT_DIR_NAME, SsdStore
from kvcellar.store.wipe import WipeSelector

log = logging.getLogger("kvcellar.checkpoints")

# Attempts found on disk at startup: older than any attempt of this process.
EARLIER_PROCESS_ATTEMPT = 0


@attrs.define(kw_only=True)
class CheckpointFile:
    request_key: str
    path: Path
    emitted_tokens: int
    bytes: int
    attempt: int
    # What a wipe selects it by (store/wipe.py): the entry's namespace and its tokens (prompt + emitted).
    namespace: str = ""
    tokens: np.ndarray = attrs.field(factory=lambda: np.empty(0, dtype=np.uint32))
    # Of `bytes`, the companion section's (the draft model's KV, store/companion.py).
    companion_bytes: int = 0


@attrs.define(kw_only=True)
class ResumePoint:
    """A restored checkpoint: `caches` cover `tokens` (prompt + emitted)."""

    caches: list[Any]
    tokens: tuple[int, ...]
    checkpoint: GenerationCheckpoint

    @property
    def emitted(self) -> tuple[int, ...]:
        return self.tokens[self.checkpoint.prompt_tokens :]


@attrs.frozen(kw_only=True, eq=False)
class CheckpointSnapshot:
    """An owned checkpoint, ready for disk (`actors.checkpoint_writer`):
    `segments[i]` are tensor i's bytes, views of the evaluated arrays that
    `pinned` keeps alive; the engine may go on decoding meanwhile."""

    checkpoint: GenerationCheckpoint
    writer: kvfile.KvFileWriter
    segments: list[list[memoryview]]
    pinned: list[Any]
    bytes: int


@attrs.define(kw_only=True)
class CheckpointCounters:
    # Published as /stats's `checkpoints`.
    written: int = 0  # files committed and indexed
    written_bytes: int = 0
    resumed: int = 0  # requests that went on from a checkpoint
    tokens_saved: int = 0  # emitted tokens those requests did not generate again
    invalidated: int = 0  # checkpoints of completed requests
    removed: int = 0  # their files unlinked
    quarantined: int = 0  # checkpoint files that failed a check
    restore_failures: int = 0  # restores that read nothing usable (the request ran cold)
    wiped: int = 0  # checkpoint files a wipe removed


class CheckpointStore:
    """The checkpoints of one serving fingerprint (see the module doc)."""

    def __init__(self, ssd: SsdStore) -> None:
        self.ssd = ssd
        self.directory = ssd.directory / CHECKPOINT_DIR_NAME
        self._lock = threading.Lock()
        self._files: dict[str, CheckpointFile] = {}
        # The newest attempt of each request that completed: nothing of it or older is indexed again.
        self._invalidated: dict[str, int] = {}
        self._attempts = itertools.count(EARLIER_PROCESS_ATTEMPT + 1)
        self.counters = CheckpointCounters()
        self.skipped: Counter[str] = Counter()

    @classmethod
    def open(cls, ssd: SsdStore) -> CheckpointStore:
        """Create the directory (durably) and index the checkpoints in it: temp
        files are reaped, files that fail a check quarantined. Disk work."""
        store = cls(ssd)
        ssd.make_durable_dir(store.directory)
        store._scan()
        return store

    def _scan(self) -> None:
        for item in self.ssd.disk.scandir(self.directory):
            path = self.directory / item.name
            if item.name.endswith(kvfile.TEMP_SUFFIX):
                with contextlib.suppress(DiskError):
                    self.ssd.disk.unlink(path)
            elif item.name.endswith(kvfile.FILE_SUFFIX) and not item.is_dir:
                self._scan_file(path, item.size_bytes)

    def _scan_file(self, path: Path, size_bytes: int) -> None:
        try:
            header = kvfile.read_header(
                path,
                disk=self.ssd.disk,
                size_bytes=size_bytes,
                safeguards=self.ssd.safeguards,
                keyring=self.ssd.keyring,
            )
        except KeyUnavailable as e:
            self.ssd.quarantine_sealed_file(path, e.key_id)
            return
        except (UnsupportedFormat, CorruptEntry) as e:
            self._quarantine(path, str(e))
            return
        except DiskError as e:
            log.warning("skipping unreadable checkpoint %s: %s", path, e)
            return
        problem = self._mismatch(header, path)
        if problem:
            self._quarantine(path, problem)
            return
        checkpoint = header.generation_checkpoint
        assert checkpoint is not None
        self._files[checkpoint.request_key] = CheckpointFile(
            request_key=checkpoint.request_key,
            path=path,
            emitted_tokens=checkpoint.emitted_tokens,
            bytes=size_bytes,
            attempt=EARLIER_PROCESS_ATTEMPT,
            namespace=header.namespace,
            tokens=header.token_array,
            companion_bytes=kvfile.companion_bytes(header, path),
        )

    def _mismatch(self, header: kvfile.Header, path: Path) -> str:
        checkpoint = header.generation_checkpoint
        if checkpoint is None:
            return "not a generation checkpoint"
        if header.fingerprint.get("digest") != self.ssd.fingerprint:
            return f"fingerprint {header.fingerprint.get('digest')!r} is not this directory's"
        if path.stem != checkpoint.request_key:
            return f"file name is not its request key {checkpoint.request_key!r}"
        if len(header.token_ids) // 4 != checkpoint.prompt_tokens + checkpoint.emitted_tokens:
            return "its tokens are not the prompt and the emitted tokens"
        if header.namespace != checkpoint.namespace:
            return "its namespace disagrees with the entry's"
        return ""

    def _quarantine(self, path: Path, reason: str) -> None:
        with self._lock:
            self.counters.quarantined += 1
        self.ssd.quarantine_file(path, f"checkpoint: {reason}")

    # -- engine thread ---------------------------------------------------------

    def new_attempt(self) -> int:
        with self._lock:
            return next(self._attempts)

    def count_skipped(self, reason: str) -> None:
        with self._lock:
            self.skipped[reason] += 1

    def lookup(self, request_key: str) -> CheckpointFile | None:
        with self._lock:
            return self._files.get(request_key)

    def restore(self, request_key: str, prompt: Sequence[int]) -> ResumePoint | None:
        """Load the request's checkpoint, or None: there is none, or its file
        failed a check (quarantined: the request runs cold) or did not read."""
        found = self.lookup(request_key)
        if found is None:
            return None
        try:
            entry = kvfile.load(
                found.path,
                verify=self.ssd.verify,
                disk=self.ssd.disk,
                safeguards=self.ssd.safeguards,
                keyring=self.ssd.keyring,
            )
            checkpoint = entry.header.generation_checkpoint
            problem = self._mismatch(entry.header, found.path)
            if not problem and tuple(entry.tokens[: len(prompt)]) != tuple(prompt):
                problem = "its tokens do not start with the request's prompt"
            if problem or checkpoint is None:
                raise CorruptEntry(f"{found.path}: {problem}", part="header")
        except KeyUnavailable as e:
            with self._lock:
                if self._files.get(found.request_key) is found:
                    del self._files[found.request_key]
                self.counters.restore_failures += 1
            self.ssd.quarantine_sealed_file(found.path, e.key_id)
            return None
        except (CorruptEntry, UnsupportedFormat) as e:
            self._drop_bad(found, str(e))
            return None
        except DiskError as e:
            with self._lock:
                self.counters.restore_failures += 1
            log.warning("cannot restore checkpoint %s: %s", found.path, e)
            return None
        with self._lock:
            self.counters.resumed += 1
            self.counters.tokens_saved += checkpoint.emitted_tokens
        self.ssd.record_event(
            CheckpointResumed(request_key=request_key, attempt=found.attempt, emitted_tokens=checkpoint.emitted_tokens)
        )
        return ResumePoint(caches=entry.caches, tokens=entry.tokens, checkpoint=checkpoint)

    def _drop_bad(self, found: CheckpointFile, reason: str) -> None:
        with self._lock:
            if self._files.get(found.request_key) is found:
                del self._files[found.request_key]
            self.counters.restore_failures += 1
        self._quarantine(found.path, reason)

    def plan(
        self, checkpoint: GenerationCheckpoint, tokens: Sequence[int], caches: Sequence[Any]
    ) -> kvfile.KvFileWriter:
        """A writer for the checkpoint (no I/O; slicing the caches is lazy MLX work)."""
        meta = kvfile.EntryMeta(
            namespace=checkpoint.namespace,
            fingerprint=self.ssd.fingerprint_fields,
            created_at_ns=self.ssd.clock_ns(),
        )
        path = self.directory / f"{checkpoint.request_key}{kvfile.FILE_SUFFIX}"
        return kvfile.KvFileWriter(
            path,
            caches,
            tokens,
            meta,
            self.ssd.disk,
            # Unique within the process without randomness (the simulator's determinism);
            # an earlier process's temp files are reaped at startup.
            temp_id=f"a{checkpoint.attempt}e{checkpoint.emitted_tokens}",
            safeguards=self.ssd.safeguards,
            generation_checkpoint=checkpoint,
            keyring=self.ssd.keyring,
        )

    def invalidate(self, request_key: str, attempt: int) -> None:
        """The attempt completed: no lookup finds its checkpoint from now on."""
        with self._lock:
            self._invalidated[request_key] = max(attempt, self._invalidated.get(request_key, attempt))
            found = self._files.get(request_key)
            if found is not None and found.attempt <= attempt:
                del self._files[request_key]
            self.counters.invalidated += 1
        self.ssd.record_event(CheckpointInvalidated(request_key=request_key, attempt=attempt))

    # -- the writer's worker thread -----------------------------------------------

    def commit(self, writer: kvfile.KvFileWriter) -> bool:
        """Index a checkpoint whose file is committed; False when its attempt
        completed meanwhile (the removal queued behind it unlinks the file)."""
        checkpoint = writer.planned_header.generation_checkpoint
        assert checkpoint is not None
        key, attempt = checkpoint.request_key, checkpoint.attempt
        file_bytes = writer.planned_header.file_bytes
        namespace, tokens = writer.planned_header.namespace, writer.planned_header.token_array
        if self.ssd.safeguards.wipe_tombstone_at_commit and any(
            selector.matches(namespace, tokens) for selector in self.ssd.unfinished_wipes().values()
        ):
            # Written before a wipe that selects it and committed after: it must not come back.
            self._unlink_quietly(writer.path)
            return False
        with self._lock:
            if self._invalidated.get(key, -1) >= attempt:
                return False
            current = self._files.get(key)
            if current is not None and current.attempt > attempt:
                return False  # a newer attempt's file replaced this one after its rename
            self._files[key] = CheckpointFile(
                request_key=key,
                path=writer.path,
                emitted_tokens=checkpoint.emitted_tokens,
                bytes=file_bytes,
                attempt=attempt,
                namespace=namespace,
                tokens=tokens,
                companion_bytes=kvfile.companion_bytes(writer.planned_header, writer.path),
            )
            self.counters.written += 1
            self.counters.written_bytes += file_bytes
        self.ssd.record_event(
            CheckpointWritten(
                request_key=key, attempt=attempt, emitted_tokens=checkpoint.emitted_tokens, bytes=file_bytes
            )
        )
        return True

    def remove(self, request_key: str, attempt: int) -> bool:
        """Unlink a completed attempt's file unless a newer attempt owns it."""
        with self._lock:
            current = self._files.get(request_key)
            newer = current is not None and current.attempt > attempt
        unlinked = False
        if not newer:
            try:
                self.ssd.disk.unlink(self.directory / f"{request_key}{kvfile.FILE_SUFFIX}")
                # Durable, so a power loss cannot bring a completed request's checkpoint back.
                self.ssd.disk.fsync_dir(self.directory)
                unlinked = True
            except DiskError as e:
                log.debug("checkpoint %s not (durably) removed: %s", request_key, e)
        with self._lock:
            self.counters.removed += int(unlinked)
        self.ssd.record_event(CheckpointRemoved(request_key=request_key, attempt=attempt, unlinked=unlinked))
        return unlinked

    def wipe(self, selector: WipeSelector) -> tuple[int, int, list[str]]:
        """Unindex and unlink every checkpoint `selector` selects (a wipe's checkpoint part);
        returns (files, bytes) removed and the names of those whose unlink failed."""
        with self._lock:
            doomed = [f for f in self._files.values() if selector.matches(f.namespace, f.tokens)]
            for found in doomed:
                del self._files[found.request_key]
        left = [found.path.name for found in doomed if not self._unlink_quietly(found.path)]
        with self._lock:
            self.counters.wiped += len(doomed) - len(left)
        return len(doomed) - len(left), sum(f.bytes for f in doomed if f.path.name not in left), left

    def _unlink_quietly(self, path: Path) -> bool:
        try:
            self.ssd.disk.unlink(path)
            self.ssd.disk.fsync_dir(self.directory)
        except DiskError as e:
            log.warning("checkpoint %s not (durably) removed: %s", path, e)
            return False
        return True

    def files(self) -> list[CheckpointFile]:
        """The indexed checkpoints, by request key (a snapshot)."""
        with self._lock:
            return [self._files[key] for key in sorted(self._files)]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "files": len(self._files),
                "file_bytes": sum(f.bytes for f in self._files.values()),
                "companion_bytes": sum(f.companion_bytes for f in self._files.values()),
                **attrs.asdict(self.counters),
                "skipped": dict(sorted(self.skipped.items())),
            }
