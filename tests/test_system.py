"""The whole actor system with a real tiny model, real files and SQLite."""

from __future__ import annotations

import errno
from contextlib import aclosing
from functools import partial

import pytest
import trio
from polling import wait_until

from kvcellar.actors.system import SystemConfig, SystemSeams, open_system
from kvcellar.engine.engine import SamplingParams
from kvcellar.engine.generation import GenerationDone, GenerationRequest
from kvcellar.errors import DiskError
from kvcellar.store.disk import RealDisk

PROMPT = tuple((17 * i + 11) % 1000 + 3 for i in range(120))


def _request(prompt, max_tokens=8):
    return GenerationRequest(prompt_ids=tuple(prompt), params=SamplingParams(temperature=0.0, max_tokens=max_tokens))


async def _run(system, request):
    tokens, done = [], None
    async for item in system.generate(request):
        if isinstance(item, GenerationDone):
            done = item
        elif item.token_id >= 0:
            tokens.append(item.token_id)
    return tokens, done


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


def test_flushed_prefix_survives_a_restart_and_continues_identically(model_dir_factory, tmp_path):
    model_dir = model_dir_factory("llama")

    async def main():
        async with open_system(_config(model_dir, tmp_path)) as system:
            first, done = await _run(system, _request(PROMPT))
            assert done.cached_tokens == 0
            verdict = await system.flush()
            assert verdict.durable and verdict.entries >= 1
            assert verdict.longest_durable_prefix_tokens >= len(PROMPT)
        follow_up = PROMPT + tuple(first[:-1]) + (5, 6, 7)
        async with open_system(_config(model_dir, tmp_path)) as restarted:
            warm, warm_done = await _run(restarted, _request(follow_up, 16))
            assert warm_done.cache_tier == "ssd" and warm_done.cached_tokens >= len(PROMPT)
            assert restarted.stats()["ssd_cache"]["restores"] == 1
        async with open_system(_config(model_dir, tmp_path / "cold", ssd_dir=None, prompt_cache_bytes=0)) as cold:
            fresh, fresh_done = await _run(cold, _request(follow_up, 16))
            assert fresh_done.cached_tokens == 0
        assert warm == fresh

    trio.run(main)


def test_second_turn_reuses_the_ram_entry(model_dir_factory, tmp_path):
    model_dir = model_dir_factory("llama")

    async def main():
        async with open_system(_config(model_dir, tmp_path, ssd_dir=None)) as system:
            first, _ = await _run(system, _request(PROMPT))
            _, done = await _run(system, _request(PROMPT + tuple(first[:-1]) + (9,)))
            assert done.cache_tier == "ram" and done.cached_tokens == len(PROMPT) + len(first) - 1
            assert system.stats()["prompt_cache"]["hits"] == 1

    trio.run(main)


async def _run_holding_the_lane(system, request, *, started: trio.Event, release: trio.Event):
    """`_run`, whose consumer stops after the first item until `release`: a
    serial request keeps the lane until its stream is consumed, so it stays
    the active request for as long as the test needs, however fast the model."""
    async with aclosing(system.generate(request)) as items:
        async for _ in items:
            if not started.is_set():
                started.set()
                await release.wait()


def test_background_work_never_runs_while_a_request_is_active_or_waiting(model_dir_factory, tmp_path):
    model_dir = model_dir_factory("llama")
    turn_log: list[tuple[str, float, float]] = []

    async def main():
        async with open_system(_config(model_dir, tmp_path, debounce_s=0.0), SystemSeams(turn_log=turn_log)) as system:
            gateway = system.gateway
            first_started, first_release, second_started, second_release = (trio.Event() for _ in range(4))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    partial(
                        _run_holding_the_lane,
                        system,
                        _request(PROMPT, 30),
                        started=first_started,
                        release=first_release,
                    )
                )
                await first_started.wait()
                for _ in range(3):
                    nursery.start_soon(gateway.run_when_idle, lambda _: None)
                await wait_until(
                    lambda: gateway.stats()["background_waiting"] >= 3,
                    what="three steps queue behind the active request",
                )
                nursery.start_soon(
                    partial(
                        _run_holding_the_lane,
                        system,
                        _request((1,) + PROMPT[:60], 20),
                        started=second_started,
                        release=second_release,
                    )
                )
                await wait_until(lambda: gateway.stats()["waiting"] == 1, what="the second request waits")
                first_release.set()
                await second_started.wait()
                assert gateway.stats()["background_waiting"] >= 3, "the lane went to the waiting request"
                nursery.start_soon(_run, system, _request((2,) + PROMPT[:60], 20))
                await wait_until(
                    lambda: gateway.stats()["waiting"] == 1, what="the third request waits behind the second"
                )
                second_release.set()
            await system.flush()

    trio.run(main)
    kinds = [label for label, _, _ in turn_log]
    generations = [i for i, kind in enumerate(kinds) if kind == "generate"]
    assert len(generations) == 3
    assert "step" not in kinds[: generations[-1]], f"background work ran while requests were waiting: {kinds}"
    assert kinds[generations[-1] + 1 :].count("step") >= 3, kinds


