"""The shared cold tier's sans-IO core: where objects live, what a manifest
says, the local index of committed manifests and the upload policy.

Layout in the bucket (one fingerprint directory per serving identity, as on SSD):

    PREFIX/<fingerprint>/<ns-hash>/<tokens-sha256>.manifest                 the commit record
    PREFIX/<fingerprint>/<ns-hash>/<tokens-sha256>.<object-sha256:16>.kvc   the entry, byte for byte

Names are content addresses: every server with the same fingerprint derives
the same manifest key for the same tokens in the same namespace (sha256 of
the token ids as little-endian uint32; never Python `hash()`). The object key
also carries a prefix of the object's own sha256, so two writers racing on
one entry never overwrite each other's bytes: whichever manifest commits
names its own object, and the loser deletes its orphan.

A reader trusts an entry only through its manifest: the manifest key must
parse, the manifest must decode, name this fingerprint, the namespace hashing
to its directory, tokens whose sha256 is its name, and an object key in its
own directory; the downloaded bytes must then match the manifest's size and
sha256 and pass the `.kvc` checks (`SsdStore.adopt`).

With a key ring (docs/security.md) a server shares only sealed entries (the
object is the sealed `.kvc` file, byte for byte) under sealed manifests
(format version 2: the token ids sealed, the rest readable), and trusts only
those: a plain manifest would bring a plain file onto its disk. The object and
manifest names stay sha256 of the token ids (every server derives them), so
whoever reads the bucket can confirm a guessed prompt, never read one.

Nothing here does I/O or reads a clock: the shell (`actors.uploader`) passes
`now` in and carries out what the index and the policy decide.
"""

from __future__ import annotations

import collections
import hashlib
import re
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import numpy as np

from kvcellar.errors import CorruptEntry, DecodeError, UsageError
from kvcellar.serialization import from_cbor, to_cbor
from kvcellar.store.prefix_index import PrefixIndex
from kvcellar.store.ssd import namespace_dir_name

MANIFEST_FORMAT_VERSION = 1
# A manifest whose token ids are sealed (`store/sealed_tokens.py`), written by a
# server with a key ring: a build that reads only version 1 refuses it.
SEALED_MANIFEST_FORMAT_VERSION = 2
MANIFEST_SUFFIX = ".manifest"
OBJECT_SUFFIX = ".kvc"
OBJECT_SHA_HEX_CHARS = 16
SECONDS_PER_DAY = 86_400
_HEX64 = re.compile(r"[0-9a-f]{64}")
_NS_HASH = re.compile(r"[0-9a-f]{16}")


def tokens_sha256(tokens: Iterable[int] | np.ndarray) -> str:
    """sha256 (hex) of the token ids as little-endian uint32: the entry's shared name."""
    array = tokens if isinstance(tokens, np.ndarray) else np.fromiter(tokens, dtype=np.int64)
    return hashlib.sha256(np.ascontiguousarray(array, dtype="<u4").tobytes()).hexdigest()


