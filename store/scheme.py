"""KV schemes: which bytes a token costs and which cache class holds it (spec §3).

A `KvScheme` is resolved once at server start (`resolve_kv_scheme`) and is
immutable apart from its warn-once bookkeeping. It is one of

- `bf16`: caches stay as the model makes them (the model's dtype);
- `affine-uniform`: every convertible layer becomes a `QuantizedKVCache` of
  `bits` bits and `group_size`;
- `affine-config`: per-layer bits from `kv_config.json` beside the model.

`kv_config.json` format: `{"group_size": 64, "layers": [4, 8, null, ...]}`.
`layers` has one entry per cache-owning layer, i.e. per entry of the model's
`make_prompt_cache` list in order; an int gives that layer's bits, `null`
keeps it unquantized. Bits given for a recurrent (`ArraysCache`) layer are
ignored: recurrent state is not KV. `group_size` is optional (the resolver's
group size otherwise). Unknown keys are rejected so a typo cannot silently
leave layers unquantized. The list's length is checked against the real
caches in `convert` and `projected_bytes`.

Supported bits are 2, 4 and 8: `mx.quantize` also takes 3, 5 and 6, but
mlx-lm's `QuantizedKVCache` allocates a fresh buffer as `dim // (32 // bits)`
words, which is wrong for bits that do not divide 32. Group sizes are the
ones `mx.quantize` takes (32, 64, 128) and must divide every converted head dim.
TurboQuant is out of scope: asking for it is a `UsageError`.

Byte formula (per cached element, i.e. per token x head x head-dim entry):
dtype size for unquantized layers; `bits/8 + 2 * scale_bytes / group_size`
for affine layers, because mlx packs the values into uint32 words
(`dim * bits / 32` words = `dim * bits / 8` bytes) and keeps one scale and one
bias per group in the keys' dtype. With 16-bit keys that is the spec's
`bits/8 + 4/group_size`; float32 keys pay `bits/8 + 8/group_size`.

All MLX work (`convert`, a warm-up in `projected_bytes`) runs on the engine
thread that owns the model's stream (docs/mlx-notes.md, "Threads").
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from kvcellar.errors import RefusedCacheKind, UsageError
from kvcellar.store import signature as sig

log = logging.getLogger(__name__)

KIND_BF16 = "bf16"
KIND_UNIFORM = "affine-uniform"
KIND_CONFIG = "affine-config"
KINDS = (KIND_BF16, KIND_UNIFORM, KIND_CONFIG)
SUPPORTED_BITS = (2, 4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
GROUP_SIZE_DEFAULT = 64
KV_CONFIG_FILE_NAME = "kv_config.json"
CONFIG_KEY_HEX_CHARS = 8

_BF16_CHOICES = ("off", "bf16")
_UNIFORM_CHOICES = {"4": 4, "8": 8, "kv4": 4, "kv8": 8}
_CONFIG_CHOICE = "config"
_TURBO_CHOICES = ("turbo", "turboquant")
_KV_CONFIG_KEYS = frozenset({"group_size", "layers"})


def _check_bits(bits: Any, where: str) -> None:
    if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise UsageError(f"{where}: KV bits {bits!r} are not supported; choose one of {SUPPORTED_BITS}")


def _check_group_size(group_size: Any, where: str) -> None:
    if isinstance(group_size, bool) or group_size not in SUPPORTED_GROUP_SIZES:
        raise UsageError(
            f"{where}: KV group size {group_size!r} is not supported; choose one of {SUPPORTED_GROUP_SIZES}"
        )


@attrs.frozen(kw_only=True)
class KvScheme:
    """The immutable KV scheme of a server: see the module docstring."""

    kind: str
    bits: int | None = None
    group_size: int = GROUP_SIZE_DEFAULT
    layer_bits: tuple[int | None, ...] | None = None
    # Which "stays unquantized" warnings this instance has logged; excluded
    # from equality so the bookkeeping never changes a scheme's identity.
    _warned: set[str] = attrs.field(factory=set, init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UsageError(f"unknown KV scheme kind {self.kind!r}; choose one of {KINDS}")
        _check_group_size(self.group_size, "KV scheme")
        if self.kind == KIND_BF16 and (self.bits is not None or self.layer_bits is not None):
            raise UsageError("the bf16 KV scheme takes no bits")
        if self.kind == KIND_UNIFORM:
            _check_bits(self.bits, "affine-uniform KV scheme")
            if self.layer_bits is not None:
                raise UsageError("the affine-uniform KV scheme takes no per-layer bits")
        if self.kind == KIND_CONFIG:
            if self.bits is not None or not self.layer_bits:
                raise UsageError("the affine-config KV scheme takes per-layer bits and no uniform bits")
            for index, bits in enumerate(self.layer_bits):
                if bits is not None:
                    _check_bits(bits, f"affine-config KV scheme, layer {index}")

    @classmethod
    def bf16(cls) -> KvScheme:
        return cls(kind=KIND_BF16)

    @classmethod
    def uniform(cls, bits: int, group_size: int = GROUP_SIZE_DEFAULT) -> KvScheme:
        return cls(kind=KIND_UNIFORM, bits=bits, group_size=group_size)

    @classmethod
    def per_layer(cls, layer_bits: Sequence[int | None], group_size: int = GROUP_SIZE_DEFAULT) -> KvScheme:
        return cls(kind=KIND_CONFIG, layer_bits=tuple(layer_bits), group_size=group_size)

    @property
    def quantized(self) -> bool:
        return self.kind != KIND_BF16

    @property
    def cache_key(self) -> str:
        """The scheme's part of the serving fingerprint.

        `bf16`; `kv<bits>` for uniform affine at the default group size 64 and
        `kv<bits>g<group>` otherwise (`kv4g32`); `config-<8 hex>` for
        affine-config, the hex being a SHA-256 prefix of the canonical
        per-layer config, so two different configs never share a key.
        """
        if self.kind == KIND_BF16:
            return "bf16"
        if self.kind == KIND_UNIFORM:
            suffix = "" if self.group_size == GROUP_SIZE_DEFAULT else f"g{self.group_size}"
            return f"kv{self.bits}{suffix}"
        canonical = json.dumps(
            {"group_size": self.group_size, "layers": list(self.layer_bits or ())},
            sort_keys=True,
            separators=(",", ":"),
        )
        return "config-" + hashlib.sha256(canonical.encode("ascii")).hexdigest()[:CONFIG_KEY_HEX_CHARS]

    def batchable(self, can_convert: bool = True) -> bool:
        """Whether this scheme may run in the batch lane (spec §2.3).

        bf16 always batches. Affine schemes batch only when the batch lane's
        cache-owning layers can convert (`can_convert`, the gateway's
        mandatory capability probe): a gateway that cannot carry the scheme
        must run such requests solo, never silently drop quantization.
        """
        return True if self.kind == KIND_BF16 else bool(can_convert)

    def bits_for_layer(self, index: int) -> int | None:
        """The bits layer `index` is quantized to, or None when it stays unquantized."""
        if self.kind == KIND_UNIFORM:
            return self.bits
        if self.layer_bits is not None:  # set exactly when the kind is KIND_CONFIG
            return self.layer_bits[index]
        return None

    def convert(self, caches: list) -> list:
        """The conversion chokepoint: quantize populated plain KV layers in place.

        Called after every prefill chunk and decode step, as mlx-lm calls
        `maybe_quantize_kv_cache`; it is idempotent, so only the first call
        after a layer is populated converts it. Per entry of `caches`:

        - `KVCache` with `offset > 0` and bits: replaced by
          `to_quantized(group_size, bits)` and evaluated before the next layer
          converts, so each bf16 source can be freed first;
        - `KVCache` at offset 0: left for a later call (nothing to quantize);
        - `QuantizedKVCache`, `ArraysCache` (recurrent): left as they are;
        - `RotatingKVCache`, `ChunkedKVCache`: stay unquantized (mlx-lm cannot
          quantize them) with one warning per kind per scheme instance;
        - `CacheList`: its members are converted by these rules.

        Returns `caches` itself. Raises `UsageError` when the per-layer config
        does not match the number of caches or a head dim is not a multiple of
        the group size, `RefusedCacheKind` for batched caches (a quantized
        scheme must not run in a lane that cannot convert), and
        `UnknownCacheKind` for an unknown cache class.
        """
        if not self.quantized:
            return caches
        self._check_layer_count(len(caches))
        for index, cache in enumerate(caches):
            bits = self.bits_for_layer(index)
            if bits is not None:
                caches[index] = self._convert_layer(cache, index, bits)
        return caches

    def bytes_for(self, caches: Sequence[Any]) -> int:
        """The logical bytes `caches` hold, which is what the RAM tier bills.

        Rows up to `offset` of plain and quantized KV (packed words, scales and
        biases), the rows a sliding ring holds (at most its window at rest; up
        to `window - 1 + chunk` right after a multi-token update, which the
        next single-token step trims), the live rows of a chunked cache, and
        recurrent state as it is. Capacity slack is never counted.
        """
        return held_bytes(caches)

    def projected_bytes(self, prototypes_or_model: Any, tokens: int) -> int:
        """The bytes an entry of `tokens` tokens costs under this scheme.

        `prototypes_or_model` is a list of prototype caches from a warm-up
        prefill of at least one token (only their shapes and dtypes are read),
        or a model, which gets a one-token warm-up here. Per layer: full
        attention `tokens` rows, sliding `min(tokens, window)` rows (the
        steady state after the last prompt token is stepped alone, as the
        generate loop does), chunked `tokens` rows (an upper bound), recurrent
        state constant; each row costs `heads x (k_dim + v_dim)` elements at
        the element cost in the module docstring.
        """
        if tokens < 0:
            raise UsageError(f"cannot project a negative token count ({tokens})")
        prototypes = prototypes_or_model
        if not isinstance(prototypes, (list, tuple)):
            prototypes = warm_up_prototype_caches(prototypes_or_model)
        if self.quantized:
            self._check_layer_count(len(prototypes))
        return sum(
            self._projected_layer_bytes(cache, index, self.bits_for_layer(index), tokens)
            for index, cache in enumerate(prototypes)
        )

    def _check_layer_count(self, cache_count: int) -> None:
        if self.layer_bits is not None and len(self.layer_bits) != cache_count:
            raise UsageError(
                f"{KV_CONFIG_FILE_NAME} lists {len(self.layer_bits)} layers but the model "
                f"has {cache_count} cache-owning layers; give one entry (bits or null) per cache"
            )

    def _convert_layer(self, cache: Any, index: int, bits: int) -> Any:
        signature = _serving_signature(cache, index)
        if signature == sig.SIGNATURE_PLAIN:
            if cache.offset == 0 or cache.keys is None:
                return cache
            _check_group_divides(cache, index, self.group_size)
            converted = cache.to_quantized(group_size=self.group_size, bits=bits)
            mx.eval(converted.keys, converted.values)
            return converted
        if signature in (sig.SIGNATURE_ROTATING, sig.SIGNATURE_CHUNKED):
            self._warn_unconvertible_once(signature, index)
        elif signature.startswith(sig.LIST_PREFIX):
            cache.caches = tuple(self._convert_layer(member, index, bits) for member in cache.caches)
        return cache

    def _warn_unconvertible_once(self, signature: str, index: int) -> None:
        if signature in self._warned:
            return
        self._warned.add(signature)
        log.warning(
            "KV scheme %s: %s layers (first: layer %d) stay unquantized because mlx-lm cannot quantize them",
            self.cache_key,
            signature,
            index,
        )

    def _projected_layer_bytes(self, cache: Any, index: int, bits: int | None, tokens: int) -> int:
        signature = _serving_signature(cache, index)
        if signature == sig.SIGNATURE_SSM:
            return _held_bytes(cache, index)
        if signature.startswith((sig.LIST_PREFIX, sig.COMPANION_PREFIX)):
            return sum(self._projected_layer_bytes(member, index, bits, tokens) for member in cache.caches)
        if cache.keys is None:
            raise UsageError(
                f"prototype layer {index} is empty: warm the prototype caches up with a prefill of at least one token"
            )
        if signature.startswith(sig.QUANT_PREFIX):
            return tokens * sum(_row_bytes(array) for array in (*cache.keys, *cache.values))
        if signature == sig.SIGNATURE_ROTATING:
            return min(tokens, cache.max_size) * (_row_bytes(cache.keys) + _row_bytes(cache.values))
        if signature == sig.SIGNATURE_PLAIN and bits is not None:
            _check_group_divides(cache, index, self.group_size)
            return tokens * (
                _quantized_row_bytes(cache.keys, bits, self.group_size)
                + _quantized_row_bytes(cache.values, bits, self.group_size)
            )
        return tokens * (_row_bytes(cache.keys) + _row_bytes(cache.values))


def _serving_signature(cache: Any, index: int) -> str:
    """The cache's signature; batched caches are refused because a scheme
    converts and bills one request's caches, never a merged batch."""
    signature = sig.cache_signature(cache)
    if signature in sig.BATCH_SIGNATURES or signature.startswith(sig.BATCH_PAGED_PREFIX):
        raise RefusedCacheKind(
            f"layer {index}: {signature} holds a batch; a KV scheme converts and "
            "bills per-request caches, and a lane that cannot convert must not batch"
        )
    return signature


