"""One engine thread for several models (issue 41, the model pool).

MLX runs on one thread only (engine/engine.py), so a pool of models shares it: each model gets a
`ModelEngine`, which is an `EngineThread` to its `System` (the same start/call/stream/stop), but
whose jobs go to the one `SharedEngineThread`. That thread keeps one FIFO per model and picks the
next job round robin among the models with work waiting: a model's own jobs still run in
submission order (its serial lane's FIFO), and no model waits behind more than one job of each
other model (fair interleaving, never starvation). A job is one engine turn (a call, a spill plan),
except a stream (a serial generation, a batch job), which gives the thread back between two of its
items while another model has a job waiting: it parks (`StreamTurns`, engine/engine.py), its
continuation goes to the front of its model's queue, and the round robin serves the other models
first. So the engine runs one model's work at a time, a batch whose rows keep coming holds it for
one step while others wait, and each model's own jobs keep their order (nothing of the model runs
between a stream's turns). A parked stream's state (the batch's rows, its MLX caches) lives in its
continuation, which only this thread runs: it stays the engine thread's.

`ModelEngine.start()` loads the model on the shared thread; `stop()` drops it there and returns
MLX's buffer cache, leaving the thread running for the other models.
"""

from __future__ import annotations

import collections
import gc
import threading
from collections.abc import Callable
from pathlib import Path

from kvcellar.engine.compute_dtype import ComputeDtype
from kvcellar.engine.engine import (
    MODEL_DTYPE,
    RELEASE_AT_ONCE_BYTES,
    RELEASE_IDLE_S,
    BufferCache,
    EngineThread,
    Job,
    LoadedModel,
    MlxBufferCache,
    _load,
    configure_host_allocator,
)

UNLOAD_WAIT_S = 30.0


class SharedEngineThread:
    """The one engine thread of a model pool: per-model FIFOs served round robin."""

    def __init__(
        self,
        *,
        buffer_cache: BufferCache | None = None,
        release_idle_s: float = RELEASE_IDLE_S,
        release_at_once_bytes: int = RELEASE_AT_ONCE_BYTES,
    ) -> None:
        self.buffer_cache = buffer_cache if buffer_cache is not None else MlxBufferCache()
        self.release_idle_s = release_idle_s
        self.release_at_once_bytes = release_at_once_bytes
        # Guards the queues, the round-robin order and the stop flag: held only to add or take a job.
        self._lock = threading.Condition()
        self._queues: dict[str, collections.deque[Job]] = {}
        self._order: list[str] = []
        self._last_served = -1
        self._stopping = False
        # Jobs run to their end, and the times a stream parked to let another model's job go first, per model
        # (/stats). Written by the engine thread only; readers copy a count.
        self.jobs_run: collections.Counter[str] = collections.Counter()
        self.engine_yields: collections.Counter[str] = collections.Counter()
        self.thread = threading.Thread(target=self._run, name="kvcellar-engine", daemon=True)

    def start(self) -> None:
        if not self.thread.is_alive():
            self.thread.start()

    def submit(self, model: str, job: Job) -> None:
        with self._lock:
            if model not in self._queues:
                self._queues[model] = collections.deque()
                self._order.append(model)
            self._queues[model].append(job)
            self._lock.notify()

    def others_waiting(self, model: str) -> bool:
        """Whether a model other than `model` has a job queued (a stream of `model` then gives way)."""
        with self._lock:
            return any(queue for name, queue in self._queues.items() if name != model)

    def _park(self, model: str, rest: Job) -> None:
        """Put a parked stream's continuation first in its model's queue: the round robin, which just served
        `model`, serves the others first, and none of `model`'s later jobs overtakes it."""
        with self._lock:
            self._queues[model].appendleft(rest)
        self.engine_yields[model] += 1

    def stop(self, timeout_s: float = 30.0) -> None:
        """Run what is queued, then end the thread (MLX aborts at exit if it still runs)."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self.thread.is_alive():
            self.thread.join(timeout_s)

    def _next(self, wait_s: float | None) -> tuple[str, Job] | None:
        """The next job, round robin from the model after the last one served; None when idle past `wait_s`
        or stopped with nothing queued."""
        with self._lock:
            while True:
                count = len(self._order)
                for step in range(1, count + 1):
                    index = (self._last_served + step) % count
                    queue = self._queues[self._order[index]]
                    if queue:
                        self._last_served = index
                        return self._order[index], queue.popleft()
                if self._stopping:
                    return None
                if not self._lock.wait(wait_s) and wait_s is not None:
                    return None

    def _run(self) -> None:
        """As `EngineThread._run`: MLX's buffer cache goes back after an idle period or past a bound."""
        configure_host_allocator()
        release_due = False
        while True:
            picked = self._next(self.release_idle_s if release_due else None)
            if picked is None:
                with self._lock:
                    if self._stopping and not any(self._queues.values()):
                        return
                self.buffer_cache.clear_cache()
                release_due = False
                continue
            model, job = picked
            rest = job()
            if rest is None:
                self.jobs_run[model] += 1
            else:
                self._park(model, rest)
            cached_bytes = self.buffer_cache.cache_bytes()
            release_due = 0 < cached_bytes <= self.release_at_once_bytes
            if cached_bytes > self.release_at_once_bytes:
                self.buffer_cache.clear_cache()

    def model_engine(
        self, name: str, model_dir: Path, *, compute: ComputeDtype = MODEL_DTYPE, turn_log: list | None = None
    ) -> ModelEngine:
        return ModelEngine(self, name, model_dir, compute=compute, turn_log=turn_log)


class _ModelQueue:
    """What `EngineThread.call`/`stream` put their jobs into, for one model of the shared thread."""

    def __init__(self, shared: SharedEngineThread, name: str) -> None:
        self._shared = shared
        self._name = name

    def put(self, job: Job | None) -> None:
        if job is not None:
            self._shared.submit(self._name, job)


class ModelEngine(EngineThread):
    """One model of a pool: an `EngineThread` to its `System`, running on the shared thread."""

    def __init__(
        self,
        shared: SharedEngineThread,
        name: str,
        model_dir: Path,
        *,
        compute: ComputeDtype = MODEL_DTYPE,
        turn_log: list | None = None,
    ) -> None:
        super().__init__(model_dir, compute=compute, turn_log=turn_log, buffer_cache=shared.buffer_cache)
        self.name = name
        self.shared = shared
        self._jobs = _ModelQueue(shared, name)  # type: ignore[assignment]
        self._thread = shared.thread

    def turn_wanted(self) -> bool:
        """Whether another model's job waits for the engine thread: this model's streams then park between
        two items, and its batch loop stops waiting for rows (engine/batch.py)."""
        return self.shared.others_waiting(self.name)

    def _give_way(self) -> Callable[[], bool]:
        return self.turn_wanted

    async def start(self) -> LoadedModel:
        self.shared.start()
        self._loaded = await self.call(lambda _: _load(self.model_dir, self.compute), needs_model=False, label="load")
        return self._loaded

    def stop(self, timeout_s: float = UNLOAD_WAIT_S) -> None:
        """Drop this model on the engine thread (after its queued jobs) and return MLX's buffer cache;
        the thread goes on for the other models. Waits for that turn at most `timeout_s`."""
        done = threading.Event()

        def unload() -> None:
            self._loaded = None
            gc.collect()
            self.buffer_cache.clear_cache()
            done.set()

        if not self.shared.thread.is_alive():
            self._loaded = None
            return
        self.shared.submit(self.name, unload)
        done.wait(timeout_s)
