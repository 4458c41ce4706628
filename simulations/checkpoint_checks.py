"""The simulator's invariants of in-flight generation checkpoints (spec §5.7),
checked as the `checkpoints` workload runs (the harness also compares every
completed request's output with the fake model's greedy continuation, so a
resumed generation must equal the uninterrupted run):

- `checkpoint_resumes_its_own_request`: a request resumes only a checkpoint
  that a request identical to it (prompt, sampling, stops, namespace) wrote;
- `superseded_checkpoint_never_restored`: a resume restores the newest
  checkpoint durably written for its key, never an older one;
- `completed_checkpoint_never_restored`: once a request completed, its
  checkpoint is not resumed in that process again, nor after a restart once
  its removal was durable.

It hooks the system in two places: `Checkpointing`'s listeners (what each
request offered and resumed, with the request itself) and the store's event
listeners (what was durably written, invalidated, resumed and removed, each
event once, in the order the store journals them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcellar.store.actor_events import (
    CheckpointInvalidated,
    CheckpointRemoved,
    CheckpointResumed,
    CheckpointWritten,
)
from kvcellar.store.checkpoints import EARLIER_PROCESS_ATTEMPT
from kvcellar.store.records import GenerationCheckpoint


class CheckpointObserver:
    def __init__(self, violate: Callable[[str, str], None]) -> None:
        self._violate = violate
        # (key, emitted tokens, pending token) -> the requests that offered such a checkpoint.
        self._writers: dict[tuple[str, int, int], set[Any]] = {}
        self._newest_written: dict[str, int] = {}
        self._durably_removed: set[str] = set()
        # This process's completions: key -> the newest completed attempt.
        self._invalidated: dict[str, int] = {}
        self.resumes = 0

    def new_process(self) -> None:
        """A system opened: attempts count afresh, files of earlier processes are attempt 0."""
        self._invalidated.clear()

    def listener(self, what: str, request: Any, checkpoint: GenerationCheckpoint) -> None:
        """`Checkpointing`'s listener: "offered" or "resumed"."""
        slot = (checkpoint.request_key, checkpoint.emitted_tokens, checkpoint.pending_token)
        if what == "offered":
            self._writers.setdefault(slot, set()).add(request)
            return
        self.resumes += 1
        if request not in self._writers.get(slot, set()):
            self._violate(
                "checkpoint_resumes_its_own_request",
                f"a request of {len(request.prompt_ids)} prompt tokens (max_tokens {request.params.max_tokens}) "
                f"resumed a checkpoint at {checkpoint.emitted_tokens} tokens that no identical request wrote",
            )
        newest = self._newest_written.get(checkpoint.request_key)
        if newest is not None and checkpoint.emitted_tokens < newest:
            self._violate(
                "superseded_checkpoint_never_restored",
                f"resumed a checkpoint at {checkpoint.emitted_tokens} tokens after one at {newest} was durable",
            )
        if checkpoint.request_key in self._durably_removed:
            self._violate(
                "completed_checkpoint_never_restored",
                f"resumed the checkpoint of a completed request after its removal ({checkpoint.emitted_tokens} tokens)",
            )

    def follow(self, event: Any) -> None:
        """The store's event listener."""
        match event:
            case CheckpointWritten():
                self._newest_written[event.request_key] = event.emitted_tokens
                self._durably_removed.discard(event.request_key)
            case CheckpointRemoved(unlinked=True):
                self._newest_written.pop(event.request_key, None)
                self._durably_removed.add(event.request_key)
            case CheckpointInvalidated():
                completed = self._invalidated.get(event.request_key, event.attempt)
                self._invalidated[event.request_key] = max(completed, event.attempt)
            case CheckpointResumed():
                newest_completed = self._invalidated.get(event.request_key)
                if newest_completed is not None and (
                    event.attempt == EARLIER_PROCESS_ATTEMPT or event.attempt <= newest_completed
                ):
                    self._violate(
                        "completed_checkpoint_never_restored",
                        f"resumed attempt {event.attempt}'s checkpoint after attempt {newest_completed} completed",
                    )
