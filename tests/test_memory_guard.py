"""The memory-pressure guard (engine/memory.py, issue 16).

The relief and admission logic runs against a deterministic meter (live bytes
= a fixed base plus what the RAM tier bills); the whole system runs with the
real tiny llama and MLX's own allocator counters: a stream of distinct long
prompts under a budget that fits the weights plus about two entries stays
under the budget (MLX's peak, reset after start) and completes, with an SSD
tier restoring the earlier prefixes with the same output and without one
dropping exactly the entries that left RAM; a request larger than the budget
is a 503 `insufficient_memory` in each API's own shape and the next one is
served; the batch lane under a burst stays under the budget.
"""

from __future__ import annotations

import gc
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
import trio
from mlx_lm.models.cache import KVCache
from test_http_errors import InProcessServer

from kvcellar.actors.system import SystemConfig, open_system
from kvcellar.engine.demo_models import model_size_bytes
from kvcellar.engine.engine import SamplingParams
from kvcellar.engine.generation import GenerationDone, GenerationRequest
from kvcellar.engine.memory import (
    Footprint,
    GuardedRequest,
    MemoryGuard,
    WorkspaceModel,
    cuda_memory_bytes,
    default_memory_budget_bytes,
)
from kvcellar.engine.speculative import Drafter
from kvcellar.errors import InsufficientMemory
from kvcellar.http.anthropic import failure_event_body
from kvcellar.http.app import failure_body
from kvcellar.store.actor_events import MemoryRelieved
from kvcellar.store.prompt_cache import PromptCache
from kvcellar.store.scheme import KvScheme

PROMPT_TOKENS = 1000
MAX_TOKENS = 24
PREFILL_STEP_TOKENS = 64
HUGE_BUDGET_BYTES = 10**12
# Past one 256-token relief check of the decode loop.
FOLLOW_UP_MAX_TOKENS = 300


# -- the guard against a deterministic meter --------------------------------------


class BilledMeter:
    """Live bytes = `base` + what the RAM tier bills + `extra`."""

    def __init__(self, cache: PromptCache, base: int) -> None:
        self.cache, self.base, self.extra, self.clears = cache, base, 0, 0

    def active_bytes(self) -> int:
        return self.base + self.cache.bytes_total + self.extra

    def peak_bytes(self) -> int:
        return 0

    def cache_bytes(self) -> int:
        return 0

    def clear_cache(self) -> None:
        self.clears += 1


class ListJournal:
    def __init__(self) -> None:
        self.events: list[tuple[object, str]] = []

    def append(self, event, *, actor: str) -> None:
        self.events.append((event, actor))


def _caches(rows: int) -> list:
    cache = KVCache()
    cache.update_and_fetch(mx.zeros((1, 1, rows, 8)), mx.zeros((1, 1, rows, 8)))
    mx.eval(cache.state)
    return [cache]


def _footprint(prototypes: list) -> Footprint:
    return Footprint(
        scheme=KvScheme.bf16(),
        prototypes=prototypes,
        workspace=WorkspaceModel(heads=1, hidden=8, intermediate=8, vocab=8),
        prefill_step_tokens=PREFILL_STEP_TOKENS,
    )


def _guard(cache: PromptCache, meter: BilledMeter, budget: int, prototypes: list | None = None, **kw) -> MemoryGuard:
    footprint = _footprint(prototypes or [])
    return MemoryGuard(budget, meter, footprint=footprint, weights_bytes=meter.base, prompt_cache=cache, **kw)


def _three_entries() -> tuple[PromptCache, list[str], int]:
    cache = PromptCache(10**9)
    ids = [cache.put_entry([first, 5, 6, 7], _caches(100)) for first in (1, 2, 3)]
    assert all(ids)
    # A take touches entry 0: the LRU order becomes 1, 2, 0.
    assert cache.take([1, 5, 6, 7, 9]).entry_id == ids[0]
    return cache, [i for i in ids if i], cache.bytes_total // 3


