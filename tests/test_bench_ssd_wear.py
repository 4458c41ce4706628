"""Smoke test of the SSD write-wear benchmark: it runs and reports, not how well."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.bench import common, ssd_wear
from kvcellar.engine.demo_models import create_model


def test_benchmark_prints_its_figures_as_json_on_the_last_line(tmp_path):
    model_dir = create_model("llama", tmp_path / "m")
    docs_before = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    arguments = ["--model", str(model_dir), "--dir", str(tmp_path / "bench"), "--conversations", "2"]
    arguments += ["--turns", "1,1,1", "--think-seconds", "0.05", "--json"]

    outcome = CliRunner().invoke(ssd_wear.main, arguments)

    assert outcome.exit_code == 0, outcome.output
    figures = json.loads(outcome.stdout.strip().splitlines()[-1])
    assert figures["default_policy"] == "always" and figures["bytes_ratio_vs_always"] == 1.0
    assert figures["cached_ratio_vs_always"] == 1.0 and figures["same_replies_every_policy"]
    for policy in ("always", "second-hit", "cost"):
        assert figures["policies"][policy]["bytes_written"] > 0
        assert 0 < figures["policies"][policy]["cached_ratio"] <= 1
    assert (
        figures["policies"]["ram-only"]["restart_cached_ratio"] < figures["policies"]["always"]["restart_cached_ratio"]
    )
    assert (common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None) == docs_before
