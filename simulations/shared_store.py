"""The shared cold tier's simulation: a seeded object-store model under the
real transfers, index, manifest checks and SSD stores.

`SimObjectStore` is an in-memory `ObjectStore` with the properties the commit
protocol relies on or must survive: a conditional put (`If-None-Match: *`,
412 when the key exists), listings that lag behind writes and deletes by a
few operations, uploads lost at a crash (a writer dies before its object or
its manifest lands), and an environment that corrupts objects, deletes
objects whose manifests remain, deletes manifests whose objects remain, and
cuts downloads short. Writer A (and a racing writer C holding the same
entries) upload with `upload_entry`; reader B refreshes a `SharedIndex` from
the lagging listing, checks manifests with `manifest_problem`, and downloads
with `download_entry` into its own `SsdStore` on a `SimDisk`.

The invariant, checked after every download that B adopts and restores: the
adopted bytes are exactly the bytes of an object a committed manifest named
when it was uploaded (a committed, checksum-verified entry), and the restored
caches hold exactly the keys and values of the entry's tokens. A race step
also checks that the loser of a conditional put leaves no object behind.

Deterministic: one `random.Random(seed)` drives every choice; no threads.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from kvcellar.errors import (
    CorruptEntry,
    SharedKeyTaken,
    SharedObjectMissing,
    SharedStoreError,
    SimulatedStoreCrash,
    UnsupportedFormat,
)
from kvcellar.simulations.sim_disk import SimDisk, TickClock
from kvcellar.store.shared_tier import (
    MANIFEST_SUFFIX,
    OBJECT_SUFFIX,
    SharedIndex,
    SharedKeys,
    decode_manifest,
    manifest_problem,
)
from kvcellar.store.shared_transfer import download_entry, fetch_manifest, upload_entry
from kvcellar.store.ssd import SsdStore

FINGERPRINT = "5" * 32
LAYERS, HEADS, DIM = 2, 2, 4
STEPS_PER_RUN = 60


class SimObjectStore:
    """An in-memory object store; see the module docstring."""

    def __init__(self, rng: random.Random, *, listing_lag_ops: int, truncate_probability: float) -> None:
        self.rng = rng
        self.listing_lag_ops = listing_lag_ops
        self.truncate_probability = truncate_probability
        self.objects: dict[str, bytes] = {}
        self.ops = 0
        self.crash_in_ops: int | None = None  # the writer dies at this many mutating calls from now
        self._changes: list[tuple[int, str, bool]] = []  # (op, key, present after) for the lagging listing
        # The truth: each object's sha256 as uploaded, and what each committed manifest named.
        self.uploaded_sha256: dict[str, str] = {}
        self.committed: dict[str, str] = {}

    def _mutate(self, key: str, present: bool) -> None:
        self.ops += 1
        if self.crash_in_ops is not None:
            self.crash_in_ops -= 1
            if self.crash_in_ops <= 0:
                self.crash_in_ops = None
                raise SimulatedStoreCrash(f"writer crashed before writing {key}")
        self._changes.append((self.ops, key, present))

    def exists(self, key: str) -> bool:
        return key in self.objects

    def put_if_absent(self, key: str, body: bytes) -> None:
        if key in self.objects:
            raise SharedKeyTaken(f"{key}: 412")
        self._mutate(key, True)
        self.objects[key] = body
        self.committed[key] = decode_manifest(body, key).object_sha256

    def put_file(self, key: str, reader: io.RawIOBase, length_bytes: int) -> None:
        data = bytearray()
        while len(data) < length_bytes and (chunk := reader.read(length_bytes - len(data))):
            data += chunk
        self._mutate(key, True)
        self.objects[key] = bytes(data)
        self.uploaded_sha256[key] = hashlib.sha256(data).hexdigest()

    def get_bytes(self, key: str) -> bytes:
        if key not in self.objects:
            raise SharedObjectMissing(f"{key}: not in the store")
        return self.objects[key]

    def get_into(self, key: str, sink: Callable[[bytes], None]) -> int:
        data = self.get_bytes(key)
        if self.rng.random() < self.truncate_probability:
            sink(data[: len(data) // 2])
            raise SharedStoreError(f"{key}: partial download")
        sink(data)
        return len(data)

    def list_keys(self, prefix: str) -> list[str]:
        """What a listing shows: the state as of `listing_lag_ops` operations ago."""
        visible: dict[str, bool] = {}
        for op, key, present in self._changes:
            if op <= self.ops - self.listing_lag_ops:
                visible[key] = present
        return sorted(key for key, present in visible.items() if present and key.startswith(prefix))

    def delete(self, key: str) -> None:
        if key in self.objects:
            self._mutate(key, False)
            del self.objects[key]


class BlindHead:
    """An `ObjectStore` view whose HEAD never sees a key: two writers whose
    existence checks both missed, so only the conditional put decides."""

    def __init__(self, inner: SimObjectStore) -> None:
        self._inner = inner

    def exists(self, key: str) -> bool:
        return False

    def put_if_absent(self, key: str, body: bytes) -> None:
        if key in self._inner.objects:
            raise SharedKeyTaken(f"{key}: 412")
        self._inner.put_if_absent(key, body)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@attrs.define
class SharedRunResult:
    seed: int
    counts: dict[str, int]
    failures: list[str]
    log_digest: str


def _caches(tokens: np.ndarray) -> list[Any]:
    """Keys and values that are a function of (token, position, layer): a
    restore is checked against them exactly."""
    caches = []
    positions = np.arange(tokens.size, dtype=np.float32)
    for layer in range(LAYERS):
        base = (tokens.astype(np.float32)[:, None] * 0.01 + positions[:, None] * 0.001 + layer)[None, None]
        keys = np.broadcast_to(base, (1, HEADS, tokens.size, DIM)).astype(np.float32)
        cache = KVCache()
        cache.update_and_fetch(mx.array(keys), mx.array(keys * -1.0))
        caches.append(cache)
    return caches


def _caches_match(caches: list[Any], tokens: np.ndarray) -> bool:
    expected = _caches(tokens)
    for got, want in zip(caches, expected, strict=True):
        if got.offset != want.offset:
            return False
        for got_array, want_array in ((got.keys, want.keys), (got.values, want.values)):
            if not mx.array_equal(got_array[..., : got.offset, :], want_array[..., : want.offset, :]).item():
                return False
    return True


Download = Callable[[SsdStore, Any, Any], str]


class SharedRun:
    """One seeded run: writers A and C, reader B, one object store.
    `download` replaces `download_entry` (a test's deliberately unchecked one
    shows that the invariant catches it)."""

    def __init__(self, seed: int, *, download: Download = download_entry) -> None:
        self.seed = seed
        self.download = download
        self.rng = random.Random(seed)
        self.objects = SimObjectStore(
            random.Random(seed * 7919 + 1), listing_lag_ops=self.rng.randint(0, 3), truncate_probability=0.1
        )
        self.keys = SharedKeys("sim", FINGERPRINT)
        self.index = SharedIndex(self.keys)
        self.readers = 0
        self.families = [[self.rng.randrange(3, 500) for _ in range(48)] for _ in range(6)]
        self.stores = {name: self._store(name) for name in ("a", "b", "c")}
        self.counts: dict[str, int] = dict.fromkeys(
            (
                "stored",
                "uploaded",
                "already_shared",
                "lost_uploads",
                "races",
                "corrupted",
                "expired",
                "manifests_deleted",
                "refreshes",
                "downloads",
                "refused",
                "download_failures",
                "restores_checked",
            ),
            0,
        )
        self.failures: list[str] = []
        self.log: list[str] = []

    def _new_reader_step(self) -> None:
        """A new server joins: B starts over on an empty SSD tier."""
        self.stores["b"].close()
        self.readers += 1
        self.stores["b"] = self._store(f"b{self.readers}")

    def _store(self, name: str) -> SsdStore:
        ids = itertools.count(1)
        return SsdStore.open(
            Path(f"/sim/{name}"),
            FINGERPRINT,
            disk=SimDisk(rng=random.Random(self.seed), clock_ns=TickClock()),
            journal=False,
            clock_ns=TickClock(),
            new_entry_id=lambda: f"{next(ids):032x}",
            owner=f"sim {name}",
        )

    def run(self) -> SharedRunResult:
        steps = {
            "store": self._store_step,
            "upload": self._upload_step,
            "race": self._race_step,
            "corrupt": self._corrupt_step,
            "expire": self._expire_step,
            "delete_manifest": self._delete_manifest_step,
            "refresh": self._refresh_step,
            "query": self._query_step,
            "new_reader": self._new_reader_step,
        }
        weights = [4, 5, 1, 1, 1, 1, 4, 8, 2]
        for _ in range(STEPS_PER_RUN):
            name = self.rng.choices(list(steps), weights)[0]
            self.log.append(name)
            steps[name]()
        for store in self.stores.values():
            store.close()
        digest = hashlib.sha256("\n".join(self.log).encode()).hexdigest()
        return SharedRunResult(seed=self.seed, counts=self.counts, failures=self.failures, log_digest=digest)

    def _tokens(self) -> np.ndarray:
        family = self.rng.choice(self.families)
        return np.asarray(family[: self.rng.randint(8, len(family))], dtype=np.uint32)

    def _store_step(self) -> None:
        tokens = self._tokens()
        for name in ("a", "c"):  # C holds the same entries: a racing writer
            self.stores[name].store(tokens, _caches(tokens))
        self.counts["stored"] += 1

    def _pick_entry(self, name: str) -> Any:
        ids = self.stores[name].entry_ids()
        return self.stores[name].entry(self.rng.choice(ids)) if ids else None

    def _upload_step(self) -> None:
        entry = self._pick_entry("a")
        if entry is None:
            return
        if self.rng.random() < 0.25:
            self.objects.crash_in_ops = self.rng.randint(1, 2)  # lose the object or the manifest
        try:
            outcome = upload_entry(self.stores["a"], self.objects, self.keys, entry, lambda: 1)
        except SimulatedStoreCrash:
            self.counts["lost_uploads"] += 1
            return
        finally:
            self.objects.crash_in_ops = None
        self.counts[outcome.outcome] += 1

    def _race_step(self) -> None:
        """C uploads what A may have committed, both HEADs having missed."""
        entry = self._pick_entry("c")
        if entry is None:
            return
        before = set(self.objects.objects)
        outcome = upload_entry(self.stores["c"], BlindHead(self.objects), self.keys, entry, lambda: 2)
        self.counts["races"] += 1
        if outcome.outcome == "already_shared":
            manifest = decode_manifest(self.objects.objects[outcome.key], outcome.key)
            left = set(self.objects.objects) - before - {manifest.object_key}
            if left:
                self.failures.append(f"seed {self.seed}: the loser of a race left {sorted(left)}")

    def _object_keys(self, suffix: str) -> list[str]:
        return sorted(key for key in self.objects.objects if key.endswith(suffix))

    def _corrupt_step(self) -> None:
        keys = self._object_keys(OBJECT_SUFFIX)
        if keys:
            key = self.rng.choice(keys)
            data = bytearray(self.objects.objects[key])
            data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
            self.objects.objects[key] = bytes(data)
            self.counts["corrupted"] += 1

    def _expire_step(self) -> None:
        keys = self._object_keys(OBJECT_SUFFIX)
        if keys:
            self.objects.delete(self.rng.choice(keys))
            self.counts["expired"] += 1

    def _delete_manifest_step(self) -> None:
        keys = self._object_keys(MANIFEST_SUFFIX)
        if keys:
            self.objects.delete(self.rng.choice(keys))
            self.counts["manifests_deleted"] += 1

    def _refresh_step(self) -> None:
        plan = self.index.plan_refresh(self.objects.list_keys(self.keys.directory))
        for key in plan.gone:
            self.index.remove(key)
        for key in plan.fetch:
            try:
                manifest = fetch_manifest(self.objects, key)
            except SharedObjectMissing:
                continue
            if manifest_problem(manifest, key, self.keys):
                self.index.refuse(key)
            else:
                self.index.add(key, manifest)
        self.counts["refreshes"] += 1

    def _query_step(self) -> None:
        tokens = self._tokens()
        query = np.append(tokens, np.uint32(1))
        match = self.index.best(query, "")
        reader = self.stores["b"]
        local = reader.find(query)
        if match is None or (local is not None and local.usable_tokens >= match.usable_tokens):
            return
        manifest = self.index.manifest(match.manifest_key)
        assert manifest is not None
        try:
            entry_id = self.download(reader, self.objects, manifest)
        except (CorruptEntry, UnsupportedFormat, SharedObjectMissing):
            self.index.refuse(match.manifest_key)
            self.counts["refused"] += 1
            return
        except SharedStoreError:
            self.counts["download_failures"] += 1
            return
        self.counts["downloads"] += 1
        self._check_adopted(reader, entry_id, match.manifest_key, manifest.object_key, query)

    def _check_adopted(self, reader: SsdStore, entry_id: str, key: str, object_key: str, query: np.ndarray) -> None:
        entry = reader.entry(entry_id)
        if entry is None:
            return  # superseded at once by nothing newer cannot happen; evicted is allowed
        disk = reader.disk
        handle = disk.open_read(entry.path)
        try:
            data = bytearray(disk.size(handle))
            disk.read_into(handle, 0, memoryview(data))
        finally:
            disk.close(handle)
        adopted = hashlib.sha256(data).hexdigest()
        if self.objects.committed.get(key) != adopted or self.objects.uploaded_sha256.get(object_key) != adopted:
            self.failures.append(f"seed {self.seed}: adopted {entry_id} is not the committed upload of {key}")
            return
        match = reader.find(query)
        if match is None or match.entry_id != entry_id:
            return
        caches = reader.restore(match)
        self.counts["restores_checked"] += 1
        if caches is None or not _caches_match(caches, entry.tokens[: match.usable_tokens]):
            self.failures.append(f"seed {self.seed}: the restore of {entry_id} does not hold its tokens' caches")


def simulate_shared(seed: int, runs: int, *, download: Download = download_entry) -> list[SharedRunResult]:
    return [SharedRun(seed + offset, download=download).run() for offset in range(runs)]


def summary(results: list[SharedRunResult]) -> dict[str, Any]:
    """The sweep's counts, failures and one digest over every run's step log."""
    counts: dict[str, int] = {}
    for result in results:
        for name, value in result.counts.items():
            counts[name] = counts.get(name, 0) + value
    digest = hashlib.sha256("".join(result.log_digest for result in results).encode()).hexdigest()
    failures = [failure for result in results for failure in result.failures]
    return {"runs": len(results), "failed": len(failures), "failures": failures, "log_digest": digest, **counts}
