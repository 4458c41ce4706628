"""SimDisk: what survives a simulated power loss, injected faults, crash
points, and the real store running on it."""

from __future__ import annotations

import contextlib
import errno
import random
from pathlib import Path, PurePosixPath

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache

from kvcellar.errors import DirectoryLocked, DiskError
from kvcellar.simulations.sim_disk import FaultConfig, SimDisk, SimulatedCrash, TickClock
from kvcellar.store import kvfile
from kvcellar.store.disk import RealDisk, TracingDisk
from kvcellar.store.ssd import SsdStore, namespace_dir_name

ROOT = PurePosixPath("/sim")
DIR = ROOT / "d"
SECTOR = 512
FINGERPRINT = "f" * 32
TOKENS = [5, 9, 2, 7, 11, 3, 8, 4]
ATOMIC_WRITE_OPS = ["create_exclusive", "write_at", "fsync", "close", "rename", "fsync_dir"]


def _durable_dir(disk: SimDisk, path: PurePosixPath = DIR) -> None:
    """Make `path` and its parents durably (fsync of every parent)."""
    disk.makedirs(path)
    relative = path.relative_to(disk.root)
    for depth in range(len(relative.parts)):
        disk.fsync_dir(disk.root.joinpath(*relative.parts[:depth]))


def _atomic_write(disk: SimDisk, path: PurePosixPath, data: bytes) -> None:
    temp = path.with_name(f".{path.name}.tmp")
    handle = disk.create_exclusive(temp)
    disk.write_at(handle, 0, data)
    disk.fsync(handle)
    disk.close(handle)
    disk.rename(temp, path)
    disk.fsync_dir(path.parent)


def _unsynced_write(disk: SimDisk, path: PurePosixPath, offset: int, data: bytes) -> None:
    handle = disk.create_exclusive(path)
    disk.write_at(handle, offset, data)
    disk.close(handle)


def _durable_file_open(disk: SimDisk, path: PurePosixPath, data: bytes):
    """A durable file (data and name) at `path`, and a write handle still open
    on it: `Disk` opens existing files read-only, so the handle is taken on the
    temp file before the rename."""
    temp = path.with_name(f".{path.name}.tmp")
    handle = disk.create_exclusive(temp)
    disk.write_at(handle, 0, data)
    disk.fsync(handle)
    disk.rename(temp, path)
    disk.fsync_dir(path.parent)
    return handle


def _sectors(data: bytes) -> list[bytes]:
    return [data[i : i + SECTOR] for i in range(0, len(data), SECTOR)]


# -- durability ---------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), size=st.integers(0, 20_000), noise=st.integers(0, 3))
def test_an_atomic_write_survives_any_power_loss_byte_identical(seed, size, noise):
    data = random.Random(seed).randbytes(size)
    disk = SimDisk(rng=random.Random(seed))
    _durable_dir(disk)
    _atomic_write(disk, DIR / "entry", b"old contents" * 100)
    _atomic_write(disk, DIR / "entry", data)
    assert disk.pending_counts() == (0, 0)
    assert disk.files(durable=True) == disk.files()
    for index in range(noise):
        _unsynced_write(disk, DIR / f"noise{index}", 0, b"x" * 5000)
    disk.crash(random.Random(seed))
    assert disk.read_bytes(DIR / "entry") == data
    assert not disk.exists(DIR / ".entry.tmp")
    assert disk.files() == disk.files(durable=True), "after a crash the image is fully synced"


def test_an_unsynced_overwrite_is_kept_dropped_or_torn_by_whole_sectors():
    old = bytes([0xAA]) * 8192
    new = bytes([0xBB]) * 8192
    outcomes = set()
    for seed in range(300):
        disk = SimDisk()
        _durable_dir(disk)
        writer = _durable_file_open(disk, DIR / "f", old)
        disk.write_at(writer, 0, new)
        disk.crash(random.Random(seed))
        after = disk.read_bytes(DIR / "f")
        assert len(after) == len(old)
        sectors = _sectors(after)
        assert all(sector in (old[:SECTOR], new[:SECTOR]) for sector in sectors), "only whole old or new sectors"
        if after == old:
            outcomes.add("dropped")
        elif after == new:
            outcomes.add("kept")
        else:
            outcomes.add("torn")
            blocks = [after[i : i + 4096] for i in range(0, len(after), 4096)]
            if any(len(set(_sectors(block))) > 1 for block in blocks):
                outcomes.add("torn within a 4096-byte block")
    assert outcomes == {"dropped", "kept", "torn", "torn within a 4096-byte block"}


