"""What the simulator sees of a run, and the invariants it checks as it goes.

The observer hooks the real system at three places: `PromptCache.put_entry` (what
entered the RAM tier: the oracle for restored bytes), and the store's two
listener hooks (`SsdStore.open`'s `restore_listeners`: every restore is
compared with the oracle; `event_listeners`: what the store evicted,
superseded or quarantined, so durable claims can be followed).

A *claim* is a (namespace, tokens) prefix that a flush reported durable. It
must come back byte-identical after any later crash, unless the store
legitimately dropped it: evicted under its byte cap, or quarantined after a
read fault was injected.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from kvcellar.engine.speculative import Drafter
from kvcellar.simulations.checkpoint_checks import CheckpointObserver
from kvcellar.simulations.fake_engine import FakeModel, cache_arrays
from kvcellar.simulations.sim_disk import SimDisk
from kvcellar.store import events as ev
from kvcellar.store.companion import companion_drafter, has_companion, split_companion
from kvcellar.store.ssd_index import SsdMatch
from kvcellar.store.wipe import WipeSelector

PROBE_TOKEN = 0xFFFFFFFF


@attrs.frozen(kw_only=True)
class Violation:
    invariant: str
    detail: str
    kind: str = "correctness"  # or "liveness", "crash"


@attrs.define(kw_only=True)
class Claim:
    namespace: str
    tokens: tuple[int, ...]
    entry_id: str | None
    released: str = ""


def probe(tokens: Sequence[int]) -> list[int]:
    """`tokens` plus a sentinel no tokenizer emits: `find` on it answers
    "which entry serves all of `tokens`" (usable == len(tokens))."""
    return [*tokens, PROBE_TOKEN]


def arrays_equal(got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> bool:
    return len(got) == len(want) and all(
        g.shape == w.shape and g.dtype == w.dtype and np.array_equal(g, w) for g, w in zip(got, want, strict=True)
    )


class Observer:
    def __init__(self, disk: SimDisk, model: Any, *, corruption_faults: bool, drafter: Drafter | None = None) -> None:
        self.disk = disk
        self.model = model
        # The draft model serving beside the target (the `companion` workload), or None.
        self.drafter = drafter
        # Per put key, the companion drafter of each of its puts (None: put without companion state).
        self.put_forms: dict[tuple[str, tuple[int, ...]], set[str | None]] = {}
        # Silent corruption (read bit flips, misdirected writes) is detected by the
        # checksums and the entry quarantined: a durable claim may then be lost,
        # but corrupt bytes must never be restored.
        self.corruption_faults = corruption_faults
        self.released_by_corruption = 0
        self.violations: list[Violation] = []
        self.oracle: dict[tuple[str, tuple[int, ...]], list[np.ndarray]] = {}
        self.puts: list[tuple[str, tuple[int, ...]]] = []
        self.claims: list[Claim] = []
        self.restores = 0
        self.evicted_since_put = 0
        self._put_epochs: list[int] = []
        self.checkpoints = CheckpointObserver(self.violate)
        # Wipes (issue 39): the puts a wipe removed (a later durable flush does not owe them), and
        # each completed wipe's selector with the index of the first put after it began.
        self._wiped_puts: set[int] = set()
        self.completed_wipes: list[tuple[WipeSelector, int]] = []
        self.puts_at_last_wipe = 0

    def violate(self, invariant: str, detail: str, kind: str = "correctness") -> None:
        self.violations.append(Violation(invariant=invariant, detail=detail, kind=kind))

    # -- hooks ------------------------------------------------------------------

    def attach(self, system: Any) -> None:
        self.checkpoints.new_process()
        cache = system.prompt_cache
        # `put_entry` is the one chokepoint: `put` and the lanes' own puts go through it.
        put = cache.put_entry

        def observed_put(
            tokens: Sequence[int], caches: Sequence[Any], namespace: str = "", *args: Any, **kw: Any
        ) -> Any:
            key = (namespace, tuple(int(t) for t in tokens))
            split = split_companion(caches, None)
            arrays = cache_arrays(split.target, len(key[1]))
            self._check_fresh(key, arrays)
            if has_companion(caches):
                self._check_companion(key[1], caches[-1], f"a put in namespace {namespace!r}")
            self.put_forms.setdefault(key, set()).add(companion_drafter(caches))
            self.oracle[key] = arrays
            self.puts.append(key)
            self._put_epochs.append(self.evicted_since_put)
            return put(tokens, caches, namespace, *args, **kw)

        cache.put_entry = observed_put
        wipe = cache.wipe

        def observed_wipe(selector: WipeSelector) -> Any:
            # The RAM tier's wipe is the line: the puts before it are wiped, those after are new.
            self._wiped_puts.update(i for i, (ns, tokens) in enumerate(self.puts) if selector.matches(ns, tokens))
            self.puts_at_last_wipe = len(self.puts)
            return wipe(selector)

        cache.wipe = observed_wipe

    def store_listeners(self) -> dict[str, Any]:
        """`SsdStore.open`'s listener arguments for the system's store: every
        event it journals is followed, every restore checked."""
        return {"event_listeners": (self.follow, self.checkpoints.follow), "restore_listeners": (self.restored,)}

    def restored(self, match: Any, entry: Any, caches: Sequence[Any]) -> None:
        self.restores += 1
        self._check_final_file(entry)
        tokens = tuple(int(t) for t in entry.tokens[: match.usable_tokens])
        if self.check_restored(match.namespace, tokens, caches, "restore"):
            self.check_form(match.namespace, tuple(int(t) for t in entry.tokens), caches, "restore")

    def _check_final_file(self, entry: Any) -> None:
        name = Path(entry.path).name
        if name.startswith(".") or not name.endswith(".kvc") or "quarantine" in str(entry.path):
            self.violate("no_partial_restore", f"restored from {entry.path}, which is not a committed entry file")

    def follow(self, event: Any) -> None:
        """Track what the store dropped (idempotent: an event may arrive twice)."""
        if isinstance(event, ev.EntryEvicted):
            self.evicted_since_put += 1
            self._release(event.entry_id, "evicted under the byte cap")
        elif isinstance(event, ev.EntrySuperseded):
            for claim in self.claims:
                if claim.entry_id == event.entry_id and not claim.released:
                    claim.entry_id = event.by_entry_id
        elif isinstance(event, ev.EntryQuarantined) and self.corruption_faults:
            self.evicted_since_put += 1
            self._release(event.entry_id, "quarantined after injected silent corruption")

    def _release(self, entry_id: str, reason: str) -> None:
        for claim in self.claims:
            if claim.entry_id == entry_id and not claim.released:
                claim.released = reason

    # -- oracle -------------------------------------------------------------------

    def expected(self, namespace: str, tokens: tuple[int, ...]) -> list[np.ndarray] | None:
        if isinstance(self.model, FakeModel):
            return self.model.expected_layer_arrays(tokens)
        exact = self.oracle.get((namespace, tokens))
        if exact is not None:
            return exact
        for (put_namespace, put_tokens), arrays in self.oracle.items():
            if put_namespace == namespace and put_tokens[: len(tokens)] == tokens and all(a.ndim == 4 for a in arrays):
                return [a[..., : len(tokens), :] for a in arrays]
        return None

    def _check_fresh(self, key: tuple[str, tuple[int, ...]], arrays: list[np.ndarray]) -> None:
        if isinstance(self.model, FakeModel) and not arrays_equal(arrays, self.model.expected_layer_arrays(key[1])):
            self.violate(
                "ram_holds_exact_bytes",
                f"a put of {len(key[1])} tokens in namespace {key[0]!r} holds bytes the model never made",
            )

    def check_restored(self, namespace: str, tokens: tuple[int, ...], caches: Sequence[Any], where: str) -> bool:
        """The restored target caches hold the model's bytes for `tokens`, and any
        companion state the serving drafter's over exactly the same tokens."""
        if has_companion(caches) and not self._check_companion(tokens, caches[-1], f"{where} in {namespace!r}"):
            return False
        want = self.expected(namespace, tokens)
        if want is None:
            return True
        if not arrays_equal(cache_arrays(split_companion(caches, None).target, len(tokens)), want):
            self.violate(
                "no_corrupt_restore",
                f"{where}: {len(tokens)} tokens in namespace {namespace!r} came back with different bytes",
            )
            return False
        return True

    def _check_companion(self, tokens: tuple[int, ...], companion: Any, where: str) -> bool:
        """Companion state is the serving drafter's and holds its bytes for
        exactly the target's tokens: never another drafter's, never other tokens."""
        if self.drafter is None or companion.drafter != self.drafter.digest:
            self.violate(
                "companion_is_the_serving_drafters",
                f"{where}: {len(tokens)} tokens paired with drafter {companion.drafter!r}'s companion state",
            )
            return False
        want = self.drafter.model.expected_layer_arrays(tokens)
        if not arrays_equal(cache_arrays(companion.caches, len(tokens)), want):
            self.violate(
                "companion_covers_the_target_tokens",
                f"{where}: the companion state of {len(tokens)} tokens holds other tokens' draft KV",
            )
            return False
        return True

    def check_form(self, namespace: str, entry_tokens: tuple[int, ...], caches: Sequence[Any], where: str) -> None:
        """An entry restores in a form it was put in: with the companion state
        of a drafter that a put of its tokens carried, or without one only if a
        put was without (a split write would leave a target alone)."""
        forms = self.put_forms.get((namespace, entry_tokens))
        form = companion_drafter(caches)
        if forms is not None and form not in forms:
            had = "without" if form is None else f"with drafter {form!r}'s"
            self.violate(
                "entry_restores_as_put",
                f"{where}: the entry of {len(entry_tokens)} tokens in {namespace!r} came back {had} companion "
                "state, which no put of those tokens had",
            )

    def check_entries_as_put(self, store: Any, entries: Sequence[Any]) -> None:
        """After recovery: every indexed entry restores whole in a form it was put in."""
        for entry in entries:
            tokens = tuple(int(t) for t in entry.tokens)
            match = SsdMatch(
                entry_id=entry.entry_id, namespace=entry.namespace, usable_tokens=len(tokens), entry_tokens=len(tokens)
            )
            caches = store.restore(match)
            if caches is not None and self.check_restored(entry.namespace, tokens, caches, "recovered entry"):
                self.check_form(entry.namespace, tokens, caches, "recovered entry")

    # -- durable claims ---------------------------------------------------------------

    def flush_reported(self, durable: bool, puts_from: int, puts_before: int, store: Any) -> None:
        """Record a verdict; on `durable`, every put of this process before the flush is claimed,
        and each claim must already be on the platter (no pending data, no
        revertible name, no failed fsync) — checked on the disk model itself."""
        if not durable:
            return
        durable_files: dict[Any, bytes] | None = None  # the platter's image, read once per verdict
        for index in range(puts_from, puts_before):
            namespace, tokens = self.puts[index]
            if index in self._wiped_puts or any(c.namespace == namespace and c.tokens == tokens for c in self.claims):
                continue
            match = store.find(probe(tokens), namespace)
            if match is None or match.usable_tokens < len(tokens):
                if self.evicted_since_put > self._put_epochs[index]:
                    continue
                self.violate(
                    "durable_means_covered",
                    f"flush said durable but {len(tokens)} tokens in {namespace!r} have no SSD entry",
                )
                continue
            self.claims.append(Claim(namespace=namespace, tokens=tokens, entry_id=match.entry_id))
            if durable_files is None:
                durable_files = self.disk.files(durable=True)
            self._check_on_platter(store, match.entry_id, tokens, durable_files)

    def _check_on_platter(
        self, store: Any, entry_id: str, tokens: tuple[int, ...], durable_files: dict[Any, bytes]
    ) -> None:
        entry = store.entry(entry_id)
        if entry is None:
            return
        relative = Path(entry.path).relative_to(self.disk.root)
        durable = durable_files.get(_posix(relative))
        if durable is None or durable != self.disk.read_bytes(entry.path):
            self.violate(
                "durable_is_on_disk",
                f"flush said durable but the entry for {len(tokens)} tokens ({relative}) "
                "could still be lost: its data or its name is not synced",
            )

    # -- wipes --------------------------------------------------------------------------

    def wipe_completed(self, selector: WipeSelector) -> None:
        """A wipe answered done: what it selected among the puts before its RAM removal must stay gone."""
        self.completed_wipes.append((selector, self.puts_at_last_wipe))

    def check_wiped_stay_wiped(self, keys: Iterable[tuple[str, Sequence[int]]], where: str) -> None:
        """No entry a completed wipe selected is found again, unless put again after its RAM removal."""
        if not self.completed_wipes:
            return
        for namespace, tokens in keys:
            key = (namespace, tuple(int(t) for t in tokens))
            for selector, puts_at_wipe in self.completed_wipes:
                if selector.matches(*key) and key not in self.puts[puts_at_wipe:]:
                    self.violate(
                        "wiped_stays_wiped",
                        f"{len(key[1])} tokens in {namespace!r} were wiped and are found again in {where}",
                    )
                    return

    def check_claims(self, store: Any) -> int:
        """After recovery: every live claim restores byte-identical. Returns how many were checked."""
        checked = 0
        for claim in self.claims:
            if claim.released:
                continue
            match = store.find(probe(claim.tokens), claim.namespace)
            lost = match is None or match.usable_tokens < len(claim.tokens)
            caches = None if lost else store.restore(match)
            if (lost or caches is None) and self.corruption_faults:
                claim.released = "lost to injected silent corruption (detected, not restored)"
                self.released_by_corruption += 1
                continue
            if lost:
                self.violate(
                    "durable_prefix_survives",
                    f"{len(claim.tokens)} tokens in {claim.namespace!r} were reported durable "
                    "but no entry serves them after recovery",
                )
                continue
            if caches is None:
                self.violate(
                    "durable_prefix_survives",
                    f"{len(claim.tokens)} tokens in {claim.namespace!r} were reported durable "
                    "but their entry failed to restore",
                )
                continue
            self.check_restored(claim.namespace, claim.tokens, caches, "durable claim")
            checked += 1
        return checked


def _posix(relative: Path) -> Any:
    from pathlib import PurePosixPath

    return PurePosixPath(relative.as_posix())
