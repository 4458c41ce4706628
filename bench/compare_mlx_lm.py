"""Benchmark: kvcellar against `mlx_lm.server`, same model, same prompts, one run.

Both servers run as subprocesses on 127.0.0.1 ephemeral ports, one at a time, in four
sessions ordered kvcellar, mlx_lm.server, mlx_lm.server, kvcellar, each opening with a
warm-up completion of its own that shares no prefix with the measured prompts. First
sessions: (a) cold TTFT of a `--context-tokens` chat prompt and (d) decode tokens/s on it,
then kvcellar flushes (`POST /admin/cache/flush`) and stops on SIGTERM. Second sessions,
restarted (kvcellar on the same `--ssd-cache` directory): (c) TTFT of the same prompt,
then (b) a `--turns`-turn chat, each turn adding the previous reply and a user message.

TTFT is the time from sending a streaming request with `max_tokens: 1` to its first chunk:
the demo model's greedy output is often partial UTF-8, which both servers hold back, so
a longer reply's first content chunk may come only at its end. Decode tokens/s is
(completion tokens - 1) / (time of a `--new-tokens` request - time of a 1-token request) on
the same cached prompt, medians over repeats. Targets (from the issue): (c) kvcellar /
mlx_lm.server <= 0.02; (b) ratio of summed per-turn TTFT <= 1.0; (d) decode >= 0.95x.

    python -m kvcellar.bench.compare_mlx_lm [--context-tokens 4096] [--turns 10] [--new-tokens 128] [--json]
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click
import httpx
import mlx_lm
import numpy as np
from rich.console import Console
from rich.table import Table
from tokenizers import Tokenizer

from kvcellar.bench.common import (
    describe_machine,
    docs_markers,
    model_option,
    publish,
    publish_options,
    scratch_dir_option,
    scratch_with_model,
    wait_until_healthy,
)
from kvcellar.blas_preload import find_openblas, preload_environment
from kvcellar.engine.demo_models import DEMO_ARCH

KVCELLAR, MLX_LM = "kvcellar", "mlx_lm"
LABELS = {KVCELLAR: "kvcellar", MLX_LM: "mlx_lm.server"}
SESSION_ORDER = ((KVCELLAR, 1), (MLX_LM, 1), (MLX_LM, 2), (KVCELLAR, 2))
TARGET_RESTART_RATIO, REFERENCE_RESTART_RATIO = 0.02, 0.0195
TARGET_TURN_RATIO, TARGET_DECODE_RATIO = 1.0, 0.95
TARGET_WARM_TTFT_RATIO = 1.0
MODEL_SIZE = "small"
WARMUP_PROMPT_TOKENS, WARMUP_NEW_TOKENS = 256, 8
START_TIMEOUT_S, STOP_TIMEOUT_S, REQUEST_TIMEOUT_S = 180.0, 180.0, 1800.0
LOG_TAIL_CHARS, REPLY_HEAD_CHARS = 3000, 24
OPTION_KEYS = ("context_tokens", "turns", "turn_tokens", "new_tokens", "decode_repeats", "seed")
# Other work above this many CPUs, on average over a session, marks the run as disturbed.
OTHERS_CPUS_DISTURBING = 0.1
SYLLABLES = tuple(consonant + vowel for consonant in "bdfgklmnprstvz" for vowel in "aeiou")
DOCS_NAME = "compare_mlx_lm"
DOCS_BEGIN, DOCS_END = docs_markers(DOCS_NAME)


def busy_cpu_s() -> float:
    """CPU seconds the whole machine spent busy (steal included) since boot; 0 without /proc."""
    try:
        fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return 0.0
    user, nice, system, _, _, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int | None) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class OthersCpu:
    """CPUs that processes other than this one and the server kept busy, on average, since construction
    (0 on an otherwise idle machine, 1 when other work kept one CPU busy throughout)."""

    def __init__(self, server_pid: int | None = None) -> None:
        self.server_pid = server_pid
        self.start = (busy_cpu_s(), time.process_time(), process_cpu_s(server_pid), time.perf_counter())

    def cpus(self, server_pid: int | None = None) -> float:
        pid = server_pid if server_pid is not None else self.server_pid
        busy, own, server, wall = self.start
        others_s = busy_cpu_s() - busy - (time.process_time() - own) - (process_cpu_s(pid) - server)
        # The counters tick at 100 Hz and are read at slightly different moments: an idle machine can read < 0.
        return max(0.0, others_s / (time.perf_counter() - wall))


class ServerProcess:
    """One server subprocess with its output in a log file, healthy once constructed."""

    def __init__(
        self, name: str, model_dir: Path, ssd_dir: Path | None, log_path: Path, extra_args: tuple[str, ...] = ()
    ) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.name, self.log_path, self.base = name, log_path, f"http://127.0.0.1:{port}"
        ssd_args = ["--ssd-cache", str(ssd_dir)] if ssd_dir is not None else []
        command = (
            [sys.executable, "-m", "kvcellar.cli", "serve", *ssd_args]
            if name == KVCELLAR
            else [sys.executable, "-m", "mlx_lm", "server"]
        )
        environment = {**os.environ, "HF_HUB_OFFLINE": "1"}
        if name == MLX_LM:
            # `kvcellar serve` preloads OpenBLAS itself (kvcellar.blas_preload): the same BLAS for both.
            system = platform.system()
            environment = preload_environment(environment, system=system, library=find_openblas()) or environment
        started = time.perf_counter()
        with log_path.open("w") as log:
            self.process = subprocess.Popen(
                [*command, "--model", str(model_dir), "--port", str(port), *extra_args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=environment,
            )
        wait_until_healthy(
            self.process, self.base, timeout_s=START_TIMEOUT_S, output=self.log_tail, name=LABELS[self.name], poll_s=0.2
        )
        self.start_s = time.perf_counter() - started

    def stop(self) -> int:
        """SIGTERM and wait: kvcellar's graceful flush-and-exit; mlx_lm.server has no handler and just ends."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise click.ClickException(
                f"{LABELS[self.name]} ignored SIGTERM for {STOP_TIMEOUT_S:.0f} s:\n{self.log_tail()}"
            ) from None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]


