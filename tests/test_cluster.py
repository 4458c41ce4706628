"""kvcellar workers behind the real SMG gateway (issue 40): `Cluster` starts two real
`kvcellar serve` workers on 127.0.0.1 sharing one moto S3 tier, and `smg launch` in
front of them. Without the `smg` wheel for this platform the tests skip and say why,
except under CI (CI=true), where that is a failure.

Every figure is read from the replies' usage and the workers' /stats counters; the
only waits poll those counters (an upload landing, a worker healthy again)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import boto3
import httpx
import openai
import pytest
from moto.server import ThreadedMotoServer

from kvcellar.http.cluster import Cluster, ClusterConfig, smg_executable

SYSTEM = "You are a careful coding agent working in a repository of caches, cellars and their tiers. " * 30


def _smg_or_skip() -> None:
    if smg_executable() is None:
        problem = (
            "SMG's `smg` command is missing: pip install 'kvcellar[cluster]' (a wheel for linux x86_64, macOS arm64)"
        )
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the cluster tests: {problem}")
        pytest.skip(problem)


@pytest.fixture(scope="module")
def cluster(model_dir_factory, tmp_path_factory) -> Iterator[Cluster]:
    _smg_or_skip()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {
        name: os.environ.get(name) for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    }
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    bucket = f"kvc-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    root = tmp_path_factory.mktemp("cluster")
    config = ClusterConfig(
        model=str(model_dir_factory("llama")),
        workers=2,
        gateway_port=_free_port(),
        ssd_root=root / "ssd",
        log_dir=root / "logs",
        shared_cache=f"s3://{bucket}/team",
        shared_cache_endpoint=endpoint,
        # Every stored entry is shared, and the survivor's index follows within a second.
        serve_args=("--shared-upload-min-tokens", "1", "--shared-cache-refresh", "1", "--kv-budget", "0.5"),
        # Probe every second, so a restarted worker rejoins within the test.
        gateway_args=("--health-check-interval-secs", "1", "--health-success-threshold", "1"),
    )
    running = Cluster(config)
    try:
        with running.running():
            yield running
    finally:
        _print_logs(config.log_dir)
        moto.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _free_port() -> int:
    from kvcellar.http.cluster import free_port

    return free_port()


def _print_logs(log_dir: Path | None) -> None:
    """The members' log tails, for a failure's report (pytest shows captured output only then)."""
    for log in sorted(log_dir.glob("*.log")) if log_dir else ():
        print(f"--- {log.name}\n" + log.read_text(errors="replace")[-3000:])


def _model(cluster: Cluster) -> str:
    return Path(cluster.config.model).name


def _stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/stats", timeout=30).json()


def _finished(cluster: Cluster) -> list[int]:
    return [_stats(w.url)["requests"]["finished"] if w.running else -1 for w in cluster.workers]


def _turn(cluster: Cluster, messages: list[dict[str, str]]) -> tuple[dict[str, Any], int]:
    """One chat turn through the gateway: (its reply, the index of the worker that served it)."""
    before = _finished(cluster)
    reply = httpx.post(
        f"{cluster.gateway.url}/v1/chat/completions",
        json={"model": _model(cluster), "messages": messages, "max_tokens": 8, "temperature": 0},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    served = [i for i, (a, b) in enumerate(zip(before, _finished(cluster), strict=True)) if b > a]
    assert len(served) == 1, (before, served)
    return reply.json(), served[0]


def _cached_share(reply: dict[str, Any]) -> float:
    usage = reply["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"]


def _wait_until(condition, what: str, evidence=lambda: None, deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {deadline_s} s until {what}: {evidence()}"
        time.sleep(0.05)


def _shared_with(cluster: Cluster, source: int, other: int) -> bool:
    """Every entry `source` stored on SSD is committed to the shared tier (each is offered once: every
    upload admitted at `--shared-upload-min-tokens 1`), and `other`'s index lists them all."""
    held, seen = _stats(cluster.workers[source].url), _stats(cluster.workers[other].url)
    ssd, shared = held["ssd_cache"], held["shared_cache"]
    if ssd["pending_spills"] or shared["upload_queue"] or shared["uploads"] + shared["already_shared"] < ssd["spills"]:
        return False
    return seen["shared_cache"]["objects"] >= shared["uploads"] + seen["shared_cache"]["uploads"] > 0


