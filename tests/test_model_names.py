"""The model pool's names and unload plan (actors/model_names.py, actors/model_pool_plan.py): pure, property-tested."""

from __future__ import annotations

import fnmatch

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcellar.actors.model_names import ModelNames, ModelSpec, parse_model_flag, parse_models_file
from kvcellar.actors.model_pool_plan import Resident, plan_unloads, ram_shares
from kvcellar.actors.model_slot_core import (
    DrainBegun,
    DrainRefused,
    LoadBegun,
    Loaded,
    LoadFailed,
    ServingFailed,
    SlotCore,
    SlotState,
    Unloaded,
)
from kvcellar.errors import IllegalTransition, ModelsFileError, UnknownModel

POOL_TOML = """
default = "coder"

[models.coder]
path = "/models/demo-coder"
aliases = ["claude-haiku-*"]

[models.small]
path = "ORG/tiny"
aliases = ["claude-haiku-*", "gpt-4o-mini"]
pin = true
kv_quant = 8
"""

NAMES = st.text(alphabet="abcxyz-*?.", min_size=1, max_size=8)


def test_the_file_parses_with_its_defaults():
    pool = parse_models_file(POOL_TOML)
    assert pool.names == ("coder", "small")
    assert pool.default == "coder"
    assert pool.spec("small") == ModelSpec(
        name="small", source="ORG/tiny", aliases=("claude-haiku-*", "gpt-4o-mini"), pin=True, kv_quant="8"
    )


def test_exact_name_then_aliases_in_file_order_then_default():
    pool = parse_models_file(POOL_TOML)
    assert pool.resolve("small") == "small"
    # Both models alias claude-haiku-*: the first in file order wins.
    assert pool.resolve("claude-haiku-4-5") == "coder"
    assert pool.resolve("gpt-4o-mini") == "small"
    assert pool.resolve("anything-else") == "coder"
    assert pool.resolve(None) == "coder"


def test_an_unknown_name_without_default_names_the_served_models():
    pool = ModelNames(models=(ModelSpec(name="a", source="/a"), ModelSpec(name="b", source="/b", aliases=("gpt-*",))))
    assert pool.resolve("gpt-5") == "b"
    assert pool.resolve(None) == "a"
    with pytest.raises(UnknownModel) as caught:
        pool.resolve("claude-sonnet-4")
    assert caught.value.served == ("a", "b")
    assert "'a', 'b'" in str(caught.value) and caught.value.param == "model"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[models.a]\naliases = []\n", "needs 'path'"),
        ("[models.a]\npath = '/a'\npinned = true\n", "unknown key(s) pinned"),
        ("models = 3\n", "names no model"),
        ("default = 'b'\n[models.a]\npath = '/a'\n", "default model 'b'"),
        ("[models.a]\npath = '/a'\naliases = 'x'\n", "'aliases' must be a list"),
        ("[models.a\n", "not valid TOML"),
        ("[models.'bad name']\npath = '/a'\n", "not a usable model name"),
    ],
)
def test_a_bad_file_is_refused_naming_the_problem(text, says):
    with pytest.raises(ModelsFileError) as caught:
        parse_models_file(text, where="pool.toml")
    assert says in str(caught.value)


def test_the_model_flag():
    assert parse_model_flag("coder=/m/demo") == ModelSpec(name="coder", source="/m/demo")
    assert parse_model_flag("small=ORG/tiny") == ModelSpec(name="small", source="ORG/tiny")
    assert parse_model_flag("/m/demo-coder/") == ModelSpec(name="demo-coder", source="/m/demo-coder/")
    with pytest.raises(ModelsFileError):
        parse_model_flag("coder=")
    with pytest.raises(ModelsFileError):
        ModelNames(models=(ModelSpec(name="a", source="/a"), ModelSpec(name="a", source="/b")))


@given(
    models=st.lists(st.tuples(NAMES, st.lists(NAMES, max_size=3)), min_size=1, max_size=4, unique_by=lambda m: m[0]),
    default_index=st.none() | st.integers(min_value=0, max_value=3),
    requested=st.none() | NAMES,
)
def test_resolution_follows_the_one_rule(models, default_index, requested):
    specs = tuple(
        ModelSpec(name=name, source=f"/{i}", aliases=tuple(aliases)) for i, (name, aliases) in enumerate(models)
    )
    default = specs[default_index].name if default_index is not None and default_index < len(specs) else None
    pool = ModelNames(models=specs, default=default)
    expected: str | None
    if requested is None:
        expected = default or specs[0].name
    elif requested in pool.names:
        expected = requested
    else:
        by_alias = [s.name for s in specs if any(fnmatch.fnmatchcase(requested, a) for a in s.aliases)]
        expected = by_alias[0] if by_alias else default
    if expected is None:
        with pytest.raises(UnknownModel):
            pool.resolve(requested)
    else:
        assert pool.resolve(requested) == expected
    listed = [item["id"] for item in pool.listing()]
    assert listed[: len(specs)] == list(pool.names)
    assert sorted(listed[len(specs) :]) == sorted(a for s in specs for a in s.aliases)


