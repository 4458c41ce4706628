"""Benchmark: quantized KV in batch rows (spec §2.3). Aggregate tokens/s of N
concurrent clients (default 4) with `--kv-quant 4` on the batch lane against the
serial lane (`quant_batch_ratio_N`), and the KV bytes the RAM tier holds after
the same requests under kv4 against bf16 (`kv_bytes_vs_bf16`).

Three sessions run one after another in this process, each a real `open_system`
(no HTTP, no SSD tier) on the same model: kv4 serial (`--batch 1`), kv4 batch
(`--batch N`) and bf16 batch (the bytes baseline, and the cost of quantized
attention at the same batch). Each session starts with a warm-up round, then runs
`rounds` rounds; in a round every client sends one greedy request at once, each
with its own prompt of `prompt_tokens` token ids (no prompt shares a prefix with
another, so every row prefills cold). A round's aggregate rate is its completion
tokens over its wall time (prefill included: short prompts keep decode dominant);
figures are medians over the rounds. `outputs_equal` says whether the kv4 batch
gave exactly the serial lane's tokens (it must: tests/test_quant_batch.py).
`forward_ceiling_N` is the bare model's decode step with N rows against one
row's, timed without any server (bench/batching.py): the most any batching can
gain on the machine at that moment.

`--kv-quant 4` quantizes at group size 64, which must divide the head dim, so the
default model is the demo llama `medium` (head dim 64).

    python -m kvcellar.bench.quant_batch [--clients 4] [--new-tokens 32] [--rounds 2] [--json] [--write-docs]

`measure_quant_batch(model_dir, ...)` returns the figures for another benchmark
(bench/live_layouts.py) to include.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import click
import mlx_lm
import trio
from rich.console import Console

from kvcellar.actors.system import SystemConfig, open_system
from kvcellar.bench.batching import forward_step_ms
from kvcellar.bench.common import (
    describe_machine,
    docs_markers,
    load_note,
    model_option,
    print_figures,
    publish,
    publish_options,
    scratch_dir_option,
    scratch_with_model,
)
from kvcellar.engine.engine import SamplingParams
from kvcellar.engine.generation import GenerationDone, GenerationRequest

DOCS_NAME = "quant_batch"
DOCS_BEGIN, DOCS_END = docs_markers(DOCS_NAME)
MODEL_SIZE = "medium"
WARMUP_NEW_TOKENS = 4
# (key, --kv-quant, batch rows or None for the clients' count)
SERIAL_KV4, BATCH_KV4, BATCH_BF16 = "kv4 serial", "kv4 batch", "bf16 batch"
SESSIONS = ((SERIAL_KV4, "4", 1), (BATCH_KV4, "4", None), (BATCH_BF16, "bf16", None))
VOCAB_IDS_FIRST, VOCAB_IDS_SPAN = 3, 997


def _prompt(seed: int, tokens: int) -> tuple[int, ...]:
    """Token ids no other prompt of the run shares a prefix with: 7919 % 997 is no multiple
    of 997, so seeds under 997 apart begin with different ids."""
    return tuple(VOCAB_IDS_FIRST + (seed * 7919 + i * (2 * seed + 31)) % VOCAB_IDS_SPAN for i in range(tokens))


def _request(prompt: tuple[int, ...], new_tokens: int) -> GenerationRequest:
    return GenerationRequest(prompt_ids=prompt, params=SamplingParams(temperature=0.0, max_tokens=new_tokens))


async def _round(system: Any, prompts: list[tuple[int, ...]], new_tokens: int) -> dict[str, Any]:
    """Every prompt as its own client at once: wall time and each reply's tokens."""
    replies: list[list[int]] = [[] for _ in prompts]

    async def client(index: int) -> None:
        async for item in system.generate(_request(prompts[index], new_tokens)):
            if not isinstance(item, GenerationDone) and item.token_id >= 0:
                replies[index].append(item.token_id)

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for index in range(len(prompts)):
            nursery.start_soon(client, index)
    return {"wall_s": time.perf_counter() - started, "replies": replies}


