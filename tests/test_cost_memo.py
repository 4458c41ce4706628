"""The restore policy's cost memo (store/cost_memo.py) holds the costs of several models and devices (issue 41's
pools): round trips and the bound, the one-key file of version 1, and files it cannot read."""

from __future__ import annotations

import collections
import logging
import tempfile
from pathlib import Path

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcellar.serialization import converter, to_cbor
from kvcellar.store.cost_memo import (
    COST_MEMO_ENTRIES_MAX,
    COST_MEMO_FILE_NAME,
    COST_MEMO_FORMAT,
    CostKey,
    load_costs,
    save_costs,
)
from kvcellar.store.restore_plan import CostModel, PrefillPoint, TierRate

# More keys than the file keeps, so that the bound is crossed.
KEYS_DRAWN = COST_MEMO_ENTRIES_MAX + 8


def _key(index: int) -> CostKey:
    return CostKey(
        config_sha256=f"{index // 2:064x}",
        weights_sha256=f"{index // 2:064x}",
        device="gpu" if index % 2 else "cpu",
        device_architecture="Apple M3" if index % 2 else "Apple M3 (cpu)",
    )


def _model(seconds_per_token: float) -> CostModel:
    return CostModel(
        tiers={"ssd": TierRate(fixed_s=0.001, bytes_per_s=2e9, samples=3)},
        prefill=(PrefillPoint(bucket_tokens=1024, context_tokens=900.0, seconds_per_token=seconds_per_token),),
        join_bytes_per_s=1e10,
    )


saves = st.lists(
    st.tuples(st.integers(0, KEYS_DRAWN - 1), st.floats(1e-6, 1.0, allow_nan=False)), min_size=1, max_size=40
)


@settings(max_examples=40, deadline=None)
@given(saves)
def test_the_memo_keeps_the_most_recently_saved_keys(saved: list[tuple[int, float]]) -> None:
    expected: collections.OrderedDict[int, CostModel] = collections.OrderedDict()
    with tempfile.TemporaryDirectory() as directory:
        for index, seconds_per_token in saved:
            assert save_costs(Path(directory), _key(index), _model(seconds_per_token))
            expected.pop(index, None)
            expected[index] = _model(seconds_per_token)
            while len(expected) > COST_MEMO_ENTRIES_MAX:
                expected.popitem(last=False)
            assert load_costs(Path(directory), _key(index)) == _model(seconds_per_token)
        for index in range(KEYS_DRAWN):
            assert load_costs(Path(directory), _key(index)) == expected.get(index)


def test_a_version_1_file_loads_as_one_entry_and_keeps_it_when_another_key_is_saved(tmp_path: Path) -> None:
    # Byte for byte what the one-key memo wrote before issue 41's pools.
    old = {
        "format": COST_MEMO_FORMAT,
        "version": 1,
        "key": converter.unstructure(_key(0)),
        "model": converter.unstructure(_model(1e-3)),
    }
    (tmp_path / COST_MEMO_FILE_NAME).write_bytes(to_cbor(old))
    assert load_costs(tmp_path, _key(0)) == _model(1e-3)
    assert load_costs(tmp_path, _key(1)) is None
    assert save_costs(tmp_path, _key(1), _model(2e-3))
    assert load_costs(tmp_path, _key(0)) == _model(1e-3)
    assert load_costs(tmp_path, _key(1)) == _model(2e-3)


def test_a_newer_or_foreign_file_is_ignored_with_a_log_line_and_replaced_by_the_next_save(tmp_path, caplog) -> None:
    path = tmp_path / COST_MEMO_FILE_NAME
    entry = {"key": converter.unstructure(_key(0)), "model": converter.unstructure(_model(1e-3))}
    caplog.set_level(logging.INFO, logger="kvcellar.store.cost_memo")
    path.write_bytes(to_cbor({"format": COST_MEMO_FORMAT, "version": 3, "entries": [entry]}))
    assert load_costs(tmp_path, _key(0)) is None
    assert "is version 3, which this kvcellar (version 2) cannot read" in caplog.text
    assert "calibrating afresh" in caplog.text
    path.write_bytes(to_cbor({"format": "another-tool", "version": 2, "entries": [entry]}))
    assert load_costs(tmp_path, _key(0)) is None
    assert f"is not a {COST_MEMO_FORMAT} file" in caplog.text
    assert save_costs(tmp_path, _key(0), _model(1e-3))
    assert load_costs(tmp_path, _key(0)) == _model(1e-3)


def test_every_key_field_tells_the_costs_apart(tmp_path: Path) -> None:
    assert save_costs(tmp_path, _key(0), _model(1e-3))
    for field in ("config_sha256", "weights_sha256", "device", "device_architecture"):
        assert load_costs(tmp_path, attrs.evolve(_key(0), **{field: "other"})) is None
