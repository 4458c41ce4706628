"""The one write-behind pipeline: the RAM tier's events port, and where its events go.

`WriteBehind` is the `TierEvents` port the RAM tier (`PromptCache`) is built
with. Its engine-thread side hands each event to the Trio thread with one
`run_sync_soon` (FIFO, so a put is recorded before the reply of the request
that made it), and only when someone listens; its Trio side routes it: takes
and puts to SSD write admission, puts to the durability coordinator
(write-behind on), spills through admission into the spill queue.

An entry's way to the SSD tier crosses from the Trio thread to another thread
at most twice (`store/spill_plan.py`):

- write-behind: the coordinator's attempt checks coverage, snapshots the RAM
  entry, plans its write and materialises every tensor in one engine turn
  (`DurabilityPorts.snapshot_exact`); the SSD writer writes, commits and
  indexes it in one worker call.
- a spill (eviction, demotion, oversize put): the snapshot is made inside the
  engine job that evicts; the SSD writer plans and materialises it in one
  engine turn, then writes it in one worker call.

Made before the RAM tier (which needs the port) and started once the SSD
tier's queue and writer run (`start`), which makes the coordinator.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import numpy as np
import trio

from kvcellar.actors.admission import AdmissionCore, AdmissionGate
from kvcellar.actors.durability_core import RecordKey
from kvcellar.actors.durability_shell import DurabilityCoordinator
from kvcellar.actors.gateway import Gateway
from kvcellar.actors.spill_queue import SpillQueue
from kvcellar.actors.ssd_writer import SsdWriter
from kvcellar.actors.system_config import SystemConfig
from kvcellar.store.prompt_cache import PromptCache, SpillSnapshot
from kvcellar.store.ssd import SsdStore
from kvcellar.store.wipe import WipeSelector

log = logging.getLogger("kvcellar.write_behind")


class ResidencyListener(Protocol):
    """Told of every entry the RAM tier gains (`resident`) and loses (`gone`)."""

    def resident(self, entry_id: str, namespace: str, tokens: np.ndarray) -> None: ...

    def gone(self, entry_id: str) -> None: ...


T = TypeVar("T")


class WriteBehind:
    """The RAM tier's `TierEvents` port and the Trio-side pipeline behind it.

    `store` None (no SSD tier): nothing listens, no spill is taken.
    `admission`: SSD write admission's core (None: `always`, no gate).
    `durable_puts`: write-behind is on, so every put is marked dirty."""

    def __init__(
        self,
        trio_token: trio.lowlevel.TrioToken,
        *,
        store: SsdStore | None,
        admission: AdmissionCore | None,
        durable_puts: bool,
    ) -> None:
        self._trio_token = trio_token
        self._store = store
        self.admission = (
            AdmissionGate(admission, clock_s=trio.current_time, on_granted=self._admission_granted)
            if admission is not None and store is not None
            else None
        )
        self._durable_puts = durable_puts and store is not None
        self._listens_to_puts = self._durable_puts or self.admission is not None
        self.queue: SpillQueue | None = None
        self.durability: DurabilityCoordinator | None = None
        self._flushes_running = 0
        self._residency_listeners: tuple[ResidencyListener, ...] = ()

    # -- the port: engine thread ------------------------------------------------

    @property
    def accepts_spills(self) -> bool:
        return self._store is not None

    def taken(self, namespace: str, tokens: tuple[int, ...]) -> None:
        if self.admission is not None:
            self._trio_token.run_sync_soon(self.admission.taken, namespace, tokens)

    def put(self, namespace: str, tokens: tuple[int, ...]) -> None:
        if self._listens_to_puts:
            self._trio_token.run_sync_soon(self._put_seen, namespace, tokens)

    def spilled(self, snapshot: SpillSnapshot) -> None:
        self._trio_token.run_sync_soon(self._submit_spill, snapshot)

    def resident(self, entry_id: str, namespace: str, tokens: np.ndarray) -> None:
        for listener in self._residency_listeners:
            listener.resident(entry_id, namespace, tokens)

    def gone(self, entry_id: str) -> None:
        for listener in self._residency_listeners:
            listener.gone(entry_id)

    def wiped(self, selector: WipeSelector) -> None:
        # After the puts this port handed on before: the coordinator forgets exactly those.
        self._trio_token.run_sync_soon(self._wiped_seen, selector)

    def add_residency_listener(self, listener: ResidencyListener) -> None:
        """Tell `listener` of every entry the RAM tier gains or loses from now
        on, on the engine thread inside the call that changed the tier (it must
        hand the work on without waiting). Call on the Trio thread: the listeners
        are an immutable tuple replaced whole, so the engine thread never sees
        one half-changed."""
        self._residency_listeners = (*self._residency_listeners, listener)

    # -- the pipeline: Trio thread ------------------------------------------------

    async def start(
        self,
        nursery: trio.Nursery,
        *,
        config: SystemConfig,
        gateway: Gateway,
        prompt_cache: PromptCache,
        queue: SpillQueue,
        writer: SsdWriter,
    ) -> None:
        """Take the spill queue, and start the durability coordinator when write-behind
        is on (its snapshot turn plans the write through `writer`). Once, before requests."""
        assert self._store is not None and self.queue is None, "start once, with an SSD tier"
        self.queue = queue
        if self._durable_puts:
            self.durability = DurabilityCoordinator(
                DurabilityPorts(gateway, prompt_cache, self._store, queue, writer),
                debounce_s=config.debounce_s,
                busy_rearm_s=config.busy_rearm_s,
                journal=self._store.journal,
                admission=self.admission,
            )
            await nursery.start(self.durability.run)

    @property
    def flushing(self) -> bool:
        """A flush is running: SSD admission lets every spill through meanwhile."""
        return self._flushes_running > 0

    @contextlib.contextmanager
    def flush_window(self) -> Iterator[None]:
        """While a flush runs (they may overlap)."""
        self._flushes_running += 1
        try:
            yield
        finally:
            self._flushes_running -= 1

    def _put_seen(self, namespace: str, tokens: tuple[int, ...]) -> None:
        # Admission sees the put before the coordinator does.
        if self.admission is not None:
            self.admission.put(namespace, tokens)
        if self.durability is not None:
            self.durability.dirty(namespace, tokens)

    def _wiped_seen(self, selector: WipeSelector) -> None:
        if self.durability is not None:
            self.durability.wiped(selector)

    def _admission_granted(self, key: RecordKey) -> None:
        if self.durability is not None:
            self.durability.admission_granted(key)

    def _submit_spill(self, snapshot: SpillSnapshot) -> None:
        # Runs inside run_sync_soon, where an exception would end the whole Trio run.
        try:
            store, queue = self._store, self.queue
            if store is None or queue is None:
                log.warning("spill of %d tokens before the SSD tier started: dropped", len(snapshot.tokens))
                return
            # The queue's one entrance asks admission; refused, the snapshot's views go with this frame.
            queue.submit_nowait(
                snapshot, forced=self.flushing, covered=lambda: store.covers(snapshot.tokens, snapshot.namespace)
            )
        except Exception as e:
            log.warning("spill of %d tokens refused: %s", len(snapshot.tokens), e)


class DurabilityPorts:
    """What the durability coordinator needs of the rest of the system."""

    def __init__(
        self, gateway: Gateway, prompt_cache: PromptCache, store: SsdStore, queue: SpillQueue, writer: SsdWriter
    ) -> None:
        self._gateway = gateway
        self._prompt_cache = prompt_cache
        self._store = store
        self._queue = queue
        self._writer = writer

    def gateway_busy(self) -> bool:
        return self._gateway.busy

    async def run_when_idle(self, step: Callable[[], T]) -> T:
        result: T = await self._gateway.run_when_idle(lambda _: step())
        return result

    def snapshot_exact(self, tokens: Any, namespace: str) -> SpillSnapshot | None:
        """The RAM entry's snapshot with its write planned and its tensors
        materialised (`PlannedSpill`): in the attempt's one engine turn, so the
        writer needs no engine turn of its own."""
        snapshot = self._prompt_cache.snapshot_exact(tokens, namespace)
        return self._writer.plan(snapshot) if snapshot is not None else None

    def covers(self, tokens: Any, namespace: str) -> bool:
        return self._store.covers(tokens, namespace)

    async def submit(self, snapshot: SpillSnapshot, *, forced: bool) -> str:
        return await self._queue.submit(snapshot, forced=forced)

    async def wait_queue_idle(self) -> None:
        await self._queue.wait_idle()
