"""A flush that always answers (spec §5.6, issue 13): `POST /admin/cache/flush`
with a `timeout_s`, against a real tiny model, real files, real SQLite and a
real hypercorn server on 127.0.0.1. A write is made to stay pending through
the system's `run_blocking` seam (the SSD writer's file work waits on a Trio
event), never by sleeping."""

from __future__ import annotations

import logging
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from test_serve import Server, _free_port

from kvcellar.actors.system import System, SystemConfig, SystemSeams, open_system
from kvcellar.http.app import HttpSettings, build_app

FLUSH = "/admin/cache/flush"


class WriteGate:
    """A `run_blocking` seam. While closed, every blocking call (the SSD
    writer's file writes and commits) waits for `open()`, so its spill stays
    pending; `entered` is set once a call waits."""

    def __init__(self) -> None:
        self.closed = False
        self.entered = trio.Event()
        self._opened = trio.Event()

    def close(self) -> None:
        self.closed = True

    def open(self) -> None:
        self.closed = False
        self._opened.set()

    async def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.closed:
            self.entered.set()
            await self._opened.wait()
        return await trio.to_thread.run_sync(fn, *args)


def _config(model_dir, tmp_path, **overrides: Any) -> SystemConfig:
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


@asynccontextmanager
async def serving(
    config: SystemConfig,
    gate: WriteGate | None = None,
    settings: HttpSettings | None = None,
) -> AsyncIterator[tuple[System, httpx.AsyncClient]]:
    """The system and hypercorn serving its app on 127.0.0.1, in this Trio
    run; `gate` holds the system's blocking calls (the writer's file I/O);
    `settings` the app's (tenants, tokens)."""
    port = _free_port()
    hypercorn_config = Config()
    hypercorn_config.bind = [f"127.0.0.1:{port}"]
    hypercorn_config.accesslog = None
    async with open_system(config, SystemSeams(run_blocking=gate) if gate is not None else None) as system:
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            await nursery.start(
                partial(serve, build_app(system, settings), hypercorn_config, shutdown_trigger=stop.wait)
            )
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
                yield system, client
            stop.set()


async def _complete(client: httpx.AsyncClient, prompt: str) -> None:
    reply = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text


def test_flush_past_its_timeout_answers_with_the_pending_evidence(model_dir_factory, tmp_path):
    gate = WriteGate()

    async def main() -> None:
        async with serving(_config(model_dir_factory("llama"), tmp_path), gate) as (system, client):
            gate.close()
            await _complete(client, "A prefix whose write stays pending")
            with trio.fail_after(60):
                await gate.entered.wait()  # the debounced write-behind snapshot is being written
            reply = await client.post(FLUSH, params={"timeout_s": "0.001"})
            assert reply.status_code == 503, reply.text
            verdict = reply.json()
            assert (verdict["durable"], verdict["reason"]) == (False, "timeout")
            assert verdict["pending"] == 1 and verdict["pending_spills"] == 1 and verdict["entries"] == 0
            gate.open()
            reply = await client.post(FLUSH, json={"timeout_s": 60})
            assert reply.status_code == 200, reply.text
            assert reply.json()["durable"] is True and reply.json()["reason"] == ""
            assert reply.json()["entries"] >= 1 and reply.json()["pending_spills"] == 0
            assert system.durability.stats()["timed_out_flushes_total"] == 1

    trio.run(main)


BAD_TIMEOUTS = [
    ({"timeout_s": "soon"}, None),
    ({"timeout_s": "-1"}, None),
    ({"timeout_s": "0"}, None),
    ({"timeout_s": "nan"}, None),
    ({"timeout_s": "inf"}, None),
    (None, {"timeout_s": "5"}),
    (None, {"timeout_s": True}),
    ({"timeout_s": "5"}, {"timeout_s": 5}),
]


