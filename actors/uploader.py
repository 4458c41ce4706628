"""The shared cold tier's Trio shell (`SharedTier`): the shared index's
refreshes, the background uploads and the downloads a request may wait for.

Owner of the `SharedIndex`, the `UploadPolicy` and the counters: the Trio
thread. The SSD store's event listener runs on whatever thread changes the
store (under its lock), so it only forwards through `run_sync_soon`. Every
object-store call and every file access runs off the Trio thread
(`run_blocking`, a worker thread), never on the engine thread.

- Refresh: at start (a request waits at most `request_timeout_s` for it) and
  every `refresh_s`: list the fingerprint's keys, fetch unknown manifests,
  check them (`manifest_problem`), drop what is no longer listed.
- Upload: an `entry.stored` of the SSD tier (or a second hit) offers the entry
  to the policy; one worker uploads the queue one entry at a time, each
  started only while the gateway is idle (no request or batch row active or
  waiting) and held between two chunks while it is busy, so an upload's
  reads and sends do not compete with a decode. A failure is
  counted and journaled; the entry is offered again on its next hit or flush.
- Download: before a request is dispatched, a usable prefix in the shared
  index longer than the SSD tier's by `download_min_gain_tokens` starts one
  download (one per key at a time) in the tier's own nursery; the request
  waits for it at most `request_timeout_s`, then goes on (the download
  finishes in the background and serves the next request). A key whose
  download failed is not tried again before an exponential backoff passes;
  one that failed a check is refused for as long as it stays listed.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from typing import Any

import attrs
import numpy as np
import trio

from kvcellar.errors import (
    CorruptEntry,
    DiskError,
    KeyUnavailable,
    SharedObjectMissing,
    SharedStoreError,
    UnsupportedFormat,
)
from kvcellar.store import events as ev
from kvcellar.store import shared_events as sev
from kvcellar.store.restore_origin import RestoreOrigins
from kvcellar.store.s3_objects import ObjectStore
from kvcellar.store.shared_tier import (
    SharedIndex,
    SharedKeys,
    UploadCandidate,
    UploadPolicy,
    UploadPolicyConfig,
    manifest_problem,
    tokens_sha256,
)
from kvcellar.store.shared_transfer import download_entry, fetch_manifest, upload_entry
from kvcellar.store.ssd import SsdStore

log = logging.getLogger("kvcellar.shared")

RunBlocking = Callable[..., Awaitable[Any]]


@attrs.frozen(kw_only=True)
class SharedCacheConfig:
    """`url` is `s3://BUCKET/PREFIX`; the timeouts bound each attempt, botocore
    retries `max_attempts` times, and no request waits on the tier longer
    than `request_timeout_s`."""

    url: str
    endpoint_url: str | None = None
    refresh_s: float = 30.0
    request_timeout_s: float = 5.0
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 20.0
    max_attempts: int = 3
    idle_poll_s: float = 0.05
    # An upload holds between two chunks while the gateway is busy, at most
    # this long at a time (an S3 server drops a connection idle for ~20 s).
    upload_pause_max_s: float = 15.0
    retry_s: float = 5.0
    retry_max_s: float = 300.0
    # A download must gain this many tokens over the SSD tier's match: a
    # shared chat-template preamble alone is no reason to fetch a whole entry.
    download_min_gain_tokens: int = 256
    upload: UploadPolicyConfig = attrs.field(factory=UploadPolicyConfig)


@attrs.define(kw_only=True)
class SharedCounters:
    uploads: int = 0
    upload_bytes: int = 0
    # Of `upload_bytes` and `download_bytes`, the entries' companion sections (the draft model's KV, issue 42).
    upload_companion_bytes: int = 0
    already_shared: int = 0  # the manifest existed when asked, or the conditional put answered 412
    conflicts_412: int = 0
    upload_failures: int = 0
    upload_over_budget: int = 0
    upload_queue_full: int = 0
    below_admission: int = 0
    downloads: int = 0
    download_bytes: int = 0
    download_companion_bytes: int = 0
    download_failures: int = 0
    download_timeouts: int = 0
    refused: int = 0  # manifests or objects that failed a check; refused objects are quarantined
    listing_failures: int = 0
    refreshes: int = 0


class SharedTier:
    """Start with `nursery.start(tier.run)`; then `before_request`, `flush`, `stats`."""

    def __init__(
        self,
        store: SsdStore,
        objects: ObjectStore,
        keys: SharedKeys,
        config: SharedCacheConfig,
        *,
        gateway_busy: Callable[[], bool],
        journal: Any = None,
        run_blocking: RunBlocking = trio.to_thread.run_sync,
        clock_wall_s: Callable[[], float] = time.time,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.store = store
        self.objects = objects
        self.keys = keys
        self.config = config
        self.index = SharedIndex(keys)
        self.policy = UploadPolicy(config.upload)
        self.counters = SharedCounters()
        self.origins = RestoreOrigins()
        self._gateway_busy = gateway_busy
        self._journal = journal
        self._run_blocking = run_blocking
        self._clock_wall_s = clock_wall_s
        self._clock_ns = clock_ns
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._upload_wanted = trio.Event()
        self._uploads_settled = trio.Event()
        self._uploads_settled.set()
        self._uploading = 0
        self._first_refresh = trio.Event()
        self._downloads: dict[str, trio.Event] = {}
        self._backoff: dict[str, tuple[float, float]] = {}  # key -> (not before, last delay)
        # Set while the gateway is idle: the upload's worker thread waits on it between chunks.
        self._engine_idle = threading.Event()

    # -- running -------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self.store.add_event_listener(self._listen)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._refresh_forever)
            nursery.start_soon(self._upload_forever)
            nursery.start_soon(self._track_idle_forever)
            task_status.started()

    async def _refresh_forever(self) -> None:
        await self.refresh()
        self._first_refresh.set()
        # Entries the SSD tier held before this start are candidates too.
        for entry_id in self.store.entry_ids():
            entry = self.store.entry(entry_id)
            if entry is not None:
                self._offer(self._candidate(entry_id, entry.namespace, entry.tokens, entry.bytes))
        while True:
            await trio.sleep(self.config.refresh_s)
            await self.refresh()

    async def refresh(self) -> None:
        """List the fingerprint directory and bring the index in line with it."""
        try:
            listed = await self._run_blocking(self.objects.list_keys, self.keys.directory)
        except SharedStoreError as e:
            self.counters.listing_failures += 1
            log.warning("shared cache: listing failed (serving goes on without new entries): %s", e)
            return
        plan = self.index.plan_refresh(listed)
        for key in plan.gone:
            self.index.remove(key)
        for key in plan.fetch:
            if not await self._fetch_into_index(key):
                return
        self.counters.refreshes += 1
        self.index.refreshed_at_s = trio.current_time()

    async def _fetch_into_index(self, key: str) -> bool:
        """Fetch, check and index one manifest; False when the store failed."""
        try:
            manifest = await self._run_blocking(fetch_manifest, self.objects, key, self.store.keyring)
        except SharedObjectMissing:
            return True  # deleted since the listing
        except (CorruptEntry, KeyUnavailable) as e:
            self._refuse(key, "manifest", str(e))
            return True
        except SharedStoreError as e:
            self.counters.listing_failures += 1
            log.warning("shared cache: fetching %s failed: %s", key, e)
            return False
        problem = manifest_problem(manifest, key, self.keys, sealing=self.store.keyring is not None)
        if problem:
            self._refuse(key, "manifest", problem)
        else:
            self.index.add(key, manifest)
        return True

    def _refuse(self, key: str, what: str, reason: str) -> None:
        self.index.refuse(key)
        self.counters.refused += 1
        log.warning("shared cache: refusing %s %s: %s", what, key, reason)
        self._record(sev.SharedRefused(key=key, what=what, reason=reason))

    def _record(self, event: Any) -> None:
        if self._journal is not None:
            self._journal.append(event, actor="shared")

    # -- uploads ---------------------------------------------------------------

    def _listen(self, event: ev.Event) -> None:
        """The SSD store's listener: any thread, under the store's lock; forwards only."""
        token = self._token
        if token is None:
            return
        with suppress(trio.RunFinishedError):
            if isinstance(event, ev.EntryStored):
                fields = event.entry
                tokens = np.frombuffer(fields.token_ids, dtype="<u4")
                candidate = self._candidate(fields.entry_id, fields.namespace, tokens, fields.bytes)
                token.run_sync_soon(self._offer, candidate)
            elif isinstance(event, ev.EntryHit):
                token.run_sync_soon(self._hit, event.entry_id)
            elif isinstance(event, ev.EntrySuperseded | ev.EntryEvicted):
                token.run_sync_soon(self.policy.forget, event.entry_id)
                token.run_sync_soon(self.origins.forget, event.entry_id)
            elif isinstance(event, ev.EntryRestored):
                token.run_sync_soon(self._restored, event.entry_id, event.usable_tokens)

    def _restored(self, entry_id: str, usable_tokens: int) -> None:
        self._record(self.origins.restored(entry_id, usable_tokens))

    def _candidate(self, entry_id: str, namespace: str, tokens: np.ndarray, size_bytes: int) -> UploadCandidate:
        return UploadCandidate(
            entry_id=entry_id,
            namespace=namespace,
            token_count=int(tokens.size),
            tokens_digest=tokens_sha256(tokens),
            bytes=size_bytes,
        )

    def _hit(self, entry_id: str) -> None:
        if self.policy.record_hit(entry_id) != self.config.upload.hits_min:
            return
        entry = self.store.entry(entry_id)
        if entry is not None:
            self._offer(self._candidate(entry_id, entry.namespace, entry.tokens, entry.bytes))

    def _offer(self, candidate: UploadCandidate, *, forced: bool = False) -> None:
        if self.keys.manifest_key(candidate.namespace, candidate.tokens_digest) in self.index:
            return  # shared already (by us, or downloaded from there)
        decision = self.policy.offer(candidate, forced=forced)
        if decision == "below_admission":
            self.counters.below_admission += 1
        elif decision == "queue_full":
            self.counters.upload_queue_full += 1
            self._skipped(candidate, "queue_full")
        elif decision == "queued":
            self._uploads_settled = trio.Event() if self._uploads_settled.is_set() else self._uploads_settled
            self._upload_wanted.set()

    def _skipped(self, candidate: UploadCandidate, reason: str, detail: str = "") -> None:
        key = self.keys.manifest_key(candidate.namespace, candidate.tokens_digest)
        self._record(sev.SharedUploadSkipped(entry_id=candidate.entry_id, key=key, reason=reason, detail=detail))

    async def _track_idle_forever(self) -> None:
        """Mirror the gateway's busy state into `_engine_idle` for the worker thread."""
        while True:
            if self._gateway_busy():
                self._engine_idle.clear()
            else:
                self._engine_idle.set()
            await trio.sleep(self.config.idle_poll_s)

    def _pause_while_busy(self) -> None:
        """The upload's pause (its worker thread): hold while a request runs."""
        self._engine_idle.wait(timeout=self.config.upload_pause_max_s)

    async def _upload_forever(self) -> None:
        while True:
            await self._upload_wanted.wait()
            self._upload_wanted = trio.Event()
            while True:
                candidate, over_budget = self.policy.next_upload(self._clock_wall_s())
                for skipped in over_budget:
                    self.counters.upload_over_budget += 1
                    self._skipped(skipped, "budget")
                if candidate is None:
                    break
                self._uploading += 1
                try:
                    while self._gateway_busy():
                        await trio.sleep(self.config.idle_poll_s)
                    await self._upload(candidate)
                finally:
                    self._uploading -= 1
            if not len(self.policy):
                self._uploads_settled.set()

    async def _upload(self, candidate: UploadCandidate) -> None:
        entry = self.store.entry(candidate.entry_id)
        if entry is None:
            self._skipped(candidate, "gone")
            return
        try:
            outcome = await self._run_blocking(
                upload_entry, self.store, self.objects, self.keys, entry, self._clock_ns, self._pause_while_busy
            )
        except DiskError as e:
            self._skipped(candidate, "gone", str(e))
            return
        except (SharedStoreError, CorruptEntry, UnsupportedFormat) as e:
            self.counters.upload_failures += 1
            log.warning("shared cache: upload of %s failed: %s", candidate.entry_id, e)
            self._skipped(candidate, "failed", str(e))
            return
        self.policy.charge(outcome.sent_bytes, self._clock_wall_s())
        if outcome.manifest is not None:
            self.counters.uploads += 1
            self.counters.upload_bytes += outcome.sent_bytes
            self.counters.upload_companion_bytes += entry.companion_bytes
            self.index.add(outcome.key, outcome.manifest)
            self._record(
                sev.SharedUploaded(
                    entry_id=candidate.entry_id,
                    key=outcome.key,
                    bytes=outcome.sent_bytes,
                    token_count=candidate.token_count,
                )
            )
            return
        self.counters.already_shared += 1
        self.counters.conflicts_412 += int(outcome.sent_bytes > 0)  # sent, then refused: a lost race
        self._skipped(candidate, "already_shared")
        await self._fetch_into_index(outcome.key)

    # -- downloads -------------------------------------------------------------

    async def before_request(self, tokens: Sequence[int], readable: Sequence[str]) -> None:
        """Bring a strictly longer shared prefix into the SSD tier before the
        request reaches the engine, waiting at most `request_timeout_s`.
        `readable`: the namespaces the request may read, its own first (then
        the tenants' `shared = true` ones); the longest match wins, a tie the
        earlier namespace."""
        with trio.move_on_after(self.config.request_timeout_s) as bound:
            await self._first_refresh.wait()
            query = np.asarray(tokens, dtype=np.uint32)
            match = None
            for namespace in readable:
                candidate = self.index.best(query, namespace)
                if candidate is not None and (match is None or candidate.usable_tokens > match.usable_tokens):
                    match = candidate
            if match is None:
                return
            local_tokens = max((self._local_tokens(query, namespace) for namespace in readable), default=0)
            if match.usable_tokens - local_tokens < self.config.download_min_gain_tokens:
                return
            done = self._downloads.get(match.manifest_key)
            if done is None:
                not_before, _ = self._backoff.get(match.manifest_key, (-math.inf, 0.0))
                if trio.current_time() < not_before or self._nursery is None:
                    return
                done = self._downloads[match.manifest_key] = trio.Event()
                self._nursery.start_soon(self._download, match.manifest_key, done)
            await done.wait()
        if bound.cancelled_caught:
            self.counters.download_timeouts += 1
            log.warning(
                "shared cache: a request went on without the shared tier after %g s", self.config.request_timeout_s
            )

    def _local_tokens(self, query: np.ndarray, namespace: str) -> int:
        local = self.store.find(query, namespace)
        return local.usable_tokens if local is not None else 0

    async def _download(self, key: str, done: trio.Event) -> None:
        try:
            manifest = self.index.manifest(key)
            if manifest is None:
                return
            try:
                entry_id = await self._run_blocking(download_entry, self.store, self.objects, manifest)
            except (CorruptEntry, UnsupportedFormat, KeyUnavailable) as e:
                self._refuse(key, "object", str(e))
                return
            except SharedObjectMissing as e:
                self._download_failed(key, str(e))
                self.index.refuse(key)  # a manifest whose object is gone: never trusted again while listed
                return
            except (SharedStoreError, DiskError) as e:
                self._download_failed(key, str(e))
                return
            self._backoff.pop(key, None)
            self.counters.downloads += 1
            self.counters.download_bytes += manifest.object_bytes
            self.counters.download_companion_bytes += self._companion_bytes(entry_id)
            token_count = len(manifest.token_ids) // 4
            self.origins.downloaded(entry_id, key)
            self._record(
                sev.SharedDownloaded(entry_id=entry_id, key=key, bytes=manifest.object_bytes, token_count=token_count)
            )
        finally:
            self._downloads.pop(key, None)
            done.set()

    def _companion_bytes(self, entry_id: str) -> int:
        """The adopted entry's companion bytes, which the SSD index took from
        its header; 0 when the tier evicted it at once (nothing to restore)."""
        adopted = self.store.entry(entry_id)
        return adopted.companion_bytes if adopted is not None else 0

    def _download_failed(self, key: str, reason: str) -> None:
        self.counters.download_failures += 1
        _, last_delay = self._backoff.get(key, (0.0, 0.0))
        delay = min(self.config.retry_max_s, max(self.config.retry_s, 2 * last_delay))
        self._backoff[key] = (trio.current_time() + delay, delay)
        log.warning("shared cache: download of %s failed (next try in %g s): %s", key, delay, reason)
        self._record(sev.SharedDownloadFailed(key=key, reason=reason))

    @property
    def uploading(self) -> bool:
        """Whether an upload is running now (a wipe waits for it to settle)."""
        return self._uploading > 0

    # -- flush and stats -------------------------------------------------------

    async def flush(self, timeout_s: float | None) -> dict[str, Any]:
        """Offer every local entry (the admission rule waived, the budget
        not), wait for the uploads to settle, and say whether every local
        entry has a committed manifest in the shared store."""
        before = attrs.asdict(self.counters)
        for entry_id in self.store.entry_ids():
            entry = self.store.entry(entry_id)
            if entry is not None:
                self._offer(self._candidate(entry_id, entry.namespace, entry.tokens, entry.bytes), forced=True)
        with trio.move_on_after(math.inf if timeout_s is None else timeout_s) as bound:
            await self._uploads_settled.wait()
        after = attrs.asdict(self.counters)
        entries = [entry for entry_id in self.store.entry_ids() if (entry := self.store.entry(entry_id))]
        committed = sum(
            self.keys.manifest_key(entry.namespace, tokens_sha256(entry.tokens)) in self.index for entry in entries
        )
        delta = {name: after[name] - before[name] for name in ("uploads", "already_shared", "upload_failures")}
        evidence = {
            "entries": len(entries),
            "committed": committed,
            "uploaded": delta["uploads"],
            "already_shared": delta["already_shared"],
            "failed": delta["upload_failures"],
            "over_budget": after["upload_over_budget"] - before["upload_over_budget"],
            "pending": len(self.policy) + self._uploading,
        }
        reason = _shared_reason(evidence, timed_out=bound.cancelled_caught)
        return {"durable": reason == "", "reason": reason, **evidence}

    def stats(self) -> dict[str, Any]:
        refreshed = self.index.refreshed_at_s
        return {
            "objects": len(self.index),
            "bytes": self.index.bytes,
            **attrs.asdict(self.counters),
            **self.policy.stats(),
            **self.origins.stats(),
            "index_age_s": round(trio.current_time() - refreshed, 3) if refreshed is not None else -1.0,
        }


def _shared_reason(evidence: dict[str, int], *, timed_out: bool) -> str:
    if timed_out:
        return "timeout"
    if evidence["committed"] == evidence["entries"]:
        return ""
    for name in ("failed", "over_budget", "pending"):
        if evidence[name]:
            return name
    return "not_shared"
