"""The pipelined `.kvc` restore and save (store/tensor_io.py): bytes land in
the final MLX arrays bit for bit, only slack is zeroed, a corrupted or cut
tensor mid-pipeline is named, the order of disk calls does not depend on
thread timing, pages are dropped once read, and save's overlapped write
reports its failures."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_buffers import buffer_address
from mlx_lm.models.cache import KVCache

from kvcellar.errors import CorruptEntry, DiskError
from kvcellar.store import codecs, kvfile, tensor_io
from kvcellar.store.disk import RealDisk, TracingDisk

# Big enough that every tensor crosses tensor_io.OVERLAP_BYTES_MIN (the threaded write path).
LAYERS, HEADS, ROWS, HEAD_DIM = 3, 4, 300, 256


def _entry(dtype=mx.float32) -> tuple[list[KVCache], list[int]]:
    mx.random.seed(3)
    caches = []
    for _ in range(LAYERS):
        cache = KVCache()
        shape = (1, HEADS, ROWS, HEAD_DIM)
        cache.update_and_fetch(mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype))
        mx.eval(cache.keys, cache.values)
        caches.append(cache)
    return caches, list(range(ROWS))


@pytest.fixture(scope="module")
def big_entry(tmp_path_factory):
    caches, tokens = _entry()
    path = tmp_path_factory.mktemp("pipeline") / "big.kvc"
    header = kvfile.save(path, caches, tokens)
    assert all(record.length >= tensor_io.OVERLAP_BYTES_MIN for record in header.tensor_records())
    return path, header, caches


def _damaged_copy(source: Path, target: Path, offset: int) -> Path:
    data = bytearray(source.read_bytes())
    data[offset] ^= 0x40
    target.write_bytes(bytes(data))
    return target


def _read_calls(disk: TracingDisk) -> list[str]:
    return [call.operation for call in disk.calls if call.operation in ("read_into", "drop_cached")]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_pipelined_restore_is_bit_identical_with_zeroed_slack(dtype, tmp_path):
    caches, tokens = _entry(dtype)
    path = tmp_path / "e.kvc"
    kvfile.save(path, caches, tokens)
    restored = kvfile.load(path).caches
    for live, back in zip(caches, restored, strict=True):
        assert back.offset == live.offset and back.keys.dtype == dtype
        assert back.keys.shape[-2] == codecs._step_capacity(ROWS)
        for ours, theirs in ((back.keys, live.keys), (back.values, live.values)):
            assert mx.array_equal(ours[..., :ROWS, :], theirs[..., :ROWS, :]).item()
            assert not mx.any(ours[..., ROWS:, :]).item()


def test_corrupted_tensor_mid_pipeline_is_named_after_every_read(big_entry, tmp_path):
    path, header, _ = big_entry
    records = list(header.tensor_records())
    middle = records[len(records) // 2]
    intact_disk = TracingDisk(RealDisk())
    kvfile.load(path, disk=intact_disk)
    damaged = _damaged_copy(path, tmp_path / "d.kvc", middle.file_offset + middle.length // 3)
    for _ in range(3):
        damaged_disk = TracingDisk(RealDisk())
        with pytest.raises(CorruptEntry) as caught:
            kvfile.load(damaged, disk=damaged_disk)
        assert caught.value.part == f"tensor {middle.name}"
        # The reader finishes its reads before the load raises: the same calls as an intact load, every time.
        assert _read_calls(damaged_disk) == _read_calls(intact_disk)


class _ShortReadDisk(RealDisk):
    """Returns fewer bytes than asked for reads starting at `short_offset`
    (a file cut beneath a load, after its header was checked)."""

    def __init__(self, short_offset: int) -> None:
        self.short_offset = short_offset
        self.read_offsets: list[int] = []

    def read_into(self, handle, offset, buffer):
        self.read_offsets.append(offset)
        got = super().read_into(handle, offset, buffer)
        return got // 2 if offset == self.short_offset else got


def test_tensor_cut_short_mid_pipeline_stops_the_reads_and_is_named(big_entry):
    path, header, _ = big_entry
    records = list(header.tensor_records())
    cut = records[2]
    disk = _ShortReadDisk(cut.file_offset)
    with pytest.raises(CorruptEntry) as caught:
        kvfile.load(path, disk=disk)
    assert caught.value.part == f"tensor {cut.name}"
    assert "truncated" in str(caught.value)
    assert max(disk.read_offsets) == cut.file_offset  # nothing after the cut tensor was read


def test_truncated_file_fails_before_any_tensor_is_read(big_entry, tmp_path):
    path, header, _ = big_entry
    short = tmp_path / "short.kvc"
    short.write_bytes(path.read_bytes()[: header.file_bytes - 4096])
    disk = TracingDisk(RealDisk())
    with pytest.raises(CorruptEntry) as caught:
        kvfile.load(short, disk=disk)
    assert caught.value.part == "size"
    assert "drop_cached" not in [call.operation for call in disk.calls]


def test_verify_off_returns_the_bytes_on_disk_unchecked(big_entry, tmp_path):
    path, header, caches = big_entry
    record = next(header.tensor_records())
    damaged = _damaged_copy(path, tmp_path / "nv.kvc", record.file_offset)
    entry = kvfile.load(damaged, verify=False)
    keys = np.asarray(memoryview(entry.caches[0].keys))
    live = np.asarray(memoryview(caches[0].keys))
    flat_restored = keys[..., :ROWS, :].reshape(-1).view(np.uint8)
    flat_live = np.ascontiguousarray(live[..., :ROWS, :]).reshape(-1).view(np.uint8)
    assert flat_restored[0] == flat_live[0] ^ 0x40
    assert np.array_equal(flat_restored[1:], flat_live[1:])
    with pytest.raises(CorruptEntry):
        kvfile.load(damaged, verify=True)


class _DropRecordingDisk(RealDisk):
    def __init__(self) -> None:
        self.dropped: list[tuple[int, int]] = []

    def drop_cached(self, handle, offset, length):
        self.dropped.append((offset, length))
        super().drop_cached(handle, offset, length)


def _covered_tensors(header, dropped: list[tuple[int, int]]) -> list[list[str]]:
    """The names of the tensors inside each dropped range, per drop call."""
    return [
        [r.name for r in header.tensor_records() if start <= r.file_offset <= start + length - r.length]
        for start, length in dropped
    ]


def test_a_load_drops_the_page_cache_of_every_tensor_in_one_batch_per_64_mib(big_entry):
    path, header, _ = big_entry
    records = list(header.tensor_records())
    assert header.payload_bytes < tensor_io.DROP_BATCH_BYTES
    disk = _DropRecordingDisk()
    kvfile.load(path, disk=disk)
    # One call for the whole payload, not one per tensor: each call has a fixed cost.
    end = records[-1].file_offset + records[-1].length
    assert disk.dropped == [(records[0].file_offset, end - records[0].file_offset)]


def test_a_smaller_drop_batch_drops_consecutive_tensors_once_each(big_entry):
    path, header, caches = big_entry
    records = list(header.tensor_records())
    disk = _DropRecordingDisk()
    handle = disk.open_read(path)
    try:
        pipeline = tensor_io.TensorReadPipeline(disk, handle, path, verify=True, drop_batch_bytes=2 * records[0].length)
        restored = codecs.rebuild_caches(header.caches, pipeline.allocate)
        pipeline.finish()
    finally:
        disk.close(handle)
    names = [record.name for record in records]
    assert _covered_tensors(header, disk.dropped) == [names[i : i + 2] for i in range(0, len(names), 2)]
    assert mx.array_equal(restored[-1].values[..., :ROWS, :], caches[-1].values[..., :ROWS, :]).item()


class _WritebackRecordingDisk(RealDisk):
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def write_at(self, handle, offset, data):
        self.calls.append(("write_at", offset, memoryview(data).nbytes))
        super().write_at(handle, offset, data)

    def start_writeback(self, handle, offset, length):
        self.calls.append(("start_writeback", offset, length))
        super().start_writeback(handle, offset, length)

    def fsync(self, handle):
        self.calls.append(("fsync", 0, 0))
        super().fsync(handle)


@pytest.mark.parametrize("threaded", [True, False], ids=["overlapped", "inline"])
def test_save_starts_each_tensors_writeback_after_its_writes_and_before_the_fsync(threaded, tmp_path):
    caches, tokens = _entry()
    disk = _WritebackRecordingDisk()
    disk.concurrent_io = threaded
    header = kvfile.save(tmp_path / "wb.kvc", caches, tokens, disk=disk)
    writebacks = [(offset, length) for op, offset, length in disk.calls if op == "start_writeback"]
    assert writebacks == [(record.file_offset, record.length) for record in header.tensor_records()]
    for record in header.tensor_records():
        started = disk.calls.index(("start_writeback", record.file_offset, record.length))
        tensor_writes = [
            i
            for i, (op, offset, _) in enumerate(disk.calls)
            if op == "write_at" and record.file_offset <= offset < record.file_offset + record.length
        ]
        assert tensor_writes and max(tensor_writes) < started
    assert max(i for i, call in enumerate(disk.calls) if call[0] == "start_writeback") < disk.calls.index(
        ("fsync", 0, 0)
    )
    assert kvfile.verify_file(tmp_path / "wb.kvc") == header


def test_start_writeback_is_advice_that_never_raises(tmp_path):
    disk = RealDisk()
    handle = disk.create_exclusive(tmp_path / "advice.bin")
    disk.write_at(handle, 0, b"kv" * 50_000)
    disk.start_writeback(handle, 0, 100_000)
    disk.fsync(handle)
    disk.close(handle)
    assert (tmp_path / "advice.bin").read_bytes() == b"kv" * 50_000
    disk.start_writeback(handle, 0, 100_000)  # a closed descriptor: advice fails silently


class _FailingPayloadWriteDisk(RealDisk):
    """Fails every tensor write (the payload starts past the first alignment unit)."""

    def write_at(self, handle, offset, data):
        if offset >= kvfile.ALIGNMENT_BYTES:
            raise DiskError("write: No space left on device", errno=28)
        super().write_at(handle, offset, data)


def test_failed_overlapped_write_leaves_neither_temp_file_nor_target(tmp_path):
    caches, tokens = _entry()
    target = tmp_path / "fail.kvc"
    with pytest.raises(DiskError) as caught:
        kvfile.save(target, caches, tokens, disk=_FailingPayloadWriteDisk())
    assert caught.value.errno == 28
    assert list(tmp_path.iterdir()) == []


def test_overlapped_save_checksums_match_a_one_shot_digest(big_entry):
    path, header, _ = big_entry
    data = path.read_bytes()
    for record in header.tensor_records():
        span = data[record.file_offset : record.file_offset + record.length]
        assert kvfile._checksum(span) == record.checksum
    kvfile.verify_file(path)


def test_a_restore_of_one_row_short_of_a_step_leaves_a_step_of_slack_and_its_first_steps_write_in_place(tmp_path):
    # 2 steps less one row: a capacity rounded only to the next step would hold one spare row, and the
    # second step (the one a generator runs before it hands out the first token) would copy every row.
    rows = 2 * codecs.STEP_ROWS - 1
    cache = KVCache()
    shape = (1, 2, rows, 16)
    cache.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
    path = tmp_path / "short-of-a-step.kvc"
    kvfile.save(path, [cache], list(range(rows)))
    (back,) = kvfile.load(path).caches
    assert back.keys.shape[-2] - rows > codecs.STEP_ROWS
    buffers = (buffer_address(back.keys), buffer_address(back.values))
    for step in range(2):
        row = mx.full((1, 2, 1, 16), float(step))
        back.update_and_fetch(row, row)
        mx.eval(back.keys, back.values)
        assert (buffer_address(back.keys), buffer_address(back.values)) == buffers, f"step {step + 1} copied"
    assert back.offset == rows + 2
    assert mx.array_equal(back.keys[..., :rows, :], cache.keys[..., :rows, :]).item()
