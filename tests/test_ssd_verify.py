"""`--ssd-cache-verify on|off`: with it off the SSD tier restores an entry
without checking its tensor checksums (the header is still checked); the flag
reaches a real server's /stats."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kvcellar.huge_pages import HUGE_PAGES_TUNABLE, TUNABLES_ENV, host_reexec_environment
from kvcellar.store import kvfile
from kvcellar.store.ssd import QUARANTINE_DIR_NAME, SsdStore

FINGERPRINT = "f" * 32
BASE = [(13 * i + 7) % 1000 + 3 for i in range(60)]


def _stored_entry_with_a_flipped_tensor_byte(model, directory):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([BASE]), cache=cache))
    store = SsdStore.open(directory, FINGERPRINT)
    path = store.entry(store.store(BASE, cache)).path
    store.close()
    record = next(kvfile.read_header(path).tensor_records())
    data = bytearray(path.read_bytes())
    data[record.file_offset + 5] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("verify", [True, False], ids=["on", "off"])
def test_verify_off_restores_without_tensor_checks_and_on_quarantines(verify, loaded_model_factory, tmp_path):
    model, _ = loaded_model_factory("llama")
    _stored_entry_with_a_flipped_tensor_byte(model, tmp_path)
    store = SsdStore.open(tmp_path, FINGERPRINT, verify=verify)
    assert store.stats()["verify_tensors"] is verify
    restored = store.restore(store.find(BASE + [1]))
    quarantine = tmp_path / FINGERPRINT / QUARANTINE_DIR_NAME
    if verify:
        assert restored is None and store.entry_ids() == []
        assert len(list(quarantine.iterdir())) == 1
    else:
        assert restored is not None and restored[0].offset == len(BASE)
        assert len(store.entry_ids()) == 1
    store.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _stats_of_a_server(model_dir, *args):
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvcellar.cli", "serve", "--model", str(model_dir), "--port", str(port), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**{key: value for key, value in os.environ.items() if key != TUNABLES_ENV}, "HF_HUB_OFFLINE": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"server exited: {process.stdout.read()}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    stats = httpx.get(f"http://127.0.0.1:{port}/stats", timeout=10).json()
                    environ_path = Path(f"/proc/{process.pid}/environ")
                    return stats, environ_path.read_bytes().split(b"\0") if environ_path.exists() else []
            except httpx.HTTPError:
                time.sleep(0.3)
        pytest.fail("server did not become healthy")
    finally:
        process.kill()
        process.wait()


def test_serve_runs_with_verification_off_and_huge_pages_where_they_help(model_dir_factory, tmp_path):
    stats, environ = _stats_of_a_server(
        model_dir_factory("llama"), "--ssd-cache", str(tmp_path), "--ssd-cache-verify", "off"
    )
    assert stats["ssd_cache"]["verify_tensors"] is False
    inherited = {key: value for key, value in os.environ.items() if key != TUNABLES_ENV}
    if host_reexec_environment(inherited) is not None:
        assert f"{TUNABLES_ENV}={HUGE_PAGES_TUNABLE}".encode() in environ


def test_serve_refuses_a_verify_value_other_than_on_or_off(model_dir_factory, tmp_path):
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcellar.cli",
            "serve",
            "--model",
            str(model_dir_factory("llama")),
            "--ssd-cache",
            str(tmp_path),
            "--ssd-cache-verify",
            "maybe",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 2 and "--ssd-cache-verify" in completed.stderr
