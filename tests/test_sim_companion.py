"""Method companion state in the crash simulator (issue 42): the `companion`
workload serves with a draft model, so its entries carry the draft's caches
through the RAM tier, spills, crashes and recovery. Every crash image and
recovery restores each entry with the serving drafter's companion over the
target's own tokens, in a form it was put in; a writer that commits the two
apart (`split-companion`) is caught."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kvcellar.simulations.fake_engine import FAKE_DRAFTER_DIGEST, FakeModel, fake_drafter
from kvcellar.simulations.harness import RunOptions, simulate
from kvcellar.simulations.observer import Observer
from kvcellar.simulations.sweep import SweepPlan, run_sweep
from kvcellar.simulations.workload import SMALL_SHAPES
from kvcellar.store.companion import CompanionState


def _describe(outcome) -> str:
    return "\n".join(
        f"seed {result.seed} at {point}: {result.violations[0].invariant}: {result.violations[0].detail}"
        for result, point in outcome.failures[:5]
    )


def test_companion_entries_go_through_the_tiers_and_back():
    runs = []

    def watch(run):
        runs.append(run)
        return lambda number, operation: None

    results = [simulate(RunOptions(seed=seed, shape=SMALL_SHAPES["companion"]), watch=watch) for seed in range(3)]
    assert all(result.ok for result in results), [result.violations[:1] for result in results]
    put_forms = {form for run in runs for forms in run.observer.put_forms.values() for form in forms}
    assert put_forms == {runs[0].observer.drafter.digest}
    speculation = [run.observer.drafter.stats.snapshot() for run in runs]
    assert sum(stats["rounds"] for stats in speculation) > 0
    assert sum(stats["companion_restored"] for stats in speculation) > 0


def _prefilled(model: FakeModel, tokens: tuple[int, ...]) -> list:
    caches = model.make_cache()
    model(mx.array([tokens]), cache=caches)
    return caches


@pytest.mark.parametrize(
    ("drafter", "draft_tokens", "invariant"),
    [
        ("another-drafter", 12, "companion_is_the_serving_drafters"),
        (FAKE_DRAFTER_DIGEST, 11, "companion_covers_the_target_tokens"),
    ],
)
def test_the_checker_refuses_a_companion_of_another_drafter_or_of_other_tokens(drafter, draft_tokens, invariant):
    draft = fake_drafter()
    observer = Observer(None, FakeModel(), corruption_faults=False, drafter=draft)
    tokens = tuple(range(1, 13))
    target = _prefilled(observer.model, tokens)
    assert observer.check_restored("", tokens, target, "restore")
    paired = [*target, CompanionState(*_prefilled(draft.model, tokens), drafter=FAKE_DRAFTER_DIGEST)]
    assert observer.check_restored("", tokens, paired, "restore") and not observer.violations
    mispaired = [*target, CompanionState(*_prefilled(draft.model, tokens[:draft_tokens]), drafter=drafter)]
    assert not observer.check_restored("", tokens, mispaired, "restore")
    assert [violation.invariant for violation in observer.violations] == [invariant]


def test_every_crash_image_of_the_companion_workload_keeps_target_and_draft_together():
    outcome = run_sweep(SweepPlan(seed=0, runs=4, faults="mixed", shape_name="companion", crash_points="images"))
    assert not outcome.failures, _describe(outcome)
    assert outcome.crash_points > 200


def test_the_simulator_catches_a_writer_that_commits_target_and_companion_apart():
    outcome = run_sweep(
        SweepPlan(
            seed=0,
            runs=4,
            faults="none",
            shape_name="companion",
            crash_points="images",
            mutations=frozenset({"split-companion"}),
        ),
        stop_on_failure=True,
    )
    assert outcome.failures, "split-companion went unnoticed"
    result, _ = outcome.failures[0]
    assert result.violations[0].invariant == "entry_restores_as_put"


@pytest.mark.slow
def test_crash_images_of_many_more_companion_seeds():
    outcome = run_sweep(SweepPlan(seed=1000, runs=60, faults="mixed", shape_name="companion", crash_points="images"))
    assert not outcome.failures, _describe(outcome)
