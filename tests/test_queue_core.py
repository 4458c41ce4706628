"""The one queue core under the checkpoint policy, driven directly (no Trio,
no MLX) by a hypothesis state machine: one operation in flight, FIFO
dispatch, a newer snapshot of a request replaces its queued older ones, the
byte cap drops the oldest queued write (never the newest, never the one in
flight), removals are never dropped, and every write is released exactly
once. The spill policy's machine is `tests/test_spill_queue.py`'s."""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcellar.actors.checkpoint_queue_core import (
    OP_OUTCOMES,
    AwaitIdle,
    CheckpointQueueCore,
    Enqueue,
    Invalidate,
    OpDone,
    Release,
    RemoveCheckpoint,
    Shutdown,
    Wake,
    WriteCheckpoint,
)
from kvcellar.actors.effects import JournalEvent
from kvcellar.actors.queue_core import QueueState
from kvcellar.store.actor_events import CheckpointNotWritten

BYTES_MAX = 60


class CheckpointQueueRules(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.core = CheckpointQueueCore(BYTES_MAX)
        self.op_ids = itertools.count(1)
        self.ops: dict[int, Enqueue | Invalidate] = {}
        self.in_flight: Enqueue | Invalidate | None = None
        self.dispatched: list[int] = []
        self.released: Counter[int] = Counter()
        self.not_written: dict[int, str] = {}
        self.written: dict[int, str] = {}
        self.waiters: set[int] = set()
        self.closed = False

    def _apply(self, effects: list[object]) -> list[int]:
        woken = []
        for effect in effects:
            match effect:
                case WriteCheckpoint() | RemoveCheckpoint():
                    assert self.in_flight is None, "two operations in flight"
                    self.in_flight = self.ops[effect.op_id]
                    assert isinstance(self.in_flight, Enqueue) == isinstance(effect, WriteCheckpoint)
                    self.dispatched.append(effect.op_id)
                case Release():
                    assert isinstance(self.ops[effect.op_id], Enqueue), "a removal holds no snapshot"
                    self.released[effect.op_id] += 1
                case JournalEvent(event=CheckpointNotWritten() as event):
                    (op_id,) = [
                        i
                        for i, op in self.ops.items()
                        if isinstance(op, Enqueue)
                        and (op.request_key, op.attempt, op.emitted_tokens)
                        == (
                            event.request_key,
                            event.attempt,
                            event.emitted_tokens,
                        )
                    ]
                    self.not_written[op_id] = event.reason
                case Wake():
                    woken.append(effect.waiter_id)
                case _:
                    raise AssertionError(f"unexpected effect {effect!r}")
        return woken

    def _queued_writes(self) -> list[Enqueue]:
        return [op for op in self.core.queued() if isinstance(op, Enqueue)]

    @rule(request=st.sampled_from("ab"), attempt=st.integers(0, 2), size=st.integers(0, 40))
    def enqueue(self, request: str, attempt: int, size: int) -> None:
        op_id = next(self.op_ids)
        # Each (request, attempt, emitted) is unique, so a journal line names its operation.
        op = Enqueue(op_id=op_id, request_key=request, attempt=attempt, emitted_tokens=op_id, bytes=size)
        self.ops[op_id] = op
        self._apply(self.core.handle(op, 0.0))
        if self.closed:
            assert self.not_written[op_id] == "shutdown" and self.released[op_id] == 1
            return
        for queued in self._queued_writes():
            if queued is not op and queued.request_key == request:
                assert queued.attempt > attempt, "an older snapshot of the request is still queued"
        queued_bytes = sum(q.bytes for q in self._queued_writes())
        flying = self.in_flight.bytes if isinstance(self.in_flight, Enqueue) else 0
        assert queued_bytes + flying <= BYTES_MAX or [q.op_id for q in self._queued_writes()] in ([], [op_id])

    @rule(request=st.sampled_from("ab"), attempt=st.integers(0, 2))
    def invalidate(self, request: str, attempt: int) -> None:
        op_id = next(self.op_ids)
        op = Invalidate(op_id=op_id, request_key=request, attempt=attempt)
        self.ops[op_id] = op
        self._apply(self.core.handle(op, 0.0))
        for queued in self._queued_writes():
            assert queued.request_key != request or queued.attempt > attempt

    @precondition(lambda self: self.in_flight is not None)
    @rule(outcome=st.sampled_from(OP_OUTCOMES))
    def finish(self, outcome: str) -> None:
        assert self.in_flight is not None
        op, self.in_flight = self.in_flight, None
        if isinstance(op, Enqueue):
            self.written[op.op_id] = outcome
        woken = self._apply(self.core.handle(OpDone(op_id=op.op_id, outcome=outcome), 0.0))
        if self.in_flight is None:
            assert set(woken) == self.waiters
            self.waiters.clear()

    @rule()
    def await_idle(self) -> None:
        waiter_id = 1000 + len(self.waiters) + next(self.op_ids)
        woken = self._apply(self.core.handle(AwaitIdle(waiter_id=waiter_id), 0.0))
        if self.in_flight is None:
            assert woken == [waiter_id]
        else:
            assert woken == []
            self.waiters.add(waiter_id)

    @precondition(lambda self: not self.closed)
    @rule()
    def shutdown(self) -> None:
        woken = self._apply(self.core.handle(Shutdown(), 0.0))
        self.closed, self.in_flight = True, None
        assert set(woken) == self.waiters
        self.waiters.clear()

    @invariant()
    def one_in_flight_fifo_and_every_write_released_once(self) -> None:
        if not hasattr(self, "core"):
            return
        assert (self.core.state is QueueState.BUSY) == (self.in_flight is not None)
        assert (self.core.state is QueueState.CLOSED) == self.closed
        assert self.dispatched == sorted(self.dispatched), "dispatch is not FIFO"
        assert all(count == 1 for count in self.released.values()), "a snapshot released twice"
        settled = set(self.not_written) | {i for i, o in self.written.items() if o != "failed"}
        assert settled <= set(self.released), "a write settled without its release"
        # A removal is never dropped: each was dispatched, is queued, or the queue closed.
        queued_ids = {op.op_id for op in self.core.queued()}
        for op_id, op in self.ops.items():
            if isinstance(op, Invalidate) and not self.closed:
                assert op_id in self.dispatched or op_id in queued_ids
        stats = self.core.stats()
        writes = sum(isinstance(op, Enqueue) for op in self.ops.values())
        finished = sum(stats[name] for name in ("stored", "stale", "failed", "dropped"))
        assert stats["enqueued"] == writes
        assert stats["enqueued"] == finished + stats["pending"] + sum(o == "removed" for o in self.written.values()), (
            "a write is neither pending nor settled"
        )


CheckpointQueueRules.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_checkpoint_queue_core_follows_its_rules = CheckpointQueueRules.TestCase
