"""The RAM prompt cache: reuse, supersession, LRU under a byte cap, lending
without aliasing, tiering over the SSD store, spills and idle demotion."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import make_prompt_cache

from kvcellar.store.prompt_cache import PromptCache, SpillSnapshot, logical_bytes
from kvcellar.store.signature import usable_prefix_length
from kvcellar.store.ssd import SsdStore


class RecordingEvents:
    """A `TierEvents` port that records what the tier tells it; `spill`
    decides what a spill does (None: no spills taken)."""

    def __init__(self, spill=None) -> None:
        self._spill = spill
        self.accepts_spills = spill is not None
        self.takes: list[tuple[str, int]] = []
        self.puts: list[tuple[str, int]] = []
        # What the port was told is resident: entry id -> (namespace, tokens).
        self.residents: dict[str, tuple[str, int]] = {}

    def taken(self, namespace: str, tokens: tuple[int, ...]) -> None:
        self.takes.append((namespace, len(tokens)))

    def put(self, namespace: str, tokens: tuple[int, ...]) -> None:
        assert all(type(token) is int for token in tokens)
        self.puts.append((namespace, len(tokens)))

    def spilled(self, snapshot: SpillSnapshot) -> None:
        self._spill(snapshot)

    def resident(self, entry_id: str, namespace: str, tokens) -> None:
        assert entry_id not in self.residents
        self.residents[entry_id] = (namespace, len(tokens))

    def gone(self, entry_id: str) -> None:
        del self.residents[entry_id]


# -- a state machine against a reference model, on real (tiny) caches ---------

KV_ROW_BYTES = 2 * 2 * 4  # keys + values, one head of two float32 per row


def _token_caches(tokens: list[int], trimmable: bool) -> list:
    """Caches whose key rows spell the tokens, so a lent prefix can be read back."""
    rows = mx.array(np.repeat(np.asarray(tokens, dtype=np.float32)[:, None], 2, axis=1))[None, None]
    kv = mlx_cache.KVCache()
    kv.update_and_fetch(rows, rows)
    if trimmable:
        return [kv]
    state = mlx_cache.ArraysCache(1)
    state[0] = mx.array([[float(sum(tokens))]])
    return [mlx_cache.CacheList(state, kv)]


def _lent_tokens(caches: list) -> list[int]:
    kv = caches[0] if isinstance(caches[0], mlx_cache.KVCache) else caches[0].caches[1]
    keys, _ = kv.keys_and_values() if kv.offset else (mx.zeros((1, 1, 0, 2)), None)
    return [int(v) for v in np.array(keys[0, 0, :, 0])]


class PromptCacheMachine(RuleBasedStateMachine):
    tokens = st.lists(st.integers(1, 3), min_size=1, max_size=7)
    namespaces = st.sampled_from(["", "adapter"])

    @initialize(cap_rows=st.integers(0, 30))
    def start(self, cap_rows):
        self.cap = cap_rows * KV_ROW_BYTES
        self.cache = PromptCache(bytes_max=self.cap)
        self.model: dict[str, dict] = {}

    @rule(tokens=tokens, namespace=namespaces, trimmable=st.booleans())
    def put(self, tokens, namespace, trimmable):
        caches = _token_caches(tokens, trimmable)
        size = logical_bytes(caches, len(tokens))
        stored = self.cache.put(tokens, caches, namespace)
        expected = 0 < size <= self.cap
        assert stored == expected
        if not stored:
            return
        for key, entry in list(self.model.items()):
            if entry["namespace"] != namespace:
                continue
            same = entry["tokens"] == tokens
            ancestor = len(entry["tokens"]) < len(tokens) and tokens[: len(entry["tokens"])] == entry["tokens"]
            if same or (trimmable and ancestor):
                del self.model[key]
        new_id = next(
            e.entry_id
            for e in self.cache._entries.values()
            if e.tokens.tolist() == tokens and e.namespace == namespace and e.entry_id not in self.model
        )
        self.model[new_id] = {
            "namespace": namespace,
            "tokens": list(tokens),
            "trimmable": trimmable,
            "bytes": size,
            "tick": self.cache._entries[new_id].last_used_tick,
        }
        while sum(e["bytes"] for e in self.model.values()) > self.cap:
            victim = min((k for k in self.model if k != new_id), key=lambda k: self.model[k]["tick"])
            del self.model[victim]

    @rule(cap_rows=st.integers(0, 30))
    def resize(self, cap_rows):
        """The model pool's re-division: a smaller cap evicts least recently used entries down to it."""
        self.cap = cap_rows * KV_ROW_BYTES
        evicted = self.cache.resize(self.cap)
        before = len(self.model)
        while sum(e["bytes"] for e in self.model.values()) > self.cap:
            del self.model[min(self.model, key=lambda k: self.model[k]["tick"])]
        assert evicted == before - len(self.model)
        assert self.cache.stats()["max_bytes"] == self.cap

    @rule(prompt=tokens, namespace=namespaces)
    def divergence(self, prompt, namespace):
        """The diagnostic's point: the longest prefix any entry of the namespace shares, usable or not."""
        found = self.cache.divergence(prompt, namespace)
        shared = [
            (_shared_tokens(entry["tokens"], prompt), entry["tokens"])
            for entry in self.model.values()
            if entry["namespace"] == namespace
        ]
        longest = max((common for common, _ in shared), default=0)
        assert found.matched_tokens == longest
        if found.cached_next_ids:
            assert any(
                common == longest and tuple(tokens[common : common + 32]) == found.cached_next_ids
                for common, tokens in shared
            )

    @rule(prompt=tokens, namespace=namespaces)
    def take(self, prompt, namespace):
        result = self.cache.take(prompt, namespace)
        best = 0
        for entry in self.model.values():
            if entry["namespace"] != namespace:
                continue
            common = 0
            for a, b in zip(entry["tokens"], prompt, strict=False):
                if a != b:
                    break
                common += 1
            minimum = 0 if entry["trimmable"] else len(entry["tokens"])
            best = max(
                best, usable_prefix_length(common, len(entry["tokens"]), len(prompt), entry["trimmable"], minimum)
            )
        assert result.reused_tokens == best
        assert result.reused_tokens <= max(len(prompt) - 1, 0)
        if best:
            assert result.tier == "ram" and result.entry_id in self.model
            assert self.model[result.entry_id]["namespace"] == namespace
            assert _lent_tokens(result.caches) == prompt[:best]
            self.model[result.entry_id]["tick"] = self.cache._entries[result.entry_id].last_used_tick
        else:
            assert result.caches is None

    @invariant()
    def billed_bytes_stay_under_the_cap_and_entries_match(self):
        if not hasattr(self, "cache"):
            return
        assert self.cache.bytes_total <= self.cap
        assert sorted(self.cache._entries) == sorted(self.model)


PromptCacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
test_prompt_cache_matches_the_reference_model = PromptCacheMachine.TestCase


# -- real models ----------------------------------------------------------------

PROMPT = [(13 * i + 7) % 1000 + 3 for i in range(60)]


def _prefill(model, tokens, cache=None):
    cache = cache if cache is not None else make_prompt_cache(model)
    logits = model(mx.array([tokens]), cache=cache)[:, -1, :]
    mx.eval(logits)
    return cache, logits


def _decode(model, cache, token, steps):
    outputs = []
    for _ in range(steps):
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
        mx.eval(logits)
        outputs.append(logits)
        token = int(mx.argmax(logits, axis=-1).item())
    return outputs


def _arrays_bytes(caches) -> list[bytes]:
    return [bytes(memoryview(mx.contiguous(a))) for c in caches for a in (c.keys, c.values)]


@pytest.fixture()
def llama(loaded_model_factory):
    return loaded_model_factory("llama")[0]


def test_borrowers_decode_without_touching_the_donor_and_diverge_independently(llama):
    cache = PromptCache()
    donor, _ = _prefill(llama, PROMPT)
    cache.put(PROMPT, donor)
    donor_bytes = _arrays_bytes(donor)
    first = cache.take(PROMPT + [5])
    second = cache.take(PROMPT + [9])
    assert first.reused_tokens == second.reused_tokens == len(PROMPT)
    got_first = _decode(llama, first.caches, 5, 6)
    got_second = _decode(llama, second.caches, 9, 6)
    assert _arrays_bytes(donor) == donor_bytes
    for token, got in ((5, got_first), (9, got_second)):
        fresh, _ = _prefill(llama, PROMPT)
        expected = _decode(llama, fresh, token, 6)
        assert all(mx.array_equal(a, b).item() for a, b in zip(expected, got, strict=True))


def test_partial_ram_hit_lends_a_trimmed_prefix(llama):
    cache = PromptCache()
    cache.put(PROMPT, _prefill(llama, PROMPT)[0])
    result = cache.take(PROMPT[:40] + [1, 2])
    assert result.reused_tokens == 40 and all(c.offset == 40 for c in result.caches)
    assert all(c.keys.shape[2] == 40 for c in result.caches), "only the reused rows are lent"
    assert cache.stats()["hits"] == 1


def test_namespaces_never_seed_each_other(llama):
    cache = PromptCache()
    cache.put(PROMPT, _prefill(llama, PROMPT)[0], namespace="adapter-a")
    assert cache.take(PROMPT + [1], namespace="").tier == "none"
    assert cache.take(PROMPT + [1], namespace="adapter-b").tier == "none"
    assert cache.take(PROMPT + [1], namespace="adapter-a").tier == "ram"


def test_oversize_entry_is_spilled_not_stored_and_a_raising_port_does_not_unwind(llama):
    spilled = []
    cache = PromptCache(bytes_max=1000, events=RecordingEvents(spilled.append))
    assert not cache.put(PROMPT, _prefill(llama, PROMPT)[0])
    assert len(cache) == 0 and [s.reason for s in spilled] == ["oversize"]
    assert spilled[0].tokens == tuple(PROMPT)

    def broken_sink(snapshot):
        raise OSError("disk gone")

    entry_bytes = logical_bytes(_prefill(llama, PROMPT[:20])[0], 20)
    failing = PromptCache(bytes_max=entry_bytes + 10, events=RecordingEvents(broken_sink))
    failing.put(PROMPT[:20], _prefill(llama, PROMPT[:20])[0])
    failing.put([1] + PROMPT[:19], _prefill(llama, [1] + PROMPT[:19])[0])
    assert len(failing) == 1 and failing.bytes_total <= failing.bytes_max
    assert failing.stats()["spill_failures"] == 1 and failing.stats()["evictions"] == 1


