"""The sampling and output fields clients send, through the official `openai`
SDK against a real `kvcellar serve` (hypercorn on 127.0.0.1) on both lanes:
`--batch 1` (the serial lane) and the default batch lane. References come
from the same tiny model run through mlx-lm directly."""

from __future__ import annotations

import json

import httpx
import mlx.core as mx
import openai
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors
from test_serve import Server

LANES = ("serial", "batch")
PROMPT = "Tell me a story about the sea"
MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def servers(model_dir_factory):
    running = {
        "serial": Server(model_dir_factory("llama"), "--batch", "1"),
        "batch": Server(model_dir_factory("llama")),
    }
    for lane, server in running.items():
        assert _stats(server)["scheduler"]["lane"] == lane
    yield running
    for server in running.values():
        server.kill()


@pytest.fixture(scope="module")
def reference(loaded_model_factory):
    return loaded_model_factory("llama")


def _stats(server) -> dict:
    return httpx.get(f"{server.base}/stats", timeout=30).json()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(server, **fields):
    fields = {"max_tokens": 8, "temperature": 0, **fields}
    extra = fields.pop("extra_body", {})
    extra.update({name: fields.pop(name) for name in ("top_k", "min_p", "repetition_penalty") if name in fields})
    return _client(server).chat.completions.create(model=server.model_id, messages=MESSAGES, extra_body=extra, **fields)


def _completion_tokens(server, **fields) -> list[str]:
    """The completion's tokens, as the completions API's `logprobs` lists them."""
    fields = {"max_tokens": 12, "temperature": 0, **fields}
    extra = {name: fields.pop(name) for name in ("top_k", "min_p", "repetition_penalty") if name in fields}
    reply = _client(server).completions.create(
        model=server.model_id, prompt=PROMPT, logprobs=0, extra_body=extra, **fields
    )
    return reply.choices[0].logprobs.tokens


def _chat_prompt_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def _reference_tokens(reference, prompt_ids: list[int], count: int, **processor_fields) -> list[int]:
    """Greedy tokens from mlx-lm's own generator with mlx-lm's processors."""
    model, _ = reference
    processors = make_logits_processors(**processor_fields) if processor_fields else None
    steps = generate_step(mx.array(prompt_ids), model, max_tokens=count, logits_processors=processors)
    return [int(token) for token, _ in steps]


@pytest.mark.parametrize("lane", LANES)
def test_logit_bias_forces_one_token(servers, lane):
    forced = 300
    reply = _chat(servers[lane], temperature=1.0, logit_bias={str(forced): 100}, logprobs=True)
    content = reply.choices[0].logprobs.content
    assert len(content) == 8
    token_text = bytes(content[0].bytes).decode()
    assert all(entry.token == token_text for entry in content)
    assert reply.choices[0].message.content == token_text * 8


@pytest.mark.parametrize("lane", LANES)
def test_top_k_1_and_min_p_near_1_equal_greedy_at_temperature_1(servers, lane):
    greedy = _chat(servers[lane], max_tokens=12).choices[0].message.content
    assert _chat(servers[lane], max_tokens=12, temperature=1.0, top_k=1).choices[0].message.content == greedy
    assert _chat(servers[lane], max_tokens=12, temperature=1.0, min_p=0.9999).choices[0].message.content == greedy


@pytest.mark.parametrize("lane", LANES)
def test_chat_logprobs_equal_the_models_log_softmax(servers, lane, reference):
    model, tokenizer = reference
    reply = _chat(servers[lane], logprobs=True, top_logprobs=5)
    content = reply.choices[0].logprobs.content
    prompt_ids = _chat_prompt_ids(tokenizer)
    generated = _reference_tokens(reference, prompt_ids, len(content))
    # One forward pass over the prompt and the generated tokens gives every step's distribution.
    logits = model(mx.array([prompt_ids + generated]))[0, len(prompt_ids) - 1 :]
    expected = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for step, entry in enumerate(content):
        row = expected[step]
        token_id = generated[step]
        assert entry.token == tokenizer.decode([token_id])
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        assert entry.logprob == pytest.approx(row[token_id].item(), abs=1e-4)
        best = mx.argsort(-row)[:5].tolist()
        assert [top.logprob for top in entry.top_logprobs] == pytest.approx([row[i].item() for i in best], abs=1e-4)
        # Greedy: the sampled token is the most likely one.
        assert entry.top_logprobs[0].bytes == entry.bytes


