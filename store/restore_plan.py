"""Restore, recompute or both: the per-request choice and the cost model it predicts with (issue 44).

A sans-IO core: no trio, no MLX, no file. `CostModel` holds what was measured
on this machine for the loaded model: each tier's restore cost (a fixed cost
plus bytes at a bandwidth) and the prefill's cost per token as a function of
the context length (attention grows with it, so a token at position 30k costs
more than one at 1k). `plan_restore` predicts the time to first token of the
three ways to serve a prompt whose first `cached_tokens` a slow tier holds:

- recompute: prefill `[fallback_tokens, prompt_tokens)` (what RAM lent stays);
- restore: load the entry, then prefill `[cached_tokens, prompt_tokens)`;
- split (Cake, Jin et al., ICML 2025): prefill `[0, k)` on the engine thread
  while a loader reads rows `[k, cached_tokens)`, join them, then prefill the
  rest; `k` is where both finish together, so the pair costs
  `max(prefill(0, k), load(k..n)) + join`.

and takes the fastest allowed one (ties: restore, recompute, split, in that
order), except that a split must beat the better single path by
`SPLIT_GAIN_MIN` (it runs a second thread, copies every row once more to
join, and cannot check tensor checksums): a split that saves a few tokens'
prefill is not worth that. A forced policy is honoured where it applies; a forced split the
cache type refuses falls back to the better of the other two.

The model learns online: `observe_restore` / `observe_prefill` fold a
request's measured times in (EWMA), so the predictions follow the machine.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

import attrs

TIERS = ("ram", "ssd", "shared")
PLAN_RESTORE = "restore"
PLAN_RECOMPUTE = "recompute"
PLAN_SPLIT = "split"
# Tie order: the cheaper-to-run plan first (restore has no join, recompute no loader thread).
PLANS = (PLAN_RESTORE, PLAN_RECOMPUTE, PLAN_SPLIT)
POLICIES = ("auto", *PLANS)
# Weight of a new observation in the exponentially weighted averages.
EWMA_WEIGHT = 0.3
# A split is chosen only when predicted at most this fraction of the better single path.
SPLIT_GAIN_MIN = 0.9
# Auto keeps the restore unless another plan is predicted to save at least this much: below it the
# choice cannot be told from noise, and a restore keeps what a hit means (the cached tokens are
# reported, the entry's LRU is touched). A short prefix is so always restored.
RESTORE_KEEP_S = 0.02
# Prefill buckets are powers of two of the context position, from this one up.
BUCKET_TOKENS_MIN = 256


@attrs.frozen(kw_only=True)
class TierRate:
    """One tier's restore: `fixed_s` plus the entry's bytes at `bytes_per_s`."""

    fixed_s: float
    bytes_per_s: float
    samples: int = 0

    def seconds(self, size_bytes: int) -> float:
        return self.fixed_s + size_bytes / self.bytes_per_s


@attrs.frozen(kw_only=True)
class PrefillPoint:
    """The prefill's cost per token around `context_tokens` (the mean position
    of the chunks measured in the power-of-two bucket `bucket_tokens`)."""

    bucket_tokens: int
    context_tokens: float
    seconds_per_token: float
    samples: int = 0

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.seconds_per_token


@attrs.frozen(kw_only=True)
class CostModel:
    """What restores and prefills cost here. `tiers` maps a tier name to its
    rate; `prefill` holds the per-token cost curve sorted by context length
    (at least one point); `join_bytes_per_s` is the copy rate of a split's join."""

    tiers: Mapping[str, TierRate]
    prefill: tuple[PrefillPoint, ...]
    join_bytes_per_s: float

    def restore_s(self, tier: str, size_bytes: int) -> float:
        return self.tiers[tier].seconds(size_bytes)

    def seconds_per_token_at(self, position: float) -> float:
        """The cost of the token at `position`: linear between the measured
        points, extended along the last two (attention's linear growth) past
        the ends, never below the cheapest point's half."""
        points = self.prefill
        if len(points) == 1:
            return points[0].seconds_per_token
        if position <= points[0].context_tokens:
            left, right = points[0], points[1]
        elif position >= points[-1].context_tokens:
            left, right = points[-2], points[-1]
        else:
            index = next(i for i, p in enumerate(points) if p.context_tokens >= position)
            left, right = points[index - 1], points[index]
        span = right.context_tokens - left.context_tokens
        slope = (right.seconds_per_token - left.seconds_per_token) / span if span > 0 else 0.0
        floor = 0.5 * min(p.seconds_per_token for p in points)
        return max(floor, left.seconds_per_token + slope * (position - left.context_tokens))

    def prefill_s(self, start_tokens: int, end_tokens: int) -> float:
        """Seconds to prefill positions `[start_tokens, end_tokens)` on top of a
        cache holding the first `start_tokens`: the trapezoid rule over the
        piecewise-linear curve, exact between its knots."""
        if end_tokens <= start_tokens:
            return 0.0
        knots: list[float] = [float(start_tokens), float(end_tokens)]
        knots[1:1] = [p.context_tokens for p in self.prefill if start_tokens < p.context_tokens < end_tokens]
        return sum(
            (b - a) * 0.5 * (self.seconds_per_token_at(a) + self.seconds_per_token_at(b))
            for a, b in itertools.pairwise(knots)
        )


