"""The simulator's engine: no threads, and a model whose KV bytes are known.

`InlineEngine` has `EngineThread`'s interface (`start`, `call`, `stream`,
`stop`) but runs every job on the Trio thread, one at a time in FIFO order
(a fair `trio.Lock` stands in for the engine thread's job queue). Work costs
virtual time (`trio.sleep` under the MockClock), so timers fire between
decode steps as they would on a real machine.

`FakeModel` is a deterministic stand-in for a transformer: its keys and
values at position p are a function of (token, p, layer, head, dim), and its
greedy next token a function of the last token and position. Restored bytes
can therefore be checked exactly against `expected_layer_arrays`. With
`recurrent=True` it adds an `ArraysCache` layer whose state is a running
function of the tokens: untrimmable, like an SSM.

It is called as mlx-lm calls a model, serially (`KVCache`, scalar `offset`)
or as rows of a `BatchGenerator` (`BatchKVCache` with a per-row `offset`,
`ArraysCache` with a batch dimension): row b's token j sits at position
`offset[b] + j`. Padding slots (a negative position, outside the recurrent
cache's `left_padding`/`lengths` mask) get keys and values too, which
mlx-lm never extracts, but never enter the recurrent state, so every row's
caches equal the serial ones. `InlineEngine.blocking_waits` is False: its
jobs run on the Trio thread, so the batch lane's job must not wait on its
inbox (`engine/batch.py`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import trio
from mlx_lm.models.cache import ArraysCache, KVCache

from kvcellar.engine.engine import LoadedModel
from kvcellar.engine.speculative import Drafter

VOCAB_SIZE = 64
KEY_MODULUS = 1021
STATE_MODULUS = 8191


class FakeTokenizer:
    """Decodes ids to letters; enough for `TextAssembler`."""

    eos_token_id = VOCAB_SIZE - 1

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(ord("a") + token % 26) for token in ids)


def _key_values(
    tokens: np.ndarray, positions: np.ndarray, layer: int, heads: int, head_dim: int
) -> tuple[np.ndarray, np.ndarray]:
    """Keys and values as exact small integers in float32: `[1, heads, T,
    head_dim]` for `T` tokens, `[B, heads, T, head_dim]` for `[B, T]` rows."""
    rows = tokens.reshape(-1, 1, tokens.shape[-1], 1).astype(np.int64)
    position = positions.reshape(rows.shape).astype(np.int64)
    head = np.arange(heads).reshape(1, heads, 1, 1)
    dim = np.arange(head_dim).reshape(1, 1, 1, head_dim)
    keys = (rows * 131 + position * 17 + layer * 7 + head * 3 + dim) % KEY_MODULUS
    values = (rows * 89 + position * 29 + layer * 11 + head * 5 + dim * 2) % KEY_MODULUS
    return keys.astype(np.float32), values.astype(np.float32)


def _recurrent_state(tokens: np.ndarray, positions: np.ndarray, state: int) -> int:
    for token, position in zip(tokens.tolist(), positions.tolist(), strict=True):
        state = (state * 31 + (int(token) + 1) * (int(position) + 1)) % STATE_MODULUS
    return state


def next_token(last_token: int, position: int) -> int:
    """The fake model's greedy choice after `last_token` at `position`."""
    return (last_token * 7 + position * 3 + 5) % (VOCAB_SIZE - 1)


