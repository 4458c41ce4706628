"""Generation checkpoints with an encryption key ring: sealed on disk (format
version 4, no plaintext run of the request's tokens), resumed with the key,
and moved to the sealed quarantine (never a crash) without it."""

from __future__ import annotations

import attrs
import numpy as np
import trio

from kvcellar.actors.system import open_system
from kvcellar.engine.generation import GenerationRequest
from kvcellar.store import kvfile
from kvcellar.store.checkpoints import CheckpointStore
from kvcellar.store.ssd import SEALED_QUARANTINE_DIR_NAME, SsdStore
from tests.test_checkpoints import GREEDY, PROMPT, STOP_AFTER_TOKENS, _caches, _checkpoint, _config, _generate

RUN_TOKENS = 16


def _runs(tokens) -> list[bytes]:
    return [np.asarray(tokens[i : i + RUN_TOKENS], dtype="<u4").tobytes() for i in range(len(tokens) - RUN_TOKENS + 1)]


def test_a_sealed_checkpoint_holds_no_run_and_opens_only_with_its_key(loaded_model_factory, rings, tmp_path):
    right, wrong = rings
    tokens = list(range(3, 40))
    caches = _caches(loaded_model_factory, tokens)
    ssd = SsdStore.open(tmp_path, "fp", keyring=right)
    store = CheckpointStore.open(ssd)
    writer = store.plan(_checkpoint(emitted=len(tokens) - 4), tokens, caches)
    kvfile.write_entry(writer)
    assert store.commit(writer)
    path = ssd.directory / "checkpoints" / f"{'k' * 32}.kvc"
    assert kvfile.read_header(path, keyring=right).format_version == kvfile.SEALED_CHECKPOINT_FORMAT_VERSION
    assert not any(run in path.read_bytes() for run in _runs(tokens))
    assert store.restore("k" * 32, tokens[:4]) is not None
    ssd.close()
    # A build that knows sealed entries but not sealed checkpoints refuses it as unsupported.
    assert kvfile.SEALED_CHECKPOINT_FORMAT_VERSION not in {1, 2, 3}

    ssd = SsdStore.open(tmp_path, "fp", keyring=wrong)
    store = CheckpointStore.open(ssd)
    assert store.lookup("k" * 32) is None
    ssd.close()
    assert [p.name for p in (ssd.directory / SEALED_QUARANTINE_DIR_NAME).iterdir()], "kept, never deleted"


def test_a_request_cut_off_resumes_from_a_sealed_checkpoint(model_dir_factory, rings, tmp_path):
    right, _ = rings
    model_dir = model_dir_factory("llama")
    request = GenerationRequest(prompt_ids=PROMPT, params=GREEDY)

    def config(directory):
        return attrs.evolve(_config(model_dir, directory, 1), ssd_keyring=right)

    async def main():
        async with open_system(_config(model_dir, tmp_path / "reference", 1)) as system:
            reference, _ = await _generate(system, request)
        async with open_system(config(tmp_path / "ssd")) as system:
            cut, _ = await _generate(system, request, stop_after=STOP_AFTER_TOKENS)
            await system.flush()
            assert system.stats()["checkpoints"]["files"] == 1
        files = list((tmp_path / "ssd").glob("*/checkpoints/*.kvc"))
        assert files and not any(run in files[0].read_bytes() for run in _runs(list(PROMPT) + reference))
        async with open_system(config(tmp_path / "ssd")) as system:
            resumed, done = await _generate(system, request)
            await system.flush()
        assert resumed == reference and cut == reference[:STOP_AFTER_TOKENS]
        assert done.cache_tier == "checkpoint" and done.resumed_tokens > 0

    trio.run(main)
