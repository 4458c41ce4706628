"""KvScheme: conversion after prefill, byte accounting, cache keys, resolution.

Real tiny random-weight models throughout. Quantized tests use llama/gemma3/
falcon_h1 `small` (head_dim 32) with group size 32, because MLX groups must
divide the head dim and the tiny models have head_dim 16.
"""

from __future__ import annotations

import json
import logging

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlx_cache

from kvcellar.errors import KvCellarError, UsageError
from kvcellar.store.scheme import KvScheme, resolve_kv_scheme, warm_up_prototype_caches

GROUP_32 = 32
PROMPT = mx.array([(7 * i + 3) % 1000 + 5 for i in range(40)])
SCHEME_LOGGER = "kvcellar.store.scheme"


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def prefill_like_mlx_lm(model, prompt: mx.array, scheme: KvScheme, step_size: int = 2048):
    """Process `prompt` on mlx-lm's `generate_step` schedule: all but the last
    token in chunks, converting after each, then the last token alone.
    Returns (caches, logits of the last token)."""
    caches = mlx_cache.make_prompt_cache(model)
    while len(prompt) > 1:
        count = min(step_size, len(prompt) - 1)
        model(prompt[:count][None], cache=caches)
        scheme.convert(caches)
        mx.eval([cache.state for cache in caches])
        prompt = prompt[count:]
    logits = model(prompt[None], cache=caches)[:, -1, :]
    scheme.convert(caches)
    return caches, logits


def greedy_generate(model, prompt: mx.array, scheme: KvScheme, max_tokens: int, step_size: int):
    """Our own greedy loop through `scheme.convert`: (token, logprobs) pairs."""
    caches, logits = prefill_like_mlx_lm(model, prompt, scheme, step_size)
    produced = []
    for _ in range(max_tokens):
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        token = greedy(logprobs)
        mx.eval(token, logprobs)
        produced.append((token.item(), logprobs.squeeze(0)))
        logits = model(token[None], cache=caches)[:, -1, :]
        scheme.convert(caches)
    return produced


def mlx_lm_generate(model, bits: int | None, step_size: int):
    return list(
        generate_step(
            PROMPT,
            model,
            max_tokens=16,
            sampler=greedy,
            prefill_step_size=step_size,
            kv_bits=bits,
            kv_group_size=GROUP_32,
            quantized_kv_start=0,
        )
    )


def reference_bytes(caches) -> int:
    """Independent count: nbytes of every array sliced to its live rows."""
    total = 0
    for cache in caches:
        if isinstance(cache, mlx_cache.CacheList):
            total += reference_bytes(cache.caches)
        elif isinstance(cache, mlx_cache.ArraysCache):
            total += sum(array.nbytes for array in cache.cache if array is not None)
        elif isinstance(cache, mlx_cache.QuantizedKVCache):
            total += sum(array[..., : cache.offset, :].nbytes for array in (*cache.keys, *cache.values))
        else:
            rows = cache.offset - getattr(cache, "start_position", 0)
            total += cache.keys[..., :rows, :].nbytes + cache.values[..., :rows, :].nbytes
    return total


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("step_size", [2048, 16], ids=["one-chunk", "chunked-prefill"])
def test_quantized_continuation_matches_mlx_lm_generation_bit_for_bit(loaded_model_factory, bits, step_size):
    model, _ = loaded_model_factory("llama", "small")
    expected = mlx_lm_generate(model, bits, step_size)
    produced = greedy_generate(model, PROMPT, KvScheme.uniform(bits, GROUP_32), 16, step_size)
    assert [token for token, _ in produced] == [token for token, _ in expected]
    for (_, ours), (_, theirs) in zip(produced, expected, strict=True):
        assert mx.array_equal(ours, theirs).item()
    unquantized = greedy_generate(model, PROMPT, KvScheme.bf16(), 1, step_size)
    assert not mx.array_equal(unquantized[0][1], produced[0][1]).item(), "quantization must change logits"


def test_bf16_continuation_matches_mlx_lm_unquantized_generation(loaded_model_factory):
    model, _ = loaded_model_factory("llama", "small")
    expected = mlx_lm_generate(model, None, 2048)
    produced = greedy_generate(model, PROMPT, KvScheme.bf16(), 16, 2048)
    assert [token for token, _ in produced] == [token for token, _ in expected]
    assert all(mx.array_equal(a, b).item() for (_, a), (_, b) in zip(produced, expected, strict=True))


