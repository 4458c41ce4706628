"""The cache wipe across the tiers (issue 39, `POST /admin/cache/wipe`; docs/security.md "Wipe").

`Wipes` owns the order of one wipe; the wipe state (a `Tombstone` per wipe of this process) is
the SSD tier's index (`SsdIndex`), the durable intent its `wipes/` directory (`store/ssd_wipe.py`).
One wipe, in order:

1. begin: the intent file is made durable, then the tombstone installed (the journal's
   `wipe.begun` beside it). From here no SSD commit the wipe selects lands.
2. RAM: one engine turn drops the selected entries of the RAM tier (no spill) and starts a new
   wipe epoch; the RAM tier's port tells write-behind, after every put before it, that those
   puts are no longer owed. The tombstone is bound to that epoch: from now on it refuses only
   the commits of caches taken before it (a spill or write-behind snapshot still in flight,
   `SpillSnapshot.wipe_epoch`), for the rest of the process; later puts are new and land.
3. SSD and checkpoints: the selected entries are unindexed, journaled (`entry.evicted`, reason
   "wipe"), unlinked, and their directories fsynced (a lost unlink would bring one back).
4. shared tier: uploads in flight settle (bounded by `timeout_s`), the index is refreshed from
   the bucket, and every selected manifest is deleted, then its object.
5. in flight: the wipe waits (bounded by `timeout_s`) until the spill queue holds no snapshot
   taken before its RAM epoch. Until then a crash between such a write's rename and the
   tombstone's unlink of it would bring the entry back at the next start; with the intent still
   there, that start redoes the wipe.
6. done, only when nothing selected is left anywhere: `wipe.done` journaled and the intent
   unlinked. Otherwise the answer says what is left; the intent stays, and the next wipe with
   the same selector (or the next start) finishes it.

A crash anywhere before step 6 leaves the intent: `SsdStore.open` puts the tombstone back (it
refuses every selected commit until the wipe is done) and removes the SSD entries before
serving, and `resume` (called by `open_system` before the system is handed out) runs steps 3
to 5 again. Without an SSD tier there is nothing durable to wipe: only the RAM tier, no intent.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any

import attrs
import trio

from kvcellar.errors import DiskError, SharedStoreError
from kvcellar.store.wipe import WipeSelector

log = logging.getLogger("kvcellar.wipe")

TIERS = ("ram", "ssd", "checkpoints", "shared")
# How long a wipe waits, by default, for work in flight to settle: shared-tier uploads (each pauses
# while requests run) and spill writes of caches taken before it.
IN_FLIGHT_SETTLE_S = 60.0
# How often a wipe looks again at the spill queue's snapshots taken before it.
SPILL_POLL_S = 0.02


@attrs.frozen(kw_only=True)
class WipeResult:
    """One wipe's answer: `done` only when no tier holds anything it selects."""

    wipe_id: str
    selector: dict[str, Any]
    done: bool
    reason: str
    removed: dict[str, dict[str, int]]  # per tier: entries (or files, objects) and bytes removed
    left: dict[str, list[str]]  # per tier: what is still there (paths, keys, or a reason)

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


