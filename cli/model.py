"""`kvcellar model ...`: demo models (random-weight ones for tests and benchmarks, the trained
demo-coder) and hub models (pull, list)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from kvcellar.engine.demo_models import (
    ARCHITECTURES,
    DEMO_ARCH,
    DEMO_DTYPE,
    DEMO_SIZE,
    DTYPES,
    SIZES,
    count_parameters,
    create_model,
    demo_model_dir,
    ensure_demo_model,
    is_complete_model,
    model_size_bytes,
)
from kvcellar.errors import ModelError, UsageError

# A byte-level BPE holds the 256 byte symbols and the 3 special tokens before any merge.
TOKENIZER_IDS_MIN = 512
_OPTIONS_EXCLUDED_BY_DEMO = ("arch", "size", "dtype", "seed", "force", "out_dir")


@click.group(name="model")
def model_group() -> None:
    """Create the offline demo models kvcellar serves in tests and benchmarks."""


@model_group.command(name="create")
@click.option(
    "--arch",
    type=click.Choice(ARCHITECTURES),
    help="Architecture of the model (an mlx-lm model type).",
)
@click.option(
    "--size",
    type=click.Choice(SIZES),
    default="tiny",
    show_default=True,
    help="tiny ~0.1M, small ~5M, medium ~20M parameters.",
)
@click.option(
    "--dtype",
    type=click.Choice(DTYPES),
    default="float32",
    show_default=True,
    help="Data type of the stored weights.",
)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Seed of the random weights; the same seed gives the same bytes.",
)
@click.option("--force", is_flag=True, help="Replace OUT_DIR if it exists and is not empty.")
@click.option(
    "--demo",
    is_flag=True,
    help=f"Create the shared demo model ({DEMO_ARCH}, {DEMO_SIZE}, {DEMO_DTYPE}) in the "
    "kvcellar cache ($KVCELLAR_CACHE_DIR if set) unless it is there; takes no other option.",
)
@click.argument("out_dir", required=False, type=click.Path(file_okay=False, path_type=Path))
@click.pass_context
def create_command(
    context: click.Context,
    arch: str | None,
    size: str,
    dtype: str,
    seed: int,
    force: bool,
    demo: bool,
    out_dir: Path | None,
) -> None:
    """Write a random-weight model that mlx-lm loads offline into OUT_DIR.
    \f
    Raises `UsageError` when --demo is combined with another option or
    OUT_DIR, when neither --demo nor --arch with OUT_DIR is given, or when
    OUT_DIR is not empty and --force is absent.
    """
    if demo:
        given = [name for name in _OPTIONS_EXCLUDED_BY_DEMO if _was_given(context, name)]
        if given:
            listed = ", ".join(name.upper() if name == "out_dir" else f"--{name}" for name in given)
            raise UsageError(f"--demo takes no other option or OUT_DIR (got {listed})")
        model_dir = demo_model_dir()
        already_present = is_complete_model(model_dir)
        model_dir = ensure_demo_model(progress=lambda line: click.echo(line, err=True))
        verb = "found" if already_present else "created"
        _echo_summary(verb, model_dir, DEMO_ARCH, DEMO_SIZE, DEMO_DTYPE)
        return
    if arch is None or out_dir is None:
        raise UsageError("give --arch ARCH and OUT_DIR, or --demo")
    model_dir = create_model(arch, out_dir, size=size, dtype=dtype, seed=seed, overwrite=force)
    _echo_summary("created", model_dir, arch, size, dtype)


def _was_given(context: click.Context, parameter_name: str) -> bool:
    source = context.get_parameter_source(parameter_name)
    return source not in (None, click.core.ParameterSource.DEFAULT)


def _echo_summary(verb: str, model_dir: Path, arch: str, size: str, dtype: str) -> None:
    click.echo(f"{verb} {model_dir}")
    click.echo(f"  arch: {arch}  size: {size}  dtype: {dtype}")
    click.echo(f"  parameters: {count_parameters(model_dir):,}")
    click.echo(f"  bytes: {model_size_bytes(model_dir):,}")


@model_group.command(name="pull")
@click.argument("repo_id")
def pull_command(repo_id: str) -> None:
    """Download hub model REPO_ID (ORG/NAME) into the Hugging Face cache, with progress.
    \f
    Only the files mlx-lm loads are fetched; a repo already cached is left
    alone. Raises `UsageError` for a malformed id, when HF_HUB_OFFLINE is set
    and the repo is not cached, or when the hub cannot serve it.
    """
    from kvcellar.engine.hub import cached_model_dir, download_model, is_repo_id

    if not is_repo_id(repo_id):
        raise UsageError(f"{repo_id!r} is not a hub repo id (ORG/NAME)")
    cached = cached_model_dir(repo_id)
    model_dir = cached if cached is not None else download_model(repo_id)
    click.echo(f"{'found' if cached is not None else 'downloaded'} {repo_id} at {model_dir}")
    click.echo(f"  bytes: {model_size_bytes(model_dir):,}")


@model_group.command(name="list")
def list_command() -> None:
    """List the models kvcellar can serve offline: the built-in demo-coder and
    the model repos in the local Hugging Face cache, with their sizes."""
    from kvcellar.engine.demo_models import DEMO_CODER_DIR, DEMO_CODER_NAME
    from kvcellar.engine.hub import list_cached_models

    rows = []
    if is_complete_model(DEMO_CODER_DIR):
        rows.append((DEMO_CODER_NAME, model_size_bytes(DEMO_CODER_DIR), "built in (the default)"))
    for model in list_cached_models():
        revisions = f", {model.revisions} revisions" if model.revisions > 1 else ""
        rows.append((model.repo_id, model.size_bytes, f"hub cache, {model.files} files{revisions}"))
    width = max((len(name) for name, _, _ in rows), default=0)
    for name, size_bytes, where in rows:
        click.echo(f"{name:<{width}}  {_human_bytes(size_bytes):>9}  {where}")


@model_group.command(name="train")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the data order and initial weights.")
@click.option(
    "--tokenizer-ids",
    type=click.IntRange(min=0),
    default=2048,
    show_default=True,
    help="Ids of the BPE trained on the training text first (0: the random-weight models' shared tokenizer).",
)
@click.option("--steps", type=click.IntRange(min=1), default=250, show_default=True, help="Steps on chats and code.")
@click.option(
    "--chat-steps", type=click.IntRange(min=0), default=240, show_default=True, help="Then steps on chats alone."
)
@click.option(
    "--tool-steps",
    type=click.IntRange(min=0),
    default=350,
    show_default=True,
    help="Then steps on whole conversations, the loss on the assistant's tokens.",
)
@click.option(
    "--tool-restart-steps",
    type=click.IntRange(min=0),
    default=300,
    show_default=True,
    help="Then this many more, from a fresh optimizer and learning rate (a warm restart).",
)
@click.option(
    "--tool-varied-values",
    "tool_varied_value_share",
    type=click.FloatRange(0, 1),
    default=0.5,
    show_default=True,
    help="Share of phase three's tool chats whose arguments are made-up values (teaches copying them).",
)
@click.option(
    "--tool-choice-weight",
    "tool_choice_loss_weight",
    type=click.FloatRange(min=0, min_open=True),
    default=8.0,
    show_default=True,
    help="Weight in phase three's loss of a turn's first token and a called tool's name (others weigh 1).",
)
@click.option(
    "--tool-rounds",
    "tool_rounds_max",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Phase three's tool chats hold 1 to this many request/call/answer rounds.",
)
@click.option(
    "--row-quantum",
    "row_tokens_quantum",
    type=click.IntRange(min=1),
    default=128,
    show_default=True,
    help="Phase three pads each step's rows to a multiple of this many tokens.",
)
@click.option(
    "--tool-rows-by-length",
    "tool_rows_by_length",
    is_flag=True,
    default=False,
    help="Draw each phase-three step's tool chats from one padded-length class (with --row-quantum 64: "
    "phase three ~1.5x faster; the committed model was made without it).",
)
@click.option(
    "--validation-prompts",
    "tool_validation_prompts",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Keep the phase-three checkpoint whose greedy replies to this many validation tool prompts most "
    "often call an offered tool (0: keep the last weights).",
)
@click.option(
    "--from-model",
    "from_model",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Run only what is left of phase three, from a model made with the same options that stopped earlier.",
)
@click.option("--force", is_flag=True, help="Replace OUT_DIR if it exists and is not empty.")
def train_command(
    out_dir: Path,
    seed: int,
    tokenizer_ids: int,
    steps: int,
    chat_steps: int,
    tool_steps: int,
    tool_restart_steps: int,
    tool_varied_value_share: float,
    tool_choice_loss_weight: float,
    tool_rounds_max: int,
    row_tokens_quantum: int,
    tool_rows_by_length: bool,
    tool_validation_prompts: int,
    from_model: Path | None,
    force: bool,
) -> None:
    """Train the demo-coder model into OUT_DIR (MLX on the CPU; the defaults made the committed one).

    On Linux it runs on the system's OpenBLAS when one is installed (the
    mlx[cpu] wheel's own BLAS is ~10x slower): 43-56 minutes on 2 cores.
    \f
    `kvcellar.cli.main` re-executes the command with OpenBLAS preloaded (kvcellar.blas_preload).
    """
    from kvcellar.blas_preload import CORETYPE_ENV, blas_note, loaded_blas, openblas_core
    from kvcellar.demo.train import train, train_from_model
    from kvcellar.demo.training_config import TrainingConfig

    if 0 < tokenizer_ids < TOKENIZER_IDS_MIN:
        raise UsageError(f"--tokenizer-ids must be 0 or at least {TOKENIZER_IDS_MIN} (got {tokenizer_ids})")
    warmup_steps = TrainingConfig().warmup_steps
    if steps <= warmup_steps:
        raise UsageError(f"--steps must be more than phase one's {warmup_steps} warm-up steps (got {steps})")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not force:
        raise UsageError(f"{out_dir} exists and is not empty (overwrite it with --force)")
    config = TrainingConfig(
        seed=seed,
        tokenizer_ids=tokenizer_ids,
        steps=steps,
        chat_steps=chat_steps,
        tool_steps=tool_steps,
        tool_restart_steps=tool_restart_steps,
        tool_varied_value_share=tool_varied_value_share,
        tool_choice_loss_weight=tool_choice_loss_weight,
        tool_rounds_max=tool_rounds_max,
        row_tokens_quantum=row_tokens_quantum,
        tool_rows_by_length=tool_rows_by_length,
        tool_validation_prompts=tool_validation_prompts,
    )

    def report(line: str) -> None:
        click.echo(line, err=True)

    note = blas_note(loaded_blas(), openblas_core(), os.environ.get(CORETYPE_ENV))
    if note:
        report(note)
    if from_model is None:
        log = train(out_dir, config, progress=report)
    else:
        try:
            log = train_from_model(out_dir, from_model, config, progress=report)
        except ModelError as e:
            raise UsageError(str(e)) from e
    click.echo(f"trained {out_dir}: {log['parameters']:,} parameters, held-out loss {log['final_held_out_loss_bf16']}")


def _human_bytes(size_bytes: int) -> str:
    size = float(size_bytes)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"
