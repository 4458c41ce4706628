"""Choosing phase three's checkpoint by what the model does, not by its loss.

The demo model's tool-call target is a share of greedy replies: on the 20
held-out tool prompts (`demo_corpus.held_out_tool_cases`), how many become a
parseable call that names only offered tools (`bench/demo_model.py`, through
`kvcellar serve --tool-call-grammar off`). The held-out assistant loss follows
it only loosely: runs of one recipe with about the same final loss scored
between 0.55 and 0.85. So phase three measures the same share on validation
prompts of its own (`validation_tool_cases`: another seed, and none equal to a
test prompt) at each evaluation, and each round of it ends on the weights
that scored best (`CheckpointScore` ranks them), instead of its last ones.

The measure here is a proxy of the bench's, in-process: greedy decoding of the
weights rounded to bfloat16 (what `serve` loads) but computed in float32 (MLX's
CPU matmuls are BLAS calls only in float32), all prompts as one batch, and the
tokenizer's own tool parser over the first `<tool_call>` block. It never touches the
training's random state, so the weights a run passes through are the same with
or without it; only which of them it keeps changes.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map

from kvcellar.demo import corpus as demo_corpus
from kvcellar.engine.tool_calls import offered_tool_names, parse_tool_calls

# Not 2_000_003 (the test prompts' seed): the choice must not see the prompts it is measured on.
VALIDATION_SEED = 3_000_017
# The bench measures the first 20 held-out tool prompts; a validation prompt equal to one is skipped.
TEST_PROMPTS = 20
# As the bench's request (`REPLY_TOKENS_MAX`): a call that has not closed by then does not count.
REPLY_TOKENS_MAX = 96


def _prompt_key(conversation: demo_corpus.Conversation) -> str:
    return json.dumps([conversation.messages, conversation.tools], sort_keys=True)


def validation_tool_cases(count: int) -> list[demo_corpus.Conversation]:
    """`count` tool prompts drawn like the held-out test prompts (held-out argument values),
    from `VALIDATION_SEED`, none equal to one of the first `TEST_PROMPTS` test prompts."""
    test_keys = {_prompt_key(conversation) for conversation, _ in demo_corpus.held_out_tool_cases(TEST_PROMPTS)}
    rng = random.Random(VALIDATION_SEED)
    cases: list[demo_corpus.Conversation] = []
    while len(cases) < count:
        conversation, _, _ = demo_corpus.tool_prompt(rng, held_out=True)
        if _prompt_key(conversation) not in test_keys:
            cases.append(conversation)
    return cases


def calls_only_offered_tools(tokenizer: Any, reply: str, tools: list[dict[str, Any]]) -> bool:
    """Whether `reply`'s first tool-call block parses (the tokenizer's `tool_parser`) into calls
    that each name an offered tool and carry object arguments, as `serve` would return them."""
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    if start not in reply:
        return False
    block = reply.split(start, 1)[1].split(end, 1)[0]
    try:
        calls = parse_tool_calls(tokenizer.tool_parser, block, tools)
    except Exception:  # the model's text, not a bug: a miss, as serve returns such text as content
        return False
    offered = offered_tool_names(tools)
    return bool(calls) and all(name in offered for name, _ in calls)


class ToolCallScorer:
    """The share of validation prompts whose greedy reply calls only offered tools.

    `build_model` makes an empty model of the trained shape: the scorer keeps one
    and loads into it a copy of the weights it scores, rounded to bfloat16 (kept
    in float32), so the model in training keeps its own float32 weights.
    """

    def __init__(self, model_dir: Path, build_model: Callable[[], nn.Module], prompts: int) -> None:
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        self._tokenizer = load_tokenizer(Path(model_dir))
        self._model = build_model()
        self._model.set_dtype(mx.float32)
        self._cases = [
            (self._tokenizer.apply_chat_template(case.messages, tools=case.tools, add_generation_prompt=True), case)
            for case in validation_tool_cases(prompts)
        ]
        # `</tool_call>` is one added token (`demo_models.TOOL_FORMAT_TOKENS`): a call ends on it.
        (self._end_marker_id,) = self._tokenizer.encode(self._tokenizer.tool_call_end, add_special_tokens=False)

    def share(self, model: nn.Module) -> float:
        self._model.update(tree_map(lambda weight: weight.astype(mx.bfloat16).astype(mx.float32), model.parameters()))
        replies = self._greedy_replies([ids for ids, _ in self._cases])
        hits = [
            calls_only_offered_tools(self._tokenizer, reply, case.tools)
            for reply, (_, case) in zip(replies, self._cases, strict=True)
        ]
        return sum(hits) / len(hits)

    def _greedy_replies(self, prompts: list[list[int]]) -> list[str]:
        """Every prompt's greedy reply, decoded as one left-padded batch (mlx-lm's `BatchKVCache`
        masks the padding): ~10x faster than one prompt at a time on a CPU."""
        from mlx_lm.models.cache import BatchKVCache

        longest = max(len(ids) for ids in prompts)
        padding = [longest - len(ids) for ids in prompts]
        cache = [BatchKVCache(padding) for _ in self._model.layers]
        logits = self._model(
            mx.array([[0] * pad + ids for pad, ids in zip(padding, prompts, strict=True)]), cache=cache
        )
        replies: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        end_id, eos_ids = self._end_marker_id, set(self._tokenizer.eos_token_ids)
        for _ in range(REPLY_TOKENS_MAX):
            tokens = mx.argmax(logits[:, -1], axis=-1)
            for row, token in enumerate(np.asarray(tokens).astype(int).tolist()):
                done[row] = done[row] or token in eos_ids
                if not done[row]:
                    replies[row].append(token)
                    done[row] = token == end_id
            if all(done):
                break
            logits = self._model(tokens[:, None], cache=cache)
        return [str(self._tokenizer.decode(ids)) for ids in replies]


@attrs.frozen(kw_only=True)
class CheckpointScore:
    """An evaluation's figures that rank checkpoints: the validation share first, then the lower
    held-out assistant loss."""

    step: int
    validation_tool_call_share: float
    assistant_loss: float

    def beats(self, other: CheckpointScore | None) -> bool:
        if other is None:
            return True
        return (self.validation_tool_call_share, -self.assistant_loss) > (
            other.validation_tool_call_share,
            -other.assistant_loss,
        )
