"""mlx-lm's `BatchGenerator` without two copies of every reused row on a RAM hit.

When rows finish their prompt, mlx-lm's `BatchGenerator` moves them to the
generation batch with `PromptProcessingBatch.split`, which deep-copies the
prompt batch's merged caches (every row of every layer) and then gathers the
moving rows out of the copy (`BatchKVCache.filter`, a second copy), even when
every row of the prompt batch moves. On a RAM hit that is the common case: a
request whose cached prefix leaves one token to run is a one-row prompt batch
that moves whole in the step it is admitted, so the two copies were most of
the hit's time past a few thousand tokens (docs/benchmarks.md, issue 23).

`LeanBatchGenerator` keeps a `MovingPromptBatch` as its prompt batch: when
all of its rows leave, `split` hands over the batch itself (its caches, as
they are) and starts over empty, which is what the deep copy and the filter
computed, minus the copies. Nothing else refers to those caches: the prompt
batch made them in `_merge_caches` and only `extract_cache` reads them (it
copies what it returns). A split that leaves rows behind takes mlx-lm's path.

The merge itself (`BatchKVCache.merge`) allocates exactly the rows it copies,
so the first decode step after it grows the cache by one 256-row step
(`update_and_fetch`), copying every row again. `LeanBatchGenerator` merges
plain `KVCache` layers with a step of capacity to spare instead
(`merge_with_capacity`, the same copy into a larger buffer), so the step
writes in place.

What a RAM hit copies, then: the merge, once (the lent views are read, never
written: the RAM entry stays byte-identical). mlx-lm's stock path copies the
reused rows four times; mlx_lm.server deep-copies its cache entry first, five.

An SSD restore's caches are not lent: the restore made them for this one row
(step-rounded capacity with at least a step of slack). engine/batch.py
inserts them through `owned_row_caches`, and a prompt batch of that row alone
adopts their buffers (`adopt_row`): a restore copies nothing on this lane.
The wrappers of both kinds live from the row's insertion to the merge.

On MLX's CPU backend the generation batch is an `EagerGenerationBatch`:
mlx-lm's step schedules step n+1 (`mx.async_eval`) before it returns step n's
tokens, which pipelines on a GPU, but on the CPU `mx.async_eval` of a forward
step returns only once most of the step has run, so a first token came one
whole step late (at 32k tokens, about 1.3 s of TTFT); the eager batch hands
new rows' first tokens over without that wait.

This relies on mlx-lm 0.32's `BatchGenerator` keeping its prompt batch as
`_prompt_batch` and its generation batch as `_generation_batch`, and on
`GenerationBatch._step`'s body (pyproject pins `mlx-lm<0.33`;
tests/test_batch_generator.py fails when that changes). Engine thread only,
as all MLX work.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch
from mlx_lm.models.cache import BatchKVCache, KVCache

# mlx-lm's KVCache growth step: the capacity the merge leaves past the rows.
CAPACITY_STEP_ROWS = BatchKVCache.step


def merge_with_capacity(caches: list[Any]) -> BatchKVCache:
    """`BatchKVCache.merge` of plain `KVCache` layers (one per row), with the
    buffer rounded up past the longest row to the next step, so at least one
    more token fits without a growth copy. Same rows, same left padding, same
    offsets; the spare rows are zeros past `_idx`, as after any growth step."""
    lengths = [c.size() for c in caches]
    longest = max(lengths)
    if longest == 0:
        return BatchKVCache([0] * len(caches))
    padding = [longest - length for length in lengths]
    filled = [c for c in caches if c.keys is not None]
    heads, key_dim, value_dim = filled[0].keys.shape[1], filled[0].keys.shape[3], filled[0].values.shape[3]
    capacity = (longest // CAPACITY_STEP_ROWS + 1) * CAPACITY_STEP_ROWS
    keys = mx.zeros((len(caches), heads, capacity, key_dim), dtype=filled[0].keys.dtype)
    values = mx.zeros((len(caches), heads, capacity, value_dim), dtype=filled[0].values.dtype)
    for row, (pad, cache) in enumerate(zip(padding, caches, strict=True)):
        if cache.keys is None:
            continue
        keys[row : row + 1, :, pad : pad + cache.offset] = cache.keys[..., : cache.offset, :]
        values[row : row + 1, :, pad : pad + cache.offset] = cache.values[..., : cache.offset, :]
    # Any: mlx-lm leaves the cache attributes unannotated, so mypy types `keys` as None.
    merged: Any = BatchKVCache(padding)
    merged.keys, merged.values = keys, values
    merged.offset += longest
    merged._idx = longest
    return merged


class _MergingWithCapacity(KVCache):
    """A row's plain layer as the prompt batch is made: mlx-lm merges layer i
    through row 0's `merge`, and this one leaves capacity. Lives only until
    the prompt batch is made (`capacity_merging_caches`; the merge copies it
    away)."""

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchKVCache:
        return merge_with_capacity(caches)


def _marked(layer: Any, kind: type[KVCache]) -> Any:
    """A plain layer as `kind` (whose `merge` decides how the prompt batch is
    made), over the same arrays; other kinds of layer as they are."""
    if type(layer) is not KVCache:
        return layer
    wrapped = kind()
    wrapped.keys, wrapped.values, wrapped.offset = layer.keys, layer.values, layer.offset
    return wrapped


def capacity_merging_caches(caches: list[Any]) -> list[Any]:
    """A row's lent caches as the batch lane inserts them: plain layers
    marked so that the merge leaves a step of capacity (`merge_with_capacity`);
    other kinds as they are."""
    return [_marked(layer, _MergingWithCapacity) for layer in caches]


def adopt_row(cache: Any) -> BatchKVCache:
    """A one-row `BatchKVCache` over `cache`'s own buffers: no copy. Only for
    a layer nothing else refers to (its step writes into those buffers). The
    restore leaves its slack rows zeroed, as `merge_with_capacity` does."""
    # Any: mlx-lm leaves the cache attributes unannotated, so mypy types `keys` as None.
    adopted: Any = BatchKVCache([0])
    if cache.keys is None:
        return adopted
    adopted.keys, adopted.values = cache.keys, cache.values
    adopted.offset += cache.offset
    adopted._idx = cache.offset
    return adopted


class _OwnedRow(KVCache):
    """A row's plain layer that the row owns outright: restored from the SSD
    tier into fresh arrays of step-rounded capacity, lent to no one. A prompt
    batch made of that row alone adopts its buffers (`adopt_row`), so the
    restored rows are not copied and the first step writes in place; a batch
    with other rows merges with capacity (one copy). Lives only until the
    prompt batch is made (`owned_row_caches`)."""

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchKVCache:
        if len(caches) == 1:
            return adopt_row(caches[0])
        return merge_with_capacity(caches)


def owned_row_caches(caches: list[Any]) -> list[Any]:
    """The caches of a row that owns them (an SSD restore), as the batch
    lane inserts them: plain layers marked so that a one-row merge adopts
    their buffers; other kinds as they are. The caller must drop its own
    references to `caches`' arrays: the batch writes into them."""
    return [_marked(layer, _OwnedRow) for layer in caches]