class FakeModel:
    """A transformer stand-in called like an mlx-lm model: `model(inputs, cache=...)`."""

    def __init__(self, *, layers: int = 2, heads: int = 2, head_dim: int = 4, recurrent: bool = False) -> None:
        self.layers = [None] * layers
        self.heads = heads
        self.head_dim = head_dim
        self.recurrent = recurrent

    def make_cache(self) -> list[Any]:
        caches: list[Any] = [KVCache() for _ in self.layers]
        if self.recurrent:
            caches.append(ArraysCache(1))
        return caches

    def __call__(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        tokens = np.array(inputs, dtype=np.int64)
        starts = np.broadcast_to(np.array(cache[0].offset, dtype=np.int64), tokens.shape[:1])
        positions = starts[:, None] + np.arange(tokens.shape[1])
        for layer, layer_cache in enumerate(cache[: len(self.layers)]):
            keys, values = _key_values(tokens, positions, layer, self.heads, self.head_dim)
            layer_cache.update_and_fetch(mx.array(keys), mx.array(values))
        if self.recurrent:
            self._advance_state(cache[len(self.layers)], tokens, positions)
        logits = np.zeros((*tokens.shape, VOCAB_SIZE), dtype=np.float32)
        for row, (token, position) in enumerate(zip(tokens[:, -1].tolist(), positions[:, -1].tolist(), strict=True)):
            logits[row, -1, next_token(token, position)] = 10.0
        return mx.array(logits)

    def _advance_state(self, state_cache: ArraysCache, tokens: np.ndarray, positions: np.ndarray) -> None:
        """Fold each row's real tokens into its state; padding slots are left out."""
        real = positions >= 0
        mask = state_cache.make_mask(tokens.shape[1])
        if mask is not None:
            real &= np.array(mask)
        previous = (
            np.zeros(tokens.shape[0], dtype=np.int64)
            if state_cache[0] is None
            else np.array(state_cache[0])[:, 0].astype(np.int64)
        )
        states = [
            _recurrent_state(row_tokens[keep], row_positions[keep], int(state))
            for row_tokens, row_positions, keep, state in zip(tokens, positions, real, previous, strict=True)
        ]
        state_cache[0] = mx.array(np.repeat(np.array(states, dtype=np.float32)[:, None], self.head_dim, axis=1))
        state_cache.advance(tokens.shape[1])

    def expected_layer_arrays(self, tokens: Sequence[int]) -> list[np.ndarray]:
        """What a cache holding exactly `tokens` must contain, per state array
        (keys and values per attention layer, then the recurrent state)."""
        token_array = np.asarray(tokens, dtype=np.int64)
        positions = np.arange(token_array.size)
        arrays: list[np.ndarray] = []
        for layer in range(len(self.layers)):
            arrays.extend(_key_values(token_array, positions, layer, self.heads, self.head_dim))
        if self.recurrent:
            arrays.append(np.full((1, self.head_dim), _recurrent_state(token_array, positions, 0), dtype=np.float32))
        return arrays


def cache_arrays(caches: Sequence[Any], token_count: int) -> list[np.ndarray]:
    """The state arrays of `caches` sliced to `token_count` tokens, as numpy
    (the same order as `FakeModel.expected_layer_arrays`)."""
    arrays: list[np.ndarray] = []
    for cache in caches:
        if isinstance(cache, ArraysCache):
            arrays.extend(np.array(slot) for slot in cache.cache if slot is not None)
            continue
        # Sliced in numpy: slicing in MLX would schedule one more evaluation per array.
        arrays.append(np.array(cache.keys)[..., :token_count, :])
        arrays.append(np.array(cache.values)[..., :token_count, :])
    return arrays


# The simulated draft model's identity (a real one's is its fingerprint digest).
FAKE_DRAFTER_DIGEST = "sim-drafter"


def fake_drafter(*, num_draft_tokens: int = 3) -> Drafter:
    """A draft model beside the fake target: one layer, one head, so its
    caches (the entries' companion state) are told apart from the target's.
    It proposes the target's own greedy tokens (`next_token`), so every
    proposal is accepted and a round emits k + 1 tokens."""
    return Drafter(
        model=FakeModel(layers=1, heads=1),
        model_dir=Path("/sim/draft"),
        num_draft_tokens=num_draft_tokens,
        digest=FAKE_DRAFTER_DIGEST,
    )


def fake_loaded_model(*, recurrent: bool = False) -> LoadedModel:
    return LoadedModel(
        model=FakeModel(recurrent=recurrent),
        tokenizer=FakeTokenizer(),
        model_dir=Path("/sim/model"),
        context_tokens_max=4096,
    )


class InlineEngine:
    """`EngineThread`'s interface, run inline on the Trio thread (see module doc).
    `token_cost_s` is the virtual time one generated token (or prefill chunk) takes."""

    # Jobs run on the Trio thread: one that waits for work would stall the tasks that send it.
    blocking_waits = False

    def __init__(
        self, loaded: LoadedModel, *, token_cost_s: float = 0.01, delay_s: Callable[[], float] | None = None
    ) -> None:
        self._loaded = loaded
        self._turn = trio.Lock()
        self.token_cost_s = token_cost_s
        # The seed's share of each job's and step's time (`BoundarySchedule`),
        # so they complete at points of the Trio schedule the seed chooses.
        self._delay_s = delay_s or (lambda: 0.0)
        self.stopped = False

    async def start(self) -> LoadedModel:
        return self._loaded

    def stop(self, timeout_s: float = 0.0) -> None:
        self.stopped = True

    async def call(
        self, job: Callable[[LoadedModel | None], Any], *, needs_model: bool = True, label: str = "call"
    ) -> Any:
        async with self._turn:
            await trio.sleep(self.token_cost_s + self._delay_s())
            result = job(self._loaded if needs_model else None)
            await trio.sleep(self._delay_s())
            return result

    async def stream(
        self, job: Callable[[LoadedModel], Iterator[Any]], cancelled: threading.Event, *, label: str = "stream"
    ):
        async with self._turn:
            items = job(self._loaded)
            try:
                for item in items:
                    yield item
                    if cancelled.is_set():
                        break
                    await trio.sleep(self.token_cost_s + self._delay_s())
            finally:
                # As the real engine does: a generator's cleanup runs here, not at collection.
                close = getattr(items, "close", None)
                if close is not None:
                    close()
                cancelled.set()
