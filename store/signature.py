"""Cache signatures: the stable storage identity of every mlx-lm cache class.

A signature names what a cache holds and how it persists (`kv:plain`,
`kv:quant:<bits>:<group>`, `kv:rotating-plain`, `kv:chunked-plain`, `ssm`,
`list(<sig>,...)`). Persistence codecs and the scheduler dispatch on it.
Classes are matched exactly, never by `isinstance`: a subclass may change the
layout, and an unknown class raises `UnknownCacheKind` ("unknown is a bug,
not a route", spec §2.4).

Minimum reusable offset (spec, "Minimum reusable offsets"): the shortest
prefix of an entry that still has a valid representation. A trimmable cache
serves any prefix (0); an untrimmable one only its full length. A cache with
a moving front (`ChunkedKVCache`, whose rows before `start_position` are
gone) serves only prefixes from the first attention-chunk boundary at or past
`start_position`. A cache may declare a larger bound after an irreversible
transition by carrying a `minimum_reusable_offset` attribute; lending and
restoring keep it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlx_lm.models import cache as mlx_cache

from kvcellar.errors import RefusedCacheKind, UnknownCacheKind
from kvcellar.store.companion import CompanionState

SIGNATURE_PLAIN = "kv:plain"
SIGNATURE_ROTATING = "kv:rotating-plain"
SIGNATURE_CHUNKED = "kv:chunked-plain"
SIGNATURE_SSM = "ssm"
SIGNATURE_BATCH_PLAIN = "kv:batch-plain"
SIGNATURE_BATCH_ROTATING = "kv:batch-rotating-plain"
QUANT_PREFIX = "kv:quant:"
# Paged KV (spec §6, engine/paged_kv.py): `kv:paged:<block_size>`, and its batch lane form.
PAGED_PREFIX = "kv:paged:"
BATCH_PAGED_PREFIX = "kv:batch-paged:"
LIST_PREFIX = "list("
# Method companion state (store/companion.py): `companion:<drafter digest>:list(<sig>,...)`.
COMPANION_PREFIX = "companion:"

# Batched caches hold several rows; they reach the scheduler but never
# persistence, which needs one row extracted per entry (spec §4, extract-and-put).
BATCH_SIGNATURES = frozenset({SIGNATURE_BATCH_PLAIN, SIGNATURE_BATCH_ROTATING})

_FIXED_SIGNATURES: dict[type, str] = {
    mlx_cache.KVCache: SIGNATURE_PLAIN,
    mlx_cache.RotatingKVCache: SIGNATURE_ROTATING,
    mlx_cache.ChunkedKVCache: SIGNATURE_CHUNKED,
    mlx_cache.ArraysCache: SIGNATURE_SSM,
    mlx_cache.BatchKVCache: SIGNATURE_BATCH_PLAIN,
    mlx_cache.BatchRotatingKVCache: SIGNATURE_BATCH_ROTATING,
}


def _class_name(cache: Any) -> str:
    cls = type(cache)
    return f"{cls.__module__}.{cls.__qualname__}"


def cache_signature(cache: Any) -> str:
    """The signature of one cache object.

    Raises `RefusedCacheKind` for `ConcatenateKVCache` (its `trim` is unsound)
    and `UnknownCacheKind` for any class without a codec.
    """
    cls = type(cache)
    fixed = _FIXED_SIGNATURES.get(cls)
    if fixed is not None:
        return fixed
    if cls is mlx_cache.QuantizedKVCache:
        return f"{QUANT_PREFIX}{cache.bits}:{cache.group_size}"
    # The paged layouts live in the engine layer (engine/paged_kv.py), above this one, so they name
    # their prefix as a class attribute rather than being imported here; only the two paged prefixes count.
    paged_prefix = getattr(cls, "paged_signature_prefix", None)
    if paged_prefix in (PAGED_PREFIX, BATCH_PAGED_PREFIX):
        return f"{paged_prefix}{cache.block_size}"
    if cls is mlx_cache.CacheList:
        return LIST_PREFIX + ",".join(cache_signature(child) for child in cache.caches) + ")"
    if cls is CompanionState:
        members = LIST_PREFIX + ",".join(cache_signature(child) for child in cache.caches) + ")"
        return f"{COMPANION_PREFIX}{cache.drafter}:{members}"
    if cls is mlx_cache.ConcatenateKVCache:
        raise RefusedCacheKind(
            "ConcatenateKVCache is refused: its trim() only moves offset while fetch returns "
            "every row, so a trimmed prefix would attend to stale keys; use KVCache"
        )
    raise UnknownCacheKind(
        f"unknown cache class {_class_name(cache)}: kvcellar has no signature or codec for it "
        "(unknown is a bug, not a route: teach store/signature.py and store/kvfile.py this class)"
    )


def is_trimmable(cache: Any) -> bool:
    """Whether the cache can drop its last tokens and still be valid.

    Plain, quantized and chunked KV always can (chunked KV only down to its
    moving front, `moving_front_bound`); a rotating ring only before it wraps
    (`offset < max_size`); recurrent state (`ssm`) never; a `CacheList`
    only if all of its members can. Raises like `cache_signature`.
    """
    signature = cache_signature(cache)
    if signature == SIGNATURE_SSM:
        return False
    if signature.startswith((LIST_PREFIX, COMPANION_PREFIX)):
        return all(is_trimmable(child) for child in cache.caches)
    return bool(cache.is_trimmable())


def moving_front_bound(cache: Any) -> int:
    """The shortest prefix a cache whose front moves can still serve (0 for
    any other cache).

    `ChunkedKVCache` (llama4's chunked attention) drops the rows before
    `start_position`. A query at position p attends to the keys of its own
    chunk, `[p // chunk_size * chunk_size, p]`, so a prefix of u tokens is
    sound only when that chunk start of u is at or past `start_position`:
    u >= `start_position` rounded up to the chunk size. (Reusing from
    `start_position` itself would silently drop the chunk's earlier rows from
    the attention.) The cache's own `offset` always meets this bound, because
    mlx-lm keeps the last `chunk_size` rows before every step.
    """
    if type(cache) is not mlx_cache.ChunkedKVCache or cache.start_position <= 0:
        return 0
    chunk_size = int(cache.chunk_size)
    return -(-int(cache.start_position) // chunk_size) * chunk_size


def declared_minimum_reusable_offset(cache: Any) -> int | None:
    """The bound a cache declares by its `minimum_reusable_offset` attribute, if any."""
    declared = getattr(cache, "minimum_reusable_offset", None)
    return None if declared is None else int(declared)


def minimum_reusable_offset(cache: Any, token_count: int) -> int:
    """The shortest prefix length this cache can serve, for an entry of
    `token_count` tokens (recurrent state has no offset of its own)."""
    if type(cache) in (mlx_cache.CacheList, CompanionState):
        bounds = [minimum_reusable_offset(child, token_count) for child in cache.caches]
        return max(bounds, default=0)
    floor = max(0 if is_trimmable(cache) else token_count, moving_front_bound(cache))
    declared = declared_minimum_reusable_offset(cache)
    return max(floor, declared) if declared is not None else floor


def caches_trimmable(caches: Sequence[Any]) -> bool:
    """Whether every cache of an entry can trim."""
    return all(is_trimmable(cache) for cache in caches)


def entry_minimum_reusable_offset(caches: Sequence[Any], token_count: int) -> int:
    """The entry's bound: the largest of its caches' bounds."""
    return max((minimum_reusable_offset(cache, token_count) for cache in caches), default=0)


def usable_prefix_length(
    common_prefix_tokens: int, entry_tokens: int, prompt_tokens: int, trimmable: bool, minimum_reusable: int
) -> int:
    """How many tokens of an entry a prompt can reuse, or 0 when none.

    The match is capped at `prompt_tokens - 1` so at least one token is
    forwarded; serving fewer tokens than the entry holds needs a trimmable
    entry; and the result must reach the entry's minimum reusable offset.
    """
    usable = min(common_prefix_tokens, prompt_tokens - 1, entry_tokens)
    if usable <= 0:
        return 0
    if usable < entry_tokens and not trimmable:
        return 0
    if usable < minimum_reusable:
        return 0
    return usable


def companion_drafter_of(signature: str) -> str:
    """The drafter digest a companion signature names."""
    return signature[len(COMPANION_PREFIX) :].split(":", 1)[0]


def is_paged(signature: str) -> bool:
    """Whether a signature names a paged layout (one row or a batch of them)."""
    return signature.startswith((PAGED_PREFIX, BATCH_PAGED_PREFIX))


def refuse_paged(signature: str, where: str) -> None:
    """The tiers' explicit refusal of paged KV: the engine converts every paged
    layer to a plain `KVCache` at the tier boundary (engine/paged_kv.py), so a
    paged cache reaching a tier is kvcellar's bug, never stored as it is."""
    if is_paged(signature):
        raise RefusedCacheKind(
            f"{where}: {signature} is a paged layout; the tiers hold plain KVCache entries, "
            "converted at the tier boundary (PagedKv.plain)"
        )
