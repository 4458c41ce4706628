"""The `kvcellar serve` command: flags, their checks, and the start-up."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import attrs
import click

from kvcellar.engine.compute_dtype import COMPUTE_DTYPE_CHOICES, COMPUTE_DTYPE_DEFAULT
from kvcellar.errors import UsageError

if TYPE_CHECKING:
    from kvcellar.actors.system import SystemConfig
    from kvcellar.actors.uploader import SharedCacheConfig
    from kvcellar.http.app import HttpSettings
    from kvcellar.store.keyring import KeyRing
    from kvcellar.store.tenants import Tenants

log = logging.getLogger("kvcellar.serve")

SHUTDOWN_TIMEOUT_ENV = "KVCELLAR_SHUTDOWN_TIMEOUT_S"
SHARD_DIGEST_MEMO_DIR_NAME = "shard-digests"
GB = 10**9


def resolve_model_dir(model: str | None) -> Path:
    """A local model directory for `--model`: the committed demo-coder model when
    absent, a directory with config.json, or a hub repo id (the cached snapshot,
    else a download with progress on stderr; see `kvcellar.engine.hub`)."""
    if model is None:
        from kvcellar.engine.demo_models import packaged_demo_coder_dir

        return packaged_demo_coder_dir()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"{path} is not a model directory (no config.json)")
        return path
    from kvcellar.engine.hub import is_repo_id, resolve_hub_model

    if is_repo_id(model) and not path.exists():
        return resolve_hub_model(model)
    raise UsageError(f"--model {model!r}: no such directory")


def shard_digest_memo_dir(environ=os.environ) -> Path:
    """Where `serve` keeps its weight and tokenizer file digests across starts:
    `<cache>/shard-digests`, `<cache>` being `$KVCELLAR_CACHE_DIR` when set,
    else the platform's user cache directory for kvcellar (as for the demo model)."""
    import platformdirs

    from kvcellar.engine.demo_models import CACHE_DIR_ENV_VAR

    base_dir = environ.get(CACHE_DIR_ENV_VAR)
    cache_dir = Path(base_dir) if base_dir else platformdirs.user_cache_path("kvcellar")
    return cache_dir / SHARD_DIGEST_MEMO_DIR_NAME


