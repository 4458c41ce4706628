"""Benchmark: decode speed of a long generation with write-behind on and off, and
the flush latency of the entry it leaves. Target (from the issue): decode tokens/s
on >= 0.99x off, same run, alternating; the flush latency is reported.

Every measurement is a fresh system on a fresh SSD directory, so both modes
prefill the same prompt cold; greedy, no stop tokens. Decode tokens/s is
(tokens - 1) / (arrival of the last token - arrival of the first) as the async
iterator hands them over; TTFT runs from calling `generate` to the first token.
Run `python -m kvcellar.bench.writebehind --help` for the options.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import click
import numpy as np
import trio
from rich.console import Console

from kvcellar.actors.system import SystemConfig, SystemSeams, open_system
from kvcellar.bench.common import (
    Figures,
    describe_machine,
    docs_markers,
    docs_section,
    machine_sentence,
    model_option,
    publish_figures,
    publish_options,
    scratch_dir_option,
    scratch_with_model,
)
from kvcellar.engine.demo_models import DEMO_ARCH, VOCAB_SIZE
from kvcellar.engine.engine import SamplingParams
from kvcellar.engine.generation import SNAPSHOT_PREFILL_TOKENS_MIN, GenerationDone, GenerationRequest, TokenDelta

MIB_BYTES = 1 << 20
TARGET_DECODE_RATIO = 0.99
# Ids 0-2 are the demo tokenizer's special tokens; prompts stay clear of them.
FIRST_ORDINARY_TOKEN_ID = 3
# A short generation first, so one-time costs of the process land in no measurement.
WARMUP_CONTEXT_TOKENS, WARMUP_NEW_TOKENS = 64, 8
MODEL_SIZE = "small"
# Other work above this many CPUs, on average over a decode, marks the run as disturbed.
OTHERS_CPUS_DISTURBING = 0.1
# Left at SystemConfig's defaults in every run; reported so the figures say what they ran under.
SETTINGS_REPORTED = ("debounce_s", "busy_rearm_s", "demote_idle_s", "prefill_step_tokens")
DOCS_BEGIN, DOCS_END = docs_markers("writebehind")
# Worker calls a flush makes besides its entries' writes: the journal catching up (once per flush).
FLUSH_CALLS_NOT_PER_ENTRY = ("wait_applied",)


class TimedBlocking:
    """`SystemSeams.run_blocking` as in production (a worker thread), noting the
    name and start of each call, so a flush's thread crossings can be counted."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

    async def __call__(self, fn: Any, *args: Any) -> Any:
        self.calls.append((getattr(fn, "__name__", type(fn).__name__), time.perf_counter()))
        return await trio.to_thread.run_sync(fn, *args)


def prompt_token_ids(count: int, seed: int, vocab_size: int = VOCAB_SIZE) -> tuple[int, ...]:
    rng = np.random.default_rng(seed)
    return tuple(int(token) for token in rng.integers(FIRST_ORDINARY_TOKEN_ID, vocab_size, count))


def _cpu_s_of_others() -> float:
    """CPU seconds of everything but this process (hypervisor steal included) since boot; 0 without /proc."""
    try:
        fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return 0.0
    user, nice, system, _, _, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK") - time.process_time()


def _decode_counters(system: Any) -> dict[str, float]:
    """Counters to difference over the decode, named for the differences."""
    ssd = system.stats()["ssd_cache"]
    return {
        "ssd_entries_written_during_decode": ssd["spills"],
        "ssd_bytes_written_during_decode": ssd["bytes"],
        "deferred_attempts_during_decode": system.durability.stats()["deferred_total"] if system.durability else 0,
        "others_cpu_s_during_decode": _cpu_s_of_others(),
    }


async def _stream_timed(system: Any, request: GenerationRequest, new_tokens: int) -> dict[str, Any]:
    """Arrival time of every token, SSD counters at the first and last token, and the done item."""
    arrivals: list[float] = []
    token_ids: list[int] = []
    counts: dict[str, dict[str, float]] = {}
    done: GenerationDone | None = None
    started = time.perf_counter()
    async for item in system.generate(request):
        if isinstance(item, TokenDelta) and item.token_id >= 0:
            arrivals.append(time.perf_counter())
            token_ids.append(item.token_id)
            if len(arrivals) == 1:
                counts["first"] = _decode_counters(system)
            if len(arrivals) == new_tokens:
                counts["last"] = _decode_counters(system)
        elif isinstance(item, GenerationDone):
            done = item
    if done is None or len(arrivals) < 2:
        raise click.ClickException(f"the generation produced {len(arrivals)} tokens, no decode to time")
    counts.setdefault("last", _decode_counters(system))
    return {"started": started, "arrivals": arrivals, "token_ids": token_ids, "counts": counts, "done": done}


