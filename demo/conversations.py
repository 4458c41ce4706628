"""Phase three's rows: whole conversations, tokenized, with a weight per token in the loss.

Phases one and two train on windows cut anywhere in a stream of chats, so few
windows hold a tool list, the request and the call together; phase three
(`demo/train.py`, `train_tool_phase`) trains on one whole chat per row and
scores only what the assistant writes, the tokens that choose weighing more.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from kvcellar.demo import corpus as demo_corpus
from kvcellar.demo.training_config import TrainingConfig
from kvcellar.engine.demo_models import EOS_TOKEN, PAD_TOKEN_ID

ASSISTANT_TURN_START = "<|im_start|>assistant\n"
ASSISTANT_TURN_END = EOS_TOKEN
TOOL_CALL_START, TOOL_NAME_KEY = "<tool_call>", '"name": "'


@attrs.frozen(kw_only=True)
class ConversationRow:
    """One tokenized conversation and, per id, its weight in the loss: 0 for context (what the
    assistant did not write), 1 for the assistant's text, `tool_choice_loss_weight` for the
    tokens that choose (`choice_spans`)."""

    ids: np.ndarray
    weights: np.ndarray


@attrs.frozen(kw_only=True)
class ConversationRows:
    tool: list[ConversationRow]
    plain: list[ConversationRow]
    held_out_tool: list[ConversationRow]


def assistant_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the assistant's turns in a rendered chat: after the turn's header,
    through its closing `<|im_end|>` (the model must learn to stop)."""
    spans = []
    start = text.find(ASSISTANT_TURN_START)
    while start != -1:
        begin = start + len(ASSISTANT_TURN_START)
        end = text.find(ASSISTANT_TURN_END, begin)
        end = len(text) if end == -1 else end + len(ASSISTANT_TURN_END)
        spans.append((begin, end))
        start = text.find(ASSISTANT_TURN_START, end)
    return spans


def choice_spans(text: str, assistant: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Character spans of the tokens that decide what the assistant does: the first token of
    each of its turns (a `<tool_call>` or text) and the name of each tool it calls."""
    spans = []
    for begin, end in assistant:
        spans.append((begin, begin + 1))
        start = text.find(TOOL_CALL_START, begin, end)
        while start != -1:
            name = text.find(TOOL_NAME_KEY, start, end)
            if name == -1:
                break
            name += len(TOOL_NAME_KEY)
            close = text.find('"', name, end)
            spans.append((name, end if close == -1 else close))
            start = text.find(TOOL_CALL_START, name, end)
    return spans


def build_conversation_rows(model_dir: Path, config: TrainingConfig) -> ConversationRows:
    """Phase three's whole conversations (own seed), tokenized with their loss weights."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    functions = demo_corpus.function_docs(demo_corpus.read_modules(demo_corpus.TRAINING_MODULES))

    def encode(conversation: demo_corpus.Conversation, choice_weight: float = 1.0) -> ConversationRow:
        tools: Any = conversation.tools or None
        text = str(tokenizer.apply_chat_template(conversation.messages, tools=tools, tokenize=False))
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        spans = assistant_spans(text)
        choices = choice_spans(text, spans)

        def weight(first: int) -> float:
            if not any(begin <= first < end for begin, end in spans):
                return 0.0
            return choice_weight if any(begin <= first < end for begin, end in choices) else 1.0

        weights = [weight(first) for first, _ in encoding["offset_mapping"]]
        return ConversationRow(ids=np.asarray(encoding["input_ids"], np.int32), weights=np.asarray(weights, np.float32))

    rng = random.Random(config.seed + 2)
    tool_count = round(config.tool_conversations * config.tool_row_share)
    tool = [
        encode(
            demo_corpus.tool_conversation(
                rng,
                varied_value_share=config.tool_varied_value_share,
                rounds=rng.randint(1, config.tool_rounds_max),
            ),
            config.tool_choice_loss_weight,
        )
        for _ in range(tool_count)
    ]
    plain = [
        encode(demo_corpus.code_conversation(rng, rng.choice(functions)))
        for _ in range(config.tool_conversations - tool_count)
    ]
    held_out_rng = random.Random(config.seed + 3)
    held_out_count = max(1, config.eval_windows // 2)
    held_out = [encode(demo_corpus.tool_conversation(held_out_rng, held_out=True)) for _ in range(held_out_count)]
    return ConversationRows(tool=tool, plain=plain, held_out_tool=held_out)


def padded_tokens(row_tokens: int, quantum_tokens: int, tokens_max: int) -> int:
    """`row_tokens` rounded up to a multiple of `quantum_tokens`, at most `tokens_max`."""
    return min(tokens_max, -(-row_tokens // quantum_tokens) * quantum_tokens)


def conversation_batch(
    rows: list[ConversationRow], tokens_max: int, quantum_tokens: int
) -> tuple[np.ndarray, np.ndarray]:
    """The rows from their first token, padded (masked out) to a multiple of `quantum_tokens`,
    cut at `tokens_max`; the mask is over the predicted tokens (`windows[:, 1:]`)."""
    tokens = padded_tokens(max(len(row.ids) for row in rows), quantum_tokens, tokens_max)
    windows = np.full((len(rows), tokens + 1), PAD_TOKEN_ID, dtype=np.int32)
    mask = np.zeros((len(rows), tokens), dtype=np.float32)
    for index, row in enumerate(rows):
        ids = row.ids[: tokens + 1]
        windows[index, : len(ids)] = ids
        mask[index, : len(ids) - 1] = row.weights[1 : len(ids)]
    return windows, mask


def tool_length_classes(
    rows: list[ConversationRow], quantum_tokens: int, tokens_max: int
) -> dict[int, list[ConversationRow]]:
    """`rows` by their padded length (`padded_tokens`)."""
    classes: dict[int, list[ConversationRow]] = {}
    for row in rows:
        classes.setdefault(padded_tokens(len(row.ids), quantum_tokens, tokens_max), []).append(row)
    return classes
