"""The SQLite journal: schema, migrations, projections, replay, degradation."""

from __future__ import annotations

import sqlite3

import pytest

from kvcellar.errors import JournalError
from kvcellar.store import events as ev
from kvcellar.store.journal import SCHEMA_VERSION, Journal


def _fields(entry_id: str, tokens: int = 10) -> ev.EntryFields:
    return ev.EntryFields(
        entry_id=entry_id,
        namespace="",
        path=f"ns/{entry_id}.kvc",
        token_count=tokens,
        tokens_digest="ab" * 16,
        token_ids=bytes(4 * tokens),
        bytes=100 * tokens,
        mtime_ns=tokens,
        trimmable=True,
        minimum_reusable_offset=0,
    )


def test_append_updates_projection_in_the_same_transaction_and_replay_matches(tmp_path):
    clock = iter(range(1000, 2000)).__next__
    journal = Journal.open(tmp_path / "j.sqlite", clock_ns=clock)
    journal.append(ev.EntryStored(entry=_fields("a")))
    journal.append(ev.EntryStored(entry=_fields("b", 20)))
    journal.append(ev.EntryHit(entry_id="a", mtime_ns=99, usable_tokens=9))
    journal.append(ev.EntryRestored(entry_id="a", usable_tokens=9, restore_ms=1.5))
    journal.append(ev.EntrySuperseded(entry_id="b", by_entry_id="a", reason="duplicate"))
    assert [record.seq for record in journal.events()] == [1, 2, 3, 4, 5]
    rows = journal.entries()
    assert [(r["entry_id"], r["hits"], r["restores"], r["mtime_ns"]) for r in rows] == [("a", 1, 1, 99)]
    assert journal.replay() == rows
    assert [r["entry_id"] for r in journal.replay(until_seq=2)] == ["a", "b"]
    records = list(journal.events(kind="entry.hit"))
    assert len(records) == 1 and records[0].event == ev.EntryHit(entry_id="a", mtime_ns=99, usable_tokens=9)
    assert records[0].time_ns == 1002 and records[0].actor == "ssd" and records[0].entry_id == "a"
    journal.close()


def test_entries_narrowed_to_some_columns_are_the_full_rows_cut_down(tmp_path):
    journal = Journal.open(tmp_path / "j.sqlite")
    journal.append(ev.EntryStored(entry=_fields("b", 20)))
    journal.append(ev.EntryStored(entry=_fields("a")))
    journal.append(ev.EntryRestored(entry_id="a", usable_tokens=9, restore_ms=1.5))
    columns = ("entry_id", "bytes", "restores")
    narrow = journal.entries(columns)
    assert narrow == [{column: row[column] for column in columns} for row in journal.entries()]
    assert narrow == [{"entry_id": "a", "bytes": 1000, "restores": 1}, {"entry_id": "b", "bytes": 2000, "restores": 0}]
    with pytest.raises(ValueError, match="token_ids; DROP"):
        journal.entries(("entry_id", "token_ids; DROP TABLE entries"))
    journal.close()


def test_reopening_keeps_events_and_a_readonly_view_sees_them(tmp_path):
    path = tmp_path / "j.sqlite"
    journal = Journal.open(path)
    journal.append(ev.EntryStored(entry=_fields("a")))
    journal.wait_applied()
    reader = Journal.open_readonly(path)
    assert [r["entry_id"] for r in reader.entries()] == ["a"]
    journal.append(ev.EntryEvicted(entry_id="a", bytes=1000))
    journal.wait_applied()
    assert reader.entries() == []
    reader.close()
    journal.close()
    reopened = Journal.open(path)
    assert [r.kind for r in reopened.events()] == ["entry.stored", "entry.evicted"]
    reopened.close()


def test_a_newer_schema_is_refused_for_reading_and_degrades_for_writing(tmp_path):
    path = tmp_path / "j.sqlite"
    Journal.open(path).close()
    with sqlite3.connect(path) as connection:
        connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(JournalError, match="newer"):
        Journal.open_readonly(path)
    journal = Journal.open(path)
    assert journal.degraded and journal.state()["state"] == "degraded" and "newer" in journal.state()["reason"]
    journal.append(ev.TempReaped(path="x"))
    assert list(journal.events()) == []


@pytest.mark.parametrize("content", [b"", b"this is not sqlite at all" * 100])
def test_a_foreign_or_damaged_file_is_a_clear_error_for_readers(tmp_path, content):
    path = tmp_path / "j.sqlite"
    path.write_bytes(content)
    with pytest.raises(JournalError):
        Journal.open_readonly(path)


def test_a_foreign_sqlite_database_is_never_migrated(tmp_path):
    path = tmp_path / "j.sqlite"
    with sqlite3.connect(path) as connection:
        connection.execute("CREATE TABLE mine (x)")
    journal = Journal.open(path)
    assert journal.degraded
    with sqlite3.connect(path) as connection:
        tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert tables == {"mine"}


def test_write_failure_degrades_once_and_stops_journaling(tmp_path, caplog):
    journal = Journal.open(tmp_path / "j.sqlite")
    journal.append(ev.EntryStored(entry=_fields("a")))
    journal._db.conn.close()
    journal.append(ev.EntryStored(entry=_fields("b")))
    assert journal.degraded
    journal.append(ev.EntryStored(entry=_fields("c")))
    lines = [record for record in caplog.records if "cannot be written" in record.message]
    assert len(lines) == 1 and lines[0].levelname == "ERROR"
    assert journal.state() == {"state": "degraded", "reason": journal.degraded_reason}


def test_events_carry_canonical_payloads_so_identical_histories_are_identical_bytes(tmp_path):
    def history(path):
        clock = iter(range(10)).__next__
        journal = Journal.open(path, clock_ns=clock)
        journal.append(ev.EntryStored(entry=_fields("a")))
        journal.append(ev.EntryQuarantined(entry_id="a", path="p", quarantine_path="q", reason="bad"))
        rows = [(r.seq, r.time_ns, r.kind) for r in journal.events()]
        payloads = journal._db.execute("SELECT payload FROM events ORDER BY seq").fetchall()
        journal.close()
        return rows, payloads

    assert history(tmp_path / "one.sqlite") == history(tmp_path / "two.sqlite")


def test_an_unregistered_event_kind_reads_back_as_opaque_data_and_changes_no_projection(tmp_path):
    import attrs as attrs_module

    from kvcellar.store.journal import OpaqueEvent

    @attrs_module.frozen(kw_only=True)
    class FutureEvent:
        kind = "future.thing"
        entry_id: str = "a"
        detail: int = 7

    journal = Journal.open(tmp_path / "j.sqlite")
    journal.append(ev.EntryStored(entry=_fields("a")))
    journal.append(FutureEvent())
    records = list(journal.events())
    assert records[1].event == OpaqueEvent(kind="future.thing", data={"entry_id": "a", "detail": 7})
    assert journal.replay() == journal.entries() and len(journal.entries()) == 1