def test_an_unsynced_append_leaves_new_bytes_or_zeros_never_foreign_bytes():
    data = random.Random(1).randbytes(9000)
    lengths = set()
    for seed in range(200):
        disk = SimDisk()
        _durable_dir(disk)
        writer = _durable_file_open(disk, DIR / "f", b"")
        disk.write_at(writer, 0, data)
        disk.crash(random.Random(seed))
        after = disk.read_bytes(DIR / "f")
        lengths.add(len(after))
        assert len(after) <= len(data)
        for index, sector in enumerate(_sectors(after)):
            expected = data[index * SECTOR : index * SECTOR + len(sector)]
            assert sector in (expected, bytes(len(sector))), f"sector {index} holds bytes never written there"
    assert 0 in lengths and len(data) in lengths and len(lengths) > 2


def test_overlapping_unsynced_writes_may_land_in_either_order():
    old = b"0" * SECTOR
    finals = set()
    for seed in range(300):
        disk = SimDisk()
        _durable_dir(disk)
        writer = _durable_file_open(disk, DIR / "f", old)
        disk.write_at(writer, 0, b"A" * 100)
        disk.write_at(writer, 50, b"B" * 100)
        assert disk.read_bytes(DIR / "f")[:150] == b"A" * 50 + b"B" * 100, "reads see the page cache"
        disk.crash(random.Random(seed))
        finals.add(disk.read_bytes(DIR / "f")[:150])
    assert finals == {
        old[:150],
        b"A" * 100 + old[100:150],
        old[:50] + b"B" * 100,
        b"A" * 50 + b"B" * 100,
        b"A" * 100 + b"B" * 50,
    }, "the last outcome is the later write landing first"


def test_a_rename_without_fsync_dir_may_revert_and_with_it_never_does():
    for synced_dir in (False, True):
        outcomes = set()
        for seed in range(100):
            disk = SimDisk()
            _durable_dir(disk)
            _atomic_write(disk, DIR / "f", b"old")
            handle = disk.create_exclusive(DIR / "f.tmp")
            disk.write_at(handle, 0, b"new")
            disk.fsync(handle)
            disk.close(handle)
            disk.rename(DIR / "f.tmp", DIR / "f")
            if synced_dir:
                disk.fsync_dir(DIR)
            disk.crash(random.Random(seed))
            outcomes.add((disk.read_bytes(DIR / "f"), disk.exists(DIR / "f.tmp")))
        if synced_dir:
            assert outcomes == {(b"new", False)}
        else:
            assert outcomes == {(b"old", False), (b"old", True), (b"new", False)}


def test_a_rename_across_directories_is_durable_through_both_directories():
    for fsync_both in (False, True):
        outcomes = set()
        for seed in range(100):
            disk = SimDisk()
            _durable_dir(disk, ROOT / "x")
            _durable_dir(disk, ROOT / "y")
            _atomic_write(disk, ROOT / "x" / "f", b"data")
            disk.rename(ROOT / "x" / "f", ROOT / "y" / "f")
            if fsync_both:
                disk.fsync_dir(ROOT / "x")
                disk.fsync_dir(ROOT / "y")
            disk.crash(random.Random(seed))
            outcomes.add((disk.exists(ROOT / "x" / "f"), disk.exists(ROOT / "y" / "f")))
        expected = {(False, True)} if fsync_both else {(True, False), (False, True), (True, True), (False, False)}
        assert outcomes == expected


