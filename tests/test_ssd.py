"""The SSD cold tier on real files, real SQLite and real tiny models."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kvcellar.errors import DirectoryLocked, DiskError
from kvcellar.store import events as ev
from kvcellar.store import kvfile
from kvcellar.store.disk import RealDisk
from kvcellar.store.ssd import QUARANTINE_DIR_NAME, SsdMatch, SsdStore, namespace_dir_name

FINGERPRINT = "f" * 32
BASE = [(11 * i + 5) % 1000 + 3 for i in range(80)]


def _prefill(model, tokens):
    cache = make_prompt_cache(model)
    logits = model(mx.array([tokens]), cache=cache)[:, -1, :]
    mx.eval(logits)
    return cache, logits


def _step(model, token, cache):
    logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
    mx.eval(logits)
    return logits


def _greedy_equal(model, live, restored, first_token, steps=16):
    token = first_token
    for step in range(steps):
        a, b = _step(model, token, live), _step(model, token, restored)
        assert mx.array_equal(a, b).item(), f"logits differ at step {step}"
        token = int(mx.argmax(a, axis=-1).item())


def _kinds(store):
    return [record.kind for record in store.journal.events()]


@pytest.fixture()
def llama(loaded_model_factory):
    return loaded_model_factory("llama")[0]


def test_restart_restores_a_bit_identical_continuation(llama, tmp_path):
    cache, _ = _prefill(llama, BASE)
    store = SsdStore.open(tmp_path, FINGERPRINT)
    assert store.store(BASE, cache) is not None
    store.close()
    reopened = SsdStore.open(tmp_path, FINGERPRINT)
    match = reopened.find(BASE + [7])
    assert match is not None and match.usable_tokens == len(BASE)
    restored = reopened.restore(match)
    _greedy_equal(llama, cache, restored, first_token=7)
    assert reopened.stats()["restores"] == 1
    reopened.close()


def test_partial_prefix_restore_trims_to_the_shared_prefix(llama, tmp_path):
    cache, _ = _prefill(llama, BASE)
    store = SsdStore.open(tmp_path, FINGERPRINT)
    store.store(BASE, cache)
    query = BASE[:50] + [1, 2, 3]
    match = store.find(query)
    assert match.usable_tokens == 50 and match.entry_tokens == 80
    restored = store.restore(match)
    assert all(c.offset == 50 for c in restored)
    fresh, _ = _prefill(llama, BASE[:50])
    tail = mx.array([[1, 2, 3]])
    expected = llama(tail, cache=fresh)
    got = llama(tail, cache=restored)
    assert mx.array_equal(expected, got).item()
    store.close()


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_next"])
def test_untrimmable_entry_serves_exact_prefixes_only(arch, loaded_model_factory, tmp_path):
    model = loaded_model_factory(arch)[0]
    cache, _ = _prefill(model, BASE)
    store = SsdStore.open(tmp_path, FINGERPRINT)
    store.store(BASE, cache)
    assert store.find(BASE[:50] + [1, 2]) is None
    assert store.find(BASE) is None, "an exact-length query would need a trim of one token"
    match = store.find(BASE + [9])
    assert match.usable_tokens == len(BASE)
    restored = store.restore(match)
    _greedy_equal(model, cache, restored, first_token=9, steps=4)
    store.close()


def test_trimmable_descendant_supersedes_its_prefix_ancestor(llama, tmp_path):
    store = SsdStore.open(tmp_path, FINGERPRINT)
    ancestor_id = store.store(BASE[:40], _prefill(llama, BASE[:40])[0])
    descendant_id = store.store(BASE, _prefill(llama, BASE)[0])
    assert store.entry_ids() == [descendant_id]
    assert not (tmp_path / FINGERPRINT / namespace_dir_name("") / f"{ancestor_id}.kvc").exists()
    assert "entry.superseded" in _kinds(store)
    assert store.find(BASE[:40] + [3]).usable_tokens == 40
    store.close()


def test_untrimmable_descendant_keeps_its_ancestor_but_duplicates_are_replaced(loaded_model_factory, tmp_path):
    model = loaded_model_factory("qwen3_next")[0]
    store = SsdStore.open(tmp_path, FINGERPRINT)
    ancestor_id = store.store(BASE[:40], _prefill(model, BASE[:40])[0])
    descendant_id = store.store(BASE, _prefill(model, BASE)[0])
    assert sorted(store.entry_ids()) == sorted([ancestor_id, descendant_id])
    duplicate_id = store.store(BASE, _prefill(model, BASE)[0])
    assert sorted(store.entry_ids()) == sorted([ancestor_id, duplicate_id])
    store.close()


def test_byte_cap_evicts_least_recently_used_and_a_hit_refreshes(llama, tmp_path):
    prompts = [[100 + i] + BASE[:30] for i in range(5)]
    caches = [_prefill(llama, p)[0] for p in prompts]
    probe = SsdStore.open(tmp_path / "probe", FINGERPRINT)
    one_entry_bytes = probe.entry(probe.store(prompts[0], caches[0])).bytes
    probe.close()
    clock = iter(range(1, 10_000)).__next__
    store = SsdStore.open(
        tmp_path / "real", FINGERPRINT, bytes_max=3 * one_entry_bytes, clock_ns=lambda: clock() * 1_000_000_000
    )
    ids = []
    for prompt, cache in zip(prompts[:3], caches[:3], strict=True):
        ids.append(store.store(prompt, cache))
        assert store.stats()["bytes"] <= store.bytes_max
    assert store.restore(store.find(prompts[0] + [1])) is not None
    ids.append(store.store(prompts[3], caches[3]))
    assert store.stats()["bytes"] <= store.bytes_max
    assert sorted(store.entry_ids()) == sorted([ids[0], ids[2], ids[3]]), "the untouched second entry goes first"
    ids.append(store.store(prompts[4], caches[4]))
    assert sorted(store.entry_ids()) == sorted([ids[0], ids[3], ids[4]])
    assert _kinds(store).count("entry.evicted") == 2
    store.close()


def _store_one(tmp_path, llama, tokens=BASE):
    store = SsdStore.open(tmp_path, FINGERPRINT)
    entry_id = store.store(tokens, _prefill(llama, tokens)[0])
    path = store.entry(entry_id).path
    store.close()
    return entry_id, path


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage", ["header", "truncated", "future_version", "foreign", "wrong_fingerprint", "wrong_namespace_dir"]
)
def test_damaged_or_mismatched_files_are_quarantined_at_startup(damage, llama, tmp_path):
    _, path = _store_one(tmp_path, llama)
    if damage == "header":
        _flip(path, kvfile.PREAMBLE_BYTES + 5)
    elif damage == "truncated":
        os.truncate(path, path.stat().st_size - 100)
    elif damage == "future_version":
        data = bytearray(path.read_bytes())
        data[8] = 9
        path.write_bytes(bytes(data))
    elif damage == "foreign":
        path.write_text("just some text")
    elif damage == "wrong_fingerprint":
        entry = kvfile.load(path)
        kvfile.save(path, entry.caches, entry.tokens, {"fingerprint": {"digest": "0" * 32}})
    else:
        moved = path.parent.parent / namespace_dir_name("other") / path.name
        moved.parent.mkdir()
        path.rename(moved)
    store = SsdStore.open(tmp_path, FINGERPRINT)
    assert store.entry_ids() == []
    quarantined = list((tmp_path / FINGERPRINT / QUARANTINE_DIR_NAME).iterdir())
    assert len(quarantined) == 1 and quarantined[0].name.endswith(path.name)
    assert "entry.quarantined" in _kinds(store)
    assert store.find(BASE + [1]) is None
    assert store.journal.entries() == store.journal.replay() == []
    store.close()


def test_corrupt_tensor_is_caught_at_restore_and_quarantined(llama, tmp_path):
    _, path = _store_one(tmp_path, llama)
    record = next(kvfile.read_header(path).tensor_records())
    _flip(path, record.file_offset + 3)
    store = SsdStore.open(tmp_path, FINGERPRINT)
    match = store.find(BASE + [1])
    assert store.restore(match) is None
    assert store.entry_ids() == [] and store.find(BASE + [1]) is None
    assert len(list((tmp_path / FINGERPRINT / QUARANTINE_DIR_NAME).iterdir())) == 1
    store.close()


def test_quarantine_stays_under_its_cap(llama, tmp_path):
    paths = [_store_one(tmp_path, llama, [200 + i] + BASE[:20])[1] for i in range(3)]
    for path in paths:
        _flip(path, kvfile.PREAMBLE_BYTES + 5)
    store = SsdStore.open(tmp_path, FINGERPRINT, quarantine_bytes_max=paths[0].stat().st_size + 1)
    assert len(list((tmp_path / FINGERPRINT / QUARANTINE_DIR_NAME).iterdir())) == 1
    assert _kinds(store).count("quarantine.purged") == 2
    store.close()


def test_temp_orphans_are_reaped_and_foreign_directories_left_untouched(llama, tmp_path):
    entry_id, path = _store_one(tmp_path, llama)
    orphan = path.parent / f".{entry_id}.kvc.deadbeef.tmp"
    orphan.write_bytes(b"half a write")
    foreign = tmp_path / ("0" * 32) / "ns" / "x.kvc"
    foreign.parent.mkdir(parents=True)
    foreign.write_bytes(b"not ours")
    foreign_mtime = foreign.stat().st_mtime_ns
    store = SsdStore.open(tmp_path, FINGERPRINT)
    assert not orphan.exists()
    assert "entry.temp_reaped" in _kinds(store)
    assert store.entry_ids() == [entry_id]
    assert foreign.read_bytes() == b"not ours" and foreign.stat().st_mtime_ns == foreign_mtime
    store.close()


def test_second_store_on_the_same_directory_is_refused_naming_the_holder(tmp_path):
    store = SsdStore.open(tmp_path, FINGERPRINT)
    with pytest.raises(DirectoryLocked, match=f"pid {os.getpid()}"):
        SsdStore.open(tmp_path, FINGERPRINT)
    store.close()
    SsdStore.open(tmp_path, FINGERPRINT).close()


class FaultyDisk(RealDisk):
    """Fails chosen operations with an errno, or flips bits in what it reads."""

    def __init__(self) -> None:
        self.fail_writes_with: int | None = None
        self.fail_reads_with: int | None = None
        self.flip_reads = False

    def write_at(self, handle, offset, data):
        if self.fail_writes_with is not None:
            raise DiskError("injected write failure", errno=self.fail_writes_with)
        super().write_at(handle, offset, data)

    def read_into(self, handle, offset, buffer):
        if self.fail_reads_with is not None and offset >= kvfile.ALIGNMENT_BYTES:
            raise DiskError("injected read failure", errno=self.fail_reads_with)
        got = super().read_into(handle, offset, buffer)
        if self.flip_reads and offset >= kvfile.ALIGNMENT_BYTES and got:
            memoryview(buffer).cast("B")[0] ^= 0xFF
        return got


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_write_failures_degrade_to_not_stored_and_serving_continues(code, llama, tmp_path):
    disk = FaultyDisk()
    store = SsdStore.open(tmp_path, FINGERPRINT, disk=disk)
    disk.fail_writes_with = code
    cache, _ = _prefill(llama, BASE)
    assert store.store(BASE, cache) is None
    assert store.stats()["write_failures"] == 1 and store.entry_ids() == []
    assert not any(p.suffix in (".kvc", ".tmp") for p in tmp_path.rglob("*") if p.is_file())
    failed = [r.event for r in store.journal.events(kind="entry.write_failed")]
    assert failed[0].errno == code
    disk.fail_writes_with = None
    assert store.store(BASE, cache) is not None
    store.close()


def test_read_faults_never_restore_anything_wrong(llama, tmp_path):
    _store_one(tmp_path, llama)
    disk = FaultyDisk()
    store = SsdStore.open(tmp_path, FINGERPRINT, disk=disk)
    match = store.find(BASE + [1])
    disk.fail_reads_with = errno.EIO
    assert store.restore(match) is None
    assert store.entry_ids() != [], "an I/O error is not corruption: the entry stays"
    disk.fail_reads_with = None
    disk.flip_reads = True
    assert store.restore(match) is None
    assert store.entry_ids() == [], "flipped bits fail the checksum: quarantined"
    store.close()


def test_every_operation_is_journaled_and_the_projection_equals_replay(llama, tmp_path):
    store = SsdStore.open(tmp_path, FINGERPRINT)
    first = store.store(BASE[:40], _prefill(llama, BASE[:40])[0])
    second = store.store(BASE, _prefill(llama, BASE)[0])
    store.restore(store.find(BASE[:60] + [4]))
    kinds = _kinds(store)
    assert kinds == ["entry.stored", "entry.stored", "entry.superseded", "entry.hit", "entry.restored"]
    rows = store.journal.entries()
    assert rows == store.journal.replay()
    assert [row["entry_id"] for row in rows] == [second]
    assert rows[0]["hits"] == 1 and rows[0]["restores"] == 1 and rows[0]["token_count"] == len(BASE)
    assert first not in [row["entry_id"] for row in rows]
    store.close()


def test_reconcile_corrects_the_journal_after_changes_behind_its_back(llama, tmp_path):
    store = SsdStore.open(tmp_path, FINGERPRINT)
    kept = store.store([1] + BASE[:30], _prefill(llama, [1] + BASE[:30])[0])
    deleted = store.store([2] + BASE[:30], _prefill(llama, [2] + BASE[:30])[0])
    corrupted = store.store([3] + BASE[:30], _prefill(llama, [3] + BASE[:30])[0])
    directory = store.entry(kept).path.parent
    store.close()
    (directory / f"{deleted}.kvc").unlink()
    _flip(directory / f"{corrupted}.kvc", kvfile.PREAMBLE_BYTES + 3)
    other = SsdStore.open(tmp_path / "elsewhere", FINGERPRINT)
    added = other.store([4] + BASE[:30], _prefill(llama, [4] + BASE[:30])[0])
    other_path = other.entry(added).path
    other.close()
    os.rename(other_path, directory / other_path.name)
    reopened = SsdStore.open(tmp_path, FINGERPRINT)
    assert sorted(reopened.entry_ids()) == sorted([kept, added])
    new_kinds = [r.kind for r in reopened.journal.events()][-4:]
    assert sorted(new_kinds) == sorted(
        ["entry.quarantined", "reconcile.added", "reconcile.removed", "reconcile.removed"]
    )
    rows = reopened.journal.entries()
    assert [r["entry_id"] for r in rows] == sorted([kept, added])
    assert rows == reopened.journal.replay()
    events_before = len(list(reopened.journal.events()))
    reopened.close()
    again = SsdStore.open(tmp_path, FINGERPRINT)
    assert len(list(again.journal.events())) == events_before, "reconciliation is idempotent"
    again.close()


def test_an_unwritable_journal_degrades_and_serving_continues(llama, tmp_path):
    journal_path = tmp_path / FINGERPRINT / "journal.sqlite"
    journal_path.mkdir(parents=True)
    store = SsdStore.open(tmp_path, FINGERPRINT)
    assert store.stats()["journal"]["state"] == "degraded"
    assert store.store(BASE, _prefill(llama, BASE)[0]) is not None
    assert store.find(BASE + [1]) is not None
    store.close()


def test_a_different_fingerprint_selects_another_directory(llama, tmp_path):
    _store_one(tmp_path, llama)
    other = SsdStore.open(tmp_path, "e" * 32)
    assert other.find(BASE + [1]) is None
    other.close()
    assert (tmp_path / FINGERPRINT).is_dir() and (tmp_path / ("e" * 32)).is_dir()
    again = SsdStore.open(tmp_path, FINGERPRINT)
    assert again.find(BASE + [1]) is not None
    again.close()


def test_covers_means_an_entry_can_serve_every_token(llama, tmp_path, loaded_model_factory):
    store = SsdStore.open(tmp_path, FINGERPRINT)
    assert not store.covers(BASE[:40])
    store.store(BASE, _prefill(llama, BASE)[0])
    assert store.covers(BASE) and store.covers(BASE[:40]) and store.covers([])
    assert not store.covers(BASE + [1]) and not store.covers([1] + BASE[:10])
    assert not store.covers(BASE[:40], namespace="other")
    assert store.longest_entry_tokens() == len(BASE)
    qwen = loaded_model_factory("qwen3_next")[0]
    store.store([5] + BASE[:30], _prefill(qwen, [5] + BASE[:30])[0])
    assert store.covers([5] + BASE[:30]) and not store.covers([5] + BASE[:20]), "untrimmable: exact only"
    store.close()


def test_listeners_see_every_event_and_every_restore(llama, tmp_path):
    events, restores = [], []
    store = SsdStore.open(
        tmp_path,
        FINGERPRINT,
        event_listeners=[events.append],
        restore_listeners=[lambda match, entry, caches: restores.append((match, entry, caches))],
    )
    entry_id = store.store(BASE, _prefill(llama, BASE)[0])
    match = store.find(BASE + [7])
    caches = store.restore(match)
    assert [type(event) for event in events] == [ev.EntryStored, ev.EntryHit, ev.EntryRestored]
    assert all(ev.event_entry_id(event) == entry_id for event in events)
    assert len(restores) == 1
    seen_match, entry, seen_caches = restores[0]
    assert seen_match == match and entry is store.entry(entry_id) and seen_caches is caches
    assert store.restore(SsdMatch(entry_id="0" * 32, namespace="", usable_tokens=1, entry_tokens=1)) is None
    assert len(restores) == 1, "a miss is no restore"
    store.close()
    reopened = SsdStore.open(tmp_path, FINGERPRINT)
    assert _kinds(reopened) == [event.kind for event in events], "the listener saw what the journal holds"
    reopened.close()
