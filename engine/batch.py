"""The batch lane's engine side: several generations as rows of one mlx-lm
`BatchGenerator`, run as one long engine job.

`BatchLoop.run` is that job. Between two steps it picks up rows the Scheduler
admitted (`BatchRow`, through a thread-safe `queue.Queue`, the inbox), seeds
each from `PromptCache.take()` so it prefills only its remainder, and hands
every step's tokens back as one `BatchStep`. Rows carry their own sampler,
logits processors (engine/sampling.py), `max_tokens`, stop tokens and stop
strings (the serial lane's `TextAssembler`) and finish independently. A finished or cancelled row's caches are extracted
per row before the batched caches are filtered and are `put` back to the RAM
tier (spec §4, extract-and-put). The prompt-boundary snapshot follows the
serial lane's rule (engine/generation.py): a row carrying the template
probe's stable boundary beyond what the tiers served is inserted as two
segments (mlx-lm's `insert_segments`, which stops its prefill at the segment
end), and when the first one ends the row's caches, extracted, hold exactly
`prompt[:boundary]` and are put; a row without a boundary puts its
prompt-only caches after a cold prefill of `snapshot_prefill_tokens_min` or
more.

A client that leaves (issue 38): its row is cancelled at the next turn of
the loop, so within one step (one prefill chunk or one decode step), and its
caches, extracted as for any finished row, hold what the row computed so far
(mid-prefill, the prompt's first tokens) and are put in the tiers, so the
client's retry reuses them. Each prefilling row's `prefill_observer` hears
its progress after every step and its cancellation.

Generation checkpoints (spec §5.7, `engine/checkpointing.py`): mlx-lm's
generation step feeds the token it sampled last step and samples the next,
so right after a step each running row is at the checkpoint boundary: its
caches cover every token it emitted and its next token is sampled, not
emitted. A row whose emitted count reaches a multiple of the interval offers
its extracted caches with that pending token and its sampler's key. A row
that resumes replays its checkpoint's tokens and the pending token as
ordinary tokens at admission, then joins the batch like any other with the
restored caches and `[pending]` as its last segment (mlx-lm feeds it and
samples the next), its own sampler chain set to the saved key and its
penalty history the checkpoint's tokens.
The job ends when the Scheduler sends `END_OF_BATCH`, which it does only when
no row is active or waiting (or when its consumer has gone). While no row is
active it waits on the inbox; with `wait_for_rows=False` (an engine that runs
jobs on the Trio thread, the simulator's `InlineEngine`, where that wait would
stall the Scheduler that fills the inbox) it yields an empty `BatchStep`
instead and the engine lets the Trio tasks run before the next turn. In a model
pool (engine/shared_engine.py) it neither waits nor holds the thread while
`turn_wanted()` says another model's job is queued: it yields an empty step,
at which the stream parks and that job runs.

Gates (spec §2.3): a model batches only when every fresh cache is one mlx-lm
can merge into rows (`KVCache`, `RotatingKVCache`, `ArraysCache`, or a
`CacheList` of those); a KV scheme batches when `KvScheme.batchable()`
allows it: the batch lane holds affine-quantized rows in
`BatchQuantizedKVCache` (engine/quant_batch.py, which also names where a row
converts), so uniform KV4/KV8 and per-layer config batch; a scheme that does
not fit the model's caches (`quantized_batch_refusal`) keeps the serial lane,
which reports its error per request.

All of this runs on the engine thread (docs/mlx-notes.md, "Threads").
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, cast

import attrs
from mlx_lm.models import cache as mlx_cache

from kvcellar.engine.batch_generator import LeanBatchGenerator, capacity_merging_caches, owned_row_caches
from kvcellar.engine.checkpointing import Checkpointing, RequestCheckpoints
from kvcellar.engine.detokenize import TextAssembler
from kvcellar.engine.engine import (
    PREFILL_STEP_TOKENS,
    LoadedModel,
    SamplingParams,
    make_params_sampler,
    resume_sampler,
    sampler_key_words,
)
from kvcellar.engine.generation import (
    SNAPSHOT_PREFILL_TOKENS_MIN,
    GenerationDone,
    GenerationRequest,
    Reuse,
    TokenDelta,
    delta_logprob,
    take_reuse,
)
from kvcellar.engine.memory import DECODE_CHECK_TOKENS, MemoryGuard
from kvcellar.engine.paged_kv import PagedKv, blocks_for
from kvcellar.engine.quant_batch import PREFILL_ROWS, QuantizedRows, quantized_batch_refusal
from kvcellar.engine.sampling import build_processors
from kvcellar.engine.scalars import item_int
from kvcellar.errors import InsufficientMemory
from kvcellar.store import signature as sig
from kvcellar.store.checkpoints import ResumePoint
from kvcellar.store.lending import snapshot_caches
from kvcellar.store.prompt_cache import CacheDivergence, PromptCache
from kvcellar.store.scheme import KvScheme

_ROW_SIGNATURES = frozenset({sig.SIGNATURE_PLAIN, sig.SIGNATURE_ROTATING, sig.SIGNATURE_SSM})
END_OF_BATCH = None
# How often an idle loop (no rows, inbox empty) looks at its cancel flag.
IDLE_POLL_S = 0.05


def _cache_refusal(cache: Any, index: int) -> str | None:
    signature = sig.cache_signature(cache)
    if type(cache) is mlx_cache.CacheList:
        return next((reason for member in cache.caches if (reason := _cache_refusal(member, index))), None)
    if signature in _ROW_SIGNATURES:
        return None
    return (
        f"layer {index} keeps a {signature} cache ({type(cache).__name__}), which mlx-lm cannot merge into batch rows"
    )


def model_batch_refusal(model: Any) -> str | None:
    """Why `model` cannot batch (its first unbatchable cache), or None."""
    for index, cache in enumerate(mlx_cache.make_prompt_cache(model)):
        reason = _cache_refusal(cache, index)
        if reason is not None:
            return reason
    return None


def batch_lane_refusal(model: Any, scheme: KvScheme, rows_max: int) -> str | None:
    """Why requests must take the serial lane, or None when the batch lane may
    run them: `rows_max` of 1, an unbatchable cache kind, or a scheme the batch
    lane cannot carry."""
    if rows_max <= 1:
        return "a batch of 1 row (--batch 1) asks for the serial lane"
    reason = model_batch_refusal(model)
    if reason is not None:
        return reason
    # The capability probe (spec §2.3): mlx-lm's merged row caches have no quantized
    # form, engine/quant_batch.py's BatchQuantizedKVCache is one, given the scheme converts this model.
    conversion_refusal = quantized_batch_refusal(model, scheme)
    if not scheme.batchable(can_convert=conversion_refusal is None):
        return conversion_refusal
    return None


@attrs.frozen(kw_only=True)
class BatchRow:
    """A row the Scheduler admitted; `cancelled` is set from the Trio thread."""

    row_id: int
    request: GenerationRequest
    cancelled: threading.Event = attrs.field(eq=False)


@attrs.frozen(kw_only=True)
class RowToken:
    row_id: int
    delta: TokenDelta


@attrs.frozen(kw_only=True)
class RowDone:
    """A row's end: `outcome` is completed, cancelled or failed (with `error`)."""

    row_id: int
    outcome: str
    done: GenerationDone | None = None
    error: BaseException | None = attrs.field(default=None, eq=False)