class EagerGenerationBatch(GenerationBatch):
    """`GenerationBatch` that hands new rows' first tokens over before the next step runs.

    mlx-lm's `_step` builds step n+1 from step n's sampled tokens, schedules
    it with `mx.async_eval`, then evaluates and returns step n's tokens. On
    MLX's CPU backend `mx.async_eval` of a forward step blocks until most of
    it has run (measured on the medium llama at 16k tokens: 0.11-0.19 s of a
    0.13-0.2 s step), so the return waited for step n+1 too: a first token
    came a whole step late. The steps that hand new rows their first tokens
    (the one in `__init__` and the next, and the next after an `extend`)
    are eager here: evaluate step n (built lazily by the call before), build
    step n+1 without scheduling it, return. Every other step is mlx-lm's,
    whose scheduling ahead still overlaps part of a step with the caller's
    work (measured: eager throughout decoded 5-9 % fewer tokens/s with 4 rows
    of the small llama). The same graphs in the same order either way, so the
    same tokens and logprobs. On a GPU, where `mx.async_eval` returns at
    once, `LeanBatchGenerator` keeps mlx-lm's batch.

    Invariant, as in mlx-lm: after `_step`, `self.tokens` holds exactly the
    tokens the (lazy) caches hold."""

    # The construction's step and the one that hands the first tokens over.
    _EAGER_STEPS_OF_NEW_ROWS = 2

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._eager_steps_left = self._EAGER_STEPS_OF_NEW_ROWS
        super().__init__(*args, **kwargs)
        if not self.uids:
            # An empty batch (the generator's own, before any row joins) has no first tokens to hand over.
            self._eager_steps_left = 0

    def extend(self, batch: Any) -> None:
        super().extend(batch)
        # The joining rows' construction step ran; the next one hands their first tokens over.
        if batch.uids:
            self._eager_steps_left = max(self._eager_steps_left, 1)

    def _step(self) -> tuple[list[int], list[mx.array]]:
        if self._eager_steps_left == 0:
            return super()._step()
        self._eager_steps_left -= 1
        return self._eager_step()

    def _eager_step(self) -> tuple[list[int], list[mx.array]]:
        # Any: mlx-lm declares these attributes None-able in `__init__`; here they are set.
        inputs: Any = self._next_tokens
        self._current_tokens, self._current_logprobs = inputs, self._next_logprobs
        mx.eval(inputs, self._current_logprobs)
        next_tokens: Any
        next_tokens, self._next_logprobs = self._sampled_after(inputs)
        self._next_tokens = next_tokens
        token_ids = inputs.tolist()
        for row_tokens, token_id in zip(self.tokens, token_ids, strict=True):
            row_tokens.append(token_id)
        return token_ids, self._current_logprobs

    def _sampled_after(self, inputs: mx.array) -> tuple[mx.array, list[mx.array]]:
        """mlx-lm's step body, unevaluated: the forward pass over `inputs`, each row's
        logits processors, the normalisation and the sampling."""
        logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
        processors_by_row: list[Any] = self.logits_processors or []
        if any(processors_by_row):
            processed = []
            for row in range(len(self.uids)):
                row_logits = logits[row : row + 1]
                processors = processors_by_row[row] or ()
                if processors:
                    context = self._token_context[row].update_and_fetch(inputs[row : row + 1])
                    for processor in processors:
                        row_logits = processor(context, row_logits)
                processed.append(row_logits)
            logits = mx.concatenate(processed, axis=0)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        given: list[Any] = self.samplers or [None] * len(self.uids)
        samplers = [self.fallback_sampler if s is None else s for s in given]
        if not samplers or all(s is samplers[0] for s in samplers):
            sampled = (samplers[0] if samplers else self.fallback_sampler)(logprobs)
        else:
            sampled = mx.concatenate([s(logprobs[row : row + 1]) for row, s in enumerate(samplers)], axis=0)
        return sampled, list(logprobs)