def test_a_conversation_keeps_hitting_and_moves_through_the_shared_tier_after_a_sigkill(cluster):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "where is the cellar?"}]
    shares, served_by = [], []
    for turn in range(4):
        reply, worker = _turn(cluster, messages)
        shares.append(_cached_share(reply))
        served_by.append(worker)
        messages += [
            {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"and the next step, number {turn}?"},
        ]
    assert len(set(served_by)) == 1, f"cache_aware kept the conversation on one worker: {served_by}"
    assert min(shares[1:]) >= 0.9, shares
    home = served_by[0]
    survivor = 1 - home
    # No flush: the home worker's write-behind and idle-time uploads land by themselves.
    _wait_until(
        lambda: _shared_with(cluster, home, survivor),
        "the home worker's entries reached the shared tier",
        lambda: [(s["ssd_cache"], s["shared_cache"]) for s in map(_stats, (w.url for w in cluster.workers))],
    )
    downloads_before = _stats(cluster.workers[survivor].url)["shared_cache"]["downloads"]

    cluster.kill_worker(home)
    reply, worker = _turn(cluster, messages)
    assert worker == survivor
    assert _cached_share(reply) >= 0.9, reply["usage"]
    survivor_stats = _stats(cluster.workers[survivor].url)
    assert survivor_stats["shared_cache"]["downloads"] > downloads_before
    # Failover bookkeeping: /stats (and the journal's `restore.sourced`) say the bytes came from the shared tier.
    last_restore = survivor_stats["shared_cache"]["recent_restores"][-1]
    assert last_restore["origin"] == "shared_tier" and last_restore["key"], last_restore
    assert survivor_stats["shared_cache"]["restores_shared_tier"] >= 1
    assert survivor_stats["requests"]["cached_tokens_ssd"] >= reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    # The killed worker comes back on its port and SSD directory and rejoins the gateway.
    cluster.start_worker(home)
    _wait_until(lambda: _gateway_healthy_workers(cluster) == 2, "the gateway saw the restarted worker healthy")
    messages += [
        {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
        {"role": "user", "content": "one more"},
    ]
    reply, _ = _turn(cluster, messages)
    assert _cached_share(reply) >= 0.9, reply["usage"]


def _gateway_healthy_workers(cluster: Cluster) -> int:
    listed = httpx.get(f"{cluster.gateway.url}/workers", timeout=10).json()
    return sum(1 for worker in listed["workers"] if worker.get("is_healthy", worker.get("healthy")))


def test_every_api_works_through_the_gateway_with_the_official_sdks(cluster):
    base = cluster.gateway.url
    model = _model(cluster)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].message.content is not None and chat.usage is not None
    streamed = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    completion = client.completions.create(model=model, prompt="def cellar():", max_tokens=4, temperature=0)
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt="def cellar():", max_tokens=4, temperature=0, stream=True
        )
    )
    assert text == completion.choices[0].text
    response = client.responses.create(model=model, input="hello", max_output_tokens=4, temperature=0)
    events = list(client.responses.create(model=model, input="hello", max_output_tokens=4, temperature=0, stream=True))
    # Four tokens end it by max_output_tokens: `response.incomplete`, carrying the whole response.
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text == response.output_text
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=-1)

    claude = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)
    message = claude.messages.create(
        model=model, max_tokens=4, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "hello"}]
    )
    with claude.messages.stream(
        model=model, max_tokens=4, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "hello"}]
    ) as stream:
        streamed_message = stream.get_final_message()
    assert [b.model_dump() for b in streamed_message.content] == [b.model_dump() for b in message.content]
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=model, max_tokens=0, messages=[{"role": "user", "content": "x"}])


def test_the_launcher_command_stops_its_whole_tree_on_ctrl_c(model_dir_factory, tmp_path):
    _smg_or_skip()
    gateway_port = _free_port()
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvcellar.cli",
            "cluster",
            "--model",
            str(model_dir_factory("llama")),
            "--workers",
            "1",
            "--gateway-port",
            str(gateway_port),
            "--ssd-root",
            str(tmp_path / "ssd"),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        announced = launcher.stdout.readline()
        assert announced.startswith(f"gateway http://127.0.0.1:{gateway_port}"), announced
        worker_url = announced.split(" over ")[1].strip()
        reply = httpx.post(
            f"http://127.0.0.1:{gateway_port}/v1/completions",
            json={"model": model_dir_factory("llama").name, "prompt": "def cellar():", "max_tokens": 4},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=120) == 0
        rest = launcher.stdout.read()
        assert "stopped: gateway" in rest and "worker-0 0" in rest, rest
        for url in (f"http://127.0.0.1:{gateway_port}/health", f"{worker_url}/health"):
            with pytest.raises(httpx.ConnectError):
                httpx.get(url, timeout=5)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        _print_logs(tmp_path / "logs")
