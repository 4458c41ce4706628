"""Smoke test of the restart benchmark: it runs and reports, not how fast."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.bench import common, restart


def test_benchmark_prints_its_figures_as_json_on_the_last_line(tmp_path):
    docs_before = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None

    outcome = CliRunner().invoke(
        restart.main,
        [
            "--contexts",
            "64,2048",
            "--repeats",
            "1",
            "--prefill-up-to",
            "64",
            "--layers",
            "1",
            "--kv-heads",
            "1",
            "--head-dim",
            "16",
            "--json",
            "--dir",
            str(tmp_path),
        ],
    )

    assert outcome.exit_code == 0, outcome.output
    figures = json.loads(outcome.stdout.strip().splitlines()[-1])
    assert figures["restart_vs_limit_2k"] > 0 and figures["restart_vs_limit_64"] > 0
    measured, extrapolated = figures["contexts"]
    assert measured["prefill_extrapolated"] is False and extrapolated["prefill_extrapolated"] is True
    assert extrapolated["entry_bytes"] > 2047 * figures["kv_bytes_per_token"]
    assert set(figures["targets_met"]) == {"restart_vs_limit_2k_le_1.2"}
    assert list(tmp_path.iterdir()) == []
    docs_after = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    assert docs_after == docs_before
