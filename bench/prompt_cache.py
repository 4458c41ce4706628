"""Benchmark: the RAM prompt cache (`PromptCache`) with a demo model, three measurements.

1. Time to first token (prompt token ids in hand -> first sampled token evaluated, through
   `engine.generate_tokens`) of a RAM prefix hit against a cold prefill, same run, per length.
2. `take()` latency (median, p99) with 1,000 conversation-shaped entries of tiny `KVCache`s on
   extending, branching and missing queries; `put()` latency filling the cache and at the cap.
3. RSS after 100 conversation turns under a 64 MiB cap, against 1.1x the cap above the baseline
   of the loaded, warmed-up model; with MLX's and the allocator's share of the difference.

    python -m kvcellar.bench.prompt_cache [--lengths 2048,8192] [--repeats 3] [--entries 1000]
        [--turns 100] [--cap-mib 64] [--model DIR | --model-size small] [--json] [--write-docs]
"""

from __future__ import annotations

import ctypes
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models.cache import KVCache, make_prompt_cache
from rich.console import Console

from kvcellar.bench.common import (
    Figures,
    describe_machine,
    docs_markers,
    docs_section,
    machine_sentence,
    model_option,
    publish_figures,
    publish_options,
)
from kvcellar.engine.demo_models import DEMO_ARCH, SIZES, VOCAB_SIZE, create_model
from kvcellar.engine.engine import PREFILL_STEP_TOKENS, SamplingParams, configure_host_allocator, generate_tokens
from kvcellar.store.lending import cache_arrays
from kvcellar.store.prompt_cache import PromptCache, logical_bytes

MIB_BYTES = 1 << 20
FIRST_ORDINARY_TOKEN_ID = 3  # ids 0-2 are the demo tokenizer's special tokens
PREVIOUS_TURN_TAIL_TOKENS = 16
WARMUP_PROMPT_TOKENS = 512
UNBOUNDED_CAP_BYTES = 1 << 62
MEMORY_TARGET_FACTOR = 1.1
CONVERSATION_SYSTEM_TOKENS = 256
MEMORY_OPTION_KEYS = ("turns", "turns_per_conversation", "user_tokens", "reply_tokens", "clear_cache_each_turn")
# take()/put() entries are system prompt + conversation body + own tail: they share prefixes and
# none is a prefix of another, which a trimmable put would supersede.
INDEX_VOCABULARY_SIZE = 151_000
SYSTEM_PROMPT_COUNT, BODIES_PER_SYSTEM_PROMPT = 10, 10
INDEX_SYSTEM_TOKENS, INDEX_BODY_TOKENS, INDEX_TAIL_TOKENS, INDEX_NEW_TOKENS = 64, 128, 128, 16
TINY_LAYERS, TINY_KV_HEADS, TINY_HEAD_DIM = 2, 2, 16
WARMUP_TAKES, EVICTING_PUTS = 100, 200
SEED = 0
DOCS_BEGIN, DOCS_END = docs_markers("prompt_cache")


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def random_tokens(count: int, rng: np.random.Generator, vocabulary_size: int = VOCAB_SIZE) -> list[int]:
    return rng.integers(FIRST_ORDINARY_TOKEN_ID, vocabulary_size, count).tolist()


def _mib(value: float) -> str:
    return f"{value / MIB_BYTES:.1f} MiB"


# -- 1. TTFT: RAM prefix hit against cold prefill -------------------------------------------------


