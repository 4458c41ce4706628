"""engine/tool_calls.py: the rule serve returns calls by and training validation scores by."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcellar.engine.tool_calls import call_fields, offered_tool_names, parse_tool_calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_call_fields_takes_object_arguments_or_their_json_text() -> None:
    assert call_fields({"name": "f", "arguments": {"city": "Oslo"}}) == ("f", '{"city": "Oslo"}')
    assert call_fields({"name": "f", "arguments": '{"city": "Ål"}'}) == ("f", '{"city": "Ål"}')
    assert call_fields({"name": "f"}) == ("f", "{}")


@pytest.mark.parametrize(
    "item",
    [
        {"arguments": {}},
        {"name": 3, "arguments": {}},
        {"name": "f", "arguments": [1]},
        {"name": "f", "arguments": "[1]"},
        "f",
    ],
)
def test_call_fields_refuses_what_is_not_a_call(item: Any) -> None:
    with pytest.raises(ValueError):
        call_fields(item)


def test_parse_tool_calls_reads_one_call_or_a_list() -> None:
    def one(block: str, tools: Any) -> Any:
        return json.loads(block)

    assert parse_tool_calls(one, '{"name": "get_weather", "arguments": {}}', TOOLS) == [("get_weather", "{}")]
    assert parse_tool_calls(one, '[{"name": "a"}, {"name": "b", "arguments": {"x": 1}}]', TOOLS) == [
        ("a", "{}"),
        ("b", '{"x": 1}'),
    ]
    assert offered_tool_names(TOOLS) == {"get_weather"}
    assert offered_tool_names(None) == set()


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(),
        lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
    )
)
def test_any_parsed_value_is_a_call_list_or_a_value_error(parsed: Any) -> None:
    try:
        calls = parse_tool_calls(lambda block, tools: parsed, "", TOOLS)
    except ValueError:
        return
    assert all(isinstance(name, str) and isinstance(json.loads(arguments), dict) for name, arguments in calls)