def test_a_shrink_spills_what_it_evicts_least_recently_used_first():
    spilled = []
    events = RecordingEvents(spilled.append)
    cache = PromptCache(bytes_max=100 * KV_ROW_BYTES, events=events)
    for first in (1, 2, 3):
        cache.put([first] * 10, _token_caches([first] * 10, trimmable=True))
    cache.take([1] * 10 + [4])  # the first entry is now the most recently used
    assert cache.resize(15 * KV_ROW_BYTES) == 2
    assert [s.tokens[0] for s in spilled] == [2, 3] and {s.reason for s in spilled} == {"evict"}
    assert cache.bytes_total <= cache.bytes_max and len(events.residents) == len(cache) == 1
    assert cache.resize(100 * KV_ROW_BYTES) == 0 and len(cache) == 1


def test_the_port_hears_every_successful_put_and_every_served_take(llama):
    events = RecordingEvents()
    cache = PromptCache(events=events)
    cache.put(PROMPT, _prefill(llama, PROMPT)[0], namespace="x")
    assert events.puts == [("x", len(PROMPT))]
    assert list(events.residents.values()) == [("x", len(PROMPT))], "the port hears each entry enter the tier"
    assert cache.take(PROMPT + [1], namespace="y").tier == "none" and events.takes == []
    assert cache.take(PROMPT + [1], namespace="x").tier == "ram"
    assert events.takes == [("x", len(PROMPT))]
    assert len(events.residents) == cache.stats()["entries"], "and leave it"


def test_cold_entry_wins_only_with_a_strictly_longer_prefix(llama, tmp_path):
    store = SsdStore.open(tmp_path, "f" * 32)
    store.store(PROMPT, _prefill(llama, PROMPT)[0])
    cache = PromptCache(cold_tier=store)
    cache.put(PROMPT[:30], _prefill(llama, PROMPT[:30])[0])
    longer = cache.take(PROMPT + [4])
    assert longer.tier == "ssd" and longer.reused_tokens == len(PROMPT)
    cache.put(PROMPT, _prefill(llama, PROMPT)[0])
    equal = cache.take(PROMPT + [4])
    assert equal.tier == "ram", "equal length: RAM serves"
    assert cache.stats()["cold_hits"] == 1
    store.close()


def test_untrimmable_cold_entry_needing_a_trim_is_refused(loaded_model_factory, tmp_path):
    model = loaded_model_factory("gemma3_text")[0]
    store = SsdStore.open(tmp_path, "f" * 32)
    store.store(PROMPT, _prefill(model, PROMPT)[0])
    cache = PromptCache(cold_tier=store)
    assert cache.take(PROMPT[:50] + [1, 2]).tier == "none"
    assert cache.take(PROMPT + [1]).tier == "ssd"
    store.close()


def test_demote_idle_spills_frees_and_the_restored_prefix_continues_bit_identically(llama, tmp_path):
    store = SsdStore.open(tmp_path, "f" * 32)
    now = [0.0]
    cache = PromptCache(
        cold_tier=store,
        clock_s=lambda: now[0],
        events=RecordingEvents(lambda snap: store.store(snap.tokens, snap.caches, snap.namespace)),
    )
    live, _ = _prefill(llama, PROMPT)
    cache.put(PROMPT, _prefill(llama, PROMPT)[0])
    assert cache.demote_idle(300) == 0
    now[0] = 301.0
    assert cache.demote_idle(300) == 1
    assert len(cache) == 0 and cache.bytes_total == 0 and cache.stats()["demotions"] == 1
    result = cache.take(PROMPT + [3])
    assert result.tier == "ssd" and result.reused_tokens == len(PROMPT)
    expected = _decode(llama, live, 3, 8)
    got = _decode(llama, result.caches, 3, 8)
    assert all(mx.array_equal(a, b).item() for a, b in zip(expected, got, strict=True))
    store.close()


def test_demote_idle_without_a_cold_tier_keeps_everything(llama):
    now = [0.0]
    cache = PromptCache(clock_s=lambda: now[0])
    cache.put(PROMPT, _prefill(llama, PROMPT)[0])
    now[0] = 10_000.0
    assert cache.demote_idle(1) == 0 and len(cache) == 1


def test_disabled_cache_holds_nothing(llama):
    cache = PromptCache(bytes_max=0)
    assert not cache.put(PROMPT, _prefill(llama, PROMPT)[0])
    assert cache.take(PROMPT + [1]).tier == "none"


def _shared_tokens(left, right) -> int:
    common = 0
    for a, b in zip(left, right, strict=False):
        if a != b:
            break
        common += 1
    return common
