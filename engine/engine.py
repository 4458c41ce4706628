"""The engine thread: the one thread that loads the model and does all MLX work.

MLX streams and lazy arrays belong to the thread that made them (mlx-notes,
"Threads"), so the model is loaded *on* this thread and every MLX call runs
here. The Trio side submits jobs and awaits their results; jobs run one at a
time in submission order, which is the serial lane's FIFO admission.
"""

from __future__ import annotations

import ctypes
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

import attrs
import mlx.core as mx
import trio
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler

from kvcellar.engine.compute_dtype import ComputeDtype, choose_compute_dtype, read_weights_facts
from kvcellar.engine.reply import CrossThreadReply
from kvcellar.engine.scalars import item_int
from kvcellar.errors import EngineStopped, ModelError, UsageError

PREFILL_STEP_TOKENS = 512
# What an engine computes in when nobody resolved a policy for it: the weights' own dtype.
MODEL_DTYPE = ComputeDtype(policy="model", cast_to=None, reason="the weights' own dtype")


@attrs.frozen(kw_only=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: frozenset[int] = frozenset()
    # Logits processors (engine/sampling.py), applied before the sampler on both lanes.
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # llguidance's serialized grammar for `response_format` (engine/structured.py).
    grammar: str | None = None
    # Report each sampled token's log-probability, and this many alternatives.
    logprobs: bool = False
    top_logprobs: int = 0


@attrs.define(kw_only=True)
class LoadedModel:
    model: Any
    tokenizer: Any
    model_dir: Path
    context_tokens_max: int
    # The dtype policy the weights were loaded under (engine/compute_dtype.py).
    compute: ComputeDtype = MODEL_DTYPE


# Called before each prefill chunk with its token count, the tokens of
# `tokens` already run and the caches (the memory guard's relief check, the
# client-gone check); raising stops the prefill before that chunk.
BeforeChunk = Callable[[int, int, list[Any]], None]


class PrefillObserver(Protocol):
    """Told about one request's prefill, on the engine thread (issue 38: a
    long prefill never looks dead). `progress` comes at least once per chunk
    with the prompt tokens the caches hold and the prompt's length; `cancelled`
    once, when the client left mid-prefill, with the tokens kept in the tiers.
    It runs on the lane's time: hand the news to another thread and return (a
    test's seam may hold it there, to hold the prefill between two chunks)."""

    def progress(self, tokens_done: int, tokens_total: int) -> None: ...

    def cancelled(self, tokens_kept: int, tokens_total: int) -> None: ...


def prefill(
    model: Any,
    tokens: Sequence[int],
    cache: list[Any],
    step_tokens: int = PREFILL_STEP_TOKENS,
    before_chunk: BeforeChunk | None = None,
) -> mx.array:
    """Run `tokens` through the model in chunks of `step_tokens` (all but the
    last), evaluating the caches after each; returns the last token's logits."""
    tokens = list(tokens)
    position = 0
    while len(tokens) - position > 1:
        chunk = tokens[position : position + min(step_tokens, len(tokens) - position - 1)]
        if before_chunk is not None:
            before_chunk(len(chunk), position, cache)
        model(mx.array([chunk]), cache=cache)
        mx.eval([c.state for c in cache])
        position += len(chunk)
    if before_chunk is not None and position < len(tokens):
        before_chunk(len(tokens) - position, position, cache)
    return model(mx.array([tokens[position:]]), cache=cache)[:, -1, :]


def sample_next(sampler: Any, logits: mx.array) -> mx.array:
    """One sampled token from logits, through an mlx-lm sampler (on log-probabilities)."""
    token = sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    mx.eval(token)
    return token


def make_params_sampler(params: SamplingParams) -> Any:
    """A sampler for `params` (on log-probabilities, one row or a batch of rows).

    Without a seed it is mlx-lm's sampler, drawing from MLX's global generator.
    With one, the draws come from the sampler's own key chain started at the
    seed, so a seeded request samples the same tokens whether it runs alone on
    the serial lane or as one row among others in the batch lane.
    """
    if params.seed is None or params.temperature == 0:
        return make_sampler(temp=params.temperature, top_p=params.top_p, min_p=params.min_p, top_k=params.top_k)
    return _SeededSampler(params)


class _SeededSampler:
    """mlx-lm's filter chain (top-p, min-p, top-k, in its order), then a
    categorical draw with the next key of a chain seeded by `params.seed`."""

    def __init__(self, params: SamplingParams) -> None:
        if params.seed is None:
            raise UsageError("a seeded sampler needs a seed")
        self._params = params
        self._key = mx.random.key(params.seed)

    def __call__(self, logprobs: mx.array) -> mx.array:
        params = self._params
        if 0 < params.top_p < 1.0:
            logprobs = apply_top_p(logprobs, params.top_p)
        if params.min_p != 0.0:
            logprobs = apply_min_p(logprobs, params.min_p)
        if params.top_k > 0:
            logprobs = apply_top_k(logprobs, params.top_k)
        self._key, draw = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1.0 / params.temperature), key=draw)

    @property
    def key_words(self) -> tuple[int, ...]:
        """The chain's key now (uint32 words): where a checkpoint resumes it."""
        words = cast(list[int], self._key.tolist())  # a key is a 1-d uint32 array
        return tuple(int(word) for word in words)

    def resume_at(self, key_words: tuple[int, ...]) -> None:
        """Go on from a key `key_words` recorded (spec §5.7: the original sampler step)."""
        self._key = mx.array(key_words, dtype=mx.uint32)


