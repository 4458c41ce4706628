"""The RAM tier: a byte-capped LRU of whole prefix entries (spec §4).

`take(prompt, namespace)` lends the entry with the longest usable prefix as views
(the donor stays intact), consulting the cold tier inside the call: the cold
tier wins only with a strictly longer usable prefix. `put` stores a finished
generation's caches: exact duplicates are replaced, strict prefix ancestors
are superseded (without spill) only by a trimmable newcomer that can serve
them, then least-recently-used entries are spilled and evicted until the
billed bytes are under the cap. Pure: no Trio, no I/O of its own; the clock is
injected.

Everything the tier tells the rest of the system goes through the one
`TierEvents` port it is built with (on the engine thread, its owner's): each
served take, each put, each spill. Spill contract: `spilled` receives a
`SpillSnapshot` (evaluated views and a copy of the tokens) made before the
donor is dropped, and owns it on every path. A port that raises has not taken
ownership: the spill is a no-op and the eviction goes on.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol

import attrs
import numpy as np

from kvcellar.store.companion import has_companion
from kvcellar.store.lending import lend_caches, snapshot_caches
from kvcellar.store.namespaces import owner_of
from kvcellar.store.prefix_index import PrefixIndex
from kvcellar.store.scheme import held_bytes
from kvcellar.store.signature import caches_trimmable, entry_minimum_reusable_offset
from kvcellar.store.wipe import WipeSelector

log = logging.getLogger("kvcellar.prompt_cache")

BYTES_MAX_DEFAULT = 8 * 10**9


@attrs.frozen(kw_only=True)
class SpillSnapshot:
    """What `TierEvents.spilled` receives and then owns."""

    namespace: str
    tokens: tuple[int, ...]
    caches: list[Any]
    bytes: int
    reason: str
    # The tier's wipe epoch when the snapshot was taken: a wipe's tombstone refuses the commit
    # of a snapshot taken before the wipe removed its entries (`SsdIndex.commit`).
    wipe_epoch: int = 0


class TierEvents(Protocol):
    """The RAM tier's one port to the rest of the system, given at construction
    and called on the engine thread (the tier's owner) inside the call that
    caused the event. Implementations hand the work on without waiting."""

    @property
    def accepts_spills(self) -> bool:
        """Whether `spilled` snapshots go anywhere: without a cold tier the tier
        never demotes (demoting to nowhere is data loss) and never snapshots."""
        ...

    def taken(self, namespace: str, tokens: tuple[int, ...]) -> None:
        """A served take: the exact tokens of the RAM entry lent (from the cold
        tier: the prefix it served). SSD admission counts hits by it."""
        ...

    def put(self, namespace: str, tokens: tuple[int, ...]) -> None:
        """An entry holding exactly `tokens` was put (also an oversize one, spilled
        instead of held): write-behind marks it dirty."""
        ...

    def spilled(self, snapshot: SpillSnapshot) -> None:
        """Take ownership of a snapshot of an entry leaving RAM (or held, for
        write-behind); raising means it was not taken."""
        ...

    def resident(self, entry_id: str, namespace: str, tokens: np.ndarray) -> None:
        """An entry entered the tier (KV events, store/kv_events.py)."""
        ...

    def wiped(self, selector: WipeSelector) -> None:
        """A wipe dropped what `selector` selects, after every put this port was told of
        before: write-behind no longer owes those puts."""
        ...

    def gone(self, entry_id: str) -> None:
        """An entry left the tier (evicted, superseded, spilled or taken whole)."""
        ...


class NoTierEvents:
    """The port of a tier nobody listens to: takes and puts go nowhere, and it
    takes no spills (so the tier makes no snapshots)."""

    accepts_spills = False

    def taken(self, namespace: str, tokens: tuple[int, ...]) -> None:
        pass

    def put(self, namespace: str, tokens: tuple[int, ...]) -> None:
        pass

    def spilled(self, snapshot: SpillSnapshot) -> None:
        raise AssertionError("a tier without listeners makes no spill snapshots")

    def resident(self, entry_id: str, namespace: str, tokens: np.ndarray) -> None:
        pass

    def wiped(self, selector: WipeSelector) -> None:
        pass

    def gone(self, entry_id: str) -> None:
        pass


NO_TIER_EVENTS = NoTierEvents()


class ColdMatch(Protocol):
    # Read-only: the SSD tier's match is frozen.
    @property
    def usable_tokens(self) -> int: ...

    @property
    def entry_tokens(self) -> int: ...


class ColdTier(Protocol):
    """What the RAM tier needs of the SSD tier (`SsdStore` fits)."""

    def find(self, tokens: Sequence[int] | np.ndarray, namespace: str = "") -> ColdMatch | None: ...
    def restore(self, match: Any) -> list[Any] | None: ...


@attrs.frozen(kw_only=True)
class TakeResult:
    """Borrowed caches covering the first `reused_tokens` of the prompt
    (`caches` is None and `tier` "none" on a miss)."""

    caches: list[Any] | None
    reused_tokens: int
    tier: str
    entry_id: str = ""
    # How the cold tier served this take when it chose ("restore", "recompute",
    # "split"; engine/restore_policy.py); "" when no cold entry was considered.
    restore_plan: str = ""


@attrs.frozen(kw_only=True)
class CacheDivergence:
    """Where a prompt left the longest prefix any tier entry shares with it
    (a diagnostic for `/stats/requests`): `matched_tokens` of it are shared,
    `cached_next_ids` are the entry's tokens from there on (a few dozen at
    most, none when the prompt ended first), `tier` holds that entry."""

    matched_tokens: int
    cached_next_ids: tuple[int, ...]
    tier: str


@attrs.define(kw_only=True)
class _RamEntry:
    entry_id: str
    namespace: str
    tokens: np.ndarray
    caches: list[Any]
    bytes: int
    trimmable: bool
    minimum_reusable_offset: int
    last_used_tick: int
    last_used_s: float
    # Of `bytes`, what its method companion state holds (the draft's KV, store/companion.py).
    companion_bytes: int = 0


@attrs.define(kw_only=True)
class PromptCacheCounters:
    # Running counts, published under these names as /stats's `prompt_cache`.
    hits: int = 0  # takes with a RAM candidate prefix
    misses: int = 0  # takes without one
    cold_hits: int = 0  # takes served from the cold tier
    cold_refused: int = 0  # cold restores refused: they could not be cut to the usable prefix
    puts: int = 0  # entries inserted
    evictions: int = 0  # entries dropped over the byte cap
    supersessions: int = 0  # entries dropped because a new one stands in for them
    spills: int = 0  # snapshots the port took
    spill_failures: int = 0  # snapshots the port raised on (dropped without a cold copy)
    demotions: int = 0  # idle entries spilled and dropped
    oversize: int = 0  # puts larger than the cap: spilled, never held
    wiped: int = 0  # entries a wipe dropped


@attrs.define(kw_only=True)
class TenantUsage:
    """One tenant's share of the tier, published under `prompt_cache.by_tenant.<name>`."""

    entries: int = 0
    bytes: int = 0
    hits: int = 0  # takes served (RAM or cold) in the tenant's namespaces
    misses: int = 0  # takes served nothing
    cached_tokens: int = 0  # prompt tokens those takes served


