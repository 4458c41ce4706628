"""Random-weight demo models that `mlx_lm.load` opens with no network access.

A demo model is a directory holding `config.json`, `model.safetensors`,
`tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json`. The
weights come from a fixed seed and the tokenizer is the committed
`assets/tokenizer.json`, so the same (arch, size, dtype, seed) gives the same
bytes on every run. Sizes: `tiny` (~0.1M parameters, the configs in
`assets/tiny-model-configs.json`), `small` (~5M) and `medium` (~20M), the
latter two used for benchmarks.

`chat_format="tools"` makes the tool-capable variant: the tokenizer gains
Qwen's `<think>`, `</think>`, `<tool_call>` and `</tool_call>` tokens (ids
1024-1027, the embedding grows to match) and the chat template
(`assets/chat-template-tools.jinja`) renders `tools`, tool calls and tool
results Qwen3-style, so mlx-lm infers thinking and its JSON tool parser. A
random-weight model never emits those markers by itself; tests script its
replies with a logits processor (`kvcellar.engine.forcing.ForcedTokens`).
"""

from __future__ import annotations

import copy
import importlib
import json
import math
import os
import re
import secrets
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import platformdirs
from mlx.utils import tree_flatten

from kvcellar.errors import ModelError, UsageError
from kvcellar.store.disk import fsync_path

ARCHITECTURES = (
    "llama",
    "gemma3_text",
    "qwen3_next",
    "mamba2",
    "falcon_h1",
    "deepseek_v3",
    "llama4",
    "recurrent_gemma",
)
SIZES = ("tiny", "small", "medium")
DTYPES = ("float32", "bfloat16")
CHAT_FORMATS = ("plain", "tools")

ASSETS_DIR = Path(__file__).parent / "assets"
TOKENIZER_ASSET_PATH = ASSETS_DIR / "tokenizer.json"
TINY_CONFIGS_ASSET_PATH = ASSETS_DIR / "tiny-model-configs.json"
TOOLS_CHAT_TEMPLATE_PATH = ASSETS_DIR / "chat-template-tools.jinja"
# The tool-capable variant's added tokens, in id order after the trained vocabulary.
TOOL_FORMAT_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

VOCAB_SIZE = 1024
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
# Ids fixed by the committed tokenizer (special tokens are trained first).
PAD_TOKEN_ID = 0
EOS_TOKEN_ID = 2
MODEL_MAX_LENGTH_TOKENS = 8192

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

WEIGHTS_FILE_NAME = "model.safetensors"
REQUIRED_MODEL_FILES = (
    "config.json",
    WEIGHTS_FILE_NAME,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)

DEMO_ARCH = "llama"
DEMO_SIZE = "small"
DEMO_DTYPE = "float32"
DEMO_SEED = 0
DEMO_MODEL_NAME = "demo-llama-small"
CACHE_DIR_ENV_VAR = "KVCELLAR_CACHE_DIR"

