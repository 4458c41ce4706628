"""The four real agent clients, each run non-interactively with its stock settings against a kvcellar
server, for tests/test_agent_clients.py and bench/agents.py (docs/agents.md gives the same setup).

Only what a user pointing the client at kvcellar changes is set: the base URL, a dummy key, the offline
switches and an onboarding file. No `max_tokens` override, no tool list trimmed.

* Claude Code (npm `@anthropic-ai/claude-code`): `claude -p PROMPT --max-turns 3` with
  `ANTHROPIC_BASE_URL`, `ANTHROPIC_API_KEY`, `DISABLE_TELEMETRY=1`,
  `CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1` and `.claude.json` saying onboarding is done.
* Codex CLI (npm `@openai/codex`): `codex exec --skip-git-repo-check PROMPT` with `CODEX_HOME` holding a
  `config.toml` whose provider points at the server (`wire_api = "responses"`), analytics off.
* aider (PyPI `aider-chat`, its own venv): `aider --openai-api-base URL --model openai/demo-coder
  --no-check-update --no-analytics --yes-always --message PROMPT FILE` in a git repository.
* The OpenAI Agents SDK (PyPI `openai-agents`, in-process): a function-tool loop through
  `OpenAIChatCompletionsModel` or `OpenAIResponsesModel`, tracing off.

The npm clients and aider live in `./.agents` (git-ignored), installed by `.ci/install-agents` from the
pins in `.ci/agent-clients.txt`. Every client talks only to 127.0.0.1: a `RecordingProxy` in front of the
server passes each request through unchanged and records its status, because the server's
`/stats/requests` lists only the requests that generated (a rejected one shows only in the proxy).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import http.client
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs
import httpx

from kvcellar.bench.common import wait_until_healthy

REPO_ROOT = Path(__file__).resolve().parent.parent
AGENTS_DIR = REPO_ROOT / ".agents"
CLAUDE_BIN = AGENTS_DIR / "node_modules" / ".bin" / "claude"
CODEX_BIN = AGENTS_DIR / "node_modules" / ".bin" / "codex"
AIDER_BIN = AGENTS_DIR / "aider-venv" / "bin" / "aider"
SERVED_MODEL = "demo-coder"
DUMMY_KEY = "sk-kvcellar-dummy"
CLAUDE_MAX_TURNS = 3
SESSION_TIMEOUT_S = 600
SERVER_START_TIMEOUT_S = 180
# The server's own drain waits up to 120 s (KVCELLAR_SHUTDOWN_TIMEOUT_S) for work in flight.
SERVER_STOP_TIMEOUT_S = 150
ERROR_EXCERPT_CHARS = 600
# The project the CLI agents work in (a git repository): calc.py, whose `add` has a bug, sized like a
# real module (~3k tokens) so that what an agent puts after the user's words (aider repeats its edit-format
# rules there, ~300 tokens) is a realistic share of a prompt, not most of it.
HELPER_NAMES = (
    "mean",
    "median",
    "spread",
    "total",
    "product",
    "smallest",
    "largest",
    "count_positive",
    "count_negative",
    "clamp_all",
    "scale",
    "shift",
    "normalise",
    "running_total",
    "differences",
    "ratios",
    "squares",
    "cubes",
    "absolute",
    "rounded",
    "halves",
    "doubles",
    "reciprocals",
    "signs",
    "even_only",
    "odd_only",
)


def _helper(name: str) -> str:
    return (
        f"def {name}(values: list[float]) -> list[float] | float:\n"
        f'    """The {name.replace("_", " ")} of `values`: see the module docstring for the rules\n'
        f'    every helper here follows (empty input, integers kept as integers, no mutation)."""\n'
        f"    if not values:\n"
        f'        raise ValueError("{name} needs at least one value")\n'
        f"    result = [value for value in values]\n"
        f"    return result\n"
    )


PROJECT_FILES = {
    "calc.py": (
        '"""Tiny arithmetic helpers. Every helper takes a list of numbers, raises ValueError on an empty\n'
        'list, keeps integers as integers and never changes its argument."""\n\n\n'
        "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n\n\n"
        + "\n\n".join(_helper(name) for name in HELPER_NAMES)
    ),
    "README.md": "# calc\n\nTiny arithmetic helpers. `add` has a bug.\n",
}
START_TAG = "start"
AGENT_INSTRUCTIONS = (
    "You are a careful assistant for a small weather service. Answer questions about the weather in a city "
    "by calling the get_weather tool with the city's name, then reply in one short sentence that repeats "
    "the temperature the tool returned. Never guess a temperature yourself, and never call any other tool."
)


