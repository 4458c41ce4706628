"""Sealed `.kvc` entries (format version 3, AES-256-GCM): a restore with the key
is bit-exact, the file holds no run of the prompt's token ids, a missing or
wrong key is `KeyUnavailable`, and a tampered or swapped header or payload
fails its tag."""

from __future__ import annotations

import errno
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import xxhash
from mlx_lm.models.cache import make_prompt_cache

from kvcellar.errors import CorruptEntry, DiskError, KeyUnavailable
from kvcellar.serialization import from_cbor, to_cbor
from kvcellar.store import kvfile
from kvcellar.store.disk import RealDisk
from kvcellar.store.keyring import load_key_ring, write_new_key_file
from kvcellar.store.records import Header

PROMPT_TOKENS = [(7 * i + 3) % 1000 + 3 for i in range(80)]
RUN_TOKENS = 16


def token_runs_in(data: bytes, tokens: list[int]) -> int:
    """How many 16-token runs of `tokens` lie in `data` as int32/uint32 LE (the two agree for ids < 2**31)."""
    return sum(
        np.asarray(tokens[i : i + RUN_TOKENS], dtype="<u4").tobytes() in data
        for i in range(len(tokens) - RUN_TOKENS + 1)
    )


@pytest.fixture
def ring(tmp_path):
    write_new_key_file(tmp_path / "first.key")
    write_new_key_file(tmp_path / "second.key")
    return load_key_ring([tmp_path / "first.key", tmp_path / "second.key"])


@pytest.fixture
def other_ring(tmp_path):
    write_new_key_file(tmp_path / "other.key")
    return load_key_ring([tmp_path / "other.key"])


@pytest.fixture(scope="module")
def llama_prefill(loaded_model_factory):
    model, _ = loaded_model_factory("llama")
    cache = make_prompt_cache(model)
    logits = model(mx.array([PROMPT_TOKENS]), cache=cache)[:, -1, :]
    mx.eval(logits)
    return model, cache, logits


def _continue(model, cache, logits, steps: int = 8) -> list[mx.array]:
    out = []
    for _ in range(steps):
        token = int(mx.argmax(logits, axis=-1).item())
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
        mx.eval(logits)
        out.append(logits)
    return out


def test_sealed_entry_restores_bit_exact_with_its_key(llama_prefill, ring, tmp_path):
    _, cache, _ = llama_prefill
    header = kvfile.save(tmp_path / "e.kvc", cache, PROMPT_TOKENS, {"namespace": "ns"}, keyring=ring)
    assert header.format_version == kvfile.SEALED_FORMAT_VERSION
    assert header.seal is not None and header.seal.key_id == ring.sealing.key_id
    entry = kvfile.load(tmp_path / "e.kvc", keyring=ring)
    assert entry.tokens == tuple(PROMPT_TOKENS)
    assert entry.header == header
    unverified = kvfile.load(tmp_path / "e.kvc", keyring=ring, verify=False)
    for restored in (entry.caches, unverified.caches):
        for live, back in zip(cache, restored, strict=True):
            rows = live.offset
            assert back.offset == rows
            assert mx.array_equal(live.keys[..., :rows, :], back.keys[..., :rows, :]).item()
            assert mx.array_equal(live.values[..., :rows, :], back.values[..., :rows, :]).item()
    summary = kvfile.read_header_summary(tmp_path / "e.kvc", disk=kvfile.RealDisk(), keyring=ring)
    assert summary.token_ids == header.token_ids
    assert kvfile.verify_file(tmp_path / "e.kvc", keyring=ring) == header


def test_sealed_entry_continues_with_identical_logits(llama_prefill, ring, tmp_path):
    model, cache, logits = llama_prefill
    kvfile.save(tmp_path / "e.kvc", cache, PROMPT_TOKENS, keyring=ring)
    first = kvfile.load(tmp_path / "e.kvc", keyring=ring)
    second = kvfile.load(tmp_path / "e.kvc", keyring=ring)
    for a, b in zip(_continue(model, first.caches, logits), _continue(model, second.caches, logits), strict=True):
        assert mx.array_equal(a, b).item()


def test_no_run_of_the_prompt_ids_in_a_sealed_file_and_the_scan_can_fail(llama_prefill, ring, tmp_path):
    _, cache, _ = llama_prefill
    kvfile.save(tmp_path / "plain.kvc", cache, PROMPT_TOKENS)
    kvfile.save(tmp_path / "sealed.kvc", cache, PROMPT_TOKENS, keyring=ring)
    assert token_runs_in((tmp_path / "plain.kvc").read_bytes(), PROMPT_TOKENS) > 0
    assert token_runs_in((tmp_path / "sealed.kvc").read_bytes(), PROMPT_TOKENS) == 0


