"""Encryption keys at rest: key files, key ids and the key ring.

A key file holds one 256-bit AES key, as 64 hex digits and a newline
(`kvcellar keygen` writes it, mode 0600) or as the 32 raw bytes. A key's id is
the hex of the first 8 bytes of sha256(key): it names the key in a sealed
entry's header and in warnings, and reveals nothing usable about the key.

The ring holds every key given (`serve --encryption-key-file`, repeatable):
the first seals new entries, every one opens entries sealed under it, so an
operator rotates by putting a new key first and keeping the old ones until
their entries are gone. Key files are read through `Disk` like every file of
the store; the key file is written with `os.open` because `Disk` creates
entry files, whose mode is the umask's, and a key must never be readable by
others, not even for an instant.
"""

from __future__ import annotations

import binascii
import errno
import hashlib
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

import attrs

from kvcellar.errors import DiskError, KeyFileError, KeyUnavailable
from kvcellar.store.disk import Disk, RealDisk

KEY_BYTES = 32
KEY_ID_BYTES = 8
KEY_FILE_MODE = 0o600
# 64 hex digits and a newline, with room for a CRLF: anything longer is not a key file.
_KEY_FILE_BYTES_MAX = 2 * KEY_BYTES + 2


def key_id_of(key: bytes) -> str:
    """The key's public name: hex of the first 8 bytes of its sha256."""
    return hashlib.sha256(key).digest()[:KEY_ID_BYTES].hex()


@attrs.frozen(kw_only=True, repr=False)
class EncryptionKey:
    """One AES-256 key and its id. `repr` shows only the id, so a key never
    lands in a log or a traceback."""

    key_id: str
    key: bytes

    def __repr__(self) -> str:
        return f"EncryptionKey(key_id={self.key_id!r})"

    @classmethod
    def from_bytes(cls, key: bytes) -> EncryptionKey:
        if len(key) != KEY_BYTES:
            raise KeyFileError(f"an encryption key is {KEY_BYTES} bytes, not {len(key)}")
        return cls(key_id=key_id_of(key), key=bytes(key))


@attrs.frozen(kw_only=True)
class KeyRing:
    """The keys of one server: `sealing` seals, every key opens."""

    keys: tuple[EncryptionKey, ...]

    def __attrs_post_init__(self) -> None:
        if not self.keys:
            raise KeyFileError("a key ring needs at least one key")

    @property
    def sealing(self) -> EncryptionKey:
        return self.keys[0]

    @property
    def key_ids(self) -> tuple[str, ...]:
        return tuple(key.key_id for key in self.keys)

    def opening(self, key_id: str) -> EncryptionKey:
        """The key named `key_id`; `KeyUnavailable` when the ring lacks it."""
        for key in self.keys:
            if key.key_id == key_id:
                return key
        raise KeyUnavailable(
            f"no encryption key with id {key_id} (the ring holds {', '.join(self.key_ids)})", key_id=key_id
        )


def parse_key_file(data: bytes, path: Path) -> EncryptionKey:
    """A key from a key file's bytes: 32 raw bytes, or 64 hex digits with an optional newline."""
    if len(data) == KEY_BYTES:
        return EncryptionKey.from_bytes(data)
    text = data.strip()
    if len(text) != 2 * KEY_BYTES:
        raise KeyFileError(
            f"{path}: not an encryption key file ({len(data)} bytes; expected {KEY_BYTES} raw bytes or "
            f"{2 * KEY_BYTES} hex digits, as `kvcellar keygen` writes)"
        )
    try:
        return EncryptionKey.from_bytes(binascii.unhexlify(text))
    except binascii.Error as e:
        raise KeyFileError(f"{path}: not an encryption key file (bad hex: {e})") from e


def load_key_file(path: Path, *, disk: Disk | None = None) -> EncryptionKey:
    """Read one key file; `KeyFileError` when it is missing, unreadable or not a key."""
    disk = disk or RealDisk()
    try:
        handle = disk.open_read(path)
    except DiskError as e:
        reason = "missing" if e.errno == errno.ENOENT else "unreadable"
        raise KeyFileError(f"{path}: encryption key file {reason} ({e})") from e
    try:
        buffer = bytearray(_KEY_FILE_BYTES_MAX + 1)
        got = disk.read_into(handle, 0, memoryview(buffer))
    except DiskError as e:
        raise KeyFileError(f"{path}: encryption key file unreadable ({e})") from e
    finally:
        disk.close(handle)
    return parse_key_file(bytes(buffer[:got]), path)


def load_key_ring(paths: Sequence[Path], *, disk: Disk | None = None) -> KeyRing:
    """The ring of the key files in order (the first seals); duplicates are refused."""
    keys = tuple(load_key_file(Path(path), disk=disk) for path in paths)
    ids = [key.key_id for key in keys]
    duplicated = sorted({key_id for key_id in ids if ids.count(key_id) > 1})
    if duplicated:
        raise KeyFileError(f"the same encryption key is given twice (key id {', '.join(duplicated)})")
    return KeyRing(keys=keys)


def write_new_key_file(path: Path) -> EncryptionKey:
    """Create `path` (never over an existing file) holding a new random key
    as hex, mode 0600 from its creation, fsynced; returns the key."""
    key = EncryptionKey.from_bytes(secrets.token_bytes(KEY_BYTES))
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, KEY_FILE_MODE)
    except OSError as e:
        raise KeyFileError(f"{path}: cannot create the key file ({e.strerror})") from e
    try:
        os.fchmod(descriptor, KEY_FILE_MODE)  # the umask may have narrowed it, never widened: make it exact
        os.write(descriptor, key.key.hex().encode("ascii") + b"\n")
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    return key
