"""`kvcellar keygen FILE`: a new 256-bit encryption key for `serve --encryption-key-file`."""

from __future__ import annotations

from pathlib import Path

import click

from kvcellar.store.keyring import write_new_key_file


@click.command("keygen")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
def keygen_command(path: Path) -> None:
    """Write a new random 256-bit key to PATH (mode 0600; never over an existing file) and print its key id.

    Give it to `kvcellar serve --encryption-key-file PATH`: the SSD tier's entries are then sealed with
    AES-256-GCM under it. Keep a copy: without the key, the entries it sealed cannot be read.
    """
    key = write_new_key_file(path)
    click.echo(f"wrote {path} (key id {key.key_id})")
