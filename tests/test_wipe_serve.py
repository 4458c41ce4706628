"""`POST /admin/cache/wipe` through a real server (issue 39 part 3): entries of two tenants (put
through the tier APIs: requests do not carry a tenant yet), requests of the default namespace
running while one tenant is wiped; the wiped tenant's files are gone, the others' kept, and so
after a restart, where the other tenant's entry restores."""

from __future__ import annotations

import errno

import mlx.core as mx
import trio
from mlx_lm.models.cache import make_prompt_cache
from test_flush import _config, serving

from kvcellar.actors.system import SystemSeams, open_system
from kvcellar.errors import DiskError
from kvcellar.store.disk import RealDisk
from kvcellar.store.namespaces import salted, tenant_namespace
from kvcellar.store.ssd import namespace_dir_name
from kvcellar.store.wipe import selector_from_body

ALICE, BOB = tenant_namespace("alice"), tenant_namespace("bob")
BASE = [(13 * i + 7) % 200 + 3 for i in range(32)]
OTHER = [(5 * i + 11) % 200 + 3 for i in range(32)]


def _put_tenant_entries(loaded, system) -> None:
    """On the engine thread: SSD entries for alice (plain and salted) and bob, and a RAM entry of alice's."""

    def prefilled(tokens):
        caches = make_prompt_cache(loaded.model)
        mx.eval(loaded.model(mx.array([tokens]), cache=caches))
        return caches

    for namespace in (ALICE, salted(ALICE, "s"), BOB):
        assert system.store.store(BASE, prefilled(BASE), namespace) is not None
    system.prompt_cache.put(OTHER, prefilled(OTHER), ALICE)


def _kvc_dirs(ssd_dir) -> set[str]:
    return {path.parent.name for path in ssd_dir.rglob("*.kvc") if "quarantine" not in str(path)}


