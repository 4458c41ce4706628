"""Events of the SSD cold tier, appended to the journal.

Every durable state change of the tier is one event: what was stored,
superseded, evicted, quarantined, reaped, hit and restored, and each
correction the startup reconciliation made. Events are frozen attrs classes,
serialised only through the one cattrs converter (CBOR). `kind` names the
class in the journal's `kind` column; `EVENT_TYPES` maps it back, for these
and for the actors' events (`store.actor_events`): the journal's whole schema
lives in the store layer.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable
from typing import Any, ClassVar

import attrs
import numpy as np
import xxhash

from kvcellar.store.actor_events import ACTOR_EVENT_TYPES
from kvcellar.store.shared_events import SHARED_EVENT_TYPES
from kvcellar.store.wipe import WipeSelector


def tokens_digest(tokens: Iterable[int] | np.ndarray) -> str:
    """xxh3-128 (hex) of the token ids as little-endian uint32: the identity of
    a token sequence in the journal (fast enough to recompute for every entry
    at startup)."""
    array = tokens if isinstance(tokens, np.ndarray) else np.fromiter(tokens, dtype=np.int64)
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(array, dtype="<u4").tobytes())


@attrs.frozen(kw_only=True)
class EntryFields:
    """What the journal's `entries` projection holds for one entry."""

    entry_id: str
    namespace: str
    path: str
    token_count: int
    tokens_digest: str
    # `builtins.bytes`: the field named `bytes` below shadows the type inside this class.
    token_ids: builtins.bytes
    bytes: int
    mtime_ns: int
    trimmable: bool
    minimum_reusable_offset: int
    # Of `bytes`, the companion section's (the draft model's KV); None in events journaled before
    # it was recorded (journal schema 1), whose rows the next startup scan reads from the header.
    companion_bytes: int | None = None


@attrs.frozen(kw_only=True)
class EntryStored:
    """A new entry was committed (after the directory fsync)."""

    kind: ClassVar[str] = "entry.stored"
    entry: EntryFields


@attrs.frozen(kw_only=True)
class EntrySuperseded:
    """An entry was removed because a newer one covers it (exact duplicate, or
    a strict prefix ancestor of a trimmable newcomer)."""

    kind: ClassVar[str] = "entry.superseded"
    entry_id: str
    by_entry_id: str
    reason: str


@attrs.frozen(kw_only=True)
class EntryEvicted:
    """An entry was removed to keep the tier under its byte cap (oldest first)."""

    kind: ClassVar[str] = "entry.evicted"
    entry_id: str
    bytes: int
    reason: str = "byte_cap"


@attrs.frozen(kw_only=True)
class EntryHit:
    """`find` matched this entry and `restore` began: its mtime (LRU) was touched."""

    kind: ClassVar[str] = "entry.hit"
    entry_id: str
    mtime_ns: int
    usable_tokens: int


@attrs.frozen(kw_only=True)
class EntryRestored:
    """The entry was loaded and trimmed to `usable_tokens`."""

    kind: ClassVar[str] = "entry.restored"
    entry_id: str
    usable_tokens: int
    restore_ms: float


@attrs.frozen(kw_only=True)
class RestoreDecided:
    """How a request with a cached prefix in a slow tier was served (issue 44):
    `plan` is "restore", "recompute" or "split" (prefill `[0, split_at_tokens)`,
    load the rest); `predicted_ms` every allowed plan's predicted time to the
    cached prefix plus the prompt's tail; `actual_ms` what the chosen plan's
    tier part took (the load, or the split's prefill and load; 0 for a
    recompute, whose prefill the request's own timing shows)."""

    kind: ClassVar[str] = "restore.decided"
    entry_id: str
    tier: str
    plan: str
    reason: str
    prompt_tokens: int
    cached_tokens: int
    split_at_tokens: int
    predicted_ms: dict[str, float]
    actual_ms: float


