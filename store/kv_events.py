"""KV events: the tiers' resident prefixes as chained block digests (issue 40).

KV-aware routers (NVIDIA Dynamo, llm-d's scheduler, SMG's event-driven
cache-aware policy) follow each worker's cache through vLLM's KV events:
`BlockStored` (blocks of `block_size` tokens became resident, each named by a
hash chained over its parent's), `BlockRemoved` and `AllBlocksCleared`. kvcellar
holds whole prefix entries, not blocks, so this module maps one to the other:
an entry of tokens T in a tier makes the `len(T) // block_size` full blocks of
T resident there (a partial last block is never published, as in vLLM), and a
block stays resident while any entry of that tier holds it (a count per
block). Because a block's digest chains over every block before it, an entry
holding block i holds blocks 0..i too: the blocks an entry adds or takes away
are always one contiguous run at the end of its chain, so each change is one
`BlockStored` (with the run's parent) or one `BlockRemoved`.

Digest: the first 8 bytes, as a big-endian unsigned int, of
sha256(parent digest as 8 big-endian bytes, or the namespace's 8-byte root,
|| the block's token ids as little-endian uint32). Namespaces (the served
configuration's KV scheme and the like) get distinct roots, so equal tokens in
two namespaces never share a block. Deterministic across processes and
machines: two workers name the same prefix the same way.

`KvEventLog` is the sans-IO core: `entry_stored` / `entry_removed` /
`tier_cleared` take the tier's change and return the events it implies, each
numbered by a sequence number that only grows; the last `retain` events stay
for readers resuming with `since(n)`. A reader whose `n` is older than what is
retained gets a `reset`: `AllBlocksCleared` for every tier then one
`BlockStored` per resident chain, which rebuilds the same set. Thread-safe
(one lock): the RAM tier changes on the engine thread, the SSD tier on the
writer's; no trio here.
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

BLOCK_SIZE_DEFAULT = 16
RETAIN_DEFAULT = 10_000
MEDIA = ("RAM", "SSD")


def namespace_root(namespace: str) -> int:
    return int.from_bytes(hashlib.sha256(b"kvcellar-kv-events\0" + namespace.encode()).digest()[:8], "big")


def block_digests(tokens: Sequence[int] | np.ndarray, block_size: int, namespace: str = "") -> list[int]:
    """The chained digests of the full blocks of `tokens`, first block first."""
    array = np.ascontiguousarray(np.asarray(tokens), dtype="<u4")
    parent = namespace_root(namespace)
    digests: list[int] = []
    for start in range(0, array.size - block_size + 1, block_size):
        digest = hashlib.sha256(parent.to_bytes(8, "big") + array[start : start + block_size].tobytes()).digest()
        parent = int.from_bytes(digest[:8], "big")
        digests.append(parent)
    return digests


@attrs.frozen(kw_only=True)
class KvEvent:
    """One event, in vLLM's vocabulary; `sequence` orders every event of one server."""

    sequence: int
    type: str  # "BlockStored", "BlockRemoved", "AllBlocksCleared"
    medium: str  # "RAM" or "SSD"
    block_hashes: tuple[int, ...] = ()
    parent_block_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = BLOCK_SIZE_DEFAULT

    def as_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"sequence": self.sequence, "type": self.type, "medium": self.medium}
        if self.type == "BlockStored":
            body.update(
                block_hashes=list(self.block_hashes),
                parent_block_hash=self.parent_block_hash,
                token_ids=list(self.token_ids),
                block_size=self.block_size,
            )
        elif self.type == "BlockRemoved":
            body["block_hashes"] = list(self.block_hashes)
        return body


@attrs.frozen(kw_only=True)
class _Held:
    """One entry's chain in one tier: its digests and the tokens of its full blocks."""

    digests: tuple[int, ...]
    tokens: tuple[int, ...]


