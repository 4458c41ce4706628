"""Smoke test of the batching benchmark: it runs all three servers and reports, not how fast."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.bench import batching, common
from kvcellar.engine.demo_models import create_model


def test_benchmark_prints_its_figures_as_json_on_the_last_line(tmp_path):
    docs_before = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    model_dir = create_model("llama", tmp_path / "m")
    work = tmp_path / "work"

    outcome = CliRunner().invoke(batching.main, [
        "--model", str(model_dir), "--prompt-tokens", "8", "--new-tokens", "16", "--rounds", "1", "--passes", "1", "--dir", str(work),
        "--json"])

    assert outcome.exit_code == 0, outcome.output
    figures = json.loads(outcome.stdout.strip().splitlines()[-1])
    for key in ("ratio_2", "ratio_4", "ratio_8", "vs_mlx_lm_4"):
        assert figures[key] > 0, key
    assert set(figures["targets_met"]) == {"ratio_4_ge_1.8", "vs_mlx_lm_4_ge_1.0"}
    assert set(figures["forward_step_ms"]) == {"1", "2", "4", "8"} and figures["forward_ceiling_4"] > 0
    assert figures["other_models"] == [], "--model runs one model"
    for server in ("serial", "batch", "mlx_lm"):
        assert set(figures["decode_tok_s"][server]) == {"1", "2", "4", "8"}
        for clients, cell in figures["sessions"][server]["passes"][0]["rounds"].items():
            assert [len(r["completion_tokens"]) for r in cell["long_rounds"]] == [int(clients)]
            assert figures["sessions"][server]["by_clients"][clients]["pairs"] == 1
    batch = figures["sessions"]["batch"]["by_clients"]
    assert batch["1"]["mean_rows_per_decode_step"] == 1.0
    assert batch["8"]["mean_rows_per_decode_step"] > 1.0, "concurrent clients shared decode steps"
    assert figures["sessions"]["serial"]["by_clients"]["8"]["mean_rows_per_decode_step"] is None
    assert [figures["sessions"][key]["exit_status"] for key in ("serial", "batch")] == [[0], [0]]
    assert list(work.iterdir()) == []
    docs_after = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    assert docs_after == docs_before
