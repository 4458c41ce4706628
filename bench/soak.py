"""Benchmark: a soak of `kvcellar serve` whose RAM tier is far below the working set.

One real server (`--ssd-cache DIR --prompt-cache 0.004`: 4 MB of RAM tier against a prompt
pool of several times that) on the demo llama, `--clients` clients for `--duration-s`
seconds, each in its own thread. A client draws prompts from a pool of `--prompts`
long-ish prompts (`--families` groups sharing a `--prefix-tokens` prefix, each with its
own `--suffix-tokens` suffix) with a seeded RNG, so every prompt comes back several times,
and sends it greedy (temperature 0), streaming or not at random (odd prompts go to
`/v1/chat/completions`, even ones to `/v1/completions`), then thinks for up to `--think-s`
seconds. Requests therefore restore from the SSD tier while RAM evictions spill to it. The
think time matters: SSD writes run in idle engine turns, and with `--think-s 0` the batch
lane's one batch never ends, so nothing reaches the SSD tier until the flush.

First `--baseline-s` of `/health` probes against the idle server give the baseline. During
the load a probe thread times `GET /health` every `--health-interval-s` and another polls
`/stats` (restores, spills, the journal's state) every `--stats-interval-s`; a probe "ran
on top of a restore" when it overlaps a stats interval in which `ssd_cache.restores` rose.
At the end: `POST /admin/cache/flush`, the final `/stats`, SIGTERM (the server's graceful
flush-and-exit, the same handler as SIGINT), then `kvcellar journal verify DIR`.

Targets (from the issue): zero 5xx, zero stream without `data: [DONE]`, journal never
degraded, `journal verify` clean, greedy outputs stable (every reply to one prompt has the
same text), worst `/health` under 50 ms on top of a restore. Misses are reported, not
raised: the exit status is 0 whenever the soak ran.

    python -m kvcellar.bench.soak [--clients 4] [--duration-s 90] [--json] [--write-docs]
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import click
import httpx
import trio
from rich.console import Console
from tokenizers import Tokenizer

from kvcellar.bench.common import (
    describe_machine,
    docs_markers,
    model_option,
    print_figures,
    publish,
    publish_options,
    scratch_dir_option,
    scratch_with_model,
)
from kvcellar.bench.compare_mlx_lm import KVCELLAR, OthersCpu, ServerProcess, text_of_tokens
from kvcellar.bench.soak_report import (
    FIGURE_COLUMNS,
    TARGET_HEALTH_S,
    figure_rows,
    interpretation,
    markdown_section,
    summary_lines,
)
from kvcellar.engine.demo_models import DEMO_ARCH

MODEL_SIZE = "small"
REQUEST_TIMEOUT_S, PROBE_TIMEOUT_S, VERIFY_TIMEOUT_S = 120.0, 30.0, 300.0
REPLY_HEAD_CHARS, BODY_HEAD_CHARS, VERIFY_TAIL_CHARS, LOG_LINES_KEPT = 40, 300, 2000, 8
OPTION_KEYS = (
    "clients",
    "duration_s",
    "prompts",
    "families",
    "prefix_tokens",
    "suffix_tokens",
    "new_tokens",
    "stream_share",
    "think_s",
    "baseline_s",
    "prompt_cache_gb",
    "health_interval_s",
    "stats_interval_s",
    "seed",
)
DOCS_NAME = "soak"
DOCS_BEGIN, DOCS_END = docs_markers(DOCS_NAME)


@attrs.frozen(kw_only=True)
class Reply:
    """One request's outcome. `status` is None when the request failed below HTTP."""

    prompt: int
    stream: bool
    status: int | None
    started_s: float
    total_s: float
    text: str | None
    cached_tokens: int | None
    done: bool
    error: str


@attrs.frozen(kw_only=True)
class HealthProbe:
    started_s: float
    latency_s: float
    status: int | None


@attrs.frozen(kw_only=True)
class StatsSample:
    at_s: float
    restores: int
    spills: int
    ssd_entries: int
    pending_spills: int
    journal_state: str
    journal_reason: str | None