def test_a_new_directory_may_vanish_unless_its_parent_is_synced():
    outcomes = set()
    for seed in range(60):
        disk = SimDisk()
        disk.makedirs(ROOT / "a" / "b")
        _atomic_write(disk, ROOT / "a" / "b" / "f", b"data")
        disk.crash(random.Random(seed))
        outcomes.add(disk.exists(ROOT / "a" / "b" / "f"))
        assert disk.files() == disk.files(durable=True)
    assert outcomes == {True, False}


def test_after_an_fsync_eio_a_later_successful_fsync_does_not_make_the_data_durable():
    for seed in range(30):
        disk = SimDisk(rng=random.Random(seed))
        _durable_dir(disk)
        writer = _durable_file_open(disk, DIR / "f", b"old!" * 1024)
        disk.write_at(writer, 0, b"new!" * 1024)
        disk.faults = FaultConfig(fsync_eio_rate=1.0)
        with pytest.raises(DiskError) as failed:
            disk.fsync(writer)
        assert failed.value.errno == errno.EIO
        disk.faults_off()
        assert disk.read_bytes(DIR / "f") == b"new!" * 1024, "the lost data stays readable until the crash"
        disk.fsync(writer)
        disk.write_at(writer, 8192, b"tail")
        disk.fsync(writer)
        disk.crash(random.Random(seed))
        after = disk.read_bytes(DIR / "f")
        assert after[:4096] == b"old!" * 1024 and after[8192:] == b"tail"


# -- crash points ---------------------------------------------------------------


def test_every_crash_point_of_an_atomic_write_leaves_old_or_new_whole():
    def fresh() -> SimDisk:
        disk = SimDisk(trace=True)
        _durable_dir(disk)
        _atomic_write(disk, DIR / "f", b"old" * 3000)
        return disk

    probe = fresh()
    base = probe.ops_done
    _atomic_write(probe, DIR / "f", b"new" * 3000)
    assert [op for op, _ in probe.trace[base:]] == ATOMIC_WRITE_OPS
    seen = set()
    for point in range(1, len(ATOMIC_WRITE_OPS) + 1):
        for seed in range(8):
            disk = fresh()
            disk.crash_at_op = disk.ops_done + point
            swallowed = []
            with pytest.raises(SimulatedCrash):
                try:
                    _atomic_write(disk, DIR / "f", b"new" * 3000)
                except Exception as e:
                    swallowed.append(e)
            assert not swallowed
            assert disk.ops_done == base + point - 1
            with pytest.raises(SimulatedCrash):
                disk.stat(DIR / "f")
            disk.crash(random.Random(seed))
            content = disk.read_bytes(DIR / "f")
            assert content in (b"old" * 3000, b"new" * 3000)
            seen.add((point, content[:3]))
    assert (len(ATOMIC_WRITE_OPS), b"new") in seen, "a crash before fsync_dir can keep the rename"
    assert all((point, b"new") not in seen for point in range(1, 6)), "nothing is renamed before the rename"


def test_an_explicit_crash_point_is_counted_traced_and_can_fire():
    disk = SimDisk(trace=True)
    disk.crash_point("journal commit")
    assert disk.ops_done == 1 and disk.trace == [("crash_point", "journal commit")]
    disk.crash_at_op = 3
    disk.makedirs(DIR)
    with pytest.raises(SimulatedCrash, match="op 3: crash_point journal commit"):
        disk.crash_point("journal commit")
    assert disk.crashed and disk.ops_done == 2
    disk.crash_clean()
    assert not disk.crashed and disk.exists(DIR)


def test_crash_clean_loses_nothing_but_drops_handles():
    disk = SimDisk()
    _durable_dir(disk)
    handle = disk.create_exclusive(DIR / "f")
    disk.write_at(handle, 0, b"unsynced")
    disk.crash_at_op = disk.ops_done + 1
    with pytest.raises(SimulatedCrash):
        disk.write_at(handle, 8, b"never")
    disk.crash_clean()
    assert disk.read_bytes(DIR / "f") == b"unsynced"
    with pytest.raises(DiskError) as closed:
        disk.write_at(handle, 0, b"x")
    assert closed.value.errno == errno.EBADF
    assert disk.pending_counts() == (1, 1), "pending stays pending: a later power loss can still drop it"


# -- faults -----------------------------------------------------------------------