async def _timed_flush(
    system: Any, turn_log: list[tuple[str, float, float]], blocking: TimedBlocking
) -> dict[str, Any]:
    """The flush's time, what it wrote, and its thread crossings: engine turns
    (the gateway's "step" turns) and worker calls (but the journal's catch-up)."""
    before, started = system.stats()["ssd_cache"], time.perf_counter()
    verdict = await system.flush()
    ended = time.perf_counter()
    seconds, after = ended - started, system.stats()["ssd_cache"]
    return {
        "s": seconds,
        "engine_turns": sum(1 for label, start, _ in turn_log if label == "step" and started <= start <= ended),
        "worker_calls": sum(
            1 for name, start in blocking.calls if started <= start <= ended and name not in FLUSH_CALLS_NOT_PER_ENTRY
        ),
        "durable": verdict.durable,
        "bytes": after["bytes"] - before["bytes"],
        "entries_written": after["spills"] - before["spills"],
        "entry_tokens": verdict.longest_durable_prefix_tokens,
    }


async def measure_generation(
    model_dir: Path, ssd_dir: Path, write_behind: bool, prompt: tuple[int, ...], new_tokens: int
) -> dict[str, Any]:
    """One generation on a fresh system; with write-behind on, the two flushes after it."""
    turn_log: list[tuple[str, float, float]] = []
    blocking = TimedBlocking()
    config = SystemConfig(model_dir=model_dir, ssd_dir=ssd_dir, write_behind=write_behind)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, stop_token_ids=frozenset())
    async with open_system(config, SystemSeams(turn_log=turn_log, run_blocking=blocking)) as system:
        streamed = await _stream_timed(system, GenerationRequest(prompt_ids=prompt, params=params), new_tokens)
        flush = await _timed_flush(system, turn_log, blocking) if write_behind else None
        idle_flush = await _timed_flush(system, turn_log, blocking) if write_behind else None
        durability_counters = system.durability.stats() if system.durability is not None else None
    arrivals, done, counts = streamed["arrivals"], streamed["done"], streamed["counts"]
    first_s, last_s = arrivals[0], arrivals[-1]
    differences = {key: counts["last"][key] - counts["first"][key] for key in counts["first"]}
    return {
        **differences,
        "write_behind": write_behind,
        "ttft_s": first_s - streamed["started"],
        "decode_tok_s": (len(arrivals) - 1) / (last_s - first_s),
        # Robust to a burst of other work: one slow gap moves the mean rate, not the median.
        "decode_tok_s_median_gap": 1 / statistics.median(np.diff(arrivals)),
        "tokens": len(arrivals),
        "cached_tokens": done.cached_tokens,
        "token_ids_hash": hash(tuple(streamed["token_ids"])),
        "background_steps_during_decode": sum(
            1 for label, start, _ in turn_log if label == "step" and first_s <= start <= last_s
        ),
        # In CPUs: 0 on an otherwise idle machine, 1 when other work kept one CPU busy throughout.
        "others_cpus_during_decode": differences["others_cpu_s_during_decode"] / (last_s - first_s),
        "flush": flush,
        "idle_flush": idle_flush,
        "durability_counters": durability_counters,
    }


def run_benchmark(model_dir: Path, options: dict[str, Any], workdir: Path, progress: Console) -> dict[str, Any]:
    """Warm up, then alternate on and off (the order swaps every repeat); figures as plain data."""

    def in_fresh_dir(ssd_dir: Path, write_behind: bool, prompt: tuple[int, ...], new_tokens: int) -> dict[str, Any]:
        try:
            return trio.run(measure_generation, model_dir, ssd_dir, write_behind, prompt, new_tokens)
        finally:
            shutil.rmtree(ssd_dir, ignore_errors=True)

    warmup_prompt = prompt_token_ids(WARMUP_CONTEXT_TOKENS, options["seed"] + 1)
    in_fresh_dir(workdir / "warmup", True, warmup_prompt, WARMUP_NEW_TOKENS)
    prompt = prompt_token_ids(options["context_tokens"], options["seed"])
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    for index in range(options["repeats"]):
        for mode in ("on", "off") if index % 2 == 0 else ("off", "on"):
            progress.print(f"repeat {index + 1}/{options['repeats']}: write-behind {mode}")
            run = in_fresh_dir(workdir / f"ssd-{mode}-{index}", mode == "on", prompt, options["new_tokens"])
            progress.print(f"  TTFT {run['ttft_s']:.2f} s, decode {run['decode_tok_s']:.1f} tok/s")
            runs[mode].append(run)
    return summarise(runs, options)


