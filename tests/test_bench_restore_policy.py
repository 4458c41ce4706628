"""Smoke test of the restore-policy benchmark: it runs and reports its keys, not how fast."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.bench import common, restore_policy


def test_benchmark_prints_its_figures_as_json_on_the_last_line(tmp_path):
    docs_before = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None

    outcome = CliRunner().invoke(
        restore_policy.main, ["--contexts", "256", "--rates", "1", "--json", "--dir", str(tmp_path)]
    )

    assert outcome.exit_code == 0, outcome.output
    figures = json.loads(outcome.stdout.strip().splitlines()[-1])
    assert figures["auto_vs_best_worst"] > 0
    assert figures["hot_load_vs_raw"] > 0
    assert "split_vs_best_where_close" in figures
    assert {cell["tier"] for cell in figures["cells"]} == {"ram", "ssd", "ssd@1MB/s"}
    assert all(cell["auto_plan"] in ("restore", "recompute", "split") for cell in figures["cells"])
    assert list(tmp_path.iterdir()) == []
    docs_after = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    assert docs_after == docs_before
