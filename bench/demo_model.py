"""Figures of the committed demo-coder model, through the real server.

* held-out loss and perplexity: from the model's `training-log.json`, which
  `kvcellar model train` measured on the stored bfloat16 weights over fixed
  held-out windows (held-out standard-library modules and chats);
* `printable_share`: of 20 fixed held-out chat prompts, the share whose greedy
  reply is >= 90 % printable-ASCII words (target >= 0.9);
* `tool_call_share`: of 20 held-out synthetic tool prompts, the share whose
  greedy reply, through `kvcellar serve --tool-call-grammar off` (the model's
  own output) and mlx-lm's tool parser, holds a tool call naming only tools
  that were offered (target >= 0.8); `right_tool_share`, the share that call
  exactly the tool the request asks for; both again through serve's defaults,
  whose tool-call grammar holds a started call to the offered tools' schemas
  (`..._with_grammar`);
* decode tokens/s of demo-coder against the random-weight `small` llama (same
  shape, float32) in the same run, in-process with mlx-lm.

`--model DIR` measures another model directory of the same kind (one
`kvcellar model train` wrote) the same way, without replacing the committed
one; `--write-docs` is for the committed model only.

Usage: python -m kvcellar.bench.demo_model [--model DIR] [--json] [--write-docs]
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import httpx
import numpy as np
from rich.console import Console

from kvcellar.bench.common import (
    describe_machine,
    load_note,
    model_option,
    print_figures,
    publish,
    publish_options,
    wait_until_healthy,
)
from kvcellar.demo.corpus import Conversation, held_out_chat_prompts, held_out_tool_cases
from kvcellar.demo.train import TRAINING_LOG_FILE_NAME, build_streams, fixed_windows, held_out_loss
from kvcellar.demo.training_config import TrainingConfig
from kvcellar.engine.demo_models import DEMO_CODER_DIR, create_model
from kvcellar.engine.tool_calls import offered_tool_names

DOCS_BEGIN, DOCS_END = "<!-- demo_model:begin -->", "<!-- demo_model:end -->"
PRINTABLE_WORD_SHARE_MIN = 0.9
PRINTABLE_SHARE_TARGET = 0.9
TOOL_CALL_SHARE_TARGET = 0.8
REPLY_TOKENS_MAX = 96
SPEED_PROMPT = "def read_config(path):\n    "
SPEED_TOKENS = 128
FIGURE_COLUMNS = ("measurement", "value", "note")


def printable_word_share(text: str) -> float:
    """The share of `text`'s whitespace-separated words made only of printable ASCII."""
    words = text.split()
    if not words:
        return 0.0
    return sum(all(33 <= ord(char) <= 126 for char in word) for word in words) / len(words)


def is_mostly_printable(text: str) -> bool:
    return printable_word_share(text) >= PRINTABLE_WORD_SHARE_MIN


def names_only_offered_tools(message: dict[str, Any], conversation: Conversation) -> bool:
    """True when `message` (an OpenAI reply message) calls at least one tool, and only offered ones."""
    calls = message.get("tool_calls") or []
    names = {call["function"]["name"] for call in calls}
    return bool(calls) and names <= offered_tool_names(conversation.tools)


def chat_request(conversation: Conversation) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": conversation.messages,
        "max_tokens": REPLY_TOKENS_MAX,
        "temperature": 0,
    }
    if conversation.tools:
        body["tools"] = conversation.tools
    return body


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def served_demo_model(*serve_args: str) -> Iterator[httpx.Client]:
    """`kvcellar serve` with `serve_args` (without --model: demo-coder), and a client for it."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "kvcellar.cli", "serve", "--port", str(port), "--batch", "1", *serve_args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        wait_until_healthy(process, base, timeout_s=180)
        with httpx.Client(base_url=base, timeout=120) as client:
            yield client
    finally:
        process.terminate()
        process.wait(timeout=60)


def tool_prompt_figures(client: httpx.Client, prompts: int) -> dict[str, Any]:
    """The held-out tool prompts' replies: which call only offered tools, which the asked-for one."""
    hits, right, replies = [], [], []
    for conversation, wanted in held_out_tool_cases(prompts):
        message = client.post("/v1/chat/completions", json=chat_request(conversation)).json()
        message = message["choices"][0]["message"]
        replies.append(message)
        hits.append(names_only_offered_tools(message, conversation))
        right.append([call["function"]["name"] for call in message.get("tool_calls") or []] == [wanted])
    return {
        "tool_call_share": sum(hits) / len(hits),
        "right_tool_share": sum(right) / len(right),
        "tool_prompts": len(hits),
        "sample_tool_reply": replies[0],
        # Which held-out tool prompts got a call to an offered tool (tests/test_demo_coder.py uses one).
        "tool_prompt_hits": [index for index, hit in enumerate(hits) if hit],
    }


