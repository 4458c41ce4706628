"""Benchmark: start-to-healthy of `kvcellar serve --ssd-cache`, first start
(cold shard digest memo) against second start (warm memo), then two starts on
a tier of `--tier-entries` entries (`serve` opens the tier beside the model
load, so the tier should add little beyond what its opening takes past it).

The SSD tier's directory is named by the serving fingerprint, which hashes
every weight and tokenizer byte; the memo, under `$KVCELLAR_CACHE_DIR`
(here a fresh directory per run), keeps those digests across starts, so the
second start of unchanged weights reads no byte for hashing. Each start is a
real `kvcellar serve` subprocess on 127.0.0.1, timed from just before it is
spawned until `/health` answers 200, then stopped with SIGTERM. Each server
logs its fingerprint time and the bytes it hashed; both are reported.

The model is a random-weight llama of at least `--model-mb` MB (float32,
built offline with the demo tokenizer) unless `--model` names one. The OS
page cache is warm for both starts (the model is read once before the first),
so what the ratio shows is the hashing time saved, not disk reads saved.
Run `python -m kvcellar.bench.startup --help` for the options.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click
import numpy as np
from rich.console import Console

from kvcellar.bench.common import (
    describe_machine,
    docs_markers,
    model_option,
    print_figures,
    publish,
    publish_options,
    scratch_dir_option,
    scratch_with_model,
    wait_until_healthy,
)
from kvcellar.cli.serve import SHARD_DIGEST_MEMO_DIR_NAME
from kvcellar.engine.demo_models import (
    CACHE_DIR_ENV_VAR,
    DEMO_ARCH,
    VOCAB_SIZE,
    WEIGHTS_FILE_NAME,
    build_weights,
    model_config,
    model_size_bytes,
    write_safetensors,
)

MB_BYTES = 10**6
FLOAT32_BYTES = 4
# Models at or above this get 2048-wide layers (about 177 MB each in float32); smaller ones 128-wide.
WIDE_LAYERS_FROM_BYTES = 64 * MB_BYTES
HEALTH_POLL_S = 0.02
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 120.0
LOG_TAIL_CHARS = 4000
FINGERPRINT_LOG = re.compile(
    r"serving fingerprint (?P<digest>[0-9a-f]+) in (?P<seconds>[0-9.]+) s: "
    r"(?P<hashed>\d+) bytes hashed"
)
TIER_LOG = re.compile(r"SSD tier opened in (?P<seconds>[0-9.]+) s: (?P<entries>\d+) entries")
# The tier of the third and fourth starts: entries of this many tokens, as bench/ssd_index builds them.
TIER_ENTRY_TOKENS = 4000
FIGURE_COLUMNS = ("start", "start-to-healthy s", "fingerprint s", "bytes hashed", "tier opened s", "note")
DOCS_BEGIN, DOCS_END = docs_markers("startup")


def llama_config_of_at_least(target_bytes: int) -> dict[str, Any]:
    """A llama config whose float32 weights take at least `target_bytes`
    (whole layers added until they do), with the demo tokenizer's vocabulary."""
    hidden, intermediate, heads, kv_heads = (
        (2048, 5504, 16, 4) if target_bytes >= WIDE_LAYERS_FROM_BYTES else (128, 344, 4, 2)
    )
    head_dim = hidden // heads
    layer_params = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate + 2 * hidden
    shared_params = VOCAB_SIZE * hidden + hidden  # tied embedding and the final norm
    layers = max(1, math.ceil((target_bytes / FLOAT32_BYTES - shared_params) / layer_params))
    config = model_config(DEMO_ARCH)
    config.update(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_hidden_layers=layers,
    )
    return config


