"""The batch lane with real tiny MLX models: rows equal the serial lane, finished
rows serve their next turn, cancellation, gates, KV-budget admission, and the
Gateway's idle gate."""

from __future__ import annotations

import logging
import threading
from contextlib import aclosing, contextmanager

import pytest
import trio
from polling import DEADLINE_S, wait_until

from kvcellar.actors.scheduler_core import BatchState
from kvcellar.actors.system import SystemConfig, SystemSeams, open_system
from kvcellar.engine.engine import EngineThread, SamplingParams
from kvcellar.engine.generation import GenerationDone, GenerationRequest

# Lengths chosen around gemma3_text's tiny sliding window (32) so rings wrap in some rows and not others.
PROMPTS = tuple(
    tuple((7 * i + 13 * k) % 1000 + 3 for i in range(length)) for k, length in enumerate((40, 5, 90, 17, 66))
)
MAX_TOKENS = 10


def _config(model_dir, **overrides):
    values = dict(model_dir=model_dir, demote_idle_s=0, shutdown_timeout_s=60, batch_rows_max=4)
    values.update(overrides)
    return SystemConfig(**values)


def _greedy(prompt, max_tokens=MAX_TOKENS, **params):
    return GenerationRequest(
        prompt_ids=tuple(prompt), params=SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    )


async def _run(system, request):
    tokens, text, done = [], "", None
    async for item in system.generate(request):
        if isinstance(item, GenerationDone):
            done = item
        else:
            text += item.text
            if item.token_id >= 0:
                tokens.append(item.token_id)
    return tokens, text, done


async def _concurrently(system, requests):
    results = [None] * len(requests)

    async def one(index):
        results[index] = await _run(system, requests[index])

    async with trio.open_nursery() as nursery:
        for index in range(len(requests)):
            nursery.start_soon(one, index)
    return results


def _outputs(model_dir, requests, **overrides):
    """Each request's (tokens, text, done), all sent at once, and the scheduler's stats."""

    async def main():
        async with open_system(_config(model_dir, **overrides)) as system:
            results = await _concurrently(system, requests)
            return results, system.stats()["scheduler"]

    return trio.run(main)


@pytest.mark.parametrize(
    ("arch", "dtype"),
    [
        ("llama", "float32"),
        ("gemma3_text", "float32"),
        ("qwen3_next", "float32"),
        ("llama", "bfloat16"),
        ("gemma3_text", "bfloat16"),
    ],
)
def test_concurrent_greedy_rows_equal_the_same_requests_on_the_serial_lane(model_dir_factory, arch, dtype):
    model_dir = model_dir_factory(arch, dtype=dtype)
    requests = [_greedy(prompt) for prompt in PROMPTS]

    batched, stats = _outputs(model_dir, requests)
    serial, serial_stats = _outputs(model_dir, requests, batch_rows_max=1)

    assert stats["lane"] == "batch" and serial_stats["lane"] == "serial"
    assert max(int(rows) for rows in stats["batch_size_history"]) == 4, "four rows decoded together"
    assert stats["completed"] == len(PROMPTS) and stats["rows_active"] == 0
    for (tokens, _, done), (serial_tokens, _, serial_done) in zip(batched, serial, strict=True):
        assert len(tokens) == MAX_TOKENS and tokens == serial_tokens
        assert done.finish_reason == serial_done.finish_reason == "length"


def test_per_row_sampling_seeds_stop_strings_and_lengths_match_the_serial_lane(model_dir_factory):
    model_dir = model_dir_factory("llama")
    ((_, probe_text, _),) = _outputs(model_dir, [_greedy(PROMPTS[1], 16)], batch_rows_max=1)[0]
    # Five characters a few in: the stop string ends inside a token, so the row must hold text back.
    stop = probe_text[4:9]
    assert len(stop) == 5, "the probe produced text to stop on"
    requests = [
        _greedy(PROMPTS[0], 16),
        GenerationRequest(
            prompt_ids=PROMPTS[1], params=SamplingParams(temperature=0.0, max_tokens=16), stop_strings=(stop,)
        ),
        GenerationRequest(prompt_ids=PROMPTS[2], params=SamplingParams(temperature=1.0, seed=7, max_tokens=12)),
        GenerationRequest(
            prompt_ids=PROMPTS[3], params=SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=12)
        ),
        _greedy(PROMPTS[4], 3),
    ]

    batched, _ = _outputs(model_dir, requests, batch_rows_max=8)
    serial, _ = _outputs(model_dir, requests, batch_rows_max=1)

    def seen_by_client(results):
        # Which tier served a prefix depends on arrival order, so it is left out.
        return [(tokens, text, done.finish_reason, done.completion_tokens) for tokens, text, done in results]

    assert seen_by_client(batched) == seen_by_client(serial)
    assert batched[1][2].finish_reason == "stop" and stop not in batched[1][1]
    assert batched[1][1] == probe_text[: probe_text.find(stop)]
    assert batched[4][2].completion_tokens == 3


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_each_finished_rows_caches_serve_its_next_turn(model_dir_factory, arch):
    model_dir = model_dir_factory(arch)

    async def main():
        async with open_system(_config(model_dir)) as system:
            first = await _concurrently(system, [_greedy(prompt) for prompt in PROMPTS[:3]])
            follow_ups = [
                _greedy(prompt + tuple(tokens) + (5, 6, 7), 2)
                for prompt, (tokens, _, _) in zip(PROMPTS[:3], first, strict=True)
            ]
            second = await _concurrently(system, follow_ups)
            return first, second, system.stats()

    first, second, stats = trio.run(main)
    for prompt, (tokens, _, _), (_, _, done) in zip(PROMPTS[:3], first, second, strict=True):
        assert done.cache_tier == "ram"
        # The row's entry holds its prompt and every token it generated (the last one was fed too).
        assert done.cached_tokens == len(prompt) + len(tokens)
    assert stats["prompt_cache"]["hits"] == 3


