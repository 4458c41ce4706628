"""The Scheduler: the batch lane (spec §2.3, §4), continuous batching with
per-row prompt-cache reuse.

The core admits requests as rows of one running batch. A row is admitted only
while fewer than `rows_max` rows are active and the batch's padded projection
with it fits `kv_budget_bytes`: rows times the largest row's projected KV bytes
(prompt plus `max_tokens` under the KV scheme), because mlx-lm left-pads every
row of the merged caches to the longest one, so a short row beside a long one
costs as much memory as the long one. The rest wait in FIFO order, and the
head of the queue is never overtaken. A row larger than the whole budget
runs alone once nothing else is active, so it waits rather than starving.
Admission is work-conserving: while anything waits, some row is active, so a
batch never ends with work queued.

One batch is one engine job (`engine/batch.py`, `BatchLoop`) holding the
Gateway's lane from its first admitted row until none remain (`LANE_BATCH`):
the Gateway stays busy for all of it, so `run_when_idle` steps (SSD writes,
snapshots, demotions) never run while a row is active. Nor while one waits:
the Gateway holds steps back while this lane is busy (its busy probe), from a
row's admission until the batch job reaches the lane and between one batch
and the next, and hears `WentIdle` once it is not. Rows cross to the
engine thread through the batch's inbox (`queue.Queue`); the job reports each
step's tokens and row ends back through the Trio token; a row's end comes
back to the core as `RowFinished`, which frees its budget for the next.

States, and which messages each takes:

    IDLE ──first Submit──▶ RUNNING ──last row finished, none waiting──▶ ENDING
      ▲                      │                                           │
      └── BatchEnded (the job failed or was cancelled) ◀─┘                │
      └──────────────────────────── BatchEnded ◀─────────────────────────┘

Submits arriving while ENDING wait and start the next batch once the current
job has reported its end, so a job never sees rows after its end-of-batch.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import queue
import threading
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from typing import Any

import attrs
import trio

from kvcellar.actors.gateway import Gateway
from kvcellar.actors.gateway_core import LANE_BATCH, AwaitDrained, Drained, Rejected, StopAdmission
from kvcellar.actors.runtime import ActorShell, Journal, Reply
from kvcellar.actors.scheduler_core import (
    KV_BUDGET_BYTES_DEFAULT,
    ROWS_MAX_DEFAULT,
    AdmitRow,
    BatchEnded,
    Cancel,
    CancelRow,
    EndBatch,
    RowAborted,
    RowFinished,
    SchedulerCore,
    SchedulerMessage,
    StartBatch,
    Submit,
    WentIdle,
    Withdrawn,
    padded_kv_bytes,
    summed_kv_bytes,
)
from kvcellar.engine.batch import END_OF_BATCH, BatchLoop, BatchRow, BatchStep, RowDone, RowToken, batch_lane_refusal
from kvcellar.engine.checkpointing import Checkpointing
from kvcellar.engine.engine import PREFILL_STEP_TOKENS
from kvcellar.engine.generation import SNAPSHOT_PREFILL_TOKENS_MIN, GenerationDone, GenerationRequest, TokenDelta
from kvcellar.engine.memory import MemoryGuard
from kvcellar.engine.paged_kv import PagedKv, blocks_for
from kvcellar.errors import AdmissionClosed, BatchAborted
from kvcellar.store.prompt_cache import PromptCache
from kvcellar.store.scheme import KvScheme, warm_up_prototype_caches

log = logging.getLogger("kvcellar.actors.scheduler")


def row_projected_kv_bytes(scheme: KvScheme, prototypes: list, tokens: int, paged_kv: PagedKv | None) -> int:
    """A row's projected KV bytes for `tokens` tokens under the scheme; a
    paged row's pools hold whole blocks."""
    if paged_kv is not None:
        tokens = blocks_for(tokens, paged_kv.block_size) * paged_kv.block_size
    return scheme.projected_bytes(prototypes, tokens)


# -- shell ----------------------------------------------------------------------


@attrs.frozen
class _Failure:
    error: BaseException


@attrs.define(kw_only=True)
class _RowChannel:
    request: GenerationRequest
    cancelled: threading.Event
    send: Any
    receive: Any

    def finish(self, item: GenerationDone | _Failure | None) -> None:
        """Deliver the last item, if any, and close; the consumer may be gone."""
        try:
            if item is not None:
                self.send.send_nowait(item)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        self.send.close()