@attrs.frozen(kw_only=True)
class BatchStep:
    """What one turn of the loop produced; `decode_rows` is the batch size of
    its decode step (0 when it only prefilled or admitted)."""

    events: tuple[RowToken | RowDone, ...]
    decode_rows: int


@attrs.define(kw_only=True)
class _Row:
    row: BatchRow
    uid: int
    prompt: list[int]
    cached_tokens: int
    cache_tier: str
    use_cache: bool
    snapshot: bool
    # The restore policy's plan for a prefix on a slow tier ("" when none; `Reuse.restore_plan`).
    restore_plan: str
    # The stable boundary whose snapshot is still owed (the end of the row's first segment), or None.
    boundary: int | None
    assembler: TextAssembler
    produced: int = 0
    # Where the prompt left the longest prefix a tier shared with it (`GenerationDone.divergence`).
    divergence: CacheDivergence | None = None
    # Until its last prompt token ran: the memory guard reserves a prefill chunk for it.
    prefilling: bool = True
    # Prompt tokens its caches hold so far (the lent prefix, then each chunk run).
    prefilled_tokens: int = 0
    # The tier entries that are this row's own (lent from, put by it): never relief victims.
    own_entry_ids: set[str] = attrs.field(factory=set)
    checkpoints: RequestCheckpoints | None = None
    # The row's own sampler (a seeded chain), whose key a checkpoint records; None when shared or greedy.
    sampler: Any = None


