"""Benchmark: in-flight generation checkpoints (spec §5.7).

A long greedy generation (no stop tokens) with `--generation-checkpoint N`:

(a) decode tokens/s with checkpoints on against off, alternating, each run a
    fresh system on a fresh SSD directory (target: on >= 0.97x off);
(b) a process generating with checkpoints on is SIGKILLed once its newest
    durable checkpoint covers `--kill-at` of the tokens; a fresh process on the
    same directory sends the same request: its wall time to the full response
    against an uninterrupted cold run in a fresh process (target: <= 0.5x),
    and whether the outputs are equal;
(c) bytes written per checkpoint and per generation (from run (a) on).

Each process of (b) opens its system before the clock starts (model load and
the store's scan are start-up, not the request). Run
`python -m kvcellar.bench.checkpoints --help` for the options.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click
import trio
from rich.console import Console

from kvcellar.actors.system import SystemConfig, SystemSeams, open_system
from kvcellar.bench.common import (
    Figures,
    describe_machine,
    docs_markers,
    docs_section,
    load_note,
    machine_sentence,
    model_option,
    publish_figures,
    publish_options,
    scratch_dir_option,
    scratch_with_model,
)
from kvcellar.bench.writebehind import prompt_token_ids
from kvcellar.engine.demo_models import DEMO_ARCH
from kvcellar.engine.engine import SamplingParams
from kvcellar.engine.generation import GenerationDone, GenerationRequest, TokenDelta
from kvcellar.errors import KvCellarError
from kvcellar.store import kvfile

TARGET_DECODE_RATIO = 0.97
TARGET_RESUME_TIME_RATIO = 0.5
MODEL_SIZE = "medium"
MIB_BYTES = 1 << 20
KILL_POLL_S = 0.005
CHILD_DEADLINE_S = 600.0
DOCS_BEGIN, DOCS_END = docs_markers("checkpoints")
FIGURE_COLUMNS = ("measurement", "checkpoints on", "checkpoints off / cold", "ratio", "target", "note")


def _request(options: dict[str, Any]) -> GenerationRequest:
    params = SamplingParams(temperature=0.0, max_tokens=options["new_tokens"], stop_token_ids=frozenset())
    return GenerationRequest(prompt_ids=prompt_token_ids(options["context_tokens"], options["seed"]), params=params)


def _config(model_dir: Path, ssd_dir: Path, checkpoint_tokens: int) -> SystemConfig:
    return SystemConfig(model_dir=model_dir, ssd_dir=ssd_dir, generation_checkpoint_tokens=checkpoint_tokens)


async def _timed(system: Any, request: GenerationRequest) -> dict[str, Any]:
    arrivals: list[float] = []
    token_ids: list[int] = []
    done: GenerationDone | None = None
    started = time.perf_counter()
    async for item in system.generate(request):
        if isinstance(item, TokenDelta) and item.token_id >= 0:
            arrivals.append(time.perf_counter())
            token_ids.append(item.token_id)
        elif isinstance(item, GenerationDone):
            done = item
    assert done is not None and len(arrivals) > 1
    return {
        "wall_s": arrivals[-1] - started,
        "decode_tok_s": (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]),
        "token_ids": token_ids,
        "resumed_tokens": done.resumed_tokens,
    }


def _hold_the_engine_past(emitted_tokens_min: int) -> Any:
    """A checkpoint listener that stops the engine thread for good at the
    first checkpoint offered after one covering `emitted_tokens_min`: that one
    was handed to the writer (a worker thread writes it), and the generation
    can no longer complete (and invalidate it) before the parent's SIGKILL,
    however fast this machine decodes."""
    covered = threading.Event()
    never = threading.Event()

    def listener(what: str, request: Any, checkpoint: Any) -> None:
        if what != "offered":
            return
        if covered.is_set():
            never.wait()
        if checkpoint.emitted_tokens >= emitted_tokens_min:
            covered.set()

    return listener


async def _one_run(
    model_dir: Path,
    ssd_dir: Path,
    checkpoint_tokens: int,
    request: GenerationRequest,
    seams: SystemSeams | None = None,
) -> dict:
    async with open_system(_config(model_dir, ssd_dir, checkpoint_tokens), seams) as system:
        run = await _timed(system, request)
        await system.flush()
        run["checkpoints"] = system.stats()["checkpoints"]
    return run


def child(arguments_json: str) -> None:
    """A fresh process's part of (b): open the system, time the request, print the figures."""
    arguments = json.loads(arguments_json)
    request = _request(arguments["options"])
    hold_past = arguments.get("hold_past_tokens")
    seams = SystemSeams(checkpoint_listeners=(_hold_the_engine_past(hold_past),)) if hold_past else None
    run = trio.run(
        _one_run,
        Path(arguments["model_dir"]),
        Path(arguments["ssd_dir"]),
        arguments["checkpoint_tokens"],
        request,
        seams,
    )
    sys.stdout.write(json.dumps(run) + "\n")
    sys.stdout.flush()
    os._exit(0)  # as `serve` does: MLX's static destructors can abort at interpreter exit


