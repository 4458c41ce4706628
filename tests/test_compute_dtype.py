"""The compute dtype policy (`serve --compute-dtype`): what it decides, that a
real system loads demo-coder in float32 on the CPU and says so in `/stats`, and
that the cast is part of the serving fingerprint (float32 KV never meets bf16 KV)."""

from __future__ import annotations

import pytest
import trio

from kvcellar.actors.system import SystemConfig, open_system
from kvcellar.engine.compute_dtype import (
    FLOAT32_WEIGHTS_BYTES_MAX,
    WeightsFacts,
    choose_compute_dtype,
    fingerprint_kv_key,
    read_weights_facts,
)
from kvcellar.engine.demo_models import packaged_demo_coder_dir
from kvcellar.engine.engine import SamplingParams
from kvcellar.engine.generation import GenerationRequest, TokenDelta
from kvcellar.errors import UsageError
from kvcellar.store.fingerprint import compute_fingerprint

SMALL_BF16 = WeightsFacts(dtypes=frozenset({"BF16"}), parameters=5_000_000, quantized=False)


@pytest.mark.parametrize(
    ("policy", "device", "facts", "cast_to"),
    [
        ("auto", "cpu", SMALL_BF16, "float32"),
        ("auto", "gpu", SMALL_BF16, None),
        ("auto", "cpu", WeightsFacts(dtypes=frozenset({"F16"}), parameters=1000, quantized=False), "float32"),
        ("auto", "cpu", WeightsFacts(dtypes=frozenset({"F32"}), parameters=1000, quantized=False), None),
        ("auto", "cpu", WeightsFacts(dtypes=frozenset({"BF16", "U32"}), parameters=1000, quantized=True), None),
        (
            "auto",
            "cpu",
            WeightsFacts(dtypes=frozenset({"BF16"}), parameters=FLOAT32_WEIGHTS_BYTES_MAX // 4 + 1, quantized=False),
            None,
        ),
        ("model", "cpu", SMALL_BF16, None),
        ("float32", "gpu", SMALL_BF16, "float32"),
        ("float32", "cpu", WeightsFacts(dtypes=frozenset({"BF16"}), parameters=10**10, quantized=False), "float32"),
    ],
)
def test_the_policy_casts_small_sixteen_bit_models_on_the_cpu_only(policy, device, facts, cast_to):
    chosen = choose_compute_dtype(policy, device=device, facts=facts)
    assert chosen.cast_to == cast_to
    assert chosen.reason and chosen.as_stats()["cast_to"] == (cast_to or "none")


def test_an_unknown_policy_is_refused_naming_the_choices():
    with pytest.raises(UsageError, match="auto, model, float32"):
        choose_compute_dtype("fp8", device="cpu", facts=SMALL_BF16)


def test_the_headers_of_demo_coder_say_bfloat16_and_its_parameter_count():
    facts = read_weights_facts(packaged_demo_coder_dir())
    assert facts == WeightsFacts(dtypes=frozenset({"BF16"}), parameters=5_247_232, quantized=False)


def test_a_cast_changes_the_serving_fingerprint_and_keeping_the_dtype_does_not():
    model_dir = packaged_demo_coder_dir()
    cast = choose_compute_dtype("auto", device="cpu", facts=SMALL_BF16)
    kept = choose_compute_dtype("model", device="cpu", facts=SMALL_BF16)
    assert fingerprint_kv_key("bf16", kept) == "bf16"
    assert fingerprint_kv_key("bf16", cast) == "bf16+float32"
    digests = {compute_fingerprint(model_dir, kv_scheme_key=fingerprint_kv_key("bf16", c)).digest for c in (cast, kept)}
    assert len(digests) == 2


def _config(tmp_path, policy: str) -> SystemConfig:
    return SystemConfig(model_dir=packaged_demo_coder_dir(), ssd_dir=tmp_path / "ssd", compute_dtype=policy)


async def _serve_once(config: SystemConfig) -> tuple[dict, str, str, list[int]]:
    async with open_system(config) as system:
        request = GenerationRequest(prompt_ids=(5, 17, 40, 99, 123, 7, 300, 41), params=SamplingParams(max_tokens=4))
        tokens: list[int] = []
        async for event in system.generate(request):
            if isinstance(event, TokenDelta) and event.token_id >= 0:
                tokens.append(event.token_id)
        kv_dtype = await system.engine.call(lambda loaded: str(loaded.model.layers[0].self_attn.k_proj.weight.dtype))
        return system.stats()["compute_dtype"], system.store.fingerprint, kv_dtype, tokens


def test_demo_coder_computes_in_float32_on_the_cpu_under_its_own_fingerprint(tmp_path):
    stats, fingerprint, weights_dtype, tokens = trio.run(_serve_once, _config(tmp_path, "auto"))
    assert stats["policy"] == "auto" and stats["cast_to"] == "float32" and "BLAS" in stats["reason"]
    assert weights_dtype == "mlx.core.float32" and len(tokens) == 4
    kept_stats, kept_fingerprint, kept_dtype, _ = trio.run(_serve_once, _config(tmp_path, "model"))
    assert kept_stats["cast_to"] == "none" and kept_dtype == "mlx.core.bfloat16"
    assert fingerprint != kept_fingerprint
    assert {path.name for path in (tmp_path / "ssd").iterdir()} >= {fingerprint, kept_fingerprint}
