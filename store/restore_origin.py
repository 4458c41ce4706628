"""Where each restored SSD entry came from: this server's own SSD tier, or the shared tier.

Failover bookkeeping (issue 40): after a gateway moves a session off a dead worker, the
survivor restores its prefix from an entry it downloaded from the shared tier, and the
journal (`restore.sourced`) and `/stats` `shared_cache` should say so. Sans-IO: the
shared tier's shell reports each download (`downloaded`), each entry the SSD tier drops
(`forget`) and each restore (`restored`, which returns the event to journal).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import attrs

from kvcellar.store.shared_events import RestoreSourced

LOCAL_SSD = "local_ssd"
SHARED_TIER = "shared_tier"
RECENT = 16


@attrs.define(kw_only=True)
class RestoreOriginCounts:
    restores_local_ssd: int = 0
    restores_shared_tier: int = 0
    restored_tokens_local_ssd: int = 0
    restored_tokens_shared_tier: int = 0


class RestoreOrigins:
    def __init__(self) -> None:
        self._downloaded: dict[str, str] = {}  # entry id -> the shared key it came from
        self.counts = RestoreOriginCounts()
        self._recent: deque[dict[str, Any]] = deque(maxlen=RECENT)

    def downloaded(self, entry_id: str, key: str) -> None:
        self._downloaded[entry_id] = key

    def forget(self, entry_id: str) -> None:
        self._downloaded.pop(entry_id, None)

    def restored(self, entry_id: str, usable_tokens: int) -> RestoreSourced:
        key = self._downloaded.get(entry_id, "")
        origin = SHARED_TIER if key else LOCAL_SSD
        if origin == SHARED_TIER:
            self.counts.restores_shared_tier += 1
            self.counts.restored_tokens_shared_tier += usable_tokens
        else:
            self.counts.restores_local_ssd += 1
            self.counts.restored_tokens_local_ssd += usable_tokens
        event = RestoreSourced(entry_id=entry_id, origin=origin, usable_tokens=usable_tokens, key=key)
        self._recent.append(attrs.asdict(event))
        return event

    def stats(self) -> dict[str, Any]:
        """The counts, and the last restores (newest last) with their origin."""
        return {**attrs.asdict(self.counts), "recent_restores": list(self._recent)}
