"""Encryption at rest through a real server (issue 39 part 2): with a key the
SSD tier's files hold no 16-token run of the prompt's ids (the same scan finds
them without a key), a restart with the key restores, and a restart with a
wrong key serves cold with identical greedy output and quarantines the entry.
The requests go through the official openai SDK."""

from __future__ import annotations

import numpy as np
import openai
import trio
from test_flush import _config, serving

from kvcellar.store import kvfile
from kvcellar.store.keyring import load_key_ring, write_new_key_file
from kvcellar.store.ssd import SEALED_QUARANTINE_DIR_NAME

PROMPT = "The cellar keeps every prefix it has seen, sealed, until a key that opens it comes back again. " * 3
RUN_TOKENS = 16


def _runs(tokens: tuple[int, ...]) -> list[bytes]:
    return [np.asarray(tokens[i : i + RUN_TOKENS], dtype="<u4").tobytes() for i in range(len(tokens) - RUN_TOKENS)]


def _served(config) -> tuple[str, dict]:
    """One greedy completion of PROMPT, flushed; returns its text and the SSD tier's stats."""
    result: list = []

    async def main() -> None:
        async with serving(config) as (_, client):
            sdk = openai.AsyncOpenAI(base_url=f"{str(client.base_url).rstrip('/')}/v1", api_key="unused", max_retries=0)
            model = (await sdk.models.list()).data[0].id
            reply = await sdk.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
            await sdk.close()
            flushed = await client.post("/admin/cache/flush", json={"timeout_s": 60})
            assert flushed.status_code == 200, flushed.text
            stats = (await client.get("/stats")).json()["ssd_cache"]
            result.extend([reply.choices[0].text, stats])

    trio.run(main)
    return result[0], result[1]


def test_sealed_tier_through_a_server(model_dir_factory, tmp_path):
    model_dir = model_dir_factory("llama")
    for name in ("right", "wrong"):
        write_new_key_file(tmp_path / f"{name}.key")
    right, wrong = (load_key_ring([tmp_path / f"{name}.key"]) for name in ("right", "wrong"))
    plain_config = _config(model_dir, tmp_path / "plain", restore_policy="restore")
    sealed_config = _config(model_dir, tmp_path / "sealed", restore_policy="restore", ssd_keyring=right)

    text, _ = _served(plain_config)
    _served(sealed_config)
    plain_files = list((tmp_path / "plain").rglob("*.kvc"))
    sealed_files = list((tmp_path / "sealed").rglob("*.kvc"))
    assert plain_files and sealed_files
    tokens = kvfile.read_header(sealed_files[0], keyring=right).tokens
    assert len(tokens) > RUN_TOKENS
    assert any(run in path.read_bytes() for path in plain_files for run in _runs(tokens))  # the scan can fail
    # Every file of the sealed cache directory: the entries, the journal (database and WAL), the lock.
    every_sealed_file = [path for path in (tmp_path / "sealed").rglob("*") if path.is_file()]
    assert any(path.name.startswith("journal.sqlite") for path in every_sealed_file)
    assert not any(run in path.read_bytes() for path in every_sealed_file for run in _runs(tokens))
    assert not any(PROMPT[:48].encode() in path.read_bytes() for path in every_sealed_file)
    plain_journal = [path for path in (tmp_path / "plain").rglob("journal.sqlite*") if path.is_file()]
    assert any(run in path.read_bytes() for path in plain_journal for run in _runs(tokens))

    restarted_text, restarted = _served(sealed_config)
    assert restarted["restores"] >= 1 and restarted_text == text

    cold_text, cold = _served(_config(model_dir, tmp_path / "sealed", restore_policy="restore", ssd_keyring=wrong))
    assert cold["restores"] == 0 and cold["quarantined"] >= 1
    assert cold_text == text
    assert list((tmp_path / "sealed").rglob(f"{SEALED_QUARANTINE_DIR_NAME}/*"))
