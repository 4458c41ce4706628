"""The SsdWriter's core: the progress of one write at a time
(IDLE → WRITING(i) → COMMITTING → IDLE); the Trio shell, which performs each
step, is `actors/ssd_writer.py`.

Pure: it imports attrs, the messages and `errors`, never Trio or MLX. Its
transitions are one table, `SSD_WRITER_TABLE`, looked up before any handler
runs; each handler returns the state it leaves the core in.
"""

from __future__ import annotations

import enum

import attrs

from kvcellar.actors.effects import JournalEvent
from kvcellar.actors.transitions import TransitionTable, rows
from kvcellar.errors import IllegalTransition
from kvcellar.store.actor_events import WriteStarted


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


SsdWriterMessage = Write | TensorWritten | Committed | WriteFailed
SsdWriterEffect = WriteTensor | Commit | Report | JournalEvent


class WriterState(enum.Enum):
    IDLE = "idle"
    WRITING = "writing"
    COMMITTING = "committing"


# A handler's answer: the state it leaves the core in, and the effects.
Step = tuple[WriterState, list[SsdWriterEffect]]


class SsdWriterCore:
    """Sans-IO progress of one write at a time.

    `handle` raises `IllegalTransition` for a message its state does not
    take (`SSD_WRITER_TABLE`), one for another write than the current one,
    and a `TensorWritten` out of order: protocol bugs in the shell
    (kvcellar's fault). The core is unchanged when it raises."""

    def __init__(self) -> None:
        self.state = WriterState.IDLE
        self.write_id: int | None = None
        self.tensor_count = 0
        self.next_index = 0

    def handle(self, msg: SsdWriterMessage, now: float) -> list[SsdWriterEffect]:
        return SSD_WRITER_TABLE.fire(self, msg, now)

    # -- handlers: (core, message, now) -> (next state, effects) ---------------

    def _on_write(self, msg: Write, now: float) -> Step:
        self.write_id, self.tensor_count, self.next_index = msg.write_id, msg.tensor_count, 0
        started = JournalEvent(
            event=WriteStarted(
                write_id=msg.write_id,
                namespace=msg.namespace,
                token_count=msg.token_count,
                tensor_count=msg.tensor_count,
            )
        )
        state, effects = self._advance(msg.write_id)
        return state, [started, *effects]

    def _on_tensor_written(self, msg: TensorWritten, now: float) -> Step:
        self._check_current(msg)
        if msg.index != self.next_index:
            raise IllegalTransition(
                f"ssd writer in state {self.state.name} got tensor {msg.index} "
                f"of write {msg.write_id}, expecting tensor {self.next_index}"
            )
        self.next_index += 1
        return self._advance(msg.write_id)

    def _on_committed(self, msg: Committed, now: float) -> Step:
        self._check_current(msg)
        return self._finish(msg.write_id, "stored")

    def _on_write_failed(self, msg: WriteFailed, now: float) -> Step:
        self._check_current(msg)
        return self._finish(msg.write_id, "failed")

    # -- steps -----------------------------------------------------------------

    def _check_current(self, msg: TensorWritten | Committed | WriteFailed) -> None:
        if msg.write_id != self.write_id:
            raise IllegalTransition(
                f"ssd writer in state {self.state.name} got {type(msg).__name__} "
                f"for write {msg.write_id}, not the current write {self.write_id}"
            )

    def _advance(self, write_id: int) -> Step:
        if self.next_index < self.tensor_count:
            return WriterState.WRITING, [WriteTensor(write_id=write_id, index=self.next_index)]
        return WriterState.COMMITTING, [Commit(write_id=write_id)]

    def _finish(self, write_id: int, outcome: str) -> Step:
        self.write_id = None
        return WriterState.IDLE, [Report(write_id=write_id, outcome=outcome)]


# The one table: (state, message type) -> (the states the handler may leave the
# core in, the handler). A write of no tensors goes straight to its commit.
_S = WriterState
SSD_WRITER_TABLE: TransitionTable[WriterState] = TransitionTable(
    "the ssd writer",
    {
        **rows([_S.IDLE], [Write], SsdWriterCore._on_write, to={_S.WRITING, _S.COMMITTING}),
        **rows([_S.WRITING], [TensorWritten], SsdWriterCore._on_tensor_written, to={_S.WRITING, _S.COMMITTING}),
        **rows([_S.COMMITTING], [Committed], SsdWriterCore._on_committed, to={_S.IDLE}),
        **rows([_S.WRITING, _S.COMMITTING], [WriteFailed], SsdWriterCore._on_write_failed, to={_S.IDLE}),
    },
)
