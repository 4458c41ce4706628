"""The serving fingerprint: which model, tokenizer, template, KV scheme, MLX
and mlx-lm build and device a stored KV entry belongs to.

The digest names the SSD directory entries live in, so any change selects
another directory; old directories stay intact and are never touched here.

Weight identity is the SHA-256 of every shard byte; tokenizer identity the
SHA-256 of every file that changes tokenization or chat rendering
(`TOKENIZER_FILE_NAMES` and `additional_chat_templates/*.jinja`). The device
is the default device's kind and its chip (Metal GPU name and architecture,
or the CPU model): kernels differ per chip, and so may the KV rows.

`ShardDigestMemo` keeps file digests keyed by resolved path and the file's
stat revision (device, inode, size, nanosecond mtime and ctime), so an
unchanged file is not re-read and any write (even a same-size one with its
mtime restored, which still moves ctime) or a changed symlink target is a
miss. Shards and tokenizer files both go through it, so a restart with
nothing changed hashes no byte. The memo stores only digests; missing,
malformed or unwritable memo storage only costs a re-read.

The model directory and the memo file use plain `os`/`pathlib`, not the
store's `Disk`: they are not KV entries and need no simulated durability.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx

from kvcellar.cpuinfo import CPUINFO_PATH, cpuinfo_field
from kvcellar.errors import DecodeError, ModelError
from kvcellar.serialization import from_cbor, to_cbor
from kvcellar.store.disk import fsync_path

log = logging.getLogger(__name__)

MEMO_FILE_NAME = "memo.cbor"
MEMO_FORMAT = "kvcellar-shard-digest-memo"
MEMO_VERSION = 1
HASH_CHUNK_BYTES = 8 * 1024 * 1024
# A file changed within this window of its last change may change again with
# an identical ctime (coarse kernel timestamps); such a digest is not memoised.
RACY_WINDOW_NS = 100_000_000
DIGEST_HEX_CHARS = 32
# Files a tokenizer loader (transformers, sentencepiece, tiktoken-style BPE)
# reads to tokenize or to render a chat; whichever are present are hashed.
TOKENIZER_FILE_NAMES = (
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "merges.txt",
    "sentencepiece.bpe.model",
    "special_tokens_map.json",
    "spiece.model",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
)
ADDITIONAL_CHAT_TEMPLATES_DIR = "additional_chat_templates"
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


@attrs.frozen(kw_only=True)
class ServingFingerprint:
    """Everything a stored KV entry's validity depends on, as hex digests and names."""

    config_sha256: str
    weights_sha256: str
    # Every tokenizer file; also what `.kvc` headers carry as `tokenizer_hash`.
    tokenizer_sha256: str
    # The template in effect (a subset of the above, named for inspection).
    chat_template_sha256: str
    kv_scheme_key: str
    mlx_version: str
    mlx_lm_version: str
    # "cpu" or "gpu": the default device kernels run on.
    device: str
    # The chip behind it: the Metal GPU's name and architecture, or the CPU model.
    device_architecture: str

    @property
    def digest(self) -> str:
        """A short stable hex name for the SSD directory of this fingerprint."""
        return hashlib.sha256(to_cbor(self)).hexdigest()[:DIGEST_HEX_CHARS]

    def as_dict(self) -> dict[str, str]:
        """The fields as a flat map, for the `.kvc` header's `fingerprint`."""
        return attrs.asdict(self)