BYTE_CASES = [
    ("llama", "small", KvScheme.bf16()),
    ("llama", "small", KvScheme.uniform(4, GROUP_32)),
    ("llama", "small", KvScheme.uniform(8, GROUP_32)),
    ("llama", "small", KvScheme.per_layer([4, 8, None, 2, 8, None], GROUP_32)),
    ("gemma3_text", "tiny", KvScheme.bf16()),
    ("gemma3_text", "small", KvScheme.uniform(4, GROUP_32)),
    ("qwen3_next", "tiny", KvScheme.bf16()),
    ("falcon_h1", "small", KvScheme.uniform(8, GROUP_32)),
]


@pytest.mark.parametrize(("arch", "size", "scheme"), BYTE_CASES, ids=lambda v: getattr(v, "cache_key", v))
def test_bytes_for_and_projection_match_real_buffers_without_slack(loaded_model_factory, arch, size, scheme):
    model, _ = loaded_model_factory(arch, size)
    prototypes = warm_up_prototype_caches(model)
    for tokens in (9, 40):
        caches, _ = prefill_like_mlx_lm(model, PROMPT[:tokens], scheme)
        mx.eval([cache.state for cache in caches])
        held = scheme.bytes_for(caches)
        real = reference_bytes(caches)
        assert held == pytest.approx(real, rel=0.02)
        assert held < sum(cache.nbytes for cache in caches), "capacity slack must not be billed"
        assert scheme.projected_bytes(prototypes, tokens) == pytest.approx(held, rel=0.02)


def test_sliding_layers_are_billed_at_most_their_window(loaded_model_factory):
    model, _ = loaded_model_factory("gemma3_text", "tiny")
    window = 32
    caches, _ = prefill_like_mlx_lm(model, PROMPT, KvScheme.bf16())
    rings = [cache for cache in caches if isinstance(cache, mlx_cache.RotatingKVCache)]
    assert rings and all(ring.offset == len(PROMPT) > window for ring in rings)

    def row_bytes(cache) -> int:
        return (cache.keys.nbytes + cache.values.nbytes) // cache.keys.shape[2]

    assert all(KvScheme.bf16().bytes_for([ring]) == window * row_bytes(ring) for ring in rings)
    full_layer_row_bytes = sum(row_bytes(cache) for cache in caches if type(cache) is mlx_cache.KVCache)
    one_more_token = KvScheme.bf16().projected_bytes(model, 1000) - KvScheme.bf16().projected_bytes(model, 999)
    assert one_more_token == full_layer_row_bytes, "past the window only full layers grow"


@pytest.mark.parametrize(("dtype", "scale_bytes"), [("bfloat16", 2), ("float32", 4)])
@pytest.mark.parametrize("bits", [4, 8])
def test_projection_uses_bits_over_8_plus_scale_and_bias_per_group(loaded_model_factory, dtype, scale_bytes, bits):
    model, _ = loaded_model_factory("llama", "small", dtype)
    layers, kv_heads, head_dim, tokens = 6, 4, 32, 100
    elements = tokens * layers * kv_heads * 2 * head_dim
    element_cost = bits / 8 + 2 * scale_bytes / GROUP_32
    projected = KvScheme.uniform(bits, GROUP_32).projected_bytes(model, tokens)
    assert projected == elements * element_cost
    assert KvScheme.bf16().projected_bytes(model, tokens) == elements * scale_bytes


def test_rotating_layers_stay_unquantized_with_exactly_one_warning(loaded_model_factory, caplog):
    model, _ = loaded_model_factory("gemma3_text", "small")
    scheme = KvScheme.uniform(4, GROUP_32)
    with caplog.at_level(logging.WARNING, logger=SCHEME_LOGGER):
        first, _ = prefill_like_mlx_lm(model, PROMPT, scheme)
        second, _ = prefill_like_mlx_lm(model, PROMPT[:12], scheme)
    kinds = [type(cache).__name__ for cache in first + second]
    assert kinds.count("RotatingKVCache") == 6 and kinds.count("QuantizedKVCache") == 6
    assert set(kinds) == {"RotatingKVCache", "QuantizedKVCache"}
    warnings = [record for record in caplog.records if record.name == SCHEME_LOGGER]
    assert len(warnings) == 1 and "rotating" in warnings[0].getMessage()
    assert warnings[0].levelno == logging.WARNING


