"""SSD write wear (issue 21) through the whole system: a real tiny model, real
files, real SQLite. Admission's refusals in a flush verdict, the write budget
across a restart and under a flush, a turn superseding its previous turn
written once, and the wear figures equal to a replay of the journal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio
from click.testing import CliRunner
from polling import wait_until

from kvcellar.actors.system import System, SystemConfig, open_system
from kvcellar.cli import cli as kvcellar_cli
from kvcellar.engine.engine import SamplingParams
from kvcellar.engine.generation import GenerationDone, GenerationRequest
from kvcellar.store.journal import JOURNAL_FILE_NAME, Journal

GENERATED_TOKENS = 8


def _prompt(seed: int, length: int = 120) -> tuple[int, ...]:
    return tuple((17 * i + 11 * seed) % 1000 + 3 + seed for i in range(length))


def _config(model_dir: Path, tmp_path: Path, **overrides: Any) -> SystemConfig:
    values: dict[str, Any] = dict(
        model_dir=model_dir,
        ssd_dir=tmp_path / "ssd",
        debounce_s=0.05,
        busy_rearm_s=0.05,
        demote_idle_s=0,
        shutdown_timeout_s=60,
    )
    values.update(overrides)
    return SystemConfig(**values)


async def _run(system: System, prompt: tuple[int, ...]) -> tuple[tuple[int, ...], GenerationDone]:
    request = GenerationRequest(prompt_ids=prompt, params=SamplingParams(temperature=0.0, max_tokens=GENERATED_TOKENS))
    tokens, done = [], None
    async for item in system.generate(request):
        if isinstance(item, GenerationDone):
            done = item
        elif item.token_id >= 0:
            tokens.append(item.token_id)
    assert done is not None
    return tuple(tokens), done


def _entry_bytes(model_dir: Path, tmp_path: Path) -> int:
    """What one 120-token prompt and its reply cost the RAM tier."""

    async def main() -> int:
        async with open_system(_config(model_dir, tmp_path / "probe", ssd_dir=None)) as system:
            await _run(system, _prompt(1))
            return int(system.prompt_cache.stats()["bytes"])

    return trio.run(main)


def _stored_events(ssd_dir: Path) -> list[Any]:
    (journal_path,) = ssd_dir.glob(f"*/{JOURNAL_FILE_NAME}")
    journal = Journal.open_readonly(journal_path)
    try:
        return [record.event for record in journal.events(kind="entry.stored")]
    finally:
        journal.close()


def test_second_hit_skips_a_one_off_prompt_reports_it_and_writes_a_conversation_that_came_back(
    model_dir_factory, tmp_path
):
    model_dir = model_dir_factory("llama")
    # Room for one entry: each put evicts the one before.
    ram_bytes = int(1.5 * _entry_bytes(model_dir, tmp_path))

    async def main() -> None:
        config = _config(model_dir, tmp_path, prompt_cache_bytes=ram_bytes, ssd_admission="second-hit")
        async with open_system(config) as system:
            assert system.durability is not None and system.admission is not None
            await _run(system, _prompt(1))
            await wait_until(lambda: system.durability.stats()["held_records"] == 1, what="the first put is held")
            reply, _ = await _run(system, _prompt(2))  # evicts the first: never taken, so not written
            await wait_until(lambda: system.admission.stats()["skipped"] == 1, what="the eviction spill is skipped")
            verdict = await system.flush()
            assert (verdict.durable, verdict.reason, verdict.skipped_by_admission) == (
                False,
                "skipped_by_admission",
                1,
            )
            assert verdict.entries == 1 and verdict.pending == verdict.missing == 0  # the flush wrote the second
            stored_before = system.store.stats()["entries_stored"]
            # The second conversation comes back twice (two branches): the first branch's entry is taken by
            # the second, then evicted by it, and is written on leaving RAM without a flush.
            _, done2 = await _run(system, _prompt(2) + reply[:-1] + (5, 6, 7))
            assert done2.cache_tier == "ram"
            _, done3 = await _run(system, _prompt(2) + reply[:-1] + (8, 9))
            assert done3.cache_tier == "ram" and done3.cached_tokens >= len(_prompt(2))
            await wait_until(
                lambda: system.store.stats()["entries_stored"] > stored_before, what="the first branch is written"
            )
            ssd = system.stats()["ssd_cache"]
            assert ssd["admission"]["policy"] == "second-hit" and ssd["admission"]["held"] >= 1
            # Like a missing prefix, the skipped one stays reported; everything else is durable.
            final = await system.flush()
            assert (final.reason, final.skipped_by_admission, final.pending, final.missing) == (
                "skipped_by_admission",
                1,
                0,
                0,
            )

    trio.run(main)


def test_a_turn_that_supersedes_its_previous_turn_within_the_debounce_window_is_written_once(
    model_dir_factory, tmp_path
):
    model_dir = model_dir_factory("llama")

    async def main() -> None:
        # The window never closes during the test: both puts are pending when the flush comes.
        async with open_system(_config(model_dir, tmp_path, debounce_s=3600.0)) as system:
            reply, _ = await _run(system, _prompt(3))
            _, done = await _run(system, _prompt(3) + reply[:-1] + (5, 6, 7))
            assert done.cache_tier == "ram"
            assert system.durability.stats()["pending_snapshots"] == 2
            verdict = await system.flush()
            assert verdict.durable and verdict.entries == 1
            assert system.store.stats()["entries_stored"] == 1
            assert system.stats()["ssd_cache"]["write_wear"]["total"]["entries_written"] == 1

    trio.run(main)
    assert len(_stored_events(tmp_path / "ssd")) == 1


def test_the_write_budget_survives_a_restart(model_dir_factory, tmp_path):
    model_dir = model_dir_factory("llama")
    budget_bytes = 10**7
    config = _config(model_dir, tmp_path, ssd_write_budget_bytes_per_day=budget_bytes)

    async def first() -> int:
        async with open_system(config) as system:
            await _run(system, _prompt(4))
            assert (await system.flush()).durable
            level = system.stats()["ssd_cache"]["write_budget"]["level_bytes"]
            assert level < budget_bytes
            return level

    async def second() -> int:
        async with open_system(config) as system:
            return system.stats()["ssd_cache"]["write_budget"]["level_bytes"]

    level_before = trio.run(first)
    (stored,) = _stored_events(tmp_path / "ssd")
    level_after = trio.run(second)
    refill_per_minute = budget_bytes * 60 / 86_400
    assert budget_bytes - stored.entry.bytes - 1 <= level_before
    assert level_before - 1 <= level_after <= level_before + refill_per_minute


def test_a_flush_under_a_dry_budget_still_writes_and_says_it_went_over(model_dir_factory, tmp_path):
    model_dir = model_dir_factory("llama")

    async def main() -> None:
        # A thousand bytes a day: the first write (larger than a day's budget) empties the bucket. A spill
        # queue of 0 bytes keeps only the newest snapshot behind the one in flight.
        config = _config(model_dir, tmp_path, ssd_write_budget_bytes_per_day=1000, spill_queue_bytes=0)
        async with open_system(config) as system:
            budgeted, queue = system.budgeted_writes, system.queue
            assert budgeted is not None and queue is not None
            await _run(system, _prompt(5))
            await wait_until(lambda: system.store.stats()["entries_stored"] == 1, what="the first write")
            await _run(system, _prompt(6))
            await wait_until(lambda: budgeted.counters.waiting == 1, what="the second write waits for the budget")
            for seed in (7, 8):  # queued behind it: the older of the two is dropped
                await _run(system, _prompt(seed))
            # Settled with the coordinator before the flush, or the drop would count against the flush.
            durability = system.durability
            assert durability is not None
            await wait_until(
                lambda: queue.stats()["dropped"] >= 1 and durability.stats()["dropped_total"] >= 1,
                what="the oldest queued snapshot is dropped and its attempt settled",
            )
            assert system.store.stats()["entries_stored"] == 1
            verdict = await system.flush()
            assert verdict.durable and verdict.entries == 4  # the flush forced the dropped one again
            stored_bytes = _stored_bytes(system)
            assert verdict.over_budget_bytes == sum(stored_bytes[1:])  # the bucket held nothing for them
            stats = system.stats()["ssd_cache"]["write_budget"]
            assert stats["waits"] == 1 and stats["waiting"] == 0 and stats["level_bytes"] < 0
            assert stats["dropped_while_waiting"] >= 1
            assert stats["over_budget_bytes"] > verdict.over_budget_bytes  # the first one overdrew it too

    trio.run(main)


def _stored_bytes(system: System) -> list[int]:
    assert system.store is not None and system.store.journal is not None
    system.store.journal.wait_applied(10.0)
    return [record.event.entry.bytes for record in system.store.journal.events(kind="entry.stored")]


def test_the_wear_figures_equal_a_replay_of_the_journal(model_dir_factory, tmp_path):
    model_dir = model_dir_factory("llama")
    entry_bytes = _entry_bytes(model_dir, tmp_path)
    wear: dict[str, Any] = {}

    async def main() -> None:
        # One entry fits in RAM and about two on SSD: spills, supersessions, evictions and restores all happen.
        config = _config(
            model_dir, tmp_path, prompt_cache_bytes=int(1.5 * entry_bytes), ssd_bytes_max=int(2.6 * entry_bytes)
        )
        async with open_system(config) as system:
            await _run(system, _prompt(7))
            assert (await system.flush()).durable
            for seed in (8, 9, 10):
                await _run(system, _prompt(seed))
                assert (await system.flush()).durable
            # The latest two are on SSD; the one before the last left RAM: a restore.
            _, done = await _run(system, _prompt(9) + (5, 6))
            assert done.cache_tier == "ssd"
            assert (await system.flush()).durable
            wear.update(system.stats()["ssd_cache"]["write_wear"])

    trio.run(main)
    total = wear["total"]
    assert total["restores"] == 1 and total["tokens_served_from_ssd"] == len(_prompt(9))
    assert total["dead_writes"] >= 1 and total["rewrites"] >= 1 and total["entries_written"] >= 5
    result = CliRunner().invoke(kvcellar_cli, ["journal", "stats", "--json", str(tmp_path / "ssd")])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["write_wear"] == wear


def test_serve_takes_the_admission_and_budget_flags_and_reports_them(model_dir_factory, tmp_path):
    import httpx
    from test_serve import Server

    model_dir = model_dir_factory("llama")
    flags = ["--ssd-cache", str(tmp_path / "ssd"), "--ssd-admission", "second-hit", "--ssd-write-budget", "1.5"]
    running = Server(model_dir, "--batch", "1", *flags)
    try:
        reply = httpx.post(
            f"{running.base}/v1/completions", json={"prompt": "Once upon", "max_tokens": 4, "temperature": 0}
        )
        assert reply.status_code == 200, reply.text
        flushed = httpx.post(f"{running.base}/admin/cache/flush", timeout=60).json()
        assert flushed["durable"] and flushed["skipped_by_admission"] == 0 and flushed["over_budget_bytes"] == 0
        ssd = httpx.get(f"{running.base}/stats").json()["ssd_cache"]
        assert ssd["admission"]["policy"] == "second-hit"
        assert ssd["write_budget"]["bytes_per_day"] == 1_500_000_000 and ssd["write_budget"]["waits"] == 0
        assert ssd["write_wear"]["total"]["entries_written"] == 1
        written = ssd["write_wear"]["total"]["bytes_written"]
        assert ssd["write_budget"]["level_bytes"] <= 1_500_000_000 - written + 1_500_000_000 * 60 // 86_400
        metrics = httpx.get(f"{running.base}/metrics").text
        assert f"kvcellar_ssd_cache_written_bytes_total {float(written)}" in metrics
        assert "kvcellar_ssd_cache_write_budget_level_bytes" in metrics
    finally:
        status, output = running.stop()
    assert status == 0, output