def journal_state(value: Any) -> tuple[str, str | None]:
    """`ssd_cache.journal` as (state, reason): a bare string ("ok"/"degraded") or
    `{"state": ..., "reason": ...}`; "missing" without an SSD tier."""
    if isinstance(value, dict):
        return str(value.get("state")), value.get("reason")
    return ("missing", None) if value is None else (str(value), None)


def build_prompts(tokenizer: Tokenizer, options: dict[str, Any]) -> list[str]:
    """`prompts` texts: prompt i is family (i mod families)'s shared prefix, then its own suffix."""
    seed = options["seed"]
    prefixes = [
        text_of_tokens(tokenizer, options["prefix_tokens"], seed + 1000 + f) for f in range(options["families"])
    ]
    return [
        f"{prefixes[i % options['families']]} {text_of_tokens(tokenizer, options['suffix_tokens'], seed + i)}"
        for i in range(options["prompts"])
    ]


def _request_body(prompt: int, text: str, stream: bool, new_tokens: int) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"max_tokens": new_tokens, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if prompt % 2:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}
    return "/v1/completions", {**body, "prompt": text}


def _cached_tokens(usage: dict[str, Any] | None) -> int | None:
    return ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")


def _streamed(response: httpx.Response) -> tuple[str, int | None, bool, str]:
    """The text of an SSE reply, its cached prompt tokens, whether its last event was `[DONE]`, and any error event."""
    parts, cached, done, error = [], None, False, ""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        done = line == "data: [DONE]"
        if done:
            continue
        chunk = json.loads(line.removeprefix("data: "))
        if "error" in chunk:
            error = json.dumps(chunk["error"])[:BODY_HEAD_CHARS]
        for choice in chunk.get("choices") or []:
            parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
        cached = _cached_tokens(chunk.get("usage")) if chunk.get("usage") else cached
    return "".join(parts), cached, done, error


def _completed(body: dict[str, Any]) -> tuple[str, int | None]:
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"], _cached_tokens(body.get("usage"))


def send(client: httpx.Client, base: str, prompt: int, text: str, stream: bool, new_tokens: int, epoch: float) -> Reply:
    path, body = _request_body(prompt, text, stream, new_tokens)
    started = time.perf_counter()
    status, reply_text, cached, done, error = None, None, None, False, ""
    try:
        with client.stream("POST", base + path, json=body) as response:
            status = response.status_code
            if status != 200:
                error = response.read().decode(errors="replace")[:BODY_HEAD_CHARS]
            elif stream:
                reply_text, cached, done, error = _streamed(response)
            else:
                reply_text, cached = _completed(json.loads(response.read()))
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError) as e:
        error = f"{type(e).__name__}: {e}"[:BODY_HEAD_CHARS]
        reply_text = None
    return Reply(
        prompt=prompt,
        stream=stream,
        status=status,
        started_s=started - epoch,
        total_s=time.perf_counter() - started,
        text=reply_text,
        cached_tokens=cached,
        done=done,
        error=error,
    )


def run_client(
    index: int, base: str, prompts: list[str], options: dict[str, Any], epoch: float, deadline: float
) -> list[Reply]:
    """One client: a request, a think time drawn from [0, think_s], again, until `deadline`
    (the request in flight then completes)."""
    rng = random.Random(options["seed"] * 1000 + index)
    replies = []
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        while time.perf_counter() < deadline:
            prompt = rng.randrange(len(prompts))
            stream = rng.random() < options["stream_share"]
            replies.append(send(client, base, prompt, prompts[prompt], stream, options["new_tokens"], epoch))
            time.sleep(rng.uniform(0, options["think_s"]))
    return replies


def probe_health(base: str, interval_s: float, epoch: float, deadline: float) -> list[HealthProbe]:
    probes = []
    with httpx.Client(timeout=PROBE_TIMEOUT_S) as client:
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            try:
                status: int | None = client.get(f"{base}/health").status_code
            except httpx.HTTPError:
                status = None
            ended = time.perf_counter()
            probes.append(HealthProbe(started_s=started - epoch, latency_s=ended - started, status=status))
            time.sleep(max(0.0, interval_s - (ended - started)))
    return probes


