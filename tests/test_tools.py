"""Tool calling and reasoning on the OpenAI chat API, end to end.

A real hypercorn server on 127.0.0.1 over a real system and a random-weight
demo model whose tokenizer and chat template are tool-capable
(`create_model(..., chat_format="tools")`: Qwen's `<think>`/`<tool_call>`
tokens, a Qwen3-style template, so mlx-lm infers thinking and its JSON tool
parser). A random model never calls a tool by itself, so the tests script its
replies: the `SystemSeams.logits_processors` seam adds a `ForcedTokens`
processor per request, which forces the scripted tokens through the real
engine (either lane), sampler, detokenizer, mlx-lm's tool parser and the
reply splitter. The official `openai` SDK is the client.
"""

from __future__ import annotations

import json
import logging
from functools import partial

import httpx
import openai
import pytest
from test_http_errors import InProcessServer

from kvcellar.actors.system import SystemConfig, SystemSeams
from kvcellar.engine.demo_models import EOS_TOKEN_ID
from kvcellar.engine.forcing import ForcedTokens
from kvcellar.http.app import HttpSettings
from kvcellar.http.tools import (
    ContentText,
    ReasoningText,
    ReplySplitter,
    ToolCall,
    ToolPlan,
    forced_prefix_text,
    render_prompt,
    stable_prefix_tokens,
)

# Scripted replies stand in for the model's own output; the tool-call grammar would mask them.
SCRIPTED_SETTINGS = HttpSettings(tool_call_grammar=False)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
IM_START_ID = 1
SYSTEM = "You are a terse assistant. Use the tools when they help. " * 4

CALL_PARIS = (
    "<think>\nThe user wants the weather; I should call the tool.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
ANSWER_PARIS = "<think>\nThe tool says sunny.\n</think>\n\nIt is sunny in Paris."
CALL_BOTH = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>'
)


