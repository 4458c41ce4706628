"""Encoding rendered chat prompts, reusing the tokens of a recent prompt.

A conversation's next request renders a text whose beginning is the previous
request's text (the same turns, the same template), and a RAM hit's own work
is dominated by tokenizing all of it again: at 16k tokens the tokenizer takes
most of a hit's time on a small model, on every server. `PromptEncoder.encode`
keeps the last few prompts it encoded (text, ids, and where their added
tokens sit, read from the fast tokenizer's character offsets) and encodes
only what follows the last added token (a turn
marker such as `<|im_start|>`) that the new text shares with the most similar
of them; the result is the tokenizer's own encoding of the whole text.

Why the spliced encoding is exact: a Hugging Face fast tokenizer first splits
its input at added tokens (leftmost-longest matching; on the raw text for an
added token that is not `normalized`), then normalizes, pre-tokenizes and
encodes every piece between them on its own (ByteLevel's prefix space and the
like apply per piece; Metaspace's `first` scheme only to the piece at offset 0).
Take an added token that the earlier encoding matched at `start` and that
ends, with room for the longest added token after `start`, inside the text both
prompts share: every match up to and including it is the same in both texts
(no candidate reaching past the shared text can start at or before `start`),
hence so is every piece before it and its tokens. Encoding the new text from
`start` on gives that added token first and then the pieces after it, none at
offset 0, as in the whole text. A `single_word` added token could match
differently at a changed neighbour, so a tokenizer with one is never spliced,
and neither is a slow tokenizer (no offsets). An added token whose match took
in whitespace around it (`lstrip`, `rstrip`) spans more than its text and is
no splice point; a splice whose tail does not begin with the same token over
the same span is dropped and the whole text encoded. The same argument gives the
template probe's cheap path (http/tools.py `stable_prefix_tokens`).

Thread use: prompts are rendered on the HTTP side's worker threads; each
encoder's recent list is its own mutable state, guarded by its lock, which is
held only to look up and to record (never while encoding). Entries are
immutable (`EncodedPrompt`). `prompt_encoder(tokenizer)` keeps one encoder per
tokenizer object for as long as that object lives.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

RECENT_PROMPTS_MAX = 4


@attrs.frozen(kw_only=True)
class AddedTokens:
    """A fast tokenizer's added tokens matched on raw text: id -> text, and the longest text's length."""

    texts: Mapping[int, str]
    longest_chars: int


@attrs.frozen(kw_only=True)
class EncodedPrompt:
    """A text and its token ids; `marks` are (start, end, index) of the ids
    that are plain added tokens (`AddedTokens`) spelled out in `text` at
    [start, end), in order: the splice points of a later text and the
    template probe's boundaries. Empty for a tokenizer that cannot splice."""

    text: str
    ids: tuple[int, ...]
    marks: tuple[tuple[int, int, int], ...] = ()