def test_a_cancelled_row_leaves_the_others_unaffected_and_keeps_its_cache(model_dir_factory):
    model_dir = model_dir_factory("llama")
    requests = [_greedy(prompt, 30) for prompt in PROMPTS[:3]]
    reference, _ = _outputs(model_dir, requests, batch_rows_max=1)

    async def main():
        async with open_system(_config(model_dir)) as system:
            results = [None] * 3
            abandoned: list[int] = []

            async def leaves_early():
                async with aclosing(system.generate(requests[1])) as items:
                    async for item in items:
                        abandoned.append(item.token_id)
                        if len(abandoned) == 3:
                            break

            async def stays(index):
                results[index] = await _run(system, requests[index])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(stays, 0)
                nursery.start_soon(leaves_early)
                nursery.start_soon(stays, 2)
            await system.scheduler.drain()
            return results, abandoned, system.stats()

    results, abandoned, stats = trio.run(main)
    assert results[0][0] == reference[0][0] and results[2][0] == reference[2][0]
    assert abandoned == reference[1][0][:3]
    scheduler = stats["scheduler"]
    assert scheduler["cancelled"] == 1 and scheduler["completed"] == 2 and scheduler["rows_active"] == 0
    assert stats["prompt_cache"]["puts"] == 3, "the abandoned row's caches were put back too"


def test_unbatchable_models_and_schemes_take_the_serial_lane_with_a_log_line_saying_why(model_dir_factory, caplog):
    caplog.set_level(logging.INFO, logger="kvcellar.actors.scheduler")

    async def main():
        async with open_system(_config(model_dir_factory("llama4"))) as chunked:
            tokens, _, _ = await _run(chunked, _greedy(PROMPTS[0], 4))
            assert len(tokens) == 4
            chunked_stats = chunked.stats()["scheduler"]
        async with open_system(_config(model_dir_factory("llama"), kv_quant="8")) as quantized:
            quantized_stats = quantized.stats()["scheduler"]
        return chunked_stats, quantized_stats

    chunked_stats, quantized_stats = trio.run(main)
    assert chunked_stats["lane"] == "serial" and "kv:chunked-plain" in chunked_stats["reason"]
    assert quantized_stats["lane"] == "serial" and "kv8" in quantized_stats["reason"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("serial lane" in w and "kv:chunked-plain" in w for w in warnings), warnings
    # Quantized KV batches (tests/test_quant_batch.py) unless the scheme cannot convert the model's caches:
    # the tiny llama's head dim 16 is no multiple of kv8's group size 64.
    assert any("serial lane" in w and "cannot convert" in w and "group size" in w for w in warnings), warnings


def test_kv_budget_admission_holds_under_a_burst(model_dir_factory):
    model_dir = model_dir_factory("llama")
    requests = [_greedy(PROMPTS[4][:60], 12) for _ in range(6)]

    async def main():
        async with open_system(_config(model_dir)) as probe:
            row_bytes = probe.scheduler.projected_kv_bytes(requests[0])
        budget = 2 * row_bytes
        async with open_system(_config(model_dir, batch_rows_max=8, kv_budget_bytes=budget)) as system:
            results = await _concurrently(system, requests)
            await system.scheduler.drain()
            return results, system.stats()["scheduler"], budget

    results, stats, budget = trio.run(main)
    assert all(len(tokens) == 12 for tokens, _, _ in results)
    assert stats["completed"] == 6 and stats["admitted"] == 6
    assert stats["kv_bytes_peak"] == budget and stats["kv_budget_bytes"] == budget
    assert max(int(rows) for rows in stats["batch_size_history"]) == 2, "never more rows than the budget fits"


class PausingEngine(EngineThread):
    """A real engine thread whose first batch job stops on the engine thread,
    after its first step (`at="first_step"`) or once its rows are all done and
    the batch has ended (`at="end"`), until `resume` is set: the batch stands
    still at that point for as long as the test needs to arrange what happens
    meanwhile, with no race against the model's speed."""

    def __init__(self, model_dir, *, at: str, turn_log=None) -> None:
        super().__init__(model_dir, turn_log=turn_log)
        self.at = at
        self.paused = threading.Event()
        self.resume = threading.Event()
        self._armed = True

    def stream(self, job, cancelled, *, label="stream"):
        if label == "batch" and self._armed:
            self._armed = False
            job = self._pausing(job)
        return super().stream(job, cancelled, label=label)

    def _pausing(self, job):
        def paused_job(loaded):
            items = job(loaded)
            try:
                for index, item in enumerate(items):
                    yield item
                    if index == 0 and self.at == "first_step":
                        self._pause()
                if self.at == "end":
                    self._pause()
            finally:
                items.close()

        return paused_job

    def _pause(self) -> None:
        self.paused.set()
        self.resume.wait(DEADLINE_S)


@contextmanager
def _resumed_at_exit(engine: PausingEngine):
    """Never leave the engine thread paused, whatever the test body raised."""
    try:
        yield
    finally:
        engine.resume.set()


def test_background_steps_wait_while_batch_rows_are_active(model_dir_factory):
    model_dir = model_dir_factory("llama")
    turn_log: list[tuple[str, float, float]] = []
    rows_seen_by_steps: list[int] = []
    engine = PausingEngine(model_dir, at="first_step", turn_log=turn_log)

    async def main():
        async with open_system(_config(model_dir), SystemSeams(engine=engine)) as system:
            gateway, scheduler = system.gateway, system.scheduler

            def step(_):
                rows_seen_by_steps.append(len(scheduler.core.active))

            with _resumed_at_exit(engine):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_run, system, _greedy(PROMPTS[0], 40))
                    await wait_until(engine.paused.is_set, what="the first row's batch took its first step")
                    assert gateway.busy and len(scheduler.core.active) == 1
                    for _ in range(3):
                        nursery.start_soon(gateway.run_when_idle, step)
                    await wait_until(
                        lambda: gateway.stats()["background_waiting"] == 3,
                        what="three steps queue behind the running batch",
                    )
                    nursery.start_soon(_run, system, _greedy(PROMPTS[2], 20))
                    await wait_until(
                        lambda: len(scheduler.core.active) == 2,
                        what="the second row is admitted into the running batch",
                    )
                    engine.resume.set()
            return scheduler.stats()

    stats = trio.run(main)
    kinds = [label for label, _, _ in turn_log]
    assert rows_seen_by_steps == [0, 0, 0]
    assert kinds.index("step") > kinds.index("batch"), kinds
    assert kinds.count("batch") == 1, f"both rows shared one batch job: {kinds}"
    assert "2" in stats["batch_size_history"], "the second row joined the first mid-batch"


