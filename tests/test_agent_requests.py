"""What agents send is accepted, clamped and rewritten (issue 38 items 1, 2; docs/agents.md).

Real request bodies of Claude Code 2.1.197, Codex 0.171, aider 0.86 and the
OpenAI Agents SDK 0.20 (tests/fixtures/agent_requests, captured by a
recording proxy; README.txt there) are parsed as the server parses them, and
the behaviours they need are driven end to end through the official
`anthropic` and `openai` SDKs against a real hypercorn server over the
tool-capable random-weight demo model (8192-token context).
"""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import attrs
import httpx
import openai
import pytest
from click.testing import CliRunner
from test_http_errors import InProcessServer

from kvcellar.actors.system import SystemConfig
from kvcellar.cli.serve import serve_command
from kvcellar.engine.engine import _load
from kvcellar.errors import HostedToolRefused
from kvcellar.http.anthropic import parse_messages_body
from kvcellar.http.app import HttpSettings
from kvcellar.http.inbound import MAX_TOKENS_LIMIT, InboundPolicy
from kvcellar.http.parsing import parse_body
from kvcellar.http.responses import parse_responses_body
from kvcellar.http.tool_grammar import ToolGrammarPolicy

FIXTURES = Path(__file__).parent / "fixtures" / "agent_requests"
CAPTURES = sorted(path for path in FIXTURES.glob("*.json") if json.loads(path.read_text())["method"] == "POST")
MODEL = "claude-any-name"
SYSTEM = "You are a careful coding agent. Read files before editing them. " * 6
BILLING = "x-anthropic-billing-header: cc_version=2.1.197.{}; cc_entrypoint=sdk-cli;{}"


@pytest.fixture(scope="module", params=[1, 2], ids=["serial", "batch"])
def served(request, tools_model_dir):
    with InProcessServer(SystemConfig(model_dir=tools_model_dir, batch_rows_max=request.param)) as server:
        yield server


@pytest.fixture(scope="module")
def large_context_model(tools_model_dir):
    """The demo model as the parsers see it, with a context that holds Claude Code's whole first prompt."""
    return attrs.evolve(_load(tools_model_dir), context_tokens_max=1_000_000)


def _claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base, api_key="unused", max_retries=0, timeout=120)


def _openai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=120)


def _last_record(server) -> dict:
    return httpx.get(f"{server.base}/stats/requests", timeout=30).json()["requests"][-1]


def _parse_capture(path: Path, loaded, policy: InboundPolicy):
    capture = json.loads(path.read_text())
    body = capture["body"]
    if not capture["path"].startswith("/v1/messages"):
        # The clients were set up to name the served model (Codex's stock model name is another's).
        body["model"] = loaded.model_dir.name
    raw = json.dumps(body).encode()
    grammar = ToolGrammarPolicy()
    if capture["path"].startswith("/v1/messages"):
        return parse_messages_body(raw, loaded, tool_grammar=grammar, inbound=policy).request
    if capture["path"] == "/v1/responses":
        parsed = parse_responses_body(raw, loaded, max_tokens_default=256, tool_grammar=grammar, inbound=policy)
        return parsed.job.request
    return parse_body(raw, loaded, chat=True, tool_grammar=grammar, inbound=policy).request


# -- every captured body is accepted --------------------------------------------------


@pytest.mark.parametrize("path", CAPTURES, ids=[path.stem for path in CAPTURES])
def test_every_captured_body_is_accepted(path, large_context_model):
    request = _parse_capture(path, large_context_model, InboundPolicy())
    assert request.prompt_ids and 1 <= request.params.max_tokens <= MAX_TOKENS_LIMIT


def test_claude_codes_first_request_is_clamped_relaxed_and_normalised(large_context_model):
    request = _parse_capture(FIXTURES / "claude-code-2.json", large_context_model, InboundPolicy())
    notes = request.notes
    assert notes.max_tokens_requested == 64000 and request.params.max_tokens == MAX_TOKENS_LIMIT
    assert notes.schema_keywords_relaxed == ("propertyNames",)
    assert request.logits_processors, "the tool-call grammar must stay on, relaxed"
    assert notes.prompt_rewrites == ("claude_code_billing_header",)


def test_claude_code_sessions_share_their_prompt_once_normalised(large_context_model):
    """The two sessions' first requests differ in their prompt, but the long system prompt and tools
    before it are the same: with the header normalised the shared prefix is most of the prompt."""
    first = _parse_capture(FIXTURES / "claude-code-2.json", large_context_model, InboundPolicy())
    second = _parse_capture(FIXTURES / "claude-code-4.json", large_context_model, InboundPolicy())
    raw = _parse_capture(FIXTURES / "claude-code-4.json", large_context_model, InboundPolicy(prompt_normalize=False))
    assert _shared(first.prompt_ids, second.prompt_ids) >= 0.9 * len(second.prompt_ids)
    assert _shared(first.prompt_ids, raw.prompt_ids) < 0.01 * len(raw.prompt_ids)


