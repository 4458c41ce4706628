"""The Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`), end to end.

A real hypercorn server on 127.0.0.1 over a real system and the tool-capable
random-weight demo model (`create_model(..., chat_format="tools")`), driven by
the official `anthropic` SDK. As in tests/test_tools.py, the model's replies
are scripted through the `SystemSeams.logits_processors` seam
(`ScriptedReplies`: `ForcedTokens` through the real engine on either lane,
sampler, detokenizer, mlx-lm's tool parser and the reply splitter).
"""

from __future__ import annotations

import json
from functools import partial

import anthropic
import httpx
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from test_http_errors import FailingBatchEngine, InProcessServer
from test_tools import ANSWER_PARIS, CALL_BOTH, CALL_PARIS, SYSTEM, ScriptedReplies

from kvcellar.actors.system import SystemConfig, SystemSeams, open_system
from kvcellar.http.app import HttpSettings, build_app

# Scripted replies stand in for the model's own output; the tool-call grammar would mask them.
SCRIPTED_SETTINGS = HttpSettings(tool_call_grammar=False)

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city now.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TIME = {
    "name": "get_time",
    "description": "The time in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
TOOLS = [WEATHER, TIME]
MODEL = "claude-any-name"


class KeyedServer(InProcessServer):
    """An in-process server whose app has `HttpSettings` (an API key)."""

    def __init__(self, config: SystemConfig, settings: HttpSettings) -> None:
        super().__init__(config)
        self.settings = settings

    async def _main(self) -> None:
        async with open_system(self.config, self.seams) as system:
            self.system = system
            self._stop = trio.Event()
            config = Config()
            config.bind = [f"127.0.0.1:{self.port}"]
            config.accesslog = None
            async with trio.open_nursery() as nursery:
                app = build_app(system, self.settings)
                await nursery.start(partial(serve, app, config, shutdown_trigger=self._stop.wait))
                self._token = trio.lowlevel.current_trio_token()
                self._ready.set()
                await self._stop.wait()


@pytest.fixture(scope="module", params=[1, 2], ids=["serial", "batch"])
def served(request, tools_model_dir, tools_tokenizer):
    script = ScriptedReplies(tools_tokenizer)
    config = SystemConfig(model_dir=tools_model_dir, batch_rows_max=request.param)
    with InProcessServer(config, SystemSeams(logits_processors=script), SCRIPTED_SETTINGS) as server:
        client = anthropic.Anthropic(base_url=server.base, api_key="unused", max_retries=0, timeout=120)
        yield server, client, script
    assert not script.scripts, "a scripted reply was never asked for"


def _create(client, messages, **fields):
    return client.messages.create(model=MODEL, messages=messages, **{"max_tokens": 96, **fields})


def _blocks(message) -> list[tuple]:
    shaped = []
    for block in message.content:
        if block.type == "text":
            shaped.append(("text", block.text))
        elif block.type == "thinking":
            shaped.append(("thinking", block.thinking))
        else:
            assert block.type == "tool_use" and block.id.startswith("toolu_")
            shaped.append(("tool_use", block.name, block.input))
    return shaped


def _sse_events(base: str, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    with httpx.stream("POST", f"{base}/v1/messages", json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line]
    pairs = list(zip(lines[::2], lines[1::2], strict=True))
    events = [(name.removeprefix("event: "), json.loads(data.removeprefix("data: "))) for name, data in pairs]
    assert all(name == data["type"] for name, data in events), events
    return events


def test_text_reply(served, tools_model_dir):
    _, client, script = served
    script.push("Hello from the cellar.")
    reply = _create(
        client, [{"role": "user", "content": "Say hello."}], system="Be brief.", metadata={"user_id": "u-1"}
    )
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert reply.model == tools_model_dir.name
    assert _blocks(reply) == [("text", "Hello from the cellar.")]
    assert reply.stop_reason == "end_turn" and reply.stop_sequence is None
    usage = reply.usage
    assert usage.output_tokens == len(script.tokenizer.encode("Hello from the cellar.", add_special_tokens=False)) + 1
    assert usage.input_tokens > 0 and usage.cache_creation_input_tokens == 0
    assert usage.cache_read_input_tokens is not None


def test_streaming_text_has_the_event_sequence_the_sdk_expects(served):
    server, client, script = served
    script.push("Streaming works.", "Streaming works.")
    parts = [{"type": "text", "text": "Stream, "}, {"type": "text", "text": "please."}]
    messages = [{"role": "user", "content": parts}]
    with client.messages.stream(model=MODEL, max_tokens=64, messages=messages) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == "Streaming works."
    assert _blocks(final) == [("text", "Streaming works.")] and final.stop_reason == "end_turn"
    assert final.usage.output_tokens > 0
    events = _sse_events(server.base, {"model": MODEL, "max_tokens": 64, "messages": messages, "stream": True})
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"] == start["usage"]["input_tokens"]


def test_tool_use_round_trip(served):
    _, client, script = served
    script.push(CALL_PARIS, ANSWER_PARIS)
    messages = [{"role": "user", "content": "Paris weather?"}]
    reply = _create(client, messages, system=SYSTEM, tools=TOOLS)
    assert reply.stop_reason == "tool_use"
    assert _blocks(reply) == [
        ("thinking", "The user wants the weather; I should call the tool."),
        ("tool_use", "get_weather", {"city": "Paris"}),
    ]
    call = reply.content[1]
    messages += [
        {"role": "assistant", "content": reply.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "sunny, 24 C"}]}
            ],
        },
    ]
    answer = _create(client, messages, system=SYSTEM, tools=TOOLS)
    assert answer.stop_reason == "end_turn"
    assert _blocks(answer) == [("thinking", "The tool says sunny."), ("text", "It is sunny in Paris.")]


