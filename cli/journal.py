"""`kvcellar journal`: read the SSD tier's journal (events and projections).

Every command opens the journal read-only (`Journal.open_readonly`), so it is
safe beside a running server (WAL) and never changes a file. DIR is the SSD
cache directory: either the root holding one directory per fingerprint, or
one fingerprint directory itself.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvcellar.cli.kv import header_as_json
from kvcellar.errors import CorruptEntry, DiskError, JournalError, UnsupportedFormat, UsageError
from kvcellar.serialization import converter
from kvcellar.store import events as ev
from kvcellar.store import kvfile
from kvcellar.store.journal import JOURNAL_FILE_NAME, Journal, JournalEvent
from kvcellar.store.journal_checks import journal_stats, verify_journal
from kvcellar.store.keyring import load_key_ring

SORT_KEYS = {"bytes": "bytes", "mtime": "mtime_ns", "tokens": "token_count"}


@click.group("journal")
def journal_group() -> None:
    """Read the SSD tier's journal: events, entries, statistics and checks.

    Read-only and safe while the server is running.
    """


# -- opening -----------------------------------------------------------------


def fingerprint_dir(directory: Path, fingerprint: str | None) -> Path:
    """The fingerprint directory of DIR that holds the journal to read.

    Raises `UsageError` when DIR is not a cache directory, when the requested
    fingerprint is absent, or when several fingerprints exist and none was chosen.
    """
    if not directory.is_dir():
        raise UsageError(f"{directory}: no such directory")
    if (directory / JOURNAL_FILE_NAME).is_file() and fingerprint is None:
        return directory
    candidates = sorted(child.name for child in directory.iterdir() if (child / JOURNAL_FILE_NAME).is_file())
    if fingerprint is not None:
        if fingerprint not in candidates:
            known = ", ".join(candidates) or "none"
            raise UsageError(f"{directory}: no journal for fingerprint {fingerprint!r} (fingerprints here: {known})")
        return directory / fingerprint
    if not candidates:
        raise UsageError(f"{directory}: not a kvcellar cache directory (no {JOURNAL_FILE_NAME} in it or below it)")
    if len(candidates) > 1:
        raise UsageError(
            f"{directory} holds several fingerprints, choose one with --fingerprint: " + ", ".join(candidates)
        )
    return directory / candidates[0]


@contextlib.contextmanager
def opened_journal(directory: Path, fingerprint: str | None) -> Iterator[tuple[Path, Journal]]:
    """The fingerprint directory and its journal, opened read-only; a database
    that turns out damaged while being read is reported as a `JournalError`."""
    root = fingerprint_dir(directory, fingerprint)
    journal = Journal.open_readonly(root / JOURNAL_FILE_NAME)
    try:
        yield root, journal
    except sqlite3.DatabaseError as e:
        raise JournalError(f"{journal.path}: damaged database: {e}") from e
    finally:
        journal.close()


def journal_command(name: str, *, with_json: bool = True) -> Callable[[Callable[..., None]], click.Command]:
    """Register a subcommand taking DIR, `--fingerprint` and (usually) `--json`."""

    def decorate(function: Callable[..., None]) -> click.Command:
        command: Any = function
        if with_json:
            command = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")(command)
        command = click.option(
            "--fingerprint",
            default=None,
            metavar="DIGEST",
            help="The fingerprint directory to read when DIR holds several.",
        )(command)
        command = click.argument("directory", metavar="DIR", type=click.Path(file_okay=False, path_type=Path))(command)
        return journal_group.command(name)(command)

    return decorate


# -- presenting --------------------------------------------------------------


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        # Token ids are long and unreadable; `token_count` beside them says enough.
        return {key: _plain(item) for key, item in value.items() if key != "token_ids"}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def event_as_json(record: JournalEvent) -> dict[str, Any]:
    """One journal event as plain JSON data (bytes in hex, token ids omitted)."""
    return {
        "seq": record.seq,
        "time_ns": record.time_ns,
        "actor": record.actor,
        "kind": record.kind,
        "entry_id": record.entry_id,
        "event": _plain(converter.unstructure(record.event)),
    }


def row_as_json(row: dict[str, Any]) -> dict[str, Any]:
    """One `entries` projection row as plain JSON data."""
    data = _plain(row)
    data["trimmable"] = bool(row["trimmable"])
    return data


def format_time(time_ns: int) -> str:
    return datetime.datetime.fromtimestamp(time_ns / 1e9).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def event_details(record: JournalEvent) -> str:
    """The payload of an event as short `key=value` pairs."""
    payload = _plain(converter.unstructure(record.event))
    entry = payload.pop("entry", None)
    payload.pop("entry_id", None)
    if entry is not None:
        payload = {
            "ns": entry["namespace"],
            "tokens": entry["token_count"],
            "bytes": entry["bytes"],
            "trimmable": entry["trimmable"],
            **payload,
        }
    return " ".join(
        f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}" for key, value in payload.items()
    )


def event_line(record: JournalEvent) -> str:
    return (
        f"{record.seq:>6}  {format_time(record.time_ns)}  {record.kind:<18} {record.entry_id or '-':<32}  "
        f"{event_details(record)}"
    )


def print_events(records: list[JournalEvent], title: str | None = None) -> None:
    table = Table(title=title)
    for column in ("seq", "time", "actor", "kind", "entry", "details"):
        table.add_column(column, overflow="fold")
    for record in records:
        table.add_row(
            str(record.seq),
            format_time(record.time_ns),
            record.actor,
            record.kind,
            record.entry_id or "-",
            escape(event_details(record)),
        )
    Console().print(table)


def print_entries(rows: list[dict[str, Any]], title: str) -> None:
    table = Table(title=title)
    for column in ("entry", "namespace", "tokens", "bytes", "mtime", "trimmable", "min reuse", "hits", "restores"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(
            row["entry_id"],
            escape(repr(row["namespace"])),
            str(row["token_count"]),
            str(row["bytes"]),
            format_time(row["mtime_ns"]),
            "yes" if row["trimmable"] else "no",
            str(row["minimum_reusable_offset"]),
            str(row["hits"]),
            str(row["restores"]),
        )
    Console().print(table)


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data))


# -- namespaces --------------------------------------------------------------


class NamespaceTracker:
    """Which namespace each event belongs to; removals and hits name only the
    entry, so the namespace comes from the entry's earlier stored event."""

    def __init__(self) -> None:
        self._by_entry: dict[str, str] = {}

    def namespace(self, record: JournalEvent) -> str | None:
        entry = getattr(record.event, "entry", None)
        if entry is not None:
            self._by_entry[entry.entry_id] = entry.namespace
            return entry.namespace
        if isinstance(record.event, ev.EntryWriteFailed):
            return record.event.namespace
        return self._by_entry.get(record.entry_id)


