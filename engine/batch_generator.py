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

What a RAM hit copies, then: `_merge_caches` copies the lent rows into the
merged cache (the lent views are read, never written: the RAM entry stays
byte-identical), and the first decode step grows that cache by one step
(mlx-lm's `update_and_fetch`), one more copy. Both are needed by any server
built on mlx-lm's batching; mlx_lm.server also deep-copies its cache entry
before that.

This relies on mlx-lm 0.32's `BatchGenerator` keeping its prompt batch as
`_prompt_batch` (pyproject pins `mlx-lm<0.33`; tests/test_batch_generator.py
fails when that changes). Engine thread only, as all MLX work.
"""

from __future__ import annotations

import copy
from typing import Any

from mlx_lm.generate import BatchGenerator, PromptProcessingBatch


class MovingPromptBatch(PromptProcessingBatch):
    """A prompt batch whose `split` of every row moves it instead of copying it."""

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
    """`BatchGenerator` with a `MovingPromptBatch` (see the module doc)."""

    def __init__(self, model: Any, **options: Any) -> None:
        super().__init__(model, **options)
        self._prompt_batch = MovingPromptBatch.empty(self.model, self.sampler, prefill_step_size=self.prefill_step_size)
