"""The staged restore (`store/staged_load.py`, the CUDA path) on the CPU
backend: bit-identical continuations for every cache kind, checksum and read
failures named, and the device choice behind `kvfile.load`."""

from __future__ import annotations

import io

import mlx.core as mx
import numpy as np
import pytest

from kvcellar.engine.demo_models import ARCHITECTURES
from kvcellar.errors import CorruptEntry, DiskError
from kvcellar.store import kvfile, staged_load
from kvcellar.store.disk import RealDisk
from tests.test_kvfile import _assert_continuations_bit_identical, _damaged_copy, _prefill_and_decode

CASES = [(arch, "float32") for arch in ARCHITECTURES] + [("llama", "bfloat16")]


@pytest.mark.parametrize(("arch", "dtype"), CASES, ids=[f"{a}-{d}" for a, d in CASES])
def test_staged_restore_continues_with_bit_identical_logits(arch, dtype, loaded_model_factory, tmp_path):
    model, _ = loaded_model_factory(arch, dtype=dtype)
    cache, tokens, logits = _prefill_and_decode(model)
    header = kvfile.save(tmp_path / "entry.kvc", cache, tokens)
    staged = kvfile.load(tmp_path / "entry.kvc", staged=True)
    direct = kvfile.load(tmp_path / "entry.kvc", staged=False)
    assert staged.header == header
    assert [type(c) for c in staged.caches] == [type(c) for c in cache]
    for staged_cache, direct_cache in zip(staged.caches, direct.caches, strict=True):
        for a, b in zip(staged_cache.state, direct_cache.state, strict=True):
            if isinstance(a, mx.array):
                assert a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b).item()
    _assert_continuations_bit_identical(model, cache, staged.caches, logits)


def test_staged_restore_of_quantized_kv_reads_in_many_chunks(loaded_model_factory, tmp_path, monkeypatch):
    monkeypatch.setattr(staged_load, "CHUNK_BYTES", 4096)
    model, _ = loaded_model_factory("llama", size="small")
    cache, tokens, logits = _prefill_and_decode(model, quantize_bits=4)
    kvfile.save(tmp_path / "q.kvc", cache, tokens)
    entry = kvfile.load(tmp_path / "q.kvc", staged=True)
    _assert_continuations_bit_identical(model, cache, entry.caches, logits)


@pytest.fixture(scope="module")
def saved_llama(loaded_model_factory, tmp_path_factory):
    model, _ = loaded_model_factory("llama")
    cache, tokens, _ = _prefill_and_decode(model)
    path = tmp_path_factory.mktemp("staged") / "llama.kvc"
    return path, kvfile.save(path, cache, tokens)


def test_flipped_byte_in_each_tensor_is_named_by_the_staged_restore(saved_llama, tmp_path):
    path, header = saved_llama
    for record in header.tensor_records():
        damaged = _damaged_copy(path, tmp_path / "t.kvc", record.file_offset + record.length // 2)
        with pytest.raises(CorruptEntry) as caught:
            kvfile.load(damaged, staged=True)
        assert caught.value.part == f"tensor {record.name}"
        kvfile.load(damaged, staged=True, verify=False)  # unchecked, the damage goes through


class _FailingPayloadDisk(RealDisk):
    """Fails every read past the header, as a dying device would."""

    def __init__(self, payload_offset: int) -> None:
        super().__init__()
        self.payload_offset = payload_offset

    def read_into(self, handle, offset, buffer):
        if offset >= self.payload_offset:
            raise DiskError("read failed: EIO")
        return super().read_into(handle, offset, buffer)


def test_read_failure_is_raised_as_the_disk_error_not_as_mlx_error(saved_llama):
    path, header = saved_llama
    with pytest.raises(DiskError, match="EIO"):
        kvfile.load(path, staged=True, disk=_FailingPayloadDisk(header.payload_offset))


@pytest.mark.parametrize("dtype", ["float32", "float16", "uint32", "int8", "uint8", "bool", "int64"])
def test_window_presents_a_npy_file_numpy_reads_too(dtype, saved_llama):
    shape = (2, 3, 5)
    header = staged_load.npy_header(dtype, shape)
    assert len(header) % 16 == 0
    stream = io.BytesIO(header + bytes(int(np.prod(shape)) * np.dtype(dtype).itemsize))
    assert np.lib.format.read_magic(stream) == (1, 0)
    read_shape, fortran, read_dtype = np.lib.format.read_array_header_1_0(stream)
    assert read_shape == shape and not fortran and read_dtype == np.dtype(dtype)


def test_only_a_gpu_with_its_own_memory_stages_restores():
    assert kvfile.staged_load_wanted(mx.Device(mx.DeviceType.cpu), lambda: True) is False
    assert kvfile.staged_load_wanted(mx.Device(mx.DeviceType.gpu), lambda: True) is True
    assert kvfile.staged_load_wanted(mx.Device(mx.DeviceType.gpu), lambda: False) is False  # Metal
    assert kvfile.staged_load_wanted() is False  # this machine's CPU backend
