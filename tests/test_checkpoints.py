"""In-flight generation checkpoints (spec §5.7) in process, with real files
and a real tiny model: the version-2 entry, the request key, the checkpoint
queue's policy, the store's attempt rules, and resume on both lanes."""

from __future__ import annotations

from contextlib import aclosing
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import pytest
import trio
from mlx_lm.models.cache import make_prompt_cache

from kvcellar.actors.checkpoint_queue_core import (
    CheckpointQueueCore,
    Enqueue,
    Invalidate,
    OpDone,
    Release,
    RemoveCheckpoint,
    WriteCheckpoint,
)
from kvcellar.actors.system import SystemConfig, open_system
from kvcellar.cli import main
from kvcellar.engine.checkpointing import request_key
from kvcellar.engine.engine import SamplingParams
from kvcellar.engine.generation import GenerationDone, GenerationRequest, TokenDelta
from kvcellar.errors import UnsupportedFormat
from kvcellar.serialization import to_cbor
from kvcellar.simulations.sweep import SweepPlan, run_sweep
from kvcellar.store import kvfile
from kvcellar.store.checkpoints import CheckpointStore
from kvcellar.store.records import GenerationCheckpoint, SamplerState
from kvcellar.store.ssd import SsdStore

PROMPT = tuple(range(5, 40))
GREEDY = SamplingParams(max_tokens=48)
SEEDED = SamplingParams(max_tokens=48, temperature=0.9, seed=7)
INTERVAL_TOKENS = 8
STOP_AFTER_TOKENS = 27
SIM_RUNS = 3


def _checkpoint(key: str = "k" * 32, attempt: int = 1, emitted: int = 3) -> GenerationCheckpoint:
    return GenerationCheckpoint(
        request_key=key,
        prompt_tokens=4,
        emitted_tokens=emitted,
        namespace="",
        pending_token=9,
        sampler=SamplerState(seed=5, sample_index=emitted + 1, rng_key=(0, 5)),
        attempt=attempt,
    )


def _caches(loaded_model_factory, tokens: list[int]) -> list:
    model, _ = loaded_model_factory("llama")
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def test_a_checkpoint_is_version_2_and_a_reader_of_version_1_refuses_it(loaded_model_factory, tmp_path, monkeypatch):
    tokens = [3, 4, 5, 6, 7, 8, 9]
    caches = _caches(loaded_model_factory, tokens)
    ordinary = kvfile.save(tmp_path / "plain.kvc", caches, tokens)
    assert ordinary.format_version == 1 and "generation_checkpoint" not in str(to_cbor(ordinary))
    checkpoint = _checkpoint()
    writer = kvfile.KvFileWriter(tmp_path / "ck.kvc", caches, tokens, generation_checkpoint=checkpoint)
    kvfile.write_entry(writer)
    header = kvfile.read_header(tmp_path / "ck.kvc")
    assert header.format_version == kvfile.CHECKPOINT_FORMAT_VERSION and header.generation_checkpoint == checkpoint
    assert kvfile.load(tmp_path / "plain.kvc").header.generation_checkpoint is None
    # An older build reads version 1 only: it refuses the checkpoint rather than restore half of it.
    monkeypatch.setattr(kvfile, "READABLE_FORMAT_VERSIONS", frozenset({kvfile.FORMAT_VERSION}))
    with pytest.raises(UnsupportedFormat, match="version 2"):
        kvfile.load(tmp_path / "ck.kvc")


def test_the_request_key_covers_every_field_that_changes_the_continuation():
    base = GenerationRequest(prompt_ids=PROMPT, params=SEEDED, stop_strings=("END",), namespace="a")
    key = request_key(base, "bf16")
    assert key == request_key(attrs.evolve(base), "bf16")
    changed = [
        attrs.evolve(base, prompt_ids=PROMPT + (1,)),
        attrs.evolve(base, stop_strings=("STOP",)),
        attrs.evolve(base, namespace="b"),
        *(
            attrs.evolve(base, params=attrs.evolve(SEEDED, **{name: value}))
            for name, value in (
                ("temperature", 0.5),
                ("seed", 8),
                ("top_p", 0.9),
                ("top_k", 5),
                ("min_p", 0.1),
                ("max_tokens", 49),
                ("repetition_penalty", 1.1),
                ("presence_penalty", 0.5),
                ("frequency_penalty", 0.5),
                ("logit_bias", ((3, 1.0),)),
                ("stop_token_ids", frozenset({2})),
            )
        ),
    ]
    keys = {request_key(request, "bf16") for request in changed} | {request_key(base, "q4")}
    assert key not in keys and len(keys) == len(changed) + 1


