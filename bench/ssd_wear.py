"""Benchmark: what each SSD write-admission policy costs the drive (issue 21).

One scripted agent-like workload, the same under every policy: several
conversations sharing a system prompt, each with tool loops (tool results fed
back at once) and human turns (a think gap longer than the write-behind
debounce), branches that regenerate from an earlier turn, one-off prompts that
never come back, and restarts between phases: graceful ones (shutdown
flushes) and, before the last phase, a crash (the process dies without a
flush: what write-behind had not written is lost). It is replayed on a
fresh SSD directory under `always`, `second-hit` and `cost`, and once with no
SSD tier (RAM only), whose cold restarts are the baseline of the restart
TTFT gains. Replies are greedy, so every configuration sees the same prompts.

Figures per policy: bytes written, dead writes (evicted, never restored) and
rewrites, all from the journal's events (`store/write_wear.py`); the
cached-token ratio over every request; the restart TTFT (the first turn of
each conversation after a graceful restart) and its gain over RAM only; the
same after the crash. Target: the
default policy writes <= 0.5x the bytes of `always` while keeping >= 0.95x of
its cached-token ratio and restart TTFT gain.

Run `python -m kvcellar.bench.ssd_wear --help` for the options.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import attrs
import click
import numpy as np
import trio
from rich.console import Console

from kvcellar.actors.admission_core import ADMISSION_POLICIES, ADMISSION_POLICY_DEFAULT
from kvcellar.actors.system import System, SystemConfig, open_system
from kvcellar.bench.common import (
    Figures,
    describe_machine,
    docs_markers,
    docs_section,
    load_note,
    machine_sentence,
    model_option,
    publish_figures,
    publish_options,
    scratch_dir_option,
    scratch_with_model,
)
from kvcellar.engine.demo_models import VOCAB_SIZE
from kvcellar.engine.engine import SamplingParams
from kvcellar.engine.generation import GenerationDone, GenerationRequest
from kvcellar.errors import BenchProcessCrash
from kvcellar.store.journal import JOURNAL_FILE_NAME, Journal
from kvcellar.store.write_wear import fold_journal

DOCS_BEGIN, DOCS_END = docs_markers("ssd_wear")
FIRST_ORDINARY_TOKEN_ID = 3
RAM_ONLY = "ram-only"
TARGET_BYTES_RATIO = 0.5
TARGET_KEEP_RATIO = 0.95
# The write-behind debounce as a share of a human turn's think gap: shorter, so a human turn's
# write-behind fires before the next turn, while a tool step (no gap) comes within the window.
DEBOUNCE_OF_THINK = 0.8
FIGURE_COLUMNS = (
    "policy",
    "bytes written",
    "vs always",
    "entries written",
    "dead writes",
    "rewrites",
    "cached-token ratio",
    "restart cached ratio",
    "restart TTFT",
    "restart gain vs always",
    "after a crash: cached ratio",
)


@attrs.frozen(kw_only=True)
class Shape:
    """The workload's size (the defaults take about a minute per policy on 2 CPUs)."""

    conversations: int = 5
    system_tokens: int = 160
    user_tokens: int = 40
    tool_tokens: int = 80
    one_off_tokens: int = 240
    reply_tokens: int = 10
    turns_per_phase: tuple[int, ...] = (4, 4, 2)
    one_offs_per_phase: int = 3
    ram_entries: float = 3.0  # the RAM tier holds about this many of the longest conversation entries
    think_s: float = 0.3  # a human turn's gap before it is sent
    crash_before_last: bool = True  # the last restart is a crash, not a shutdown

    @property
    def debounce_s(self) -> float:
        return self.think_s * DEBOUNCE_OF_THINK


def _tokens(rng: np.random.Generator, count: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(FIRST_ORDINARY_TOKEN_ID, VOCAB_SIZE, count))


@attrs.define(kw_only=True)
class Conversation:
    history: tuple[int, ...]
    turns: list[tuple[int, ...]] = attrs.Factory(list)  # the history after each human turn (branch points)


