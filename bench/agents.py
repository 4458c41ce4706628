"""The real agent clients through a real `kvcellar serve` of the demo model: a scripted multi-session task
per client (bench/agent_clients.py runs each with its stock settings, docs/agents.md gives the setup).

Per client, on a server of its own (so its first turn is cold): `--sessions` sessions on the same project,
each a first prompt and a follow-up on the same conversation (SCRIPT); the figures come from the server's
/stats/requests and a recording proxy:

* cold first-turn TTFT: the first session's first request (Claude Code's ~28k-token prompt: the cold
  prefill, target <= 60 s);
* cached share of turns 2+: cached over prompt tokens of every request that continues a conversation an
  earlier request of its session started (target >= 0.9; aider's commit-message requests, a chat of their
  own, are first turns);
* cached share of a new session's first turn: the lowest over sessions 2+ (target >= 0.9);
* requests the client sent and how many were not 2xx (target 0), and each session's exit status.

A client `.ci/install-agents` has not installed is reported as not installed, not run.

Usage: python -m kvcellar.bench.agents [--clients claude,codex,aider,agents_sdk_chat,agents_sdk_responses]
       [--sessions N] [--json] [--write-docs]
"""

from __future__ import annotations

import functools
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from kvcellar.bench import agent_clients
from kvcellar.bench.agent_clients import AgentsRun, ClientRun, RecordingProxy, Session, cached_share
from kvcellar.bench.common import (
    Figures,
    describe_machine,
    docs_section,
    load_note,
    machine_sentence,
    publish_figures,
    publish_options,
)

NAME = "agents"
DOCS_BEGIN, DOCS_END = "<!-- agents:begin -->", "<!-- agents:end -->"
SHARE_TARGET = 0.9
COLD_PREFILL_TARGET_S = 60.0
# The scripted task: per client, each session's first prompt and a follow-up on the same conversation
# (Claude Code `-c`, Codex `exec resume --last`, the Agents SDK's history plus a user turn); aider's own
# edit loop (the model's edit, then its lint errors sent back) gives it later turns. The n-th session
# takes the n-th pair, cycling.
SCRIPT: dict[str, tuple[tuple[str, str | None], ...]] = {
    "claude": (
        ("List the files in this project.", "Which of them is Python?"),
        ("What does calc.py define? Answer in one sentence.", "And what is wrong with add?"),
    ),
    "codex": (
        ("List the files in this directory.", "Which of them is Python?"),
        ("Show what calc.py contains.", "What is wrong with add?"),
    ),
    "aider": (("Fix the bug in add in calc.py.", None), ("Add a docstring to mul in calc.py.", None)),
    "agents_sdk_chat": (
        ("What is the weather in Paris?", "And in Rome?"),
        ("How warm is it in Oslo right now?", "And in Bergen?"),
    ),
    "agents_sdk_responses": (
        ("What is the weather in Lima?", "And in Quito?"),
        ("Is it cold in Cairo today?", "And in Tunis?"),
    ),
}
CLIENTS = tuple(SCRIPT)


def run_script_session(
    client: str, base_url: str, home: Path, project: Path, prompts: tuple[str, str | None]
) -> ClientRun | AgentsRun:
    """One session of `client`: its first prompt, then the follow-up on the same conversation."""
    first, follow_up = prompts
    if client.startswith("agents_sdk"):
        api = client.removeprefix("agents_sdk_")
        return agent_clients.agents_sdk_session(base_url, first, api, follow_up)
    drive = {"claude": agent_clients.claude_session, "codex": agent_clients.codex_session}.get(client)
    if drive is None:
        return agent_clients.aider_session(base_url, home, project, first)
    runs = [drive(base_url, home, project, first)]
    if follow_up is not None and runs[0].exit_code == 0:
        runs.append(drive(base_url, home, project, follow_up, resume=True))
    return ClientRun(
        exit_code=next((run.exit_code for run in runs if run.exit_code != 0), 0),
        output="\n".join(run.output for run in runs),
        duration_s=sum(run.duration_s for run in runs),
    )