def sample_stats(client: httpx.Client, base: str, epoch: float) -> tuple[StatsSample, dict[str, Any]]:
    stats = client.get(f"{base}/stats").json()
    ssd = stats["ssd_cache"]
    state, reason = journal_state(ssd.get("journal"))
    return StatsSample(
        at_s=time.perf_counter() - epoch,
        restores=ssd.get("restores", 0),
        spills=ssd.get("spills", 0),
        ssd_entries=ssd.get("entries", 0),
        pending_spills=ssd.get("pending_spills", 0),
        journal_state=state,
        journal_reason=reason,
    ), stats


def poll_stats(
    base: str,
    interval_s: float,
    epoch: float,
    deadline: float,
) -> tuple[list[StatsSample], dict[str, Any]]:
    """The samples, and the last full `/stats` answer."""
    samples: list[StatsSample] = []
    last: dict[str, Any] = {}
    with httpx.Client(timeout=PROBE_TIMEOUT_S) as client:
        while time.perf_counter() < deadline:
            try:
                sample, last = sample_stats(client, base, epoch)
                samples.append(sample)
            except (httpx.HTTPError, json.JSONDecodeError, KeyError):
                pass
            time.sleep(interval_s)
    return samples, last


async def run_load(
    base: str,
    prompts: list[str],
    options: dict[str, Any],
    epoch: float,
) -> tuple[list[Reply], list[HealthProbe], tuple[list[StatsSample], dict[str, Any]]]:
    """The clients, the health probe and the stats poller, each in its own thread, at once."""
    deadline = epoch + options["duration_s"]
    per_client: list[list[Reply]] = [[] for _ in range(options["clients"])]
    probes: list[HealthProbe] = []
    polled: list[tuple[list[StatsSample], dict[str, Any]]] = []

    async def client(index: int) -> None:
        per_client[index] = await trio.to_thread.run_sync(run_client, index, base, prompts, options, epoch, deadline)

    async def health() -> None:
        probes.extend(await trio.to_thread.run_sync(probe_health, base, options["health_interval_s"], epoch, deadline))

    async def stats() -> None:
        polled.append(await trio.to_thread.run_sync(poll_stats, base, options["stats_interval_s"], epoch, deadline))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(health)
        nursery.start_soon(stats)
        for index in range(options["clients"]):
            nursery.start_soon(client, index)
    return [reply for replies in per_client for reply in replies], probes, polled[0]


def verify_journal(ssd_dir: Path) -> dict[str, Any]:
    """`kvcellar journal verify --json DIR` in its own process: its exit status, counts and first mismatches."""
    completed = subprocess.run(
        [sys.executable, "-m", "kvcellar.cli", "journal", "verify", "--json", str(ssd_dir)],
        capture_output=True,
        text=True,
        timeout=VERIFY_TIMEOUT_S,
    )
    verdict: dict[str, Any] = {"rc": completed.returncode}
    try:
        report = json.loads(completed.stdout)
        verdict.update(
            entries=report["entries"],
            mismatches=len(report["mismatches"]),
            mismatches_head=report["mismatches"][:LOG_LINES_KEPT],
        )
    except (json.JSONDecodeError, KeyError, TypeError):
        verdict["output"] = (completed.stdout + completed.stderr)[-VERIFY_TAIL_CHARS:]
    return verdict


def log_warnings(log_path: Path) -> list[str]:
    """The server log's first WARNING/ERROR lines (the journal's degradation among them), each
    traceback as its exception line."""
    lines = log_path.read_text(errors="replace").splitlines()
    flagged = []
    for number, line in enumerate(lines):
        if " WARNING " in line or " ERROR " in line:
            flagged.append(line)
        elif line.startswith("Traceback"):
            exception = next((later for later in lines[number + 1 :] if later and not later[0].isspace()), "")
            flagged.append(f"Traceback: {exception}")
    return flagged[:LOG_LINES_KEPT]


