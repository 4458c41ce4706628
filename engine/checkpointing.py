"""What a lane needs to checkpoint a generation and to resume one (spec §5.7).

`Checkpointing` is the port the system hands both lanes when
`--generation-checkpoint N` is on; `begin(request)` gives a generation its
`RequestCheckpoints` (None when the request is not eligible: that is counted
by reason). Every N emitted tokens the lane calls `offer` at the boundary
where its caches cover every emitted token and the next token has been
sampled but not emitted: the caches are snapshotted (evaluated views) and
every tensor materialised into bytes here, on the engine thread, and the
snapshot goes to the checkpoint writer without waiting for it. Completion
`invalidate`s at once; cancellation leaves the checkpoint in place.

The request key covers everything that changes the continuation: the
rendered prompt ids, every sampling field (seed, temperature, filters,
penalties, bias, stop token ids, max tokens), the stop strings, the
namespace and the KV scheme. Requests whose continuation a token replay
cannot reconstruct are not checkpointed: log-probabilities (the response
would lack them for the replayed tokens), a grammar (its matcher's state),
the request's own logits processors (a forced reply start counts its steps),
and requests that do not use the cache tiers. Engine thread only, except
the two callables, which hand work to the Trio thread.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvcellar.engine.engine import SamplingParams
from kvcellar.errors import KvCellarError
from kvcellar.serialization import to_cbor
from kvcellar.store.checkpoints import CheckpointSnapshot, CheckpointStore, ResumePoint
from kvcellar.store.lending import snapshot_caches
from kvcellar.store.records import GenerationCheckpoint, SamplerState
from kvcellar.store.safeguards import SAFEGUARDS, Safeguards

SKIP_LOGPROBS = "logprobs"
SKIP_GRAMMAR = "grammar"
SKIP_REQUEST_PROCESSORS = "request_processors"
SKIP_NO_CACHE = "no_prompt_cache"
# Counted when a generation's caches cannot be persisted (a kind without a codec): it goes on unchecked.
SKIP_UNPERSISTABLE = "unpersistable_caches"
log = logging.getLogger("kvcellar.checkpointing")
_KEY_HEX_CHARS = 32


def _plain(value: Any) -> Any:
    if isinstance(value, frozenset):
        return sorted(value)
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    return value


def request_key(request: Any, kv_scheme_key: str, *, include_sampling: bool = True) -> str:
    """The identity of a generation's continuation (see the module doc);
    `include_sampling=False` only under the simulator's mutation."""
    params: SamplingParams = request.params
    fields: dict[str, Any] = {
        "prompt_ids": list(request.prompt_ids),
        "stop_strings": list(request.stop_strings),
        "namespace": request.namespace,
        "kv_scheme": kv_scheme_key,
    }
    if include_sampling:
        fields["params"] = {field.name: _plain(getattr(params, field.name)) for field in attrs.fields(SamplingParams)}
    return hashlib.sha256(to_cbor(fields)).hexdigest()[:_KEY_HEX_CHARS]


def skip_reason(request: Any) -> str | None:
    """Why a request is not checkpointed, or None."""
    if request.params.logprobs:
        return SKIP_LOGPROBS
    if request.params.grammar is not None:
        return SKIP_GRAMMAR
    if request.logits_processors:
        return SKIP_REQUEST_PROCESSORS
    if not request.use_prompt_cache:
        return SKIP_NO_CACHE
    return None


CheckpointListener = Callable[[str, Any, GenerationCheckpoint], None]