def test_relief_persists_lru_entries_first_skips_protected_ones_and_journals_once():
    cache, ids, entry_bytes = _three_entries()
    meter = BilledMeter(cache, base=1000)
    persisted: list[tuple[int, ...]] = []
    journal = ListJournal()

    def persist(snapshot):
        persisted.append(snapshot.tokens)
        return "stored"

    # Over by just over one entry: two releases are needed, and entry 1 (the LRU) is protected.
    budget = meter.active_bytes() + 100 - entry_bytes - 1
    guard = _guard(cache, meter, budget, persist=persist, journal=journal)
    guard.relieve(100, protected={ids[1]}, phase="prefill")
    assert persisted == [(3, 5, 6, 7), (1, 5, 6, 7)]
    assert len(cache) == 1 and meter.clears == 1
    stats = guard.stats()
    assert stats["relief_events"] == 1 and stats["relief_persisted_entries"] == 2
    assert stats["relief_persisted_bytes"] == 2 * entry_bytes and stats["relief_dropped_entries"] == 0
    ((event, actor),) = journal.events
    assert actor == "memory" and isinstance(event, MemoryRelieved) and event.satisfied
    assert event.persisted_entries == 2 and event.active_after_bytes == meter.active_bytes()
    # Under the budget: no relief, no event.
    guard.relieve(0, phase="decode")
    assert guard.stats()["relief_events"] == 1 and len(journal.events) == 1


def test_relief_without_an_ssd_tier_drops_and_counts_and_fails_when_only_protected_entries_are_left():
    cache, ids, entry_bytes = _three_entries()
    meter = BilledMeter(cache, base=1000)
    guard = _guard(cache, meter, budget=1000 + entry_bytes)
    with pytest.raises(InsufficientMemory) as refused:
        guard.relieve(entry_bytes, protected={ids[0]}, phase="decode")
    assert len(cache) == 1 and cache.take([1, 5, 6, 7, 9]).entry_id == ids[0]
    stats = guard.stats()
    assert stats["relief_dropped_entries"] == 2 and stats["relief_dropped_bytes"] == 2 * entry_bytes
    assert stats["relief_failures"] == 1 and stats["relief_persisted_entries"] == 0
    assert refused.value.budget_bytes == 1000 + entry_bytes and refused.value.needed_bytes == entry_bytes


def test_admission_refuses_only_what_cannot_fit_after_every_reclaimable_entry_is_released():
    cache, ids, entry_bytes = _three_entries()
    meter = BilledMeter(cache, base=1000)
    guard = _guard(cache, meter, budget=meter.active_bytes())
    guard.admit(3 * entry_bytes)  # everything reclaimable
    guard.admit(2 * entry_bytes, protected={ids[0]})
    with pytest.raises(InsufficientMemory) as refused:
        guard.admit(2 * entry_bytes + 1, protected={ids[0]})
    assert refused.value.available_bytes == 2 * entry_bytes and len(cache) == 3
    assert guard.stats()["requests_refused"] == 1
    assert guard.fits_budget(3 * entry_bytes) is None and guard.fits_budget(3 * entry_bytes + 1) is not None


def test_admission_counts_the_drafts_kv_over_the_same_tokens_when_a_draft_may_serve():
    footprint = _footprint(_caches(1))
    plain = footprint.request_bytes(PROMPT_TOKENS, MAX_TOKENS)
    # The KV of 1000 + 24 tokens is allocated in 256-token steps: 1024 tokens for the draft too.
    assert footprint.request_bytes(PROMPT_TOKENS, MAX_TOKENS, draft_kv_bytes_per_token=48) == plain + 48 * 1024
    cache = PromptCache(10**9)
    meter = BilledMeter(cache, base=1000)
    guard = _guard(cache, meter, budget=1000 + plain + 100, prototypes=_caches(1))
    GuardedRequest(guard).admit(PROMPT_TOKENS, MAX_TOKENS)
    with pytest.raises(InsufficientMemory):
        GuardedRequest(guard).admit(PROMPT_TOKENS, MAX_TOKENS, draft_kv_bytes_per_token=48)
    assert guard.stats()["requests_refused"] == 1
    # A request the draft never serves (log-probabilities) counts no draft KV.
    drafter = Drafter(model=None, model_dir=Path("/draft"), num_draft_tokens=3, digest="d" * 32, kv_bytes_per_token=48)
    logprobs = GenerationRequest(prompt_ids=(1, 2), params=SamplingParams(logprobs=True))
    assert drafter.admission_kv_bytes_per_token(logprobs) == 0
    assert drafter.admission_kv_bytes_per_token(GenerationRequest(prompt_ids=(1, 2), params=SamplingParams())) == 48


