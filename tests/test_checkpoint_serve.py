"""In-flight generation checkpoints through a real server (spec §5.7), one
story over three server processes on one SSD directory: greedy and seeded
generations killed with SIGKILL part-way (batch rows together, then a serial
request) resume after a restart with the uninterrupted output and
`resumed_tokens` > 0; a changed temperature or prompt does not resume; a
client disconnect keeps the checkpoint; completion removes it; a damaged
checkpoint is quarantined and the request runs cold with the right output."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import httpx
from polling import wait_until_sync
from test_serve import Server

CHECKPOINT_TOKENS = 16
MAX_TOKENS = 300
# Tokens the client reads before the kill: well before the end, after a few checkpoints.
KILL_AFTER_CHUNKS = 64
GREEDY = {"prompt": "The cellar keeps", "max_tokens": MAX_TOKENS, "temperature": 0}
SEEDED = {**GREEDY, "temperature": 0.8, "seed": 3}
# A changed sampling field or prompt: never resumes another request's checkpoint.
CHANGED = ({**GREEDY, "temperature": 0.5, "seed": 1}, {**GREEDY, "prompt": "The cellar kept"})


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


def _stream_until_checkpointed(server: Server, bodies: list[dict], files_min: int, then) -> None:
    """Stream the requests at once; once each sent `KILL_AFTER_CHUNKS` chunks
    and `files_min` checkpoints are on disk, call `then()` with the streams open."""
    with ExitStack() as streams:
        opened = [
            streams.enter_context(
                httpx.stream("POST", f"{server.base}/v1/completions", json={**body, "stream": True}, timeout=120)
            )
            for body in bodies
        ]
        for stream in opened:
            _read_chunks(stream, KILL_AFTER_CHUNKS)
        wait_until_sync(lambda: _checkpoints(server)["files"] >= files_min, what="the checkpoints were written")
        then()


def _kill_part_way(server: Server, bodies: list[dict], ssd_dir: Path, files_after: int) -> None:
    """SIGKILL the server while it generates the requests, once each has a checkpoint on disk."""
    _stream_until_checkpointed(server, bodies, files_after, server.kill)
    assert len(_files(ssd_dir)) == files_after, "a generation had completed before the kill"


def _disconnect_part_way(server: Server, body: dict) -> None:
    """Stream the request and hang up once a checkpoint is written."""
    files_before = _checkpoints(server)["files"]
    _stream_until_checkpointed(server, [body], files_before + 1, lambda: None)
    wait_until_sync(
        lambda: httpx.get(f"{server.base}/stats", timeout=10).json()["scheduler"]["rows_active"] == 0,
        what="the cancelled generation ended",
    )


def _text(result: dict) -> str:
    return result["choices"][0]["text"]


def test_generations_killed_part_way_resume_after_a_restart_with_the_uninterrupted_output(model_dir_factory, tmp_path):
    model_dir, ssd_dir = model_dir_factory("llama"), tmp_path / "ssd"
    # The batch lane: a greedy and a seeded row killed together, each with its checkpoint on disk.
    first = _start(model_dir, ssd_dir, "--batch", "4")
    try:
        assert httpx.get(f"{first.base}/stats").json()["scheduler"]["lane"] == "batch"
        greedy, seeded = _complete(first, GREEDY), _complete(first, SEEDED)
        assert greedy["usage"]["completion_tokens"] == MAX_TOKENS and _resumed(greedy) == 0
        # Completion removes what each request checkpointed.
        wait_until_sync(lambda: _checkpoints(first)["removed"] == 2, what="the completed checkpoints were removed")
        assert _files(ssd_dir) == []
        _kill_part_way(first, [GREEDY, SEEDED], ssd_dir, files_after=2)
    finally:
        first.kill()
    # The serial lane resumes them (a resumed request joins whichever lane serves it).
    second = _start(model_dir, ssd_dir, "--batch", "1")
    try:
        # A changed sampling field or prompt starts normally (one chunk: the resume decision is made).
        for changed in CHANGED:
            with httpx.stream("POST", f"{second.base}/v1/completions", json={**changed, "stream": True}) as stream:
                _read_chunks(stream, 1)
        assert _checkpoints(second)["resumed"] == 0
        for body, reference in ((GREEDY, greedy), (SEEDED, seeded)):
            resumed = _complete(second, body)
            assert _text(resumed) == _text(reference)
            assert 0 < _resumed(resumed) < MAX_TOKENS and resumed["usage"]["completion_tokens"] == MAX_TOKENS
        stats = _checkpoints(second)
        assert stats["resumed"] == 2 and stats["tokens_saved"] > 0
        assert "kvcellar_checkpoints_resumed_total 2.0" in httpx.get(f"{second.base}/metrics").text
        # A client that hangs up keeps its checkpoint; then the greedy request is killed part-way on this lane.
        _disconnect_part_way(second, SEEDED)
        files_before = _checkpoints(second)["files"]
        _kill_part_way(second, [GREEDY], ssd_dir, files_after=files_before + 1)
    finally:
        second.kill()
    # A damaged checkpoint (the greedy one, written last) is quarantined and its request runs cold.
    damaged = max(_files(ssd_dir), key=lambda path: path.stat().st_mtime_ns)
    data = bytearray(damaged.read_bytes())
    data[-64:] = bytes(64)
    damaged.write_bytes(bytes(data))
    third = _start(model_dir, ssd_dir, "--batch", "1")
    try:
        kept = _complete(third, SEEDED)
        assert _text(kept) == _text(seeded) and _resumed(kept) > 0, "the disconnected request resumes"
        cold = _complete(third, GREEDY)
        assert _text(cold) == _text(greedy) and _resumed(cold) == 0
        stats = _checkpoints(third)
        assert stats["quarantined"] == 1 and stats["resumed"] == 1
        # The changed requests hung up after one chunk: under load the engine may have passed a
        # checkpoint before it saw them go, and a hang-up keeps its checkpoint. Completing them
        # removes whatever they kept, so the tier ends empty either way.
        for changed in CHANGED:
            _complete(third, changed)
        wait_until_sync(lambda: _files(ssd_dir) == [], what="completion removed every checkpoint")
    finally:
        third.kill()
