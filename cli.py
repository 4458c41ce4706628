"""The `kvcellar` command line: serve, model, kv (and later simulate, journal).

Subcommand groups live beside the code they drive; this module only assembles
them and turns a `KvCellarError` into a clear message and exit status 2
instead of a traceback.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import click

from kvcellar import __version__
from kvcellar.errors import KvCellarError, UsageError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvcellar")
def cli() -> None:
    """kvcellar: an MLX inference server whose KV caches stay warm across RAM and SSD."""


@cli.command("serve")
@click.option("--model", "model_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Model directory (mlx-lm layout). Default: the built-in demo model, created on first use.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind; loopback by default.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="TCP port.")
def serve_command(model_dir: Path | None, host: str, port: int) -> None:
    """Serve the OpenAI-compatible HTTP API (chat and text completions)."""
    import trio

    from kvcellar.engine.demo_models import ensure_demo_model
    from kvcellar.http.server import serve_forever

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if model_dir is None:
        model_dir = ensure_demo_model(progress=lambda message: click.echo(message, err=True))
    elif not (model_dir / "config.json").is_file():
        raise UsageError(f"{model_dir} is not a model directory (no config.json)")
    click.echo(f"kvcellar {__version__}: loading {model_dir}", err=True)
    trio.run(serve_forever, model_dir, host, port)
    # Everything is flushed and the engine thread joined by now. MLX's C++
    # runtime can abort in its static destructors at interpreter exit
    # ("terminate called without an active exception", SIGABRT, seen in about
    # one clean shutdown in three), so end the process without running them.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _register_commands() -> None:
    from kvcellar.engine.model_cli import model_group
    from kvcellar.store.kv_cli import kv_group

    cli.add_command(model_group)
    cli.add_command(kv_group)


_register_commands()


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 a check failed, 2 an error)."""
    try:
        result = cli.main(args=argv, prog_name="kvcellar", standalone_mode=False)
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except KvCellarError as e:
        click.echo(f"error: {e}", err=True)
        return 2
    # In non-standalone mode click returns `ctx.exit(code)` codes as the result.
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
