"""The demo-coder's attention window (engine/attention_window.py): what it computes
equals full attention under a banded mask, chunked or not, on the serial and the
batch caches, and the cache stays a plain trimmable KVCache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, make_prompt_cache

from kvcellar.engine.attention_window import WINDOW_CONFIG_KEY, WindowedAttention, model_classes
from kvcellar.engine.demo_models import packaged_demo_coder_dir
from kvcellar.engine.engine import _load
from kvcellar.errors import ModelError

WINDOW = 16
CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 100,
    WINDOW_CONFIG_KEY: WINDOW,
}


@pytest.fixture(scope="module")
def models() -> tuple[Any, Any]:
    model_class, args_class = model_classes(CONFIG)
    args = args_class.from_dict(CONFIG)
    mx.random.seed(0)
    windowed = model_class(args)
    mx.eval(windowed.parameters())
    plain = llama.Model(args)
    plain.update(windowed.parameters())
    return windowed, plain


def banded_reference(plain: Any, ids: mx.array) -> mx.array:
    """Full attention over every key, with the band (p - W, p] as its mask."""
    hidden = plain.model.embed_tokens(ids)
    band = create_causal_mask(ids.shape[1], window_size=WINDOW)
    for layer in plain.model.layers:
        hidden = layer(hidden, band, None)
    return plain.model.embed_tokens.as_linear(plain.model.norm(hidden))


def close(a: mx.array, b: mx.array) -> bool:
    return bool(mx.allclose(a, b, atol=1e-5).item())


def test_chunked_prefill_and_decode_equal_the_banded_reference(models: tuple[Any, Any]) -> None:
    windowed, plain = models
    ids = mx.random.randint(0, 100, (1, 70))
    reference = banded_reference(plain, ids)
    cache = make_prompt_cache(windowed)
    assert all(type(layer) is KVCache for layer in cache)
    pieces = [windowed(ids[:, a:b], cache=cache) for a, b in [(0, 10), (10, 40), (40, 41), (41, 65), (65, 70)]]
    assert close(mx.concatenate(pieces, axis=1), reference)
    # Every row is kept (the window is the attention's, not the cache's).
    assert cache[0].offset == 70


def test_up_to_the_window_it_is_full_attention(models: tuple[Any, Any]) -> None:
    windowed, plain = models
    ids = mx.random.randint(0, 100, (1, WINDOW))
    assert close(windowed(ids), plain(ids))
    longer = mx.random.randint(0, 100, (1, 3 * WINDOW))
    assert not close(windowed(longer), plain(longer))


def test_trim_then_extend_equals_a_fresh_prefill(models: tuple[Any, Any]) -> None:
    """Prefix reuse: a cache trimmed back to a shared prefix continues as if fresh."""
    windowed, _ = models
    ids = mx.random.randint(0, 100, (1, 60))
    other = mx.concatenate([ids[:, :35], mx.random.randint(0, 100, (1, 25))], axis=1)
    cache = make_prompt_cache(windowed)
    windowed(ids, cache=cache)
    for layer in cache:
        layer.trim(25)
    reused = windowed(other[:, 35:], cache=cache)
    assert close(reused, windowed(other)[:, 35:])


def test_batch_rows_with_left_padding(models: tuple[Any, Any]) -> None:
    windowed, plain = models
    ids = mx.random.randint(0, 100, (1, 45))
    reference = banded_reference(plain, ids)
    padded = mx.concatenate([mx.zeros((1, 5), dtype=ids.dtype), ids[:, :35]], axis=1)
    cache = [BatchKVCache(left_padding=[0, 5]) for _ in range(2)]
    out = windowed(mx.concatenate([ids[:, :40], padded], axis=0), cache=cache)
    assert close(out[0], reference[0, :40]) and close(out[1, 5:], reference[0, :35])
    step = windowed(mx.array([[int(ids[0, 40].item())], [int(ids[0, 35].item())]]), cache=cache)
    assert close(step[0, 0], reference[0, 40]) and close(step[1, 0], reference[0, 35])


def test_quantized_cache_reads_the_window(models: tuple[Any, Any]) -> None:
    windowed, plain = models
    ids = mx.random.randint(0, 100, (1, 50))
    cache = [QuantizedKVCache(group_size=32, bits=8) for _ in range(2)]
    out = windowed(ids, cache=cache)
    assert mx.abs(out - banded_reference(plain, ids)).max().item() < 0.1


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({WINDOW_CONFIG_KEY: 0}, "positive integer"),
        ({WINDOW_CONFIG_KEY: "768"}, "positive integer"),
        ({"model_type": "qwen2"}, "llama models only"),
    ],
)
def test_a_bad_window_config_names_the_key(change: dict[str, Any], words: str) -> None:
    with pytest.raises(ModelError, match=words):
        model_classes(CONFIG | change)


def test_the_packaged_demo_coder_is_windowed_at_its_training_length() -> None:
    model_dir = packaged_demo_coder_dir()
    config = json.loads((Path(model_dir) / "config.json").read_text())
    loaded = _load(Path(model_dir))
    attention = loaded.model.model.layers[0].self_attn
    assert isinstance(attention, WindowedAttention)
    assert attention.window == config[WINDOW_CONFIG_KEY] == 768
    assert all(type(layer) is KVCache for layer in make_prompt_cache(loaded.model))