class Wipes:
    """The wipes of one system; Trio thread. Wipes run one at a time."""

    def __init__(self, system: Any) -> None:
        # `actors.system.System` (not imported: it imports this module); used for its tiers,
        # engine, seams and `flush`.
        self.system = system
        self._lock = trio.Lock()
        self._serial = itertools.count(1)
        # Files of an unfinished wipe whose unlink failed (unindexed already): the next try unlinks them.
        self._left_files: dict[str, list[Path]] = {}
        self.completed = 0

    def stats(self) -> dict[str, Any]:
        """`/stats` `wipes`: how many finished here, and the unfinished ones' ids."""
        unfinished = sorted(self.system.store.unfinished_wipes()) if self.system.store is not None else []
        return {"completed": self.completed, "unfinished": unfinished}

    def _new_wipe_id(self) -> str:
        store = self.system.store
        # The store's clock (the simulator's, in a simulation) and a per-process count: unique and deterministic.
        now_ns = store.clock_ns() if store is not None else 0
        return f"{now_ns:x}-{next(self._serial)}"

    async def wipe(self, selector: WipeSelector, timeout_s: float | None = None) -> WipeResult:
        """Run one wipe (steps 1 to 6 of the module doc); `timeout_s` bounds each wait for work in
        flight (None: `IN_FLIGHT_SETTLE_S`)."""
        async with self._lock:
            wipe_id = self._existing_wipe_id(selector) or self._new_wipe_id()
            removed = {tier: {"entries": 0, "bytes": 0} for tier in TIERS}
            store, seams = self.system.store, self.system.seams
            if store is not None and wipe_id not in store.unfinished_wipes():
                try:
                    await seams.run_blocking(store.begin_wipe, wipe_id, selector)
                except DiskError as e:
                    reason = f"the wipe's intent could not be made durable; nothing was removed: {e}"
                    return _result(wipe_id, selector, removed, {"ssd": [str(e)]}, reason)
            entries, size, ram_epoch = await self.system.engine.call(
                lambda _: self.system.prompt_cache.wipe(selector), needs_model=False, label="wipe"
            )
            removed["ram"] = {"entries": entries, "bytes": size}
            if store is not None:
                store.bound_wipe(wipe_id, ram_epoch)
            return await self._finish(wipe_id, selector, removed, timeout_s, ram_epoch=ram_epoch)

    async def resume(self) -> list[WipeResult]:
        """Finish the wipes a crash left (the SSD tier already removed their entries at open)."""
        store = self.system.store
        if store is None:
            return []
        results = []
        async with self._lock:
            for wipe_id, selector in sorted(store.unfinished_wipes().items()):
                removed = {tier: {"entries": 0, "bytes": 0} for tier in TIERS}
                results.append(await self._finish(wipe_id, selector, removed))
                log.warning("resumed wipe %s: %s", wipe_id, "done" if results[-1].done else results[-1].reason)
        return results

    def _existing_wipe_id(self, selector: WipeSelector) -> str | None:
        """An unfinished wipe with the same selector is finished rather than begun again."""
        store = self.system.store
        if store is None:
            return None
        return next((wipe_id for wipe_id, s in store.unfinished_wipes().items() if s == selector), None)

    async def _finish(
        self,
        wipe_id: str,
        selector: WipeSelector,
        removed: dict[str, dict[str, int]],
        timeout_s: float | None = None,
        *,
        ram_epoch: int | None = None,
    ) -> WipeResult:
        store, seams = self.system.store, self.system.seams
        left: dict[str, list[str]] = {}
        if store is None:
            return _result(wipe_id, selector, removed, left, "")
        retried = self._left_files.pop(wipe_id, [])
        try:
            await seams.run_blocking(store.remove_wiped_files, retried)
            doomed = await seams.run_blocking(store.wipe_entries, selector)
        except DiskError as e:
            doomed, left["ssd"] = [], [f"a removal is not durable: {e}"]
            self._left_files[wipe_id] = retried
        removed["ssd"] = {"entries": len(doomed), "bytes": sum(entry.bytes for entry in doomed)}
        ssd_left = await seams.run_blocking(store.wipe_left, selector, [*retried, *(e.path for e in doomed)])
        if ssd_left:
            left.setdefault("ssd", []).extend(ssd_left)
            self._left_files[wipe_id] = [store.directory / relative for relative in ssd_left]
        await self._wipe_checkpoints(selector, removed, left)
        await self._wipe_shared(selector, removed, left, timeout_s)
        if ram_epoch is not None:
            await self._await_spills_before(ram_epoch, left, timeout_s)
        if left:
            return _result(wipe_id, selector, removed, left, "not everything selected is gone yet; wipe again")
        try:
            await seams.run_blocking(store.finish_wipe, wipe_id, removed["ssd"]["entries"], removed["ssd"]["bytes"])
        except DiskError as e:
            # Everything is gone; only the intent stays (the next start redoes the wipe, removing nothing new).
            return _result(wipe_id, selector, removed, {"intent": [str(e)]}, "the wipe's intent could not be removed")
        self.completed += 1
        return _result(wipe_id, selector, removed, left, "")

    async def _await_spills_before(self, ram_epoch: int, left: dict[str, list[str]], timeout_s: float | None) -> None:
        """The intent stays until no spill or write-behind snapshot taken before the wipe is still
        queued or being written: the tombstone refuses such a write at commit, but a crash between
        its rename and the refusal's unlink would bring the entry back at the next start, unless
        the intent is still there to be redone. (Snapshots reach the queue through `run_sync_soon`,
        FIFO, so every one taken before the wipe's RAM turn is queued before that turn's answer.)"""
        queue = self.system.queue
        if queue is None:
            return
        with trio.move_on_after(IN_FLIGHT_SETTLE_S if timeout_s is None else timeout_s):
            while queue.holds_snapshots_before(ram_epoch):
                await trio.sleep(SPILL_POLL_S)
        in_flight = queue.holds_snapshots_before(ram_epoch)
        if in_flight:
            left["ssd"] = [*left.get("ssd", []), f"{in_flight} spill writes of caches taken before the wipe in flight"]

    async def _wipe_checkpoints(
        self, selector: WipeSelector, removed: dict[str, dict[str, int]], left: dict[str, list[str]]
    ) -> None:
        checkpointing = self.system.checkpointing
        if checkpointing is None:
            return
        files, size, failed = await self.system.seams.run_blocking(checkpointing.store.wipe, selector)
        removed["checkpoints"] = {"entries": files, "bytes": size}
        if failed:
            left["checkpoints"] = failed

    async def _wipe_shared(
        self,
        selector: WipeSelector,
        removed: dict[str, dict[str, int]],
        left: dict[str, list[str]],
        timeout_s: float | None,
    ) -> None:
        shared = self.system.shared
        if shared is None:
            return
        # An upload that began before the SSD removal may still commit its manifest: let it settle.
        with trio.move_on_after(IN_FLIGHT_SETTLE_S if timeout_s is None else timeout_s):
            while shared.uploading:
                await trio.sleep(shared.config.idle_poll_s)
        await shared.refresh()
        entries = size = 0
        for key, manifest in shared.index.selected(selector.matches):
            try:
                await self.system.seams.run_blocking(shared.objects.delete, key)
                await self.system.seams.run_blocking(shared.objects.delete, manifest.object_key)
            except SharedStoreError as e:
                left.setdefault("shared", []).append(f"{key}: {e}")
                continue
            shared.index.remove(key)
            entries += 1
            size += manifest.object_bytes
        removed["shared"] = {"entries": entries, "bytes": size}


def _result(
    wipe_id: str,
    selector: WipeSelector,
    removed: dict[str, dict[str, int]],
    left: dict[str, list[str]],
    reason: str,
) -> WipeResult:
    return WipeResult(
        wipe_id=wipe_id, selector=selector.to_record(), done=not left, reason=reason, removed=removed, left=left
    )
