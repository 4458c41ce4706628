"""A model's tool-call block read into calls: the one rule by which `serve`
returns calls (http/tools.py) and the demo model's training validation scores
replies (demo/tool_validation.py), so the training score and the server agree.

The block is what sits between the tokenizer's tool-call markers; the parser is
the tokenizer's own `tool_parser` (mlx-lm's `TokenizerWrapper`), a third-party
function over model output, so callers treat any exception it raises as the
text's fault, never as a bug.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any


def parse_tool_calls(
    tool_parser: Callable[..., Any], block: str, tools: Sequence[dict[str, Any]] | None
) -> list[tuple[str, str]]:
    """The (name, arguments as JSON text) of each call `tool_parser` reads in
    `block`. Raises what the parser raises, and ValueError for a call without a
    string name or whose arguments (an object or its JSON text) are not an object."""
    parsed = tool_parser(block, tools)
    items = parsed if isinstance(parsed, list) else [parsed]
    return [call_fields(item) for item in items]


def call_fields(item: Any) -> tuple[str, str]:
    """One parsed call's name and its arguments as JSON text."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise ValueError("a tool call needs a string 'name'")
    arguments = item.get("arguments", {})
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("a tool call's arguments must be a JSON object")
    return item["name"], json.dumps(arguments, ensure_ascii=False)


def offered_tool_names(tools: Sequence[dict[str, Any]] | None) -> set[str]:
    """The function names of OpenAI-shaped tool definitions."""
    return {tool["function"]["name"] for tool in tools or ()}