def enlarge_model(model_dir: Path, target_bytes: int) -> None:
    """Replace the demo model's config and weights in `model_dir` by a llama of
    at least `target_bytes`; its tokenizer files stay."""
    config = llama_config_of_at_least(target_bytes)
    weights = build_weights(config, dtype="float32", seed=0)
    write_safetensors(model_dir / WEIGHTS_FILE_NAME, weights)
    del weights
    (model_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def read_through(model_dir: Path) -> None:
    """Read every model file once, so both starts find it in the page cache."""
    for path in sorted(model_dir.iterdir()):
        if path.is_file():
            with path.open("rb") as file:
                while file.read(8 * MB_BYTES):
                    pass


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def time_one_start(model_dir: Path, ssd_dir: Path, cache_dir: Path, log_path: Path) -> dict[str, Any]:
    """Spawn `kvcellar serve`, time it to a 200 from `/health`, stop it; the
    server's own fingerprint time and hashed bytes come from its log."""
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "kvcellar.cli",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--ssd-cache",
        str(ssd_dir),
        "--prompt-cache",
        "0.1",
        "--log-level",
        "info",
    ]
    environment = {**os.environ, CACHE_DIR_ENV_VAR: str(cache_dir), "HF_HUB_OFFLINE": "1"}
    with log_path.open("w") as log:
        started = time.perf_counter()
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=environment
        )
        try:
            wait_until_healthy(
                process,
                f"http://127.0.0.1:{port}",
                timeout_s=START_TIMEOUT_S,
                output=lambda: log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:],
                poll_s=HEALTH_POLL_S,
            )
            start_s = time.perf_counter() - started
            process.send_signal(signal.SIGTERM)
            exit_status = process.wait(timeout=STOP_TIMEOUT_S)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    log_text = log_path.read_text(errors="replace")
    logged, tier = FINGERPRINT_LOG.search(log_text), TIER_LOG.search(log_text)
    if logged is None or tier is None:
        raise click.ClickException(f"kvcellar serve logged no fingerprint or SSD tier line; see {log_path}")
    return {
        "start_s": start_s,
        "fingerprint_s": float(logged["seconds"]),
        "bytes_hashed": int(logged["hashed"]),
        "digest": logged["digest"],
        "tier_open_s": float(tier["seconds"]),
        "tier_entries": int(tier["entries"]),
        "exit_status": exit_status,
    }


def build_tier(ssd_dir: Path, digest: str, entries: int, progress: Console) -> None:
    """`entries` entries of `TIER_ENTRY_TOKENS` tokens in the tier of fingerprint `digest`, shaped
    as conversations branching at turns (bench/ssd_index's tree, tiny caches: the scan reads
    no payload)."""
    from kvcellar.bench.ssd_index import build_tree, conversation_tree

    progress.print(f"building an SSD tier of {entries:,} entries")
    build_tree(ssd_dir, conversation_tree(entries, TIER_ENTRY_TOKENS, np.random.default_rng(0)), progress, digest)


def run_benchmark(model_dir: Path, workdir: Path, runs: int, tier_entries: int, progress: Console) -> dict[str, Any]:
    """`runs` rounds, each on a fresh memo and SSD directory: a first and a second start on an
    empty tier, then (with `tier_entries`) a tier of that many entries built and two more starts,
    the first of which reconciles the journal against the new files."""
    read_through(model_dir)
    load_before = os.getloadavg()[0]
    pairs = []
    for run in range(runs):
        cache_dir, ssd_dir = workdir / f"cache-{run}", workdir / f"ssd-{run}"
        pair: dict[str, Any] = {}
        for start in ("first", "second", "tier_reconciled", "tier") if tier_entries else ("first", "second"):
            if start == "tier_reconciled":
                build_tier(ssd_dir, pair["second"]["digest"], tier_entries, progress)
            progress.print(f"run {run + 1}/{runs}: {start} start")
            pair[start] = time_one_start(model_dir, ssd_dir, cache_dir, workdir / f"serve-{run}-{start}.log")
        memo_dir = cache_dir / SHARD_DIGEST_MEMO_DIR_NAME
        pair["memo_file_bytes"] = sum(path.stat().st_size for path in memo_dir.iterdir())
        pairs.append(pair)
        shutil.rmtree(ssd_dir, ignore_errors=True)
    first, second = start_figures(pairs, "first"), start_figures(pairs, "second")
    return {
        **(_tier_figures(pairs, second["start_s"]) if tier_entries else {}),
        "model_bytes": model_size_bytes(model_dir),
        "first_start_s": first["start_s"],
        "second_start_s": second["start_s"],
        "ratio": first["start_s"] / second["start_s"],
        "first_fingerprint_s": first["fingerprint_s"],
        "second_fingerprint_s": second["fingerprint_s"],
        "first_bytes_hashed": first["bytes_hashed"],
        "second_bytes_hashed": second["bytes_hashed"],
        "same_digest": all(pair["first"]["digest"] == pair["second"]["digest"] for pair in pairs),
        "load_average_1m": [load_before, os.getloadavg()[0]],
        "runs": pairs,
    }


