"""The startup scan's speed measures (issue 23, item 4) keep its outcome: the
cyclic garbage collector is paused only over the scan and restored after,
even when the scan fails; the journal's projection is read on its own thread
while the scan lists directories; the index built is the same either way."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from kvcellar.store import kvfile
from kvcellar.store.disk import DirEntry, RealDisk
from kvcellar.store.journal import InlineRunner, Journal, JournalThread
from kvcellar.store.ssd import SsdStore

FINGERPRINT = "f" * 32


def _caches(rows: int) -> list[KVCache]:
    cache, shape = KVCache(), (1, 1, rows, 4)
    cache.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
    mx.eval(cache.keys, cache.values)
    return [cache]


def _stored_tree(root: Path) -> dict[str, list[int]]:
    store = SsdStore.open(root, FINGERPRINT)
    tokens_by_id = {}
    for number in range(6):
        tokens = [number + 1] * 3 + list(range(10 * number, 10 * number + 9))
        entry_id = store.store(tokens, _caches(len(tokens)))
        assert entry_id is not None
        tokens_by_id[entry_id] = tokens
    store.close()
    return tokens_by_id


class GcWatchingDisk(RealDisk):
    """Records whether automatic collection was on at each directory listing."""

    def __init__(self) -> None:
        super().__init__()
        self.gc_enabled_at_scandir: list[bool] = []

    def scandir(self, path: Path) -> list[DirEntry]:
        self.gc_enabled_at_scandir.append(gc.isenabled())
        return super().scandir(path)


class FailingScanDisk(RealDisk):
    def scandir(self, path: Path) -> list[DirEntry]:
        raise RuntimeError("listing failed")


@pytest.fixture()
def gc_state_restored() -> Iterator[None]:
    was_enabled = gc.isenabled()
    yield
    if was_enabled:
        gc.enable()
    else:
        gc.disable()


@pytest.mark.parametrize("journal", [True, False])
def test_the_scan_runs_with_collection_paused_and_restores_it(tmp_path, journal, gc_state_restored):
    tokens_by_id = _stored_tree(tmp_path)
    gc.enable()
    disk = GcWatchingDisk()
    store = SsdStore.open(tmp_path, FINGERPRINT, disk=disk, journal=journal)
    try:
        assert disk.gc_enabled_at_scandir and not any(disk.gc_enabled_at_scandir)
        assert gc.isenabled()
        assert sorted(store.entry_ids()) == sorted(tokens_by_id)
        for entry_id, tokens in tokens_by_id.items():
            assert store.entry(entry_id).tokens.tolist() == tokens
    finally:
        store.close()


def test_a_caller_that_had_collection_off_keeps_it_off(tmp_path, gc_state_restored):
    _stored_tree(tmp_path)
    gc.disable()
    SsdStore.open(tmp_path, FINGERPRINT).close()
    assert not gc.isenabled()


def test_a_failing_scan_still_restores_collection(tmp_path, gc_state_restored):
    _stored_tree(tmp_path)
    gc.enable()
    with pytest.raises(RuntimeError, match="listing failed"):
        SsdStore.open(tmp_path, FINGERPRINT, disk=FailingScanDisk())
    assert gc.isenabled()
    SsdStore.open(tmp_path, FINGERPRINT).close()  # the failed open released its lock


def test_read_header_takes_a_path_or_a_string_alike(tmp_path):
    entry_id = next(iter(_stored_tree(tmp_path)))
    (path,) = tmp_path.glob(f"*/*/{entry_id}{kvfile.FILE_SUFFIX}")
    assert kvfile.read_header(path) == kvfile.read_header(str(path))


LISTING_WAIT_S = 30.0


class ListingSignalDisk(RealDisk):
    """Sets `listed` once a namespace directory (below the fingerprint one) is listed."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory
        self.listed = threading.Event()

    def scandir(self, path: Path) -> list[DirEntry]:
        listing = super().scandir(path)
        if path.parent == self.directory:
            self.listed.set()
        return listing


class ProjectionAfterListingRunner(JournalThread):
    """A real journal thread whose deferred reads first wait for the scan's
    first namespace listing: an open that waited for the projection before
    listing would stall here until the wait gave up."""

    def __init__(self, listed: threading.Event) -> None:
        super().__init__()
        self.listed = listed
        self.waited: list[bool] = []

    def call_later(self, work):
        def after_listing():
            self.waited.append(self.listed.wait(LISTING_WAIT_S))
            return work()

        return super().call_later(after_listing)


def test_the_projection_is_read_while_the_scan_lists_directories(tmp_path):
    tokens_by_id = _stored_tree(tmp_path)
    directory = tmp_path / FINGERPRINT
    disk = ListingSignalDisk(directory)
    runner = ProjectionAfterListingRunner(disk.listed)

    def opener(path: Path) -> Journal:
        return Journal.open(path, runner=runner)

    store = SsdStore.open(tmp_path, FINGERPRINT, disk=disk, journal_opener=opener)
    try:
        assert runner.waited == [True]
        assert sorted(store.entry_ids()) == sorted(tokens_by_id)
        # Every file matched the projection: the reconciliation had nothing to correct.
        kinds = [record.kind for record in store.journal.events()]
        assert not [kind for kind in kinds if kind.startswith("reconcile")]
    finally:
        store.close()


@pytest.mark.parametrize("runner_class", [JournalThread, InlineRunner])
def test_call_later_returns_the_result_or_raises_what_the_work_raised(runner_class):
    runner = runner_class()
    try:
        assert runner.call_later(lambda: 41 + 1)() == 42
        if runner_class is JournalThread:
            failing = runner.call_later(lambda: 1 // 0)
            with pytest.raises(ZeroDivisionError):
                failing()
    finally:
        runner.close()
