"""The template probe's cheap path (http/tools.py `stable_prefix_tokens`).

The probe used to encode the common text of the two renderings a second
time; with a fast tokenizer it now takes the token count from the prompt's
own added-token marks (`EncodedPrompt.marks`) whenever the renderings part
right after an added token, and encodes again only otherwise. These tests hold it
to the old function (kept here as the oracle, verbatim in behaviour) on
generated conversations through the demo models' real chat templates and
tokenizers: the boundary must equal the old one (so never exceed it).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import load as load_tokenizer
from test_tools import TOOLS

from kvcellar.http import tools
from kvcellar.http.prompt_tokens import PromptEncoder, common_length
from kvcellar.http.tools import NO_TOOLS, ToolPlan, render_prompt, stable_prefix_tokens


def old_stable_prefix_tokens(tokenizer: Any, messages: list[dict[str, Any]], tools_: Any) -> int:
    """The probe as it was before: a char-by-char common prefix of the two
    renderings, the common text encoded again, a token-by-token common prefix."""
    rendered = tokenizer.apply_chat_template(messages, tools=tools_, add_generation_prompt=True, tokenize=False)
    continued = tokenizer.apply_chat_template(
        messages + [tools._PROBE_MESSAGE], tools=tools_, add_generation_prompt=False, tokenize=False
    )
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)

    def common(left: Any, right: Any) -> int:
        shared = 0
        for ours, theirs in zip(left, right, strict=False):
            if ours != theirs:
                break
            shared += 1
        return shared

    common_ids = tokenizer.encode(rendered[: common(rendered, continued)], add_special_tokens=False)
    return common(prompt_ids, common_ids)


@pytest.fixture(scope="session")
def plain_tokenizer(model_dir_factory):
    return load_tokenizer(model_dir_factory("llama"))


# Text that stresses the tokenizer at the cut: spaces and newlines (byte-level
# BPE's whitespace pre-tokenizer looks ahead), the template's own markers and
# the added tokens' text inside a message.
FRAGMENTS = ("a", "bo", " ", "  ", "\n", "\n\n", "<", "|", "im", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
texts = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=6), max_size=12).map("".join)


@st.composite
def conversations(draw: st.DrawFn, *, with_tools: bool) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(texts)})
    for _ in range(draw(st.integers(min_value=0, max_value=2))):
        messages.append({"role": "user", "content": draw(texts)})
        reply: dict[str, Any] = {"role": "assistant", "content": draw(texts)}
        if with_tools and draw(st.booleans()):
            reply["reasoning_content"] = draw(texts)
        if with_tools and draw(st.booleans()):
            function = {"name": "get_time", "arguments": {"city": draw(texts)}}
            reply["tool_calls"] = [{"id": "c", "type": "function", "function": function}]
            messages += [reply, {"role": "tool", "tool_call_id": "c", "content": draw(texts)}]
        else:
            messages.append(reply)
    if not messages or messages[-1]["role"] == "assistant" or draw(st.booleans()):
        messages.append({"role": "user", "content": draw(texts)})
    return messages


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=conversations(with_tools=False))
def test_probe_equals_the_old_one_on_the_plain_template(plain_tokenizer, messages):
    rendered = render_prompt(plain_tokenizer, messages, NO_TOOLS, probe=True)
    assert rendered.prompt_ids == tuple(plain_tokenizer.encode(rendered.text, add_special_tokens=False))
    assert rendered.stable_prefix_tokens == old_stable_prefix_tokens(plain_tokenizer, messages, None)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=conversations(with_tools=True), with_tool_list=st.booleans())
def test_probe_equals_the_old_one_on_the_tools_template(tools_tokenizer, messages, with_tool_list):
    plan = ToolPlan(tools=tuple(TOOLS)) if with_tool_list else NO_TOOLS
    rendered = render_prompt(tools_tokenizer, messages, plan, probe=True)
    assert rendered.prompt_ids == tuple(tools_tokenizer.encode(rendered.text, add_special_tokens=False))
    expected = old_stable_prefix_tokens(tools_tokenizer, messages, plan.template_tools())
    assert rendered.stable_prefix_tokens == expected


def test_a_turn_marker_boundary_needs_no_second_encode(plain_tokenizer):
    """The renderings part after `<|im_start|>` (assistant against user):
    the offsets give the count, so the common text is never encoded again."""
    messages = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"}]
    messages.append({"role": "user", "content": "and again " * 50})
    rendered = render_prompt(plain_tokenizer, messages, NO_TOOLS, probe=True)
    encoded: list[str] = []

    class CountingTokenizer:
        def __getattr__(self, name: str) -> Any:
            return getattr(plain_tokenizer, name)

        def encode(self, text: str, **kwargs: Any) -> list[int]:
            encoded.append(text)
            return plain_tokenizer.encode(text, **kwargs)

    marks = PromptEncoder(plain_tokenizer).encode(rendered.text).marks
    stable = stable_prefix_tokens(
        CountingTokenizer(), messages, rendered.prompt_ids, tools=None, rendered=rendered.text, added_marks=marks
    )
    assert encoded == []
    assert stable == rendered.stable_prefix_tokens == old_stable_prefix_tokens(plain_tokenizer, messages, None)
    assert rendered.prompt_ids[stable - 1] == plain_tokenizer.convert_tokens_to_ids("<|im_start|>")


@settings(max_examples=300, deadline=None)
@given(
    left=st.lists(st.integers(0, 3), max_size=40) | st.text("ab", max_size=40),
    right=st.lists(st.integers(0, 3), max_size=40) | st.text("ab", max_size=40),
)
def test_common_length_matches_an_item_by_item_count(left, right):
    expected = 0
    for ours, theirs in zip(left, right, strict=False):
        if ours != theirs:
            break
        expected += 1
    if isinstance(left, str) != isinstance(right, str):
        return  # the probe compares text with text and ids with ids
    assert common_length(left, right) == expected
    assert common_length(tuple(left), list(right)) == expected