class ScriptedReplies:
    """The seam: the next scripted reply for each request, in arrival order
    (forced token by token, then end of turn); no forcing once they run out."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.scripts: list[list[int]] = []

    def push(self, *texts: str) -> None:
        for text in texts:
            self.scripts.append(self.tokenizer.encode(text, add_special_tokens=False) + [EOS_TOKEN_ID])

    def push_ids(self, ids: list[int]) -> None:
        self.scripts.append(ids + [EOS_TOKEN_ID])

    def __call__(self, request):
        if not self.scripts:
            return ()
        return (partial(ForcedTokens, self.scripts.pop(0)),)


@pytest.fixture(scope="module", params=[1, 2], ids=["serial", "batch"])
def served(request, tools_model_dir, tools_tokenizer):
    script = ScriptedReplies(tools_tokenizer)
    config = SystemConfig(model_dir=tools_model_dir, batch_rows_max=request.param)
    with InProcessServer(config, SystemSeams(logits_processors=script), SCRIPTED_SETTINGS) as server:
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)
        yield server, client, script
    assert not script.scripts, "a scripted reply was never asked for"


def _chat(client, messages, **fields):
    return client.chat.completions.create(
        model="llama-tools", messages=messages, max_tokens=96, temperature=0, **fields
    )


def test_tool_call_round_trip(served):
    _, client, script = served
    script.push(CALL_PARIS)
    reply = _chat(
        client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Paris weather?"}], tools=TOOLS
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.reasoning_content == "The user wants the weather; I should call the tool."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_tool_call_stream_accumulates_in_the_sdk_helper(served):
    _, client, script = served
    script.push(CALL_PARIS)
    with client.chat.completions.stream(
        model="llama-tools",
        max_tokens=96,
        temperature=0,
        tools=TOOLS,
        messages=[{"role": "user", "content": "Paris weather?"}],
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert "tool_calls.function.arguments.done" in kinds
    assert not choice.message.content
    assert choice.message.model_extra.get("reasoning_content") == "The user wants the weather; I should call the tool."


def test_streamed_deltas_carry_reasoning_then_indexed_tool_calls(served):
    _, client, script = served
    script.push(CALL_BOTH)
    chunks = list(_chat(client, [{"role": "user", "content": "Rome?"}], tools=TOOLS, stream=True))
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta_call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            entry = calls.setdefault(delta_call.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = entry["id"] or delta_call.id
            entry["name"] += delta_call.function.name or ""
            entry["arguments"] += delta_call.function.arguments or ""
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    assert all(entry["id"].startswith("call_") for entry in calls.values())
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_parallel_tool_calls_false_keeps_the_first_call(served):
    _, client, script = served
    script.push(CALL_BOTH)
    reply = _chat(client, [{"role": "user", "content": "Rome?"}], tools=TOOLS, parallel_tool_calls=False)
    assert [call.function.name for call in reply.choices[0].message.tool_calls] == ["get_weather"]


def test_tool_result_turn_is_accepted_and_reasoning_split(served):
    _, client, script = served
    script.push(ANSWER_PARIS)
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Paris "}, {"type": "text", "text": "weather?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": "sunny, 24 C"},
    ]
    reply = _chat(client, messages, tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == "It is sunny in Paris."
    assert choice.message.reasoning_content == "The tool says sunny."
    assert choice.message.tool_calls is None


def test_tool_choice_none_renders_no_tools_and_parses_none(served):
    _, client, script = served
    script.push(CALL_PARIS, CALL_PARIS)
    messages = [{"role": "user", "content": "Paris weather?"}]
    with_tools = _chat(client, messages, tools=TOOLS)
    without = _chat(client, messages, tools=TOOLS, tool_choice="none")
    assert without.usage.prompt_tokens < with_tools.usage.prompt_tokens
    choice = without.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content.startswith('<tool_call>\n{"name": "get_weather"')


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_choice_starts_the_reply_with_a_call(served, tool_choice, caplog):
    """No script: the server's own forcing makes the random model start a
    call; what it then makes up is not a valid call, so it comes back as
    content (never a 500) with a warning."""
    _, client, _ = served
    with caplog.at_level(logging.WARNING, logger="kvcellar.http.tools"):
        reply = client.chat.completions.create(
            model="llama-tools",
            max_tokens=32,
            temperature=0,
            tools=TOOLS,
            tool_choice=tool_choice,
            messages=[{"role": "user", "content": "What time is it?"}],
        )
    content = reply.choices[0].message.content
    expected = '<tool_call>\n{"name": "get_time", "arguments": ' if isinstance(tool_choice, dict) else "<tool_call>"
    assert content.startswith(expected)
    assert reply.choices[0].finish_reason != "tool_calls" and reply.choices[0].message.tool_calls is None
    assert any("returned as content" in record.getMessage() for record in caplog.records)


def test_named_tool_choice_with_a_scripted_continuation_parses(served, tools_tokenizer):
    _, client, script = served
    plan = ToolPlan(tools=tuple(TOOLS), choice="function", function_name="get_time")
    prefix = forced_prefix_text(tools_tokenizer, plan)
    script.push_ids(
        tools_tokenizer.encode(prefix, add_special_tokens=False)
        + tools_tokenizer.encode('{"city": "Oslo"}}\n</tool_call>', add_special_tokens=False)
    )
    reply = _chat(
        client,
        [{"role": "user", "content": "Time in Oslo?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"city": "Oslo"}


def test_malformed_tool_text_is_content_with_a_warning(served, caplog):
    _, client, script = served
    script.push('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {oops}\n</tool_call>')
    with caplog.at_level(logging.WARNING, logger="kvcellar.http.tools"):
        reply = _chat(client, [{"role": "user", "content": "Paris?"}], tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == (
        'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {oops}\n</tool_call>'
    )
    assert any("does not parse" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": {"name": "x"}}, "tools"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{bad"}}
                        ],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ],
)
def test_bad_tool_fields_are_400s_naming_them(served, fields, param):
    server, _, _ = served
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    response = httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_model_without_tool_calling_refuses_tools(model_dir_factory):
    with InProcessServer(SystemConfig(model_dir=model_dir_factory("llama"))) as server:
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 4}
        refused = httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=30)
        body["tool_choice"] = "none"
        accepted = httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=30)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "tools"
    assert "does not support tool calling" in refused.json()["error"]["message"]
    assert accepted.status_code == 200


def _assistant_turn(message, *, echo_reasoning: bool) -> dict:
    turn = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        turn["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if echo_reasoning and message.reasoning_content:
        turn["reasoning_content"] = message.reasoning_content
    return turn


@pytest.mark.parametrize("echo_reasoning", [False, True], ids=["reasoning-dropped", "reasoning-echoed"])
def test_agent_loop_turns_are_prefix_hits(served, echo_reasoning, capsys):
    """system + tools + user -> tool call -> tool result -> answer -> next
    user turn -> tool call -> result -> answer: every turn after the first
    reuses the cached prefix of the one before it."""
    _, client, script = served
    city = "Lyon" if echo_reasoning else "Nice"
    call = CALL_PARIS.replace("Paris", city)
    script.push(call, ANSWER_PARIS, call, ANSWER_PARIS)
    # The city first: the first turn shares little more than the template's opening with earlier tests.
    messages = [{"role": "system", "content": f"{city}. {SYSTEM}"}, {"role": "user", "content": f"Weather in {city}?"}]
    ratios = []
    for turn in range(4):
        reply = _chat(client, messages, tools=TOOLS)
        usage = reply.usage
        cached = usage.prompt_tokens_details.cached_tokens
        ratios.append((usage.prompt_tokens, cached, round(cached / usage.prompt_tokens, 3)))
        message = reply.choices[0].message
        messages.append(_assistant_turn(message, echo_reasoning=echo_reasoning))
        if message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny, 24 C"})
        elif turn == 1:
            messages.append({"role": "user", "content": "And tomorrow?"})
    with capsys.disabled():
        print(
            f"\nagent loop ({'echoing' if echo_reasoning else 'dropping'} reasoning): "
            f"(prompt_tokens, cached_tokens, ratio) per turn: {ratios}"
        )
    assert ratios[0][2] < 0.1, ratios
    for _prompt_tokens, cached, ratio in ratios[1:]:
        assert cached > 0 and ratio >= 0.75, ratios


# -- the API-neutral pieces, without a server -------------------------------------


def _pieces(tokenizer, text: str, plan: ToolPlan, *, step: int) -> list:
    splitter = ReplySplitter(tokenizer, plan)
    pieces = []
    for start in range(0, len(text), step):
        pieces.extend(splitter.feed(text[start : start + step]))
    pieces.extend(splitter.finish())
    return pieces


def _merged(pieces: list) -> list:
    """Adjacent text pieces of one kind joined; calls without their random ids."""
    merged: list = []
    for piece in pieces:
        if isinstance(piece, ToolCall):
            merged.append(("call", piece.index, piece.name, piece.arguments))
        elif merged and merged[-1][0] == type(piece).__name__:
            merged[-1] = (merged[-1][0], merged[-1][1] + piece.text)
        else:
            merged.append((type(piece).__name__, piece.text))
    return merged


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_splitter_pieces_do_not_depend_on_how_the_text_is_cut(tools_tokenizer, step):
    plan = ToolPlan(tools=tuple(TOOLS))
    text = "<think>\nhmm\n</think>\n\nLooking it up.\n" + CALL_BOTH + "\nDone."
    assert _merged(_pieces(tools_tokenizer, text, plan, step=step)) == [
        (ReasoningText.__name__, "hmm"),
        (ContentText.__name__, "Looking it up."),
        ("call", 0, "get_weather", '{"city": "Rome"}'),
        ("call", 1, "get_time", '{"city": "Rome"}'),
        (ContentText.__name__, "Done."),
    ]


def test_an_unterminated_call_at_the_end_still_parses(tools_tokenizer):
    plan = ToolPlan(tools=tuple(TOOLS))
    pieces = _pieces(tools_tokenizer, '<tool_call>\n{"name": "get_time", "arguments": {}}', plan, step=2)
    assert _merged(pieces) == [("call", 0, "get_time", "{}")]


def test_template_probe_finds_where_the_next_turn_rerenders(tools_tokenizer):
    """The demo template drops the reasoning of assistant turns before the
    last user message (as Qwen3's does): the probe's stable boundary stops
    before an echoed reasoning block and covers the whole prompt otherwise."""
    plan = ToolPlan(tools=tuple(TOOLS))
    base = [{"role": "user", "content": "Paris?"}]
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    }
    result = {"role": "tool", "tool_call_id": "c", "content": "sunny"}
    for echoed, expect_whole in ((False, True), (True, False)):
        turn = {**call, "reasoning_content": "thinking"} if echoed else call
        messages = base + [turn, result]
        rendered = render_prompt(tools_tokenizer, messages, plan, probe=True)
        # Both renderings open a turn after the last message: its role marker is shared, its role is not.
        last_turn_marker = len(rendered.prompt_ids) - rendered.prompt_ids[::-1].index(IM_START_ID)
        stable = stable_prefix_tokens(
            tools_tokenizer, messages, rendered.prompt_ids, tools=list(TOOLS), rendered=rendered.text
        )
        assert stable == rendered.stable_prefix_tokens
        if expect_whole:
            assert stable == last_turn_marker
        else:
            think_at = rendered.prompt_ids.index(tools_tokenizer.think_start_tokens[0])
            assert stable <= think_at
