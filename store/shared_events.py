"""Journal events of the shared cold tier: uploads, downloads and refusals.

Part of the journal's schema like the store's and the actors' events
(`store.events` registers them); they carry keys, ids and sizes, never bytes.
`key` is the manifest key (the entry's content address in the bucket).
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs


@attrs.frozen(kw_only=True)
class SharedUploaded:
    """A local entry's object and manifest were committed to the shared store."""

    kind: ClassVar[str] = "shared.uploaded"
    entry_id: str
    key: str
    bytes: int
    token_count: int


@attrs.frozen(kw_only=True)
class SharedUploadSkipped:
    """An upload that did not commit. `reason`: "already_shared" (the manifest
    existed, or the conditional put answered 412), "budget" (over the daily
    byte budget), "queue_full", "gone" (the local entry left the SSD tier) or
    "failed" (the store failed; `detail` says how)."""

    kind: ClassVar[str] = "shared.upload_skipped"
    entry_id: str
    key: str
    reason: str
    detail: str = ""


@attrs.frozen(kw_only=True)
class SharedDownloaded:
    """A shared entry was downloaded, verified and adopted into the SSD tier."""

    kind: ClassVar[str] = "shared.downloaded"
    entry_id: str
    key: str
    bytes: int
    token_count: int


@attrs.frozen(kw_only=True)
class SharedRefused:
    """A shared manifest or object failed a check and is never restored:
    `what` is "manifest" or "object"; a refused object is quarantined locally."""

    kind: ClassVar[str] = "shared.refused"
    key: str
    what: str
    reason: str


@attrs.frozen(kw_only=True)
class SharedDownloadFailed:
    """A download that did not complete (store unreachable, 5xx, throttled,
    a partial stream, a deleted object, or the request's timeout)."""

    kind: ClassVar[str] = "shared.download_failed"
    key: str
    reason: str


@attrs.frozen(kw_only=True)
class RestoreSourced:
    """An SSD entry was restored for a request; `origin` says where its bytes came from:
    "local_ssd" (this server stored it) or "shared_tier" (downloaded from `key`): failover
    bookkeeping, after a gateway moved a session here (store/restore_origin.py)."""

    kind: ClassVar[str] = "restore.sourced"
    entry_id: str
    origin: str
    usable_tokens: int
    key: str = ""


SHARED_EVENT_TYPES: tuple[type[Any], ...] = (
    SharedUploaded,
    SharedUploadSkipped,
    SharedDownloaded,
    SharedRefused,
    SharedDownloadFailed,
    RestoreSourced,
)