def test_the_queue_keeps_only_the_newest_snapshot_of_a_request_and_never_drops_a_removal():
    core = CheckpointQueueCore(bytes_max=250)
    assert core.handle(Enqueue(op_id=1, request_key="a", attempt=1, emitted_tokens=8, bytes=100), 0) == [
        WriteCheckpoint(op_id=1)
    ]
    core.handle(Enqueue(op_id=2, request_key="a", attempt=1, emitted_tokens=16, bytes=100), 0)
    superseded = core.handle(Enqueue(op_id=3, request_key="a", attempt=1, emitted_tokens=24, bytes=100), 0)
    assert Release(op_id=2) in superseded, "a newer snapshot of the request replaces its queued one"
    over_cap = core.handle(Enqueue(op_id=4, request_key="b", attempt=2, emitted_tokens=8, bytes=100), 0)
    assert Release(op_id=3) in over_cap and Release(op_id=4) not in over_cap and Release(op_id=1) not in over_cap
    core.handle(Enqueue(op_id=5, request_key="a", attempt=3, emitted_tokens=8, bytes=10), 0)
    # Request b completes while the first write is in flight: its snapshot goes, its removal waits its turn.
    invalidated = core.handle(Invalidate(op_id=6, request_key="b", attempt=2), 0)
    assert Release(op_id=4) in invalidated and not any(isinstance(e, RemoveCheckpoint) for e in invalidated)
    assert core.handle(OpDone(op_id=1, outcome="stored"), 0) == [Release(op_id=1), WriteCheckpoint(op_id=5)]
    assert core.handle(OpDone(op_id=5, outcome="stored"), 0)[-1] == RemoveCheckpoint(
        op_id=6, request_key="b", attempt=2
    )
    assert core.stats()["pending_removals"] == 1 and core.stats()["pending"] == 0


def test_an_older_cleanup_never_erases_a_newer_attempt(loaded_model_factory, tmp_path):
    tokens = [3, 4, 5, 6, 7, 8, 9]
    caches = _caches(loaded_model_factory, tokens)
    ssd = SsdStore.open(tmp_path, "fp")
    try:
        store = CheckpointStore.open(ssd)
        old, new = store.new_attempt(), store.new_attempt()
        for attempt in (old, new):
            writer = store.plan(_checkpoint(attempt=attempt), tokens, caches)
            kvfile.write_entry(writer)
            assert store.commit(writer)
        store.invalidate("k" * 32, old)
        assert store.lookup("k" * 32) is not None, "the newer attempt stays resumable"
        assert not store.remove("k" * 32, old) and store.restore("k" * 32, tokens[:4]) is not None
        store.invalidate("k" * 32, new)
        assert store.lookup("k" * 32) is None
        stale = store.plan(_checkpoint(attempt=new, emitted=3), tokens, caches)
        kvfile.write_entry(stale)
        assert not store.commit(stale), "a write of a completed attempt is never indexed"
        assert store.remove("k" * 32, new) and list((ssd.directory / "checkpoints").iterdir()) == []
    finally:
        ssd.close()


async def _generate(system, request: GenerationRequest, stop_after: int | None = None) -> tuple[list[int], Any]:
    produced, done = [], None
    async with aclosing(system.generate(request)) as items:
        async for item in items:
            if isinstance(item, TokenDelta) and item.token_id >= 0:
                produced.append(item.token_id)
                if stop_after is not None and len(produced) >= stop_after:
                    break
            elif isinstance(item, GenerationDone):
                done = item
    return produced, done


def _config(model_dir: Path, ssd_dir: Path, rows: int) -> SystemConfig:
    return SystemConfig(
        model_dir=model_dir,
        ssd_dir=ssd_dir,
        generation_checkpoint_tokens=INTERVAL_TOKENS,
        batch_rows_max=rows,
        demote_idle_s=0,
        debounce_s=0.05,
    )


CASES = [
    ("llama", 1, GREEDY),
    ("llama", 1, SEEDED),
    ("llama", 3, GREEDY),
    # Recurrent state cannot trim a token to recompute logits: the pending token is what makes these work.
    ("qwen3_next", 3, SEEDED),
    ("mamba2", 1, SEEDED),
    # A sliding window's ring.
    ("gemma3_text", 3, SEEDED),
]


