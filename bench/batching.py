"""Benchmark: aggregate decode tokens/s of kvcellar's batch lane for 1, 2, 4 and 8
concurrent clients, against kvcellar's serial lane (`--batch 1`) and `mlx_lm.server`
(its own continuous batching) at the same concurrency, same model, same prompts, one run.

The three servers run one at a time as subprocesses on 127.0.0.1 (kvcellar without an SSD
tier, so no background writes share the CPUs). Each session starts with a warm-up round
at the highest concurrency, then for each client count runs `--rounds` pairs of rounds.
In a round every client sends one greedy streaming `/v1/completions` request at once,
each with its own prompt of `--prompt-tokens` pseudo-words (no prompt shares a prefix with
another or repeats); a pair is a short round (`max_tokens` 1: prefill and request
overhead) and a long one (`max_tokens` = `--new-tokens`). The aggregate decode rate is
the long rounds' tokens after each client's first, summed, over the long round's wall
time less the short round's (medians over the pairs). Timing by wall clock, not by the
first streamed chunk: the demo models' replies are often partial UTF-8 that servers
hold back, so a first content chunk can arrive only at the end. Targets (from the
issue): batch / serial >= 1.8x at 4 clients, batch / mlx_lm.server >= 1.0x at 4 clients.

Before the servers, the bare model's decode step is timed in this process at each
client count as a row count (no server, no sampling): rows / step time over one row's
rate is the most any batching can gain on the machine (`forward_ceiling_N`).

    python -m kvcellar.bench.batching [--clients 1,2,4,8] [--new-tokens 128] [--rounds 3] [--json] [--write-docs]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import click
import httpx
import mlx.core as mx
import mlx_lm
import trio
from mlx_lm.models.cache import make_prompt_cache
from rich.console import Console
from tokenizers import Tokenizer

from kvcellar.bench.common import (
    Figures,
    describe_machine,
    docs_markers,
    machine_sentence,
    model_option,
    publish,
    publish_options,
    scratch_dir_option,
    scratch_with_model,
)
from kvcellar.bench.compare_mlx_lm import (
    KVCELLAR,
    MLX_LM,
    REQUEST_TIMEOUT_S,
    OthersCpu,
    ServerProcess,
    stream_request,
    text_of_tokens,
)
from kvcellar.engine.demo_models import DEMO_ARCH

SERIAL, BATCH = "serial", "batch"
# (key, server, extra flags): kvcellar's two lanes and mlx_lm.server with its defaults.
SESSIONS = ((SERIAL, KVCELLAR, ("--batch", "1")), (BATCH, KVCELLAR, ("--batch", "8")), (MLX_LM, MLX_LM, ()))
LABELS = {SERIAL: "kvcellar --batch 1", BATCH: "kvcellar --batch 8", MLX_LM: "mlx_lm.server"}
TARGET_RATIO_4, TARGET_VS_MLX_LM_4 = 1.8, 1.0
# small: per-step overhead dominates a decode step on this CPU build, as weight reads do on
# a GPU, and batching amortises both; medium is closer to compute-bound here (see the docs).
MODEL_SIZES = ("small",)
DEMO_SIZES = ("tiny", "small", "medium")
WARMUP_NEW_TOKENS = 8
FORWARD_STEPS, FORWARD_WARMUP_STEPS = 20, 3
OTHERS_CPUS_DISTURBING = 0.1
OPTION_KEYS = ("clients", "prompt_tokens", "new_tokens", "rounds", "passes", "seed")
DOCS_NAME = "batching"
DOCS_BEGIN, DOCS_END = docs_markers(DOCS_NAME)


def parse_clients(value: str) -> tuple[int, ...]:
    try:
        counts = tuple(sorted({int(part) for part in value.split(",") if part.strip()}))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of client counts") from None
    if not counts or counts[0] < 1:
        raise click.BadParameter("client counts must be positive integers")
    return counts


async def run_round(base: str, prompts: list[str], new_tokens: int) -> dict[str, Any]:
    """Every prompt as its own client at once: the round's wall time and token counts."""
    replies: list[dict[str, Any]] = [{} for _ in prompts]

    async def client(index: int) -> None:
        # stream_request is synchronous; each client gets a thread so they really overlap.
        replies[index] = await trio.to_thread.run_sync(_request, base, prompts[index], new_tokens)

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for index in range(len(prompts)):
            nursery.start_soon(client, index)
    return {"wall_s": time.perf_counter() - started, "completion_tokens": [r["completion_tokens"] for r in replies]}


