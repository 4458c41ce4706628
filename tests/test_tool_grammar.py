"""The tool-call grammar (engine/tool_grammar.py, http/tool_grammar.py), end to end.

A random-weight tiny llama with the tool chat format (Qwen's `<tool_call>`
markers, mlx-lm's JSON tool parser) sampled at temperature 1.0 writes
garbage; with the grammar on, every call it makes names an offered tool and
its arguments validate against that tool's schema, through a real hypercorn
server, the real engine (both lanes), mlx-lm's parser and the reply
splitter. With `--tool-call-grammar off` the same requests do not parse.
The processor's phases (free, in a call, turn over) are checked directly.
"""

from __future__ import annotations

import json
from functools import partial

import httpx
import jsonschema
import mlx.core as mx
import numpy as np
import openai
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.utils import load
from test_http_errors import InProcessServer

from kvcellar.actors.system import SystemConfig
from kvcellar.cli.serve import serve_command
from kvcellar.engine.demo_models import EOS_TOKEN_ID
from kvcellar.engine.engine import LoadedModel
from kvcellar.engine.structured import token_table
from kvcellar.engine.tool_grammar import (
    Phase,
    ToolCallGrammar,
    ToolCallGrammarMask,
    compile_tool_call_grammar,
)
from kvcellar.http.anthropic import parse_messages_body
from kvcellar.http.app import HttpSettings
from kvcellar.http.parsing import parse_body
from kvcellar.http.responses import parse_responses_body
from kvcellar.http.tool_grammar import ToolGrammarPolicy

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "description": "Set an alarm.",
        "parameters": {
            "type": "object",
            "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
            "required": ["hour"],
            "additionalProperties": False,
        },
    },
}
PING = {"type": "function", "function": {"name": "ping", "description": "No arguments."}}
TOOLS = [WEATHER, ALARM, PING]
# A function without `parameters` takes none (OpenAI's reading, and the grammar's).
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
SCHEMAS = {tool["function"]["name"]: tool["function"].get("parameters", NO_ARGUMENTS) for tool in TOOLS}
# A schema llguidance refuses: a $ref to nowhere.
BROKEN = {
    "type": "function",
    "function": {
        "name": "broken",
        "parameters": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}},
    },
}
SEEDS = range(4)
MESSAGES = [{"role": "user", "content": "Weather in Rome, and wake me at seven."}]
MAX_TOKENS = 96
TOOL_CALL_START_ID, TOOL_CALL_END_ID = 1026, 1027


@pytest.fixture(scope="module", params=[1, 2], ids=["serial", "batch"])
def served(request, tools_model_dir):
    config = SystemConfig(model_dir=tools_model_dir, batch_rows_max=request.param)
    with InProcessServer(config) as server:
        yield server, openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def served_off(tools_model_dir):
    with InProcessServer(SystemConfig(model_dir=tools_model_dir), settings=HttpSettings(tool_call_grammar=False)) as s:
        yield s


def _chat_body(seed: int, **fields) -> dict:
    return {
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "temperature": 1.0,
        "seed": seed,
        "max_tokens": MAX_TOKENS,
        **fields,
    }


def _assert_valid(name: str, arguments: dict, offered: set[str]) -> None:
    assert name in offered
    jsonschema.validate(arguments, SCHEMAS[name])


@pytest.mark.parametrize("seed", SEEDS)
def test_required_calls_name_an_offered_tool_with_valid_arguments(served, seed):
    _, client = served
    reply = client.chat.completions.create(model="llama-tools", **_chat_body(seed))
    choice = reply.choices[0]
    # After the call the text is free again: the random model rambles on to the length limit.
    assert choice.message.tool_calls, choice.message.content
    for call in choice.message.tool_calls:
        _assert_valid(call.function.name, json.loads(call.function.arguments), set(SCHEMAS))


