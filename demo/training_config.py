"""The demo-coder's training configuration (`TrainingConfig`), apart from the loop that
uses it (`demo/train.py`) so the data pipeline (`demo/conversations.py`) can read it too."""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class TrainingConfig:
    """Everything that decides the trained weights besides the library versions and the
    CPU, and how often the held-out losses are measured (`*eval_every_steps`: forward passes
    only, so they change the loss curve's points, never the weights)."""

    seed: int = 0
    # Ids of the byte-level BPE trained on the training text (phase one's chats and code) before
    # anything else, so frequent words and identifiers (`weather`, `get_weather`, `self`) are one
    # token each; 0: the shared tokenizer of the random-weight models (1024 ids, trained on 14
    # stdlib files), which split each tool name into 3 to 9 tokens.
    tokenizer_ids: int = 2048
    steps: int = 250
    batch_rows: int = 4
    window_tokens: int = 384
    learning_rate_peak: float = 3e-3
    learning_rate_final: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.01
    # Share of each batch's rows drawn from the chat stream (the rest: standard-library code).
    chat_row_share: float = 0.75
    chat_conversations: int = 6000
    # 50, not 10: each evaluation costs ~2.5 training steps (16 windows), ~7 % of phases one and two.
    eval_every_steps: int = 50
    eval_windows: int = 16
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    # Phase two (`train_chat_phase`): chat windows only, a fresh AdamW with a cosine decay from this rate.
    chat_steps: int = 240
    chat_learning_rate: float = 1e-3
    # Phase three (`train_tool_phase`): whole conversations, one per row from its first token, with the
    # loss on the assistant's tokens only; `tool_row_share` of the rows are tool chats, the rest plain chats.
    tool_steps: int = 350
    tool_learning_rate: float = 1e-3
    tool_conversations: int = 3000
    tool_row_share: float = 0.75
    conversation_tokens_max: int = 768
    # Rows are padded to a multiple of this many tokens (so the compiled step sees few shapes).
    row_tokens_quantum: int = 128
    # When set, a step's tool chats come from one length class (a multiple of the quantum): the
    # first is drawn from all of them, the others from its class, so every chat is still drawn with
    # the same chance, and a step pads to about its first chat's length instead of the longest of
    # three random ones. With a 64-token quantum phase three ran ~1.5x faster (attention's cost
    # grows with the square of the padded length), but the two models made so scored below the
    # committed one on tool calls (docs/demo-model.md), so the default stays as it made that one.
    tool_rows_by_length: bool = False
    # Its evaluations cost ~2 training steps each (whole conversations), so they come less often.
    tool_eval_every_steps: int = 50
    # Then a warm restart of phase three: this many more steps from its stored weights, a fresh AdamW,
    # the same schedule shape, new batch draws (the assistant loss was still falling when the first
    # round's learning rate had decayed).
    tool_restart_steps: int = 300
    # Share of phase three's tool chats whose arguments are made-up values (`demo_corpus.varied_value`),
    # so the model learns to copy them from the request rather than recall the training pools.
    tool_varied_value_share: float = 0.5
    # Weight in phase three's loss of the tokens that decide what the assistant does (`choice_spans`:
    # a turn's first token, a called tool's name), against 1 for its other tokens: they are a few of
    # a chat's ~60 assistant tokens, and the made-up argument values' high loss would drown them.
    tool_choice_loss_weight: float = 8.0
    # Phase three's tool chats hold 1 to this many request/call/result/answer rounds (uniformly): the
    # tool list is most of a chat's tokens, and each round after the first adds a choice for ~70 more.
    tool_rounds_max: int = 4
    # When non-zero, each round of phase three ends on the checkpoint (of its evaluations; the
    # restart's also against the weights it started from) whose greedy replies to this many
    # validation tool prompts most often call only offered tools (`tool_validation`), the lower
    # held-out assistant loss breaking ties; the restart starts from what the first round kept.
    # 0: each round ends on its last weights.
    tool_validation_prompts: int = 0


# Settings that decide when the held-out losses are measured, not the weights.
EVALUATION_SETTINGS = frozenset({"eval_every_steps", "tool_eval_every_steps"})

# Phase-three settings added after models were made without them, and the value that means "as before".
SETTINGS_BEFORE_THEY_EXISTED: dict[str, float] = {
    "tool_varied_value_share": 0.0,
    "tool_choice_loss_weight": 1.0,
    "tool_rounds_max": 1,
    "row_tokens_quantum": 128,
    "tool_rows_by_length": False,
    "tokenizer_ids": 0,
    "tool_validation_prompts": 0,
}
