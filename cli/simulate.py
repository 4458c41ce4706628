"""`kvcellar simulate`: deterministic crash/replay simulation of the real
store and actors (see docs/architecture.md, "Simulations")."""

from __future__ import annotations

import json
import random
import shutil
import sqlite3
import tempfile
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvcellar.errors import UsageError
from kvcellar.simulations.harness import CACHE_DIR, FINGERPRINT, SIM_ROOT, simulate
from kvcellar.simulations.sweep import SweepOutcome, SweepPlan, parse_faults, run_sweep
from kvcellar.store.journal import JOURNAL_FILE_NAME
from kvcellar.store.mutations import ALL_MUTATIONS


@click.command("simulate")
@click.option("--seed", type=int, default=None, help="First seed (default: drawn at random and printed).")
@click.option("--runs", type=click.IntRange(min=1), default=1, show_default=True, help="Seeds to run, from --seed on.")
@click.option(
    "--faults",
    default="mixed",
    show_default=True,
    help="none, all, mixed (a subset drawn per seed) or a comma list of fsync,enospc,eio,bitflip,misdirect.",
)
@click.option(
    "--crash-points",
    type=click.Choice(["all", "random", "images"]),
    default=None,
    help="Also crash at every disk operation of each seed's workload, or at one drawn at random (a run "
    "each); images: run each seed once and check recovery on a crashed copy before every disk operation.",
)
@click.option(
    "--crash-at",
    type=click.IntRange(min=1),
    default=None,
    help="Crash at this disk operation (replay); with --crash-points images, check only its image.",
)
@click.option(
    "--workload",
    "workload_name",
    default="default",
    show_default=True,
    help="default, or a small one: chat, fork, hybrid, checkpoints (long generations cut off by crashes), "
    "wipes (cache wipes beside spills), companion (a draft model: entries carry its caches as companion state).",
)
@click.option("--real-model", is_flag=True, help="Run the demo MLX model inline instead of the fake engine.")
@click.option(
    "--batch-rows",
    type=click.IntRange(min=1),
    default=None,
    help="Run every seed on the batch lane with up to this many rows (1: the serial lane); "
    "default: each seed draws its lane.",
)
@click.option(
    "--mutate",
    "mutate",
    multiple=True,
    type=click.Choice(sorted(ALL_MUTATIONS)),
    help="Switch a deliberate durability bug on (the checkers must catch it).",
)
@click.option(
    "--keep",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Leave the last run's disk image and journal here, laid out like --ssd-cache.",
)
@click.option("--json", "as_json", is_flag=True, help="End with one JSON object on the last line.")
@click.option(
    "--shared-tier",
    is_flag=True,
    help="Run the shared cold tier's object-store model instead (conditional puts, listing lag, lost "
    "uploads, corrupted and deleted objects): only --seed, --runs and --json apply.",
)
@click.pass_context
def simulate_command(
    ctx: click.Context,
    seed: int | None,
    runs: int,
    faults: str,
    crash_points: str | None,
    crash_at: int | None,
    workload_name: str,
    real_model: bool,
    batch_rows: int | None,
    mutate: tuple[str, ...],
    keep: Path | None,
    as_json: bool,
    shared_tier: bool,
) -> None:
    """Run the real store and actors on a simulated disk under a seeded
    workload, inject crashes and faults, recover, and check the invariants.

    Exit status: 0 all invariants held, 3 a correctness invariant failed,
    4 liveness (a flush never became durable once faults stopped), 5 the
    system raised an unexpected error, 2 bad arguments.
    """
    seed = seed if seed is not None else random.SystemRandom().randrange(10**6)
    click.echo(f"SEED={seed}")
    if shared_tier:
        ctx.exit(_simulate_shared_tier(seed, runs, as_json))
    plan = SweepPlan(
        seed=seed,
        runs=runs,
        faults=parse_faults(faults),
        crash_points=crash_points,
        crash_at_op=crash_at,
        shape_name=workload_name,
        real_model_dir=_real_model_dir() if real_model else None,
        mutations=frozenset(mutate),
        batch_rows=batch_rows,
    )
    plan.options(seed, None)  # validates the workload name before any run
    console = Console(stderr=True)
    outcome = _run_with_progress(plan, console, show=runs > 1 or crash_points is not None)
    _print_summary(plan, outcome, console)
    if outcome.failures:
        _print_failures(plan, outcome, console)
    if keep is not None:
        _keep(plan, outcome, keep, console)
    if as_json:
        click.echo(json.dumps(_summary_json(plan, outcome), sort_keys=True))
    ctx.exit(outcome.exit_code())


def _real_model_dir() -> Path:
    from kvcellar.engine.demo_models import ensure_demo_model

    return ensure_demo_model()