def sampler_key_words(sampler: Any) -> tuple[int, ...]:
    """A seeded sampler's key words; () for greedy and unseeded samplers (nothing to resume)."""
    return sampler.key_words if isinstance(sampler, _SeededSampler) else ()


def resume_sampler(sampler: Any, key_words: tuple[int, ...]) -> None:
    """Set a seeded sampler's chain to `key_words`; refuses a key for a sampler without one."""
    if not key_words:
        return
    if not isinstance(sampler, _SeededSampler):
        raise UsageError("a sampler key was recorded for a request whose sampler has none")
    sampler.resume_at(key_words)


def generate_tokens(
    model: Any, prompt_ids: Sequence[int], params: SamplingParams, cache: list[Any] | None = None
) -> Iterator[int]:
    """Prefill `prompt_ids` in chunks, then yield sampled token ids until
    `max_tokens` or a stop token (the stop token is yielded, then generation
    ends). No prompt cache: the plain loop benchmarks compare against. Runs on
    the engine thread."""
    sampler = make_params_sampler(params)
    cache = cache if cache is not None else make_prompt_cache(model)
    logits = prefill(model, prompt_ids, cache)
    for _ in range(params.max_tokens):
        token = sample_next(sampler, logits)
        token_id = item_int(token)
        yield token_id
        if token_id in params.stop_token_ids:
            return
        logits = model(token.reshape(1, 1), cache=cache)[:, -1, :]


_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 128 * 1024


def configure_host_allocator() -> bool:
    """On glibc, pin the mmap threshold so large freed buffers (KV caches, MLX
    arrays) go back to the OS at once. Otherwise glibc raises the threshold
    after the first large free and keeps later ones in its heap, so resident
    memory stays far above what the RAM tier bills. Returns whether it applied."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False


# After a job, MLX's buffer cache is handed back to the allocator once the
# engine has had no job for this long (so a request sent the moment a reply
# ends never waits for the release), or at once when it holds more than this.
RELEASE_IDLE_S = 0.25
RELEASE_AT_ONCE_BYTES = 256 << 20


class BufferCache(Protocol):
    """MLX's buffer cache as the engine thread releases it (`MlxBufferCache`)."""

    def cache_bytes(self) -> int: ...
    def clear_cache(self) -> None: ...