def is_installed(client: str) -> bool:
    if client.startswith("agents_sdk"):
        try:
            import agents  # noqa: F401
        except ImportError:
            return False
        return True
    return agent_clients.installed_clients()[client] is not None


def run_client(client: str, sessions: int, progress: Console) -> dict[str, Any]:
    """`sessions` sessions of `client` against a fresh server; its figures."""
    started = time.perf_counter()
    runs: list[Session] = []
    with tempfile.TemporaryDirectory(prefix=f"kvcellar-agents-{client}-") as scratch:
        home, project = agent_clients.make_workspace(Path(scratch) / "agent")
        with agent_clients.served_stock(Path(scratch) / "serve.log") as server_url, RecordingProxy(server_url) as proxy:
            for index in range(sessions):
                prompts = SCRIPT[client][index % len(SCRIPT[client])]
                agent_clients.reset_project(project)
                drive = functools.partial(run_script_session, client, proxy.base_url, home, project, prompts)
                session, _ = agent_clients.recorded_session(proxy, server_url, drive)
                progress.print(
                    f"{client} session {index + 1}: exit {session.exit_code}, {len(session.exchanges)} requests, "
                    f"{len(session.non_2xx)} not 2xx, {session.duration_s:.0f} s"
                )
                runs.append(session)
    return client_figures(runs, time.perf_counter() - started)


def client_figures(runs: list[Session], wall_s: float) -> dict[str, Any]:
    first = runs[0].requests[0] if runs[0].requests else None
    later = tuple(record for run in runs for record in run.later_turns())
    new_session_shares = [run.first_request_share for run in runs[1:]]
    known_shares = [share for share in new_session_shares if share is not None]
    failures = [f"{e.method} {e.path} -> {e.status} {e.error_excerpt[:300]}" for run in runs for e in run.non_2xx]
    return {
        "installed": True,
        "cold_ttft_s": first["ttft_s"] if first else None,
        "cold_prompt_tokens": first["prompt_tokens"] if first else None,
        "turns_2plus_share": cached_share(later),
        "new_session_share": min(known_shares) if len(known_shares) == len(new_session_shares) else None,
        "new_session_shares": new_session_shares,
        "requests": sum(len(run.exchanges) for run in runs),
        "generated": sum(len(run.requests) for run in runs),
        "non_2xx": sum(len(run.non_2xx) for run in runs),
        "non_2xx_first": failures[:3],
        "exit_codes": [run.exit_code for run in runs],
        "wall_s": wall_s,
    }


def run_benchmark(clients: tuple[str, ...], sessions: int, progress: Console) -> dict[str, Any]:
    per_client: dict[str, Any] = {}
    for client in clients:
        if not is_installed(client):
            progress.print(f"{client}: not installed (run .ci/install-agents); skipped")
            per_client[client] = {"installed": False}
            continue
        per_client[client] = run_client(client, sessions, progress)
    ran = [figures for figures in per_client.values() if figures["installed"]]
    result: dict[str, Any] = {
        "clients": per_client,
        "sessions": sessions,
        "claude_cross_session_share": per_client.get("claude", {}).get("new_session_share"),
        "codex_cross_session_share": per_client.get("codex", {}).get("new_session_share"),
        "claude_cold_prefill_s": per_client.get("claude", {}).get("cold_ttft_s"),
        "claude_cold_prompt_tokens": per_client.get("claude", {}).get("cold_prompt_tokens"),
        "non_2xx": sum(figures["non_2xx"] for figures in ran),
    }
    result["targets_met"] = targets_met(result)
    return result