# Keys merged over the tiny config to make the bigger sizes; nested dicts
# (llama4's text_config) merge key by key. Every entry keeps the invariants
# the architecture needs (e.g. mamba2: hidden_size * expand == num_heads * head_dim).
SIZE_OVERRIDES: dict[str, dict[str, dict[str, Any]]] = {
    "llama": {
        "small": {
            "hidden_size": 256,
            "intermediate_size": 768,
            "num_hidden_layers": 6,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
        },
        "medium": {
            "hidden_size": 512,
            "intermediate_size": 1536,
            "num_hidden_layers": 6,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
        },
    },
    "gemma3_text": {
        "small": {
            "hidden_size": 256,
            "intermediate_size": 768,
            "num_hidden_layers": 6,
            "num_attention_heads": 8,
            "head_dim": 32,
            "num_key_value_heads": 2,
            "query_pre_attn_scalar": 32,
            "sliding_window": 128,
        },
        "medium": {
            "hidden_size": 512,
            "intermediate_size": 1536,
            "num_hidden_layers": 6,
            "num_attention_heads": 8,
            "head_dim": 64,
            "num_key_value_heads": 2,
            "query_pre_attn_scalar": 64,
            "sliding_window": 256,
        },
    },
    "qwen3_next": {
        "small": {
            "hidden_size": 256,
            "intermediate_size": 768,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "linear_num_value_heads": 8,
            "linear_num_key_heads": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "moe_intermediate_size": 256,
            "shared_expert_intermediate_size": 256,
        },
        "medium": {
            "hidden_size": 512,
            "intermediate_size": 1536,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "linear_num_value_heads": 8,
            "linear_num_key_heads": 4,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
        },
    },
    "mamba2": {
        "small": {
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_heads": 16,
            "head_dim": 32,
            "state_size": 32,
            "num_hidden_layers": 12,
        },
        "medium": {
            "hidden_size": 512,
            "intermediate_size": 1024,
            "num_heads": 16,
            "head_dim": 64,
            "state_size": 64,
            "num_hidden_layers": 12,
        },
    },
    "falcon_h1": {
        "small": {
            "hidden_size": 256,
            "intermediate_size": 768,
            "num_hidden_layers": 5,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 32,
            "mamba_d_head": 32,
            "mamba_n_heads": 8,
            "mamba_d_ssm": 256,
            "mamba_d_state": 32,
        },
        "medium": {
            "hidden_size": 512,
            "intermediate_size": 1536,
            "num_hidden_layers": 5,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 64,
            "mamba_d_head": 64,
            "mamba_n_heads": 8,
            "mamba_d_ssm": 512,
            "mamba_d_state": 64,
        },
    },
    "deepseek_v3": {
        "small": {
            "hidden_size": 256,
            "intermediate_size": 768,
            "moe_intermediate_size": 256,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "kv_lora_rank": 128,
            "q_lora_rank": 192,
            "qk_rope_head_dim": 16,
            "v_head_dim": 32,
            "qk_nope_head_dim": 32,
        },
        "medium": {
            "hidden_size": 512,
            "intermediate_size": 1536,
            "moe_intermediate_size": 512,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "kv_lora_rank": 256,
            "q_lora_rank": 384,
            "qk_rope_head_dim": 32,
            "v_head_dim": 64,
            "qk_nope_head_dim": 64,
        },
    },
    "llama4": {
        "small": {
            "text_config": {
                "hidden_size": 256,
                "intermediate_size": 256,
                "intermediate_size_mlp": 768,
                "num_hidden_layers": 6,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "attention_chunk_size": 128,
            },
        },
        "medium": {
            "text_config": {
                "hidden_size": 512,
                "intermediate_size": 512,
                "intermediate_size_mlp": 1536,
                "num_hidden_layers": 6,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "head_dim": 64,
                "attention_chunk_size": 256,
            },
        },
    },
    "recurrent_gemma": {
        "small": {
            "hidden_size": 256,
            "intermediate_size": 768,
            "num_attention_heads": 8,
            "num_hidden_layers": 9,
            "attention_window_size": 128,
            "block_types": ["recurrent", "recurrent", "attention"],
        },
        "medium": {
            "hidden_size": 512,
            "intermediate_size": 1536,
            "num_attention_heads": 8,
            "num_hidden_layers": 9,
            "attention_window_size": 256,
            "block_types": ["recurrent", "recurrent", "attention"],
        },
    },
}

_PARTIAL_DIR_MARKER = ".partial-"
_REPLACED_DIR_MARKER = ".replaced-"
_TEMPORARY_DIR_PID_PATTERN = re.compile(r"\.(?:partial|replaced)-(\d+)-")

ProgressCallback = Callable[[str], None]


def supported_sizes(arch: str) -> tuple[str, ...]:
    """The sizes `arch` can be built in; raises `UsageError` for an unknown arch."""
    _require_choice("architecture", arch, ARCHITECTURES)
    return tuple(size for size in SIZES if size == "tiny" or size in SIZE_OVERRIDES.get(arch, {}))


def model_config(arch: str, size: str = "tiny") -> dict[str, Any]:
    """The `config.json` dict of `arch` at `size`, including `eos_token_id`.

    Raises `UsageError` for an unknown arch or size, or a size the arch does
    not support (the message names the sizes it does support).
    """
    _require_choice("architecture", arch, ARCHITECTURES)
    _require_choice("size", size, SIZES)
    if size not in supported_sizes(arch):
        raise UsageError(f"architecture {arch!r} has no {size!r} size; it supports: {', '.join(supported_sizes(arch))}")
    config = _load_tiny_configs()[arch]
    if size != "tiny":
        config = copy.deepcopy(_merge_config(config, SIZE_OVERRIDES[arch][size]))
    config["eos_token_id"] = EOS_TOKEN_ID
    return config