def text_of_tokens(tokenizer: Tokenizer, tokens: int, seed: int) -> str:
    """Deterministic pseudo-words from `seed`, as many as fit in `tokens` tokens."""
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(SYLLABLES, size=int(rng.integers(1, 4)))) for _ in range(tokens)]
    fewest, most = 1, len(words)
    while fewest < most:
        middle = (fewest + most + 1) // 2
        if len(tokenizer.encode(" ".join(words[:middle]), add_special_tokens=False).ids) <= tokens:
            fewest = middle
        else:
            most = middle - 1
    return " ".join(words[:fewest])


def stream_request(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """A greedy streaming request: time to its first chunk with a choice, total time, text and usage."""
    body = {**body, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    first_chunk_s, parts, usage = None, [], None
    started = time.perf_counter()
    with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            response.read()
            raise click.ClickException(f"POST {url}: HTTP {response.status_code}: {response.text[:500]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise click.ClickException(f"POST {url}: error in the stream: {chunk['error']}")
            if chunk.get("choices"):
                first_chunk_s = time.perf_counter() - started if first_chunk_s is None else first_chunk_s
                choice = chunk["choices"][0]
                parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            usage = chunk.get("usage") or usage
    total_s = time.perf_counter() - started
    if first_chunk_s is None or usage is None:
        raise click.ClickException(f"POST {url}: the stream had no choice or no usage chunk")
    return {
        "first_chunk_s": first_chunk_s,
        "total_s": total_s,
        "text": "".join(parts),
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
    }


def chat(
    client: httpx.Client,
    server: ServerProcess,
    messages: list[dict[str, str]],
    max_tokens: int,
) -> dict[str, Any]:
    # No "model" field: mlx_lm.server would try to load a model by that name.
    return stream_request(
        client, f"{server.base}/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens}
    )


def kvcellar_counters(client: httpx.Client, server: ServerProcess) -> dict[str, int]:
    if server.name != KVCELLAR:
        return {}
    stats = client.get(f"{server.base}/stats").json()
    return {
        "ssd_restores": stats["ssd_cache"]["restores"],
        "cold_hits": stats["prompt_cache"]["cold_hits"],
        "ssd_writes": stats["ssd_cache"]["spills"],
        "ssd_entries": stats["ssd_cache"]["entries"],
    }


def _counted(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in after}


def cold_and_decode(client: httpx.Client, server: ServerProcess, setup: dict[str, Any]) -> dict[str, Any]:
    """(a) cold TTFT of the context prompt, (d) decode pairs on it; kvcellar then flushes."""
    messages = [{"role": "user", "content": setup["context_text"]}]
    figures: dict[str, Any] = {"cold": chat(client, server, messages, 1), "decode_runs": []}
    for _ in range(setup["decode_repeats"]):
        long_run = chat(client, server, messages, setup["new_tokens"])
        short_run = chat(client, server, messages, 1)
        figures["decode_runs"].append(
            {
                "long_total_s": long_run["total_s"],
                "short_total_s": short_run["total_s"],
                "short_first_chunk_s": short_run["first_chunk_s"],
                "completion_tokens": long_run["completion_tokens"],
                "long_cached_tokens": long_run["cached_tokens"],
                "short_cached_tokens": short_run["cached_tokens"],
            }
        )
    if server.name == KVCELLAR:
        started = time.perf_counter()
        flushed = client.post(f"{server.base}/admin/cache/flush")
        figures["flush"] = {
            "status": flushed.status_code,
            "s": time.perf_counter() - started,
            "durable": flushed.json().get("durable") if flushed.status_code in (200, 503) else None,
        }
    return figures


def restart_and_conversation(client: httpx.Client, server: ServerProcess, setup: dict[str, Any]) -> dict[str, Any]:
    """(c) TTFT of the context prompt after the restart, then (b) the multi-turn chat."""
    before = kvcellar_counters(client, server)
    figures: dict[str, Any] = {
        "restart": chat(client, server, [{"role": "user", "content": setup["context_text"]}], 1),
        "restart_counters": _counted(before, kvcellar_counters(client, server)),
        "ssd_entries_at_restart": before.get("ssd_entries"),
        "turns": [],
    }
    messages: list[dict[str, str]] = []
    for user_text in setup["turn_texts"]:
        messages.append({"role": "user", "content": user_text})
        before, others = kvcellar_counters(client, server), OthersCpu(server.process.pid)
        probe = chat(client, server, messages, 1)
        others_cpus, counted = others.cpus(), _counted(before, kvcellar_counters(client, server))
        reply = chat(client, server, messages, setup["new_tokens"])
        messages.append({"role": "assistant", "content": reply["text"]})
        figures["turns"].append(
            {
                "ttft_s": probe["first_chunk_s"],
                "prompt_tokens": probe["prompt_tokens"],
                "cached_tokens": probe["cached_tokens"],
                "others_cpus": others_cpus,
                "ssd_writes_during_probe": counted.get("ssd_writes"),
                "reply_tokens": reply["completion_tokens"],
                "reply_total_s": reply["total_s"],
                "reply_head": reply["text"][:REPLY_HEAD_CHARS],
                "reply_sha1": hashlib.sha1(reply["text"].encode()).hexdigest()[:12],
            }
        )
    return figures


def run_session(name: str, session: int, setup: dict[str, Any], progress: Console) -> dict[str, Any]:
    """Start, warm up, measure, stop; with the CPU other processes used meanwhile."""
    progress.print(f"{LABELS[name]} session {session}: starting")
    others, started = OthersCpu(), time.perf_counter()
    server = ServerProcess(name, setup["model_dir"], setup["ssd_dir"], setup["workdir"] / f"{name}-{session}.log")
    try:
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            warmup = stream_request(
                client,
                f"{server.base}/v1/completions",
                {"prompt": setup["warmup_texts"][session - 1], "max_tokens": WARMUP_NEW_TOKENS},
            )
            steps = cold_and_decode if session == 1 else restart_and_conversation
            figures = steps(client, server, setup)
        others_cpus, session_s = others.cpus(server.process.pid), time.perf_counter() - started
        exit_status = server.stop()
    finally:
        server.kill()
    progress.print(f"  {session_s:.0f} s, exit status {exit_status}")
    return {
        **figures,
        "start_s": server.start_s,
        "warmup_total_s": warmup["total_s"],
        "exit_status": exit_status,
        "session_s": session_s,
        "others_cpus": others_cpus,
    }


def build_setup(model_dir: Path, workdir: Path, options: dict[str, Any]) -> dict[str, Any]:
    if not (model_dir / "tokenizer.json").is_file():
        raise click.ClickException(f"{model_dir} has no tokenizer.json to size the prompts with")
    tokenizer, seed = Tokenizer.from_file(str(model_dir / "tokenizer.json")), options["seed"]
    return {
        "model_dir": model_dir,
        "workdir": workdir,
        "ssd_dir": workdir / "ssd",
        **options,
        "context_text": text_of_tokens(tokenizer, options["context_tokens"], seed),
        # One per session: kvcellar's SSD tier would serve a repeated warm-up from cache, warming nothing.
        "warmup_texts": [text_of_tokens(tokenizer, WARMUP_PROMPT_TOKENS, seed + 1 + session) for session in (0, 1)],
        "turn_texts": [
            text_of_tokens(tokenizer, options["turn_tokens"], seed + 3 + turn) for turn in range(options["turns"])
        ],
    }


def decode_tok_s(runs: list[dict[str, Any]]) -> float | None:
    """None when the long request did not take longer than the short one (too few tokens to time)."""
    median = statistics.median
    decode_s = median(run["long_total_s"] for run in runs) - median(run["short_total_s"] for run in runs)
    tokens = median(run["completion_tokens"] for run in runs)
    return (tokens - 1) / decode_s if decode_s > 0 and tokens > 1 else None


def warm_ttft_s(runs: list[dict[str, Any]]) -> float:
    """Median TTFT of the 1-token requests on the cached prompt: a RAM hit on both servers."""
    return statistics.median(run["short_first_chunk_s"] for run in runs)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def _summed_ratio(turn_pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> float | None:
    return (
        _ratio(sum(a["ttft_s"] for a, _ in turn_pairs), sum(b["ttft_s"] for _, b in turn_pairs)) if turn_pairs else None
    )


def _leading_space_dropped(kvcellar_turn: dict[str, Any], mlx_lm_turn: dict[str, Any]) -> bool:
    """Whether mlx_lm.server's reply is kvcellar's without its first character, a space: mlx_lm's
    BPEStreamingDetokenizer drops the space that begins a generation's first token."""
    head = kvcellar_turn["reply_head"]
    return head.startswith(" ") and head[1:] == mlx_lm_turn["reply_head"][: len(head) - 1]


def server_figures(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """One server's figures from its two sessions."""
    turn_ttft_s = [turn["ttft_s"] for turn in second["turns"]]
    return {
        "cold_ttft_s": first["cold"]["first_chunk_s"],
        "prompt_tokens": first["cold"]["prompt_tokens"],
        "cold_cached_tokens": first["cold"]["cached_tokens"],
        "restart_ttft_s": second["restart"]["first_chunk_s"],
        "restart_cached_tokens": second["restart"]["cached_tokens"],
        "turn_ttft_s": turn_ttft_s,
        "turn_ttft_sum_s": sum(turn_ttft_s),
        "decode_tok_s": decode_tok_s(first["decode_runs"]),
        "short_request_s": statistics.median(run["short_total_s"] for run in first["decode_runs"]),
        "warm_ttft_s": warm_ttft_s(first["decode_runs"]),
        "decode_runs": first["decode_runs"],
        "turns": second["turns"],
        **{key: [first[key], second[key]] for key in ("start_s", "warmup_total_s", "exit_status", "others_cpus")},
    }


def summarise(sessions: dict[tuple[str, int], dict[str, Any]], setup: dict[str, Any]) -> dict[str, Any]:
    servers = {name: server_figures(sessions[(name, 1)], sessions[(name, 2)]) for name in (KVCELLAR, MLX_LM)}
    kv, mlx, kv_restarted = servers[KVCELLAR], servers[MLX_LM], sessions[(KVCELLAR, 2)]
    turn_pairs = list(zip(kv["turns"], mlx["turns"], strict=True))
    result: dict[str, Any] = {
        "restart_ttft_ratio": _ratio(kv["restart_ttft_s"], mlx["restart_ttft_s"]),
        "turn_ttft_ratio": _ratio(kv["turn_ttft_sum_s"], mlx["turn_ttft_sum_s"]),
        "decode_ratio": _ratio(kv["decode_tok_s"], mlx["decode_tok_s"]),
        "cold_ttft_ratio": _ratio(kv["cold_ttft_s"], mlx["cold_ttft_s"]),
        "warm_ttft_ratio": _ratio(kv["warm_ttft_s"], mlx["warm_ttft_s"]),
        "servers": servers,
        "flush": sessions[(KVCELLAR, 1)]["flush"],
        "restart_counters": kv_restarted["restart_counters"],
        "ssd_entries_at_restart": kv_restarted["ssd_entries_at_restart"],
        "kvcellar_exit_statuses_zero": kv["exit_status"] == [0, 0],
        "same_replies_turns": sum(a["reply_sha1"] == b["reply_sha1"] for a, b in turn_pairs),
        "same_cached_tokens_turns": sum(a["cached_tokens"] == b["cached_tokens"] for a, b in turn_pairs),
        "kvcellar_cached_more_turns": sum(a["cached_tokens"] > b["cached_tokens"] for a, b in turn_pairs),
        "turn_ttft_ratio_same_cached": _summed_ratio(
            [(a, b) for a, b in turn_pairs if a["cached_tokens"] == b["cached_tokens"]]
        ),
        "leading_space_dropped_turns": sum(_leading_space_dropped(a, b) for a, b in turn_pairs),
        "same_prompt_tokens_turns": sum(a["prompt_tokens"] == b["prompt_tokens"] for a, b in turn_pairs),
        "others_cpus_max": max(kv["others_cpus"] + mlx["others_cpus"]),
        "options": {key: setup[key] for key in OPTION_KEYS},
    }
    restart, turn, decode = result["restart_ttft_ratio"], result["turn_ttft_ratio"], result["decode_ratio"]
    result["targets_met"] = {
        "restart_ttft_ratio_le_0.02": restart is not None and restart <= TARGET_RESTART_RATIO,
        "turn_ttft_ratio_le_1.0": turn is not None and turn <= TARGET_TURN_RATIO,
        "decode_ratio_ge_0.95": decode is not None and decode >= TARGET_DECODE_RATIO,
        "warm_ttft_ratio_le_1.0": result["warm_ttft_ratio"] is not None
        and result["warm_ttft_ratio"] <= TARGET_WARM_TTFT_RATIO,
    }
    return result


def run_benchmark(model_dir: Path, options: dict[str, Any], workdir: Path, progress: Console) -> dict[str, Any]:
    setup = build_setup(model_dir, workdir, options)
    sessions = {(name, session): run_session(name, session, setup, progress) for name, session in SESSION_ORDER}
    return summarise(sessions, setup)


def _fmt(value: float | None, scale: float = 1.0, digits: int = 2, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value * scale:,.{digits}f}{suffix}"


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


FIGURE_COLUMNS = ("measurement", "kvcellar", "mlx_lm.server", "kvcellar / mlx_lm", "target")
TURN_COLUMNS = (
    "turn",
    "prompt tokens",
    "kvcellar TTFT ms (cached)",
    "mlx_lm.server TTFT ms (cached)",
    "ratio",
    "others' CPUs k / m",
)
LEFT_COLUMNS = ("measurement", "target")


def figure_rows(result: dict[str, Any]) -> list[tuple[str, ...]]:
    kv, mlx, met = result["servers"][KVCELLAR], result["servers"][MLX_LM], result["targets_met"]

    def compared(label: str, key: str, ratio_key: str, target: str = "", digits: int = 3) -> tuple[str, ...]:
        return (
            label,
            _fmt(kv[key], digits=digits),
            _fmt(mlx[key], digits=digits),
            _fmt(result[ratio_key], digits=4, suffix="x"),
            target,
        )

    def per_session(label: str, key: str, digits: int) -> tuple[str, ...]:
        return (
            label,
            *(" / ".join(_fmt(value, digits=digits) for value in server[key]) for server in (kv, mlx)),
            "",
            "",
        )

    return [
        compared(f"(a) cold TTFT, {kv['prompt_tokens']:,}-token prompt (s)", "cold_ttft_s", "cold_ttft_ratio"),
        compared(
            "(c) TTFT after a restart, same prompt (s)",
            "restart_ttft_s",
            "restart_ttft_ratio",
            f"<= {TARGET_RESTART_RATIO}x: {_verdict(met['restart_ttft_ratio_le_0.02'])}",
        ),
        (
            "(c) cached tokens after the restart",
            f"{kv['restart_cached_tokens']:,}",
            f"{mlx['restart_cached_tokens']:,}",
            "",
            "",
        ),
        compared(
            f"(b) sum of per-turn TTFT, {len(kv['turns'])} turns (s)",
            "turn_ttft_sum_s",
            "turn_ttft_ratio",
            f"<= {TARGET_TURN_RATIO}x: {_verdict(met['turn_ttft_ratio_le_1.0'])}",
        ),
        compared(
            f"(d) decode tokens/s at {kv['prompt_tokens']:,} tokens of context",
            "decode_tok_s",
            "decode_ratio",
            f">= {TARGET_DECODE_RATIO}x: {_verdict(met['decode_ratio_ge_0.95'])}",
            digits=1,
        ),
        per_session("start to healthy, session 1 / 2 (s)", "start_s", 1),
        per_session("warm-up request, session 1 / 2 (s)", "warmup_total_s", 2),
        per_session("others' CPUs, session 1 / 2", "others_cpus", 2),
        compared(
            f"(e) RAM-hit TTFT, the cached {kv['prompt_tokens']:,}-token prompt again (s, median)",
            "warm_ttft_s",
            "warm_ttft_ratio",
            f"<= {TARGET_WARM_TTFT_RATIO}x: {_verdict(met['warm_ttft_ratio_le_1.0'])}",
        ),
    ]


def turn_rows(result: dict[str, Any]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    turns = zip(result["servers"][KVCELLAR]["turns"], result["servers"][MLX_LM]["turns"], strict=True)
    for index, (kv, mlx) in enumerate(turns, start=1):
        prompt_tokens = f"{kv['prompt_tokens']:,}" + (
            "" if mlx["prompt_tokens"] == kv["prompt_tokens"] else f" / {mlx['prompt_tokens']:,}"
        )
        rows.append(
            (
                str(index),
                prompt_tokens,
                f"{kv['ttft_s'] * 1000:.1f} ({kv['cached_tokens']:,})",
                f"{mlx['ttft_s'] * 1000:.1f} ({mlx['cached_tokens']:,})",
                f"{kv['ttft_s'] / mlx['ttft_s']:.2f}x",
                f"{kv['others_cpus']:.2f} / {mlx['others_cpus']:.2f}",
            )
        )
    return rows


def summary_lines(result: dict[str, Any]) -> list[str]:
    kv, mlx, flush = result["servers"][KVCELLAR], result["servers"][MLX_LM], result["flush"]
    options, counters, turns = result["options"], result["restart_counters"], result["options"]["turns"]
    writes = [turn["ssd_writes_during_probe"] for turn in kv["turns"]]
    return [
        f"model: {result['model']}; chat endpoint, greedy; {turns} turns of ~{options['turn_tokens']}-token user "
        f"messages (identical on both servers) and {options['new_tokens']}-token replies (each server's own, sent "
        f"back as received); {options['decode_repeats']} decode pairs per server",
        f"kvcellar flush before its restart: HTTP {flush['status']}, durable {flush['durable']}, "
        f"{flush['s'] * 1000:.0f} ms; the request after the restart took {counters['cold_hits']} cold hit(s) and "
        f"{counters['ssd_restores']} SSD restore(s) from {result['ssd_entries_at_restart']} entries on disk; "
        f"exit statuses on SIGTERM: {kv['exit_status']} (mlx_lm.server, no handler: {mlx['exit_status']})",
        f"identical on both servers: replies in {result['same_replies_turns']} of {turns} turns, prompt token counts "
        f"in {result['same_prompt_tokens_turns']}, cached tokens in {result['same_cached_tokens_turns']}; turn-1 "
        f"replies begin {kv['turns'][0]['reply_head']!r} (kvcellar) and {mlx['turns'][0]['reply_head']!r} "
        f"(mlx_lm.server); SSD entries kvcellar wrote during a turn's TTFT request: {sum(writes)} (per turn {writes})",
        f"1-token request on the cached {kv['prompt_tokens']:,}-token prompt (median): kvcellar "
        f"{kv['short_request_s'] * 1000:.0f} ms, mlx_lm.server {mlx['short_request_s'] * 1000:.0f} ms",
    ]


def _turn_sentences(result: dict[str, Any]) -> str:
    kv, mlx = result["servers"][KVCELLAR], result["servers"][MLX_LM]
    ratios = [mine["ttft_s"] / theirs["ttft_s"] for mine, theirs in zip(kv["turns"], mlx["turns"], strict=True)]
    text = (
        f"Over the {len(ratios)}-turn chat the ratio of summed TTFT is "
        f"{_fmt(result['turn_ttft_ratio'], digits=3, suffix='x')} "
        f"({_verdict(result['targets_met']['turn_ttft_ratio_le_1.0'])} against <= {TARGET_TURN_RATIO}x), "
        f"per-turn ratios {min(ratios):.2f}x-{max(ratios):.2f}x. "
    )
    if not result["kvcellar_cached_more_turns"]:
        return text + (
            "Both servers reused prefixes of equal length every turn, so both prefilled the same new "
            "tokens; the spread is other processes' CPU use and each server's overhead around that prefill."
        )
    return text + (
        f"kvcellar reused more cached tokens in {result['kvcellar_cached_more_turns']} turns. In "
        f"{result['leading_space_dropped_turns']} turns mlx_lm.server's reply was kvcellar's without its leading "
        f"space, which mlx_lm's BPEStreamingDetokenizer drops from the first generated token, so the history sent "
        f"back next turn re-tokenises differently from what mlx_lm.server cached and it prefills that reply again. "
        f"On the turns where both reused equally many tokens ({result['same_cached_tokens_turns']}) the ratio of "
        f"sums is {_fmt(result['turn_ttft_ratio_same_cached'], digits=3, suffix='x')}."
    )


def interpretation(result: dict[str, Any]) -> str:
    """One paragraph built from the figures: which targets hold and why."""
    kv, mlx, met = result["servers"][KVCELLAR], result["servers"][MLX_LM], result["targets_met"]
    disturbed = result["others_cpus_max"] > OTHERS_CPUS_DISTURBING
    fastest_prefill_s = min(mlx["cold_ttft_s"], mlx["restart_ttft_s"])
    return (
        f"After a restart kvcellar {'meets' if met['restart_ttft_ratio_le_0.02'] else 'misses'} the "
        f"{TARGET_RESTART_RATIO}x target at {_fmt(result['restart_ttft_ratio'], digits=4, suffix='x')}: it served "
        f"{kv['restart_cached_tokens']:,} of {kv['prompt_tokens']:,} prompt tokens from the SSD tier and prefilled "
        f"the rest, while mlx_lm.server, whose prompt cache lives only in its process, recomputed the prompt "
        f"({mlx['restart_cached_tokens']:,} cached) at {kv['prompt_tokens'] / mlx['restart_ttft_s']:.0f} tokens/s; "
        f"against the faster of its two prefills of that prompt ({fastest_prefill_s:.1f} s) the ratio would be "
        f"{kv['restart_ttft_s'] / fastest_prefill_s:.4f}x. The ratio is restore time over prefill time, so it "
        f"depends on the machine's prefill speed as much as on the prefix length, and is not directly comparable "
        f"with the reference design's {REFERENCE_RESTART_RATIO} on a 13.7k-token prefix. "
        f"{_turn_sentences(result)} Decode runs at "
        f"{_fmt(result['decode_ratio'], digits=3, suffix='x')} of mlx_lm.server's rate "
        f"({_verdict(met['decode_ratio_ge_0.95'])} against >= {TARGET_DECODE_RATIO}x) on the same model and "
        f"context. Cold TTFT ({_fmt(result['cold_ttft_ratio'], digits=3, suffix='x')}) compares each server's "
        f"default prefill over the same tokens (kvcellar: 512-token chunks plus its prompt-boundary snapshot; "
        f"mlx_lm.server: 2048-token chunks), which the benchmark does not separate further; every session first ran "
        f"its own warm-up, so no figure carries MLX's first-call costs. "
        + (
            f"Other processes kept up to {result['others_cpus_max']:.2f} CPUs busy during a session (rows above), so "
            f"absolute times carry that noise; the sessions ran one at a time, so it can fall on either server."
            if disturbed
            else "The machine was otherwise idle during the run (others' CPUs above)."
        )
    )


def tables(result: dict[str, Any]) -> list[tuple[str, tuple[str, ...], list[tuple[str, ...]]]]:
    return [
        ("kvcellar against mlx_lm.server", FIGURE_COLUMNS, figure_rows(result)),
        ("(b) per turn", TURN_COLUMNS, turn_rows(result)),
    ]


def markdown_section(result: dict[str, Any], command: str, run_date: str) -> str:
    machine = result["machine"]
    lines = [
        "## kvcellar against mlx_lm.server: cold, restart, multi-turn TTFT and decode",
        "",
        f"Run {run_date} with `{command}` (wall time {result['wall_s']:.0f} s; one measurement per cell unless "
        f"stated; the servers ran one at a time).",
        "",
        f"Machine: {machine['cpus']} CPUs ({machine['cpu_model']}), {machine['memory_total']} RAM, "
        f"{machine['platform']}, Python {machine['python']}, MLX {machine['mlx']} (CPU), mlx-lm "
        f"{result['mlx_lm_version']}; SSD tier on {machine['filesystem']}.",
    ]
    for _, columns, rows in tables(result):
        alignment = "|".join("---" if column in LEFT_COLUMNS else "---:" for column in columns)
        lines += ["", f"| {' | '.join(columns)} |", f"|{alignment}|", *(f"| {' | '.join(row)} |" for row in rows)]
    return "\n".join([*lines, "", *(f"- {line}" for line in summary_lines(result)), "", interpretation(result)])


def print_tables(result: dict[str, Any], console: Console) -> None:
    for title, columns, rows in tables(result):
        table = Table(title=title)
        for column in columns:
            table.add_column(column, justify="left" if column in LEFT_COLUMNS else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    for line in summary_lines(result):
        console.print(line, highlight=False)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--context-tokens",
    type=click.IntRange(min=8),
    default=4096,
    show_default=True,
    help="Tokens of the user message in the cold and restart prompt (the chat template adds a few).",
)
@click.option(
    "--turns",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="Turns of the multi-turn chat; each adds the previous reply and a new user message.",
)
@click.option(
    "--turn-tokens",
    type=click.IntRange(min=8),
    default=200,
    show_default=True,
    help="Tokens of each new user message in the multi-turn chat.",
)
@click.option(
    "--new-tokens",
    type=click.IntRange(min=2),
    default=128,
    show_default=True,
    help="max_tokens of each reply and of the long request of a decode pair (greedy; fewer on EOS).",
)
@click.option(
    "--decode-repeats",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Decode pairs (a --new-tokens request, then a 1-token one) per server; figures are medians.",
)
@model_option(
    f"An mlx-lm model directory with tokenizer.json; default: a fresh offline demo {DEMO_ARCH} "
    f"{MODEL_SIZE} made in a temporary directory."
)
@scratch_dir_option("the SSD tier and server logs")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the prompts' pseudo-words.")
@publish_options(DOCS_BEGIN, DOCS_END)
def main(model_dir: Path | None, directory: Path | None, as_json: bool, write_docs: bool, **options: Any) -> None:
    """Compare kvcellar with mlx_lm.server: cold, restart and per-turn TTFT, and decode tokens/s."""
    started = time.perf_counter()
    console = Console() if sys.stdout.isatty() else Console(width=160)
    progress = Console(stderr=True)
    with scratch_with_model("compare_mlx_lm", directory, model_dir, progress, size=MODEL_SIZE) as scratch:
        result = run_benchmark(scratch.model_dir, options, scratch.workdir, progress)
    base, described = scratch.base, scratch.model_described
    result.update(
        model=described,
        machine=describe_machine(base),
        mlx_lm_version=mlx_lm.__version__,
        wall_s=time.perf_counter() - started,
    )
    print_tables(result, console)
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
