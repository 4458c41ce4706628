"""Smoke test of the SSD index benchmark tool: it runs and reports, not how fast."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.bench import common, ssd_index


def test_benchmark_prints_its_figures_as_json_on_the_last_line(tmp_path):
    docs_before = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None

    outcome = CliRunner().invoke(
        ssd_index.main,
        [
            "--entries",
            "50",
            "--tokens",
            "64",
            "--queries",
            "50",
            "--store-mib",
            "1",
            "--stores",
            "2",
            "--open-repeats",
            "1",
            "--json",
            "--dir",
            str(tmp_path),
        ],
    )

    assert outcome.exit_code == 0, outcome.output
    figures = json.loads(outcome.stdout.strip().splitlines()[-1])
    for key in ("open_journal_off", "open_journal_on", "scan_baseline"):
        assert figures["median_seconds"][key] > 0
    for key in ("on", "off", "append"):
        assert figures["store_median_seconds"][key] > 0
    for key in (
        "find_median_seconds",
        "find_p99_seconds",
        "find_list_median_seconds",
        "journal_append_pct",
        "open_ratio_journal_off",
        "open_ratio_journal_on",
        "build_seconds",
        "wall_seconds",
    ):
        assert figures[key] > 0, key
    assert "journal_end_to_end_seconds" in figures
    assert set(figures["targets_met"]) == {
        "open_ratio_journal_off_le_10",
        "open_ratio_journal_on_le_3",
        "find_median_lt_1_ms",
        "journal_append_lt_5_pct",
    }
    assert figures["entries"] == 50
    assert figures["verified_queries"] > 0 and figures["verification_mismatches"] == 0
    assert figures["reconcile_events_in_timed_opens"] == 0
    assert set(figures["collection_median_seconds"]) == {"open_journal_off", "open_journal_on"}
    assert all(seconds >= 0 for seconds in figures["collection_median_seconds"].values())
    assert figures["first_journal_open_events"] == 50
    assert [path.name[: len("ssd_index-")] for path in tmp_path.iterdir()] == ["ssd_index-"]
    docs_after = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    assert docs_after == docs_before
