"""Smoke test of the checkpoints benchmark tool: it runs, kills, resumes and reports, not how fast."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.bench import checkpoints, common
from kvcellar.engine.demo_models import create_model

TINY_SETTINGS = ["--new-tokens", "160", "--checkpoint-tokens", "8", "--repeats", "1", "--json"]
EXPECTED_KEYS = {
    "decode_ratio",
    "resume_time_ratio",
    "outputs_equal",
    "checkpoint_bytes_mean",
    "generation_checkpoint_bytes",
    "resumed_tokens",
    "targets_met",
    "machine",
}


def test_benchmark_prints_its_figures_as_json_on_the_last_line(tmp_path):
    model_dir = create_model("llama", tmp_path / "m")
    docs_before = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    outcome = CliRunner().invoke(
        checkpoints.main, ["--model", str(model_dir), "--dir", str(tmp_path / "bench"), *TINY_SETTINGS]
    )
    assert outcome.exit_code == 0, outcome.output
    result = json.loads(outcome.output.strip().splitlines()[-1])
    assert result.keys() >= EXPECTED_KEYS
    assert result["outputs_equal"] is True
    assert result["resumed_tokens"] >= 96
    assert result["generation_checkpoint_bytes"] > result["checkpoint_bytes_mean"] > 0
    assert (common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None) == docs_before
