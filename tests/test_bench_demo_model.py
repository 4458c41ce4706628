"""Smoke test of the demo-coder figures script: one prompt of each kind through a
real `kvcellar serve` of the model it is given (a copy of the committed one),
the JSON last line with the keys the README names, the docs untouched. It
checks what the script reports, not the figures' values."""

from __future__ import annotations

import json
import shutil

from click.testing import CliRunner

from kvcellar.bench import common, demo_model
from kvcellar.demo.train import TRAINING_LOG_FILE_NAME
from kvcellar.engine.demo_models import DEMO_CODER_DIR


def test_figures_script_prints_its_json_last_line_for_the_model_it_is_given(tmp_path):
    docs_before = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    # A candidate model beside the committed one: a copy whose training log says another loss.
    candidate = tmp_path / "candidate"
    shutil.copytree(DEMO_CODER_DIR, candidate)
    log_path = candidate / TRAINING_LOG_FILE_NAME
    log = json.loads(log_path.read_text())
    log["final_held_out_loss_bf16"] = 9.5
    log_path.write_text(json.dumps(log))

    outcome = CliRunner().invoke(demo_model.main, ["--prompts", "1", "--model", str(candidate), "--json"])

    assert outcome.exit_code == 0, outcome.output
    figures = json.loads(outcome.output.strip().splitlines()[-1])
    assert figures["model"] == str(candidate) and figures["held_out_loss"] == 9.5
    assert {"printable_share", "tool_call_share", "held_out_loss", "held_out_perplexity"} <= set(figures)
    assert 0 < figures["held_out_nats_per_byte"] < figures["held_out_loss"]
    assert {"right_tool_share", "tool_call_share_with_grammar", "right_tool_share_with_grammar"} <= set(figures)
    assert figures["chat_prompts"] == figures["tool_prompts"] == 1
    assert 0 <= figures["printable_share"] <= 1 and 0 <= figures["tool_call_share"] <= 1
    assert figures["demo_tokens_per_s"] > 0 and figures["random_small_tokens_per_s"] > 0
    assert (common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None) == docs_before


def test_a_model_other_than_the_committed_one_is_never_published_and_must_be_a_trained_one(tmp_path):
    refused = CliRunner().invoke(demo_model.main, ["--model", str(tmp_path), "--write-docs"])
    assert refused.exit_code == 2 and "drop --model DIR" in refused.output
    untrained = CliRunner().invoke(demo_model.main, ["--model", str(tmp_path)])
    assert untrained.exit_code == 2 and f"has no {TRAINING_LOG_FILE_NAME}" in untrained.output


def test_printable_word_share_counts_words_of_printable_ascii_only():
    assert demo_model.printable_word_share("def f(x): return x") == 1.0
    assert demo_model.printable_word_share("ok \ufffd\ufffd ok ok") == 0.75
    assert demo_model.printable_word_share("") == 0.0
    assert not demo_model.is_mostly_printable("a b c d e f g h \u00e9 \u00e9")
