"""Which models the pool unloads to make room for one more (issue 41). Pure: no trio, no MLX.

The rule: the models stay within one memory budget (`serve --models-memory-gb`), each counted at its
weights' bytes on disk. To load a model, unload the least recently used unpinned loaded models, oldest
first, until it fits; a pinned model is never chosen, nor a model with requests in flight (it is busy
now, so it is not the least recently used). When even that cannot make room the plan says so and the
pool refuses the request (503) rather than go over the budget.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs


@attrs.frozen(kw_only=True)
class Resident:
    """A loaded (or loading) model as the plan sees it."""

    weights_bytes: int
    last_used_s: float
    pinned: bool = False
    busy: bool = False


@attrs.frozen(kw_only=True)
class UnloadPlan:
    unload: tuple[str, ...]
    fits: bool
    # What the budget would hold after the plan, the wanted model included.
    bytes_after: int


def plan_unloads(resident: Mapping[str, Resident], wanted: str, wanted_bytes: int, budget_bytes: int) -> UnloadPlan:
    """The models to unload, least recently used first, so that `wanted` fits in `budget_bytes`.
    `wanted` already resident needs nothing; a budget of 0 or less means no budget."""
    if wanted in resident:
        return UnloadPlan(unload=(), fits=True, bytes_after=sum(r.weights_bytes for r in resident.values()))
    total = sum(r.weights_bytes for r in resident.values()) + wanted_bytes
    if budget_bytes <= 0 or total <= budget_bytes:
        return UnloadPlan(unload=(), fits=True, bytes_after=total)
    candidates = sorted(
        (name for name, r in resident.items() if not r.pinned and not r.busy),
        key=lambda name: (resident[name].last_used_s, name),
    )
    chosen: list[str] = []
    for name in candidates:
        if total <= budget_bytes:
            break
        chosen.append(name)
        total -= resident[name].weights_bytes
    if total > budget_bytes:
        # Unloading cannot make room: unload nothing rather than lose caches for a load that cannot happen.
        return UnloadPlan(unload=(), fits=False, bytes_after=sum(r.weights_bytes for r in resident.values()))
    return UnloadPlan(unload=tuple(chosen), fits=True, bytes_after=total)


def ram_shares(
    uses: Mapping[str, int],
    total_bytes: int,
    floor_share: float = 0.1,
    *,
    fixed_bytes: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """Each loaded model's share of the RAM prompt cache. A model with a fixed share (`fixed_bytes`, the
    models file's `ram_gb`) gets exactly that; every fixed share is held back whether its model is loaded
    or not, so loading one never shrinks another's. The rest of `total_bytes` goes to the other loaded
    models, proportional to their requests (`uses`), each at least `floor_share` of an equal split so that
    a quiet model keeps a warm entry or two. The shares never sum past `total_bytes` when the fixed ones
    fit in it (`fixed_shares_fit`)."""
    fixed = dict(fixed_bytes or {})
    shares = {name: fixed[name] for name in uses if name in fixed}
    shared_uses = {name: use for name, use in uses.items() if name not in fixed}
    if not shared_uses:
        return shares
    count = len(shared_uses)
    rest_bytes = max(0, total_bytes - sum(fixed.values()))
    floor_bytes = int(rest_bytes / count * floor_share)
    spread = rest_bytes - floor_bytes * count
    used = sum(max(0, use) for use in shared_uses.values())
    for name, use in shared_uses.items():
        part = max(0, use) / used if used else 1 / count
        shares[name] = floor_bytes + int(spread * part)
    return shares


def fixed_shares_fit(fixed_bytes: Mapping[str, int], model_count: int, total_bytes: int) -> bool:
    """Whether the fixed shares fit in the RAM prompt cache: within it when every model has one, else
    strictly within it, so that the models sharing the rest by use get some RAM."""
    held = sum(fixed_bytes.values())
    return held <= total_bytes if len(fixed_bytes) >= model_count else held < total_bytes
