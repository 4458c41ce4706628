"""One generation on the engine thread, with prompt-cache reuse.

`run_generation` is a generator run as a single engine job: take the longest
usable prefix from the RAM tier (which consults the SSD tier), prefill only
the remainder in chunks, put a prompt-only snapshot after a substantial cold
prefill (spec §4, "prompt-boundary snapshot"), decode with mlx-lm's samplers,
and put the finished caches back, also when the client went away.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from kvcellar.engine.detokenize import TextAssembler
from kvcellar.engine.engine import (
    PREFILL_STEP_TOKENS,
    LoadedModel,
    SamplingParams,
    prefill,
    release_cached_buffers,
)
from kvcellar.engine.sampling import SerialSampling, TokenLogprob, token_logprob
from kvcellar.store.lending import lend_caches
from kvcellar.store.prompt_cache import PromptCache
from kvcellar.store.scheme import KvScheme

SNAPSHOT_PREFILL_TOKENS_MIN = 512


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

    def snapshot_due(self, prompt_tokens: int, snapshot_prefill_tokens_min: int) -> bool:
        """Whether the prompt-boundary snapshot is owed: a cold prefill of at least the minimum."""
        return self.use_cache and prompt_tokens - self.cached_tokens >= snapshot_prefill_tokens_min


def take_reuse(prompt_cache: PromptCache | None, request: GenerationRequest) -> Reuse:
    """Take the longest usable prefix of the request's prompt from the tiers, when it uses them."""
    use_cache = request.use_prompt_cache and prompt_cache is not None and prompt_cache.enabled
    if not use_cache:
        return Reuse(use_cache=False, caches=None, cached_tokens=0, tier="none")
    taken = prompt_cache.take(list(request.prompt_ids), request.namespace)
    return Reuse(use_cache=True, caches=taken.caches, cached_tokens=taken.reused_tokens, tier=taken.tier)


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


def run_generation(loaded: LoadedModel, prompt_cache: PromptCache | None, request: GenerationRequest,
                   cancelled: threading.Event, *, scheme: KvScheme | None = None,
                   prefill_step_tokens: int = PREFILL_STEP_TOKENS,
                   snapshot_prefill_tokens_min: int = SNAPSHOT_PREFILL_TOKENS_MIN,
                   ) -> Iterator[TokenDelta | GenerationDone]:
    """Yield a `TokenDelta` per sampled token, then one `GenerationDone`."""
    params = request.params
    prompt = list(request.prompt_ids)
    reuse = take_reuse(prompt_cache, request)
    use_cache, cached_tokens = reuse.use_cache, reuse.cached_tokens
    cache = reuse.caches if reuse.caches is not None else make_prompt_cache(loaded.model)
    logits = prefill(loaded.model, prompt[cached_tokens:], cache, prefill_step_tokens)
    if scheme is not None:
        # The conversion chokepoint (spec §3): after the first prefill; idempotent on reused caches.
        cache = scheme.convert(cache)
    if reuse.snapshot_due(len(prompt), snapshot_prefill_tokens_min):
        mx.eval(logits)
        prompt_cache.put(prompt, lend_caches(cache), request.namespace)
    sampling = SerialSampling(params, loaded.tokenizer, prompt, request.make_logits_processors())
    assembler = TextAssembler(loaded.tokenizer, params.stop_token_ids, request.stop_strings)
    fed: list[int] = []
    produced = 0
    try:
        while produced < params.max_tokens and not cancelled.is_set():
            token, logprobs = sampling.sample(logits)
            token_id = int(token.item())
            produced += 1
            text = assembler.add(token_id)
            yield TokenDelta(token_id=token_id, text=text,
                             logprob=delta_logprob(loaded, params, token_id, logprobs))
            if assembler.finished_by_stop or produced >= params.max_tokens:
                break
            logits = loaded.model(token.reshape(1, 1), cache=cache)[:, -1, :]
            fed.append(token_id)
        tail = assembler.closing_text()
        if tail:
            yield TokenDelta(token_id=-1, text=tail)
    finally:
        if use_cache:
            # The caches hold the prompt and every token fed back; the last sampled one was never fed.
            prompt_cache.put(prompt + fed, cache, request.namespace)
        release_cached_buffers()
    yield GenerationDone(finish_reason=assembler.finish_reason,
                         prompt_tokens=len(prompt), completion_tokens=produced, cached_tokens=cached_tokens,
                         cache_tier=reuse.tier)