def _request(base: str, prompt: str, new_tokens: int) -> dict[str, Any]:
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        return stream_request(client, f"{base}/v1/completions", {"prompt": prompt, "max_tokens": new_tokens})


def decode_steps_by_rows(server: ServerProcess) -> Counter[int]:
    if server.name != KVCELLAR:
        return Counter()
    history = httpx.get(f"{server.base}/stats", timeout=30).json()["scheduler"].get("batch_size_history", {})
    return Counter({int(rows): steps for rows, steps in history.items()})


def mean_rows(before: Counter[int], after: Counter[int]) -> float | None:
    steps = after - before
    total = sum(steps.values())
    return sum(rows * count for rows, count in steps.items()) / total if total else None


def run_session(key: str, setup: dict[str, Any], progress: Console, pass_index: int) -> dict[str, Any]:
    """Start one server, warm it up, run every client count's pairs of rounds, stop it."""
    _, name, flags = next(session for session in SESSIONS if session[0] == key)
    progress.print(f"{LABELS[key]}, pass {pass_index + 1}: starting")
    others = OthersCpu()
    server = ServerProcess(name, setup["model_dir"], None, setup["workdir"] / f"{key}-{pass_index}.log", flags)
    try:
        trio.run(run_round, server.base, setup["warmup_prompts"], WARMUP_NEW_TOKENS)
        rounds: dict[str, Any] = {}
        for clients in setup["clients"]:
            rounds[str(clients)] = measure(server, setup, clients)
            rate = decode_figures([rounds[str(clients)]])["decode_tok_s"]
            progress.print(f"  {clients} clients: {rate or 0:.1f} tok/s")
        others_cpus = others.cpus(server.process.pid)
        exit_status = server.stop()
    finally:
        server.kill()
    return {"rounds": rounds, "start_s": server.start_s, "others_cpus": others_cpus, "exit_status": exit_status}


def measure(server: ServerProcess, setup: dict[str, Any], clients: int) -> dict[str, Any]:
    """The pairs of rounds for one client count, with the decode steps kvcellar's batch lane took."""
    short, long, steps = [], [], Counter[int]()
    for r in range(setup["rounds"]):
        short.append(trio.run(run_round, server.base, setup["prompts"][(clients, r, "short")], 1))
        before = decode_steps_by_rows(server)
        long.append(trio.run(run_round, server.base, setup["prompts"][(clients, r, "long")], setup["new_tokens"]))
        steps += decode_steps_by_rows(server) - before
    return {
        "short_rounds": short,
        "long_rounds": long,
        "decode_steps_by_rows": {str(rows): count for rows, count in sorted(steps.items())},
    }


def decode_figures(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """The decode rate of one server at one client count, over every pass's pairs of rounds."""
    short = [r["wall_s"] for cell in cells for r in cell["short_rounds"]]
    long = [r for cell in cells for r in cell["long_rounds"]]
    steps = sum((Counter({int(k): v for k, v in cell["decode_steps_by_rows"].items()}) for cell in cells), Counter())
    decode_s = statistics.median(r["wall_s"] for r in long) - statistics.median(short)
    decode_tokens = statistics.median(sum(n - 1 for n in r["completion_tokens"]) for r in long)
    steps_per_round = sum(steps.values()) / len(long)
    return {
        "decode_tok_s": decode_tokens / decode_s if decode_s > 0 and decode_tokens > 0 else None,
        "decode_tokens": decode_tokens,
        "decode_s": decode_s,
        "pairs": len(long),
        "mean_rows_per_decode_step": mean_rows(Counter(), steps),
        # About: the decode time is a difference of medians, the steps an average.
        "decode_step_ms": decode_s / steps_per_round * 1000 if steps_per_round and decode_s > 0 else None,
    }


def forward_step_ms(
    model_dir: Path, row_counts: tuple[int, ...], context_tokens: int, steps: int = FORWARD_STEPS
) -> dict[str, float]:
    """Milliseconds of one decode step of the bare model with each number of rows,
    over a cache of `context_tokens` per row (MLX on this process's own thread)."""
    model = mlx_lm.load(str(model_dir))[0]
    times: dict[str, float] = {}
    for rows in row_counts:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.zeros((rows, context_tokens), dtype=mx.int32), cache=cache))
        step = mx.zeros((rows, 1), dtype=mx.int32)
        for _ in range(FORWARD_WARMUP_STEPS):
            mx.eval(model(step, cache=cache))
        started = time.perf_counter()
        for _ in range(steps):
            mx.eval(model(step, cache=cache))
        times[str(rows)] = (time.perf_counter() - started) / steps * 1000
    del model, cache
    mx.clear_cache()
    return times


