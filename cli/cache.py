"""`kvcellar cache rekey`: re-seal an SSD cache directory under a new key (`store/rekey.py`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from kvcellar.errors import UsageError
from kvcellar.store.keyring import load_key_ring
from kvcellar.store.rekey import fingerprint_dirs, rekey_directory


@click.group("cache")
def cache_group() -> None:
    """Offline maintenance of an SSD cache directory (no server may hold it)."""


@cache_group.command("rekey")
@click.option(
    "--ssd-cache",
    "ssd_dir",
    required=True,
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="The SSD cache directory, as given to `serve --ssd-cache`.",
)
@click.option(
    "--encryption-key-file",
    "key_files",
    multiple=True,
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The new key first, then every key that sealed entries in the directory (repeatable).",
)
@click.option("--json", "as_json", is_flag=True, help="End with one JSON object: what each directory's rekey did.")
def rekey_command(ssd_dir: Path, key_files: tuple[Path, ...], as_json: bool) -> None:
    """Re-seal every entry (and journal row) of the SSD cache under the first key.

    Prints one line per entry as its new file is committed. Crash-safe: a kill
    leaves every entry readable with the same keys, and a rerun finishes the
    job. Refuses a directory a running server holds. Exits 1 when an entry
    could not be rekeyed (it is left as it was, named in the output).
    """
    keyring = load_key_ring(key_files)
    directories = fingerprint_dirs(ssd_dir)
    if not directories:
        raise UsageError(f"{ssd_dir}: no fingerprint directories (not an SSD cache directory?)")

    def progress(line: str) -> None:
        click.echo(line)
        sys.stdout.flush()  # each line as its entry commits, also into a pipe: the operator's (or a test's) clock

    reports = [rekey_directory(ssd_dir, fingerprint, keyring, progress) for fingerprint in directories]
    for report in reports:
        click.echo(
            f"{report.fingerprint}: {report.rekeyed} rekeyed, {report.already} already under key "
            f"{keyring.sealing.key_id}, {report.rows_resealed} journal rows resealed, {len(report.failed)} failed"
        )
    if as_json:
        click.echo(json.dumps({"key_id": keyring.sealing.key_id, "directories": [r.as_json() for r in reports]}))
    if any(report.failed for report in reports):
        click.get_current_context().exit(1)