def test_any_key_of_the_ring_opens_what_it_sealed(llama_prefill, ring, tmp_path):
    _, cache, _ = llama_prefill
    rotated = load_key_ring([tmp_path / "second.key", tmp_path / "first.key"])
    kvfile.save(tmp_path / "e.kvc", cache, PROMPT_TOKENS, keyring=ring)
    assert kvfile.load(tmp_path / "e.kvc", keyring=rotated).tokens == tuple(PROMPT_TOKENS)
    assert kvfile.save(tmp_path / "r.kvc", cache, PROMPT_TOKENS, keyring=rotated).seal.key_id == rotated.sealing.key_id


def test_a_missing_or_wrong_key_is_key_unavailable_naming_the_key(llama_prefill, ring, other_ring, tmp_path):
    _, cache, _ = llama_prefill
    kvfile.save(tmp_path / "e.kvc", cache, PROMPT_TOKENS, keyring=ring)
    for keyring in (None, other_ring):
        with pytest.raises(KeyUnavailable) as caught:
            kvfile.load(tmp_path / "e.kvc", keyring=keyring)
        assert caught.value.key_id == ring.sealing.key_id
        assert ring.sealing.key_id in str(caught.value)
        with pytest.raises(KeyUnavailable):
            kvfile.read_header_summary(tmp_path / "e.kvc", disk=kvfile.RealDisk(), keyring=keyring)


def test_unsealed_entries_still_read_with_a_ring(llama_prefill, ring, tmp_path):
    _, cache, _ = llama_prefill
    header = kvfile.save(tmp_path / "old.kvc", cache, PROMPT_TOKENS)
    assert header.format_version == kvfile.FORMAT_VERSION and header.seal is None
    assert kvfile.load(tmp_path / "old.kvc", keyring=ring).tokens == tuple(PROMPT_TOKENS)


def _rewrite_header(path: Path, edit) -> None:
    """Re-encode the on-disk header through `edit` with a valid xxh3 checksum: what a forger can do without the key."""
    data = bytearray(path.read_bytes())
    magic, version, length, _, payload_offset = struct.unpack_from("<8sIIQQ", data)
    header = edit(from_cbor(bytes(data[32 : 32 + length]), Header))
    header_bytes = to_cbor(header)
    assert len(header_bytes) == length
    unsigned = struct.pack("<8sIIQQ", magic, version, length, 0, payload_offset)
    digest = xxhash.xxh3_64_intdigest(unsigned + header_bytes)
    data[:32] = struct.pack("<8sIIQQ", magic, version, length, digest, payload_offset)
    data[32 : 32 + length] = header_bytes
    path.write_bytes(bytes(data))


def test_an_edited_header_fails_its_tag(llama_prefill, ring, tmp_path):
    import attrs

    _, cache, _ = llama_prefill
    kvfile.save(tmp_path / "e.kvc", cache, PROMPT_TOKENS, {"namespace": "alice"}, keyring=ring)
    _rewrite_header(tmp_path / "e.kvc", lambda h: attrs.evolve(h, namespace="bobby"))
    with pytest.raises(CorruptEntry) as caught:
        kvfile.load(tmp_path / "e.kvc", keyring=ring)
    assert caught.value.part == "header"


def test_a_header_swapped_onto_another_payload_fails(llama_prefill, ring, tmp_path):
    _, cache, _ = llama_prefill
    kvfile.save(tmp_path / "a.kvc", cache, PROMPT_TOKENS, keyring=ring)
    kvfile.save(tmp_path / "b.kvc", cache, PROMPT_TOKENS, keyring=ring)
    a, b = (tmp_path / "a.kvc").read_bytes(), (tmp_path / "b.kvc").read_bytes()
    payload_offset = struct.unpack_from("<8sIIQQ", a)[4]
    (tmp_path / "swapped.kvc").write_bytes(a[:payload_offset] + b[payload_offset:])
    with pytest.raises(CorruptEntry) as caught:
        kvfile.load(tmp_path / "swapped.kvc", keyring=ring, verify=False)
    assert caught.value.part.startswith("tensor ")


def test_a_flipped_payload_byte_fails_its_tag_even_unverified(llama_prefill, ring, tmp_path):
    _, cache, _ = llama_prefill
    header = kvfile.save(tmp_path / "e.kvc", cache, PROMPT_TOKENS, keyring=ring)
    data = bytearray((tmp_path / "e.kvc").read_bytes())
    data[next(header.tensor_records()).file_offset + 5] ^= 0x01
    (tmp_path / "e.kvc").write_bytes(bytes(data))
    for verify in (True, False):
        with pytest.raises(CorruptEntry, match="fails its tag"):
            kvfile.load(tmp_path / "e.kvc", keyring=ring, verify=verify)
    with pytest.raises(CorruptEntry, match="checksum mismatch"):
        kvfile.verify_file(tmp_path / "e.kvc", keyring=ring)  # the xxh3 of the ciphertext needs no key


