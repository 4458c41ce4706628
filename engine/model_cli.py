"""`kvcellar model ...`: create random-weight demo models for tests and benchmarks."""

from __future__ import annotations

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
from kvcellar.errors import UsageError

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
