"""Smoke test of the write-behind benchmark tool: it runs and reports, not how fast."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.bench import common, writebehind
from kvcellar.engine.demo_models import create_model

TINY_SETTINGS = ["--context-tokens", "64", "--new-tokens", "8", "--repeats", "1", "--json"]
EXPECTED_KEYS = {
    "decode_ratio",
    "decode_tok_s_on",
    "decode_tok_s_off",
    "ttft_s_on",
    "ttft_s_off",
    "flush_s",
    "flush_bytes",
    "flush_durable",
    "background_steps_during_decode",
    "repeats",
    "targets_met",
    "idle_flush_s",
    "runs",
    "machine",
}


def _docs_text() -> str | None:
    return common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None


def test_benchmark_prints_its_figures_as_json_on_the_last_line(tmp_path):
    model_dir = create_model("llama", tmp_path / "m")
    bench_dir = tmp_path / "bench"
    docs_before = _docs_text()

    outcome = CliRunner().invoke(writebehind.main, ["--model", str(model_dir), "--dir", str(bench_dir), *TINY_SETTINGS])

    assert outcome.exit_code == 0, outcome.output
    figures = json.loads(outcome.stdout.strip().splitlines()[-1])
    assert set(figures) >= EXPECTED_KEYS
    for key in (
        "decode_ratio",
        "decode_tok_s_on",
        "decode_tok_s_off",
        "ttft_s_on",
        "ttft_s_off",
        "flush_s",
        "flush_bytes",
    ):
        assert figures[key] > 0, key
    assert figures["flush_durable"] is True
    assert figures["repeats"] == 1
    assert figures["all_prefills_cold"] is True
    assert [run["tokens"] for mode in ("on", "off") for run in figures["runs"][mode]] == [8, 8]
    assert set(figures["targets_met"]) == {"decode_ratio_ge_0.99", "no_background_work_during_decode"}
    assert list(bench_dir.iterdir()) == []
    assert _docs_text() == docs_before