def run_server_prompts(prompts: int, progress: Console, model_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """Both prompt sets through `kvcellar serve --tool-call-grammar off` (the model's own output, what
    the targets measure), then the tool prompts again through the server's defaults, whose
    tool-call grammar holds a started call to the offered tools' schemas."""
    with served_demo_model(*model_args, "--tool-call-grammar", "off") as client:
        chats = []
        for conversation in held_out_chat_prompts()[:prompts]:
            reply = client.post("/v1/chat/completions", json=chat_request(conversation)).json()
            chats.append(reply["choices"][0]["message"].get("content") or "")
        progress.print(f"{len(chats)} chat replies")
        result = tool_prompt_figures(client, prompts)
        progress.print(f"{result['tool_prompts']} tool replies, the grammar off")
    with served_demo_model(*model_args) as client:
        with_grammar = tool_prompt_figures(client, prompts)
        progress.print(f"{with_grammar['tool_prompts']} tool replies, the grammar on (the default)")
    result.update(
        printable_share=sum(map(is_mostly_printable, chats)) / len(chats),
        chat_prompts=len(chats),
        sample_chat_reply=chats[0],
        plain_replies_with_tool_calls=sum("<tool_call>" in chat for chat in chats),
        tool_call_share_with_grammar=with_grammar["tool_call_share"],
        right_tool_share_with_grammar=with_grammar["right_tool_share"],
        sample_tool_reply_with_grammar=with_grammar["sample_tool_reply"],
    )
    return result


def decode_tokens_per_s(model_dir: Path) -> float:
    """Greedy decode speed of `model_dir` on `SPEED_PROMPT`, as mlx-lm reports it (best of two)."""
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(model_dir))[:2]
    speeds = []
    for _ in range(2):
        responses = list(stream_generate(model, tokenizer, SPEED_PROMPT, max_tokens=SPEED_TOKENS))
        speeds.append(responses[-1].generation_tps)
    return max(speeds)