def test_capacity_writes_what_fits_then_enospc_and_unlink_frees_space():
    disk = SimDisk(bytes_max=1000)
    handle = disk.create_exclusive(ROOT / "a")
    disk.write_at(handle, 0, b"a" * 600)
    with pytest.raises(DiskError) as full:
        disk.write_at(handle, 600, b"b" * 600)
    assert full.value.errno == errno.ENOSPC
    assert disk.size(handle) == 1000 and disk.bytes_used() == 1000
    disk.write_at(handle, 0, b"c" * 1000)
    disk.close(handle)
    disk.unlink(ROOT / "a")
    other = disk.create_exclusive(ROOT / "b")
    disk.write_at(other, 0, b"d" * 1000)
    assert disk.read_bytes(ROOT / "b") == b"d" * 1000


@pytest.mark.parametrize(("fault", "code"), [("write_enospc_rate", errno.ENOSPC), ("write_eio_rate", errno.EIO)])
def test_injected_write_errors_write_at_most_a_sector_aligned_prefix(fault, code):
    data = random.Random(2).randbytes(5000)
    sizes = set()
    for seed in range(40):
        disk = SimDisk(rng=random.Random(seed), faults=FaultConfig(**{fault: 1.0}))
        handle = disk.create_exclusive(ROOT / "f")
        with pytest.raises(DiskError) as failed:
            disk.write_at(handle, 0, data)
        assert failed.value.errno == code
        written = disk.read_bytes(ROOT / "f")
        assert written == data[: len(written)] and len(written) % SECTOR == 0
        sizes.add(len(written))
    assert 0 in sizes and len(sizes) > 2


def test_a_read_can_flip_exactly_one_bit_transiently():
    data = random.Random(3).randbytes(4096)
    disk = SimDisk(rng=random.Random(4))
    handle = disk.create_exclusive(ROOT / "f")
    disk.write_at(handle, 0, data)
    disk.close(handle)
    reader = disk.open_read(ROOT / "f")
    disk.faults = FaultConfig(read_bitflip_rate=1.0)
    for _ in range(20):
        buffer = bytearray(len(data))
        assert disk.read_into(reader, 0, memoryview(buffer)) == len(data)
        flipped = np.bitwise_xor(np.frombuffer(bytes(buffer), np.uint8), np.frombuffer(data, np.uint8))
        assert int(np.unpackbits(flipped).sum()) == 1
    disk.faults_off()
    buffer = bytearray(len(data))
    disk.read_into(reader, 0, memoryview(buffer))
    assert bytes(buffer) == data


def test_a_misdirected_write_lands_a_sector_away_without_an_error():
    shifts = set()
    for seed in range(30):
        disk = SimDisk(rng=random.Random(seed), faults=FaultConfig(misdirected_write_rate=1.0))
        handle = disk.create_exclusive(ROOT / "f")
        disk.write_at(handle, 8192, b"P" * 100)
        content = disk.read_bytes(ROOT / "f")
        assert content[8192:8292] != b"P" * 100
        landed = content.index(b"P" * 100)
        assert content.count(b"P") == 100
        shifts.add(landed - 8192)
    assert shifts == {-4096, -512, 512, 4096}


def test_fault_config_rejects_rates_outside_zero_to_one():
    with pytest.raises(ValueError):
        FaultConfig(fsync_eio_rate=1.5)


# -- errors, locks, paths ------------------------------------------------------------


