"""The compute dtype policy (`serve --compute-dtype`): which float type the
model's weights, and therefore its activations and KV cache, have in memory.

Why. On the CPU backend MLX runs a bfloat16 (or float16) matmul in its own
generic kernel, a few GFLOP/s, while a float32 matmul goes to BLAS: with
OpenBLAS loaded (`kvcellar.blas_preload`) that was 4.6x faster end to end
for a 4,096-token prefill of demo-coder (docs/demo-model.md, "Where the time
went"). A small model's float32 copy costs little memory, so `auto` casts
16-bit weights to float32 at load on the CPU when the float32 weights stay
under `FLOAT32_WEIGHTS_BYTES_MAX`. On a GPU, or for quantized or larger
models, the model keeps its own dtype.

The KV cache then holds float32 rows, not the model file's bfloat16 ones:
`fingerprint_kv_key` names the cast in the serving fingerprint, so a float32
KV entry is never served to (or restored by) a server computing in bfloat16.

The decision (`choose_compute_dtype`) is a pure function of the policy, the
device kind and the weights' header facts; `read_weights_facts` reads those
from the safetensors headers (no tensor bytes, no MLX).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path

import attrs

from kvcellar.errors import ModelError, UsageError

COMPUTE_DTYPE_CHOICES = ("auto", "model", "float32")
COMPUTE_DTYPE_DEFAULT = "auto"
# `auto` casts to float32 only while the float32 weights stay this small
# (256 M parameters): the cast doubles the weights' memory.
FLOAT32_WEIGHTS_BYTES_MAX = 1 << 30
# safetensors dtype tags the cast applies to, and the float32 tag.
_SIXTEEN_BIT_FLOATS = frozenset({"BF16", "F16"})
_FLOAT32 = "F32"
_FLOAT_TAGS = _SIXTEEN_BIT_FLOATS | {_FLOAT32, "F64"}


@attrs.frozen(kw_only=True)
class WeightsFacts:
    """What the safetensors headers say: the dtype tags present, and how many parameters."""

    dtypes: frozenset[str]
    parameters: int
    quantized: bool


@attrs.frozen(kw_only=True)
class ComputeDtype:
    """The resolved policy: `cast_to` is the MLX dtype name the weights are
    cast to at load ("float32"), or None to keep the model's own; `reason`
    says why, for the log and `/stats`."""

    policy: str
    cast_to: str | None
    reason: str

    def as_stats(self) -> dict[str, str]:
        return {"policy": self.policy, "cast_to": self.cast_to or "none", "reason": self.reason}


def check_policy(policy: str) -> str:
    if policy not in COMPUTE_DTYPE_CHOICES:
        raise UsageError(f"--compute-dtype must be one of {', '.join(COMPUTE_DTYPE_CHOICES)}, not {policy!r}")
    return policy


def choose_compute_dtype(policy: str, *, device: str, facts: WeightsFacts) -> ComputeDtype:
    """`policy` ("auto", "model" or "float32") for a model with `facts` on
    `device` ("cpu" or "gpu"). `float32` casts whenever there are 16-bit
    float weights and the model is not quantized."""
    check_policy(policy)
    sixteen_bit = sorted(facts.dtypes & _SIXTEEN_BIT_FLOATS)
    float32_bytes = facts.parameters * 4

    def keep(reason: str) -> ComputeDtype:
        return ComputeDtype(policy=policy, cast_to=None, reason=reason)

    if policy == "model":
        return keep("--compute-dtype model: the weights' own dtype")
    if facts.quantized:
        return keep("quantized weights keep their own dtype")
    if not sixteen_bit:
        return keep("no 16-bit float weights to cast")
    if policy == "auto":
        if device != "cpu":
            return keep(f"on the {device} the {'/'.join(sixteen_bit)} kernels are fast")
        if float32_bytes > FLOAT32_WEIGHTS_BYTES_MAX:
            return keep(
                f"float32 weights would take {float32_bytes / 2**30:.1f} GiB, over the "
                f"{FLOAT32_WEIGHTS_BYTES_MAX / 2**30:.0f} GiB `auto` casts"
            )
        why = "on the CPU, float32 matmuls run in BLAS while 16-bit ones run MLX's slow generic kernel"
    else:
        why = "--compute-dtype float32"
    return ComputeDtype(policy=policy, cast_to="float32", reason=f"{'/'.join(sixteen_bit)} cast to float32: {why}")


def fingerprint_kv_key(scheme_key: str, compute: ComputeDtype) -> str:
    """The KV scheme key the serving fingerprint carries: unchanged when the
    model keeps its dtype, else it names the cast (`bf16+float32`), so KV
    computed in float32 lives under another fingerprint than the bfloat16 KV
    of the same weights."""
    return scheme_key if compute.cast_to is None else f"{scheme_key}+{compute.cast_to}"


def read_weights_facts(model_dir: Path) -> WeightsFacts:
    """The dtype tags and parameter count of every `*.safetensors` shard in
    `model_dir`, from their headers; `quantized` when `config.json` names a
    quantization. Raises `ModelError` when a header cannot be read."""
    model_dir = Path(model_dir)
    dtypes: set[str] = set()
    parameters = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        for entry in _header_entries(path):
            dtypes.add(str(entry["dtype"]))
            if entry["dtype"] in _FLOAT_TAGS:
                parameters += math.prod(entry["shape"])
    return WeightsFacts(dtypes=frozenset(dtypes), parameters=parameters, quantized=_is_quantized(model_dir))


def _header_entries(path: Path) -> Iterable[dict]:
    try:
        with path.open("rb") as weights_file:
            (header_length_bytes,) = struct.unpack("<Q", weights_file.read(8))
            header = json.loads(weights_file.read(header_length_bytes))
        return [entry for name, entry in header.items() if name != "__metadata__"]
    except (OSError, struct.error, ValueError, AttributeError) as e:
        raise ModelError(f"cannot read the safetensors header of {path}: {e}") from e


def _is_quantized(model_dir: Path) -> bool:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("quantization") or config.get("quantization_config"))