class MlxBufferCache:
    """MLX's buffer cache (engine/memory.py's `MlxMemoryMeter` adds the live-memory counters)."""

    def cache_bytes(self) -> int:
        return int(mx.get_cache_memory())

    def clear_cache(self) -> None:
        mx.clear_cache()


# An engine job: it runs on the engine thread and returns None when done, or, when it parked to give the
# thread to other work, its continuation (a stream's next turn; engine/shared_engine.py runs it later).
Job = Callable[[], "Job | None"]


class StreamTurns:
    """One `EngineThread.stream` job on the engine thread: the generator `start()` makes, and `deliver`, which
    hands each item, the end or the error to Trio. `run` drives the generator until it ends, or parks it
    when `give_way()` says, between two items, that another model's job waits: it then returns itself as
    the continuation, the generator suspended inside it. Only the engine thread runs a turn, so the
    generator's state (a batch's rows and caches) is the engine thread's whether it runs or waits."""

    def __init__(
        self,
        start: Callable[[], Iterator[Any]],
        cancelled: threading.Event,
        deliver: Callable[[str, Any], None],
        give_way: Callable[[], bool] | None,
    ) -> None:
        self._start = start
        self._cancelled = cancelled
        self._deliver = deliver
        self._give_way = give_way
        self._items: Iterator[Any] | None = None

    def run(self) -> Job | None:
        parked = False
        try:
            if self._items is None:
                self._items = self._start()
            for item in self._items:
                self._deliver("item", item)
                if self._cancelled.is_set():
                    break
                if self._give_way is not None and self._give_way():
                    parked = True
                    return self.run
            self._deliver("end", None)
        except BaseException as e:
            self._deliver("error", e)
        finally:
            # Close here, on the engine thread: a generator's cleanup does MLX
            # work and must not run wherever garbage collection happens.
            close = getattr(self._items, "close", None)
            if not parked and close is not None:
                close()
        return None


