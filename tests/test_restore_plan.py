"""The restore/recompute/split choice (store/restore_plan.py): the predicted fastest plan is chosen."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcellar.store.restore_plan import (
    PLAN_RECOMPUTE,
    PLAN_RESTORE,
    PLAN_SPLIT,
    POLICIES,
    RESTORE_KEEP_S,
    SPLIT_GAIN_MIN,
    CostModel,
    PrefillPoint,
    RestoreQuery,
    TierRate,
    observe_prefill,
    observe_restore,
    plan_restore,
    split_cost_s,
)

rates = st.builds(
    TierRate,
    fixed_s=st.floats(0.0, 0.05),
    bytes_per_s=st.floats(1e5, 1e11),
)


@st.composite
def cost_models(draw) -> CostModel:
    contexts = sorted(draw(st.sets(st.integers(64, 200_000), min_size=1, max_size=6)))
    costs = draw(st.lists(st.floats(1e-6, 1e-2), min_size=len(contexts), max_size=len(contexts)))
    points = tuple(
        PrefillPoint(bucket_tokens=c, context_tokens=float(c), seconds_per_token=s)
        for c, s in zip(contexts, costs, strict=True)
    )
    return CostModel(
        tiers={"ram": draw(rates), "ssd": draw(rates), "shared": draw(rates)},
        prefill=points,
        join_bytes_per_s=draw(st.floats(1e8, 1e11)),
    )


@st.composite
def queries(draw) -> RestoreQuery:
    cached = draw(st.integers(1, 64_000))
    return RestoreQuery(
        tier=draw(st.sampled_from(["ram", "ssd", "shared"])),
        prompt_tokens=cached + draw(st.integers(1, 4000)),
        cached_tokens=cached,
        entry_bytes=cached * draw(st.integers(1, 300_000)),
        fallback_tokens=draw(st.integers(0, cached)),
        split_refusal=draw(st.sampled_from(["", "RotatingKVCache is not plain full attention"])),
        policy=draw(st.sampled_from(POLICIES)),
    )


@settings(max_examples=300, deadline=None)
@given(model=cost_models(), query=queries())
def test_the_predicted_fastest_allowed_plan_is_chosen(model: CostModel, query: RestoreQuery) -> None:
    plan = plan_restore(model, query)
    allowed = set(plan.predicted_s)
    assert (PLAN_SPLIT in allowed) == (query.split_refusal == "")
    if query.policy == "auto" or query.policy not in allowed:
        single = min(plan.predicted_s[PLAN_RESTORE], plan.predicted_s[PLAN_RECOMPUTE])
        split_s = plan.predicted_s.get(PLAN_SPLIT, float("inf"))
        fastest = split_s if query.policy == "auto" and split_s <= SPLIT_GAIN_MIN * single else single
        if plan.predicted_s[PLAN_RESTORE] - fastest < RESTORE_KEEP_S:
            # Within the keep margin of the restore: the restore stays.
            assert plan.kind == PLAN_RESTORE
        elif query.policy == "auto" and split_s <= SPLIT_GAIN_MIN * single:
            assert plan.kind == PLAN_SPLIT
        else:
            assert plan.kind in (PLAN_RESTORE, PLAN_RECOMPUTE)
            assert plan.chosen_predicted_s == single
    else:
        assert plan.kind == query.policy and plan.reason == "forced"
    if plan.kind != PLAN_SPLIT:
        assert plan.split_at_tokens == query.cached_tokens


@settings(max_examples=200, deadline=None)
@given(model=cost_models(), query=queries().filter(lambda q: q.split_refusal == ""), probe=st.floats(0, 1))
def test_the_split_point_is_where_the_split_is_cheapest(model: CostModel, query: RestoreQuery, probe: float) -> None:
    """No other k gives a cheaper split: the prefill grows with k, the load shrinks, the best k is their crossing."""
    plan = plan_restore(model, attrs_evolve(query, policy=PLAN_SPLIT))
    k = plan.split_at_tokens
    assert 0 <= k <= query.cached_tokens
    other = round(probe * query.cached_tokens)
    assert split_cost_s(model, query, k) <= split_cost_s(model, query, other) * (1 + 1e-9)


def attrs_evolve(query: RestoreQuery, **changes) -> RestoreQuery:
    import attrs

    return attrs.evolve(query, **changes)


def _flat_model(prefill_tokens_per_s: float, ssd_bytes_per_s: float) -> CostModel:
    return CostModel(
        tiers={
            "ram": TierRate(fixed_s=0.0, bytes_per_s=1e10),
            "ssd": TierRate(fixed_s=0.001, bytes_per_s=ssd_bytes_per_s),
            "shared": TierRate(fixed_s=0.05, bytes_per_s=1e8),
        },
        prefill=(PrefillPoint(bucket_tokens=1024, context_tokens=1024.0, seconds_per_token=1 / prefill_tokens_per_s),),
        join_bytes_per_s=1e10,
    )


def test_a_slow_disk_recomputes_and_a_fast_one_restores() -> None:
    query = RestoreQuery(tier="ssd", prompt_tokens=8200, cached_tokens=8192, entry_bytes=8192 * 32 * 1024)
    assert plan_restore(_flat_model(2000, 1e6), query).kind == PLAN_RECOMPUTE
    assert plan_restore(_flat_model(2000, 5e9), query).kind == PLAN_RESTORE


def test_a_split_wins_where_both_single_paths_take_about_as_long() -> None:
    query = RestoreQuery(tier="ssd", prompt_tokens=8200, cached_tokens=8192, entry_bytes=8192 * 1000)
    plan = plan_restore(_flat_model(2000, 2e6), query)  # prefill 4.1 s, load 4.1 s
    assert plan.kind == PLAN_SPLIT
    assert 0.4 < plan.split_at_tokens / 8192 < 0.6
    assert plan.chosen_predicted_s < 0.6 * min(plan.predicted_s[PLAN_RESTORE], plan.predicted_s[PLAN_RECOMPUTE])


def test_an_unknown_policy_is_refused() -> None:
    query = RestoreQuery(tier="ssd", prompt_tokens=10, cached_tokens=8, entry_bytes=800, policy="fastest")
    with pytest.raises(ValueError, match="unknown restore policy"):
        plan_restore(_flat_model(2000, 1e9), query)


def test_observations_move_the_model_toward_what_was_measured() -> None:
    model = _flat_model(2000, 1e9)
    for _ in range(30):
        model = observe_restore(model, "ssd", 10**8, 1.001)
        model = observe_prefill(model, 0, 4096, 4096 / 500)
    assert model.tiers["ssd"].bytes_per_s == pytest.approx(1e8, rel=0.01)
    assert model.seconds_per_token_at(2048) == pytest.approx(1 / 500, rel=0.01)