def run_session(model_dir: Path, kv_quant: str, rows: int, options: dict[str, Any]) -> dict[str, Any]:
    """One system: a warm-up round, then the measured rounds; the tier's bytes after them."""
    clients, new_tokens = options["clients"], options["new_tokens"]
    config = SystemConfig(
        model_dir=model_dir, kv_quant=kv_quant, batch_rows_max=rows, demote_idle_s=0, shutdown_timeout_s=120
    )

    async def main() -> dict[str, Any]:
        async with open_system(config) as system:
            first_warmup_seed = options["seed"] + clients * options["rounds"]
            warmup = [_prompt(first_warmup_seed + c, options["prompt_tokens"]) for c in range(clients)]
            await _round(system, warmup, WARMUP_NEW_TOKENS)
            bytes_before = system.prompt_cache.stats()["bytes"]
            rounds = []
            for r in range(options["rounds"]):
                seeds = [options["seed"] + clients * r + c for c in range(clients)]
                rounds.append(await _round(system, [_prompt(s, options["prompt_tokens"]) for s in seeds], new_tokens))
            scheduler = system.stats()["scheduler"]
            return {
                "rounds": rounds,
                "tier_bytes": system.prompt_cache.stats()["bytes"] - bytes_before,
                "lane": scheduler["lane"],
                "batch_size_history": scheduler.get("batch_size_history", {}),
            }

    session = trio.run(main)
    rates = [sum(len(reply) for reply in r["replies"]) / r["wall_s"] for r in session["rounds"]]
    session["tok_s"] = statistics.median(rates)
    return session


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def measure_quant_batch(
    model_dir: Path,
    *,
    clients: int = 4,
    prompt_tokens: int = 64,
    new_tokens: int = 32,
    rounds: int = 2,
    seed: int = 0,
    progress: Console | None = None,
) -> dict[str, Any]:
    """The figures (module docstring): `quant_batch_ratio_<clients>`,
    `kv_bytes_vs_bf16`, `quant_vs_bf16_batch_<clients>`, `outputs_equal`, and each
    session's rate and lane. Runs on the caller's thread (each session is a `trio.run`)."""
    options = {"clients": clients, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "rounds": rounds}
    options["seed"] = seed
    if progress is not None:
        progress.print("timing the bare model's decode step")
    forward_ms = forward_step_ms(model_dir, (1, clients), prompt_tokens)
    sessions = {}
    for key, kv_quant, rows in SESSIONS:
        if progress is not None:
            progress.print(f"{key}: {clients} clients")
        sessions[key] = run_session(model_dir, kv_quant, rows or clients, options)
    serial, batch, plain = (sessions[key] for key, _, _ in SESSIONS)
    return {
        f"quant_batch_ratio_{clients}": _ratio(batch["tok_s"], serial["tok_s"]),
        f"quant_vs_bf16_batch_{clients}": _ratio(batch["tok_s"], plain["tok_s"]),
        "kv_bytes_vs_bf16": _ratio(batch["tier_bytes"], plain["tier_bytes"]),
        f"forward_ceiling_{clients}": clients * forward_ms["1"] / forward_ms[str(clients)],
        "outputs_equal": [r["replies"] for r in batch["rounds"]] == [r["replies"] for r in serial["rounds"]],
        "tok_s": {key: session["tok_s"] for key, session in sessions.items()},
        "tier_bytes": {key: session["tier_bytes"] for key, session in sessions.items()},
        "lanes": {key: session["lane"] for key, session in sessions.items()},
        "batch_size_history": {key: session["batch_size_history"] for key, session in sessions.items()},
        "options": options,
    }


def _fmt(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}{suffix}"


FIGURE_COLUMNS = ("session", "lane", "aggregate tok/s", "KV bytes in the RAM tier after the rounds")


def figure_rows(result: dict[str, Any]) -> list[tuple[str, ...]]:
    return [
        (key, result["lanes"][key], _fmt(result["tok_s"][key], 1), f"{result['tier_bytes'][key]:,}")
        for key, _, _ in SESSIONS
    ]


def summary_lines(result: dict[str, Any]) -> list[str]:
    options, clients = result["options"], result["options"]["clients"]
    return [
        f"model: {result['model']}; {clients} clients, {options['prompt_tokens']}-token prompts, "
        f"{options['new_tokens']} new tokens each (greedy), {options['rounds']} rounds per session, medians",
        f"kv4 batch / kv4 serial at {clients} clients (quant_batch_ratio_{clients}): "
        f"{_fmt(result[f'quant_batch_ratio_{clients}'], 2, 'x')}; kv4 batch / bf16 batch: "
        f"{_fmt(result[f'quant_vs_bf16_batch_{clients}'], 2, 'x')}",
        f"KV bytes held, kv4 / bf16 (kv_bytes_vs_bf16): {_fmt(result['kv_bytes_vs_bf16'], 3)}; "
        f"kv4 batch tokens equal the kv4 serial lane's: {result['outputs_equal']}",
        f"bare model decode step, {clients} rows against 1 (forward_ceiling_{clients}, the most batching can gain "
        f"here): {_fmt(result[f'forward_ceiling_{clients}'], 2, 'x')}",
    ]