@attrs.frozen(kw_only=True)
class SharedLocation:
    """Where the shared tier lives: `s3://BUCKET/PREFIX` (PREFIX may be empty)."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> SharedLocation:
        """Raises `UsageError` for anything but `s3://BUCKET[/PREFIX]`."""
        scheme, _, rest = url.partition("://")
        bucket, _, prefix = rest.partition("/")
        if scheme != "s3" or not bucket:
            raise UsageError(f"--shared-cache {url!r}: expected s3://BUCKET/PREFIX")
        return cls(bucket=bucket, prefix=prefix.strip("/"))


class SharedKeys:
    """The key names of one fingerprint's directory under a prefix."""

    def __init__(self, prefix: str, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        self.directory = f"{prefix}/{fingerprint}/" if prefix else f"{fingerprint}/"

    def manifest_key(self, namespace: str, tokens_digest: str) -> str:
        return f"{self.directory}{namespace_dir_name(namespace)}/{tokens_digest}{MANIFEST_SUFFIX}"

    def object_key(self, namespace: str, tokens_digest: str, object_sha256: str) -> str:
        return (
            f"{self.directory}{namespace_dir_name(namespace)}/"
            f"{tokens_digest}.{object_sha256[:OBJECT_SHA_HEX_CHARS]}{OBJECT_SUFFIX}"
        )

    def is_manifest_key(self, key: str) -> bool:
        return self._manifest_parts(key) is not None

    def _manifest_parts(self, key: str) -> tuple[str, str] | None:
        if not key.startswith(self.directory) or not key.endswith(MANIFEST_SUFFIX):
            return None
        ns_hash, _, name = key[len(self.directory) : -len(MANIFEST_SUFFIX)].partition("/")
        if not _NS_HASH.fullmatch(ns_hash) or not _HEX64.fullmatch(name):
            return None
        return ns_hash, name


@attrs.frozen(kw_only=True)
class SharedManifest:
    """The commit record of one shared entry: what `find` needs (tokens,
    trimmability, the minimum reusable offset) and what a download is checked
    against (the object's key, size and sha256)."""

    format_version: int
    fingerprint: str
    namespace: str
    tokens_sha256: str
    token_ids: bytes
    object_key: str
    object_bytes: int
    object_sha256: str
    trimmable: bool
    minimum_reusable_offset: int
    created_at_ns: int

    @property
    def tokens(self) -> np.ndarray:
        return np.frombuffer(self.token_ids, dtype="<u4")


def encode_manifest(manifest: SharedManifest) -> bytes:
    return to_cbor(manifest)


def decode_manifest(data: bytes, key: str) -> SharedManifest:
    """Raises `CorruptEntry(part="manifest")` for bytes that are no manifest."""
    try:
        return from_cbor(data, SharedManifest)
    except DecodeError as e:
        raise CorruptEntry(f"{key}: not a manifest: {e}", part="manifest") from e


def manifest_name(fingerprint: str, namespace: str, tokens_digest: str) -> str:
    """What a sealed manifest's token ids are bound to (their AAD)."""
    return f"{fingerprint}/{namespace_dir_name(namespace)}/{tokens_digest}"


def manifest_problem(manifest: SharedManifest, key: str, keys: SharedKeys, *, sealing: bool = False) -> str:
    """Why a manifest listed under `key` (its token ids opened) cannot be
    trusted ("" when it can); `sealing`: this server seals, and trusts only sealed manifests."""
    if sealing and manifest.format_version != SEALED_MANIFEST_FORMAT_VERSION:
        return "a plain manifest, and this server seals (--encryption-key-file): it would store the entry in the clear"
    if manifest.format_version not in (MANIFEST_FORMAT_VERSION, SEALED_MANIFEST_FORMAT_VERSION):
        readable = f"{MANIFEST_FORMAT_VERSION} and {SEALED_MANIFEST_FORMAT_VERSION}"
        return f"manifest format version {manifest.format_version}; this build reads {readable}"
    if manifest.fingerprint != keys.fingerprint:
        return f"fingerprint {manifest.fingerprint!r} is not this directory's"
    if tokens_sha256(manifest.tokens) != manifest.tokens_sha256 or len(manifest.token_ids) % 4:
        return "tokens do not hash to the manifest's tokens digest"
    if keys.manifest_key(manifest.namespace, manifest.tokens_sha256) != key:
        return "manifest does not belong under its key"
    if keys.object_key(manifest.namespace, manifest.tokens_sha256, manifest.object_sha256) != manifest.object_key:
        return "object key is not the one its tokens and sha256 name"
    if manifest.object_bytes <= 0 or not _HEX64.fullmatch(manifest.object_sha256):
        return "implausible object size or sha256"
    return ""


@attrs.frozen(kw_only=True)
class SharedMatch:
    manifest_key: str
    usable_tokens: int
    entry_tokens: int


@attrs.frozen(kw_only=True)
class RefreshPlan:
    """What one listing changes: manifests to fetch, and keys gone from the store."""

    fetch: tuple[str, ...]
    gone: tuple[str, ...]


class SharedIndex:
    """The committed manifests this server knows, one `PrefixIndex` per
    namespace (keyed by manifest key), so `best` is index-only. Refused keys
    (a manifest or object that failed a check) are never fetched again while
    they stay listed. Owned by the Trio thread (the `SharedTier` shell)."""

    def __init__(self, keys: SharedKeys) -> None:
        self.keys = keys
        self._manifests: dict[str, SharedManifest] = {}
        self._indexes: dict[str, PrefixIndex] = {}
        self._refused: set[str] = set()
        self.refreshed_at_s: float | None = None

    def __len__(self) -> int:
        return len(self._manifests)

    def __contains__(self, key: object) -> bool:
        return key in self._manifests

    @property
    def bytes(self) -> int:
        return sum(manifest.object_bytes for manifest in self._manifests.values())

    def manifest(self, key: str) -> SharedManifest | None:
        return self._manifests.get(key)

    def plan_refresh(self, listed_keys: Iterable[str]) -> RefreshPlan:
        """Content-addressed keys do not sort by time, so a listing after the
        last key seen would miss new entries: each refresh lists the
        directory's keys (1000 per request) and fetches only unknown manifests;
        keys no longer listed leave the index (and the refused set)."""
        listed = {key for key in listed_keys if self.keys.is_manifest_key(key)}
        fetch = sorted(listed - self._manifests.keys() - self._refused)
        gone = sorted(self._manifests.keys() - listed)
        self._refused &= listed
        return RefreshPlan(fetch=tuple(fetch), gone=tuple(gone))

    def add(self, key: str, manifest: SharedManifest) -> None:
        if key in self._manifests or key in self._refused:
            return
        self._manifests[key] = manifest
        self._indexes.setdefault(manifest.namespace, PrefixIndex()).add(
            key,
            manifest.tokens,
            trimmable=manifest.trimmable,
            minimum_reusable_offset=manifest.minimum_reusable_offset,
        )

    def remove(self, key: str) -> None:
        manifest = self._manifests.pop(key, None)
        if manifest is not None:
            self._indexes[manifest.namespace].remove(key)

    def selected(self, selects: Callable[[str, np.ndarray], bool]) -> list[tuple[str, SharedManifest]]:
        """The manifests `selects(namespace, tokens)` picks, with their keys (a wipe's shared part)."""
        return [(key, m) for key, m in sorted(self._manifests.items()) if selects(m.namespace, m.tokens)]

    def refuse(self, key: str) -> None:
        """Drop `key` and never fetch it again while it stays listed."""
        self.remove(key)
        self._refused.add(key)

    def best(self, tokens: np.ndarray, namespace: str) -> SharedMatch | None:
        index = self._indexes.get(namespace)
        if index is None or tokens.size < 2:
            return None
        match = index.best(tokens)
        if match is None:
            return None
        return SharedMatch(
            manifest_key=match.entry_id, usable_tokens=match.usable_tokens, entry_tokens=match.entry_tokens
        )


@attrs.frozen(kw_only=True)
class UploadPolicyConfig:
    """An entry is admitted when it holds at least `min_tokens` tokens or has
    been hit `hits_min` times; uploads stop for the day once `bytes_per_day`
    were sent (UTC days); at most `queue_max` entries wait."""

    min_tokens: int = 1024
    hits_min: int = 2
    bytes_per_day: int = 10 * 10**9
    queue_max: int = 64


@attrs.frozen(kw_only=True)
class UploadCandidate:
    entry_id: str
    namespace: str
    token_count: int
    tokens_digest: str
    bytes: int


class UploadPolicy:
    """Admission, the bounded queue and the daily byte budget. `offer`
    answers "queued" or why not; `next_upload` pops the next candidate that
    fits today's budget (returning the ones it skips for the shell to count)."""

    def __init__(self, config: UploadPolicyConfig) -> None:
        self.config = config
        self._queue: collections.OrderedDict[str, UploadCandidate] = collections.OrderedDict()
        self._hits: collections.Counter[str] = collections.Counter()
        self._day = -1
        self.bytes_sent_today = 0

    def __len__(self) -> int:
        return len(self._queue)

    def record_hit(self, entry_id: str) -> int:
        self._hits[entry_id] += 1
        return self._hits[entry_id]

    def forget(self, entry_id: str) -> None:
        self._hits.pop(entry_id, None)

    def offer(self, candidate: UploadCandidate, *, forced: bool = False) -> str:
        """ "queued", "queued_already", "below_admission" or "queue_full".
        `forced` (a shared flush) skips the admission rule, not the bound."""
        if candidate.entry_id in self._queue:
            return "queued_already"
        admitted = (
            candidate.token_count >= self.config.min_tokens or self._hits[candidate.entry_id] >= self.config.hits_min
        )
        if not (admitted or forced):
            return "below_admission"
        if len(self._queue) >= self.config.queue_max:
            return "queue_full"
        self._queue[candidate.entry_id] = candidate
        return "queued"

    def next_upload(self, now_wall_s: float) -> tuple[UploadCandidate | None, list[UploadCandidate]]:
        """The next candidate within today's budget, and those skipped as over it."""
        self._roll_day(now_wall_s)
        over_budget: list[UploadCandidate] = []
        while self._queue:
            _, candidate = self._queue.popitem(last=False)
            if self.bytes_sent_today + candidate.bytes <= self.config.bytes_per_day:
                return candidate, over_budget
            over_budget.append(candidate)
        return None, over_budget

    def charge(self, sent_bytes: int, now_wall_s: float) -> None:
        self._roll_day(now_wall_s)
        self.bytes_sent_today += sent_bytes

    def _roll_day(self, now_wall_s: float) -> None:
        day = int(now_wall_s // SECONDS_PER_DAY)
        if day != self._day:
            self._day, self.bytes_sent_today = day, 0

    def stats(self) -> dict[str, Any]:
        return {
            "upload_queue": len(self._queue),
            "upload_queue_max": self.config.queue_max,
            "upload_bytes_today": self.bytes_sent_today,
            "upload_bytes_per_day": self.config.bytes_per_day,
        }
