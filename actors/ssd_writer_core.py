"""The SsdWriter's core: one write at a time (IDLE → WRITING → IDLE); the
Trio shell, which performs the write in one worker call, is
`actors/ssd_writer.py`.

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
class Committed:
    write_id: int


@attrs.frozen(kw_only=True)
class WriteFailed:
    write_id: int
    reason: str


@attrs.frozen(kw_only=True)
class WriteEntry:
    """Write every tensor of the planned entry and commit it, in one worker call."""

    write_id: int


@attrs.frozen(kw_only=True)
class Report:
    write_id: int
    outcome: str


SsdWriterMessage = Write | Committed | WriteFailed
SsdWriterEffect = WriteEntry | Report | JournalEvent


class WriterState(enum.Enum):
    IDLE = "idle"
    WRITING = "writing"


# A handler's answer: the state it leaves the core in, and the effects.
Step = tuple[WriterState, list[SsdWriterEffect]]


class SsdWriterCore:
    """Sans-IO progress of one write at a time.

    `handle` raises `IllegalTransition` for a message its state does not
    take (`SSD_WRITER_TABLE`) and for one about another write than the
    current one: protocol bugs in the shell (kvcellar's fault). The core is
    unchanged when it raises."""

    def __init__(self) -> None:
        self.state = WriterState.IDLE
        self.write_id: int | None = None

    def handle(self, msg: SsdWriterMessage, now: float) -> list[SsdWriterEffect]:
        return SSD_WRITER_TABLE.fire(self, msg, now)

    # -- handlers: (core, message, now) -> (next state, effects) ---------------

    def _on_write(self, msg: Write, now: float) -> Step:
        self.write_id = msg.write_id
        started = JournalEvent(
            event=WriteStarted(
                write_id=msg.write_id,
                namespace=msg.namespace,
                token_count=msg.token_count,
                tensor_count=msg.tensor_count,
            )
        )
        return WriterState.WRITING, [started, WriteEntry(write_id=msg.write_id)]

    def _on_committed(self, msg: Committed, now: float) -> Step:
        self._check_current(msg)
        return self._finish(msg.write_id, "stored")

    def _on_write_failed(self, msg: WriteFailed, now: float) -> Step:
        self._check_current(msg)
        return self._finish(msg.write_id, "failed")

    def _check_current(self, msg: Committed | WriteFailed) -> None:
        if msg.write_id != self.write_id:
            raise IllegalTransition(
                f"ssd writer in state {self.state.name} got {type(msg).__name__} "
                f"for write {msg.write_id}, not the current write {self.write_id}"
            )

    def _finish(self, write_id: int, outcome: str) -> Step:
        self.write_id = None
        return WriterState.IDLE, [Report(write_id=write_id, outcome=outcome)]


# The one table: (state, message type) -> (the states the handler may leave the core in, the handler).
_S = WriterState
SSD_WRITER_TABLE: TransitionTable[WriterState] = TransitionTable(
    "the ssd writer",
    {
        **rows([_S.IDLE], [Write], SsdWriterCore._on_write, to={_S.WRITING}),
        **rows([_S.WRITING], [Committed], SsdWriterCore._on_committed, to={_S.IDLE}),
        **rows([_S.WRITING], [WriteFailed], SsdWriterCore._on_write_failed, to={_S.IDLE}),
    },
)