@attrs.frozen(kw_only=True)
class RestoreQuery:
    """One request's situation. `entry_bytes` is what restoring the
    `cached_tokens` prefix reads; `fallback_tokens` what a recompute keeps
    (a shorter RAM prefix, else 0); `split_refusal` why the caches cannot be
    split ("" when they can); `policy` one of `POLICIES`."""

    tier: str
    prompt_tokens: int
    cached_tokens: int
    entry_bytes: int
    fallback_tokens: int = 0
    split_refusal: str = ""
    policy: str = "auto"


@attrs.frozen(kw_only=True)
class RestorePlan:
    """The chosen plan, the split point (`cached_tokens` unless split: the
    prefix the loader skips is `[0, split_at_tokens)`), and every plan's
    predicted time to first token (plans not allowed are absent)."""

    kind: str
    split_at_tokens: int
    predicted_s: Mapping[str, float]
    reason: str

    @property
    def chosen_predicted_s(self) -> float:
        return self.predicted_s[self.kind]


def split_cost_s(model: CostModel, query: RestoreQuery, split_at_tokens: int) -> float:
    """Seconds until a split at `split_at_tokens` holds the cached prefix: the
    slower of the prefix's prefill and the suffix's load, plus the join."""
    n = query.cached_tokens
    suffix_bytes = query.entry_bytes * (n - split_at_tokens) // max(n, 1)
    load_s = model.restore_s(query.tier, suffix_bytes) if split_at_tokens < n else 0.0
    join_s = query.entry_bytes / model.join_bytes_per_s
    return max(model.prefill_s(0, split_at_tokens), load_s) + join_s


