"""Smoke test of the shared tier benchmark: it runs against its own moto
server and reports its figures, not how fast."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.bench import common, shared_tier


def test_benchmark_prints_its_figures_as_json_on_the_last_line(model_dir_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    model_dir = model_dir_factory("llama")
    docs_before = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    arguments = ["--model", str(model_dir), "--dir", str(tmp_path / "bench"), "--context-tokens", "48"]
    outcome = CliRunner().invoke(shared_tier.main, [*arguments, "--new-tokens", "4", "--repeats", "1", "--json"])
    assert outcome.exit_code == 0, outcome.output
    result = json.loads(outcome.output.strip().splitlines()[-1])
    assert {"restore_vs_get_ratio", "second_server_cached_fraction", "decode_ratio"} <= set(result)
    assert result["received_restore_vs_get_ratio"] > 0
    assert result["received_persisted_s"] >= result["received_restore_s"] > 0
    assert result["second_server_cached_fraction"] >= (48 - 1) / 48
    assert result["targets_met"]["second_server_cached_ge_prompt_minus_1"] is True
    assert (common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None) == docs_before
