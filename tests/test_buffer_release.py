"""The engine thread releases MLX's buffer cache once idle, not after every job.

A request sent the moment the previous reply ends used to wait for that job's
tail `mx.clear_cache()` (up to 16 ms on a RAM hit). `EngineThread._run` now
releases the cache only when no job came for `release_idle_s`, or at once when
it holds more than `release_at_once_bytes`. Real engine threads with a real tiny
model; the order of jobs and releases is read from what they record, and the
idle release is waited on as observable state (never a sleep).
"""

from __future__ import annotations

import mlx.core as mx
import trio
from polling import wait_until

from kvcellar.engine.engine import EngineThread, MlxBufferCache

NEVER_IDLE_S = 3600.0


class RecordingCache:
    """A buffer cache that holds what jobs say and records every release in `log`."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.held_bytes = 0

    def cache_bytes(self) -> int:
        return self.held_bytes

    def clear_cache(self) -> None:
        self.log.append("release")
        self.held_bytes = 0


def _run_jobs(engine: EngineThread, jobs: list) -> list:
    async def main() -> list:
        await engine.start()
        try:
            return [await engine.call(job, needs_model=False) for job in jobs]
        finally:
            engine.stop()

    return trio.run(main)


def _job(log: list[str], cache: RecordingCache, name: str, leaves_bytes: int):
    def job(_: object) -> None:
        log.append(name)
        cache.held_bytes = leaves_bytes

    return job


def test_back_to_back_jobs_do_not_wait_for_a_release(model_dir_factory):
    log: list[str] = []
    cache = RecordingCache(log)
    engine = EngineThread(model_dir_factory("llama"), buffer_cache=cache, release_idle_s=NEVER_IDLE_S)
    _run_jobs(engine, [_job(log, cache, "first", 1 << 20), _job(log, cache, "second", 1 << 20)])
    assert log[-2:] == ["first", "second"]
    assert cache.held_bytes == 1 << 20


def test_a_cache_over_the_bound_is_released_at_once(model_dir_factory):
    log: list[str] = []
    cache = RecordingCache(log)
    engine = EngineThread(
        model_dir_factory("llama"), buffer_cache=cache, release_idle_s=NEVER_IDLE_S, release_at_once_bytes=1000
    )
    _run_jobs(engine, [_job(log, cache, "big", 1001), _job(log, cache, "small", 1000), _job(log, cache, "last", 0)])
    assert log[-4:] == ["big", "release", "small", "last"]


def test_an_idle_engine_releases_the_real_mlx_cache(model_dir_factory):
    releases: list[str] = []

    class Recorded(MlxBufferCache):
        def clear_cache(self) -> None:
            super().clear_cache()
            releases.append("release")

    engine = EngineThread(model_dir_factory("llama"), buffer_cache=Recorded(), release_idle_s=0.05)

    def allocate_and_free(_: object) -> tuple[int, int]:
        mx.eval(mx.ones((1 << 20,)) + 1)  # freed on return: its buffers go to MLX's cache
        return len(releases), int(mx.get_cache_memory())

    async def main() -> tuple[int, int]:
        await engine.start()
        try:
            releases_before, cached_bytes = await engine.call(allocate_and_free, needs_model=False)
            await wait_until(lambda: len(releases) > releases_before, what="the idle engine released MLX's cache")
            return cached_bytes, await engine.call(lambda _: int(mx.get_cache_memory()), needs_model=False)
        finally:
            engine.stop()

    cached_bytes, after_bytes = trio.run(main)
    assert cached_bytes >= 4 << 20
    assert after_bytes == 0