def test_default_budget_is_three_quarters_of_physical_memory_capped_by_the_working_set():
    assert default_memory_budget_bytes(physical_bytes=16 * 10**9, working_set_bytes=0) == 12 * 10**9
    assert default_memory_budget_bytes(physical_bytes=16 * 10**9, working_set_bytes=10**10) == 10**10
    assert 0 < default_memory_budget_bytes() < default_memory_budget_bytes(physical_bytes=10**15)


def test_on_a_cuda_gpu_the_budget_is_nine_tenths_of_its_memory_whatever_the_host_has():
    h200 = {"device_name": "NVIDIA H200", "architecture": "sm_90", "total_memory": 150_000_000_000}
    gpu, cpu = mx.Device(mx.DeviceType.gpu), mx.Device(mx.DeviceType.cpu)
    assert cuda_memory_bytes(gpu, cuda_available=lambda: True, device_info=lambda _: h200) == 150 * 10**9
    assert cuda_memory_bytes(gpu, cuda_available=lambda: False, device_info=lambda _: h200) is None  # Metal
    assert cuda_memory_bytes(cpu, cuda_available=lambda: True, device_info=lambda _: h200) is None
    assert cuda_memory_bytes() is None  # this machine: the CPU backend
    assert default_memory_budget_bytes(physical_bytes=16 * 10**9, working_set_bytes=0, cuda_bytes=150 * 10**9) == (
        135 * 10**9
    )
    assert default_memory_budget_bytes(physical_bytes=16 * 10**9, working_set_bytes=0, cuda_bytes=0) == 12 * 10**9


def test_stats_show_the_gpu_memory_the_driver_reports_and_nothing_without_one():
    cache, _, _ = _three_entries()
    driver = {"device_name": "NVIDIA H200", "total_memory": 150 * 10**9, "free_memory": 90 * 10**9}
    on_gpu = _guard(cache, BilledMeter(cache, 0), 10**9, device_info=lambda: driver)
    assert on_gpu.stats()["device_total_bytes"] == 150 * 10**9
    assert on_gpu.stats()["device_free_bytes"] == 90 * 10**9
    on_cpu = _guard(cache, BilledMeter(cache, 0), 10**9)
    assert "device_total_bytes" not in on_cpu.stats()


def test_insufficient_memory_is_a_503_in_the_openai_and_anthropic_shapes():
    error = InsufficientMemory("too big", needed_bytes=9, available_bytes=4, budget_bytes=7)
    status, body = failure_body(error)
    assert status == 503 and body["error"]["type"] == "insufficient_memory"
    assert body["error"]["code"] == "insufficient_memory" and body["error"]["needed_bytes"] == 9
    status, body = failure_event_body(error)
    assert status == 503 and body["type"] == "error" and body["error"]["type"] == "insufficient_memory"
    assert (body["error"]["available_bytes"], body["error"]["budget_bytes"]) == (4, 7)


# -- the whole system with real MLX accounting -----------------------------------------


def _prompt(index: int, tokens: int = PROMPT_TOKENS) -> tuple[int, ...]:
    return tuple((31 * index + 7 * j + 3) % 1000 + 3 for j in range(tokens))


def _request(prompt, max_tokens=MAX_TOKENS) -> GenerationRequest:
    return GenerationRequest(prompt_ids=tuple(prompt), params=SamplingParams(max_tokens=max_tokens))


async def _run(system, request):
    tokens, done = [], None
    async for item in system.generate(request):
        if isinstance(item, GenerationDone):
            done = item
        elif item.token_id >= 0:
            tokens.append(item.token_id)
    return tokens, done


