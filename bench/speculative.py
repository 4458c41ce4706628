"""Speculative decoding with companion state (issue 42): decode tok/s with and
without a draft in the same run, and the TTFT of a restored conversation after
a restart with and without the draft's KV in the SSD entry.

- self-draft: the target drafts for itself (acceptance 1.0, the mechanism's
  ceiling: every round emits k + 1 tokens for one target forward of k + 1);
- small draft: a tiny random model of the same tokenizer for a larger one
  (random weights agree rarely: the acceptance shown is the floor);
- restart: a system with the draft stores an 8k-token conversation, restarts,
  and serves its next turn (companion restored), against the same turn from
  an SSD tier written without the draft (the draft re-prefills all 8k tokens).

Keys of `--json`: `self_draft_speedup`, `small_draft_speedup`, `acceptance`,
`small_draft_acceptance`, `restored_with_companion_ttft_ratio` (TTFT with the
companion restored over TTFT with the draft re-prefilled: below 1 is the gain).
CPU figures with random tiny models do not predict Apple-silicon gains.
"""

from __future__ import annotations

import tempfile
import threading
import time
from contextlib import aclosing
from pathlib import Path
from typing import Any

import click
import trio
from mlx_lm import load
from rich.console import Console

from kvcellar.actors.system import SystemConfig, open_system
from kvcellar.bench.common import describe_machine, machine_sentence, publish
from kvcellar.engine.demo_models import create_model
from kvcellar.engine.engine import LoadedModel, SamplingParams
from kvcellar.engine.generation import GenerationDone, GenerationRequest, TokenDelta, run_generation
from kvcellar.engine.speculative import Drafter
from kvcellar.store.fingerprint import compute_fingerprint

NAME = "speculative"
DECODE_TOKENS = 128
RESTORED_TOKENS = 8192


def _loaded(model_dir: Path) -> LoadedModel:
    model, tokenizer = load(str(model_dir))[:2]
    return LoadedModel(model=model, tokenizer=tokenizer, model_dir=model_dir, context_tokens_max=16384)


def _drafter(loaded: LoadedModel, num_draft_tokens: int) -> Drafter:
    digest = compute_fingerprint(loaded.model_dir).digest
    return Drafter(model=loaded.model, model_dir=loaded.model_dir, num_draft_tokens=num_draft_tokens, digest=digest)


def _decode_tok_s(target: LoadedModel, drafter: Drafter | None, decode_tokens: int) -> tuple[float, list[int]]:
    """Decode tokens per second after a short prompt (the prefill excluded), and the tokens."""
    request = GenerationRequest(prompt_ids=tuple(range(5, 37)), params=SamplingParams(max_tokens=decode_tokens))
    tokens: list[int] = []
    first_s = None
    for item in run_generation(target, None, request, threading.Event(), drafter=drafter):
        if isinstance(item, TokenDelta) and item.token_id >= 0:
            tokens.append(item.token_id)
            if first_s is None:
                first_s = time.perf_counter()
    assert first_s is not None
    return (len(tokens) - 1) / (time.perf_counter() - first_s), tokens


def _speedup(target: LoadedModel, drafter: Drafter, decode_tokens: int) -> dict[str, Any]:
    _decode_tok_s(target, None, 8)  # warm the kernels
    plain_tok_s, plain = _decode_tok_s(target, None, decode_tokens)
    drafted_tok_s, drafted = _decode_tok_s(target, drafter, decode_tokens)
    stats = drafter.stats.snapshot()
    return {
        "plain_tok_s": plain_tok_s,
        "draft_tok_s": drafted_tok_s,
        "speedup": drafted_tok_s / plain_tok_s,
        "acceptance": stats["acceptance_rate"],
        "draft_time_share": stats["draft_time_share"],
        "identical": drafted == plain,
    }


async def _ttft(system: Any, request: GenerationRequest) -> tuple[float, GenerationDone]:
    started_s, first_s, done = time.perf_counter(), None, None
    async with aclosing(system.generate(request)) as items:
        async for item in items:
            if first_s is None:
                first_s = time.perf_counter()
            if isinstance(item, GenerationDone):
                done = item
    assert first_s is not None and done is not None
    return first_s - started_s, done


def _restart_ttft(target_dir: Path, draft_dir: Path, scratch: Path, tokens: int) -> dict[str, Any]:
    """TTFT of a conversation's next turn after a restart: its entry written with the draft's KV, and without."""
    conversation = tuple(5 + (i * 7919) % 1000 for i in range(tokens))
    first = GenerationRequest(prompt_ids=conversation, params=SamplingParams(max_tokens=4))
    follow_up = GenerationRequest(prompt_ids=conversation + (11, 12, 13), params=SamplingParams(max_tokens=4))

    def config(ssd: str, draft: Path | None) -> SystemConfig:
        return SystemConfig(model_dir=target_dir, ssd_dir=scratch / ssd, draft_model_dir=draft, demote_idle_s=0)

    async def main() -> dict[str, Any]:
        for ssd, writer_draft in (("with", draft_dir), ("without", None)):
            async with open_system(config(ssd, writer_draft)) as system:
                await _ttft(system, first)
                await system.flush()
        figures: dict[str, Any] = {}
        for ssd in ("with", "without"):
            async with open_system(config(ssd, draft_dir)) as system:
                ttft_s, done = await _ttft(system, follow_up)
                figures[f"ttft_{ssd}_companion_s"] = ttft_s
                figures[f"tier_{ssd}"] = done.cache_tier
                figures[f"speculative_{ssd}"] = system.stats()["speculative"]
        return figures

    figures = trio.run(main)
    figures["restored_with_companion_ttft_ratio"] = (
        figures["ttft_with_companion_s"] / figures["ttft_without_companion_s"]
    )
    return figures