@attrs.frozen(kw_only=True)
class Exchange:
    """One request a client sent, as the proxy saw it."""

    method: str
    path: str
    status: int
    # The start of a non-2xx answer's body (the server's error text), else "".
    error_excerpt: str
    # Which conversation a generation request continues ("" for others): a digest of its leading
    # instructions, so aider's commit-message requests are not counted as turns of its edit chat.
    conversation: str = ""
    # For a non-2xx answer: the shape of what the client sent (its turns' types, roles and call ids,
    # no text), so a failure names the offending item; else "".
    request_outline: str = ""
    # The `model` a generation request named ("" for others): which pool model an alias sent it to.
    model: str = ""


@attrs.frozen(kw_only=True)
class ClientRun:
    exit_code: int
    output: str
    duration_s: float


def installed_clients() -> dict[str, Path | None]:
    """Each CLI client's binary, or None when `.ci/install-agents` has not installed it."""
    return {name: (path if path.exists() else None) for name, path in _BINARIES.items()}


_BINARIES = {"claude": CLAUDE_BIN, "codex": CODEX_BIN, "aider": AIDER_BIN}


class _QuietServer(http.server.ThreadingHTTPServer):
    """A client that drops its kept-alive connection is normal here, not a traceback on stderr."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class RecordingProxy:
    """Passes every request through to `upstream` unchanged, the answer streamed back as it comes
    (SSE included), and records each one's method, path and status. The handler threads append to
    `_exchanges` under `_lock`; readers get an immutable snapshot."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self._server = _QuietServer(("127.0.0.1", 0), self._handler_class())
        self._thread = threading.Thread(target=self._server.serve_forever, name="recording-proxy", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def exchanges(self) -> tuple[Exchange, ...]:
        with self._lock:
            return tuple(self._exchanges)

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _record(self, exchange: Exchange) -> None:
        with self._lock:
            self._exchanges.append(exchange)

    def _handler_class(self) -> type[http.server.BaseHTTPRequestHandler]:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "accept-encoding")}
                upstream = http.client.HTTPConnection(*proxy._upstream, timeout=SESSION_TIMEOUT_S)
                upstream.request(self.command, self.path, body=body, headers=headers)
                answer = upstream.getresponse()
                self.send_response(answer.status)
                for name, value in answer.getheaders():
                    if name.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(name, value)
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                kept = 0 if answer.status < 300 else ERROR_EXCERPT_CHARS
                excerpt = _stream_back(answer, self.wfile, keep_chars=kept)
                exchange = Exchange(
                    method=self.command,
                    path=self.path,
                    status=answer.status,
                    error_excerpt=excerpt,
                    conversation=conversation_of(body),
                    request_outline="" if answer.status < 300 else outline_of(body),
                    model=model_of(body),
                )
                proxy._record(exchange)

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = _forward

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: the exchanges are the record."""

        return Handler


def model_of(body: bytes | None) -> str:
    """A JSON request body's `model`, else ""."""
    try:
        model = json.loads(body or b"{}").get("model")
    except (ValueError, AttributeError):
        return ""
    return model if isinstance(model, str) else ""


def conversation_of(body: bytes | None) -> str:
    """A digest of a generation request's leading instructions: Anthropic's `system`, the Responses
    API's `instructions`, else the first message or input item; "" when the body is no JSON object."""
    try:
        request = json.loads(body) if body else None
    except ValueError:
        return ""
    if not isinstance(request, dict):
        return ""
    turns = request.get("messages") or request.get("input") or [None]
    lead = request.get("system") or request.get("instructions") or (turns[0] if isinstance(turns, list) else turns)
    return hashlib.sha256(json.dumps(lead, sort_keys=True).encode()).hexdigest()[:16]


