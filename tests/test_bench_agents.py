"""Smoke test of the real-agents benchmark: the Agents SDK client (in the dev extra, so always there)
through a real server, the JSON last line with the keys the issue names, the docs untouched. It checks
what the script reports, not the figures' values."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.bench import agents, common


def test_benchmark_prints_its_figures_as_json_on_the_last_line():
    docs_before = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None

    outcome = CliRunner().invoke(agents.main, ["--clients", "agents_sdk_chat", "--json"])

    assert outcome.exit_code == 0, outcome.output
    figures = json.loads(outcome.stdout.strip().splitlines()[-1])
    assert {"claude_cross_session_share", "codex_cross_session_share", "claude_cold_prefill_s", "non_2xx"} <= set(
        figures
    )
    # Only the Agents SDK ran: the Claude and Codex figures are unmeasured, not made up.
    assert figures["claude_cross_session_share"] is None and figures["claude_cold_prefill_s"] is None
    client = figures["clients"]["agents_sdk_chat"]
    assert client["installed"] and client["exit_codes"] == [0, 0]
    assert client["requests"] >= 2 and client["generated"] >= 2 and client["non_2xx"] == figures["non_2xx"]
    assert client["cold_ttft_s"] > 0 and 0 <= client["new_session_share"] <= 1
    assert "non_2xx_eq_0" in figures["targets_met"]
    assert (common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None) == docs_before


def test_unknown_clients_are_refused_with_the_names_it_knows():
    outcome = CliRunner().invoke(agents.main, ["--clients", "claude,cursor"])
    assert outcome.exit_code == 2 and "unknown client cursor" in outcome.output and "agents_sdk_chat" in outcome.output
