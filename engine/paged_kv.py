"""Optional paged KV (spec §6, `serve --paged-kv`): full-attention KV held in
fixed-size blocks of a per-layer pool instead of one contiguous buffer.

`BlockPool` is one layer's arena of one request: K and V pool tensors
`[kv_heads, blocks, block_size, head_dim]` (V may differ in head dim; heads
outermost rather than the spec's `[blocks, kv_heads, ...]`, so consecutive
blocks are one strided view, see `_gathered`),
allocated by MLX (`mx.zeros`) on the first write, with a LIFO free list. It is
sized once from the request's prompt plus `max_tokens` (the admission's own
projection), so `PagedPoolExhausted` is a tripwire for an accounting bug,
never silent truncation.

`PagedKVCache` is the serial row: `update_and_fetch` splits the incoming
tokens at block boundaries, allocating a tail block as each is reached, then
gathers the occupied blocks (a strided view of the pool when they are
consecutive, one concatenation otherwise, cut to `offset`): the same bytes a plain `KVCache` returns, differently
arranged. `trim` rewinds `offset` and frees the now-unoccupied tail blocks
(the stale bytes past `offset` are never read: `KVCache`'s padding
invariant, block-shaped).

`BatchPagedKVCache` is the batch lane's merged layer: each row keeps its own
`PagedKVCache` (its own block table and pool), and the batch keeps exactly
`BatchKVCache`'s index bookkeeping (`_idx`, per-row left padding), so the
transient tensor it gathers for the attention op has the shape and the real
rows' positions `BatchKVCache` would have had, and the mask is the same call.
Only that transient tensor is padded; the held KV is each row's blocks.

Tier boundary (spec §6.3, the "better" option): the tiers only ever see plain
`KVCache` layers. `PagedKv.page` copies what the tiers lent (or a checkpoint
restored) into blocks before prefill; `to_plain` (`PagedKv.plain`, and every
row `extract`) gathers a contiguous plain copy for `put`, the prompt-boundary
snapshot and checkpoints. A paged cache that reaches a tier anyway is refused
by signature (`kv:paged:<block>`, store/signature.py).

Everything here runs on the engine thread; `PagedPoolLedger` is the one
exception: its counters are written by the engine thread (and by pool
finalizers, wherever the last reference drops) and read by `/stats`, under
its lock, which guards only that arithmetic.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.base import create_causal_mask

from kvcellar.errors import PagedLayoutError, PagedPoolExhausted, UsageError
from kvcellar.store.signature import BATCH_PAGED_PREFIX, PAGED_PREFIX

BLOCK_SIZE_DEFAULT = 256  # = KVCache.step: v1's growth granularity, permuted into reusable slots
_PAGEABLE = mlx_cache.KVCache
# Kinds a paged model may keep beside its paged full-attention layers (they stay as they are).
_KEPT_KINDS = (mlx_cache.RotatingKVCache, mlx_cache.ArraysCache)


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` tokens."""
    return -(-max(0, tokens) // block_size)


class PagedPoolLedger:
    """Live pool counters for `/stats`: pools, blocks reserved and blocks free,
    and how many pools were ever made (one per paged layer of each request)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._lock = threading.Lock()
        self._pools = 0
        self._blocks_total = 0
        self._blocks_used = 0
        self._pools_created = 0

    def _change(self, pools: int, total: int, used: int) -> None:
        with self._lock:
            self._pools_created += max(0, pools)
            self._pools += pools
            self._blocks_total += total
            self._blocks_used += used

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "block_size": self.block_size,
                "pools": self._pools,
                "blocks_total": self._blocks_total,
                "blocks_free": self._blocks_total - self._blocks_used,
                "pools_created": self._pools_created,
            }

    def __deepcopy__(self, memo: dict) -> PagedPoolLedger:
        # One ledger per server: a copied pool still reports to it.
        return self


class _PoolCount:
    """A pool's own share of the ledger, which its finalizer hands back."""

    def __init__(self, ledger: PagedPoolLedger | None, blocks: int) -> None:
        self.ledger = ledger
        self.blocks = blocks
        self.used = 0
        if ledger is not None:
            ledger._change(1, blocks, 0)

    def change_used(self, delta: int) -> None:
        self.used += delta
        if self.ledger is not None:
            self.ledger._change(0, 0, delta)

    def release(self) -> None:
        if self.ledger is not None:
            self.ledger._change(-1, -self.blocks, -self.used)
            self.ledger = None


class BlockPool:
    """One layer's block arena of one request (see the module docstring)."""

    def __init__(self, *, blocks: int, block_size: int, ledger: PagedPoolLedger | None = None) -> None:
        if blocks < 1 or block_size < 1:
            raise UsageError(f"a block pool needs at least one block of one token, got {blocks} x {block_size}")
        self.blocks_total = blocks
        self.block_size = block_size
        self.k_pool: mx.array | None = None
        self.v_pool: mx.array | None = None
        # LIFO: the block freed last is handed out first (block 0 first on a fresh pool).
        self._free = list(range(blocks - 1, -1, -1))
        self._count = _PoolCount(ledger, blocks)
        weakref.finalize(self, self._count.release)

    @property
    def blocks_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise PagedPoolExhausted(
                f"the block pool's {self.blocks_total} blocks of {self.block_size} tokens are all in use "
                "(it was sized from the prompt plus max_tokens: an accounting bug)"
            )
        self._count.change_used(1)
        return self._free.pop()

    def free(self, block: int) -> None:
        self._free.append(block)
        self._count.change_used(-1)

    def write(self, block: int, within: int, keys: mx.array, values: mx.array) -> None:
        """Write `[H, l, D]` pieces at `[:, block, within:within+l, :]`."""
        if self.k_pool is None or self.v_pool is None:
            heads, _, k_dim = keys.shape
            shape = (heads, self.blocks_total, self.block_size)
            self.k_pool = mx.zeros((*shape, k_dim), keys.dtype)
            self.v_pool = mx.zeros((*shape, values.shape[-1]), values.dtype)
        end = within + keys.shape[1]
        self.k_pool[:, block, within:end, :] = keys
        self.v_pool[:, block, within:end, :] = values

    def gather(self, table: Sequence[int], tokens: int) -> tuple[mx.array, mx.array]:
        """The first `tokens` tokens of the blocks in `table`, as `[1, H, tokens, D]`."""
        assert self.k_pool is not None and self.v_pool is not None
        return _gathered(self.k_pool, table, tokens), _gathered(self.v_pool, table, tokens)

    @property
    def nbytes(self) -> int:
        if self.k_pool is None or self.v_pool is None:
            return 0
        return self.k_pool.nbytes + self.v_pool.nbytes

    def __deepcopy__(self, memo: dict) -> BlockPool:
        # mlx-lm deep-copies a prompt batch before splitting it: the copy is a
        # pool of its own, counted as one.
        clone = BlockPool(blocks=self.blocks_total, block_size=self.block_size, ledger=self._count.ledger)
        # New array objects: a slice write rebinds the object it is made through, so sharing one would alias.
        clone.k_pool, clone.v_pool = copy.deepcopy(self.k_pool, memo), copy.deepcopy(self.v_pool, memo)
        clone._free = list(self._free)
        clone._count.change_used(self.blocks_total - len(self._free))
        return clone


def _gathered(pool: mx.array, table: Sequence[int], tokens: int) -> mx.array:
    """The pool seen as `[1, H, blocks * block_size, D]` (a free reshape: the
    pool is contiguous). A table of consecutive blocks, which a request's own
    LIFO pool hands out (trim gives the tail back, the next writes take it in
    the same order), is one strided slice of that, as a plain `KVCache`'s
    buffer is: no copy. Any other table is one concatenation of its blocks."""
    heads, blocks, block_size, dim = pool.shape
    flat = pool.reshape(1, heads, blocks * block_size, dim)
    first = table[0] if table else 0
    if list(table) == list(range(first, first + len(table))):
        start = first * block_size
        return flat[:, :, start : start + tokens, :]
    pieces = [flat[:, :, block * block_size : (block + 1) * block_size, :] for block in table]
    return mx.concatenate(pieces, axis=2)[:, :, :tokens, :]


class PagedKVCache:
    """One request's paged full-attention layer (`kv:paged:<block_size>`)."""

    # How store/signature.py names this layout (the store layer cannot import this module).
    paged_signature_prefix = PAGED_PREFIX

    def __init__(self, *, block_size: int, capacity_tokens: int, ledger: PagedPoolLedger | None = None) -> None:
        self.block_size = block_size
        blocks = blocks_for(max(1, capacity_tokens), block_size)
        self.pool = BlockPool(blocks=blocks, block_size=block_size, ledger=ledger)
        self.block_table: list[int] = []
        self.offset = 0

    def append(self, keys: mx.array, values: mx.array) -> None:
        """Write `[1, H, L, D]` keys and values after `offset`, split at block boundaries."""
        if keys.shape[0] != 1:
            raise UsageError(f"a paged cache holds one row, got a batch of {keys.shape[0]}")
        written, length = 0, keys.shape[2]
        while written < length:
            position = self.offset + written
            within = position % self.block_size
            if within == 0 and position // self.block_size == len(self.block_table):
                self.block_table.append(self.pool.alloc())
            piece = min(length - written, self.block_size - within)
            block = self.block_table[position // self.block_size]
            end = written + piece
            self.pool.write(block, within, keys[0, :, written:end], values[0, :, written:end])
            written += piece
        self.offset += length

    def fetch(self) -> tuple[mx.array, mx.array]:
        """The held keys and values, `[1, H, offset, D]`."""
        return self.pool.gather(self.block_table, self.offset)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.append(keys, values)
        return self.fetch()

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        return mlx_cache.create_attention_mask(N, self.offset, return_array, window_size)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last `n` tokens; the tail blocks they leave empty go back to the free list."""
        n = min(self.offset, n)
        self.offset -= n
        while len(self.block_table) > blocks_for(self.offset, self.block_size):
            self.pool.free(self.block_table.pop())
        return n

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.pool.k_pool is None

    @property
    def state(self) -> list[mx.array]:
        """The arrays to evaluate at a prefill chunk boundary."""
        return [a for a in (self.pool.k_pool, self.pool.v_pool) if a is not None]

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    @property
    def blocks_held(self) -> int:
        return len(self.block_table)

    def to_plain(self) -> mlx_cache.KVCache:
        """A plain `KVCache` holding an owned, contiguous copy (the tier boundary)."""
        plain = mlx_cache.KVCache()
        if self.offset:
            keys, values = self.fetch()
            plain.keys, plain.values = mx.contiguous(keys), mx.contiguous(values)
            mx.eval(plain.keys, plain.values)
        plain.offset = self.offset
        return plain

    @classmethod
    def from_plain(
        cls, plain: Any, *, block_size: int, capacity_tokens: int, ledger: PagedPoolLedger | None = None
    ) -> PagedKVCache:
        paged = cls(block_size=block_size, capacity_tokens=capacity_tokens, ledger=ledger)
        if plain.keys is not None and plain.offset:
            paged.append(plain.keys[..., : plain.offset, :], plain.values[..., : plain.offset, :])
        return paged

    @classmethod
    def merge(cls, caches: list[PagedKVCache]) -> BatchPagedKVCache:
        return BatchPagedKVCache.merge(caches)


class BatchPagedKVCache:
    """The batch lane's merged paged layer (`kv:batch-paged:<block_size>`).

    Invariant, per row i: `rows[i].offset + unwritten[i] == _idx - left[i]`.
    `unwritten[i]` is the right padding mlx-lm adds to a short row's prompt
    chunk: it is never written into the row's blocks (it would overrun a pool
    sized from the real tokens), only zero-padded into the gathered tensor,
    where the causal mask hides it from every real query, as in `BatchKVCache`.
    """

    # How store/signature.py names this layout (the store layer cannot import this module).
    paged_signature_prefix = BATCH_PAGED_PREFIX

    def __init__(self, rows: list[PagedKVCache], left: list[int], idx: int) -> None:
        self.rows = rows
        self.block_size = rows[0].block_size if rows else BLOCK_SIZE_DEFAULT
        self._left = left
        self._idx = idx
        self._unwritten = [0] * len(rows)
        # During a right-padded prompt call: each row's real tokens still to come.
        self._real_left: list[int] | None = None

    @classmethod
    def merge(cls, caches: list[PagedKVCache]) -> BatchPagedKVCache:
        lengths = [cache.offset for cache in caches]
        longest = max(lengths, default=0)
        return cls(list(caches), [longest - length for length in lengths], longest)

    @property
    def offset(self) -> mx.array:
        return mx.array([self._idx - left for left in self._left])

    @property
    def left_padding(self) -> mx.array:
        return mx.array(self._left)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        length = keys.shape[2]
        for i, row in enumerate(self.rows):
            real = length if self._real_left is None else min(length, self._real_left[i])
            if real:
                row.append(keys[i : i + 1, :, :real], values[i : i + 1, :, :real])
            if self._real_left is not None:
                self._real_left[i] -= real
            self._unwritten[i] += length - real
        self._idx += length
        return self._gather(keys, values)

    def _gather(self, keys_in: mx.array, values_in: mx.array) -> tuple[mx.array, mx.array]:
        """The transient `[B, H, _idx, D]` attention input: each row's tokens
        (a view of its pool) between zeros at `[left, left + offset)`, one
        concatenation per row, then one across rows. (Writing rows into an
        `mx.zeros` buffer instead materializes the broadcast zeros once per row.)"""
        keys, values = [], []
        for row, left in zip(self.rows, self._left, strict=True):
            right = self._idx - left - row.offset
            if row.offset:
                row_keys, row_values = row.fetch()
            else:  # nothing written yet: all padding
                row_keys, row_values = keys_in[:1, :, :0, :], values_in[:1, :, :0, :]
            keys.append(_padded(row_keys, left, right))
            values.append(_padded(row_values, left, right))
        return mx.concatenate(keys, axis=0), mx.concatenate(values, axis=0)

    def prepare(self, *, left_padding: Any = None, lengths: Any = None, right_padding: Any = None) -> None:
        if left_padding is not None:
            raise PagedLayoutError("a paged batch takes no left padding (mlx-lm's BatchGenerator never asks for it)")
        if right_padding is not None and max(right_padding) > 0:
            self._real_left = [int(length) for length in lengths]

    def finalize(self) -> None:
        """End of a right-padded prompt call: the padding becomes left padding (`BatchKVCache` rolls it there)."""
        if self._real_left is None:
            return
        self._left = [left + unwritten for left, unwritten in zip(self._left, self._unwritten, strict=True)]
        self._unwritten = [0] * len(self.rows)
        self._real_left = None

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def filter(self, batch_indices: Sequence[int]) -> None:
        indices = [int(i) for i in batch_indices]
        self.rows = [self.rows[i] for i in indices]
        self._left = [self._left[i] for i in indices]
        self._unwritten = [self._unwritten[i] for i in indices]
        shift = min(self._left, default=0)
        if shift > 0:
            self._idx -= shift
            self._left = [left - shift for left in self._left]

    def extend(self, other: BatchPagedKVCache) -> None:
        longest = max(self._idx, other._idx)
        self._left = [left + longest - self._idx for left in self._left] + [
            left + longest - other._idx for left in other._left
        ]
        self.rows = self.rows + other.rows
        self._unwritten = self._unwritten + other._unwritten
        self._idx = longest

    def extract(self, idx: int) -> mlx_cache.KVCache:
        return self.rows[idx].to_plain()

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n, *(row.offset for row in self.rows))
        for row in self.rows:
            row.trim(n)
        self._idx -= n
        return n

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return all(row.empty() for row in self.rows)

    @property
    def state(self) -> list[mx.array]:
        return [array for row in self.rows for array in row.state]

    @property
    def nbytes(self) -> int:
        return sum(row.nbytes for row in self.rows)

    def __deepcopy__(self, memo: dict) -> BatchPagedKVCache:
        clone = BatchPagedKVCache([copy.deepcopy(row, memo) for row in self.rows], list(self._left), self._idx)
        clone._unwritten = list(self._unwritten)
        clone._real_left = None if self._real_left is None else list(self._real_left)
        return clone


def _padded(row: mx.array, left: int, right: int) -> mx.array:
    """`row` (`[1, H, n, D]`) with `left` and `right` zero tokens around it."""
    if not left and not right:
        return row
    _, heads, _, dim = row.shape
    pieces = [mx.zeros((1, heads, left, dim), row.dtype)] if left else []
    pieces.append(row)
    if right:
        pieces.append(mx.zeros((1, heads, right, dim), row.dtype))
    return mx.concatenate(pieces, axis=2)


def paged_model_refusal(caches: Sequence[Any]) -> str | None:
    """Why a model's fresh caches cannot be paged (spec §6.3), or None: paging
    replaces plain `KVCache` layers only, beside which sliding rings and
    recurrent state stay as they are; any other kind (chunked attention, a
    cache list, a quantized cache) refuses, as does a model with no plain layer."""
    for index, cache in enumerate(caches):
        if type(cache) is not _PAGEABLE and type(cache) not in _KEPT_KINDS:
            return (
                f"layer {index} keeps a {type(cache).__name__} cache; --paged-kv pages plain KVCache "
                "full-attention layers only (beside sliding-window rings and recurrent state)"
            )
    if not any(type(cache) is _PAGEABLE for cache in caches):
        return "the model has no plain KVCache full-attention layer for --paged-kv to page"
    return None


@attrs.frozen(kw_only=True)
class PagedKv:
    """The server's paged-KV layout: its block size and the pool ledger."""

    block_size: int = BLOCK_SIZE_DEFAULT
    ledger: PagedPoolLedger = attrs.field(eq=False)

    @classmethod
    def with_block_size(cls, block_size: int) -> PagedKv:
        if block_size < 1:
            raise UsageError(f"the paged-KV block size must be a positive number of tokens, got {block_size}")
        return cls(block_size=block_size, ledger=PagedPoolLedger(block_size))

    def page(self, caches: Sequence[Any], capacity_tokens: int) -> list[Any]:
        """The request's caches with every plain layer paged (a copy of what it
        held, as the tiers lent it), pools sized for `capacity_tokens`."""
        return [
            PagedKVCache.from_plain(
                cache, block_size=self.block_size, capacity_tokens=capacity_tokens, ledger=self.ledger
            )
            if type(cache) is _PAGEABLE
            else cache
            for cache in caches
        ]

    def plain(self, caches: Sequence[Any]) -> list[Any]:
        """The tier form: every paged layer as a plain, owned `KVCache` copy."""
        return [cache.to_plain() if type(cache) is PagedKVCache else cache for cache in caches]

    def stats(self) -> dict[str, int]:
        return self.ledger.stats()