def build_setup(model_dir: Path, workdir: Path, options: dict[str, Any]) -> dict[str, Any]:
    if not (model_dir / "tokenizer.json").is_file():
        raise click.ClickException(f"{model_dir} has no tokenizer.json to size the prompts with")
    tokenizer, seed, size = (
        Tokenizer.from_file(str(model_dir / "tokenizer.json")),
        options["seed"],
        options["prompt_tokens"],
    )
    top = max(options["clients"])
    # One distinct prompt per (client count, round, kind, client), the same for every server.
    prompts = {
        (clients, r, kind): [
            text_of_tokens(tokenizer, size, seed + 10_000 * clients + 100 * r + 50 * k + c) for c in range(clients)
        ]
        for clients in options["clients"]
        for r in range(options["rounds"])
        for k, kind in enumerate(("short", "long"))
    }
    warmup = [text_of_tokens(tokenizer, size, seed + 999_000 + c) for c in range(top)]
    return {"model_dir": model_dir, "workdir": workdir, **options, "prompts": prompts, "warmup_prompts": warmup}


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def summarise(
    sessions: dict[str, dict[str, Any]], options: dict[str, Any], forward_ms: dict[str, float]
) -> dict[str, Any]:
    rate = {
        key: {int(c): figures["decode_tok_s"] for c, figures in session["by_clients"].items()}
        for key, session in sessions.items()
    }
    lone_ms = forward_ms[str(min(options["clients"]))] / min(options["clients"])
    result: dict[str, Any] = {
        **{f"forward_ceiling_{c}": c * lone_ms / forward_ms[str(c)] for c in options["clients"]},
        "forward_step_ms": forward_ms,
        **{f"ratio_{c}": _ratio(rate[BATCH][c], rate[SERIAL][c]) for c in options["clients"]},
        **{f"vs_mlx_lm_{c}": _ratio(rate[BATCH][c], rate[MLX_LM][c]) for c in options["clients"]},
        "decode_tok_s": {key: {str(c): value for c, value in by_c.items()} for key, by_c in rate.items()},
        "sessions": sessions,
        "options": {key: options[key] for key in OPTION_KEYS},
        "others_cpus_max": max(session["others_cpus"] for session in sessions.values()),
    }
    ratio_4, vs_4 = result.get("ratio_4"), result.get("vs_mlx_lm_4")
    result["targets_met"] = {
        "ratio_4_ge_1.8": ratio_4 is not None and ratio_4 >= TARGET_RATIO_4,
        "vs_mlx_lm_4_ge_1.0": vs_4 is not None and vs_4 >= TARGET_VS_MLX_LM_4,
    }
    return result


def _fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}{suffix}"


FIGURE_COLUMNS = (
    "clients",
    *(f"{LABELS[key]} tok/s" for key, _, _ in SESSIONS),
    "batch / serial",
    "batch / mlx_lm.server",
    "rows per decode step (batch)",
    "bare model forward vs 1 row (ceiling)",
)