def _config(model_dir, tmp_path, budget, *, ssd: bool, **overrides) -> SystemConfig:
    values = dict(
        model_dir=model_dir,
        ssd_dir=tmp_path / "ssd" if ssd else None,
        demote_idle_s=0,
        debounce_s=0.05,
        busy_rearm_s=0.05,
        prefill_step_tokens=PREFILL_STEP_TOKENS,
        memory_budget_bytes=budget,
    )
    values.update(overrides)
    return SystemConfig(**values)


def _tight_budget(model_dir, tmp_path, **overrides) -> int:
    """The weights, the largest request's footprint (the follow-up below: a
    prompt entry plus 300 tokens) and two entries, as the guard of this model
    measures and projects them."""

    async def measure():
        async with open_system(_config(model_dir, tmp_path / "probe", HUGE_BUDGET_BYTES, ssd=False)) as probe:
            guard = probe.memory_guard
            entry = guard.footprint.kv_bytes(PROMPT_TOKENS + MAX_TOKENS)
            request = guard.footprint.request_bytes(PROMPT_TOKENS + MAX_TOKENS + 3, FOLLOW_UP_MAX_TOKENS)
            return guard.weights_bytes + request + 2 * entry

    gc.collect()  # what earlier tests' systems held is freed before the probe measures
    budget = trio.run(measure)
    gc.collect()  # and what the probe system held, before the real one loads
    return budget


async def _peak_reset(system) -> None:
    await system.engine.call(lambda _: mx.reset_peak_memory())


async def _peak(system) -> int:
    return await system.engine.call(lambda _: int(mx.get_peak_memory()))


def test_a_stream_of_long_prompts_stays_under_the_budget_and_ssd_restores_earlier_prefixes(model_dir_factory, tmp_path):
    model_dir = model_dir_factory("llama")
    budget = _tight_budget(model_dir, tmp_path)

    async def main():
        async with open_system(_config(model_dir, tmp_path, budget, ssd=True)) as system:
            await _peak_reset(system)
            outputs = [await _run(system, _request(_prompt(i))) for i in range(5)]
            peak = await _peak(system)
            memory = system.stats()["memory"]
            assert memory["relief_events"] >= 1 and memory["relief_persisted_entries"] >= 1
            assert memory["relief_failures"] == 0 and memory["relief_dropped_entries"] == 0
            assert peak <= budget, f"MLX peaked at {peak} bytes over the {budget}-byte budget"
            journal = system.store.journal
            relieved = await trio.to_thread.run_sync(lambda: list(journal.events(kind="memory.relieved")))
            assert len(relieved) == memory["relief_events"]
            assert all(e.event.satisfied and e.actor == "memory" for e in relieved)
            again, done = await _run(system, _request(_prompt(0)))
            assert done.cache_tier == "ssd" and done.cached_tokens == PROMPT_TOKENS - 1
            assert again == outputs[0][0]

    trio.run(main)


def test_without_an_ssd_tier_relief_drops_what_left_ram_and_never_the_requests_own_cache(model_dir_factory, tmp_path):
    model_dir = model_dir_factory("llama")
    budget = _tight_budget(model_dir, tmp_path)
    # The last prompt's follow-up is lent the last entry and decodes past a 256-token relief check.
    follow_up_of_last = 3

    async def stream(config):
        async with open_system(config) as system:
            await _peak_reset(system)
            outputs = [await _run(system, _request(_prompt(i))) for i in range(follow_up_of_last + 1)]
            last_tokens, _ = outputs[-1]
            follow_up = _prompt(follow_up_of_last) + tuple(last_tokens[:-1]) + (9, 10, 11)
            outputs.append(await _run(system, _request(follow_up, max_tokens=FOLLOW_UP_MAX_TOKENS)))
            return outputs, await _peak(system), system.stats()

    tight, peak, stats = trio.run(stream, _config(model_dir, tmp_path, budget, ssd=False))
    gc.collect()
    roomy, _, _ = trio.run(stream, _config(model_dir, tmp_path, HUGE_BUDGET_BYTES, ssd=False))
    assert [tokens for tokens, _ in tight] == [tokens for tokens, _ in roomy]
    follow_up_done = tight[-1][1]
    assert follow_up_done.cache_tier == "ram" and follow_up_done.cached_tokens > PROMPT_TOKENS
    memory, ram = stats["memory"], stats["prompt_cache"]
    assert memory["relief_events"] >= 1 and memory["relief_failures"] == 0
    assert memory["relief_dropped_entries"] == ram["puts"] - ram["supersessions"] - ram["evictions"] - ram["entries"]
    assert memory["relief_dropped_entries"] >= 1 and memory["relief_persisted_entries"] == 0
    assert peak <= budget, f"MLX peaked at {peak} bytes over the {budget}-byte budget"