def _keep(state: _Row, entry_id: str | None) -> None:
    """Protect an entry the row put (its caches share buffers with the batch's)."""
    if entry_id:
        state.own_entry_ids.add(entry_id)


class BatchLoop:
    """One batch job: `run(loaded)` is the generator the engine thread drives."""

    def __init__(
        self,
        prompt_cache: PromptCache | None,
        inbox: queue.Queue,
        *,
        rows_max: int,
        cancelled: threading.Event,
        prefill_step_tokens: int = PREFILL_STEP_TOKENS,
        snapshot_prefill_tokens_min: int = SNAPSHOT_PREFILL_TOKENS_MIN,
        wait_for_rows: bool = True,
        memory_guard: MemoryGuard | None = None,
        checkpointing: Checkpointing | None = None,
        scheme: KvScheme | None = None,
        paged_kv: PagedKv | None = None,
        turn_wanted: Callable[[], bool] | None = None,
    ) -> None:
        self.prompt_cache = prompt_cache
        # A pool's engine: whether another model waits for the thread (None: one model, never).
        self._turn_wanted = turn_wanted
        # A quantized scheme's conversion points (engine/quant_batch.py); None keeps KV as the model makes it.
        self._quantized = QuantizedRows(scheme) if scheme is not None and scheme.quantized else None
        # With paged KV, rows hold their plain layers in block pools (engine/paged_kv.py).
        self.paged_kv = paged_kv
        self.memory_guard = memory_guard if memory_guard is not None and memory_guard.enabled else None
        # Decode steps since the guard last checked (a check is due every DECODE_CHECK_TOKENS).
        self._decode_steps_unchecked = 0
        self.checkpointing = checkpointing
        self.inbox = inbox
        self.rows_max = rows_max
        self.cancelled = cancelled
        self.wait_for_rows = wait_for_rows
        self.prefill_step_tokens = prefill_step_tokens
        self.snapshot_prefill_tokens_min = snapshot_prefill_tokens_min
        self._rows: dict[int, _Row] = {}
        self._shared_samplers: dict[tuple, Any] = {}
        self._generator: LeanBatchGenerator | None = None
        self._loaded: LoadedModel | None = None

    def run(self, loaded: LoadedModel) -> Iterator[BatchStep]:
        self._loaded = loaded
        self._generator = LeanBatchGenerator(
            loaded.model,
            completion_batch_size=self.rows_max,
            prefill_batch_size=self.rows_max if self._quantized is None else PREFILL_ROWS,
            prefill_step_size=self.prefill_step_tokens,
        )
        try:
            while True:
                events: list[RowToken | RowDone] = []
                if not self._take_rows(events):
                    if events:
                        yield BatchStep(events=tuple(events), decode_rows=0)
                    return
                self._cancel_rows(events)
                self._relieve_memory(events)
                decode_rows = self._step(events) if self._rows else 0
                yield BatchStep(events=tuple(events), decode_rows=decode_rows)
        finally:
            # MLX's buffer cache is the engine thread's to release (EngineThread._run), once idle.
            self._generator.close()
            self._generator = None

    # -- admission ---------------------------------------------------------------

    def _take_rows(self, events: list[RowToken | RowDone]) -> bool:
        """Admit what the inbox holds, waiting for it while no row is active
        (unless `wait_for_rows` is off). False once the batch is over
        (`END_OF_BATCH`, or the consumer left)."""
        while True:
            if not self._rows and events:
                # Report rows that ended at admission before waiting again: the
                # Scheduler needs their end to admit more or to end the batch.
                return True
            waits = self.wait_for_rows and not self._rows and not self._gives_way()
            try:
                item = self.inbox.get(timeout=IDLE_POLL_S) if waits else self.inbox.get_nowait()
            except queue.Empty:
                if self._rows:
                    return True
                if self.cancelled.is_set():
                    return False
                if not waits:
                    return True
                continue
            if item is END_OF_BATCH:
                return False
            self._admit(item, events)

    def _gives_way(self) -> bool:
        return self._turn_wanted is not None and self._turn_wanted()

    def _admit(self, row: BatchRow, events: list[RowToken | RowDone]) -> None:
        if row.cancelled.is_set():
            events.append(RowDone(row_id=row.row_id, outcome="cancelled"))
            return
        try:
            checkpoints = self.checkpointing.begin(row.request) if self.checkpointing is not None else None
            point = checkpoints.resume() if checkpoints is not None else None
            if checkpoints is not None and point is not None:
                self._insert_resumed(row, checkpoints, point, events)
            else:
                self._insert(row, checkpoints)
        except Exception as e:  # a bad row fails alone; the batch goes on
            events.append(RowDone(row_id=row.row_id, outcome="failed", error=e))

    def _insert(self, row: BatchRow, checkpoints: RequestCheckpoints | None = None) -> None:
        assert self._generator is not None and self._loaded is not None
        request, params = row.request, row.request.params
        prompt = list(request.prompt_ids)
        reuse = take_reuse(self.prompt_cache, request)
        own_entry_ids = {reuse.entry_id} if reuse.entry_id else set()
        if self.memory_guard is not None:
            footprint = self.memory_guard.footprint.request_bytes(len(prompt), params.max_tokens)
            self.memory_guard.admit(footprint, self._own_entry_ids() | own_entry_ids)
        cached_tokens = reuse.cached_tokens
        boundary = reuse.boundary_snapshot_at(request)
        segments = [prompt[cached_tokens:]] if boundary is None else [prompt[cached_tokens:boundary], prompt[boundary:]]
        sampler = self._sampler(params)
        (uid,) = self._generator.insert_segments(
            # A cold row has no caches: mlx-lm takes None for it, which its annotation does not say.
            [segments],
            max_tokens=[params.max_tokens],
            caches=cast("list[list[Any]]", [self._joining_caches(reuse, row.request)]),
            all_tokens=[prompt[:cached_tokens]],
            samplers=[sampler],
            logits_processors=[build_processors(params, self._loaded.tokenizer) + request.make_logits_processors()],
        )
        self._rows[uid] = _Row(
            row=row,
            uid=uid,
            prompt=prompt,
            cached_tokens=cached_tokens,
            prefilled_tokens=cached_tokens,
            cache_tier=reuse.tier,
            restore_plan=reuse.restore_plan,
            divergence=reuse.divergence,
            use_cache=reuse.use_cache,
            snapshot=reuse.snapshot_due(request, self.snapshot_prefill_tokens_min),
            boundary=boundary,
            assembler=TextAssembler(self._loaded.tokenizer, params.stop_token_ids, request.stop_strings),
            own_entry_ids=own_entry_ids,
            checkpoints=checkpoints,
            sampler=sampler if params.seed is not None else None,
        )

    def _sampler(self, params: SamplingParams) -> Any:
        """None for greedy rows (they share the generator's greedy sampler, one
        batched call); one sampler per parameter set for unseeded rows, so rows
        alike are sampled together; a seeded row's own key chain otherwise."""
        if params.temperature == 0:
            return None
        if params.seed is not None:
            return make_params_sampler(params)
        key = (params.temperature, params.top_p, params.min_p, params.top_k)
        if key not in self._shared_samplers:
            self._shared_samplers[key] = make_params_sampler(params)
        return self._shared_samplers[key]

    def _insert_resumed(
        self, row: BatchRow, checkpoints: RequestCheckpoints, point: ResumePoint, events: list[RowToken | RowDone]
    ) -> None:
        """Replay a checkpoint's tokens and its pending token, then join the
        batch from the restored caches (see the module doc)."""
        assert self._generator is not None and self._loaded is not None and self.prompt_cache is not None
        request, params = row.request, row.request.params
        prompt, pending = list(request.prompt_ids), point.checkpoint.pending_token
        if self.memory_guard is not None:
            footprint = self.memory_guard.footprint.request_bytes(len(prompt), params.max_tokens)
            self.memory_guard.admit(footprint, self._own_entry_ids())
        state = _Row(
            row=row,
            uid=-1,
            prompt=prompt,
            cached_tokens=len(prompt),
            cache_tier="checkpoint",
            restore_plan="",
            use_cache=self.prompt_cache.enabled,
            snapshot=False,
            boundary=None,
            assembler=TextAssembler(self._loaded.tokenizer, params.stop_token_ids, request.stop_strings),
            checkpoints=checkpoints,
        )
        for token_id in (*point.emitted, pending):
            state.produced += 1
            events.append(
                RowToken(row_id=row.row_id, delta=TokenDelta(token_id=token_id, text=state.assembler.add(token_id)))
            )
        if state.assembler.finished_by_stop or state.produced >= params.max_tokens:
            self._finish(state, "completed", events, removed=(point.caches, list(point.tokens)))
            return
        sampler = self._sampler(params)
        resume_sampler(sampler, point.checkpoint.sampler.rng_key)
        (state.uid,) = self._generator.insert_segments(
            [[[pending]]],
            max_tokens=[params.max_tokens - state.produced],
            caches=cast("list[list[Any]]", [self._row_caches(point.caches, request)]),
            all_tokens=[list(point.tokens)],
            samplers=[sampler],
            logits_processors=[build_processors(params, self._loaded.tokenizer) + request.make_logits_processors()],
        )
        state.sampler = sampler if params.seed is not None else None
        self._rows[state.uid] = state

    def _offer_checkpoint(self, state: _Row) -> None:
        """At the step boundary: the row's caches cover its emitted tokens, its next token is sampled."""
        assert self._generator is not None and state.checkpoints is not None
        generation = self._generator._generation_batch  # mlx-lm keeps the sampled, unfed tokens here
        index = generation.uids.index(state.uid)
        pending = item_int(generation._next_tokens[index])
        caches, tokens = self._generator.extract_cache([state.uid])[state.uid]
        state.checkpoints.offer(tokens, caches, pending, state.produced + 1, sampler_key_words(state.sampler))

    # -- stepping ----------------------------------------------------------------

    def _cancel_rows(self, events: list[RowToken | RowDone]) -> None:
        for state in [s for s in self._rows.values() if s.row.cancelled.is_set()]:
            self._finish(state, "cancelled", events, removed=None)

    def _step(self, events: list[RowToken | RowDone]) -> int:
        assert self._generator is not None and self._loaded is not None
        loaded = self._loaded
        prompt_responses, generation_responses = self._generator.next()
        if self._quantized is not None:
            self._quantized.convert_decoding(self._generator)
        for response in prompt_responses:
            state = self._rows.get(response.uid)
            if state is None:
                continue
            state.prefilled_tokens = state.cached_tokens + response.progress[0]
            if response.end_of_prompt:
                state.prefilling = False
            elif (observer := state.row.request.prefill_observer) is not None:
                observer.progress(state.prefilled_tokens, len(state.prompt))
            if response.end_of_segment and state.boundary is not None:
                if self._quantized is not None:
                    self._quantized.convert_prefilling(self._generator)
                self._put_boundary_snapshot(state)
            elif response.end_of_prompt and state.snapshot:
                self._put_snapshot(state)
        for response in generation_responses:
            state = self._rows[response.uid]
            state.produced += 1
            text = state.assembler.add(response.token)
            logprob = delta_logprob(loaded, state.row.request.params, response.token, response.logprobs)
            events.append(
                RowToken(row_id=state.row.row_id, delta=TokenDelta(token_id=response.token, text=text, logprob=logprob))
            )
            if response.finish_reason is not None:
                self._finish(state, "completed", events, removed=(response.prompt_cache, response.all_tokens))
            elif state.assembler.finished_by_stop:
                self._finish(state, "completed", events, removed=None)
            elif state.checkpoints is not None and state.checkpoints.due(state.produced):
                self._offer_checkpoint(state)
        return len(generation_responses)

    def _put_snapshot(self, state: _Row) -> None:
        """The prompt-boundary snapshot: right after a row's last prompt token
        ran, its extracted caches hold exactly the prompt."""
        assert self._generator is not None and self.prompt_cache is not None
        caches, tokens = self._generator.extract_cache([state.uid])[state.uid]
        if list(tokens) == state.prompt:
            _keep(state, self.prompt_cache.put_entry(state.prompt, caches, state.row.request.namespace))

    def _put_boundary_snapshot(self, state: _Row) -> None:
        """The stable-boundary snapshot: the row's first segment ended, so its
        extracted caches hold exactly `prompt[:boundary]`; put an evaluated
        copy (the batched caches go on changing)."""
        assert self._generator is not None and self.prompt_cache is not None and state.boundary is not None
        boundary, state.boundary = state.boundary, None
        caches, tokens = self._generator.extract_cache([state.uid])[state.uid]
        if list(tokens) == state.prompt[:boundary]:
            entry_id = self.prompt_cache.put_entry(
                state.prompt[:boundary], snapshot_caches(caches), state.row.request.namespace
            )
            _keep(state, entry_id)

    def _finish(
        self,
        state: _Row,
        outcome: str,
        events: list[RowToken | RowDone],
        removed: tuple[list[Any], list[int]] | None,
        error: BaseException | None = None,
    ) -> None:
        """End a row: extract its caches (unless the generator already did)
        before the batch is filtered, put them back, report the end."""
        assert self._generator is not None
        self._rows.pop(state.uid, None)
        if outcome == "completed" and state.checkpoints is not None:
            state.checkpoints.completed()
        if removed is None:
            removed = self._generator.remove([state.uid], return_prompt_caches=True).get(state.uid)
        caches, tokens = removed if removed is not None else (None, [])
        # A row still waiting to prefill holds only the lent prefix: nothing new to keep.
        if state.use_cache and caches is not None and len(tokens) > state.cached_tokens:
            assert self.prompt_cache is not None
            if self._quantized is not None:
                # A row cancelled mid-prefill still holds unquantized KV: the chokepoint converts it, as serially.
                caches = self._quantized.scheme.convert(list(caches))
            self.prompt_cache.put(list(tokens), caches, state.row.request.namespace)
        observer = state.row.request.prefill_observer
        if outcome == "cancelled" and state.prefilling and observer is not None:
            kept_tokens = len(tokens) if state.use_cache and len(tokens) > state.cached_tokens else 0
            observer.cancelled(kept_tokens, len(state.prompt))
        tail = state.assembler.closing_text() if outcome == "completed" else ""
        if tail:
            events.append(RowToken(row_id=state.row.row_id, delta=TokenDelta(token_id=-1, text=tail)))
        done = GenerationDone(
            finish_reason=state.assembler.finish_reason,
            prompt_tokens=len(state.prompt),
            completion_tokens=state.produced,
            cached_tokens=state.cached_tokens,
            cache_tier=state.cache_tier,
            restore_plan=state.restore_plan,
            resumed_tokens=state.checkpoints.resumed_tokens if state.checkpoints is not None else 0,
            divergence=state.divergence,
        )
        events.append(RowDone(row_id=state.row.row_id, outcome=outcome, done=done, error=error))

    # -- memory guard (engine/memory.py) -------------------------------------------

    def _own_entry_ids(self) -> set[str]:
        return set().union(*(state.own_entry_ids for state in self._rows.values()))

    def _relieve_memory(self, events: list[RowToken | RowDone]) -> None:
        """Before a step that prefills a chunk, and every DECODE_CHECK_TOKENS
        decode steps: relief for what the step may allocate. Rows are padded
        to the longest, so the live KV is rows x the longest row's. Past
        relief, the newest row fails with the error and the check repeats;
        the rest of the batch goes on."""
        guard = self.memory_guard
        if guard is None or not self._rows:
            return
        prefilling = sum(state.prefilling for state in self._rows.values())
        self._decode_steps_unchecked += 1
        if not prefilling and self._decode_steps_unchecked < DECODE_CHECK_TOKENS:
            return
        self._decode_steps_unchecked = 0
        while self._rows:
            rows = len(self._rows)
            longest = max(state.prefilled_tokens + state.produced for state in self._rows.values())
            live_kv = self._live_kv_bytes(guard, rows, longest)
            if prefilling:
                # mlx-lm pads the rows' chunks of one prefill step to the longest.
                chunk = max(
                    min(self.prefill_step_tokens, len(state.prompt) - state.prefilled_tokens)
                    for state in self._rows.values()
                    if state.prefilling
                )
                chunk = max(1, chunk)
                reserve = guard.footprint.prefill_reserve_bytes(chunk, longest + chunk, live_kv, rows=prefilling)
            else:
                reserve = guard.footprint.decode_reserve_bytes(longest, live_kv, rows=rows)
            try:
                guard.relieve(reserve, self._own_entry_ids(), phase="prefill" if prefilling else "decode")
                return
            except InsufficientMemory as e:
                newest = self._rows[max(self._rows)]
                self._finish(newest, "failed", events, removed=None, error=e)
                prefilling = sum(state.prefilling for state in self._rows.values())

    # -- paged KV (engine/paged_kv.py) -----------------------------------------------

    def _row_caches(self, caches: list[Any] | None, request: GenerationRequest) -> list[Any] | None:
        """A row's caches as it joins: as lent (None: cold), or paged, its pools
        sized from its prompt plus `max_tokens`, or at a quantized scheme's
        conversion point (the two exclude each other: `serve` refuses both)."""
        if self._quantized is not None:
            return self._quantized.row_caches(caches)
        if self.paged_kv is None:
            return caches
        assert self._loaded is not None
        fresh = caches if caches is not None else mlx_cache.make_prompt_cache(self._loaded.model)
        return self.paged_kv.page(fresh, len(request.prompt_ids) + request.params.max_tokens)

    def _joining_caches(self, reuse: Reuse, request: GenerationRequest) -> list[Any] | None:
        """`_row_caches` of a fresh row, marked for the prompt batch's merge:
        an SSD restore's caches, which no one else holds (the restore made
        them for this row), as the row's own, so a one-row prompt batch adopts
        them uncopied; lent ones (a RAM hit's views) to be merged with a step
        of capacity, so the first step after the one copy writes in place."""
        caches = self._row_caches(reuse.caches, request)
        if caches is None or caches is not reuse.caches:
            return caches
        if reuse.tier == "ssd":
            return owned_row_caches(caches)
        return capacity_merging_caches(caches)

    def _live_kv_bytes(self, guard: MemoryGuard, rows: int, longest: int) -> int:
        """The batch's live KV: rows x the longest row (padded rows), or with
        paged KV the blocks each row's pools hold (whole blocks of its prompt
        plus `max_tokens`)."""
        paged = self.paged_kv
        if paged is None:
            return rows * guard.footprint.kv_bytes(longest)
        reserved_tokens = (
            blocks_for(len(state.prompt) + state.row.request.params.max_tokens, paged.block_size) * paged.block_size
            for state in self._rows.values()
        )
        return sum(guard.footprint.kv_bytes(tokens) for tokens in reserved_tokens)