@attrs.define(kw_only=True)
class Replay:
    """What one configuration's replay measured."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    restart_prompt_tokens: int = 0
    restart_cached_tokens: int = 0
    restart_ttft_s: list[float] = attrs.Factory(list)
    crash_prompt_tokens: int = 0
    crash_cached_tokens: int = 0
    crash_ttft_s: list[float] = attrs.Factory(list)
    replies: list[tuple[int, ...]] = attrs.Factory(list)


async def _generate(system: System, prompt: tuple[int, ...], reply_tokens: int) -> tuple[tuple[int, ...], Any, float]:
    request = GenerationRequest(prompt_ids=prompt, params=SamplingParams(temperature=0.0, max_tokens=reply_tokens))
    started_s, first_s, tokens, done = time.perf_counter(), None, [], None
    async for item in system.generate(request):
        if first_s is None:
            first_s = time.perf_counter() - started_s
        if isinstance(item, GenerationDone):
            done = item
        elif item.token_id >= 0:
            tokens.append(item.token_id)
    assert done is not None and first_s is not None
    return tuple(tokens), done, first_s


class Workload:
    """The script: seeded, so every configuration replays the same one."""

    def __init__(self, shape: Shape, seed: int) -> None:
        self.shape = shape
        self.rng = np.random.default_rng(seed)
        self.system_prompt = _tokens(self.rng, shape.system_tokens)
        # Drawn up front, so the replies (which differ by nothing but the model) change no later draw.
        self.users = [_tokens(self.rng, shape.user_tokens) for _ in range(400)]
        self.tools = [_tokens(self.rng, shape.tool_tokens) for _ in range(400)]
        self.tool_steps = [int(n) for n in self.rng.integers(0, 3, 400)]
        self.one_offs = [_tokens(self.rng, shape.one_off_tokens) for _ in range(100)]


async def _turn(
    system: System, workload: Workload, conversation: Conversation, draw: int, replay: Replay, *, restart: str
) -> None:
    """One human turn (after its think gap), then its tool loop (no gap)."""
    shape = workload.shape
    await trio.sleep(shape.think_s)
    prompt = conversation.history + workload.users[draw]
    for step in range(workload.tool_steps[draw] + 1):
        reply, done, ttft_s = await _generate(system, prompt, shape.reply_tokens)
        replay.replies.append(reply)
        replay.prompt_tokens += done.prompt_tokens
        replay.cached_tokens += done.cached_tokens
        if restart == "shutdown" and step == 0:
            replay.restart_ttft_s.append(ttft_s)
            replay.restart_prompt_tokens += done.prompt_tokens
            replay.restart_cached_tokens += done.cached_tokens
        elif restart == "crash" and step == 0:
            replay.crash_ttft_s.append(ttft_s)
            replay.crash_prompt_tokens += done.prompt_tokens
            replay.crash_cached_tokens += done.cached_tokens
        conversation.history = prompt + reply
        prompt = conversation.history + workload.tools[(draw + step) % len(workload.tools)]
    conversation.turns.append(conversation.history)


async def _phase(system: System, workload: Workload, conversations: list[Conversation], phase: int, replay: Replay):
    shape = workload.shape
    draw = 100 * phase
    for turn in range(shape.turns_per_phase[phase]):
        for index, conversation in enumerate(conversations):
            await _turn(system, workload, conversation, draw, replay, restart=_restart_before(shape, phase, turn))
            draw += 1
            if turn == 0 and index % 2 == 1:
                one_off = workload.system_prompt + workload.one_offs[(draw + index) % len(workload.one_offs)]
                reply, done, _ = await _generate(system, one_off, shape.reply_tokens)
                replay.replies.append(reply)
                replay.prompt_tokens += done.prompt_tokens
                replay.cached_tokens += done.cached_tokens
    if phase == 1:
        # A branch: the first conversation regenerates from its first turn with another message.
        branch = Conversation(history=conversations[0].turns[0])
        await _turn(system, workload, branch, draw, replay, restart="")


def _restart_before(shape: Shape, phase: int, turn: int) -> str:
    """ "shutdown" or "crash" for a conversation's first turn after a restart, else ""."""
    if phase == 0 or turn > 0:
        return ""
    return "crash" if shape.crash_before_last and phase == len(shape.turns_per_phase) - 1 else "shutdown"


def _ram_bytes(shape: Shape, bytes_per_token: int) -> int:
    longest = shape.system_tokens + sum(shape.turns_per_phase) * (
        shape.user_tokens + 2 * (shape.tool_tokens + shape.reply_tokens) + shape.reply_tokens
    )
    return int(shape.ram_entries * longest * bytes_per_token)