def _median_of(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(run[key] for run in runs)


DECODE_WINDOW_COUNTS = (
    "background_steps_during_decode",
    "ssd_entries_written_during_decode",
    "ssd_bytes_written_during_decode",
    "deferred_attempts_during_decode",
)


def summarise(runs: dict[str, list[dict[str, Any]]], options: dict[str, Any]) -> dict[str, Any]:
    on, off = runs["on"], runs["off"]
    defaults = SystemConfig(model_dir=Path("."))
    result: dict[str, Any] = {
        "decode_ratio_paired_median": statistics.median(
            run_on["decode_tok_s"] / run_off["decode_tok_s"] for run_on, run_off in zip(on, off, strict=True)
        ),
        "all_prefills_cold": all(run["cached_tokens"] == 0 for run in on + off),
        "same_tokens_every_run": len({run["token_ids_hash"] for run in on + off}) == 1,
        "context_tokens": options["context_tokens"],
        "new_tokens": options["new_tokens"],
        "repeats": options["repeats"],
        "seed": options["seed"],
        "settings": {name: getattr(defaults, name) for name in SETTINGS_REPORTED},
        "runs": {
            mode: [{key: value for key, value in run.items() if key != "token_ids_hash"} for run in mode_runs]
            for mode, mode_runs in runs.items()
        },
    }
    for mode, mode_runs in runs.items():
        for key in ("decode_tok_s", "decode_tok_s_median_gap", "ttft_s"):
            result[f"{key}_{mode}"] = _median_of(mode_runs, key)
    for name in ("flush", "idle_flush"):
        flushes = [run[name] for run in on]
        result.update(
            {
                f"{name}_s": _median_of(flushes, "s"),
                f"{name}_durable": all(f["durable"] for f in flushes),
                # Maxima: a single write by a flush that should have had nothing to do must show.
                f"{name}_bytes": max(f["bytes"] for f in flushes),
                f"{name}_entries_written": max(f["entries_written"] for f in flushes),
                f"{name}_entry_tokens": max(f["entry_tokens"] for f in flushes),
                f"{name}_engine_turns": max(f["engine_turns"] for f in flushes),
                f"{name}_worker_calls": max(f["worker_calls"] for f in flushes),
            }
        )
    result.update({key: sum(run[key] for run in on) for key in DECODE_WINDOW_COUNTS})
    result["decode_ratio"] = result["decode_tok_s_on"] / result["decode_tok_s_off"]
    result["decode_ratio_median_gap"] = result["decode_tok_s_median_gap_on"] / result["decode_tok_s_median_gap_off"]
    result["targets_met"] = {
        "decode_ratio_ge_0.99": result["decode_ratio"] >= TARGET_DECODE_RATIO,
        "no_background_work_during_decode": result["background_steps_during_decode"] == 0
        and result["ssd_entries_written_during_decode"] == 0,
    }
    return result


def _range(runs: list[dict[str, Any]], key: str, scale: float = 1.0, digits: int = 2) -> str:
    values = [run[key] * scale for run in runs]
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}"


FIGURE_COLUMNS = ("measurement", "median", "range", "note")


