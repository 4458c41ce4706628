"""Benchmark: the live tier's layouts (issue 19). Paged KV on vs off (spec §6):

- batch 1: decode tokens/s of one request, paged over plain (the gather adds a
  copy per step: a small regression is expected and reported as measured);
- mixed rows: 4 and 8 rows of mlx-lm's `BatchGenerator` (what the batch lane
  runs), one `--long-tokens` row beside `--short-tokens` rows, paged over
  plain: aggregate decode tokens/s and the KV bytes the batch holds (plain:
  every row padded to the longest; paged: each row's own blocks);
- admission: the most such rows (one long, the rest short) the same
  `--kv-budget` admits, through the Scheduler's own core and projection, paged
  over plain; the budget is what the plain lane needs for 4 rows.

All in one process on the demo llama (`--size`, default small), paged and
plain measured alternately in the same run. Each measurement is one function
of `MEASUREMENTS` that adds its figures to the result; `--json` prints them as
one object on the last line, with `paged_decode_ratio_b1` and
`paged_rows_admitted_ratio` among them. The quantized half (`bench/quant_batch.py`:
kv4 rows batched against the serial lane, on the demo llama medium, whose head
dim kv4's groups of 64 divide) adds `quant_batch_ratio_4` and `kv_bytes_vs_bf16`;
`--no-quant-batch` leaves it out.

    python -m kvcellar.bench.live_layouts [--long-tokens 2048] [--short-tokens 64] [--json] [--write-docs]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import attrs
import click
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache
from rich.console import Console

from kvcellar.actors.scheduler import row_projected_kv_bytes
from kvcellar.actors.scheduler_core import SchedulerCore, Submit, padded_kv_bytes, summed_kv_bytes
from kvcellar.bench import quant_batch
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
from kvcellar.engine.engine import prefill
from kvcellar.engine.paged_kv import BLOCK_SIZE_DEFAULT, PagedKv
from kvcellar.store.scheme import KvScheme, warm_up_prototype_caches

DOCS_BEGIN, DOCS_END = docs_markers("live_layouts")
ADMISSION_ROWS_MAX = 256
PLAIN_ROWS_BUDGETED = 4
PREFILL_STEP_TOKENS = 512


@attrs.frozen(kw_only=True)
class Shape:
    long_tokens: int
    short_tokens: int
    new_tokens: int
    rounds: int
    block_size: int
    row_counts: tuple[int, ...]


@attrs.frozen(kw_only=True)
class Context:
    model: Any
    shape: Shape
    paged_kv: PagedKv
    progress: Console


def _prompt(row: int, tokens: int) -> list[int]:
    return [(7 * j + 31 * row + (j * j) % 97) % 1000 + 3 for j in range(tokens)]


def _alternating_bursts(
    context: Context, step_plain: Callable[[], None], step_paged: Callable[[], None]
) -> tuple[float, float]:
    """Median seconds per decode step of each layout, timed in alternating
    bursts of `new_tokens` steps (`rounds` each), so load that other work puts
    on a shared machine falls on both alike."""
    plain: list[float] = []
    paged: list[float] = []
    for _ in range(context.shape.rounds):
        for step, times in ((step_plain, plain), (step_paged, paged)):
            started = time.perf_counter()
            for _ in range(context.shape.new_tokens):
                step()
            times.append((time.perf_counter() - started) / context.shape.new_tokens)
    return statistics.median(plain), statistics.median(paged)


def _serial_stepper(context: Context, paged: bool) -> Callable[[], None]:
    """One request after a `long_tokens` prompt: a function that runs one greedy decode step."""
    shape, model = context.shape, context.model
    cache = make_prompt_cache(model)
    if paged:
        cache = context.paged_kv.page(cache, shape.long_tokens + shape.rounds * shape.new_tokens + 1)
    logits = prefill(model, _prompt(0, shape.long_tokens), cache)
    token = [mx.argmax(logits, axis=-1)]

    def step() -> None:
        logits = model(token[0].reshape(1, 1), cache=cache)[:, -1, :]
        token[0] = mx.argmax(logits, axis=-1)
        mx.eval(token[0])

    step()
    return step


def measure_paged_decode_b1(context: Context) -> dict[str, Any]:
    plain_s, paged_s = _alternating_bursts(
        context, _serial_stepper(context, paged=False), _serial_stepper(context, paged=True)
    )
    plain_rate, paged_rate = 1 / plain_s, 1 / paged_s
    context.progress.print(f"batch 1: plain {plain_rate:.1f} tok/s, paged {paged_rate:.1f} tok/s")
    return {
        "plain_decode_tok_s_b1": round(plain_rate, 2),
        "paged_decode_tok_s_b1": round(paged_rate, 2),
        "paged_decode_ratio_b1": round(paged_rate / plain_rate, 3),
    }


def _mixed_batch(context: Context, rows: int, paged: bool) -> BatchGenerator:
    """`rows` rows (one long, the rest short) in mlx-lm's BatchGenerator, all decoding."""
    shape, model = context.shape, context.model
    prompts = [_prompt(row, shape.long_tokens if row == 0 else shape.short_tokens) for row in range(rows)]
    generator = BatchGenerator(
        model, completion_batch_size=rows, prefill_batch_size=rows, prefill_step_size=PREFILL_STEP_TOKENS
    )
    # Enough that no row finishes before the bursts end: short rows decode during the long row's prefill chunks.
    max_tokens = shape.rounds * shape.new_tokens + -(-shape.long_tokens // PREFILL_STEP_TOKENS) + 8
    caches = [
        context.paged_kv.page(make_prompt_cache(model), len(prompt) + max_tokens) if paged else None
        for prompt in prompts
    ]
    # A plain row's None (a fresh cache) is what mlx-lm takes, which its annotation does not say.
    generator.insert_segments(
        [[p] for p in prompts], max_tokens=[max_tokens] * rows, caches=cast("list[list[Any]]", caches)
    )
    while len(generator._generation_batch) < rows:  # prefill until every row decodes
        generator.next()
    generator.next()
    return generator


def measure_paged_mixed_rows(context: Context) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for rows in context.shape.row_counts:
        plain, paged = _mixed_batch(context, rows, paged=False), _mixed_batch(context, rows, paged=True)
        try:
            plain_bytes, paged_bytes = plain.prompt_cache_nbytes, paged.prompt_cache_nbytes
            plain_s, paged_s = _alternating_bursts(context, plain.next, paged.next)
            if len(plain._generation_batch) < rows or len(paged._generation_batch) < rows:
                raise click.ClickException("a row finished during the timed bursts: the rates would be wrong")
        finally:
            plain.close()
            paged.close()
        plain_rate, paged_rate = rows / plain_s, rows / paged_s
        figures |= {
            f"plain_decode_tok_s_{rows}": round(plain_rate, 2),
            f"paged_decode_tok_s_{rows}": round(paged_rate, 2),
            f"paged_decode_ratio_{rows}": round(paged_rate / plain_rate, 3),
            f"plain_kv_bytes_{rows}": plain_bytes,
            f"paged_kv_bytes_{rows}": paged_bytes,
            f"paged_kv_bytes_ratio_{rows}": round(paged_bytes / plain_bytes, 3),
        }
        context.progress.print(
            f"{rows} mixed rows: plain {plain_rate:.1f} tok/s {plain_bytes / 1e6:.1f} MB, "
            f"paged {paged_rate:.1f} tok/s {paged_bytes / 1e6:.1f} MB"
        )
    return figures


def _rows_admitted(budget_bytes: int, row_bytes: list[int], billing: Callable[..., int]) -> int:
    core = SchedulerCore(rows_max=ADMISSION_ROWS_MAX, kv_budget_bytes=budget_bytes, billing=billing)
    for request_id, kv_bytes in enumerate(row_bytes):
        core.handle(Submit(request_id=request_id, prompt_tokens=1, kv_bytes=kv_bytes), now=0.0)
    return len(core.active)


def measure_paged_rows_admitted(context: Context) -> dict[str, Any]:
    shape, scheme = context.shape, KvScheme.bf16()
    prototypes = warm_up_prototype_caches(context.model)
    lengths = [shape.long_tokens] + [shape.short_tokens] * (ADMISSION_ROWS_MAX - 1)
    tokens = [length + shape.new_tokens for length in lengths]
    plain_bytes = [row_projected_kv_bytes(scheme, prototypes, t, None) for t in tokens]
    paged_bytes = [row_projected_kv_bytes(scheme, prototypes, t, context.paged_kv) for t in tokens]
    budget_bytes = padded_kv_bytes(plain_bytes[:PLAIN_ROWS_BUDGETED])
    plain_rows = _rows_admitted(budget_bytes, plain_bytes, padded_kv_bytes)
    paged_rows = _rows_admitted(budget_bytes, paged_bytes, summed_kv_bytes)
    context.progress.print(f"admitted under {budget_bytes / 1e6:.1f} MB: plain {plain_rows}, paged {paged_rows}")
    return {
        "kv_budget_bytes": budget_bytes,
        "plain_rows_admitted": plain_rows,
        "paged_rows_admitted": paged_rows,
        "paged_rows_admitted_ratio": round(paged_rows / plain_rows, 3),
    }


# One function per measurement; each adds its figures (and headline keys) to the result.
MEASUREMENTS: tuple[Callable[[Context], dict[str, Any]], ...] = (
    measure_paged_decode_b1,
    measure_paged_mixed_rows,
    measure_paged_rows_admitted,
)


def measure(model_dir: Path, shape: Shape, progress: Console) -> dict[str, Any]:
    model = load(str(model_dir))[0]
    context = Context(model=model, shape=shape, paged_kv=PagedKv.with_block_size(shape.block_size), progress=progress)
    result: dict[str, Any] = {"shape": attrs.asdict(shape)}
    for measurement in MEASUREMENTS:
        result |= measurement(context)
    return result


def measure_quantized_half(directory: Path | None, progress: Console) -> dict[str, Any]:
    """The quantized half: 4 clients with kv4, batch against serial (its own
    scratch model, since kv4 needs a head dim that 64 divides)."""
    with scratch_with_model("quant-batch", directory, None, progress, size=quant_batch.MODEL_SIZE) as scratch:
        figures = quant_batch.measure_quant_batch(scratch.model_dir, progress=progress)
        return {
            "quant_batch_ratio_4": figures["quant_batch_ratio_4"],
            "kv_bytes_vs_bf16": figures["kv_bytes_vs_bf16"],
            "quant_batch": {**figures, "model": scratch.model_described},
        }


def quantized_summary(result: dict[str, Any]) -> list[str]:
    """The quantized half's lines (none when `--no-quant-batch` left it out)."""
    if "quant_batch_ratio_4" not in result:
        return []
    figures = result["quant_batch"]
    return [
        f"kv4, 4 clients, batch / serial lane (quant_batch_ratio_4): {result['quant_batch_ratio_4']:.2f}x "
        f"({figures['model']}; outputs equal: {figures['outputs_equal']})",
        f"kv4 KV bytes held / bf16 (kv_bytes_vs_bf16): {result['kv_bytes_vs_bf16']:.3f}",
    ]


def _mb(value: int) -> str:
    return f"{value / 1e6:.1f} MB"


def figure_rows(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows = [
        (
            "decode tok/s, batch 1",
            f"{result['plain_decode_tok_s_b1']:.1f}",
            f"{result['paged_decode_tok_s_b1']:.1f}",
            f"{result['paged_decode_ratio_b1']}x",
        )
    ]
    for count in result["shape"]["row_counts"]:
        rows += [
            (
                f"decode tok/s, {count} mixed rows",
                f"{result[f'plain_decode_tok_s_{count}']:.1f}",
                f"{result[f'paged_decode_tok_s_{count}']:.1f}",
                f"{result[f'paged_decode_ratio_{count}']}x",
            ),
            (
                f"KV bytes held, {count} mixed rows",
                _mb(result[f"plain_kv_bytes_{count}"]),
                _mb(result[f"paged_kv_bytes_{count}"]),
                f"{result[f'paged_kv_bytes_ratio_{count}']}x",
            ),
        ]
    rows.append(
        (
            f"rows admitted by a {_mb(result['kv_budget_bytes'])} KV budget",
            str(result["plain_rows_admitted"]),
            str(result["paged_rows_admitted"]),
            f"{result['paged_rows_admitted_ratio']}x",
        )
    )
    return rows


def markdown_section(result: dict[str, Any], command: str, run_date: str) -> str:
    machine, shape = result["machine"], result["shape"]
    rows = [f"| {name} | {plain} | {paged} | {ratio} |" for name, plain, paged, ratio in figure_rows(result)]
    quantized = [f"- {line}" for line in quantized_summary(result)]
    return "\n".join(
        [
            "## Live-tier layouts: paged KV on vs off",
            "",
            f"Run {run_date} with `{command}` on {machine['cpu_model']} ({machine['cpus']} CPUs, "
            f"{machine['memory_total']}), Python {machine['python']}, mlx {machine['mlx']} (CPU backend), "
            f"model {result['model']}. {load_note()}",
            "",
            f"Blocks of {shape['block_size']} tokens. Batch 1: one {shape['long_tokens']}-token prompt. Mixed "
            f"rows: one {shape['long_tokens']}-token row beside {shape['short_tokens']}-token rows in mlx-lm's "
            "BatchGenerator (the batch lane's engine), once every row decodes; KV bytes are what the batch's "
            "caches then hold (plain: every row padded to the longest, in 256-token steps; paged: each row's "
            "pools, sized from its prompt plus max_tokens). Rates: both layouts prefilled once, then "
            f"{shape['rounds']} alternating bursts of {shape['new_tokens']} decode steps each, medians. "
            "Admission: the Scheduler core with each layout's billing "
            f"(plain: rows x the largest row; paged: the sum of each row's whole blocks), one long row then "
            f"short ones, under the budget the plain lane needs for {PLAIN_ROWS_BUDGETED} such rows.",
            "",
            "| measure | plain | paged | paged / plain |",
            "|---|---|---|---|",
            *rows,
            "",
            f"At batch 1 paged decode runs at {result['paged_decode_ratio_b1']}x plain: a request's blocks are "
            "consecutive in its own pool, so attention reads them as one strided view, as it reads a plain "
            "KVCache's buffer; what remains is the write split at block boundaries. In mixed batches every step "
            "copies each row's blocks into one zero-padded transient tensor for the attention op (plain "
            "BatchKVCache keeps that padded tensor as its storage and copies nothing), which is the decode "
            "cost there; what paging removes is the held padding, and with it the budget a short row costs: "
            f"the same budget admits {result['paged_rows_admitted_ratio']}x the rows.",
            *(["", *quantized] if quantized else []),
        ]
    )


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--long-tokens", type=click.IntRange(min=2), default=2048, show_default=True)
@click.option("--short-tokens", type=click.IntRange(min=2), default=64, show_default=True)
@click.option("--new-tokens", type=click.IntRange(min=1), default=8, show_default=True, help="Decode steps a burst.")
@click.option("--rounds", type=click.IntRange(min=1), default=7, show_default=True, help="Bursts of each layout.")
@click.option("--rows", "row_counts", default="4,8", show_default=True, help="Row counts of the mixed batches.")
@click.option("--block-size", type=click.IntRange(min=1), default=BLOCK_SIZE_DEFAULT, show_default=True)
@click.option(
    "--size",
    type=click.Choice(["tiny", "small", "medium"]),
    default="small",
    show_default=True,
    help="Demo model size when --model is not given.",
)
@click.option(
    "--quant-batch/--no-quant-batch",
    default=True,
    show_default=True,
    help="Also measure kv4 rows batched against the serial lane (bench/quant_batch.py, the demo llama medium).",
)
@model_option("An mlx-lm model directory to run instead of the demo llama.")
@scratch_dir_option("the demo model")
@publish_options(DOCS_BEGIN, DOCS_END)
def main(
    long_tokens: int,
    short_tokens: int,
    new_tokens: int,
    rounds: int,
    row_counts: str,
    block_size: int,
    size: str,
    quant_batch: bool,
    model_dir: Path | None,
    directory: Path | None,
    as_json: bool,
    write_docs: bool,
) -> None:
    """Measure paged KV against plain KV on the live tier."""
    console = Console() if sys.stdout.isatty() else Console(width=140)
    progress = Console(stderr=True)
    try:
        counts = tuple(int(count) for count in row_counts.split(","))
    except ValueError as e:
        raise click.BadParameter(f"--rows takes comma-separated row counts, got {row_counts!r}") from e
    if any(count < 2 for count in counts):
        raise click.BadParameter("--rows: a mixed batch needs at least 2 rows")
    shape = Shape(
        long_tokens=long_tokens,
        short_tokens=short_tokens,
        new_tokens=new_tokens,
        rounds=rounds,
        block_size=block_size,
        row_counts=counts,
    )
    with scratch_with_model("live-layouts", directory, model_dir, progress, size=size) as scratch:
        result = measure(scratch.model_dir, shape, progress)
        result["model"] = scratch.model_described
        result["machine"] = describe_machine(scratch.workdir)
    if quant_batch:
        result |= measure_quantized_half(directory, progress)
    print_figures(
        "live-tier layouts: paged KV on vs off",
        ("measurement", "plain", "paged", "paged / plain"),
        figure_rows(result),
        [
            f"paged decode at batch 1: {result['paged_decode_ratio_b1']}x plain",
            f"rows the same KV budget admits: {result['paged_rows_admitted_ratio']}x plain",
            *quantized_summary(result),
        ],
        console,
    )
    publish(
        "live_layouts",
        result,
        lambda command, run_date: markdown_section(result, command, run_date),
        write_docs=write_docs,
        as_json=as_json,
        console=console,
        progress=progress,
    )


if __name__ == "__main__":
    main()
