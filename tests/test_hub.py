"""Hub models: `kvcellar model pull`, `model list` and `serve --model ORG/NAME`
against a local fake of the Hugging Face hub.

The fake is a real HTTP server on 127.0.0.1 (`HF_ENDPOINT` points the CLI at
it) serving the endpoints `snapshot_download` uses: the revision API, the
tree listing and the file resolve URLs, for one tiny repo made of a
random-weight llama plus files mlx-lm does not need (which must not be
fetched). Every CLI runs as a subprocess with its own `HF_HOME`, so nothing
touches the user's cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from test_serve import Server

REPO_ID = "kvcellar-tests/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
UNWANTED_FILES = {"README.md": b"# a model card\n", "pytorch_model.bin": b"\0" * 4096}


class FakeHub:
    """The files of one repo, served the way the hub serves them; records every request path."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.respond(self, send_body=False)

            def do_GET(self) -> None:
                hub.respond(self, send_body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def respond(self, handler: BaseHTTPRequestHandler, *, send_body: bool) -> None:
        path = handler.path.split("?", 1)[0]
        self.requests.append(f"{handler.command} {path}")
        headers: dict[str, str] = {}
        if path in (f"/api/models/{REPO_ID}/revision/main", f"/api/models/{REPO_ID}"):
            body = json.dumps({"id": REPO_ID, "sha": COMMIT, "siblings": [{"rfilename": n} for n in self.files]})
        elif path == f"/api/models/{REPO_ID}/tree/{COMMIT}":
            body = json.dumps(
                [
                    {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for name, data in self.files.items()
                ]
            )
        elif match := re.fullmatch(rf"/{re.escape(REPO_ID)}/resolve/(main|{COMMIT})/(.+)", path):
            data = self.files.get(match.group(2))
            if data is None:
                self._send(handler, 404, b"", {"X-Error-Code": "EntryNotFound"}, send_body=send_body)
                return
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
            self._send(handler, 200, data, headers, send_body=send_body)
            return
        else:
            self._send(
                handler,
                404,
                b'{"error": "Repository not found"}',
                {"X-Error-Code": "RepoNotFound"},
                send_body=send_body,
            )
            return
        self._send(handler, 200, body.encode(), {"Content-Type": "application/json"}, send_body=send_body)

    @staticmethod
    def _send(
        handler: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str], *, send_body: bool
    ) -> None:
        handler.send_response(status)
        for name, value in headers.items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if send_body:
            handler.wfile.write(body)


@pytest.fixture
def fake_hub(model_dir_factory) -> Iterator[FakeHub]:
    model_dir = model_dir_factory("llama")
    files = {path.name: path.read_bytes() for path in sorted(model_dir.iterdir()) if path.is_file()}
    hub = FakeHub({**files, **UNWANTED_FILES})
    yield hub
    hub.close()


def hub_env(hub: FakeHub, hf_home: Path, *, offline: bool = False) -> dict[str, str]:
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(hf_home)}
    env.pop("HF_HUB_CACHE", None)
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    env["HF_HUB_OFFLINE"] = "1" if offline else "0"
    return env


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvcellar.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )


def snapshot_files(hf_home: Path) -> set[str]:
    snapshot_dir = hf_home / "hub" / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT
    return {path.name for path in snapshot_dir.iterdir()}


def test_pull_downloads_only_the_mlx_files_with_progress_then_list_shows_it(fake_hub, tmp_path):
    env = hub_env(fake_hub, tmp_path / "hf")
    pulled = run_cli(env, "model", "pull", REPO_ID)
    assert pulled.returncode == 0, pulled.stderr
    assert f"downloaded {REPO_ID}" in pulled.stdout
    # huggingface_hub's progress bars, on stderr: the file count and the bytes.
    assert "Fetching 5 files" in pulled.stderr
    assert "100%" in pulled.stderr
    assert snapshot_files(tmp_path / "hf") == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
    assert not any(name in request for request in fake_hub.requests for name in UNWANTED_FILES)

    requests_before = len(fake_hub.requests)
    again = run_cli(hub_env(fake_hub, tmp_path / "hf", offline=True), "model", "pull", REPO_ID)
    assert again.returncode == 0, again.stderr
    assert f"found {REPO_ID}" in again.stdout
    assert len(fake_hub.requests) == requests_before

    listed = run_cli(env, "model", "list")
    assert listed.returncode == 0, listed.stderr
    line = next(line for line in listed.stdout.splitlines() if line.startswith(REPO_ID))
    size_bytes = sum(len(data) for name, data in fake_hub.files.items() if name not in UNWANTED_FILES)
    assert f"{size_bytes / 1000:.1f} kB" in line and "hub cache, 5 files" in line
    assert listed.stdout.splitlines()[0].startswith("demo-coder ")


def test_serve_downloads_a_hub_model_and_serves_it(fake_hub, tmp_path):
    server = Server(Path(REPO_ID), "--batch", "1", env=hub_env(fake_hub, tmp_path / "hf"))
    try:
        models = httpx.get(f"{server.base}/v1/models", timeout=5).json()
        assert len(models["data"]) == 1
        reply = httpx.post(
            f"{server.base}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=30,
        )
        assert reply.status_code == 200
    finally:
        status, output = server.stop()
    assert status == 0
    assert "Fetching 5 files" in output
    assert f"GET /{REPO_ID}/resolve/{COMMIT}/model.safetensors" in fake_hub.requests


def test_offline_and_not_cached_is_a_clear_start_up_error(fake_hub, tmp_path):
    served = run_cli(hub_env(fake_hub, tmp_path / "hf", offline=True), "serve", "--model", REPO_ID)
    assert served.returncode == 2
    assert f"'{REPO_ID}' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set" in served.stderr
    assert f"kvcellar model pull {REPO_ID}" in served.stderr
    assert "Traceback" not in served.stderr
    assert fake_hub.requests == []


def test_a_repo_the_hub_does_not_have_is_a_clear_error(fake_hub, tmp_path):
    pulled = run_cli(hub_env(fake_hub, tmp_path / "hf"), "model", "pull", "kvcellar-tests/no-such-model")
    assert pulled.returncode == 2
    assert "'kvcellar-tests/no-such-model' is not a model repo on the hub" in pulled.stderr
    assert "Traceback" not in pulled.stderr