def test_errors_carry_the_errno_real_disk_would():
    disk = SimDisk()
    handle = disk.create_exclusive(ROOT / "f")
    cases = {
        errno.EEXIST: lambda: disk.create_exclusive(ROOT / "f"),
        errno.ENOENT: lambda: disk.open_read(ROOT / "missing"),
    }
    for code, call in cases.items():
        with pytest.raises(DiskError) as failed:
            call()
        assert failed.value.errno == code
    for call in (
        lambda: disk.unlink(ROOT / "missing"),
        lambda: disk.stat(ROOT / "missing"),
        lambda: disk.scandir(ROOT / "missing"),
        lambda: disk.create_exclusive(ROOT / "no" / "f"),
        lambda: disk.rename(ROOT / "missing", ROOT / "g"),
        lambda: disk.stat("/elsewhere/f"),
    ):
        with pytest.raises(DiskError) as failed:
            call()
        assert failed.value.errno == errno.ENOENT
    with pytest.raises(DiskError) as not_dir:
        disk.makedirs(ROOT / "f" / "sub")
    assert not_dir.value.errno == errno.ENOTDIR
    reader = disk.open_read(ROOT / "f")
    with pytest.raises(DiskError) as read_only:
        disk.write_at(reader, 0, b"x")
    assert read_only.value.errno == errno.EBADF
    disk.close(handle)
    for call in (lambda: disk.close(handle), lambda: disk.write_at(handle, 0, b"x"), lambda: disk.fsync(handle)):
        with pytest.raises(DiskError) as closed:
            call()
        assert closed.value.errno == errno.EBADF


def test_the_roots_ancestors_exist_for_makedirs_and_fsync_dir_only():
    disk = SimDisk(root="/sim/deep")
    disk.makedirs("/sim")
    disk.fsync_dir("/")
    disk.fsync_dir(Path("/sim"))
    with pytest.raises(DiskError) as outside:
        disk.scandir("/sim")
    assert outside.value.errno == errno.ENOENT


def test_paths_may_be_str_path_or_relative_to_the_root():
    disk = SimDisk()
    disk.makedirs(Path("/sim/a/../b"))
    handle = disk.create_exclusive("b/f")
    disk.write_at(handle, 0, b"12345")
    disk.utime(Path("/sim/b/f"), 42)
    assert disk.stat("/sim/b/f") == disk.stat(Path("/sim/b/f"))
    assert disk.stat("/sim/b/f").size_bytes == 5 and disk.stat("/sim/b/f").mtime_ns == 42
    assert [entry.name for entry in disk.scandir(ROOT)] == ["b"]


def test_scandir_is_sorted_with_volatile_sizes():
    disk = SimDisk()
    for name in ["c", "a", "b"]:
        handle = disk.create_exclusive(ROOT / name)
        disk.write_at(handle, 0, name.encode() * (ord(name) - 96))
    disk.makedirs(ROOT / "d")
    entries = disk.scandir(ROOT)
    assert [(e.name, e.is_dir, e.size_bytes) for e in entries] == [
        ("a", False, 1),
        ("b", False, 2),
        ("c", False, 3),
        ("d", True, 0),
    ]


def test_locks_conflict_name_their_holder_and_die_with_the_process():
    disk = SimDisk()
    lock_path = DIR / "lock"
    _durable_dir(disk)
    handle = disk.lock_exclusive(lock_path, "pid 1")
    with pytest.raises(DirectoryLocked, match="pid 1"):
        disk.lock_exclusive(lock_path, "pid 2")
    assert disk.read_bytes(lock_path) == b"pid 1"
    disk.unlock(handle)
    disk.lock_exclusive(lock_path, "pid 2")
    disk.crash_clean()
    disk.lock_exclusive(lock_path, "pid 3")
    disk.crash(random.Random(0))
    disk.lock_exclusive(lock_path, "pid 4")
    assert disk.read_bytes(lock_path) == b"pid 4"
    with pytest.raises(DiskError) as stale:
        disk.unlock(handle)
    assert stale.value.errno == errno.EBADF


def test_tracing_disk_wraps_a_sim_disk_and_names_handle_paths():
    traced = TracingDisk(SimDisk())
    handle = traced.create_exclusive(ROOT / "f")
    traced.write_at(handle, 0, b"x")
    traced.close(handle)
    assert [(call.operation, call.path) for call in traced.calls] == [
        ("create_exclusive", "/sim/f"),
        ("write_at", "/sim/f"),
        ("close", "/sim/f"),
    ]


# -- determinism and export --------------------------------------------------------------


