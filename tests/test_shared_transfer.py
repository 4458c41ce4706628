"""The shared tier's transfers, index and policy below the server: real SSD
stores of a real tiny model's caches, real boto3 against moto's server mode
on 127.0.0.1 (the commit protocol's races, the download checks), and the
sans-IO core on its own."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import pytest
from moto.server import ThreadedMotoServer
from polling import wait_until_sync
from test_shared_tier import _credentials_and_bucket
from test_ssd import BASE, FINGERPRINT, _prefill

from kvcellar.errors import CorruptEntry, SharedKeyTaken, UsageError
from kvcellar.store import kvfile
from kvcellar.store.s3_objects import S3ObjectStore
from kvcellar.store.shared_tier import (
    MANIFEST_FORMAT_VERSION,
    SharedIndex,
    SharedKeys,
    SharedLocation,
    SharedManifest,
    UploadCandidate,
    UploadPolicy,
    UploadPolicyConfig,
    decode_manifest,
    encode_manifest,
    manifest_problem,
    tokens_sha256,
)
from kvcellar.store.shared_transfer import (
    download_entry,
    fetch_manifest,
    persist_received,
    receive_entry,
    upload_entry,
)
from kvcellar.store.ssd import QUARANTINE_DIR_NAME, SsdStore


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def objects(moto_url: str, monkeypatch: pytest.MonkeyPatch) -> S3ObjectStore:
    bucket = _credentials_and_bucket(moto_url, monkeypatch)
    return S3ObjectStore.open(bucket, endpoint_url=moto_url, connect_timeout_s=1, read_timeout_s=5, max_attempts=2)


@pytest.fixture
def llama(loaded_model_factory):
    return loaded_model_factory("llama")[0]


KEYS = SharedKeys("team", FINGERPRINT)


def _stored(tmp_path, name: str, llama, tokens=BASE) -> tuple[SsdStore, Any]:
    store = SsdStore.open(tmp_path / name, FINGERPRINT)
    entry_id = store.store(tokens, _prefill(llama, tokens)[0])
    return store, store.entry(entry_id)


def _bucket_keys(objects: S3ObjectStore) -> list[str]:
    return sorted(objects.list_keys(""))


class RacingObjects(S3ObjectStore):
    """Two writers that both miss each other's manifest: every HEAD says
    "absent" and both wait at a barrier once their objects are up, so the
    conditional put alone decides (moto answers the loser 412)."""

    def __init__(self, inner: S3ObjectStore, barrier: threading.Barrier) -> None:
        super().__init__(inner._client, inner.bucket)
        self._barrier = barrier

    def exists(self, key: str) -> bool:
        return False

    def put_file(self, key: str, reader: Any, length_bytes: int) -> None:
        super().put_file(key, reader, length_bytes)
        self._barrier.wait(timeout=30)


def test_concurrent_uploads_of_one_entry_leave_one_object_and_one_manifest(tmp_path, llama, objects):
    stores = [_stored(tmp_path, name, llama) for name in ("a", "b")]
    barrier = threading.Barrier(2)
    racing = RacingObjects(objects, barrier)
    outcomes: list[Any] = [None, None]

    def upload(index: int) -> None:
        store, entry = stores[index]
        outcomes[index] = upload_entry(store, racing, KEYS, entry, lambda: 1)

    threads = [threading.Thread(target=upload, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(outcome.outcome for outcome in outcomes) == ["already_shared", "uploaded"]
    assert all(outcome.sent_bytes > 0 for outcome in outcomes)  # both objects went up; the loser deleted its own
    keys = _bucket_keys(objects)
    assert [key.rsplit(".", 1)[1] for key in keys] == ["kvc", "manifest"]
    winner = fetch_manifest(objects, keys[1])
    assert winner.object_key == keys[0]
    with pytest.raises(SharedKeyTaken):
        objects.put_if_absent(keys[1], b"another manifest")
    for store, _ in stores:
        store.close()


def test_a_download_is_verified_adopted_and_restores_the_same_caches(tmp_path, llama, objects):
    source, entry = _stored(tmp_path, "a", llama)
    shared = upload_entry(source, objects, KEYS, entry, lambda: 1)
    assert shared.outcome == "uploaded" and shared.manifest is not None
    target = SsdStore.open(tmp_path / "b", FINGERPRINT)
    entry_id = download_entry(target, objects, shared.manifest)
    match = target.find(BASE + [7])
    assert match is not None and match.entry_id == entry_id and match.usable_tokens == len(BASE)
    restored = target.restore(match)
    assert restored is not None and restored[0].offset == len(BASE)
    assert upload_entry(target, objects, KEYS, target.entry(entry_id), lambda: 2).outcome == "already_shared"
    source.close()
    target.close()


def test_received_bytes_restore_while_they_are_persisted_behind(tmp_path, llama, objects):
    source, entry = _stored(tmp_path, "a", llama)
    shared = upload_entry(source, objects, KEYS, entry, lambda: 1)
    assert shared.manifest is not None
    received = receive_entry(objects, shared.manifest)
    assert bytes(received.image) == entry.path.read_bytes()
    target = SsdStore.open(tmp_path / "b", FINGERPRINT)
    persisted: list[str] = []
    persist = threading.Thread(target=lambda: persisted.append(persist_received(target, received)))
    persist.start()
    from_memory = kvfile.load_image(received.image)
    persist.join(timeout=60)
    from_file = kvfile.load(entry.path)
    assert from_memory.tokens == from_file.tokens == tuple(BASE)
    for a, b in zip(from_memory.caches, from_file.caches, strict=True):
        assert all(np.array_equal(np.array(x), np.array(y)) for x, y in zip(a.state, b.state, strict=True))
    match = target.find(BASE + [7])
    assert match is not None and [match.entry_id] == persisted == target.entry_ids()
    assert target.entry(persisted[0]).path.read_bytes() == bytes(received.image)
    source.close()
    target.close()


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_received_bytes_that_do_not_match_the_manifest_are_refused_and_nothing_is_written(
    tmp_path, llama, objects, damage
):
    source, entry = _stored(tmp_path, "a", llama)
    manifest = upload_entry(source, objects, KEYS, entry, lambda: 1).manifest
    assert manifest is not None
    data = bytearray(objects.get_bytes(manifest.object_key))
    if damage == "flipped":
        data[len(data) // 2] ^= 0x01
    else:
        del data[len(data) // 2 :]
    objects._client.put_object(Bucket=objects.bucket, Key=manifest.object_key, Body=bytes(data))
    with pytest.raises(CorruptEntry) as refused:
        receive_entry(objects, manifest)
    assert refused.value.part == "object"
    source.close()


def test_an_image_with_a_damaged_tensor_names_it_like_a_file_does(tmp_path, llama):
    store, entry = _stored(tmp_path, "a", llama)
    header = kvfile.read_header(entry.path)
    record = next(iter(header.tensor_records()))
    image = bytearray(entry.path.read_bytes())
    image[record.file_offset + record.length // 2] ^= 0x10
    for staged in (False, True):
        with pytest.raises(CorruptEntry) as caught:
            kvfile.load_image(image, staged=staged)
        assert caught.value.part == f"tensor {record.name}"
    store.close()


@pytest.mark.parametrize("damage", ["flipped", "truncated", "other_tokens"])
def test_an_object_that_does_not_match_its_manifest_is_quarantined_never_indexed(tmp_path, llama, objects, damage):
    source, entry = _stored(tmp_path, "a", llama)
    shared = upload_entry(source, objects, KEYS, entry, lambda: 1)
    manifest = shared.manifest
    assert manifest is not None
    data = bytearray(objects.get_bytes(manifest.object_key))
    if damage == "flipped":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncated":
        del data[len(data) // 2 :]
    else:
        # A well-formed entry of other tokens under this manifest: its sha256 and size made to match.
        other_store, other = _stored(tmp_path, "c", llama, tokens=BASE[:40] + [9] * 40)
        data = bytearray(other.path.read_bytes())
        other_store.close()
        manifest = attrs.evolve(manifest, object_sha256=hashlib.sha256(data).hexdigest(), object_bytes=len(data))
    objects._client.put_object(Bucket=objects.bucket, Key=manifest.object_key, Body=bytes(data))
    target = SsdStore.open(tmp_path / "b", FINGERPRINT)
    with pytest.raises(CorruptEntry):
        download_entry(target, objects, manifest)
    assert target.entry_ids() == [] and target.find(BASE + [7]) is None
    assert len(list((target.directory / QUARANTINE_DIR_NAME).iterdir())) == 1
    assert not [path for path in target.directory.rglob("*.tmp") if path.parent.name != QUARANTINE_DIR_NAME]
    source.close()
    target.close()


def test_manifests_are_checked_against_their_keys():
    tokens = np.asarray(BASE, dtype=np.uint32)
    digest = tokens_sha256(tokens)
    key = KEYS.manifest_key("", digest)
    good = decode_manifest(
        encode_manifest(
            _manifest(tokens, digest, object_key=KEYS.object_key("", digest, "a" * 64)),
        ),
        key,
    )
    assert manifest_problem(good, key, KEYS) == ""
    assert "fingerprint" in manifest_problem(good, key, SharedKeys("team", "e" * 32))
    assert "belong" in manifest_problem(good, KEYS.manifest_key("other", digest), KEYS)
    bad_object = _manifest(tokens, digest, object_key="team/elsewhere.kvc")
    assert "object key" in manifest_problem(bad_object, key, KEYS)
    lying = _manifest(tokens[:-1], digest, object_key=KEYS.object_key("", digest, "a" * 64))
    assert "tokens" in manifest_problem(lying, key, KEYS)
    with pytest.raises(CorruptEntry):
        decode_manifest(b"not cbor at all", key)
    with pytest.raises(UsageError):
        SharedLocation.parse("https://bucket/prefix")
    assert SharedLocation.parse("s3://bucket/a/b/") == SharedLocation(bucket="bucket", prefix="a/b")


def _manifest(tokens: np.ndarray, digest: str, *, object_key: str) -> SharedManifest:
    return SharedManifest(
        format_version=MANIFEST_FORMAT_VERSION,
        fingerprint=FINGERPRINT,
        namespace="",
        tokens_sha256=digest,
        token_ids=np.ascontiguousarray(tokens, dtype="<u4").tobytes(),
        object_key=object_key,
        object_bytes=100,
        object_sha256="a" * 64,
        trimmable=True,
        minimum_reusable_offset=0,
        created_at_ns=1,
    )


def test_the_shared_index_follows_listings_and_never_refetches_a_refused_key():
    tokens = np.asarray(BASE, dtype=np.uint32)
    digest = tokens_sha256(tokens)
    key = KEYS.manifest_key("", digest)
    other_key = KEYS.manifest_key("", tokens_sha256(tokens[:10]))
    index = SharedIndex(KEYS)
    plan = index.plan_refresh([key, other_key, "team/unrelated.txt", KEYS.object_key("", digest, "a" * 64)])
    assert plan.fetch == tuple(sorted([key, other_key])) and plan.gone == ()
    index.add(key, _manifest(tokens, digest, object_key=KEYS.object_key("", digest, "a" * 64)))
    index.refuse(other_key)
    match = index.best(np.asarray(BASE + [1], dtype=np.uint32), "")
    assert match is not None and match.manifest_key == key and match.usable_tokens == len(BASE)
    assert index.plan_refresh([key, other_key]).fetch == ()
    assert index.plan_refresh([]).gone == (key,)
    index.remove(key)
    assert index.best(np.asarray(BASE + [1], dtype=np.uint32), "") is None
    assert index.plan_refresh([other_key]).fetch == (other_key,)  # refused only while it stayed listed


def _candidate(entry_id: str, token_count: int, size_bytes: int = 100) -> UploadCandidate:
    return UploadCandidate(
        entry_id=entry_id, namespace="", token_count=token_count, tokens_digest=entry_id, bytes=size_bytes
    )


def test_the_upload_policy_admits_bounds_and_budgets():
    policy = UploadPolicy(UploadPolicyConfig(min_tokens=100, hits_min=2, bytes_per_day=250, queue_max=3))
    assert policy.offer(_candidate("short", 10)) == "below_admission"
    policy.record_hit("short")
    policy.record_hit("short")
    assert policy.offer(_candidate("short", 10)) == "queued"
    assert policy.offer(_candidate("short", 10)) == "queued_already"
    assert policy.offer(_candidate("flushed", 10), forced=True) == "queued"
    assert policy.offer(_candidate("long", 100, size_bytes=200)) == "queued"
    assert policy.offer(_candidate("more", 500)) == "queue_full"
    day_s = 86_400.0 * 20_000
    first, skipped = policy.next_upload(day_s)
    assert first is not None and first.entry_id == "short" and skipped == []
    policy.charge(100, day_s)
    second, _ = policy.next_upload(day_s)
    assert second is not None and second.entry_id == "flushed"
    policy.charge(100, day_s)
    third, skipped = policy.next_upload(day_s + 1)
    assert third is None and [c.entry_id for c in skipped] == ["long"]  # 200 + 200 > 250 today
    assert policy.offer(_candidate("long", 100, size_bytes=200)) == "queued"
    tomorrow, _ = policy.next_upload(day_s + 86_400)
    assert tomorrow is not None and tomorrow.entry_id == "long" and policy.bytes_sent_today == 0


def test_an_upload_holds_before_every_step_and_chunk_while_told_to(tmp_path, llama, objects):
    """The shell's pause (held while the gateway is busy) runs before the
    verification, each hashing chunk and each read botocore makes; while it
    holds, nothing reaches the store."""
    store, entry = _stored(tmp_path, "a", llama)
    may_go = threading.Event()
    pauses: list[int] = []

    def pause() -> None:
        pauses.append(len(_bucket_keys(objects)))
        may_go.wait(timeout=30)

    outcome: list[Any] = []

    def upload() -> None:
        outcome.append(upload_entry(store, objects, KEYS, entry, lambda: 1, pause))

    thread = threading.Thread(target=upload)
    thread.start()
    wait_until_sync(lambda: len(pauses) == 1, what="the upload holding at its first pause")
    assert thread.is_alive() and _bucket_keys(objects) == []  # it holds there until told to go
    may_go.set()
    thread.join(timeout=60)
    assert outcome[0].outcome == "uploaded" and len(pauses) >= 3
    assert pauses[0] == 0 and len(_bucket_keys(objects)) == 2
    store.close()