def shutdown_timeout_s(environ=os.environ) -> float:
    raw = environ.get(SHUTDOWN_TIMEOUT_ENV, "120")
    try:
        value = float(raw)
    except ValueError:
        raise UsageError(f"{SHUTDOWN_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise UsageError(f"{SHUTDOWN_TIMEOUT_ENV} must be positive")
    return value


@click.command("serve")
@click.option(
    "--model",
    "model",
    multiple=True,
    help="Model: a local mlx-lm directory or a hub repo id ORG/NAME (downloaded into the Hugging Face "
    "cache unless cached; HF_HUB_OFFLINE=1 forbids it). Default: the built-in demo-coder model. "
    "NAME=DIR or NAME=ORG/NAME, repeatable, serves a model pool under those names (docs/models.md).",
)
@click.option(
    "--models",
    "models_file",
    default=None,
    type=click.Path(path_type=Path, dir_okay=False),
    help="A TOML file of the models to serve: per model its path, aliases (names or globs such as "
    "claude-haiku-*), pin and kv_quant, and an optional default model (docs/models.md).",
)
@click.option(
    "--models-memory-gb",
    "models_memory_gb",
    default=None,
    type=click.FloatRange(min=0),
    help="A model pool's budget for loaded weights in GB: a model loads when first asked for, and the "
    "least recently used unpinned model is drained to the SSD tier and unloaded to make room. "
    "Default: the memory budget's default (75% of physical memory); 0 = no limit.",
)
@click.option(
    "--default-model",
    "default_model",
    default=None,
    help="In a model pool, the model a request naming no served model or alias goes to "
    "(else it is a 404 naming the served models).",
)
@click.option(
    "--draft-model",
    default=None,
    help="Speculative decoding: a draft model (local directory or hub ORG/NAME, the target's tokenizer) proposes "
    "tokens the model verifies; greedy and seeded output is unchanged. Its KV rides with the target's in every "
    "cache tier. Off unless set.",
)
@click.option(
    "--num-draft-tokens",
    default=3,
    show_default=True,
    type=click.IntRange(min=1),
    help="Tokens the draft model proposes per step (with --draft-model).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind; loopback by default.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="TCP port.")
@click.option(
    "--prompt-cache",
    "prompt_cache_gb",
    default=8.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="RAM prompt cache size in GB; 0 disables it.",
)
@click.option(
    "--ssd-cache",
    "ssd_dir",
    default=None,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory of the SSD cold tier (off unless set).",
)
@click.option(
    "--ssd-cache-max",
    "ssd_max_gb",
    default=None,
    type=click.FloatRange(min=0),
    help="Byte cap of the SSD tier in GB; 0 or unset = unlimited. Needs --ssd-cache.",
)
@click.option(
    "--ssd-demote-idle",
    "demote_idle_s",
    default=None,
    type=click.FloatRange(min=0),
    help="Seconds after which unused RAM entries move to SSD (default 300 with the tier on; 0 disables). "
    "Needs --ssd-cache.",
)
@click.option(
    "--kv-quant",
    default="off",
    show_default=True,
    type=click.Choice(["off", "4", "8", "config"]),
    help="KV cache quantization: off (model dtype), 4 or 8 bits, or per-layer from kv_config.json.",
)
@click.option(
    "--batch",
    "--max-batch",
    "batch_rows",
    default=8,
    show_default=True,
    type=click.IntRange(min=1),
    help="Rows of the batch lane: up to this many requests decode together. 1 = the serial lane "
    "(one request at a time). --max-batch is the same flag.",
)
@click.option(
    "--kv-budget",
    "kv_budget_gb",
    default=4.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="KV budget of the batch lane in GB: a request joins the batch only if the batch's projected "
    "KV with it fits (rows x the largest row's prompt + max_tokens: rows are padded to the "
    "longest); the rest wait in FIFO order.",
)
@click.option(
    "--prefill-step-size", default=512, show_default=True, type=click.IntRange(min=1), help="Tokens per prefill chunk."
)
@click.option(
    "--max-tokens",
    default=256,
    show_default=True,
    type=click.IntRange(min=1),
    help="Default max_tokens for requests that do not set it.",
)
@click.option(
    "--admin-token",
    envvar="KVCELLAR_ADMIN_TOKEN",
    default=None,
    help="Bearer token required by /stats, /metrics and /admin/* (or KVCELLAR_ADMIN_TOKEN).",
)
@click.option(
    "--api-key",
    envvar="KVCELLAR_API_KEY",
    default=None,
    help="Bearer token required by the /v1 API (or KVCELLAR_API_KEY).",
)
@click.option(
    "--tenants",
    "tenants_file",
    default=None,
    type=click.Path(dir_okay=False, path_type=Path),
    help="A TOML file of tenants ([tenants.NAME] with api_keys or api_key_sha256, optional ram_gb, ssd_gb, "
    "shared): each API key selects its tenant's own cache namespace in every tier; other keys get a 401. "
    "Not with --api-key (docs/security.md).",
)
@click.option(
    "--memory-budget",
    "memory_budget_gb",
    default=None,
    type=click.FloatRange(min=0),
    help="What MLX may hold live, model weights included, in GB: over it, RAM cache entries are "
    "persisted to SSD (or dropped) before the next step, and a request that cannot fit gets a 503 "
    "insufficient_memory. Default: 75% of physical memory (on macOS at most Metal's recommended "
    "working set); 0 = off.",
)
@click.option(
    "--generation-checkpoint",
    "generation_checkpoint_tokens",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Checkpoint each generation to the SSD tier every this many emitted tokens, so an identical "
    "request after a crash or restart resumes where it was; 0 = off. Needs --ssd-cache.",
)
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"]),
    help="Logging verbosity.",
)
@click.option(
    "--ssd-admission",
    "ssd_admission",
    default="always",
    show_default=True,
    type=click.Choice(["always", "second-hit", "cost"]),
    help="Which background writes reach the SSD tier: always; second-hit (once a prefix was taken twice, "
    "or on leaving RAM after a hit); cost (when recomputing it takes longer than --ssd-cost-threshold "
    "seconds per GB written). A flush and shutdown write everything regardless. Needs --ssd-cache.",
)
@click.option(
    "--ssd-cost-threshold",
    "ssd_cost_threshold_s_per_gb",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Seconds of prefill per GB written above which --ssd-admission cost writes an entry.",
)
@click.option(
    "--ssd-write-budget",
    "ssd_write_budget_gb_per_day",
    default=None,
    type=click.FloatRange(min=0, min_open=True),
    help="SSD write budget in GB a day (a token bucket kept in the journal, so it survives restarts); "
    "when it runs dry background writes wait and the oldest queued are dropped; a flush still writes "
    "and says how far it went over. Unset: unlimited. Needs --ssd-cache.",
)
@click.option(
    "--shared-cache",
    "shared_cache_url",
    default=None,
    help="Shared cold tier on S3-compatible object storage, s3://BUCKET/PREFIX (off unless set; needs "
    "--ssd-cache). Credentials and region: the standard AWS environment and config files.",
)
@click.option(
    "--shared-cache-endpoint",
    "shared_cache_endpoint",
    default=None,
    help="Endpoint URL of the object store (MinIO, R2, a local server); default: AWS S3.",
)
@click.option(
    "--shared-upload-min-tokens",
    default=1024,
    show_default=True,
    type=click.IntRange(min=1),
    help="Upload an entry to the shared tier once it holds this many tokens (or was hit twice).",
)
@click.option(
    "--shared-upload-gb-per-day",
    default=10.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Egress budget of the shared tier's uploads per UTC day, in GB.",
)
@click.option(
    "--shared-cache-timeout",
    "shared_cache_timeout_s",
    default=5.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Most seconds a request waits on the shared tier (a download) before going on without it.",
)
@click.option(
    "--shared-cache-refresh",
    "shared_cache_refresh_s",
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=1),
    help="Seconds between listings of the shared tier's manifests.",
)
@click.option(
    "--ssd-cache-verify",
    "ssd_cache_verify",
    default="on",
    show_default=True,
    type=click.Choice(["on", "off"]),
    help="Check every tensor's xxh3-64 checksum when restoring from the SSD tier (off: a corrupted "
    "tensor is restored as it is on disk; the header is always checked). Needs --ssd-cache.",
)
@click.option(
    "--encryption-key-file",
    "encryption_key_files",
    multiple=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Seal the SSD tier's entries at rest with AES-256-GCM (`kvcellar keygen FILE` makes a key). Repeatable: "
    "the first key seals new entries, every key opens old ones (rotation). An entry whose key is not given is "
    "moved to quarantine-sealed/ and its prompt served cold. Needs --ssd-cache; not yet with --shared-cache or "
    "--generation-checkpoint (docs/security.md).",
)
@click.option(
    "--paged-kv",
    "paged_kv",
    is_flag=True,
    default=False,
    help="Hold full-attention KV in fixed-size blocks (spec §6): batch rows keep their own blocks instead of "
    "padding to the longest row, and --kv-budget bills each row's blocks. Not with --kv-quant. Batch-lane "
    "decode pays a copy of the rows' blocks per step (docs/benchmarks.md, live-tier layouts).",
)
@click.option(
    "--paged-kv-block-size",
    "paged_kv_block_size",
    default=256,
    show_default=True,
    type=click.IntRange(min=1),
    help="Tokens per paged-KV block. Needs --paged-kv.",
)
@click.option(
    "--tool-call-grammar",
    "tool_call_grammar",
    default="on",
    show_default=True,
    type=click.Choice(["on", "off"]),
    help="Constrain tool calls (models with mlx-lm's JSON tool format): once the model writes the tool-call "
    "start marker, its tokens must form a call naming an offered tool with arguments valid against that "
    "tool's JSON schema, then the end marker; the rest of the reply stays free. off leaves the model's "
    "own output as-is (a tool with strict: true still turns it on for its request).",
)
@click.option(
    "--restore-policy",
    "restore_policy",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "restore", "recompute", "split"]),
    help="How a request whose prefix is on the SSD tier is served: auto takes the fastest predicted of "
    "restoring it, recomputing it, and splitting it (prefill the front while the back loads; full-attention "
    "models only), from a cost model measured on this machine (docs/restore-policy.md); the others force "
    "one plan, for benchmarks and debugging (restore: every hit restored as before, nothing measured at "
    "start). Needs --ssd-cache.",
)
@click.option(
    "--disk-throttle-mbps",
    "disk_throttle_mbps",
    default=None,
    type=click.FloatRange(min=0, min_open=True),
    help="Emulate a slower SSD: every read and write of the SSD tier keeps to this many MB/s (10**6 "
    "bytes). For benchmarks and for seeing the restore policy recompute where a disk is slow. Needs --ssd-cache.",
)
@click.option(
    "--hosted-tools",
    "hosted_tools",
    default="omit",
    show_default=True,
    type=click.Choice(["omit", "reject"]),
    help="Hosted or server tools this server cannot run (OpenAI Responses web_search, namespace; Anthropic "
    "web_search_..., bash_..., text_editor_..., code_execution_...): omit leaves them out of the prompt (one "
    "WARNING per kind, names in /stats/requests); reject answers such a request with a 400 naming the tool.",
)
@click.option(
    "--prompt-normalize",
    "prompt_normalize",
    default="on",
    show_default=True,
    type=click.Choice(["on", "off"]),
    help="Rewrite system text that varies per request without changing its meaning (Claude Code's billing "
    "header line) into one fixed form before templating, so sessions share their cached prefix "
    "(rules: docs/agents.md).",
)
@click.option(
    "--keepalive-interval",
    "keepalive_interval_s",
    # http/streaming.py's KEEPALIVE_INTERVAL_S_DEFAULT (the CLI imports nothing heavy before a command runs).
    default=5.0,
    show_default=True,
    type=click.FloatRange(min=0.01, max=3600),
    help="Seconds a stream may stay silent (a long prefill, a wait for the lane) before it gets a keep-alive: "
    "an Anthropic ping event, an SSE comment on the OpenAI APIs. Agents give up on a stream silent for "
    "minutes; keep it well under their idle timeout.",
)
@click.option(
    "--kv-events-block-size",
    "kv_events_block_size",
    # store/kv_events.py's BLOCK_SIZE_DEFAULT, vLLM's default block size.
    default=16,
    show_default=True,
    type=click.IntRange(min=1, max=4096),
    help="Tokens per block of the KV events on GET /v1/kv_events (chained block digests, docs/cluster.md).",
)
@click.option(
    "--compute-dtype",
    "compute_dtype",
    default=COMPUTE_DTYPE_DEFAULT,
    show_default=True,
    type=click.Choice(list(COMPUTE_DTYPE_CHOICES)),
    help="The dtype weights, activations and KV are computed in. auto: on the CPU, a 16-bit model whose "
    "float32 weights fit in 1 GiB is cast to float32 at load (MLX's 16-bit CPU matmul is a slow generic "
    "kernel; float32 runs in BLAS), otherwise the weights' own; model: always the weights' own; float32: "
    "always cast. The choice shows in the start-up log and /stats (compute_dtype), and a cast is part of the "
    "serving fingerprint.",
)
def serve_command(**options: Any) -> None:
    """Serve the OpenAI-compatible HTTP API with the RAM and SSD cache tiers."""
    flags = ServeFlags(**options)
    logging.basicConfig(level=flags.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _check_flags(flags)
    tenants = _tenants(flags)  # before any model work: a bad file stops the start at once
    from kvcellar.cli.serve_pool import make_pool, pool_names

    names = pool_names(flags.model, flags.models_file, flags.default_model)
    if names is not None and flags.draft_model is not None:
        raise UsageError(
            "--draft-model serves one model; in a model pool give each model its own draft: "
            "draft_model (and num_draft_tokens) in its [models.NAME] table of --models FILE (docs/models.md)"
        )
    if names is not None:
        from kvcellar.http.server import serve_pool_forever

        base = _system_config(flags, tenants, model_dir=Path("."))
        pool = make_pool(names, base, flags.models_memory_gb, resolve_model_dir)
        run_trio_and_exit(serve_pool_forever, pool, flags.host, flags.port, _http_settings(flags, tenants))
    _run(_system_config(flags, tenants), flags.host, flags.port, _http_settings(flags, tenants))


def _tenants(flags: ServeFlags) -> Tenants | None:
    """The `--tenants` file, parsed; refused beside `--api-key` (one key would bypass the tenants)."""
    if flags.tenants_file is None:
        return None
    if flags.api_key:
        raise UsageError(
            "--tenants and --api-key cannot be combined: give the --api-key key to a tenant in the tenants file"
        )
    from kvcellar.store.tenants import load_tenants

    return load_tenants(flags.tenants_file)


def _check_flags(flags: ServeFlags) -> None:
    """Refuse combinations that cannot run; warn about options that need another."""
    ssd_dir = flags.ssd_dir
    if ssd_dir is not None and flags.prompt_cache_gb == 0:
        raise UsageError("--ssd-cache needs the RAM tier: --prompt-cache 0 cannot be combined with it")
    check_generation_checkpoint(flags.generation_checkpoint_tokens, ssd_dir)
    check_paged_kv(flags.paged_kv, flags.kv_quant, ssd_dir)
    if ssd_dir is None and (flags.ssd_max_gb is not None or flags.demote_idle_s is not None):
        log.warning("--ssd-cache-max and --ssd-demote-idle need --ssd-cache; ignored")
    if ssd_dir is None and (flags.ssd_admission != "always" or flags.ssd_write_budget_gb_per_day is not None):
        log.warning("--ssd-admission and --ssd-write-budget need --ssd-cache; ignored")
    check_encryption(flags, ssd_dir)


def check_encryption(flags: ServeFlags, ssd_dir: Path | None) -> None:
    """Encryption at rest seals what the SSD tier writes (entries, journal, checkpoints) and the shared tier's
    objects and manifests: it needs the SSD tier."""
    if not flags.encryption_key_files:
        return
    if ssd_dir is None:
        raise UsageError("--encryption-key-file seals the SSD tier's entries: it needs --ssd-cache")


def _system_config(flags: ServeFlags, tenants: Tenants | None = None, model_dir: Path | None = None) -> SystemConfig:
    """The system's configuration; `model_dir` given, it is used as is (a pool sets each model's own)."""
    from kvcellar.actors.system import SystemConfig
    from kvcellar.store.fingerprint import ShardDigestMemo

    ssd_dir = flags.ssd_dir
    keyring = _keyring(flags.encryption_key_files)  # first: a bad key file stops the start before any model work
    return SystemConfig(
        model_dir=model_dir if model_dir is not None else resolve_model_dir(flags.model[0] if flags.model else None),
        draft_model_dir=resolve_model_dir(flags.draft_model) if flags.draft_model is not None else None,
        num_draft_tokens=flags.num_draft_tokens,
        ssd_dir=ssd_dir,
        ssd_bytes_max=int(flags.ssd_max_gb * GB) if ssd_dir is not None and flags.ssd_max_gb else None,
        prompt_cache_bytes=int(flags.prompt_cache_gb * GB),
        demote_idle_s=300.0 if flags.demote_idle_s is None else flags.demote_idle_s,
        kv_quant=flags.kv_quant,
        batch_rows_max=flags.batch_rows,
        kv_budget_bytes=int(flags.kv_budget_gb * GB),
        prefill_step_tokens=flags.prefill_step_size,
        shutdown_timeout_s=shutdown_timeout_s(),
        # Only the SSD tier's directory name needs the fingerprint, so only it reads the memo.
        shard_digest_memo=ShardDigestMemo(shard_digest_memo_dir()) if ssd_dir is not None else None,
        memory_budget_bytes=None if flags.memory_budget_gb is None else int(flags.memory_budget_gb * GB),
        ssd_admission=flags.ssd_admission,
        ssd_cost_threshold_s_per_gb=flags.ssd_cost_threshold_s_per_gb,
        ssd_write_budget_bytes_per_day=ssd_write_budget_bytes(flags.ssd_write_budget_gb_per_day),
        shared_cache=shared_cache_config(
            flags.shared_cache_url,
            ssd_dir,
            endpoint_url=flags.shared_cache_endpoint,
            min_tokens=flags.shared_upload_min_tokens,
            bytes_per_day=int(flags.shared_upload_gb_per_day * GB),
            request_timeout_s=flags.shared_cache_timeout_s,
            refresh_s=flags.shared_cache_refresh_s,
        ),
        generation_checkpoint_tokens=flags.generation_checkpoint_tokens,
        ssd_verify=flags.ssd_cache_verify == "on",
        paged_kv_block_size=flags.paged_kv_block_size if flags.paged_kv else None,
        restore_policy=flags.restore_policy,
        disk_throttle_bytes_per_s=None if flags.disk_throttle_mbps is None else flags.disk_throttle_mbps * 1e6,
        compute_dtype=flags.compute_dtype,
        ssd_keyring=keyring,
        tenants=tenants,
    )


def _keyring(paths: tuple[Path, ...]) -> KeyRing | None:
    """The key ring of `--encryption-key-file`, read at start-up: a missing or bad key file stops the server."""
    from kvcellar.store.keyring import load_key_ring

    return load_key_ring(paths) if paths else None


def _http_settings(flags: ServeFlags, tenants: Tenants | None = None) -> HttpSettings:
    from kvcellar.http.app import HttpSettings

    return HttpSettings(
        api_key=flags.api_key,
        tenants=tenants,
        admin_token=flags.admin_token,
        max_tokens_default=flags.max_tokens,
        tool_call_grammar=flags.tool_call_grammar == "on",
        hosted_tools="reject" if flags.hosted_tools == "reject" else "omit",
        prompt_normalize=flags.prompt_normalize == "on",
        keepalive_interval_s=flags.keepalive_interval_s,
        kv_events_block_size=flags.kv_events_block_size,
    )


def run_trio_and_exit(main: Any, *args: Any) -> NoReturn:
    """`trio.run(main, *args)`, then end the process without Python's teardown.

    A start-up refusal made once a model is loaded (`--paged-kv`'s model gate) is a
    `UsageError`: MLX ran, so it is reported as `kvcellar` does and the process ends with 2.
    By the end everything is flushed and the engine thread joined. MLX's C++ runtime can
    abort in its static destructors at interpreter exit ("terminate called without an active
    exception", SIGABRT, seen in about one clean shutdown in three), so the process ends
    without running them."""
    import trio

    try:
        trio.run(main, *args)
    except UsageError as e:
        click.echo(f"error: {e}", err=True)
        logging.shutdown()
        sys.stderr.flush()
        os._exit(2)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(config: SystemConfig, host: str, port: int, settings: HttpSettings) -> NoReturn:
    from kvcellar.http.server import serve_forever

    run_trio_and_exit(serve_forever, config, host, port, settings)


@attrs.frozen(kw_only=True)
class ServeFlags:
    """`kvcellar serve`'s options as click parsed them (one field per option, named as its parameter)."""

    model: tuple[str, ...]
    models_file: Path | None
    models_memory_gb: float | None
    default_model: str | None
    draft_model: str | None
    num_draft_tokens: int
    host: str
    port: int
    prompt_cache_gb: float
    ssd_dir: Path | None
    ssd_max_gb: float | None
    demote_idle_s: float | None
    kv_quant: str
    batch_rows: int
    kv_budget_gb: float
    prefill_step_size: int
    max_tokens: int
    admin_token: str | None
    api_key: str | None
    tenants_file: Path | None
    generation_checkpoint_tokens: int
    log_level: str
    memory_budget_gb: float | None
    ssd_admission: str
    ssd_cost_threshold_s_per_gb: float
    ssd_write_budget_gb_per_day: float | None
    shared_cache_url: str | None
    shared_cache_endpoint: str | None
    shared_upload_min_tokens: int
    shared_upload_gb_per_day: float
    shared_cache_timeout_s: float
    shared_cache_refresh_s: float
    ssd_cache_verify: str
    encryption_key_files: tuple[Path, ...]
    paged_kv: bool
    paged_kv_block_size: int
    tool_call_grammar: str
    restore_policy: str
    disk_throttle_mbps: float | None
    hosted_tools: str
    prompt_normalize: str
    keepalive_interval_s: float
    kv_events_block_size: int
    compute_dtype: str


def ssd_write_budget_bytes(gb_per_day: float | None) -> int | None:
    """`--ssd-write-budget` in bytes a day (GB are 10**9 bytes, as for the other sizes)."""
    if gb_per_day is None:
        return None
    budget_bytes = int(gb_per_day * GB)
    if budget_bytes <= 0:
        raise UsageError(f"--ssd-write-budget {gb_per_day} GB/day is less than a byte a day")
    return budget_bytes


def shared_cache_config(
    url: str | None,
    ssd_dir: Path | None,
    *,
    endpoint_url: str | None,
    min_tokens: int,
    bytes_per_day: int,
    request_timeout_s: float,
    refresh_s: float,
) -> SharedCacheConfig | None:
    """The shared tier's config from `serve`'s flags, None without `--shared-cache`.
    Raises `UsageError` for a malformed URL or a missing `--ssd-cache`."""
    from kvcellar.actors.uploader import SharedCacheConfig
    from kvcellar.store.shared_tier import SharedLocation, UploadPolicyConfig

    if url is None:
        if endpoint_url is not None:
            log.warning("--shared-cache-endpoint needs --shared-cache; ignored")
        return None
    SharedLocation.parse(url)
    if ssd_dir is None:
        raise UsageError("--shared-cache needs --ssd-cache: downloaded entries land in the SSD tier")
    try:
        import boto3  # noqa: F401
    except ImportError as e:
        raise UsageError("--shared-cache needs boto3: pip install 'kvcellar[s3]'") from e
    return SharedCacheConfig(
        url=url,
        endpoint_url=endpoint_url,
        request_timeout_s=request_timeout_s,
        refresh_s=refresh_s,
        upload=UploadPolicyConfig(min_tokens=min_tokens, bytes_per_day=bytes_per_day),
    )


def check_generation_checkpoint(tokens: int, ssd_dir: Path | None) -> None:
    """`--generation-checkpoint N` needs the SSD tier: a clear start-up error otherwise."""
    if tokens > 0 and ssd_dir is None:
        raise UsageError("--generation-checkpoint needs --ssd-cache DIR: checkpoints are written to the SSD tier")


def check_paged_kv(paged_kv: bool, kv_quant: str, ssd_dir: Path | None) -> None:
    """`--paged-kv`'s start-up gates (spec §6.3): refused with `--kv-quant`;
    with the tiers on, a warning of what they see. The model's own gate runs
    once it is loaded (`actors/system_wiring.py`, `open_paged_kv`)."""
    if not paged_kv:
        return
    if kv_quant != "off":
        raise UsageError(f"--paged-kv cannot run with --kv-quant {kv_quant}: paged blocks hold unquantized KV only")
    if ssd_dir is not None:
        log.warning(
            "--paged-kv with --ssd-cache: the RAM and SSD tiers see plain KVCache entries, converted from "
            "blocks at the tier boundary (a copy at every take, put and snapshot)"
        )
