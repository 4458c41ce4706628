"""Quantized KV in batch rows (engine/quant_batch.py): the batched cache's
token-axis surgery is byte-safe, rows in a batch give exactly the serial
lane's tokens and log-probabilities under the same scheme, extracted rows
persist and restore bit-identically, admission bills quantized bytes, and a
real server with `--kv-quant 4` batches.

Schemes at group size 32 run on llama `small` (head_dim 32) through
`--kv-quant config`; the uniform `--kv-quant 4` (group 64) runs on llama
`medium` (head_dim 64): MLX groups must divide the head dim.
"""

from __future__ import annotations

import json
import os

import httpx
import mlx.core as mx
import pytest
import trio
from mlx_lm.models import cache as mlx_cache
from test_batching import PROMPTS
from test_checkpoints import INTERVAL_TOKENS, STOP_AFTER_TOKENS, _generate
from test_serve import Server

from kvcellar.actors.system import SystemConfig, open_system
from kvcellar.engine.engine import SamplingParams
from kvcellar.engine.generation import GenerationDone, GenerationRequest
from kvcellar.engine.quant_batch import BatchQuantizedKVCache
from kvcellar.store import kvfile
from kvcellar.store.scheme import held_bytes

GROUP_32 = 32
MAX_TOKENS = 8
# Four rows of different lengths (5 to 90 tokens): the decode pads them left.
ROW_PROMPTS = PROMPTS[:4]
SCHEME_LAYERS = {
    "kv4": [4] * 6,
    "kv8": [8] * 6,
    "mixed": [4, 8, None, 4, 8, None],
}


@pytest.fixture(scope="module")
def config_model_dirs(model_dir_factory, tmp_path_factory):
    """`dirs[name]`: llama small with a kv_config.json of SCHEME_LAYERS[name] (group 32)."""
    source = model_dir_factory("llama", "small")
    dirs = {}
    for name, layers in SCHEME_LAYERS.items():
        model_dir = tmp_path_factory.mktemp(f"llama-small-{name}")
        for path in source.iterdir():
            os.symlink(path, model_dir / path.name)
        (model_dir / "kv_config.json").write_text(json.dumps({"group_size": GROUP_32, "layers": layers}))
        dirs[name] = model_dir
    return dirs


def _request(prompt, max_tokens=MAX_TOKENS, snapshot_at_tokens=None):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=True, top_logprobs=2)
    return GenerationRequest(prompt_ids=tuple(prompt), params=params, snapshot_at_tokens=snapshot_at_tokens)


async def _deltas(system, request):
    """Every token with its log-probability (and alternatives), and the done."""
    deltas, done = [], None
    async for item in system.generate(request):
        if isinstance(item, GenerationDone):
            done = item
        elif item.token_id >= 0:
            deltas.append((item.token_id, item.logprob))
    return deltas, done


async def _all_deltas(system, requests):
    results = [None] * len(requests)

    async def one(index):
        results[index] = await _deltas(system, requests[index])

    async with trio.open_nursery() as nursery:
        for index in range(len(requests)):
            nursery.start_soon(one, index)
    return results


def _config(model_dir, rows, **overrides):
    values = dict(model_dir=model_dir, demote_idle_s=0, shutdown_timeout_s=60, batch_rows_max=rows)
    return SystemConfig(**{**values, "kv_quant": "config", **overrides})


def _two_turns(model_dir, rows, **overrides):
    """Turn one (stable boundaries on every other row) then the continuations, each turn sent at once."""
    first = [_request(p, snapshot_at_tokens=len(p) - 2 if k % 2 else None) for k, p in enumerate(ROW_PROMPTS)]

    async def main():
        async with open_system(_config(model_dir, rows, **overrides)) as system:
            turn_one = await _all_deltas(system, first)
            second = [
                _request((*p, *(token for token, _ in deltas), 5, 6, 7))
                for p, (deltas, _) in zip(ROW_PROMPTS, turn_one, strict=True)
            ]
            turn_two = await _all_deltas(system, second)
            return turn_one, turn_two, system.stats()["scheduler"]

    return trio.run(main)