def _check_group_divides(cache: Any, index: int, group_size: int) -> None:
    key_dim, value_dim = cache.keys.shape[-1], cache.values.shape[-1]
    if key_dim % group_size or value_dim % group_size:
        raise UsageError(
            f"layer {index}: key/value head dims {key_dim}/{value_dim} are not multiples of the "
            f"KV group size {group_size}; pick a group size from {SUPPORTED_GROUP_SIZES} "
            "that divides them, or keep this model's KV in bf16"
        )


def _row_bytes(array: mx.array) -> int:
    """Bytes of one token row of a `[..., rows, dim]` cache array."""
    return math.prod(array.shape[:-2]) * array.shape[-1] * array.dtype.size


def _quantized_row_bytes(array: mx.array, bits: int, group_size: int) -> int:
    """Bytes one token row of `array` takes once affine-quantized: packed
    words plus one scale and one bias per group, in the array's dtype."""
    dim = array.shape[-1]
    return math.prod(array.shape[:-2]) * (dim * bits // 8 + 2 * (dim // group_size) * array.dtype.size)


def held_bytes(caches: Sequence[Any]) -> int:
    """The logical bytes `caches` hold, whatever the scheme (see `KvScheme.bytes_for`)."""
    return sum(_held_bytes(cache, index) for index, cache in enumerate(caches))


def _held_bytes(cache: Any, index: int) -> int:
    signature = _serving_signature(cache, index)
    if signature.startswith((sig.LIST_PREFIX, sig.COMPANION_PREFIX)):
        # A companion's draft KV is billed with the target's (spec, "Method companion state").
        return sum(_held_bytes(member, index) for member in cache.caches)
    if signature.startswith(sig.PAGED_PREFIX):
        # A paged layer holds its whole pool (sized once from prompt plus max_tokens).
        return int(cache.nbytes)
    if signature == sig.SIGNATURE_SSM:
        extras = [getattr(cache, name, None) for name in ("left_padding", "lengths")]
        return sum(array.nbytes for array in (*cache.cache, *extras) if array is not None)
    if cache.keys is None:
        return 0
    if signature.startswith(sig.QUANT_PREFIX):
        return cache.offset * sum(_row_bytes(array) for array in (*cache.keys, *cache.values))
    if signature == sig.SIGNATURE_CHUNKED:
        rows = cache.offset - cache.start_position
    else:
        # A ring past its window holds its buffer, not `offset` rows.
        rows = min(cache.offset, cache.keys.shape[-2])
    return rows * (_row_bytes(cache.keys) + _row_bytes(cache.values))


def warm_up_prototype_caches(model: Any) -> list:
    """Fresh caches of `model` after a one-token prefill: the prototypes
    `projected_bytes` reads shapes and dtypes from. Runs on the caller's
    (engine) thread."""
    caches = mlx_cache.make_prompt_cache(model)
    model(mx.array([[0]]), cache=caches)
    mx.eval([cache.state for cache in caches])
    return caches


def resolve_kv_scheme(
    kv_quant: str, model_dir: Path | None = None, *, group_size: int = GROUP_SIZE_DEFAULT
) -> KvScheme:
    """The scheme for the `--kv-quant` value, resolved once at server start.

    `off`/`bf16` -> bf16; `4`/`kv4`/`8`/`kv8` -> uniform affine at
    `group_size`; `config` -> per-layer bits from `<model_dir>/kv_config.json`.
    Raises `UsageError` for TurboQuant (out of scope), any other value, a
    missing or malformed `kv_config.json`, or unsupported bits/group size.
    """
    choice = str(kv_quant).strip().lower()
    if choice in _BF16_CHOICES:
        return KvScheme.bf16()
    if choice in _UNIFORM_CHOICES:
        return KvScheme.uniform(_UNIFORM_CHOICES[choice], group_size)
    if choice == _CONFIG_CHOICE:
        if model_dir is None:
            raise UsageError(
                f"--kv-quant config reads {KV_CONFIG_FILE_NAME} beside the model, but no model directory was given"
            )
        return _read_kv_config(Path(model_dir) / KV_CONFIG_FILE_NAME, group_size)
    if choice in _TURBO_CHOICES:
        raise UsageError("TurboQuant KV is out of scope for kvcellar; use --kv-quant off, 4, 8 or config")
    choices = ", ".join((*_BF16_CHOICES, *_UNIFORM_CHOICES, _CONFIG_CHOICE))
    raise UsageError(f"unknown --kv-quant value {kv_quant!r}; choose one of {choices}")


def _read_kv_config(path: Path, default_group_size: int) -> KvScheme:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"--kv-quant config needs {path}, which does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read {path}: {e}") from e
    try:
        document = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(document, dict):
        raise UsageError(f'{path} must be an object like {{"group_size": 64, "layers": [4, 8, null]}}')
    unknown = sorted(set(document) - _KV_CONFIG_KEYS)
    if unknown:
        raise UsageError(f"{path}: unknown keys {unknown}; allowed: {sorted(_KV_CONFIG_KEYS)}")
    layers = document.get("layers")
    if not isinstance(layers, list) or not layers:
        raise UsageError(f'{path}: "layers" must be a non-empty list of bits or null, one per cache-owning layer')
    for index, bits in enumerate(layers):
        if bits is not None:
            _check_bits(bits, f"{path}, layer {index}")
    group_size = document.get("group_size", default_group_size)
    _check_group_size(group_size, str(path))
    return KvScheme.per_layer(layers, group_size)