class EngineThread:
    """Owns the engine thread. `start()` loads the model on it; `call(job)`
    runs `job(loaded_model)` there; `stream(job, cancelled)` runs a generator
    job there and yields its items to Trio as they come."""

    def __init__(
        self,
        model_dir: Path,
        *,
        turn_log: list[tuple[str, float, float]] | None = None,
        buffer_cache: BufferCache | None = None,
        release_idle_s: float = RELEASE_IDLE_S,
        release_at_once_bytes: int = RELEASE_AT_ONCE_BYTES,
        compute: ComputeDtype = MODEL_DTYPE,
    ) -> None:
        self.model_dir = Path(model_dir)
        # Resolved before the engine starts: the serving fingerprint names it too.
        self.compute = compute
        # (label, start, end) of every job, in perf_counter seconds, when given: lets
        # tests prove what ran between what.
        self.turn_log = turn_log
        self.buffer_cache = buffer_cache if buffer_cache is not None else MlxBufferCache()
        self.release_idle_s = release_idle_s
        self.release_at_once_bytes = release_at_once_bytes
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvcellar-engine", daemon=True)
        self._loaded: LoadedModel | None = None

    def _run(self) -> None:
        """Run jobs in order. What a finished job freed stays in MLX's buffer
        cache until the engine idles for `release_idle_s` (then nobody waits
        on the release, which can take tens of milliseconds) or until the
        cache holds more than `release_at_once_bytes`: between jobs it never
        holds more than that bound longer than an idle period."""
        configure_host_allocator()
        release_due = False
        while True:
            try:
                job = self._jobs.get(timeout=self.release_idle_s) if release_due else self._jobs.get()
            except queue.Empty:
                self.buffer_cache.clear_cache()
                release_due = False
                continue
            if job is None:
                return
            job()
            cached_bytes = self.buffer_cache.cache_bytes()
            release_due = 0 < cached_bytes <= self.release_at_once_bytes
            if cached_bytes > self.release_at_once_bytes:
                self.buffer_cache.clear_cache()

    async def start(self) -> LoadedModel:
        self._thread.start()
        self._loaded = await self.call(lambda _: _load(self.model_dir, self.compute), needs_model=False)
        return self._loaded

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish the queued jobs, then end the thread. Joining matters: MLX
        aborts the process if its thread is still running at interpreter exit."""
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _logged(self, label: str, run: Job) -> Job:
        """`run`, appending its (label, start, end) to `turn_log` when one is kept; a turn that parks
        returns its continuation, logged the same way."""
        turn_log = self.turn_log
        if turn_log is None:
            return run

        def logged() -> Job | None:
            started = time.perf_counter()
            try:
                rest = run()
            finally:
                turn_log.append((label, started, time.perf_counter()))
            return self._logged(label, rest) if rest is not None else None

        return logged

    def _give_way(self) -> Callable[[], bool] | None:
        """What a stream asks between two items whether to hand the thread to other work (engine/shared_engine.py);
        None here: one model's jobs run in order and a stream keeps the thread until it ends."""
        return None

    async def call(
        self, job: Callable[[LoadedModel | None], Any], *, needs_model: bool = True, label: str = "call"
    ) -> Any:
        if not self._thread.is_alive():
            raise EngineStopped("the engine thread is not running")
        reply: CrossThreadReply[Any] = CrossThreadReply()

        def run() -> None:
            # Whatever the job raises is carried back to the awaiting task.
            reply.capture_from_thread(job, self._loaded if needs_model else None)

        self._jobs.put(self._logged(label, run))
        with trio.CancelScope(shield=True):
            await reply.settled()
        return reply.result()

    async def stream(
        self, job: Callable[[LoadedModel], Iterator[Any]], cancelled: threading.Event, *, label: str = "stream"
    ):
        """Yield each item `job` produces on the engine thread; setting
        `cancelled` stops the job between two steps."""
        token = trio.lowlevel.current_trio_token()
        send, receive = trio.open_memory_channel[tuple[str, Any]](float("inf"))

        def deliver(kind: str, value: Any) -> None:
            token.run_sync_soon(send.send_nowait, (kind, value))

        def start() -> Iterator[Any]:
            if self._loaded is None:
                raise EngineStopped("the model is not loaded")
            return job(self._loaded)

        run = StreamTurns(start, cancelled, deliver, self._give_way()).run
        self._jobs.put(self._logged(label, run))
        try:
            async for kind, value in receive:
                if kind == "item":
                    yield value
                elif kind == "error":
                    raise value
                else:
                    return
        finally:
            cancelled.set()


def resolve_compute_dtype(policy: str, model_dir: Path) -> ComputeDtype:
    """`--compute-dtype` for the model in `model_dir` on MLX's default device: reads
    the safetensors headers (file I/O: call it off the Trio thread) and device metadata only."""
    return choose_compute_dtype(policy, device=mx.default_device().type.name, facts=read_weights_facts(model_dir))


def _load(model_dir: Path, compute: ComputeDtype = MODEL_DTYPE) -> LoadedModel:
    from kvcellar.engine.attention_window import load_model_and_tokenizer

    try:
        model, tokenizer = load_model_and_tokenizer(model_dir)
    except ModelError:
        raise
    except Exception as e:
        raise ModelError(f"cannot load the model in {model_dir}: {e}") from e
    if compute.cast_to is not None:
        # Floating parameters only (nn.Module.set_dtype's default predicate); evaluated
        # here so the bfloat16 originals are freed before the first request.
        model.set_dtype(getattr(mx, compute.cast_to))
        mx.eval(model.parameters())
    config = getattr(model, "args", None)
    context = getattr(config, "max_position_embeddings", None) or 8192
    return LoadedModel(
        model=model, tokenizer=tokenizer, model_dir=model_dir, context_tokens_max=int(context), compute=compute
    )
