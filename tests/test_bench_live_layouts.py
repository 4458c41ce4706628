"""Smoke test of the live-layouts benchmark at a tiny size: it runs every
measurement and reports the figures the issue names, not how fast they were."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.bench import common, live_layouts


def test_benchmark_prints_its_figures_as_json_on_the_last_line(model_dir_factory, tmp_path):
    docs_before = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    arguments = ["--model", str(model_dir_factory("llama")), "--dir", str(tmp_path), "--json"]
    shape = ["--long-tokens", "100", "--short-tokens", "8", "--new-tokens", "2", "--rounds", "1", "--rows", "4"]
    outcome = CliRunner().invoke(live_layouts.main, [*arguments, *shape, "--block-size", "16", "--no-quant-batch"])
    assert outcome.exit_code == 0, outcome.output
    figures = json.loads(outcome.stdout.strip().splitlines()[-1])
    assert figures["paged_decode_ratio_b1"] > 0 and figures["paged_decode_ratio_4"] > 0
    # Held KV and admission do not depend on speed: one 100-token row beside 8-token rows.
    assert figures["paged_kv_bytes_4"] < figures["plain_kv_bytes_4"]
    assert figures["paged_rows_admitted"] > figures["plain_rows_admitted"] == 4
    assert figures["paged_rows_admitted_ratio"] == figures["paged_rows_admitted"] / 4
    assert (common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None) == docs_before
