"""Encryption keys at rest: `kvcellar keygen`, key files and the key ring."""

from __future__ import annotations

import hashlib
import os
import stat

import pytest
from click.testing import CliRunner

from kvcellar.cli import cli, main
from kvcellar.errors import KeyFileError, KeyUnavailable
from kvcellar.store.keyring import KEY_BYTES, EncryptionKey, load_key_file, load_key_ring, write_new_key_file


def test_keygen_writes_a_256_bit_key_readable_only_by_its_owner(tmp_path):
    path = tmp_path / "server.key"
    result = CliRunner().invoke(cli, ["keygen", str(path)])
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    key = load_key_file(path)
    assert len(key.key) == KEY_BYTES
    assert key.key_id == hashlib.sha256(key.key).digest()[:8].hex()
    assert key.key_id in result.output
    assert key.key.hex() not in result.output


def test_keygen_never_overwrites_a_key(tmp_path, capsys):
    path = tmp_path / "server.key"
    first = write_new_key_file(path)
    assert main(["keygen", str(path)]) == 2
    assert "cannot create the key file" in capsys.readouterr().err
    assert load_key_file(path) == first


def test_two_keys_differ(tmp_path):
    assert write_new_key_file(tmp_path / "a").key != write_new_key_file(tmp_path / "b").key


def test_raw_32_byte_key_files_are_accepted(tmp_path):
    raw = bytes(range(KEY_BYTES))
    (tmp_path / "raw.key").write_bytes(raw)
    assert load_key_file(tmp_path / "raw.key") == EncryptionKey.from_bytes(raw)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (None, "missing"),
        (b"", "not an encryption key"),
        (b"ab" * 31 + b"\n", "not an encryption key"),
        (b"zz" * 32 + b"\n", "bad hex"),
        (bytes(33), "not an encryption key"),
    ],
    ids=["missing", "empty", "short-hex", "bad-hex", "33-raw-bytes"],
)
def test_bad_key_files_fail_clearly(tmp_path, content, reason):
    path = tmp_path / "bad.key"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(KeyFileError, match=reason):
        load_key_file(path)


def test_unreadable_key_file_fails_clearly(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads a mode-000 file")
    path = tmp_path / "locked.key"
    write_new_key_file(path)
    path.chmod(0)
    with pytest.raises(KeyFileError, match="unreadable"):
        load_key_file(path)


def test_first_key_seals_and_every_key_opens(tmp_path):
    new, old = write_new_key_file(tmp_path / "new"), write_new_key_file(tmp_path / "old")
    ring = load_key_ring([tmp_path / "new", tmp_path / "old"])
    assert ring.sealing == new
    assert ring.opening(old.key_id) == old
    with pytest.raises(KeyUnavailable) as caught:
        ring.opening("0123456789abcdef")
    assert caught.value.key_id == "0123456789abcdef"


def test_a_key_given_twice_is_refused(tmp_path):
    write_new_key_file(tmp_path / "k")
    with pytest.raises(KeyFileError, match="twice"):
        load_key_ring([tmp_path / "k", tmp_path / "k"])


def test_a_key_never_shows_in_its_repr(tmp_path):
    key = write_new_key_file(tmp_path / "k")
    assert key.key.hex() not in repr(key) and key.key_id in repr(key)


def _serve(*args: str) -> int:
    """`kvcellar serve` with `args`; every case here stops at its flag checks, before any model work."""
    return main(["serve", "--model", "/nonexistent-model", *args])


def test_serve_refuses_a_key_without_the_ssd_tier(tmp_path, capsys):
    write_new_key_file(tmp_path / "k")
    assert _serve("--encryption-key-file", str(tmp_path / "k")) == 2
    assert "needs --ssd-cache" in capsys.readouterr().err


def test_serve_stops_at_a_missing_key_file(tmp_path, capsys):
    assert _serve("--ssd-cache", str(tmp_path / "ssd"), "--encryption-key-file", str(tmp_path / "absent.key")) == 2
    assert "encryption key file missing" in capsys.readouterr().err
