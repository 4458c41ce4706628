"""The Trio/engine thread boundary under real threads, real files and real SQLite.

Three threads use one `SsdStore` the way a server does: an engine thread
restores entries and plans writes (MLX work), a writer thread writes and
commits them (`finish_store`: supersession and eviction unlink files), and a
third thread stands for the Trio thread: it journals actor events and asks
`stats`/`covers`/`find`. Before the journal had one owner, the first overlap
of two transactions on the shared connection degraded it for good ("cannot
start a transaction within a transaction") and `journal verify` failed.
"""

from __future__ import annotations

import json
import queue
import random
import threading

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx_lm.models.cache import make_prompt_cache

from kvcellar.cli import cli
from kvcellar.store import events as ev
from kvcellar.store import kvfile
from kvcellar.store.actor_events import RequestAdmitted
from kvcellar.store.safeguards import SAFEGUARDS
from kvcellar.store.ssd import SsdStore

FINGERPRINT = "b" * 32
ROUNDS = 60
ACTOR_EVENTS = 600
# A handful of the tiny llama's entries: writes evict while restores read.
ENTRY_CAP_BYTES = 1 << 20
DONE = object()


def _prompt(rng: random.Random, stem: list[int]) -> list[int]:
    # Shared stems, so entries supersede one another as well as being evicted.
    return stem[: rng.randrange(8, len(stem))] + [rng.randrange(3, 900) for _ in range(rng.randrange(1, 24))]


def _engine(store: SsdStore, model, writes: queue.Queue, errors: list[BaseException], seed: int) -> None:
    """Restores and write plans, all MLX work on this one thread."""
    rng = random.Random(seed)
    stems = [[rng.randrange(3, 900) for _ in range(64)] for _ in range(3)]
    try:
        for _ in range(ROUNDS):
            tokens = _prompt(rng, rng.choice(stems))
            match = store.find(tokens + [1])
            if match is not None:
                caches = store.restore(match)
                assert caches is None or all(cache.offset == match.usable_tokens for cache in caches)
            cache = make_prompt_cache(model)
            mx.eval(model(mx.array([tokens]), cache=cache))
            pending = store.prepare_store(tokens, cache)
            if pending is not None:
                segments = [pending.writer.materialise_tensor(i) for i in range(pending.writer.tensor_count)]
                writes.put((pending, segments))
    except BaseException as e:  # reported by the test thread
        errors.append(e)
    finally:
        writes.put(DONE)


def _writer(store: SsdStore, writes: queue.Queue, errors: list[BaseException]) -> None:
    """Writes, commits and indexes (unlinking what each entry replaces)."""
    try:
        while (item := writes.get()) is not DONE:
            pending, segments = item
            pending.writer.open()
            for index, tensor_segments in enumerate(segments):
                pending.writer.write_segments(index, tensor_segments)
            pending.writer.commit()
            store.finish_store(pending)
    except BaseException as e:
        errors.append(e)


def test_restores_writes_and_actor_journaling_on_three_threads_keep_the_journal_sound(loaded_model_factory, tmp_path):
    model = loaded_model_factory("llama")[0]
    store = SsdStore.open(tmp_path, FINGERPRINT, bytes_max=ENTRY_CAP_BYTES)
    writes: queue.Queue = queue.Queue(maxsize=4)
    errors: list[BaseException] = []
    engine = threading.Thread(target=_engine, args=(store, model, writes, errors, 7), name="engine")
    writer = threading.Thread(target=_writer, args=(store, writes, errors), name="writer")
    engine.start()
    writer.start()
    for request_id in range(ACTOR_EVENTS):
        store.journal.append(RequestAdmitted(request_id=request_id, prompt_tokens=request_id % 97), actor="gateway")
        store.stats()
        store.covers([request_id % 900 + 3])
    engine.join()
    writer.join()
    assert not errors, errors
    stats = store.stats()
    assert stats["journal"] == {"state": "ok", "reason": None}
    assert stats["restores"] > 0 and stats["entries_stored"] > 0 and stats["evictions"] + stats["supersessions"] > 0
    admitted = list(store.journal.events(kind="request.admitted"))
    assert [record.event.request_id for record in admitted] == list(range(ACTOR_EVENTS))
    assert store.journal.entries() == store.journal.replay()
    store.close()
    result = CliRunner().invoke(cli, ["journal", "verify", "--json", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["mismatches"] == []


@pytest.mark.parametrize("verify", [True, False])
def test_a_restore_of_an_entry_evicted_while_it_was_read_is_the_committed_bytes_or_a_miss(
    loaded_model_factory, tmp_path, verify
):
    """The restore reads outside the lock; an eviction between `find` and the
    read unlinks the file. What comes back is the committed entry or None,
    never a failure counted against the store."""
    model = loaded_model_factory("llama")[0]
    tokens = list(range(5, 45))
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([tokens]), cache=cache))
    store = SsdStore.open(tmp_path, FINGERPRINT, verify=verify)
    entry_id = store.store(tokens, cache)
    match = store.find(tokens + [1])
    assert match is not None and match.entry_id == entry_id
    store.files.unlink_removed(store.index.remove(entry_id, ev.EntryEvicted(entry_id=entry_id, bytes=0)))
    assert store.restore(match) is None
    assert store.stats()["restore_failures"] == 0
    store.close()


def test_a_restore_that_has_its_file_open_when_the_entry_is_evicted_still_returns_the_committed_bytes(
    loaded_model_factory, tmp_path
):
    model = loaded_model_factory("llama")[0]
    tokens = list(range(5, 45))
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([tokens]), cache=cache))
    store = SsdStore.open(tmp_path, FINGERPRINT)
    entry_id = store.store(tokens, cache)
    match = store.find(tokens + [1])
    original_load = kvfile.load

    def load_then_evict(path, verify=True, *, disk=None, safeguards=SAFEGUARDS, **options):
        # The eviction lands while the file is being read: unlinked, still open.
        with open(path, "rb") as handle:
            store.files.unlink_removed(store.index.remove(entry_id, ev.EntryEvicted(entry_id=entry_id, bytes=0)))
            assert not path.exists()
            return original_load(
                f"/proc/self/fd/{handle.fileno()}", verify, disk=disk, safeguards=safeguards, **options
            )

    kvfile.load = load_then_evict
    try:
        restored = store.restore(match)
    finally:
        kvfile.load = original_load
    assert restored is not None and restored[0].offset == len(tokens)
    live_keys = cache[0].state[0][..., : len(tokens), :]
    assert mx.array_equal(restored[0].state[0][..., : len(tokens), :], live_keys).item()
    kinds = [record.kind for record in store.journal.events(entry_id=entry_id)]
    assert kinds == ["entry.stored", "entry.evicted"], "no hit is journaled for an entry already removed"
    store.close()
