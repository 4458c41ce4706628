"""`kvcellar journal` on a journal written by a real SSD store."""

from __future__ import annotations

import json
import shutil
import sqlite3
import threading
import time
import uuid

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx_lm.models.cache import KVCache

from kvcellar.cli import cli, main
from kvcellar.cli import journal as journal_cli
from kvcellar.store.journal import JOURNAL_FILE_NAME, SCHEMA_VERSION
from kvcellar.store.ssd import SsdStore, namespace_dir_name

FINGERPRINT = "f" * 32
SHORT = list(range(3, 11))
LONG = SHORT + [40, 41, 42, 43]
OTHER = [500 + i for i in range(6)]


def _caches(tokens):
    cache = KVCache()
    rows = mx.ones((1, 1, len(tokens), 4))
    cache.update_and_fetch(rows, rows)
    return [cache]


@pytest.fixture()
def cache_dir(tmp_path):
    """A cache directory after storing, superseding, hitting, restoring and
    evicting; yields (root, live store, ids by role)."""
    store = SsdStore.open(tmp_path, FINGERPRINT)
    ids = {"short": store.store(SHORT, _caches(SHORT))}
    ids["long"] = store.store(LONG, _caches(LONG))
    ids["other"] = store.store(OTHER, _caches(OTHER), namespace="adapter-x")
    match = store.find(LONG + [7])
    assert match is not None and store.restore(match) is not None
    cap_bytes = store.entry(ids["long"]).bytes + 1
    store.close()
    # Reopening under a smaller cap evicts the least recently used entry ("other").
    store = SsdStore.open(tmp_path, FINGERPRINT, bytes_max=cap_bytes)
    assert store.entry_ids() == [ids["long"]]
    # The journal's own thread applies appends after the call that queued them
    # returns: every test (a follower above all) starts from an applied journal.
    store.journal.wait_applied(timeout_s=60)
    yield tmp_path, store, ids
    store.close()


def _run(*args):
    result = CliRunner(env={"COLUMNS": "250"}).invoke(cli, ["journal", *args])
    return result


def _json(*args):
    result = _run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _kinds(root):
    result = _run("export", str(root))
    assert result.exit_code == 0, result.output
    return [json.loads(line)["kind"] for line in result.output.splitlines()]


def test_export_writes_every_event_as_a_json_line(cache_dir):
    root, _, ids = cache_dir
    result = _run("export", "--format", "jsonl", str(root))
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in result.output.splitlines()]
    assert [e["kind"] for e in events] == [
        "entry.stored",
        "entry.stored",
        "entry.superseded",
        "entry.stored",
        "entry.hit",
        "entry.restored",
        "entry.evicted",
    ]
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    stored = events[0]["event"]["entry"]
    assert "token_ids" not in stored and stored["token_count"] == len(SHORT)
    assert events[2]["event"] == {"entry_id": ids["short"], "by_entry_id": ids["long"], "reason": "prefix"}


def test_tail_shows_the_last_events_filtered_by_kind_and_namespace(cache_dir):
    root, _, ids = cache_dir
    result = _run("tail", "-n", "2", str(root))
    assert result.exit_code == 0, result.output
    assert "entry.restored" in result.output and "entry.evicted" in result.output
    assert "entry.hit" not in result.output
    lines = _run("tail", "--json", "--kind", "entry.stored", str(root)).output.splitlines()
    assert [json.loads(line)["entry_id"] for line in lines] == [ids["short"], ids["long"], ids["other"]]
    lines = _run("tail", "--json", "--ns", "adapter-x", str(root)).output.splitlines()
    assert [json.loads(line)["kind"] for line in lines] == ["entry.stored", "entry.evicted"]


def test_tail_follow_sees_an_append_by_the_running_store(cache_dir, monkeypatch):
    root, store, _ = cache_dir
    outcome = {}
    following = threading.Event()
    follow_events = journal_cli._follow

    def signalling_follow(*args, **kwargs):
        # Called once the existing events are read: from here on, an append is a live one.
        following.set()
        return follow_events(*args, **kwargs)

    monkeypatch.setattr(journal_cli, "_follow", signalling_follow)

    def follow():
        outcome["result"] = _run(
            "tail",
            "-f",
            "--json",
            "-n",
            "0",
            "--interval-seconds",
            "0.05",
            "--max-seconds",
            "10",
            "--max-events",
            "1",
            str(root),
        )

    follower = threading.Thread(target=follow)
    started = time.monotonic()
    follower.start()
    assert following.wait(10), "the follower never got past the existing events"
    new_id = store.store(OTHER, _caches(OTHER), namespace="adapter-x")
    follower.join(timeout=15)
    result = outcome["result"]
    assert result.exit_code == 0, result.output
    assert time.monotonic() - started < 10
    events = [json.loads(line) for line in result.output.splitlines()]
    assert [(e["kind"], e["entry_id"]) for e in events] == [("entry.stored", new_id)]


