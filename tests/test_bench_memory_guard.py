"""Smoke test of the memory-guard benchmark at a tiny size: it runs both passes
and reports the figures the issue names, not how fast they were."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.bench import common, memory_guard


def test_benchmark_prints_its_figures_as_json_on_the_last_line(model_dir_factory, tmp_path):
    docs_before = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    arguments = ["--model", str(model_dir_factory("llama")), "--dir", str(tmp_path), "--json"]
    shape = ["--clients", "2", "--requests-per-client", "2", "--prompt-tokens", "300", "--max-tokens", "4"]
    outcome = CliRunner().invoke(memory_guard.main, arguments + shape)
    assert outcome.exit_code == 0, outcome.output
    figures = json.loads(outcome.stdout.strip().splitlines()[-1])
    assert {"budget_bytes", "peak_active_bytes", "completed", "refused", "failed"} <= set(figures)
    assert figures["completed"] + figures["refused"] + figures["failed"] == figures["requests"] == 4
    assert figures["failed"] == 0 and figures["baseline_completed"] == 4
    assert figures["budget_bytes"] > figures["weights_bytes"] > 0
    assert figures["peak_active_bytes"] > 0 and figures["baseline_peak_active_bytes"] > 0
    assert isinstance(figures["peak_within_budget"], bool)
    assert (common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None) == docs_before