def _rows(length, seed, heads=2, dim=64, dtype=mx.float32):
    mx.random.seed(seed)
    shape = (1, heads, length, dim)
    return mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype)


def _quantized_row(length, seed, bits=4):
    keys, values = _rows(length, seed)
    row = mlx_cache.KVCache()
    row.update_and_fetch(keys, values)
    return row.to_quantized(group_size=64, bits=bits)


def _assert_same_row(row, expected):
    assert type(row) is mlx_cache.QuantizedKVCache and row.offset == expected.offset
    for ours, theirs in zip((*row.keys, *row.values), (*expected.keys, *expected.values), strict=True):
        # Either side may hold capacity past its offset (a restored entry grows in whole steps).
        assert mx.array_equal(ours[..., : row.offset, :], theirs[..., : expected.offset, :]).item()


# -- the batched cache -----------------------------------------------------------


def test_quantized_groups_run_along_head_dim_so_token_slices_are_byte_safe():
    keys, _ = _rows(300, 0, dtype=mx.bfloat16)
    whole = mx.quantize(keys, group_size=64, bits=4)
    part = mx.quantize(keys[..., 37:211, :], group_size=64, bits=4)
    assert all(mx.array_equal(a[..., 37:211, :], b).item() for a, b in zip(whole, part, strict=True))


def test_merge_extend_filter_and_extract_move_rows_bit_for_bit():
    rows = [_quantized_row(length, seed) for seed, length in enumerate((5, 40, 17))]
    batch = BatchQuantizedKVCache.merge([BatchQuantizedKVCache.from_row(row) for row in rows[:2]])
    batch.extend(BatchQuantizedKVCache.from_row(rows[2]))
    assert batch.left_padding.tolist() == [35, 0, 23] and batch.offset.tolist() == [5, 40, 17]
    for index, row in enumerate(rows):
        _assert_same_row(batch.extract(index), row)
    # One decode step appends to every row as a lone row's update does.
    step_keys, step_values = _rows(3, 9)
    batch.update_and_fetch(step_keys.transpose(2, 1, 0, 3), step_values.transpose(2, 1, 0, 3))
    for index, row in enumerate(rows):
        row.update_and_fetch(step_keys[:, :, index : index + 1], step_values[:, :, index : index + 1])
    batch.filter([0, 2])
    assert batch.left_padding.tolist() == [12, 0], "the padding both rows had is dropped"
    _assert_same_row(batch.extract(0), rows[0])
    _assert_same_row(batch.extract(1), rows[2])
    mask = batch.make_mask(1)
    # The mask is made before the next token's update: it covers that token too.
    assert mask[0, 0, 0].tolist() == [False] * 12 + [True] * 7 and all(mask[1, 0, 0].tolist())


def test_a_converted_unquantized_batch_equals_each_row_quantized_alone():
    rows = [_rows(length, seed) for seed, length in enumerate((9, 30))]
    plain = []
    for keys, values in rows:
        row = mlx_cache.KVCache()
        row.update_and_fetch(keys, values)
        plain.append(row)
    converted = BatchQuantizedKVCache.from_plain_batch(mlx_cache.BatchKVCache.merge(plain), group_size=64, bits=8)
    assert converted.bits == 8 and converted.left_padding.tolist() == [21, 0]
    for index, row in enumerate(plain):
        _assert_same_row(converted.extract(index), row.to_quantized(group_size=64, bits=8))


def test_an_extracted_row_persists_as_kvc_and_restores_bit_identically(tmp_path):
    rows = [_quantized_row(length, seed, bits=8) for seed, length in enumerate((12, 50))]
    extracted = BatchQuantizedKVCache.merge(rows).extract(0)
    tokens = list(range(3, 15))
    header = kvfile.save(tmp_path / "row.kvc", [extracted], tokens)
    assert [record.signature for record in header.caches] == ["kv:quant:8:64"]
    entry = kvfile.load(tmp_path / "row.kvc")
    assert entry.tokens == tuple(tokens)
    _assert_same_row(entry.caches[0], extracted)
    assert held_bytes(entry.caches) == held_bytes([extracted]) == held_bytes([rows[0]])