def test_tool_use_streams_input_json_deltas(served):
    server, client, script = served
    script.push(CALL_BOTH, CALL_BOTH)
    messages = [{"role": "user", "content": "Rome?"}]
    with client.messages.stream(model=MODEL, max_tokens=96, tools=TOOLS, messages=messages) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert _blocks(final) == [("tool_use", "get_weather", {"city": "Rome"}), ("tool_use", "get_time", {"city": "Rome"})]
    assert "input_json" in kinds
    body = {
        "model": MODEL,
        "max_tokens": 96,
        "messages": messages,
        "tools": TOOLS,
        "stream": True,
        "tool_choice": {"type": "auto"},
    }
    events = _sse_events(server.base, body)
    starts = [data["content_block"] for name, data in events if name == "content_block_start"]
    assert [(block["type"], block["name"], block["input"]) for block in starts] == [
        ("tool_use", "get_weather", {}),
        ("tool_use", "get_time", {}),
    ]
    partial_json = [data["delta"]["partial_json"] for name, data in events if name == "content_block_delta"]
    assert [json.loads(text) for text in partial_json] == [{"city": "Rome"}, {"city": "Rome"}]


def test_tool_result_error_and_disable_parallel(served):
    _, client, script = served
    script.push(CALL_BOTH)
    messages = [
        {"role": "user", "content": "Rome?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"city": "Rome"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True, "content": "clock unavailable"},
                {"type": "text", "text": "Try the weather then."},
            ],
        },
    ]
    reply = _create(client, messages, tools=TOOLS, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [block[1] for block in _blocks(reply)] == ["get_weather"]


def test_thinking_history_and_config_are_accepted(served):
    _, client, script = served
    script.push(ANSWER_PARIS)
    messages = [
        {"role": "user", "content": "Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Check the tool.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "tool_use", "id": "toolu_9", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "sunny"}]},
    ]
    reply = client.messages.create(
        model=MODEL,
        max_tokens=2048,
        messages=messages,
        tools=TOOLS,
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert _blocks(reply) == [("thinking", "The tool says sunny."), ("text", "It is sunny in Paris.")]
    assert reply.content[0].signature == ""


@pytest.mark.parametrize("stops", [["STOP"], ["NEVER", "STOP", "here"]])
def test_stop_sequences_end_with_stop_reason_stop_sequence(served, stops):
    _, client, script = served
    script.push("Hello world. STOP here and more")
    reply = _create(client, [{"role": "user", "content": "Go."}], stop_sequences=stops)
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "STOP"
    assert _blocks(reply) == [("text", "Hello world. ")]


def test_max_tokens_ends_with_stop_reason_max_tokens(served):
    server, client, script = served
    script.push("one two three four five six seven eight", "one two three four five six seven eight")
    reply = client.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Count."}])
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 3
    events = _sse_events(
        server.base,
        {"model": MODEL, "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "Count."}]},
    )
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens" and events[-2][1]["usage"]["output_tokens"] == 3


def test_sampling_fields_in_extra_body(served):
    """The SDK's `create` has no temperature/top_p/top_k: clients send them in
    the body, and top_k 1 at temperature 1 samples what greedy does."""
    _, client, _ = served
    messages = [{"role": "user", "content": "Tell me about the cellar."}]
    greedy = _create(client, messages, max_tokens=12, extra_body={"temperature": 0})
    top_one = _create(client, messages, max_tokens=12, extra_body={"temperature": 1, "top_k": 1, "top_p": 0.9})
    assert _blocks(top_one) == _blocks(greedy) and greedy.usage.output_tokens >= 1


def test_output_config_format_is_valid_json_for_its_schema(served):
    _, client, _ = served
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    }
    reply = _create(
        client,
        [{"role": "user", "content": "A city as JSON."}],
        max_tokens=48,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    (block,) = reply.content
    parsed = json.loads(block.text)
    assert set(parsed) == {"city"} and isinstance(parsed["city"], str)


def test_count_tokens_matches_the_prompt_a_reply_reports(served):
    _, client, script = served
    script.push("ok")
    fields = {
        "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        "tools": TOOLS,
        "messages": [{"role": "user", "content": "How many tokens is this?"}],
    }
    counted = client.messages.count_tokens(model=MODEL, **fields)
    reply = client.messages.create(model=MODEL, max_tokens=8, **fields)
    usage = reply.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens
    fewer = client.messages.count_tokens(model=MODEL, messages=fields["messages"])
    assert 0 < fewer.input_tokens < counted.input_tokens


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"model": None}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"max_tokens": 0}, "max_tokens"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                            }
                        ],
                    }
                ]
            },
            "messages[0].content[0]",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "document"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]}, "prefill"),
        ({"system": [{"type": "image"}]}, "system[0]"),
        ({"temperature": 1.5}, "temperature"),
        ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format"),
        ({"top_k": "many"}, "top_k"),
        ({"stop_sequences": "STOP"}, "stop_sequences"),
        ({"stream": "yes"}, "stream"),
        ({"thinking": {"type": "enabled"}}, "budget_tokens"),
        ({"tools": [{"name": "x"}]}, "tools[0].input_schema"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]}, "tool_use_id"),
    ],
)
def test_bad_fields_are_400s_in_anthropics_error_shape(served, fields, needle):
    server, _, _ = served
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields}
    body = {name: value for name, value in body.items() if value is not None}
    response = httpx.post(f"{server.base}/v1/messages", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert needle in error["error"]["message"], error


def test_the_sdk_raises_bad_request_for_an_image(served):
    _, client, _ = served
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        _create(client, [{"role": "user", "content": [image, {"type": "text", "text": "what is it?"}]}])
    assert refused.value.status_code == 400
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert "'image' block" in refused.value.body["error"]["message"]


def test_a_model_without_tool_calling_refuses_tools(model_dir_factory):
    with InProcessServer(SystemConfig(model_dir=model_dir_factory("llama"))) as server:
        client = anthropic.Anthropic(base_url=server.base, api_key="unused", max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.create(model=MODEL, max_tokens=4, tools=TOOLS, messages=[{"role": "user", "content": "hi"}])
    assert "does not support tool calling" in refused.value.body["error"]["message"]


def test_api_key_as_x_api_key_or_bearer(model_dir_factory):
    settings = HttpSettings(api_key="cellar-key")
    with KeyedServer(SystemConfig(model_dir=model_dir_factory("llama")), settings) as server:
        keyed = anthropic.Anthropic(base_url=server.base, api_key="cellar-key", max_retries=0)
        bearer = anthropic.Anthropic(base_url=server.base, auth_token="cellar-key", max_retries=0)
        wrong = anthropic.Anthropic(base_url=server.base, api_key="not-it", max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        assert keyed.messages.create(model=MODEL, max_tokens=2, messages=messages).usage.output_tokens >= 1
        assert bearer.messages.count_tokens(model=MODEL, messages=messages).input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError) as refused:
            wrong.messages.create(model=MODEL, max_tokens=2, messages=messages)
        # Refused with the body unread, so the connection closes and the reply says so: the
        # client's next request then goes on a new connection instead of the closing one.
        assert refused.value.response.headers["connection"] == "close"
        with pytest.raises(anthropic.AuthenticationError):
            wrong.messages.count_tokens(model=MODEL, messages=messages)
        plain = httpx.post(
            f"{server.base}/v1/messages",
            timeout=30,
            json={"model": MODEL, "max_tokens": 2, "messages": messages},
            headers={"x-api-key": "cellar-key", "anthropic-version": "1999-01-01"},
        )
    assert refused.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "missing or wrong x-api-key"},
    }
    assert plain.status_code == 200


