"""`kvcellar serve`: a real hypercorn server on 127.0.0.1 with a tiny model."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server(model_dir_factory):
    model_dir = model_dir_factory("llama")
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvcellar.cli", "serve", "--model", str(model_dir), "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"server exited: {process.stdout.read()}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
    else:
        process.kill()
        pytest.fail("server did not become healthy")
    yield base, model_dir.name, process
    if process.poll() is None:
        process.kill()


def test_chat_completion_returns_text_and_usage(server):
    base, model_id, _ = server
    body = {"model": model_id, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "temperature": 0}
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "chat.completion"
    assert data["choices"][0]["message"]["role"] == "assistant"
    assert data["choices"][0]["finish_reason"] in ("stop", "length")
    assert data["usage"]["prompt_tokens"] > 0
    assert 1 <= data["usage"]["completion_tokens"] <= 5
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_greedy_completion_is_repeatable_and_streaming_matches_it(server):
    base, _, _ = server
    body = {"prompt": "The cellar keeps", "max_tokens": 8, "temperature": 0}
    first = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
    second = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    with httpx.stream("POST", f"{base}/v1/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert streamed == first["choices"][0]["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == first["usage"]["completion_tokens"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"\xff\xfe", None),
        (json.dumps({"messages": []}).encode(), "messages"),
        (json.dumps({"messages": "hi"}).encode(), "messages"),
        (json.dumps({"messages": [{"role": "user", "content": 3}]}).encode(), "messages[0].content"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}).encode(), "max_tokens"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9}).encode(), "max_tokens"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 2}).encode(), "n"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "model": "nope"}).encode(), "model"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(), "temperature"),
        (json.dumps({"messages": [{"role": "user", "content": "x" * 20000}], "max_tokens": 8}).encode(), "messages"),
    ],
)
def test_bad_input_gets_a_400_naming_the_field_and_the_server_keeps_serving(server, body, param):
    base, _, _ = server
    response = httpx.post(f"{base}/v1/chat/completions", content=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200


def test_models_lists_the_served_model(server):
    base, model_id, _ = server
    data = httpx.get(f"{base}/v1/models", timeout=5).json()
    assert [m["id"] for m in data["data"]] == [model_id]


def test_sigterm_shuts_the_server_down_cleanly(server):
    _, _, process = server
    process.send_signal(signal.SIGTERM)
    status = process.wait(timeout=30)
    assert status == 0, process.stdout.read()
