"""The recent-requests ring behind `/stats/requests` and the dashboard, and
the running totals behind `/stats` `requests` (and so `/metrics`).

`RecentRequests` is a plain class with no clock and no I/O: `System.generate`
(the one path every API's request takes, on the Trio thread) measures each
request and hands it one `RequestRecord` when the request ends, however it
ends. The ring is bounded (`capacity`, oldest dropped first); the totals
count every request since start. Its only owner is the Trio thread: the HTTP
routes read it there too, so it needs no lock.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

import attrs

from kvcellar.engine.generation import NO_NOTES, GenerationDone, RequestNotes, TokenDelta
from kvcellar.errors import UsageError

RECENT_REQUESTS_MAX_DEFAULT = 256

# Upper bounds (seconds) of the TTFT histogram's buckets; +Inf is implied.
TTFT_BUCKETS_S: tuple[float, ...] = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# How a request ended when the engine never reported its end.
FINISH_CANCELLED = "cancelled"
FINISH_ERROR = "error"


@attrs.frozen(kw_only=True)
class RequestRecord:
    """One finished request. `cache_tier` is where its reused prefix came from
    ("ram", "ssd", or "none" for a cold prefill); `ttft_s` runs from the
    request reaching the system to its first token (queueing included) and is
    None when no token came; `decode_tokens_per_s` is the completion's tokens
    after the first over the time after the first (None under two tokens).
    `finish_reason` is the engine's ("stop", "length"), or "cancelled" (the
    client went away) or "error"."""

    finished_at_s: float  # wall clock, Unix seconds
    prompt_tokens: int
    cached_tokens: int
    cache_tier: str
    completion_tokens: int
    ttft_s: float | None
    decode_tokens_per_s: float | None
    duration_s: float
    finish_reason: str
    # The restore policy's plan when the prefix was on a slow tier ("" when none; issue 44).
    restore_plan: str = ""
    # What the HTTP side changed of the request on its way in (clamps, tools left out, rewrites).
    notes: RequestNotes = NO_NOTES
    # The cache diagnostic: where the prompt left the longest prefix a tier shared with it.
    cache_divergence: CacheDivergenceRecord | None = None


@attrs.frozen(kw_only=True)
class CacheDivergenceRecord:
    """Where a request's prompt left the longest prefix any tier entry shared
    with it (`at_tokens`, in `tier`), and token ids around that point: the
    shared tokens just before it, the prompt's and the cached entry's just
    after. `/stats/requests` shows them decoded to admins only."""

    at_tokens: int
    tier: str
    shared_before_ids: tuple[int, ...]
    prompt_next_ids: tuple[int, ...]
    cached_next_ids: tuple[int, ...]


@attrs.define
class _Totals:
    finished: int = 0
    prompt_tokens: int = 0
    cached_tokens_ram: int = 0
    cached_tokens_ssd: int = 0
    completion_tokens: int = 0
    cancelled: int = 0
    errors: int = 0
    ttft_count: int = 0
    ttft_seconds_sum: float = 0.0
    # Per bucket of TTFT_BUCKETS_S plus one for +Inf; not cumulative.
    ttft_bucket_counts: list[int] = attrs.field(factory=lambda: [0] * (len(TTFT_BUCKETS_S) + 1))


class RecentRequests:
    """The last `capacity` requests, oldest first, each with a sequence number,
    and totals over every request since start."""

    def __init__(self, capacity: int = RECENT_REQUESTS_MAX_DEFAULT) -> None:
        if capacity < 1:
            raise UsageError(f"the recent-requests ring needs room for one request, got {capacity}")
        self.capacity = capacity
        self._ring: deque[tuple[int, RequestRecord]] = deque(maxlen=capacity)
        self._seq = 0
        self._totals = _Totals()

    def record(self, record: RequestRecord) -> int:
        """Keep `record` (dropping the oldest when full); returns its sequence number."""
        self._seq += 1
        self._ring.append((self._seq, record))
        totals = self._totals
        totals.finished += 1
        totals.prompt_tokens += record.prompt_tokens
        totals.completion_tokens += record.completion_tokens
        if record.cache_tier == "ram":
            totals.cached_tokens_ram += record.cached_tokens
        elif record.cache_tier == "ssd":
            totals.cached_tokens_ssd += record.cached_tokens
        totals.cancelled += record.finish_reason == FINISH_CANCELLED
        totals.errors += record.finish_reason == FINISH_ERROR
        if record.ttft_s is not None:
            totals.ttft_count += 1
            totals.ttft_seconds_sum += record.ttft_s
            totals.ttft_bucket_counts[bisect.bisect_left(TTFT_BUCKETS_S, record.ttft_s)] += 1
        return self._seq

    def snapshot(self, *, after_seq: int = 0) -> dict[str, Any]:
        """`/stats/requests`: the ring's records newer than `after_seq`, oldest first."""
        return {
            "capacity": self.capacity,
            "last_seq": self._seq,
            "requests": [{"seq": seq, **attrs.asdict(record)} for seq, record in self._ring if seq > after_seq],
        }

    def stats(self) -> dict[str, Any]:
        """`/stats` `requests`: totals since start; `ttft_seconds_buckets` maps
        each bucket's upper bound (text, "+Inf" last) to the cumulative count."""
        totals = self._totals
        cumulative, buckets = 0, {}
        for bound, count in zip((*TTFT_BUCKETS_S, float("inf")), totals.ttft_bucket_counts, strict=True):
            cumulative += count
            buckets["+Inf" if bound == float("inf") else repr(bound)] = cumulative
        return {
            "finished": totals.finished,
            "cancelled": totals.cancelled,
            "errors": totals.errors,
            "prompt_tokens": totals.prompt_tokens,
            "cached_tokens_ram": totals.cached_tokens_ram,
            "cached_tokens_ssd": totals.cached_tokens_ssd,
            "completion_tokens": totals.completion_tokens,
            "ttft_count": totals.ttft_count,
            "ttft_seconds_sum": totals.ttft_seconds_sum,
            "ttft_seconds_buckets": buckets,
        }


