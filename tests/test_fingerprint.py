"""The serving fingerprint and the shard digest memo, on real tiny models."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import time
from pathlib import Path

import mlx.core as mx
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from kvcellar.actors.system import SystemConfig, open_system
from kvcellar.engine.demo_models import create_model
from kvcellar.engine.engine import SamplingParams
from kvcellar.engine.generation import GenerationRequest
from kvcellar.errors import ModelError
from kvcellar.serialization import to_cbor
from kvcellar.store import kvfile
from kvcellar.store.fingerprint import (
    MEMO_FILE_NAME,
    RACY_WINDOW_NS,
    ServingFingerprint,
    ShardDigestMemo,
    canonical_config_bytes,
    compute_fingerprint,
    describe_device_architecture,
    tokenizer_files,
)

WEIGHTS = "model.safetensors"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return create_model("llama", tmp_path / "m")


def _settle() -> None:
    """Let recent writes age past the racy window, so their digests may be memoised."""
    time.sleep(RACY_WINDOW_NS / 1e9 + 0.02)


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _hashed_bytes(model_dir: Path) -> int:
    """What a cold memo reads: every shard and every tokenizer file."""
    return sum(path.stat().st_size for path in model_dir.glob("*.safetensors")) + sum(
        path.stat().st_size for _, path in tokenizer_files(model_dir)
    )


def test_digest_is_stable_and_fields_are_plain_strings(model_dir):
    first = compute_fingerprint(model_dir)
    second = compute_fingerprint(model_dir)
    assert first == second and first.digest == second.digest
    assert len(first.digest) == 32 and int(first.digest, 16) >= 0
    fields = first.as_dict()
    assert set(fields) == {a.name for a in ServingFingerprint.__attrs_attrs__}
    assert all(isinstance(value, str) for value in fields.values())
    assert fields["kv_scheme_key"] == "bf16" and fields["device"] in {"cpu", "gpu"}


def test_fingerprint_names_the_mlx_lm_version_and_the_device_architecture(model_dir):
    fingerprint = compute_fingerprint(model_dir)
    assert fingerprint.mlx_lm_version == importlib.metadata.version("mlx-lm")
    assert fingerprint.mlx_version == mx.__version__
    assert fingerprint.device_architecture == describe_device_architecture() != ""
    other_chip = compute_fingerprint(model_dir, device_architecture="Another Chip (arm64)")
    assert other_chip.digest != fingerprint.digest
    assert {name for name, value in other_chip.as_dict().items() if fingerprint.as_dict()[name] != value} == {
        "device_architecture"
    }


def test_device_architecture_names_the_cpu_model_or_the_gpu(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: Acme\nmodel name\t: Acme Turbo 9000 @ 3.1GHz\n\nprocessor\t: 1\n")
    described = describe_device_architecture(mx.Device(mx.DeviceType.cpu), cpuinfo_path=cpuinfo)
    assert described.startswith("Acme Turbo 9000 @ 3.1GHz (") and described.endswith(")")
    fallback = describe_device_architecture(mx.Device(mx.DeviceType.cpu), cpuinfo_path=tmp_path / "absent")
    assert fallback and "(" in fallback

    queried = []

    def metal_info(device):
        queried.append(device)
        return {"device_name": "Apple M3 Max", "architecture": "applegpu_g15s", "memory_size": 1 << 36}

    gpu = mx.Device(mx.DeviceType.gpu)
    assert describe_device_architecture(gpu, device_info=metal_info) == "Apple M3 Max (applegpu_g15s)"
    assert queried == [gpu]


def test_device_architecture_names_a_cuda_gpu_by_name_and_compute_capability_not_its_free_memory():
    # What MLX 0.32's CUDA backend returns (mlx/backend/cuda/device_info.cpp); free memory changes at every call.
    h200 = {
        "device_name": "NVIDIA H200",
        "architecture": "sm_90",
        "uuid": "GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0",
        "pci_bus_id": "0000:19:00.0",
        "compute_capability_major": 9,
        "compute_capability_minor": 0,
        "total_memory": 150_000_000_000,
        "free_memory": 149_000_000_000,
    }
    gpu = mx.Device(mx.DeviceType.gpu)
    assert describe_device_architecture(gpu, device_info=lambda _: h200) == "NVIDIA H200 (sm_90)"
    busier = h200 | {"free_memory": 1}
    assert describe_device_architecture(gpu, device_info=lambda _: busier) == "NVIDIA H200 (sm_90)"


def test_config_key_order_and_whitespace_do_not_change_the_digest(model_dir):
    before = compute_fingerprint(model_dir).digest
    config = json.loads((model_dir / "config.json").read_text())
    reordered = dict(reversed(list(config.items())))
    (model_dir / "config.json").write_text(json.dumps(reordered, indent=7) + "\n\n  ")
    assert compute_fingerprint(model_dir).digest == before


def _change_config(model_dir: Path) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config["rope_theta"] = float(config.get("rope_theta", 10000.0)) + 1.0
    path.write_text(json.dumps(config))


def _change_tokenizer_config_template(model_dir: Path) -> None:
    path = model_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(path.read_text())
    tokenizer_config["chat_template"] += "{{- '' }}"
    path.write_text(json.dumps(tokenizer_config))


def _add_jinja_template(model_dir: Path) -> None:
    (model_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")


def _change_tokenizer(model_dir: Path) -> None:
    path = model_dir / "tokenizer.json"
    path.write_text(path.read_text() + " ")


def _change_special_tokens(model_dir: Path) -> None:
    path = model_dir / "special_tokens_map.json"
    special_tokens = json.loads(path.read_text())
    special_tokens["bos_token"] = "<|im_start|>"
    path.write_text(json.dumps(special_tokens))


def _add_additional_template(model_dir: Path) -> None:
    (model_dir / "additional_chat_templates").mkdir()
    (model_dir / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")


TOKENIZER = "tokenizer_sha256"
TEMPLATE = "chat_template_sha256"
# Each change, and the fields it must change (every other field stays put).
CHANGES = {
    "config": (_change_config, {"config_sha256"}),
    "weight byte": (lambda d: _flip_last_byte(d / WEIGHTS), {"weights_sha256"}),
    "extra shard": (lambda d: (d / "extra.safetensors").write_bytes(b"x"), {"weights_sha256"}),
    "tokenizer.json": (_change_tokenizer, {TOKENIZER}),
    "special_tokens_map.json": (_change_special_tokens, {TOKENIZER}),
    "tokenizer.model": (lambda d: (d / "tokenizer.model").write_bytes(b"sentencepiece"), {TOKENIZER}),
    "merges.txt": (lambda d: (d / "merges.txt").write_text("#version: 0.2\na b\n"), {TOKENIZER}),
    # tokenizer_config.json's template wins over the legacy file, which still counts as a tokenizer file.
    "chat_template.json": (lambda d: (d / "chat_template.json").write_text('{"chat_template": "x"}'), {TOKENIZER}),
    "additional chat template": (_add_additional_template, {TOKENIZER}),
    "chat template": (_change_tokenizer_config_template, {TOKENIZER, TEMPLATE}),
    "chat_template.jinja": (_add_jinja_template, {TOKENIZER, TEMPLATE}),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_each_input_changes_only_its_fields_and_the_digest(model_dir, change):
    mutate, fields = CHANGES[change]
    before = compute_fingerprint(model_dir)
    mutate(model_dir)
    after = compute_fingerprint(model_dir)
    assert after.digest != before.digest
    changed = {name for name, value in after.as_dict().items() if before.as_dict()[name] != value}
    assert changed == fields


def test_kv_scheme_key_changes_the_digest(model_dir):
    digests = {compute_fingerprint(model_dir, kv_scheme_key=key).digest for key in ("bf16", "kv4", "kv8")}
    assert len(digests) == 3


def test_memo_hit_from_a_fresh_memo_reads_no_shard_bytes(model_dir, tmp_path):
    _settle()
    memo_dir = tmp_path / "cache" / "artifact-identities"
    first_memo = ShardDigestMemo(memo_dir)
    first = compute_fingerprint(model_dir, memo=first_memo)
    assert first_memo.bytes_hashed == _hashed_bytes(model_dir)
    assert (memo_dir / MEMO_FILE_NAME).is_file()
    assert [p.name for p in memo_dir.iterdir()] == [MEMO_FILE_NAME]

    second_memo = ShardDigestMemo(memo_dir)
    assert compute_fingerprint(model_dir, memo=second_memo) == first
    assert second_memo.bytes_hashed == 0


def test_recently_changed_shard_is_hashed_but_not_memoised(model_dir, tmp_path):
    memo = ShardDigestMemo(tmp_path / "memo")
    (model_dir / WEIGHTS).touch()
    expected = _sha256_file(model_dir / WEIGHTS)
    assert memo.digest(model_dir / WEIGHTS) == expected
    fresh = ShardDigestMemo(tmp_path / "memo")
    assert fresh.digest(model_dir / WEIGHTS) == expected
    assert fresh.bytes_hashed > 0


def test_same_size_rewrite_with_restored_mtime_invalidates(model_dir, tmp_path):
    _settle()
    weights = model_dir / WEIGHTS
    memo_dir = tmp_path / "memo"
    before = compute_fingerprint(model_dir, memo=ShardDigestMemo(memo_dir))
    old = weights.stat()
    _flip_last_byte(weights)
    os.utime(weights, ns=(old.st_atime_ns, old.st_mtime_ns))
    new = weights.stat()
    assert (new.st_size, new.st_mtime_ns, new.st_ino) == (old.st_size, old.st_mtime_ns, old.st_ino)
    assert new.st_ctime_ns != old.st_ctime_ns

    memo = ShardDigestMemo(memo_dir)
    after = compute_fingerprint(model_dir, memo=memo)
    assert memo.bytes_hashed == new.st_size
    assert after.weights_sha256 != before.weights_sha256
    assert after == compute_fingerprint(model_dir)


def test_changed_symlink_target_invalidates(model_dir, tmp_path):
    weights = model_dir / WEIGHTS
    target_a = tmp_path / "a.safetensors"
    target_b = tmp_path / "b.safetensors"
    weights.rename(target_a)
    target_b.write_bytes(target_a.read_bytes()[:-1] + b"\x00")
    weights.symlink_to(target_a)
    _settle()
    memo_dir = tmp_path / "memo"
    before = compute_fingerprint(model_dir, memo=ShardDigestMemo(memo_dir))

    weights.unlink()
    weights.symlink_to(target_b)
    memo = ShardDigestMemo(memo_dir)
    after = compute_fingerprint(model_dir, memo=memo)
    assert memo.bytes_hashed == target_b.stat().st_size
    assert after.weights_sha256 != before.weights_sha256
    assert memo.digest(weights) == _sha256_file(target_b)


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\xff\x00garbage",
        b'{"json": true}',
        to_cbor({"format": "someone-else", "version": 1, "entries": {}}),
        to_cbor({"format": "kvcellar-shard-digest-memo", "version": 1, "entries": {"/x": {"sha256": 5}}}),
    ],
    ids=["empty", "garbage", "json", "foreign", "malformed-entry"],
)
def test_corrupt_or_foreign_memo_is_ignored(model_dir, tmp_path, content):
    expected = compute_fingerprint(model_dir)
    memo_dir = tmp_path / "memo"
    memo_dir.mkdir()
    (memo_dir / MEMO_FILE_NAME).write_bytes(content)
    memo = ShardDigestMemo(memo_dir)
    assert compute_fingerprint(model_dir, memo=memo) == expected
    assert memo.bytes_hashed > 0


def test_memo_entry_with_a_bad_digest_is_dropped(model_dir, tmp_path):
    _settle()
    memo_dir = tmp_path / "memo"
    expected = compute_fingerprint(model_dir, memo=ShardDigestMemo(memo_dir))
    memo_path = memo_dir / MEMO_FILE_NAME
    real_sha = _sha256_file(model_dir / WEIGHTS).encode()
    memo_path.write_bytes(memo_path.read_bytes().replace(real_sha, b"z" * 64))
    memo = ShardDigestMemo(memo_dir)
    assert compute_fingerprint(model_dir, memo=memo) == expected
    assert memo.bytes_hashed > 0


def test_unwritable_memo_directory_still_gives_the_right_digest(model_dir, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    (model_dir / "second.safetensors").write_bytes(b"more weights")
    _settle()
    expected = compute_fingerprint(model_dir)
    memo = ShardDigestMemo(blocker / "artifact-identities")
    with caplog.at_level(logging.DEBUG, logger="kvcellar.store.fingerprint"):
        assert compute_fingerprint(model_dir, memo=memo) == expected
        assert compute_fingerprint(model_dir, memo=memo) == expected
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "memo" in warnings[0].getMessage()
    assert blocker.read_text() == "not a directory"


def test_model_errors_name_the_directory(tmp_path, model_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelError, match=r"config\.json") as error:
        compute_fingerprint(empty)
    assert str(empty) in str(error.value)

    (model_dir / WEIGHTS).unlink()
    with pytest.raises(ModelError, match="safetensors") as error:
        compute_fingerprint(model_dir)
    assert str(model_dir) in str(error.value)

    (empty / "config.json").write_text("{not json")
    (empty / WEIGHTS).write_bytes(b"w")
    with pytest.raises(ModelError, match="not valid JSON"):
        compute_fingerprint(empty)
    (empty / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelError, match="not a JSON object"):
        compute_fingerprint(empty)


def test_optional_tokenizer_files_may_be_absent(model_dir):
    for _, path in tokenizer_files(model_dir):
        path.unlink()
    fingerprint = compute_fingerprint(model_dir)
    assert fingerprint.tokenizer_sha256 == "" and fingerprint.chat_template_sha256 == ""


_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
_json_values = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20,
)


def _reordered(value, seed: int):
    if isinstance(value, dict):
        items = [(key, _reordered(item, seed)) for key, item in value.items()]
        items.sort(key=lambda pair: hashlib.sha256(f"{seed}:{pair[0]}".encode("utf-8", "surrogatepass")).digest())
        return dict(items)
    if isinstance(value, list):
        return [_reordered(item, seed) for item in value]
    return value


@given(st.dictionaries(st.text(max_size=6), _json_values, max_size=6), st.integers(0, 1000))
def test_canonical_config_bytes_ignores_key_order(config, seed):
    reordered = _reordered(config, seed)
    assert canonical_config_bytes(reordered) == canonical_config_bytes(config)
    assert canonical_config_bytes(config).isascii()


def _system_config(model_dir: Path, tmp_path: Path, memo: ShardDigestMemo) -> SystemConfig:
    return SystemConfig(
        model_dir=model_dir,
        ssd_dir=tmp_path / "ssd",
        shard_digest_memo=memo,
        debounce_s=0.05,
        busy_rearm_s=0.05,
        demote_idle_s=0,
        shutdown_timeout_s=60,
    )


async def _generate(system, prompt: tuple[int, ...]) -> None:
    request = GenerationRequest(prompt_ids=prompt, params=SamplingParams(temperature=0.0, max_tokens=4))
    async for _ in system.generate(request):
        pass


def test_a_second_system_start_hashes_no_byte_and_entries_carry_the_tokenizer_hash(model_dir, tmp_path):
    _settle()
    memo_dir = tmp_path / "cache" / "shard-digests"
    expected = compute_fingerprint(model_dir)
    assert expected.tokenizer_sha256
    prompt = tuple((7 * i + 5) % 1000 + 3 for i in range(48))
    first_memo, second_memo = ShardDigestMemo(memo_dir), None

    async def main():
        nonlocal second_memo
        async with open_system(_system_config(model_dir, tmp_path, first_memo)) as system:
            assert system.store.fingerprint == expected.digest
            await _generate(system, prompt)
            assert (await system.flush()).durable
        # A fresh memo object: only what the first start persisted can spare the reads.
        second_memo = ShardDigestMemo(memo_dir)
        async with open_system(_system_config(model_dir, tmp_path, second_memo)) as restarted:
            assert restarted.store.fingerprint == expected.digest
            assert len(restarted.store.entry_ids()) >= 1

    trio.run(main)
    assert first_memo.bytes_hashed == _hashed_bytes(model_dir)
    assert second_memo.bytes_hashed == 0
    entry_paths = sorted((tmp_path / "ssd" / expected.digest).glob("*/*.kvc"))
    assert entry_paths
    for path in entry_paths:
        header = kvfile.read_header(path)
        assert header.tokenizer_hash == expected.tokenizer_sha256
        assert header.fingerprint["device_architecture"] == expected.device_architecture
        assert header.fingerprint["mlx_lm_version"] == expected.mlx_lm_version


def test_serve_keeps_the_memo_under_the_kvcellar_cache_directory(tmp_path):
    import platformdirs

    from kvcellar.cli.serve import shard_digest_memo_dir

    assert shard_digest_memo_dir({"KVCELLAR_CACHE_DIR": str(tmp_path)}) == tmp_path / "shard-digests"
    assert shard_digest_memo_dir({}) == platformdirs.user_cache_path("kvcellar") / "shard-digests"