def _section(result: dict[str, Any], machine: dict[str, str]) -> Any:
    def section(command: str, run_date: str) -> str:
        self_draft, small = result["self_draft"], result["small_draft"]
        restart = result["restart"]
        lines = [
            "## Speculative decoding with companion state (issue 42)",
            "",
            f"`{command}`, {run_date}. " + machine_sentence(machine, "."),
            "",
            "| measurement | without draft | with draft | ratio | acceptance | draft time share | identical |",
            "|---|---:|---:|---:|---:|---:|:---:|",
        ]
        for label, run in (
            (f"self-draft, {result['target']} ({DECODE_TOKENS} tokens)", self_draft),
            (f"{result['draft']} drafting for {result['target']}", small),
        ):
            lines.append(
                f"| {label} | {run['plain_tok_s']:.1f} tok/s | {run['draft_tok_s']:.1f} tok/s | "
                f"{run['speedup']:.2f}x | {run['acceptance']:.2f} | {run['draft_time_share']:.2f} | "
                f"{'yes' if run['identical'] else 'no'} |"
            )
        lines += [
            "",
            f"After a restart, the next turn of a {result['restored_tokens']}-token conversation restored from the "
            f"SSD tier: TTFT {restart['ttft_with_companion_s'] * 1000:.0f} ms with the draft's KV in the entry, "
            f"{restart['ttft_without_companion_s'] * 1000:.0f} ms when the entry has none and the draft re-prefills "
            f"(ratio {restart['restored_with_companion_ttft_ratio']:.2f}).",
            "",
            "These are CPU figures with random-weight tiny models: they do not predict gains on Apple silicon, "
            "where the draft's and the target's forward costs scale differently. A self-draft shows the ceiling "
            "of the mechanism (every proposal accepted) minus the draft's own cost, which is the target's here; "
            "a random small draft agrees with a random target almost never, so its acceptance is a floor, not a "
            "forecast of a trained draft's.",
        ]
        return "\n".join(lines)

    return section


@click.command()
@click.option("--target-size", default="small", show_default=True, help="Size of the random llama target.")
@click.option("--num-draft-tokens", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--decode-tokens", default=DECODE_TOKENS, show_default=True, type=click.IntRange(min=8))
@click.option("--restored-tokens", default=RESTORED_TOKENS, show_default=True, type=click.IntRange(min=64))
@click.option("--json", "as_json", is_flag=True, help="Print the figures as one JSON object on the last line.")
@click.option("--write-docs", is_flag=True, help="Rewrite this benchmark's section of docs/benchmarks.md.")
def main(
    target_size: str, num_draft_tokens: int, decode_tokens: int, restored_tokens: int, as_json: bool, write_docs: bool
) -> None:
    console, progress = Console(), Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="kvcellar-bench-spec-") as scratch_name:
        scratch = Path(scratch_name)
        target_dir = create_model("llama", scratch / "target", size=target_size)
        draft_dir = create_model("llama", scratch / "draft", size="tiny", seed=1)
        target, draft = _loaded(target_dir), _loaded(draft_dir)
        progress.print("self-draft…")
        self_draft = _speedup(target, _drafter(target, num_draft_tokens), decode_tokens)
        progress.print("small draft…")
        small_draft = _speedup(target, _drafter(draft, num_draft_tokens), decode_tokens)
        progress.print(f"restart with a {restored_tokens}-token conversation…")
        restart = _restart_ttft(target_dir, draft_dir, scratch, restored_tokens)
        machine = describe_machine(scratch)
    result = {
        "target": f"llama {target_size}",
        "draft": "llama tiny",
        "restored_tokens": restored_tokens,
        "self_draft": self_draft,
        "small_draft": small_draft,
        "restart": restart,
        "self_draft_speedup": self_draft["speedup"],
        "small_draft_speedup": small_draft["speedup"],
        "acceptance": self_draft["acceptance"],
        "small_draft_acceptance": small_draft["acceptance"],
        "restored_with_companion_ttft_ratio": restart["restored_with_companion_ttft_ratio"],
    }
    console.print(
        f"self-draft {self_draft['speedup']:.2f}x (acceptance {self_draft['acceptance']:.2f}), "
        f"small draft {small_draft['speedup']:.2f}x (acceptance {small_draft['acceptance']:.2f}), "
        f"restored TTFT ratio {restart['restored_with_companion_ttft_ratio']:.2f}"
    )
    publish(
        NAME,
        result,
        _section(result, machine),
        write_docs=write_docs,
        as_json=as_json,
        console=console,
        progress=progress,
    )


if __name__ == "__main__":
    main()