def canonical_config_bytes(config: dict[str, Any]) -> bytes:
    """Canonical JSON of a config: sorted keys, no whitespace, floats as Python
    `repr`, ASCII only, so key order and formatting never change the bytes."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


@attrs.frozen(kw_only=True)
class _MemoEntry:
    size_bytes: int
    inode: int
    device: int
    mtime_ns: int
    ctime_ns: int
    sha256: str


@attrs.frozen(kw_only=True)
class _MemoFile:
    format: str
    version: int
    entries: dict[str, _MemoEntry]


def _revision(stat: os.stat_result, sha256: str = "") -> _MemoEntry:
    return _MemoEntry(
        size_bytes=stat.st_size,
        inode=stat.st_ino,
        device=stat.st_dev,
        mtime_ns=stat.st_mtime_ns,
        ctime_ns=stat.st_ctime_ns,
        sha256=sha256,
    )


class ShardDigestMemo:
    """SHA-256 of files, memoised by resolved path and stat revision.

    `directory` holds the memo file; `None` keeps the memo in RAM only.
    `bytes_hashed` counts the file bytes this instance has read.
    """

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self.path = None if directory is None else directory / MEMO_FILE_NAME
        self.bytes_hashed = 0
        self._warned_write_failure = False
        self._entries = self._load()

    def digest(self, path: Path) -> str:
        """The SHA-256 hex of `path`'s bytes (a symlink is followed).

        Raises `OSError` when the file cannot be opened or read: the caller
        decides whose fault that is. Memo trouble never raises.
        """
        resolved = Path(path).resolve(strict=True)
        key = str(resolved)
        with open(resolved, "rb") as file:
            before = _revision(os.fstat(file.fileno()))
            memoised = self._entries.get(key)
            if memoised is not None and attrs.evolve(memoised, sha256="") == before:
                return memoised.sha256
            sha256 = self._hash(file)
            after = _revision(os.fstat(file.fileno()))
        # The path must still name the file we read, unchanged while we read it,
        # or the digest would be memoised under a revision it does not describe.
        settled = time.time_ns() - after.ctime_ns >= RACY_WINDOW_NS
        if before == after == _revision(os.stat(resolved)) and settled:
            self._entries[key] = attrs.evolve(after, sha256=sha256)
            self._persist()
        else:
            log.debug("not memoising %s: changed while hashing or too recently", resolved)
        return sha256

    def _hash(self, file: Any) -> str:
        hasher = hashlib.sha256()
        buffer = bytearray(HASH_CHUNK_BYTES)
        view = memoryview(buffer)
        while count := file.readinto(buffer):
            hasher.update(view[:count])
            self.bytes_hashed += count
        return hasher.hexdigest()

    def _load(self) -> dict[str, _MemoEntry]:
        if self.path is None:
            return {}
        try:
            memo = from_cbor(self.path.read_bytes(), _MemoFile)
        except (OSError, DecodeError) as e:
            log.debug("shard digest memo %s unusable, starting empty: %s", self.path, e)
            return {}
        if memo.format != MEMO_FORMAT or memo.version != MEMO_VERSION:
            log.debug("shard digest memo %s is foreign (%s v%s), starting empty", self.path, memo.format, memo.version)
            return {}
        return {key: entry for key, entry in memo.entries.items() if _SHA256_HEX.fullmatch(entry.sha256)}

    def _persist(self) -> None:
        """Write the memo atomically (temp, fsync, rename, fsync directory);
        entries of files that no longer exist are dropped."""
        if self.directory is None or self.path is None:
            return
        self._entries = {key: entry for key, entry in sorted(self._entries.items()) if os.path.exists(key)}
        payload = to_cbor(_MemoFile(format=MEMO_FORMAT, version=MEMO_VERSION, entries=self._entries))
        temp = self.directory / f"{MEMO_FILE_NAME}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(temp, "xb") as file:
                file.write(payload)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temp, self.path)
            fsync_path(self.directory)
        except OSError as e:
            with contextlib.suppress(OSError):
                temp.unlink(missing_ok=True)
            # Warned once: a read-only cache directory would otherwise log per shard.
            level = logging.DEBUG if self._warned_write_failure else logging.WARNING
            log.log(level, "cannot write shard digest memo %s (shards will be re-read): %s", self.path, e)
            self._warned_write_failure = True


def _read_json(path: Path) -> Any:
    """Raises `ModelError` for invalid JSON; `OSError` passes to the caller."""
    try:
        return json.loads(path.read_bytes())
    except ValueError as e:
        raise ModelError(f"{path} is not valid JSON: {e}") from e


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _optional_file_sha256(path: Path) -> str:
    return _sha256_bytes(path.read_bytes()) if path.is_file() else ""


def _chat_template_sha256(model_dir: Path) -> str:
    """A separate `chat_template.jinja` wins over `tokenizer_config.json`'s
    `chat_template`, as in transformers, which wins over the legacy
    `chat_template.json`; a list of named templates is hashed as canonical JSON."""
    if jinja_sha256 := _optional_file_sha256(model_dir / "chat_template.jinja"):
        return jinja_sha256
    template = None
    for name in ("tokenizer_config.json", "chat_template.json"):
        config_path = model_dir / name
        loaded = _read_json(config_path) if config_path.is_file() else {}
        template = loaded.get("chat_template") if isinstance(loaded, dict) else None
        if template is not None:
            break
    if template is None:
        return ""
    if isinstance(template, str):
        return _sha256_bytes(template.encode("utf-8"))
    return _sha256_bytes(canonical_config_bytes({"chat_template": template}))


def tokenizer_files(model_dir: Path) -> list[tuple[str, Path]]:
    """The tokenizer and chat template files present in `model_dir`, as
    (name relative to `model_dir`, path), sorted by name."""
    found = [(name, model_dir / name) for name in TOKENIZER_FILE_NAMES if (model_dir / name).is_file()]
    extra_dir = model_dir / ADDITIONAL_CHAT_TEMPLATES_DIR
    if extra_dir.is_dir():
        found += [
            (f"{ADDITIONAL_CHAT_TEMPLATES_DIR}/{path.name}", path)
            for path in extra_dir.glob("*.jinja")
            if path.is_file()
        ]
    return sorted(found)


def _tokenizer_sha256(model_dir: Path, memo: ShardDigestMemo) -> str:
    """The SHA-256 of the (name, file SHA-256) list of `tokenizer_files`; ""
    when there are none (a model without a tokenizer of its own)."""
    files = tokenizer_files(model_dir)
    if not files:
        return ""
    return _sha256_bytes(to_cbor([[name, memo.digest(path)] for name, path in files]))


def mlx_version() -> str:
    """The MLX build: its kernels shape every KV row."""
    return mx.__version__  # type: ignore[attr-defined]  # MLX's type stubs omit `__version__`


def mlx_lm_version() -> str:
    """The installed mlx-lm version: its model code shapes every KV row."""
    try:
        return importlib.metadata.version("mlx-lm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _cpu_model(cpuinfo_path: Path) -> str:
    """Linux's /proc/cpuinfo "model name", else what `platform` knows."""
    return cpuinfo_field("model name", cpuinfo_path) or platform.processor() or platform.machine() or "unknown"


