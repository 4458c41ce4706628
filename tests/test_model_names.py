"""The model pool's names and unload plan (actors/model_names.py, actors/model_pool_plan.py): pure, property-tested."""

from __future__ import annotations

import fnmatch

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcellar.actors.model_names import ModelNames, ModelSpec, parse_model_flag, parse_models_file
from kvcellar.actors.model_pool_plan import Resident, fixed_shares_fit, plan_unloads, ram_shares
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
ram_gb = 1.5
draft_model = "ORG/tiny-draft"
num_draft_tokens = 5
"""

NAMES = st.text(alphabet="abcxyz-*?.", min_size=1, max_size=8)


def test_the_file_parses_with_its_defaults():
    pool = parse_models_file(POOL_TOML)
    assert pool.names == ("coder", "small")
    assert pool.default == "coder"
    assert pool.spec("small") == ModelSpec(
        name="small",
        source="ORG/tiny",
        aliases=("claude-haiku-*", "gpt-4o-mini"),
        pin=True,
        kv_quant="8",
        ram_gb=1.5,
        draft_source="ORG/tiny-draft",
        num_draft_tokens=5,
    )
    assert pool.spec("coder").ram_gb is None and pool.spec("coder").draft_source is None


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
        ("[models.a]\npath = '/a'\nram_gb = 0\n", "[models.a]: 'ram_gb' must be a number of GB above 0"),
        ("[models.a]\npath = '/a'\nram_gb = '2'\n", "'ram_gb' must be a number of GB above 0"),
        ("[models.a]\npath = '/a'\nram_gb = nan\n", "'ram_gb' must be a number of GB above 0"),
        ("[models.a]\npath = '/a'\nram_gb = true\n", "'ram_gb' must be a number of GB above 0"),
        ("[models.a]\npath = '/a'\ndraft_model = ''\n", "[models.a]: 'draft_model' must be a model directory"),
        ("[models.a]\npath = '/a'\nnum_draft_tokens = 3\n", "'num_draft_tokens' needs 'draft_model'"),
        ("[models.a]\npath = '/a'\ndraft_model = '/d'\nnum_draft_tokens = 0\n", "1 or more"),
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
    fixed=st.dictionaries(st.sampled_from("abcdefgh"), st.integers(min_value=1, max_value=10**11), max_size=4),
    total=st.integers(min_value=0, max_value=10**12),
)
def test_ram_shares_fix_the_ram_gb_models_and_share_the_rest_by_use(uses, fixed, total):
    shares = ram_shares(uses, total, fixed_bytes=fixed)
    assert set(shares) == set(uses)
    # A model with ram_gb has exactly that share, loaded with whichever others.
    assert all(shares[name] == fixed[name] for name in uses if name in fixed)
    by_use = {name: use for name, use in uses.items() if name not in fixed}
    rest = max(0, total - sum(fixed.values()))
    assert sum(shares[name] for name in by_use) <= rest
    if fixed_shares_fit(fixed, len(set(uses) | set(fixed)), total):
        assert sum(shares.values()) <= total
        if by_use:
            assert rest > 0
    floor = int(rest / len(by_use) * 0.1) if by_use else 0
    assert all(shares[name] >= floor for name in by_use)
    for a in by_use:
        for b in by_use:
            if by_use[a] > by_use[b]:
                assert shares[a] >= shares[b]


def test_fixed_shares_must_leave_room_for_the_models_sharing_by_use():
    assert fixed_shares_fit({"a": 10, "b": 5}, 2, 15)
    assert not fixed_shares_fit({"a": 10, "b": 6}, 2, 15)
    assert fixed_shares_fit({"a": 10}, 2, 11)
    assert not fixed_shares_fit({"a": 10}, 2, 10)


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
    said = capsys.readouterr().err
    assert "--draft-model serves one model" in said and "draft_model" in said and "[models.NAME]" in said


def test_ram_gb_beyond_the_prompt_cache_and_an_unknown_draft_are_refused_at_start(tmp_path, capsys):
    from kvcellar.cli import main
    from kvcellar.engine.demo_models import packaged_demo_coder_dir

    models = tmp_path / "models.toml"
    coder = packaged_demo_coder_dir()
    models.write_text(f'[models.a]\npath = "{coder}"\nram_gb = 1.5\n[models.b]\npath = "{coder}"\nram_gb = 1\n')
    assert main(["serve", "--models", str(models), "--prompt-cache", "2"]) == 2
    said = capsys.readouterr().err
    assert "a: 1.5, b: 1" in said and "--prompt-cache (2 GB)" in said and "raise --prompt-cache or lower ram_gb" in said
    missing = tmp_path / "no-such-draft"
    models.write_text(f'[models.a]\npath = "{coder}"\ndraft_model = "{missing}"\n')
    assert main(["serve", "--models", str(models)]) == 2
    said = capsys.readouterr().err
    assert f"model 'a': its draft_model '{missing}'" in said and "no such directory" in said
