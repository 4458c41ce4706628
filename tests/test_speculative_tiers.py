"""Companion state in the SSD tier, across restarts and in generation
checkpoints (issue 42), with real files, a real journal and a tiny model:
the `.kvc` companion section (format versions 5-8) and its compatibility
both ways, token identity with the draft restored from the SSD tier after a
restart, and a checkpoint carrying the draft's KV resuming to the
uninterrupted output."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import trio
from mlx_lm.models.cache import make_prompt_cache
from test_checkpoints import _generate

from kvcellar.actors.system import SystemConfig, open_system
from kvcellar.engine.engine import SamplingParams, prefill
from kvcellar.engine.generation import GenerationRequest
from kvcellar.errors import UnsupportedFormat
from kvcellar.store import kvfile
from kvcellar.store.companion import CompanionState, split_companion
from kvcellar.store.records import record_bytes
from kvcellar.store.ssd import SsdStore

FIXTURE_V1 = Path(__file__).parent / "fixtures" / "kvc-v1-llama-tiny.kvc"
FIXTURE_TOKENS = list(range(5, 25))
PROMPT = tuple(range(5, 45))
GREEDY = SamplingParams(max_tokens=40)
FINGERPRINT = "f" * 32
META = {"namespace": "", "tokenizer_hash": "t", "fingerprint": {"model": "m"}}


def _prefilled(model: Any, tokens: list[int]) -> list[Any]:
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache)
    mx.eval([c.state for c in cache])
    return cache


def test_an_entry_with_companion_state_is_one_file_of_the_next_version(loaded_model_factory, tmp_path, rings):
    model, _ = loaded_model_factory("llama")
    draft, _ = loaded_model_factory("deepseek_v3")
    tokens = list(range(5, 30))
    caches = [*_prefilled(model, tokens), CompanionState(*_prefilled(draft, tokens), drafter="d" * 32)]
    path = tmp_path / "e.kvc"
    header = kvfile.save(path, caches, tokens, META)
    assert header.format_version == kvfile.COMPANION_FORMAT_VERSION and header.companion == "d" * 32
    loaded = kvfile.load(path)
    split = split_companion(loaded.caches, "d" * 32)
    assert split.draft is not None and len(split.target) == len(model.layers)
    for restored, original in zip(split.draft, caches[-1].caches, strict=True):
        rows = original.offset
        assert np.array_equal(np.array(restored.keys[..., :rows, :]), np.array(original.keys[..., :rows, :]))
    # Sealed, the companion's tensors are sealed segments like the target's.
    sealed, right = tmp_path / "sealed.kvc", rings[0]
    kvfile.save(sealed, caches, tokens, META, keyring=right)
    assert kvfile.read_header(sealed, keyring=right).format_version == kvfile.SEALED_COMPANION_FORMAT_VERSION
    assert split_companion(kvfile.load(sealed, keyring=right).caches, "d" * 32).draft is not None


def test_a_reader_without_companion_state_refuses_the_new_file(loaded_model_factory, tmp_path, monkeypatch):
    model, _ = loaded_model_factory("llama")
    tokens = list(range(5, 30))
    cache = _prefilled(model, tokens)
    path = tmp_path / "e.kvc"
    kvfile.save(path, [*cache, CompanionState(*_prefilled(model, tokens), drafter="d" * 32)], tokens, META)
    # The previous build read exactly these versions.
    monkeypatch.setattr(kvfile, "READABLE_FORMAT_VERSIONS", kvfile.PRE_COMPANION_FORMAT_VERSIONS)
    with pytest.raises(UnsupportedFormat, match="format version 5"):
        kvfile.read_header(path)


def test_a_file_the_previous_version_wrote_still_loads(loaded_model_factory):
    model, _ = loaded_model_factory("llama")
    entry = kvfile.load(FIXTURE_V1)
    assert entry.header.format_version == kvfile.FORMAT_VERSION and entry.header.companion is None
    assert list(entry.header.tokens) == FIXTURE_TOKENS
    fresh = _prefilled(model, FIXTURE_TOKENS)
    for restored, original in zip(entry.caches, fresh, strict=True):
        keys, rows = restored.keys[..., : restored.offset, :], original.keys[..., : original.offset, :]
        assert np.allclose(np.array(keys), np.array(rows), atol=1e-5)
    assert split_companion(entry.caches, "d" * 32).reason == "companion_missing"


def _config(model_dir: Path, ssd_dir: Path, draft_dir: Path | None, **overrides: Any) -> SystemConfig:
    return SystemConfig(
        model_dir=model_dir,
        ssd_dir=ssd_dir,
        draft_model_dir=draft_dir,
        demote_idle_s=0,
        debounce_s=0.05,
        **overrides,
    )


def test_greedy_output_with_the_draft_restored_from_the_ssd_tier_after_a_restart(model_dir_factory, tmp_path):
    model_dir, draft_dir = model_dir_factory("llama"), model_dir_factory("deepseek_v3")
    first_request = GenerationRequest(prompt_ids=PROMPT, params=GREEDY)

    async def main():
        async with open_system(_config(model_dir, tmp_path / "plain", None)) as system:
            first_plain, _ = await _generate(system, first_request)
            follow_up = GenerationRequest(prompt_ids=PROMPT + tuple(first_plain) + (7, 8), params=GREEDY)
            reference, _ = await _generate(system, follow_up)
        async with open_system(_config(model_dir, tmp_path / "ssd", draft_dir, batch_rows_max=4)) as system:
            first, _ = await _generate(system, first_request)
            assert (await system.flush()).durable
            stats = system.stats()
            assert stats["speculative"]["serial_fallbacks"] == 1, "the batch lane sends speculation to the serial lane"
        files = list((tmp_path / "ssd").glob("*/**/*.kvc"))
        assert any(kvfile.read_header(f).companion is not None for f in files)
        async with open_system(_config(model_dir, tmp_path / "ssd", draft_dir)) as system:
            resumed, done = await _generate(system, follow_up)
            stats = system.stats()["speculative"]
        assert first == first_plain and resumed == reference
        assert done.cache_tier == "ssd" and done.cached_tokens > len(PROMPT)
        assert stats["companion_restored"] == 1 and stats["draft_reprefills"] == {}

    trio.run(main)


def test_a_checkpoint_with_companion_state_resumes_with_the_uninterrupted_output(model_dir_factory, tmp_path):
    model_dir = model_dir_factory("llama")
    request = GenerationRequest(prompt_ids=PROMPT, params=SamplingParams(max_tokens=48))

    async def main():
        async with open_system(_config(model_dir, tmp_path / "plain", None)) as system:
            reference, _ = await _generate(system, request)
        config = _config(model_dir, tmp_path / "ssd", model_dir, generation_checkpoint_tokens=8)
        async with open_system(config) as system:
            cut, _ = await _generate(system, request, stop_after=27)
            await system.flush()
            checkpoints = system.stats()["checkpoints"]
            assert checkpoints["files"] == 1 and checkpoints["companion_bytes"] > 0
        headers = [kvfile.read_header(f) for f in (tmp_path / "ssd").glob("*/checkpoints/*.kvc")]
        assert [h.format_version for h in headers] == [kvfile.COMPANION_CHECKPOINT_FORMAT_VERSION]
        async with open_system(config) as system:
            resumed, done = await _generate(system, request)
            stats = system.stats()["speculative"]
        assert cut == reference[:27] and resumed == reference
        assert done.cache_tier == "checkpoint" and done.resumed_tokens >= 24
        assert stats["companion_restored"] == 1

    trio.run(main)


def test_the_ssd_tier_counts_companion_bytes_from_the_file_the_journal_and_a_schema_1_journal(
    loaded_model_factory, tmp_path
):
    model, _ = loaded_model_factory("llama")
    tokens = list(range(5, 30))
    caches = [*_prefilled(model, tokens), CompanionState(*_prefilled(model, tokens), drafter="d" * 32)]
    store = SsdStore.open(tmp_path, FINGERPRINT)
    entry_id = store.store(tokens, caches)
    store.store(tokens[:20], _prefilled(model, tokens[:20]), "other")
    companion = record_bytes(kvfile.read_header(store.entry(entry_id).path).caches[-1])
    assert 0 < companion < store.stats()["bytes"] and store.stats()["companion_bytes"] == companion
    journal_path = store.journal.path
    store.close()
    reopened = SsdStore.open(tmp_path, FINGERPRINT)  # indexed from the journal's rows
    assert reopened.stats()["companion_bytes"] == companion
    reopened.close()
    # A journal of schema 1 had no companion bytes: migrated, its rows are NULL and read from the headers once.
    with sqlite3.connect(journal_path) as connection:
        connection.execute("ALTER TABLE entries DROP COLUMN companion_bytes")
        connection.execute("PRAGMA user_version = 1")
    migrated = SsdStore.open(tmp_path, FINGERPRINT)
    assert migrated.stats()["companion_bytes"] == companion
    assert sorted(row["companion_bytes"] for row in migrated.journal.entries()) == [0, companion]
    assert [record.kind for record in migrated.journal.events()][-2:] == ["reconcile.updated"] * 2
    migrated.close()