# -- rows through the real system -------------------------------------------------


@pytest.mark.parametrize("scheme", list(SCHEME_LAYERS))
def test_quantized_rows_in_a_batch_give_exactly_the_serial_lanes_tokens_and_logprobs(config_model_dirs, scheme):
    """Cold rows, then warm ones the tiers lend quantized caches, half of them
    through a stable-boundary snapshot; tolerance 0."""
    batched_one, batched_two, stats = _two_turns(config_model_dirs[scheme], rows=4)
    serial_one, serial_two, serial_stats = _two_turns(config_model_dirs[scheme], rows=1)
    assert stats["lane"] == "batch" and stats["reason"] == "" and serial_stats["lane"] == "serial"
    assert max(int(rows) for rows in stats["batch_size_history"]) == 4, "four rows decoded together"
    for batched, serial in ((batched_one, serial_one), (batched_two, serial_two)):
        for (deltas, done), (serial_deltas, serial_done) in zip(batched, serial, strict=True):
            assert len(deltas) == MAX_TOKENS and deltas == serial_deltas
            # (cached_tokens differ by one: the batch lane's entry holds the last emitted token, fed by mlx-lm.)
            assert done.cache_tier == serial_done.cache_tier
    assert all(done.cache_tier == "ram" and done.cached_tokens > 0 for _, done in batched_two)


def test_uniform_kv4_rows_batch_and_equal_the_serial_lane(model_dir_factory):
    model_dir = model_dir_factory("llama", "medium")
    requests = [_request(prompt[:24], max_tokens=6) for prompt in PROMPTS[:3]]

    def outputs(rows):
        async def main():
            async with open_system(_config(model_dir, rows, kv_quant="4")) as system:
                return await _all_deltas(system, requests), system.stats()["scheduler"]

        return trio.run(main)

    batched, stats = outputs(3)
    serial, _ = outputs(1)
    assert stats["lane"] == "batch" and max(int(rows) for rows in stats["batch_size_history"]) == 3
    assert [deltas for deltas, _ in batched] == [deltas for deltas, _ in serial]


def test_batched_rows_persist_on_the_ssd_and_restore_bit_identically_after_a_restart(config_model_dirs, tmp_path):
    model_dir, ssd_dir = config_model_dirs["kv8"], tmp_path / "ssd"
    first = [_request(prompt) for prompt in PROMPTS[:3]]

    async def main():
        async with open_system(_config(model_dir, 3, ssd_dir=ssd_dir)) as system:
            turn_one = await _all_deltas(system, first)
            verdict = await system.flush()
            assert verdict.durable, verdict
            second = [_request((*p, *(t for t, _ in d), 9)) for p, (d, _) in zip(PROMPTS[:3], turn_one, strict=True)]
            from_ram = await _all_deltas(system, second)
        async with open_system(_config(model_dir, 3, ssd_dir=ssd_dir)) as restarted:
            from_ssd = await _all_deltas(restarted, second)
        return from_ram, from_ssd

    from_ram, from_ssd = trio.run(main)
    assert all(done.cache_tier == "ram" for _, done in from_ram)
    assert all(done.cache_tier == "ssd" and done.cached_tokens > 0 for _, done in from_ssd)
    assert [deltas for deltas, _ in from_ssd] == [deltas for deltas, _ in from_ram]


