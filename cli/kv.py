"""`kvcellar kv`: look inside a `.kvc` file and check it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from kvcellar.errors import StoreError
from kvcellar.serialization import converter
from kvcellar.store import kvfile
from kvcellar.store.keyring import KeyRing, load_key_ring


@click.group("kv")
def kv_group() -> None:
    """Inspect and verify .kvc KV-cache entry files."""


def header_as_json(header: kvfile.Header) -> dict[str, Any]:
    """The header as plain JSON data (checksums in hex)."""
    data = converter.unstructure(header)

    def hexify(records: list[dict[str, Any]]) -> None:
        for record in records:
            for tensor in record["tensors"]:
                tensor["checksum"] = tensor["checksum"].hex()
            hexify(record["children"])

    hexify(data["caches"])
    if "seal" in data:
        data["seal"]["nonce"] = data["seal"]["nonce"].hex()
    del data["token_ids"]
    data["tokens"] = list(header.tokens)
    data["payload_bytes"] = header.payload_bytes
    return data


def _cache_rows(records: tuple[kvfile.CacheRecord, ...], prefix: str = "") -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for index, record in enumerate(records):
        label = f"{prefix}{index}"
        fields = " ".join(f"{key}={value}" for key, value in sorted(record.fields.items()))
        tensors = ", ".join(f"{t.name.rsplit('.', 1)[-1]} {t.dtype}{list(t.shape)}" for t in record.tensors)
        rows.append(
            (
                label,
                record.signature,
                str(record.offset),
                "yes" if record.trimmable else "no",
                str(record.minimum_reusable_offset),
                fields,
                tensors,
            )
        )
        rows.extend(_cache_rows(record.children, prefix=f"{label}."))
    return rows


def _print_header(header: kvfile.Header, path: Path) -> None:
    console = Console()
    summary = Table.grid(padding=(0, 2))
    summary.add_row("file", str(path))
    summary.add_row("format version", str(header.format_version))
    summary.add_row("namespace", repr(header.namespace))
    summary.add_row("tokens", str(len(header.tokens)))
    summary.add_row("trimmable", "yes" if header.trimmable else "no")
    summary.add_row("minimum reusable offset", str(header.minimum_reusable_offset))
    summary.add_row("tokenizer hash", header.tokenizer_hash or "-")
    summary.add_row("created at (ns)", str(header.created_at_ns))
    summary.add_row("payload", f"{header.payload_bytes} bytes from offset {header.payload_offset}")
    summary.add_row("file size", f"{header.file_bytes} bytes")
    for key, value in sorted(header.fingerprint.items()):
        summary.add_row(f"fingerprint.{key}", value)
    console.print(summary)
    table = Table(title="caches")
    for column in ("#", "signature", "offset", "trimmable", "min reuse", "fields", "tensors"):
        table.add_column(column)
    for row in _cache_rows(header.caches):
        table.add_row(*row)
    console.print(table)


_KEY_FILE_OPTION = click.option(
    "--encryption-key-file",
    "key_files",
    multiple=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="A key that opens a sealed entry (`kvcellar keygen`; repeatable, as for `serve`).",
)


def _keyring(key_files: tuple[Path, ...]) -> KeyRing | None:
    return load_key_ring(key_files) if key_files else None


@kv_group.command("inspect")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the header as one JSON object.")
@_KEY_FILE_OPTION
def inspect_command(file: Path, as_json: bool, key_files: tuple[Path, ...]) -> None:
    """Show the header of FILE: tokens, namespace, fingerprint and every cache.

    Only the header is read and checked (its checksum and the file's length);
    use `kvcellar kv verify` to check every tensor.
    """
    header = kvfile.read_header(file, keyring=_keyring(key_files))
    if as_json:
        click.echo(json.dumps(header_as_json(header)))
    else:
        _print_header(header, file)


@kv_group.command("verify")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_KEY_FILE_OPTION
def verify_command(file: Path, key_files: tuple[Path, ...]) -> None:
    """Check every byte of FILE: header checksum, length and each tensor checksum (and tag, if sealed).

    Exits 0 when the entry is intact, 1 with the reason when it is not.
    """
    keyring = _keyring(key_files)
    try:
        header = kvfile.verify_file(file, keyring=keyring)
    except StoreError as e:
        click.echo(f"FAILED: {e}", err=True)
        click.get_current_context().exit(1)
    tensor_count = sum(1 for _ in header.tensor_records())
    click.echo(
        f"ok: {file} ({len(header.tokens)} tokens, {tensor_count} tensors, {header.payload_bytes} payload bytes)"
    )