# -- tail --------------------------------------------------------------------


@journal_command("tail")
@click.option(
    "-n",
    "--lines",
    "count",
    type=click.IntRange(min=0),
    default=20,
    show_default=True,
    help="How many of the most recent matching events to show first.",
)
@click.option("--kind", default=None, type=click.Choice(sorted(ev.EVENT_TYPES)), help="Only events of this kind.")
@click.option("--ns", "namespace", default=None, help="Only events about entries of this namespace.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing events as the server appends them.")
@click.option(
    "--interval-seconds",
    "interval_s",
    type=click.FloatRange(min=0.01),
    default=0.5,
    show_default=True,
    help="How often --follow polls the journal.",
)
@click.option(
    "--max-seconds",
    "follow_max_s",
    type=click.FloatRange(min=0),
    default=None,
    help="Stop following after this many seconds (default: until interrupted).",
)
@click.option(
    "--max-events",
    "events_max",
    type=click.IntRange(min=1),
    default=None,
    help="Stop following after this many new events (default: until interrupted).",
)
def tail_command(
    directory: Path,
    fingerprint: str | None,
    as_json: bool,
    count: int,
    kind: str | None,
    namespace: str | None,
    follow: bool,
    interval_s: float,
    follow_max_s: float | None,
    events_max: int | None,
) -> None:
    """Show the most recent events; with -f, follow new events as they are appended.

    JSON output is one event per line, so it can be piped while following.
    """
    with opened_journal(directory, fingerprint) as (_, journal):
        tracker = NamespaceTracker()
        recent: collections.deque[JournalEvent] = collections.deque(maxlen=count)
        last_seq = 0
        for record in journal.events(kind=kind):
            last_seq = record.seq
            if namespace is None or tracker.namespace(record) == namespace:
                recent.append(record)
        if as_json:
            for record in recent:
                echo_json(event_as_json(record))
        elif recent or not follow:
            print_events(list(recent))
        if follow:
            _follow(
                journal,
                tracker,
                last_seq,
                kind=kind,
                namespace=namespace,
                as_json=as_json,
                interval_s=interval_s,
                follow_max_s=follow_max_s,
                events_max=events_max,
            )