RESIDENTS = st.dictionaries(
    st.sampled_from("abcdef"),
    st.builds(
        Resident,
        weights_bytes=st.integers(min_value=1, max_value=100),
        last_used_s=st.floats(min_value=0, max_value=100),
        pinned=st.booleans(),
        busy=st.booleans(),
    ),
    max_size=5,
)


@given(
    resident=RESIDENTS,
    wanted=st.sampled_from("abcdefg"),
    wanted_bytes=st.integers(min_value=1, max_value=100),
    budget=st.integers(min_value=0, max_value=300),
)
def test_the_plan_unloads_lru_unpinned_idle_models_only_as_needed(resident, wanted, wanted_bytes, budget):
    plan = plan_unloads(resident, wanted, wanted_bytes, budget)
    assert len(set(plan.unload)) == len(plan.unload)
    for name in plan.unload:
        assert not resident[name].pinned and not resident[name].busy and name != wanted
    if wanted in resident or budget <= 0:
        assert plan.unload == () and plan.fits
        return
    total = sum(r.weights_bytes for r in resident.values()) + wanted_bytes
    if not plan.fits:
        assert plan.unload == ()
        freeable = sum(r.weights_bytes for r in resident.values() if not r.pinned and not r.busy)
        assert total - freeable > budget
        return
    assert plan.bytes_after == total - sum(resident[n].weights_bytes for n in plan.unload) <= budget
    if plan.unload:
        # Least recently used first, and nothing more than needed: without the last one it would not fit.
        times = [resident[n].last_used_s for n in plan.unload]
        assert times == sorted(times)
        assert plan.bytes_after + resident[plan.unload[-1]].weights_bytes > budget


@given(
    uses=st.dictionaries(st.sampled_from("abcdef"), st.integers(min_value=0, max_value=1000), max_size=6),
    total=st.integers(min_value=0, max_value=10**12),
)
def test_ram_shares_follow_use_and_never_exceed_the_total(uses, total):
    shares = ram_shares(uses, total)
    assert set(shares) == set(uses)
    assert sum(shares.values()) <= total
    floor = int(total / len(uses) * 0.1) if uses else 0
    assert all(share >= floor for share in shares.values())
    for a in uses:
        for b in uses:
            if uses[a] > uses[b]:
                assert shares[a] >= shares[b]


SLOT_MESSAGES = st.sampled_from(
    [
        LoadBegun(),
        Loaded(load_s=1.0),
        LoadFailed(error="boom"),
        DrainBegun(),
        DrainRefused(reason="pending"),
        Unloaded(),
        ServingFailed(error="gone"),
    ]
)
# The lifecycle the pool's shell may drive: (state, message) -> next state; nothing else is taken.
SLOT_RULES = {
    (SlotState.UNLOADED, LoadBegun): SlotState.LOADING,
    (SlotState.FAILED, LoadBegun): SlotState.LOADING,
    (SlotState.LOADING, Loaded): SlotState.LOADED,
    (SlotState.LOADING, LoadFailed): SlotState.FAILED,
    (SlotState.LOADED, DrainBegun): SlotState.DRAINING,
    (SlotState.DRAINING, DrainRefused): SlotState.LOADED,
    (SlotState.DRAINING, Unloaded): SlotState.UNLOADED,
    (SlotState.LOADING, ServingFailed): SlotState.FAILED,
    (SlotState.LOADED, ServingFailed): SlotState.FAILED,
    (SlotState.DRAINING, ServingFailed): SlotState.FAILED,
}


@given(messages=st.lists(SLOT_MESSAGES, max_size=30))
def test_a_model_slot_follows_its_lifecycle_and_a_refused_message_changes_nothing(messages):
    core = SlotCore()
    for now, msg in enumerate(messages):
        before = attrs.asdict(core)
        expected = SLOT_RULES.get((core.state, type(msg)))
        if expected is None:
            with pytest.raises(IllegalTransition):
                core.handle(msg, float(now))
            assert attrs.asdict(core) == before
            continue
        assert core.handle(msg, float(now)) == []
        assert core.state is expected
    # Every unload followed a load, and a drain's refusal never counts as one.
    assert core.unloads <= core.loads


def test_a_draft_model_with_a_pool_is_a_usage_error_naming_the_way_out(tmp_path, capsys):
    from kvcellar.cli import main

    status = main(["serve", "--model", f"a={tmp_path}", "--model", f"b={tmp_path}", "--draft-model", str(tmp_path)])
    assert status == 2
    assert "--draft-model serves one model" in capsys.readouterr().err
