"""Smoke test of the kvfile I/O benchmark tool: it runs and reports, not how fast."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.bench import common, kvfile_io


def test_benchmark_prints_its_figures_as_json_on_the_last_line(tmp_path):
    docs_before = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None

    outcome = CliRunner().invoke(
        kvfile_io.main, ["--size-mib", "4", "--repeats", "1", "--json", "--dir", str(tmp_path)]
    )

    assert outcome.exit_code == 0, outcome.output
    figures = json.loads(outcome.stdout.strip().splitlines()[-1])
    assert figures["save_mb_s"] > 0
    assert figures["load_mb_s"] > 0
    assert "save_ratio" in figures and "load_ratio" in figures
    assert figures["payload_bytes"] >= 4 * kvfile_io.MIB_BYTES
    assert list(tmp_path.iterdir()) == []
    docs_after = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    assert docs_after == docs_before


def test_the_encrypt_mode_prints_the_sealed_over_plain_ratios(tmp_path):
    docs_before = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None

    outcome = CliRunner().invoke(
        kvfile_io.main, ["--encrypt", "--size-mib", "2", "--repeats", "1", "--json", "--dir", str(tmp_path)]
    )

    assert outcome.exit_code == 0, outcome.output
    figures = json.loads(outcome.stdout.strip().splitlines()[-1])
    assert figures["save_sealed_over_plain"] > 0 and figures["load_sealed_over_plain"] > 0
    assert set(figures["targets_met"]) == {"save_sealed_over_plain_ge_0.9", "load_sealed_over_plain_ge_0.9"}
    assert list(tmp_path.iterdir()) == []
    docs_after = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    assert docs_after == docs_before
