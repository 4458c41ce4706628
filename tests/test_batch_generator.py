"""The batch lane's generator (engine/batch_generator.py): a RAM hit moves its
prompt batch to generation without copying it, the tokens are mlx-lm's, and
the RAM entry the hit was lent from stays byte-identical; an SSD restore's own
caches are adopted by a one-row batch without a copy."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx_buffers import buffer_address
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from kvcellar.engine.batch_generator import (
    EagerGenerationBatch,
    LeanBatchGenerator,
    MovingPromptBatch,
    merge_with_capacity,
    owned_row_caches,
)
from kvcellar.engine.engine import SamplingParams, _load, prefill
from kvcellar.engine.generation import GenerationRequest, TokenDelta, run_generation
from kvcellar.store import kvfile
from kvcellar.store.lending import cache_arrays
from kvcellar.store.prompt_cache import PromptCache

PROMPT = tuple((11 * i) % 500 + 3 for i in range(70))
OTHER_PROMPT = tuple((5 * i) % 400 + 7 for i in range(23))
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def loaded(model_dir_factory):
    return _load(model_dir_factory("llama"))


def _entry(loaded, tokens):
    """Caches holding exactly `tokens`, evaluated."""
    caches = make_prompt_cache(loaded.model)
    prefill(loaded.model, tokens, caches)
    mx.eval([c.state for c in caches])
    return caches


def _generate(generator_class, loaded, rows):
    """Each row's tokens, rows given as (prompt, caches or None, cached tokens), all inserted at once."""
    generator = generator_class(loaded.model, completion_batch_size=4, prefill_batch_size=4, prefill_step_size=16)
    try:
        uids = generator.insert_segments(
            [[list(prompt[cached:])] for prompt, _, cached in rows],
            max_tokens=[NEW_TOKENS] * len(rows),
            caches=[caches for _, caches, _ in rows],
            all_tokens=[list(prompt[:cached]) for prompt, _, cached in rows],
        )
        tokens: dict[int, list[int]] = {uid: [] for uid in uids}
        finished: set[int] = set()
        while len(finished) < len(uids):
            _, responses = generator.next()
            for response in responses:
                tokens[response.uid].append(response.token)
                if response.finish_reason is not None:
                    finished.add(response.uid)
        return [tokens[uid] for uid in uids]
    finally:
        generator.close()


def _host_copy(caches):
    return [np.array(a) for a in cache_arrays(caches)]


def _lent(loaded, prompt_cache: PromptCache, prompt):
    taken = prompt_cache.take(list(prompt))
    assert taken.tier == "ram" and taken.reused_tokens == len(prompt) - 1
    return taken.caches


def test_the_generator_keeps_a_moving_prompt_batch(loaded):
    # Guards mlx-lm's internals the lean generator relies on (engine/batch_generator.py).
    generator = LeanBatchGenerator(loaded.model, completion_batch_size=2, prefill_batch_size=2)
    assert type(generator._prompt_batch) is MovingPromptBatch
    generator.close()


def test_on_the_cpu_the_generator_hands_each_token_over_before_it_schedules_the_next_step(loaded, monkeypatch):
    assert mx.default_device().type == mx.cpu
    generator = LeanBatchGenerator(loaded.model, completion_batch_size=2, prefill_batch_size=2)
    assert type(generator._generation_batch) is EagerGenerationBatch
    assert generator._prompt_batch.generation_batch_class is EagerGenerationBatch
    # mlx-lm's step schedules the next one (mx.async_eval), which on the CPU runs most of it
    # before returning: up to a row's first token nothing is scheduled ahead, so that token comes
    # back after its own step; later steps are mlx-lm's, scheduled ahead. A row that joins later
    # gets its first token the same way.
    scheduled = []
    real_async_eval = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *arrays: scheduled.append(arrays) or real_async_eval(*arrays))
    try:

        def scheduled_by_the_call_with_first_token(uid: int) -> int:
            while True:
                before = len(scheduled)
                _, responses = generator.next()
                if any(response.uid == uid for response in responses):
                    return len(scheduled) - before

        (first,) = generator.insert([list(PROMPT)], max_tokens=[8])
        assert scheduled_by_the_call_with_first_token(first) == 0 and scheduled == []
        _, responses = generator.next()
        assert [response.uid for response in responses] == [first] and len(scheduled) == 1
        (joining,) = generator.insert([list(OTHER_PROMPT)], max_tokens=[4])
        assert scheduled_by_the_call_with_first_token(joining) == 0
        before = len(scheduled)
        generator.next()
        assert len(scheduled) == before + 1
    finally:
        generator.close()


