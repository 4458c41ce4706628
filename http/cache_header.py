"""The `x-kvcellar-cache` reply header: what the cache tiers served a request.

Every reply of the four generation APIs carries it (docs/agents.md):

    x-kvcellar-cache: tier=<ram|ssd|checkpoint|none>; reused=<tokens>; prompt=<tokens>

`tier` is where the reused prefix came from (`ssd` also for a prefix the
shared tier brought in: it lands in the SSD tier first; `none`: a cold
prefill), `reused` the prompt tokens it served, `prompt` the prompt's
tokens. A stream's headers go out before its prefill, when the tiers have
not been asked yet: there it reads `tier=pending; reused=pending;
prompt=<tokens>`, and the figures come in the stream's final usage (and in
`/stats/requests`).
"""

from __future__ import annotations

from kvcellar.engine.generation import GenerationDone

CACHE_HEADER = "x-kvcellar-cache"


def cache_header(done: GenerationDone | None, prompt_tokens: int) -> dict[str, str]:
    """The header of a reply whose generation ended with `done` (None: it produced no end)."""
    if done is None:
        return {CACHE_HEADER: f"tier=none; reused=0; prompt={prompt_tokens}"}
    return {CACHE_HEADER: f"tier={done.cache_tier}; reused={done.cached_tokens}; prompt={done.prompt_tokens}"}


def stream_cache_header(prompt_tokens: int) -> dict[str, str]:
    """The header of a stream, sent before the tiers were asked."""
    return {CACHE_HEADER: f"tier=pending; reused=pending; prompt={prompt_tokens}"}
