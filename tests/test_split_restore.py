"""The split restore (issue 44): prefill the front while the back loads.

Equal to a cold run where it applies, refused elsewhere."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kvcellar.engine.demo_models import ARCHITECTURES
from kvcellar.engine.engine import SamplingParams, generate_tokens, prefill
from kvcellar.engine.split_restore import prefill_rows, run_split, split_refusal
from kvcellar.errors import RefusedCacheKind
from kvcellar.store import kvfile
from kvcellar.store.disk import RealDisk
from kvcellar.store.suffix_rows import read_suffix_rows, split_refusal_for_records

SPLIT_ARCHITECTURES = ("llama", "deepseek_v3")
REFUSED_ARCHITECTURES = tuple(arch for arch in ARCHITECTURES if arch not in SPLIT_ARCHITECTURES)
PROMPT_TOKENS = 300
CACHED_TOKENS = 260
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def _prompt(vocab_tokens: int) -> list[int]:
    rng = np.random.default_rng(44)
    return [int(t) for t in rng.integers(3, vocab_tokens, size=PROMPT_TOKENS)]


def _stored_entry(model, prompt: list[int], path: Path) -> kvfile.Header:
    """An entry of the prompt's first CACHED_TOKENS, prefilled as the server does (chunks, then the rest)."""
    cache = make_prompt_cache(model)
    prefill_rows(model, prompt[:CACHED_TOKENS], cache, 128)
    return kvfile.save(path, cache, prompt[:CACHED_TOKENS])


def _decode(model, prompt: list[int], cache: list) -> list[int]:
    logits = prefill(model, prompt[CACHED_TOKENS:], cache)
    tokens = []
    for _ in range(GREEDY.max_tokens):
        token = mx.argmax(logits, axis=-1)
        tokens.append(int(token.item()))
        logits = model(token.reshape(1, 1), cache=cache)[:, -1, :]
    return tokens


# bfloat16 on llama only: deepseek_v3's MoE gather runs float32 alone on the CPU.
@pytest.mark.parametrize(("arch", "dtype"), [("llama", "float32"), ("llama", "bfloat16"), ("deepseek_v3", "float32")])
@pytest.mark.parametrize("split_at", [0, 100, CACHED_TOKENS])
def test_split_gives_a_cold_runs_greedy_tokens(loaded_model_factory, tmp_path: Path, arch, dtype, split_at) -> None:
    model, tokenizer = loaded_model_factory(arch, dtype=dtype)
    prompt = _prompt(tokenizer.vocab_size)
    cold = list(generate_tokens(model, prompt, GREEDY))
    header = _stored_entry(model, prompt, tmp_path / "entry.kvc")
    assert split_refusal_for_records(header.caches) == ""

    def load():
        return read_suffix_rows(
            RealDisk(), tmp_path / "entry.kvc", split_at, CACHED_TOKENS, expected_tokens=np.asarray(prompt[:split_at])
        )

    caches = run_split(model, prompt[:split_at], load, step_tokens=64)
    assert caches is not None
    assert [c.offset for c in caches] == [CACHED_TOKENS] * len(caches)
    assert _decode(model, prompt, caches) == cold


@pytest.mark.parametrize("arch", SPLIT_ARCHITECTURES)
def test_split_rows_equal_a_full_prefills_within_rounding(loaded_model_factory, tmp_path: Path, arch) -> None:
    """The joined rows against one prefill of the whole prefix: float32 rows
    differ only by the kernels' rounding of other chunk shapes (measured
    below 1e-5 relative); the loaded rows are the stored ones, bit for bit."""
    model, tokenizer = loaded_model_factory(arch)
    prompt = _prompt(tokenizer.vocab_size)
    _stored_entry(model, prompt, tmp_path / "entry.kvc")
    reference = make_prompt_cache(model)
    prefill_rows(model, prompt[:CACHED_TOKENS], reference, 128)
    split_at = 100
    caches = run_split(
        model, prompt[:split_at], lambda: read_suffix_rows(RealDisk(), tmp_path / "entry.kvc", split_at, CACHED_TOKENS)
    )
    assert caches is not None
    for joined, full in zip(caches, reference, strict=True):
        for got, want in ((joined.keys, full.keys), (joined.values, full.values)):
            got, want = got[..., :CACHED_TOKENS, :], want[..., :CACHED_TOKENS, :]
            assert mx.array_equal(got[..., split_at:, :], want[..., split_at:, :])
            scale = float(mx.max(mx.abs(want)).item())
            assert float(mx.max(mx.abs(got - want)).item()) <= 1e-5 * max(scale, 1.0)


@pytest.mark.parametrize("arch", REFUSED_ARCHITECTURES)
def test_split_is_refused_where_rows_cannot_be_split(loaded_model_factory, tmp_path: Path, arch) -> None:
    model, tokenizer = loaded_model_factory(arch)
    assert split_refusal(make_prompt_cache(model)) != ""
    prompt = _prompt(tokenizer.vocab_size)
    header = _stored_entry(model, prompt, tmp_path / "entry.kvc")
    assert split_refusal_for_records(header.caches) != ""
    with pytest.raises(RefusedCacheKind):
        read_suffix_rows(RealDisk(), tmp_path / "entry.kvc", 10, CACHED_TOKENS)
    with pytest.raises(RefusedCacheKind):
        run_split(model, prompt[:10], lambda: None)


def test_a_quantizing_kv_scheme_refuses_the_split(loaded_model_factory) -> None:
    """Entries under --kv-quant hold quantized rows: the policy keeps restore-or-recompute for them."""
    from kvcellar.engine.restore_policy import CostBook, PolicyColdTier
    from kvcellar.store.restore_plan import CostModel, PrefillPoint, TierRate

    model, _ = loaded_model_factory("llama")
    costs = CostModel(
        tiers={"ssd": TierRate(fixed_s=0.0, bytes_per_s=1e9)},
        prefill=(PrefillPoint(bucket_tokens=256, context_tokens=256.0, seconds_per_token=1e-3),),
        join_bytes_per_s=1e9,
    )
    book = CostBook(costs, key=None, memo_dir=None)
    assert PolicyColdTier(None, book, model=model).refusal == ""
    assert "quantized" in PolicyColdTier(None, book, model=model, quantized_kv=True).refusal
