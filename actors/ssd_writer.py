"""The SsdWriter: writes one snapshot at a time into the SSD store.

Each tensor is materialised in its own `run_when_idle` engine turn (MLX work,
never between two decode steps) and written off the Trio thread; the commit
(header, fsync, rename, directory fsync) runs off the Trio thread too, then
the store indexes the entry and supersedes or evicts. The outcome is
"stored" or "failed"; a failure never leaves a temp file behind, and a
failed fsync is never retried on the same file: a later attempt writes a new
one.

The core tracks the write's progress (IDLE → WRITING(i) → COMMITTING → IDLE);
the shell performs each step.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import attrs
import trio

from kvcellar.actors.runtime import IllegalTransition, JournalEvent
from kvcellar.errors import DiskError
from kvcellar.store import mutations
from kvcellar.store.events import register_event
from kvcellar.store.prompt_cache import SpillSnapshot
from kvcellar.store.ssd import PendingStore, SsdStore

log = logging.getLogger("kvcellar.ssd_writer")


@attrs.frozen(kw_only=True)
class Write:
    write_id: int
    tensor_count: int
    token_count: int
    namespace: str


@attrs.frozen(kw_only=True)
class TensorWritten:
    write_id: int
    index: int


@attrs.frozen(kw_only=True)
class Committed:
    write_id: int


@attrs.frozen(kw_only=True)
class WriteFailed:
    write_id: int
    reason: str


@attrs.frozen(kw_only=True)
class WriteTensor:
    write_id: int
    index: int


@attrs.frozen(kw_only=True)
class Commit:
    write_id: int


@attrs.frozen(kw_only=True)
class Report:
    write_id: int
    outcome: str


@register_event
@attrs.frozen(kw_only=True)
class WriteStarted:
    """Journaled before the temp file exists."""

    kind: ClassVar[str] = "entry.write_started"
    write_id: int
    namespace: str
    token_count: int
    tensor_count: int


class WriterState(enum.Enum):
    IDLE = "idle"
    WRITING = "writing"
    COMMITTING = "committing"


class SsdWriterCore:
    """Sans-IO progress of one write at a time."""

    def __init__(self) -> None:
        self.state = WriterState.IDLE
        self.write_id: int | None = None
        self.tensor_count = 0
        self.next_index = 0

    def handle(self, msg: Any, now: float) -> list[Any]:
        if isinstance(msg, Write) and self.state is WriterState.IDLE:
            self.state, self.write_id, self.tensor_count, self.next_index = (
                WriterState.WRITING, msg.write_id, msg.tensor_count, 0)
            started = JournalEvent(event=WriteStarted(write_id=msg.write_id, namespace=msg.namespace,
                                                      token_count=msg.token_count, tensor_count=msg.tensor_count))
            return [started, *self._advance()]
        if getattr(msg, "write_id", None) != self.write_id:
            raise IllegalTransition(f"ssd writer in state {self.state.value} got {type(msg).__name__} "
                                    f"for write {getattr(msg, 'write_id', None)}")
        if isinstance(msg, TensorWritten) and self.state is WriterState.WRITING and msg.index == self.next_index:
            self.next_index += 1
            return self._advance()
        if isinstance(msg, Committed) and self.state is WriterState.COMMITTING:
            return self._finish("stored")
        if isinstance(msg, WriteFailed) and self.state is not WriterState.IDLE:
            return self._finish("failed")
        raise IllegalTransition(f"ssd writer in state {self.state.value} got {type(msg).__name__}")

    def _advance(self) -> list[Any]:
        if self.next_index < self.tensor_count:
            return [WriteTensor(write_id=self.write_id, index=self.next_index)]
        self.state = WriterState.COMMITTING
        return [Commit(write_id=self.write_id)]

    def _finish(self, outcome: str) -> list[Any]:
        write_id = self.write_id
        self.state, self.write_id = WriterState.IDLE, None
        return [Report(write_id=write_id, outcome=outcome)]


RunWhenIdle = Callable[[Callable[[Any], Any]], Awaitable[Any]]
RunBlocking = Callable[..., Awaitable[Any]]


class SsdWriter:
    """The shell: `await write(snapshot)` → "stored" | "failed". Writes are
    serial (the SpillQueue dispatches one at a time); calls must not overlap."""

    def __init__(self, store: SsdStore, run_when_idle: RunWhenIdle, *, journal: Any = None,
                 tokenizer_hash: str = "", run_blocking: RunBlocking | None = None) -> None:
        self.store = store
        # Blocking file I/O goes to a worker thread; the simulator runs it inline.
        self.run_blocking: RunBlocking = run_blocking or trio.to_thread.run_sync
        self._unpublished: list[Any] = []  # only under the ack-before-rename mutation
        self.run_when_idle = run_when_idle
        self.core = SsdWriterCore()
        self.journal = journal
        self.tokenizer_hash = tokenizer_hash
        self._write_ids = 0

    async def write(self, snapshot: SpillSnapshot) -> str:
        while self._unpublished:
            await self.run_blocking(self._unpublished.pop(0).publish)
        # Planning slices the snapshot's arrays: MLX work, so it takes an engine turn too.
        pending = await self.run_when_idle(lambda _: self.store.prepare_store(
            snapshot.tokens, snapshot.caches, snapshot.namespace, tokenizer_hash=self.tokenizer_hash))
        if pending is None:
            return "failed"
        self._write_ids += 1
        msg: Any = Write(write_id=self._write_ids, tensor_count=pending.writer.tensor_count,
                         token_count=len(snapshot.tokens), namespace=snapshot.namespace)
        try:
            await self.run_blocking(pending.writer.open)
        except DiskError as e:
            self.store.fail_store(pending, e)
            return "failed"
        while True:
            effects = self.core.handle(msg, trio.current_time())
            for effect in effects:
                if isinstance(effect, JournalEvent):
                    if self.journal is not None:
                        self.journal.append(effect.event, actor="ssd_writer")
                elif isinstance(effect, Report):
                    return effect.outcome
                else:
                    msg = await self._perform(effect, pending)

    async def _perform(self, effect: Any, pending: PendingStore) -> Any:
        writer = pending.writer
        try:
            if isinstance(effect, WriteTensor):
                segments = await self.run_when_idle(lambda _: writer.materialise_tensor(effect.index))
                await self.run_blocking(writer.write_segments, effect.index, segments)
                return TensorWritten(write_id=effect.write_id, index=effect.index)
            if mutations.active("ack-before-rename"):
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
