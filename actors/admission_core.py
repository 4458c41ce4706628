"""SSD write admission's core (issue 21): which background writes reach the drive.

Every prefix the RAM tier holds can reach the SSD tier twice over: as a
write-behind snapshot (the durability coordinator's timed attempt) and as a
spill when it leaves RAM (eviction, idle demotion, an oversize put). A cold
tier that writes all of them wears a laptop SSD out for entries nobody reads
back. `AdmissionCore` is the sans-IO policy that says yes or no to each
*background* write; a flush's forced writes (and shutdown's) are always
admitted, so the durability verdict keeps its meaning and what admission
skipped is reported as `skipped_by_admission`, never as durable.

Policies (`--ssd-admission`):

- `always`: every write is admitted (the behaviour before admission existed).
- `second-hit`: a write is admitted once its prefix has been taken twice, or
  when it is leaving RAM (an eviction, demotion or oversize spill) after a
  hit. A take counts as a hit of the entry that served it (the exact tokens of
  the RAM entry it borrowed from; for the SSD tier, the prefix it served):
  `own` hits. Leaving RAM, an entry counts the hits of every entry it extends
  too (`lineage`): turn N+1 of a conversation supersedes turn N in RAM, and
  the conversation came back once turn N was taken. So a write-behind
  snapshot is written only for an entry served twice itself (a branch point, a
  shared document); a conversation that came back is written once, when it
  leaves RAM (or at a flush), instead of once per turn; a one-off prompt is
  not written at all unless a flush asks.
- `cost`: a write is admitted when recomputing the prefix would take at least
  `cost_threshold_s_per_gb` seconds per GB the write costs the drive, the
  recompute time being the prefix's tokens over the measured prefill rate
  (an exponentially weighted mean of cold prefills; before the first
  measurement every write is admitted: no evidence, no refusal).

Both refuse a spill the SSD tier already serves whole (an entry evicted after
its write-behind snapshot was written): `always` writes it again.

The core only observes (takes, puts, prefill measurements) and decides; it
never does I/O and reads no clock. It is pure (attrs, the messages, `errors`
and the store's Trio-free prefix index; never Trio or MLX), and its one table,
`ADMISSION_TABLE`, takes the three observations and `Candidate` (a decision),
raising `IllegalTransition` for anything else before anything changes. The
Trio thread's face of it, `AdmissionGate`, is `actors/admission.py`. A write-behind snapshot it refuses is
*held*: the durability record waits, without a timer, until a flush forces it
or a later take makes it admissible (`Reconsider`). A spill it refuses is
*skipped*: the entry leaves RAM unwritten, and the coordinator's attempt for
it answers "skipped" instead of "missing".
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import attrs

from kvcellar.actors.durability_core import RecordKey, token_tuple
from kvcellar.actors.transitions import TransitionTable, rows
from kvcellar.errors import UsageError
from kvcellar.store.prefix_index import PrefixIndex

ADMISSION_POLICIES = ("always", "second-hit", "cost")
ADMISSION_POLICY_DEFAULT = "always"
# Spill kinds that mean "the entry is leaving RAM" (SpillQueue.KINDS minus write-behind).
LEAVING_RAM_KINDS = frozenset({"evict", "demote", "oversize"})
HITS_TO_ADMIT = 2
LEAVING_HITS_TO_ADMIT = 1
COST_THRESHOLD_S_PER_GB_DEFAULT = 1.0
# Keys remembered for hit counts, skipped spills and held snapshots (least recently seen forgotten first).
KEYS_MAX_DEFAULT = 4096
PREFILL_RATE_WEIGHT = 0.25  # weight of the newest measurement in the mean
PREFILL_TOKENS_MIN = 64  # shorter prefills measure overheads, not the model's rate
GB = 10**9


# -- observations (messages) ----------------------------------------------------


@attrs.frozen(kw_only=True)
class Taken:
    """A take reused a prefix from the entry holding exactly `tokens` (RAM),
    or the SSD tier served the prefix `tokens`."""

    namespace: str
    tokens: tuple[int, ...] = attrs.field(converter=token_tuple)


@attrs.frozen(kw_only=True)
class Put:
    """`PromptCache.on_put`: an entry holding exactly `tokens` was put."""

    namespace: str
    tokens: tuple[int, ...] = attrs.field(converter=token_tuple)


@attrs.frozen(kw_only=True)
class PrefillMeasured:
    """A cold prefill of `tokens` took `seconds` (the cost policy's rate)."""

    tokens: int
    seconds: float


AdmissionMessage = Taken | Put | PrefillMeasured


@attrs.frozen(kw_only=True)
class Reconsider:
    """The held write-behind snapshot of `key` is admissible now."""

    key: RecordKey


@attrs.frozen(kw_only=True)
class Candidate:
    """A background write asking for admission; `kind` is the spill kind
    ("write-behind", "evict", "demote", "oversize"); `forced`: a flush's;
    `covered`: a committed SSD entry already serves all of its tokens."""

    namespace: str
    tokens: tuple[int, ...] = attrs.field(converter=token_tuple)
    bytes: int
    kind: str
    forced: bool = False
    covered: bool = False


@attrs.frozen(kw_only=True)
class AdmissionDecision:
    admit: bool
    reason: str
    hits: int


@attrs.define(kw_only=True)
class AdmissionCounters:
    # Running counts, published by `stats()` as `ssd_cache.admission`.
    admitted: int = 0  # background writes admitted (forced ones included)
    forced: int = 0  # of those, a flush's (never refused)
    held: int = 0  # write-behind snapshots refused (the record waits for a flush or a hit)
    skipped: int = 0  # spills refused: the entry left RAM unwritten
    skipped_bytes: int = 0  # bytes of held and skipped writes
    reconsidered: int = 0  # held records made admissible by a later hit
    covered: int = 0  # spills refused because the SSD tier already serves them (not skipped: durable)


class AdmissionState(enum.Enum):
    # One state: the policy only observes and decides; its table still says what it takes.
    OBSERVING = "observing"


class AdmissionCore:
    """The sans-IO admission policy. `handle(observation, now)` returns
    `Reconsider` effects; `decide(candidate)` answers one write and notes a
    refusal; `was_skipped(key)` says whether a key left RAM unwritten by its
    decision. Raises `UsageError` for an unknown policy or a bad threshold."""

    def __init__(
        self,
        policy: str = ADMISSION_POLICY_DEFAULT,
        *,
        cost_threshold_s_per_gb: float = COST_THRESHOLD_S_PER_GB_DEFAULT,
        keys_max: int = KEYS_MAX_DEFAULT,
    ) -> None:
        if policy not in ADMISSION_POLICIES:
            raise UsageError(f"unknown SSD admission policy {policy!r}: choose one of {', '.join(ADMISSION_POLICIES)}")
        if not cost_threshold_s_per_gb >= 0:
            raise UsageError(f"the cost threshold must be >= 0 s/GB, got {cost_threshold_s_per_gb}")
        self.policy = policy
        self.state = AdmissionState.OBSERVING
        self.cost_threshold_s_per_gb = cost_threshold_s_per_gb
        self.keys_max = keys_max
        self.counters = AdmissionCounters()
        self.prefill_tokens_per_s: float | None = None
        self._ids = itertools.count(1)
        # Hit counts by key, least recently seen first, and each key's id in its namespace's index.
        self._hits: OrderedDict[RecordKey, int] = OrderedDict()
        self._key_ids: dict[RecordKey, str] = {}
        self._keys_by_id: dict[str, RecordKey] = {}
        self._indexes: dict[str, PrefixIndex] = {}
        self._held: OrderedDict[RecordKey, None] = OrderedDict()
        self._skipped: OrderedDict[RecordKey, None] = OrderedDict()

    # -- observations ------------------------------------------------------------

    def handle(self, msg: AdmissionMessage | Candidate, now: float) -> list[Reconsider] | list[AdmissionDecision]:
        """An observation answers its `Reconsider` effects; a `Candidate` its one `AdmissionDecision`."""
        return ADMISSION_TABLE.fire(self, msg, now)

    def _on_taken(self, msg: Taken, now: float) -> tuple[AdmissionState, list[Reconsider]]:
        return self.state, self._count_hit(RecordKey(namespace=msg.namespace, tokens=msg.tokens))

    def _on_put(self, msg: Put, now: float) -> tuple[AdmissionState, list[Reconsider]]:
        # Back in RAM: a later attempt finds it there, not skipped.
        self._skipped.pop(RecordKey(namespace=msg.namespace, tokens=msg.tokens), None)
        return self.state, []

    def _on_prefill(self, msg: PrefillMeasured, now: float) -> tuple[AdmissionState, list[Reconsider]]:
        if msg.tokens >= PREFILL_TOKENS_MIN and msg.seconds > 0:
            rate = msg.tokens / msg.seconds
            previous = self.prefill_tokens_per_s
            self.prefill_tokens_per_s = rate if previous is None else previous + PREFILL_RATE_WEIGHT * (rate - previous)
        return self.state, []

    def _on_candidate(self, msg: Candidate, now: float) -> tuple[AdmissionState, list[AdmissionDecision]]:
        return self.state, [self._decide(msg)]

    def _count_hit(self, key: RecordKey) -> list[Reconsider]:
        self._remember(key, self.hits(key) + 1)
        if key in self._held and self._hits_admit(self._hits[key], 0, leaving_ram=False):
            del self._held[key]
            self.counters.reconsidered += 1
            return [Reconsider(key=key)]
        return []

    def hits(self, key: RecordKey) -> int:
        """Takes the entry holding exactly `key`'s tokens served (its own hits)."""
        return self._hits.get(key, 0)

    def lineage_hits(self, key: RecordKey) -> int:
        """The most hits of `key` or of any entry it extends (a strict prefix of it)."""
        index = self._indexes.get(key.namespace)
        if index is None or not key.tokens:
            return self.hits(key)
        ancestors = index.strict_prefix_ancestors(key.tokens)
        return max([self.hits(key), *(self._hits[self._keys_by_id[a]] for a in ancestors)])

    def _remember(self, key: RecordKey, hits: int) -> None:
        if key in self._hits:
            self._hits.move_to_end(key)
            self._hits[key] = hits
            return
        if key.tokens:
            key_id = f"k{next(self._ids)}"
            self._indexes.setdefault(key.namespace, PrefixIndex()).add(
                key_id, key.tokens, trimmable=True, minimum_reusable_offset=0
            )
            self._key_ids[key] = key_id
            self._keys_by_id[key_id] = key
        self._hits[key] = hits
        while len(self._hits) > self.keys_max:
            self._forget(next(iter(self._hits)))

    def _forget(self, key: RecordKey) -> None:
        del self._hits[key]
        key_id = self._key_ids.pop(key, None)
        if key_id is not None:
            del self._keys_by_id[key_id]
            index = self._indexes[key.namespace]
            index.remove(key_id)
            if not len(index):
                del self._indexes[key.namespace]

    # -- decisions ---------------------------------------------------------------

    def decide(self, candidate: Candidate) -> AdmissionDecision:
        """Admit or refuse one write through the table; a refusal is remembered (held or skipped)."""
        (decision,) = self.handle(candidate, 0.0)
        assert isinstance(decision, AdmissionDecision)
        return decision

    def _decide(self, candidate: Candidate) -> AdmissionDecision:
        key = RecordKey(namespace=candidate.namespace, tokens=candidate.tokens)
        leaving_ram = candidate.kind in LEAVING_RAM_KINDS
        hits, lineage = self.hits(key), self.lineage_hits(key) if leaving_ram else 0
        if candidate.covered and self.policy != "always":
            # Durable already: rewriting it would only wear the drive (`always` does, as it always did).
            self.counters.covered += 1
            return AdmissionDecision(admit=False, reason="already on SSD", hits=hits)
        decision = self._judge(candidate, hits, lineage, leaving_ram)
        if decision.admit:
            self.counters.admitted += 1
            self.counters.forced += candidate.forced
            self._held.pop(key, None)
            return decision
        self.counters.skipped_bytes += candidate.bytes
        remembered = self._skipped if leaving_ram else self._held
        if leaving_ram:
            self.counters.skipped += 1
            self._held.pop(key, None)
        else:
            self.counters.held += 1
        remembered[key] = None
        remembered.move_to_end(key)
        while len(remembered) > self.keys_max:
            remembered.popitem(last=False)
        return decision

    def _judge(self, candidate: Candidate, hits: int, lineage: int, leaving_ram: bool) -> AdmissionDecision:
        if candidate.forced:
            return AdmissionDecision(admit=True, reason="forced", hits=hits)
        if self.policy == "always":
            return AdmissionDecision(admit=True, reason="always", hits=hits)
        if self.policy == "second-hit":
            if self._hits_admit(hits, lineage, leaving_ram=leaving_ram):
                reason = "second hit" if hits >= HITS_TO_ADMIT else "leaving RAM after a hit"
                return AdmissionDecision(admit=True, reason=reason, hits=hits)
            return AdmissionDecision(admit=False, reason="not taken twice", hits=hits)
        rate = self.prefill_tokens_per_s
        if rate is None or candidate.bytes <= 0:
            return AdmissionDecision(admit=True, reason="no prefill rate measured yet", hits=hits)
        recompute_s_per_gb = (len(candidate.tokens) / rate) / (candidate.bytes / GB)
        if recompute_s_per_gb >= self.cost_threshold_s_per_gb:
            return AdmissionDecision(admit=True, reason="dearer to recompute than to write", hits=hits)
        return AdmissionDecision(admit=False, reason="cheaper to recompute than to write", hits=hits)

    @staticmethod
    def _hits_admit(hits: int, lineage: int, *, leaving_ram: bool) -> bool:
        return hits >= HITS_TO_ADMIT or (leaving_ram and max(hits, lineage) >= LEAVING_HITS_TO_ADMIT)

    def was_skipped(self, key: RecordKey) -> bool:
        """Whether `key` left RAM unwritten because a spill of it was refused."""
        return key in self._skipped

    def held_keys(self) -> Iterable[RecordKey]:
        return tuple(self._held)

    def stats(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "cost_threshold_s_per_gb": self.cost_threshold_s_per_gb,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "keys": len(self._hits),
            **attrs.asdict(self.counters),
        }


ADMISSION_TABLE: TransitionTable[AdmissionState] = TransitionTable(
    "admission",
    {
        **rows([AdmissionState.OBSERVING], [Taken], AdmissionCore._on_taken),
        **rows([AdmissionState.OBSERVING], [Put], AdmissionCore._on_put),
        **rows([AdmissionState.OBSERVING], [PrefillMeasured], AdmissionCore._on_prefill),
        **rows([AdmissionState.OBSERVING], [Candidate], AdmissionCore._on_candidate),
    },
)
