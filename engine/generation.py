"""One generation on the engine thread, with prompt-cache reuse.

`run_generation` is a generator run as a single engine job: take the longest
usable prefix from the RAM tier (which consults the SSD tier), prefill only
the remainder in chunks, put a prompt-only snapshot (spec §4, "prompt-boundary
snapshot"), decode with mlx-lm's samplers, and put the finished caches back,
also when the client went away.

A client that leaves (issue 38) is seen between two steps: between two
decode steps, and before each prefill chunk (`PrefillCancelled`), so a long
prefill stops within one chunk and its caches, which then hold the prompt's
first tokens, are put in the tiers as any finished request's are (written
behind to the SSD tier): the client's retry reuses them. The request's
`prefill_observer` hears the prefill's progress before each chunk.

Where the snapshot goes: a chat request carries the template probe's stable
boundary (`GenerationRequest.snapshot_at_tokens`, spec §4 "template probe"),
the leading prompt tokens the next turn's rendering keeps; the prefill is
split there and the snapshot holds exactly `prompt[:boundary]`, whenever the
tiers served less than that (no minimum: an agent's turns are often short,
and an untrimmable cache, recurrent state or a wrapped ring, serves the next
turn only from an entry that is an exact prefix of it). A request without a
boundary (completions) gets the whole-prompt snapshot after a cold prefill of
`SNAPSHOT_PREFILL_TOKENS_MIN` or more.

Generation checkpoints (spec §5.7, `engine/checkpointing.py`): with the port
on, every N emitted tokens, right after the next token is sampled and before
it is emitted (the caches then cover every emitted token), the caches, that
pending token and the sampler's key go to the checkpoint writer. An identical
request finding a checkpoint skips the tiers and the prefill: it replays the
saved tokens as ordinary deltas, then emits the pending token and decodes on
with the sampler where it stood, so greedy and seeded output is exactly the
uninterrupted run's. Normal completion invalidates the checkpoint; a client
gone (cancellation) leaves it for the next identical request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterator
from functools import partial
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from kvcellar.engine.checkpointing import Checkpointing, RequestCheckpoints
from kvcellar.engine.detokenize import TextAssembler
from kvcellar.engine.engine import (
    PREFILL_STEP_TOKENS,
    BeforeChunk,
    LoadedModel,
    PrefillObserver,
    SamplingParams,
    prefill,
)
from kvcellar.engine.memory import DECODE_CHECK_TOKENS, GuardedRequest, MemoryGuard
from kvcellar.engine.paged_kv import PagedKv
from kvcellar.engine.sampling import SerialSampling, TokenLogprob, token_logprob
from kvcellar.engine.scalars import item_int
from kvcellar.engine.speculative import (
    Drafter,
    SpeculativeRounds,
    admission_draft_kv_bytes_per_token,
    prepare_draft,
    refusal,
)
from kvcellar.errors import PrefillCancelled, UsageError
from kvcellar.store.checkpoints import ResumePoint
from kvcellar.store.companion import SplitEntry, split_companion, with_companion
from kvcellar.store.lending import lend_caches, snapshot_caches
from kvcellar.store.prompt_cache import CacheDivergence, PromptCache
from kvcellar.store.safeguards import SAFEGUARDS, Safeguards
from kvcellar.store.scheme import KvScheme

SNAPSHOT_PREFILL_TOKENS_MIN = 512


def tier_form(cache: list, paged_kv: PagedKv | None) -> list:
    """The caches as the tiers and checkpoints take them: with paged KV, every
    paged layer converted to a plain copy (the tier boundary, spec §6.3)."""
    return cache if paged_kv is None else paged_kv.plain(cache)


@attrs.frozen(kw_only=True)
class RequestNotes:
    """What the HTTP side changed of a request on its way in (docs/agents.md),
    carried to its `/stats/requests` record; the engine never reads it.
    `max_tokens_requested` is set only when the reply bound was clamped (to
    `params.max_tokens`); `hosted_tools_left_out` names the hosted or server
    tools left out of the prompt; `schema_keywords_relaxed` the JSON-schema
    keywords dropped from the tool-call grammar's copy of the tools;
    `prompt_rewrites` the prompt-normalisation rules that rewrote the prompt."""

    api: str = ""
    max_tokens_requested: int | None = None
    hosted_tools_left_out: tuple[str, ...] = ()
    schema_keywords_relaxed: tuple[str, ...] = ()
    prompt_rewrites: tuple[str, ...] = ()


NO_NOTES = RequestNotes()


@attrs.frozen(kw_only=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stop_strings: tuple[str, ...] = ()
    namespace: str = ""
    use_prompt_cache: bool = True
    # Factories of logits processors of this request's own (a forced reply
    # start, `engine/forcing.py`), applied after the sampling parameters'
    # processors on both lanes; called once per generation, on the engine
    # thread, since a processor may keep state.
    logits_processors: tuple[Callable[[], Any], ...] = attrs.field(default=(), eq=False)
    # The template probe's stable boundary (spec §4): how many leading prompt
    # tokens the next turn's rendering keeps, strictly inside the prompt; the
    # prompt-boundary snapshot goes there. None: no boundary known.
    snapshot_at_tokens: int | None = None
    # Hears the prefill's progress and a cancellation mid-prefill (engine thread); None: nobody listens.
    prefill_observer: PrefillObserver | None = attrs.field(default=None, eq=False)
    notes: RequestNotes = attrs.field(default=NO_NOTES, eq=False)

    def __attrs_post_init__(self) -> None:
        boundary = self.snapshot_at_tokens
        if boundary is not None and not 0 < boundary < len(self.prompt_ids):
            raise UsageError(f"snapshot boundary {boundary} is not inside the {len(self.prompt_ids)}-token prompt")

    def make_logits_processors(self) -> list[Any]:
        return [make() for make in self.logits_processors]


@attrs.frozen(kw_only=True)
class Reuse:
    """What the tiers lent a request: `caches` covering its first `cached_tokens`
    (None on a miss); `use_cache` says whether the request uses the tiers at all."""

    use_cache: bool
    caches: list | None
    cached_tokens: int
    tier: str
    # The tier's entry the caches were lent from ("" on a miss): the request's own, never a relief victim.
    entry_id: str = ""
    # How a cold entry was served (store/prompt_cache.py `TakeResult.restore_plan`); "" when none was considered.
    restore_plan: str = ""
    # Where the prompt left the longest prefix a tier shares with it (before this take); None without tiers.
    divergence: CacheDivergence | None = None
    # The lent entry's draft state (store/companion.py), told apart from `caches` (the target's); None on a miss.
    companion: SplitEntry | None = None

    def snapshot_due(self, request: GenerationRequest, snapshot_prefill_tokens_min: int) -> bool:
        """Whether the whole-prompt snapshot is owed: no stable boundary is
        known and the cold prefill is at least the minimum."""
        return (
            self.use_cache
            and request.snapshot_at_tokens is None
            and len(request.prompt_ids) - self.cached_tokens >= snapshot_prefill_tokens_min
        )

    def boundary_snapshot_at(self, request: GenerationRequest) -> int | None:
        """Where the stable-boundary snapshot goes (`prompt[:boundary]`), or
        None: no boundary, no tiers, or the tiers already served it."""
        boundary = request.snapshot_at_tokens
        if not self.use_cache or boundary is None or boundary <= self.cached_tokens:
            return None
        return boundary


def take_reuse(prompt_cache: PromptCache | None, request: GenerationRequest, drafter: str | None = None) -> Reuse:
    """Take the longest usable prefix of the request's prompt from the tiers,
    when it uses them; `caches` are the target's, any companion state the
    entry held is in `companion` (usable only when `drafter` wrote it)."""
    if not request.use_prompt_cache or prompt_cache is None or not prompt_cache.enabled:
        return Reuse(use_cache=False, caches=None, cached_tokens=0, tier="none")
    prompt = list(request.prompt_ids)
    divergence = prompt_cache.divergence(prompt, request.namespace)
    taken = prompt_cache.take(prompt, request.namespace)
    companion = split_companion(taken.caches, drafter) if taken.caches is not None else None
    return Reuse(
        use_cache=True,
        caches=companion.target if companion is not None else None,
        companion=companion,
        cached_tokens=taken.reused_tokens,
        tier=taken.tier,
        entry_id=taken.entry_id,
        restore_plan=taken.restore_plan,
        divergence=divergence,
    )


@attrs.frozen(kw_only=True)
class TokenDelta:
    """A sampled token and the text it made safe to emit; `logprob` when the
    request asked for log-probabilities (never for a stop token, nor for the
    closing text, whose `token_id` is -1)."""

    token_id: int
    text: str
    logprob: TokenLogprob | None = None


def delta_logprob(loaded: LoadedModel, params: SamplingParams, token_id: int, logprobs) -> TokenLogprob | None:
    """What a `TokenDelta` reports for `token_id`, drawn from `logprobs`."""
    if not params.logprobs or token_id in params.stop_token_ids:
        return None
    return token_logprob(loaded.tokenizer, logprobs, token_id, params.top_logprobs)


@attrs.frozen(kw_only=True)
class GenerationDone:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cache_tier: str
    # Emitted tokens a resumed generation took from its checkpoint (spec §5.7), replayed, not generated.
    resumed_tokens: int = 0
    # The restore policy's plan for a prefix on a slow tier ("restore", "recompute", "split"; "" when none).
    restore_plan: str = ""
    # Where the prompt left the longest prefix a tier shared with it (`/stats/requests`); None without tiers.
    divergence: CacheDivergence | None = None


def watched_prefill(
    check: BeforeChunk | None, request: GenerationRequest, cancelled: threading.Event, base_tokens: int
) -> BeforeChunk:
    """What runs before each chunk of a prefill that starts at prompt token
    `base_tokens`: report the progress, stop if the client left
    (`PrefillCancelled` with the tokens the caches hold), then `check` (the
    memory guard's relief)."""
    observer, total = request.prefill_observer, len(request.prompt_ids)

    def before_chunk(chunk_tokens: int, position: int, caches: list[Any]) -> None:
        tokens_done = base_tokens + position
        if observer is not None:
            observer.progress(tokens_done, total)
        if cancelled.is_set():
            raise PrefillCancelled("the client left during the prefill", tokens_done=tokens_done)
        if check is not None:
            check(chunk_tokens, position, caches)

    return before_chunk


def _keep_cancelled_prefix(
    tiers: PromptCache | None,
    request: GenerationRequest,
    reuse: Reuse,
    cache: list,
    tokens_done: int,
    *,
    scheme: KvScheme | None,
    paged_kv: PagedKv | None,
) -> None:
    """A prefill stopped by a client that left: its caches hold the prompt's
    first `tokens_done` tokens (every chunk run was evaluated); put them in
    the tiers, as a finished request's, when they hold more than was lent."""
    kept_tokens = 0
    if tiers is not None and tokens_done > reuse.cached_tokens:
        if scheme is not None:
            # The chokepoint (spec §3); idempotent when the boundary snapshot already converted them.
            cache = scheme.convert(cache)
        tiers.put(list(request.prompt_ids[:tokens_done]), tier_form(cache, paged_kv), request.namespace)
        kept_tokens = tokens_done
    if request.prefill_observer is not None:
        request.prefill_observer.cancelled(kept_tokens, len(request.prompt_ids))


def _prefill_boundary_snapshot(
    loaded: LoadedModel,
    prompt_cache: PromptCache,
    request: GenerationRequest,
    reuse: Reuse,
    cache: list,
    *,
    scheme: KvScheme | None,
    prefill_step_tokens: int,
    memory: GuardedRequest,
    cancelled: threading.Event,
    paged_kv: PagedKv | None = None,
) -> list:
    """Prefill from what the tiers served up to the stable boundary and put
    an owned, evaluated snapshot of the caches, which then hold exactly
    `prompt[:boundary]`; returns the (converted) caches to go on with."""
    boundary = request.snapshot_at_tokens
    assert boundary is not None
    check = watched_prefill(memory.prefill_check(reuse.cached_tokens), request, cancelled, reuse.cached_tokens)
    prefill(loaded.model, request.prompt_ids[reuse.cached_tokens : boundary], cache, prefill_step_tokens, check)
    if scheme is not None:
        # The snapshot is put in the form every entry has: converted.
        cache = scheme.convert(cache)
    snapshot = snapshot_caches(tier_form(cache, paged_kv))
    memory.keep(prompt_cache.put_entry(request.prompt_ids[:boundary], snapshot, request.namespace))
    return cache


@attrs.define(kw_only=True)
class _Start:
    """Where decoding starts: `cache` covers the prompt and `emitted`, and
    either `logits` give the next token or `pending` is it (a resume).
    `memory` is the request's side of the memory guard."""

    cache: list
    reuse: Reuse
    sampling: SerialSampling
    memory: GuardedRequest
    logits: Any = None
    emitted: tuple[int, ...] = ()
    pending: int | None = None
    # The draft's rounds when a draft serves this request (engine/speculative.py).
    speculation: SpeculativeRounds | None = None

    def entry_caches(self, paged_kv: PagedKv | None) -> list:
        """The caches the tiers and checkpoints take: the target's, with the
        draft's as companion state when they cover the same tokens."""
        caches = tier_form(self.cache, paged_kv)
        rounds = self.speculation
        if rounds is None:
            return caches
        return with_companion(caches, rounds.synced_draft(), rounds.drafter.digest)


def _speculation(
    loaded: LoadedModel,
    drafter: Drafter | None,
    request: GenerationRequest,
    start: _Start,
    covered: list[int],
    *,
    paged: bool,
    prefill_step_tokens: int,
) -> SpeculativeRounds | None:
    """The draft's rounds for a request about to decode from `covered`
    (prompt and emitted tokens), or None: no draft, or refused (counted)."""
    if drafter is None:
        return None
    reason = refusal(request, start.cache, paged=paged)
    if reason is not None:
        drafter.stats.count_refused(reason)
        return None
    drafter.stats.count_request()
    companion = start.reuse.companion or SplitEntry(target=[], draft=None)
    draft = prepare_draft(drafter, companion, covered, start.reuse.cached_tokens, prefill_step_tokens)
    return SpeculativeRounds(loaded.model, drafter, start.cache, draft, start.sampling, covered)


def _cold_start(
    loaded: LoadedModel,
    prompt_cache: PromptCache | None,
    request: GenerationRequest,
    cancelled: threading.Event,
    *,
    scheme: KvScheme | None,
    prefill_step_tokens: int,
    snapshot_prefill_tokens_min: int,
    memory_guard: MemoryGuard | None,
    paged_kv: PagedKv | None = None,
    drafter: Drafter | None = None,
) -> _Start:
    """Take what the tiers hold, admit the request against the memory budget,
    prefill the rest (with the prompt-boundary snapshot). A client that
    leaves mid-prefill raises `PrefillCancelled` once its prefix is kept."""
    prompt = list(request.prompt_ids)
    reuse = take_reuse(prompt_cache, request, drafter.digest if drafter is not None else None)
    memory = GuardedRequest(memory_guard, (reuse.entry_id,))
    memory.admit(len(prompt), request.params.max_tokens, admission_draft_kv_bytes_per_token(drafter, request))
    # The tiers this request uses: None exactly when `reuse.use_cache` is false.
    tiers = prompt_cache if reuse.use_cache else None
    cache = reuse.caches if reuse.caches is not None else make_prompt_cache(loaded.model)
    if paged_kv is not None:
        # Paging changes layout, not arithmetic: once, before prefill, pools sized for the whole request.
        cache = paged_kv.page(cache, len(prompt) + request.params.max_tokens)
    prefilled_tokens = reuse.cached_tokens
    boundary = reuse.boundary_snapshot_at(request)
    try:
        if boundary is not None and tiers is not None:
            cache = _prefill_boundary_snapshot(
                loaded,
                tiers,
                request,
                reuse,
                cache,
                scheme=scheme,
                prefill_step_tokens=prefill_step_tokens,
                memory=memory,
                cancelled=cancelled,
                paged_kv=paged_kv,
            )
            prefilled_tokens = boundary
        check = watched_prefill(memory.prefill_check(prefilled_tokens), request, cancelled, prefilled_tokens)
        logits = prefill(loaded.model, prompt[prefilled_tokens:], cache, prefill_step_tokens, check)
    except PrefillCancelled as e:
        _keep_cancelled_prefix(tiers, request, reuse, cache, e.tokens_done, scheme=scheme, paged_kv=paged_kv)
        raise
    if scheme is not None:
        # The conversion chokepoint (spec §3): after the first prefill; idempotent on reused caches.
        cache = scheme.convert(cache)
    if tiers is not None and reuse.snapshot_due(request, snapshot_prefill_tokens_min):
        mx.eval(logits)
        memory.keep(tiers.put_entry(prompt, lend_caches(tier_form(cache, paged_kv)), request.namespace))
    sampling = SerialSampling(request.params, loaded.tokenizer, prompt, request.make_logits_processors())
    start = _Start(cache=cache, reuse=reuse, sampling=sampling, memory=memory, logits=logits)
    start.speculation = _speculation(
        loaded, drafter, request, start, prompt, paged=paged_kv is not None, prefill_step_tokens=prefill_step_tokens
    )
    return start


def _resumed_start(
    loaded: LoadedModel,
    prompt_cache: PromptCache | None,
    request: GenerationRequest,
    point: ResumePoint,
    *,
    scheme: KvScheme | None,
    safeguards: Safeguards,
    memory_guard: MemoryGuard | None,
    paged_kv: PagedKv | None = None,
    drafter: Drafter | None = None,
) -> _Start:
    """Go on from a checkpoint (spec §5.7): its caches cover the prompt and
    the emitted tokens; the pending token and the sampler's key and history
    are where the interrupted run stood, so the rest is what it would have been."""
    prompt = list(request.prompt_ids)
    memory = GuardedRequest(memory_guard)
    memory.admit(len(prompt), request.params.max_tokens, admission_draft_kv_bytes_per_token(drafter, request))
    use_cache = prompt_cache is not None and prompt_cache.enabled
    companion = split_companion(point.caches, drafter.digest if drafter is not None else None)
    reuse = Reuse(
        use_cache=use_cache,
        caches=None,
        cached_tokens=len(prompt) + len(point.emitted),
        tier="checkpoint",
        companion=companion,
    )
    cache = scheme.convert(companion.target) if scheme is not None else companion.target
    if paged_kv is not None:
        cache = paged_kv.page(cache, len(prompt) + request.params.max_tokens)
    emitted, pending = point.emitted, point.checkpoint.pending_token
    sampling = SerialSampling(
        request.params,
        loaded.tokenizer,
        prompt + list(emitted) + [pending],
        request.make_logits_processors(),
        rng_key=point.checkpoint.sampler.rng_key,
    )
    if not safeguards.checkpoint_resumes_pending_token:
        # The simulator's mutation: the bug of a resume that did not save the pending token.
        logits = loaded.model(mx.array([[point.tokens[-1]]]), cache=cache)[:, -1, :]
        return _Start(cache=cache, reuse=reuse, sampling=sampling, memory=memory, logits=logits, emitted=emitted)
    start = _Start(cache=cache, reuse=reuse, sampling=sampling, memory=memory, emitted=emitted, pending=pending)
    start.speculation = _speculation(
        loaded,
        drafter,
        request,
        start,
        list(point.tokens),
        paged=paged_kv is not None,
        prefill_step_tokens=PREFILL_STEP_TOKENS,
    )
    # What the reply reports as cached: the prompt (the emitted tokens are replayed, counted apart).
    start.reuse = attrs.evolve(reuse, cached_tokens=len(prompt))
    return start


def _start(
    loaded: LoadedModel,
    prompt_cache: PromptCache | None,
    request: GenerationRequest,
    checkpoints: RequestCheckpoints | None,
    cancelled: threading.Event,
    *,
    scheme: KvScheme | None,
    prefill_step_tokens: int,
    snapshot_prefill_tokens_min: int,
    memory_guard: MemoryGuard | None,
    safeguards: Safeguards,
    paged_kv: PagedKv | None = None,
    drafter: Drafter | None = None,
) -> _Start:
    """A resume when the request has a checkpoint, else a cold start."""
    point = checkpoints.resume() if checkpoints is not None else None
    if point is not None:
        return _resumed_start(
            loaded,
            prompt_cache,
            request,
            point,
            scheme=scheme,
            safeguards=safeguards,
            memory_guard=memory_guard,
            paged_kv=paged_kv,
            drafter=drafter,
        )
    return _cold_start(
        loaded,
        prompt_cache,
        request,
        cancelled,
        scheme=scheme,
        prefill_step_tokens=prefill_step_tokens,
        snapshot_prefill_tokens_min=snapshot_prefill_tokens_min,
        memory_guard=memory_guard,
        paged_kv=paged_kv,
        drafter=drafter,
    )


def run_generation(
    loaded: LoadedModel,
    prompt_cache: PromptCache | None,
    request: GenerationRequest,
    cancelled: threading.Event,
    *,
    scheme: KvScheme | None = None,
    prefill_step_tokens: int = PREFILL_STEP_TOKENS,
    snapshot_prefill_tokens_min: int = SNAPSHOT_PREFILL_TOKENS_MIN,
    memory_guard: MemoryGuard | None = None,
    checkpointing: Checkpointing | None = None,
    paged_kv: PagedKv | None = None,
    drafter: Drafter | None = None,
) -> Iterator[TokenDelta | GenerationDone]:
    """Yield a `TokenDelta` per sampled token, then one `GenerationDone`.
    With `memory_guard`, the request is admitted against its budget after the
    tiers lent it a prefix, and relief runs before each prefill chunk and
    every 256 decode tokens (engine/memory.py); `InsufficientMemory` fails
    this request alone. With `checkpointing`, an identical request's
    checkpoint is resumed (its emitted tokens replayed first) and new ones
    are offered every interval. With `paged_kv`, plain full-attention layers
    are paged (engine/paged_kv.py) and converted back at the tier boundary.
    `cancelled` (the client left) ends it between two decode steps or before
    a prefill chunk; a cancelled prefill yields nothing. With `drafter`, the
    decode runs speculative rounds (engine/speculative.py) unless the request
    is refused them (counted), and the tiers take the draft's caches with the
    target's as companion state."""
    params = request.params
    prompt = list(request.prompt_ids)
    checkpoints = checkpointing.begin(request) if checkpointing is not None else None
    prefill = partial(
        _start,
        scheme=scheme,
        prefill_step_tokens=prefill_step_tokens,
        snapshot_prefill_tokens_min=snapshot_prefill_tokens_min,
        memory_guard=memory_guard,
        safeguards=checkpointing.safeguards if checkpointing is not None else SAFEGUARDS,
        paged_kv=paged_kv,
        drafter=drafter,
    )
    try:
        start = prefill(loaded, prompt_cache, request, checkpoints, cancelled)
    except PrefillCancelled:
        return  # the client left mid-prefill and its prefix is kept: nobody waits for a token
    tiers = prompt_cache if start.reuse.use_cache else None
    assembler = TextAssembler(loaded.tokenizer, params.stop_token_ids, request.stop_strings)
    fed: list[int] = []
    produced = 0
    try:
        for token_id in start.emitted:
            # The replay: the client sees the checkpoint's tokens as ordinary ones.
            produced += 1
            yield TokenDelta(token_id=token_id, text=assembler.add(token_id))
            fed.append(token_id)
        decode = _decode if start.speculation is None else _decode_speculative
        produced = yield from decode(loaded, start, request, assembler, fed, produced, cancelled, checkpoints, paged_kv)
        if checkpoints is not None and not cancelled.is_set():
            checkpoints.completed()
        tail = assembler.closing_text()
        if tail:
            yield TokenDelta(token_id=-1, text=tail)
    finally:
        if start.speculation is not None:
            start.speculation.settle()
        if tiers is not None:
            # The caches hold the prompt and every token fed back; the last sampled one was never fed.
            tiers.put(prompt + fed, start.entry_caches(paged_kv), request.namespace)
        # MLX's buffer cache is the engine thread's to release (EngineThread._run), once idle.
    yield _done(start.reuse, assembler.finish_reason, len(prompt), produced, checkpoints)


def _done(
    reuse: Reuse, finish_reason: str, prompt_tokens: int, produced: int, checkpoints: RequestCheckpoints | None
) -> GenerationDone:
    return GenerationDone(
        finish_reason=finish_reason,
        prompt_tokens=prompt_tokens,
        completion_tokens=produced,
        cached_tokens=reuse.cached_tokens,
        cache_tier=reuse.tier,
        resumed_tokens=checkpoints.resumed_tokens if checkpoints is not None else 0,
        restore_plan=reuse.restore_plan,
        divergence=reuse.divergence,
    )


def _decode(
    loaded: LoadedModel,
    start: _Start,
    request: GenerationRequest,
    assembler: TextAssembler,
    fed: list[int],
    produced: int,
    cancelled: threading.Event,
    checkpoints: RequestCheckpoints | None,
    paged_kv: PagedKv | None,
) -> Generator[TokenDelta, None, int]:
    """The decode loop after the prompt (and any replayed checkpoint tokens):
    yields each sampled token, appends every token fed back to `fed`, offers
    checkpoints when due; returns the tokens produced in all."""
    params, prompt = request.params, request.prompt_ids
    cache, sampling, logits, pending, memory = start.cache, start.sampling, start.logits, start.pending, start.memory
    while produced < params.max_tokens and not cancelled.is_set():
        if pending is not None:
            token, logprobs, token_id, pending = None, None, pending, None
        else:
            token, logprobs = sampling.sample(logits)
            token_id = item_int(token)
            if checkpoints is not None and checkpoints.due(produced):
                # The boundary: the caches cover every emitted token; `token_id` is sampled, not emitted.
                offered = tier_form(cache, paged_kv)
                checkpoints.offer(list(prompt) + fed, offered, token_id, produced + 1, sampling.rng_key)
        produced += 1
        text = assembler.add(token_id)
        yield TokenDelta(token_id=token_id, text=text, logprob=delta_logprob(loaded, params, token_id, logprobs))
        if assembler.finished_by_stop or produced >= params.max_tokens:
            break
        memory.decode_check(produced, len(prompt) + produced, cache)
        fed_input = token.reshape(1, 1) if token is not None else mx.array([[token_id]])
        logits = loaded.model(fed_input, cache=cache)[:, -1, :]
        fed.append(token_id)
    return produced


def _decode_speculative(
    loaded: LoadedModel,
    start: _Start,
    request: GenerationRequest,
    assembler: TextAssembler,
    fed: list[int],
    produced: int,
    cancelled: threading.Event,
    checkpoints: RequestCheckpoints | None,
    paged_kv: PagedKv | None,
) -> Generator[TokenDelta, None, int]:
    """`_decode` with a draft: each round emits one or more tokens
    (engine/speculative.py). `fed` follows the rounds' `covered`; a stop
    inside a round cuts the caches back to the last emitted token. A
    checkpoint is offered at a round's end whose emitted tokens reach an
    interval: its pending token is the round's last, already emitted."""
    params, prompt = request.params, request.prompt_ids
    rounds, memory = start.speculation, start.memory
    assert rounds is not None
    checked = produced // DECODE_CHECK_TOKENS * DECODE_CHECK_TOKENS
    if start.pending is not None:
        batch = [start.pending]
    else:
        token, _ = start.sampling.sample(start.logits)
        batch = [item_int(token)]
    fed_offered = len(fed)
    while True:
        for index, token_id in enumerate(batch):
            produced += 1
            yield TokenDelta(token_id=token_id, text=assembler.add(token_id))
            if assembler.finished_by_stop or produced >= params.max_tokens or cancelled.is_set():
                rounds.cut(len(batch) - 1 - index)
                fed[:] = rounds.covered[len(prompt) :]
                return produced
        if checkpoints is not None and checkpoints.due_between(fed_offered, len(fed)):
            checkpoints.offer(rounds.covered, start.entry_caches(paged_kv), batch[-1], produced, start.sampling.rng_key)
        fed_offered = len(fed)
        # A round may step over a multiple of the guard's interval: check at the multiple, draft KV counted.
        crossed = produced // DECODE_CHECK_TOKENS * DECODE_CHECK_TOKENS
        if crossed > checked:
            memory.decode_check(crossed, len(prompt) + produced, [*start.cache, *rounds.draft])
            checked = crossed
        batch = rounds.round(batch[-1])
        # The caches now cover the round's tokens but its last: so does `fed`, also while they are yielded.
        fed[:] = rounds.covered[len(prompt) :]
