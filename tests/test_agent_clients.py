"""The real agent clients, unmodified, against a real `kvcellar serve` of the demo model on 127.0.0.1
(issue 38 item 6): Claude Code, Codex, aider and the OpenAI Agents SDK each run two sessions with
different prompts and their stock settings; only the base URL, a dummy key, the offline switches and an
onboarding file change (bench/agent_clients.py holds the setup, docs/agents.md documents it).

Every request must be 2xx (a recording proxy in front of the server sees each one; the server's
/stats/requests lists only those that generated), every client must exit 0, and the second session's
first request must read >= 0.9 of its prompt from the cache (/stats/requests). A client that
`.ci/install-agents` has not installed is skipped, except under CI=true, where it fails.

These are the suite's longest tests; tests/conftest.py hands them out first.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from polling import wait_until_sync
from test_model_pool_serve import PoolServer

from kvcellar.bench import agent_clients
from kvcellar.bench.agent_clients import RecordingProxy, Session, describe, recorded_session
from kvcellar.engine.demo_models import packaged_demo_coder_dir

CROSS_SESSION_SHARE_MIN = 0.9


def require_client(name: str) -> None:
    if agent_clients.installed_clients()[name] is not None:
        return
    reason = f"the real client {name!r} is not installed: run .ci/install-agents (pins in .ci/agent-clients.txt)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"under CI every agent client must run; {reason}")
    pytest.skip(reason)


@pytest.fixture
def served(tmp_path) -> Iterator[tuple[RecordingProxy, str]]:
    """A real `kvcellar serve` with its defaults (the demo model), and a recording proxy in front of it."""
    with agent_clients.served_stock(tmp_path / "serve.log") as server_url, RecordingProxy(server_url) as proxy:
        yield proxy, server_url


def assert_session_passed(session: Session) -> None:
    assert session.exit_code == 0, describe(session)
    assert not session.non_2xx, describe(session)
    assert session.requests, f"the server recorded no request: {describe(session)}"


def assert_second_session_reused(second: Session) -> None:
    first_record = second.requests[0]
    assert second.first_request_share is not None
    assert second.first_request_share >= CROSS_SESSION_SHARE_MIN, (
        f"the second session's first request read {first_record['cached_tokens']} of "
        f"{first_record['prompt_tokens']} prompt tokens from the cache: {first_record}"
    )


def test_claude_code_runs_two_sessions_and_the_second_reads_its_prompt_from_the_cache(served, tmp_path):
    require_client("claude")
    proxy, server_url = served
    home, project = agent_clients.make_workspace(tmp_path / "agent")
    sessions = []
    for prompt in ("List the files in this project.", "What does calc.py define? Answer in one sentence."):
        run = lambda prompt=prompt: agent_clients.claude_session(proxy.base_url, home, project, prompt)  # noqa: E731
        session, _ = recorded_session(proxy, server_url, run)
        assert_session_passed(session)
        sessions.append(session)
    assert_second_session_reused(sessions[1])


def test_claude_codes_background_calls_reach_the_small_model_through_a_haiku_alias(model_dir_factory, tmp_path):
    """Issue 41: a pool with Claude Code's two model names. Its main request (`claude-opus-*`) goes to
    the demo-coder through `claude-*`, its background call (the session's title, under
    ANTHROPIC_DEFAULT_HAIKU_MODEL's name) to the tiny llama through `claude-haiku-*`, listed first."""
    require_client("claude")
    small_dir = model_dir_factory("llama")
    models_toml = (
        f'[models.small]\npath = "{small_dir}"\naliases = ["claude-haiku-*"]\n'
        f'[models.coder]\npath = "{packaged_demo_coder_dir()}"\naliases = ["claude-*"]\npin = true\n'
    )
    server = PoolServer(models_toml, tmp_path)
    try:
        with RecordingProxy(server.base) as proxy:
            home, project = agent_clients.make_workspace(tmp_path / "agent")
            run = lambda: agent_clients.claude_session(  # noqa: E731
                proxy.base_url, home, project, "Say hello in one word.", background_calls=True
            )
            session, _ = recorded_session(proxy, f"{server.base}/models/coder", run)
            assert_session_passed(session)
            sent = {e.model for e in session.exchanges if e.method == "POST"}
            assert any(name.startswith("claude-") and "haiku" not in name for name in sent), sent
            assert server.models()["coder"]["requests"] >= 1
            # The title call runs beside the main request and may still be generating when the client
            # exits (the proxy records an exchange once its answer ends): the pool counts it on arrival.
            wait_until_sync(lambda: server.models()["small"]["requests"] >= 1, what="a request reached small")
    finally:
        server.stop()


MODEL_CUT_MARK = "Incomplete response returned, reason: max_output_tokens"


def _model_cut_its_reply(session: Session) -> bool:
    """Codex exited because the demo model's reply ran into the server's default reply bound (Codex
    sends no `max_output_tokens`; `--max-tokens`, 256): every request was 2xx and the server's answer
    was a well-formed `incomplete`. The tiny model does that on a few prompts in a hundred (its tool
    call rambles), and which prompts depends on the workspace path and the date in Codex's prompt."""
    return bool(session.exit_code and not session.non_2xx and MODEL_CUT_MARK in session.output)


def _codex_pair(proxy: RecordingProxy, server_url: str, root) -> list[Session]:
    home, project = agent_clients.make_workspace(root)
    sessions = []
    for prompt in ("List the files in this directory.", "Show what calc.py contains."):
        run = lambda prompt=prompt: agent_clients.codex_session(proxy.base_url, home, project, prompt)  # noqa: E731
        session, _ = recorded_session(proxy, server_url, run)
        sessions.append(session)
        if session.exit_code:
            break
    return sessions


def test_codex_runs_two_sessions_and_the_second_reads_its_prompt_from_the_cache(served, tmp_path):
    """A pair the model itself cut short (see `_model_cut_its_reply`) is run once more in a fresh
    workspace, whose path changes the prompt; anything else fails at once."""
    require_client("codex")
    proxy, server_url = served
    sessions = _codex_pair(proxy, server_url, tmp_path / "agent")
    if _model_cut_its_reply(sessions[-1]):
        print(f"codex: the demo model cut its reply; rerun in a fresh workspace: {describe(sessions[-1])[:300]}")
        sessions = _codex_pair(proxy, server_url, tmp_path / "agent-rerun")
    for session in sessions:
        assert_session_passed(session)
    assert_second_session_reused(sessions[1])


def test_aider_edit_loop_completes_twice_and_the_second_reads_its_prompt_from_the_cache(served, tmp_path):
    require_client("aider")
    proxy, server_url = served
    home, project = agent_clients.make_workspace(tmp_path / "agent")
    sessions = []
    for prompt in ("Fix the bug in add in calc.py.", "Add a docstring to mul in calc.py."):
        agent_clients.reset_project(project)
        run = lambda prompt=prompt: agent_clients.aider_session(proxy.base_url, home, project, prompt)  # noqa: E731
        session, _ = recorded_session(proxy, server_url, run)
        assert_session_passed(session)
        # The edit loop: aider sent the file and the request, and got the model's edit back.
        edits = [e for e in session.exchanges if e.method == "POST" and e.path.startswith("/v1/chat/completions")]
        assert edits, describe(session)
        sessions.append(session)
    assert_second_session_reused(sessions[1])


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_agents_sdk_function_tool_loop_completes_twice_and_the_second_reads_its_prompt_from_the_cache(served, api):
    try:
        import agents  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("under CI the OpenAI Agents SDK must be installed (the dev extra holds openai-agents)")
        pytest.skip("openai-agents is not installed: pip install -e '.[dev]'")
    proxy, server_url = served
    sessions = []
    for prompt in ("What is the weather in Paris?", "How warm is it in Oslo right now?"):
        session, outcome = recorded_session(
            proxy, server_url, lambda prompt=prompt: agent_clients.agents_sdk_session(proxy.base_url, prompt, api)
        )
        assert not session.non_2xx, describe(session)
        assert isinstance(outcome, agent_clients.AgentsRun)
        assert outcome.tool_calls >= 1, f"the model never called get_weather: {outcome.final_output!r}"
        assert outcome.final_output
        sessions.append(session)
    assert_second_session_reused(sessions[1])
