"""serve loads the model while the SSD tier opens (`load_model_beside_store`): ready after
the longer of the two, and a failure of either is the user's error itself, with nothing
left open."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from kvcellar.actors.system import SystemConfig, SystemSeams, open_system
from kvcellar.actors.system_wiring import load_model_beside_store
from kvcellar.engine.engine import EngineThread
from kvcellar.errors import DirectoryLocked, ModelError
from kvcellar.store.fingerprint import compute_fingerprint
from kvcellar.store.scheme import resolve_kv_scheme
from kvcellar.store.ssd import SsdStore

LOADED = object()


class _Store:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _Engine:
    """`start()` waits for `before_loading` (when given), then loads or fails."""

    def __init__(self, *, error: Exception | None = None, before_loading: trio.Event | None = None) -> None:
        self.error = error
        self.before_loading = before_loading
        self.loading = trio.Event()

    async def start(self) -> object:
        self.loading.set()
        if self.before_loading is not None:
            await self.before_loading.wait()
        if self.error is not None:
            raise self.error
        return LOADED


def _run(main) -> None:
    # Virtual time: a start that waited on itself would reach the deadline at once, not hang.
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_the_tier_opens_while_the_model_loads():
    store = _Store()

    async def main():
        tier_opening = trio.Event()
        engine = _Engine(before_loading=tier_opening)

        async def open_tier():
            tier_opening.set()
            await engine.loading.wait()  # one after the other, either way round, never gets past here
            return store, "tokenizer-hash"

        with trio.fail_after(60):
            assert await load_model_beside_store(engine, open_tier) == (LOADED, store, "tokenizer-hash")
        assert not store.closed

    _run(main)


def test_a_model_that_fails_to_load_closes_the_tier_it_opened_and_raises_its_own_error():
    store = _Store()

    async def main():
        tier_opened = trio.Event()
        engine = _Engine(error=ModelError("config.json: no model_type"), before_loading=tier_opened)

        async def open_tier():
            tier_opened.set()  # the engine fails after this returns: no checkpoint in between
            return store, ""

        with pytest.raises(ModelError, match="no model_type"):
            await load_model_beside_store(engine, open_tier)
        assert store.closed

    _run(main)


def test_a_model_that_fails_to_load_stops_the_tier_from_opening_on():
    async def main():
        steps: list[str] = []

        async def open_tier():
            steps.append("fingerprint")
            await trio.sleep_forever()  # a long scan: a failed model must not wait for it
            steps.append("scan")
            return _Store(), ""

        with trio.fail_after(60), pytest.raises(ModelError):
            await load_model_beside_store(_Engine(error=ModelError("no weights")), open_tier)
        assert steps == ["fingerprint"]

    _run(main)


@pytest.mark.parametrize("model_fails_too", [False, True], ids=["model-loads", "model-fails-too"])
def test_a_tier_that_fails_to_open_raises_its_error_unless_the_model_failed_first(model_fails_too):
    async def main():
        engine = _Engine(error=ModelError("bad weights") if model_fails_too else None)

        async def open_tier():
            raise DirectoryLocked("/ssd/abc is in use by pid 1")

        expected = ModelError if model_fails_too else DirectoryLocked
        with pytest.raises(expected):
            await load_model_beside_store(engine, open_tier)

    _run(main)


def test_no_tier_is_no_store():
    async def main():
        async def no_tier():
            return None, ""

        assert await load_model_beside_store(_Engine(), no_tier) == (LOADED, None, "")

    _run(main)


def test_serve_on_a_locked_tier_says_so_and_stops_its_engine(model_dir_factory, tmp_path):
    """Real model, real files: the tier opens beside the model load and fails on the lock another
    store holds; the caller gets `DirectoryLocked` itself, and the engine thread is stopped."""
    model_dir = model_dir_factory("llama")
    config = SystemConfig(model_dir=model_dir, ssd_dir=tmp_path / "ssd")
    fingerprint = compute_fingerprint(model_dir, kv_scheme_key=resolve_kv_scheme(config.kv_quant, model_dir).cache_key)
    holder = SsdStore.open(config.ssd_dir, fingerprint.digest)
    engine = EngineThread(model_dir)

    async def main():
        async with open_system(config, SystemSeams(engine=engine)):
            pytest.fail("the system started on a locked tier")

    try:
        with pytest.raises(DirectoryLocked):
            trio.run(main)
    finally:
        holder.close()
    assert not engine._thread.is_alive()