@attrs.frozen(kw_only=True, eq=False)
class Checkpointing:
    """`submit(snapshot)` and `invalidate(key, attempt)` hand over to the
    checkpoint writer without waiting (the system's `run_sync_soon`)."""

    interval_tokens: int
    store: CheckpointStore
    submit: Callable[[CheckpointSnapshot], None]
    invalidate: Callable[[str, int], None]
    kv_scheme_key: str
    safeguards: Safeguards = SAFEGUARDS
    # Each sees ("offered" | "resumed", request, checkpoint) on the engine thread
    # (the simulator's invariant checks); quick, no I/O.
    listeners: tuple[CheckpointListener, ...] = ()

    def begin(self, request: Any) -> RequestCheckpoints | None:
        reason = skip_reason(request)
        if reason is not None:
            self.store.count_skipped(reason)
            return None
        key = request_key(request, self.kv_scheme_key, include_sampling=self.safeguards.checkpoint_key_has_sampling)
        return RequestCheckpoints(self, request, key, self.store.new_attempt())


class RequestCheckpoints:
    """One generation's checkpoints: its key, its attempt, where it resumed."""

    def __init__(self, port: Checkpointing, request: Any, key: str, attempt: int) -> None:
        self.port = port
        self.request = request
        self.key = key
        self.attempt = attempt
        self.resumed_tokens = 0
        self.offered = 0
        self.disabled = False

    def resume(self) -> ResumePoint | None:
        """The request's checkpoint restored, or None (none, or unusable: it runs cold)."""
        point = self.port.store.restore(self.key, self.request.prompt_ids)
        if point is not None:
            self.resumed_tokens = point.checkpoint.emitted_tokens
            self._notify("resumed", point.checkpoint)
        return point

    def _notify(self, what: str, checkpoint: GenerationCheckpoint) -> None:
        for listener in self.port.listeners:
            listener(what, self.request, checkpoint)

    def due(self, emitted_tokens: int) -> bool:
        """Whether the boundary after `emitted_tokens` emitted tokens takes a checkpoint."""
        interval = self.port.interval_tokens
        return not self.disabled and emitted_tokens > self.resumed_tokens and emitted_tokens % interval == 0

    def due_between(self, emitted_before: int, emitted_after: int) -> bool:
        """Whether a boundary in `(emitted_before, emitted_after]` takes one: a
        speculative round emits several tokens, and its end is the boundary."""
        interval = self.port.interval_tokens
        after = max(emitted_before, self.resumed_tokens)
        return not self.disabled and emitted_after > after and emitted_after // interval > after // interval

    def offer(
        self,
        tokens: Sequence[int],
        caches: Sequence[Any],
        pending_token: int,
        sample_index: int,
        rng_key: tuple[int, ...],
    ) -> None:
        """Snapshot the caches (covering `tokens`: prompt + emitted) with the
        pending token and hand the materialised checkpoint to the writer."""
        prompt_tokens = len(self.request.prompt_ids)
        checkpoint = GenerationCheckpoint(
            request_key=self.key,
            prompt_tokens=prompt_tokens,
            emitted_tokens=len(tokens) - prompt_tokens,
            namespace=self.request.namespace,
            pending_token=pending_token,
            sampler=SamplerState(seed=self.request.params.seed, sample_index=sample_index, rng_key=rng_key),
            attempt=self.attempt,
        )
        try:
            snapshot = snapshot_caches(caches)
            writer = self.port.store.plan(checkpoint, tokens, snapshot)
            segments = [writer.materialise_tensor(index) for index in range(writer.tensor_count)]
        except KvCellarError as e:
            # A checkpoint is a restart point, never a reason for the request to fail.
            log.warning("generation checkpoints off for this request: %s", e)
            self.disabled = True
            self.port.store.count_skipped(SKIP_UNPERSISTABLE)
            return
        self.offered += 1
        self._notify("offered", checkpoint)
        self.port.submit(
            CheckpointSnapshot(
                checkpoint=checkpoint,
                writer=writer,
                segments=segments,
                pinned=snapshot,
                bytes=writer.planned_header.payload_bytes,
            )
        )

    def completed(self) -> None:
        """Normal completion: no resume from now on; the file's removal is queued."""
        self.port.store.invalidate(self.key, self.attempt)
        self.port.invalidate(self.key, self.attempt)