def markdown_section(result: dict[str, Any], command: str, run_date: str) -> str:
    machine = result["machine"]
    return "\n".join(
        [
            "## Quantized KV in batch rows: `--kv-quant 4` batch against serial, and KV bytes against bf16",
            "",
            f"Run {run_date} with `{command}` (wall time {result['wall_s']:.0f} s; sessions one at a time, "
            "in process, no SSD tier).",
            "",
            f"Machine: {machine['cpus']} CPUs ({machine['cpu_model']}), {machine['memory_total']} RAM, "
            f"{machine['platform']}, Python {machine['python']}, MLX {machine['mlx']}, mlx-lm "
            f"{result['mlx_lm_version']}. {load_note()}",
            "",
            f"| {' | '.join(FIGURE_COLUMNS)} |",
            f"|{'|'.join('---:' for _ in FIGURE_COLUMNS)}|",
            *(f"| {' | '.join(row)} |" for row in figure_rows(result)),
            "",
            *(f"- {line}" for line in summary_lines(result)),
            "",
            interpretation(result),
        ]
    )


def interpretation(result: dict[str, Any]) -> str:
    """One paragraph built from the figures."""
    clients = result["options"]["clients"]
    ratio, ceiling = result[f"quant_batch_ratio_{clients}"], result[f"forward_ceiling_{clients}"]
    verdict = (
        f"the batch lane gained {_fmt(ratio, 2, 'x')} over the serial lane"
        if ratio is not None and ratio >= 1
        else f"the batch lane came out at {_fmt(ratio, 2, 'x')} of the serial lane, a loss"
    )
    return (
        f"Before this, `--kv-quant 4` forced the serial lane, so {clients} clients decoded one at a time; now "
        f"{verdict}. The bare model's decode step with {clients} rows yielded {_fmt(ceiling, 2, 'x')} the tokens/s "
        "of one row during the run: the most any batching could gain on this machine then, since MLX's CPU "
        "matmul pays for each row (a GPU shares the weight reads among rows). The batch lane prefills quantized "
        "rows one at a time, so each row converts exactly where the serial lane does, and decodes them together; "
        "kv4 against bf16 batch is the cost of quantized attention at the same batch. The KV ratio is 4-bit "
        "words plus a scale and a bias per 64-value group against the model's float32 KV: "
        "(0.5 + 8/64) / 4 = 0.156."
    )


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--clients", type=click.IntRange(min=2), default=4, show_default=True, help="Concurrent clients.")
@click.option("--prompt-tokens", type=click.IntRange(min=2), default=64, show_default=True, help="Prompt tokens.")
@click.option("--new-tokens", type=click.IntRange(min=2), default=32, show_default=True, help="max_tokens (greedy).")
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True, help="Measured rounds a session.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the prompts' token ids.")
@model_option(
    f"An mlx-lm model directory whose head dim 64 divides (kv4 groups of 64); default: the demo llama {MODEL_SIZE}."
)
@scratch_dir_option("the demo model")
@publish_options(DOCS_BEGIN, DOCS_END)
def main(model_dir: Path | None, directory: Path | None, as_json: bool, write_docs: bool, **options: Any) -> None:
    """Aggregate tokens/s of kv4 rows batched against the serial lane, and kv4 KV bytes against bf16."""
    started = time.perf_counter()
    console = Console() if sys.stdout.isatty() else Console(width=180)
    progress = Console(stderr=True)
    with scratch_with_model("quant-batch", directory, model_dir, progress, size=MODEL_SIZE) as scratch:
        figures = measure_quant_batch(scratch.model_dir, progress=progress, **options)
        machine = describe_machine(scratch.base)
    result = {
        **figures,
        "model": scratch.model_described,
        "machine": machine,
        "mlx_lm_version": mlx_lm.__version__,
        "wall_s": time.perf_counter() - started,
    }
    print_figures("Quantized KV in batch rows", FIGURE_COLUMNS, figure_rows(result), summary_lines(result), console)
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
