"""Smoke test of the prompt cache benchmark tool: it runs and reports, not how fast."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.bench import common, prompt_cache

TINY_SETTINGS = [
    "--lengths",
    "64",
    "--repeats",
    "1",
    "--entries",
    "20",
    "--queries",
    "30",
    "--turns",
    "4",
    "--turns-per-conversation",
    "2",
    "--user-tokens",
    "16",
    "--reply-tokens",
    "4",
    "--cap-mib",
    "1",
    "--json",
]


def _docs_text() -> str | None:
    return common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None


def test_benchmark_prints_its_figures_as_json_on_the_last_line(model_dir_factory):
    model_dir = model_dir_factory("llama")
    docs_before = _docs_text()

    outcome = CliRunner().invoke(prompt_cache.main, ["--model", str(model_dir), *TINY_SETTINGS])

    assert outcome.exit_code == 0, outcome.output
    figures = json.loads(outcome.stdout.strip().splitlines()[-1])
    assert {"ttft", "take_latency", "memory", "targets_met", "machine", "model", "wall_s"} <= set(figures)
    (ttft,) = figures["ttft"]
    assert ttft["prompt_tokens"] == 64
    assert ttft["reused_tokens"] == 64 - prompt_cache.PREVIOUS_TURN_TAIL_TOKENS
    assert ttft["cold_median_s"] > 0 and ttft["hit_median_s"] > 0 and ttft["speedup"] > 0
    latency = figures["take_latency"]
    assert latency["entries_after"] == 20
    assert latency["tiers_by_kind"] == {"extend": ["ram"], "branch": ["ram"], "miss": ["none"]}
    for key in ("take", "put_filling", "put_evicting"):
        assert latency[key]["median_us"] > 0 and latency[key]["p99_us"] > 0
    memory = figures["memory"]
    assert len(memory["samples"]) == 4
    assert memory["stats"]["hits"] == 3 and memory["stats"]["misses"] == 1
    assert 0 < memory["billed_bytes"] <= memory["held_capacity_bytes"]
    assert memory["baseline_rss_bytes"] > 0
    assert set(figures["targets_met"]) == {"hit_faster_than_cold", "rss_growth_le_1.1x_cap"}
    assert _docs_text() == docs_before