async def replay_one(
    config_name: str, model_dir: Path, workdir: Path, shape: Shape, seed: int, bytes_per_token: int
) -> tuple[Replay, dict[str, Any]]:
    """Replay the workload under one configuration; its replay and journal figures."""
    workload = Workload(shape, seed)
    conversations = [Conversation(history=workload.system_prompt) for _ in range(shape.conversations)]
    replay = Replay()
    ssd_dir = None if config_name == RAM_ONLY else workdir / config_name
    config = SystemConfig(
        model_dir=model_dir,
        ssd_dir=ssd_dir,
        prompt_cache_bytes=_ram_bytes(shape, bytes_per_token),
        debounce_s=shape.debounce_s,
        busy_rearm_s=shape.debounce_s,
        demote_idle_s=0,
        ssd_admission="always" if config_name == RAM_ONLY else config_name,
    )
    lives = len(shape.turns_per_phase)
    for phase in range(lives):
        # Each phase is one process life; leaving the context is a graceful shutdown (it flushes), leaving it
        # by an exception a crash: no flush, and the spills still queued are dropped.
        crash = shape.crash_before_last and phase == lives - 2
        try:
            async with open_system(config) as system:
                await _phase(system, workload, conversations, phase, replay)
                if crash:
                    raise BenchProcessCrash
        except* BenchProcessCrash:
            pass  # the nursery wraps it in an ExceptionGroup
    return replay, (_journal_figures(ssd_dir) if ssd_dir is not None else {})


def _journal_figures(ssd_dir: Path) -> dict[str, Any]:
    (journal_path,) = ssd_dir.glob(f"*/{JOURNAL_FILE_NAME}")
    journal = Journal.open_readonly(journal_path)
    try:
        return fold_journal(journal.events()).as_json()["total"]
    finally:
        journal.close()


async def _bytes_per_token(model_dir: Path) -> int:
    """The RAM tier's bill per token of this model (to size it in entries)."""
    async with open_system(SystemConfig(model_dir=model_dir, demote_idle_s=0)) as system:
        prompt = tuple(range(FIRST_ORDINARY_TOKEN_ID, FIRST_ORDINARY_TOKEN_ID + 64))
        _, done, _ = await _generate(system, prompt, 4)
        return int(system.prompt_cache.stats()["bytes"]) // (done.prompt_tokens + done.completion_tokens - 1)


