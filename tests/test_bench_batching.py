"""Smoke test of the batching benchmark: it runs all three servers and reports, not how fast.

A decode rate is the difference of two wall-clock medians, so on a loaded machine a tiny run
can honestly come out as None (the long round was not measurably slower than the short one).
The test therefore checks how the figures are derived, never that timing noise stayed small."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.bench import batching, common
from kvcellar.engine.demo_models import create_model

NEW_TOKENS = 48
CLIENT_COUNTS = ("1", "2", "4", "8")


def expected_ratio(numerator, denominator):
    return None if numerator is None or denominator is None else numerator / denominator


def test_benchmark_prints_its_figures_as_json_on_the_last_line(tmp_path):
    docs_before = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    model_dir = create_model("llama", tmp_path / "m")
    work = tmp_path / "work"

    outcome = CliRunner().invoke(
        batching.main,
        [
            "--model",
            str(model_dir),
            "--prompt-tokens",
            "8",
            "--new-tokens",
            str(NEW_TOKENS),
            "--rounds",
            "1",
            "--passes",
            "1",
            "--dir",
            str(work),
            "--json",
        ],
    )

    assert outcome.exit_code == 0, outcome.output
    figures = json.loads(outcome.stdout.strip().splitlines()[-1])
    rates = figures["decode_tok_s"]
    for clients in CLIENT_COUNTS:
        assert figures[f"ratio_{clients}"] == expected_ratio(rates["batch"][clients], rates["serial"][clients])
        assert figures[f"vs_mlx_lm_{clients}"] == expected_ratio(rates["batch"][clients], rates["mlx_lm"][clients])
    assert figures["targets_met"]["ratio_4_ge_1.8"] == (figures["ratio_4"] is not None and figures["ratio_4"] >= 1.8)
    assert set(figures["targets_met"]) == {"ratio_4_ge_1.8", "vs_mlx_lm_4_ge_1.0"}
    assert set(figures["forward_step_ms"]) == {"1", "2", "4", "8"} and figures["forward_ceiling_4"] > 0
    assert figures["other_models"] == [], "--model runs one model"
    for server in ("serial", "batch", "mlx_lm"):
        assert set(rates[server]) == set(CLIENT_COUNTS)
        for clients, cell in figures["sessions"][server]["passes"][0]["rounds"].items():
            assert [r["completion_tokens"] for r in cell["long_rounds"]] == [[NEW_TOKENS] * int(clients)]
            by_clients = figures["sessions"][server]["by_clients"][clients]
            assert by_clients["pairs"] == 1
            assert by_clients["decode_tokens"] == int(clients) * (NEW_TOKENS - 1), "the first token is prefill's"
            assert (rates[server][clients] is None) == (by_clients["decode_s"] <= 0)
    batch = figures["sessions"]["batch"]["by_clients"]
    assert batch["1"]["mean_rows_per_decode_step"] == 1.0
    assert batch["8"]["mean_rows_per_decode_step"] > 1.0, "concurrent clients shared decode steps"
    assert figures["sessions"]["serial"]["by_clients"]["8"]["mean_rows_per_decode_step"] is None
    assert [figures["sessions"][key]["exit_status"] for key in ("serial", "batch")] == [[0], [0]]
    assert list(work.iterdir()) == []
    docs_after = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    assert docs_after == docs_before