def test_show_an_event_and_an_entry_with_its_header(cache_dir):
    root, _, ids = cache_dir
    event = _json("show", str(root), "3")
    assert event["kind"] == "entry.superseded" and event["entry_id"] == ids["short"]
    entry = _json("show", str(root), ids["long"][:10])
    assert entry["entry_id"] == ids["long"]
    assert entry["entry"]["hits"] == 1 and entry["entry"]["restores"] == 1
    assert entry["header"]["token_count"] == len(LONG) and entry["header"]["namespace"] == ""
    assert [e["kind"] for e in entry["events"]] == ["entry.stored", "entry.hit", "entry.restored"]
    gone = _json("show", str(root), ids["other"])
    assert gone["entry"] is None and gone["header"] is None
    table = _run("show", str(root), ids["long"])
    assert table.exit_code == 0 and f"{len(LONG)} tokens" in table.output and "entry.restored" in table.output


def test_entries_lists_the_index_with_namespace_filter_and_sort(cache_dir):
    root, store, ids = cache_dir
    rows = _json("entries", str(root))
    assert [row["entry_id"] for row in rows] == [ids["long"]]
    assert rows[0]["token_count"] == len(LONG) and "token_ids" not in rows[0]
    store.close()
    # Without the fixture's cap, so that both entries stay.
    uncapped = SsdStore.open(root, FINGERPRINT)
    newer = uncapped.store(OTHER, _caches(OTHER), namespace="adapter-x")
    uncapped.close()
    assert [r["entry_id"] for r in _json("entries", str(root), "--ns", "adapter-x")] == [newer]
    assert [r["entry_id"] for r in _json("entries", str(root), "--sort", "tokens")] == [ids["long"], newer]
    assert [r["entry_id"] for r in _json("entries", str(root), "--sort", "mtime")] == [newer, ids["long"]]
    table = _run("entries", str(root))
    assert table.exit_code == 0 and ids["long"] in table.output and "'adapter-x'" in table.output


def test_stats_counts_kinds_and_traffic(cache_dir):
    root, store, ids = cache_dir
    stats = _json("stats", str(root))
    assert stats["counts_by_kind"] == {
        "entry.evicted": 1,
        "entry.hit": 1,
        "entry.restored": 1,
        "entry.stored": 3,
        "entry.superseded": 1,
    }
    long_bytes = store.entry(ids["long"]).bytes
    assert stats["bytes_restored"] == long_bytes
    assert stats["bytes_written"] > 2 * long_bytes
    assert stats["write_amplification"] == pytest.approx(stats["bytes_written"] / long_bytes)
    assert stats["hit_rate"] == pytest.approx(1 / 3)
    assert stats["entries"] == 1 and stats["quarantined"] == 0 and stats["quarantine_files"] == 0
    table = _run("stats", str(root))
    assert table.exit_code == 0 and "write amplification" in table.output and "entry.superseded" in table.output


def test_stats_counts_the_quarantined_files_and_their_bytes(cache_dir):
    root, _store, _ids = cache_dir
    quarantine = root / FINGERPRINT / "quarantine"
    quarantine.mkdir(exist_ok=True)
    (quarantine / "damaged.kvc").write_bytes(b"\0" * 1234)
    stats = _json("stats", str(root))
    assert stats["quarantine_files"] == 1 and stats["quarantine_bytes"] == 1234


def test_timeline_follows_an_entry_through_its_life(cache_dir):
    root, _, ids = cache_dir
    short = _json("timeline", str(root), ids["short"])
    assert not short["live"]
    assert [e["kind"] for e in short["events"]] == ["entry.stored", "entry.superseded"]
    long = _json("timeline", str(root), ids["long"])
    assert long["live"]
    assert [e["kind"] for e in long["events"]] == ["entry.stored", "entry.superseded", "entry.hit", "entry.restored"]
    table = _run("timeline", str(root), ids["long"])
    assert table.exit_code == 0 and f"superseded {ids['short']}" in table.output and "(live)" in table.output


def test_replay_until_shows_the_index_at_that_event(cache_dir):
    root, _, ids = cache_dir
    assert [r["entry_id"] for r in _json("replay", str(root), "--until", "1")] == [ids["short"]]
    assert {r["entry_id"] for r in _json("replay", str(root), "--until", "4")} == {ids["long"], ids["other"]}
    assert [r["entry_id"] for r in _json("replay", str(root))] == [ids["long"]]
    assert _json("replay", str(root), "--until", "0") == []


def test_verify_passes_on_a_consistent_store(cache_dir):
    root, _, _ = cache_dir
    result = _run("verify", str(root))
    assert result.exit_code == 0, result.output
    assert result.output.startswith("ok: 1 entries")


def test_verify_catches_a_file_deleted_behind_its_back(cache_dir):
    root, store, ids = cache_dir
    store.entry(ids["long"]).path.unlink()
    report = _run("verify", "--json", str(root))
    assert report.exit_code == 1
    mismatches = json.loads(report.output)["mismatches"]
    assert mismatches == [
        {
            "check": "projection vs files",
            "entry_id": ids["long"],
            "field": "entry",
            "left": "present",
            "right": "missing",
        }
    ]


