"""Smoke test of the quantized-batch benchmark: it runs its three sessions and
derives its figures from them; never how fast (the machine is shared)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.bench import common, quant_batch

NEW_TOKENS = 3
CLIENTS = 2


def test_benchmark_prints_its_figures_as_json_on_the_last_line(model_dir_factory, tmp_path):
    docs_before = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    work = tmp_path / "work"
    arguments = ["--model", str(model_dir_factory("llama", "medium")), "--dir", str(work), "--json"]
    arguments += ["--clients", str(CLIENTS), "--prompt-tokens", "8", "--new-tokens", str(NEW_TOKENS), "--rounds", "1"]

    outcome = CliRunner().invoke(quant_batch.main, arguments)

    assert outcome.exit_code == 0, outcome.output
    figures = json.loads(outcome.stdout.strip().splitlines()[-1])
    rates, tier_bytes = figures["tok_s"], figures["tier_bytes"]
    assert figures["quant_batch_ratio_2"] == rates["kv4 batch"] / rates["kv4 serial"]
    assert figures["quant_vs_bf16_batch_2"] == rates["kv4 batch"] / rates["bf16 batch"]
    assert figures["kv_bytes_vs_bf16"] == tier_bytes["kv4 batch"] / tier_bytes["bf16 batch"]
    # float32 KV against 4-bit words plus a float32 scale and bias per 64 values, same tokens in both batch sessions.
    assert abs(figures["kv_bytes_vs_bf16"] - (0.5 + 8 / 64) / 4) < 1e-9
    assert figures["lanes"] == {"kv4 serial": "serial", "kv4 batch": "batch", "bf16 batch": "batch"}
    assert figures["outputs_equal"] is True
    assert max(int(rows) for rows in figures["batch_size_history"]["kv4 batch"]) == CLIENTS
    assert figures["forward_ceiling_2"] > 0
    assert list(work.iterdir()) == []
    assert (common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None) == docs_before