def targets_met(result: dict[str, Any]) -> dict[str, bool]:
    """Each target the issue sets, over the clients that ran (an unmeasured figure is a miss)."""
    met: dict[str, bool] = {"non_2xx_eq_0": result["non_2xx"] == 0}
    for client, figures in result["clients"].items():
        if not figures["installed"]:
            continue
        for key in ("new_session_share", "turns_2plus_share"):
            value = figures[key]
            met[f"{client}_{key}_ge_{SHARE_TARGET}"] = value is not None and value >= SHARE_TARGET
    if result["clients"].get("claude", {}).get("installed"):
        cold = result["claude_cold_prefill_s"]
        met[f"claude_cold_prefill_le_{COLD_PREFILL_TARGET_S:.0f}s"] = cold is not None and cold <= COLD_PREFILL_TARGET_S
    return met


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def figures_of(result: dict[str, Any]) -> Figures:
    rows = []
    for client, figures in result["clients"].items():
        if not figures["installed"]:
            rows.append((client, "not installed", "", "", "", "", ""))
            continue
        cold = figures["cold_ttft_s"]
        rows.append(
            (
                client,
                "-" if cold is None else f"{cold:.1f} s ({figures['cold_prompt_tokens']:,} tok)",
                _share(figures["turns_2plus_share"]),
                ", ".join(_share(share) for share in figures["new_session_shares"]),
                f"{figures['requests']} ({figures['generated']} generated)",
                str(figures["non_2xx"]),
                " ".join(map(str, figures["exit_codes"])),
            )
        )
    missed = [name for name, met in result["targets_met"].items() if not met]
    failures = [line for figures in result["clients"].values() for line in figures.get("non_2xx_first", [])[:1]]
    summary = [f"targets missed: {', '.join(missed) if missed else 'none'}", *(f"first failure: {f}" for f in failures)]
    return Figures(
        title="Real agent clients against kvcellar serve (demo model)",
        columns=("client", "cold TTFT", "turns 2+ cached", "new session cached", "requests", "non-2xx", "exit"),
        rows=rows,
        summary=summary,
        text_columns=("client",),
    )


def markdown_section(result: dict[str, Any], command: str, run_date: str) -> str:
    opening = [
        f"Run {run_date} with `{command}` (wall time {result['wall_s']:.0f} s, {result['sessions']} sessions per "
        f"client, each client on a fresh server).",
        machine_sentence(result["machine"], f" (CPU). {load_note()}"),
        f"Targets: cached share of turns 2+ and of a new session's first turn >= {SHARE_TARGET}, no non-2xx "
        f"answer, Claude Code's cold first turn (its ~28k-token prompt) <= {COLD_PREFILL_TARGET_S:.0f} s.",
    ]
    return docs_section("Real agent clients (issue 38)", opening, figures_of(result))


def parse_clients(_: Any, __: Any, value: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in value.split(",") if name.strip())
    unknown = [name for name in names if name not in CLIENTS]
    if unknown or not names:
        raise click.BadParameter(f"unknown client {', '.join(unknown) or '(none)'}; choose from {', '.join(CLIENTS)}")
    return names


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--clients", default=",".join(CLIENTS), show_default=True, callback=parse_clients, help="Comma-separated clients."
)
@click.option("--sessions", type=click.IntRange(min=2), default=2, show_default=True, help="Sessions per client.")
@publish_options(DOCS_BEGIN, DOCS_END)
def main(clients: tuple[str, ...], sessions: int, as_json: bool, write_docs: bool) -> None:
    """Claude Code, Codex, aider and the OpenAI Agents SDK, unmodified, through kvcellar serve."""
    started = time.perf_counter()
    console = Console() if sys.stdout.isatty() else Console(width=160)
    progress = Console(stderr=True)
    result = run_benchmark(clients, sessions, progress)
    result.update(machine=describe_machine(Path(tempfile.gettempdir())), wall_s=time.perf_counter() - started)
    publish_figures(
        NAME,
        result,
        figures_of(result),
        lambda command, run_date: markdown_section(result, command, run_date),
        write_docs=write_docs,
        as_json=as_json,
        console=console,
        progress=progress,
    )


if __name__ == "__main__":
    main()