def test_without_the_grammar_the_same_requests_do_not_parse(served_off):
    parsed = []
    for seed in SEEDS:
        response = httpx.post(f"{served_off.base}/v1/chat/completions", json=_chat_body(seed), timeout=60)
        assert response.status_code == 200, response.text
        parsed.append(bool(response.json()["choices"][0]["message"].get("tool_calls")))
    assert not all(parsed), "the random model made valid calls on its own: the comparison shows nothing"
    stats = httpx.get(f"{served_off.base}/stats", timeout=30).json()["tool_call_grammar"]
    assert stats["requests"] == 0 and stats["calls"] == 0


def test_strict_tools_turn_the_grammar_on_when_the_server_has_it_off(served_off):
    strict_tools = [{**tool, "function": {**tool["function"], "strict": True}} for tool in TOOLS]
    for seed in SEEDS:
        body = _chat_body(seed, tools=strict_tools)
        message = httpx.post(f"{served_off.base}/v1/chat/completions", json=body, timeout=60).json()
        (call, *_) = message["choices"][0]["message"]["tool_calls"]
        _assert_valid(call["function"]["name"], json.loads(call["function"]["arguments"]), set(SCHEMAS))


def test_a_named_function_is_the_only_name_allowed(served):
    server, _ = served
    body = _chat_body(7, tool_choice={"type": "function", "function": {"name": "set_alarm"}})
    message = httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert message["message"]["tool_calls"]
    for call in message["message"]["tool_calls"]:
        _assert_valid(call["function"]["name"], json.loads(call["function"]["arguments"]), {"set_alarm"})


def test_parallel_calls_off_ends_the_turn_after_one_call(served):
    server, _ = served
    for seed in SEEDS:
        body = _chat_body(seed, parallel_tool_calls=False)
        choice = httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1
        # Nothing but the end of turn after the call: no text either.
        assert not choice["message"].get("content")


def test_anthropic_any_and_responses_required_are_constrained(served):
    server, _ = served
    anthropic_tools = [
        {"name": tool["function"]["name"], "input_schema": SCHEMAS[tool["function"]["name"]]} for tool in TOOLS
    ]
    for _ in range(2):  # the Messages API has no seed
        reply = httpx.post(
            f"{server.base}/v1/messages",
            json={
                "model": "any",
                "max_tokens": MAX_TOKENS,
                "messages": MESSAGES,
                "tools": anthropic_tools,
                "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                "temperature": 1.0,
            },
            timeout=60,
        ).json()
        assert reply["stop_reason"] == "tool_use", reply
        (block,) = [block for block in reply["content"] if block["type"] == "tool_use"]
        _assert_valid(block["name"], block["input"], set(SCHEMAS))
    responses_tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    reply = httpx.post(
        f"{server.base}/v1/responses",
        json={"input": "Rome?", "tools": responses_tools, "tool_choice": "required", "max_output_tokens": MAX_TOKENS},
        timeout=60,
    ).json()
    calls = [item for item in reply["output"] if item["type"] == "function_call"]
    assert calls, reply
    for item in calls:
        _assert_valid(item["name"], json.loads(item["arguments"]), set(SCHEMAS))


def test_counts_reach_stats_and_metrics(served):
    server, client = served
    client.chat.completions.create(model="llama-tools", **_chat_body(11))
    stats = httpx.get(f"{server.base}/stats", timeout=30).json()["tool_call_grammar"]
    assert stats["requests"] >= 1 and stats["calls"] >= 1 and stats["compile_ms_last"] >= 0
    metrics = httpx.get(f"{server.base}/metrics", timeout=30).text
    assert f"kvcellar_tool_call_grammar_total {float(stats['calls'])}" in metrics
    assert "kvcellar_tool_call_grammar_requests_total" in metrics


