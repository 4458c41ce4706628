"""Phase three's checkpoint choice (`demo/tool_validation.py`): its prompts, its parser
check, its batched greedy decoding and its ranking, with the committed demo-coder and
mlx-lm's own tokenizer wrapper and tool parser."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_map

from kvcellar.demo import corpus as demo_corpus
from kvcellar.demo.tool_validation import (
    TEST_PROMPTS,
    CheckpointScore,
    ToolCallScorer,
    calls_only_offered_tools,
    validation_tool_cases,
)
from kvcellar.demo.train import _build_model
from kvcellar.engine.demo_models import DEMO_CODER_DIR


@pytest.fixture(scope="module")
def tokenizer():
    from mlx_lm.tokenizer_utils import load

    return load(DEMO_CODER_DIR)


WEATHER = [demo_corpus.TOOL_SPECS[0].schema()]
WEATHER_NAME = WEATHER[0]["function"]["name"]


def test_validation_prompts_are_fixed_held_out_and_never_a_test_prompt():
    cases = validation_tool_cases(60)
    assert [case.messages for case in cases] == [case.messages for case in validation_tool_cases(60)]
    test = [conversation for conversation, _ in demo_corpus.held_out_tool_cases(TEST_PROMPTS)]
    assert len(cases) == 60 and not any(case in test for case in cases)
    assert all(case.tools and case.messages[-1]["role"] == "user" for case in cases)
    # Drawn like the test prompts: several tools and requests, with and without a system prompt.
    assert len({case.messages[-1]["content"] for case in cases}) > 25
    assert {case.messages[0]["role"] for case in cases} == {"system", "user"}


def test_a_reply_counts_only_when_mlx_lms_parser_reads_a_call_to_an_offered_tool(tokenizer):
    def call(name: str, arguments: object) -> str:
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"

    assert calls_only_offered_tools(tokenizer, call(WEATHER_NAME, {"city": "Oslo"}), WEATHER)
    # Arguments as a JSON string, text before the call, a call cut off before its end marker.
    assert calls_only_offered_tools(tokenizer, call(WEATHER_NAME, '{"city": "Oslo"}'), WEATHER)
    assert calls_only_offered_tools(tokenizer, "Let me look.\n" + call(WEATHER_NAME, {}), WEATHER)
    assert calls_only_offered_tools(tokenizer, call(WEATHER_NAME, {"city": "Oslo"})[: -len("</tool_call>")], WEATHER)
    assert not calls_only_offered_tools(tokenizer, call("get_time", {"city": "Oslo"}), WEATHER)
    assert not calls_only_offered_tools(tokenizer, call(WEATHER_NAME, ["Oslo"]), WEATHER)
    assert not calls_only_offered_tools(tokenizer, '<tool_call>\n{"name": "get_weather", "argu', WEATHER)
    assert not calls_only_offered_tools(tokenizer, "It is sunny in Oslo.", WEATHER)


@settings(max_examples=200, deadline=None)
@given(reply=st.lists(st.sampled_from([*'<>/{}[]":, \nname', "<tool_call>", "</tool_call>", '"name": '])).map("".join))
def test_any_reply_is_a_verdict_never_an_exception(tokenizer, reply):
    assert calls_only_offered_tools(tokenizer, reply, WEATHER) in (True, False)


def test_batched_greedy_replies_score_as_replies_decoded_one_at_a_time():
    config = json.loads((DEMO_CODER_DIR / "config.json").read_text())
    model = _build_model(config)
    model.load_weights(str(DEMO_CODER_DIR / "model.safetensors"))
    model.set_dtype(mx.float32)
    scorer = ToolCallScorer(DEMO_CODER_DIR, lambda: _build_model(config), 6)
    share = scorer.share(model)
    assert share > 0, "the committed model calls an offered tool on some validation prompts"
    # `share` loaded the bfloat16-rounded weights; decode each prompt alone (no padding) with them.
    scorer._model.update(tree_map(lambda weight: weight.astype(mx.bfloat16).astype(mx.float32), model.parameters()))
    alone = [
        calls_only_offered_tools(scorer._tokenizer, scorer._greedy_replies([ids])[0], case.tools)
        for ids, case in scorer._cases
    ]
    assert sum(alone) / len(alone) == share
    assert {len(ids) for ids, _ in scorer._cases} != 1, "prompts of different lengths: the batch pads"


def test_checkpoints_rank_by_validation_share_then_by_lower_assistant_loss():
    first = CheckpointScore(step=540, validation_tool_call_share=0.7, assistant_loss=2.0)
    assert first.beats(None)
    assert CheckpointScore(step=590, validation_tool_call_share=0.75, assistant_loss=2.5).beats(first)
    assert CheckpointScore(step=590, validation_tool_call_share=0.7, assistant_loss=1.9).beats(first)
    assert not CheckpointScore(step=590, validation_tool_call_share=0.7, assistant_loss=2.0).beats(first)
    assert not CheckpointScore(step=590, validation_tool_call_share=0.65, assistant_loss=1.0).beats(first)