def _run_with_progress(plan: SweepPlan, console: Console, *, show: bool) -> SweepOutcome:
    if not show:
        return run_sweep(plan)
    columns = (TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("runs", total=plan.runs)

        def report(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        return run_sweep(plan, progress=report)


JOURNAL_ROWS = (
    ("entries stored", ("entry.stored",)),
    ("supersessions", ("entry.superseded",)),
    ("evictions", ("entry.evicted",)),
    ("quarantines", ("entry.quarantined",)),
    ("failed writes", ("entry.write_failed",)),
    ("dropped spills", ("spill.dropped",)),
    ("temp files reaped", ("entry.temp_reaped",)),
    ("reconcile corrections", ("reconcile.added", "reconcile.updated", "reconcile.removed")),
)


def _print_summary(plan: SweepPlan, outcome: SweepOutcome, console: Console) -> None:
    results = [result for result, _ in outcome.results]
    table = Table(title="simulation summary")
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        ("runs", len(results)),
        ("crash-point images" if plan.crash_points == "images" else "crash-point runs", outcome.crash_points),
        *((("images recovered", outcome.image_recoveries),) if plan.crash_points == "images" else ()),
        ("failed runs", len(outcome.failures)),
        *((name.replace("_", " "), value) for name, value in outcome.lane_counts().items()),
        ("requests", sum(r.requests for r in results)),
        ("flushes", sum(r.flushes for r in results)),
        ("durable flushes", sum(r.durable_flushes for r in results)),
        ("durable prefixes checked", sum(r.claims_checked for r in results)),
        ("crashes", sum(r.crashes for r in results)),
        ("restarts", sum(r.restarts for r in results)),
        ("disk operations", sum(r.disk_ops for r in results)),
        *(
            (f"journaled {label}", sum(r.journal_kinds.get(kind, 0) for r in results for kind in kinds))
            for label, kinds in JOURNAL_ROWS
        ),
        ("runs/s", f"{len(results) / outcome.elapsed_s:.1f}" if outcome.elapsed_s else "-"),
    ]
    for name, value in rows:
        table.add_row(name, str(value))
    console.print(table)


def _print_failures(plan: SweepPlan, outcome: SweepOutcome, console: Console) -> None:
    for result, point in outcome.failures[:5]:
        first = result.violations[0]
        console.print(
            f"[bold red]FAILED[/] seed {result.seed}"
            + (f" crash point {point}" if point is not None else "")
            + f": {first.invariant} ({first.kind})\n  {first.detail}"
        )
        console.print(f"  replay: {plan.replay_command(result.seed, point)}")
    if len(outcome.failures) > 5:
        console.print(f"... and {len(outcome.failures) - 5} more failed runs")


def _keep(plan: SweepPlan, outcome: SweepOutcome, keep: Path, console: Console) -> None:
    """Re-run the last (or first failing) run and export its final image."""
    result, point = outcome.failures[0] if outcome.failures else outcome.results[-1]
    # An image's crash is not the run's: keep the run that the images were taken from.
    kept = simulate(plan.options(result.seed, None if plan.crash_points == "images" else point), keep=True)
    if kept.kept_disk is None:
        raise UsageError("the run left no disk image to keep")
    export_image(kept.kept_disk, kept.kept_journal, keep)
    console.print(f"kept seed {result.seed}'s disk image and journal in {keep}")


def export_image(disk: Any, journal_image: bytes | None, target: Path) -> None:
    """Write the simulated cache directory to `target` like a server's
    `--ssd-cache` directory: `<target>/<fingerprint>/…` plus its journal."""
    with tempfile.TemporaryDirectory() as scratch:
        disk.export_to(Path(scratch))
        exported = Path(scratch) / CACHE_DIR.relative_to(SIM_ROOT)
        target.mkdir(parents=True, exist_ok=True)
        if exported.is_dir():
            shutil.copytree(exported, target, dirs_exist_ok=True)
    if journal_image:
        journal_path = target / FINGERPRINT / JOURNAL_FILE_NAME
        journal_path.parent.mkdir(parents=True, exist_ok=True)
        journal_path.unlink(missing_ok=True)
        source = sqlite3.connect(":memory:")
        source.deserialize(journal_image)
        destination = sqlite3.connect(journal_path)
        try:
            source.backup(destination)
        finally:
            destination.close()
            source.close()


def _summary_json(plan: SweepPlan, outcome: SweepOutcome) -> dict[str, Any]:
    results = [result for result, _ in outcome.results]
    failures = [
        {
            "seed": r.seed,
            "crash_at": p,
            "invariant": r.violations[0].invariant,
            "kind": r.violations[0].kind,
            "replay": plan.replay_command(r.seed, p),
        }
        for r, p in outcome.failures
    ]
    return {
        "seed": plan.seed,
        "runs": len(results),
        "crash_point_runs": outcome.crash_points,
        "image_recoveries": outcome.image_recoveries,
        "failed": len(failures),
        "failures": failures[:20],
        "journal_digest": outcome.journal_digest(),
        "disk_digest": results[0].disk_digest if len(results) == 1 else None,
        "requests": sum(r.requests for r in results),
        "durable_flushes": sum(r.durable_flushes for r in results),
        "claims_checked": sum(r.claims_checked for r in results),
        **outcome.lane_counts(),
        "elapsed_s": round(outcome.elapsed_s, 3),
        "runs_per_s": round(len(results) / outcome.elapsed_s, 2) if outcome.elapsed_s else None,
        "exit_code": outcome.exit_code(),
    }


def _simulate_shared_tier(seed: int, runs: int, as_json: bool) -> int:
    """`--shared-tier`: exit 0 when every restored shared entry was a committed,
    checksum-verified upload, 3 otherwise."""
    from kvcellar.simulations.shared_store import simulate_shared, summary

    result = summary(simulate_shared(seed, runs))
    console = Console(stderr=True)
    for name, value in result.items():
        if name != "failures":
            console.print(f"{name:>20}  {value}")
    for failure in result["failures"]:
        console.print(f"[red]{failure}[/red]")
    if as_json:
        click.echo(json.dumps(result, sort_keys=True))
    return 3 if result["failures"] else 0
