"""Tenants without a server (issue 39 part 1): the `--tenants` file's parser, the
key lookup, and the RAM and SSD tiers' per-tenant accounting and quotas."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_prompt_cache import RecordingEvents, _token_caches

from kvcellar.cli import main as kvcellar_main
from kvcellar.errors import TenantsFileError
from kvcellar.store.namespaces import salted, tenant_namespace
from kvcellar.store.prompt_cache import PromptCache
from kvcellar.store.ssd_index import IndexedEntry, SsdIndex
from kvcellar.store.tenants import GB, load_tenants, parse_tenants

GOOD = """
[tenants.alice]
api_keys = ["sk-alice", "sk-alice-2"]
ram_gb = 2
ssd_gb = 20

[tenants.bob]
api_key_sha256 = ["{bob_digest}"]

[tenants.common]
api_keys = ["sk-common"]
shared = true
""".replace("{bob_digest}", hashlib.sha256(b"sk-bob").hexdigest())


def test_a_good_file_maps_keys_to_tenants_and_quotas():
    tenants = parse_tenants(GOOD)
    assert [t.name for t in tenants.tenants] == ["alice", "bob", "common"]
    assert tenants.tenant_for_key("sk-alice-2").namespace == tenant_namespace("alice")
    assert tenants.tenant_for_key("sk-bob").name == "bob"
    assert tenants.tenant_for_key("sk-carol") is None and tenants.tenant_for_key("") is None
    assert tenants.ram_quotas() == {"alice": 2 * GB} and tenants.ssd_quotas() == {"alice": 20 * GB}
    assert tenants.shared_namespaces() == (tenant_namespace("common"),)
    assert "sk-alice" not in repr(tenants)  # only digests are kept


BAD_FILES = {
    "not toml": ("[tenants.alice", "not valid TOML"),
    "no tenants": ("", "no tenants"),
    "unknown top-level field": ('api_keys = ["x"]\n[tenants.a]\napi_keys = ["k"]', "unknown top-level field"),
    "unknown field": ('[tenants.a]\napi_keys = ["k"]\nram_mb = 3', "unknown field 'ram_mb'"),
    "bad name": ('[tenants."a b"]\napi_keys = ["k"]', "tenant name 'a b' is not valid"),
    "no key": ("[tenants.a]\nram_gb = 1", "no API key"),
    "empty key": ('[tenants.a]\napi_keys = [""]', "api_keys[0] is empty"),
    "keys not a list": ('[tenants.a]\napi_keys = "k"', "api_keys must be a list of strings"),
    "key in two tenants": ('[tenants.a]\napi_keys = ["k"]\n[tenants.b]\napi_keys = ["k"]', "share an API key"),
    "key twice": ('[tenants.a]\napi_keys = ["k", "k"]', "listed twice"),
    "bad sha256 hex": ('[tenants.a]\napi_key_sha256 = ["sk-secret-pasted-here"]', "not 64 hex digits"),
    "negative quota": ('[tenants.a]\napi_keys = ["k"]\nram_gb = -1', "ram_gb = -1 is not a size"),
    "zero quota": ('[tenants.a]\napi_keys = ["k"]\nssd_gb = 0', "ssd_gb = 0 is not a size"),
    "bool quota": ('[tenants.a]\napi_keys = ["k"]\nssd_gb = true', "is not a size"),
    "shared not bool": ('[tenants.a]\napi_keys = ["k"]\nshared = "yes"', "shared must be true or false"),
    "not a table": ("tenants = {a = 3}", "is not a table"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_file_names_the_file_what_and_the_fix_and_never_a_key(case):
    text, what = BAD_FILES[case]
    with pytest.raises(TenantsFileError) as refused:
        parse_tenants(text, source="team.toml")
    message = str(refused.value)
    assert message.startswith("team.toml: ") and what in message
    assert "sk-secret" not in message


@given(st.text(min_size=1, max_size=40))
@settings(max_examples=50, deadline=None)
def test_a_hashed_key_and_its_plain_key_select_the_same_tenant(key):
    digest = hashlib.sha256(key.encode()).hexdigest()
    plain = parse_tenants(f"[tenants.t]\napi_keys = [{_toml_string(key)}]")
    hashed = parse_tenants(f'[tenants.t]\napi_key_sha256 = ["{digest}"]')
    assert plain.tenant_for_key(key) == hashed.tenant_for_key(key) == plain.by_name("t")
    assert plain.tenant_for_key(key + "x") is None


def _toml_string(text: str) -> str:
    escaped = "".join(c if c.isprintable() and c not in '"\\' else f"\\U{ord(c):08x}" for c in text)
    return f'"{escaped}"'


def test_serve_stops_at_start_on_a_bad_file_with_one_error_line(tmp_path: Path, capsys):
    bad = tmp_path / "team.toml"
    bad.write_text('[tenants.a]\napi_keys = ["sk-a"]\nram_gb = -2\n')
    assert kvcellar_main(["serve", "--tenants", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}: [tenants.a]: ram_gb = -2 is not a size, give a number")
    assert "Traceback" not in err and "sk-a" not in err
    with pytest.raises(TenantsFileError, match="cannot read the tenants file"):
        load_tenants(tmp_path / "missing.toml")


def test_serve_refuses_tenants_beside_api_key(tmp_path: Path, capsys):
    good = tmp_path / "team.toml"
    good.write_text('[tenants.a]\napi_keys = ["sk-a"]\n')
    assert kvcellar_main(["serve", "--tenants", str(good), "--api-key", "k"]) == 2
    assert "--tenants and --api-key cannot be combined" in capsys.readouterr().err


# -- quotas ------------------------------------------------------------------------

OWNERS = ("alice", "bob", "carol")


def _rows_bill(caches, token_count: int) -> int:
    return token_count  # one byte per token: quotas in tokens


@given(
    puts=st.lists(st.tuples(st.sampled_from(OWNERS), st.lists(st.integers(1, 3), min_size=1, max_size=6)), max_size=25),
    quotas=st.tuples(*(st.integers(1, 12) for _ in OWNERS)),
)
@settings(max_examples=60, deadline=None)
def test_ram_quotas_a_tenant_never_evicts_another_inside_its_quota(puts, quotas):
    """With every tenant quota'd and the quotas inside the cap, a put evicts only the putter's
    own entries, every tenant stays inside its quota, and the accounting adds up."""
    owner_quota = dict(zip(OWNERS, quotas, strict=True))
    cache = PromptCache(
        bytes_max=sum(quotas),
        events=RecordingEvents(),
        bill=_rows_bill,
        owner_bytes_max=owner_quota,
    )
    for owner, tokens in puts:
        before = {entry_id: e.namespace for entry_id, e in cache._entries.items()}
        cache.put(tokens, _token_caches(tokens, True), tenant_namespace(owner))
        gone = {entry_id: ns for entry_id, ns in before.items() if entry_id not in cache._entries}
        assert all(ns == tenant_namespace(owner) for ns in gone.values())
        by_tenant = cache.stats()["by_tenant"]
        for name, usage in by_tenant.items():
            assert usage["bytes"] <= owner_quota[name]
            held = [e for e in cache._entries.values() if e.namespace == tenant_namespace(name)]
            assert usage["entries"] == len(held) and usage["bytes"] == sum(e.bytes for e in held)
        assert sum(u["bytes"] for u in by_tenant.values()) == cache.bytes_total


def test_ram_counts_hits_and_cached_tokens_per_tenant_and_salts_split():
    cache = PromptCache(bytes_max=10**6, events=RecordingEvents())
    alice, bob = tenant_namespace("alice"), tenant_namespace("bob")
    prompt = list(range(1, 9))
    cache.put(prompt, _token_caches(prompt, True), alice)
    assert cache.take(prompt + [9], alice).reused_tokens == 8
    assert cache.take(prompt + [9], bob).reused_tokens == 0
    assert cache.take(prompt + [9], salted(alice, "s")).reused_tokens == 0
    stats = cache.stats()["by_tenant"]
    assert stats["alice"]["hits"] == 1 and stats["alice"]["cached_tokens"] == 8 and stats["alice"]["misses"] == 1
    assert stats["bob"] == {**stats["bob"], "hits": 0, "misses": 1, "entries": 0, "cached_tokens": 0}


def test_ram_shared_namespace_is_read_by_all_and_written_by_its_owner_only():
    common, alice, bob = (tenant_namespace(n) for n in ("common", "alice", "bob"))
    cache = PromptCache(bytes_max=10**6, events=RecordingEvents(), shared_namespaces=(common,))
    system_prompt = [5, 6, 7, 8, 9, 10]
    cache.put(system_prompt, _token_caches(system_prompt, True), common)
    served = cache.take(system_prompt + [1, 2], alice)
    assert served.reused_tokens == len(system_prompt)
    longer = system_prompt + [1, 2, 3]
    cache.put(longer, _token_caches(longer, True), alice)
    # Alice's own longer entry wins for her; Bob still reads only the shared one, never Alice's.
    assert cache.take(longer + [4], alice).reused_tokens == len(longer)
    assert cache.take(longer + [4], bob).reused_tokens == len(system_prompt)
    assert cache.take(system_prompt + [1], common).reused_tokens == len(system_prompt)
    assert {e.namespace for e in cache._entries.values()} == {common, alice}


def _ssd_entry(entry_id: str, namespace: str, size: int, mtime_ns: int) -> IndexedEntry:
    return IndexedEntry(
        entry_id=entry_id,
        namespace=namespace,
        directory=Path("/nowhere"),
        file_name=f"{entry_id}.kvc",
        tokens=np.arange(1, 3 + int(entry_id[1:]), dtype=np.uint32),
        bytes=size,
        mtime_ns=mtime_ns,
        trimmable=False,
        minimum_reusable_offset=0,
    )


def test_ssd_quota_evicts_the_over_quota_tenants_oldest_first():
    index = SsdIndex(directory=Path("/nowhere"), bytes_max=100, clock_ns=lambda: 0)
    index.set_owner_quotas({"alice": 30})
    alice, bob = tenant_namespace("alice"), tenant_namespace("bob")
    index.commit(_ssd_entry("e1", bob, 20, 1))  # bob's, the oldest of all
    index.commit(_ssd_entry("e2", alice, 20, 2))
    removed = index.commit(_ssd_entry("e3", alice, 20, 3))  # alice is over 30: her oldest goes, not bob's
    assert removed == [Path("/nowhere/e2.kvc")]
    by_tenant = index.stats()["by_tenant"]
    assert by_tenant["alice"] == {"entries": 1, "bytes": 20, "hits": 0, "max_bytes": 30}
    assert by_tenant["bob"]["entries"] == 1
    # Over the cap itself the oldest of all goes, whoever owns it.
    removed = index.commit(_ssd_entry("e4", salted(bob, "s"), 70, 4))
    assert removed == [Path("/nowhere/e1.kvc")]
    # Lowering a quota evicts at once.
    assert index.set_owner_quotas({"bob": 10}) == [Path("/nowhere/e4.kvc")]


@given(
    commits=st.lists(st.tuples(st.sampled_from(OWNERS), st.integers(1, 9)), max_size=30),
    quotas=st.tuples(*(st.integers(1, 20) for _ in OWNERS)),
)
@settings(max_examples=60, deadline=None)
def test_ssd_quotas_a_commit_evicts_only_the_committers_entries(commits, quotas):
    """The SSD index's side of the quota rule: with the quotas inside the cap, a commit removes
    only the committing tenant's entries, and per-tenant usage adds up to the totals."""
    owner_quota = dict(zip(OWNERS, quotas, strict=True))
    index = SsdIndex(directory=Path("/nowhere"), bytes_max=sum(quotas), clock_ns=lambda: 0)
    index.set_owner_quotas(owner_quota)
    for number, (owner, size) in enumerate(commits, start=1):
        before = index.entries()
        removed = index.commit(_ssd_entry(f"e{number}", tenant_namespace(owner), size, number))
        gone = [before[path.stem] for path in removed if path.stem in before]
        assert all(entry.namespace == tenant_namespace(owner) for entry in gone)
        stats = index.stats()
        for name, usage in stats["by_tenant"].items():
            assert usage["bytes"] <= owner_quota[name]
        assert sum(u["bytes"] for u in stats["by_tenant"].values()) == stats["bytes"]
        assert sum(u["entries"] for u in stats["by_tenant"].values()) == stats["entries"]
