"""A logits processor that forces a reply's first tokens.

`ForcedTokens(token_ids)` makes the i-th generated token `token_ids[i]` for
the first `len(token_ids)` steps (every other logit becomes -inf, so greedy
and sampled rows alike pick it) and leaves the logits alone after that. The
server uses it for a `tool_choice` of `required` or a named function (the
reply starts with the tool-call marker); a test seam uses it to script a whole
reply through the real engine, sampler, detokenizer and parsers.

It has the mlx-lm `LogitsProcessor` signature, `(tokens, logits) -> logits`,
and runs on either lane: mlx-lm's `BatchGenerator` calls each row's
processors once per generated token, and so does the serial lane. It counts
its calls, so each generation needs its own instance (`GenerationRequest.
logits_processors` holds factories for that reason). Engine thread only.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx


class ForcedTokens:
    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = tuple(int(token_id) for token_id in token_ids)
        self._step = 0

    @property
    def done(self) -> bool:
        return self._step >= len(self.token_ids)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.done:
            return logits
        forced = self.token_ids[self._step]
        self._step += 1
        vocabulary = mx.arange(logits.shape[-1])
        return mx.where(vocabulary == forced, logits, mx.array(-mx.inf, dtype=logits.dtype))