def flush_and_sample(
    base: str, epoch: float, last_stats: dict[str, Any]
) -> tuple[dict[str, Any], list[StatsSample], dict[str, Any]]:
    """`POST /admin/cache/flush` and the final `/stats`; a server that no longer answers is
    reported (the last stats polled during the load stand in), never raised."""
    flush: dict[str, Any] = {"status": None, "s": None, "verdict": None}
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        started = time.perf_counter()
        try:
            flushed = client.post(f"{base}/admin/cache/flush")
            flush.update(status=flushed.status_code, s=time.perf_counter() - started)
            is_json = flushed.headers.get("content-type", "").startswith("application/json")
            flush["verdict"] = flushed.json() if is_json else flushed.text[:BODY_HEAD_CHARS]
            sample, stats = sample_stats(client, base, epoch)
        except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
            flush["error"] = f"{type(e).__name__}: {e}"[:BODY_HEAD_CHARS]
            return flush, [], last_stats
    return flush, [sample], stats


def run_soak(model_dir: Path, workdir: Path, options: dict[str, Any], progress: Console) -> dict[str, Any]:
    """Start the server, soak it, flush, stop it, verify its journal."""
    prompts = build_prompts(Tokenizer.from_file(str(model_dir / "tokenizer.json")), options)
    ssd_dir, log_path = workdir / "ssd", workdir / "kvcellar.log"
    progress.print(f"kvcellar serve --ssd-cache … --prompt-cache {options['prompt_cache_gb']}: starting")
    server = ServerProcess(KVCELLAR, model_dir, ssd_dir, log_path, ("--prompt-cache", str(options["prompt_cache_gb"])))
    try:
        progress.print(
            f"/health of the idle server for {options['baseline_s']:.0f} s, then {options['clients']} "
            f"clients for {options['duration_s']:.0f} s"
        )
        started = time.perf_counter()
        idle = probe_health(server.base, options["health_interval_s"], started, started + options["baseline_s"])
        others, epoch = OthersCpu(server.process.pid), time.perf_counter()
        replies, probes, (samples, last_stats) = trio.run(run_load, server.base, prompts, options, epoch)
        load_s, others_cpus = time.perf_counter() - epoch, others.cpus()
        flush, final_samples, final_stats = flush_and_sample(server.base, epoch, last_stats)
        progress.print("flushed; stopping the server")
        exit_status = server.stop()
    finally:
        server.kill()
    progress.print("kvcellar journal verify")
    verify = verify_journal(ssd_dir)
    return summarise(
        replies,
        probes,
        [*samples, *final_samples],
        final_stats,
        {
            "ssd_entries_before_flush": samples[-1].ssd_entries if samples else None,
            "options": {key: options[key] for key in OPTION_KEYS},
            "load_s": load_s,
            "others_cpus": others_cpus,
            "start_s": server.start_s,
            "flush": flush,
            "exit_status": exit_status,
            "verify": verify,
            "log_warnings": log_warnings(log_path),
            "health_idle_probes": len(idle),
            # The first probe also opens the connection: not part of the idle server's answer time.
            "health_idle_worst_s": max((probe.latency_s for probe in idle[1:]), default=None),
            "health_idle_p50_s": _percentile([probe.latency_s for probe in idle[1:]], 0.5),
        },
    )


def restore_windows(samples: list[StatsSample]) -> list[tuple[float, float]]:
    """The stats intervals in which `ssd_cache.restores` rose: restores ran somewhere inside them."""
    return [
        (before.at_s, after.at_s) for before, after in itertools.pairwise(samples) if after.restores > before.restores
    ]


def _on_top_of_restore(probe: HealthProbe, windows: list[tuple[float, float]]) -> bool:
    return any(start <= probe.started_s + probe.latency_s and probe.started_s <= end for start, end in windows)


def _percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def _cached_mean(replies: list[Reply]) -> float | None:
    """Mean prompt tokens a successful reply took from a cache, over the replies that reported it."""
    cached = [reply.cached_tokens for reply in replies if reply.status == 200 and reply.cached_tokens is not None]
    return statistics.mean(cached) if cached else None