def _sampled_rows(generator_class, loaded):
    """Tokens and logprobs of three rows with a greedy, a seeded temperature and a penalised
    sampler; the third joins once the first two are decoding, and one row leaves early."""
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    mx.random.seed(7)
    generator = generator_class(loaded.model, completion_batch_size=4, prefill_batch_size=4, prefill_step_size=16)
    penalty = make_logits_processors(repetition_penalty=1.3, repetition_context_size=8)
    got: dict[int, list[tuple[int, list[float]]]] = {}
    try:
        first = generator.insert(
            [list(PROMPT), list(OTHER_PROMPT)],
            max_tokens=[NEW_TOKENS, 4],
            samplers=[make_sampler(0.0), make_sampler(0.8)],
        )
        late, finished = None, set()
        while late is None or len(finished) < 3:
            _, responses = generator.next()
            for response in responses:
                got.setdefault(response.uid, []).append((response.token, response.logprobs.tolist()[:8]))
                if response.finish_reason is not None:
                    finished.add(response.uid)
            if late is None and all(got.get(uid) for uid in first):
                (late,) = generator.insert(
                    [list(PROMPT[:40])], max_tokens=[6], samplers=[make_sampler(0.5)], logits_processors=[penalty]
                )
        return [got[uid] for uid in (*first, late)]
    finally:
        generator.close()


def test_the_eager_generation_batch_samples_what_mlx_lm_samples(loaded):
    assert _sampled_rows(LeanBatchGenerator, loaded) == _sampled_rows(BatchGenerator, loaded)


def test_a_split_of_every_row_hands_over_the_same_caches_and_starts_over(loaded):
    caches = _entry(loaded, PROMPT[:-1])
    batch = MovingPromptBatch(model=loaded.model, uids=[5], caches=[caches], tokens=[list(PROMPT[:-1])])
    merged = batch.prompt_cache
    moved = batch.split([0])
    assert moved.uids == [5] and moved.prompt_cache is merged, "moved, not copied"
    assert batch.uids == [] and batch.prompt_cache == [] and batch.tokens == []
    assert moved.prompt_cache is not batch.prompt_cache


def test_a_ram_hit_decodes_what_mlx_lm_decodes_and_what_a_cold_prefill_decodes(loaded):
    prompt_cache = PromptCache()
    prompt_cache.put(PROMPT + (9, 9, 9), _entry(loaded, PROMPT + (9, 9, 9)))
    entry_caches = prompt_cache._entries[next(iter(prompt_cache._entries))].caches
    before = _host_copy(entry_caches)

    lean_hit = _generate(LeanBatchGenerator, loaded, [(PROMPT, _lent(loaded, prompt_cache, PROMPT), len(PROMPT) - 1)])
    stock_hit = _generate(BatchGenerator, loaded, [(PROMPT, _lent(loaded, prompt_cache, PROMPT), len(PROMPT) - 1)])
    cold = _generate(LeanBatchGenerator, loaded, [(PROMPT, None, 0)])

    assert lean_hit == stock_hit == cold
    assert len(lean_hit[0]) == NEW_TOKENS
    after = _host_copy(entry_caches)
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True)), "the entry's bytes are unchanged"


def test_rows_that_leave_the_prompt_batch_apart_decode_what_mlx_lm_decodes(loaded):
    # A hit moves to generation in its first step while a cold row still prefills: a partial split.
    prompt_cache = PromptCache()
    prompt_cache.put(PROMPT, _entry(loaded, PROMPT))

    def rows():
        return [(OTHER_PROMPT, None, 0), (PROMPT, _lent(loaded, prompt_cache, PROMPT), len(PROMPT) - 1)]

    assert _generate(LeanBatchGenerator, loaded, rows()) == _generate(BatchGenerator, loaded, rows())


