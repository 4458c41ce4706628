"""A local attention window for llama models (config key `kvcellar_attention_window`).

Why. On the CPU backend, MLX's attention runs at ~15-60 M scores/s on the
2-core machines kvcellar is tested on. Full attention over an agent's first
prompt (Claude Code's ~28k tokens) is 6 layers x 8 heads x n^2/2 = 1.9e10
scores for the demo-coder: a cold prefill of 300-900 s, longer than Claude
Code waits. With a window of W keys per query the work is n x W, linear in the
prompt: ~20-40 s for the same prompt (docs/demo-model.md, "Attention window").

What it computes. A query at position p attends to the keys at positions
(p - W, p]. The demo-coder was trained on 768-token rows, so with W = 768 its
outputs on prompts of up to 768 tokens are exactly the full-attention ones, and
past that it never sees a relative distance it was not trained on. Past W
tokens the model reads only the last W: a long agent prompt is "seen" through
that window, which is honest for a ~5M-parameter demo and stated in the docs.

Why not mlx-lm's own sliding window (`layer_types` = "sliding_attention"): it
stores the window in a `RotatingKVCache`, which cannot be trimmed back to a
shorter prefix, so a new session that shares only the system prompt and tools
of a cached conversation could not reuse it. Here the cache stays a plain
`KVCache` (or the batch lane's, paged or quantized forms) holding every row;
only the attention op reads the last rows. Prefix reuse, trim, split restores,
checkpoints and the tiers are unchanged.

Which loader. `load_model_and_tokenizer` is `mlx_lm.load` with the model
classes chosen here: a config without the key loads mlx-lm's own classes. A
plain `mlx_lm.load` of a windowed model ignores the key and computes full
attention (identical up to W tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.utils import _get_classes, load_model, load_tokenizer

from kvcellar.errors import ModelError

WINDOW_CONFIG_KEY = "kvcellar_attention_window"
WINDOWED_MODEL_TYPES = frozenset({"llama"})


def _tail(tensor: Any, start: int) -> Any:
    """Rows `start:` of a cache's keys or values (a quantized cache's are a tuple)."""
    if isinstance(tensor, tuple | list):
        return type(tensor)(part[..., start:, :] for part in tensor)
    return tensor[..., start:, :]


def _rows(tensor: Any) -> int:
    return int((tensor[0] if isinstance(tensor, tuple | list) else tensor).shape[-2])


def windowed_mask(mask: Any, *, queries: int, keys: int, start: int, window: int) -> mx.array | None:
    """The mask for `queries` rows ending at key `keys` over the keys from `start`:
    the caller's mask (None, "causal" or an array over all `keys`) cut to those
    keys and narrowed to the band (p - window, p]. Positions are buffer indices,
    so a batch row's left padding shifts queries and keys alike."""
    key_positions = mx.arange(start, keys)[None]
    query_positions = mx.arange(keys - queries, keys)[:, None]
    band = (key_positions <= query_positions) & (key_positions > query_positions - window)
    if isinstance(mask, mx.array):
        if mask.dtype != mx.bool_:
            raise ModelError("the attention window needs a boolean mask; this cache made an additive one")
        return mask[..., start:] & band
    if queries == 1 and keys - start <= window:
        return None
    return band


class WindowedAttention(llama.Attention):
    """llama's attention reading only the last `window` keys per query."""

    def __init__(self, args: llama.ModelArgs, window: int) -> None:
        super().__init__(args)
        self.window = window

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        batch, length, _ = x.shape
        queries = self.q_proj(x).reshape(batch, length, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = self.k_proj(x).reshape(batch, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(batch, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        queries = self.rope(queries, offset=offset)
        keys = self.rope(keys, offset=offset)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        total = _rows(keys)
        if total > self.window:
            # Keys before `start` are outside every query's window: never read them.
            start = max(0, total - length - self.window + 1)
            keys, values = _tail(keys, start), _tail(values, start)
            mask = windowed_mask(mask, queries=length, keys=total, start=start, window=self.window)
        output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(batch, length, -1))


def _window_of(config: dict[str, Any]) -> int | None:
    window = config.get(WINDOW_CONFIG_KEY)
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelError(f"config.json's {WINDOW_CONFIG_KEY} must be a positive integer, not {window!r}")
    if config.get("model_type") not in WINDOWED_MODEL_TYPES:
        raise ModelError(
            f"config.json sets {WINDOW_CONFIG_KEY}, which kvcellar implements for "
            f"{', '.join(sorted(WINDOWED_MODEL_TYPES))} models only, not {config.get('model_type')!r}; remove the key"
        )
    return window


def model_classes(config: dict[str, Any]) -> tuple[type, type]:
    """mlx-lm's classes for `config`, or a windowed llama where the config asks for one."""
    window = _window_of(config)
    if window is None:
        return _get_classes(config)
    size: int = window

    class WindowedLlama(llama.Model):
        def __init__(self, args: llama.ModelArgs) -> None:
            super().__init__(args)
            for layer in self.model.layers:
                layer.self_attn = WindowedAttention(args, size)

    return WindowedLlama, llama.ModelArgs


def load_model_and_tokenizer(model_dir: Path) -> tuple[Any, Any]:
    """`mlx_lm.load(model_dir)` with `model_classes`: the model and its tokenizer."""
    model, config = load_model(model_dir, get_model_classes=model_classes)
    tokenizer = load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id", None))
    return model, tokenizer
