"""Sweeps of simulated runs: many seeds, every or a random crash point per
seed, and the summary that comes out of them."""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable
from pathlib import Path

import attrs

from kvcellar.errors import UsageError
from kvcellar.simulations.crash_images import explore
from kvcellar.simulations.harness import FAULTS, RunOptions, RunResult, simulate
from kvcellar.simulations.workload import SMALL_SHAPES, WorkloadShape

EXIT_CORRECTNESS = 3
EXIT_LIVENESS = 4
EXIT_CRASH = 5


def parse_faults(text: str) -> str | frozenset[str]:
    """`none`, `all`, `mixed` (a seed-drawn subset per run) or a comma list of
    fault names; raises `UsageError` naming the valid ones."""
    text = text.strip().lower()
    if text in ("none", ""):
        return frozenset()
    if text == "all":
        return frozenset(FAULTS)
    if text == "mixed":
        return "mixed"
    names = frozenset(name.strip() for name in text.split(",") if name.strip())
    unknown = sorted(names - FAULTS.keys())
    if unknown:
        raise UsageError(f"unknown fault {', '.join(unknown)}; choose from none, all, mixed, {', '.join(FAULTS)}")
    return names


def faults_for_seed(faults: str | frozenset[str], seed: int) -> frozenset[str]:
    if isinstance(faults, str) and faults != "mixed":
        faults = parse_faults(faults)
    if not isinstance(faults, str):  # the only string left is "mixed"
        return faults
    rng = random.Random(f"faults-{seed}")
    if rng.random() < 0.35:
        return frozenset()
    return frozenset(rng.sample(sorted(FAULTS), rng.randint(1, 2)))


def shape_named(name: str) -> WorkloadShape:
    if name == "default":
        return WorkloadShape()
    if name not in SMALL_SHAPES:
        raise UsageError(f"unknown workload {name!r}; choose from default, {', '.join(SMALL_SHAPES)}")
    return SMALL_SHAPES[name]


@attrs.frozen(kw_only=True)
class SweepPlan:
    seed: int
    runs: int = 1
    faults: str | frozenset[str] = "mixed"
    # None, "all" or "random" (crash-point runs), or "images" (`crash_images.explore`).
    crash_points: str | None = None
    # The crash point of a replay; with "images", the one image to check.
    crash_at_op: int | None = None
    shape_name: str = "default"
    real_model_dir: Path | None = None
    mutations: frozenset[str] = frozenset()
    batch_rows: int | None = None  # None: each seed draws its lane

    def options(self, seed: int, crash_at_op: int | None) -> RunOptions:
        return RunOptions(
            seed=seed,
            shape=shape_named(self.shape_name),
            faults=faults_for_seed(self.faults, seed),
            crash_at_op=crash_at_op,
            real_model_dir=self.real_model_dir,
            mutations=self.mutations,
            batch_rows=self.batch_rows,
        )

    def replay_command(self, seed: int, crash_at_op: int | None) -> str:
        faults = faults_for_seed(self.faults, seed)
        parts = [
            "kvcellar simulate",
            f"--seed {seed}",
            "--runs 1",
            f"--faults {','.join(sorted(faults)) if faults else 'none'}",
        ]
        if self.shape_name != "default":
            parts.append(f"--workload {self.shape_name}")
        if self.crash_points == "images":
            parts.append("--crash-points images")
        if crash_at_op is not None:
            parts.append(f"--crash-at {crash_at_op}")
        if self.real_model_dir is not None:
            parts.append("--real-model")
        if self.batch_rows is not None:
            parts.append(f"--batch-rows {self.batch_rows}")
        parts.extend(f"--mutate {name}" for name in sorted(self.mutations))
        return " ".join(parts)


@attrs.define(kw_only=True)
class SweepOutcome:
    results: list[tuple[RunResult, int | None]] = attrs.Factory(list)
    crash_points: int = 0
    # With crash images: the images recovered (crash points less repeated images), and
    # each failed image as its run with the image's violations, at its point.
    image_recoveries: int = 0
    image_failures: list[tuple[RunResult, int | None]] = attrs.Factory(list)
    elapsed_s: float = 0.0

    @property
    def failures(self) -> list[tuple[RunResult, int | None]]:
        return [(result, point) for result, point in self.results if not result.ok] + self.image_failures

    def exit_code(self) -> int:
        kinds = {violation.kind for result, _ in self.failures for violation in result.violations}
        if "correctness" in kinds:
            return EXIT_CORRECTNESS
        if "liveness" in kinds:
            return EXIT_LIVENESS
        if "crash" in kinds:
            return EXIT_CRASH
        return 0

    def lane_counts(self) -> dict[str, int]:
        """Runs on each lane, and batch-lane decode steps that more than one row shared."""
        results = [result for result, _ in self.results]
        return {
            "serial_lane_runs": sum(r.batch_rows == 1 for r in results),
            "batch_lane_runs": sum(r.batch_rows > 1 for r in results),
            "shared_decode_steps": sum(
                steps for r in results for rows, steps in r.decode_steps_by_rows.items() if rows > 1
            ),
        }

    def journal_digest(self) -> str:
        """The single run's journal digest, or a digest over all runs' in order."""
        if len(self.results) == 1:
            return self.results[0][0].journal_digest
        combined = hashlib.sha256()
        for result, _ in self.results:
            combined.update(bytes.fromhex(result.journal_digest))
        return combined.hexdigest()


def run_sweep(
    plan: SweepPlan, *, progress: Callable[[int, int], None] | None = None, stop_on_failure: bool = False
) -> SweepOutcome:
    """Run the plan; `progress(done, total)` after each run (total grows as
    crash points are counted)."""
    outcome = SweepOutcome()
    started = time.perf_counter()
    total = plan.runs
    done = 0
    for seed in range(plan.seed, plan.seed + plan.runs):
        if plan.crash_points == "images":
            _explore_seed(plan, seed, outcome)
            done += 1
            if progress:
                progress(done, total)
            if stop_on_failure and outcome.failures:
                break
            continue
        base = simulate(plan.options(seed, plan.crash_at_op))
        outcome.results.append((base, plan.crash_at_op))
        done += 1
        points = _crash_points(plan, seed, base)
        total += len(points)
        if progress:
            progress(done, total)
        for point in points:
            result = simulate(plan.options(seed, point))
            outcome.results.append((result, point))
            outcome.crash_points += 1
            done += 1
            if progress:
                progress(done, total)
            if stop_on_failure and not result.ok:
                break
        if stop_on_failure and outcome.failures:
            break
    outcome.elapsed_s = time.perf_counter() - started
    return outcome


def _explore_seed(plan: SweepPlan, seed: int, outcome: SweepOutcome) -> None:
    """One run of the seed with the image of every crash point (or of `crash_at_op` alone) checked."""
    points = None if plan.crash_at_op is None else {plan.crash_at_op}
    explored = explore(plan.options(seed, None), points=points)
    outcome.results.append((explored.run, None))
    outcome.crash_points += len(explored.images)
    outcome.image_recoveries += explored.recoveries
    for image in explored.failures:
        failed = attrs.evolve(explored.run, violations=list(image.violations))
        outcome.image_failures.append((failed, image.point))


def _crash_points(plan: SweepPlan, seed: int, base: RunResult) -> list[int]:
    if plan.crash_points is None or plan.crash_at_op is not None:
        return []
    if plan.crash_points == "all":
        return list(range(1, base.workload_ops + 1))
    return [random.Random(f"point-{seed}").randint(1, max(1, base.workload_ops))]