def output_stability(replies: list[Reply]) -> dict[str, Any]:
    """Whether every complete reply to one prompt has the same text (greedy), with the first counterexample."""
    texts: dict[int, Counter[str]] = {}
    for reply in replies:
        if reply.status == 200 and reply.text is not None and (reply.done or not reply.stream) and not reply.error:
            texts.setdefault(reply.prompt, Counter())[reply.text] += 1
    unstable = sorted(prompt for prompt, seen in texts.items() if len(seen) > 1)
    example = None
    if unstable:
        first = texts[unstable[0]].most_common()
        example = {
            "prompt": unstable[0],
            "texts": [
                {"head": text[:REPLY_HEAD_CHARS], "chars": len(text), "count": count} for text, count in first[:3]
            ],
        }
    repeats = [sum(seen.values()) for seen in texts.values()]
    return {
        "outputs_stable": not unstable,
        "unstable_prompts": unstable,
        "unstable_example": example,
        "prompts_seen": len(texts),
        "repeats_min": min(repeats, default=0),
        "repeats_median": statistics.median(repeats) if repeats else 0,
    }


def summarise(
    replies: list[Reply],
    probes: list[HealthProbe],
    samples: list[StatsSample],
    final_stats: dict[str, Any],
    run: dict[str, Any],
) -> dict[str, Any]:
    codes = Counter("transport_error" if reply.status is None else str(reply.status) for reply in replies)
    streams = [reply for reply in replies if reply.stream and reply.status == 200]
    windows = restore_windows(samples)
    on_restore = [probe.latency_s for probe in probes if _on_top_of_restore(probe, windows)]
    latencies = [reply.total_s for reply in replies if reply.status == 200]
    degraded = [sample for sample in samples if sample.journal_state != "ok"]
    ssd, ram = final_stats.get("ssd_cache", {}), final_stats.get("prompt_cache", {})
    failures = [
        {"status": reply.status, "stream": reply.stream, "prompt": reply.prompt, "error": reply.error}
        for reply in replies
        if reply.status != 200 or reply.error or (reply.stream and not reply.done)
    ]
    result: dict[str, Any] = {
        "requests": len(replies),
        "status_codes": dict(sorted(codes.items())),
        "five_xx": sum(count for code, count in codes.items() if code.isdigit() and int(code) >= 500),
        "transport_errors": codes.get("transport_error", 0),
        "streams": len(streams),
        "streams_without_done": sum(not reply.done for reply in streams),
        "stream_error_events": sum(bool(reply.error) for reply in streams),
        "failures_head": failures[:LOG_LINES_KEPT],
        "p50_s": _percentile(latencies, 0.5),
        "p99_s": _percentile(latencies, 0.99),
        "restores": ssd.get("restores", 0),
        "spills": ssd.get("spills", 0),
        "evictions": ram.get("evictions", 0),
        "ram_hits": ram.get("hits", 0),
        "cold_hits": ram.get("cold_hits", 0),
        "cached_tokens_mean": _cached_mean(replies),
        "ssd_entries": ssd.get("entries", 0),
        "ssd_bytes": ssd.get("bytes", 0),
        "health_probes": len(probes),
        "health_worst_s": max((p.latency_s for p in probes), default=None),
        "health_p99_s": _percentile([p.latency_s for p in probes], 0.99),
        "health_not_200": sum(probe.status != 200 for probe in probes),
        "health_probes_on_restore": len(on_restore),
        "health_worst_on_restore_s": max(on_restore, default=None),
        "health_p99_on_restore_s": _percentile(on_restore, 0.99),
        "restore_windows": len(windows),
        "stats_samples": len(samples),
        "pending_spills_peak": max((sample.pending_spills for sample in samples), default=0),
        "ssd_entries_before_flush": run["ssd_entries_before_flush"],
        "journal_state": samples[-1].journal_state if samples else "unknown",
        "journal_reason": samples[-1].journal_reason if samples else None,
        "journal_degraded": bool(degraded),
        "journal_first_degraded": attrs.asdict(degraded[0]) if degraded else None,
        "verify_ok": run["verify"]["rc"] == 0,
        **output_stability(replies),
        **run,
    }
    result["targets_met"] = targets_met(result)
    return result