def test_a_serial_ram_hit_leaves_its_entry_unchanged_and_decodes_what_a_cold_prefill_decodes(loaded):
    prompt_cache = PromptCache()
    request = GenerationRequest(prompt_ids=PROMPT, params=SamplingParams(max_tokens=NEW_TOKENS))

    def tokens():
        items = run_generation(loaded, prompt_cache, request, threading.Event())
        return [item.token_id for item in items if isinstance(item, TokenDelta) and item.token_id >= 0]

    cold = tokens()
    longest = max(prompt_cache._entries.values(), key=lambda e: e.tokens.size)
    before = _host_copy(longest.caches)
    hit = tokens()
    assert hit == cold
    assert all(np.array_equal(a, b) for a, b in zip(before, _host_copy(longest.caches), strict=True))


def _filled(rows: int) -> KVCache:
    cache = KVCache()
    if rows:
        shape = (1, 2, rows, 8)
        cache.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
    return cache


def test_a_merge_with_capacity_holds_what_mlx_lms_merge_holds_and_a_step_more():
    rows = [_filled(300), _filled(0), _filled(5)]
    stock, ours = BatchKVCache.merge(rows), merge_with_capacity(rows)

    assert ours._idx == stock._idx == 300
    assert ours.keys.shape[2] == 512 and stock.keys.shape[2] == 300, "room for the next token"
    assert np.array_equal(np.array(ours.offset), np.array(stock.offset))
    assert np.array_equal(np.array(ours.left_padding), np.array(stock.left_padding))
    for mine, theirs in ((ours.keys, stock.keys), (ours.values, stock.values)):
        assert np.array_equal(np.array(mine[..., :300, :]), np.array(theirs))
        assert not np.array(mine[..., 300:, :]).any()
    assert merge_with_capacity([_filled(0)]).keys is None


def _generated_and_first_step_buffers(loaded, caches, cached: int):
    """The tokens a one-row hit on `caches` decodes, and its batch cache's
    key buffers right after its first token."""
    generator = LeanBatchGenerator(loaded.model, completion_batch_size=2, prefill_batch_size=2, prefill_step_size=16)
    try:
        generator.insert_segments(
            [[list(PROMPT[cached:])]], max_tokens=[NEW_TOKENS], caches=[caches], all_tokens=[list(PROMPT[:cached])]
        )
        del caches
        tokens: list[int] = []
        buffers: list[int] = []
        while True:
            _, responses = generator.next()
            for response in responses:
                if not buffers:
                    buffers = [buffer_address(layer.keys) for layer in generator._generation_batch.prompt_cache]
                tokens.append(response.token)
                if response.finish_reason is not None:
                    return tokens, buffers
    finally:
        generator.close()


def test_an_ssd_restored_row_is_adopted_uncopied_and_decodes_what_a_copying_merge_decodes(loaded, tmp_path):
    cached = len(PROMPT) - 1
    path = tmp_path / "entry.kvc"
    kvfile.save(path, _entry(loaded, PROMPT[:cached]), list(PROMPT[:cached]))

    restored = kvfile.load(path).caches
    restored_buffers = [buffer_address(layer.keys) for layer in restored]
    owned_tokens, first_step_buffers = _generated_and_first_step_buffers(loaded, owned_row_caches(restored), cached)
    del restored
    copied_tokens, copied_buffers = _generated_and_first_step_buffers(loaded, kvfile.load(path).caches, cached)
    cold = _generate(LeanBatchGenerator, loaded, [(PROMPT, None, 0)])

    assert first_step_buffers == restored_buffers, "the batch writes into the restored buffers"
    assert not set(copied_buffers) & set(restored_buffers)
    assert owned_tokens == copied_tokens == cold[0]


def test_an_owned_row_beside_another_row_is_merged_with_capacity():
    alone, other = _filled(300), _filled(5)
    (owned,) = owned_row_caches([alone])
    merged = type(owned).merge([owned, other])
    assert merged.keys.shape[0] == 2 and merged.keys.shape[2] == 512 and merged._idx == 300
    assert np.array_equal(np.array(merged.keys[0, :, :300]), np.array(alone.keys[0, :, :300]))
