"""The soak's short version: 4 clients for 20 s against a real `kvcellar serve` with an SSD
tier and a RAM tier far below the working set, then a flush, a graceful stop and
`kvcellar journal verify`.

It asserts the soak's hard targets (nothing lost, nothing degraded, greedy replies stable)
and that the SSD path really ran (restores and spills), never a latency: the worst /health
time is reported in the JSON only. The RAM tier is scaled down with the prompts (1 MB
against about 3 MB of distinct prompts) so that 20 s on a slow CPU see every prompt come
back from the SSD tier several times."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvcellar.bench import common, soak

SHORT_RUN = (
    "--duration-s",
    "20",
    "--prompts",
    "8",
    "--prefix-tokens",
    "32",
    "--suffix-tokens",
    "24",
    "--new-tokens",
    "8",
    "--prompt-cache-gb",
    "0.001",
)


def test_short_soak_loses_nothing_and_keeps_the_journal_sound(tmp_path, model_dir_factory):
    docs_before = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    work = tmp_path / "work"

    outcome = CliRunner().invoke(
        soak.main, ["--model", str(model_dir_factory("llama", "small")), *SHORT_RUN, "--dir", str(work), "--json"]
    )

    assert outcome.exit_code == 0, outcome.output
    figures = json.loads(outcome.stdout.strip().splitlines()[-1])
    evidence = {
        key: figures[key]
        for key in (
            "status_codes",
            "failures_head",
            "log_warnings",
            "verify",
            "journal_first_degraded",
            "unstable_example",
            "flush",
        )
    }
    assert figures["requests"] > 0 and figures["status_codes"].get("200") == figures["requests"], evidence
    assert figures["five_xx"] == 0 and figures["transport_errors"] == 0, evidence
    assert figures["streams"] > 0 and figures["streams_without_done"] == 0, evidence
    assert figures["stream_error_events"] == 0, evidence
    assert not figures["journal_degraded"] and figures["journal_state"] == "ok", evidence
    assert figures["verify_ok"], evidence
    assert figures["outputs_stable"] and figures["repeats_median"] >= 2, evidence
    assert figures["restores"] > 0 and figures["spills"] > 0, "the soak exercised the SSD tier"
    assert figures["flush"]["status"] == 200 and figures["flush"]["verdict"]["durable"] is True, evidence
    assert figures["exit_status"] == 0, evidence
    assert figures["health_probes"] > 0 and figures["health_worst_s"] is not None
    assert set(figures["targets_met"]) == {
        "zero_5xx",
        "zero_streams_without_done",
        "journal_never_degraded",
        "verify_clean",
        "greedy_outputs_stable",
        "health_on_restore_lt_50ms",
    }
    assert list(work.iterdir()) == []
    docs_after = common.DOCS_PATH.read_text() if common.DOCS_PATH.exists() else None
    assert docs_after == docs_before