def test_chunked_layers_stay_unquantized_with_one_warning(loaded_model_factory, caplog):
    model, _ = loaded_model_factory("llama4", "tiny")
    scheme = KvScheme.per_layer([4, 4, 4, None], GROUP_32)
    with caplog.at_level(logging.WARNING, logger=SCHEME_LOGGER):
        caches, _ = prefill_like_mlx_lm(model, PROMPT[:10], scheme)
    assert [type(cache).__name__ for cache in caches] == ["ChunkedKVCache"] * 3 + ["KVCache"]
    assert len([record for record in caplog.records if record.name == SCHEME_LOGGER]) == 1


def test_cache_list_members_convert_and_recurrent_state_is_untouched(loaded_model_factory):
    model, _ = loaded_model_factory("falcon_h1", "small")
    prefilled, _ = prefill_like_mlx_lm(model, PROMPT, KvScheme.bf16())
    recurrent_before = [mx.array(slot) for slot in prefilled[0].caches[0].cache]
    scheme = KvScheme.uniform(4, GROUP_32)
    scheme.convert(prefilled)
    for layer in prefilled:
        assert type(layer) is mlx_cache.CacheList
        assert [type(member).__name__ for member in layer.caches] == ["ArraysCache", "QuantizedKVCache"]
    assert all(mx.array_equal(a, b).item() for a, b in zip(recurrent_before, prefilled[0].caches[0].cache, strict=True))
    logits = model(mx.array([[11]]), cache=prefilled)
    assert bool(mx.all(mx.isfinite(logits)).item())


def test_offset_zero_caches_are_skipped_and_converted_once_populated(loaded_model_factory):
    model, _ = loaded_model_factory("llama", "small")
    scheme = KvScheme.uniform(4, GROUP_32)
    fresh = mlx_cache.make_prompt_cache(model)
    originals = list(fresh)
    assert scheme.convert(fresh) is fresh
    assert all(a is b for a, b in zip(fresh, originals, strict=True))
    caches, _ = prefill_like_mlx_lm(model, PROMPT[:8], KvScheme.bf16())
    empty = mlx_cache.KVCache()
    caches[2] = empty
    scheme.convert(caches)
    assert caches[2] is empty
    assert all(type(cache) is mlx_cache.QuantizedKVCache for i, cache in enumerate(caches) if i != 2)
    empty.update_and_fetch(mx.ones((1, 4, 8, 32)), mx.ones((1, 4, 8, 32)))
    scheme.convert(caches)
    assert type(caches[2]) is mlx_cache.QuantizedKVCache and caches[2].offset == 8
    trimmed, _ = prefill_like_mlx_lm(model, PROMPT[:8], KvScheme.bf16())
    trimmed[0].trim(trimmed[0].offset)
    scheme.convert(trimmed)
    assert type(trimmed[0]) is mlx_cache.KVCache, "a cache trimmed back to offset 0 holds nothing to convert"


def test_convert_is_idempotent_and_bf16_is_identity(loaded_model_factory):
    model, _ = loaded_model_factory("llama", "small")
    caches, _ = prefill_like_mlx_lm(model, PROMPT[:8], KvScheme.bf16())
    untouched = list(caches)
    assert KvScheme.bf16().convert(caches) is caches and all(a is b for a, b in zip(caches, untouched, strict=True))
    scheme = KvScheme.uniform(8, GROUP_32)
    scheme.convert(caches)
    converted = list(caches)
    states = [[mx.array(part) for part in (*cache.keys, *cache.values)] for cache in caches]
    scheme.convert(caches)
    assert all(a is b for a, b in zip(caches, converted, strict=True))
    for cache, before in zip(caches, states, strict=True):
        assert all(mx.array_equal(a, b).item() for a, b in zip((*cache.keys, *cache.values), before, strict=True))


def test_affine_config_quantizes_each_layer_to_its_bits(loaded_model_factory):
    model, _ = loaded_model_factory("llama", "small")
    scheme = KvScheme.per_layer([4, 8, None, 2, 8, None], GROUP_32)
    caches, logits = prefill_like_mlx_lm(model, PROMPT[:12], scheme)
    assert [getattr(cache, "bits", None) for cache in caches] == [4, 8, None, 2, 8, None]
    assert bool(mx.all(mx.isfinite(logits)).item())
    with pytest.raises(UsageError, match="lists 6 layers but the model has 5"):
        scheme.convert(caches[:5])
    with pytest.raises(UsageError, match="lists 6 layers"):
        scheme.projected_bytes(caches[:5], 10)