class ToggleFaultDisk(RealDisk):
    fail = False

    def write_at(self, handle, offset, data):
        if self.fail:
            raise DiskError("injected: no space left on device", errno=errno.ENOSPC)
        super().write_at(handle, offset, data)


def test_a_write_failure_is_not_durable_and_the_next_flush_after_the_fault_is(model_dir_factory, tmp_path):
    model_dir = model_dir_factory("llama")
    disk = ToggleFaultDisk()

    async def main():
        async with open_system(_config(model_dir, tmp_path, debounce_s=30.0), SystemSeams(disk=disk)) as system:
            disk.fail = True
            await _run(system, _request(PROMPT))
            failed = await system.flush()
            assert not failed.durable and failed.failed >= 1
            disk.fail = False
            healed = await system.flush()
            assert healed.durable and healed.entries >= 1

    trio.run(main)


def test_prompt_cache_zero_with_an_ssd_tier_is_a_usage_error(model_dir_factory, tmp_path):
    from kvcellar.errors import UsageError

    async def main():
        async with open_system(_config(model_dir_factory("llama"), tmp_path, prompt_cache_bytes=0)):
            pass

    with pytest.raises(UsageError, match="RAM tier"):
        trio.run(main)


def test_prompt_boundary_snapshot_serves_a_diverging_next_turn_of_an_untrimmable_model(model_dir_factory, tmp_path):
    model_dir = model_dir_factory("gemma3_text")
    long_prompt = tuple((7 * i + 3) % 1000 + 3 for i in range(600))

    async def main():
        async with open_system(_config(model_dir, tmp_path, ssd_dir=None)) as system:
            await _run(system, _request(long_prompt, 6))
            assert system.stats()["prompt_cache"]["entries"] == 2, "prompt-only snapshot + final entry"
            _, done = await _run(system, _request(long_prompt + (999, 998), 2))
            assert done.cache_tier == "ram" and done.cached_tokens == len(long_prompt)

    trio.run(main)


def test_write_behind_off_by_environment_keeps_spill_on_evict_and_says_so(model_dir_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCELLAR_SSD_WRITEBEHIND", "0")
    model_dir = model_dir_factory("llama")

    async def main():
        async with open_system(_config(model_dir, tmp_path)) as system:
            assert system.durability is None and system.queue is not None
            await _run(system, _request(PROMPT))
            verdict = await system.flush()
            assert not verdict.durable and "write-behind is off" in verdict.note
            assert system.stats()["ssd_cache"]["entries"] == 0

    trio.run(main)


def test_the_journal_cli_reads_a_real_system_run(model_dir_factory, tmp_path):
    import json

    from click.testing import CliRunner

    from kvcellar.cli import cli

    async def main():
        async with open_system(_config(model_dir_factory("llama"), tmp_path)) as system:
            await _run(system, _request(PROMPT))
            assert (await system.flush()).durable

    trio.run(main)
    runner = CliRunner()
    verify = runner.invoke(cli, ["journal", "verify", str(tmp_path / "ssd")])
    assert verify.exit_code == 0, verify.output
    exported = runner.invoke(cli, ["journal", "export", "--format", "jsonl", str(tmp_path / "ssd")])
    kinds = {json.loads(line)["kind"] for line in exported.output.splitlines() if line.strip()}
    assert {"request.admitted", "durability.settled", "entry.write_started", "entry.stored", "flush.verdict"} <= kinds