@attrs.frozen(kw_only=True)
class EntryQuarantined:
    """A corrupt, foreign or mismatched file was moved aside (`entry_id` is
    empty when the file was never indexed)."""

    kind: ClassVar[str] = "entry.quarantined"
    entry_id: str
    path: str
    quarantine_path: str
    reason: str


@attrs.frozen(kw_only=True)
class QuarantinePurged:
    """A quarantined file was removed to keep quarantine under its cap."""

    kind: ClassVar[str] = "quarantine.purged"
    quarantine_path: str
    bytes: int


@attrs.frozen(kw_only=True)
class TempReaped:
    """An orphaned `.tmp` file of an interrupted write was removed at startup."""

    kind: ClassVar[str] = "entry.temp_reaped"
    path: str


@attrs.frozen(kw_only=True)
class EntryWriteFailed:
    """A store did not happen (disk full, I/O error): the entry is not stored."""

    kind: ClassVar[str] = "entry.write_failed"
    namespace: str
    token_count: int
    reason: str
    errno: int | None = None


@attrs.frozen(kw_only=True)
class ReconcileAdded:
    """Startup found a valid file the journal did not know."""

    kind: ClassVar[str] = "reconcile.added"
    entry: EntryFields


@attrs.frozen(kw_only=True)
class ReconcileRemoved:
    """Startup found a journal entry whose file is gone."""

    kind: ClassVar[str] = "reconcile.removed"
    entry_id: str


@attrs.frozen(kw_only=True)
class ReconcileUpdated:
    """Startup found a file whose header or stat disagrees with the journal."""

    kind: ClassVar[str] = "reconcile.updated"
    entry: EntryFields


@attrs.frozen(kw_only=True)
class WipeBegun:
    """A wipe's intent, journaled (and its intent file made durable) before anything is removed."""

    kind: ClassVar[str] = "wipe.begun"
    wipe_id: str
    selector: WipeSelector


@attrs.frozen(kw_only=True)
class WipeDone:
    """Every tier holds nothing the wipe selects; `entries` and `bytes` are the SSD tier's removals
    (each one is also an `entry.evicted` with reason "wipe")."""

    kind: ClassVar[str] = "wipe.done"
    wipe_id: str
    entries: int
    bytes: int


Event = (
    EntryStored
    | EntrySuperseded
    | EntryEvicted
    | EntryHit
    | EntryRestored
    | RestoreDecided
    | EntryQuarantined
    | QuarantinePurged
    | TempReaped
    | EntryWriteFailed
    | ReconcileAdded
    | ReconcileRemoved
    | ReconcileUpdated
    | WipeBegun
    | WipeDone
)

STORE_EVENT_TYPES: tuple[type[Any], ...] = (
    EntryStored,
    EntrySuperseded,
    EntryEvicted,
    EntryHit,
    EntryRestored,
    RestoreDecided,
    EntryQuarantined,
    QuarantinePurged,
    TempReaped,
    EntryWriteFailed,
    ReconcileAdded,
    ReconcileRemoved,
    ReconcileUpdated,
    WipeBegun,
    WipeDone,
)


def _by_kind(classes: Iterable[type[Any]]) -> dict[str, type[Any]]:
    """Kinds are unique: a second class with a kind already taken is an error."""
    by_kind: dict[str, type[Any]] = {}
    for cls in classes:
        existing = by_kind.setdefault(cls.kind, cls)
        if existing is not cls:
            raise ValueError(f"event kind {cls.kind!r} is defined by {existing.__qualname__} and {cls.__qualname__}")
    return by_kind


# Every kind the journal can hold: the store's, the actors' (`store.actor_events`) and the
# shared tier's (`store.shared_events`).
EVENT_TYPES: dict[str, type[Any]] = _by_kind((*STORE_EVENT_TYPES, *ACTOR_EVENT_TYPES, *SHARED_EVENT_TYPES))


def event_entry_id(event: Event) -> str:
    """The entry an event is about ("" when none)."""
    entry = getattr(event, "entry", None)
    if entry is not None:
        return entry.entry_id
    return getattr(event, "entry_id", "") or ""
