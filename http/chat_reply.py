"""The OpenAI chat shape of a reply: `message` (non-streaming) and `delta`s
(streaming) with `content`, `reasoning_content` and `tool_calls`.

`ChatReply` wraps one `ReplySplitter` (http/tools.py) per request. A
streamed tool call goes out as two deltas of the same `index`: the first
with its `id`, `type` and `function.name` (arguments ""), the second with
the arguments, the way OpenAI streams them and the OpenAI SDK's stream
helpers accumulate them (`choices[0].message.tool_calls` of the final
snapshot). A reply that made a call and ended by itself finishes with
`finish_reason: "tool_calls"`.
"""

from __future__ import annotations

from typing import Any

from kvcellar.http.tools import ContentText, Piece, ReasoningText, ReplySplitter, ToolCall, ToolPlan


def tool_call_object(call: ToolCall) -> dict[str, Any]:
    return {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class ChatReply:
    def __init__(self, tokenizer: Any, tools: ToolPlan, *, in_reasoning: bool) -> None:
        self.splitter = ReplySplitter(tokenizer, tools, in_reasoning=in_reasoning)
        self._role_sent = False

    def deltas(self, text: str) -> list[dict[str, Any]]:
        """The deltas a piece of generated text makes (none while a marker or a tool call is pending)."""
        return self._with_role([delta for piece in self.splitter.feed(text) for delta in _piece_deltas(piece)])

    def closing_deltas(self) -> list[dict[str, Any]]:
        """The deltas of what the end of the reply releases."""
        return self._with_role([delta for piece in self.splitter.finish() for delta in _piece_deltas(piece)])

    def finish_reason(self, engine_reason: str) -> str:
        return self.splitter.finish_reason(engine_reason)

    def message(self, text: str) -> dict[str, Any]:
        """The whole reply as a `message`: `content` is null when the reply
        is only tool calls; `reasoning_content` appears when it reasoned."""
        for _ in self.splitter.feed(text):
            pass
        for _ in self.splitter.finish():
            pass
        splitter = self.splitter
        message: dict[str, Any] = {
            "role": "assistant",
            "content": splitter.content_text or (None if splitter.tool_calls else ""),
        }
        if splitter.reasoning_text:
            message["reasoning_content"] = splitter.reasoning_text
        if splitter.tool_calls:
            message["tool_calls"] = [tool_call_object(call) for call in splitter.tool_calls]
        return message

    def _with_role(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # OpenAI names the role in the first delta only.
        if deltas and not self._role_sent:
            deltas[0] = {"role": "assistant", **deltas[0]}
            self._role_sent = True
        return deltas


def _piece_deltas(piece: Piece) -> list[dict[str, Any]]:
    if isinstance(piece, ContentText):
        return [{"content": piece.text}]
    if isinstance(piece, ReasoningText):
        return [{"reasoning_content": piece.text}]
    opening = {
        "index": piece.index,
        "id": piece.call_id,
        "type": "function",
        "function": {"name": piece.name, "arguments": ""},
    }
    arguments = {"index": piece.index, "function": {"arguments": piece.arguments}}
    return [{"tool_calls": [opening]}, {"tool_calls": [arguments]}]
