"""The restore policy through a real server (issue 44): a throttled disk recomputes, a full-speed one restores;
the measured costs persist across a restart and are invalidated by another model or device."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvcellar.store.cost_memo import COST_MEMO_FILE_NAME, CostKey, load_costs, save_costs
from kvcellar.store.restore_plan import CostModel, PrefillPoint, TierRate
from tests.test_serve import Server

PROMPT = "The cellar keeps every prefix it has seen, one shelf per conversation. " * 24
BODY = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}


def _first_then_restarted(model_dir: Path, tmp_path: Path, *flags: str) -> tuple[dict, dict, dict]:
    """One completion, a flush and a clean stop; then the same completion on a
    restarted server (its prefix now on the SSD tier only): both replies and the second server's policy stats."""
    env = {"KVCELLAR_CACHE_DIR": str(tmp_path / "cache")}
    args = ("--ssd-cache", str(tmp_path / "ssd"), *flags)
    first = Server(model_dir, *args, env=env)
    try:
        before = httpx.post(f"{first.base}/v1/completions", json=BODY, timeout=120).json()
        assert httpx.post(f"{first.base}/admin/cache/flush", timeout=120).json()["durable"] is True
        status, output = first.stop()
        assert status == 0, output
    finally:
        first.kill()
    second = Server(model_dir, *args, env=env)
    try:
        after = httpx.post(f"{second.base}/v1/completions", json=BODY, timeout=120).json()
        policy = httpx.get(f"{second.base}/stats", timeout=30).json()["restore_policy"]
        recent = httpx.get(f"{second.base}/stats/requests", timeout=30).json()["requests"]
        # /stats/requests names each request's plan; the decision shows it and its times.
        assert recent[-1]["restore_plan"] == policy["recent_decisions"][-1]["plan"]
    finally:
        second.kill()
    return before, after, policy


def test_a_slow_disk_does_not_restore(model_dir_factory, tmp_path: Path) -> None:
    """On a disk at 0.1 MB/s the tiny llama's restore is slower than its
    prefill: the server recomputes, or splits where overlapping the two is
    faster still (it is, for this full-attention model: the load covers the
    tail while the front prefills); never the whole restore. Its KV costs 512
    bytes a token and this CPU prefills 500-4000 tokens/s depending on the
    load, so the crossover lies at 0.25-2 MB/s: 1 MB/s would be a coin toss
    on a busy machine, 0.1 MB/s is on one side of it whatever the load."""
    before, after, policy = _first_then_restarted(model_dir_factory("llama"), tmp_path, "--disk-throttle-mbps", "0.1")
    assert policy["plans"]["restore"] == 0 and policy["plans"]["recompute"] + policy["plans"]["split"] == 1, policy
    assert policy["costs"]["tiers"]["ssd"]["mb_per_s"] < 0.2
    decision = policy["recent_decisions"][-1]
    assert decision["predicted_ms"]["recompute"] < decision["predicted_ms"]["restore"]
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    assert (tmp_path / "cache" / "shard-digests" / COST_MEMO_FILE_NAME).is_file()


def test_a_full_speed_disk_restores(model_dir_factory, tmp_path: Path) -> None:
    """A disk at full speed never recomputes. Restore and split are both right
    here and close (the prefix is 0.3 MB): on a machine busy enough to slow
    the disk probe, a split that prefills a few front tokens is predicted a
    hair faster, and the policy may take it; the cached share then holds the
    loaded back."""
    before, after, policy = _first_then_restarted(model_dir_factory("llama"), tmp_path)
    assert policy["plans"]["recompute"] == 0 and policy["plans"]["restore"] + policy["plans"]["split"] == 1, policy
    decision = policy["recent_decisions"][-1]
    assert decision["actual_ms"] > 0 and decision["predicted_ms"]["restore"] < decision["predicted_ms"]["recompute"]
    usage = after["usage"]
    loaded_tokens = decision["cached_tokens"] - (decision.get("split_at_tokens") or 0)
    assert usage["prompt_tokens_details"]["cached_tokens"] >= min(loaded_tokens, usage["prompt_tokens"] - 1)
    assert after["choices"][0]["text"] == before["choices"][0]["text"]


def test_a_forced_split_serves_the_cold_runs_tokens(model_dir_factory, tmp_path: Path) -> None:
    before, after, policy = _first_then_restarted(model_dir_factory("llama"), tmp_path, "--restore-policy", "split")
    assert policy["plans"]["split"] == 1, policy
    decision = policy["recent_decisions"][-1]
    assert 0 <= decision["split_at_tokens"] <= decision["cached_tokens"]
    assert after["choices"][0]["text"] == before["choices"][0]["text"]


def _model(seconds_per_token: float) -> CostModel:
    return CostModel(
        tiers={"ssd": TierRate(fixed_s=0.001, bytes_per_s=2e9, samples=3)},
        prefill=(PrefillPoint(bucket_tokens=1024, context_tokens=900.0, seconds_per_token=seconds_per_token),),
        join_bytes_per_s=1e10,
    )


KEY = CostKey(config_sha256="c" * 64, weights_sha256="w" * 64, device="cpu", device_architecture="AMD EPYC (x86_64)")


def test_costs_persist_and_a_model_or_device_change_invalidates_them(tmp_path: Path) -> None:
    assert load_costs(tmp_path, KEY) is None
    assert save_costs(tmp_path, KEY, _model(1e-3))
    assert load_costs(tmp_path, KEY) == _model(1e-3)
    for changed in (
        CostKey(
            config_sha256=KEY.config_sha256,
            weights_sha256="v" * 64,
            device="cpu",
            device_architecture=KEY.device_architecture,
        ),
        CostKey(
            config_sha256=KEY.config_sha256,
            weights_sha256=KEY.weights_sha256,
            device="gpu",
            device_architecture="NVIDIA H200",
        ),
    ):
        assert load_costs(tmp_path, changed) is None
    (tmp_path / COST_MEMO_FILE_NAME).write_bytes(b"not cbor")
    assert load_costs(tmp_path, KEY) is None


@pytest.mark.parametrize("flag", [("--restore-policy", "fastest"), ("--disk-throttle-mbps", "0")])
def test_bad_policy_flags_are_refused_at_start(flag, model_dir_factory) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "kvcellar.cli", "serve", "--model", str(model_dir_factory("llama")), *flag],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert flag[0] in result.stderr


def test_calibrate_prints_the_curve_and_persists_it_for_serve(model_dir_factory, tmp_path: Path, monkeypatch) -> None:
    import json

    from click.testing import CliRunner

    from kvcellar.cli import cli
    from kvcellar.store.fingerprint import ShardDigestMemo, compute_fingerprint

    monkeypatch.setenv("KVCELLAR_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = model_dir_factory("llama")
    outcome = CliRunner().invoke(
        cli,
        [
            "calibrate",
            "--model",
            str(model_dir),
            "--seconds",
            "1",
            "--context-max",
            "1024",
            "--ssd-cache",
            str(tmp_path / "ssd"),
            "--json",
        ],
    )
    assert outcome.exit_code == 0, outcome.output
    assert "context_tokens  tokens_per_s" in outcome.output
    shown = json.loads(outcome.output.strip().splitlines()[-1])
    assert shown["prefill"] and shown["tiers"]["ssd"]["mb_per_s"] > 0
    memo_dir = tmp_path / "cache" / "shard-digests"
    key = CostKey.of(compute_fingerprint(model_dir, memo=ShardDigestMemo(memo_dir)))
    persisted = load_costs(memo_dir, key)
    assert persisted is not None and len(persisted.prefill) == len(shown["prefill"])