def test_an_aborted_batch_is_overloaded_and_an_error_event_mid_stream(model_dir_factory):
    model_dir = model_dir_factory("llama")
    config = SystemConfig(model_dir=model_dir, demote_idle_s=0, batch_rows_max=4)
    body = {"model": MODEL, "max_tokens": 40, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    with InProcessServer(config, SystemSeams(engine=FailingBatchEngine(model_dir, batches_failing=2))) as server:
        events = _sse_events(server.base, {**body, "stream": True})
        plain = httpx.post(f"{server.base}/v1/messages", json=body, timeout=120)
    assert [name for name, _ in events][:2] == ["message_start", "ping"]
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "overloaded_error"
    assert plain.status_code == 529
    assert plain.json()["error"]["type"] == "overloaded_error"


@pytest.mark.parametrize("echo_thinking", [False, True], ids=["thinking-dropped", "thinking-echoed"])
def test_agent_loop_turns_are_prefix_hits(served, echo_thinking, capsys):
    """system + tools + user -> tool_use -> tool_result -> answer -> next user
    turn -> tool_use -> tool_result -> answer, the way an agent loops with the
    SDK (the reply's content appended as the assistant turn): every turn after
    the first is served mostly from the cache."""
    _, client, script = served
    city = "Lyon" if echo_thinking else "Nice"
    call = CALL_PARIS.replace("Paris", city)
    script.push(call, ANSWER_PARIS, call, ANSWER_PARIS)
    system = f"{city}. {SYSTEM}"
    messages: list[dict] = [{"role": "user", "content": f"Weather in {city}?"}]
    ratios = []
    for turn in range(4):
        reply = _create(client, messages, system=system, tools=TOOLS)
        usage = reply.usage
        prompt_tokens = usage.input_tokens + usage.cache_read_input_tokens
        ratios.append(
            (prompt_tokens, usage.cache_read_input_tokens, round(usage.cache_read_input_tokens / prompt_tokens, 3))
        )
        content = [block for block in reply.content if echo_thinking or block.type != "thinking"]
        messages.append({"role": "assistant", "content": content})
        calls = [block for block in reply.content if block.type == "tool_use"]
        if calls:
            messages.append(
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "sunny, 24 C"}],
                }
            )
        elif turn == 1:
            messages.append({"role": "user", "content": "And tomorrow?"})
    with capsys.disabled():
        print(
            f"\nanthropic agent loop ({'echoing' if echo_thinking else 'dropping'} thinking): "
            f"(prompt tokens, cache_read_input_tokens, ratio) per turn: {ratios}"
        )
    assert ratios[0][2] < 0.1, ratios
    for _prompt_tokens, cached, ratio in ratios[1:]:
        assert cached > 0 and ratio >= 0.75, ratios
