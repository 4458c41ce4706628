"""Smoke test of the demo-coder figures script: one prompt of each kind through a
real `kvcellar serve`, the JSON last line with the keys the README names, the
docs untouched. It checks what the script reports, not the figures' values."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.bench import common, demo_model


def test_figures_script_prints_its_json_last_line(tmp_path):
    docs_before = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None

    outcome = CliRunner().invoke(demo_model.main, ["--prompts", "1", "--json"])

    assert outcome.exit_code == 0, outcome.output
    figures = json.loads(outcome.output.strip().splitlines()[-1])
    assert {"printable_share", "tool_call_share", "held_out_loss", "held_out_perplexity"} <= set(figures)
    assert 0 < figures["held_out_nats_per_byte"] < figures["held_out_loss"]
    assert {"right_tool_share", "tool_call_share_with_grammar", "right_tool_share_with_grammar"} <= set(figures)
    assert figures["chat_prompts"] == figures["tool_prompts"] == 1
    assert 0 <= figures["printable_share"] <= 1 and 0 <= figures["tool_call_share"] <= 1
    assert figures["demo_tokens_per_s"] > 0 and figures["random_small_tokens_per_s"] > 0
    assert (common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None) == docs_before


def test_printable_word_share_counts_words_of_printable_ascii_only():
    assert demo_model.printable_word_share("def f(x): return x") == 1.0
    assert demo_model.printable_word_share("ok \ufffd\ufffd ok ok") == 0.75
    assert demo_model.printable_word_share("") == 0.0
    assert not demo_model.is_mostly_printable("a b c d e f g h \u00e9 \u00e9")
