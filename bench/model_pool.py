"""The model pool (issue 41) through a real `kvcellar serve --models`: swaps and alternation.

1. Swap: a budget that holds one model. The TTFT (a `max_tokens=1` request's time) of a request that
   needs the unloaded demo-coder model: cold (never seen: load + full prefill) against drained and
   restored (after a swap to the tiny llama and back: load + the prefix restored from the SSD tier).
   `swap_restore_ttft_ratio` = restored / cold (below 1: the drain paid off).
2. Alternation: a budget that holds both. Requests per second with demo-coder and the tiny llama
   alternating against demo-coder alone, the same requests (fresh prompts, 16 tokens each).
   `alternating_throughput_ratio` = alternating / one model.

    python -m kvcellar.bench.model_pool [--prompt-words 300] [--requests 8] [--json] [--write-docs]
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import httpx
from rich.console import Console

from kvcellar.bench.common import (
    Figures,
    describe_machine,
    docs_section,
    machine_sentence,
    publish_figures,
    wait_until_healthy,
)
from kvcellar.engine.demo_models import create_model, packaged_demo_coder_dir

NAME = "model_pool"
ONE_MODEL_GB = 0.0108  # demo-coder's 10.5 MB of safetensors, not both models
WORDS = [
    "def",
    "add(a,",
    "b):",
    "return",
    "a",
    "+",
    "b",
    "#",
    "adds",
    "two",
    "numbers",
    "and",
    "explains",
    "it",
    "at",
    "length",
    "please",
]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Pool:
    def __init__(self, workdir: Path, small_dir: Path, budget_gb: float) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        models = workdir / "models.toml"
        models.write_text(
            f'[models.coder]\npath = "{packaged_demo_coder_dir()}"\n[models.small]\npath = "{small_dir}"\n'
        )
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvcellar.cli", "serve", "--models", str(models), "--port", str(self.port)]
            + ["--ssd-cache", str(workdir / f"ssd-{self.port}"), "--models-memory-gb", str(budget_gb)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        wait_until_healthy(self.process, self.base, timeout_s=120, name="the pool server")

    def request_s(self, model: str, prompt: str, max_tokens: int) -> tuple[float, dict[str, Any]]:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        started = time.perf_counter()
        reply = httpx.post(f"{self.base}/v1/completions", json=body, timeout=600)
        reply.raise_for_status()
        return time.perf_counter() - started, reply.json()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=120)


def _prompt(words: int, seed: int) -> str:
    return f"# conversation {seed}\n" + " ".join(WORDS[(i + seed) % len(WORDS)] for i in range(words))


def measure_swap(workdir: Path, small_dir: Path, words: int) -> dict[str, float]:
    pool = Pool(workdir, small_dir, ONE_MODEL_GB)
    try:
        prompt = _prompt(words, 0)
        cold_s, _ = pool.request_s("coder", prompt, 1)
        pool.request_s("small", "hello", 1)  # coder drained and unloaded
        restored_s, reply = pool.request_s("coder", prompt, 1)
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"] / reply["usage"]["prompt_tokens"]
    finally:
        pool.stop()
    return {"cold_ttft_s": cold_s, "restored_ttft_s": restored_s, "restored_cached_share": cached}


def measure_alternation(workdir: Path, small_dir: Path, words: int, requests: int) -> dict[str, float]:
    pool = Pool(workdir, small_dir, 0)
    try:
        pool.request_s("coder", "warm", 1)
        pool.request_s("small", "warm", 1)
        started = time.perf_counter()
        for i in range(requests):
            pool.request_s("coder", _prompt(words, 100 + i), 16)
        one_rps = requests / (time.perf_counter() - started)
        started = time.perf_counter()
        for i in range(requests):
            pool.request_s("coder" if i % 2 == 0 else "small", _prompt(words, 200 + i), 16)
        alternating_rps = requests / (time.perf_counter() - started)
    finally:
        pool.stop()
    return {"one_model_rps": one_rps, "alternating_rps": alternating_rps}


@click.command()
@click.option("--prompt-words", default=300, show_default=True, type=click.IntRange(min=10))
@click.option("--requests", default=8, show_default=True, type=click.IntRange(min=2))
@click.option("--json", "as_json", is_flag=True, help="Print the figures as one JSON object as the last line.")
@click.option("--write-docs", is_flag=True, help="Rewrite this benchmark's section of docs/benchmarks.md.")
def main(prompt_words: int, requests: int, as_json: bool, write_docs: bool) -> None:
    console = Console(stderr=as_json)
    with tempfile.TemporaryDirectory(prefix="kvcellar-pool-bench-") as scratch:
        workdir = Path(scratch)
        small_dir = create_model("llama", workdir / "llama-tiny", size="tiny", dtype="float32")
        swap = measure_swap(workdir, small_dir, prompt_words)
        alternation = measure_alternation(workdir, small_dir, prompt_words, requests)
        machine = describe_machine(workdir)
    result = {
        **swap,
        **alternation,
        "swap_restore_ttft_ratio": swap["restored_ttft_s"] / swap["cold_ttft_s"],
        "alternating_throughput_ratio": alternation["alternating_rps"] / alternation["one_model_rps"],
    }
    figures = Figures(
        title="Model pool: swap and alternation (demo-coder and a tiny llama)",
        columns=("measurement", "value"),
        rows=[
            ("TTFT, model unloaded, prompt cold (s)", f"{swap['cold_ttft_s']:.3f}"),
            ("TTFT, model drained, unloaded and restored (s)", f"{swap['restored_ttft_s']:.3f}"),
            ("cached share after the restore", f"{swap['restored_cached_share']:.3f}"),
            ("swap_restore_ttft_ratio", f"{result['swap_restore_ttft_ratio']:.3f}"),
            ("requests/s, demo-coder alone", f"{alternation['one_model_rps']:.2f}"),
            ("requests/s, demo-coder and the tiny llama alternating", f"{alternation['alternating_rps']:.2f}"),
            ("alternating_throughput_ratio", f"{result['alternating_throughput_ratio']:.3f}"),
        ],
    )

    def section(command: str, run_date: str) -> str:
        return docs_section(
            "Model pool (issue 41)",
            [
                f"`{command}`, {run_date}. "
                + machine_sentence(machine, ", the CPU back end (mlx[cpu]), one `kvcellar serve --models` each run."),
                f"Prompts of {prompt_words} words; TTFT is a `max_tokens=1` completion's time, load included. A "
                "reload reads the model's restore costs from the cost memo (it keeps several models' costs) "
                "instead of calibrating afresh. Each model runs its batch lane (serve's default `--batch`). The "
                "alternation's tiny llama is far cheaper than demo-coder, so the ratio above 1 says the "
                "switches cost little, not that two models are faster.",
            ],
            figures,
        )

    publish_figures(
        NAME, result, figures, section, write_docs=write_docs, as_json=as_json, console=console, progress=console
    )


if __name__ == "__main__":
    main()
