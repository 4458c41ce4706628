"""Benchmark: how fast the simulator runs. Simulated runs per second over a
seed sweep (default workload, mixed faults; each seed draws its lane), the
same seeds forced onto each lane, crash points per second over the crash
images of every crash point of the small workloads (one run per seed, a
recovery per image: `simulations/crash_images.py`), and crash-point runs per
second over their exhaustive enumeration as full runs (workload, crash,
recovery, the rest of the workload, invariant checks). Each rate is also
given per CPU second: on a shared machine that is what a quiet one would show.

Target: at least 100 crash points per second; the other figures size the
default test sweep and tell how long a long sweep takes. Run `python -m kvcellar.bench.simulation --help`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from kvcellar.bench.common import (
    Figures,
    describe_machine,
    docs_markers,
    docs_section,
    load_note,
    publish_figures,
    publish_options,
)
from kvcellar.simulations.sweep import SweepPlan, run_sweep
from kvcellar.simulations.workload import SMALL_SHAPES

DOCS_BEGIN, DOCS_END = docs_markers("simulation")


# Crash points checked per second (issue 43): what lets `make test` cover 10^4 of them.
CRASH_POINTS_PER_S_TARGET = 100

# Forced lanes over the same seeds: what a run costs on each (1 = the serial lane).
LANE_ROWS = {"serial": 1, "batch": 4}


def _timed_sweep(plan: SweepPlan) -> tuple[Any, float]:
    started = time.perf_counter()
    outcome = run_sweep(plan)
    return outcome, time.perf_counter() - started


def _crash_sweeps(plans: list[SweepPlan]) -> dict[str, Any]:
    """Crash points, images recovered, failures, wall and CPU seconds over `plans`."""
    points, recoveries, failures = 0, 0, 0
    started, cpu_started = time.perf_counter(), time.process_time()
    for plan in plans:
        outcome = run_sweep(plan)
        points += outcome.crash_points
        recoveries += outcome.image_recoveries
        failures += len(outcome.failures)
    return {
        "points": points,
        "recoveries": recoveries,
        "failures": failures,
        "s": time.perf_counter() - started,
        "cpu_s": time.process_time() - cpu_started,
    }


def _rate(count: int, seconds: float) -> float:
    return round(count / seconds, 2) if seconds else 0.0


def measure(seeds: int, crash_workloads: tuple[str, ...], image_seeds: int, progress: Console) -> dict[str, Any]:
    progress.print(f"sweeping {seeds} seeds (default workload, mixed faults, each seed's own lane)")
    sweep, sweep_s = _timed_sweep(SweepPlan(seed=0, runs=seeds, faults="mixed"))
    results = [result for result, _ in sweep.results]
    lanes = sweep.lane_counts()
    failures = len(sweep.failures)
    lane_runs_per_s = {}
    for lane, rows in LANE_ROWS.items():
        progress.print(f"the same seeds, all on the {lane} lane")
        forced, forced_s = _timed_sweep(SweepPlan(seed=0, runs=seeds, faults="mixed", batch_rows=rows))
        failures += len(forced.failures)
        lane_runs_per_s[lane] = round(seeds / forced_s, 2)
    progress.print(f"the crash image of every crash point of {image_seeds} seeds of {', '.join(crash_workloads)}")
    images = _crash_sweeps(
        [
            SweepPlan(seed=index + 1, runs=image_seeds, faults="none", shape_name=name, crash_points="images")
            for index, name in enumerate(crash_workloads)
        ]
    )
    # The machine's load while the images ran: a shared 2-CPU machine can halve the wall-clock rate.
    images_load_average = os.getloadavg()[0]
    progress.print(f"every crash point of {', '.join(crash_workloads)} as a run of its own")
    runs = _crash_sweeps(
        [
            SweepPlan(seed=index + 1, runs=1, faults="none", shape_name=name, crash_points="all")
            for index, name in enumerate(crash_workloads)
        ]
    )
    failures += images["failures"] + runs["failures"]
    return {
        "seeds": seeds,
        "sweep_s": round(sweep_s, 3),
        "runs_per_s": round(seeds / sweep_s, 2),
        "batch_lane_seeds": lanes["batch_lane_runs"],
        "runs_per_s_by_lane": lane_runs_per_s,
        "shared_decode_steps": lanes["shared_decode_steps"],
        "disk_ops_per_run": round(sum(r.disk_ops for r in results) / max(1, len(results)), 1),
        "requests_per_run": round(sum(r.requests for r in results) / max(1, len(results)), 1),
        "image_seeds": image_seeds,
        "crash_points": images["points"],
        "image_recoveries": images["recoveries"],
        "crash_images_s": round(images["s"], 3),
        "crash_points_per_s": _rate(images["points"], images["s"]),
        "crash_points_per_cpu_s": _rate(images["points"], images["cpu_s"]),
        "images_load_average": round(images_load_average, 2),
        "crash_point_runs": runs["points"],
        "crash_s": round(runs["s"], 3),
        "crash_runs_per_s": _rate(runs["points"], runs["s"]),
        "crash_runs_per_cpu_s": _rate(runs["points"], runs["cpu_s"]),
        "failed_runs": failures,
        "crash_workloads": list(crash_workloads),
    }


def _with_cpu(result: dict[str, Any], name: str) -> str:
    return f"{result[f'{name}_per_s']} ({result[f'{name}_per_cpu_s']})"


def markdown_section(result: dict[str, Any], command: str, run_date: str) -> str:
    machine = result["machine"]
    rows = [
        ("seeds swept (default workload, mixed faults)", f"{result['seeds']} in {result['sweep_s']} s"),
        ("simulated runs per second", str(result["runs_per_s"])),
        (
            "seeds that drew the batch lane / decode steps rows shared",
            f"{result['batch_lane_seeds']} / {result['shared_decode_steps']}",
        ),
        *(
            (f"runs per second, the same seeds all on the {lane} lane", str(rate))
            for lane, rate in result["runs_per_s_by_lane"].items()
        ),
        ("disk operations / requests per run", f"{result['disk_ops_per_run']} / {result['requests_per_run']}"),
        (
            f"crash points checked as images ({result['image_seeds']} seeds each of "
            f"{', '.join(result['crash_workloads'])}) / images recovered",
            f"{result['crash_points']} in {result['crash_images_s']} s / {result['image_recoveries']}",
        ),
        ("crash points per second (per CPU second)", _with_cpu(result, "crash_points")),
        (
            f"crash-point runs (one seed each of {', '.join(result['crash_workloads'])})",
            f"{result['crash_point_runs']} in {result['crash_s']} s",
        ),
        ("crash-point runs per second (per CPU second)", _with_cpu(result, "crash_runs")),
        ("failed runs", str(result["failed_runs"])),
    ]
    columns = ("measure", "value")
    return docs_section(
        "Simulator throughput",
        [
            f"Run {run_date} with `{command}` on {machine['cpu_model']} ({machine['cpus']} CPUs), Python "
            f"{machine['python']}, mlx {machine['mlx']}. Target: at least {CRASH_POINTS_PER_S_TARGET} crash points "
            f"per second ({'met' if result['crash_points_per_s'] >= CRASH_POINTS_PER_S_TARGET else 'missed'} at "
            f"{result['crash_points_per_s']}; {result['crash_points_per_cpu_s']} per CPU second), so that the "
            "default test run covers 10^4 crash points; the other figures size the default test sweep. "
            f"Load average as the images ended: {result['images_load_average']:.1f}; {load_note()}"
        ],
        Figures(title="simulator throughput", columns=columns, rows=rows, text_columns=columns),
        [
            "Each run is the real store, actors, prompt cache and journal on `SimDisk` under a MockClock: "
            "workload, crashes, recovery and every invariant checker. A crash point is a disk operation (or "
            "journal commit) at which the power fails. A crash image checks it with one recovery: a crashed copy "
            "of the disk and journal taken before that operation, recovered and checked as a run's end is "
            "(index, journal, a fresh scan, a second recovery, every durable claim restored byte-identical), while "
            "the run goes on uncrashed; a crash-point run replays the workload to that operation, crashes, "
            "recovers the whole system and runs the rest of the workload. The forced-lane rows run the same seeds, "
            "so their ratio is what the "
            "batch lane costs a run; on a shared 2-CPU VM repeated runs of this command have differed by up to a "
            "third, so compare figures within one run."
        ],
    )


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--seeds", type=click.IntRange(min=1), default=100, show_default=True, help="Seeds in the sweep.")
@click.option(
    "--crash-workloads",
    default="chat,fork,hybrid",
    show_default=True,
    help="Small workloads whose every crash point is run (comma list; empty for none).",
)
@click.option(
    "--image-seeds",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Seeds of each crash workload whose every crash point is checked as an image.",
)
@publish_options(DOCS_BEGIN, DOCS_END)
def main(seeds: int, crash_workloads: str, image_seeds: int, as_json: bool, write_docs: bool) -> None:
    """Measure simulated runs per second, crash points per second (images) and crash-point runs per second."""
    names = tuple(name.strip() for name in crash_workloads.split(",") if name.strip())
    unknown = sorted(set(names) - SMALL_SHAPES.keys())
    if unknown:
        raise click.BadParameter(f"unknown workload {', '.join(unknown)}; choose from {', '.join(SMALL_SHAPES)}")
    console = Console() if sys.stdout.isatty() else Console(width=140)
    progress = Console(stderr=True)
    result = measure(seeds, names, image_seeds, progress)
    result["machine"] = describe_machine(Path.cwd())
    rows = [(key, str(value)) for key, value in result.items() if key != "machine"]
    publish_figures(
        "simulation",
        result,
        Figures(title="simulator throughput", columns=("measurement", "value"), rows=rows),
        lambda command, run_date: markdown_section(result, command, run_date),
        write_docs=write_docs,
        as_json=as_json,
        console=console,
        progress=progress,
    )


if __name__ == "__main__":
    main()
