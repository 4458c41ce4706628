"""The prompt-boundary snapshot at the template probe's stable boundary (spec §4).

A chat request carries the probe's boundary (`GenerationRequest.snapshot_at_tokens`):
both lanes split the prefill there and put a snapshot holding exactly
`prompt[:boundary]`, so the next turn of a conversation whose template
re-renders earlier turns (the demo template drops an earlier turn's reasoning
once a new user message follows, as Qwen3's does) is a prefix hit even for
caches that cannot be trimmed: recurrent state (mamba2's `ArraysCache`,
qwen3_next's linear layers) and wrapped rings. The engine tests run both
lanes directly against a real RAM tier and compare the snapshot with a cold
prefill of the same tokens; the server test drives two chat turns through a
real hypercorn server with the `openai` SDK.
"""

from __future__ import annotations

import json
import queue
import threading

import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from test_http_errors import InProcessServer
from test_tools import ScriptedReplies

from kvcellar.actors.system import SystemConfig, SystemSeams
from kvcellar.engine.batch import END_OF_BATCH, BatchLoop, BatchRow, RowDone
from kvcellar.engine.demo_models import create_model
from kvcellar.engine.engine import LoadedModel, SamplingParams, prefill
from kvcellar.engine.generation import GenerationDone, GenerationRequest, run_generation
from kvcellar.errors import UsageError
from kvcellar.http.anthropic import parse_messages_body
from kvcellar.http.app import HttpSettings
from kvcellar.http.parsing import parse_job
from kvcellar.http.responses import parse_responses_body
from kvcellar.http.tools import NO_TOOLS, render_prompt
from kvcellar.store.lending import cache_arrays, lend_caches
from kvcellar.store.prompt_cache import PromptCache

# Scripted replies stand in for the model's own output; the tool-call grammar would mask them.
SCRIPTED_SETTINGS = HttpSettings(tool_call_grammar=False)

PROMPT = tuple((29 * i + 7) % 1000 + 3 for i in range(72))
BOUNDARY = 50
MODEL = "mamba2-tools"
ANSWER = "<think>\nThe user greets; answer briefly.\n</think>\n\nHello there, how can I help?"


@pytest.fixture(scope="module", params=["mamba2", "qwen3_next"])
def loaded(request, tmp_path_factory):
    model_dir = create_model(request.param, tmp_path_factory.mktemp("boundary") / request.param, chat_format="tools")
    model, tokenizer = load(str(model_dir))
    return LoadedModel(model=model, tokenizer=tokenizer, model_dir=model_dir, context_tokens_max=4096)


def _request(prompt=PROMPT, boundary: int | None = BOUNDARY) -> GenerationRequest:
    return GenerationRequest(prompt_ids=tuple(prompt), params=SamplingParams(max_tokens=4), snapshot_at_tokens=boundary)


def _serial(loaded, prompt_cache, request):
    done = [
        item
        for item in run_generation(loaded, prompt_cache, request, threading.Event())
        if isinstance(item, GenerationDone)
    ]
    return done[0]


def _batch(loaded, prompt_cache, *requests):
    inbox: queue.Queue = queue.Queue()
    for row_id, request in enumerate(requests):
        inbox.put(BatchRow(row_id=row_id, request=request, cancelled=threading.Event()))
    loop = BatchLoop(prompt_cache, inbox, rows_max=2, cancelled=threading.Event())
    ends: dict[int, RowDone] = {}
    steps = loop.run(loaded)
    for step in steps:
        ends.update({event.row_id: event for event in step.events if isinstance(event, RowDone)})
        if len(ends) == len(requests):
            inbox.put(END_OF_BATCH)
    assert all(end.outcome == "completed" for end in ends.values()), ends
    return ends


def _cold_arrays(loaded, tokens):
    caches = make_prompt_cache(loaded.model)
    prefill(loaded.model, tokens, caches)
    lent = lend_caches(caches)
    mx.eval(cache_arrays(lent))
    return cache_arrays(lent)


