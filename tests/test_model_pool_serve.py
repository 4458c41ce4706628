"""The model pool through a real `kvcellar serve` (issue 41): two models (the demo-coder model and a
tiny llama), the official openai and anthropic SDKs, load on demand, drain before unload."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcellar.bench.common import wait_until_healthy
from kvcellar.engine.demo_models import packaged_demo_coder_dir

# demo-coder's safetensors are about 10.5 MB, the tiny llama's about 0.56 MB: this budget holds either, not both.
ONE_MODEL_GB = 0.0108
PROMPT = "Write a python function that adds two numbers and explain it at length please. " * 6


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class PoolServer:
    def __init__(
        self, models_toml: str, tmp_path: Path, *args: str, ssd_dir: Path | None = None, env: dict | None = None
    ) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        models_file = tmp_path / f"models-{self.port}.toml"
        models_file.write_text(models_toml)
        ssd = ssd_dir or tmp_path / "ssd"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvcellar.cli", "serve", "--models", str(models_file), "--port", str(self.port)]
            + ["--ssd-cache", str(ssd), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        )
        wait_until_healthy(self.process, self.base, timeout_s=120, output=self.process.stdout.read)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, timeout=120)

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.base, api_key="unused", max_retries=0, timeout=120)

    def models(self) -> dict:
        return httpx.get(f"{self.base}/stats", timeout=10).json()["pool"]["models"]

    def stop(self) -> str:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)
        return self.process.stdout.read()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _toml(small_dir: Path, *, coder_pin: bool = False, default: str | None = None) -> str:
    head = f'default = "{default}"\n' if default else ""
    return head + (
        f'[models.coder]\npath = "{packaged_demo_coder_dir()}"\naliases = ["gpt-*", "claude-sonnet-*"]\n'
        f"pin = {'true' if coder_pin else 'false'}\n"
        f'[models.small]\npath = "{small_dir}"\naliases = ["claude-haiku-*"]\n'
    )


def _chat(server: PoolServer, model: str, content: str = PROMPT):
    reply = server.openai().chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0
    )
    details = reply.usage.prompt_tokens_details
    return reply, (details.cached_tokens if details else 0) / reply.usage.prompt_tokens


@pytest.fixture(scope="module")
def small_dir(model_dir_factory) -> Path:
    return model_dir_factory("llama")


def test_names_and_aliases_route_through_both_sdks(small_dir, tmp_path):
    server = PoolServer(_toml(small_dir), tmp_path, "--keepalive-interval", "0.05")
    try:
        # A stream for a model still to load gets its 200 at once and keep-alives while the model loads.
        body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"{server.base}/v1/chat/completions", json=body, timeout=120) as streamed:
            assert streamed.status_code == 200
            lines = [line for line in streamed.iter_lines() if line]
        first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
        assert lines[0] == ": keep-alive" and first_data > 0 and lines[-1] == "data: [DONE]"
        assert '"model": "coder"' in lines[first_data].replace('":"', '": "')
        listed = [model.id for model in server.openai().models.list().data]
        assert listed == ["coder", "small", "gpt-*", "claude-sonnet-*", "claude-haiku-*"]
        reply, _ = _chat(server, "gpt-4o")
        assert reply.model == "coder"
        haiku = server.anthropic().messages.create(
            model="claude-haiku-4-5", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
        assert haiku.model == "small"
        sonnet = server.anthropic().messages.create(
            model="claude-sonnet-4-5", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
        assert sonnet.model == "coder"
        with pytest.raises(openai.NotFoundError) as unknown:
            _chat(server, "llama-70b")
        assert unknown.value.body["code"] == "model_not_found" and unknown.value.body["served"] == ["coder", "small"]
        with pytest.raises(anthropic.NotFoundError) as refused:
            server.anthropic().messages.create(model="opus", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        assert "'coder', 'small'" in refused.value.body["error"]["message"]
        models = server.models()
        assert models["coder"]["requests"] == 3 and models["small"]["requests"] == 1
        page = httpx.get(f"{server.base}/dashboard", timeout=10).text
        assert "kvcellar model pool" in page
        assert all(f"<th>{column}</th>" in page for column in ("lane", "engine yields", "draft"))
        # Every per-model field the page's script reads is one /stats has.
        assert set(re.findall(r"\bm\.(\w+)", page)) <= set(models["coder"])
        # A loaded model's own routes, under /models/NAME/ (its dashboard's relative paths read them).
        assert httpx.get(f"{server.base}/models/coder/stats", timeout=10).json()["prompt_cache"]["entries"] >= 1
        assert httpx.get(f"{server.base}/models/coder/health", timeout=10).json()["model"] == "coder"
        assert httpx.get(f"{server.base}/models/coder/dashboard", timeout=10).status_code == 200
        metrics = httpx.get(f"{server.base}/metrics", timeout=10).text
        assert 'kvcellar_pool_model_loaded{model="small"} 1.0' in metrics
    finally:
        server.kill()


def test_a_budget_for_one_model_swaps_and_the_conversation_resumes_from_ssd(small_dir, tmp_path):
    env = {"KVCELLAR_CACHE_DIR": str(tmp_path / "cache")}  # an empty restore cost memo
    server = PoolServer(_toml(small_dir), tmp_path, "--models-memory-gb", str(ONE_MODEL_GB), env=env)
    try:
        first, cold_share = _chat(server, "coder")
        assert cold_share == 0
        _chat(server, "small")
        models = server.models()
        assert (models["coder"]["state"], models["small"]["state"]) == ("unloaded", "loaded")
        assert models["coder"]["last_drain"]["durable"] is True
        again, cached_share = _chat(server, "coder")
        assert cached_share >= 0.9
        assert again.choices[0].message.content == first.choices[0].message.content
        models = server.models()
        assert models["coder"]["loads"] == 2 and models["coder"]["ssd_restores"] >= 1
        assert models["small"]["state"] == "unloaded" and models["small"]["last_drain"]["durable"] is True
        # The memo keeps both models' restore costs: coder's second load reads its own, calibrating nothing.
        output = server.stop()
        assert output.count("calibrating afresh") == 2 and output.count("holds no costs for this model") == 1
    finally:
        server.kill()


def test_a_pinned_model_never_unloads(small_dir, tmp_path):
    server = PoolServer(_toml(small_dir, coder_pin=True), tmp_path, "--models-memory-gb", str(ONE_MODEL_GB))
    try:
        assert server.models()["coder"]["state"] == "loaded"  # pinned models load at start
        for _ in range(2):
            with pytest.raises(openai.APIStatusError) as refused:
                _chat(server, "small")
            assert refused.value.status_code == 503
            _chat(server, "coder")
        models = server.models()
        assert models["coder"]["unloads"] == 0 and models["coder"]["state"] == "loaded"
        assert models["small"]["loads"] == 0
        drained = httpx.post(f"{server.base}/admin/drain", json={"model": "coder"}, timeout=60)
        assert drained.status_code == 200 and drained.json()["durable"] and drained.json()["state"] == "loaded"
    finally:
        server.kill()


def test_a_drain_that_cannot_vouch_for_every_entry_keeps_the_model_loaded(small_dir, tmp_path):
    # Write-behind off: puts are not tracked, so no drain is durable and no model may unload for room.
    env = {"KVCELLAR_SSD_WRITEBEHIND": "0"}
    server = PoolServer(_toml(small_dir), tmp_path, "--models-memory-gb", str(ONE_MODEL_GB), env=env)
    try:
        _chat(server, "coder")
        with pytest.raises(openai.APIStatusError) as refused:
            _chat(server, "small")
        assert refused.value.status_code == 503 and "not durable" in refused.value.message
        models = server.models()
        assert models["coder"]["state"] == "loaded" and models["coder"]["unloads"] == 0
        assert models["coder"]["last_drain"]["reason"] == "write-behind off"
        _chat(server, "coder")
    finally:
        server.kill()


def test_sigkill_during_a_drain_loses_nothing_the_drain_reported_durable(small_dir, tmp_path):
    ssd = tmp_path / "ssd"
    server = PoolServer(_toml(small_dir), tmp_path, ssd_dir=ssd)
    prompts = [f"Conversation {i}: " + PROMPT for i in range(3)]
    try:
        firsts = [_chat(server, "coder", prompt)[0].choices[0].message.content for prompt in prompts]
        drained = httpx.post(f"{server.base}/admin/drain", json={"model": "coder"}, timeout=60)
        assert drained.status_code == 200 and drained.json()["durable"], drained.text
        # More work, then a drain the server is killed in the middle of.
        for i in range(3):
            _chat(server, "coder", f"Later {i}: " + PROMPT)
        killer = threading.Timer(0.05, server.kill)
        killer.start()
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{server.base}/admin/drain", json={"model": "coder"}, timeout=60)
        killer.join()
    finally:
        server.kill()
    restarted = PoolServer(_toml(small_dir), tmp_path, ssd_dir=ssd)
    try:
        for prompt, first in zip(prompts, firsts, strict=True):
            reply, cached_share = _chat(restarted, "coder", prompt)
            assert cached_share >= 0.9
            assert reply.choices[0].message.content == first
    finally:
        restarted.kill()


def _pool_model_samples(server: PoolServer) -> dict[tuple[str, str], float]:
    """The pool's /metrics samples labelled by model, as {(sample name, model): value}."""
    text = httpx.get(f"{server.base}/metrics", timeout=10).text
    return {
        (sample.name, sample.labels["model"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if "model" in sample.labels
    }


def _copy_under_another_fingerprint(model_dir: Path, to: Path) -> Path:
    """The same weights under another serving fingerprint (one more config key, which mlx-lm ignores), so
    that two pool models of one model keep separate SSD directories."""
    shutil.copytree(model_dir, to)
    config = json.loads((to / "config.json").read_text())
    (to / "config.json").write_text(json.dumps({**config, "kvcellar_test_copy": True}))
    return to


def test_ram_gb_fixes_a_share_and_a_draft_model_keeps_greedy_output(small_dir, tmp_path):
    # `drafted` is the tiny llama drafting for itself (tests/test_speculative.py's self-draft), `plain` the
    # same weights without a draft and with a fixed RAM share; `drafted` shares the rest of --prompt-cache.
    drafted_dir = _copy_under_another_fingerprint(small_dir, tmp_path / "drafted")
    models_toml = (
        f'[models.plain]\npath = "{small_dir}"\nram_gb = 0.25\n'
        f'[models.drafted]\npath = "{drafted_dir}"\ndraft_model = "{small_dir}"\nnum_draft_tokens = 2\n'
    )
    server = PoolServer(models_toml, tmp_path, "--prompt-cache", "1")
    try:
        plain, _ = _chat(server, "plain")
        drafted, _ = _chat(server, "drafted")
        assert drafted.choices[0].message.content == plain.choices[0].message.content
        speculative = httpx.get(f"{server.base}/models/drafted/stats", timeout=10).json()["speculative"]
        assert speculative["requests"] > 0 and speculative["rounds"] > 0
        models = server.models()
        assert models["plain"]["ram_max_bytes"] == 250_000_000 and models["plain"]["ram_fixed"]
        assert models["drafted"]["ram_max_bytes"] == 750_000_000 and not models["drafted"]["ram_fixed"]
        assert models["drafted"]["draft_model"] == str(small_dir) and models["plain"]["draft_model"] is None
        assert models["drafted"]["speculative"]["requests"] == speculative["requests"]
        assert models["plain"]["speculative"] == {}
        # The draft's weights count against the models memory budget with the model's own.
        assert models["drafted"]["weights_bytes"] == 2 * models["plain"]["weights_bytes"] > 0
        # /metrics has the engine turns of each model and the speculative counters of the drafted one.
        samples, later = _pool_model_samples(server), server.models()
        for name, field in itertools.product(("plain", "drafted"), ("engine_jobs", "engine_yields")):
            assert models[name][field] <= samples[f"kvcellar_pool_model_{field}_total", name] <= later[name][field]
        assert models["plain"]["engine_jobs"] > 0 and models["drafted"]["engine_jobs"] > 0
        for field in ("requests", "rounds", "proposed_tokens", "accepted_tokens"):
            sample = f"kvcellar_pool_model_speculative_{field}_total"
            assert samples[sample, "drafted"] == models["drafted"]["speculative"][field]
            assert (sample, "plain") not in samples
    finally:
        server.kill()
