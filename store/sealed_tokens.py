"""Token ids sealed under a key ring outside `.kvc` files: the journal's
(the `entries.token_ids` column and the `EntryFields` of every stored event)
and the shared tier's manifests (format version 2).

With a key ring, the journal holds each entry's token ids as
`key id (8 bytes) || nonce (12) || AES-256-GCM ciphertext || tag (16)`,
sealed under the ring's first key with a fresh random nonce per row and the
entry id as AAD (a row's blob moved onto another entry fails its tag). The
startup scan opens them to index the entry without reading its file.

A plain column holds exactly `4 * token_count` bytes and a sealed one
`4 * token_count + SEAL_OVERHEAD_BYTES`, so the two are told apart by length
alone: a journal written without a key still reads, and a row that is plain
while the server seals is read from its file and journaled again, sealed.

`tokens_digest` stays an unkeyed xxh3-128 of the ids: it names a token
sequence, so someone holding the journal can confirm a guessed prompt, never
read one.
"""

from __future__ import annotations

import secrets

import attrs
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvcellar.errors import CorruptEntry, KeyUnavailable
from kvcellar.store import events as ev
from kvcellar.store.keyring import KEY_ID_BYTES, EncryptionKey, KeyRing
from kvcellar.store.sealing import NONCE_BYTES, TAG_BYTES

SEAL_OVERHEAD_BYTES = KEY_ID_BYTES + NONCE_BYTES + TAG_BYTES
_JOURNAL_AAD_PREFIX = b"kvcellar journal token_ids\x00"
_MANIFEST_AAD_PREFIX = b"kvcellar shared manifest token_ids\x00"


def _aad(entry_id: str) -> bytes:
    return _JOURNAL_AAD_PREFIX + entry_id.encode("utf-8")


def _sealed(key: EncryptionKey, aad: bytes, plaintext: bytes) -> bytes:
    nonce = secrets.token_bytes(NONCE_BYTES)
    return bytes.fromhex(key.key_id) + nonce + AESGCM(key.key).encrypt(nonce, plaintext, aad)


def _opened(keyring: KeyRing | None, aad: bytes, sealed: bytes, name: str) -> bytes:
    """Raises `KeyUnavailable` without the key, `CorruptEntry` when the tag fails."""
    key_id = bytes(sealed[:KEY_ID_BYTES]).hex()
    if keyring is None:
        raise KeyUnavailable(f"{name} is sealed under key {key_id}; no key given", key_id=key_id)
    key = keyring.opening(key_id)
    nonce = bytes(sealed[KEY_ID_BYTES : KEY_ID_BYTES + NONCE_BYTES])
    try:
        return AESGCM(key.key).decrypt(nonce, bytes(sealed[KEY_ID_BYTES + NONCE_BYTES :]), aad)
    except InvalidTag as e:
        raise CorruptEntry(f"{name}: its token ids fail their tag under key {key_id}", part="token_ids") from e


def seal_token_ids(key: EncryptionKey, entry_id: str, token_ids: bytes) -> bytes:
    """`token_ids` (uint32 LE) sealed for the journal row of `entry_id`."""
    return _sealed(key, _aad(entry_id), token_ids)


def seal_manifest_token_ids(key: EncryptionKey, manifest_name: str, token_ids: bytes) -> bytes:
    """A shared manifest's token ids sealed; `manifest_name` (its fingerprint,
    namespace and tokens digest) is their AAD, so they open only in their own manifest."""
    return _sealed(key, _MANIFEST_AAD_PREFIX + manifest_name.encode("utf-8"), token_ids)


def open_manifest_token_ids(keyring: KeyRing | None, manifest_name: str, sealed: bytes) -> bytes:
    """The plain token ids of a sealed manifest; raises like `open_token_ids`."""
    if len(sealed) < SEAL_OVERHEAD_BYTES or (len(sealed) - SEAL_OVERHEAD_BYTES) % 4:
        raise CorruptEntry(f"manifest {manifest_name}: {len(sealed)} bytes of sealed token ids", part="manifest")
    return _opened(keyring, _MANIFEST_AAD_PREFIX + manifest_name.encode("utf-8"), sealed, f"manifest {manifest_name}")


def sealed_key_id(token_ids: bytes, token_count: int) -> str | None:
    """The key id a stored column is sealed under; None for a plain column."""
    if len(token_ids) == 4 * token_count:
        return None
    return bytes(token_ids[:KEY_ID_BYTES]).hex()


def open_token_ids(keyring: KeyRing | None, entry_id: str, token_ids: bytes, token_count: int) -> bytes:
    """The plain token ids of a stored column (a plain one as it is).
    `KeyUnavailable` when it is sealed under a key the ring lacks,
    `CorruptEntry` when it has the wrong length or fails its tag."""
    key_id = sealed_key_id(token_ids, token_count)
    if key_id is None:
        return bytes(token_ids)
    if len(token_ids) != 4 * token_count + SEAL_OVERHEAD_BYTES:
        raise CorruptEntry(
            f"journal row {entry_id}: {len(token_ids)} bytes of token ids for {token_count} tokens",
            part="journal token_ids",
        )
    return _opened(keyring, _aad(entry_id), token_ids, f"journal row {entry_id}")


def sealed_fields(key: EncryptionKey, entry: ev.EntryFields) -> ev.EntryFields:
    """`entry` with its token ids sealed under `key` (they must be plain)."""
    if sealed_key_id(entry.token_ids, entry.token_count) is not None:
        raise ValueError(f"entry {entry.entry_id}: its token ids are sealed already")
    return attrs.evolve(entry, token_ids=seal_token_ids(key, entry.entry_id, entry.token_ids))


# The stored events that carry an entry's token ids (`sealed_event` seals them).
TOKEN_CARRYING_KINDS = (ev.EntryStored.kind, ev.ReconcileAdded.kind, ev.ReconcileUpdated.kind)


def resealed_event(keyring: KeyRing, event: ev.Event) -> ev.Event | None:
    """A stored event with its entry's token ids sealed under the ring's first key; None when
    it carries none or they are sealed under that key already. Raises like `open_token_ids`."""
    if not isinstance(event, (ev.EntryStored, ev.ReconcileAdded, ev.ReconcileUpdated)):
        return None
    entry = event.entry
    key_id = sealed_key_id(entry.token_ids, entry.token_count)
    if key_id == keyring.sealing.key_id:
        return None
    plain = open_token_ids(keyring, entry.entry_id, entry.token_ids, entry.token_count)
    return attrs.evolve(event, entry=sealed_fields(keyring.sealing, attrs.evolve(entry, token_ids=plain)))


def sealed_event(key: EncryptionKey, event: ev.Event) -> ev.Event:
    """The event as the journal stores it: the token ids of any entry it carries sealed."""
    if isinstance(event, (ev.EntryStored, ev.ReconcileAdded, ev.ReconcileUpdated)):
        return attrs.evolve(event, entry=sealed_fields(key, event.entry))
    return event
