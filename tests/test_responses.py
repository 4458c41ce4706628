"""The OpenAI Responses API (`POST /v1/responses`), end to end.

A real hypercorn server on 127.0.0.1 over a real system and the
tool-capable demo model (`create_model(..., chat_format="tools")`), driven by
the official `openai` SDK's `client.responses` (`create`, `create(stream=True)`
and the `stream()` helper with `get_final_response()`). As in
tests/test_tools.py, the replies are scripted through the real engine, sampler,
detokenizer, mlx-lm's tool parser and the reply splitter by the
`SystemSeams.logits_processors` seam (`ScriptedReplies`).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_http_errors import FailingBatchEngine, InProcessServer
from test_tools import ANSWER_PARIS, CALL_BOTH, CALL_PARIS, SYSTEM, ScriptedReplies

from kvcellar.actors.system import SystemConfig, SystemSeams
from kvcellar.http.app import HttpSettings
from kvcellar.http.tools import ToolPlan, render_prompt

# Scripted replies stand in for the model's own output; the tool-call grammar would mask them.
SCRIPTED_SETTINGS = HttpSettings(tool_call_grammar=False)

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": False,
}
TIME_TOOL = {
    "type": "function",
    "name": "get_time",
    "description": "The time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
MODEL = "llama-tools"
REASONING = "The user wants the weather; I should call the tool."


@pytest.fixture(scope="module", params=[1, 2], ids=["serial", "batch"])
def served(request, tools_model_dir, tools_tokenizer):
    script = ScriptedReplies(tools_tokenizer)
    config = SystemConfig(model_dir=tools_model_dir, batch_rows_max=request.param)
    with InProcessServer(config, SystemSeams(logits_processors=script), SCRIPTED_SETTINGS) as server:
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)
        yield server, client, script
    assert not script.scripts, "a scripted reply was never asked for"


def _create(client, items, **fields):
    return client.responses.create(model=MODEL, input=items, max_output_tokens=96, temperature=0, **fields)


def test_text_reply(served):
    _, client, script = served
    script.push("Hello there, friend.")
    response = _create(client, "Hi!", instructions="Be brief.", metadata={"run": "1"}, store=True)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.incomplete_details is None
    assert response.output_text == "Hello there, friend."
    (message,) = response.output
    assert message.type == "message" and message.id.startswith("msg_") and message.status == "completed"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert response.store is False and response.instructions == "Be brief." and response.model == MODEL
    usage = response.usage
    assert usage.output_tokens == len(script.tokenizer.encode("Hello there, friend.")) + 1  # + the end of turn
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert 0 <= usage.input_tokens_details.cached_tokens < usage.input_tokens


def _sequence_is_whole(events) -> None:
    assert [event.sequence_number for event in events] == list(range(len(events)))


def test_streaming_text_events(served):
    _, client, script = served
    script.push("Streaming words arrive one by one.")
    events = list(_create(client, [{"role": "user", "content": "Stream?"}], stream=True))
    _sequence_is_whole(events)
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == "Streaming words arrive one by one."
    assert events[-4].text == text and events[-3].part.text == text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens > 0
    assert {event.item_id for event in events if hasattr(event, "item_id")} == {final.output[0].id}


def test_stream_helper_final_response(served):
    _, client, script = served
    script.push("Helper text.")
    with client.responses.stream(model=MODEL, input="Helper?", max_output_tokens=32, temperature=0) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == "Helper text." == final.output_text


def _assert_paris_call(output) -> None:
    reasoning, call = output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.status == "completed"
    assert [part.text for part in reasoning.content] == [REASONING]
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris"}


def test_function_call_round_trip(served):
    _, client, script = served
    script.push(CALL_PARIS)
    response = _create(client, "Paris weather?", instructions=SYSTEM, tools=TOOLS)
    assert response.status == "completed" and response.output_text == ""
    _assert_paris_call(response.output)
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    assert [tool.name for tool in response.tools] == ["get_weather", "get_time"]
    assert response.tool_choice == "auto" and response.parallel_tool_calls is True


def test_function_call_streams_with_the_sdk_helper(served):
    _, client, script = served
    script.push(CALL_PARIS)
    with client.responses.stream(
        model=MODEL, input="Paris weather?", tools=TOOLS, max_output_tokens=96, temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    _sequence_is_whole(events)
    kinds = [event.type for event in events]
    for kind in (
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
    ):
        assert kind in kinds
    assert "response.output_text.delta" not in kinds
    _assert_paris_call(final.output)
    (done,) = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert done.name == "get_weather" and json.loads(done.arguments) == {"city": "Paris"}
    reasoning = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    assert reasoning == REASONING


def test_parallel_calls_and_parallel_tool_calls_false(served):
    _, client, script = served
    script.push(CALL_BOTH, CALL_BOTH)
    both = _create(client, "Rome?", tools=TOOLS)
    first = _create(client, "Rome?", tools=TOOLS, parallel_tool_calls=False)
    assert [item.name for item in both.output] == ["get_weather", "get_time"]
    assert len({item.call_id for item in both.output}) == 2
    assert [item.name for item in first.output] == ["get_weather"] and first.parallel_tool_calls is False


def test_function_call_output_turn_renders_like_the_chat_api(served, tools_tokenizer):
    """The items render the same template messages as the chat API's
    equivalent turns: the same prompt, token for token."""
    _, client, script = served
    script.push(ANSWER_PARIS)
    items = [
        {"role": "developer", "content": "Answer in one sentence."},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "Paris "}, {"type": "input_text", "text": "weather?"}],
        },
        {"type": "function_call", "call_id": "call_abc", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_abc", "output": "sunny, 24 C"},
    ]
    response = _create(client, items, instructions=SYSTEM, tools=TOOLS)
    assert response.status == "completed"
    assert response.output_text == "It is sunny in Paris."
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "The tool says sunny."
    assert message.type == "message" and message.content[0].text == "It is sunny in Paris."
    chat_messages = _paris_call_turns(f"{SYSTEM}\n\nAnswer in one sentence.")
    assert response.usage.input_tokens == _chat_prompt_tokens(tools_tokenizer, chat_messages)


def _paris_call_turns(system: str) -> list[dict]:
    """The chat API's turns for: system, "Paris weather?", a get_weather call and its answer."""
    call = {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": "Paris weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "sunny, 24 C"},
    ]