def test_verify_catches_a_file_added_behind_its_back(cache_dir):
    root, store, ids = cache_dir
    original = store.entry(ids["long"]).path
    copy_id = uuid.uuid4().hex
    shutil.copy2(original, original.with_name(f"{copy_id}.kvc"))
    report = _run("verify", str(root))
    assert report.exit_code == 1
    assert copy_id in report.output and "projection vs files" in report.output and "missing" in report.output


def test_verify_catches_a_tampered_projection_row(cache_dir):
    root, _, ids = cache_dir
    with sqlite3.connect(root / FINGERPRINT / JOURNAL_FILE_NAME) as connection:
        connection.execute("UPDATE entries SET bytes = 12345 WHERE entry_id = ?", [ids["long"]])
    mismatches = json.loads(_run("verify", "--json", str(root)).output)["mismatches"]
    assert {(m["check"], m["field"], m["left"]) for m in mismatches} == {
        ("projection vs replay", "bytes", 12345),
        ("projection vs files", "bytes", 12345),
    }
    assert _run("verify", str(root)).exit_code == 1


def test_verify_reports_an_unreadable_entry_file(cache_dir):
    root, _, _ = cache_dir
    junk = root / FINGERPRINT / namespace_dir_name("") / f"{uuid.uuid4().hex}.kvc"
    junk.write_bytes(b"not an entry")
    report = json.loads(_run("verify", "--json", str(root)).output)
    assert not report["ok"]
    assert any(m["field"] == "header" and "unreadable" in m["right"] for m in report["mismatches"])


def test_several_fingerprints_need_a_choice(cache_dir, capsys):
    root, _, ids = cache_dir
    SsdStore.open(root, "e" * 32).close()
    assert main(["journal", "entries", str(root)]) == 2
    err = capsys.readouterr().err
    assert "--fingerprint" in err and "e" * 32 in err and FINGERPRINT in err
    assert [r["entry_id"] for r in _json("entries", str(root), "--fingerprint", FINGERPRINT)] == [ids["long"]]
    assert [r["entry_id"] for r in _json("entries", str(root / FINGERPRINT))] == [ids["long"]]
    assert main(["journal", "entries", str(root), "--fingerprint", "0" * 32]) == 2


def test_a_directory_that_is_not_a_cache_is_a_clear_error(tmp_path, capsys):
    assert main(["journal", "stats", str(tmp_path)]) == 2
    assert "not a kvcellar cache directory" in capsys.readouterr().err


def test_a_newer_schema_is_a_clear_error(cache_dir, capsys):
    root, store, _ = cache_dir
    store.close()
    with sqlite3.connect(root / FINGERPRINT / JOURNAL_FILE_NAME) as connection:
        connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    assert main(["journal", "tail", str(root)]) == 2
    assert "newer" in capsys.readouterr().err


def test_a_damaged_database_is_a_clear_error(cache_dir, capsys):
    root, store, _ = cache_dir
    store.close()
    journal_path = root / FINGERPRINT / JOURNAL_FILE_NAME
    journal_path.write_bytes(b"this is not sqlite at all" * 100)
    assert main(["journal", "verify", str(root)]) == 2
    assert f"error: {journal_path}" in capsys.readouterr().err


def test_unknown_event_or_entry_is_a_clear_error(cache_dir, capsys):
    root, _, _ = cache_dir
    # Digits that name no event are tried as an entry-id prefix (hex ids often begin with digits). Eighteen
    # nines: no event has that number and no random hex id begins with them (a short one, like 999, did once).
    unknown = "9" * 18
    assert main(["journal", "show", str(root), unknown]) == 2
    assert f"no event or entry '{unknown}'" in capsys.readouterr().err
    assert main(["journal", "timeline", str(root), "zzz"]) == 2
    assert "no event or entry 'zzz'" in capsys.readouterr().err


def test_commands_never_modify_the_cache_directory(cache_dir):
    root, store, _ = cache_dir
    store.close()

    def snapshot():
        # SQLite's WAL sidecars (-wal, -shm) are its reader coordination, created even by read-only readers.
        files = [path for path in root.rglob("*") if path.is_file() and not path.name.endswith(("-wal", "-shm"))]
        return {path: (path.stat().st_mtime_ns, path.read_bytes()) for path in files}

    before = snapshot()
    for args in (["stats"], ["verify"], ["entries"], ["tail"], ["export"], ["replay", "--until", "2"]):
        assert _run(*args, str(root)).exit_code == 0
    assert snapshot() == before


def test_every_journal_command_has_help_text():
    for name, command in cli.commands["journal"].commands.items():
        assert command.help, f"journal {name} has no help"
        for param in command.params:
            if param.param_type_name == "option" and param.name != "help":
                assert param.help, f"journal {name} {param.opts[0]} has no help"
        assert _run(name, "--help").exit_code == 0