def test_steps_wait_for_a_row_that_arrived_while_the_last_batch_was_ending(model_dir_factory):
    """Between a batch job leaving the engine lane and the Scheduler starting
    the next one for a row that arrived meanwhile, the lane is free but a row
    waits: background work must not slip into that gap."""
    model_dir = model_dir_factory("llama")
    turn_log: list[tuple[str, float, float]] = []
    scheduler_busy_seen_by_steps: list[bool] = []
    engine = PausingEngine(model_dir, at="end", turn_log=turn_log)

    async def main():
        async with open_system(_config(model_dir), SystemSeams(engine=engine)) as system:
            gateway, scheduler = system.gateway, system.scheduler

            def step(_):
                scheduler_busy_seen_by_steps.append(scheduler.busy)

            with _resumed_at_exit(engine):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_run, system, _greedy(PROMPTS[0], 4))
                    await wait_until(engine.paused.is_set, what="the first batch ran its last row to the end")
                    assert scheduler.core.state is BatchState.ENDING and gateway.busy
                    for _ in range(3):
                        nursery.start_soon(gateway.run_when_idle, step)
                    await wait_until(
                        lambda: gateway.stats()["background_waiting"] == 3,
                        what="three steps queue behind the ending batch",
                    )
                    nursery.start_soon(_run, system, _greedy(PROMPTS[2], 4))
                    await wait_until(
                        lambda: len(scheduler.core.waiting) == 1, what="the second row waits for the next batch"
                    )
                    engine.resume.set()

    trio.run(main)
    kinds = [label for label, _, _ in turn_log]
    assert scheduler_busy_seen_by_steps == [False, False, False], kinds
    second_batch = max(i for i, kind in enumerate(kinds) if kind == "batch")
    assert kinds.count("batch") == 2, kinds
    assert "step" not in kinds[:second_batch], f"a step ran between the batches while a row waited: {kinds}"


def test_the_batch_lane_puts_a_prompt_boundary_snapshot_that_serves_a_diverging_next_turn(model_dir_factory):
    model_dir = model_dir_factory("gemma3_text")
    long_prompt = tuple((7 * i + 3) % 1000 + 3 for i in range(600))

    async def main():
        async with open_system(_config(model_dir)) as system:
            await _concurrently(system, [_greedy(long_prompt, 6), _greedy(PROMPTS[1], 6)])
            assert system.stats()["prompt_cache"]["entries"] == 3, "prompt-only snapshot + two final entries"
            _, _, done = await _run(system, _greedy(long_prompt + (999, 998), 2))
            assert done.cache_tier == "ram" and done.cached_tokens == len(long_prompt)

    trio.run(main)