def test_codex_hosted_tools_are_left_out_or_refused(large_context_model):
    request = _parse_capture(FIXTURES / "codex-1.json", large_context_model, InboundPolicy())
    assert request.notes.hosted_tools_left_out == ("multi_agent_v1", "web_search")
    with pytest.raises(HostedToolRefused, match="'namespace' tool") as refused:
        _parse_capture(FIXTURES / "codex-1.json", large_context_model, InboundPolicy(hosted_tools="reject"))
    assert refused.value.param == "tools[4]"


def _shared(left, right) -> int:
    shared = 0
    for a, b in zip(left, right, strict=False):
        if a != b:
            break
        shared += 1
    return shared


# -- through the SDKs --------------------------------------------------------------


def test_root_answers_head_and_get(served):
    assert httpx.head(f"{served.base}/", timeout=30).status_code == 200
    index = httpx.get(f"{served.base}/", timeout=30).json()
    assert index["dashboard"] == "/dashboard" and "/v1/messages" in index["apis"]


def test_max_tokens_past_the_context_is_clamped_and_recorded(served):
    reply = _claude(served).messages.create(
        model=MODEL, max_tokens=64000, messages=[{"role": "user", "content": "hi"}], stop_sequences=["e"]
    )
    assert reply.type == "message"
    record = _last_record(served)
    assert record["notes"]["max_tokens_requested"] == 64000 and record["notes"]["api"] == "messages"
    stats = httpx.get(f"{served.base}/stats", timeout=30).json()
    assert stats["inbound"]["max_tokens_clamped"] >= 1


def test_a_prompt_past_the_context_is_refused_in_each_apis_words(served):
    long_text = "lorem ipsum dolor sit amet " * 3000
    with pytest.raises(anthropic.BadRequestError) as refused:
        _claude(served).messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": long_text}])
    message = refused.value.body["error"]["message"]
    prompt_tokens = int(message.split()[4])
    assert message == f"prompt is too long: {prompt_tokens} tokens > 8191 maximum"
    with pytest.raises(openai.BadRequestError) as too_long:
        _openai(served).chat.completions.create(model="llama-tools", messages=[{"role": "user", "content": long_text}])
    assert too_long.value.code == "context_length_exceeded" and too_long.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as too_long_input:
        _openai(served).responses.create(model="llama-tools", input=long_text)
    assert too_long_input.value.code == "context_length_exceeded" and too_long_input.value.param == "input"


def test_system_messages_anywhere_are_rendered(served):
    """Claude Code sends `[user, system]`; the demo template (Qwen3-style) renders a system turn anywhere."""
    client = _claude(served)
    user = {"role": "user", "content": "list the files"}
    inner = {"role": "system", "content": "Available agents: general-purpose, Explore."}
    alone = client.messages.count_tokens(model=MODEL, messages=[user]).input_tokens
    both = client.messages.count_tokens(model=MODEL, messages=[user, inner]).input_tokens
    assert both > alone
    reply = client.messages.create(model=MODEL, max_tokens=4, system=SYSTEM, messages=[user, inner])
    assert reply.type == "message"
    chat = _openai(served).chat.completions.create(
        model="llama-tools", max_tokens=4, messages=[{"role": "user", "content": "hi"}, inner]
    )
    assert chat.choices[0].message.role == "assistant"


def test_an_anthropic_server_tool_is_left_out_and_recorded(served):
    tools = [
        {"name": "Bash", "description": "Run a command.", "input_schema": {"type": "object", "properties": {}}},
        {"type": "web_search_20250305", "name": "web_search"},
    ]
    reply = _claude(served).messages.create(
        model=MODEL, max_tokens=4, tools=tools, messages=[{"role": "user", "content": "search"}]
    )
    assert reply.type == "message"
    assert _last_record(served)["notes"]["hosted_tools_left_out"] == ["web_search"]


@pytest.mark.parametrize("cch", ["", " cch=1a2b3;"])
def test_two_sessions_differing_only_in_the_billing_header_share_the_cache(served, cch):
    """The second session's prompt is read from the cache (usage), and /stats counts the rewrites."""
    client = _claude(served)
    question = [{"role": "user", "content": f"what does notes{len(cch)}.txt say?"}]

    def session(suffix: str):
        system = [{"type": "text", "text": BILLING.format(suffix, cch)}, {"type": "text", "text": SYSTEM}]
        return client.messages.create(model=MODEL, max_tokens=4, system=system, messages=question)

    session("8a5")
    second = session("191").usage
    prompt_tokens = second.input_tokens + second.cache_read_input_tokens
    assert second.cache_read_input_tokens >= 0.9 * prompt_tokens
    rewrites = httpx.get(f"{served.base}/stats", timeout=30).json()["inbound"]["prompt_rewrites"]
    assert rewrites["claude_code_billing_header"] >= 2
    metrics = httpx.get(f"{served.base}/metrics", timeout=30).text
    counted = float(rewrites["claude_code_billing_header"])
    assert f'kvcellar_inbound_prompt_rewrites_total{{rule="claude_code_billing_header"}} {counted}' in metrics


