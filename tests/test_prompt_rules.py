"""Prompt normalisation rules (http/prompt_rules.py) and where system messages go (http/tools.py).

Hypothesis drives the billing-header rule over any fields Claude Code may
put in the line; the system-message placement is checked on the demo
model's real tokenizer with three chat templates: one that renders system
turns anywhere, one that refuses them past the first message, and one that
drops them silently.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import load as load_tokenizer

from kvcellar.http.prompt_rules import PROMPT_RULES, normalize_text
from kvcellar.http.tools import merge_inner_system, render_prompt

FIXED = "x-anthropic-billing-header: normalized-by-kvcellar;"
field_names = st.sampled_from(["cc_version", "cc_entrypoint", "cch", "cc_workload", "x"])
field_values = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789.-_", min_size=0, max_size=12)
fields = st.lists(st.tuples(field_names, field_values), max_size=5)
prose = st.text(alphabet=st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), max_size=40)


def _header(pairs: list[tuple[str, str]], trailing_semicolon: bool) -> str:
    line = "; ".join(f"{name}={value}" for name, value in pairs)
    return f"x-anthropic-billing-header: {line}{';' if trailing_semicolon and pairs else ''}"


@given(fields, fields, st.booleans(), st.booleans(), prose)
def test_any_two_billing_headers_normalise_to_the_same_text(first, second, semi_a, semi_b, rest):
    """The line becomes one fixed form whatever its fields, and the text after it is kept."""
    a, applied = normalize_text(f"{_header(first, semi_a)}\n{rest}")
    b, _ = normalize_text(f"{_header(second, semi_b)}\n{rest}")
    assert a == b == f"{FIXED}\n{rest}"
    assert applied == ["claude_code_billing_header"]


@given(prose.filter(lambda text: "x-anthropic-billing-header" not in text.lower()))
def test_text_without_the_header_is_untouched(text):
    assert normalize_text(text) == (text, [])


@given(fields, st.booleans(), prose, prose)
def test_normalising_is_idempotent_and_only_touches_the_header_line(pairs, semi, before, after):
    text = f"{before}\n{_header(pairs, semi)}\n{after}"
    once, _ = normalize_text(text)
    assert normalize_text(once) == (once, [])
    assert once.split("\n")[0] == before and once.split("\n")[2] == after


def test_rules_are_data_with_distinct_names():
    names = [rule.name for rule in PROMPT_RULES]
    assert len(set(names)) == len(names) and all(rule.why for rule in PROMPT_RULES)


def test_off_means_no_rule_runs():
    text = _header([("cc_version", "2.1.197.8a5")], True)
    assert normalize_text(text, ()) == (text, [])


# -- system messages past the first ---------------------------------------------------

_TURNS = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
REFUSING = (
    "{%- for m in messages %}{%- if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('system messages go first') }}{%- endif %}{%- endfor %}" + _TURNS
)
DROPPING = (
    "{%- for m in messages %}{%- if m.role != 'system' or loop.first %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
MESSAGES = [
    {"role": "system", "content": "You are Claude Code."},
    {"role": "user", "content": "list the files"},
    {"role": "system", "content": "Agents: Explore."},
    {"role": "assistant", "content": "Sure."},
    {"role": "user", "content": "and now?"},
]


@pytest.fixture
def fresh_tokenizer(tools_model_dir):
    """A tokenizer of its own: the test changes its chat template."""
    return load_tokenizer(tools_model_dir)


def test_a_template_that_takes_system_turns_anywhere_renders_them_where_they_stand(tools_tokenizer):
    text = render_prompt(tools_tokenizer, MESSAGES).text
    assert text.index("list the files") < text.index("Agents: Explore.") < text.index("Sure.")


@pytest.mark.parametrize("template", [REFUSING, DROPPING], ids=["refusing", "dropping"])
def test_a_template_that_refuses_or_drops_them_gets_them_merged_into_the_next_user_turn(fresh_tokenizer, template):
    fresh_tokenizer._tokenizer.chat_template = template
    text = render_prompt(fresh_tokenizer, MESSAGES).text
    assert text.count("<|im_start|>system") == 1
    assert "<|im_start|>user\nAgents: Explore.\n\nand now?" in text


def test_merging_puts_a_trailing_system_message_into_the_opening_one():
    """Claude Code's first request is `[user, system]`: no user turn follows the system one."""
    merged = merge_inner_system(
        [
            {"role": "system", "content": "A"},
            {"role": "user", "content": "q"},
            {"role": "system", "content": "B"},
        ]
    )
    assert merged == [{"role": "system", "content": "A\n\nB"}, {"role": "user", "content": "q"}]