def measure_ttft_at(model: Any, length: int, repeats: int, rng: np.random.Generator) -> dict[str, Any]:
    """Cold and hit TTFT, swapping order on odd repeats. The first cold run's caches, trimmed by the
    last turn's tokens, become the previous turn's entry: the same rows a separate prefill would make."""
    prompt = random_tokens(length, rng)
    cache = PromptCache(UNBOUNDED_CAP_BYTES)
    runs: dict[str, list[float]] = {"cold": [], "hit": [], "take": []}
    reused: list[int] = []

    def cold() -> None:
        started = time.perf_counter()
        caches = make_prompt_cache(model)
        next(generate_tokens(model, prompt, greedy(1), cache=caches))
        runs["cold"].append(time.perf_counter() - started)
        if len(cache) == 0:
            for layer in caches:
                layer.trim(PREVIOUS_TURN_TAIL_TOKENS)
            cache.put(prompt[:-PREVIOUS_TURN_TAIL_TOKENS], caches)

    def hit() -> None:
        started = time.perf_counter()
        taken = cache.take(prompt)
        runs["take"].append(time.perf_counter() - started)
        if taken.caches is None:
            raise RuntimeError(f"expected a RAM hit for a {length}-token prompt, got a miss")
        next(generate_tokens(model, prompt[taken.reused_tokens :], greedy(1), cache=taken.caches))
        runs["hit"].append(time.perf_counter() - started)
        reused.append(taken.reused_tokens)

    for index in range(repeats):
        for step in (cold, hit) if index % 2 == 0 else (hit, cold):
            step()
    cold_s, hit_s = statistics.median(runs["cold"]), statistics.median(runs["hit"])
    return {
        "prompt_tokens": length,
        "reused_tokens": reused[0],
        "cold_median_s": cold_s,
        "hit_median_s": hit_s,
        "take_median_s": statistics.median(runs["take"]),
        "speedup": cold_s / hit_s,
        "runs_s": runs,
    }


# -- 2. take() and put() latency with many entries ------------------------------------------------


def tiny_caches(rows: int) -> list[KVCache]:
    """Real mlx-lm KVCache layers, as small as still makes take() lend and put() bill them."""
    shape = (1, TINY_KV_HEADS, rows, TINY_HEAD_DIM)
    caches = [KVCache() for _ in range(TINY_LAYERS)]
    for layer in caches:
        layer.update_and_fetch(mx.zeros(shape), mx.zeros(shape))
    mx.eval(cache_arrays(caches))
    return caches


def conversation_token_lists(entries: int, rng: np.random.Generator) -> list[np.ndarray]:
    def tokens(count: int) -> np.ndarray:
        return np.asarray(random_tokens(count, rng, INDEX_VOCABULARY_SIZE), dtype=np.uint32)

    systems = [tokens(INDEX_SYSTEM_TOKENS) for _ in range(SYSTEM_PROMPT_COUNT)]
    bodies = [tokens(INDEX_BODY_TOKENS) for _ in range(SYSTEM_PROMPT_COUNT * BODIES_PER_SYSTEM_PROMPT)]
    return [
        np.concatenate([systems[n % SYSTEM_PROMPT_COUNT], bodies[n % len(bodies)], tokens(INDEX_TAIL_TOKENS)])
        for n in range(entries)
    ]


def take_queries(stored: list[np.ndarray], count: int, rng: np.random.Generator) -> list[tuple[str, list[int]]]:
    """In random order: a third extend a stored entry, a third branch off one mid-way, a third share
    no first token with any (ids at and above INDEX_VOCABULARY_SIZE are never stored)."""
    queries = []
    for number in range(count):
        entry = stored[int(rng.integers(len(stored)))].tolist()
        new_tokens = random_tokens(INDEX_NEW_TOKENS, rng, INDEX_VOCABULARY_SIZE)
        if number % 3 == 0:
            queries.append(("extend", entry + new_tokens))
        elif number % 3 == 1:
            cut = int(rng.integers(INDEX_SYSTEM_TOKENS, len(entry) - 1))
            queries.append(("branch", entry[:cut] + [INDEX_VOCABULARY_SIZE] + new_tokens))
        else:
            queries.append(("miss", [INDEX_VOCABULARY_SIZE + 1] + entry[1:] + new_tokens))
    return [queries[i] for i in rng.permutation(count)]