def create_model(
    arch: str,
    out_dir: Path,
    *,
    size: str = "tiny",
    dtype: str = "float32",
    seed: int = 0,
    overwrite: bool = False,
    chat_format: str = "plain",
) -> Path:
    """Write a random-weight model of `arch` into `out_dir` and return `out_dir`.

    The files are written into a temporary directory beside `out_dir` and
    renamed into place last, so a half-made model never looks complete.
    Raises `UsageError` for an unknown arch, size or dtype, or when `out_dir`
    exists and is non-empty (or is not a directory) and `overwrite` is false;
    raises `ModelError` when MLX cannot build the model, a weight is not
    finite, or the files cannot be written.
    """
    _require_choice("dtype", dtype, DTYPES)
    _require_choice("chat format", chat_format, CHAT_FORMATS)
    config = model_config(arch, size)
    if chat_format == "tools":
        _set_vocab_size(config, VOCAB_SIZE + len(TOOL_FORMAT_TOKENS))
    out_dir = Path(out_dir)
    _check_out_dir_free(out_dir, overwrite=overwrite)
    weights = build_weights(config, dtype=dtype, seed=seed)
    # Named rather than mkdtemp'd so the directory gets the umask's usual
    # permissions; the pid in the name lets a later run clean up after a crash.
    partial_name = f".{out_dir.name}{_PARTIAL_DIR_MARKER}{os.getpid()}-{secrets.token_hex(4)}"
    partial_dir = out_dir.with_name(partial_name)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        partial_dir.mkdir()
    except OSError as e:
        raise ModelError(f"cannot create a directory beside {out_dir}: {e}") from e
    try:
        # The plain call keeps the writer's three-argument form (tests replace the writer).
        variant = {"chat_format": chat_format} if chat_format != "plain" else {}
        _write_model_files(partial_dir, config, weights, **variant)
        _publish_dir(partial_dir, out_dir, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(partial_dir, ignore_errors=True)
        raise
    return out_dir


def build_weights(config: dict[str, Any], *, dtype: str, seed: int) -> dict[str, mx.array]:
    """Build the model described by `config` from `seed` and return its flat weights.

    Initialisation runs on the CPU stream so the numbers do not depend on the
    default device; it reseeds MLX's global random generator. Raises
    `ModelError` when mlx-lm rejects the config or a weight is NaN or infinite.
    """
    try:
        module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
        with mx.stream(mx.cpu):
            mx.random.seed(seed)
            model = module.Model(module.ModelArgs.from_dict(config))
            model.set_dtype(getattr(mx, dtype))
            weights = dict(tree_flatten(model.parameters()))
            mx.eval(weights)
            non_finite_names = [name for name, weight in weights.items() if not mx.all(mx.isfinite(weight)).item()]
    except (ImportError, AttributeError, KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ModelError(f"mlx-lm cannot build a {config.get('model_type')!r} model: {e}") from e
    if non_finite_names:
        raise ModelError(f"non-finite weights after initialisation: {', '.join(non_finite_names)}")
    return weights


def is_complete_model(model_dir: Path) -> bool:
    """True when `model_dir` holds every file a demo model consists of."""
    return all((Path(model_dir) / name).is_file() for name in REQUIRED_MODEL_FILES)


def count_parameters(model_dir: Path) -> int:
    """The number of weights in `model_dir/model.safetensors`, read from its header.

    Raises `ModelError` when the file is missing or its header is malformed.
    """
    weights_path = Path(model_dir) / WEIGHTS_FILE_NAME
    try:
        with weights_path.open("rb") as weights_file:
            (header_length_bytes,) = struct.unpack("<Q", weights_file.read(8))
            header = json.loads(weights_file.read(header_length_bytes))
    except (OSError, struct.error, ValueError) as e:
        raise ModelError(f"cannot read the safetensors header of {weights_path}: {e}") from e
    return sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")


def model_size_bytes(model_dir: Path) -> int:
    """The total size of the files in `model_dir`; raises `ModelError` if unreadable."""
    try:
        return sum(path.stat().st_size for path in Path(model_dir).iterdir() if path.is_file())
    except OSError as e:
        raise ModelError(f"cannot read {model_dir}: {e}") from e


def demo_model_dir() -> Path:
    """Where the demo model lives: `<cache>/models/demo-llama-small`.

    `<cache>` is `$KVCELLAR_CACHE_DIR` when set, else the platform's user
    cache directory for kvcellar.
    """
    base_dir = os.environ.get(CACHE_DIR_ENV_VAR)
    cache_dir = Path(base_dir) if base_dir else platformdirs.user_cache_path("kvcellar")
    return cache_dir / "models" / DEMO_MODEL_NAME


def ensure_demo_model(progress: ProgressCallback | None = None) -> Path:
    """Return the demo model's directory, creating it first if it is incomplete.

    Idempotent: a complete model is left alone. Leftover temporary directories
    of dead processes are removed first. `progress`, when given, receives one
    line per step. Raises `ModelError` when the model cannot be created.
    """
    model_dir = demo_model_dir()
    if is_complete_model(model_dir):
        return model_dir
    _remove_abandoned_partial_dirs(model_dir)
    if progress is not None:
        progress(f"creating demo model ({DEMO_ARCH}, {DEMO_SIZE}, {DEMO_DTYPE}) in {model_dir}")
    try:
        create_model(DEMO_ARCH, model_dir, size=DEMO_SIZE, dtype=DEMO_DTYPE, seed=DEMO_SEED, overwrite=True)
    except ModelError:
        # Another process may have published the same model first.
        if not is_complete_model(model_dir):
            raise
    if progress is not None:
        progress(f"demo model ready at {model_dir}")
    return model_dir


def _require_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UsageError(f"unknown {what} {value!r}; choose one of: {', '.join(choices)}")


def _load_tiny_configs() -> dict[str, dict[str, Any]]:
    try:
        return json.loads(TINY_CONFIGS_ASSET_PATH.read_text(encoding="utf-8"))["configs"]
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"cannot read {TINY_CONFIGS_ASSET_PATH}: {e}") from e


def _merge_config(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge_config(merged[key], value)
        else:
            merged[key] = value
    return merged


def _check_out_dir_free(out_dir: Path, *, overwrite: bool) -> None:
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if not out_dir.is_dir():
        raise UsageError(f"{out_dir} exists and is not a directory")
    if not overwrite and any(out_dir.iterdir()):
        raise UsageError(f"{out_dir} exists and is not empty (overwrite it with --force)")


def _set_vocab_size(config: dict[str, Any], vocab_size: int) -> None:
    """Grow the embedding (and output) rows to `vocab_size`, top-level or in a nested text config."""
    for section in (config, config.get("text_config")):
        if isinstance(section, dict) and "vocab_size" in section:
            section["vocab_size"] = vocab_size


def _tools_tokenizer_json(base: dict[str, Any] | None = None) -> dict[str, Any]:
    """`base` (a tokenizer.json's content; default: the committed tokenizer) plus the tool-format
    tokens as added tokens after its vocabulary (not special, as in Qwen's tokenizer: decoding
    keeps them as text)."""
    if base is None:
        try:
            base = json.loads(TOKENIZER_ASSET_PATH.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ModelError(f"cannot read {TOKENIZER_ASSET_PATH}: {e}") from e
    tokenizer = copy.deepcopy(base)
    vocab_size = len(tokenizer["model"]["vocab"])
    for offset, content in enumerate(TOOL_FORMAT_TOKENS):
        tokenizer["added_tokens"].append(
            {
                "id": vocab_size + offset,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": False,
            }
        )
    return tokenizer


def _tokenizer_config(chat_format: str = "plain") -> dict[str, Any]:
    if chat_format == "tools":
        try:
            chat_template = TOOLS_CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")
        except OSError as e:
            raise ModelError(f"cannot read {TOOLS_CHAT_TEMPLATE_PATH}: {e}") from e
    else:
        chat_template = CHAT_TEMPLATE
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH_TOKENS,
        "chat_template": chat_template,
    }


_SAFETENSORS_DTYPES = {
    mx.float32: ("F32", None),
    mx.float16: ("F16", None),
    mx.bfloat16: ("BF16", mx.uint16),
    mx.int32: ("I32", None),
    mx.uint32: ("U32", None),
}


def write_safetensors(path: Path, weights: dict[str, mx.array]) -> None:
    """Write a safetensors file with tensors in sorted name order.

    `mx.save_safetensors` lays tensor data out in its hash map's order, which
    may differ between MLX builds; sorting makes the bytes the same on every
    machine for the same weights.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for name in sorted(weights):
        array = weights[name]
        tag, _ = _SAFETENSORS_DTYPES[array.dtype]
        length = array.nbytes
        header[name] = {"dtype": tag, "shape": list(array.shape), "data_offsets": [offset, offset + length]}
        offset += length
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as out:
        out.write(len(header_bytes).to_bytes(8, "little"))
        out.write(header_bytes)
        for name in sorted(weights):
            array = weights[name]
            view_dtype = _SAFETENSORS_DTYPES[array.dtype][1]
            array = mx.contiguous(array.view(view_dtype) if view_dtype is not None else array)
            mx.eval(array)
            out.write(memoryview(array).cast("B"))  # type: ignore[arg-type]  # stubs omit mx.array's buffer protocol


def _write_model_files(
    model_dir: Path, config: dict[str, Any], weights: dict[str, mx.array], *, chat_format: str = "plain"
) -> None:
    """Write every model file into `model_dir`, each flushed to disk.

    Raises `ModelError` when a file cannot be written.
    """
    json_files = {
        "config.json": config,
        "tokenizer_config.json": _tokenizer_config(chat_format),
        "special_tokens_map.json": {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN},
    }
    try:
        for name, content in json_files.items():
            (model_dir / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        if chat_format == "tools":
            (model_dir / "tokenizer.json").write_text(json.dumps(_tools_tokenizer_json()), encoding="utf-8")
        else:
            shutil.copyfile(TOKENIZER_ASSET_PATH, model_dir / "tokenizer.json")
        # Metadata is constant on purpose: nothing time- or host-dependent may
        # enter the file, so its sha256 is reproducible.
        write_safetensors(model_dir / WEIGHTS_FILE_NAME, weights)
        for path in model_dir.iterdir():
            fsync_path(path)
    except (OSError, RuntimeError, ValueError) as e:
        raise ModelError(f"cannot write model files into {model_dir}: {e}") from e


def _publish_dir(partial_dir: Path, out_dir: Path, *, overwrite: bool) -> None:
    """Rename `partial_dir` to `out_dir`, moving an existing `out_dir` aside first.

    Raises `UsageError` when `out_dir` became non-empty meanwhile and
    `overwrite` is false; `ModelError` when a rename fails.
    """
    _check_out_dir_free(out_dir, overwrite=overwrite)
    replaced_dir: Path | None = None
    try:
        if out_dir.exists():
            unique_suffix = partial_dir.name.split(_PARTIAL_DIR_MARKER, 1)[1]
            replaced_name = f".{out_dir.name}{_REPLACED_DIR_MARKER}{unique_suffix}"
            replaced_dir = out_dir.with_name(replaced_name)
            out_dir.rename(replaced_dir)
        partial_dir.rename(out_dir)
        fsync_path(out_dir.parent)
    except OSError as e:
        raise ModelError(f"cannot move the new model into {out_dir}: {e}") from e
    if replaced_dir is not None:
        shutil.rmtree(replaced_dir, ignore_errors=True)


def _remove_abandoned_partial_dirs(model_dir: Path) -> None:
    """Remove temporary directories beside `model_dir` whose creating process is gone."""
    parent_dir = model_dir.parent
    if not parent_dir.is_dir():
        return
    for candidate in parent_dir.glob(f".{model_dir.name}.*"):
        if not candidate.is_dir():
            continue
        pid_match = _TEMPORARY_DIR_PID_PATTERN.search(candidate.name)
        if pid_match and not _process_is_alive(int(pid_match.group(1))):
            shutil.rmtree(candidate, ignore_errors=True)


def _process_is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


DEMO_CODER_NAME = "demo-coder"
DEMO_CODER_DIR = ASSETS_DIR / DEMO_CODER_NAME


def packaged_demo_coder_dir() -> Path:
    """The committed `demo-coder` model (trained by `kvcellar model train`),
    shipped as package data: what `serve` uses when no --model is given.

    Raises `ModelError` when the installed package lacks its files (a build
    that left the package data out).
    """
    if not is_complete_model(DEMO_CODER_DIR):
        missing = [name for name in REQUIRED_MODEL_FILES if not (DEMO_CODER_DIR / name).is_file()]
        raise ModelError(f"the packaged demo-coder model in {DEMO_CODER_DIR} lacks {', '.join(missing)}")
    return DEMO_CODER_DIR