def _chat_prompt_tokens(tools_tokenizer, chat_messages: list[dict]) -> int:
    chat_tools = tuple(
        {"type": "function", "function": {key: tool[key] for key in ("name", "description", "parameters")}}
        for tool in TOOLS
    )
    return len(render_prompt(tools_tokenizer, chat_messages, ToolPlan(tools=chat_tools)).prompt_ids)


def test_a_named_output_without_call_id_is_context_not_an_answer(served, tools_tokenizer):
    """Codex answers its `create_goal` call, then adds a `function_call_output` with a `name` and a
    `namespace` but no `call_id` (the goal's text): it is rendered as a tool turn of its own, named
    after it, and the call's own answer stays the call's."""
    _, client, script = served
    script.push(ANSWER_PARIS)
    items = [
        {"role": "user", "content": "Paris weather?"},
        {"type": "function_call", "call_id": "call_abc", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_abc", "output": "sunny, 24 C"},
        {"type": "function_call_output", "name": "goal_objective", "namespace": "agent", "output": "Keed"},
    ]
    response = _create(client, items, instructions=SYSTEM, tools=TOOLS)
    assert response.status == "completed"
    chat_messages = [
        *_paris_call_turns(SYSTEM),
        {"role": "tool", "tool_call_id": "agent.goal_objective", "content": "Keed"},
    ]
    assert response.usage.input_tokens == _chat_prompt_tokens(tools_tokenizer, chat_messages)


def test_max_output_tokens_is_incomplete(served):
    _, client, script = served
    script.push("one two three four five six seven eight nine ten", "one two three four five six seven")
    response = client.responses.create(model=MODEL, input="Count.", max_output_tokens=3, temperature=0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"
    assert response.output_text
    events = list(client.responses.create(model=MODEL, input="Count.", max_output_tokens=3, temperature=0, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_structured_output_through_text_format(served):
    _, client, _ = served
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=MODEL,
        input="A city as JSON.",
        max_output_tokens=64,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}},
    )
    assert response.status == "completed", response.output_text
    assert set(json.loads(response.output_text)) == {"city"}
    assert response.text.format.type == "json_schema"


def test_previous_response_id_is_refused_as_stateless(served):
    server, client, _ = served
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="again", previous_response_id="resp_123")
    assert refused.value.param == "previous_response_id"
    assert "stateless" in refused.value.message
    missing = httpx.get(f"{server.base}/v1/responses/resp_123", timeout=30)
    assert missing.status_code == 404 and "stateless" in missing.json()["error"]["message"]


