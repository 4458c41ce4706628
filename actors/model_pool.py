"""The model pool (issue 41): several models behind one server, loaded on demand, drained before unload.

Each model is a whole `System` (actors/system.py: its own RAM prompt cache, SSD tier under its own
serving fingerprint, journal, lanes and write-behind), opened inside the pool's nursery when a
request first names it, on a `ModelEngine` of the one `SharedEngineThread` (engine/shared_engine.py:
MLX on one thread, per-model FIFOs served round robin). So every tier is keyed by model by
construction: the RAM tier and the checkpoints are the model's own objects, and its SSD entries
live in its fingerprint's directory.

Owner: the Trio thread owns every `ModelSlot` and the pool's counters; the engine thread never sees
them. The models stay within one memory budget (weights' bytes on disk): to load one, the least
recently used unpinned idle models are unloaded first (actors/model_pool_plan.py), each after its
drain: a flush of its write-behind whose verdict must be durable (or the model has no SSD tier, so
there is nothing to persist) before the System closes and its arrays are freed. A drain that is not
durable keeps the model loaded and the load is refused (503): the pool never trades cached work
for room.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from kvcellar.actors.model_names import ModelNames
from kvcellar.actors.model_pool_plan import Resident, plan_unloads, ram_shares
from kvcellar.actors.model_slot_core import (
    DrainBegun,
    DrainRefused,
    LoadBegun,
    Loaded,
    LoadFailed,
    ServingFailed,
    SlotCore,
    SlotState,
    Unloaded,
)
from kvcellar.actors.system import System, open_system
from kvcellar.actors.system_config import FlushResult, SystemConfig, SystemSeams
from kvcellar.engine.engine import resolve_compute_dtype
from kvcellar.engine.shared_engine import SharedEngineThread
from kvcellar.errors import KvCellarError, RoomRefused

log = logging.getLogger("kvcellar.pool")

DRAIN_TIMEOUT_S_DEFAULT = 60.0
# How long a load waits for a busy model to finish its requests before refusing (503).
ROOM_WAIT_S = 120.0
RAM_REBALANCE_S = 30.0


def weights_bytes_on_disk(model_dir: Path, draft_model_dir: Path | None = None) -> int:
    """What a model's weights cost the budget: its safetensors' bytes, and its draft's, loaded beside it
    (blocking: a worker thread's call)."""
    dirs = [model_dir] if draft_model_dir is None else [model_dir, draft_model_dir]
    return sum(path.stat().st_size for directory in dirs for path in directory.glob("*.safetensors"))


@attrs.define(kw_only=True)
class ModelSlot:
    """One model of the pool, owned by the Trio thread."""

    name: str
    config: SystemConfig
    pinned: bool = False
    weights_bytes: int = 0
    # The lifecycle (actors/model_slot_core.py); `state` reads it.
    core: SlotCore = attrs.field(factory=SlotCore)
    system: System | None = None
    in_flight: int = 0
    requests: int = 0
    last_used_s: float = 0.0
    last_drain: dict[str, Any] | None = None
    # Set to close the model's System; the task that holds it sets `closed` once it is gone.
    close: trio.Event = attrs.field(factory=trio.Event)
    closed: trio.Event = attrs.field(factory=trio.Event)
    ready: trio.Event = attrs.field(factory=trio.Event)

    @property
    def state(self) -> str:
        return self.core.state.value


class ModelPool:
    """The served models by name; `use(name)` lends a loaded model's `System` to one request."""

    def __init__(
        self,
        names: ModelNames,
        configs: dict[str, SystemConfig],
        *,
        budget_bytes: int,
        ram_total_bytes: int,
        ram_fixed_bytes: Mapping[str, int] | None = None,
        seams: SystemSeams | None = None,
        clock_s: Callable[[], float] = time.monotonic,
    ) -> None:
        self.names = names
        self.budget_bytes = budget_bytes
        self.ram_total_bytes = ram_total_bytes
        # The models file's `ram_gb`, in bytes: those models' RAM shares, never re-divided.
        self.ram_fixed_bytes = dict(ram_fixed_bytes or {})
        self.seams = seams or SystemSeams()
        self.clock_s = clock_s
        self.engine = SharedEngineThread()
        self.slots = {
            spec.name: ModelSlot(name=spec.name, config=configs[spec.name], pinned=spec.pin) for spec in names.models
        }
        self._room = trio.Lock()
        self._changed = trio.lowlevel.ParkingLot()
        self._nursery: trio.Nursery | None = None
        self.refusals = 0

    # -- serving -------------------------------------------------------------------

    @asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[System]:
        """The model's System for one request, loading it first when needed; it is not unloaded meanwhile."""
        slot = self.slots[name]
        while slot.state != "loaded":
            await self._make_loaded(slot)
        slot.in_flight += 1
        slot.requests += 1
        slot.last_used_s = self.clock_s()
        assert slot.system is not None
        try:
            yield slot.system
        finally:
            slot.in_flight -= 1
            slot.last_used_s = self.clock_s()
            self._changed.unpark_all()

    async def _make_loaded(self, slot: ModelSlot) -> None:
        if slot.state in ("loading", "draining"):
            await self._wait_changed()
            return
        async with self._room:
            if slot.state != "unloaded" and slot.state != "failed":
                return
            await self._make_room(slot)
            await self._load(slot)

    async def _wait_changed(self) -> None:
        await self._changed.park()

    async def _make_room(self, slot: ModelSlot) -> None:
        if not slot.weights_bytes:
            slot.weights_bytes = await trio.to_thread.run_sync(
                weights_bytes_on_disk, slot.config.model_dir, slot.config.draft_model_dir
            )
        with trio.move_on_after(ROOM_WAIT_S):
            while True:
                resident = {
                    s.name: Resident(
                        weights_bytes=s.weights_bytes, last_used_s=s.last_used_s, pinned=s.pinned, busy=s.in_flight > 0
                    )
                    for s in self.slots.values()
                    if s.state in ("loaded", "loading")
                }
                plan = plan_unloads(resident, slot.name, slot.weights_bytes, self.budget_bytes)
                if plan.fits:
                    try:
                        for name in plan.unload:
                            await self.unload(name, reason=f"making room for {slot.name}")
                    except RoomRefused:
                        self.refusals += 1
                        raise
                    return
                if not any(r.busy and not r.pinned for r in resident.values()):
                    break
                await self._wait_changed()  # a busy model may finish its requests and become unloadable
        self.refusals += 1
        raise RoomRefused(
            f"cannot load model {slot.name!r} ({slot.weights_bytes / 1e9:.3g} GB): the models memory budget "
            f"({self.budget_bytes / 1e9:.3g} GB) is held by pinned or busy "
            "models; retry later or raise --models-memory-gb"
        )

    async def _load(self, slot: ModelSlot) -> None:
        assert self._nursery is not None, "the pool is not running"
        slot.core.handle(LoadBegun(), self.clock_s())
        slot.close, slot.closed, slot.ready = trio.Event(), trio.Event(), trio.Event()
        self._changed.unpark_all()
        log.info("model %s: loading from %s", slot.name, slot.config.model_dir)
        started = time.perf_counter()
        try:
            await self._nursery.start(self._hold_system, slot)
        except BaseException as e:
            slot.core.handle(LoadFailed(error=f"{type(e).__name__}: {e}"), self.clock_s())
            self._changed.unpark_all()
            log.error("model %s: load failed: %s", slot.name, slot.core.error)
            raise
        load_s = time.perf_counter() - started
        slot.core.handle(Loaded(load_s=load_s), self.clock_s())
        slot.last_used_s = self.clock_s()
        log.info("model %s: loaded in %.2f s", slot.name, load_s)
        await self.rebalance_ram()
        self._changed.unpark_all()

    async def _hold_system(self, slot: ModelSlot, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The model's System for its loaded life: open, serve until `close`, then shut down and free."""
        compute = await trio.to_thread.run_sync(resolve_compute_dtype, slot.config.compute_dtype, slot.config.model_dir)
        engine = self.engine.model_engine(slot.name, slot.config.model_dir, compute=compute)
        seams = attrs.evolve(self.seams, engine=engine)
        started = False
        try:
            async with open_system(slot.config, seams) as system:
                slot.system = system
                task_status.started()
                started = True
                await slot.close.wait()
        except Exception as e:
            if not started:
                raise
            # Past its start a model's failure is its own: the pool and the other models go on.
            slot.core.handle(ServingFailed(error=f"{type(e).__name__}: {e}"), self.clock_s())
            log.error("model %s: failed while serving or closing: %s", slot.name, slot.core.error, exc_info=e)
        finally:
            slot.system = None
            slot.closed.set()

    # -- draining and unloading ----------------------------------------------------

    async def drain(self, name: str, timeout_s: float | None = DRAIN_TIMEOUT_S_DEFAULT) -> FlushResult | None:
        """Persist every RAM entry of a loaded model (its write-behind flushed); None when it is not loaded."""
        slot = self.slots[name]
        if slot.system is None or slot.state not in ("loaded", "draining"):
            return None
        verdict = await slot.system.flush(timeout_s=timeout_s)
        slot.last_drain = {"at_s": time.time(), **attrs.asdict(verdict)}
        log.info("model %s: drain %s", name, "durable" if verdict.durable else f"not durable ({verdict.reason})")
        return verdict

    async def unload(self, name: str, *, reason: str, timeout_s: float = DRAIN_TIMEOUT_S_DEFAULT) -> FlushResult:
        """Drain, then close the model: its arrays are freed only after a durable drain (or with no SSD tier,
        where nothing can be persisted). Waits for its requests in flight; raises `RoomRefused` when the drain
        is not durable, leaving the model loaded."""
        slot = self.slots[name]
        if slot.state != "loaded" or slot.system is None:
            raise RoomRefused(f"model {name!r} is {slot.state}, not loaded")
        slot.core.handle(DrainBegun(), self.clock_s())
        self._changed.unpark_all()
        while slot.in_flight:
            await self._wait_changed()
        log.info("model %s: unloading (%s): draining its RAM entries to the SSD tier first", name, reason)
        verdict = await self.drain(name, timeout_s)
        assert verdict is not None
        if not verdict.durable and verdict.reason != "no SSD tier":
            slot.core.handle(DrainRefused(reason=verdict.reason), self.clock_s())
            self._changed.unpark_all()
            raise RoomRefused(f"model {name!r} stays loaded: its drain was not durable ({verdict.reason})")
        slot.close.set()
        await slot.closed.wait()
        if slot.core.state is SlotState.DRAINING:  # else its System failed while closing (FAILED, logged)
            slot.core.handle(Unloaded(), self.clock_s())
        log.info("model %s: unloaded", name)
        await self.rebalance_ram()
        self._changed.unpark_all()
        return verdict

    async def rebalance_ram(self) -> None:
        """Each loaded model's RAM tier gets its share of the total (`ram_shares`: a fixed `ram_gb`, else
        by requests), set by the tier's owner: `PromptCache.resize` runs on the engine thread between jobs
        and evicts down to a smaller share through its spill path."""
        loaded = {s.name: s for s in self.slots.values() if s.state == "loaded" and s.system is not None}
        shares = ram_shares(
            {name: s.requests for name, s in loaded.items()}, self.ram_total_bytes, fixed_bytes=self.ram_fixed_bytes
        )
        for name, share in shares.items():
            system = loaded[name].system
            if system is None or system.prompt_cache.bytes_max == share:
                continue
            cache = system.prompt_cache

            def resize(_: Any, cache: Any = cache, share: int = share) -> None:
                cache.resize(share)

            try:
                await system.gateway.run_when_idle(resize)
            except (KvCellarError, trio.ClosedResourceError, trio.BrokenResourceError) as e:
                # The model closed meanwhile (an unload): its next load gets a share again.
                log.info("model %s: RAM share not updated: %s", name, e)

    # -- lifetime and stats --------------------------------------------------------

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The pool's nursery: load the pinned models, then hold every model's System until `close()`."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                while True:
                    # Shares follow use between loads too (each load and unload re-divides at once).
                    await trio.sleep(RAM_REBALANCE_S)
                    await self.rebalance_ram()
        finally:
            self.engine.stop()

    async def start_pinned(self) -> None:
        for slot in self.slots.values():
            if slot.pinned:
                async with self.use(slot.name):
                    pass

    async def shutdown(self) -> None:
        """Close every loaded model (each System's own shutdown drains, flushes and warns)."""
        for slot in self.slots.values():
            if slot.system is not None:
                slot.close.set()
        for slot in self.slots.values():
            if slot.core.state is SlotState.LOADED:
                slot.core.handle(DrainBegun(), self.clock_s())
            if slot.core.state is SlotState.DRAINING:
                await slot.closed.wait()
                if slot.core.state is SlotState.DRAINING:
                    slot.core.handle(Unloaded(), self.clock_s())

    def loaded_systems(self) -> list[System]:
        return [s.system for s in self.slots.values() if s.system is not None and s.state == "loaded"]

    def stats(self) -> dict[str, Any]:
        now = self.clock_s()
        models = {}
        for slot in self.slots.values():
            system = slot.system if slot.state in ("loaded", "draining") else None
            tiers = system.stats() if system is not None else None
            models[slot.name] = {
                "state": slot.state,
                "pinned": slot.pinned,
                "weights_bytes": slot.weights_bytes,
                "in_flight": slot.in_flight,
                "requests": slot.requests,
                "loads": slot.core.loads,
                "unloads": slot.core.unloads,
                "load_s_last": slot.core.load_s_last,
                "loading_for_s": None if slot.core.loading_since_s is None else now - slot.core.loading_since_s,
                "error": slot.core.error,
                "ram_bytes": tiers["prompt_cache"]["bytes"] if tiers else 0,
                "ram_max_bytes": tiers["prompt_cache"]["max_bytes"] if tiers else 0,
                "ram_fixed": slot.name in self.ram_fixed_bytes,
                "ram_hits": tiers["prompt_cache"].get("hits", 0) if tiers else 0,
                "ssd_bytes": tiers["ssd_cache"].get("bytes", 0) if tiers else 0,
                "ssd_entries": tiers["ssd_cache"].get("entries", 0) if tiers else 0,
                "ssd_restores": tiers["ssd_cache"].get("restores", 0) if tiers else 0,
                "last_drain": slot.last_drain,
                "engine_jobs": self.engine.jobs_run.get(slot.name, 0),
                "draft_model": None if slot.config.draft_model_dir is None else str(slot.config.draft_model_dir),
                "speculative": tiers["speculative"] if tiers else {},
                "engine_yields": self.engine.engine_yields.get(slot.name, 0),
                "lane": tiers["scheduler"]["lane"] if tiers else None,
                "batch_size_history": tiers["scheduler"].get("batch_size_history", {}) if tiers else {},
            }
        return {
            "budget_bytes": self.budget_bytes,
            "resident_bytes": sum(s.weights_bytes for s in self.slots.values() if s.state in ("loaded", "loading")),
            "default": self.names.default,
            "refusals": self.refusals,
            "models": models,
        }