def logical_bytes(caches: Sequence[Any], token_count: int | None = None) -> int:
    """Bytes the caches really hold (rows up to `offset`, the ring a sliding
    window holds, recurrent state as is), never the slack: the RAM tier's bill.
    `token_count` is accepted for the `bill` hook's signature and not needed."""
    return held_bytes(caches)


class PromptCache:
    """The RAM prompt cache. Not thread-safe: the engine thread owns it. Other
    threads read only `stats()`: an immutable snapshot the owner publishes
    (one reference swap) at the end of each public call that changes it."""

    def __init__(
        self,
        bytes_max: int = BYTES_MAX_DEFAULT,
        *,
        cold_tier: ColdTier | None = None,
        events: TierEvents = NO_TIER_EVENTS,
        clock_s: Callable[[], float] = time.monotonic,
        bill: Callable[[Sequence[Any], int], int] = logical_bytes,
        owner_bytes_max: Mapping[str, int] | None = None,
        shared_namespaces: Sequence[str] = (),
    ) -> None:
        self.bytes_max = bytes_max
        # Tenant quotas (`serve --tenants`, store/tenants.py): a tenant over its own
        # quota evicts its own least-recently-used entries, never another's.
        self.owner_bytes_max: Mapping[str, int] = dict(owner_bytes_max or {})
        # Namespaces every caller may read (a tenant with `shared = true`); puts stay in the caller's own.
        self.shared_namespaces = tuple(shared_namespaces)
        self._usage: dict[str, TenantUsage] = {}
        self.cold_tier = cold_tier
        # The one port to the rest of the system, fixed for the tier's life.
        self._events = events
        self._clock_s = clock_s
        self._bill = bill
        self._entries: dict[str, _RamEntry] = {}
        self._indexes: dict[str, PrefixIndex] = {}
        self._ids = itertools.count(1)
        self._ticks = itertools.count(1)
        self.bytes_total = 0
        # Of `bytes_total`, the bytes of method companion state (draft KV) the entries hold.
        self.companion_bytes_total = 0
        self.counters = PromptCacheCounters()
        # Bumped by each wipe; snapshots carry it (`SpillSnapshot.wipe_epoch`).
        self.wipe_epoch = 0
        self._published: Mapping[str, Any] = MappingProxyType({})
        self._publish()

    @property
    def enabled(self) -> bool:
        return self.bytes_max > 0

    def resize(self, bytes_max: int) -> int:
        """A new cap (the model pool's RAM share): on a shrink the least-recently-used entries are
        evicted down to it through the eviction path (spilled to the cold tier first, as at a put),
        so the bytes held never stay over the cap. Returns how many entries were evicted."""
        evictions_before = self.counters.evictions
        self.bytes_max = bytes_max
        try:
            self._evict_until_under_cap(keep="")
        finally:
            self._publish()
        return self.counters.evictions - evictions_before

    def __len__(self) -> int:
        return len(self._entries)

    # -- take ------------------------------------------------------------------

    def take(self, prompt: Sequence[int], namespace: str = "") -> TakeResult:
        """Borrow the longest usable prefix of `prompt` in `namespace` (capped at
        `len(prompt) - 1`), from RAM or, when strictly longer, from the cold tier."""
        try:
            return self._take(np.asarray(prompt, dtype=np.uint32), namespace)
        finally:
            self._publish()

    def divergence(self, prompt: Sequence[int], namespace: str = "", next_tokens: int = 32) -> CacheDivergence:
        """Where `prompt` leaves the longest prefix a RAM or SSD entry of a namespace the
        caller may read (`readable`) shares with it (the longer wins; RAM, then the caller's
        own namespace, on a tie). Index-only, no I/O; changes nothing."""
        query = np.asarray(prompt, dtype=np.uint32)
        readable = self.readable(namespace)
        # In order of preference on a tie: RAM before SSD, the caller's own namespace first.
        candidates = [
            ("ram", *self._indexes[ns].divergence(query, next_tokens))
            for ns in readable
            if self.enabled and ns in self._indexes
        ]
        cold_divergence = getattr(self.cold_tier, "divergence", None)
        if cold_divergence is not None:
            candidates += [("ssd", *cold_divergence(query, ns, next_tokens)) for ns in readable]
        found = CacheDivergence(matched_tokens=0, cached_next_ids=(), tier="none")
        for tier, matched, following in candidates:
            if matched > found.matched_tokens:
                found = CacheDivergence(matched_tokens=matched, cached_next_ids=tuple(following.tolist()), tier=tier)
        return found

    def _take(self, query: np.ndarray, namespace: str) -> TakeResult:
        result = self._take_readable(query, namespace)
        usage = self._usage_of(owner_of(namespace))
        if result.reused_tokens:
            usage.hits += 1
            usage.cached_tokens += result.reused_tokens
        else:
            usage.misses += 1
        return result

    def readable(self, namespace: str) -> tuple[str, ...]:
        """The caller's own namespace first, then the shared ones (a tie keeps the own)."""
        return (namespace, *(shared for shared in self.shared_namespaces if shared != namespace))

    def _take_readable(self, query: np.ndarray, namespace: str) -> TakeResult:
        ram = None
        for readable in self.readable(namespace):
            candidate = self._ram_candidate(query, readable)
            if candidate is not None and (ram is None or candidate[1] > ram[1]):
                ram = candidate
        if ram is None:
            self.counters.misses += 1
        else:
            self.counters.hits += 1
        ram_tokens = ram[1] if ram is not None else 0
        for readable in self.readable(namespace):
            cold = self._cold_take(query, readable, ram_tokens)
            if cold is not None:
                self._notify_take(readable, query[: cold.reused_tokens])
                return cold
        plan = self._cold_plan()
        if ram is None:
            return TakeResult(caches=None, reused_tokens=0, tier="none", restore_plan=plan)
        entry, usable = ram
        self._touch(entry)
        self._notify_take(entry.namespace, entry.tokens)
        lent = lend_caches(entry.caches, drop_tokens=entry.tokens.size - usable)
        return TakeResult(caches=lent, reused_tokens=usable, tier="ram", entry_id=entry.entry_id, restore_plan=plan)

    def _cold_plan(self) -> str:
        """The plan a cold tier with a restore policy (`last_plan`, reset by its
        `find`) chose in this take; "" for a tier without one (a bare `SsdStore`)."""
        return str(getattr(self.cold_tier, "last_plan", ""))

    def _ram_candidate(self, query: np.ndarray, namespace: str) -> tuple[_RamEntry, int] | None:
        index = self._indexes.get(namespace)
        if not self.enabled or index is None or query.size < 2:
            return None
        match = index.best(query)
        if match is None:
            return None
        return self._entries[match.entry_id], match.usable_tokens

    def _cold_take(self, query: np.ndarray, namespace: str, ram_tokens: int) -> TakeResult | None:
        if self.cold_tier is None or query.size < 2:
            return None
        match = self.cold_tier.find(query, namespace)
        if match is None or match.usable_tokens <= ram_tokens:
            return None
        caches = self.cold_tier.restore(match)
        if caches is None:
            return None
        offsets = {cache.offset for cache in caches if hasattr(cache, "offset")}
        if offsets and offsets != {match.usable_tokens}:
            # A cold entry the tier could not trim to the usable prefix is never served.
            self.counters.cold_refused += 1
            log.warning("cold entry refused: restored offsets %s, needed %d", sorted(offsets), match.usable_tokens)
            return None
        self.counters.cold_hits += 1
        return TakeResult(
            caches=caches,
            reused_tokens=match.usable_tokens,
            tier="ssd",
            entry_id=getattr(match, "entry_id", ""),
            restore_plan=self._cold_plan(),
        )

    def _touch(self, entry: _RamEntry) -> None:
        entry.last_used_tick = next(self._ticks)
        entry.last_used_s = self._clock_s()
        # `_entries` is kept in least-recently-used-first order: eviction takes the head.
        self._entries[entry.entry_id] = self._entries.pop(entry.entry_id)

    # -- put -------------------------------------------------------------------

    def put(self, tokens: Sequence[int] | np.ndarray, caches: Sequence[Any], namespace: str = "") -> bool:
        """Take ownership of a finished generation's caches as an entry.
        Returns whether it is now held in RAM (an entry larger than the cap is
        spilled instead; a disabled cache holds nothing)."""
        return self.put_entry(tokens, caches, namespace) is not None

    def put_entry(self, tokens: Sequence[int] | np.ndarray, caches: Sequence[Any], namespace: str = "") -> str | None:
        """`put`, returning the id the entry is held under (None when it is
        not held), so a generation can keep its own entries from relief."""
        if not self.enabled:
            return None
        try:
            return self._put(np.asarray(tokens, dtype=np.uint32), list(caches), namespace)
        finally:
            self._publish()

    def _put(self, token_array: np.ndarray, caches: list[Any], namespace: str) -> str | None:
        entry = _RamEntry(
            entry_id=f"r{next(self._ids)}",
            namespace=namespace,
            tokens=token_array,
            caches=caches,
            bytes=self._bill(caches, token_array.size),
            trimmable=caches_trimmable(caches),
            minimum_reusable_offset=entry_minimum_reusable_offset(caches, token_array.size),
            last_used_tick=next(self._ticks),
            last_used_s=self._clock_s(),
            companion_bytes=held_bytes(caches[-1:]) if has_companion(caches) else 0,
        )
        if entry.bytes > min(self.bytes_max, self.owner_bytes_max.get(owner_of(namespace), self.bytes_max)):
            self.counters.oversize += 1
            self._spill(entry, "oversize")
            # Still dirty: a flush must wait for this spill and report it missing
            # if the spill is dropped or fails (the simulator's seed 15 found
            # flushes saying durable while an oversize spill was lost).
            self._notify_put(namespace, token_array)
            return None
        self._supersede(entry)
        self._insert(entry)
        self.counters.puts += 1
        self._evict_until_under_cap(keep=entry.entry_id)
        self._notify_put(namespace, token_array)
        return entry.entry_id

    def _notify_take(self, namespace: str, served_tokens: np.ndarray) -> None:
        self._events.taken(namespace, tuple(served_tokens.tolist()))

    def _notify_put(self, namespace: str, token_array: np.ndarray) -> None:
        self._events.put(namespace, tuple(token_array.tolist()))

    def _supersede(self, entry: _RamEntry) -> None:
        index = self._indexes.get(entry.namespace)
        if index is None:
            return
        doomed = list(index.exact(entry.tokens))
        if entry.trimmable:
            for ancestor_id in index.strict_prefix_ancestors(entry.tokens):
                if entry.minimum_reusable_offset <= self._entries[ancestor_id].tokens.size:
                    doomed.append(ancestor_id)
        for entry_id in doomed:
            self._drop(entry_id)
            self.counters.supersessions += 1

    def _insert(self, entry: _RamEntry) -> None:
        self._entries[entry.entry_id] = entry
        self._indexes.setdefault(entry.namespace, PrefixIndex()).add(
            entry.entry_id,
            entry.tokens,
            trimmable=entry.trimmable,
            minimum_reusable_offset=entry.minimum_reusable_offset,
        )
        self.bytes_total += entry.bytes
        self.companion_bytes_total += entry.companion_bytes
        usage = self._usage_of(owner_of(entry.namespace))
        usage.entries += 1
        usage.bytes += entry.bytes
        self._events.resident(entry.entry_id, entry.namespace, entry.tokens)

    def _drop(self, entry_id: str) -> _RamEntry:
        entry = self._entries.pop(entry_id)
        self._indexes[entry.namespace].remove(entry_id)
        self.bytes_total -= entry.bytes
        self.companion_bytes_total -= entry.companion_bytes
        usage = self._usage_of(owner_of(entry.namespace))
        usage.entries -= 1
        usage.bytes -= entry.bytes
        self._events.gone(entry_id)
        return entry

    def _evict_until_under_cap(self, *, keep: str) -> None:
        """Evict least-recently-used entries until the putter is inside its quota and the
        tier under its cap. Over-quota tenants' entries go first: a tenant inside its
        quota loses entries only to the cap itself, never to another's excess."""
        while True:
            over = {owner for owner, quota in self.owner_bytes_max.items() if self._usage_of(owner).bytes > quota}
            if not over and self.bytes_total <= self.bytes_max:
                return
            # Lazy scans in LRU order: an eviction looks only as far as its victim.
            victim = None
            if over:
                victim = next(
                    (e for e in self._entries.values() if e.entry_id != keep and owner_of(e.namespace) in over), None
                )
            if victim is None and self.bytes_total > self.bytes_max:
                victim = next((e for e in self._entries.values() if e.entry_id != keep), None)
            if victim is None:
                return
            self._spill(victim, "evict")
            self._drop(victim.entry_id)
            self.counters.evictions += 1

    def _usage_of(self, owner: str) -> TenantUsage:
        return self._usage.setdefault(owner, TenantUsage())

    # -- spill and demotion ----------------------------------------------------

    def _spill(self, entry: _RamEntry, reason: str) -> None:
        """Hand a snapshot to the port; a raising port has not taken it."""
        if not self._events.accepts_spills:
            return
        snapshot = SpillSnapshot(
            namespace=entry.namespace,
            tokens=tuple(int(t) for t in entry.tokens),
            caches=snapshot_caches(entry.caches),
            bytes=entry.bytes,
            reason=reason,
            wipe_epoch=self.wipe_epoch,
        )
        try:
            self._events.spilled(snapshot)
        except Exception as e:
            self.counters.spill_failures += 1
            log.warning(
                "spill of %d tokens failed (%s); the entry is dropped without a cold copy", entry.tokens.size, e
            )
            return
        self.counters.spills += 1

    def demote_idle(self, threshold_s: float) -> int:
        """Spill and drop entries unused for `threshold_s` or longer; returns
        how many. A no-op when the port takes no spills: demoting to nowhere is data loss."""
        if not self._events.accepts_spills:
            return 0
        now_s = self._clock_s()
        idle = [e for e in self._entries.values() if now_s - e.last_used_s >= threshold_s]
        for entry in sorted(idle, key=lambda e: e.last_used_tick):
            self._spill(entry, "demote")
            self._drop(entry.entry_id)
            self.counters.demotions += 1
        self._publish()
        return len(idle)

    # -- memory relief (engine/memory.py) ---------------------------------------

    def reclaimable_bytes(self, protected: Collection[str] = ()) -> int:
        """What releasing every entry not in `protected` would unbill."""
        return sum(e.bytes for e in self._entries.values() if e.entry_id not in protected)

    def release_lru(self, protected: Collection[str] = ()) -> SpillSnapshot | None:
        """Drop the least-recently-used entry not in `protected` for the
        memory guard and hand over its own caches (no copy: once the caller
        lets go, its memory is free), or None when nothing is left. No spill:
        the guard persists it synchronously or counts it dropped."""
        victim = next((e for e in self._entries.values() if e.entry_id not in protected), None)
        if victim is None:
            return None
        self._drop(victim.entry_id)
        self._publish()
        return SpillSnapshot(
            namespace=victim.namespace,
            tokens=tuple(int(t) for t in victim.tokens),
            caches=victim.caches,
            bytes=victim.bytes,
            reason="relief",
            wipe_epoch=self.wipe_epoch,
        )

    def snapshot_exact(self, tokens: Sequence[int], namespace: str = "") -> SpillSnapshot | None:
        """A snapshot of the entry holding exactly `tokens` (for write-behind), or None."""
        index = self._indexes.get(namespace)
        if index is None:
            return None
        matches = index.exact(np.asarray(tokens, dtype=np.uint32))
        if not matches:
            return None
        entry = self._entries[matches[0]]
        return SpillSnapshot(
            namespace=namespace,
            tokens=tuple(int(t) for t in entry.tokens),
            caches=snapshot_caches(entry.caches),
            bytes=entry.bytes,
            reason="write-behind",
            wipe_epoch=self.wipe_epoch,
        )

    def keys(self) -> list[tuple[str, np.ndarray]]:
        """The (namespace, tokens) of every entry held (the engine thread, or a simulation's one thread)."""
        return [(e.namespace, e.tokens) for e in self._entries.values()]

    def wipe(self, selector: WipeSelector) -> tuple[int, int, int]:
        """Drop every entry `selector` selects, with no spill (a wipe's RAM part, store/wipe.py),
        and start a new wipe epoch; returns (entries, bytes) dropped and the new epoch. Every
        snapshot taken before carries an older epoch, which the wipe's tombstone refuses."""
        doomed = [e for e in self._entries.values() if selector.matches(e.namespace, e.tokens)]
        for entry in doomed:
            self._drop(entry.entry_id)
        self.wipe_epoch += 1
        self.counters.wiped += len(doomed)
        self._events.wiped(selector)
        self._publish()
        return len(doomed), sum(e.bytes for e in doomed), self.wipe_epoch

    def stats(self) -> dict[str, Any]:
        """The last published snapshot: safe from any thread."""
        return dict(self._published)

    def _publish(self) -> None:
        # The keys are /stats's `prompt_cache` keys: the cap keeps its public name `max_bytes`.
        self._published = MappingProxyType(
            {
                "entries": len(self._entries),
                "bytes": self.bytes_total,
                "max_bytes": self.bytes_max,
                "companion_bytes": self.companion_bytes_total,
                **attrs.asdict(self.counters),
                # Tenant names only (never keys); the default namespace is the totals above.
                "by_tenant": {
                    owner: {**attrs.asdict(usage), "max_bytes": self.owner_bytes_max.get(owner)}
                    for owner, usage in sorted(self._usage.items())
                    if owner
                },
            }
        )