def run_benchmark(model_dir: Path, workdir: Path, shape: Shape, seed: int, progress: Console) -> dict[str, Any]:
    started_s = time.perf_counter()
    bytes_per_token = trio.run(_bytes_per_token, model_dir)
    policies: dict[str, Any] = {}
    replies: dict[str, list[tuple[int, ...]]] = {}
    for name in (*ADMISSION_POLICIES, RAM_ONLY):
        progress.print(f"replaying the workload under {name}")
        replay, figures = trio.run(replay_one, name, model_dir, workdir, shape, seed, bytes_per_token)
        replies[name] = replay.replies
        policies[name] = {
            **figures,
            "requests": len(replay.replies),
            "cached_ratio": replay.cached_tokens / replay.prompt_tokens,
            "restart_cached_ratio": replay.restart_cached_tokens / replay.restart_prompt_tokens,
            "restart_ttft_s": statistics.median(replay.restart_ttft_s),
            "crash_restart_cached_ratio": (
                replay.crash_cached_tokens / replay.crash_prompt_tokens if replay.crash_prompt_tokens else None
            ),
            "crash_restart_ttft_s": statistics.median(replay.crash_ttft_s) if replay.crash_ttft_s else None,
        }
    cold_ttft_s = policies[RAM_ONLY]["restart_ttft_s"]
    always = policies["always"]
    for name in ADMISSION_POLICIES:
        figures = policies[name]
        figures["restart_ttft_gain_s"] = cold_ttft_s - figures["restart_ttft_s"]
        figures["bytes_ratio_vs_always"] = figures["bytes_written"] / always["bytes_written"]
        figures["cached_ratio_vs_always"] = figures["cached_ratio"] / always["cached_ratio"]
        figures["restart_cached_ratio_vs_always"] = figures["restart_cached_ratio"] / always["restart_cached_ratio"]
        crash_ratio, always_crash_ratio = figures["crash_restart_cached_ratio"], always["crash_restart_cached_ratio"]
        figures["crash_restart_cached_ratio_vs_always"] = (
            crash_ratio / always_crash_ratio if crash_ratio is not None and always_crash_ratio else None
        )
        figures["restart_gain_ratio_vs_always"] = (
            figures["restart_ttft_gain_s"] / always["restart_ttft_gain_s"]
            if always["restart_ttft_gain_s"] > 0
            else None
        )
    default = policies[ADMISSION_POLICY_DEFAULT]
    second_hit = policies["second-hit"]
    return {
        "default_policy": ADMISSION_POLICY_DEFAULT,
        "bytes_ratio_vs_always": default["bytes_ratio_vs_always"],
        "cached_ratio_vs_always": default["cached_ratio_vs_always"],
        "policies": policies,
        "targets_met": {
            f"second_hit_bytes_le_{TARGET_BYTES_RATIO}x": second_hit["bytes_ratio_vs_always"] <= TARGET_BYTES_RATIO,
            f"second_hit_cached_ge_{TARGET_KEEP_RATIO}x": second_hit["cached_ratio_vs_always"] >= TARGET_KEEP_RATIO,
            f"second_hit_restart_gain_ge_{TARGET_KEEP_RATIO}x": (second_hit["restart_gain_ratio_vs_always"] or 0)
            >= TARGET_KEEP_RATIO,
            f"second_hit_crash_restart_cached_ge_{TARGET_KEEP_RATIO}x": (
                second_hit["crash_restart_cached_ratio_vs_always"] or 0
            )
            >= TARGET_KEEP_RATIO,
        },
        "same_replies_every_policy": all(replies[name] == replies["always"] for name in replies),
        "shape": attrs.asdict(shape),
        "seed": seed,
        "bytes_per_token": bytes_per_token,
        "debounce_s": shape.debounce_s,
        "think_s": shape.think_s,
        "wall_s": time.perf_counter() - started_s,
    }


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def figure_rows(result: dict[str, Any]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for name in (*ADMISSION_POLICIES, RAM_ONLY):
        figures = result["policies"][name]
        restart = f"{figures['restart_ttft_s'] * 1000:.1f} ms"
        if name == RAM_ONLY:
            rows.append(
                (
                    name,
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    f"{figures['cached_ratio']:.3f}",
                    f"{figures['restart_cached_ratio']:.3f}",
                    restart,
                    "(cold baseline)",
                    _fraction(figures["crash_restart_cached_ratio"]),
                )
            )
            continue
        rows.append(
            (
                name + (" (default)" if name == result["default_policy"] else ""),
                f"{figures['bytes_written'] / 2**20:.1f} MiB",
                _ratio(figures["bytes_ratio_vs_always"]),
                str(figures["entries_written"]),
                str(figures["dead_writes"]),
                str(figures["rewrites"]),
                f"{figures['cached_ratio']:.3f}",
                f"{figures['restart_cached_ratio']:.3f}",
                restart,
                _ratio(figures["restart_gain_ratio_vs_always"]),
                _fraction(figures["crash_restart_cached_ratio"]),
            )
        )
    return rows


def summary_lines(result: dict[str, Any]) -> list[str]:
    shape = result["shape"]
    second_hit = result["policies"]["second-hit"]
    return [
        f"workload (seed {result['seed']}): {shape['conversations']} conversations sharing a "
        f"{shape['system_tokens']}-token system prompt, {sum(shape['turns_per_phase'])} human turns each over "
        f"{len(shape['turns_per_phase'])} process lives (graceful restarts "
        f"between, save a crash before the last), 0-2 tool steps per turn, a "
        f"branch, {shape['one_off_tokens']}-token one-off prompts; {result['policies']['always']['requests']} "
        f"requests per policy; RAM tier sized for about {shape['ram_entries']} conversation entries; debounce "
        f"{result['debounce_s']} s, think gap {result['think_s']} s; same replies under every policy: "
        f"{result['same_replies_every_policy']}",
        f"second-hit against always: bytes {second_hit['bytes_ratio_vs_always']:.2f}x (target <= "
        f"{TARGET_BYTES_RATIO}x), cached-token ratio {second_hit['cached_ratio_vs_always']:.3f}x, restart cached "
        f"ratio {second_hit['restart_cached_ratio_vs_always']:.3f}x, restart TTFT gain "
        f"{_ratio(second_hit['restart_gain_ratio_vs_always'])} (targets >= {TARGET_KEEP_RATIO}x); after the crash, "
        f"restart cached ratio {_ratio(second_hit['crash_restart_cached_ratio_vs_always'])}; targets met: "
        + ", ".join(f"{name} {met}" for name, met in result["targets_met"].items()),
        f"whole run {result['wall_s']:.0f} s",
    ]


def interpretation(result: dict[str, Any]) -> str:
    """One paragraph, built from the figures."""
    always, second_hit, cost = (result["policies"][name] for name in ("always", "second-hit", "cost"))
    return (
        f"`second-hit` wrote {second_hit['bytes_ratio_vs_always']:.2f}x the bytes of `always` "
        f"({second_hit['entries_written']} entries against {always['entries_written']}, "
        f"{second_hit['rewrites']} rewrites of a superseded prefix against {always['rewrites']}): a conversation "
        f"is written when it leaves RAM or at shutdown instead of after every human turn, and a one-off prompt "
        f"only if a shutdown finds it in RAM. Across graceful restarts it kept "
        f"{second_hit['restart_cached_ratio_vs_always']:.2f}x of `always`'s cached tokens and "
        f"{second_hit['cached_ratio_vs_always']:.2f}x over all requests (a conversation whose first turn left RAM "
        f"before anything came back for it is recomputed). After the crash it kept "
        f"{_ratio(second_hit['crash_restart_cached_ratio_vs_always'])}: the snapshots it held back died with the "
        f"process, which `always`'s write-behind had written within a debounce. `cost` wrote "
        f"{cost['bytes_ratio_vs_always']:.2f}x: at the default threshold every prefix of this model is dearer to "
        f"recompute than to write, so it saved only the spills of prefixes already on SSD. "
        + (
            "No write was dead (the SSD tier was unbounded, so nothing was evicted from it). "
            if always["dead_writes"] == 0
            else f"Dead writes: {always['dead_writes']} under `always`, {second_hit['dead_writes']} under "
            f"`second-hit`. "
        )
        + f"Restart TTFTs are medians of "
        f"{result['shape']['conversations']} first turns; the cached ratios are exact."
    )


def figures(result: dict[str, Any]) -> Figures:
    return Figures(
        title="SSD write wear by admission policy",
        columns=FIGURE_COLUMNS,
        rows=figure_rows(result),
        summary=summary_lines(result),
        text_columns=("policy",),
    )


def markdown_section(result: dict[str, Any], command: str, run_date: str) -> str:
    machine = result["machine"]
    shared = f"{load_note()} TTFTs vary with the load, byte counts do not."
    return docs_section(
        "SSD write wear: admission policies on an agent-like workload",
        [
            f"Run {run_date} with `{command}` (wall time {result['wall_s']:.0f} s).",
            machine_sentence(machine, f" (CPU); SSD tier on {machine['filesystem']}. {shared}"),
        ],
        figures(result),
        [interpretation(result)],
    )


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--conversations", type=click.IntRange(min=2), default=Shape().conversations, show_default=True)
@click.option(
    "--turns",
    default="4,4,2",
    show_default=True,
    help="Human turns per conversation in each process life, comma-separated (a restart between each).",
)
@click.option(
    "--think-seconds",
    "think_s",
    type=click.FloatRange(min=0.01),
    default=Shape().think_s,
    show_default=True,
    help="The gap before each human turn; the write-behind debounce is 0.8 of it (tool steps have no gap).",
)
@click.option("--seed", type=int, default=21, show_default=True)
@model_option("An mlx-lm model directory (default: the demo llama, tiny).")
@scratch_dir_option("the SSD directories")
@publish_options(DOCS_BEGIN, DOCS_END)
def main(
    conversations: int,
    turns: str,
    think_s: float,
    seed: int,
    model_dir: Path | None,
    directory: Path | None,
    write_docs: bool,
    as_json: bool,
) -> None:
    """Replay an agent-like workload under each SSD admission policy and compare the bytes written."""
    console = Console()
    progress = Console(stderr=True)
    try:
        turns_per_phase = tuple(int(part) for part in turns.split(","))
    except ValueError as e:
        raise click.BadParameter(f"{turns!r} is not a comma-separated list of turn counts", param_hint="--turns") from e
    if len(turns_per_phase) < 3 or min(turns_per_phase) < 1:
        raise click.BadParameter(
            "at least three process lives (a graceful restart, then a crash), each with a turn or more",
            param_hint="--turns",
        )
    shape = Shape(conversations=conversations, turns_per_phase=turns_per_phase, think_s=think_s)
    with scratch_with_model("ssd-wear", directory, model_dir, progress, size="tiny") as scratch:
        result = run_benchmark(scratch.model_dir, scratch.workdir, shape, seed, progress)
        result["model"] = scratch.model_described
        result["machine"] = describe_machine(scratch.workdir)
    publish_figures(
        "ssd_wear",
        result,
        figures(result),
        lambda command, run_date: markdown_section(result, command, run_date),
        write_docs=write_docs,
        as_json=as_json,
        console=console,
        progress=progress,
    )


if __name__ == "__main__":
    main()
