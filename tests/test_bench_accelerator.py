"""Smoke test of the accelerator benchmark with its tiny shape on the CPU: it
runs every cell, reports the issue's keys and writes its figures to $OUT."""

from __future__ import annotations

import json

from kvcellar.bench import accelerator


def test_smoke_run_reports_every_key_and_writes_full_figures_to_out(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    scratch = tmp_path / "scratch"
    scratch.mkdir()

    # A budget no loaded machine reaches: this test checks that every cell runs and reports, not the budget.
    assert accelerator.main(["--smoke", "--json", "--budget-s", "3600", "--dir", str(scratch)]) == 0

    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("restore_vs_prefill", "split_vs_best_single", "first_step_ratio", "hot_load_vs_raw"):
        assert isinstance(figures[key], float) and figures[key] > 0, key
    assert figures["key_cell"] == "tiny@1024"
    assert figures["errors"] == 0
    report = json.loads((out / "accelerator.json").read_text())
    assert [(c["shape"], c["tokens"]) for c in report["cells"]] == accelerator.PLANS["tiny"]
    assert all(c["restore_hot"]["ttft_s"] > 0 and c["split"]["k"] > 0 for c in report["cells"])
    assert "| tiny, 1024 |" in (out / "accelerator.md").read_text()
    assert list(scratch.iterdir()) == []


def test_split_point_balances_prefill_and_restore_in_whole_steps():
    assert accelerator.split_point(32768, prefill_s=1.0, restore_s=1.0) == 16384
    assert accelerator.split_point(32768, prefill_s=3.0, restore_s=1.0) == 8192
    assert accelerator.split_point(1024, prefill_s=1.0, restore_s=100.0) == 768
    assert accelerator.split_point(1024, prefill_s=100.0, restore_s=1.0) == 256


def test_a_cell_is_skipped_when_the_rate_of_the_cells_done_says_it_would_end_past_the_budget(tmp_path):
    done = [{"shape": "8b", "tokens": 32768, "seconds": 60.0, "kv_bytes": 4 << 30}]
    # 8B at 8k holds a quarter of the 32k cell's KV: about 20 s at the measured rate.
    assert accelerator._fits("8b", 8192, done, elapsed_s=100, budget_s=330, workdir=tmp_path) == ""
    reason = accelerator._fits("8b", 8192, done, elapsed_s=320, budget_s=330, workdir=tmp_path)
    assert reason.startswith("estimated")
    assert accelerator._fits("tiny", 256, [], elapsed_s=10**6, budget_s=1, workdir=tmp_path) == ""  # the first runs
