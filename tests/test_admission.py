"""SSD write admission's sans-IO core (issue 21): its decisions on scripted
sequences of takes, puts and writes asking for admission, against a model of
the policy written out plainly; and the write budget's token bucket."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcellar.actors.admission_core import (
    GB,
    LEAVING_RAM_KINDS,
    AdmissionCore,
    Candidate,
    PrefillMeasured,
    Put,
    Reconsider,
    Taken,
)
from kvcellar.actors.durability_core import RecordKey
from kvcellar.errors import UsageError
from kvcellar.store.write_wear import DAY_NS, WriteBudget

KINDS = ("write-behind", "evict", "demote", "oversize")
# Token sequences sharing prefixes, so lineages (one extending another) occur often.
SEQUENCES = [(1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), (1, 2, 5), (7, 8), (7, 8, 9)]
KEYS = [RecordKey(namespace=namespace, tokens=tokens) for namespace in ("", "b") for tokens in SEQUENCES]


def candidate(key: RecordKey, kind: str, *, forced: bool = False, size_bytes: int = 1000) -> Candidate:
    return Candidate(namespace=key.namespace, tokens=key.tokens, bytes=size_bytes, kind=kind, forced=forced)


class SecondHitModel:
    """The policy as the issue words it, written out plainly: an entry is
    written once taken twice itself, or on leaving RAM after a hit of it or
    of any entry it extends."""

    def __init__(self) -> None:
        self.hits: dict[RecordKey, int] = {}
        self.held: set[RecordKey] = set()
        self.skipped: set[RecordKey] = set()

    def lineage(self, key: RecordKey) -> int:
        extended = [
            hits
            for other, hits in self.hits.items()
            if other.namespace == key.namespace and key.tokens[: len(other.tokens)] == other.tokens
        ]
        return max(extended, default=0)

    def put(self, key: RecordKey) -> None:
        self.skipped.discard(key)

    def take(self, key: RecordKey) -> list[Reconsider]:
        self.hits[key] = self.hits.get(key, 0) + 1
        if key in self.held and self.hits[key] >= 2:
            self.held.discard(key)
            return [Reconsider(key=key)]
        return []

    def decide(self, key: RecordKey, kind: str, forced: bool) -> bool:
        own, leaving = self.hits.get(key, 0), kind in LEAVING_RAM_KINDS
        admit = forced or own >= 2 or (leaving and self.lineage(key) >= 1)
        if admit:
            self.held.discard(key)
        elif leaving:
            self.skipped.add(key)
            self.held.discard(key)
        else:
            self.held.add(key)
        return admit


STEP = st.one_of(
    st.tuples(st.just("put"), st.sampled_from(KEYS)),
    st.tuples(st.just("take"), st.sampled_from(KEYS)),
    st.tuples(st.just("decide"), st.sampled_from(KEYS), st.sampled_from(KINDS), st.booleans()),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(STEP, max_size=40))
def test_second_hit_decides_as_the_policy_says_on_any_script(script: list[tuple[Any, ...]]) -> None:
    core, model = AdmissionCore("second-hit"), SecondHitModel()
    for step in script:
        key = step[1]
        if step[0] == "put":
            assert core.handle(Put(namespace=key.namespace, tokens=key.tokens), 0.0) == []
            model.put(key)
        elif step[0] == "take":
            assert core.handle(Taken(namespace=key.namespace, tokens=key.tokens), 0.0) == model.take(key)
        else:
            _, _, kind, forced = step
            decision = core.decide(candidate(key, kind, forced=forced))
            assert decision.hits == model.hits.get(key, 0)
            assert decision.admit == model.decide(key, kind, forced), (step, decision)
        for known in KEYS:
            assert core.hits(known) == model.hits.get(known, 0), known
            assert core.lineage_hits(known) == model.lineage(known), known
            assert core.was_skipped(known) == (known in model.skipped), known
        assert set(core.held_keys()) == model.held


@settings(max_examples=100, deadline=None)
@given(st.lists(STEP, max_size=30))
def test_always_admits_every_write_and_a_flush_is_never_refused(script: list[tuple[Any, ...]]) -> None:
    always, second_hit = AdmissionCore("always"), AdmissionCore("second-hit")
    for step in script:
        key = step[1]
        for core in (always, second_hit):
            if step[0] == "put":
                core.handle(Put(namespace=key.namespace, tokens=key.tokens), 0.0)
            elif step[0] == "take":
                core.handle(Taken(namespace=key.namespace, tokens=key.tokens), 0.0)
        if step[0] == "decide":
            assert always.decide(candidate(key, step[2], forced=step[3])).admit
            assert second_hit.decide(candidate(key, step[2], forced=True)).admit
    assert always.counters.held == always.counters.skipped == 0
    assert second_hit.counters.held == second_hit.counters.skipped == 0


def test_a_conversation_that_comes_back_is_written_once_on_leaving_ram_and_a_one_off_prompt_is_not() -> None:
    core = AdmissionCore("second-hit")
    turn1, turn2 = RecordKey(namespace="", tokens=(1, 2)), RecordKey(namespace="", tokens=(1, 2, 3, 4))
    turn3 = RecordKey(namespace="", tokens=(1, 2, 3, 4, 5))
    one_off = RecordKey(namespace="", tokens=(9, 9, 9))
    core.handle(Put(namespace="", tokens=turn1.tokens), 0.0)
    assert not core.decide(candidate(turn1, "write-behind")).admit  # held: nobody came back yet
    core.handle(Taken(namespace="", tokens=turn1.tokens), 0.0)  # turn 2 reuses turn 1
    core.handle(Put(namespace="", tokens=turn2.tokens), 0.0)  # and supersedes it in RAM
    assert (core.hits(turn2), core.lineage_hits(turn2)) == (0, 1)
    assert not core.decide(candidate(turn2, "write-behind")).admit  # no write per turn
    core.handle(Taken(namespace="", tokens=turn2.tokens), 0.0)
    core.handle(Put(namespace="", tokens=turn3.tokens), 0.0)
    assert not core.decide(candidate(turn3, "write-behind")).admit
    assert core.decide(candidate(turn3, "evict")).admit  # leaving RAM after its conversation came back
    core.handle(Put(namespace="", tokens=one_off.tokens), 0.0)
    assert not core.decide(candidate(one_off, "demote")).admit
    assert core.was_skipped(one_off) and not core.was_skipped(turn3)
    assert core.counters.skipped == 1 and core.counters.held == 3


def test_a_spill_the_ssd_tier_already_serves_is_not_written_again_except_by_always() -> None:
    for policy in ("second-hit", "cost"):
        core = AdmissionCore(policy)
        covered = Candidate(namespace="", tokens=(1, 2, 3), bytes=10, kind="evict", forced=True, covered=True)
        decision = core.decide(covered)
        assert (decision.admit, decision.reason) == (False, "already on SSD")
        assert core.counters.covered == 1 and not core.was_skipped(RecordKey(namespace="", tokens=(1, 2, 3)))
    assert AdmissionCore("always").decide(covered).admit


def test_a_held_snapshot_is_reconsidered_once_its_entry_is_taken_twice() -> None:
    core = AdmissionCore("second-hit")
    document = RecordKey(namespace="", tokens=(5, 6, 7))
    core.handle(Put(namespace="", tokens=document.tokens), 0.0)
    assert not core.decide(candidate(document, "write-behind")).admit
    assert core.handle(Taken(namespace="", tokens=document.tokens), 0.0) == []
    assert core.handle(Taken(namespace="", tokens=document.tokens), 0.0) == [Reconsider(key=document)]
    assert core.handle(Taken(namespace="", tokens=document.tokens), 0.0) == []  # once
    assert core.decide(candidate(document, "write-behind")).admit


def test_cost_admits_what_is_dearer_to_recompute_than_to_write() -> None:
    core = AdmissionCore("cost", cost_threshold_s_per_gb=1.0)
    prefix = RecordKey(namespace="", tokens=tuple(range(1000)))
    assert core.decide(candidate(prefix, "evict", size_bytes=GB)).reason == "no prefill rate measured yet"
    core.handle(PrefillMeasured(tokens=1000, seconds=1.0), 0.0)  # 1000 tokens/s: this prefix costs 1 s
    core.handle(PrefillMeasured(tokens=10, seconds=10.0), 0.0)  # too short to measure the model: ignored
    assert core.prefill_tokens_per_s == pytest.approx(1000.0)
    assert core.decide(candidate(prefix, "write-behind", size_bytes=GB // 2)).admit  # 2 s per GB
    assert not core.decide(candidate(prefix, "evict", size_bytes=2 * GB)).admit  # 0.5 s per GB
    assert core.decide(candidate(prefix, "evict", size_bytes=2 * GB, forced=True)).admit
    core.handle(PrefillMeasured(tokens=1000, seconds=0.5), 0.0)  # the mean moves a quarter of the way
    assert core.prefill_tokens_per_s == pytest.approx(1250.0)


def test_the_remembered_keys_stay_bounded() -> None:
    core = AdmissionCore("second-hit", keys_max=4)
    for n in range(50):
        core.handle(Taken(namespace="", tokens=(n, n + 1)), 0.0)
        core.decide(candidate(RecordKey(namespace="", tokens=(n,)), "evict"))
        core.decide(candidate(RecordKey(namespace="", tokens=(n, 0)), "write-behind"))
    assert core.stats()["keys"] == 4 and len(core.held_keys()) <= 4
    assert sum(core.was_skipped(RecordKey(namespace="", tokens=(n,))) for n in range(50)) == 4


def test_an_unknown_policy_or_threshold_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="second-hit"):
        AdmissionCore("sometimes")
    with pytest.raises(UsageError, match="threshold"):
        AdmissionCore("cost", cost_threshold_s_per_gb=float("nan"))


# -- the write budget's bucket ---------------------------------------------------


def test_the_bucket_refills_over_a_day_and_a_flush_may_overdraw_it() -> None:
    budget = WriteBudget(1000, now_ns=0)
    assert budget.wait_s(1000, now_ns=0) == 0.0
    budget.charge(800, now_ns=0)
    assert budget.wait_s(100, now_ns=0) == 0.0
    # 300 more need 100 refilled: a tenth of a day.
    assert budget.wait_s(300, now_ns=0) == pytest.approx(8640.0)
    assert budget.wait_s(300, now_ns=DAY_NS // 10) == pytest.approx(0.0, abs=1e-6)
    budget.charge(500, now_ns=0)  # a flush: writes anyway
    assert budget.over_budget_bytes == 300 and budget.level_bytes == -300
    # A write larger than a day's bytes waits only for a full bucket.
    assert budget.wait_s(5000, now_ns=2 * DAY_NS) == 0.0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3 * DAY_NS), st.integers(0, 1500)), max_size=20), st.integers(0, DAY_NS))
def test_the_bucket_follows_from_the_journals_writes(writes: list[tuple[int, int]], later_ns: int) -> None:
    """Replaying the journal's writes gives the bucket a running server had,
    overdrafts included."""
    start_ns = 5 * DAY_NS
    live = WriteBudget(1000, now_ns=start_ns)
    history = sorted((start_ns + offset, size) for offset, size in writes)
    for time_ns, size in history:
        live.charge(size, now_ns=time_ns)
    now_ns = start_ns + 3 * DAY_NS + later_ns
    replayed = WriteBudget.from_history(1000, history, now_ns=now_ns)
    live.refill(now_ns)
    assert replayed.level_bytes == pytest.approx(live.level_bytes, abs=1e-6)