def test_a_wipe_under_load_removes_one_tenant_and_keeps_the_others_across_a_restart(model_dir_factory, tmp_path):
    config = _config(model_dir_factory("llama"), tmp_path, restore_policy="restore")
    answers: list = []

    async def load(client) -> None:
        for i in range(4):
            reply = await client.post(
                "/v1/completions", json={"prompt": f"Request {i} runs while a tenant is wiped.", "max_tokens": 4}
            )
            assert reply.status_code == 200, reply.text

    async def first_run() -> None:
        async with serving(config) as (system, client):
            await system.engine.call(lambda loaded: _put_tenant_entries(loaded, system), label="test")
            bad = await client.post("/admin/cache/wipe", json={"tenant": "alice", "prefix_tokens": "no"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "prefix_tokens"
            async with trio.open_nursery() as nursery:
                nursery.start_soon(load, client)
                await trio.sleep(0.05)
                answers.append(await client.post("/admin/cache/wipe", json={"tenant": "alice", "timeout_s": 60}))
            assert system.store.find(BASE + [1], ALICE) is None
            assert system.store.find(OTHER + [1], ALICE) is None
            assert system.store.find(BASE + [1], BOB) is not None
            flushed = await client.post("/admin/cache/flush", json={"timeout_s": 60})
            assert flushed.status_code == 200, f"the wiped entry is no longer owed to the SSD tier: {flushed.text}"
            answers.append((await client.get("/stats")).json()["ssd_cache"])

    trio.run(first_run)
    wiped, stats = answers
    assert wiped.status_code == 200, wiped.text
    body = wiped.json()
    assert body["done"] and body["left"] == {} and body["selector"] == {"tenant": "alice"}
    assert body["removed"]["ram"]["entries"] == 1
    assert body["removed"]["ssd"]["entries"] >= 2 and body["removed"]["ssd"]["bytes"] > 0
    assert stats["wiped"] >= 2
    dirs = _kvc_dirs(tmp_path / "ssd")
    assert namespace_dir_name(ALICE) not in dirs and namespace_dir_name(salted(ALICE, "s")) not in dirs
    assert namespace_dir_name(BOB) in dirs and namespace_dir_name("") in dirs
    assert not list((tmp_path / "ssd").rglob("wipes/*")), "a finished wipe leaves no intent"

    restored: list = []

    async def second_run() -> None:
        async with serving(config) as (system, _):
            assert system.store.find(BASE + [1], ALICE) is None
            assert system.store.find(OTHER + [1], ALICE) is None
            match = system.store.find(BASE + [1], BOB)
            assert match is not None
            restored.append(await system.engine.call(lambda _: system.store.restore(match), label="test"))

    trio.run(second_run)
    assert restored[0] is not None, "the other tenant's entry restores after the restart"


class StuckUnlinks(RealDisk):
    """A disk whose entry unlinks fail while `stuck` (a file a wipe cannot remove)."""

    stuck = True

    def unlink(self, path):
        if self.stuck and path.suffix == ".kvc":
            raise DiskError(f"cannot unlink {path}", errno=errno.EBUSY)
        super().unlink(path)


def test_a_wipe_that_cannot_remove_a_file_says_what_is_left_and_finishes_when_sent_again(model_dir_factory, tmp_path):
    config = _config(model_dir_factory("llama"), tmp_path, restore_policy="restore")
    disk = StuckUnlinks()
    answers: list = []

    async def main() -> None:
        async with open_system(config, SystemSeams(disk=disk)) as system:
            await system.engine.call(lambda loaded: _put_tenant_entries(loaded, system), label="test")
            selector = selector_from_body({"tenant": "alice"})
            answers.append(await system.wipes.wipe(selector))
            answers.append(system.stats()["wipes"])
            disk.stuck = False
            answers.append(await system.wipes.wipe(selector))
            answers.append(system.stats()["wipes"])

    trio.run(main)
    stuck, during, finished, after = answers
    assert not stuck.done and stuck.left["ssd"] and "wipe again" in stuck.reason
    assert during["unfinished"] == [stuck.wipe_id]
    assert finished.done and finished.wipe_id == stuck.wipe_id and finished.left == {}
    assert after == {"completed": 1, "unfinished": []}
    assert _kvc_dirs(tmp_path / "ssd") == {namespace_dir_name(BOB)}


class WriterGate:
    """A `run_blocking` seam that holds only the SSD writer's write-and-commit call (every other
    blocking call, the wipe's included, runs at once) until `open()`; `entered` is set once held."""

    def __init__(self) -> None:
        self.entered = trio.Event()
        self._opened = trio.Event()

    def open(self) -> None:
        self._opened.set()

    async def __call__(self, fn, *args):
        if getattr(fn, "__name__", "") == "write_and_index" and not self._opened.is_set():
            self.entered.set()
            await self._opened.wait()
        return await trio.to_thread.run_sync(fn, *args)


def test_a_wipe_keeps_its_intent_while_a_write_taken_before_it_is_in_flight(model_dir_factory, tmp_path):
    """A write-behind snapshot of alice's entry is being written when the wipe runs: the wipe
    answers 503 naming the write in flight and keeps its intent (a crash now would redo it at
    the next start); once the write has landed (and been refused), the same wipe finishes."""
    config = _config(model_dir_factory("llama"), tmp_path, restore_policy="restore")
    gate = WriterGate()
    answers: list = []

    async def main() -> None:
        async with open_system(config, SystemSeams(run_blocking=gate)) as system:

            def put_alice(loaded) -> None:
                caches = make_prompt_cache(loaded.model)
                mx.eval(loaded.model(mx.array([OTHER]), cache=caches))
                system.prompt_cache.put(OTHER, caches, ALICE)

            await system.engine.call(put_alice, label="test")
            await gate.entered.wait()
            selector = selector_from_body({"tenant": "alice"})
            answers.append(await system.wipes.wipe(selector, timeout_s=0.2))
            answers.append(sorted((tmp_path / "ssd").rglob("wipes/*.wipe")))
            gate.open()
            await system.queue.wait_idle()
            answers.append(await system.wipes.wipe(selector))
            answers.append(system.store.find(OTHER + [1], ALICE))

    trio.run(main)
    held, intents, finished, found = answers
    assert not held.done and any("in flight" in line for line in held.left["ssd"]), held
    assert len(intents) == 1, "the intent stays while a write taken before the wipe is in flight"
    assert finished.done and finished.wipe_id == held.wipe_id and finished.left == {}
    assert found is None
    assert not list((tmp_path / "ssd").rglob("wipes/*.wipe"))
    assert _kvc_dirs(tmp_path / "ssd") == set()