class MovingPromptBatch(PromptProcessingBatch):
    """A prompt batch whose `split` of every row moves it instead of copying it, and whose
    `generate` makes a `generation_batch_class` (mlx-lm's own unless told otherwise)."""

    generation_batch_class: type[GenerationBatch] = GenerationBatch

    def generate(self, tokens: list[list[int]]) -> GenerationBatch:
        """mlx-lm's `generate` with `generation_batch_class`."""
        if any(len(row) > 1 for row in tokens):
            self.prompt([row[:-1] for row in tokens])
        generation = self.generation_batch_class(
            self.model,
            self.uids,
            mx.array([row[-1] for row in tokens]),
            self.prompt_cache,
            self.tokens,
            self.samplers,
            self.fallback_sampler,
            self.logits_processors,
            self.stop_sequences,
            self.max_tokens,
        )
        self._start_over()
        return generation

    def split(self, indices: list[int]) -> PromptProcessingBatch:
        if sorted(indices) != list(range(len(self.uids))):
            return super().split(indices)
        # A shallow copy: the moved batch takes the lists and caches as they are.
        moved = copy.copy(self)
        self._start_over()
        return moved

    def _start_over(self) -> None:
        """Empty, with fresh lists (the moved batch holds the old ones)."""
        self.uids = []
        self.prompt_cache = []
        self.tokens = []
        self.samplers = []
        self.logits_processors = []
        self.stop_sequences = []
        self.max_tokens = []


class LeanBatchGenerator(BatchGenerator):
    """`BatchGenerator` with a `MovingPromptBatch`, and on the CPU an `EagerGenerationBatch`
    (see the module doc)."""

    def __init__(self, model: Any, **options: Any) -> None:
        super().__init__(model, **options)
        self._prompt_batch = MovingPromptBatch.empty(self.model, self.sampler, prefill_step_size=self.prefill_step_size)
        if self._stream.device.type == mx.cpu:
            self._prompt_batch.generation_batch_class = EagerGenerationBatch
            self._generation_batch = EagerGenerationBatch.empty(self.model, self.sampler)