def split_point(model: CostModel, query: RestoreQuery) -> int:
    """The k in `[0, cached_tokens]` where the prefix's prefill and the
    suffix's load finish together (the prefill grows with k, the load
    shrinks), as the better of the two integers around the crossing."""
    n = query.cached_tokens
    suffix_bytes = query.entry_bytes

    def prefill_behind(k: int) -> bool:
        load_s = model.restore_s(query.tier, suffix_bytes * (n - k) // max(n, 1)) if k < n else 0.0
        return model.prefill_s(0, k) < load_s

    low, high = 0, n  # invariant: prefill_behind(low) or low == 0; not prefill_behind(high)
    while high - low > 1:
        middle = (low + high) // 2
        if prefill_behind(middle):
            low = middle
        else:
            high = middle
    return min((low, high), key=lambda k: (split_cost_s(model, query, k), k))


def predictions(model: CostModel, query: RestoreQuery) -> tuple[dict[str, float], int]:
    """Every allowed plan's predicted time to first token, and the split point."""
    n, length = query.cached_tokens, query.prompt_tokens
    tail_s = model.prefill_s(n, length)
    predicted = {
        PLAN_RESTORE: model.restore_s(query.tier, query.entry_bytes) + tail_s,
        PLAN_RECOMPUTE: model.prefill_s(min(query.fallback_tokens, n), length),
    }
    split_at = n
    if not query.split_refusal and n > 0:
        split_at = split_point(model, query)
        predicted[PLAN_SPLIT] = split_cost_s(model, query, split_at) + tail_s
    return predicted, split_at


def _fastest(predicted: Mapping[str, float]) -> str:
    single = min((PLAN_RESTORE, PLAN_RECOMPUTE), key=lambda plan: (predicted[plan], PLANS.index(plan)))
    split_s = predicted.get(PLAN_SPLIT)
    best = PLAN_SPLIT if split_s is not None and split_s <= SPLIT_GAIN_MIN * predicted[single] else single
    return best if predicted[PLAN_RESTORE] - predicted[best] >= RESTORE_KEEP_S else PLAN_RESTORE


def plan_restore(model: CostModel, query: RestoreQuery) -> RestorePlan:
    """Choose how to serve `query`: the forced policy where it applies, else the fastest predicted plan."""
    if query.policy not in POLICIES:
        raise ValueError(f"unknown restore policy {query.policy!r}")
    predicted, split_at = predictions(model, query)
    if query.policy != "auto" and query.policy in predicted:
        kind, reason = query.policy, "forced"
    else:
        kind = _fastest(predicted)
        reason = "fastest" if query.policy == "auto" else f"forced split refused: {query.split_refusal}"
    return RestorePlan(
        kind=kind,
        split_at_tokens=split_at if kind == PLAN_SPLIT else query.cached_tokens,
        predicted_s=predicted,
        reason=reason,
    )


# -- online refresh -------------------------------------------------------------


def bucket_of(position: float) -> int:
    """The power-of-two bucket a context position falls in (at least `BUCKET_TOKENS_MIN`)."""
    return max(BUCKET_TOKENS_MIN, 1 << max(0, math.ceil(math.log2(max(position, 1.0)))))


def _ewma(old: float, new: float, samples: int) -> float:
    return new if samples == 0 else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * new


def observe_prefill(model: CostModel, start_tokens: int, end_tokens: int, seconds: float) -> CostModel:
    """The model with a prefill of `[start_tokens, end_tokens)` that took `seconds` folded in."""
    count = end_tokens - start_tokens
    if count <= 0 or seconds <= 0:
        return model
    middle = (start_tokens + end_tokens) / 2
    bucket = bucket_of(middle)
    points = {p.bucket_tokens: p for p in model.prefill}
    old = points.get(bucket)
    samples = old.samples if old is not None else 0
    points[bucket] = PrefillPoint(
        bucket_tokens=bucket,
        context_tokens=_ewma(old.context_tokens if old else middle, middle, samples),
        seconds_per_token=_ewma(old.seconds_per_token if old else 0.0, seconds / count, samples),
        samples=samples + 1,
    )
    ordered = tuple(sorted(points.values(), key=lambda p: p.context_tokens))
    return attrs.evolve(model, prefill=ordered)


def observe_restore(model: CostModel, tier: str, size_bytes: int, seconds: float) -> CostModel:
    """The model with a restore of `size_bytes` from `tier` that took `seconds`
    folded in: the fixed cost stays what calibration measured, the bandwidth
    follows what is left of the time."""
    old = model.tiers.get(tier)
    if old is None or size_bytes <= 0 or seconds <= 0:
        return model
    moving_s = max(seconds - old.fixed_s, seconds * 0.05)
    bandwidth = _ewma(old.bytes_per_s, size_bytes / moving_s, old.samples)
    tiers = dict(model.tiers)
    tiers[tier] = attrs.evolve(old, bytes_per_s=bandwidth, samples=old.samples + 1)
    return attrs.evolve(model, tiers=tiers)