def outline_of(body: bytes | None) -> str:
    """The turns of a generation request without their text: per message or input item its index,
    type or role, and any call id, e.g. `[5] function_call call_id='c1' | [6] function_call_output`."""
    try:
        request = json.loads(body) if body else None
    except ValueError:
        return "(not JSON)"
    turns = request.get("messages") or request.get("input") if isinstance(request, dict) else None
    if not isinstance(turns, list):
        return ""
    parts = []
    for index, turn in enumerate(turns):
        if not isinstance(turn, dict):
            parts.append(f"[{index}] {type(turn).__name__}")
            continue
        ids = " ".join(f"{key}={turn[key]!r}" for key in ("call_id", "tool_call_id", "id") if key in turn)
        parts.append(f"[{index}] {turn.get('type') or turn.get('role')} {ids}".rstrip())
    return " | ".join(parts)


def _stream_back(answer: http.client.HTTPResponse, out: Any, keep_chars: int) -> str:
    """Copies `answer`'s body to `out` as HTTP/1.1 chunks while it arrives; returns its first
    `keep_chars` characters. A client that left mid-stream ends the copy."""
    kept = b""
    while chunk := answer.read1(65536):
        if len(kept) < keep_chars:
            kept += chunk
        try:
            out.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            out.flush()
        except OSError:
            return kept.decode("utf-8", "replace")[:keep_chars]
    try:
        out.write(b"0\r\n\r\n")
        out.flush()
    except OSError:
        pass
    return kept.decode("utf-8", "replace")[:keep_chars]


def make_workspace(root: Path) -> tuple[Path, Path]:
    """A fresh `home` (the clients' config and onboarding files) and `project` (a git repository
    of PROJECT_FILES) under `root`."""
    home, project = root / "home", root / "project"
    home.mkdir(parents=True)
    project.mkdir()
    for name, text in PROJECT_FILES.items():
        (project / name).write_text(text)
    git = ["git", "-c", "user.name=kvcellar", "-c", "user.email=kvcellar@localhost"]
    subprocess.run([*git, "init", "-q", "-b", "main"], cwd=project, check=True)
    subprocess.run([*git, "add", "."], cwd=project, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "start"], cwd=project, check=True)
    subprocess.run([*git, "tag", START_TAG], cwd=project, check=True)
    # Claude Code: onboarding done, so `-p` asks nothing (both places it reads the file from).
    onboarding = json.dumps({"hasCompletedOnboarding": True, "lastOnboardingVersion": "2.1.197"})
    (home / ".claude").mkdir()
    (home / ".claude" / ".claude.json").write_text(onboarding)
    (home / ".claude.json").write_text(onboarding)
    return home, project


def reset_project(project: Path) -> None:
    """Back to the first commit (aider commits its edits), so a second session starts from the same
    files as the first."""
    subprocess.run(["git", "reset", "-q", "--hard", START_TAG], cwd=project, check=True)
    subprocess.run(["git", "clean", "-q", "-fdx"], cwd=project, check=True)


def _base_env(home: Path) -> dict[str, str]:
    """Only PATH and locale from the caller: no real key or proxy setting leaks into a client."""
    kept = {name: os.environ[name] for name in ("PATH", "LANG", "LC_ALL", "TMPDIR") if name in os.environ}
    return {**kept, "HOME": str(home), "NO_COLOR": "1"}


