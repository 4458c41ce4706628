"""The SsdWriter: writes one snapshot at a time into the SSD store.

A write crosses to other threads at most twice (`store/spill_plan.py`): one
engine turn plans the write and materialises every tensor (none when the
snapshot came planned: a write-behind snapshot is planned in the turn that
took it from the RAM tier), and one worker call writes every tensor, commits
(header, fsync, rename, directory fsync) and lets the store index the entry
and supersede or evict. The outcome is "stored" or "failed"; a failure never
leaves a temp file behind, and a failed fsync is never retried on the same
file: a later attempt writes a new one.

The core (`actors/ssd_writer_core.py`) tracks the write (IDLE → WRITING →
IDLE); the shell performs it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, assert_never

import trio

from kvcellar.actors.runtime import ActorShell, Reply
from kvcellar.actors.ssd_writer_core import (
    Committed,
    Report,
    SsdWriterCore,
    SsdWriterMessage,
    Write,
    WriteEntry,
    WriteFailed,
)
from kvcellar.errors import DiskError
from kvcellar.store.companion import has_companion
from kvcellar.store.prompt_cache import SpillSnapshot
from kvcellar.store.safeguards import SAFEGUARDS, Safeguards
from kvcellar.store.spill_plan import PlannedSpill, plan_spill, write_planned
from kvcellar.store.ssd import PendingStore, SsdStore

log = logging.getLogger("kvcellar.ssd_writer")


RunWhenIdle = Callable[[Callable[[Any], Any]], Awaitable[Any]]
RunBlocking = Callable[..., Awaitable[Any]]


class SsdWriter:
    """The shell: `await write(snapshot)` → "stored" | "failed". Writes are
    serial (the SpillQueue dispatches one at a time); calls must not overlap."""

    def __init__(
        self,
        store: SsdStore,
        run_when_idle: RunWhenIdle,
        *,
        journal: Any = None,
        tokenizer_hash: str = "",
        run_blocking: RunBlocking | None = None,
        safeguards: Safeguards = SAFEGUARDS,
    ) -> None:
        self.store = store
        self.safeguards = safeguards
        # Blocking file I/O goes to a worker thread; the simulator runs it inline.
        self.run_blocking: RunBlocking = run_blocking or trio.to_thread.run_sync
        self._unpublished: list[Any] = []  # only without the ack_after_rename safeguard
        self.run_when_idle = run_when_idle
        self.core = SsdWriterCore()
        # No mailbox: `write` drives the core in its own task (`ActorShell.drive`).
        self.shell = ActorShell("ssd_writer", self.core, self._perform, journal=journal)
        self.tokenizer_hash = tokenizer_hash
        self._write_ids = 0
        self._current: PlannedSpill | None = None  # the write in progress (writes are serial)
        self._reports: dict[int, Reply[str]] = {}

    def plan(self, snapshot: SpillSnapshot) -> PlannedSpill:
        """Plan `snapshot`'s write and materialise its tensors: MLX work, on the
        engine thread only (the durability coordinator's snapshot turn calls it)."""
        return plan_spill(self.store, snapshot, self.tokenizer_hash)

    async def write(self, snapshot: SpillSnapshot) -> str:
        while self._unpublished:
            await self.run_blocking(self._unpublished.pop(0).publish)
        # A write-behind snapshot comes planned; a spill is planned in this one engine turn.
        planned = snapshot
        if not isinstance(planned, PlannedSpill):
            planned = await self.run_when_idle(lambda _: self.plan(snapshot))
        if planned.pending is None:
            return "failed"
        self._write_ids += 1
        write = Write(
            write_id=self._write_ids,
            tensor_count=planned.pending.writer.tensor_count,
            token_count=len(planned.tokens),
            namespace=planned.namespace,
        )
        report = self._reports[write.write_id] = Reply[str]()
        self._current = planned
        try:
            # The step's work answers the next message; the last effect is the Report.
            await self.shell.drive(write)
        finally:
            self._current = None
            self._reports.pop(write.write_id, None)
        return report.result()

    def _perform(self, effect: WriteEntry | Report) -> Awaitable[SsdWriterMessage] | None:
        match effect:
            case Report():
                self._reports[effect.write_id].set(effect.outcome)
                return None
            case WriteEntry():
                assert self._current is not None and self._current.pending is not None, "no write in progress"
                return self._write_entry(effect.write_id, self._current.pending, self._current.segments)
            case _:
                assert_never(effect)

    def _commit_target_alone(self) -> None:
        """The `split-companion` mutation's bug (store/mutations.py): an entry's
        target caches committed in a file of their own before the entry itself."""
        planned = self._current
        if planned is not None and has_companion(planned.caches):
            self.store.store(planned.tokens, planned.caches[:-1], planned.namespace, tokenizer_hash=self.tokenizer_hash)

    async def _write_entry(
        self, write_id: int, pending: PendingStore, segments: tuple[list[memoryview], ...]
    ) -> SsdWriterMessage:
        """Write, commit and index the entry in one worker call; the message says how it went."""
        publish = self.safeguards.ack_after_rename
        written: list[bool] = []

        def write_and_index() -> Exception | None:
            try:
                if not self.safeguards.companion_in_entry_file:
                    self._commit_target_alone()
                write_planned(pending, segments, publish=publish)
            except Exception as e:  # the temp file is gone already
                return e
            written.append(True)
            # Indexing unlinks what the entry supersedes or evicts: file I/O, on this worker too.
            self.store.finish_store(pending)
            return None

        try:
            failure = await self.run_blocking(write_and_index)
        except trio.Cancelled:
            # A worker call is never interrupted: cancelled before it ran (the simulator's
            # seam), nothing is left to remove; after, the entry is committed and indexed.
            if not written:
                pending.writer.abort()
            elif not publish:
                self._unpublished.append(pending.writer)
            raise
        if failure is None:
            if not publish:
                self._unpublished.append(pending.writer)
            return Committed(write_id=write_id)
        if isinstance(failure, DiskError):
            self.store.fail_store(pending, failure)
        else:
            log.warning("SSD write failed: %s", failure)
        return WriteFailed(write_id=write_id, reason=str(failure))