def test_head_dim_not_divisible_by_group_size_is_a_usage_error(loaded_model_factory):
    model, _ = loaded_model_factory("llama", "tiny")
    caches, _ = prefill_like_mlx_lm(model, PROMPT[:6], KvScheme.bf16())
    with pytest.raises(UsageError, match="not multiples of the KV group size 32"):
        KvScheme.uniform(4, GROUP_32).convert(caches)
    with pytest.raises(UsageError, match="group size"):
        KvScheme.uniform(4, GROUP_32).projected_bytes(model, 10)


def test_cache_keys_name_the_scheme_and_separate_configs():
    assert KvScheme.bf16().cache_key == "bf16"
    assert KvScheme.uniform(4).cache_key == "kv4"
    assert KvScheme.uniform(8).cache_key == "kv8"
    assert KvScheme.uniform(4, 32).cache_key == "kv4g32"
    first = KvScheme.per_layer([4, 8, None]).cache_key
    assert first.startswith("config-") and len(first) == len("config-") + 8
    assert first == KvScheme.per_layer([4, 8, None]).cache_key
    assert first != KvScheme.per_layer([8, 4, None]).cache_key
    assert first != KvScheme.per_layer([4, 8, None], 32).cache_key


def test_batchable_needs_the_capability_probe_for_quantized_schemes():
    assert KvScheme.bf16().batchable() and KvScheme.bf16().batchable(can_convert=False)
    for scheme in (KvScheme.uniform(4), KvScheme.per_layer([8, None])):
        assert scheme.batchable(can_convert=True)
        assert not scheme.batchable(can_convert=False)


@pytest.mark.parametrize(
    ("value", "key"), [("off", "bf16"), ("bf16", "bf16"), ("4", "kv4"), ("kv4", "kv4"), ("8", "kv8"), ("KV8", "kv8")]
)
def test_resolve_maps_cli_values_to_schemes(value, key):
    assert resolve_kv_scheme(value).cache_key == key


def test_resolve_reads_kv_config_beside_the_model(tmp_path):
    (tmp_path / "kv_config.json").write_text(json.dumps({"group_size": 32, "layers": [4, None, 8]}))
    scheme = resolve_kv_scheme("config", tmp_path)
    assert (scheme.kind, scheme.layer_bits, scheme.group_size) == ("affine-config", (4, None, 8), 32)
    (tmp_path / "kv_config.json").write_text(json.dumps({"layers": [8]}))
    assert resolve_kv_scheme("config", tmp_path, group_size=128).group_size == 128


@pytest.mark.parametrize("value", ["turbo", "turboquant"])
def test_resolve_refuses_turboquant_as_out_of_scope(value):
    with pytest.raises(UsageError, match="TurboQuant KV is out of scope"):
        resolve_kv_scheme(value)


def test_resolve_refuses_unknown_values_listing_the_choices():
    with pytest.raises(UsageError, match="choose one of off, bf16, 4, 8, kv4, kv8, config"):
        resolve_kv_scheme("6")
    with pytest.raises(UsageError, match="group size"):
        resolve_kv_scheme("4", group_size=48)


def test_resolve_config_without_kv_config_json_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        resolve_kv_scheme("config", tmp_path)
    with pytest.raises(UsageError, match="no model directory"):
        resolve_kv_scheme("config")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[4, 8]", "must be an object"),
        ('{"layers": []}', "non-empty list"),
        ('{"layers": "4,8"}', "non-empty list"),
        ('{"layers": [4, 3]}', "layer 1: KV bits 3"),
        ('{"layers": [4, true]}', "KV bits True"),
        ('{"layers": [4], "group_size": 48}', "group size 48"),
        ('{"layers": [4], "bits": 8}', "unknown keys"),
    ],
)
def test_resolve_rejects_malformed_kv_config_json(tmp_path, content, message):
    (tmp_path / "kv_config.json").write_text(content)
    with pytest.raises(UsageError, match=message):
        resolve_kv_scheme("config", tmp_path)


def test_invalid_scheme_declarations_are_usage_errors():
    for build in (
        lambda: KvScheme.uniform(3),
        lambda: KvScheme.uniform(4, 48),
        lambda: KvScheme(kind="turbo"),
        lambda: KvScheme.per_layer([]),
        lambda: KvScheme(kind="bf16", bits=4),
    ):
        with pytest.raises(UsageError) as caught:
            build()
        assert isinstance(caught.value, KvCellarError)
    assert KvScheme.uniform(4) == KvScheme.uniform(4)
    assert hash(KvScheme.uniform(4)) == hash(KvScheme.uniform(4))
