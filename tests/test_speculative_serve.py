"""Speculative decoding's companion state through a real server (issue 42):
`kvcellar serve --draft-model ... --generation-checkpoint ...` as a
subprocess. The SSD tier reports its companion bytes (`/stats`
`ssd_cache.companion_bytes`, `/metrics`), the same after a restart that
indexes the entries from the journal; and a generation killed with SIGKILL
part-way, once a checkpoint carrying the draft's KV is on disk, resumes
after a restart with the uninterrupted output without re-prefilling the
draft (`speculative.companion_restored`)."""

from __future__ import annotations

from pathlib import Path

import httpx
from polling import wait_until_sync
from test_checkpoint_serve import (
    CHECKPOINT_TOKENS,
    GREEDY,
    MAX_TOKENS,
    _complete,
    _files,
    _kill_part_way,
    _resumed,
    _text,
)
from test_serve import Server

from kvcellar.store import kvfile


def _start(model_dir: Path, ssd_dir: Path) -> Server:
    # The target is its own draft: the same tokenizer, and every proposal accepted.
    return Server(
        model_dir,
        "--ssd-cache",
        str(ssd_dir),
        "--generation-checkpoint",
        str(CHECKPOINT_TOKENS),
        "--draft-model",
        str(model_dir),
        "--batch",
        "1",
    )


def _stats(server: Server) -> dict:
    return httpx.get(f"{server.base}/stats", timeout=10).json()


def _flush(server: Server) -> None:
    response = httpx.post(f"{server.base}/admin/cache/flush", timeout=60)
    assert response.status_code == 200 and response.json()["durable"], response.text


def test_a_generation_killed_part_way_resumes_with_its_draft_state_and_the_ssd_tier_counts_it(
    model_dir_factory, tmp_path
):
    model_dir, ssd_dir = model_dir_factory("llama"), tmp_path / "ssd"
    first = _start(model_dir, ssd_dir)
    try:
        # The memory guard measured the weights after the draft loaded: the target's and its copy's.
        weights_on_disk_bytes = sum(path.stat().st_size for path in model_dir.glob("*.safetensors"))
        assert _stats(first)["memory"]["weights_bytes"] >= 1.9 * weights_on_disk_bytes
        reference = _complete(first, GREEDY)
        assert reference["usage"]["completion_tokens"] == MAX_TOKENS
        _flush(first)
        ssd = _stats(first)["ssd_cache"]
        assert 0 < ssd["companion_bytes"] < ssd["bytes"]
        metrics = httpx.get(f"{first.base}/metrics", timeout=10).text
        assert f"kvcellar_ssd_cache_companion_bytes {float(ssd['companion_bytes'])}" in metrics
        # Completion removed what the request checkpointed; now it is killed part-way.
        wait_until_sync(lambda: _files(ssd_dir) == [], what="the completed checkpoint was removed")
        _kill_part_way(first, [GREEDY], ssd_dir, files_after=1)
    finally:
        first.kill()
    (checkpoint,) = _files(ssd_dir)
    header = kvfile.read_header(checkpoint)
    assert header.format_version == kvfile.COMPANION_CHECKPOINT_FORMAT_VERSION and header.companion is not None
    second = _start(model_dir, ssd_dir)
    try:
        # Indexed from the journal this time (no header read): the same companion bytes.
        restarted = _stats(second)
        assert restarted["ssd_cache"]["companion_bytes"] == ssd["companion_bytes"]
        assert 0 < restarted["checkpoints"]["companion_bytes"] < checkpoint.stat().st_size
        resumed = _complete(second, GREEDY)
        assert _text(resumed) == _text(reference)
        assert 0 < _resumed(resumed) < MAX_TOKENS and resumed["usage"]["completion_tokens"] == MAX_TOKENS
        stats = _stats(second)
        assert stats["checkpoints"]["resumed"] == 1
        speculative = stats["speculative"]
        assert speculative["companion_restored"] == 1 and speculative["draft_reprefills"] == {}
    finally:
        second.kill()
