"""Smoke test of the end-to-end RAM-hit benchmark: both servers run and it reports, not how fast."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.bench import common, ram_hit_serve


def test_benchmark_prints_its_figures_as_json_on_the_last_line(tmp_path):
    docs_before = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    work = tmp_path / "work"

    outcome = CliRunner().invoke(
        ram_hit_serve.main, ["--contexts", "48,96", "--rounds", "2", "--dir", str(work), "--json"]
    )

    assert outcome.exit_code == 0, outcome.output
    figures = json.loads(outcome.stdout.strip().splitlines()[-1])
    assert figures["warm_ttft_ratio"] == max(figures["warm_ttft_ratio_48"], figures["warm_ttft_ratio_96"]) > 0
    assert set(figures["targets_met"]) == {"warm_ttft_ratio_le_1.0_48", "warm_ttft_ratio_le_1.0_96"}
    for context in figures["contexts"].values():
        for server in context["servers"].values():
            assert len(server["hit_ttft_s"]) == 2 and all(ttft > 0 for ttft in server["hit_ttft_s"])
            # A RAM hit on both servers: all but the last prompt token came from the cache.
            assert server["hit_cached_tokens"] == [server["prompt_tokens"] - 1] * 2
    assert list(work.iterdir()) == []
    docs_after = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    assert docs_after == docs_before


def test_contexts_that_are_not_token_counts_are_refused(tmp_path):
    for contexts in ("2k", "8", "40000"):
        outcome = CliRunner().invoke(ram_hit_serve.main, ["--contexts", contexts, "--dir", str(tmp_path)])
        assert outcome.exit_code == 2 and "--contexts" in outcome.output, contexts