def figure_rows(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    runs, context = result["runs"], result["context_tokens"]
    flushes, idle_flushes = ([run[name] for run in runs["on"]] for name in ("flush", "idle_flush"))
    verdict = "met" if result["targets_met"]["decode_ratio_ge_0.99"] else "MISSED"
    return [
        (
            "decode, write-behind off (baseline)",
            f"{result['decode_tok_s_off']:.1f} tok/s",
            _range(runs["off"], "decode_tok_s", 1, 1),
            "baseline",
        ),
        (
            "decode, write-behind on",
            f"{result['decode_tok_s_on']:.1f} tok/s",
            _range(runs["on"], "decode_tok_s", 1, 1),
            f"{result['decode_ratio']:.3f}x off (target >= {TARGET_DECODE_RATIO}x: {verdict})",
        ),
        (
            f"TTFT, cold {context}-token prefill, off",
            f"{result['ttft_s_off']:.2f} s",
            _range(runs["off"], "ttft_s"),
            "",
        ),
        (
            f"TTFT, cold {context}-token prefill, on",
            f"{result['ttft_s_on']:.2f} s",
            _range(runs["on"], "ttft_s"),
            f"{result['ttft_s_on'] / result['ttft_s_off']:.3f}x off",
        ),
        (
            "flush after the generation (on)",
            f"{result['flush_s'] * 1000:.1f} ms",
            _range(flushes, "s", 1000, 1) + " ms",
            f"{result['flush_bytes'] / MIB_BYTES:.1f} MiB, entries written: {result['flush_entries_written']}, "
            f"longest {result['flush_entry_tokens']} tokens; durable={result['flush_durable']}",
        ),
        (
            "thread crossings of that flush (on)",
            f"{result['flush_engine_turns']} + {result['flush_worker_calls']}",
            "",
            f"engine turns + worker calls (maxima over the runs) for {result['flush_entries_written']} entries "
            "written: one turn per forced attempt (the written entry's turn also plans it and materialises "
            "every tensor), any idle-demotion turn due, one worker call per entry written",
        ),
        (
            "second flush, nothing dirty (on)",
            f"{result['idle_flush_s'] * 1000:.2f} ms",
            _range(idle_flushes, "s", 1000) + " ms",
            f"{result['idle_flush_bytes']} bytes, durable={result['idle_flush_durable']}",
        ),
        (
            "engine steps / SSD writes during decode (on)",
            f"{result['background_steps_during_decode']} / {result['ssd_entries_written_during_decode']}",
            "",
            f"sum over {result['repeats']} runs ({result['ssd_bytes_written_during_decode']} bytes); expected 0 / 0",
        ),
        (
            "timed attempts deferred during decode (on)",
            str(result["deferred_attempts_during_decode"]),
            "",
            "the coordinator found the gateway busy and re-armed",
        ),
    ]


def _others_cpus(result: dict[str, Any]) -> list[float]:
    return [run["others_cpus_during_decode"] for mode in ("on", "off") for run in result["runs"][mode]]


def summary_lines(result: dict[str, Any]) -> list[str]:
    pairs = ", ".join(
        f"{run_on['decode_tok_s'] / run_off['decode_tok_s']:.3f}"
        for run_on, run_off in zip(result["runs"]["on"], result["runs"]["off"], strict=True)
    )
    others = _others_cpus(result)
    return [
        f"model: {result['model']}; prompt {result['context_tokens']} random token ids (seed {result['seed']}), "
        f"greedy, {result['new_tokens']} new tokens, no stop tokens; every prefill cold: "
        f"{result['all_prefills_cold']}; same tokens in every run: {result['same_tokens_every_run']}",
        f"each run a fresh system on a fresh SSD directory; on and off alternate, the order swapping every "
        f"repeat; median of {result['repeats']} per mode; SystemConfig defaults otherwise: "
        + ", ".join(f"{name} {value}" for name, value in result["settings"].items()),
        f"decode ratio per repeat (on/off, same pair): {pairs}; median of pairs "
        f"{result['decode_ratio_paired_median']:.3f}",
        f"decode rate from the median gap between tokens: {result['decode_tok_s_median_gap_on']:.1f} tok/s on, "
        f"{result['decode_tok_s_median_gap_off']:.1f} off, ratio {result['decode_ratio_median_gap']:.3f}",
        f"other work during the decodes (CPU time of every other process and hypervisor steal, /proc/stat): "
        f"{min(others):.2f}-{max(others):.2f} CPUs of {result['machine']['cpus']}; whole run {result['wall_s']:.0f} s",
    ]


def interpretation(result: dict[str, Any]) -> str:
    """One paragraph, built from the figures."""
    met = result["targets_met"]["decode_ratio_ge_0.99"]
    quiet = result["targets_met"]["no_background_work_during_decode"]
    decode_runs = [run["decode_tok_s"] for mode in ("on", "off") for run in result["runs"][mode]]
    spread_pct = 100 * (max(decode_runs) - min(decode_runs)) / statistics.median(decode_runs)
    others = _others_cpus(result)
    return (
        f"With write-behind on, decode ran at {result['decode_ratio']:.3f}x the speed with it off "
        f"({result['decode_tok_s_on']:.1f} against {result['decode_tok_s_off']:.1f} tokens/s), which "
        f"{'meets' if met else 'misses'} the {TARGET_DECODE_RATIO}x target; decode rates of all runs spread "
        f"over {spread_pct:.1f}% of their median, so a smaller difference cannot be told from noise. "
        f"{'No' if quiet else 'Some'} background work ran during decode: "
        f"{result['background_steps_during_decode']} engine steps and "
        f"{result['ssd_entries_written_during_decode']} SSD writes between the first and the last token, while "
        f"the coordinator deferred {result['deferred_attempts_during_decode']} timed attempts in all because "
        f"the gateway was busy.{_snapshot_sentence(result)} The flush after the generation wrote "
        f"{result['flush_bytes'] / MIB_BYTES:.1f} MiB in {result['flush_s'] * 1000:.0f} ms "
        f"({result['flush_entries_written']} entries written, the longest {result['flush_entry_tokens']} "
        f"tokens), {'durable' if result['flush_durable'] else 'NOT durable'}; a second flush with nothing dirty "
        f"takes {result['idle_flush_s'] * 1000:.1f} ms. TTFT is the same cold prefill in both modes, before "
        f"write-behind has anything to do, so its gap ({result['ttft_s_on']:.1f} s on, {result['ttft_s_off']:.1f} s "
        f"off) shows run-to-run noise alone."
        + (
            f" Other work ran during the decodes ({min(others):.2f}-{max(others):.2f} CPUs of the "
            f"{result['machine']['cpus']} on average per decode), which widens the spread; the rate from the "
            f"median gap between tokens, less moved by bursts, gives a ratio of "
            f"{result['decode_ratio_median_gap']:.3f}."
            if max(others) > OTHERS_CPUS_DISTURBING
            else ""
        )
    )


def _snapshot_sentence(result: dict[str, Any]) -> str:
    if result["context_tokens"] < SNAPSHOT_PREFILL_TOKENS_MIN:
        return ""
    counters = result["runs"]["on"][0]["durability_counters"]
    return (
        f" So the prompt-boundary snapshot put after the cold prefill is not written during the request; once it "
        f"ends, the final put (prompt plus the tokens fed back, trimmable) supersedes it in RAM. The first run's "
        f"coordinator counted {counters['puts_total']} puts, {counters['forced_attempts_total']} forced attempts, "
        f"{counters['stored_total']} stored, {counters['missing_total']} missing from RAM, "
        f"{counters['rechecked_covered_total']} "
        f"re-checked as covered by the stored entry."
    )


def markdown_section(result: dict[str, Any], command: str, run_date: str) -> str:
    machine = result["machine"]
    return docs_section(
        "Write-behind: decode speed on against off, flush latency",
        [
            f"Run {run_date} with `{command}` (median of {result['repeats']} repeats per mode; wall time "
            f"{result['wall_s']:.0f} s).",
            machine_sentence(machine, f" (CPU); SSD tier on {machine['filesystem']}."),
        ],
        figures(result),
        [interpretation(result)],
    )


def figures(result: dict[str, Any]) -> Figures:
    title = f"Write-behind, median of {result['repeats']} per mode"
    return Figures(title=title, columns=FIGURE_COLUMNS, rows=figure_rows(result), summary=summary_lines(result))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--context-tokens",
    type=click.IntRange(min=2),
    default=4096,
    show_default=True,
    help="Prompt length in tokens, prefilled cold in every run.",
)
@click.option(
    "--new-tokens",
    type=click.IntRange(min=2),
    default=512,
    show_default=True,
    help="Tokens generated per run (greedy, no stop tokens, so always this many).",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Runs per mode, on and off alternating; figures are medians.",
)
@model_option(
    f"An mlx-lm model directory; default: a fresh offline demo {DEMO_ARCH} {MODEL_SIZE} made in a temporary directory."
)
@scratch_dir_option("the runs' SSD tiers")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the prompt's random token ids.")
@publish_options(DOCS_BEGIN, DOCS_END)
def main(model_dir: Path | None, directory: Path | None, as_json: bool, write_docs: bool, **options: Any) -> None:
    """Time decode with write-behind on against off, and the flush that follows."""
    started = time.perf_counter()
    console = Console() if sys.stdout.isatty() else Console(width=140)
    progress = Console(stderr=True)
    with scratch_with_model("writebehind", directory, model_dir, progress, size=MODEL_SIZE) as scratch:
        result = run_benchmark(scratch.model_dir, options, scratch.workdir, progress)
    base, described = scratch.base, scratch.model_described
    result.update(model=described, machine=describe_machine(base), wall_s=time.perf_counter() - started)
    publish_figures(
        "writebehind",
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