def _child_process(
    model_dir: Path, ssd_dir: Path, options: dict[str, Any], hold_past_tokens: int | None = None
) -> subprocess.Popen:
    arguments = {
        "model_dir": str(model_dir),
        "ssd_dir": str(ssd_dir),
        "checkpoint_tokens": options["checkpoint_tokens"],
        "options": options,
        "hold_past_tokens": hold_past_tokens,
    }
    code = f"from kvcellar.bench.checkpoints import child; child({json.dumps(json.dumps(arguments))})"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def _child_run(model_dir: Path, ssd_dir: Path, options: dict[str, Any]) -> dict[str, Any]:
    process = _child_process(model_dir, ssd_dir, options)
    out, _ = process.communicate(timeout=CHILD_DEADLINE_S)
    if process.returncode != 0:
        raise click.ClickException(f"the benchmark's child process failed ({process.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def _newest_checkpoint_tokens(ssd_dir: Path) -> int:
    for path in ssd_dir.glob("*/checkpoints/*.kvc"):
        try:
            checkpoint = kvfile.read_header(path).generation_checkpoint
        except (KvCellarError, OSError):
            continue  # replaced under us: the next poll reads the new one
        if checkpoint is not None:
            return checkpoint.emitted_tokens
    return 0


def _kill_part_way(model_dir: Path, ssd_dir: Path, options: dict[str, Any]) -> int:
    """Run the request in a child and SIGKILL it once a durable checkpoint
    covers `kill_at` of the tokens; returns the checkpoint's emitted tokens."""
    wanted = int(options["kill_at"] * options["new_tokens"])
    # The child's engine stops at the checkpoint after the one covering `wanted`,
    # so the kill lands part-way whatever the decode speed (no race with completion).
    process = _child_process(model_dir, ssd_dir, options, hold_past_tokens=wanted)
    deadline = time.monotonic() + CHILD_DEADLINE_S
    while (emitted := _newest_checkpoint_tokens(ssd_dir)) < wanted:
        if process.poll() is not None or time.monotonic() > deadline:
            raise click.ClickException("the generation ended before the kill point")
        time.sleep(KILL_POLL_S)
    process.send_signal(signal.SIGKILL)
    process.wait()
    return emitted


def run_benchmark(model_dir: Path, options: dict[str, Any], workdir: Path, progress: Console) -> dict[str, Any]:
    request = _request(options)
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    for index in range(options["repeats"]):
        for mode in ("on", "off") if index % 2 == 0 else ("off", "on"):
            ssd_dir = workdir / f"decode-{mode}-{index}"
            tokens = options["checkpoint_tokens"] if mode == "on" else 0
            run = trio.run(_one_run, model_dir, ssd_dir, tokens, request)
            shutil.rmtree(ssd_dir, ignore_errors=True)
            progress.print(f"repeat {index + 1}: checkpoints {mode}: decode {run['decode_tok_s']:.1f} tok/s")
            runs[mode].append(run)
    progress.print("uninterrupted cold run in a fresh process")
    cold = _child_run(model_dir, workdir / "cold", options)
    progress.print(f"  {cold['wall_s']:.2f} s; now a run SIGKILLed at {options['kill_at']:.0%}")
    killed_at = _kill_part_way(model_dir, workdir / "killed", options)
    progress.print(f"  killed with a checkpoint at {killed_at} tokens; the same request in a fresh process")
    resumed = _child_run(model_dir, workdir / "killed", options)
    progress.print(f"  {resumed['wall_s']:.2f} s, {resumed['resumed_tokens']} tokens resumed")
    return summarise(runs, cold, resumed, killed_at, options)


def summarise(
    runs: dict[str, list[dict[str, Any]]],
    cold: dict[str, Any],
    resumed: dict[str, Any],
    killed_at: int,
    options: dict[str, Any],
) -> dict[str, Any]:
    on = statistics.median(run["decode_tok_s"] for run in runs["on"])
    off = statistics.median(run["decode_tok_s"] for run in runs["off"])
    stats = runs["on"][0]["checkpoints"]
    per_checkpoint = stats["written_bytes"] / stats["written"] if stats["written"] else 0.0
    decode_ratio, resume_ratio = on / off, resumed["wall_s"] / cold["wall_s"]
    return {
        "decode_ratio": decode_ratio,
        "decode_tok_s_on": on,
        "decode_tok_s_off": off,
        "decode_runs_tok_s": {mode: [run["decode_tok_s"] for run in runs[mode]] for mode in runs},
        "resume_time_ratio": resume_ratio,
        "cold_wall_s": cold["wall_s"],
        "resumed_wall_s": resumed["wall_s"],
        "resumed_tokens": resumed["resumed_tokens"],
        "killed_at_tokens": killed_at,
        "outputs_equal": resumed["token_ids"] == cold["token_ids"]
        and all(run["token_ids"] == cold["token_ids"] for mode in runs for run in runs[mode]),
        "checkpoints_written": stats["written"],
        "checkpoints_dropped": stats["dropped"],
        "checkpoint_bytes_mean": per_checkpoint,
        "generation_checkpoint_bytes": stats["written_bytes"],
        "targets_met": {
            "decode_ratio_ge_0.97": decode_ratio >= TARGET_DECODE_RATIO,
            "resume_time_ratio_le_0.5": resume_ratio <= TARGET_RESUME_TIME_RATIO,
        },
        **{name: options[name] for name in ("new_tokens", "context_tokens", "checkpoint_tokens", "repeats", "kill_at")},
    }


def figure_rows(result: dict[str, Any]) -> list[tuple[str, ...]]:
    met = result["targets_met"]
    per_checkpoint_mib = result["checkpoint_bytes_mean"] / MIB_BYTES
    per_generation_mib = result["generation_checkpoint_bytes"] / MIB_BYTES
    return [
        (
            "decode tokens/s (median)",
            f"{result['decode_tok_s_on']:.1f}",
            f"{result['decode_tok_s_off']:.1f}",
            f"{result['decode_ratio']:.3f}",
            f">= {TARGET_DECODE_RATIO}",
            "met" if met["decode_ratio_ge_0.97"] else "MISSED",
        ),
        (
            f"wall time to the full response after SIGKILL at {result['killed_at_tokens']} tokens (s)",
            f"{result['resumed_wall_s']:.2f}",
            f"{result['cold_wall_s']:.2f}",
            f"{result['resume_time_ratio']:.3f}",
            f"<= {TARGET_RESUME_TIME_RATIO}",
            ("met" if met["resume_time_ratio_le_0.5"] else "MISSED")
            + f"; {result['resumed_tokens']} tokens resumed, outputs equal: {result['outputs_equal']}",
        ),
        (
            "bytes per checkpoint (mean) / per generation (MiB)",
            f"{per_checkpoint_mib:.2f} / {per_generation_mib:.1f}",
            "-",
            "-",
            "reported",
            f"{result['checkpoints_written']} written, {result['checkpoints_dropped']} superseded in the queue",
        ),
    ]


def summary_lines(result: dict[str, Any]) -> list[str]:
    runs = result["decode_runs_tok_s"]
    return [
        f"model: {result['model']}; prompt {result['context_tokens']} random token ids, greedy, "
        f"{result['new_tokens']} new tokens, no stop tokens, --generation-checkpoint {result['checkpoint_tokens']}",
        f"decode runs (tok/s): on {', '.join(f'{v:.1f}' for v in runs['on'])}; "
        f"off {', '.join(f'{v:.1f}' for v in runs['off'])} (alternating, fresh system and directory each)",
        f"(b) cold and resumed runs each in a fresh process whose system is open before the clock starts; "
        f"killed once a durable checkpoint covered {result['kill_at']:.0%} of the tokens",
        f"whole run {result['wall_s']:.0f} s; {load_note()}",
    ]


def interpretation(result: dict[str, Any]) -> str:
    """One paragraph, built from the figures."""
    met = result["targets_met"]
    decode_runs = [rate for rates in result["decode_runs_tok_s"].values() for rate in rates]
    spread_pct = 100 * (max(decode_runs) - min(decode_runs)) / statistics.median(decode_runs)
    checkpoint_mib = result["checkpoint_bytes_mean"] / MIB_BYTES
    return (
        f"With checkpoints every {result['checkpoint_tokens']} tokens, decode ran at {result['decode_ratio']:.3f}x "
        f"the speed without ({result['decode_tok_s_on']:.1f} against {result['decode_tok_s_off']:.1f} tokens/s), "
        f"which {'meets' if met['decode_ratio_ge_0.97'] else 'misses'} the {TARGET_DECODE_RATIO}x target; the "
        f"decode rates of all runs spread over {spread_pct:.0f}% of their median, so on this shared machine a "
        f"difference smaller than that cannot be told from noise. Each checkpoint costs the engine thread one "
        f"snapshot of the caches and their materialisation into bytes ({checkpoint_mib:.1f} MiB on average "
        f"here, growing with the context); the file I/O runs on a worker thread. After a SIGKILL "
        f"with a durable checkpoint at {result['killed_at_tokens']} of {result['new_tokens']} tokens, the same "
        f"request in a fresh process returned its full response in {result['resume_time_ratio']:.3f}x the "
        f"uninterrupted cold run's time, which {'meets' if met['resume_time_ratio_le_0.5'] else 'misses'} the "
        f"{TARGET_RESUME_TIME_RATIO}x target; the outputs were {'equal' if result['outputs_equal'] else 'NOT equal'}."
    )


def figures(result: dict[str, Any]) -> Figures:
    return Figures(
        title="Generation checkpoints", columns=FIGURE_COLUMNS, rows=figure_rows(result), summary=summary_lines(result)
    )


def markdown_section(result: dict[str, Any], command: str, run_date: str) -> str:
    machine = result["machine"]
    return docs_section(
        "Generation checkpoints: decode on against off, resume after SIGKILL, bytes written",
        [
            f"Run {run_date} with `{command}`.",
            machine_sentence(
                machine,
                f" (CPU); SSD tier on {machine['filesystem']}. {load_note()}",
            ),
        ],
        figures(result),
        [interpretation(result)],
    )


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--new-tokens", type=click.IntRange(min=8), default=1024, show_default=True, help="Tokens generated.")
@click.option("--context-tokens", type=click.IntRange(min=2), default=64, show_default=True, help="Prompt tokens.")
@click.option(
    "--checkpoint-tokens", type=click.IntRange(min=1), default=64, show_default=True, help="Checkpoint interval."
)
@click.option("--repeats", type=click.IntRange(min=1), default=2, show_default=True, help="Decode runs per mode.")
@click.option(
    "--kill-at",
    type=click.FloatRange(0.05, 0.95),
    default=0.6,
    show_default=True,
    help="SIGKILL once a durable checkpoint covers this share of the tokens.",
)
@model_option(f"An mlx-lm model directory; default: a fresh offline demo {DEMO_ARCH} {MODEL_SIZE}.")
@scratch_dir_option("the runs' SSD tiers")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the prompt's random token ids.")
@publish_options(DOCS_BEGIN, DOCS_END)
def main(model_dir: Path | None, directory: Path | None, as_json: bool, write_docs: bool, **options: Any) -> None:
    """Time decode with generation checkpoints on against off, and a resume after SIGKILL."""
    started = time.perf_counter()
    console = Console() if sys.stdout.isatty() else Console(width=160)
    progress = Console(stderr=True)
    with scratch_with_model("checkpoints", directory, model_dir, progress, size=MODEL_SIZE) as scratch:
        result = run_benchmark(scratch.model_dir, options, scratch.workdir, progress)
    result.update(
        model=scratch.model_described, machine=describe_machine(scratch.base), wall_s=time.perf_counter() - started
    )
    publish_figures(
        "checkpoints",
        result,
        figures(result),
        lambda command, run_date: markdown_section(result, command, run_date),
        write_docs=write_docs,
        as_json=as_json,
        console=console,
        progress=progress,
    )


if __name__ == "__main__":
    main()