@pytest.mark.parametrize(
    ("arch", "rows", "params"),
    CASES,
    ids=[f"{a}-{'serial' if r == 1 else 'batch'}-{'seeded' if p.seed else 'greedy'}" for a, r, p in CASES],
)
def test_a_request_cut_off_part_way_resumes_after_a_restart_with_the_uninterrupted_output(
    model_dir_factory, tmp_path, arch, rows, params
):
    model_dir = model_dir_factory(arch)
    request = GenerationRequest(prompt_ids=PROMPT, params=params)

    async def main():
        async with open_system(_config(model_dir, tmp_path / "reference", rows)) as system:
            reference, _ = await _generate(system, request)
        async with open_system(_config(model_dir, tmp_path / "ssd", rows)) as system:
            cut, _ = await _generate(system, request, stop_after=STOP_AFTER_TOKENS)
            verdict = await system.flush()
            assert verdict.pending_checkpoints == 0 and verdict.failed_checkpoints == 0
            assert system.stats()["checkpoints"]["files"] == 1, "a disconnect keeps the checkpoint"
        async with open_system(_config(model_dir, tmp_path / "ssd", rows)) as system:
            resumed, done = await _generate(system, request)
            await system.flush()
            stats = system.stats()["checkpoints"]
            kinds = {record.kind for record in system.store.journal.events()}
        assert {"checkpoint.written", "checkpoint.resumed", "checkpoint.invalidated", "checkpoint.removed"} <= kinds
        assert resumed == reference and cut == reference[:STOP_AFTER_TOKENS]
        # The engine may run a little past the client's hang-up: the newest checkpoint is at least this far.
        saved = done.resumed_tokens
        assert saved >= STOP_AFTER_TOKENS // INTERVAL_TOKENS * INTERVAL_TOKENS and saved % INTERVAL_TOKENS == 0
        assert done.cache_tier == "checkpoint" and saved < params.max_tokens
        assert stats["resumed"] == 1 and stats["tokens_saved"] == saved and stats["files"] == 0
        assert list((tmp_path / "ssd").glob("*/checkpoints/*.kvc")) == []

    trio.run(main)


def test_requests_a_replay_cannot_reconstruct_are_skipped_by_reason(model_dir_factory, tmp_path):
    model_dir = model_dir_factory("llama")
    logprobs = GenerationRequest(prompt_ids=PROMPT, params=attrs.evolve(GREEDY, logprobs=True, max_tokens=20))
    uncached = GenerationRequest(prompt_ids=PROMPT, params=GREEDY, use_prompt_cache=False)

    async def main():
        async with open_system(_config(model_dir, tmp_path / "ssd", 1)) as system:
            await _generate(system, logprobs)
            await _generate(system, uncached)
            await system.flush()
            return system.stats()["checkpoints"]

    stats = trio.run(main)
    assert stats["skipped"] == {"logprobs": 1, "no_prompt_cache": 1} and stats["written"] == 0


def test_generation_checkpoint_without_the_ssd_tier_is_a_clear_start_up_error(capsys):
    assert main(["serve", "--generation-checkpoint", "64"]) == 2
    assert "--generation-checkpoint needs --ssd-cache" in capsys.readouterr().err


def test_the_simulator_resumes_generations_cut_off_by_crashes_with_the_uninterrupted_output():
    outcome = run_sweep(
        SweepPlan(seed=0, runs=SIM_RUNS, faults="mixed", crash_points="random", shape_name="checkpoints")
    )
    assert not outcome.failures, [(r.seed, r.violations[0]) for r, _ in outcome.failures[:3]]
    results = [result for result, _ in outcome.results]
    assert sum(r.checkpoint_resumes for r in results) >= SIM_RUNS
    assert 0 < sum(r.batch_rows > 1 for r in results) < len(results), "both lanes"


@pytest.mark.parametrize(
    ("mutation", "invariant"),
    [
        ("checkpoint-drops-pending-token", None),
        ("checkpoint-key-without-sampling", "checkpoint_resumes_its_own_request"),
    ],
)
def test_each_checkpoint_bug_is_caught_by_the_checkpoints_workload(mutation, invariant):
    outcome = run_sweep(
        SweepPlan(seed=0, runs=SIM_RUNS, faults="none", shape_name="checkpoints", mutations=frozenset({mutation})),
        stop_on_failure=True,
    )
    assert outcome.failures, f"{mutation} went unnoticed"
    result, _ = outcome.failures[0]
    assert invariant is None or result.violations[0].invariant == invariant