def _timed_puts(cache: PromptCache, token_lists: list[np.ndarray]) -> list[float]:
    latencies_us = []
    for tokens in token_lists:
        caches = tiny_caches(len(tokens))
        started = time.perf_counter_ns()
        cache.put(tokens, caches)
        latencies_us.append((time.perf_counter_ns() - started) / 1000)
    return latencies_us


def _latency_summary(latencies_us: list[float]) -> dict[str, float]:
    return {
        "median_us": statistics.median(latencies_us),
        "p99_us": float(np.percentile(latencies_us, 99)),
        "max_us": max(latencies_us),
        "count": len(latencies_us),
    }


def measure_take_latency(entries: int, queries: int, rng: np.random.Generator) -> dict[str, Any]:
    """Fill a cache capped at exactly `entries` entries, time take() on mixed queries, then time puts
    that each evict one entry."""
    stored = conversation_token_lists(entries + EVICTING_PUTS, rng)
    entry_bytes = logical_bytes(tiny_caches(len(stored[0])), len(stored[0]))
    cache = PromptCache(entries * entry_bytes)
    filling_us = _timed_puts(cache, stored[:entries])
    query_list = take_queries(stored[:entries], queries, rng)
    for _, query in query_list[:WARMUP_TAKES]:
        cache.take(query)
    by_kind: dict[str, list[float]] = {"extend": [], "branch": [], "miss": []}
    tiers: dict[str, set[str]] = {kind: set() for kind in by_kind}
    for kind, query in query_list:
        started = time.perf_counter_ns()
        taken = cache.take(query)
        by_kind[kind].append((time.perf_counter_ns() - started) / 1000)
        tiers[kind].add(taken.tier)
    evictions_before = cache.counters.evictions
    evicting_us = _timed_puts(cache, stored[entries:])
    return {
        "entries": entries,
        "entry_tokens": len(stored[0]),
        "entry_bytes": entry_bytes,
        "cache_layers": f"{TINY_LAYERS} x KVCache [1, {TINY_KV_HEADS}, rows, {TINY_HEAD_DIM}] float32",
        "take": _latency_summary([latency for values in by_kind.values() for latency in values]),
        "take_by_kind": {kind: _latency_summary(values) for kind, values in by_kind.items()},
        "tiers_by_kind": {kind: sorted(seen) for kind, seen in tiers.items()},
        "put_filling": _latency_summary(filling_us),
        "put_evicting": _latency_summary(evicting_us),
        "evictions_by_evicting_puts": cache.counters.evictions - evictions_before,
        "entries_after": len(cache),
    }


# -- 3. Memory over conversations under the cap ---------------------------------------------------


def conversation_turn(
    model: Any, cache: PromptCache, history: list[int], user_tokens: list[int], reply_tokens: int
) -> tuple[list[int], int]:
    """take -> prefill the rest -> greedy decode -> put the full caches, as the engine would.
    Returns the conversation so far and the tokens reused."""
    prompt = history + user_tokens
    taken = cache.take(prompt)
    caches = taken.caches if taken.caches is not None else make_prompt_cache(model)
    reply = list(generate_tokens(model, prompt[taken.reused_tokens :], greedy(reply_tokens), cache=caches))
    # Exhausting the generator feeds the last reply token too; its cache rows are still lazy.
    mx.eval(cache_arrays(caches))
    conversation = prompt + reply
    cache.put(conversation, caches)
    return conversation, taken.reused_tokens