def start_figures(pairs: list[dict[str, Any]], start: str) -> dict[str, Any]:
    """One start's figures over the runs: the medians, and the most bytes hashed."""
    runs = [pair[start] for pair in pairs]
    return {
        "start_s": statistics.median(run["start_s"] for run in runs),
        "fingerprint_s": statistics.median(run["fingerprint_s"] for run in runs),
        "bytes_hashed": max(run["bytes_hashed"] for run in runs),
        "tier_open_s": statistics.median(run["tier_open_s"] for run in runs),
    }


def _tier_figures(pairs: list[dict[str, Any]], second_s: float) -> dict[str, Any]:
    """The two starts on the built tier against the second start (warm memo, empty tier)."""
    figures: dict[str, Any] = {"tier_entries": pairs[0]["tier"]["tier_entries"]}
    for start in ("tier_reconciled", "tier"):
        medians = start_figures(pairs, start)
        figures[f"{start}_start_s"] = medians["start_s"]
        figures[f"{start}_open_s"] = medians["tier_open_s"]
        figures[f"{start}_added_s"] = medians["start_s"] - second_s
    return figures


def _row(result: dict[str, Any], start: str, label: str, note: str) -> tuple[str, ...]:
    """One start's figures, medians over the runs."""
    figures = start_figures(result["runs"], start)
    return (
        label,
        f"{figures['start_s']:.2f}",
        f"{figures['fingerprint_s']:.2f}",
        f"{figures['bytes_hashed']:,}",
        f"{figures['tier_open_s']:.2f}",
        note,
    )


