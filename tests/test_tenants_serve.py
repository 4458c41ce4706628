"""Tenants through a real server (issue 39 part 1): hypercorn on 127.0.0.1, the
official openai and anthropic SDKs. A tenant's cached prefixes are invisible to
another tenant and to another `cache_salt`; unknown keys get each API's 401;
/stats and /metrics break the tiers down by tenant name and never show a key.
Every assertion is on `usage` and the tier counters, never on timing."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from test_http_errors import InProcessServer

from kvcellar.actors.system import SystemConfig
from kvcellar.http.app import HttpSettings
from kvcellar.store.tenants import parse_tenants

TENANTS = """
[tenants.alice]
api_keys = ["sk-alice-secret"]
ram_gb = 1

[tenants.bob]
api_keys = ["sk-bob-secret"]

[tenants.common]
api_keys = ["sk-common-secret"]
shared = true
"""
KEYS = ("sk-alice-secret", "sk-bob-secret", "sk-common-secret")
ADMIN = "root-token"
MODEL_ID = "llama-tiny-float32"  # the served model's directory name (GET /v1/models)
PROMPT = [{"role": "user", "content": "Tell me which cellar keeps the prefixes of every tenant apart, and why."}]


@pytest.fixture(scope="module")
def server(model_dir_factory):
    tenants = parse_tenants(TENANTS)
    config = SystemConfig(model_dir=model_dir_factory("llama"), tenants=tenants)
    with InProcessServer(config, settings=HttpSettings(tenants=tenants, admin_token=ADMIN)) as running:
        yield running


def _client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=key, max_retries=0)


def _cached(client: openai.OpenAI, messages=PROMPT, **extra) -> int:
    reply = client.chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=2, temperature=0, extra_body=extra or None
    )
    return reply.usage.prompt_tokens_details.cached_tokens


def _ram_by_tenant(server) -> dict:
    stats = httpx.get(f"{server.base}/stats", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    assert stats.status_code == 200
    return stats.json()["prompt_cache"]["by_tenant"]


def test_another_tenant_never_hits_a_tenants_prefix(server):
    alice, bob = _client(server, KEYS[0]), _client(server, KEYS[1])
    messages = [{"role": "user", "content": "Alice asks about her private prefix: " + "cellar " * 20}]
    # The same salt for both: fresh namespaces (the chat template's opening tokens are a tenant's
    # own history too), and proof that a salt never joins two tenants.
    fresh = {"cache_salt": "tenant-test"}
    before = _ram_by_tenant(server)
    assert _cached(alice, messages, **fresh) == 0
    assert _cached(alice, messages, **fresh) > 0
    assert _cached(bob, messages, **fresh) == 0
    after = _ram_by_tenant(server)
    assert after["alice"]["hits"] == before.get("alice", {}).get("hits", 0) + 1
    assert after["bob"]["hits"] == before.get("bob", {}).get("hits", 0)
    assert after["bob"]["cached_tokens"] == before.get("bob", {}).get("cached_tokens", 0)
    # Anthropic's SDK, x-api-key: Bob's Messages request does not read Alice's entries either.
    bob_messages = anthropic.Anthropic(base_url=server.base, api_key=KEYS[1], max_retries=0)
    reply = bob_messages.messages.create(model=MODEL_ID, max_tokens=2, messages=[{"role": "user", "content": "x" * 5}])
    assert reply.usage.output_tokens >= 1


def test_cache_salt_splits_a_tenants_namespace(server):
    alice = _client(server, KEYS[0])
    messages = [{"role": "user", "content": "Salted question, kept apart from the unsalted one: " + "vault " * 20}]
    _cached(alice, messages)
    assert _cached(alice, messages) > 0
    assert _cached(alice, messages, cache_salt="team-1") == 0
    assert _cached(alice, messages, cache_salt="team-1") > 0
    assert _cached(alice, messages, cache_salt="team-2") == 0


@pytest.mark.parametrize("salt", ["", 42, ["s"]])
def test_a_bad_cache_salt_is_a_400_naming_it(server, salt):
    alice = _client(server, KEYS[0])
    with pytest.raises(openai.BadRequestError) as refused:
        _cached(alice, PROMPT, cache_salt=salt)
    assert refused.value.body["param"] == "cache_salt"
    completions = httpx.post(
        f"{server.base}/v1/completions",
        json={"prompt": "hi", "max_tokens": 1, "cache_salt": salt},
        headers={"Authorization": f"Bearer {KEYS[0]}"},
        timeout=60,
    )
    assert completions.status_code == 400 and completions.json()["error"]["param"] == "cache_salt"
    messages = anthropic.Anthropic(base_url=server.base, api_key=KEYS[0], max_retries=0)
    with pytest.raises(anthropic.BadRequestError):
        messages.messages.create(model=MODEL_ID, max_tokens=1, messages=PROMPT, extra_body={"cache_salt": salt})
    with pytest.raises(openai.BadRequestError) as refused_responses:
        alice.responses.create(model=MODEL_ID, input="hi", max_output_tokens=16, extra_body={"cache_salt": salt})
    assert refused_responses.value.body["param"] == "cache_salt"


@pytest.mark.parametrize("key", ["sk-carol-unknown", None])
def test_an_unknown_or_missing_key_is_a_401_in_each_apis_shape(server, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for path, body in (
        ("/v1/chat/completions", {"messages": PROMPT, "max_tokens": 1}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
        ("/v1/responses", {"input": "hi"}),
    ):
        refused = httpx.post(f"{server.base}{path}", json=body, headers=headers, timeout=30)
        assert refused.status_code == 401
        error = refused.json()["error"]
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    messages = httpx.post(
        f"{server.base}/v1/messages", json={"messages": PROMPT, "max_tokens": 1}, headers=headers, timeout=30
    )
    assert messages.status_code == 401 and messages.json()["error"]["type"] == "authentication_error"
    if key is None:
        return
    client = _client(server, key)
    with pytest.raises(openai.AuthenticationError):
        _cached(client)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model=MODEL_ID, prompt="hi", max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        client.responses.create(model=MODEL_ID, input="hi", max_output_tokens=16)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.base, api_key=key, max_retries=0).messages.create(
            model=MODEL_ID, max_tokens=1, messages=PROMPT
        )


def test_stats_and_metrics_name_tenants_and_never_keys(server):
    _cached(_client(server, KEYS[0]))
    _cached(_client(server, KEYS[1]))
    admin = {"Authorization": f"Bearer {ADMIN}"}
    stats = httpx.get(f"{server.base}/stats", headers=admin, timeout=30)
    metrics = httpx.get(f"{server.base}/metrics", headers=admin, timeout=30)
    assert stats.status_code == metrics.status_code == 200
    by_tenant = stats.json()["prompt_cache"]["by_tenant"]
    assert {"alice", "bob"} <= set(by_tenant) <= {"alice", "bob", "common"}
    assert by_tenant["alice"]["max_bytes"] == 10**9 and by_tenant["bob"]["max_bytes"] is None
    assert by_tenant["alice"]["entries"] >= 1 and by_tenant["alice"]["bytes"] > 0
    assert 'kvcellar_prompt_cache_tenant_bytes{tenant="alice"}' in metrics.text
    assert 'kvcellar_prompt_cache_tenant_cached_tokens_total{tenant="bob"}' in metrics.text
    for key in KEYS:
        assert key not in stats.text and key not in metrics.text
    # A tenant's key is not the admin token; the KV events, which name every namespace's blocks, are the admin's.
    tenant_key = {"Authorization": f"Bearer {KEYS[0]}"}
    assert httpx.get(f"{server.base}/stats", headers=tenant_key).status_code == 401
    assert httpx.get(f"{server.base}/v1/kv_events", headers=tenant_key).status_code == 401
    assert httpx.get(f"{server.base}/v1/kv_events?follow=false", headers=admin, timeout=30).status_code == 200


def test_api_key_alone_keeps_the_default_namespace(model_dir_factory):
    config = SystemConfig(model_dir=model_dir_factory("llama"))
    with InProcessServer(config, settings=HttpSettings(api_key="one-key", admin_token=ADMIN)) as server:
        client = _client(server, "one-key")
        messages = [{"role": "user", "content": "One key, one namespace: " + "shelf " * 20}]
        assert _cached(client, messages) == 0
        assert _cached(client, messages) > 0
        with pytest.raises(openai.AuthenticationError):
            _cached(_client(server, "another-key"), messages)
        stats = httpx.get(f"{server.base}/stats", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).json()
        # Everything lives in the default namespace "": no tenant breakdown.
        assert stats["prompt_cache"]["by_tenant"] == {}
        namespaces = {entry.namespace for entry in server.system.prompt_cache._entries.values()}
        assert namespaces == {""}


def test_a_shared_tenants_prefix_is_read_by_all_and_nothing_flows_back(server):
    common, alice, bob = (_client(server, key) for key in (KEYS[2], KEYS[0], KEYS[1]))
    system_prompt = [{"role": "system", "content": "The team's common instructions: " + "policy " * 30}]
    fresh = {"cache_salt": "shared-test"}  # fresh namespaces for alice and bob; common's own stays unsalted
    _cached(common, system_prompt)
    served_alice = _cached(alice, system_prompt, **fresh)
    assert served_alice > 0  # read from common's namespace
    alice_only = system_prompt + [{"role": "user", "content": "Alice's own follow-up " + "secret " * 20}]
    _cached(alice, alice_only, **fresh)
    assert _cached(alice, alice_only, **fresh) > served_alice
    # Bob reads what common wrote, never what alice wrote on top of it.
    assert 0 < _cached(bob, alice_only, **fresh) <= served_alice


def test_a_wipe_of_one_tenant_through_the_admin_route_ends_its_hits_and_keeps_the_others(server):
    """Tenants and wipe together, through the openai SDK: after `POST /admin/cache/wipe {"tenant":
    "alice"}`, alice's prompt reads none of her own entries back; bob's still hits."""
    alice, bob = _client(server, "sk-alice-secret"), _client(server, "sk-bob-secret")
    alice_prompt = [{"role": "user", "content": "Alice keeps her notes about the wine cellar's third shelf here."}]
    bob_prompt = [{"role": "user", "content": "Bob asks which barrel in the north vault is the oldest one."}]
    hits = []
    for client, messages in ((alice, alice_prompt), (bob, bob_prompt)):
        _cached(client, messages)
        hits.append(_cached(client, messages))
    assert min(hits) > 8
    admin = {"Authorization": f"Bearer {ADMIN}"}
    refused = httpx.post(f"{server.base}/admin/cache/wipe", json={"tenant": "alice"}, timeout=60)
    assert refused.status_code == 401
    wiped = httpx.post(f"{server.base}/admin/cache/wipe", json={"tenant": "alice"}, headers=admin, timeout=60)
    assert wiped.status_code == 200, wiped.text
    assert wiped.json()["done"] and wiped.json()["removed"]["ram"]["entries"] >= 1
    assert _ram_by_tenant(server).get("alice", {}).get("entries", 0) == 0
    # Only the chat template's first tokens may still come from the shared tenant's namespace
    # (another test's `common` prompt): nothing of alice's own.
    assert _cached(alice, alice_prompt) < hits[0] // 2
    assert _cached(bob, bob_prompt) > 0
