"""A spill's SSD write in two steps: planned and materialised in one engine
turn, written and committed in one blocking call.

The write-behind pipeline crosses from the Trio thread to another thread at
most twice per entry: one engine turn (`plan_spill`: the write plan and every
tensor's bytes, MLX work) and one worker call (`write_planned`, then
`SsdStore.finish_store`: file I/O). A write-behind snapshot is planned in the
same engine turn that takes it from the RAM tier; an eviction's snapshot,
made inside the put that evicts, is planned by the SSD writer's one turn.

No Trio here: the actors decide on which thread each step runs.
"""

from __future__ import annotations

import attrs

from kvcellar.store.prompt_cache import SpillSnapshot
from kvcellar.store.ssd import PendingStore, SsdStore


@attrs.frozen(kw_only=True)
class PlannedSpill(SpillSnapshot):
    """A snapshot with its write planned and its tensors materialised: the
    spill queue holds and drops it like any snapshot. `pending` is None when
    the entry can never fit under the SSD tier's cap (`prepare_store` said so
    and journaled it); `segments[i]` are tensor i's bytes, views of the
    snapshot's evaluated arrays (`KvFileWriter.materialise_tensor`)."""

    pending: PendingStore | None
    segments: tuple[list[memoryview], ...]


def plan_spill(store: SsdStore, snapshot: SpillSnapshot, tokenizer_hash: str) -> PlannedSpill:
    """Plan `snapshot`'s write and materialise every tensor in one go. MLX
    work: call it on the engine thread, inside an engine turn."""
    if isinstance(snapshot, PlannedSpill):
        return snapshot
    pending = store.prepare_store(
        snapshot.tokens,
        snapshot.caches,
        snapshot.namespace,
        tokenizer_hash=tokenizer_hash,
        captured_epoch=snapshot.wipe_epoch,
    )
    segments: tuple[list[memoryview], ...] = ()
    if pending is not None:
        writer = pending.writer
        segments = tuple(writer.materialise_tensor(index) for index in range(writer.tensor_count))
    return PlannedSpill(
        namespace=snapshot.namespace,
        tokens=snapshot.tokens,
        caches=snapshot.caches,
        bytes=snapshot.bytes,
        reason=snapshot.reason,
        wipe_epoch=snapshot.wipe_epoch,
        pending=pending,
        segments=segments,
    )


def write_planned(pending: PendingStore, segments: tuple[list[memoryview], ...], *, publish: bool = True) -> None:
    """Create the temp file, write every tensor at its offset while hashing it,
    and commit: with `publish` the rename and directory fsync too (the commit
    point), without it only the data (`KvFileWriter.commit_data`; the caller
    publishes later). No MLX: call it off the Trio thread. On a failure after
    the temp file exists it is removed before the error is raised."""
    writer = pending.writer
    writer.open()
    try:
        for index, tensor_segments in enumerate(segments):
            writer.write_segments(index, tensor_segments)
        if publish:
            writer.commit()
        else:
            writer.commit_data()
    except BaseException:
        writer.abort()
        raise
