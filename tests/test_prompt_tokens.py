"""`PromptEncoder` (http/prompt_tokens.py): a prompt spliced onto a recent
one's tokens is exactly the tokenizer's own encoding of the whole text.

Held to the real demo tokenizers on conversations rendered through their real
chat templates, encoded in the order a client would send them (each turn's
prompt extending the last, with the same prompt sent again and edits in
between), and on texts with the added tokens' text at arbitrary places.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import load as load_tokenizer
from test_template_probe import conversations, texts

from kvcellar.http.prompt_tokens import PromptEncoder, prompt_encoder


@pytest.fixture(scope="session")
def plain_tokenizer(model_dir_factory):
    return load_tokenizer(model_dir_factory("llama"))


def _assert_exact(tokenizer: Any, encoder: PromptEncoder, text: str) -> None:
    encoded = encoder.encode(text)
    assert encoded.text == text
    assert encoded.ids == tuple(tokenizer.encode(text, add_special_tokens=False))
    # The marks a splice carries over are the ones the whole text's encoding has.
    assert encoded.marks == PromptEncoder(tokenizer).encode(text).marks


def _renderings(tokenizer: Any, messages: list[dict[str, Any]]) -> list[str]:
    """Each prefix of the conversation that ends with a user turn, and the whole, rendered for a reply."""
    ends = [index + 1 for index, message in enumerate(messages) if message["role"] in ("user", "tool")]
    ends += [] if ends and ends[-1] == len(messages) else [len(messages)]
    return [tokenizer.apply_chat_template(messages[:end], add_generation_prompt=True, tokenize=False) for end in ends]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=conversations(with_tools=True), edits=st.lists(texts, max_size=3), data=st.data())
def test_spliced_encodings_equal_the_whole_texts_on_both_templates(
    plain_tokenizer, tools_tokenizer, messages, edits, data
):
    for tokenizer in (plain_tokenizer, tools_tokenizer):
        encoder = PromptEncoder(tokenizer)
        renderings = _renderings(tokenizer, messages)
        for text in renderings + renderings[-1:]:
            _assert_exact(tokenizer, encoder, text)
        for edit in edits:
            # Something else at an arbitrary place of the last prompt: the encoder splices before it or not at all.
            last = renderings[-1]
            cut = data.draw(st.integers(min_value=0, max_value=len(last)))
            _assert_exact(tokenizer, encoder, last[:cut] + edit + last[cut:])


def test_a_repeated_conversation_encodes_only_its_new_tail(plain_tokenizer):
    """The second turn's prompt reuses the first's tokens up to the last turn marker they share."""
    encoder = PromptEncoder(plain_tokenizer)
    first = [{"role": "user", "content": "word " * 400}]
    second = first + [{"role": "assistant", "content": "a reply"}, {"role": "user", "content": "more"}]
    texts_ = [
        plain_tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in (first, second)
    ]
    encoder.encode(texts_[0])
    encoded: list[str] = []
    real = encoder._fast

    def counting(text: str, **kwargs: Any) -> Any:
        encoded.append(text)
        return real(text, **kwargs)

    encoder._fast = counting
    _assert_exact(plain_tokenizer, encoder, texts_[1])
    (tail,) = encoded
    assert tail.startswith("<|im_start|>assistant\n") and "word" not in tail
    assert encoder.encode(texts_[1]) is encoder.encode(texts_[1])


def test_one_encoder_per_tokenizer(plain_tokenizer, tools_tokenizer):
    assert prompt_encoder(plain_tokenizer) is prompt_encoder(plain_tokenizer)
    assert prompt_encoder(plain_tokenizer) is not prompt_encoder(tools_tokenizer)