def held_capacity_bytes(cache: PromptCache, put_token_lists: list[list[int]]) -> int:
    """Bytes of the buffers the entries hold, capacity slack included (the bill counts rows up to
    offset only), read through a public snapshot of each entry still present."""
    snapshots = (cache.snapshot_exact(tokens) for tokens in put_token_lists)
    return sum(
        array.nbytes for snapshot in snapshots if snapshot is not None for array in cache_arrays(snapshot.caches)
    )


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def malloc_trim() -> bool:
    """Ask glibc to return free heap pages to the kernel; False where there is no glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        return False
    return True


def _turn_sample(
    turn: int, seconds: float, reused: int, history: list[int], cache: PromptCache, baseline_rss: int
) -> dict[str, Any]:
    return {
        "turn": turn,
        "seconds": seconds,
        "reused_tokens": reused,
        "conversation_tokens": len(history),
        "entries": len(cache),
        "billed_bytes": cache.bytes_total,
        "rss_growth_bytes": rss_bytes() - baseline_rss,
        "mlx_active_bytes": mx.get_active_memory(),
        "mlx_buffer_cache_bytes": mx.get_cache_memory(),
    }


def measure_memory(model: Any, options: dict[str, Any], rng: np.random.Generator, progress: Console) -> dict[str, Any]:
    """Conversations one after another, all opening with the same system prompt, each turn adding
    user and reply tokens; RSS against the baseline of the loaded, warmed-up model."""
    system_prompt = random_tokens(CONVERSATION_SYSTEM_TOKENS, rng)
    gc.collect()
    mx.clear_cache()
    malloc_trim()
    baseline_rss, baseline_active = rss_bytes(), mx.get_active_memory()
    mx.reset_peak_memory()
    cap_bytes = options["cap_mib"] * MIB_BYTES
    cache = PromptCache(cap_bytes)
    samples, put_token_lists, history = [], [], system_prompt
    for turn in range(1, options["turns"] + 1):
        if (turn - 1) % options["turns_per_conversation"] == 0:
            history = system_prompt
        started = time.perf_counter()
        history, reused = conversation_turn(
            model, cache, history, random_tokens(options["user_tokens"], rng), options["reply_tokens"]
        )
        if options["clear_cache_each_turn"]:
            mx.clear_cache()
        put_token_lists.append(history)
        samples.append(_turn_sample(turn, time.perf_counter() - started, reused, history, cache, baseline_rss))
        if turn % 10 == 0:
            progress.print(
                f"turn {turn}: {len(cache)} entries, billed {_mib(cache.bytes_total)}, "
                f"RSS +{_mib(samples[-1]['rss_growth_bytes'])}"
            )
    peak_growth_bytes = mx.get_peak_memory() - baseline_active
    held_bytes = held_capacity_bytes(cache, put_token_lists)
    gc.collect()
    active_growth_bytes = mx.get_active_memory() - baseline_active
    mx.clear_cache()
    after_clear_growth = rss_bytes() - baseline_rss
    trimmed = malloc_trim()
    after_trim_growth = rss_bytes() - baseline_rss if trimmed else None
    return {
        **{key: options[key] for key in MEMORY_OPTION_KEYS},
        "system_tokens": CONVERSATION_SYSTEM_TOKENS,
        "cap_bytes": cap_bytes,
        "target_bytes": MEMORY_TARGET_FACTOR * cap_bytes,
        "entry_bytes_per_token": samples[0]["billed_bytes"] / samples[0]["conversation_tokens"],
        "baseline_rss_bytes": baseline_rss,
        "rss_growth_bytes": samples[-1]["rss_growth_bytes"],
        "rss_growth_max_bytes": max(sample["rss_growth_bytes"] for sample in samples),
        "rss_growth_after_clear_cache_bytes": after_clear_growth,
        "rss_growth_after_malloc_trim_bytes": after_trim_growth,
        "billed_bytes": cache.bytes_total,
        "held_capacity_bytes": held_bytes,
        "mlx_active_growth_bytes": active_growth_bytes,
        "mlx_peak_growth_bytes": peak_growth_bytes,
        "mlx_buffer_cache_bytes": samples[-1]["mlx_buffer_cache_bytes"],
        "turn_median_s": statistics.median(sample["seconds"] for sample in samples),
        "stats": cache.stats(),
        "samples": samples,
    }


# -- running and reporting ------------------------------------------------------------------------


def load_model(model_dir: Path | None, model_size: str, workdir: Path) -> tuple[Any, str, int]:
    """The model, a description and its context length; without `model_dir`, a fresh demo model."""
    if model_dir is None:
        model_dir = create_model(DEMO_ARCH, workdir / f"{DEMO_ARCH}-{model_size}", size=model_size)
        described = f"demo {DEMO_ARCH} {model_size}"
    else:
        described = str(model_dir)
    model = load(str(model_dir))[0]
    weights_bytes = sum(array.nbytes for array in dict(tree_flatten(model.parameters())).values())
    layers = len(make_prompt_cache(model))
    context_tokens = int(getattr(model.args, "max_position_embeddings", 0) or 0)
    return model, f"{described} ({_mib(weights_bytes)} of weights, {layers} layers)", context_tokens


def run_benchmark(model: Any, options: dict[str, Any], progress: Console) -> dict[str, Any]:
    """Warm up, then memory first (its baseline is the freshly loaded model), then take() and put()
    latency, then TTFT; returns the figures as plain data."""
    rng = np.random.default_rng(SEED)
    list(generate_tokens(model, random_tokens(WARMUP_PROMPT_TOKENS, rng), greedy(8), cache=make_prompt_cache(model)))
    progress.print(f"memory: {options['turns']} turns under a {options['cap_mib']} MiB cap")
    memory = measure_memory(model, options, rng, progress)
    progress.print(f"take()/put() latency with {options['entries']} entries")
    latency = measure_take_latency(options["entries"], options["queries"], rng)
    ttft = []
    for length in options["lengths"]:
        progress.print(f"TTFT at {length} tokens, {options['repeats']} repeats")
        ttft.append(measure_ttft_at(model, length, options["repeats"], rng))
    return {
        "ttft": ttft,
        "take_latency": latency,
        "memory": memory,
        "repeats": options["repeats"],
        "prefill_step_tokens": PREFILL_STEP_TOKENS,
        "previous_turn_tail_tokens": PREVIOUS_TURN_TAIL_TOKENS,
        "targets_met": {
            "hit_faster_than_cold": all(row["speedup"] > 1 for row in ttft),
            "rss_growth_le_1.1x_cap": memory["rss_growth_bytes"] <= memory["target_bytes"],
        },
    }


FIGURE_COLUMNS = ("measurement", "median / value", "p99 or range", "note")


def _us(summary: dict[str, float]) -> tuple[str, str]:
    return f"{summary['median_us']:,.0f} us", f"{summary['p99_us']:,.0f} us"


def _spread(values: list[float], scale: float = 1.0, unit: str = "s", digits: int = 3) -> str:
    return f"{min(values) * scale:,.{digits}f}-{max(values) * scale:,.{digits}f} {unit}"


def figure_rows(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows = []
    for row in result["ttft"]:
        tokens, runs = row["prompt_tokens"], row["runs_s"]
        rows += [
            (f"TTFT cold prefill, {tokens} tokens", f"{row['cold_median_s']:.3f} s", _spread(runs["cold"]), "baseline"),
            (
                f"TTFT RAM hit, {tokens} tokens ({row['reused_tokens']} reused)",
                f"{row['hit_median_s']:.3f} s",
                _spread(runs["hit"]),
                f"{row['speedup']:.1f}x faster than cold",
            ),
            ("  of which take()", f"{row['take_median_s'] * 1e6:,.0f} us", _spread(runs["take"], 1e6, "us", 0), ""),
        ]
    latency = result["take_latency"]
    rows.append(
        (
            f"take(), {latency['entries']:,} entries, all queries",
            *_us(latency["take"]),
            f"{latency['take']['count']:,} queries",
        )
    )
    for kind, summary in latency["take_by_kind"].items():
        rows.append((f"  take(), {kind} queries", *_us(summary), "tier " + "/".join(latency["tiers_by_kind"][kind])))
    rows.append((f"put(), filling to {latency['entries']:,} entries", *_us(latency["put_filling"]), ""))
    rows.append(
        (
            "put() at the cap (each evicts one)",
            *_us(latency["put_evicting"]),
            f"{latency['evictions_by_evicting_puts']} evictions",
        )
    )
    memory, trimmed = result["memory"], result["memory"]["rss_growth_after_malloc_trim_bytes"]
    met = "met" if result["targets_met"]["rss_growth_le_1.1x_cap"] else "MISSED"
    return rows + [
        (
            f"RSS growth after turn {memory['turns']}",
            _mib(memory["rss_growth_bytes"]),
            f"max {_mib(memory['rss_growth_max_bytes'])}",
            f"target <= {_mib(memory['target_bytes'])}: {met}",
        ),
        ("  then after gc + mx.clear_cache()", _mib(memory["rss_growth_after_clear_cache_bytes"]), "", ""),
        ("  then after glibc malloc_trim(0)", "n/a" if trimmed is None else _mib(trimmed), "", ""),
        (
            "cache billed bytes (rows up to offset)",
            _mib(memory["billed_bytes"]),
            "",
            f"cap {_mib(memory['cap_bytes'])}, {memory['stats']['entries']} entries",
        ),
        ("buffers the entries hold (capacity)", _mib(memory["held_capacity_bytes"]), "", ""),
        ("MLX active memory growth", _mib(memory["mlx_active_growth_bytes"]), "", "after gc"),
        (
            f"MLX buffer cache after turn {memory['turns']}",
            _mib(memory["mlx_buffer_cache_bytes"]),
            "",
            "freed, kept for reuse",
        ),
        ("MLX peak memory growth", _mib(memory["mlx_peak_growth_bytes"]), "", ""),
    ]


def summary_lines(result: dict[str, Any]) -> list[str]:
    memory, latency = result["memory"], result["take_latency"]
    conversation_tokens = memory["system_tokens"] + memory["turns_per_conversation"] * (
        memory["user_tokens"] + memory["reply_tokens"]
    )
    clearing = (
        "called after every turn, as the engine thread does once idle after a generation"
        if memory["clear_cache_each_turn"]
        else "not called during the turns (--keep-cache-each-turn)"
    )
    return [
        f"model: {result['model']}; TTFT runs through engine.generate_tokens ({result['prefill_step_tokens']}-token "
        f"prefill chunks, greedy); the hit's entry is the prompt minus its last {result['previous_turn_tail_tokens']} "
        f"tokens (the first cold run's caches, trimmed); cold and hit swap order on odd repeats",
        f"take()/put(): {latency['entries']:,} entries of {latency['entry_tokens']} tokens ({latency['cache_layers']}, "
        f"{latency['entry_bytes']:,} billed bytes each) sharing system prompts and conversation bodies; a third of "
        f"the queries extend an entry, a third branch off one mid-way (a trimmed lend), a third share no first token",
        f"memory: conversations of {memory['turns_per_conversation']} turns one after another, each opening with the "
        f"same {memory['system_tokens']}-token system prompt, +{memory['user_tokens']} user and "
        f"+{memory['reply_tokens']} greedily decoded tokens a turn ({conversation_tokens} tokens, "
        f"{_mib(memory['entry_bytes_per_token'] * conversation_tokens)} billed, at a conversation's end); median turn "
        f"{memory['turn_median_s']:.2f} s; baseline RSS {_mib(memory['baseline_rss_bytes'])} after loading, a "
        f"warm-up, gc, mx.clear_cache() and malloc_trim(0); mx.clear_cache() {clearing}; glibc's mmap "
        f"threshold "
        f"{'pinned at 128 KiB, as the engine thread does' if result.get('allocator_configured') else 'left dynamic'}",
        "cache counters at the end: "
        + ", ".join(f"{key} {value}" for key, value in memory["stats"].items() if key != "max_bytes"),
        f"load average (1 min) before and after the run: {result['load_average'][0]:.2f} and "
        f"{result['load_average'][1]:.2f} on {result['machine']['cpus']} CPUs",
    ]


def interpretation(result: dict[str, Any]) -> str:
    """One paragraph, built from the figures."""
    memory, latency = result["memory"], result["take_latency"]
    speedups = ", ".join(f"{row['speedup']:,.0f}x at {row['prompt_tokens']} tokens" for row in result["ttft"])
    take_ms = " and ".join(f"{row['take_median_s'] * 1000:.2f} ms at {row['prompt_tokens']}" for row in result["ttft"])
    met = result["targets_met"]["rss_growth_le_1.1x_cap"]
    held, billed = memory["held_capacity_bytes"], memory["billed_bytes"]
    rest_bytes = memory["rss_growth_bytes"] - memory["mlx_active_growth_bytes"] - memory["mlx_buffer_cache_bytes"]
    return (
        f"A RAM hit reaches the first token sooner than a cold prefill by {speedups}. Of a hit, take() takes "
        f"{take_ms} tokens (it converts the whole prompt to a token array and compares it along the index; lending "
        f"makes views of the reused rows), the rest is the prefill of the last {result['previous_turn_tail_tokens']} "
        f"tokens, whose first write into each lent layer grows it into a fresh buffer, copying the reused rows. With "
        f"{latency['entries']:,} tiny entries take() stays near {latency['take']['median_us']:,.0f} us; put() at the "
        f"cap, where each put also evicts the least recently used entry, costs "
        f"{latency['put_evicting']['median_us'] - latency['put_filling']['median_us']:,.0f} us more than while the "
        f"cache fills. Memory: a single conversation would hold one entry, since each turn's "
        f"put supersedes the previous turn's, and at {memory['entry_bytes_per_token']:,.0f} billed bytes a token it "
        f"could not fill {_mib(memory['cap_bytes'])} within the model's {result['context_tokens']:,}-token context, so "
        f"conversations run one after another. After {memory['turns']} turns the process had grown "
        f"{_mib(memory['rss_growth_bytes'])}, {'within' if met else 'above'} the {_mib(memory['target_bytes'])} "
        f"target. The cap holds for what the cache bills ({_mib(billed)}); the entries' buffers held "
        f"{_mib(held)} ({_mib(held - billed)} of capacity past the entries' rows, which the bill leaves out), so "
        f"the cached arrays alone come to {held / memory['cap_bytes']:.2f}x the cap. MLX's active memory grew "
        f"{_mib(memory['mlx_active_growth_bytes'])}, {_mib(memory['mlx_active_growth_bytes'] - held)} more than "
        f"the cached arrays (the model's working buffers between turns); MLX kept "
        f"{_mib(memory['mlx_buffer_cache_bytes'])} of freed buffers for reuse and {_mib(rest_bytes)} went to the "
        f"allocator and runtime. {_release_sentence(memory)}"
    )


def _release_sentence(memory: dict[str, Any]) -> str:
    after_clear, after_trim = memory["rss_growth_after_clear_cache_bytes"], memory["rss_growth_after_malloc_trim_bytes"]
    said = f"mx.clear_cache() hands MLX's buffers to malloc, which left RSS {_mib(after_clear)} above the baseline"
    if after_trim is None:
        return said + " (no glibc to trim)."
    if after_clear - after_trim < MIB_BYTES:
        return said + "; malloc_trim(0) returned under 1 MiB more."
    return (
        f"{said}: glibc kept {_mib(after_clear - after_trim)} of freed heap pages until malloc_trim(0) returned "
        f"them, leaving {_mib(after_trim)}, {_mib(after_trim - memory['held_capacity_bytes'])} more than the "
        f"live arrays."
    )


def markdown_section(result: dict[str, Any], machine: dict[str, str], command: str, run_date: str) -> str:
    return docs_section(
        "RAM prompt cache: TTFT of a hit, take() latency, memory under the cap",
        [
            f"Run {run_date} with `{command}` (wall time {result['wall_s']:.0f} s; TTFT figures are medians of "
            f"{result['repeats']} repeats).",
            machine_sentence(machine, " (CPU)."),
        ],
        figures(result),
        [interpretation(result)],
    )


def figures(result: dict[str, Any]) -> Figures:
    return Figures(
        title="RAM prompt cache",
        columns=FIGURE_COLUMNS,
        rows=figure_rows(result),
        summary=summary_lines(result),
        text_columns=("measurement",),
    )


def _lengths(_: Any, __: Any, value: str) -> list[int]:
    try:
        lengths = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter("expected comma-separated token counts, e.g. 2048,8192") from None
    if not lengths or min(lengths) <= PREVIOUS_TURN_TAIL_TOKENS + 1:
        raise click.BadParameter(f"each length must exceed {PREVIOUS_TURN_TAIL_TOKENS + 1} tokens")
    return lengths


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--lengths",
    default="2048,8192",
    show_default=True,
    callback=_lengths,
    help="Prompt lengths in tokens for the TTFT comparison, comma-separated.",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Cold and hit TTFT runs per length; figures are medians.",
)
@click.option(
    "--entries",
    type=click.IntRange(min=2),
    default=1000,
    show_default=True,
    help="Entries in the cache while take() is timed (the cap holds exactly these).",
)
@click.option(
    "--queries",
    type=click.IntRange(min=3),
    default=3000,
    show_default=True,
    help="take() calls timed, a third each extending, branching off and missing.",
)
@click.option(
    "--turns",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="Conversation turns in the memory measurement.",
)
@click.option(
    "--turns-per-conversation",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Turns before the next conversation starts from the shared system prompt.",
)
@click.option(
    "--user-tokens",
    type=click.IntRange(min=1),
    default=128,
    show_default=True,
    help="Tokens each turn adds as the user's message (prefilled).",
)
@click.option(
    "--reply-tokens",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Tokens each turn decodes greedily as the reply.",
)
@click.option(
    "--cap-mib",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="The cache's byte cap in the memory measurement, in MiB (2^20 bytes).",
)
@click.option(
    "--clear-cache-each-turn/--keep-cache-each-turn",
    default=True,
    show_default=True,
    help="Call mx.clear_cache() after every turn of the memory measurement, as the engine thread does once idle.",
)
@model_option("An mlx-lm model directory; default: a fresh offline demo llama of --model-size.")
@click.option(
    "--model-size",
    type=click.Choice(SIZES),
    default="small",
    show_default=True,
    help="Size of the demo llama made when --model is not given.",
)
@publish_options(DOCS_BEGIN, DOCS_END)
def main(model_dir: Path | None, model_size: str, as_json: bool, write_docs: bool, **options: Any) -> None:
    """Time RAM prefix hits against cold prefills, take()/put() with many entries, and memory under the cap."""
    started = time.perf_counter()
    console = Console() if sys.stdout.isatty() else Console(width=140)
    progress = Console(stderr=True)
    # The allocator set-up the engine thread makes before it loads a model.
    allocator_configured = configure_host_allocator()
    with tempfile.TemporaryDirectory(prefix="prompt_cache-") as workdir:
        model, described, context_tokens = load_model(model_dir, model_size, Path(workdir))
        load_before = os.getloadavg()[0]
        result = run_benchmark(model, options, progress)
    machine = describe_machine(Path.cwd())
    result.update(
        model=described,
        context_tokens=context_tokens,
        wall_s=time.perf_counter() - started,
        allocator_configured=allocator_configured,
        load_average=[load_before, os.getloadavg()[0]],
        machine=machine,
    )
    publish_figures(
        "prompt_cache",
        result,
        figures(result),
        lambda command, run_date: markdown_section(result, machine, command, run_date),
        write_docs=write_docs,
        as_json=as_json,
        console=console,
        progress=progress,
    )


if __name__ == "__main__":
    main()
