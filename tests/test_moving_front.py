"""Caches whose reusable offset moves: llama4's `ChunkedKVCache` drops the
rows before `start_position`, so an entry serves only prefixes from the first
attention-chunk boundary at or past it. A branch below that bound is a shorter
hit or a cold prefill with the cold-run output, from RAM and from SSD alike;
a branch at or above it is still a hit with the cold-run output."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import make_prompt_cache

from kvcellar.actors.system import SystemConfig, open_system
from kvcellar.engine.engine import LoadedModel, SamplingParams, prefill
from kvcellar.engine.generation import GenerationDone, GenerationRequest, run_generation
from kvcellar.errors import UsageError
from kvcellar.store import kvfile
from kvcellar.store.lending import lend_cache, lend_caches
from kvcellar.store.prompt_cache import PromptCache
from kvcellar.store.signature import entry_minimum_reusable_offset, minimum_reusable_offset, moving_front_bound
from kvcellar.store.ssd import SsdStore

FINGERPRINT = "c" * 32
# Longer than three attention chunks (the tiny llama4 chunks by 32), so the
# front moves well past 0 before the first decode step.
PROMPT = tuple((17 * i + 11) % 1000 + 3 for i in range(100))
BRANCH_TAIL = (5, 6, 7, 8)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llama4(model_dir_factory):
    from mlx_lm import load

    model_dir = model_dir_factory("llama4")
    model, tokenizer = load(str(model_dir))
    return LoadedModel(model=model, tokenizer=tokenizer, model_dir=model_dir, context_tokens_max=8192)


def _request(prompt, max_tokens=MAX_TOKENS):
    return GenerationRequest(prompt_ids=tuple(prompt), params=SamplingParams(temperature=0.0, max_tokens=max_tokens))


def _generate(loaded, prompt_cache, prompt):
    tokens, done = [], None
    for item in run_generation(loaded, prompt_cache, _request(prompt), threading.Event()):
        if isinstance(item, GenerationDone):
            done = item
        elif item.token_id >= 0:
            tokens.append(item.token_id)
    return tokens, done


def _chunked(caches):
    return [cache for cache in caches if type(cache) is mlx_cache.ChunkedKVCache]


def _moved_caches(loaded, decode_tokens=6):
    """Caches of PROMPT plus a few greedy decode steps, as a generation leaves them."""
    caches = make_prompt_cache(loaded.model)
    logits = prefill(loaded.model, PROMPT, caches)
    fed = []
    for _ in range(decode_tokens):
        token = int(mx.argmax(logits, axis=-1).item())
        logits = loaded.model(mx.array([[token]]), cache=caches)[:, -1, :]
        fed.append(token)
    mx.eval([cache.state for cache in caches])
    return list(PROMPT) + fed, caches


def _branch_points(entry_tokens, start, bound):
    """Branch depths around the interesting places: far below the front, at
    it, between it and the bound, either side of the bound, and above."""
    return sorted({10, start, start + 1, bound - 1, bound, bound + 3, len(entry_tokens) - 1})


def _branch(entry_tokens, depth):
    return tuple(entry_tokens[:depth]) + BRANCH_TAIL


def test_the_bound_is_the_first_chunk_boundary_at_or_past_the_moved_front(llama4):
    tokens, caches = _moved_caches(llama4)
    chunked = _chunked(caches)
    start = chunked[0].start_position
    chunk = chunked[0].chunk_size
    assert start > chunk, "the prompt is long enough to move the front past a whole chunk"
    bound = -(-start // chunk) * chunk
    assert bound > start, "this prompt's front is not chunk-aligned, so the two bounds differ"
    assert all(moving_front_bound(cache) == bound for cache in chunked)
    assert entry_minimum_reusable_offset(caches, len(tokens)) == bound
    assert moving_front_bound(mlx_cache.ChunkedKVCache(chunk)) == 0, "an unmoved front bounds nothing"


def _position_rows(first, count):
    """Key rows whose value is their token position, to read back which positions a cache holds."""
    return mx.array(np.arange(first, first + count, dtype=np.float32)[:, None])[None, None]


@settings(max_examples=30, deadline=None)
@given(chunk_size=st.integers(2, 9), forwards=st.lists(st.integers(1, 20), min_size=1, max_size=12))
def test_every_prefix_from_the_bound_holds_its_chunk_and_none_below_does(chunk_size, forwards):
    """As llama4 drives it (trim the front, then append each forward), the cache
    keeps the rows a query at u attends to, `[u // chunk * chunk, u)`, exactly
    for the prefixes u from the bound up to its offset."""
    cache = mlx_cache.ChunkedKVCache(chunk_size)
    for count in forwards:
        cache.maybe_trim_front()
        rows = _position_rows(cache.offset, count)
        cache.update_and_fetch(rows, rows)
    bound = minimum_reusable_offset(cache, cache.offset)
    assert bound == moving_front_bound(cache) <= cache.offset
    for usable in range(cache.start_position, cache.offset + 1):
        needed = set(range(usable // chunk_size * chunk_size, usable))
        if usable < bound:
            assert not needed <= set(range(cache.start_position, usable))
            with pytest.raises(UsageError):
                lend_cache(cache, drop_tokens=cache.offset - usable)
            continue
        lent = lend_cache(cache, drop_tokens=cache.offset - usable)
        keys, _ = lent.keys_and_values()
        held = [int(v) for v in np.array(keys[0, 0, :, 0])]
        assert held == list(range(cache.start_position, usable)) and needed <= set(held)


def test_lending_refuses_a_trim_below_the_bound_and_keeps_the_front(llama4):
    tokens, caches = _moved_caches(llama4)
    bound = entry_minimum_reusable_offset(caches, len(tokens))
    with pytest.raises(UsageError, match="no prefix shorter than"):
        lend_caches(caches, drop_tokens=len(tokens) - (bound - 1))
    lent = lend_caches(caches, drop_tokens=len(tokens) - bound)
    assert all(cache.offset == bound for cache in lent)
    assert [c.start_position for c in _chunked(lent)] == [c.start_position for c in _chunked(caches)]
    assert entry_minimum_reusable_offset(lent, bound) == bound


def test_a_declared_bound_survives_lending_and_a_kvc_round_trip(tmp_path):
    cache = mlx_cache.KVCache()
    rows = mx.ones((1, 1, 10, 2))
    cache.update_and_fetch(rows, rows)
    cache.minimum_reusable_offset = 7
    assert lend_cache(cache).minimum_reusable_offset == 7
    with pytest.raises(UsageError):
        lend_cache(cache, drop_tokens=4)
    path = tmp_path / "declared.kvc"
    kvfile.save(path, [cache], list(range(10)))
    assert kvfile.read_header(path).minimum_reusable_offset == 7
    restored = kvfile.load(path).caches
    assert minimum_reusable_offset(restored[0], 10) == 7


def test_ram_tier_branch_at_every_depth_gives_the_cold_output(llama4):
    probe = PromptCache(bytes_max=10**9)
    first, _ = _generate(llama4, probe, PROMPT)
    (entry,) = probe._entries.values()
    entry_tokens = [int(t) for t in entry.tokens]
    start = _chunked(entry.caches)[0].start_position
    bound = entry.minimum_reusable_offset
    assert start < bound <= len(entry_tokens)
    for depth in _branch_points(entry_tokens, start, bound):
        prompt_cache = PromptCache(bytes_max=10**9)
        assert _generate(llama4, prompt_cache, PROMPT)[0] == first
        prompt = _branch(entry_tokens, depth)
        warm, done = _generate(llama4, prompt_cache, prompt)
        cold, _ = _generate(llama4, None, prompt)
        assert warm == cold, f"branch at {depth} (front {start}, bound {bound})"
        if depth >= bound:
            assert (done.cache_tier, done.cached_tokens) == ("ram", depth)
        else:
            assert (done.cache_tier, done.cached_tokens) == ("none", 0)


def test_ssd_header_records_the_bound_and_find_never_picks_a_trim_below_it(llama4, tmp_path):
    tokens, caches = _moved_caches(llama4)
    bound = entry_minimum_reusable_offset(caches, len(tokens))
    start = _chunked(caches)[0].start_position
    store = SsdStore.open(tmp_path, FINGERPRINT)
    entry_id = store.store(tokens, lend_caches(caches))
    assert entry_id is not None
    assert kvfile.read_header(store.entry(entry_id).path).minimum_reusable_offset == bound
    store.close()
    restarted = SsdStore.open(tmp_path, FINGERPRINT)
    try:
        for depth in _branch_points(tokens, start, bound):
            prompt = _branch(tokens, depth)
            match = restarted.find(prompt)
            if depth < bound:
                assert match is None, f"branch at {depth} is below the bound {bound}"
                continue
            assert match.usable_tokens == depth
            # The RAM tier in front of the store, empty: the take restores from the file.
            warm, done = _generate(llama4, PromptCache(bytes_max=10**9, cold_tier=restarted), prompt)
            assert (done.cache_tier, done.cached_tokens) == ("ssd", depth)
            assert warm == _generate(llama4, None, prompt)[0], f"branch at {depth} (front {start}, bound {bound})"
    finally:
        restarted.close()


def test_an_ssd_header_that_understates_the_bound_is_refused_at_restore(llama4, tmp_path, monkeypatch):
    tokens, caches = _moved_caches(llama4)
    bound = entry_minimum_reusable_offset(caches, len(tokens))
    start = _chunked(caches)[0].start_position
    # A file as a build without the moving-front bound wrote it: the header claims every prefix.
    monkeypatch.setattr(kvfile, "entry_minimum_reusable_offset", lambda caches, token_count: 0)
    store = SsdStore.open(tmp_path, FINGERPRINT)
    store.store(tokens, lend_caches(caches))
    store.close()
    monkeypatch.undo()
    restarted = SsdStore.open(tmp_path, FINGERPRINT)
    try:
        prompt = _branch(tokens, start + 1)
        match = restarted.find(prompt)
        assert match is not None and match.usable_tokens == start + 1 < bound
        assert restarted.restore(match) is None
        prompt_cache = PromptCache(bytes_max=10**9, cold_tier=restarted)
        warm, done = _generate(llama4, prompt_cache, prompt)
        assert done.cached_tokens == 0 and warm == _generate(llama4, None, prompt)[0]
    finally:
        restarted.close()


def _config(model_dir, tmp_path, **overrides):
    values = dict(
        model_dir=model_dir,
        ssd_dir=tmp_path / "ssd",
        debounce_s=0.05,
        busy_rearm_s=0.05,
        demote_idle_s=0,
        shutdown_timeout_s=60,
    )
    values.update(overrides)
    return SystemConfig(**values)


async def _run(system, prompt):
    tokens, done = [], None
    async for item in system.generate(_request(prompt)):
        if isinstance(item, GenerationDone):
            done = item
        elif item.token_id >= 0:
            tokens.append(item.token_id)
    return tokens, done


def test_a_system_serves_branches_below_and_above_the_bound_from_ram_and_after_a_restart_from_ssd(
    llama4, model_dir_factory, tmp_path
):
    model_dir = model_dir_factory("llama4")
    probe = PromptCache(bytes_max=10**9)
    first, _ = _generate(llama4, probe, PROMPT)
    (entry,) = probe._entries.values()
    entry_tokens, bound = [int(t) for t in entry.tokens], entry.minimum_reusable_offset
    start = _chunked(entry.caches)[0].start_position
    below, above = _branch(entry_tokens, start + 1), _branch(entry_tokens, bound + 2)
    # After the restart: new branches, so the entries the first branches left are only shorter hits.
    below_again = tuple(entry_tokens[: start + 2]) + (9, 9, 9)
    above_again = tuple(entry_tokens[: bound + 3]) + (9, 9, 9)
    cold = {prompt: _generate(llama4, None, prompt)[0] for prompt in (below, above, below_again, above_again)}

    async def main():
        async with open_system(_config(model_dir, tmp_path)) as system:
            assert (await _run(system, PROMPT))[0] == first
            for prompt, hit in ((below, False), (above, True)):
                tokens, done = await _run(system, prompt)
                assert tokens == cold[prompt]
                assert (done.cache_tier, done.cached_tokens) == (("ram", bound + 2) if hit else ("none", 0))
            assert (await system.flush()).durable
        async with open_system(_config(model_dir, tmp_path)) as restarted:
            tokens, done = await _run(restarted, below_again)
            assert tokens == cold[below_again]
            assert done.cached_tokens <= start + 1, "at most the shorter hit the first below-branch left"
            tokens, done = await _run(restarted, above_again)
            assert tokens == cold[above_again]
            assert (done.cache_tier, done.cached_tokens) == ("ssd", bound + 3)

    trio.run(main)
