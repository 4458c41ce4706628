"""In-flight generation checkpoints through a real server (spec §5.7): a
generation killed with SIGKILL part-way resumes after a restart with the
uninterrupted output, on the serial lane (greedy) and the batch lane
(seeded sampling); a changed request does not resume; a client disconnect
keeps the checkpoint; completion removes it; a corrupted checkpoint is
quarantined and the request runs cold with the right output."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from polling import wait_until_sync
from test_serve import Server

CHECKPOINT_TOKENS = 16
MAX_TOKENS = 400
# Tokens the client reads before the kill: well before the end, after a few checkpoints.
KILL_AFTER_CHUNKS = 80
GREEDY = {"prompt": "The cellar keeps", "max_tokens": MAX_TOKENS, "temperature": 0}
SEEDED = {**GREEDY, "temperature": 0.8, "seed": 3}


def _start(model_dir: Path, ssd_dir: Path, *extra: str) -> Server:
    return Server(model_dir, "--ssd-cache", str(ssd_dir), "--generation-checkpoint", str(CHECKPOINT_TOKENS), *extra)


def _complete(server: Server, body: dict) -> dict:
    response = httpx.post(f"{server.base}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _checkpoints(server: Server) -> dict:
    return httpx.get(f"{server.base}/stats", timeout=10).json()["checkpoints"]


def _files(ssd_dir: Path) -> list[Path]:
    return sorted(ssd_dir.glob("*/checkpoints/*.kvc"))


def _resumed(result: dict) -> int:
    return result["usage"]["completion_tokens_details"]["resumed_tokens"]


def _read_chunks(response: httpx.Response, count: int) -> None:
    seen = 0
    for line in response.iter_lines():
        if line.startswith("data: {"):
            seen += 1
            if seen >= count:
                return
    raise AssertionError(f"the stream ended after {seen} chunks")


def _kill_part_way(server: Server, body: dict, ssd_dir: Path) -> None:
    """Stream the request and SIGKILL the server while it generates, once a checkpoint is on disk."""
    with httpx.stream("POST", f"{server.base}/v1/completions", json={**body, "stream": True}, timeout=120) as stream:
        _read_chunks(stream, KILL_AFTER_CHUNKS)
        wait_until_sync(lambda: _checkpoints(server)["files"] >= 1, what="a checkpoint was written")
        server.kill()
    assert len(_files(ssd_dir)) == 1, "the generation had completed before the kill"


def _disconnect_part_way(server: Server, body: dict) -> None:
    """Stream the request and hang up once a checkpoint is written."""
    with httpx.stream("POST", f"{server.base}/v1/completions", json={**body, "stream": True}, timeout=120) as stream:
        _read_chunks(stream, KILL_AFTER_CHUNKS)
        wait_until_sync(lambda: _checkpoints(server)["files"] >= 1, what="a checkpoint was written")
    wait_until_sync(
        lambda: httpx.get(f"{server.base}/stats", timeout=10).json()["scheduler"]["rows_active"] == 0,
        what="the cancelled generation ended",
    )


def test_a_greedy_generation_killed_part_way_resumes_with_the_same_output(model_dir_factory, tmp_path):
    model_dir, ssd_dir = model_dir_factory("llama"), tmp_path / "ssd"
    first = _start(model_dir, ssd_dir, "--batch", "1")
    try:
        reference = _complete(first, GREEDY)
        assert reference["usage"]["completion_tokens"] == MAX_TOKENS and _resumed(reference) == 0
        # Completion removes what the request checkpointed.
        wait_until_sync(lambda: _checkpoints(first)["removed"] == 1, what="the completed checkpoint was removed")
        assert _files(ssd_dir) == []
        _kill_part_way(first, GREEDY, ssd_dir)
    finally:
        first.kill()
    second = _start(model_dir, ssd_dir, "--batch", "1")
    try:
        # A changed sampling field or prompt starts normally (read one chunk: the resume decision is made).
        for changed in ({**GREEDY, "temperature": 0.5, "seed": 1}, {**GREEDY, "prompt": "The cellar kept"}):
            with httpx.stream("POST", f"{second.base}/v1/completions", json={**changed, "stream": True}) as stream:
                _read_chunks(stream, 1)
        assert _checkpoints(second)["resumed"] == 0
        resumed = _complete(second, GREEDY)
        assert resumed["choices"][0]["text"] == reference["choices"][0]["text"]
        assert 0 < _resumed(resumed) < MAX_TOKENS
        assert resumed["usage"]["completion_tokens"] == MAX_TOKENS
        # A client that hangs up keeps its checkpoint: the next identical request resumes it.
        _disconnect_part_way(second, GREEDY)
        stats = _checkpoints(second)
        assert stats["resumed"] == 1 and stats["files"] >= 1
        again = _complete(second, GREEDY)
        assert again["choices"][0]["text"] == reference["choices"][0]["text"] and _resumed(again) > 0
        _disconnect_part_way(second, GREEDY)
        second.kill()
        # A damaged checkpoint is quarantined and the request runs cold with the right output
        # (the newest file is that request's: the changed ones hung up first).
        damaged = max(_files(ssd_dir), key=lambda path: path.stat().st_mtime_ns)
        data = bytearray(damaged.read_bytes())
        data[-64:] = bytes(64)
        damaged.write_bytes(bytes(data))
        third = _start(model_dir, ssd_dir, "--batch", "1")
        try:
            cold = _complete(third, GREEDY)
            assert cold["choices"][0]["text"] == reference["choices"][0]["text"] and _resumed(cold) == 0
            stats = _checkpoints(third)
            assert stats["quarantined"] == 1 and stats["resumed"] == 0
        finally:
            third.kill()
    finally:
        second.kill()


def test_a_seeded_batch_lane_generation_killed_part_way_resumes_with_the_same_output(model_dir_factory, tmp_path):
    model_dir, ssd_dir = model_dir_factory("llama"), tmp_path / "ssd"
    first = _start(model_dir, ssd_dir, "--batch", "4")
    try:
        assert httpx.get(f"{first.base}/stats").json()["scheduler"]["lane"] == "batch"
        reference = _complete(first, SEEDED)
        _kill_part_way(first, SEEDED, ssd_dir)
    finally:
        first.kill()
    (checkpoint,) = _files(ssd_dir)
    second = _start(model_dir, ssd_dir, "--batch", "4")
    try:
        resumed = _complete(second, SEEDED)
        assert resumed["choices"][0]["text"] == reference["choices"][0]["text"]
        assert _resumed(resumed) > 0
        stats = _checkpoints(second)
        assert stats["resumed"] == 1 and stats["tokens_saved"] == _resumed(resumed)
        wait_until_sync(lambda: not checkpoint.exists(), what="completion removed the checkpoint")
        metrics = httpx.get(f"{second.base}/metrics").text
        assert "kvcellar_checkpoints_resumed_total 1.0" in metrics, json.dumps(stats)
    finally:
        second.kill()
