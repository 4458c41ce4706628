"""Cache signatures, trimmability and the usable-prefix rule."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models import cache as mlx_cache

from kvcellar.errors import RefusedCacheKind, UnknownCacheKind
from kvcellar.store import kvfile
from kvcellar.store.signature import (
    cache_signature,
    caches_trimmable,
    entry_minimum_reusable_offset,
    is_trimmable,
    minimum_reusable_offset,
    usable_prefix_length,
)


def _filled(cache, tokens: int, heads: int = 2, head_dim: int = 32):
    keys = mx.ones((1, heads, tokens, head_dim))
    cache.update_and_fetch(keys, keys)
    return cache


def test_every_known_class_has_its_signature():
    assert cache_signature(mlx_cache.KVCache()) == "kv:plain"
    assert cache_signature(mlx_cache.QuantizedKVCache(group_size=32, bits=4)) == "kv:quant:4:32"
    assert cache_signature(mlx_cache.RotatingKVCache(max_size=8)) == "kv:rotating-plain"
    assert cache_signature(mlx_cache.ChunkedKVCache(16)) == "kv:chunked-plain"
    assert cache_signature(mlx_cache.ArraysCache(2)) == "ssm"
    both = mlx_cache.CacheList(mlx_cache.ArraysCache(2), mlx_cache.KVCache())
    assert cache_signature(both) == "list(ssm,kv:plain)"
    assert cache_signature(mlx_cache.BatchKVCache([0])) == "kv:batch-plain"
    assert cache_signature(mlx_cache.BatchRotatingKVCache(8, [0])) == "kv:batch-rotating-plain"


def test_unknown_class_raises_naming_the_class():
    class HomeMadeCache(mlx_cache.KVCache):
        pass

    with pytest.raises(UnknownCacheKind, match="HomeMadeCache"):
        cache_signature(HomeMadeCache())
    with pytest.raises(UnknownCacheKind, match="HomeMadeCache"):
        is_trimmable(mlx_cache.CacheList(mlx_cache.KVCache(), HomeMadeCache()))


def test_concatenate_cache_is_refused_with_the_reason():
    with pytest.raises(RefusedCacheKind, match="trim"):
        cache_signature(mlx_cache.ConcatenateKVCache())


def test_batched_caches_are_refused_by_persistence(tmp_path):
    batch = mlx_cache.BatchKVCache([0])
    with pytest.raises(RefusedCacheKind, match="extract"):
        kvfile.save(tmp_path / "b.kvc", [batch], [])
    assert list(tmp_path.iterdir()) == []


def test_rotating_ring_is_trimmable_only_before_it_wraps():
    ring = _filled(mlx_cache.RotatingKVCache(max_size=8), 5)
    assert is_trimmable(ring) and minimum_reusable_offset(ring, 5) == 0
    _filled(ring, 4)
    assert not is_trimmable(ring) and minimum_reusable_offset(ring, 9) == 9


def test_recurrent_state_is_never_trimmable_and_pins_the_whole_entry():
    ssm = mlx_cache.ArraysCache(2)
    hybrid = [_filled(mlx_cache.KVCache(), 6), ssm]
    assert not is_trimmable(ssm)
    assert not caches_trimmable(hybrid)
    assert entry_minimum_reusable_offset(hybrid, 6) == 6
    assert caches_trimmable([_filled(mlx_cache.KVCache(), 6)])


def test_declared_minimum_reusable_offset_raises_the_bound():
    cache = _filled(mlx_cache.KVCache(), 10)
    cache.minimum_reusable_offset = 7
    assert minimum_reusable_offset(cache, 10) == 7
    listed = mlx_cache.CacheList(_filled(mlx_cache.KVCache(), 10), cache)
    assert minimum_reusable_offset(listed, 10) == 7


@given(
    common=st.integers(0, 50),
    entry=st.integers(1, 50),
    prompt=st.integers(1, 60),
    trimmable=st.booleans(),
    minimum=st.integers(0, 50),
)
def test_usable_prefix_obeys_every_rule(common, entry, prompt, trimmable, minimum):
    common = min(common, entry, prompt)
    usable = usable_prefix_length(common, entry, prompt, trimmable, minimum)
    assert 0 <= usable <= min(common, prompt - 1, entry)
    if usable:
        assert usable >= minimum
        assert trimmable or usable == entry
    elif common and min(common, prompt - 1) >= max(minimum, 1) and (trimmable or min(common, prompt - 1) == entry):
        pytest.fail("a usable prefix was refused")