def test_a_quantized_row_cut_off_part_way_resumes_from_its_checkpoint_on_the_batch_lane(config_model_dirs, tmp_path):
    """The resumed row joins the batch with its restored quantized caches as a one-row batch."""
    model_dir = config_model_dirs["mixed"]
    request = GenerationRequest(prompt_ids=tuple(range(5, 40)), params=SamplingParams(max_tokens=40))

    def config(ssd_dir):
        return _config(model_dir, 3, ssd_dir=ssd_dir, generation_checkpoint_tokens=INTERVAL_TOKENS, debounce_s=0.05)

    async def main():
        async with open_system(config(tmp_path / "reference")) as system:
            reference, _ = await _generate(system, request)
        async with open_system(config(tmp_path / "ssd")) as system:
            cut, _ = await _generate(system, request, stop_after=STOP_AFTER_TOKENS)
            await system.flush()
        async with open_system(config(tmp_path / "ssd")) as system:
            resumed, done = await _generate(system, request)
            lane = system.stats()["scheduler"]["lane"]
        return reference, cut, resumed, done, lane

    reference, cut, resumed, done, lane = trio.run(main)
    assert lane == "batch" and done.cache_tier == "checkpoint" and done.resumed_tokens >= INTERVAL_TOKENS
    assert resumed == reference and cut == reference[:STOP_AFTER_TOKENS]


def test_admission_bills_quantized_bytes_and_the_tiers_hold_them(config_model_dirs, model_dir_factory):
    """A budget of one unquantized row admits five kv4 rows (0.75 bytes an
    element against float32's 4), and a finished row's entry holds exactly
    the quantized bytes projected."""
    requests = [_request(PROMPTS[4][:60], 12) for _ in range(6)]

    async def main():
        # The memory guard off: the budget bills KV bytes alone (its footprint adds a prefill workspace).
        plain_config = _config(model_dir_factory("llama", "small"), 8, kv_quant="bf16", memory_budget_bytes=0)
        async with open_system(plain_config) as plain:
            plain_row_bytes = plain.scheduler.projected_kv_bytes(requests[0])
        config = _config(config_model_dirs["kv4"], 8, kv_budget_bytes=plain_row_bytes, memory_budget_bytes=0)
        async with open_system(config) as system:
            scheduler = system.scheduler
            row_bytes = scheduler.projected_kv_bytes(requests[0])
            expected = scheduler.scheme.projected_bytes(scheduler._prototypes, 60 + 12)
            await _all_deltas(system, requests[:1])
            entry_bytes = system.prompt_cache.stats()["bytes"]
            entry_tokens = [scheduler.scheme.projected_bytes(scheduler._prototypes, n) for n in (71, 72)]
            results = await _all_deltas(system, requests)
            await scheduler.drain()
            return plain_row_bytes, row_bytes, expected, entry_bytes, entry_tokens, results, system.stats()

    plain_row_bytes, row_bytes, expected, entry_bytes, entry_tokens, results, stats = trio.run(main)
    assert row_bytes == expected and row_bytes * 16 == plain_row_bytes * 3, "0.75 of 4 bytes an element"
    assert entry_bytes in entry_tokens, "the finished row's entry is billed its quantized bytes"
    scheduler = stats["scheduler"]
    assert all(len(deltas) == 12 for deltas, _ in results)
    assert max(int(rows) for rows in scheduler["batch_size_history"]) == 5, "five kv4 rows fit one bf16 row's budget"
    assert scheduler["kv_bytes_peak"] == 5 * row_bytes <= plain_row_bytes


def test_a_real_server_with_kv_quant_4_batches_concurrent_clients(model_dir_factory):
    server = Server(model_dir_factory("llama", "medium"), "--kv-quant", "4", "--batch", "3")
    try:

        async def main():
            async with httpx.AsyncClient(timeout=120) as client:
                replies = [None] * 3

                async def one(i):
                    body = {"prompt": f"client {i} asks about quantized rows", "max_tokens": 8, "temperature": 0}
                    replies[i] = (await client.post(f"{server.base}/v1/completions", json=body)).json()

                async with trio.open_nursery() as nursery:
                    for i in range(3):
                        nursery.start_soon(one, i)
                return replies

        replies = trio.run(main)
        scheduler = httpx.get(f"{server.base}/stats", timeout=5).json()["scheduler"]
    finally:
        server.kill()
    assert all(reply["usage"]["completion_tokens"] == 8 for reply in replies), replies
    assert scheduler["lane"] == "batch" and scheduler["reason"] == "", scheduler
    assert max(int(rows) for rows in scheduler["batch_size_history"]) >= 2, scheduler