def test_a_bad_timeout_is_a_400_naming_it(model_dir_factory, tmp_path):
    async def main() -> None:
        config = _config(model_dir_factory("llama"), tmp_path, ssd_dir=None)
        async with serving(config) as (_, client):
            for params, body in BAD_TIMEOUTS:
                reply = await client.post(FLUSH, params=params, json=body)
                assert reply.status_code == 400, (params, body, reply.text)
                assert reply.json()["error"]["param"] == "timeout_s", (params, body)
            other = await client.post(FLUSH, json={"timeout": 5})
            assert other.status_code == 400 and other.json()["error"]["param"] == "timeout"
            not_json = await client.post(FLUSH, content=b"{oops")
            assert not_json.status_code == 400
            fine = await client.post(FLUSH, json={"timeout_s": 2.5})
            assert fine.status_code == 503 and fine.json()["reason"] == "no SSD tier"

    trio.run(main)


def test_write_behind_off_drains_the_spill_queue_and_says_what_it_vouches_for(model_dir_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCELLAR_SSD_WRITEBEHIND", "0")
    gate = WriteGate()

    async def main() -> None:
        # A 1-byte RAM tier: every put is oversize and spilled at once.
        config = _config(model_dir_factory("llama"), tmp_path, prompt_cache_bytes=1)
        async with serving(config, gate) as (system, client):
            assert system.durability is None
            gate.close()
            await _complete(client, "Spilled as soon as it is put")
            with trio.fail_after(60):
                await gate.entered.wait()
            reply = await client.post(FLUSH, params={"timeout_s": "0.001"})
            assert reply.status_code == 503
            timed_out = reply.json()
            assert (timed_out["reason"], timed_out["pending_spills"], timed_out["pending"]) == ("timeout", 1, 1)
            gate.open()
            reply = await client.post(FLUSH)
            assert reply.status_code == 503, reply.text
            verdict = reply.json()
            assert (verdict["durable"], verdict["reason"]) == (False, "write-behind off")
            evidence = (verdict["pending"], verdict["pending_spills"], verdict["dropped"], verdict["failed"])
            assert evidence == (0, 0, 0, 0)
            assert verdict["entries"] == 1 and "1 stored" in verdict["note"]

    trio.run(main)


def test_shutdown_counts_and_logs_the_spills_it_could_not_write(model_dir_factory, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KVCELLAR_SSD_WRITEBEHIND", "0")
    gate = WriteGate()

    async def main() -> None:
        # The shutdown bound is a deadline, not an ordering: the write cannot finish before the gate opens.
        config = _config(model_dir_factory("llama"), tmp_path, prompt_cache_bytes=1, shutdown_timeout_s=0.2)
        async with serving(config, gate) as (system, client):
            gate.close()
            await _complete(client, "Never written")
            with trio.fail_after(60):
                await gate.entered.wait()
            verdict = await system.shutdown()
            assert (verdict.durable, verdict.reason, verdict.pending_spills) == (False, "timeout", 1)
            assert await system.shutdown() is verdict

    with caplog.at_level(logging.WARNING, logger="kvcellar.system"):
        trio.run(main)
    warnings = [r.getMessage() for r in caplog.records if r.name == "kvcellar.system"]
    assert any("1 prefixes were not made durable" in m and "1 queued spills" in m for m in warnings), warnings


def test_a_server_without_an_ssd_tier_says_so(model_dir_factory):
    running = Server(model_dir_factory("llama"), "--batch", "1")
    try:
        reply = httpx.post(f"{running.base}{FLUSH}", timeout=60)
        assert reply.status_code == 503, reply.text
        assert (reply.json()["durable"], reply.json()["reason"]) == (False, "no SSD tier")
        bad = httpx.post(f"{running.base}{FLUSH}?timeout_s=-3", timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "timeout_s"
        running.process.send_signal(signal.SIGTERM)
        status = running.process.wait(timeout=60)
        output = running.process.stdout.read()
        assert status == 0, output
        assert "shutdown flush" in output and "no SSD tier" in output and "not made durable" not in output
    finally:
        running.kill()
