"""The SSD tier with an encryption key ring: entries are sealed on disk, a
restart with the key restores them, and one with a missing or wrong key moves
them to the sealed quarantine (never deletes them), warns once naming the key
id, and serves cold."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kvcellar.store.ssd import SEALED_QUARANTINE_DIR_NAME, SsdStore

FINGERPRINT = "f" * 32
PROMPT = [(13 * i + 7) % 1000 + 3 for i in range(64)]
RUN_TOKENS = 16


def _prefill(model, tokens):
    cache = make_prompt_cache(model)
    logits = model(mx.array([tokens]), cache=cache)[:, -1, :]
    mx.eval(logits)
    return cache


def _token_runs(directory, tokens) -> int:
    """16-token runs of `tokens` as uint32/int32 LE in any `.kvc` file under `directory`."""
    runs = [np.asarray(tokens[i : i + RUN_TOKENS], dtype="<u4").tobytes() for i in range(len(tokens) - RUN_TOKENS + 1)]
    return sum(run in path.read_bytes() for path in directory.rglob("*.kvc") for run in runs)


@pytest.fixture
def llama(loaded_model_factory):
    return loaded_model_factory("llama")[0]


def _store_one(root, model, keyring) -> None:
    store = SsdStore.open(root, FINGERPRINT, keyring=keyring)
    assert store.store(PROMPT, _prefill(model, PROMPT)) is not None
    store.close()


def test_sealed_tier_holds_no_prompt_run_and_the_scan_can_fail(llama, rings, tmp_path):
    right, _ = rings
    _store_one(tmp_path / "plain", llama, None)
    _store_one(tmp_path / "sealed", llama, right)
    assert _token_runs(tmp_path / "plain", PROMPT) > 0
    assert _token_runs(tmp_path / "sealed", PROMPT) == 0


@pytest.mark.parametrize("journal", [True, False], ids=["indexed-from-journal", "indexed-from-headers"])
def test_restart_with_the_key_restores(llama, rings, tmp_path, journal):
    right, _ = rings
    _store_one(tmp_path, llama, right)
    store = SsdStore.open(tmp_path, FINGERPRINT, keyring=right, journal=journal)
    match = store.find(PROMPT + [5])
    assert match is not None and match.usable_tokens == len(PROMPT)
    restored = store.restore(match)
    assert restored is not None
    live = _prefill(llama, PROMPT)
    for a, b in zip(live, restored, strict=True):
        assert mx.array_equal(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :]).item()
    store.close()


@pytest.mark.parametrize("journal", [True, False], ids=["indexed-from-journal", "indexed-from-headers"])
@pytest.mark.parametrize("which", ["wrong-key", "no-key"])
def test_a_missing_or_wrong_key_quarantines_warns_once_and_serves_cold(llama, rings, tmp_path, caplog, journal, which):
    right, wrong = rings
    _store_one(tmp_path, llama, right)
    _store_one(tmp_path, llama, right)  # a second entry of the same key: still one warning
    keyring = wrong if which == "wrong-key" else None
    with caplog.at_level(logging.INFO, logger="kvcellar.ssd"):
        store = SsdStore.open(tmp_path, FINGERPRINT, keyring=keyring, journal=journal)
        match = store.find(PROMPT + [5])
        assert match is None or store.restore(match) is None  # served cold
        match = store.find(PROMPT + [5])
        assert match is None or store.restore(match) is None
    assert store.find(PROMPT + [5]) is None
    store.close()
    kept = list((tmp_path / FINGERPRINT / SEALED_QUARANTINE_DIR_NAME).iterdir())
    assert kept, "the sealed entries are kept, never deleted"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and right.sealing.key_id in r.getMessage()]
    assert len(warnings) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r not in warnings]


def test_journal_verify_opens_a_sealed_tier_with_its_key(llama, rings, tmp_path, capsys):
    from kvcellar.cli import main

    right, _ = rings
    _store_one(tmp_path / "tier", llama, right)
    key = ["--encryption-key-file", str(tmp_path / "keys" / "right.key")]
    assert main(["journal", "verify", str(tmp_path / "tier"), *key]) == 0
    assert "1 entries agree" in capsys.readouterr().out
    assert main(["journal", "verify", "--json", str(tmp_path / "tier")]) == 1
    assert right.sealing.key_id in capsys.readouterr().out


def _journal_runs(directory, tokens) -> int:
    """16-token runs of `tokens` as uint32/int32 LE in the journal's files (the database, its WAL)."""
    runs = [np.asarray(tokens[i : i + RUN_TOKENS], dtype="<u4").tobytes() for i in range(len(tokens) - RUN_TOKENS + 1)]
    files = [path for path in directory.rglob("journal.sqlite*") if path.is_file()]
    assert files
    return sum(run in path.read_bytes() for path in files for run in runs)


def test_a_sealed_tier_journals_no_prompt_run(llama, rings, tmp_path):
    right, _ = rings
    _store_one(tmp_path / "plain", llama, None)
    _store_one(tmp_path / "sealed", llama, right)
    assert _journal_runs(tmp_path / "plain", PROMPT) > 0
    assert _journal_runs(tmp_path / "sealed", PROMPT) == 0


def test_plain_journal_rows_are_sealed_at_the_next_start_with_a_key(llama, rings, tmp_path):
    from kvcellar.store.sealed_tokens import open_token_ids, sealed_key_id

    right, _ = rings
    _store_one(tmp_path, llama, None)
    store = SsdStore.open(tmp_path, FINGERPRINT, keyring=right)
    assert store.find(PROMPT + [5]) is not None
    rows = store.journal.entries()
    store.close()
    assert [sealed_key_id(row["token_ids"], row["token_count"]) for row in rows] == [right.sealing.key_id]
    row = rows[0]
    assert (
        open_token_ids(right, row["entry_id"], row["token_ids"], row["token_count"])
        == np.asarray(PROMPT, dtype="<u4").tobytes()
    )
    reopened = SsdStore.open(tmp_path, FINGERPRINT, keyring=right)
    assert reopened.find(PROMPT + [5]) is not None
    assert reopened.journal.entries() == rows, "a sealed row that agrees is not journaled again"
    reopened.close()


def test_a_sealed_row_opens_only_for_its_entry_and_key(rings):
    from kvcellar.errors import CorruptEntry, KeyUnavailable
    from kvcellar.store.sealed_tokens import open_token_ids, seal_token_ids

    right, wrong = rings
    plain = np.asarray(PROMPT, dtype="<u4").tobytes()
    sealed = seal_token_ids(right.sealing, "a" * 32, plain)
    assert open_token_ids(right, "a" * 32, sealed, len(PROMPT)) == plain
    assert open_token_ids(None, "a" * 32, plain, len(PROMPT)) == plain
    with pytest.raises(CorruptEntry):
        open_token_ids(right, "b" * 32, sealed, len(PROMPT))
    with pytest.raises(CorruptEntry):
        open_token_ids(right, "a" * 32, sealed[:-1], len(PROMPT))
    for ring in (wrong, None):
        with pytest.raises(KeyUnavailable) as raised:
            open_token_ids(ring, "a" * 32, sealed, len(PROMPT))
        assert raised.value.key_id == right.sealing.key_id