def held_out_nats_per_byte(model_dir: Path, log: dict[str, Any]) -> float:
    """The held-out loss per UTF-8 byte of the text it predicts, on the windows training's held-out
    loss uses (the same streams and windows, rebuilt with the model's own tokenizer, and the same
    `held_out_loss`): comparable across tokenizers, where nats per token is not. Each window's bytes
    are those of its decoded target tokens (a character cut at a window's edge counts as its
    replacement character)."""
    from mlx_lm import load

    # A log from before `tokenizer_ids` existed was made with the shared tokenizer (0).
    config = TrainingConfig(**{"tokenizer_ids": 0, **log["config"]})
    streams = build_streams(model_dir, config)
    windows = [
        fixed_windows(stream, config.eval_windows // 2, config.window_tokens)
        for stream in (streams.code_held_out, streams.chat_held_out)
    ]
    model, tokenizer = load(str(model_dir))[:2]
    predicted = np.concatenate(windows)[:, 1:]
    byte_count = sum(len(tokenizer.decode(row.tolist()).encode("utf-8")) for row in predicted)
    return held_out_loss(model, windows) * predicted.size / byte_count


def markdown_section(result: dict[str, Any], command: str, run_date: str) -> str:
    machine = result["machine"]
    rows = figure_rows(result)
    lines = [
        "## Demo model (demo-coder): quality and speed",
        "",
        f"`{command}`, {run_date}; {machine['cpus']} CPUs ({machine['cpu_model']}), MLX {machine['mlx']}. "
        + load_note(),
        "",
        "| measurement | value | note |",
        "|---|---|---|",
        *[f"| {' | '.join(row)} |" for row in rows],
        "",
        f"- first held-out chat reply, unedited: `{json.dumps(result['sample_chat_reply'])[:300]}`",
        f"- first held-out tool reply's calls: `{json.dumps(result['sample_tool_reply'].get('tool_calls'))[:300]}`",
        "- the same with the grammar on: "
        f"`{json.dumps(result['sample_tool_reply_with_grammar'].get('tool_calls'))[:300]}`",
    ]
    return "\n".join(lines)


def _target(value: float, target: float) -> str:
    return f"target >= {target}: {'met' if value >= target else 'MISSED'}"


def figure_rows(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [
        ("held-out loss (nats/token)", f"{result['held_out_loss']:.3f}", "bfloat16 weights, from training-log.json"),
        ("held-out perplexity", f"{result['held_out_perplexity']:.1f}", ""),
        (
            "held-out loss (nats/byte)",
            f"{result['held_out_nats_per_byte']:.3f}",
            "the same windows per UTF-8 byte of the text predicted: comparable across tokenizers",
        ),
        (
            "printable_share",
            f"{result['printable_share']:.2f}",
            f"{result['chat_prompts']} held-out prompts, reply >= 90 % printable words; "
            + _target(result["printable_share"], PRINTABLE_SHARE_TARGET),
        ),
        (
            "tool_call_share",
            f"{result['tool_call_share']:.2f}",
            f"{result['tool_prompts']} held-out tool prompts via serve (--tool-call-grammar off: the model's "
            "own output) and mlx-lm's parser, a call naming only offered tools; "
            + _target(result["tool_call_share"], TOOL_CALL_SHARE_TARGET),
        ),
        ("right_tool_share", f"{result['right_tool_share']:.2f}", "the same replies: one call, of the tool asked for"),
        (
            "tool_call_share_with_grammar",
            f"{result['tool_call_share_with_grammar']:.2f}",
            "the same prompts through serve's defaults (the tool-call grammar on)",
        ),
        (
            "right_tool_share_with_grammar",
            f"{result['right_tool_share_with_grammar']:.2f}",
            "the same, one call of the tool asked for",
        ),
        ("plain prompts answered with a tool call", str(result["plain_replies_with_tool_calls"]), "grammar off"),
        (
            "decode tokens/s, demo-coder (bfloat16 weights)",
            f"{result['demo_tokens_per_s']:.0f}",
            "serve's compute dtype: float32 on the CPU",
        ),
        (
            "decode tokens/s, random small llama (float32)",
            f"{result['random_small_tokens_per_s']:.0f}",
            f"demo-coder at {result['speed_ratio']:.2f}x of it",
        ),
    ]


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--prompts",
    type=click.IntRange(1, 20),
    default=20,
    show_default=True,
    help="How many of the 20 held-out chat prompts and of the 20 tool prompts to send.",
)
@model_option("A model directory `kvcellar model train` wrote, measured instead of the committed demo-coder.")
@publish_options(DOCS_BEGIN, DOCS_END)
def main(prompts: int, model_dir: Path | None, as_json: bool, write_docs: bool) -> None:
    """Measure the committed demo-coder model (or --model DIR): held-out loss, printable and tool-call shares, speed."""
    if model_dir is not None and write_docs:
        raise click.UsageError("--write-docs publishes the committed demo-coder's figures; drop --model DIR")
    model_args = () if model_dir is None else ("--model", str(model_dir))
    model_dir = model_dir or DEMO_CODER_DIR
    if not (model_dir / TRAINING_LOG_FILE_NAME).is_file():
        raise click.UsageError(f"{model_dir} has no {TRAINING_LOG_FILE_NAME}: not a model `kvcellar model train` wrote")
    started = time.perf_counter()
    console = Console() if sys.stdout.isatty() else Console(width=140)
    progress = Console(stderr=True)
    log = json.loads((model_dir / TRAINING_LOG_FILE_NAME).read_text(encoding="utf-8"))
    result: dict[str, Any] = {
        "held_out_loss": log["final_held_out_loss_bf16"],
        "held_out_perplexity": log["final_held_out_perplexity_bf16"],
        "held_out_nats_per_byte": held_out_nats_per_byte(model_dir, log),
    }
    result.update(run_server_prompts(prompts, progress, model_args))
    with tempfile.TemporaryDirectory(prefix="demo-model-bench-") as scratch:
        random_dir = create_model("llama", Path(scratch) / "llama-small", size="small")
        result["random_small_tokens_per_s"] = decode_tokens_per_s(random_dir)
        result["demo_tokens_per_s"] = decode_tokens_per_s(model_dir)
    result["speed_ratio"] = result["demo_tokens_per_s"] / result["random_small_tokens_per_s"]
    result.update(
        model=str(model_dir),
        machine=describe_machine(Path(tempfile.gettempdir())),
        wall_s=time.perf_counter() - started,
    )
    print_figures("demo-coder", FIGURE_COLUMNS, figure_rows(result), [], console)
    publish(
        "demo_model",
        result,
        lambda command, run_date: markdown_section(result, command, run_date),
        write_docs=write_docs,
        as_json=as_json,
        console=console,
        progress=progress,
    )


if __name__ == "__main__":
    main()
