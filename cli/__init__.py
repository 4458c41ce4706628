"""The `kvcellar` command line: serve, model, kv, journal, cache, simulate, calibrate, cluster and keygen.

Each command group is one module of this room, a thin click layer over the
library (`serve.py`, `model.py`, `kv.py`, `journal.py`, `cache.py`, `simulate.py`,
`calibrate.py`, `cluster.py`, `keygen.py`); this module only assembles them and turns a `KvCellarError`
into a clear message and exit status 2 instead of a traceback. `python -m kvcellar.cli` runs it
(`__main__.py`).
"""

from __future__ import annotations

import os
import sys

import click

from kvcellar import __version__
from kvcellar.errors import KvCellarError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvcellar")
def cli() -> None:
    """kvcellar: an MLX inference server whose KV caches stay warm across RAM and SSD."""


def _register_commands() -> None:
    from kvcellar.cli.cache import cache_group
    from kvcellar.cli.calibrate import calibrate_command
    from kvcellar.cli.cluster import cluster_command
    from kvcellar.cli.journal import journal_group
    from kvcellar.cli.keygen import keygen_command
    from kvcellar.cli.kv import kv_group
    from kvcellar.cli.model import model_group
    from kvcellar.cli.serve import serve_command
    from kvcellar.cli.simulate import simulate_command

    cli.add_command(serve_command)
    cli.add_command(model_group)
    cli.add_command(kv_group)
    cli.add_command(journal_group)
    cli.add_command(cache_group)
    cli.add_command(simulate_command)
    cli.add_command(calibrate_command)
    cli.add_command(cluster_command)
    cli.add_command(keygen_command)


_register_commands()


def reexec_serve() -> None:
    """Replace this process by itself once, with glibc's huge-page tunable (kvcellar.huge_pages)
    and OpenBLAS preloaded (kvcellar.blas_preload), when either applies; else return."""
    from kvcellar.blas_preload import serve_preload_environment
    from kvcellar.huge_pages import host_reexec_environment

    huge_pages = host_reexec_environment(os.environ)
    environment = serve_preload_environment(huge_pages or os.environ) or huge_pages
    if environment is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, environment)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 a check failed, 2 an error).
    `serve` from a real command line (not `argv` from a caller) first
    re-executes itself with huge pages for its allocations (kvcellar.huge_pages) and OpenBLAS
    preloaded, and `model train` with OpenBLAS preloaded (kvcellar.blas_preload)."""
    if argv is None and sys.argv[1:2] == ["serve"]:
        reexec_serve()
    if argv is None and sys.argv[1:3] == ["model", "train"]:
        from kvcellar.blas_preload import reexec_with_openblas

        reexec_with_openblas()
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
