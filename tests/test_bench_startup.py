"""Smoke test of the start-to-healthy benchmark: two real `kvcellar serve`
starts of a tiny model, the second reading its digests from the memo the
first left. It checks what the starts report, not how fast they were."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.bench import common, startup
from kvcellar.engine.demo_models import build_weights

EXPECTED_KEYS = {
    "model_bytes",
    "first_start_s",
    "second_start_s",
    "ratio",
    "first_bytes_hashed",
    "second_bytes_hashed",
    "first_fingerprint_s",
    "second_fingerprint_s",
    "same_digest",
    "runs",
    "machine",
    "model",
}


def _docs_text() -> str | None:
    return common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None


def test_benchmark_prints_its_figures_as_json_on_the_last_line(tmp_path):
    bench_dir = tmp_path / "bench"
    docs_before = _docs_text()

    outcome = CliRunner().invoke(
        startup.main, ["--model-mb", "1", "--tier-entries", "120", "--dir", str(bench_dir), "--json"]
    )

    assert outcome.exit_code == 0, outcome.output
    figures = json.loads(outcome.stdout.strip().splitlines()[-1])
    assert set(figures) >= EXPECTED_KEYS
    assert figures["model_bytes"] >= 10**6
    assert figures["first_start_s"] > 0 and figures["second_start_s"] > 0
    assert figures["ratio"] == figures["first_start_s"] / figures["second_start_s"]
    # The first start hashes at least every weight byte; the second none at all.
    assert figures["first_bytes_hashed"] >= 10**6
    assert figures["second_bytes_hashed"] == 0
    assert figures["same_digest"] is True
    [pair] = figures["runs"]
    assert pair["memo_file_bytes"] > 0
    assert all(pair[start]["exit_status"] == 0 for start in ("first", "second", "tier_reconciled", "tier"))
    # The tier built after the second start is what the third and fourth starts opened, all of it.
    assert pair["second"]["tier_entries"] == 0
    assert pair["tier_reconciled"]["tier_entries"] == pair["tier"]["tier_entries"] == figures["tier_entries"] == 120
    assert figures["tier_start_s"] == pair["tier"]["start_s"]
    assert figures["tier_added_s"] == figures["tier_start_s"] - figures["second_start_s"]
    assert list(bench_dir.iterdir()) == []
    assert _docs_text() == docs_before


def test_the_built_model_reaches_the_asked_size_in_whole_layers():
    target_bytes = 3 * 10**6
    config = startup.llama_config_of_at_least(target_bytes)
    one_layer_less = {**config, "num_hidden_layers": config["num_hidden_layers"] - 1}

    def weight_bytes(of: dict) -> int:
        return sum(weight.nbytes for weight in build_weights(of, dtype="float32", seed=0).values())

    assert config["num_hidden_layers"] > 1
    assert weight_bytes(one_layer_less) < target_bytes <= weight_bytes(config)