def _follow(
    journal: Journal,
    tracker: NamespaceTracker,
    last_seq: int,
    *,
    kind: str | None,
    namespace: str | None,
    as_json: bool,
    interval_s: float,
    follow_max_s: float | None,
    events_max: int | None,
) -> None:
    deadline = None if follow_max_s is None else time.monotonic() + follow_max_s
    shown = 0
    try:
        while True:
            for record in journal.events(after_seq=last_seq, kind=kind):
                last_seq = record.seq
                if namespace is not None and tracker.namespace(record) != namespace:
                    continue
                click.echo(json.dumps(event_as_json(record)) if as_json else event_line(record))
                shown += 1
                if events_max is not None and shown >= events_max:
                    return
            if deadline is not None and time.monotonic() >= deadline:
                return
            time.sleep(interval_s)
    except KeyboardInterrupt:
        # Interrupting is how an operator ends following: not an error.
        return


# -- show / timeline ---------------------------------------------------------


def _resolve_entry(journal: Journal, reference: str) -> str:
    """The full entry id for a full id or a unique prefix of one."""
    known = {record.entry_id for record in journal.events() if record.entry_id}
    if reference in known:
        return reference
    matches = sorted(entry_id for entry_id in known if entry_id.startswith(reference))
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise UsageError(f"no event or entry {reference!r} in the journal")
    raise UsageError(f"{reference!r} names several entries: {', '.join(matches)}")


def _file_header(root: Path, row: dict[str, Any] | None) -> tuple[kvfile.Header | None, str]:
    if row is None:
        return None, "no file (the entry is not in the index)"
    try:
        return kvfile.read_header(root / row["path"]), ""
    except (CorruptEntry, UnsupportedFormat, DiskError) as e:
        return None, f"unreadable: {e}"


@journal_command("show")
@click.argument("reference", metavar="SEQ|ENTRY")
def show_command(directory: Path, fingerprint: str | None, as_json: bool, reference: str) -> None:
    """Show one event by its sequence number, or one entry (id or unique id prefix)
    with its index row, its file's header and every event about it."""
    with opened_journal(directory, fingerprint) as (root, journal):
        # Digits name an event when there is one; else they may begin an entry id
        # (ids are hex, so a prefix of digits alone is no rarity).
        records = []
        if reference.isdigit():
            seq = int(reference)
            records = list(journal.events(after_seq=seq - 1, until_seq=seq))
        if records:
            if as_json:
                echo_json(event_as_json(records[0]))
            else:
                print_events(records)
            return
        entry_id = _resolve_entry(journal, reference)
        row = next((row for row in journal.entries() if row["entry_id"] == entry_id), None)
        header, problem = _file_header(root, row)
        records = list(journal.events(entry_id=entry_id))
        if as_json:
            header_data = None
            if header is not None:
                header_data = header_as_json(header)
                header_data["token_count"] = len(header_data.pop("tokens"))
            echo_json(
                {
                    "entry_id": entry_id,
                    "entry": None if row is None else row_as_json(row),
                    "header": header_data,
                    "header_problem": problem or None,
                    "events": [event_as_json(record) for record in records],
                }
            )
            return
        if row is not None:
            print_entries([row], title=f"entry {entry_id}")
        else:
            click.echo(f"entry {entry_id} is no longer in the index")
        if row is not None and header is not None:  # a header implies a row (`_file_header`)
            click.echo(
                f"file {row['path']}: format {header.format_version}, namespace {header.namespace!r}, "
                f"{len(header.tokens)} tokens, {header.file_bytes} bytes, "
                f"{sum(1 for _ in header.tensor_records())} tensors"
            )
        elif row is not None:
            click.echo(f"file {row['path']}: {problem}")
        print_events(records, title="events")


