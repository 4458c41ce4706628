"""The shared tier's blocking transfers: one upload (entry object, then the
manifest as the commit) and one download (streamed into the SSD tier,
verified, adopted). Each runs in a worker thread (`actors.uploader` calls
them through `trio.to_thread.run_sync`); file access goes through the
store's `Disk`, the network through an `ObjectStore`.

Crash safety of an upload, step by step: before the object lands nothing is
visible; an object without its manifest is never listed as an entry (readers
list manifests) and costs only space; the manifest's conditional put is the
commit point, and it names an object already complete and of known sha256;
a writer that loses the race (412) deletes only its own object, whose key
(carrying its sha256) no committed manifest names.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress

import attrs
import numpy as np

from kvcellar.errors import CorruptEntry, SharedKeyTaken, SharedStoreError, UnsupportedFormat
from kvcellar.store import kvfile
from kvcellar.store.keyring import KeyRing
from kvcellar.store.s3_objects import DiskFileReader, ObjectStore, iter_file_chunks
from kvcellar.store.sealed_tokens import open_manifest_token_ids, seal_manifest_token_ids
from kvcellar.store.shared_tier import (
    MANIFEST_FORMAT_VERSION,
    SEALED_MANIFEST_FORMAT_VERSION,
    SharedKeys,
    SharedManifest,
    decode_manifest,
    encode_manifest,
    manifest_name,
    tokens_sha256,
)
from kvcellar.store.ssd import IndexedEntry, SsdStore


@attrs.frozen(kw_only=True)
class UploadOutcome:
    """`outcome`: "uploaded" or "already_shared"; `sent_bytes` what went out."""

    outcome: str
    key: str
    sent_bytes: int
    manifest: SharedManifest | None = None


def upload_entry(
    store: SsdStore,
    objects: ObjectStore,
    keys: SharedKeys,
    entry: IndexedEntry,
    clock_ns: Callable[[], int],
    pause: Callable[[], None] = lambda: None,
) -> UploadOutcome:
    """Share one local entry. Raises `DiskError` when its file is gone or
    unreadable, `CorruptEntry` when it fails its own checks (never uploaded),
    `UnsupportedFormat` for a plain entry of a store that seals (never shared
    in the clear), `SharedStoreError` when the store fails. `pause` runs
    before each step and each chunk read (the shell holds it while the engine
    decodes). The returned manifest holds the token ids in the clear; the
    stored one, sealed, when the store has a key ring."""
    digest = tokens_sha256(entry.tokens)
    manifest_key = keys.manifest_key(entry.namespace, digest)
    if objects.exists(manifest_key):
        return UploadOutcome(outcome="already_shared", key=manifest_key, sent_bytes=0)
    disk = store.disk
    pause()
    # A bad local file would poison the key for everyone.
    header = kvfile.verify_file(entry.path, disk=disk, keyring=store.keyring)
    if store.keyring is not None and header.seal is None:
        raise UnsupportedFormat(f"{entry.path}: a plain entry is not shared while the store seals")
    handle = disk.open_read(entry.path)
    try:
        size_bytes = disk.size(handle)
        hasher = hashlib.sha256()
        for chunk in iter_file_chunks(disk, handle, size_bytes, pause):
            hasher.update(chunk)
        object_sha256 = hasher.hexdigest()
        object_key = keys.object_key(entry.namespace, digest, object_sha256)
        objects.put_file(object_key, DiskFileReader(disk, handle, size_bytes, pause), size_bytes)
    finally:
        disk.close(handle)
    manifest = SharedManifest(
        format_version=MANIFEST_FORMAT_VERSION,
        fingerprint=keys.fingerprint,
        namespace=entry.namespace,
        tokens_sha256=digest,
        token_ids=np.ascontiguousarray(entry.tokens, dtype="<u4").tobytes(),
        object_key=object_key,
        object_bytes=size_bytes,
        object_sha256=object_sha256,
        trimmable=header.trimmable,
        minimum_reusable_offset=header.minimum_reusable_offset,
        created_at_ns=clock_ns(),
    )
    stored = manifest
    if store.keyring is not None:
        sealed_ids = seal_manifest_token_ids(
            store.keyring.sealing, manifest_name(keys.fingerprint, entry.namespace, digest), manifest.token_ids
        )
        stored = attrs.evolve(manifest, format_version=SEALED_MANIFEST_FORMAT_VERSION, token_ids=sealed_ids)
        manifest = attrs.evolve(manifest, format_version=SEALED_MANIFEST_FORMAT_VERSION)
    try:
        objects.put_if_absent(manifest_key, encode_manifest(stored))
    except SharedKeyTaken:
        _delete_orphan(objects, manifest_key, object_key)
        return UploadOutcome(outcome="already_shared", key=manifest_key, sent_bytes=size_bytes)
    return UploadOutcome(outcome="uploaded", key=manifest_key, sent_bytes=size_bytes, manifest=manifest)


def _delete_orphan(objects: ObjectStore, manifest_key: str, object_key: str) -> None:
    """After a lost race: delete our object unless the winner's manifest names
    the same key (identical bytes). Best effort: a failure leaves an orphan,
    which costs space and nothing else."""
    with suppress(SharedStoreError, CorruptEntry):
        winner = decode_manifest(objects.get_bytes(manifest_key), manifest_key)
        if winner.object_key != object_key:
            objects.delete(object_key)


def fetch_manifest(objects: ObjectStore, key: str, keyring: KeyRing | None = None) -> SharedManifest:
    """The manifest under `key`, a sealed one's token ids opened with
    `keyring`. Raises `SharedObjectMissing`/`SharedStoreError`, `CorruptEntry`
    for a bad manifest (or sealed token ids that fail their tag), and
    `KeyUnavailable` for one sealed under a key the ring lacks."""
    manifest = decode_manifest(objects.get_bytes(key), key)
    if manifest.format_version != SEALED_MANIFEST_FORMAT_VERSION:
        return manifest
    name = manifest_name(manifest.fingerprint, manifest.namespace, manifest.tokens_sha256)
    return attrs.evolve(manifest, token_ids=open_manifest_token_ids(keyring, name, manifest.token_ids))


@attrs.frozen(kw_only=True, eq=False)
class ReceivedEntry:
    """A shared entry's object received into memory, of the manifest's size and sha256."""

    manifest: SharedManifest
    image: bytearray


def receive_entry(objects: ObjectStore, manifest: SharedManifest) -> ReceivedEntry:
    """GET the manifest's object into one buffer of its size, hashing as it
    arrives, for a restore from memory (`kvfile.load_image`) while
    `persist_received` commits it to the SSD tier. Raises `CorruptEntry`
    (part "object") when its size or sha256 differs from the manifest's,
    `SharedStoreError` / `SharedObjectMissing` when the store fails. Nothing
    is written locally, so bytes that fail are not quarantined (the caller
    refuses the key, as for a quarantined download)."""
    image = bytearray(manifest.object_bytes)
    view = memoryview(image)
    hasher = hashlib.sha256()
    received = 0
    # sha256 runs on a helper thread while the next chunk arrives (hashlib and socket reads release the GIL);
    # one worker keeps the chunks in order.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvc-sha256") as hashing:

        def sink(chunk: bytes) -> None:
            nonlocal received
            end = received + len(chunk)
            if end > manifest.object_bytes:
                raise CorruptEntry(f"{manifest.object_key}: longer than its manifest says", part="object")
            view[received:end] = chunk
            hashing.submit(hasher.update, chunk)
            received = end

        objects.get_into(manifest.object_key, sink)
    if received != manifest.object_bytes:
        raise CorruptEntry(
            f"{manifest.object_key}: {received} bytes, its manifest says {manifest.object_bytes}", part="object"
        )
    if hasher.hexdigest() != manifest.object_sha256:
        raise CorruptEntry(f"{manifest.object_key}: sha256 differs from its manifest's", part="object")
    return ReceivedEntry(manifest=manifest, image=image)


def persist_received(store: SsdStore, received: ReceivedEntry) -> str:
    """Commit received bytes to the SSD tier exactly as `download_entry`
    commits streamed ones (`SsdStore.adopt`: temp file, fsync, header checks,
    rename, directory fsync, index, `entry.stored`); returns the entry id.
    It only reads `received.image`, so a restore from the same buffer may run
    beside it."""
    manifest = received.manifest

    def fill(write: Callable[[memoryview | bytes], None]) -> None:
        write(memoryview(received.image))

    return store.adopt(manifest.namespace, manifest.tokens, fill, verify_tensors=False)


def download_entry(store: SsdStore, objects: ObjectStore, manifest: SharedManifest) -> str:
    """Stream the manifest's object into the SSD tier and adopt it; returns
    the local entry id. The bytes must match the manifest's size and sha256
    and pass the `.kvc` header checks, else they are quarantined and
    `CorruptEntry` raised; a broken or partial stream raises `SharedStoreError` (nothing kept).
    A wipe not done when the stream began refuses the adopted entry (`SsdStore.wipe_seq`)."""
    fetched_since = store.wipe_seq()
    hasher = hashlib.sha256()
    received = 0

    def fill(write: Callable[[memoryview | bytes], None]) -> None:
        nonlocal received

        def sink(chunk: bytes) -> None:
            nonlocal received
            received += len(chunk)
            if received > manifest.object_bytes:
                raise CorruptEntry(f"{manifest.object_key}: longer than its manifest says", part="object")
            hasher.update(chunk)
            write(chunk)

        # A stream that breaks before its Content-Length raises SharedStoreError
        # in get_into; one that completes at another size is another object.
        objects.get_into(manifest.object_key, sink)
        if received != manifest.object_bytes:
            raise CorruptEntry(
                f"{manifest.object_key}: {received} bytes, its manifest says {manifest.object_bytes}", part="object"
            )
        if hasher.hexdigest() != manifest.object_sha256:
            raise CorruptEntry(f"{manifest.object_key}: sha256 differs from its manifest's", part="object")

    # The whole object's sha256 matched the manifest, whose writer verified
    # every tensor before uploading, and every restore verifies them again:
    # adoption checks the header, size, fingerprint, namespace and tokens.
    return store.adopt(manifest.namespace, manifest.tokens, fill, verify_tensors=False, fetched_since=fetched_since)
