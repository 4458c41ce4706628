"""The SsdWriter: writes one snapshot at a time into the SSD store.

Each tensor is materialised in its own `run_when_idle` engine turn (MLX work,
never between two decode steps) and written off the Trio thread; the commit
(header, fsync, rename, directory fsync) runs off the Trio thread too, then
the store indexes the entry and supersedes or evicts. The outcome is
"stored" or "failed"; a failure never leaves a temp file behind, and a
failed fsync is never retried on the same file: a later attempt writes a new
one.

The core (`actors/ssd_writer_core.py`) tracks the write's progress (IDLE →
WRITING(i) → COMMITTING → IDLE); the shell performs each step.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, assert_never

import trio

from kvcellar.actors.runtime import ActorShell, Reply
from kvcellar.actors.ssd_writer_core import (
    Commit,
    Committed,
    Report,
    SsdWriterCore,
    SsdWriterMessage,
    TensorWritten,
    Write,
    WriteFailed,
    WriteTensor,
)
from kvcellar.errors import DiskError
from kvcellar.store.prompt_cache import SpillSnapshot
from kvcellar.store.safeguards import SAFEGUARDS, Safeguards
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
        self._current: PendingStore | None = None  # the write in progress (writes are serial)
        self._reports: dict[int, Reply[str]] = {}

    async def write(self, snapshot: SpillSnapshot) -> str:
        while self._unpublished:
            await self.run_blocking(self._unpublished.pop(0).publish)
        # Planning slices the snapshot's arrays: MLX work, so it takes an engine turn too.
        pending = await self.run_when_idle(
            lambda _: self.store.prepare_store(
                snapshot.tokens, snapshot.caches, snapshot.namespace, tokenizer_hash=self.tokenizer_hash
            )
        )
        if pending is None:
            return "failed"
        self._write_ids += 1
        write = Write(
            write_id=self._write_ids,
            tensor_count=pending.writer.tensor_count,
            token_count=len(snapshot.tokens),
            namespace=snapshot.namespace,
        )
        try:
            await self.run_blocking(pending.writer.open)
        except DiskError as e:
            self.store.fail_store(pending, e)
            return "failed"
        report = self._reports[write.write_id] = Reply[str]()
        self._current = pending
        try:
            # Each step's work answers the next message; the last effect is the Report.
            await self.shell.drive(write)
        finally:
            self._current = None
            self._reports.pop(write.write_id, None)
        return report.result()

    def _perform(self, effect: WriteTensor | Commit | Report) -> Awaitable[SsdWriterMessage] | None:
        match effect:
            case Report():
                self._reports[effect.write_id].set(effect.outcome)
                return None
            case WriteTensor() | Commit():
                assert self._current is not None, "the ssd writer has no write in progress"
                return self._step(effect, self._current)
            case _:
                assert_never(effect)

    async def _step(self, effect: WriteTensor | Commit, pending: PendingStore) -> SsdWriterMessage:
        """Do one step of the write; the message says how it went."""
        writer = pending.writer
        try:
            if isinstance(effect, WriteTensor):
                index = effect.index
                segments = await self.run_when_idle(lambda _: writer.materialise_tensor(index))
                await self.run_blocking(writer.write_segments, index, segments)
                return TensorWritten(write_id=effect.write_id, index=index)
            if not self.safeguards.ack_after_rename:
                await self.run_blocking(writer.commit_data)
                self._unpublished.append(writer)
                self.store.finish_store(pending)
                return Committed(write_id=effect.write_id)
            await self.run_blocking(writer.commit)
        except trio.Cancelled:
            writer.abort()
            raise
        except Exception as e:
            # abort() is a close and an unlink: quick enough for this rare path.
            writer.abort()
            if isinstance(e, DiskError):
                self.store.fail_store(pending, e)
            else:
                log.warning("SSD write failed: %s", e)
            return WriteFailed(write_id=effect.write_id, reason=str(e))
        # Indexing unlinks what the entry supersedes or evicts: file I/O, off the Trio thread.
        await self.run_blocking(self.store.finish_store, pending)
        return Committed(write_id=effect.write_id)