class Scheduler:
    """The Trio shell around `SchedulerCore`. Start with `nursery.start(run)`;
    `generate(request)` streams a request's `TokenDelta`s and `GenerationDone`."""

    def __init__(
        self,
        gateway: Gateway,
        prompt_cache: PromptCache | None,
        scheme: KvScheme,
        prototypes: list,
        *,
        rows_max: int = ROWS_MAX_DEFAULT,
        kv_budget_bytes: int = KV_BUDGET_BYTES_DEFAULT,
        prefill_step_tokens: int = PREFILL_STEP_TOKENS,
        snapshot_prefill_tokens_min: int = SNAPSHOT_PREFILL_TOKENS_MIN,
        journal: Journal | None = None,
        wait_for_rows: bool = True,
        turn_wanted: Callable[[], bool] | None = None,
        memory_guard: MemoryGuard | None = None,
        checkpointing: Checkpointing | None = None,
        paged_kv: PagedKv | None = None,
    ) -> None:
        billing = padded_kv_bytes if paged_kv is None else summed_kv_bytes
        self.core = SchedulerCore(rows_max=rows_max, kv_budget_bytes=kv_budget_bytes, billing=billing)
        self.paged_kv = paged_kv
        self.memory_guard = memory_guard
        self.shell = ActorShell("scheduler", self.core, self._perform, journal=journal)
        self.gateway = gateway
        self.prompt_cache = prompt_cache
        self.scheme = scheme
        # Warmed-up prototype caches: only their shapes and dtypes are read.
        self._prototypes = prototypes
        self._prefill_step_tokens = prefill_step_tokens
        self._snapshot_prefill_tokens_min = snapshot_prefill_tokens_min
        # BatchLoop's seam: False for an engine that runs jobs on the Trio thread.
        self._wait_for_rows = wait_for_rows
        # BatchLoop's seam: a pool's engine says when another model waits for the thread.
        self._turn_wanted = turn_wanted
        self._checkpointing = checkpointing
        self._rows: dict[int, _RowChannel] = {}
        self._drains: dict[int, Reply[None]] = {}
        self._waiter_ids = itertools.count(1)
        self._inbox: queue.Queue | None = None
        self.decode_steps_by_rows: Counter[int] = Counter()
        gateway.add_busy_probe(lambda: self.busy)

    @property
    def busy(self) -> bool:
        return self.core.busy

    def projected_kv_bytes(self, request: GenerationRequest) -> int:
        """The KV bytes the row can come to hold: prompt plus `max_tokens` under
        the scheme; with a memory guard, its whole footprint (engine/memory.py:
        one prefill chunk's workspace too), so the rows admitted fit the
        memory budget's headroom."""
        if self.memory_guard is not None and self.memory_guard.enabled:
            return self.memory_guard.footprint.request_bytes(len(request.prompt_ids), request.params.max_tokens)
        tokens = len(request.prompt_ids) + request.params.max_tokens
        return row_projected_kv_bytes(self.scheme, self._prototypes, tokens, self.paged_kv)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until `close()`; a batch job still running then finishes first."""
        await self.shell.run(task_status=task_status)

    def close(self) -> None:
        self.shell.close()

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenDelta | GenerationDone, None]:
        """Stream one request as a batch row. Raises `AdmissionClosed` after
        shutdown began and `BatchAborted` when its batch failed under it."""
        request_id = self.gateway.new_id()
        send, receive = trio.open_memory_channel[Any](math.inf)
        self._rows[request_id] = _RowChannel(request=request, cancelled=threading.Event(), send=send, receive=receive)
        self.shell.send_nowait(
            Submit(
                request_id=request_id, prompt_tokens=len(request.prompt_ids), kv_bytes=self.projected_kv_bytes(request)
            )
        )
        done = False
        try:
            async with receive:
                async for item in receive:
                    if isinstance(item, _Failure):
                        raise item.error
                    done = isinstance(item, GenerationDone)
                    yield item
        finally:
            if not done:
                # Synchronous: this also runs when the consumer was cancelled or collected.
                self._send_quietly(Cancel(request_id=request_id))

    async def stop_admission(self) -> None:
        await self.shell.send(StopAdmission())

    async def drain(self) -> None:
        """Wait until no row is active or waiting and the last batch job ended."""
        waiter_id = next(self._waiter_ids)
        drained = self._drains[waiter_id] = Reply[None]()
        await self.shell.send(AwaitDrained(waiter_id=waiter_id))
        await drained.wait()

    def stats(self) -> dict[str, Any]:
        core = self.core.stats()
        return {
            "lane": "batch",
            "reason": "",
            "batch_size": self.core.rows_max,
            "kv_budget_bytes": self.core.kv_budget_bytes,
            **core,
            "batch_size_history": {str(rows): steps for rows, steps in sorted(self.decode_steps_by_rows.items())},
        }

    def _send_quietly(self, msg: SchedulerMessage) -> None:
        # The scheduler may have shut down: then nothing is left to tell.
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            self.shell.send_nowait(msg)

    def _perform(self, effect: Any) -> None:
        if isinstance(effect, StartBatch):
            self._inbox = queue.Queue()
            self.shell.start_soon(self._run_batch, effect.batch_id, self._inbox)
        elif isinstance(effect, AdmitRow):
            row = self._rows[effect.request_id]
            assert self._inbox is not None
            self._inbox.put(BatchRow(row_id=effect.request_id, request=row.request, cancelled=row.cancelled))
        elif isinstance(effect, CancelRow):
            if (cancelled := self._rows.get(effect.request_id)) is not None:
                cancelled.cancelled.set()
        elif isinstance(effect, EndBatch):
            assert self._inbox is not None
            self._inbox.put(END_OF_BATCH)
        elif isinstance(effect, Rejected):
            self._rows.pop(effect.request_id).finish(_Failure(AdmissionClosed(effect.reason)))
        elif isinstance(effect, Withdrawn):
            self._rows.pop(effect.request_id).finish(None)
        elif isinstance(effect, RowAborted):
            if (aborted := self._rows.pop(effect.request_id, None)) is not None:
                aborted.finish(_Failure(BatchAborted(effect.reason)))
        elif isinstance(effect, Drained):
            self._drains.pop(effect.waiter_id).set(None)
        elif isinstance(effect, WentIdle):
            self.gateway.other_lane_idle()

    async def _run_batch(self, batch_id: int, inbox: queue.Queue) -> None:
        cancelled = threading.Event()
        loop = BatchLoop(
            self.prompt_cache,
            inbox,
            rows_max=self.core.rows_max,
            cancelled=cancelled,
            prefill_step_tokens=self._prefill_step_tokens,
            snapshot_prefill_tokens_min=self._snapshot_prefill_tokens_min,
            wait_for_rows=self._wait_for_rows,
            memory_guard=self.memory_guard,
            checkpointing=self._checkpointing,
            scheme=self.scheme,
            paged_kv=self.paged_kv,
            turn_wanted=self._turn_wanted,
        )
        error = "the batch job was cancelled"
        try:
            async for step in self.gateway.generate(loop.run, prompt_tokens=0, cancelled=cancelled, lane=LANE_BATCH):
                self._route(step)
            error = ""
        except Exception as e:
            error = f"the batch job failed: {type(e).__name__}: {e}"
            log.exception("batch %d failed; its rows fail with it", batch_id)
        finally:
            # The engine job waits on its inbox while no row is active: never leave it waiting.
            inbox.put(END_OF_BATCH)
            self._send_quietly(BatchEnded(batch_id=batch_id, error=error))

    def _route(self, step: BatchStep) -> None:
        if step.decode_rows:
            self.decode_steps_by_rows[step.decode_rows] += 1
        for event in step.events:
            row = self._rows.get(event.row_id)
            if isinstance(event, RowToken):
                if row is not None:
                    # The client may have left; the Cancel it sent ends the row.
                    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                        row.send.send_nowait(event.delta)
                continue
            self._end_row(event, row)

    def _end_row(self, event: RowDone, row: _RowChannel | None) -> None:
        if row is not None:
            del self._rows[event.row_id]
            if event.outcome == "failed":
                row.finish(_Failure(event.error or BatchAborted("the row failed")))
            else:
                row.finish(event.done)
        completion_tokens = event.done.completion_tokens if event.done is not None else 0
        self.shell.send_nowait(
            RowFinished(request_id=event.row_id, outcome=event.outcome, completion_tokens=completion_tokens)
        )


async def open_batch_lane(
    nursery: trio.Nursery,
    *,
    engine: Any,
    gateway: Gateway,
    prompt_cache: PromptCache,
    scheme: KvScheme,
    rows_max: int,
    kv_budget_bytes: int,
    prefill_step_tokens: int = PREFILL_STEP_TOKENS,
    journal: Journal | None = None,
    memory_guard: MemoryGuard | None = None,
    checkpointing: Checkpointing | None = None,
    paged_kv: PagedKv | None = None,
) -> tuple[Scheduler | None, str]:
    """Start the Scheduler when the gates allow it; otherwise log why requests
    take the serial lane. Returns the scheduler (or None) and that reason."""
    if rows_max <= 1:
        reason = batch_lane_refusal(None, scheme, rows_max) or ""
        log.info("serial lane: %s", reason)
        return None, reason

    def probe(loaded: Any) -> tuple[str | None, list | None]:
        reason = batch_lane_refusal(loaded.model, scheme, rows_max)
        return reason, None if reason else warm_up_prototype_caches(loaded.model)

    reason, prototypes = await engine.call(probe, label="probe")
    if reason:
        log.warning("batch lane off, every request takes the serial lane: %s", reason)
        return None, reason
    # An engine that runs jobs on the Trio thread says so (`blocking_waits = False`).
    scheduler = Scheduler(
        gateway,
        prompt_cache,
        scheme,
        prototypes,
        rows_max=rows_max,
        kv_budget_bytes=kv_budget_bytes,
        prefill_step_tokens=prefill_step_tokens,
        journal=journal,
        wait_for_rows=getattr(engine, "blocking_waits", True),
        turn_wanted=getattr(engine, "turn_wanted", None),
        memory_guard=memory_guard,
        checkpointing=checkpointing,
        paged_kv=paged_kv,
    )
    await nursery.start(scheduler.run)
    log.info("batch lane on: up to %d rows, KV budget %.3g GB", rows_max, kv_budget_bytes / 1e9)
    return scheduler, ""