@pytest.mark.parametrize("lane", LANES)
def test_completion_logprobs_have_the_legacy_shape_and_stream_the_same(servers, lane):
    client = _client(servers[lane])
    reply = client.completions.create(
        model=servers[lane].model_id, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3
    )
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert all(
        len(top) <= 3 and max(top.values()) == pytest.approx(value, abs=1e-6)
        for top, value in zip(logprobs.top_logprobs, logprobs.token_logprobs, strict=True)
    )
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    streamed = [
        chunk.choices[0].logprobs
        for chunk in client.completions.create(
            model=servers[lane].model_id, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, stream=True
        )
        if chunk.choices and chunk.choices[0].logprobs
    ]
    assert [token for part in streamed for token in part.tokens] == logprobs.tokens
    assert [offset for part in streamed for offset in part.text_offset] == logprobs.text_offset


@pytest.mark.parametrize("lane", LANES)
def test_chat_logprobs_stream_like_the_plain_reply(servers, lane):
    plain = _chat(servers[lane], logprobs=True, top_logprobs=2).choices[0].logprobs.content
    stream = _client(servers[lane]).chat.completions.create(
        model=servers[lane].model_id,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    streamed = [
        entry
        for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in plain]


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("field", ["repetition_penalty", "presence_penalty", "frequency_penalty"])
def test_penalties_match_mlx_lm_and_change_the_output(servers, lane, reference, field):
    _, tokenizer = reference
    value = 1.5 if field == "repetition_penalty" else 2.0
    tokens = _completion_tokens(servers[lane], **{field: value})
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    expected = _reference_tokens(reference, prompt_ids, 12, **{field: value})
    plain = _reference_tokens(reference, prompt_ids, 12)
    assert tokens == [tokenizer.decode([t]) for t in expected]
    # Plain greedy repeats the prompt's last token; every penalty pushes it out.
    assert plain == [prompt_ids[-1]] * 12
    assert prompt_ids[-1] not in expected
    if field == "frequency_penalty":
        # Each repeat costs 2 more: this model's logit gaps let no token come a third time.
        assert max(expected.count(t) for t in expected) <= 2
        assert len(set(expected)) > len(set(_reference_tokens(reference, prompt_ids, 12, presence_penalty=value)))


def test_seeded_sampling_with_the_new_fields_is_the_same_on_both_lanes(servers):
    fields = {
        "temperature": 1.0,
        "seed": 7,
        "max_tokens": 16,
        "top_k": 40,
        "min_p": 0.01,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.3,
        "repetition_penalty": 1.2,
        "logit_bias": {"300": 3},
    }
    replies = [_chat(servers[lane], **fields).choices[0].message.content for lane in LANES]
    assert replies[0] == replies[1]
    assert replies[0] == _chat(servers["batch"], **fields).choices[0].message.content


@pytest.mark.parametrize("lane", LANES)
def test_stop_takes_four_strings_and_cuts_the_text(servers, lane):
    text = _chat(servers[lane], max_tokens=12).choices[0].message.content
    cut = text[len(text) // 2 :][:3]
    stops = ["\x01never", "\x02never", cut, "\x03never"]
    reply = _chat(servers[lane], max_tokens=12, stop=stops, user="someone")
    assert reply.choices[0].message.content == text[: text.index(cut)]
    assert reply.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(servers[lane], stop=[*stops, "\x04never"])
    assert caught.value.param == "stop"


BAD_FIELDS = [
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "high"}, "frequency_penalty"),
    ({"logit_bias": {"seven": 1}}, "logit_bias"),
    ({"logit_bias": {"7": 101}}, "logit_bias"),
    ({"logit_bias": {"7": -100.5}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"logit_bias": [7]}, "logit_bias"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"user": 5}, "user"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}}, "response_format"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
        "response_format",
    ),
]