def figure_rows(result: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = [
        _row(result, "first", "first (cold memo)", "every weight and tokenizer byte hashed"),
        _row(result, "second", "second (warm memo)", "digests read from the memo"),
    ]
    if "tier_entries" in result:
        rows += [
            _row(
                result,
                "tier_reconciled",
                f"third ({result['tier_entries']:,} entries built since)",
                "the journal reconciled with every header",
            ),
            _row(result, "tier", "fourth (the same tier)", "the tier indexed from the journal"),
        ]
    return rows


def summary_lines(result: dict[str, Any]) -> list[str]:
    saved_s = result["first_start_s"] - result["second_start_s"]
    return [
        f"model: {result['model']}, {result['model_bytes'] / 1e9:.2f} GB of files",
        f"first / second start-to-healthy: {result['ratio']:.2f}x ({saved_s:.2f} s saved; the fingerprint itself "
        f"took {result['first_fingerprint_s']:.2f} s cold and {result['second_fingerprint_s']:.3f} s warm)",
        f"same fingerprint digest on both starts: {'yes' if result['same_digest'] else 'NO'}",
        *_tier_lines(result),
        "1-minute load average before and after the starts: "
        + " and ".join(f"{load:.1f}" for load in result["load_average_1m"])
        + f" on {result['machine']['cpus']} CPUs",
    ]


def _tier_lines(result: dict[str, Any]) -> list[str]:
    if "tier_entries" not in result:
        return []
    return [
        f"a tier of {result['tier_entries']:,} entries added {result[f'{start}_added_s']:+.2f} s to start-to-healthy "
        f"against the second start, while opening it took {result[f'{start}_open_s']:.2f} s beside the model load "
        f"({label})"
        for start, label in (("tier_reconciled", "third start"), ("tier", "fourth start"))
    ]


def markdown_section(result: dict[str, Any], command: str, run_date: str) -> str:
    machine = result["machine"]
    runs = len(result["runs"])
    lines = [
        "## Start-to-healthy: the shard digest memo and a full SSD tier",
        "",
        f"Run {run_date} with `{command}` ({runs} pair{'s' if runs != 1 else ''} of starts"
        f"{', medians' if runs > 1 else ''}; wall time {result['wall_s']:.0f} s).",
        "",
        f"Machine: {machine['cpus']} CPUs ({machine['cpu_model']}), {machine['memory_total']} RAM, "
        f"{machine['platform']}, Python {machine['python']}, MLX {machine['mlx']} (CPU); model and memo on "
        f"{machine['filesystem']}.",
        "",
        f"| {' | '.join(FIGURE_COLUMNS)} |",
        "|---|" + "---:|" * (len(FIGURE_COLUMNS) - 2) + "---|",
        *(f"| {' | '.join(row)} |" for row in figure_rows(result)),
        "",
        *(f"- {line}" for line in summary_lines(result)),
        "",
        "Start-to-healthy runs from spawning `kvcellar serve --ssd-cache DIR` until `/health` answers 200: "
        "interpreter and import time, loading the weights, the serving fingerprint (which names the SSD tier's "
        "directory), opening the tier and binding the port. The first start of each pair has an empty memo under "
        "`$KVCELLAR_CACHE_DIR` and hashes every byte; the second reads the digests back and hashes none. The OS "
        "page cache was warm for both starts (the model was read once beforehand, and dropping the cache needs "
        "root), so the difference is hashing time saved; a cold page cache would add the read time of the weights "
        "to the first start's hashing, though the model load would read them either way. The warm start's saving "
        "is the fingerprint's cold time, and whatever the saving shows above or below that is noise from other "
        "work on the CPUs (see the load average). The third and fourth starts (when a tier is built) open a "
        "tier of that many entries: `serve` opens the tier on worker threads while the engine thread loads the "
        "weights, so a tier adds to start-to-healthy only what its opening takes beyond the model load (and "
        "what the two take from each other on the CPUs); `tier opened s` is the server's own log line.",
    ]
    return "\n".join(lines)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--model-mb",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="Least size in MB (10^6 bytes) of the random-weight float32 llama built for the run.",
)
@model_option("An mlx-lm model directory to start instead of the built one.")
@click.option(
    "--runs",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Pairs of starts (first on an empty memo, second on the memo it left); figures are medians.",
)
@click.option(
    "--tier-entries",
    type=click.IntRange(min=0),
    default=10_000,
    show_default=True,
    help="Entries of the SSD tier built for the third and fourth starts (0: no tier, two starts).",
)
@scratch_dir_option("the model, memo and SSD tier")
@publish_options(DOCS_BEGIN, DOCS_END)
def main(
    model_mb: int,
    model_dir: Path | None,
    runs: int,
    tier_entries: int,
    directory: Path | None,
    as_json: bool,
    write_docs: bool,
) -> None:
    """Time `kvcellar serve` to healthy, with a cold and then a warm shard digest memo, then on a
    tier of `--tier-entries` entries."""
    started = time.perf_counter()
    console = Console() if sys.stdout.isatty() else Console(width=140)
    progress = Console(stderr=True)
    with scratch_with_model("startup", directory, model_dir, progress, size="tiny") as scratch:
        described = scratch.model_described
        if model_dir is None:
            progress.print(f"building a random-weight float32 {DEMO_ARCH} of at least {model_mb} MB")
            enlarge_model(scratch.model_dir, model_mb * MB_BYTES)
            layers = json.loads((scratch.model_dir / "config.json").read_text())["num_hidden_layers"]
            described = f"random-weight {DEMO_ARCH}, {layers} layers, float32, demo tokenizer"
        result = run_benchmark(scratch.model_dir, scratch.workdir, runs, tier_entries, progress)
    result.update(model=described, machine=describe_machine(scratch.base), wall_s=time.perf_counter() - started)
    print_figures(
        "Start-to-healthy of kvcellar serve --ssd-cache",
        FIGURE_COLUMNS,
        figure_rows(result),
        summary_lines(result),
        console,
        text_columns=("start", "note"),
    )
    publish(
        "startup",
        result,
        lambda command, run_date: markdown_section(result, command, run_date),
        write_docs=write_docs,
        as_json=as_json,
        console=console,
        progress=progress,
    )


if __name__ == "__main__":
    main()
