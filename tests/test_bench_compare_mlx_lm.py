"""Smoke test of the kvcellar-against-mlx_lm.server benchmark: it runs both servers and reports, not how fast."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.bench import common, compare_mlx_lm
from kvcellar.engine.demo_models import create_model


def test_benchmark_prints_its_figures_as_json_on_the_last_line(tmp_path):
    docs_before = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    model_dir = create_model("llama", tmp_path / "m")
    work = tmp_path / "work"

    outcome = CliRunner().invoke(
        compare_mlx_lm.main,
        [
            "--model",
            str(model_dir),
            "--context-tokens",
            "64",
            "--turns",
            "2",
            "--new-tokens",
            "4",
            "--dir",
            str(work),
            "--json",
        ],
    )

    assert outcome.exit_code == 0, outcome.output
    figures = json.loads(outcome.stdout.strip().splitlines()[-1])
    for key in ("restart_ttft_ratio", "turn_ttft_ratio", "cold_ttft_ratio", "warm_ttft_ratio"):
        assert figures[key] > 0, key
    assert "decode_ratio" in figures and set(figures["targets_met"]) == {
        "restart_ttft_ratio_le_0.02",
        "turn_ttft_ratio_le_1.0",
        "decode_ratio_ge_0.95",
        "warm_ttft_ratio_le_1.0",
    }
    for name in ("kvcellar", "mlx_lm"):
        server = figures["servers"][name]
        assert server["cold_ttft_s"] > 0 and server["restart_ttft_s"] > 0
        assert len(server["turn_ttft_s"]) == 2 and all(ttft > 0 for ttft in server["turn_ttft_s"])
        assert all(run["long_total_s"] > 0 and run["short_total_s"] > 0 for run in server["decode_runs"])
    kvcellar = figures["servers"]["kvcellar"]
    assert kvcellar["exit_status"] == [0, 0]
    assert figures["flush"]["status"] == 200 and figures["flush"]["durable"] is True
    assert kvcellar["restart_cached_tokens"] >= kvcellar["prompt_tokens"] - 1
    assert list(work.iterdir()) == []
    docs_after = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    assert docs_after == docs_before