def targets_met(result: dict[str, Any]) -> dict[str, bool]:
    worst = result["health_worst_on_restore_s"]
    return {
        "zero_5xx": result["five_xx"] == 0,
        "zero_streams_without_done": result["streams_without_done"] == 0,
        "journal_never_degraded": not result["journal_degraded"],
        "verify_clean": result["verify_ok"],
        "greedy_outputs_stable": result["outputs_stable"],
        "health_on_restore_lt_50ms": worst is not None and worst < TARGET_HEALTH_S,
    }


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--clients", type=click.IntRange(min=1), default=4, show_default=True, help="Concurrent clients.")
@click.option(
    "--duration-s",
    type=click.FloatRange(min=1),
    default=90.0,
    show_default=True,
    help="Seconds the clients keep sending; requests in flight then complete.",
)
@click.option("--prompts", type=click.IntRange(min=2), default=24, show_default=True, help="Prompts in the pool.")
@click.option(
    "--families", type=click.IntRange(min=1), default=3, show_default=True, help="Groups of prompts sharing a prefix."
)
@click.option(
    "--prefix-tokens",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Tokens of each family's shared prefix.",
)
@click.option(
    "--suffix-tokens",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Tokens of each prompt's own suffix.",
)
@click.option(
    "--new-tokens",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="max_tokens of every request (greedy).",
)
@click.option(
    "--stream-share", type=click.FloatRange(0, 1), default=0.5, show_default=True, help="Share of requests that stream."
)
@click.option(
    "--think-s",
    type=click.FloatRange(min=0),
    default=0.5,
    show_default=True,
    help="Most seconds a client pauses between two requests (uniform from 0).",
)
@click.option(
    "--baseline-s",
    type=click.FloatRange(min=0),
    default=2.0,
    show_default=True,
    help="Seconds of /health probes against the idle server before the load (the baseline).",
)
@click.option(
    "--prompt-cache-gb",
    type=click.FloatRange(min=0),
    default=0.004,
    show_default=True,
    help="The server's --prompt-cache (RAM tier, GB).",
)
@click.option(
    "--health-interval-s",
    type=click.FloatRange(min=0.001),
    default=0.05,
    show_default=True,
    help="Pause between /health probes.",
)
@click.option(
    "--stats-interval-s",
    type=click.FloatRange(min=0.01),
    default=0.1,
    show_default=True,
    help="Pause between /stats samples (the resolution of 'on top of a restore').",
)
@model_option(
    f"An mlx-lm model directory with tokenizer.json; default: a fresh offline demo {DEMO_ARCH} "
    f"{MODEL_SIZE} made in a temporary directory."
)
@scratch_dir_option("the SSD tier and the server log")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the prompts and the clients' draws.")
@publish_options(DOCS_BEGIN, DOCS_END)
def main(model_dir: Path | None, directory: Path | None, as_json: bool, write_docs: bool, **options: Any) -> None:
    """Soak kvcellar serve with an SSD tier and a tiny RAM tier; check nothing is lost, frozen or degraded."""
    started = time.perf_counter()
    console = Console() if sys.stdout.isatty() else Console(width=160)
    progress = Console(stderr=True)
    with scratch_with_model("soak", directory, model_dir, progress, size=MODEL_SIZE) as scratch:
        if not (scratch.model_dir / "tokenizer.json").is_file():
            raise click.ClickException(f"{scratch.model_dir} has no tokenizer.json to size the prompts with")
        result = run_soak(scratch.model_dir, scratch.workdir, options, progress)
    result.update(
        model=scratch.model_described, machine=describe_machine(scratch.base), wall_s=time.perf_counter() - started
    )
    print_figures(
        "Soak",
        FIGURE_COLUMNS,
        figure_rows(result),
        [*summary_lines(result), interpretation(result)],
        console,
        text_columns=FIGURE_COLUMNS,
    )
    publish(
        DOCS_NAME,
        result,
        lambda command, run_date: markdown_section(result, command, run_date),
        write_docs=write_docs,
        as_json=as_json,
        console=console,
        progress=progress,
    )


if __name__ == "__main__":
    main()
