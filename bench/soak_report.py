"""The soak benchmark's report: its figure rows, summary, reading and docs section (`kvcellar.bench.soak` runs it)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvcellar.bench.common import Figures, docs_section, machine_sentence

# The soak's target for the worst `/health` on top of a restore.
TARGET_HEALTH_S = 0.05


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:,.1f} ms"


FIGURE_COLUMNS = ("measurement", "value", "target", "verdict")


def figure_rows(result: dict[str, Any]) -> list[tuple[str, ...]]:
    met = result["targets_met"]

    def verdict(key: str) -> str:
        return "met" if met[key] else "MISSED"

    codes = ", ".join(f"{code}: {count}" for code, count in result["status_codes"].items()) or "none"
    journal = result["journal_state"] + (f" ({result['journal_reason']})" if result["journal_reason"] else "")
    if result["journal_degraded"] and result["journal_first_degraded"]:
        journal += f"; first degraded {result['journal_first_degraded']['at_s']:.1f} s into the load"
    return [
        ("requests (status codes)", f"{result['requests']} ({codes})", "", ""),
        ("5xx replies", str(result["five_xx"]), "0", verdict("zero_5xx")),
        (
            "streams without [DONE]",
            f"{result['streams_without_done']} of {result['streams']}",
            "0",
            verdict("zero_streams_without_done"),
        ),
        ("journal state (end)", journal, "never degraded", verdict("journal_never_degraded")),
        (
            "journal verify after flush",
            "clean"
            if result["verify_ok"]
            else f"FAILED (exit {result['verify']['rc']}, {result['verify'].get('mismatches', '?')} mismatches)",
            "clean",
            verdict("verify_clean"),
        ),
        (
            "greedy outputs",
            "stable"
            if result["outputs_stable"]
            else f"{len(result['unstable_prompts'])} prompts with differing replies",
            "stable",
            verdict("greedy_outputs_stable"),
        ),
        (
            "worst /health on top of a restore (p99)",
            f"{_ms(result['health_worst_on_restore_s'])} ({_ms(result['health_p99_on_restore_s'])})",
            f"< {TARGET_HEALTH_S * 1000:.0f} ms",
            verdict("health_on_restore_lt_50ms"),
        ),
        ("worst /health overall (p99)", f"{_ms(result['health_worst_s'])} ({_ms(result['health_p99_s'])})", "", ""),
        (
            "worst /health of the idle server before the load (p50)",
            f"{_ms(result['health_idle_worst_s'])} ({_ms(result['health_idle_p50_s'])})",
            "",
            "",
        ),
        ("request latency p50 / p99", f"{_ms(result['p50_s'])} / {_ms(result['p99_s'])}", "", ""),
        (
            "SSD restores / spills / RAM evictions",
            f"{result['restores']} / {result['spills']} / {result['evictions']}",
            "",
            "",
        ),
        ("most spills queued at once", str(result["pending_spills_peak"]), "", ""),
    ]


def _flush_described(flush: dict[str, Any]) -> str:
    if flush["status"] is None:
        return f"no answer ({flush.get('error')})"
    verdict = flush["verdict"]
    durable = verdict.get("durable") if isinstance(verdict, dict) else None
    return f"HTTP {flush['status']} in {flush['s']:.2f} s, durable: {durable}"


def summary_lines(result: dict[str, Any]) -> list[str]:
    options = result["options"]
    return [
        f"model: {result['model']}; {options['clients']} clients for {options['duration_s']:.0f} s "
        f"({result['load_s']:.1f} s with the last requests in flight); RAM tier {options['prompt_cache_gb']} GB; "
        f"{options['prompts']} prompts in {options['families']} families ({options['prefix_tokens']}-token shared "
        f"prefix + {options['suffix_tokens']}-token suffix), {options['new_tokens']} new tokens, greedy, "
        f"{options['stream_share']:.0%} streaming, up to {options['think_s']} s think time; "
        f"each prompt came back {result['repeats_min']} times or more "
        f"(median {result['repeats_median']})",
        f"/health: {result['health_probes']} probes every {options['health_interval_s'] * 1000:.0f} ms, "
        f"{result['health_probes_on_restore']} of them overlapping one of {result['restore_windows']} "
        f"{options['stats_interval_s'] * 1000:.0f}-ms stats intervals in which restores rose; "
        f"{result['health_not_200']} not 200",
        f"flush: {_flush_described(result['flush'])}; server exit status {result['exit_status']}; others' CPUs "
        f"during the load {result['others_cpus']:.2f}",
    ]


def _without_timestamp(line: str) -> str:
    fields = line.split(" ", 2)
    return fields[2] if len(fields) == 3 and fields[0][:1].isdigit() else line


def interpretation(result: dict[str, Any]) -> str:
    """One paragraph built from the figures."""
    missed = [key for key, met in result["targets_met"].items() if not met]
    parts = [
        f"The soak met {len(result['targets_met']) - len(missed)} of {len(result['targets_met'])} targets"
        + (f"; missed: {', '.join(missed)}." if missed else ".")
    ]
    if result["journal_degraded"]:
        parts.append(
            f"The journal degraded during the load ({result['journal_reason'] or 'no reason given'}); "
            f"the server's log said: "
            + "; ".join(f"`{_without_timestamp(line)[:300]}`" for line in result["log_warnings"][:3])
            + "."
        )
    if not result["verify_ok"]:
        checks = Counter(item.get("check", "?") for item in result["verify"].get("mismatches_head", []))
        parts.append(
            "`kvcellar journal verify` failed after the flush and the graceful stop"
            + (
                f" ({', '.join(f'{check}: {count}' for check, count in checks.items())} among the first mismatches)"
                if checks
                else ""
            )
            + "."
        )
    if result["unstable_example"]:
        example = result["unstable_example"]
        parts.append(
            f"Prompt {example['prompt']} got differing greedy replies: "
            + ", ".join(
                f"{text['count']}x {text['chars']} chars starting {text['head']!r}" for text in example["texts"]
            )
            + "."
        )
    if not result["targets_met"]["health_on_restore_lt_50ms"] and result["health_idle_worst_s"] is not None:
        parts.append(
            f"On top of a restore /health took at worst {_ms(result['health_worst_on_restore_s'])} (p99 "
            f"{_ms(result['health_p99_on_restore_s'])}); the idle server before the load took at worst "
            f"{_ms(result['health_idle_worst_s'])} (median {_ms(result['health_idle_p50_s'])}): scheduling on "
            f"this machine alone comes close to the target."
        )
    if result["restores"] == 0:
        parts.append(
            f"No request restored from the SSD tier: {result['ssd_entries_before_flush']} entries had "
            f"reached it by the end of the load, with up to {result['pending_spills_peak']} spills queued "
            f"(SSD writes run in idle engine turns, which a batch that never ends does not leave)."
        )
    elif result["pending_spills_peak"]:
        drained = (
            f", and the flush drained the rest in {result['flush']['s']:.2f} s"
            if result["flush"]["s"] is not None
            else ""
        )
        parts.append(
            f"Up to {result['pending_spills_peak']} spills waited in the queue at once: SSD writes run in "
            f"idle engine turns, which come only between batches{drained}."
        )
    if result["others_cpus"] > 0.1:
        parts.append(
            f"Other processes kept {result['others_cpus']:.2f} CPUs busy during the load, so the latencies "
            f"carry that noise."
        )
    return " ".join(parts)


def markdown_section(result: dict[str, Any], command: str, run_date: str) -> str:
    machine = result["machine"]
    # The docs right-align the figures; the terminal (`main`) shows every column as text.
    figures = Figures(
        title="Soak",
        columns=FIGURE_COLUMNS,
        rows=figure_rows(result),
        summary=summary_lines(result),
        text_columns=("measurement", "verdict"),
    )
    return docs_section(
        "Soak: concurrent clients against a RAM tier far below the working set",
        [
            f"Run {run_date} with `{command}` (wall time {result['wall_s']:.0f} s).",
            machine_sentence(machine, f" (CPU); SSD tier on {machine['filesystem']}."),
        ],
        figures,
        [interpretation(result)],
    )
