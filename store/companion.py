"""Method companion state (spec, "Method companion state"; issue 42): the
draft model's caches riding in the same entry as the target's.

A speculative generation keeps two sets of caches over the same tokens: the
target model's and the draft model's. The tiers hold them as one entry: the
target's caches, then one `CompanionState` holding the draft's, so the RAM
tier bills them together, a `.kvc` file writes them under the same header
checksum and commit (a companion section, format versions 5-8), a generation
checkpoint carries them, and every trim, lend and restore treats them as one.

`drafter` is the draft model's serving-fingerprint digest (its config,
weights and tokenizer files through the same digest memo as the target's):
the companion's identity. State whose drafter is not the one serving is
stale and is never paired with it: `split_companion` hands it back as such,
and the engine re-prefills the draft alone over the target's reused tokens.

Pure: no I/O; MLX only through the cache objects mlx-lm defines.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
from mlx_lm.models import cache as mlx_cache

# Why a take served the target's KV without usable draft state (counted by the engine).
COMPANION_MISSING = "companion_missing"
COMPANION_STALE = "companion_stale"


class CompanionState(mlx_cache.CacheList):
    """The draft model's caches, as one more cache after the target's.

    A `CacheList` for trimming and byte counts, but a class of its own: its
    signature (`companion:<drafter>:list(...)`) names the drafter, so the
    codecs write and rebuild it with its identity."""

    def __init__(self, *caches: Any, drafter: str) -> None:
        super().__init__(*caches)
        self.drafter = drafter


@attrs.frozen(kw_only=True)
class SplitEntry:
    """An entry's caches told apart: the target's, the draft's when they are
    the serving drafter's (else None), and why not (`COMPANION_*`, "" when usable
    or when the entry had none and none was wanted)."""

    target: list[Any]
    draft: list[Any] | None
    reason: str = ""


def has_companion(caches: Sequence[Any]) -> bool:
    return bool(caches) and type(caches[-1]) is CompanionState


def split_companion(caches: Sequence[Any], drafter: str | None) -> SplitEntry:
    """The target's caches, and the draft's when `drafter` (the serving
    drafter's digest; None: no draft serves) wrote them."""
    if not has_companion(caches):
        return SplitEntry(target=list(caches), draft=None, reason=COMPANION_MISSING if drafter else "")
    companion = caches[-1]
    target = list(caches[:-1])
    if drafter is None:
        return SplitEntry(target=target, draft=None)
    if companion.drafter != drafter:
        return SplitEntry(target=target, draft=None, reason=COMPANION_STALE)
    return SplitEntry(target=target, draft=list(companion.caches))


def with_companion(target: Sequence[Any], draft: Sequence[Any] | None, drafter: str) -> list[Any]:
    """The entry form: the target's caches, then the draft's as one `CompanionState` (none without a draft)."""
    if draft is None:
        return list(target)
    return [*target, CompanionState(*draft, drafter=drafter)]


def companion_drafter(caches: Sequence[Any]) -> str | None:
    """The drafter digest of an entry's companion, or None without one."""
    return caches[-1].drafter if has_companion(caches) else None
