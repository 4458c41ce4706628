"""The write-behind pipeline crosses threads at most twice per entry (issue 43
item 2): one engine turn (snapshot, write plan and every tensor's bytes) and
one worker call (write, commit, index), however many tensors the entry has.

Counted through the seams every crossing goes through: the engine's turn log
(`SystemSeams.turn_log`; the SSD writer's and the coordinator's turns are
the gateway's "step" turns) and a counting `SystemSeams.run_blocking`. The
simulator crosses the same seams (`InlineEngine`, `SeededBlocking`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import trio
from mlx_lm.models.cache import make_prompt_cache

from kvcellar.actors.ssd_writer import SsdWriter
from kvcellar.actors.system import SystemConfig, SystemSeams, open_system
from kvcellar.engine.engine import SamplingParams
from kvcellar.engine.generation import GenerationDone, GenerationRequest
from kvcellar.store.prompt_cache import SpillSnapshot
from kvcellar.store.scheme import held_bytes
from kvcellar.store.spill_plan import PlannedSpill
from kvcellar.store.ssd import SsdStore

PROMPT = tuple((17 * i + 11) % 1000 + 3 for i in range(120))
OTHER_PROMPT = tuple((13 * i + 5) % 1000 + 3 for i in range(120))
# Work besides the entry's write: the journal catching up on a flush, and the restore policy's cost
# model persisted at shutdown (neither per entry).
NOT_THE_WRITE = ("wait_applied", "persist")


class CountingBlocking:
    """`run_blocking` that runs on a worker thread, as in production, and counts
    each call by the name of what it ran."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    async def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        self.calls[getattr(fn, "__name__", type(fn).__name__)] += 1
        return await trio.to_thread.run_sync(fn, *args)

    def entry_calls(self) -> Counter[str]:
        return Counter({name: count for name, count in self.calls.items() if name not in NOT_THE_WRITE})


def _request(prompt: tuple[int, ...]) -> GenerationRequest:
    return GenerationRequest(prompt_ids=prompt, params=SamplingParams(temperature=0.0, max_tokens=8))


async def _run(system: Any, request: GenerationRequest) -> GenerationDone:
    done = None
    async for item in system.generate(request):
        if isinstance(item, GenerationDone):
            done = item
    assert done is not None
    return done


def _config(model_dir: Any, tmp_path: Any, **overrides: Any) -> SystemConfig:
    values: dict[str, Any] = dict(
        model_dir=model_dir,
        ssd_dir=tmp_path / "ssd",
        # No timed attempt: the flush forces the one write, so the counts are exact.
        debounce_s=3600.0,
        busy_rearm_s=3600.0,
        demote_idle_s=0,
        shutdown_timeout_s=60,
    )
    values.update(overrides)
    return SystemConfig(**values)


def _tensor_counts(system: Any) -> list[int]:
    journal = system.store.journal
    journal.wait_applied(10.0)
    return [record.event.tensor_count for record in journal.events(kind="entry.write_started")]


def test_a_write_behind_entry_crosses_threads_twice(model_dir_factory, tmp_path):
    model_dir = model_dir_factory("llama")
    turn_log: list[tuple[str, float, float]] = []
    blocking = CountingBlocking()
    seams = SystemSeams(turn_log=turn_log, run_blocking=blocking)

    async def main() -> list[int]:
        async with open_system(_config(model_dir, tmp_path), seams) as system:
            await _run(system, _request(PROMPT))
            turn_log.clear()
            blocking.calls.clear()
            verdict = await system.flush()
            assert verdict.durable and verdict.entries == 1
            return _tensor_counts(system)

    tensor_counts = trio.run(main)
    steps = [label for label, _, _ in turn_log if label == "step"]
    assert tensor_counts == [tensor_counts[0]] and tensor_counts[0] >= 4, "one entry of several tensors"
    assert len(steps) == 1, f"engine turns for one entry: {turn_log}"
    assert blocking.entry_calls() == Counter({"write_and_index": 1}), blocking.calls
    assert len(steps) + sum(blocking.entry_calls().values()) <= 2


def test_an_evicted_entry_crosses_threads_twice(model_dir_factory, tmp_path):
    model_dir = model_dir_factory("llama")
    turn_log: list[tuple[str, float, float]] = []
    blocking = CountingBlocking()
    seams = SystemSeams(turn_log=turn_log, run_blocking=blocking)

    async def main() -> list[int]:
        # Write-behind off: the entry reaches the SSD tier only as the spill of its eviction.
        config = _config(model_dir, tmp_path, write_behind=False)
        async with open_system(config, seams) as system:
            await _run(system, _request(PROMPT))
            held = system.prompt_cache.stats()["bytes"]
            # Room for one entry: the next put evicts the first.
            system.prompt_cache.bytes_max = held + held // 2
            turn_log.clear()
            blocking.calls.clear()
            await _run(system, _request(OTHER_PROMPT))
            await system.flush()
            assert system.prompt_cache.stats()["evictions"] == 1
            assert system.store.stats()["entries_stored"] == 1
            return _tensor_counts(system)

    tensor_counts = trio.run(main)
    steps = [label for label, _, _ in turn_log if label == "step"]
    assert tensor_counts[0] >= 4
    assert len(steps) == 1, f"engine turns for one entry: {turn_log}"
    assert blocking.entry_calls() == Counter({"write_and_index": 1}), blocking.calls


def test_the_writer_takes_one_engine_turn_for_a_plain_snapshot_and_none_for_a_planned_one(
    loaded_model_factory, tmp_path
):
    llama = loaded_model_factory("llama")[0]
    store = SsdStore.open(tmp_path, "f" * 32)
    turns: list[str] = []
    blocking = CountingBlocking()

    async def run_when_idle(step: Callable[[Any], Any]) -> Any:
        turns.append("step")
        return step(None)

    writer = SsdWriter(store, run_when_idle, run_blocking=blocking)

    def snapshot(tokens: list[int]) -> SpillSnapshot:
        caches = make_prompt_cache(llama)
        mx.eval(llama(mx.array([tokens]), cache=caches))
        return SpillSnapshot(
            namespace="", tokens=tuple(tokens), caches=caches, bytes=held_bytes(caches), reason="evict"
        )

    async def main() -> None:
        assert await writer.write(snapshot(list(PROMPT))) == "stored"
        assert turns == ["step"] and blocking.calls == Counter({"write_and_index": 1})
        planned = writer.plan(snapshot([1, *list(PROMPT)]))
        assert isinstance(planned, PlannedSpill) and planned.pending is not None
        assert len(planned.segments) == planned.pending.writer.tensor_count >= 4
        assert await writer.write(planned) == "stored"
        assert turns == ["step"] and blocking.calls == Counter({"write_and_index": 2})

    trio.run(main)
    assert len(store.entry_ids()) == 2
    assert store.find([1, *list(PROMPT), 7]) is not None
    store.close()