def _run(command: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> ClientRun:
    started = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as timeout:
        output = timeout.output if isinstance(timeout.output, str) else ""
        return ClientRun(exit_code=-1, output=f"{output}\n(timed out after {timeout_s} s)", duration_s=timeout_s)
    return ClientRun(exit_code=done.returncode, output=done.stdout + done.stderr, duration_s=time.monotonic() - started)


# Claude Code names its small model in its background calls (a session's title) only when
# ANTHROPIC_DEFAULT_HAIKU_MODEL is set (or ANTHROPIC_SMALL_FAST_MODEL, or the key is shaped like
# Anthropic's own); otherwise they name the main model. Its "nonessential traffic" switch turns them off
# altogether, so `background_calls` leaves that switch unset and turns telemetry, error reports, the
# updater and the bug command off one by one instead.
CLAUDE_BACKGROUND_MODEL = "claude-haiku-4-5"


def claude_session(
    base_url: str, home: Path, project: Path, prompt: str, *, resume: bool = False, background_calls: bool = False
) -> ClientRun:
    """`claude -p PROMPT --max-turns 3`; `resume` continues the project's last conversation (`-c`);
    `background_calls` lets it send its background calls under `CLAUDE_BACKGROUND_MODEL`."""
    quiet = {"DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    if background_calls:
        quiet = {
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_BUG_COMMAND": "1",
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": CLAUDE_BACKGROUND_MODEL,
        }
    env = {
        **_base_env(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": DUMMY_KEY,
        **quiet,
    }
    command = [str(CLAUDE_BIN), *(["-c"] if resume else []), "-p", prompt, "--max-turns", str(CLAUDE_MAX_TURNS)]
    return _run(command, project, env, SESSION_TIMEOUT_S)


CODEX_CONFIG = """\
model = "{model}"
model_provider = "kvcellar"
check_for_update_on_startup = false

[model_providers.kvcellar]
name = "kvcellar"
base_url = "{base_url}/v1"
env_key = "KVCELLAR_API_KEY"
wire_api = "responses"

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"
"""


def codex_session(base_url: str, home: Path, project: Path, prompt: str, *, resume: bool = False) -> ClientRun:
    """`codex exec PROMPT`; `resume` continues the last session (`codex exec resume --last PROMPT`)."""
    codex_home = home / ".codex"
    codex_home.mkdir(exist_ok=True)
    (codex_home / "config.toml").write_text(CODEX_CONFIG.format(model=SERVED_MODEL, base_url=base_url))
    env = {**_base_env(home), "CODEX_HOME": str(codex_home), "KVCELLAR_API_KEY": DUMMY_KEY}
    command = [str(CODEX_BIN), "exec", "--skip-git-repo-check", *(["resume", "--last"] if resume else []), prompt]
    return _run(command, project, env, SESSION_TIMEOUT_S)


def aider_session(base_url: str, home: Path, project: Path, prompt: str) -> ClientRun:
    # litellm (inside aider) fetches its model price list from GitHub unless told to use its own copy.
    env = {**_base_env(home), "OPENAI_API_KEY": DUMMY_KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    command = [
        str(AIDER_BIN),
        "--openai-api-base",
        f"{base_url}/v1",
        "--model",
        f"openai/{SERVED_MODEL}",
        "--no-check-update",
        "--no-analytics",
        "--yes-always",
        "--message",
        prompt,
        "calc.py",
    ]
    return _run(command, project, env, SESSION_TIMEOUT_S)


@attrs.frozen(kw_only=True)
class AgentsRun:
    tool_calls: int
    final_output: str
    duration_s: float


def agents_sdk_session(base_url: str, prompt: str, api: str, follow_up: str | None = None) -> AgentsRun:
    """One Agents SDK run of a `get_weather` function-tool loop; `api` is "chat" or "responses".
    `follow_up`: a second user turn on the same conversation (the first run's items, then it)."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        ToolCallOutputItem,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI
    from openai.types.responses import EasyInputMessageParam

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"The weather in {city} is sunny, 21 C."

    async def run() -> AgentsRun:
        started = time.monotonic()
        set_tracing_disabled(True)
        client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=DUMMY_KEY)
        model_class = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
        model = model_class(model=SERVED_MODEL, openai_client=client)
        # Greedy: at the server's default temperature (1.0) the demo model sometimes kept calling the tool
        # past the SDK's turn bound (one CI run in several); greedy replies are the same every run.
        settings = ModelSettings(temperature=0.0)
        agent = Agent(
            name="weather", instructions=AGENT_INSTRUCTIONS, tools=[get_weather], model=model, model_settings=settings
        )
        result = await Runner.run(agent, prompt, max_turns=4)
        outputs = sum(isinstance(item, ToolCallOutputItem) for item in result.new_items)
        if follow_up is not None:
            turn: EasyInputMessageParam = {"role": "user", "content": follow_up}
            history = [*result.to_input_list(), turn]
            result = await Runner.run(agent, history, max_turns=4)
            outputs += sum(isinstance(item, ToolCallOutputItem) for item in result.new_items)
        await client.close()
        return AgentsRun(
            tool_calls=outputs, final_output=str(result.final_output), duration_s=time.monotonic() - started
        )

    return asyncio.run(run())


@contextlib.contextmanager
def served_stock(log_path: Path) -> Iterator[str]:
    """`kvcellar serve` with its defaults (the demo model) on a free 127.0.0.1 port, its log in
    `log_path`; yields its base URL. Only the port is set: the clients meet the server a user starts."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvcellar.cli", "serve", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        try:
            wait_until_healthy(
                process, base, timeout_s=SERVER_START_TIMEOUT_S, output=lambda: log_path.read_text()[-2000:]
            )
            yield base
        finally:
            stop_server(process)


def stop_server(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, as a user's Ctrl-C; a server still running after SERVER_STOP_TIMEOUT_S is killed (so
    no orphan outlives a test) and reported: shutdown must never wait that long."""
    process.terminate()
    try:
        process.wait(timeout=SERVER_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise RuntimeError(f"kvcellar serve did not stop within {SERVER_STOP_TIMEOUT_S} s of SIGTERM") from None


def last_request_seq(server_url: str) -> int:
    return int(httpx.get(f"{server_url}/stats/requests", timeout=30).json()["last_seq"])


def requests_after(server_url: str, after_seq: int) -> list[dict[str, Any]]:
    """The server's records of the requests that finished after `after_seq`, oldest first."""
    answer = httpx.get(f"{server_url}/stats/requests", params={"after_seq": after_seq}, timeout=30).json()
    return sorted(answer["requests"], key=lambda record: record["seq"])


@attrs.frozen(kw_only=True)
class Session:
    """One client session as the proxy and the server saw it."""

    exit_code: int
    output: str
    duration_s: float
    exchanges: tuple[Exchange, ...]
    # /stats/requests records of the requests it generated, in order.
    requests: tuple[dict[str, Any], ...]

    @property
    def non_2xx(self) -> tuple[Exchange, ...]:
        return tuple(exchange for exchange in self.exchanges if not 200 <= exchange.status < 300)

    @property
    def first_request_share(self) -> float | None:
        """The share of the session's first prompt that came from the cache."""
        return cached_share(self.requests[:1])

    @property
    def later_turns_share(self) -> float | None:
        """The share of turns 2+'s prompt tokens that came from the cache."""
        return cached_share(self.later_turns())

    def later_turns(self) -> tuple[dict[str, Any], ...]:
        """The records of requests that continue a conversation an earlier request of the session
        started (same leading instructions). The successful generation requests pair with the
        server's records in order (each client here sends one request at a time); when they do not
        pair, every request after the first counts."""
        generated = [
            exchange for exchange in self.exchanges if exchange.method == "POST" and 200 <= exchange.status < 300
        ]
        if len(generated) != len(self.requests):
            return self.requests[1:]
        seen: set[str] = set()
        later = []
        for exchange, record in zip(generated, self.requests, strict=True):
            if exchange.conversation in seen:
                later.append(record)
            seen.add(exchange.conversation)
        return tuple(later)


def cached_share(records: tuple[dict[str, Any], ...]) -> float | None:
    prompt = sum(record["prompt_tokens"] for record in records)
    return sum(record["cached_tokens"] for record in records) / prompt if prompt else None


def recorded_session(
    proxy: RecordingProxy, server_url: str, run: Callable[[], ClientRun | AgentsRun]
) -> tuple[Session, ClientRun | AgentsRun]:
    """Runs one client session through `proxy` and collects what it sent and what the server recorded."""
    exchanges_before, seq_before = len(proxy.exchanges()), last_request_seq(server_url)
    outcome = run()
    session = Session(
        exit_code=outcome.exit_code if isinstance(outcome, ClientRun) else 0,
        output=outcome.output if isinstance(outcome, ClientRun) else outcome.final_output,
        duration_s=outcome.duration_s,
        exchanges=proxy.exchanges()[exchanges_before:],
        requests=tuple(requests_after(server_url, seq_before)),
    )
    return session, outcome


def describe(session: Session) -> str:
    """What an assertion message needs: exit code, non-2xx requests with the server's text, output tail."""
    failures = "; ".join(
        f"{e.method} {e.path} -> {e.status} {e.error_excerpt} (sent: {e.request_outline})" for e in session.non_2xx
    )
    return f"exit {session.exit_code}; non-2xx: [{failures}]; output tail: {session.output[-1500:]}"
