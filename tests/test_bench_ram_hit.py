"""Smoke test of the RAM-hit benchmark on a tiny model: it reports its figures, not how fast they were."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.bench import common, ram_hit
from kvcellar.engine.demo_models import create_model


def test_benchmark_prints_its_figures_as_json_on_the_last_line(tmp_path):
    docs_before = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    model_dir = create_model("llama", tmp_path / "m")

    outcome = CliRunner().invoke(
        ram_hit.main, ["--model", str(model_dir), "--contexts", "40,300", "--repeats", "2", "--json"]
    )

    assert outcome.exit_code == 0, outcome.output
    figures = json.loads(outcome.stdout.strip().splitlines()[-1])
    assert figures["ram_hit_ratio_40"] > 0 and figures["ram_hit_ratio_300"] > 0
    assert set(figures["targets_met"]) == {"ram_hit_ratio_40_le_1.0", "ram_hit_ratio_300_le_1.0"}
    for context in figures["contexts"]:
        assert set(context["runs_s"]) == set(ram_hit.SIDES)
        assert all(len(runs) == 2 and min(runs) > 0 for runs in context["runs_s"].values())
    assert "## RAM hit" in ram_hit.markdown_section(figures, "python -m kvcellar.bench.ram_hit", "today")
    assert (common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None) == docs_before


def test_a_context_list_that_is_not_integers_is_refused(tmp_path):
    outcome = CliRunner().invoke(ram_hit.main, ["--contexts", "2k", "--json"])

    assert outcome.exit_code != 0
    assert "comma-separated list of integers" in outcome.output