class KvEventLog:
    def __init__(self, *, block_size: int = BLOCK_SIZE_DEFAULT, retain: int = RETAIN_DEFAULT) -> None:
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.block_size = block_size
        self._lock = threading.Lock()
        self._sequence = 0
        self._events: deque[KvEvent] = deque(maxlen=retain)
        self._entries: dict[tuple[str, str], _Held] = {}
        self._counts: dict[str, dict[int, int]] = {medium: {} for medium in MEDIA}
        self._listeners: list[Any] = []

    @property
    def sequence(self) -> int:
        """The number of the last event (0: none yet)."""
        with self._lock:
            return self._sequence

    def add_listener(self, listener: Any) -> None:
        """`listener(sequence)` after each batch of events (the SSE route's wake-up)."""
        with self._lock:
            self._listeners.append(listener)

    def entry_stored(
        self, medium: str, entry_id: str, tokens: Sequence[int] | np.ndarray, namespace: str = ""
    ) -> list[KvEvent]:
        """An entry of `medium` now holds `tokens`; a second report of the same entry changes nothing."""
        digests = block_digests(tokens, self.block_size, namespace)
        full = np.asarray(tokens)[: len(digests) * self.block_size]
        with self._lock:
            if (medium, entry_id) in self._entries:
                return []
            self._entries[medium, entry_id] = _Held(digests=tuple(digests), tokens=tuple(int(t) for t in full))
            counts = self._counts[medium]
            first_new = next((i for i, d in enumerate(digests) if counts.get(d, 0) == 0), len(digests))
            for digest in digests:
                counts[digest] = counts.get(digest, 0) + 1
            if first_new == len(digests):
                return self._published([])
            event = KvEvent(
                sequence=self._next(),
                type="BlockStored",
                medium=medium,
                block_hashes=tuple(digests[first_new:]),
                parent_block_hash=digests[first_new - 1] if first_new else None,
                token_ids=tuple(int(t) for t in full[first_new * self.block_size :]),
                block_size=self.block_size,
            )
            return self._published([event])

    def entry_removed(self, medium: str, entry_id: str) -> list[KvEvent]:
        """An entry of `medium` is gone; an unknown entry changes nothing."""
        with self._lock:
            held = self._entries.pop((medium, entry_id), None)
            if held is None:
                return []
            counts = self._counts[medium]
            gone: list[int] = []
            for digest in held.digests:
                counts[digest] -= 1
                if counts[digest] == 0:
                    del counts[digest]
                    gone.append(digest)
            if not gone:
                return self._published([])
            event = KvEvent(sequence=self._next(), type="BlockRemoved", medium=medium, block_hashes=tuple(gone))
            return self._published([event])

    def tier_cleared(self, medium: str) -> list[KvEvent]:
        with self._lock:
            for key in [key for key in self._entries if key[0] == medium]:
                del self._entries[key]
            self._counts[medium].clear()
            event = KvEvent(sequence=self._next(), type="AllBlocksCleared", medium=medium)
            return self._published([event])

    def since(self, sequence: int) -> tuple[list[KvEvent], bool]:
        """The events after `sequence`, and whether they start with a reset (the
        reader was behind what is retained, or ahead of this server: a restart)."""
        with self._lock:
            oldest = self._events[0].sequence if self._events else self._sequence + 1
            if oldest - 1 <= sequence <= self._sequence:
                return [e for e in self._events if e.sequence > sequence], False
            return self._reset(), True

    def resident(self) -> dict[str, list[int]]:
        """Each tier's resident block digests, sorted: what replaying every event yields."""
        with self._lock:
            return {medium: sorted(counts) for medium, counts in self._counts.items()}

    def stats(self) -> dict[str, Any]:
        """/stats `kv_events`: the block size, the last sequence, each medium's resident
        blocks (`blocks_ram`, `blocks_ssd`) and the sha256 of its sorted digests (decimal, one a line)."""
        resident = self.resident()
        return {
            "block_size": self.block_size,
            "sequence": self.sequence,
            **{f"blocks_{medium.lower()}": len(digests) for medium, digests in resident.items()},
            "resident_sha256": {medium: resident_sha256(digests) for medium, digests in resident.items()},
        }

    def _reset(self) -> list[KvEvent]:
        """The current state as events, all numbered by the current sequence."""
        events = [KvEvent(sequence=self._sequence, type="AllBlocksCleared", medium=m) for m in MEDIA]
        for (medium, _), held in sorted(self._entries.items()):
            if held.digests:
                events.append(
                    KvEvent(
                        sequence=self._sequence,
                        type="BlockStored",
                        medium=medium,
                        block_hashes=held.digests,
                        token_ids=held.tokens,
                        block_size=self.block_size,
                    )
                )
        return events

    def _next(self) -> int:
        self._sequence += 1
        return self._sequence

    def _published(self, events: list[KvEvent]) -> list[KvEvent]:
        self._events.extend(events)
        if events:
            for listener in self._listeners:
                listener(self._sequence)
        return events


def resident_sha256(digests: Sequence[int] | set[int]) -> str:
    return hashlib.sha256("".join(f"{d}\n" for d in sorted(digests)).encode()).hexdigest()


def replay(events: Sequence[dict[str, Any]], into: dict[str, set[int]] | None = None) -> dict[str, set[int]]:
    """A router's view: the resident digests per medium after applying `events` (as JSON)."""
    resident = into if into is not None else {medium: set() for medium in MEDIA}
    for event in events:
        blocks = resident.setdefault(event["medium"], set())
        if event["type"] == "BlockStored":
            blocks.update(event["block_hashes"])
        elif event["type"] == "BlockRemoved":
            blocks.difference_update(event["block_hashes"])
        elif event["type"] == "AllBlocksCleared":
            blocks.clear()
    return resident
