"""`kvcellar kv inspect` and `kvcellar kv verify` on real entries."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx_lm.models import cache as mlx_cache

from kvcellar.cli import cli, main
from kvcellar.store import kvfile


@pytest.fixture()
def entry_path(tmp_path):
    ring = mlx_cache.RotatingKVCache(max_size=4)
    plain = mlx_cache.KVCache()
    for cache in (ring, plain):
        rows = mx.arange(1 * 2 * 6 * 8, dtype=mx.float32).reshape(1, 2, 6, 8)
        cache.update_and_fetch(rows, rows)
    path = tmp_path / "e.kvc"
    kvfile.save(path, [ring, plain], list(range(6)), {"namespace": "ns1", "fingerprint": {"model": "m"}})
    return path


def test_inspect_json_prints_the_header(entry_path):
    result = CliRunner().invoke(cli, ["kv", "inspect", "--json", str(entry_path)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output.strip().splitlines()[-1])
    assert data["namespace"] == "ns1"
    assert data["tokens"] == list(range(6))
    assert [c["signature"] for c in data["caches"]] == ["kv:rotating-plain", "kv:plain"]
    assert data["caches"][0]["fields"]["wrapped"] == 1
    assert len(data["caches"][1]["tensors"][0]["checksum"]) == 16


def test_inspect_table_names_signatures_and_fields(entry_path):
    result = CliRunner(env={"COLUMNS": "240"}).invoke(cli, ["kv", "inspect", str(entry_path)])
    assert result.exit_code == 0, result.output
    assert "kv:rotating-plain" in result.output and "ring_index=" in result.output
    assert "fingerprint.model" in result.output


def test_verify_exits_zero_when_intact_and_one_with_the_reason_when_damaged(entry_path, tmp_path):
    ok = CliRunner().invoke(cli, ["kv", "verify", str(entry_path)])
    assert ok.exit_code == 0 and ok.output.startswith("ok:")
    header = kvfile.read_header(entry_path)
    record = list(header.tensor_records())[-1]
    data = bytearray(entry_path.read_bytes())
    data[record.file_offset] ^= 1
    damaged = tmp_path / "d.kvc"
    damaged.write_bytes(bytes(data))
    bad = CliRunner().invoke(cli, ["kv", "verify", str(damaged)])
    assert bad.exit_code == 1
    assert f"tensor {record.name}" in bad.output


def test_inspect_of_a_foreign_file_is_a_clear_error_not_a_traceback(tmp_path, capsys):
    foreign = tmp_path / "notes.txt"
    foreign.write_text("hello")
    assert main(["kv", "inspect", str(foreign)]) == 2
    assert "not a .kvc file" in capsys.readouterr().err


def _walk(group, path):
    yield path, group
    for name, command in getattr(group, "commands", {}).items():
        yield from _walk(command, [*path, name])


def test_every_command_and_option_has_help_text():
    for path, command in _walk(cli, []):
        assert command.help, f"kvcellar {' '.join(path)} has no help"
        for param in command.params:
            if param.param_type_name == "option" and param.name not in ("help", "version"):
                assert param.help, f"kvcellar {' '.join(path)} {param.opts[0]} has no help"
        result = CliRunner().invoke(cli, [*path, "--help"])
        assert result.exit_code == 0, result.output