def test_a_sealed_checkpoint_is_version_4_and_a_reader_of_version_3_refuses_it(
    llama_prefill, ring, tmp_path, monkeypatch
):
    from kvcellar.errors import UnsupportedFormat
    from kvcellar.store.records import GenerationCheckpoint, SamplerState

    _, cache, _ = llama_prefill
    checkpoint = GenerationCheckpoint(
        request_key="r",
        prompt_tokens=80,
        emitted_tokens=0,
        namespace="",
        pending_token=1,
        sampler=SamplerState(seed=None, sample_index=1),
    )
    writer = kvfile.KvFileWriter(
        tmp_path / "c.kvc", cache, PROMPT_TOKENS, generation_checkpoint=checkpoint, keyring=ring
    )
    kvfile.write_entry(writer)
    assert token_runs_in((tmp_path / "c.kvc").read_bytes(), PROMPT_TOKENS) == 0
    entry = kvfile.load(tmp_path / "c.kvc", keyring=ring)
    assert entry.header.format_version == kvfile.SEALED_CHECKPOINT_FORMAT_VERSION
    assert entry.header.generation_checkpoint == checkpoint and list(entry.tokens) == PROMPT_TOKENS
    with pytest.raises(KeyUnavailable):
        kvfile.load(tmp_path / "c.kvc")
    monkeypatch.setattr(
        kvfile,
        "READABLE_FORMAT_VERSIONS",
        frozenset({1, kvfile.CHECKPOINT_FORMAT_VERSION, kvfile.SEALED_FORMAT_VERSION}),
    )
    with pytest.raises(UnsupportedFormat, match="version 4"):
        kvfile.load(tmp_path / "c.kvc", keyring=ring)


def test_a_sealed_entry_is_refused_a_split_restore(llama_prefill, ring, tmp_path):
    from kvcellar.errors import RefusedCacheKind
    from kvcellar.store.disk import RealDisk
    from kvcellar.store.suffix_rows import read_suffix_rows

    _, cache, _ = llama_prefill
    kvfile.save(tmp_path / "e.kvc", cache, PROMPT_TOKENS, keyring=ring)
    with pytest.raises(RefusedCacheKind, match="sealed"):
        read_suffix_rows(RealDisk(), tmp_path / "e.kvc", 16, 32)


def test_a_failed_sealed_write_raises_and_leaves_no_temp_file(llama_prefill, ring, tmp_path):
    from kvcellar.errors import DiskError
    from kvcellar.store.disk import RealDisk

    class FailingDisk(RealDisk):
        """Fails the second payload write: the writer thread stops writing, the sealing thread goes on."""

        writes = 0

        def write_at(self, handle, offset, data):
            self.writes += 1
            if self.writes == 2:
                raise DiskError("no space left", errno=28)
            super().write_at(handle, offset, data)

    _, cache, _ = llama_prefill
    (tmp_path / "entries").mkdir()
    with pytest.raises(DiskError, match="no space"):
        kvfile.save(tmp_path / "entries" / "e.kvc", cache, PROMPT_TOKENS, disk=FailingDisk(), keyring=ring)
    assert list((tmp_path / "entries").iterdir()) == []


def test_kv_inspect_and_verify_open_a_sealed_entry_with_its_key(llama_prefill, ring, tmp_path, capsys):
    import json

    from kvcellar.cli import main

    _, cache, _ = llama_prefill
    kvfile.save(tmp_path / "e.kvc", cache, PROMPT_TOKENS, keyring=ring)
    key = ["--encryption-key-file", str(tmp_path / "first.key")]
    assert main(["kv", "inspect", "--json", str(tmp_path / "e.kvc"), *key]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["tokens"] == PROMPT_TOKENS and shown["seal"]["key_id"] == ring.sealing.key_id
    assert main(["kv", "verify", str(tmp_path / "e.kvc"), *key]) == 0
    assert main(["kv", "verify", str(tmp_path / "e.kvc")]) == 1
    assert ring.sealing.key_id in capsys.readouterr().err


class FailingWrite(RealDisk):
    """Fails the `fail_at`-th write with EIO (on the sealed save's writer thread)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.writes = 0

    def write_at(self, handle, offset, data):
        self.writes += 1
        if self.writes == self.fail_at:
            raise DiskError(f"write of {len(data)} bytes failed (injected)", errno=errno.EIO)
        return super().write_at(handle, offset, data)


@pytest.mark.parametrize("fail_at", [1, 3])
def test_a_failed_write_behind_the_sealing_fails_the_save_and_leaves_no_file(llama_prefill, ring, tmp_path, fail_at):
    # A sealed save writes on one helper thread while the next tensor is sealed: its error must
    # still fail the save, and the temp file go.
    _, cache, _ = llama_prefill
    disk = FailingWrite(fail_at)
    with pytest.raises(DiskError, match="injected"):
        kvfile.save(tmp_path / "e.kvc", cache, PROMPT_TOKENS, {"namespace": "ns"}, keyring=ring, disk=disk)
    assert list(tmp_path.glob("*.kvc*")) == [] and list(tmp_path.glob(".*")) == []
    assert disk.writes >= fail_at
