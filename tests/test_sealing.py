"""AES-256-GCM segments (`store.sealing`): a segment sealed in any pieces is the
same bytes, opens to its plaintext, and fails its tag under any other segment
index, header binding, nonce or a flipped byte."""

from __future__ import annotations

import itertools

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcellar.store import sealing
from kvcellar.store.keyring import EncryptionKey

KEY = EncryptionKey.from_bytes(bytes(range(32)))
SEAL = sealing.new_seal(KEY)
BINDING = bytes(32)


@settings(max_examples=60, deadline=None)
@given(
    plaintext=st.binary(max_size=4096),
    cuts=st.lists(st.integers(min_value=0, max_value=4096), max_size=5),
    piece_bytes=st.integers(min_value=1, max_value=1024),
    segment=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_pieces_do_not_change_the_sealed_bytes_and_they_open(plaintext, cuts, piece_bytes, segment):
    bounds = sorted({0, len(plaintext), *(cut % (len(plaintext) + 1) for cut in cuts)})
    parts = [plaintext[a:b] for a, b in itertools.pairwise(bounds)]
    streamed = b"".join(sealing.seal_segments(KEY, SEAL, BINDING, segment, parts, piece_bytes))
    assert streamed == sealing.seal_bytes(KEY, SEAL, BINDING, segment, plaintext)
    assert len(streamed) == len(plaintext) + sealing.TAG_BYTES
    assert sealing.open_bytes(KEY, SEAL, BINDING, segment, streamed) == plaintext


@settings(max_examples=60, deadline=None)
@given(plaintext=st.binary(min_size=1, max_size=512), flip=st.integers(min_value=0), segment=st.integers(0, 1000))
def test_anything_changed_fails_the_tag(plaintext, flip, segment):
    sealed = sealing.seal_bytes(KEY, SEAL, BINDING, segment, plaintext)
    flipped = bytearray(sealed)
    flipped[flip % len(flipped)] ^= 0x80
    assert sealing.open_bytes(KEY, SEAL, BINDING, segment, bytes(flipped)) is None
    assert sealing.open_bytes(KEY, SEAL, BINDING, segment + 1, sealed) is None
    assert sealing.open_bytes(KEY, SEAL, b"\x01" + BINDING[1:], segment, sealed) is None
    other_nonce = attrs.evolve(SEAL, nonce=bytes(a ^ 1 for a in SEAL.nonce))
    assert sealing.open_bytes(KEY, other_nonce, BINDING, segment, sealed) is None
    assert sealing.open_bytes(KEY, SEAL, BINDING, segment, sealed[: sealing.TAG_BYTES - 1]) is None


def test_segment_nonces_wrap_and_differ():
    top = attrs.evolve(SEAL, nonce=b"\xff" * sealing.NONCE_BYTES)
    assert sealing.segment_nonce(top, 1) == bytes(sealing.NONCE_BYTES)
    assert len({sealing.segment_nonce(SEAL, i) for i in range(1000)}) == 1000


def test_the_binding_ignores_token_ids_and_checksums_only():
    header = {
        "namespace": "a",
        "token_ids": b"\x01\x02",
        "caches": [{"tensors": [{"name": "k", "checksum": b"\x07" * 8}], "children": []}],
    }
    same = {
        **header,
        "token_ids": b"other",
        "caches": [{"tensors": [{"name": "k", "checksum": bytes(8)}], "children": []}],
    }
    assert sealing.header_binding(header) == sealing.header_binding(same)
    assert sealing.header_binding(header) != sealing.header_binding({**header, "namespace": "b"})
