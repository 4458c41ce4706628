"""`kvcellar serve`: a real hypercorn server on 127.0.0.1 with a tiny model."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import trio
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from kvcellar.bench.common import wait_until_healthy


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    def __init__(self, model_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.model_id = model_dir.name
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvcellar.cli", "serve", "--model", str(model_dir), "--port", str(self.port), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        )
        wait_until_healthy(self.process, self.base, timeout_s=120, output=self.process.stdout.read)

    def stop(self) -> tuple[int, str]:
        """SIGTERM, wait, return (exit status, output)."""
        self.process.send_signal(signal.SIGTERM)
        status = self.process.wait(timeout=60)
        return status, self.process.stdout.read()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def server(model_dir_factory, tmp_path_factory):
    running = Server(
        model_dir_factory("llama"), "--ssd-cache", str(tmp_path_factory.mktemp("ssd")), "--kv-budget", "0.5"
    )
    yield running
    running.kill()


def _chat(server, content, **extra):
    body = {
        "model": server.model_id,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0,
        **extra,
    }
    return httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=120)


def test_chat_completion_returns_text_and_usage(server):
    response = _chat(server, "hello there")
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "chat.completion"
    assert data["choices"][0]["message"]["role"] == "assistant"
    assert data["choices"][0]["finish_reason"] in ("stop", "length")
    assert data["usage"]["prompt_tokens"] > 0 and 1 <= data["usage"]["completion_tokens"] <= 6


def test_second_request_sharing_a_prefix_reports_cached_tokens(server):
    history = "a long shared system prompt about cellars and caches " * 4
    first = _chat(server, history + "first question").json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < 10, "only the template header is shared"
    body = {
        "model": server.model_id,
        "temperature": 0,
        "max_tokens": 4,
        "messages": [
            {"role": "user", "content": history + "first question"},
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "and a follow-up"},
        ],
    }
    second = httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=120).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 1


def test_greedy_completion_is_repeatable_and_streaming_matches_it(server):
    body = {"prompt": "The cellar keeps", "max_tokens": 8, "temperature": 0}
    first = httpx.post(f"{server.base}/v1/completions", json=body, timeout=60).json()
    second = httpx.post(f"{server.base}/v1/completions", json=body, timeout=60).json()
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    with httpx.stream(
        "POST",
        f"{server.base}/v1/completions",
        timeout=60,
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    ) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert streamed == first["choices"][0]["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == first["usage"]["completion_tokens"]
    assert chunks[-2]["choices"][0]["finish_reason"] == first["choices"][0]["finish_reason"]


def test_streaming_chat_sends_deltas_and_done(server):
    with httpx.stream(
        "POST",
        f"{server.base}/v1/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True, "temperature": 0},
    ) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"\xff\xfe", None),
        (json.dumps({"messages": []}).encode(), "messages"),
        (json.dumps({"messages": "hi"}).encode(), "messages"),
        (json.dumps({"messages": [{"role": "user", "content": 3}]}).encode(), "messages[0].content"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}).encode(), "max_tokens"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2.5}).encode(), "max_tokens"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 2}).encode(), "n"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "model": "nope"}).encode(), "model"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(), "temperature"),
        (json.dumps({"messages": [{"role": "user", "content": "x" * 20000}], "max_tokens": 8}).encode(), "messages"),
    ],
)
def test_bad_input_gets_a_400_naming_the_field_and_the_server_keeps_serving(server, body, param):
    response = httpx.post(f"{server.base}/v1/chat/completions", content=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    assert _chat(server, "still alive?").status_code == 200


def test_models_lists_the_served_model(server):
    data = httpx.get(f"{server.base}/v1/models", timeout=5).json()
    assert [m["id"] for m in data["data"]] == [server.model_id]


def test_stats_and_metrics_expose_the_tiers(server):
    _chat(server, "warm the caches")
    stats = httpx.get(f"{server.base}/stats", timeout=5).json()
    for field in (
        "entries",
        "bytes",
        "max_bytes",
        "restores",
        "spills",
        "restore_ms_last",
        "demotions",
        "pending_snapshots",
        "pending_spills",
        "pending_spill_bytes",
        "dropped_spills",
        "failed_spills",
        "longest_durable_prefix_tokens",
    ):
        assert field in stats["ssd_cache"], field
    assert stats["prompt_cache"]["entries"] >= 1 and "busy" in stats["gateway"]
    scheduler = stats["scheduler"]
    assert scheduler["lane"] == "batch" and scheduler["reason"] == "", "the batch lane is the default"
    assert scheduler["batch_size"] == 8 and scheduler["kv_budget_bytes"] == 500_000_000
    for field in ("rows_active", "waiting", "batch_size_history", "kv_bytes_active", "kv_bytes_peak", "completed"):
        assert field in scheduler, field
    response = httpx.get(f"{server.base}/metrics", timeout=5)
    assert response.headers["content-type"] == CONTENT_TYPE_LATEST
    types = {family.name: family.type for family in text_string_to_metric_families(response.text)}
    assert types["kvcellar_prompt_cache_entries"] == "gauge" and types["kvcellar_prompt_cache_hits"] == "counter"
    assert types["kvcellar_ssd_cache_entries"] == "gauge" and types["kvcellar_ssd_cache_pending_spills"] == "gauge"
    assert types["kvcellar_scheduler_rows_active"] == "gauge" and types["kvcellar_scheduler_completed"] == "counter"
    assert types["kvcellar_scheduler_decode_steps"] == "counter" and types["kvcellar_journal_degraded"] == "gauge"


def test_eight_concurrent_clients_all_complete_with_the_same_greedy_output(server):
    async def main():
        async with httpx.AsyncClient(timeout=180) as client:
            results = [None] * 8

            async def one(i):
                body = {"prompt": "Eight clients ask the same thing", "max_tokens": 6, "temperature": 0}
                results[i] = (await client.post(f"{server.base}/v1/completions", json=body)).json()

            async with trio.open_nursery() as nursery:
                for i in range(8):
                    nursery.start_soon(one, i)
            return results

    results = trio.run(main)
    texts = {r["choices"][0]["text"] for r in results}
    assert len(texts) == 1 and all(r["usage"]["completion_tokens"] >= 1 for r in results)


def test_requests_arriving_during_a_long_generation_join_its_batch(server):
    body = {"prompt": "A long one that others join " * 2, "max_tokens": 1500, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))

        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                replies = [None] * 3

                async def one(i):
                    reply = await client.post(
                        f"{server.base}/v1/completions",
                        json={"prompt": f"joiner {i}", "max_tokens": 4, "temperature": 0},
                    )
                    replies[i] = reply.json()

                async with trio.open_nursery() as nursery:
                    for i in range(3):
                        nursery.start_soon(one, i)
                return replies

        replies = trio.run(main)
        history = httpx.get(f"{server.base}/stats", timeout=5).json()["scheduler"]["batch_size_history"]
    assert all(reply["usage"]["completion_tokens"] >= 1 for reply in replies)
    assert max(int(rows) for rows in history) >= 2, history


def test_client_disconnect_mid_stream_cancels_and_keeps_the_cache(server):
    before = httpx.get(f"{server.base}/stats", timeout=5).json()["prompt_cache"]["puts"]
    body = {"prompt": "A client that leaves early " * 3, "max_tokens": 2000, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = httpx.get(f"{server.base}/stats", timeout=5).json()
        if not stats["gateway"]["busy"] and stats["prompt_cache"]["puts"] > before:
            break
        time.sleep(0.2)
    assert not stats["gateway"]["busy"], "the abandoned generation is still running"
    assert stats["prompt_cache"]["puts"] > before, "the abandoned request's cache was not kept"
    assert _chat(server, "next one").status_code == 200


def test_flush_then_restart_restores_the_prefix_and_the_same_output(model_dir_factory, tmp_path):
    model_dir = model_dir_factory("llama")
    body = {"prompt": "Restart me please, " * 6, "max_tokens": 8, "temperature": 0}
    first = Server(model_dir, "--ssd-cache", str(tmp_path))
    try:
        before = httpx.post(f"{first.base}/v1/completions", json=body, timeout=60).json()
        flushed = httpx.post(f"{first.base}/admin/cache/flush", timeout=60)
        assert flushed.status_code == 200 and flushed.json()["durable"] is True
        status, output = first.stop()
        assert status == 0, output
        assert "shutdown flush" in output
    finally:
        first.kill()
    second = Server(model_dir, "--ssd-cache", str(tmp_path))
    try:
        after = httpx.post(f"{second.base}/v1/completions", json=body, timeout=60).json()
        usage = after["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
    finally:
        second.kill()


def test_sigterm_during_a_generation_finishes_cleanly_and_flushes(model_dir_factory, tmp_path):
    running = Server(model_dir_factory("llama"), "--ssd-cache", str(tmp_path))
    try:
        with httpx.stream(
            "POST",
            f"{running.base}/v1/completions",
            timeout=60,
            json={"prompt": "long one", "max_tokens": 400, "stream": True},
        ) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            running.process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        status = running.process.wait(timeout=60)
        output = running.process.stdout.read()
        assert status == 0, output
        assert "shutdown flush" in output
    finally:
        running.kill()


def test_admin_token_and_api_key_are_enforced(model_dir_factory, tmp_path):
    running = Server(model_dir_factory("llama"), "--api-key", "k1", "--batch", "1", env={"KVCELLAR_ADMIN_TOKEN": "a1"})
    try:
        refused = _chat(running, "no key")
        # Refused with its body unread: the reply says the connection closes, so a keep-alive
        # client sends its next request on a new one rather than on the closing one.
        assert refused.status_code == 401 and refused.headers["connection"] == "close"
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        with httpx.Client(base_url=running.base, timeout=60) as client:
            assert client.post("/v1/chat/completions", json=body).status_code == 401
            keyed = client.post("/v1/chat/completions", headers={"Authorization": "Bearer k1"}, json=body)
        assert keyed.status_code == 200
        assert httpx.get(f"{running.base}/stats", timeout=5).status_code == 401
        assert httpx.get(f"{running.base}/stats", headers={"Authorization": "Bearer k1"}, timeout=5).status_code == 401
        assert httpx.get(f"{running.base}/stats", headers={"Authorization": "Bearer a1"}, timeout=5).status_code == 200
        assert httpx.post(f"{running.base}/admin/cache/flush", timeout=5).status_code == 401
        scheduler = httpx.get(f"{running.base}/stats", headers={"Authorization": "Bearer a1"}, timeout=5).json()[
            "scheduler"
        ]
        assert scheduler["lane"] == "serial" and "--batch 1" in scheduler["reason"]
    finally:
        running.kill()


def test_invalid_flag_combinations_fail_at_start_with_a_clear_message(model_dir_factory, tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcellar.cli",
            "serve",
            "--model",
            str(model_dir_factory("llama")),
            "--prompt-cache",
            "0",
            "--ssd-cache",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--prompt-cache 0" in result.stderr