def test_an_uncompilable_schema_is_relaxed_unless_strict(served):
    """The grammar is never switched off for a schema llguidance cannot take:
    its copy of that tool's schema is relaxed (here a dangling $ref: the
    arguments become any object, the name still one of the offered)."""
    server, _ = served
    relaxed_before = httpx.get(f"{server.base}/stats", timeout=30).json()["tool_call_grammar"]["relaxed"]
    body = _chat_body(0, tools=[*TOOLS, BROKEN], max_tokens=8)
    response = httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    counts = httpx.get(f"{server.base}/stats", timeout=30).json()["tool_call_grammar"]
    assert counts["relaxed"] == relaxed_before + 1
    record = httpx.get(f"{server.base}/stats/requests", timeout=30).json()["requests"][-1]
    assert record["notes"]["schema_keywords_relaxed"] == ["parameters"]
    strict_broken = {**BROKEN, "function": {**BROKEN["function"], "strict": True}}
    refused = httpx.post(
        f"{server.base}/v1/chat/completions", json=_chat_body(0, tools=[*TOOLS, strict_broken]), timeout=60
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"


# -- the processor on its own ------------------------------------------------------


def _mask(tokenizer, *, parallel: bool, tools=TOOLS, start_marker: str = "<tool_call>") -> ToolCallGrammarMask:
    spec = ToolCallGrammar(
        grammar=compile_tool_call_grammar(tokenizer, tools), start_marker=start_marker, parallel=parallel
    )
    return ToolCallGrammarMask(tokenizer, spec)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


CALL_BODY = '\n{"name": "set_alarm", "arguments": {"hour": 7}}\n'


@pytest.mark.parametrize("parallel", [True, False])
def test_phases_free_then_constrained_then_released(tools_tokenizer, parallel):
    mask = _mask(tools_tokenizer, parallel=parallel)
    for token in _ids(tools_tokenizer, "I will call it."):
        mask.observe(token)
        assert mask.phase is Phase.FREE and mask.allowed_tokens().all()
    mask.observe(TOOL_CALL_START_ID)
    assert mask.phase is Phase.IN_CALL and mask.calls_constrained == 1
    allowed = mask.allowed_tokens()
    assert allowed[_ids(tools_tokenizer, "\n")[0]] and not allowed[_ids(tools_tokenizer, "hello")[0]]
    for token in _ids(tools_tokenizer, CALL_BODY):
        assert mask.allowed_tokens()[token], tools_tokenizer.decode([token])
        mask.observe(token)
        assert mask.phase is Phase.IN_CALL
    assert mask.allowed_tokens()[TOOL_CALL_END_ID] and mask.allowed_tokens().sum() == 1
    mask.observe(TOOL_CALL_END_ID)
    if parallel:
        assert mask.phase is Phase.FREE and mask.allowed_tokens().all()
        mask.observe(TOOL_CALL_START_ID)
        assert mask.phase is Phase.IN_CALL and mask.calls_constrained == 2
    else:
        assert mask.phase is Phase.TURN_OVER
        assert np.flatnonzero(mask.allowed_tokens()).tolist() == [EOS_TOKEN_ID]


def test_a_marker_of_several_tokens_triggers_on_its_text(tools_tokenizer):
    marker = "CALL>>"
    marker_ids = _ids(tools_tokenizer, marker)
    assert len(marker_ids) > 1
    mask = _mask(tools_tokenizer, parallel=True, start_marker=marker)
    for token in _ids(tools_tokenizer, "text CALL then ") + marker_ids[:-1]:
        mask.observe(token)
        assert mask.phase is Phase.FREE
    mask.observe(marker_ids[-1])
    assert mask.phase is Phase.IN_CALL


def test_the_processor_masks_logits_only_inside_a_call(tools_tokenizer):
    mask = _mask(tools_tokenizer, parallel=True)
    # Embedding rows past the vocabulary (padding) are never allowed inside a call.
    width = len(tools_tokenizer.get_vocab()) + 4
    logits = mx.zeros((1, width))
    prompt = _ids(tools_tokenizer, "hi")
    assert mx.array_equal(mask(mx.array(prompt), logits), logits)
    masked = np.array(mask(mx.array([*prompt, TOOL_CALL_START_ID]), logits)).reshape(-1)
    # The grammar's first byte is the newline after the marker.
    assert np.flatnonzero(np.isfinite(masked)).tolist() == np.flatnonzero(mask.allowed_tokens()).tolist()
    assert np.isfinite(masked[_ids(tools_tokenizer, "\n")[0]]) and np.isinf(masked[-4:]).all()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_path_the_mask_allows_is_a_valid_call(tools_tokenizer, data):
    """Free tokens trigger only once their text ends in the marker; after it,
    every path of allowed tokens closes a call that parses and validates."""
    mask = _mask(tools_tokenizer, parallel=False)
    free = data.draw(st.lists(st.integers(0, TOOL_CALL_START_ID - 1), max_size=8))
    text = b""
    for token in free:
        mask.observe(token)
        text += token_table(tools_tokenizer).decode_bytes([token])
        # The marker is text: only free tokens that spell it out end in a call.
        assert (mask.phase is Phase.IN_CALL) == text.endswith(b"<tool_call>")
        if mask.phase is Phase.IN_CALL:
            return
    mask.observe(TOOL_CALL_START_ID)
    body: list[int] = []
    for _ in range(120):
        if mask.phase is not Phase.IN_CALL:
            break
        allowed = np.flatnonzero(mask.allowed_tokens())
        token = int(allowed[data.draw(st.integers(0, len(allowed) - 1))])
        body.append(token)
        mask.observe(token)
    # Every schema here is bounded (short strings, an enum, a small integer): a call closes well within 120 tokens.
    assert mask.phase is Phase.TURN_OVER and body[-1] == TOOL_CALL_END_ID
    call = json.loads(tools_tokenizer.decode(body[:-1]))
    _assert_valid(call["name"], call["arguments"], set(SCHEMAS))


def test_compiles_are_cached_per_tools(tools_tokenizer):
    first = compile_tool_call_grammar(tools_tokenizer, TOOLS)
    assert compile_tool_call_grammar(tools_tokenizer, TOOLS) is first
    assert compile_tool_call_grammar(tools_tokenizer, TOOLS, "ping") is not first


def test_the_flag_is_in_serve_help():
    result = CliRunner().invoke(serve_command, ["--help"], terminal_width=200)
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "--tool-call-grammar [on|off]" in text and "off leaves the model's own output as-is" in text


@pytest.fixture(scope="module")
def loaded_tools(tools_model_dir):
    model, tokenizer = load(str(tools_model_dir))
    return LoadedModel(model=model, tokenizer=tokenizer, model_dir=tools_model_dir, context_tokens_max=4096)


def _has_grammar(request) -> bool:
    return any(isinstance(make, partial) and make.func is ToolCallGrammarMask for make in request.logits_processors)


@pytest.mark.parametrize("strict", [False, True])
def test_strict_tools_force_the_grammar_in_every_api(loaded_tools, strict):
    """The server's switch off: only a `strict: true` tool attaches the grammar, in each API's own spelling."""
    off = ToolGrammarPolicy(enabled=False)
    function = {**WEATHER["function"], "strict": strict}
    chat = {"messages": MESSAGES, "tools": [{"type": "function", "function": function}], "max_tokens": 8}
    chat_job = parse_body(json.dumps(chat).encode(), loaded_tools, chat=True, tool_grammar=off)
    responses = {"input": "Rome?", "tools": [{"type": "function", **function}], "max_output_tokens": 8}
    responses_job = parse_responses_body(
        json.dumps(responses).encode(), loaded_tools, max_tokens_default=8, tool_grammar=off
    )
    tool = {"name": "get_weather", "input_schema": SCHEMAS["get_weather"], "strict": strict}
    messages = {"model": "any", "max_tokens": 8, "messages": MESSAGES, "tools": [tool]}
    messages_job = parse_messages_body(json.dumps(messages).encode(), loaded_tools, tool_grammar=off)
    requests = [chat_job.request, responses_job.job.request, messages_job.request]
    assert [_has_grammar(request) for request in requests] == [strict] * 3
    on = ToolGrammarPolicy(enabled=True)
    assert _has_grammar(parse_body(json.dumps(chat).encode(), loaded_tools, chat=True, tool_grammar=on).request)
