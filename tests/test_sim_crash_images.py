"""Crash images (`simulations/crash_images.py`): every crash point of a run
checked by one recovery on a crashed copy. The run is left as it was, an image
replays alone, images catch what only recovery shows, and the default sweep
covers at least 10^4 crash points this way (the `slow` tests cover more)."""

from __future__ import annotations

import json
import math

import pytest

from kvcellar.cli import main
from kvcellar.simulations.crash_images import explore
from kvcellar.simulations.harness import RunOptions, simulate
from kvcellar.simulations.sweep import EXIT_CORRECTNESS, SweepPlan, run_sweep
from kvcellar.simulations.workload import SMALL_SHAPES

# What the default test run covers as crash images, split over workloads so xdist's workers share it.
CI_CRASH_POINTS_MIN = 10_000
CI_IMAGE_WORKLOADS = ("chat", "fork", "hybrid")
CI_IMAGE_SEEDS = 22


def _describe(outcome) -> str:
    return "\n".join(
        f"seed {result.seed} image at {point}: {result.violations[0].invariant}: {result.violations[0].detail}"
        for result, point in outcome.failures[:5]
    )


def test_exploring_leaves_the_run_byte_for_byte_as_it_was():
    options = RunOptions(seed=1, shape=SMALL_SHAPES["chat"], batch_rows=3)
    plain = simulate(options)
    explored = explore(options)
    assert (explored.run.journal_digest, explored.run.disk_digest) == (plain.journal_digest, plain.disk_digest)
    assert [image.point for image in explored.images] == list(range(1, plain.workload_ops + 1))
    assert not explored.failures, explored.failures[:3]
    assert 0 < explored.recoveries <= len(explored.images)
    assert sum(image.claims_checked for image in explored.images) > 0


def test_an_image_replays_alone():
    options = RunOptions(seed=4, shape=SMALL_SHAPES["fork"], faults=frozenset({"fsync"}), batch_rows=1)
    images = {image.point: image for image in explore(options).images}
    for point in (1, len(images) // 2, len(images)):
        (alone,) = explore(options, points={point}).images
        assert (alone.violations, alone.claims_checked) == (images[point].violations, images[point].claims_checked)


def test_images_catch_a_startup_that_leaves_superseded_entries():
    # A power loss can undo a removal that was not directory-fsynced; startup must redo it.
    # The run itself never crashes here: only the images see it.
    outcome = run_sweep(
        SweepPlan(
            seed=0,
            runs=10,
            faults="none",
            shape_name="chat",
            crash_points="images",
            mutations=frozenset({"skip-startup-supersession"}),
        ),
        stop_on_failure=True,
    )
    result, point = outcome.failures[0]
    assert point is not None and result.violations[0].invariant == "nothing_left_to_supersede"
    assert outcome.exit_code() == EXIT_CORRECTNESS


def test_cli_names_the_image_to_replay(capsys):
    status = main(
        [
            "simulate",
            "--seed",
            "0",
            "--runs",
            "2",
            "--faults",
            "none",
            "--workload",
            "chat",
            "--crash-points",
            "images",
            "--mutate",
            "skip-startup-supersession",
            "--json",
        ]
    )
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert status == EXIT_CORRECTNESS and summary["crash_point_runs"] > 100
    replay = summary["failures"][0]["replay"]
    assert "--crash-points images --crash-at" in replay
    assert main([*replay.split()[1:], "--json"]) == EXIT_CORRECTNESS
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["crash_point_runs"] == 1


@pytest.mark.parametrize("workload", CI_IMAGE_WORKLOADS)
def test_the_default_sweep_checks_every_crash_point_as_an_image(workload):
    outcome = run_sweep(
        SweepPlan(seed=0, runs=CI_IMAGE_SEEDS, faults="mixed", shape_name=workload, crash_points="images")
    )
    assert not outcome.failures, _describe(outcome)
    assert outcome.crash_points >= math.ceil(CI_CRASH_POINTS_MIN / len(CI_IMAGE_WORKLOADS))
    assert outcome.image_recoveries > outcome.crash_points // 2


def test_crash_images_of_wipes_recover_with_nothing_wiped_back():
    outcome = run_sweep(SweepPlan(seed=0, runs=8, faults="mixed", shape_name="wipes", crash_points="images"))
    assert not outcome.failures, _describe(outcome)
    assert outcome.image_recoveries > outcome.crash_points // 2


@pytest.mark.slow
@pytest.mark.parametrize("first_seed", [0, 25])
def test_crash_images_of_the_default_workload(first_seed):
    outcome = run_sweep(SweepPlan(seed=first_seed, runs=25, faults="mixed", crash_points="images"))
    assert not outcome.failures, _describe(outcome)
    assert outcome.crash_points > 25 * 300


@pytest.mark.slow
@pytest.mark.parametrize(
    ("workload", "seeds"), [*((name, 100) for name in CI_IMAGE_WORKLOADS), ("checkpoints", 20), ("wipes", 100)]
)
def test_crash_images_of_many_more_small_workload_seeds(workload, seeds):
    outcome = run_sweep(SweepPlan(seed=1000, runs=seeds, faults="mixed", shape_name=workload, crash_points="images"))
    assert not outcome.failures, _describe(outcome)