def fast_offsets_tokenizer(tokenizer: Any) -> Any | None:
    """The Hugging Face fast tokenizer inside mlx-lm's wrapper (or the
    tokenizer itself), which encodes with character offsets; None for any
    other tokenizer."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    return inner if getattr(inner, "is_fast", False) is True and callable(inner) else None


def plain_added_tokens(tokenizer: Any) -> AddedTokens | None:
    """The fast tokenizer's added tokens that are matched on raw text (not
    `normalized`); None when it has none, has a `single_word` one, or is not
    a fast tokenizer (see the module's note)."""
    inner = fast_offsets_tokenizer(tokenizer)
    decoder = getattr(inner, "added_tokens_decoder", None) if inner is not None else None
    if not isinstance(decoder, dict) or not decoder:
        return None
    if any(getattr(token, "single_word", True) for token in decoder.values()):
        return None
    texts = {token_id: str(token.content) for token_id, token in decoder.items()}
    raw = {
        token_id: text for token_id, text in texts.items() if getattr(decoder[token_id], "normalized", True) is False
    }
    return AddedTokens(texts=raw, longest_chars=max(len(text) for text in texts.values())) if raw else None


def common_length(left: Sequence[Any], right: Sequence[Any]) -> int:
    """How many leading items two sequences share: slices compared in C,
    halving the differing span (str against str, anything else as tuples)."""
    if not (isinstance(left, str) and isinstance(right, str)):
        left, right = tuple(left), tuple(right)
    limit = min(len(left), len(right))
    if left[:limit] == right[:limit]:
        return limit
    # Invariant: left[:shared] == right[:shared] and the first difference lies before `differs`.
    shared, differs = 0, limit
    while differs - shared > 1:
        middle = (shared + differs) // 2
        if left[shared:middle] == right[shared:middle]:
            shared = middle
        else:
            differs = middle
    return shared


class PromptEncoder:
    """Encodes texts with one tokenizer, splicing onto a recent encoding
    where that is exact (module note)."""

    def __init__(self, tokenizer: Any, *, recent_max: int = RECENT_PROMPTS_MAX) -> None:
        self.tokenizer = tokenizer
        self._fast = fast_offsets_tokenizer(tokenizer)
        self._added = plain_added_tokens(tokenizer) if self._fast is not None else None
        self._recent: list[EncodedPrompt] = []
        self._recent_max = recent_max
        self._lock = threading.Lock()

    def encode(self, text: str) -> EncodedPrompt:
        if self._fast is None or self._added is None:
            return EncodedPrompt(text=text, ids=tuple(self.tokenizer.encode(text, add_special_tokens=False)))
        with self._lock:
            recent = list(self._recent)
        same = [entry for entry in recent if entry.text == text]
        encoded = same[0] if same else self._spliced(text, recent)
        if encoded is None:
            encoded = self._marked(text, *self._encode_with_offsets(text))
        with self._lock:
            self._recent = [encoded, *(entry for entry in self._recent if entry.text != text)][: self._recent_max]
        return encoded

    def _encode_with_offsets(self, text: str) -> tuple[tuple[int, ...], Sequence[tuple[int, int]]]:
        assert self._fast is not None
        encoding = self._fast(text, add_special_tokens=False, return_offsets_mapping=True)
        return tuple(encoding["input_ids"]), encoding["offset_mapping"]

    def _marked(
        self, text: str, ids: tuple[int, ...], spans: Sequence[tuple[int, int]], shift: int = 0
    ) -> EncodedPrompt:
        """`ids` with the marks of their plain added tokens; `shift` is added to every index (a spliced tail's)."""
        assert self._added is not None
        texts = self._added.texts
        marks = []
        for index in [index for index, token_id in enumerate(ids) if token_id in texts]:
            start, end = spans[index]
            if text[start:end] == texts[ids[index]]:
                marks.append((start, end, index + shift))
        return EncodedPrompt(text=text, ids=ids, marks=tuple(marks))

    def _spliced(self, text: str, recent: list[EncodedPrompt]) -> EncodedPrompt | None:
        """`text` encoded from the last added token it shares with the recent
        prompt that shares most with it; None where no such token is found."""
        assert self._added is not None
        longest_chars = self._added.longest_chars
        best, shared_chars = None, 0
        for entry in recent:
            length = common_length(entry.text, text)
            if length > shared_chars:
                best, shared_chars = entry, length
        if best is None:
            return None
        # The last added token that starts with room for the longest added token before the shared text ends.
        position = bisect.bisect_right(best.marks, shared_chars - longest_chars, key=lambda mark: mark[0])
        if position == 0:
            return None
        start, end, index = best.marks[position - 1]
        tail_ids, tail_spans = self._encode_with_offsets(text[start:])
        if not tail_ids or tail_ids[0] != best.ids[index] or tuple(tail_spans[0]) != (0, end - start):
            return None  # not the tokenizer this module reasons about: encode the whole text instead
        tail = self._marked(text[start:], tail_ids, tail_spans, shift=index)
        kept = best.marks[: position - 1]
        shifted = tuple((begin + start, stop + start, at) for begin, stop, at in tail.marks)
        return EncodedPrompt(text=text, ids=best.ids[:index] + tail_ids, marks=kept + shifted)


_ENCODERS: weakref.WeakKeyDictionary[Any, PromptEncoder] = weakref.WeakKeyDictionary()
_ENCODERS_LOCK = threading.Lock()


def prompt_encoder(tokenizer: Any) -> PromptEncoder:
    """The encoder of `tokenizer` (one per tokenizer object, kept while it lives);
    a fresh one, remembering nothing, for a tokenizer that cannot be weakly referenced."""
    with _ENCODERS_LOCK:
        try:
            encoder = _ENCODERS.get(tokenizer)
            if encoder is None:
                encoder = _ENCODERS[tokenizer] = PromptEncoder(tokenizer)
        except TypeError:
            return PromptEncoder(tokenizer)
        return encoder