def _faulty_workload(seed: int) -> str:
    disk = SimDisk(
        rng=random.Random(seed),
        faults=FaultConfig(fsync_eio_rate=0.2, write_eio_rate=0.1, misdirected_write_rate=0.1, read_bitflip_rate=0.2),
    )
    _durable_dir(disk)
    for index in range(8):
        with contextlib.suppress(DiskError):
            _atomic_write(disk, DIR / f"e{index}", random.Random(seed + index).randbytes(3000))
    for index in range(3):
        with contextlib.suppress(DiskError):
            _unsynced_write(disk, DIR / f"u{index}", 100, b"u" * 2000)
    disk.crash(random.Random(seed))
    return disk.image_digest()


def test_the_same_seed_gives_the_same_image_and_seeds_differ():
    assert _faulty_workload(7) == _faulty_workload(7)
    assert len({_faulty_workload(seed) for seed in range(6)}) > 1


def test_export_writes_the_image_onto_the_real_file_system(tmp_path):
    disk = SimDisk()
    disk.makedirs(ROOT / "a" / "b")
    _atomic_write(disk, ROOT / "a" / "b" / "f", b"payload")
    disk.utime(ROOT / "a" / "b" / "f", 1_234_000_000_000)
    disk.export_to(tmp_path / "out")
    exported = tmp_path / "out" / "a" / "b" / "f"
    assert exported.read_bytes() == b"payload"
    assert exported.stat().st_mtime_ns == 1_234_000_000_000
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == ["a", "b", "f"]


# -- the real store on a SimDisk ------------------------------------------------------------


def _caches(seed: int, token_count: int = len(TOKENS)) -> list[KVCache]:
    caches = []
    for layer in range(2):
        cache = KVCache()
        keys = mx.random.normal((1, 2, token_count, 4), key=mx.random.key(seed * 10 + layer))
        values = mx.random.normal((1, 2, token_count, 4), key=mx.random.key(seed * 10 + layer + 5))
        cache.update_and_fetch(keys, values)
        caches.append(cache)
    mx.eval([c.keys for c in caches] + [c.values for c in caches])
    return caches


def _tensors(caches) -> list[bytes]:
    out = []
    for cache in caches:
        for array in (cache.keys, cache.values):
            out.append(np.array(array[..., : cache.offset, :]).tobytes())
    return out


def test_every_crash_point_of_kvfile_save_leaves_no_entry_or_the_whole_entry():
    caches = _caches(1)
    path = DIR / "entry.kvc"

    def fresh() -> SimDisk:
        disk = SimDisk()
        _durable_dir(disk)
        return disk

    probe = fresh()
    base = probe.ops_done
    kvfile.save(path, caches, TOKENS, disk=probe)
    count = probe.ops_done - base
    outcomes = set()
    for point in range(1, count + 1):
        for seed in range(8):
            disk = fresh()
            disk.crash_at_op = disk.ops_done + point
            with pytest.raises(SimulatedCrash):
                kvfile.save(path, caches, TOKENS, disk=disk)
            disk.crash(random.Random(seed))
            if disk.exists(path):
                assert _tensors(kvfile.load(path, disk=disk).caches) == _tensors(caches)
            outcomes.add(disk.exists(path))
    assert outcomes == {True, False}


STORE_ROOT = ROOT / "cache"


def _open_store(disk: SimDisk, **options) -> SsdStore:
    return SsdStore.open(Path(STORE_ROOT), FINGERPRINT, disk=disk, journal=False, clock_ns=TickClock(), **options)


def _store_directories_durable(disk: SimDisk) -> None:
    _durable_dir(disk, STORE_ROOT / FINGERPRINT / namespace_dir_name(""))


@pytest.mark.parametrize("seed", range(8))
def test_the_store_restores_bit_identical_tensors_after_a_power_loss(seed):
    disk = SimDisk(rng=random.Random(seed))
    _store_directories_durable(disk)
    caches = _caches(seed)
    store = _open_store(disk)
    assert store.store(TOKENS, caches) is not None
    disk.crash(random.Random(seed))
    reopened = _open_store(disk)
    match = reopened.find(TOKENS + [1])
    assert match is not None and match.usable_tokens == len(TOKENS)
    restored = reopened.restore(match)
    assert _tensors(restored) == _tensors(caches)
    with pytest.raises(DirectoryLocked):
        _open_store(disk)
    reopened.close()