def _timeline(journal: Journal, entry_id: str) -> list[JournalEvent]:
    """The events about an entry plus the supersessions it caused, in order."""
    return [
        record
        for record in journal.events()
        if record.entry_id == entry_id or getattr(record.event, "by_entry_id", None) == entry_id
    ]


@journal_command("timeline")
@click.argument("entry", metavar="ENTRY")
def timeline_command(directory: Path, fingerprint: str | None, as_json: bool, entry: str) -> None:
    """The lifecycle of ENTRY (id or unique id prefix): stored, hit, restored,
    superseded, evicted, quarantined, reconciled, and the entries it superseded."""
    with opened_journal(directory, fingerprint) as (_, journal):
        entry_id = _resolve_entry(journal, entry)
        records = _timeline(journal, entry_id)
        live = any(row["entry_id"] == entry_id for row in journal.entries())
        if as_json:
            echo_json({"entry_id": entry_id, "live": live, "events": [event_as_json(r) for r in records]})
            return
        table = Table(title=f"entry {entry_id} ({'live' if live else 'gone'})")
        for column in ("seq", "time", "step", "details"):
            table.add_column(column, overflow="fold")
        for record in records:
            step = record.kind if record.entry_id == entry_id else f"superseded {record.entry_id}"
            table.add_row(str(record.seq), format_time(record.time_ns), step, escape(event_details(record)))
        Console().print(table)


# -- entries / replay --------------------------------------------------------


def _sorted_rows(rows: list[dict[str, Any]], namespace: str | None, sort: str) -> list[dict[str, Any]]:
    selected = [row for row in rows if namespace is None or row["namespace"] == namespace]
    return sorted(selected, key=lambda row: (row[SORT_KEYS[sort]], row["entry_id"]), reverse=True)


_NS_OPTION = click.option("--ns", "namespace", default=None, help="Only entries of this namespace.")
_SORT_OPTION = click.option(
    "--sort",
    type=click.Choice(sorted(SORT_KEYS)),
    default="mtime",
    show_default=True,
    help="Order by this column, largest or newest first.",
)


@journal_command("entries")
@_NS_OPTION
@_SORT_OPTION
def entries_command(directory: Path, fingerprint: str | None, as_json: bool, namespace: str | None, sort: str) -> None:
    """The index as the journal sees it (its stored `entries` projection)."""
    with opened_journal(directory, fingerprint) as (_, journal):
        rows = _sorted_rows(journal.entries(), namespace, sort)
    if as_json:
        echo_json([row_as_json(row) for row in rows])
    else:
        print_entries(rows, title=f"{len(rows)} entries, {sum(row['bytes'] for row in rows)} bytes")


@journal_command("replay")
@click.option(
    "--until",
    "until_seq",
    type=click.IntRange(min=0),
    default=None,
    help="Replay events up to and including this sequence number (default: all).",
)
@_NS_OPTION
@_SORT_OPTION
def replay_command(
    directory: Path, fingerprint: str | None, as_json: bool, until_seq: int | None, namespace: str | None, sort: str
) -> None:
    """The index as it was right after event --until, rebuilt from the events alone."""
    with opened_journal(directory, fingerprint) as (_, journal):
        rows = _sorted_rows(journal.replay(until_seq=until_seq), namespace, sort)
    if as_json:
        echo_json([row_as_json(row) for row in rows])
    else:
        at = "the last event" if until_seq is None else f"event {until_seq}"
        print_entries(rows, title=f"{len(rows)} entries after {at}")