def _assert_snapshot_is_cold_prefill(loaded, prompt_cache, tokens, *, exact: bool):
    snapshot = prompt_cache.snapshot_exact(tokens)
    assert snapshot is not None, "no entry holds exactly the boundary's tokens"
    ours, cold = cache_arrays(snapshot.caches), _cold_arrays(loaded, tokens)
    assert [a.shape for a in ours] == [a.shape for a in cold]
    for a, b in zip(ours, cold, strict=True):
        if exact:
            assert np.array_equal(np.array(a), np.array(b))
        else:
            assert np.allclose(np.array(a), np.array(b), atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("lane", ["serial", "batch"])
def test_the_snapshot_holds_exactly_the_prompt_up_to_the_boundary(loaded, lane):
    prompt_cache = PromptCache()
    if lane == "serial":
        _serial(loaded, prompt_cache, _request())
    else:
        # A second row beside it: the boundary row's prefill shares batched steps.
        _batch(loaded, prompt_cache, _request(), _request(PROMPT[::-1], None))
    # The serial lane's boundary prefill is a cold prefill of those tokens; a batched one agrees to rounding.
    _assert_snapshot_is_cold_prefill(loaded, prompt_cache, PROMPT[:BOUNDARY], exact=lane == "serial")
    # The next turn keeps the stable part and renders the rest anew: the snapshot serves it.
    next_turn = PROMPT[:BOUNDARY] + (11, 12, 13, 14)
    assert _serial(loaded, prompt_cache, _request(next_turn, None)).cached_tokens == BOUNDARY


@pytest.mark.parametrize("lane", ["serial", "batch"])
def test_without_a_boundary_a_short_prompt_leaves_only_its_untrimmable_final_entry(loaded, lane):
    prompt_cache = PromptCache()
    if lane == "serial":
        _serial(loaded, prompt_cache, _request(boundary=None))
    else:
        _batch(loaded, prompt_cache, _request(boundary=None))
    assert prompt_cache.snapshot_exact(PROMPT[:BOUNDARY]) is None
    next_turn = PROMPT[:BOUNDARY] + (11, 12, 13, 14)
    assert _serial(loaded, prompt_cache, _request(next_turn, None)).cached_tokens == 0


def test_a_boundary_the_tiers_already_served_puts_no_second_snapshot(loaded):
    prompt_cache = PromptCache()
    _serial(loaded, prompt_cache, _request())
    entries = prompt_cache.stats()["entries"]
    longer = PROMPT + (5, 6, 7)
    done = _serial(loaded, prompt_cache, _request(longer, BOUNDARY))
    assert done.cached_tokens >= BOUNDARY
    # Only the new final entry: the boundary's snapshot was already there.
    assert prompt_cache.stats()["entries"] == entries + 1


@pytest.mark.parametrize("boundary", [0, len(PROMPT), len(PROMPT) + 3])
def test_a_boundary_outside_the_prompt_is_refused(boundary):
    with pytest.raises(UsageError, match="not inside"):
        _request(boundary=boundary)


def test_every_chat_api_carries_the_probes_boundary_and_completions_none(loaded):
    """The chat, Messages and Responses parsers render the same conversation
    to the same prompt and carry its stable boundary; a completion has none."""
    system, user = "Be terse.", "Hello!"
    rendered = render_prompt(
        loaded.tokenizer,
        [{"role": "system", "content": system}, {"role": "user", "content": user}],
        NO_TOOLS,
        probe=True,
    )
    assert 0 < rendered.stable_prefix_tokens < len(rendered.prompt_ids)
    chat = parse_job(
        {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}, loaded, chat=True
    ).request
    messages = parse_messages_body(
        json.dumps(
            {"model": "any", "max_tokens": 8, "system": system, "messages": [{"role": "user", "content": user}]}
        ).encode(),
        loaded,
    ).request
    responses = parse_responses_body(
        json.dumps({"instructions": system, "input": user}).encode(), loaded, max_tokens_default=8
    ).job.request
    for request in (chat, messages, responses):
        assert request.prompt_ids == rendered.prompt_ids
        assert request.snapshot_at_tokens == rendered.stable_prefix_tokens
    completion = parse_job({"prompt": rendered.text}, loaded, chat=False).request
    assert completion.snapshot_at_tokens is None


# -- two chat turns through a real server ---------------------------------------------


@pytest.fixture(scope="module")
def mamba2_tools(tmp_path_factory):
    return create_model("mamba2", tmp_path_factory.mktemp("boundary-server") / MODEL, chat_format="tools")


@pytest.mark.parametrize("rows", [1, 2], ids=["serial", "batch"])
def test_the_next_chat_turn_reads_the_first_turns_stable_boundary_from_the_cache(mamba2_tools, rows):
    """Turn 1's reply has reasoning, which the template drops once turn 2's
    user message follows: turn 1's final entry (prompt and reply, recurrent
    state that cannot be cut back) is no prefix of turn 2, so only the
    snapshot at turn 1's stable boundary serves it. Sent as a completion
    (no probe, no boundary) the same turn-1 prompt leaves turn 2 cold."""
    tokenizer = load(str(mamba2_tools))[1]
    script = ScriptedReplies(tokenizer)
    config = SystemConfig(model_dir=mamba2_tools, batch_rows_max=rows)
    with InProcessServer(config, SystemSeams(logits_processors=script), SCRIPTED_SETTINGS) as server:
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)
        results = {}
        for probed in (False, True):
            messages = [
                {"role": "system", "content": f"Probed: {probed}. You are a terse assistant."},
                {"role": "user", "content": "Hello!"},
            ]
            first = render_prompt(tokenizer, messages, NO_TOOLS, probe=True)
            script.push(ANSWER)
            if probed:
                reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0)
                assert reply.choices[0].message.reasoning_content
                assert reply.usage.prompt_tokens == len(first.prompt_ids)
            else:
                client.completions.create(model=MODEL, prompt=first.text, max_tokens=64, temperature=0)
            messages += [
                {
                    "role": "assistant",
                    "content": "Hello there, how can I help?",
                    "reasoning_content": "The user greets; answer briefly.",
                },
                {"role": "user", "content": "What is the weather?"},
            ]
            second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
            results[probed] = (
                first.stable_prefix_tokens,
                second.usage.prompt_tokens,
                second.usage.prompt_tokens_details.cached_tokens,
            )
    boundary, prompt_tokens, cached = results[True]
    assert 0 < boundary < prompt_tokens
    assert cached == boundary, results
    assert results[False][2] == 0, results
