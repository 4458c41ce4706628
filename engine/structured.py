"""Structured output (`response_format`) through llguidance.

llguidance compiles a JSON schema (or "any JSON object") into a grammar and,
given the tokens sampled so far, computes the set of tokens that keep the
output inside it: a bitmask over the vocabulary per step. `GrammarMask` is a
logits processor (mlx-lm's `(tokens, logits) -> logits` shape) that applies
that mask to the MLX logits, so it runs unchanged in the serial lane and as a
batch row's processor in `BatchGenerator`.

The grammar travels as llguidance's serialized grammar string (immutable,
validated on the HTTP worker thread by `compile_response_grammar`); each
generation builds its own `LLMatcher` from it on the engine thread, so no
matcher state is ever shared between requests or threads. The token table
(`LLTokenizer`) is built once per tokenizer and is immutable; the memo that
holds it is guarded by a lock held only for the dictionary access.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from kvcellar.engine.scalars import item_int

if TYPE_CHECKING:
    # A TypedDict of the extension's stub only; not importable at run time.
    from llguidance._lib import JsonCompileOptions
from kvcellar.errors import GrammarError

log = logging.getLogger("kvcellar.engine")


# Compact JSON: a random or small model given "any whitespace" spends its
# tokens on whitespace instead of closing the object.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}

_token_tables: weakref.WeakKeyDictionary[Any, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()
_token_tables_lock = threading.Lock()


def token_table(tokenizer: Any) -> llguidance.LLTokenizer:
    """llguidance's token table for an mlx-lm `TokenizerWrapper` (a Hugging
    Face fast tokenizer inside), built once per tokenizer."""
    with _token_tables_lock:
        table = _token_tables.get(tokenizer)
    if table is not None:
        return table
    hf_tokenizer = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        table = llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=sorted(tokenizer.eos_token_ids))
    except Exception as e:
        raise GrammarError(f"llguidance cannot build a token table from this tokenizer: {e}") from e
    with _token_tables_lock:
        return _token_tables.setdefault(tokenizer, table)


def compile_response_grammar(tokenizer: Any, schema: dict[str, Any] | None) -> str:
    """The grammar for JSON valid against `schema` (None: any JSON object),
    checked against the tokenizer; raises `GrammarError` saying why not."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"} if schema is None else schema, defaults=_JSON_OPTIONS
        )
    except (ValueError, TypeError) as e:
        raise GrammarError(f"the schema is not a JSON schema llguidance accepts: {e}") from e
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, token_table(tokenizer))
    if is_error:
        raise GrammarError(f"llguidance cannot compile the schema: {messages[0] if messages else 'unknown error'}")
    return grammar


class GrammarMask:
    """A stateful logits processor for one generation: before each step it
    feeds the previously sampled token (the last one of `tokens`, from the
    second call on) to its matcher, then masks every token the grammar
    forbids to -inf. Once the grammar is complete only the end tokens stay;
    should the matcher ever refuse a token, only the end tokens stay too."""

    def __init__(self, tokenizer: Any, grammar: str) -> None:
        table = token_table(tokenizer)
        self._matcher = llguidance.LLMatcher(table, grammar, log_level=0)
        if self._matcher.is_error():
            raise GrammarError(f"llguidance rejected the grammar: {self._matcher.get_error()}")
        self._vocab_tokens = table.vocab_size
        self._end_token_ids = sorted(i for i in tokenizer.eos_token_ids if i < table.vocab_size)
        self._bitmask = allocate_token_bitmask(1, table.vocab_size)
        self._calls = 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._calls > 0 and not self._matcher.is_error():
            sampled = item_int(tokens[-1])
            if not self._matcher.consume_token(sampled):
                log.warning(
                    "the grammar refused sampled token %d (%s); ending the generation",
                    sampled,
                    self._matcher.get_error(),
                )
        self._calls += 1
        if self._matcher.is_error():
            # Raising here would fail every row of a batch: end this one instead.
            allowed = np.zeros(self._vocab_tokens, dtype=np.uint8)
            allowed[self._end_token_ids] = 1
        else:
            allowed = matcher_allowed_tokens(self._matcher, self._bitmask, self._vocab_tokens)
        return masked_logits(logits, allowed)


def matcher_allowed_tokens(matcher: llguidance.LLMatcher, bitmask: np.ndarray, vocab_tokens: int) -> np.ndarray:
    """A 0/1 vector over the vocabulary of the tokens `matcher` allows next (`bitmask`: its scratch space)."""
    fill_next_token_bitmask(matcher, bitmask)
    return np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab_tokens]


def masked_logits(logits: mx.array, allowed: np.ndarray) -> mx.array:
    """`logits` with every token `allowed` (a 0/1 vector over the vocabulary) does not allow set to -inf."""
    width = logits.shape[-1]
    # Logits past the tokenizer's vocabulary (padded embeddings) are never allowed.
    if width > allowed.size:
        allowed = np.concatenate([allowed, np.zeros(width - allowed.size, dtype=allowed.dtype)])
    mask = mx.array(allowed[:width].astype(np.bool_))
    return mx.where(mask, logits, mx.array(-float("inf"), dtype=logits.dtype))
