"""The SSD index benchmark's synthetic tree: conversations sharing system
prompts, the queries that extend them, and the entries written for them
(bench/ssd_index.py and bench/startup.py build it)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache
from rich.console import Console

from kvcellar.store.disk import RealDisk
from kvcellar.store.ssd import SsdStore

FINGERPRINT = "ssd-index-bench"
VOCABULARY_SIZE = 151_000
ENTRIES_PER_SYSTEM_PROMPT = 100
NEW_TOKENS_PER_QUERY = 50
TREE_HEADS, TREE_HEAD_DIM = 1, 4


class BuildOnlyDisk(RealDisk):
    """`RealDisk` without fsync, for the build: 20,000 fsyncs would take minutes and no figure depends on them."""

    def fsync(self, handle: int) -> None:
        pass

    def fsync_dir(self, path: Path) -> None:
        pass


def tree_shape(entries: int, tokens: int) -> tuple[int, int, int, int]:
    """System prompt tokens, turn tokens, system prompt count, and the most turns an entry shares with another."""
    prompt_tokens, turn_tokens = max(1, tokens // 4), max(1, tokens // 8)
    most_turns = (tokens - 1 - prompt_tokens) // turn_tokens
    return prompt_tokens, turn_tokens, max(1, entries // ENTRIES_PER_SYSTEM_PROMPT), most_turns


def conversation_tree(entries: int, tokens: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Entry `i` opens with system prompt `i % prompts` (a quarter of its tokens); each odd entry then
    repeats an earlier same-prompt entry up to a turn boundary (turns are an eighth) before its own
    tokens, as a conversation branched at that turn does. Equal lengths keep every entry alive: an
    earlier turn stored alone would be superseded by its trimmable continuation."""
    prompt_tokens, turn_tokens, prompt_count, most_turns = tree_shape(entries, tokens)
    prompts = rng.integers(0, VOCABULARY_SIZE, (prompt_count, prompt_tokens), dtype=np.uint32)
    made: list[np.ndarray] = []
    for number in range(entries):
        head = prompts[number % prompt_count]
        earlier = range(number % prompt_count, number, prompt_count)
        if number % 2 and len(earlier) and most_turns >= 1:
            parent = made[earlier[int(rng.integers(len(earlier)))]]
            head = parent[: prompt_tokens + turn_tokens * int(rng.integers(1, most_turns + 1))]
        made.append(np.concatenate([head, rng.integers(0, VOCABULARY_SIZE, tokens - len(head), dtype=np.uint32)]))
    return made


def conversation_queries(
    stored: list[np.ndarray], count: int, rng: np.random.Generator
) -> list[tuple[str, np.ndarray]]:
    """Even queries extend a stored entry by new tokens; odd ones leave one at a random point."""
    made = []
    for number in range(count):
        entry = stored[int(rng.integers(len(stored)))]
        cut = len(entry) if number % 2 == 0 else int(rng.integers(1, len(entry)))
        new_tokens = rng.integers(0, VOCABULARY_SIZE, NEW_TOKENS_PER_QUERY, dtype=np.uint32)
        if cut < len(entry) and new_tokens[0] == entry[cut]:
            new_tokens[0] = (int(entry[cut]) + 1) % VOCABULARY_SIZE
        made.append(("extend" if cut == len(entry) else "diverge", np.concatenate([entry[:cut], new_tokens])))
    return made


def filled_caches(layers: int, heads: int, rows: int, head_dim: int, dtype: mx.Dtype) -> list[KVCache]:
    """KVCache layers filled by `update_and_fetch` as a prefill fills them (capacity past offset)."""
    caches = []
    for _ in range(layers):
        cache, shape = KVCache(), (1, heads, rows, head_dim)
        cache.update_and_fetch(mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype))
        mx.eval(cache.keys, cache.values)
        caches.append(cache)
    return caches


def build_tree(
    root: Path, stored: list[np.ndarray], progress: Console, fingerprint: str = FINGERPRINT
) -> tuple[dict[str, np.ndarray], float]:
    """Store every entry (no fsync, no journal, one sync at the end) under `fingerprint`;
    returns tokens by entry id and the build time."""
    caches = filled_caches(1, TREE_HEADS, len(stored[0]), TREE_HEAD_DIM, mx.float32)
    started = time.perf_counter()
    store = SsdStore.open(root, fingerprint, disk=BuildOnlyDisk(), journal=False)
    tokens_by_id: dict[str, np.ndarray] = {}
    try:
        for number, tokens in enumerate(stored, start=1):
            entry_id = store.store(tokens, caches)
            if entry_id is None:
                raise RuntimeError(f"entry {number} was not stored: {store.stats()}")
            tokens_by_id[entry_id] = tokens
            if number % 2000 == 0:
                progress.print(f"  stored {number:,}/{len(stored):,}")
        if store.stats()["entries"] != len(stored):
            raise RuntimeError(f"the tree lost entries while building: {store.stats()}")
    finally:
        store.close()
    # One sync instead of 20,000 fsyncs, so no writeback of the tree overlaps a timed figure.
    os.sync()
    return tokens_by_id, time.perf_counter() - started