# -- export ------------------------------------------------------------------


@journal_command("export", with_json=False)
@click.option(
    "--format",
    "output_format",
    type=click.Choice(["jsonl"]),
    default="jsonl",
    show_default=True,
    help="Output format: one JSON object per event and line.",
)
def export_command(directory: Path, fingerprint: str | None, output_format: str) -> None:
    """Every event in sequence order, as JSON lines (bytes in hex, token ids omitted)."""
    with opened_journal(directory, fingerprint) as (_, journal):
        for record in journal.events():
            click.echo(json.dumps(event_as_json(record)))


# -- stats -------------------------------------------------------------------


@journal_command("stats")
def stats_command(directory: Path, fingerprint: str | None, as_json: bool) -> None:
    """Counts by kind, bytes written and restored, hit rate, write amplification
    and quarantine count.

    Misses are not journaled: the hit rate is the share of stored entries that
    were restored at least once, and write amplification is bytes written per
    byte restored (the whole file is read on a restore). Write wear, since the
    journal began and per UTC day: bytes written, bytes written per token
    served from SSD, dead writes (evicted, never restored) and supersessions
    that rewrote a prefix.
    """
    with opened_journal(directory, fingerprint) as (root, journal):
        stats = journal_stats(root, journal)
    if as_json:
        echo_json(stats)
        return
    summary = Table(title=f"fingerprint {root.name}", show_header=False)
    summary.add_column("what")
    summary.add_column("value", justify="right")
    for key, value in stats.items():
        if key not in ("counts_by_kind", "write_wear"):
            shown = "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)
            summary.add_row(key.replace("_", " "), shown)
    kinds = Table(title="events by kind")
    kinds.add_column("kind")
    kinds.add_column("count", justify="right")
    for kind, count in stats["counts_by_kind"].items():
        kinds.add_row(kind, str(count))
    console = Console()
    console.print(summary)
    console.print(kinds)
    console.print(write_wear_table(stats["write_wear"]))


def write_wear_table(wear: dict[str, Any]) -> Table:
    """The write-wear figures: one row for the whole journal, one per UTC day."""
    table = Table(title="SSD write wear")
    columns = ("bytes_written", "bytes_written_per_ssd_token", "dead_writes", "dead_write_bytes", "rewrites")
    table.add_column("period")
    for column in columns:
        table.add_column(column.replace("_", " "), justify="right")
    periods = [("total", wear["total"]), *wear["per_day"].items()]
    for period, figures in periods:
        values = [figures[column] for column in columns]
        table.add_row(period, *("-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v) for v in values))
    return table


# -- verify ------------------------------------------------------------------


@journal_command("verify")
@click.option(
    "--encryption-key-file",
    "key_files",
    multiple=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="A key that opens the tier's sealed entries (as given to `serve`; repeatable).",
)
def verify_command(directory: Path, fingerprint: str | None, as_json: bool, key_files: tuple[Path, ...]) -> None:
    """Check the stored index against a replay of the events and against a
    fresh header scan of the files.

    Exits 0 when all three agree, 1 with a table of every difference when not
    ("left" is the first source the check names). Files written or removed by
    a running server between the reads may show up as transient differences.
    """
    with opened_journal(directory, fingerprint) as (root, journal):
        entry_count, mismatches = verify_journal(root, journal, keyring=load_key_ring(key_files) if key_files else None)
    if as_json:
        echo_json({"ok": not mismatches, "entries": entry_count, "mismatches": mismatches})
    elif mismatches:
        table = Table(title=f"{len(mismatches)} mismatches")
        for column in ("check", "entry", "field", "left", "right"):
            table.add_column(column, overflow="fold")
        for item in mismatches:
            table.add_row(
                item["check"], item["entry_id"], item["field"], escape(str(item["left"])), escape(str(item["right"]))
            )
        Console().print(table)
    else:
        click.echo(f"ok: {entry_count} entries agree across the projection, a replay and the files")
    if mismatches:
        click.get_current_context().exit(1)
