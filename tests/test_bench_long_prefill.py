"""Smoke test of the long-prefill benchmark at a tiny size: it renders an agent's
prompt to the exact length asked for, prefills it in both variants and reports
the figures the issue names, not how fast they were."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.bench import common, long_prefill
from kvcellar.engine.demo_models import packaged_demo_coder_dir


def test_benchmark_prints_its_figures_as_json_on_the_last_line():
    docs_before = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    outcome = CliRunner().invoke(long_prefill.main, ["--tokens", "600", "--json"])
    assert outcome.exit_code == 0, outcome.output
    figures = json.loads(outcome.stdout.strip().splitlines()[-1])
    assert {"prefill_28k_s", "tokens_per_s", "baseline_bf16_28k_s", "speedup", "compute_dtype", "blas"} <= set(figures)
    assert figures["prompt_tokens"] == figures["baseline_tokens"] == 600
    assert figures["prefill_28k_s"] > 0 and figures["baseline_bf16_28k_s"] > 0
    # On the CPU the packaged bfloat16 demo-coder is computed in float32 by default, its baseline in bfloat16.
    assert (figures["compute_dtype"], figures["kv_dtype"], figures["baseline_kv_dtype"]) == (
        "float32",
        "float32",
        "bfloat16",
    )
    assert isinstance(figures["target_met"], bool)
    assert (common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None) == docs_before


def test_an_agents_prompt_renders_to_exactly_the_tokens_asked_for_with_its_tools():
    from mlx_lm import load

    tokenizer = load(str(packaged_demo_coder_dir()))[1]
    ids = long_prefill.prompt_ids(tokenizer, 3000)
    assert len(ids) == 3000
    text = tokenizer.decode(ids)
    assert "TodoWrite" in text and "list the files here" not in text  # cut: the tools come first, then more


def test_a_captured_anthropic_body_renders_its_system_messages_and_tools():
    body = {
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "list the files here"}]},
            {"role": "system", "content": "agents: general-purpose"},
        ],
        "tools": [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}}],
    }
    messages, tools = long_prefill.anthropic_body_request(body)
    assert messages[0] == {
        "role": "system",
        "content": "x-anthropic-billing-header: cc_version=1\n\nagents: general-purpose",
    }
    assert messages[1:] == [{"role": "user", "content": "list the files here"}]
    assert [tool["function"]["name"] for tool in tools] == ["Bash"]