def test_every_reply_carries_the_cache_header(served):
    client, chat = _claude(served), _openai(served)
    question = [{"role": "user", "content": "Say something about caches, please."}]
    chat.chat.completions.create(model="llama-tools", max_tokens=2, messages=question)
    raw = chat.chat.completions.with_raw_response.create(model="llama-tools", max_tokens=2, messages=question)
    tier, reused, prompt = (part.split("=")[1] for part in raw.headers["x-kvcellar-cache"].split("; "))
    usage = raw.parse().usage
    assert tier == "ram" and int(reused) == usage.prompt_tokens_details.cached_tokens > 0
    assert int(prompt) == usage.prompt_tokens
    headers = [
        client.messages.with_raw_response.create(model=MODEL, max_tokens=2, messages=question).headers,
        chat.responses.with_raw_response.create(model="llama-tools", max_output_tokens=2, input="hi").headers,
        chat.completions.with_raw_response.create(model="llama-tools", max_tokens=2, prompt="hi").headers,
    ]
    assert all(header["x-kvcellar-cache"].startswith("tier=") for header in headers)
    with client.messages.with_streaming_response.create(
        model=MODEL, max_tokens=2, messages=question, stream=True
    ) as streamed:
        assert streamed.headers["x-kvcellar-cache"].startswith("tier=pending; reused=pending; prompt=")


def test_the_divergence_point_is_recorded_and_its_text_withheld_without_an_admin_token(served):
    client = _claude(served)
    client.messages.create(
        model=MODEL, max_tokens=2, system=SYSTEM + "Alpha.", messages=[{"role": "user", "content": "a"}]
    )
    client.messages.create(
        model=MODEL, max_tokens=2, system=SYSTEM + "Omega.", messages=[{"role": "user", "content": "a"}]
    )
    divergence = _last_record(served)["cache_divergence"]
    assert divergence["at_tokens"] > 20 and divergence["tier"] == "ram"
    assert "prompt_next" not in divergence and "prompt_next_ids" not in divergence
    assert "admin-token" in divergence["excerpts"]


def test_admins_see_the_excerpts_at_the_divergence_point(tools_model_dir):
    settings = HttpSettings(admin_token="sesame")
    with InProcessServer(SystemConfig(model_dir=tools_model_dir), settings=settings) as server:
        client = _claude(server)
        for ending in ("Alpha.", "Omega."):
            client.messages.create(
                model=MODEL, max_tokens=2, system=SYSTEM + ending, messages=[{"role": "user", "content": "a"}]
            )
        auth = {"Authorization": "Bearer sesame"}
        records = httpx.get(f"{server.base}/stats/requests", headers=auth, timeout=30).json()["requests"]
        divergence = records[-1]["cache_divergence"]
        assert "Omega" in divergence["prompt_next"] and "Alpha" in divergence["cached_next"]
        assert divergence["shared_before"].strip()
        assert httpx.get(f"{server.base}/stats/requests", timeout=30).status_code == 401


def test_hosted_tools_reject_keeps_the_400(tools_model_dir):
    settings = HttpSettings(hosted_tools="reject")
    with InProcessServer(SystemConfig(model_dir=tools_model_dir), settings=settings) as server:
        with pytest.raises(anthropic.BadRequestError) as refused:
            _claude(server).messages.create(
                model=MODEL,
                max_tokens=4,
                tools=[{"type": "bash_20250124", "name": "bash"}],
                messages=[{"role": "user", "content": "ls"}],
            )
        assert "tools[0].type is a 'bash_20250124' tool" in refused.value.body["error"]["message"]
        with pytest.raises(openai.BadRequestError) as refused_openai:
            _openai(server).responses.create(model="llama-tools", input="hi", tools=[{"type": "web_search"}])
        assert refused_openai.value.param == "tools[0]"


def test_serve_names_the_two_switches():
    text = CliRunner().invoke(serve_command, ["--help"], terminal_width=200).output
    assert "--hosted-tools [omit|reject]" in text and "--prompt-normalize [on|off]" in text


def test_replayed_function_items_without_call_id_pair_up(large_context_model):
    """Codex's `exec resume` replays its history; an item that lost its `call_id` still pairs
    with its call (the output answers the latest unanswered call), as if the ids were sent."""

    def parse(items: list[dict]) -> list[int]:
        body = {"model": large_context_model.model_dir.name, "input": items}
        raw = json.dumps(body).encode()
        return parse_responses_body(raw, large_context_model, max_tokens_default=16).job.request.prompt_ids

    question = {"role": "user", "content": "List the files."}
    call = {"type": "function_call", "name": "exec_command", "arguments": '{"cmd": "ls"}'}
    output = {"type": "function_call_output", "output": "notes.txt"}
    with_ids = parse([question, {**call, "call_id": "call_input_1"}, {**output, "call_id": "call_input_1"}])
    assert parse([question, call, output]) == with_ids
    assert parse([question, {**call, "id": "fc_1"}, output]) == parse(
        [question, {**call, "call_id": "fc_1"}, {**output, "call_id": "fc_1"}]
    )