def describe_device_architecture(
    device: Any = None, *, device_info: Callable[[Any], dict[str, Any]] | None = None, cpuinfo_path: Path = CPUINFO_PATH
) -> str:
    """The chip the default device runs on: "<GPU name> (<architecture>)" for
    a GPU (from `mx.device_info`: the Metal GPU on macOS, e.g. "Apple M3 Max
    (applegpu_g15s)"; an NVIDIA GPU under MLX's CUDA backend, e.g. "NVIDIA
    H200 (sm_90)", its compute capability), "<CPU model> (<machine>)" for the
    CPU. Only the name and architecture count, never the memory counters,
    which change while it runs. Reads device metadata only; runs no kernel."""
    device = device if device is not None else mx.default_device()
    if device.type == mx.DeviceType.gpu:
        info = (device_info or mx.device_info)(device)
        name = str(info.get("device_name") or "unknown GPU")
        architecture = info.get("architecture")
        return f"{name} ({architecture})" if architecture else name
    return f"{_cpu_model(cpuinfo_path)} ({platform.machine() or 'unknown'})"


def compute_fingerprint(
    model_dir: Path,
    *,
    kv_scheme_key: str = "bf16",
    memo: ShardDigestMemo | None = None,
    device_architecture: str | None = None,
) -> ServingFingerprint:
    """The serving fingerprint of the model in `model_dir`; `memo` (RAM-only
    when omitted) spares re-reading unchanged shards and tokenizer files;
    `device_architecture` replaces `describe_device_architecture()`.

    Raises `ModelError` (the operator's fault, or a damaged directory) when
    `model_dir` has no `config.json` or no `*.safetensors` shard, when
    `config.json`, `tokenizer_config.json` or `chat_template.json` is not
    valid JSON (or the config is not an object), or when a model file cannot
    be read.
    """
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelError(f"model directory {model_dir} has no config.json")
    shard_paths = sorted(model_dir.glob("*.safetensors"))
    if not shard_paths:
        raise ModelError(f"model directory {model_dir} has no *.safetensors weights")
    memo = memo if memo is not None else ShardDigestMemo(None)
    try:
        config = _read_json(config_path)
        shards = [[path.name, memo.digest(path)] for path in shard_paths]
        tokenizer_sha256 = _tokenizer_sha256(model_dir, memo)
        chat_template_sha256 = _chat_template_sha256(model_dir)
    except OSError as e:
        raise ModelError(f"cannot read the model files in {model_dir}: {e}") from e
    if not isinstance(config, dict):
        raise ModelError(f"{config_path} is not a JSON object")
    return ServingFingerprint(
        config_sha256=_sha256_bytes(canonical_config_bytes(config)),
        weights_sha256=_sha256_bytes(to_cbor(shards)),
        tokenizer_sha256=tokenizer_sha256,
        chat_template_sha256=chat_template_sha256,
        kv_scheme_key=kv_scheme_key,
        mlx_version=mlx_version(),
        mlx_lm_version=mlx_lm_version(),
        device=mx.default_device().type.name,
        device_architecture=(
            device_architecture if device_architecture is not None else describe_device_architecture()
        ),
    )