def test_an_exported_store_image_reads_back_through_the_real_disk(tmp_path):
    disk = SimDisk()
    store = _open_store(disk)
    entry_id = store.store(TOKENS, _caches(3))
    store.close()
    disk.export_to(tmp_path)
    exported = tmp_path / "cache" / FINGERPRINT / namespace_dir_name("") / f"{entry_id}.kvc"
    assert _tensors(kvfile.load(exported, disk=RealDisk()).caches) == _tensors(_caches(3))


def test_a_committed_entry_in_fresh_directories_survives_a_power_loss():
    """The store must fsync the parents of the directories it creates."""
    for seed in range(20):
        disk = SimDisk(rng=random.Random(seed))
        store = _open_store(disk)
        assert store.store(TOKENS, _caches(seed)) is not None
        disk.crash(random.Random(seed))
        reopened = _open_store(disk)
        assert reopened.find(TOKENS + [1]) is not None, f"seed {seed}: the committed entry is gone"
        reopened.close()


# -- removals are not directory-fsynced: a lost one heals at the next startup ---------------


class _NoPendingDirectoryChangePersists(random.Random):
    """A power loss in which every unsynced create, rename and unlink reverts."""

    def random(self) -> float:
        return 0.999999


def test_a_supersession_lost_to_a_power_loss_is_redone_at_the_next_startup():
    disk = SimDisk()
    store = _open_store(disk)
    ancestor_id = store.store(TOKENS[:4], _caches(1, 4))
    ancestor_path = store.entry(ancestor_id).path
    descendant_id = store.store(TOKENS, _caches(2))
    assert store.entry_ids() == [descendant_id] and not disk.exists(ancestor_path)

    disk.crash(_NoPendingDirectoryChangePersists())
    assert disk.exists(ancestor_path), "the unsynced unlink reverted: the superseded file is back"
    reopened = _open_store(disk)

    assert reopened.entry_ids() == [descendant_id] and not disk.exists(ancestor_path)
    match = reopened.find(TOKENS[:4] + [1])
    assert match.entry_id == descendant_id and match.usable_tokens == 4
    reopened.close()


def test_an_eviction_lost_to_a_power_loss_is_redone_at_the_next_startup():
    probe = _open_store(SimDisk())
    one_entry_bytes = probe.entry(probe.store(TOKENS, _caches(1))).bytes
    disk = SimDisk()
    store = _open_store(disk, bytes_max=one_entry_bytes)
    evicted_id = store.store(TOKENS, _caches(1))
    evicted_path = store.entry(evicted_id).path
    kept_id = store.store([t + 1 for t in TOKENS], _caches(2))
    assert store.entry_ids() == [kept_id]

    disk.crash(_NoPendingDirectoryChangePersists())
    assert disk.exists(evicted_path), "the unsynced unlink reverted: the evicted file is back"
    reopened = _open_store(disk, bytes_max=one_entry_bytes)

    assert reopened.entry_ids() == [kept_id] and not disk.exists(evicted_path)
    assert reopened.stats()["bytes"] <= one_entry_bytes
    reopened.close()


def test_a_quarantine_lost_to_a_power_loss_never_serves_bad_bytes_and_the_intact_file_serves_again():
    disk = SimDisk(rng=random.Random(4))
    store = _open_store(disk)
    entry_id = store.store(TOKENS, _caches(3))
    entry_path = store.entry(entry_id).path
    disk.faults = FaultConfig(read_bitflip_rate=1.0)
    assert store.restore(store.find(TOKENS + [1])) is None, "a flipped bit is caught, never restored"
    assert store.entry_ids() == [] and not disk.exists(entry_path)

    disk.faults = FaultConfig()
    disk.crash(_NoPendingDirectoryChangePersists())
    assert disk.exists(entry_path), "the unsynced quarantine rename reverted"
    reopened = _open_store(disk)

    assert reopened.entry_ids() == [entry_id]
    assert _tensors(reopened.restore(reopened.find(TOKENS + [1]))) == _tensors(_caches(3))
    reopened.close()
