"""`kvcellar cache rekey`: every entry and journal row re-sealed under the
new key; a process killed (SIGKILL) part way leaves every entry readable and
a rerun finishes; a directory a live store holds is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kvcellar.cli import main
from kvcellar.store import kvfile
from kvcellar.store.checkpoints import CheckpointStore
from kvcellar.store.keyring import load_key_ring, write_new_key_file
from kvcellar.store.records import GenerationCheckpoint, SamplerState
from kvcellar.store.sealed_tokens import TOKEN_CARRYING_KINDS, sealed_key_id
from kvcellar.store.ssd import SsdStore

FINGERPRINT = "f" * 32
PROMPTS = [[(17 * i + 31 * p) % 900 + 5 for i in range(24)] for p in range(1, 7)]
KILL_AT_ENTRY = 3


def _prefill(model, tokens):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([tokens]), cache=cache))
    return cache


@pytest.fixture
def keys(tmp_path):
    directory = tmp_path / "keys"
    directory.mkdir()
    for name in ("old", "new"):
        write_new_key_file(directory / f"{name}.key")
    return directory / "new.key", directory / "old.key"


@pytest.fixture
def cache_dir(loaded_model_factory, keys, tmp_path):
    """Entries sealed under the old key, and one plain."""
    model = loaded_model_factory("llama")[0]
    _, old = keys
    root = tmp_path / "ssd"
    for ring, prompts in ((None, PROMPTS[:1]), (load_key_ring([old]), PROMPTS[1:])):
        store = SsdStore.open(root, FINGERPRINT, keyring=ring)
        for prompt in prompts:
            assert store.store(prompt, _prefill(model, prompt)) is not None
        store.close()
    return root


def _rekey_command(root, keys) -> list[str]:
    new, old = keys
    return [
        sys.executable, "-m", "kvcellar.cli", "cache", "rekey", "--ssd-cache", str(root),
        "--encryption-key-file", str(new), "--encryption-key-file", str(old),
    ]  # fmt: skip


def _assert_all_readable(root, ring, model) -> None:
    store = SsdStore.open(root, FINGERPRINT, keyring=ring)
    try:
        for prompt in PROMPTS:
            match = store.find(prompt + [3])
            assert match is not None and match.usable_tokens == len(prompt)
            restored = store.restore(match)
            assert restored is not None
            live = _prefill(model, prompt)
            assert mx.array_equal(live[0].keys[..., : len(prompt), :], restored[0].keys[..., : len(prompt), :]).item()
    finally:
        store.close()


def test_a_rekey_killed_part_way_leaves_everything_readable_and_a_rerun_finishes(loaded_model_factory, cache_dir, keys):
    model = loaded_model_factory("llama")[0]
    new, old = keys
    process = subprocess.Popen(_rekey_command(cache_dir, keys), stdout=subprocess.PIPE, text=True)
    seen = []
    assert process.stdout is not None
    for line in process.stdout:
        seen.append(line)
        if f" {KILL_AT_ENTRY}/{len(PROMPTS)} " in line:
            os.kill(process.pid, signal.SIGKILL)
            break
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL, seen
    _assert_all_readable(cache_dir, load_key_ring([new, old]), model)

    rerun = subprocess.run([*_rekey_command(cache_dir, keys), "--json"], capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert "rekeyed" in rerun.stdout

    new_ring = load_key_ring([new])
    files = [p for p in (cache_dir / FINGERPRINT).rglob("*.kvc")]
    assert len(files) == len(PROMPTS)
    assert {kvfile.read_header(path, keyring=new_ring).seal.key_id for path in files} == {new_ring.sealing.key_id}
    _assert_all_readable(cache_dir, new_ring, model)  # the old key is no longer needed
    store = SsdStore.open(cache_dir, FINGERPRINT, keyring=new_ring)
    rows = store.journal.entries()
    store.close()
    assert len(rows) == len(PROMPTS)
    assert {sealed_key_id(row["token_ids"], row["token_count"]) for row in rows} == {new_ring.sealing.key_id}
    tokens = np.asarray(PROMPTS[0], dtype="<u4").tobytes()
    assert not any(tokens[:64] in path.read_bytes() for path in files)


def test_rekey_refuses_a_directory_a_live_store_holds(cache_dir, keys, capsys):
    new, old = keys
    store = SsdStore.open(cache_dir, FINGERPRINT, keyring=load_key_ring([old]))
    try:
        args = ["cache", "rekey", "--ssd-cache", str(cache_dir)]
        assert main([*args, "--encryption-key-file", str(new), "--encryption-key-file", str(old)]) == 2
    finally:
        store.close()
    assert "error:" in capsys.readouterr().err


def test_rekey_reseals_checkpoints_and_the_journal_history_so_the_old_key_can_go(loaded_model_factory, cache_dir, keys):
    """After a rekey nothing of the tier needs the old key: the generation checkpoints and every
    stored event carrying token ids are sealed under the new one."""
    model = loaded_model_factory("llama")[0]
    new, old = keys
    prompt = PROMPTS[2] + [7, 8, 9]
    store = SsdStore.open(cache_dir, FINGERPRINT, keyring=load_key_ring([old]))
    checkpoints = CheckpointStore.open(store)
    checkpoint = GenerationCheckpoint(
        request_key="c" * 32,
        prompt_tokens=len(PROMPTS[2]),
        emitted_tokens=3,
        namespace="",
        pending_token=11,
        sampler=SamplerState(seed=5, sample_index=4, rng_key=(0, 5)),
        attempt=1,
    )
    writer = checkpoints.plan(checkpoint, prompt, _prefill(model, prompt))
    kvfile.write_entry(writer)
    assert checkpoints.commit(writer)
    store.close()

    result = subprocess.run([*_rekey_command(cache_dir, keys), "--json"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])["directories"][0]
    assert report["checkpoints_rekeyed"] == 1 and report["history_failed"] == 0
    assert report["history_resealed"] >= len(PROMPTS)

    new_ring = load_key_ring([new])
    store = SsdStore.open(cache_dir, FINGERPRINT, keyring=new_ring)
    try:
        (found,) = CheckpointStore.open(store).files()
        assert kvfile.read_header(found.path, keyring=new_ring).seal.key_id == new_ring.sealing.key_id
        resumed = kvfile.load(found.path, keyring=new_ring)
        assert resumed.header.generation_checkpoint == checkpoint
        history = [r.event for r in store.journal.events() if r.kind in TOKEN_CARRYING_KINDS]
    finally:
        store.close()
    assert history and {sealed_key_id(e.entry.token_ids, e.entry.token_count) for e in history} == {
        new_ring.sealing.key_id
    }
    journal_bytes = b"".join(p.read_bytes() for p in (cache_dir / FINGERPRINT).glob("journal.sqlite*"))
    assert not any(np.asarray(p[:16], dtype="<u4").tobytes() in journal_bytes for p in PROMPTS)
