"""What both lanes sample with: one request's logits processors, its sampler,
and the log-probabilities it reports.

The order is mlx-lm's, on both lanes: the model's logits go through the
request's processors (`logit_bias`, then the repetition, presence and
frequency penalties from `mlx_lm.sample_utils.make_logits_processors`, then
the structured-output mask), are normalised to log-probabilities, and the
sampler (temperature, top-p, min-p, top-k; seeded or not) draws from those.
Each processor sees the same token context on either lane: the prompt and
every token sampled so far, the last one included (the batch lane's
`BatchGenerator` keeps it in a `TokenBuffer` per row; the serial lane's
`SerialSampling` keeps one the same way), so a seeded request samples the
same tokens on either lane with these fields too.

Reported log-probabilities are those the sampler drew from: after the
processors, before temperature and the top-k/top-p/min-p filters (what
mlx-lm's own generators yield). Everything here runs on the engine thread.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import attrs
import mlx.core as mx
from mlx_lm.models.cache import TokenBuffer
from mlx_lm.sample_utils import make_logits_processors

from kvcellar.engine.engine import SamplingParams, make_params_sampler, resume_sampler, sampler_key_words
from kvcellar.engine.scalars import item_float, item_int
from kvcellar.engine.structured import GrammarMask, token_table

# Penalties look back this many tokens of the context (prompt and completion),
# mlx-lm's default window for all three.
PENALTY_CONTEXT_TOKENS = 20
# JSON has no -inf; OpenAI reports a token the model rules out as -9999.0.
LOGPROB_FLOOR = -9999.0


@attrs.frozen(kw_only=True)
class TopLogprob:
    token: str
    token_bytes: tuple[int, ...]
    logprob: float


@attrs.frozen(kw_only=True)
class TokenLogprob:
    """One sampled token's log-probability and the `top_logprobs` most likely alternatives."""

    token: str
    token_bytes: tuple[int, ...]
    logprob: float
    top: tuple[TopLogprob, ...]


def build_processors(params: SamplingParams, tokenizer: Any) -> list[Any]:
    """The request's logits processors, new for each generation (the grammar
    mask keeps state), in the order they apply."""
    processors = make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        repetition_penalty=params.repetition_penalty,
        repetition_context_size=PENALTY_CONTEXT_TOKENS,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=PENALTY_CONTEXT_TOKENS,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=PENALTY_CONTEXT_TOKENS,
    )
    if params.grammar is not None:
        processors.append(GrammarMask(tokenizer, params.grammar))
    return processors


def _finite(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def token_logprob(tokenizer: Any, logprobs: mx.array, token_id: int, top_n: int) -> TokenLogprob:
    """`token_id`'s entry in one row of log-probabilities, with the `top_n` best."""
    table = token_table(tokenizer)
    row = logprobs.reshape(-1)
    top: list[TopLogprob] = []
    if top_n > 0:
        best = mx.argsort(-row)[:top_n]
        values = row[best]
        mx.eval(best, values)
        for candidate, value in zip(cast(list[int], best.tolist()), cast(list[float], values.tolist()), strict=True):
            raw = table.decode_bytes([candidate])
            top.append(TopLogprob(token=raw.decode("utf-8", "replace"), token_bytes=tuple(raw), logprob=_finite(value)))
    raw = table.decode_bytes([token_id])
    return TokenLogprob(
        token=raw.decode("utf-8", "replace"),
        token_bytes=tuple(raw),
        logprob=_finite(item_float(row[token_id])),
        top=tuple(top),
    )


class SerialSampling:
    """The serial lane's sampling state for one generation: its sampler, its
    processors and their token context, kept as `BatchGenerator` keeps a
    row's (a `TokenBuffer` holding the prompt, fed each sampled token)."""

    def __init__(
        self,
        params: SamplingParams,
        tokenizer: Any,
        prompt: Sequence[int],
        extra_processors: Sequence[Any] = (),
        *,
        rng_key: tuple[int, ...] = (),
    ) -> None:
        self.sampler = make_params_sampler(params)
        # A resumed generation (spec §5.7) passes its prompt, its emitted tokens
        # and its pending token as `prompt`, and the seeded chain's key it had.
        resume_sampler(self.sampler, rng_key)
        # The request's own processors (`GenerationRequest.logits_processors`) apply last, as on the batch lane.
        self.processors = build_processors(params, tokenizer) + list(extra_processors)
        self._context = TokenBuffer(list(prompt[:-1])) if self.processors else None
        self._next_input = prompt[-1]

    def sample(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """The next token and the log-probabilities it was drawn from."""
        if self._context is not None:
            context = self._context.update_and_fetch(mx.array([self._next_input]))
            for processor in self.processors:
                logits = processor(context, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = self.sampler(logprobs)
        mx.eval(token, logprobs)
        self._next_input = item_int(token)
        return token, logprobs

    @property
    def rng_key(self) -> tuple[int, ...]:
        """The seeded chain's key after the draws so far (() when not seeded)."""
        return sampler_key_words(self.sampler)
