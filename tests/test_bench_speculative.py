"""Smoke test of the speculative-decoding benchmark: it runs and reports its keys, not how fast."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.bench import common, speculative

TINY_SETTINGS = ["--target-size", "tiny", "--decode-tokens", "16", "--restored-tokens", "96", "--json"]


def test_benchmark_prints_its_figures_as_json_on_the_last_line():
    docs_before = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    outcome = CliRunner().invoke(speculative.main, TINY_SETTINGS)
    assert outcome.exit_code == 0, outcome.output
    result = json.loads(outcome.output.strip().splitlines()[-1])
    assert result.keys() >= {"self_draft_speedup", "restored_with_companion_ttft_ratio", "acceptance"}
    assert result["acceptance"] == 1.0 and result["self_draft"]["identical"] and result["small_draft"]["identical"]
    assert result["restart"]["speculative_with"]["companion_restored"] == 1
    assert result["restart"]["speculative_without"]["draft_reprefills"] == {"companion_missing": 1}
    assert (common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None) == docs_before
