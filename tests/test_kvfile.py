"""The .kvc format: bit-exact restore of every cache kind on real tiny models,
corruption detection, no persisted slack, and the crash-safety sequence."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kvcellar.engine.demo_models import ARCHITECTURES
from kvcellar.errors import CorruptEntry, DiskError, UnsupportedFormat, UsageError
from kvcellar.store import kvfile
from kvcellar.store.disk import RealDisk, TracingDisk
from kvcellar.store.safeguards import Safeguards

# Longer than every sliding window / attention chunk (32) of the tiny configs, so rings wrap.
PROMPT_TOKENS = [(7 * i + 3) % 1000 + 3 for i in range(80)]
DECODE_BEFORE_SAVE = 3
CONTINUATION_STEPS = 16


def _forward(model, tokens, cache) -> mx.array:
    logits = model(mx.array([tokens]), cache=cache)[:, -1, :]
    mx.eval(logits)
    return logits


def _prefill_and_decode(model, *, quantize_bits: int | None = None):
    cache = make_prompt_cache(model)
    logits = _forward(model, PROMPT_TOKENS, cache)
    if quantize_bits is not None:
        cache = [c.to_quantized(group_size=32, bits=quantize_bits) for c in cache]
    tokens = list(PROMPT_TOKENS)
    for _ in range(DECODE_BEFORE_SAVE):
        token = int(mx.argmax(logits, axis=-1).item())
        tokens.append(token)
        logits = _forward(model, [token], cache)
    return cache, tokens, logits


def _assert_continuations_bit_identical(model, live_cache, restored_cache, logits) -> None:
    for step in range(CONTINUATION_STEPS):
        token = int(mx.argmax(logits, axis=-1).item())
        logits = _forward(model, [token], live_cache)
        restored_logits = _forward(model, [token], restored_cache)
        assert mx.array_equal(logits, restored_logits).item(), f"logits differ at continuation step {step}"


CASES = [(arch, "float32") for arch in ARCHITECTURES] + [("llama", "bfloat16"), ("gemma3_text", "bfloat16")]


@pytest.mark.parametrize(("arch", "dtype"), CASES, ids=[f"{a}-{d}" for a, d in CASES])
def test_restored_entry_continues_with_bit_identical_logits(arch, dtype, loaded_model_factory, tmp_path):
    model, _ = loaded_model_factory(arch, dtype=dtype)
    cache, tokens, logits = _prefill_and_decode(model)
    header = kvfile.save(tmp_path / "entry.kvc", cache, tokens, {"namespace": "ns-a"})
    entry = kvfile.load(tmp_path / "entry.kvc")
    assert entry.tokens == tuple(tokens)
    assert entry.header == header
    assert [type(c) for c in entry.caches] == [type(c) for c in cache]
    _assert_continuations_bit_identical(model, cache, entry.caches, logits)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_kv_restores_with_bit_identical_logits(bits, loaded_model_factory, tmp_path):
    model, _ = loaded_model_factory("llama", size="small")
    cache, tokens, logits = _prefill_and_decode(model, quantize_bits=bits)
    header = kvfile.save(tmp_path / "q.kvc", cache, tokens)
    assert {record.signature for record in header.caches} == {f"kv:quant:{bits}:32"}
    entry = kvfile.load(tmp_path / "q.kvc")
    _assert_continuations_bit_identical(model, cache, entry.caches, logits)


@pytest.fixture(scope="module")
def llama_entry(loaded_model_factory, tmp_path_factory):
    model, _ = loaded_model_factory("llama")
    cache, tokens, _ = _prefill_and_decode(model)
    path = tmp_path_factory.mktemp("entry") / "llama.kvc"
    meta = {"namespace": "adapter-x", "fingerprint": {"model": "abc"}, "tokenizer_hash": "t1", "created_at_ns": 42}
    header = kvfile.save(path, cache, tokens, meta)
    return path, header, cache, model


def _damaged_copy(source: Path, target: Path, offset: int) -> Path:
    data = bytearray(source.read_bytes())
    data[offset] ^= 0x40
    target.write_bytes(bytes(data))
    return target


def test_header_carries_tokens_namespace_fingerprint_and_cache_fields(llama_entry):
    path, header, _, _ = llama_entry
    read = kvfile.read_header(path)
    assert read == header
    assert read.format_version == 1
    assert read.namespace == "adapter-x"
    assert read.fingerprint == {"model": "abc"}
    assert read.tokenizer_hash == "t1"
    assert read.created_at_ns == 42
    assert len(read.tokens) == len(PROMPT_TOKENS) + DECODE_BEFORE_SAVE
    assert read.trimmable is True and read.minimum_reusable_offset == 0
    assert all(t.file_offset % kvfile.ALIGNMENT_BYTES == 0 for t in read.tensor_records())
    assert all(len(t.checksum) == 8 and t.checksum != bytes(8) for t in read.tensor_records())


def test_flipped_header_byte_is_detected_as_corrupt_header(llama_entry, tmp_path):
    path, _, _, _ = llama_entry
    damaged = _damaged_copy(path, tmp_path / "h.kvc", kvfile.PREAMBLE_BYTES + 20)
    with pytest.raises(CorruptEntry) as caught:
        kvfile.read_header(damaged)
    assert caught.value.part == "header"
    with pytest.raises(CorruptEntry):
        kvfile.load(damaged)


def test_flipped_byte_in_each_tensor_region_names_that_tensor(llama_entry, tmp_path):
    path, header, _, _ = llama_entry
    for record in header.tensor_records():
        damaged = _damaged_copy(path, tmp_path / "t.kvc", record.file_offset + record.length // 2)
        with pytest.raises(CorruptEntry) as caught:
            kvfile.load(damaged, verify=True)
        assert caught.value.part == f"tensor {record.name}"
        with pytest.raises(CorruptEntry):
            kvfile.verify_file(damaged)


def test_truncated_file_is_detected_by_the_header_read(llama_entry, tmp_path):
    path, header, _, _ = llama_entry
    data = path.read_bytes()
    short = tmp_path / "short.kvc"
    short.write_bytes(data[: header.file_bytes - 1])
    with pytest.raises(CorruptEntry) as caught:
        kvfile.read_header(short)
    assert caught.value.part == "size"
    short.write_bytes(data[:20])
    with pytest.raises(CorruptEntry) as caught:
        kvfile.read_header(short)
    assert caught.value.part == "preamble"
    short.write_bytes(data[: kvfile.PREAMBLE_BYTES + 10])
    with pytest.raises(CorruptEntry) as caught:
        kvfile.read_header(short)
    assert caught.value.part == "header"


def test_future_format_version_and_foreign_files_are_refused(llama_entry, tmp_path):
    path, _, _, _ = llama_entry
    data = bytearray(path.read_bytes())
    # Version 2 is a generation checkpoint (test_checkpoints.py), 3 a sealed entry and 4 a sealed checkpoint
    # (test_kvfile_sealed.py), 5-8 the same with companion state (test_speculative_tiers.py); 9 is from the future.
    struct.pack_into("<I", data, 8, 9)
    future = tmp_path / "future.kvc"
    future.write_bytes(bytes(data))
    with pytest.raises(UnsupportedFormat, match="version 9"):
        kvfile.read_header(future)
    foreign = tmp_path / "foreign.kvc"
    foreign.write_text(json.dumps({"not": "a kv file"}))
    with pytest.raises(UnsupportedFormat, match=r"not a \.kvc file"):
        kvfile.load(foreign)
    empty = tmp_path / "empty.kvc"
    empty.write_bytes(b"")
    with pytest.raises(UnsupportedFormat):
        kvfile.read_header(empty)


def test_file_holds_header_plus_aligned_rows_up_to_offset_and_no_slack(llama_entry):
    path, header, cache, _ = llama_entry
    token_count = len(header.tokens)
    assert os.path.getsize(path) == header.file_bytes
    expected_end = header.payload_offset
    records = list(header.tensor_records())
    for index, (record, layer) in enumerate(zip(records, [a for c in cache for a in (c.keys, c.values)], strict=True)):
        batch, heads, capacity, head_dim = layer.shape
        assert capacity > token_count, "the live cache has slack, so this test can tell"
        assert record.shape == (batch, heads, token_count, head_dim)
        assert record.length == batch * heads * token_count * head_dim * layer.dtype.size
        assert record.file_offset == expected_end
        expected_end += record.length
        if index < len(records) - 1:
            expected_end = -(-expected_end // kvfile.ALIGNMENT_BYTES) * kvfile.ALIGNMENT_BYTES
    assert header.file_bytes == expected_end
    header_length = struct.unpack_from("<I", path.read_bytes(), 12)[0]
    aligned_header_end = -(-(kvfile.PREAMBLE_BYTES + header_length) // kvfile.ALIGNMENT_BYTES) * kvfile.ALIGNMENT_BYTES
    assert header.payload_offset == aligned_header_end


def test_one_decode_step_after_restore_updates_plain_kv_in_place(llama_entry):
    path, _, _, model = llama_entry
    entry = kvfile.load(path)
    buffers_before = [(id(c.keys), c.keys.shape) for c in entry.caches]
    offsets_before = [c.offset for c in entry.caches]
    _forward(model, [5], entry.caches)
    assert [(id(c.keys), c.keys.shape) for c in entry.caches] == buffers_before
    assert [c.offset for c in entry.caches] == [o + 1 for o in offsets_before]


def test_atomic_write_fsyncs_file_before_rename_and_directory_after(llama_entry, tmp_path):
    _, _, cache, _ = llama_entry
    disk = TracingDisk(RealDisk())
    target = tmp_path / "traced.kvc"
    kvfile.save(target, cache, list(range(cache[0].offset)), disk=disk)
    operations = [call.operation for call in disk.calls]
    create = operations.index("create_exclusive")
    temp_path = Path(disk.calls[create].path)
    assert temp_path.parent == target.parent and temp_path.name.endswith(".tmp")
    fsync = operations.index("fsync")
    rename = operations.index("rename")
    fsync_dir = operations.index("fsync_dir")
    last_write = max(i for i, op in enumerate(operations) if op == "write_at")
    assert create < last_write < fsync < rename < fsync_dir
    assert disk.calls[fsync].path == str(temp_path)
    assert disk.calls[rename].path == f"{temp_path} -> {target}"
    assert disk.calls[fsync_dir].path == str(target.parent)
    assert not temp_path.exists() and target.exists()


def test_safeguards_switched_off_skip_the_fsyncs_and_the_checksums(llama_entry, tmp_path):
    _, _, cache, _ = llama_entry
    tokens = list(range(cache[0].offset))
    disk = TracingDisk(RealDisk())
    unsafe = Safeguards(fsync_entry_file=False, fsync_entry_dir=False, verify_checksums=False)
    target = tmp_path / "unsafe.kvc"
    kvfile.write_entry(kvfile.KvFileWriter(target, cache, tokens, disk=disk, safeguards=unsafe))
    operations = [call.operation for call in disk.calls]
    assert "rename" in operations and "fsync" not in operations and "fsync_dir" not in operations
    record = next(kvfile.read_header(target).tensor_records())
    data = bytearray(target.read_bytes())
    data[record.file_offset + 3] ^= 0x10
    # The preamble's header checksum (bytes 16..24) no longer matches; the header still decodes.
    struct.pack_into("<Q", data, 16, struct.unpack_from("<Q", data, 16)[0] ^ 1)
    target.write_bytes(bytes(data))
    with pytest.raises(CorruptEntry):
        kvfile.read_header(target)
    with pytest.raises(CorruptEntry):
        kvfile.load(target, safeguards=Safeguards(fsync_entry_file=False))
    assert kvfile.load(target, safeguards=unsafe).tokens == tuple(tokens)


class _FailingWriteDisk(RealDisk):
    def write_at(self, handle, offset, data):
        raise DiskError("write: No space left on device", errno=28)


def test_failed_write_leaves_neither_temp_file_nor_target(llama_entry, tmp_path):
    _, _, cache, _ = llama_entry
    target = tmp_path / "fail.kvc"
    with pytest.raises(DiskError) as caught:
        kvfile.save(target, cache, list(range(cache[0].offset)), disk=_FailingWriteDisk())
    assert caught.value.errno == 28
    assert list(tmp_path.iterdir()) == []


def test_tokens_that_disagree_with_the_cache_offset_are_refused(llama_entry, tmp_path):
    _, _, cache, _ = llama_entry
    with pytest.raises(UsageError, match="offset"):
        kvfile.save(tmp_path / "bad.kvc", cache, [1, 2, 3])
    assert list(tmp_path.iterdir()) == []


def test_load_without_verification_skips_tensor_checksums(llama_entry, tmp_path):
    path, header, _, _ = llama_entry
    record = next(header.tensor_records())
    damaged = _damaged_copy(path, tmp_path / "nv.kvc", record.file_offset)
    entry = kvfile.load(damaged, verify=False)
    assert entry.tokens == header.tokens
