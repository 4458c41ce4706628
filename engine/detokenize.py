"""Streaming detokenisation with stop tokens and stop strings."""

from __future__ import annotations

from typing import Any


class TextAssembler:
    """Turns token ids into text deltas. Holds back an incomplete UTF-8
    sequence (the decoder's U+FFFD at the end) and any tail that could still
    become a stop string, so no stop string is ever emitted, even in part."""

    def __init__(self, tokenizer: Any, stop_token_ids: frozenset[int], stop_strings: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop_token_ids = stop_token_ids
        self.stop_strings = stop_strings
        self.ids: list[int] = []
        self.emitted = 0
        self.finished_by_stop = False

    def add(self, token_id: int) -> str:
        """The new text `token_id` makes safe to emit ("" if none yet)."""
        if token_id in self.stop_token_ids:
            self.finished_by_stop = True
            return self.flush()
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        for stop in self.stop_strings:
            at = text.find(stop, max(0, self.emitted - len(stop)))
            if at != -1:
                self.finished_by_stop = True
                return self._emit_until(text, at)
        if text.endswith("\ufffd"):
            return ""
        hold = max((len(s) - 1 for s in self.stop_strings), default=0)
        return self._emit_until(text, max(self.emitted, len(text) - hold))

    @property
    def finish_reason(self) -> str:
        """ "stop" once a stop token or string ended the text, "length" otherwise."""
        return "stop" if self.finished_by_stop else "length"

    def closing_text(self) -> str:
        """What is left to emit at the end: nothing after a stop, the held-back tail otherwise."""
        return "" if self.finished_by_stop else self.flush()

    def flush(self) -> str:
        """Everything not yet emitted (at the end of generation)."""
        return self._emit_until(self.tokenizer.decode(self.ids), None)

    def _emit_until(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else end
        delta = text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return delta
