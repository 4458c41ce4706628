"""Journal events of the actors: the spill queue, the SSD writer, the
durability coordinator and the gateway (with the batch-lane Scheduler).

They are part of the journal's schema, so they live beside the store's own
events (`store.events`), below the actors: every reader of the journal (the
`kvcellar journal` command, `decode_event`, the simulator) knows every kind
without importing an actor, and no registry depends on import order. The
actors import their events from here. Events carry ids, sizes and names only,
never tensors.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

# -- spill queue ----------------------------------------------------------------
# `spill_kind` is the Enqueue's `kind` (the name `kind` is the event class's journal kind).


@attrs.frozen(kw_only=True)
class _SpillEvent:
    item_id: int
    bytes: int
    spill_kind: str


@attrs.frozen(kw_only=True)
class SpillEnqueued(_SpillEvent):
    kind: ClassVar[str] = "spill.enqueued"


@attrs.frozen(kw_only=True)
class SpillDropped(_SpillEvent):
    """`reason`: "byte_cap", "shutdown" (held when the shell stopped) or
    "closed" (enqueued after it stopped). A drop is the item's settle record."""

    kind: ClassVar[str] = "spill.dropped"
    reason: str


@attrs.frozen(kw_only=True)
class SpillDispatched(_SpillEvent):
    kind: ClassVar[str] = "spill.dispatched"


@attrs.frozen(kw_only=True)
class SpillSettled(_SpillEvent):
    """A write finished: `outcome` is "stored" or "failed"."""

    kind: ClassVar[str] = "spill.settled"
    outcome: str


# -- SSD writer -------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class WriteStarted:
    """Journaled before the temp file exists."""

    kind: ClassVar[str] = "entry.write_started"
    write_id: int
    namespace: str
    token_count: int
    tensor_count: int


# -- durability coordinator -------------------------------------------------------


@attrs.frozen(kw_only=True)
class _RecordEvent:
    namespace: str
    token_count: int
    tokens_hash: str
    version: int


@attrs.frozen(kw_only=True)
class DurabilityDirty(_RecordEvent):
    """A put made a record dirty; `replaced`: an older version was still pending."""

    kind: ClassVar[str] = "durability.dirty"
    replaced: bool


@attrs.frozen(kw_only=True)
class DurabilityAttempt(_RecordEvent):
    kind: ClassVar[str] = "durability.attempt"
    forced: bool


@attrs.frozen(kw_only=True)
class DurabilitySettled(_RecordEvent):
    """`outcome`: one of OUTCOMES, "deferred" (busy gateway) or "recheck_covered"
    (a flush's re-check); `current`: it was for the record's latest version;
    `clean`: the record is durable now."""

    kind: ClassVar[str] = "durability.settled"
    outcome: str
    current: bool
    clean: bool


@attrs.frozen(kw_only=True)
class FlushBegun:
    """A flush run began; `flush_ids` share it (queued flushes coalesce)."""

    kind: ClassVar[str] = "flush.begin"
    flush_ids: tuple[int, ...]
    scope_records: int
    in_flight: int


@attrs.frozen(kw_only=True)
class FlushVerdictRecorded:
    kind: ClassVar[str] = "flush.verdict"
    flush_id: int
    durable: bool
    pending: int
    dropped: int
    failed: int
    missing_uncovered: int
    dirty_keys_count: int
    forced: int
    rechecked_covered: int
    elapsed_s: float


@attrs.frozen(kw_only=True)
class FlushTimedOutRecorded:
    """The caller of `flush_id` stopped waiting; the evidence at that moment.
    `begun`: its run had begun (it goes on, and its `flush.verdict` follows);
    otherwise it was still queued and is withdrawn."""

    kind: ClassVar[str] = "flush.timeout"
    flush_id: int
    begun: bool
    pending: int
    dropped: int
    failed: int
    missing_uncovered: int
    dirty_keys_count: int
    forced: int
    elapsed_s: float


@attrs.frozen(kw_only=True)
class FlushSkippedByAdmission:
    """Beside `flush.verdict`, only when not zero: `records` of the flush's
    scope left RAM unwritten because SSD admission refused their spill."""

    kind: ClassVar[str] = "flush.skipped_by_admission"
    flush_id: int
    records: int


# -- gateway and batch-lane scheduler ---------------------------------------------


@attrs.frozen(kw_only=True)
class RequestAdmitted:
    kind: ClassVar[str] = "request.admitted"
    request_id: int
    prompt_tokens: int


@attrs.frozen(kw_only=True)
class RequestFinished:
    kind: ClassVar[str] = "request.finished"
    request_id: int
    completion_tokens: int
    outcome: str


# -- memory guard -------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class MemoryRelieved:
    """One relief check of the memory guard that was over the budget
    (engine/memory.py): what it released and whether it got under."""

    kind: ClassVar[str] = "memory.relieved"
    phase: str
    budget_bytes: int
    reserve_bytes: int
    active_before_bytes: int
    active_after_bytes: int
    persisted_entries: int
    persisted_bytes: int
    dropped_entries: int
    dropped_bytes: int
    satisfied: bool


# -- in-flight generation checkpoints (store/checkpoints.py, actors/checkpoint_writer.py) --


@attrs.frozen(kw_only=True)
class CheckpointWritten:
    """A checkpoint's file is committed (after the directory fsync) and indexed."""

    kind: ClassVar[str] = "checkpoint.written"
    request_key: str
    attempt: int
    emitted_tokens: int
    bytes: int


@attrs.frozen(kw_only=True)
class CheckpointResumed:
    """A request restored its checkpoint and goes on from its pending token."""

    kind: ClassVar[str] = "checkpoint.resumed"
    request_key: str
    attempt: int
    emitted_tokens: int


@attrs.frozen(kw_only=True)
class CheckpointInvalidated:
    """A request completed: its checkpoint is no longer resumable (its file's removal is queued)."""

    kind: ClassVar[str] = "checkpoint.invalidated"
    request_key: str
    attempt: int


@attrs.frozen(kw_only=True)
class CheckpointRemoved:
    """An invalidated checkpoint's removal: `unlinked`, the file is gone durably
    (false: a newer attempt owns it, it was gone already, or the unlink or the
    directory fsync failed)."""

    kind: ClassVar[str] = "checkpoint.removed"
    request_key: str
    attempt: int
    unlinked: bool


@attrs.frozen(kw_only=True)
class CheckpointNotWritten:
    """A checkpoint snapshot that never became a file: `reason` is superseded
    (a newer one of the request replaced it in the queue), byte_cap,
    invalidated, shutdown, or failed (the write failed: `detail` says how)."""

    kind: ClassVar[str] = "checkpoint.not_written"
    request_key: str
    attempt: int
    emitted_tokens: int
    reason: str
    detail: str = ""


ACTOR_EVENT_TYPES: tuple[type[Any], ...] = (
    SpillEnqueued,
    SpillDropped,
    SpillDispatched,
    SpillSettled,
    WriteStarted,
    DurabilityDirty,
    DurabilityAttempt,
    DurabilitySettled,
    FlushBegun,
    FlushVerdictRecorded,
    FlushTimedOutRecorded,
    FlushSkippedByAdmission,
    RequestAdmitted,
    RequestFinished,
    MemoryRelieved,
    CheckpointWritten,
    CheckpointResumed,
    CheckpointInvalidated,
    CheckpointRemoved,
    CheckpointNotWritten,
)