@pytest.mark.parametrize(("fields", "param"), BAD_FIELDS)
def test_bad_values_are_a_400_naming_the_field(servers, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        _client(servers["batch"]).chat.completions.create(
            model=servers["batch"].model_id, messages=MESSAGES, max_tokens=2, extra_body=fields
        )
    assert caught.value.param == param


def test_completions_logprobs_out_of_range_is_a_400(servers):
    for value in (-1, 6, True):
        with pytest.raises(openai.BadRequestError) as caught:
            _client(servers["serial"]).completions.create(
                model=servers["serial"].model_id, prompt=PROMPT, max_tokens=2, extra_body={"logprobs": value}
            )
        assert caught.value.param == "logprobs"


def test_unknown_fields_are_ignored(servers):
    reply = _chat(servers["serial"], extra_body={"an_unknown_field": {"x": 1}})
    assert reply.choices[0].finish_reason in ("stop", "length")


PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "mood": {"enum": ["calm", "stormy"]},
        "waves": {"type": "integer", "minimum": 0, "maximum": 9},
        "windy": {"type": "boolean"},
    },
    "required": ["mood", "waves", "windy"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_is_valid_against_the_schema(servers, lane, stream):
    response_format = {"type": "json_schema", "json_schema": {"name": "sea", "schema": PERSON_SCHEMA, "strict": True}}
    client = _client(servers[lane])
    for temperature in (0.0, 1.0):
        kwargs = {
            "model": servers[lane].model_id,
            "messages": MESSAGES,
            "max_tokens": 64,
            "temperature": temperature,
            "seed": 3,
            "response_format": response_format,
        }
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            reply = client.chat.completions.create(**kwargs)
            text, finish = reply.choices[0].message.content, [reply.choices[0].finish_reason]
        value = json.loads(text)
        assert finish == ["stop"]
        assert set(value) == {"mood", "waves", "windy"}
        assert value["mood"] in ("calm", "stormy")
        assert isinstance(value["waves"], int) and not isinstance(value["waves"], bool) and 0 <= value["waves"] <= 9
        assert isinstance(value["windy"], bool)


@pytest.mark.parametrize("lane", LANES)
def test_json_object_output_is_a_json_object(servers, lane, reference):
    # A bias towards "}" lets the random model close its object within the budget.
    _, tokenizer = reference
    close = tokenizer.encode("}", add_special_tokens=False)
    reply = _chat(servers[lane], max_tokens=64, response_format={"type": "json_object"}, logit_bias={str(close[0]): 5})
    value = json.loads(reply.choices[0].message.content)
    assert isinstance(value, dict)
    assert reply.choices[0].finish_reason == "stop"


def test_rows_with_their_own_processors_share_one_batch(servers):
    """A forced row, a schema row and a penalised row decode in one batch;
    each gets what it gets alone."""
    server = servers["batch"]
    schema_format = {"type": "json_schema", "json_schema": {"name": "sea", "schema": PERSON_SCHEMA}}
    alone = [
        _chat(server, max_tokens=40, response_format=schema_format).choices[0].message.content,
        _chat(server, max_tokens=12, frequency_penalty=2.0).choices[0].message.content,
    ]
    before = _stats(server)["scheduler"]["batch_size_history"]
    forced = _client(server).chat.completions.create(
        model=server.model_id, messages=MESSAGES, max_tokens=4000, temperature=0, logit_bias={"300": 100}, stream=True
    )
    with forced:
        first = next(chunk for chunk in forced if chunk.choices and chunk.choices[0].delta.content)
        # The forced row runs for thousands of steps: these two join its batch.
        together = [
            _chat(server, max_tokens=40, response_format=schema_format).choices[0].message.content,
            _chat(server, max_tokens=12, frequency_penalty=2.0).choices[0].message.content,
        ]
        later = next(chunk for chunk in forced if chunk.choices and chunk.choices[0].delta.content)
    assert first.choices[0].delta.content.strip() == later.choices[0].delta.content.strip() == "o"
    assert together == alone
    after = _stats(server)["scheduler"]["batch_size_history"]
    assert int(after.get("2", 0)) > int(before.get("2", 0))