async def recorded(
    items: AsyncGenerator[TokenDelta | GenerationDone, None],
    ring: RecentRequests,
    *,
    prompt_tokens: int,
    clock_s: Callable[[], float],
    wall_clock_s: Callable[[], float],
    notes: RequestNotes = NO_NOTES,
    prompt_ids: tuple[int, ...] = (),
) -> AsyncGenerator[TokenDelta | GenerationDone, None]:
    """Pass `items` through, timing the first token and the end, and record
    the request in `ring` when it ends: done, cancelled (the consumer closed
    the stream or was cancelled) or failed. `clock_s` measures durations,
    `wall_clock_s` stamps the end."""
    started_s = clock_s()
    first_token_s: float | None = None
    done: GenerationDone | None = None
    finish_reason = FINISH_CANCELLED
    try:
        async with aclosing(items) as stream:
            async for item in stream:
                if isinstance(item, GenerationDone):
                    done = item
                elif first_token_s is None:
                    first_token_s = clock_s()
                yield item
    except Exception:
        finish_reason = FINISH_ERROR
        raise
    finally:
        ended_s = clock_s()
        record = _request_record(done, finish_reason, prompt_tokens, started_s, first_token_s, ended_s, wall_clock_s())
        divergence = _divergence_record(done, prompt_ids)
        ring.record(attrs.evolve(record, notes=notes, cache_divergence=divergence))


EXCERPT_TOKENS = 32


def _divergence_record(done: GenerationDone | None, prompt_ids: tuple[int, ...]) -> CacheDivergenceRecord | None:
    divergence = done.divergence if done is not None else None
    if divergence is None:
        return None
    at = divergence.matched_tokens
    return CacheDivergenceRecord(
        at_tokens=at,
        tier=divergence.tier,
        shared_before_ids=tuple(prompt_ids[max(0, at - EXCERPT_TOKENS // 2) : at]),
        prompt_next_ids=tuple(prompt_ids[at : at + EXCERPT_TOKENS]),
        cached_next_ids=divergence.cached_next_ids[:EXCERPT_TOKENS],
    )


def _request_record(
    done: GenerationDone | None,
    finish_reason: str,
    prompt_tokens: int,
    started_s: float,
    first_token_s: float | None,
    ended_s: float,
    wall_s: float,
) -> RequestRecord:
    completion_tokens = done.completion_tokens if done is not None else 0
    decode_tokens_per_s = None
    if first_token_s is not None and completion_tokens > 1 and ended_s > first_token_s:
        decode_tokens_per_s = (completion_tokens - 1) / (ended_s - first_token_s)
    return RequestRecord(
        finished_at_s=wall_s,
        prompt_tokens=done.prompt_tokens if done is not None else prompt_tokens,
        cached_tokens=done.cached_tokens if done is not None else 0,
        cache_tier=done.cache_tier if done is not None else "none",
        completion_tokens=completion_tokens,
        ttft_s=None if first_token_s is None else first_token_s - started_s,
        decode_tokens_per_s=decode_tokens_per_s,
        duration_s=ended_s - started_s,
        finish_reason=done.finish_reason if done is not None else finish_reason,
        restore_plan=done.restore_plan if done is not None else "",
    )


__all__ = [
    "FINISH_CANCELLED",
    "FINISH_ERROR",
    "RECENT_REQUESTS_MAX_DEFAULT",
    "TTFT_BUCKETS_S",
    "CacheDivergenceRecord",
    "RecentRequests",
    "RequestRecord",
    "recorded",
]