def test_the_batch_lane_under_a_burst_stays_under_the_budget(model_dir_factory, tmp_path):
    model_dir = model_dir_factory("llama")
    budget = _tight_budget(model_dir, tmp_path)
    outcomes: list[str] = []

    async def one(system, index):
        try:
            await _run(system, _request(_prompt(index)))
        except InsufficientMemory:
            outcomes.append("refused")
        else:
            outcomes.append("completed")

    async def main():
        async with open_system(_config(model_dir, tmp_path, budget, ssd=False, batch_rows_max=4)) as system:
            assert system.scheduler is not None
            assert system.scheduler.stats()["kv_budget_bytes"] <= budget - system.memory_guard.weights_bytes
            await _peak_reset(system)
            async with trio.open_nursery() as nursery:
                for index in range(6):
                    nursery.start_soon(one, system, index)
            return await _peak(system), system.stats()

    peak, stats = trio.run(main)
    # The scheduler admits rows by their whole footprint against the headroom, so the
    # burst is queued rather than refused, and relief makes room for each row.
    assert outcomes == ["completed"] * 6
    assert stats["memory"]["relief_events"] >= 1 and stats["memory"]["relief_failures"] == 0
    assert peak <= budget, f"MLX peaked at {peak} bytes over the {budget}-byte budget"


def test_a_request_larger_than_the_budget_is_a_503_in_each_api_and_the_next_one_is_served(model_dir_factory):
    model_dir = model_dir_factory("llama")
    gc.collect()
    # Headroom of 4 MB over what is live before the start and the weights: a request
    # of 7000 tokens needs far more (KV and one chunk's attention scores).
    budget = int(mx.get_active_memory()) + model_size_bytes(model_dir) + 4 * 10**6
    huge = {"max_tokens": 7000}
    config = SystemConfig(model_dir=model_dir, memory_budget_bytes=budget)
    with InProcessServer(config) as server, httpx.Client(base_url=server.base, timeout=60) as client:
        chat = {"messages": [{"role": "user", "content": "hello " * 40}], **huge}
        for stream in (False, True):
            answer = client.post("/v1/chat/completions", json={**chat, "stream": stream})
            assert answer.status_code == 503, answer.text
            error = answer.json()["error"]
            assert error["type"] == "insufficient_memory" and error["budget_bytes"] == budget
            assert error["needed_bytes"] > error["available_bytes"]
        answer = client.post("/v1/messages", json={**chat, "model": "m"})
        assert answer.status_code == 503 and answer.json()["type"] == "error"
        assert answer.json()["error"]["type"] == "insufficient_memory"
        answer = client.post("/v1/responses", json={"input": "hello " * 40, "max_output_tokens": 7000})
        assert answer.status_code == 503 and answer.json()["error"]["type"] == "insufficient_memory"
        served = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert served.status_code == 200 and served.json()["choices"][0]["message"]["content"] is not None
        memory = client.get("/stats").json()["memory"]
        assert memory["requests_refused"] == 4 and memory["budget_bytes"] == budget
        metrics = client.get("/metrics").text
        assert "kvcellar_memory_requests_refused_total 4.0" in metrics
        samples = dict(line.split(" ") for line in metrics.splitlines() if not line.startswith("#"))
        assert float(samples["kvcellar_memory_budget_bytes"]) == budget
