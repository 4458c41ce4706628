"""The deterministic crash/replay simulator: reproducibility, the default
sweep (both lanes), exhaustive crash points, mutations the checkers must
catch, the CLI, and regressions for what it found. The batch lane's own
checks are in test_sim_batch_lane.py."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import trio
import trio.testing

from kvcellar.cli import main
from kvcellar.simulations.harness import RunOptions, simulate
from kvcellar.simulations.sweep import EXIT_CORRECTNESS, SweepPlan, run_sweep
from kvcellar.simulations.workload import SMALL_SHAPES
from kvcellar.store.mutations import MUTATIONS

SWEEP_SEEDS_DEFAULT = 200


def _describe(outcome) -> str:
    lines = []
    for result, point in outcome.failures[:5]:
        violation = result.violations[0]
        lines.append(f"seed {result.seed} crash point {point}: {violation.invariant}: {violation.detail}")
    return "\n".join(lines)


def test_the_same_seed_gives_the_same_journal_and_disk_byte_for_byte():
    first = simulate(RunOptions(seed=11, faults=frozenset({"fsync", "enospc"})))
    second = simulate(RunOptions(seed=11, faults=frozenset({"fsync", "enospc"})))
    other = simulate(RunOptions(seed=12, faults=frozenset({"fsync", "enospc"})))
    assert first.requests > 5 and first.durable_flushes > 0
    assert (first.journal_digest, first.disk_digest) == (second.journal_digest, second.disk_digest)
    assert first.journal_digest != other.journal_digest


def test_the_journal_digest_is_the_same_in_another_process_with_another_hash_seed():
    digests = []
    for hash_seed in ("1", "977"):
        completed = subprocess.run(
            [sys.executable, "-m", "kvcellar.cli", "simulate", "--seed", "5", "--faults", "mixed", "--json"],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
            timeout=300,
        )
        assert completed.returncode == 0, completed.stderr
        assert completed.stdout.splitlines()[0] == "SEED=5"
        digests.append(json.loads(completed.stdout.splitlines()[-1])["journal_digest"])
    assert digests[0] == digests[1]


@pytest.mark.parametrize("batch_rows", [1, 3])
def test_a_run_uses_no_worker_threads(monkeypatch, batch_rows):
    def refuse(*args, **kwargs):
        raise AssertionError("a simulated run must not start threads")

    monkeypatch.setattr(trio.to_thread, "run_sync", refuse)
    monkeypatch.setattr(threading.Thread, "start", refuse)
    result = simulate(RunOptions(seed=3, batch_rows=batch_rows))
    assert result.ok, result.violations
    assert result.requests > 0


# The sweep runs as halves of its seeds, so two xdist workers can share it. The default test run
# sweeps the first half; the second is `slow` (make test-slow): crash points are covered by the
# crash images (test_sim_crash_images.py), and the suite keeps its simulation share near 100 s.
SWEEP_HALF_SEEDS = SWEEP_SEEDS_DEFAULT // 2


@pytest.mark.parametrize(
    "first_seed",
    [pytest.param(0, id="seeds-0-99"), pytest.param(SWEEP_HALF_SEEDS, id="seeds-100-199", marks=pytest.mark.slow)],
)
def test_the_default_sweep_holds_every_invariant(first_seed):
    outcome = run_sweep(SweepPlan(seed=first_seed, runs=SWEEP_HALF_SEEDS, faults="mixed", crash_points="random"))
    assert not outcome.failures, _describe(outcome)
    results = [result for result, _ in outcome.results]
    assert len(results) == 2 * SWEEP_HALF_SEEDS
    assert sum(r.crashes for r in results) > SWEEP_HALF_SEEDS
    assert sum(r.claims_checked for r in results) > SWEEP_HALF_SEEDS
    assert sum(r.restarts for r in results) > 0
    batched = [r for r in results if r.batch_rows > 1]
    assert 0 < len(batched) < len(results)
    assert sum(steps for r in batched for rows, steps in r.decode_steps_by_rows.items() if rows > 1) > 0


# chat runs on the batch lane (its burst shares decode steps), fork and hybrid on the serial lane.
# A crash-point run replays the workload, so enumerating them costs a run per point: the default
# test run enumerates chat's, and covers every crash point of many more seeds as crash images
# (test_sim_crash_images.py); fork's and hybrid's are `slow`.
@pytest.mark.parametrize(
    "workload,seed,batch_rows",
    [
        ("chat", 1, 3),
        pytest.param("fork", 2, 1, marks=pytest.mark.slow),
        pytest.param("hybrid", 5, 1, marks=pytest.mark.slow),
    ],
)
def test_every_crash_point_of_a_small_workload_recovers(workload, seed, batch_rows):
    outcome = run_sweep(
        SweepPlan(seed=seed, runs=1, faults="none", shape_name=workload, crash_points="all", batch_rows=batch_rows)
    )
    base = outcome.results[0][0]
    assert base.workload_ops > 50
    assert base.batch_rows == batch_rows
    assert (max(base.decode_steps_by_rows, default=1) > 1) == (batch_rows > 1)
    assert outcome.crash_points == base.workload_ops
    assert not outcome.failures, _describe(outcome)
    assert sum(result.crashes for result, _ in outcome.results) >= base.workload_ops


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_deliberate_durability_bug_is_caught_by_the_default_sweep(mutation):
    outcome = run_sweep(
        SweepPlan(
            seed=0, runs=SWEEP_SEEDS_DEFAULT, faults="mixed", crash_points="random", mutations=frozenset({mutation})
        ),
        stop_on_failure=True,
    )
    assert outcome.failures, f"{mutation} went unnoticed"
    assert outcome.exit_code() == EXIT_CORRECTNESS


@pytest.mark.parametrize(
    ("mutation", "invariant"),
    [
        ("restore-holds-index-lock", "no_io_under_index_lock"),
        ("journal-unowned-append", "journal_has_one_owner"),
    ],
)
def test_the_thread_boundary_bugs_are_each_caught_by_their_own_invariant(mutation, invariant):
    outcome = run_sweep(
        SweepPlan(
            seed=0, runs=SWEEP_SEEDS_DEFAULT, faults="mixed", crash_points="random", mutations=frozenset({mutation})
        ),
        stop_on_failure=True,
    )
    result, _ = outcome.failures[0]
    assert result.violations[0].invariant == invariant


def test_the_seed_chooses_where_engine_jobs_and_blocking_calls_complete():
    """Two seeds of one workload shape differ in where the boundary's crossings
    land in virtual time; one seed replays exactly."""
    from kvcellar.simulations.boundary import BoundarySchedule, SeededBlocking

    async def completions(seed: int) -> list[float]:
        blocking = SeededBlocking(BoundarySchedule(random.Random(f"boundary-{seed}")))
        times = []
        for _ in range(20):
            times.append(await blocking(trio.current_time))
        return times

    def run(seed: int) -> list[float]:
        return trio.run(completions, seed, clock=trio.testing.MockClock(autojump_threshold=0))

    assert run(1) == run(1)
    assert run(1) != run(2)
    first, second = simulate(RunOptions(seed=5)), simulate(RunOptions(seed=5))
    assert first.ok, first.violations
    assert first.sim_time_s == second.sim_time_s and first.journal_digest == second.journal_digest


def test_seed_3_new_namespace_directories_are_synced_into_their_parent():
    # Found by the simulator: the store created namespace directories without
    # fsyncing their parent, so a power loss could take committed entries with them.
    result = simulate(RunOptions(seed=3, batch_rows=1))
    assert result.ok, result.violations
    assert result.claims_checked > 0


def test_seed_15_an_oversize_put_stays_dirty_until_its_spill_lands():
    # Found by the simulator: a put larger than the RAM cap went straight to the
    # spill queue untracked, so a flush said durable while it was lost.
    result = simulate(RunOptions(seed=15, faults=frozenset({"misdirect"}), batch_rows=1))
    assert not [v for v in result.violations if v.invariant == "durable_means_covered"], result.violations


def test_cli_prints_the_seed_first_a_summary_and_json_last(capsys):
    status = main(["simulate", "--seed", "4", "--runs", "3", "--faults", "none", "--json"])
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert status == 0
    assert lines[0] == "SEED=4"
    summary = json.loads(lines[-1])
    assert summary["runs"] == 3 and summary["failed"] == 0 and len(summary["journal_digest"]) == 64
    assert "simulation summary" in captured.err


def test_cli_failure_names_the_seed_the_invariant_and_the_replay_command(capsys):
    status = main(["simulate", "--seed", "0", "--runs", "2", "--mutate", "skip-dir-fsync", "--json"])
    captured = capsys.readouterr()
    assert status == EXIT_CORRECTNESS
    summary = json.loads(captured.out.splitlines()[-1])
    failure = summary["failures"][0]
    assert failure["invariant"] in {"durable_is_on_disk", "durable_prefix_survives"}
    assert failure["replay"].startswith(f"kvcellar simulate --seed {failure['seed']} --runs 1")
    assert "--mutate skip-dir-fsync" in failure["replay"]
    assert "replay: kvcellar simulate" in captured.err
    replayed = main(failure["replay"].split()[1:])
    assert replayed == EXIT_CORRECTNESS


def test_cli_rejects_unknown_faults_and_workloads(capsys):
    assert main(["simulate", "--seed", "1", "--faults", "gremlins"]) == 2
    assert "unknown fault gremlins" in capsys.readouterr().err
    assert main(["simulate", "--seed", "1", "--workload", "huge"]) == 2
    assert "unknown workload" in capsys.readouterr().err


def test_cli_keep_leaves_a_cache_directory_the_inspection_tools_read(tmp_path, capsys):
    keep = tmp_path / "kept"
    assert main(["simulate", "--seed", "9", "--faults", "none", "--keep", str(keep)]) == 0
    capsys.readouterr()
    fingerprint_dir = keep / "sim-fingerprint"
    assert (fingerprint_dir / "journal.sqlite").is_file()
    entry_files = sorted(fingerprint_dir.glob("*/*.kvc"))
    assert entry_files
    assert main(["journal", "verify", str(fingerprint_dir)]) == 0
    assert main(["kv", "verify", str(entry_files[0])]) == 0
    output = capsys.readouterr().out
    assert "ok" in output.lower()


def test_small_workloads_are_really_small():
    assert all(shape.steps <= 8 for shape in SMALL_SHAPES.values())


def test_a_real_tiny_model_runs_inline(model_dir_factory):
    model_dir = model_dir_factory("llama", "tiny", "float32")
    result = simulate(RunOptions(seed=2, real_model_dir=Path(model_dir), shape=SMALL_SHAPES["chat"]))
    assert result.ok, result.violations
    assert result.requests > 0 and result.claims_checked > 0


def _result_with(kinds: list[str]):
    from kvcellar.simulations.harness import RunResult
    from kvcellar.simulations.observer import Violation

    return RunResult(
        seed=0,
        violations=[Violation(invariant="x", detail="", kind=kind) for kind in kinds],
        journal_digest="00",
        disk_digest="",
        disk_ops=0,
        workload_ops=0,
        crashes=0,
        restarts=0,
        requests=0,
        flushes=0,
        durable_flushes=0,
        claims_checked=0,
        sim_time_s=0.0,
    )


@pytest.mark.parametrize(
    "kinds,code",
    [([], 0), (["liveness"], 4), (["crash"], 5), (["crash", "liveness"], 4), (["liveness", "correctness"], 3)],
)
def test_exit_codes_tell_correctness_liveness_and_crash_failures_apart(kinds, code):
    from kvcellar.simulations.sweep import SweepOutcome

    outcome = SweepOutcome(results=[(_result_with(kinds), None), (_result_with([]), None)])
    assert outcome.exit_code() == code