def figure_rows(result: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = []
    for clients in result["options"]["clients"]:
        batch = result["sessions"][BATCH]["by_clients"][str(clients)]
        rows.append(
            (
                str(clients),
                *(_fmt(result["decode_tok_s"][key][str(clients)]) for key, _, _ in SESSIONS),
                _fmt(result[f"ratio_{clients}"], 2, "x"),
                _fmt(result[f"vs_mlx_lm_{clients}"], 2, "x"),
                _fmt(batch["mean_rows_per_decode_step"], 2),
                _fmt(result[f"forward_ceiling_{clients}"], 2, "x"),
            )
        )
    return rows


def summary_lines(result: dict[str, Any]) -> list[str]:
    options, met, sessions = result["options"], result["targets_met"], result["sessions"]
    return [
        f"model: {result['model']}; {options['prompt_tokens']}-token prompts, {options['new_tokens']} new tokens "
        f"per client (greedy; fewer when a reply hits EOS); {options['rounds']} pairs of rounds per cell in each of "
        f"{options['passes']} passes per server, medians",
        f"batch / serial at 4 clients: {_fmt(result.get('ratio_4'), 2, 'x')} (target >= {TARGET_RATIO_4}x: "
        f"{'met' if met['ratio_4_ge_1.8'] else 'MISSED'}); batch / mlx_lm.server at 4 clients: "
        f"{_fmt(result.get('vs_mlx_lm_4'), 2, 'x')} (target >= {TARGET_VS_MLX_LM_4}x: "
        f"{'met' if met['vs_mlx_lm_4_ge_1.0'] else 'MISSED'})",
        "others' CPUs, worst pass per server: "
        + ", ".join(f"{LABELS[key]} {sessions[key]['others_cpus']:.2f}" for key, _, _ in SESSIONS),
    ]


def interpretation(result: dict[str, Any]) -> str:
    """One paragraph built from the figures."""
    clients = result["options"]["clients"]
    low, top = str(min(clients)), str(max(clients))
    serial_rates = [result["decode_tok_s"][SERIAL][str(c)] or 0 for c in clients]
    batch = result["sessions"][BATCH]["by_clients"]
    rows, step_ms, lone_ms = (
        batch[top]["mean_rows_per_decode_step"],
        batch[top]["decode_step_ms"],
        batch[low]["decode_step_ms"],
    )
    step_sentence = ""
    if rows and step_ms and lone_ms and rows > 1:
        step_sentence = (
            f" and took about {step_ms:.1f} ms against {lone_ms:.1f} ms with {low} client(s): each "
            f"row beyond the first added about {(step_ms - lone_ms) / (rows - 1) / lone_ms:.0%} of a "
            f"lone step, which is what the batch lane's gain is made of"
        )
    ceiling_4, ratio_4 = result.get("forward_ceiling_4"), result.get("ratio_4")
    ceiling_sentence = ""
    if ceiling_4 and ratio_4:
        ceiling_sentence = (
            f"The bare model's decode step with 4 rows yields {ceiling_4:.2f}x the tokens/s of one row (last "
            f"column, timed without any server): the most batching can gain on this machine, whichever server "
            f"does it"
            + (
                f", and below the {TARGET_RATIO_4}x target, because a step's cost here grows almost in proportion "
                f"to its rows (MLX's CPU matmul on this build computes each row at a few GFLOP/s, with no weight "
                f"reads to share as on a GPU)"
                if ceiling_4 < TARGET_RATIO_4
                else ""
            )
            + f". The batch lane's {ratio_4:.2f}x over the serial lane also includes the serial lane's own "
            f"per-token overhead, which the batch lane shares among rows and pipelines. "
        )
    return ceiling_sentence + (
        f"The serial lane decodes one request at a time, so its aggregate rate stays near its single-client rate "
        f"({min(serial_rates):.1f}-{max(serial_rates):.1f} tok/s across client counts). The batch lane decodes "
        f"every active row in one step: at {top} clients its steps averaged {_fmt(rows, 2)} rows{step_sentence}. "
        f"mlx_lm.server runs the same mlx-lm BatchGenerator behind its own HTTP server; at 4 clients it decoded "
        f"{_fmt(result['decode_tok_s'][MLX_LM].get('4'))} tok/s against kvcellar's "
        f"{_fmt(result['decode_tok_s'][BATCH].get('4'))}. "
        + (
            f"Other processes kept up to {result['others_cpus_max']:.2f} CPUs busy during a session, so the figures "
            f"carry that noise; the passes alternate the servers' order, so it can fall on any of them."
            if result["others_cpus_max"] > OTHERS_CPUS_DISTURBING
            else "The machine was otherwise idle during the run (others' CPUs above)."
        )
    )


def model_figures(figures: dict[str, Any]) -> Figures:
    """One model's table, every column right-aligned."""
    return Figures(
        title=f"Aggregate decode tokens/s, {figures['model']}",
        columns=FIGURE_COLUMNS,
        rows=figure_rows(figures),
        summary=summary_lines(figures),
        text_columns=(),
    )


def markdown_section(result: dict[str, Any], command: str, run_date: str) -> str:
    """The docs section: one table per model, the first model's figures being the JSON's top level."""
    machine = result["machine"]
    lines = [
        "## Batch lane: aggregate decode tokens/s against the serial lane and mlx_lm.server",
        "",
        f"Run {run_date} with `{command}` (wall time {result['wall_s']:.0f} s; the servers ran one at a time).",
        "",
        machine_sentence(machine, f" (CPU), mlx-lm {result['mlx_lm_version']}."),
    ]
    for figures in (result, *result["other_models"]):
        lines += [
            "",
            f"### {figures['model']}",
            "",
            *model_figures(figures).markdown(),
            "",
            interpretation(figures),
        ]
    return "\n".join(lines)


def run_benchmark(model_dir: Path, options: dict[str, Any], workdir: Path, progress: Console) -> dict[str, Any]:
    """Every server once per pass, in reverse order on odd passes, so drift over the run
    falls on all of them alike; each cell combines its pairs of rounds from all passes."""
    setup = build_setup(model_dir, workdir, options)
    progress.print("timing the bare model's decode step")
    forward_ms = forward_step_ms(model_dir, options["clients"], options["prompt_tokens"])
    keys = [key for key, _, _ in SESSIONS]
    runs: dict[str, list[dict[str, Any]]] = {key: [] for key in keys}
    for pass_index in range(options["passes"]):
        for key in keys if pass_index % 2 == 0 else keys[::-1]:
            runs[key].append(run_session(key, setup, progress, pass_index))
    sessions = {
        key: {
            "by_clients": {
                str(c): decode_figures([run["rounds"][str(c)] for run in runs[key]]) for c in options["clients"]
            },
            "passes": runs[key],
            "others_cpus": max(run["others_cpus"] for run in runs[key]),
            "exit_status": [run["exit_status"] for run in runs[key]],
        }
        for key in keys
    }
    return summarise(sessions, options, forward_ms)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--clients",
    type=parse_clients,
    default="1,2,4,8",
    show_default=True,
    help="Comma-separated concurrent client counts; ratio_N and vs_mlx_lm_N come out for each N.",
)
@click.option(
    "--prompt-tokens",
    type=click.IntRange(min=4),
    default=64,
    show_default=True,
    help="Tokens of each client's prompt (short, so decode dominates).",
)
@click.option(
    "--new-tokens",
    type=click.IntRange(min=2),
    default=128,
    show_default=True,
    help="max_tokens of every request (greedy).",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Rounds per client count; figures are medians.",
)
@click.option(
    "--passes",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Times each server runs, in alternating order; a cell's median spans all passes.",
)
@click.option(
    "--sizes",
    type=click.Choice(DEMO_SIZES),
    multiple=True,
    default=MODEL_SIZES,
    show_default=True,
    help=f"Demo {DEMO_ARCH} sizes to run, each a full benchmark (repeat the flag for more); the first "
    f"gives the top-level figures. Ignored with --model.",
)
@model_option(
    f"An mlx-lm model directory with tokenizer.json; default: fresh offline demo {DEMO_ARCH} "
    f"models of --sizes made in a temporary directory."
)
@scratch_dir_option("the server logs")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the prompts' pseudo-words.")
@publish_options(DOCS_BEGIN, DOCS_END)
def main(
    model_dir: Path | None,
    directory: Path | None,
    as_json: bool,
    write_docs: bool,
    sizes: tuple[str, ...],
    **options: Any,
) -> None:
    """Aggregate decode tokens/s: kvcellar's batch lane against its serial lane and mlx_lm.server."""
    started = time.perf_counter()
    console = Console() if sys.stdout.isatty() else Console(width=180)
    progress = Console(stderr=True)
    models = []
    for size in sizes if model_dir is None else sizes[:1]:
        with scratch_with_model("batching", directory, model_dir, progress, size=size) as scratch:
            figures = run_benchmark(scratch.model_dir, options, scratch.workdir, progress)
        figures["model"] = scratch.model_described
        models.append(figures)
        model_figures(figures).show(console)
    result = {
        **models[0],
        "other_models": models[1:],
        "machine": describe_machine(scratch.base),
        "mlx_lm_version": mlx_lm.__version__,
        "wall_s": time.perf_counter() - started,
    }
    publish(
        DOCS_NAME,
        result,
        lambda command, run_date: markdown_section(result, command, run_date),
        write_docs=write_docs,
        as_json=as_json,
        console=console,
        progress=progress,
    )


if __name__ == "__main__":
    main()
