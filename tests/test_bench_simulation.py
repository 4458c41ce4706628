"""Smoke test of the simulator benchmark: it runs and reports, not how fast."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.bench import simulation
from kvcellar.simulations.harness import lane_for_seed


def test_benchmark_prints_runs_and_crash_points_per_second_as_json():
    outcome = CliRunner().invoke(simulation.main, ["--seeds", "2", "--crash-workloads", "", "--json"])
    assert outcome.exit_code == 0, outcome.output
    figures = json.loads(outcome.stdout.strip().splitlines()[-1])
    assert figures["seeds"] == 2 and figures["runs_per_s"] > 0
    assert set(figures["runs_per_s_by_lane"]) == {"serial", "batch"}
    assert all(rate > 0 for rate in figures["runs_per_s_by_lane"].values())
    assert figures["batch_lane_seeds"] == sum(lane_for_seed(seed).rows > 1 for seed in range(2))
    assert figures["failed_runs"] == 0
    assert figures["crash_point_runs"] == 0


def test_benchmark_rejects_an_unknown_workload():
    outcome = CliRunner().invoke(simulation.main, ["--crash-workloads", "nope"])
    assert outcome.exit_code == 2
    assert "unknown workload nope" in outcome.output