def test_a_hosted_tool_is_left_out_and_recorded(served):
    """Codex sends `web_search` (and a `namespace`) by default: left out of the prompt, named in /stats/requests."""
    server, client, script = served
    script.push(ANSWER_PARIS)
    reply = client.responses.create(
        model=MODEL, input="search", tools=[WEATHER_TOOL, {"type": "web_search"}], max_output_tokens=96
    )
    assert reply.status == "completed"
    assert [tool.type for tool in reply.tools] == ["function"]
    record = httpx.get(f"{server.base}/stats/requests", timeout=30).json()["requests"][-1]
    assert record["notes"]["hosted_tools_left_out"] == ["web_search"]
    assert record["notes"]["api"] == "responses"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        (
            {
                "input": [
                    {"role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{bad"},
                ]
            },
            "input[1].arguments",
        ),
        ({"input": [{"type": "function_call_output", "output": "sunny"}]}, "input[0].call_id"),
        ({"input": [{"type": "reasoning", "summary": "thinking"}]}, "input[0].summary"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 5}, "temperature"),
        ({"top_p": "high"}, "top_p"),
        ({"instructions": ["be brief"]}, "instructions"),
        ({"stream": "yes"}, "stream"),
        ({"store": "no"}, "store"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "function"}]}, "tools[0].name"),
        ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools[0].parameters"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}}, "text.format"),
        ({"model": "gpt-nope"}, "model"),
        ({"top_logprobs": 3}, "top_logprobs"),
    ],
)
def test_bad_fields_are_400s_naming_them(served, fields, param):
    server, _, _ = served
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **fields}
    response = httpx.post(f"{server.base}/v1/responses", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]


def _next_input(response, *, echo_reasoning: bool) -> list[dict]:
    """What a stateless client sends back of a response: its output items."""
    return [
        item.model_dump(exclude_none=True) for item in response.output if echo_reasoning or item.type != "reasoning"
    ]


@pytest.mark.parametrize("echo_reasoning", [False, True], ids=["reasoning-dropped", "reasoning-echoed"])
def test_agent_loop_turns_are_prefix_hits(served, echo_reasoning, capsys):
    """instructions + tools + user -> function_call -> function_call_output
    -> answer -> next user turn -> function_call -> output -> answer, the
    whole input resent every turn: each turn after the first is a prefix hit."""
    _, client, script = served
    city = "Lyon" if echo_reasoning else "Nice"
    call = CALL_PARIS.replace("Paris", city)
    script.push(call, ANSWER_PARIS, call, ANSWER_PARIS)
    instructions = f"{city}. {SYSTEM}"
    items: list[dict] = [{"role": "user", "content": f"Weather in {city}?"}]
    ratios = []
    for turn in range(4):
        response = _create(client, items, instructions=instructions, tools=TOOLS)
        usage = response.usage
        cached = usage.input_tokens_details.cached_tokens
        ratios.append((usage.input_tokens, cached, round(cached / usage.input_tokens, 3)))
        items += _next_input(response, echo_reasoning=echo_reasoning)
        calls = [item for item in response.output if item.type == "function_call"]
        if calls:
            items.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 24 C"})
        elif turn == 1:
            items.append({"role": "user", "content": "And tomorrow?"})
    with capsys.disabled():
        print(
            f"\nresponses agent loop ({'echoing' if echo_reasoning else 'dropping'} reasoning): "
            f"(input_tokens, cached_tokens, ratio) per turn: {ratios}"
        )
    assert ratios[0][2] < 0.1, ratios
    for _input_tokens, cached, ratio in ratios[1:]:
        assert cached > 0 and ratio >= 0.75, ratios


def test_a_failure_mid_stream_ends_with_error_and_failed_events(model_dir_factory):
    """A batch aborted on the engine thread after the stream began: an `error`
    event and `response.failed`, never a claimed completion; not streaming, a 503."""
    model_dir = model_dir_factory("llama")
    config = SystemConfig(model_dir=model_dir, batch_rows_max=4)
    with InProcessServer(config, SystemSeams(engine=FailingBatchEngine(model_dir, batches_failing=2))) as server:
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)
        events = list(
            client.responses.create(
                model=model_dir.name, input="The cellar keeps", max_output_tokens=40, temperature=0, stream=True
            )
        )
        _sequence_is_whole(events)
        assert [event.type for event in events[-2:]] == ["error", "response.failed"]
        assert "the batch job failed" in events[-2].message
        assert events[-1].response.status == "failed" and events[-1].response.error.code == "server_error"
        assert not any(event.type in ("response.completed", "response.incomplete") for event in events)
        with pytest.raises(openai.APIStatusError) as plain:
            client.responses.create(model=model_dir.name, input="The cellar keeps", max_output_tokens=40)
        assert plain.value.status_code == 503 and plain.value.body["type"] == "server_unavailable"
        after = client.responses.create(model=model_dir.name, input="The cellar keeps", max_output_tokens=8)
        assert after.status in ("completed", "incomplete") and after.usage.output_tokens >= 1
