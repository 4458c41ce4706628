"""Benchmark: `PrefixIndex.best()` latency on conversation-shaped entries.

Entries share prefixes the way conversations do: `system_prompts` system
prompts of `system_prompt_tokens` tokens, each followed by 20 conversation
bodies, each ending in several tails; every entry is `tokens_per_entry` long
and trimmable (plain KV). Half the queries extend a stored entry by 50 new
tokens, half leave a stored entry at a random point and go on with 50 new
tokens. Target (from the issue): median under 1 ms at 10,000 x 4,000 tokens.

Latencies are microseconds per `best()` call on uint32 query arrays; the
`list_query` figures add the conversion of a Python list of ints. Memory is
what tracemalloc sees the index hold after a build (token arrays included).

    python -m kvcellar.bench.prefix_index_latency [--entries 10000] [--tokens-per-entry 4000]
"""

from __future__ import annotations

import json
import resource
import statistics
import time
import tracemalloc

import click
import numpy as np

from kvcellar.store.prefix_index import IndexMatch, PrefixIndex
from kvcellar.store.signature import usable_prefix_length

VOCABULARY_SIZE = 151_000
CONVERSATIONS_PER_SYSTEM_PROMPT = 20
NEW_TOKENS_PER_QUERY = 50
MIB_BYTES = 1 << 20


def conversation_entries(
    entries: int, tokens_per_entry: int, system_prompts: int, system_prompt_tokens: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Token arrays laid out as system prompt + conversation body + tail."""
    body_tokens = (tokens_per_entry - system_prompt_tokens) // 2
    tail_tokens = tokens_per_entry - system_prompt_tokens - body_tokens
    prompts = rng.integers(0, VOCABULARY_SIZE, (system_prompts, system_prompt_tokens), dtype=np.uint32)
    bodies = rng.integers(
        0, VOCABULARY_SIZE, (system_prompts, CONVERSATIONS_PER_SYSTEM_PROMPT, body_tokens), dtype=np.uint32
    )
    made = []
    for number in range(entries):
        prompt = number % system_prompts
        body = (number // system_prompts) % CONVERSATIONS_PER_SYSTEM_PROMPT
        tail = rng.integers(0, VOCABULARY_SIZE, tail_tokens, dtype=np.uint32)
        made.append(np.concatenate([prompts[prompt], bodies[prompt, body], tail]))
    return made


def conversation_queries(stored: list[np.ndarray], queries: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Half extend a stored entry, half diverge from one at a random point."""
    made = []
    for number in range(queries):
        entry = stored[int(rng.integers(len(stored)))]
        cut = len(entry) if number % 2 == 0 else int(rng.integers(1, len(entry)))
        new_tokens = rng.integers(0, VOCABULARY_SIZE, NEW_TOKENS_PER_QUERY, dtype=np.uint32)
        if cut < len(entry) and new_tokens[0] == entry[cut]:
            new_tokens[0] = (int(entry[cut]) + 1) % VOCABULARY_SIZE
        made.append(np.concatenate([entry[:cut], new_tokens]))
    return made


def brute_force_best(stored: list[np.ndarray], query: np.ndarray) -> IndexMatch | None:
    """Every entry scored by `usable_prefix_length` (all trimmable, offset 0)."""
    best_key = None
    for number, tokens in enumerate(stored):
        length = min(len(tokens), len(query))
        mismatches = np.flatnonzero(tokens[:length] != query[:length])
        common = int(mismatches[0]) if mismatches.size else length
        usable = usable_prefix_length(common, len(tokens), len(query), True, 0)
        if usable > 0:
            key = (-usable, usable != len(tokens), len(tokens), f"entry-{number:06d}")
            best_key = key if best_key is None else min(best_key, key)
    if best_key is None:
        return None
    return IndexMatch(entry_id=best_key[3], usable_tokens=-best_key[0], entry_tokens=best_key[2])


def _built(stored: list[np.ndarray]) -> PrefixIndex:
    index = PrefixIndex()
    for number, tokens in enumerate(stored):
        index.add(f"entry-{number:06d}", tokens, trimmable=True, minimum_reusable_offset=0)
    return index


def _latencies_us(index: PrefixIndex, queries: list) -> list[float]:
    latencies = []
    for query in queries:
        started = time.perf_counter_ns()
        index.best(query)
        latencies.append((time.perf_counter_ns() - started) / 1000)
    return latencies


def _percentile(values: list[float], share: float) -> float:
    return float(np.percentile(values, share * 100))


def measure_find_latency(
    entries: int = 10_000,
    tokens_per_entry: int = 4_000,
    queries: int = 2_000,
    seed: int = 0,
    system_prompts: int = 100,
    system_prompt_tokens: int = 1_000,
    verify_queries: int = 20,
) -> dict:
    """Build an index, time `best()` per query, and check `verify_queries` of
    the answers against a brute-force scan. Returns the figures as a dict."""
    rng = np.random.default_rng(seed)
    stored = conversation_entries(entries, tokens_per_entry, system_prompts, system_prompt_tokens, rng)
    query_arrays = conversation_queries(stored, queries, rng)

    started = time.perf_counter()
    index = _built(stored)
    build_seconds = time.perf_counter() - started

    _latencies_us(index, query_arrays[: min(100, queries)])
    array_latencies = _latencies_us(index, query_arrays)
    list_latencies = _latencies_us(index, [query.tolist() for query in query_arrays])
    mismatched = sum(index.best(query) != brute_force_best(stored, query) for query in query_arrays[:verify_queries])
    node_count = index.node_count()
    del index

    tracemalloc.start()
    baseline_bytes = tracemalloc.get_traced_memory()[0]
    traced_index = _built(stored)
    index_bytes = tracemalloc.get_traced_memory()[0] - baseline_bytes
    tracemalloc.stop()
    token_bytes = sum(tokens.nbytes for tokens in stored)
    del traced_index

    return {
        "entries": entries,
        "tokens_per_entry": tokens_per_entry,
        "queries": queries,
        "build_s": round(build_seconds, 3),
        "median_us": round(statistics.median(array_latencies), 1),
        "p99_us": round(_percentile(array_latencies, 0.99), 1),
        "max_us": round(max(array_latencies), 1),
        "list_query_median_us": round(statistics.median(list_latencies), 1),
        "list_query_p99_us": round(_percentile(list_latencies, 0.99), 1),
        "index_mib": round(index_bytes / MIB_BYTES, 1),
        "token_array_mib": round(token_bytes / MIB_BYTES, 1),
        "overhead_mib": round((index_bytes - token_bytes) / MIB_BYTES, 1),
        "trie_nodes": node_count,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "verified_queries": min(verify_queries, queries),
        "verification_mismatches": int(mismatched),
    }


@click.command()
@click.option("--entries", default=10_000, show_default=True)
@click.option("--tokens-per-entry", default=4_000, show_default=True)
@click.option("--queries", default=2_000, show_default=True)
@click.option("--seed", default=0, show_default=True)
def main(entries: int, tokens_per_entry: int, queries: int, seed: int) -> None:
    """Print the figures as one JSON line."""
    click.echo(json.dumps(measure_find_latency(entries, tokens_per_entry, queries, seed)))


if __name__ == "__main__":
    main()
