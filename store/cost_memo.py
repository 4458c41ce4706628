"""The restore cost model kept across restarts, beside the shard digest memo (issue 44).

One file, `restore-costs.cbor`, in the directory of the digest memo
(`serve`'s `<cache>/shard-digests`). It holds `CostModel`s, each with the key
it was measured under: the model (config and weight digests of the serving
fingerprint) and the device (its kind and chip), at most
`COST_MEMO_ENTRIES_MAX`, the most recently saved (so a model pool's models
keep theirs across loads and unloads). A start whose key is not there
calibrates afresh; a missing, malformed or foreign file is the same as none,
and so is one of a newer version (logged; the next save replaces it). A
version 1 file (one key, before issue 41's pools) reads as one entry. Saving
reads the file, puts the key last and writes it whole, atomically (temp,
fsync, rename, fsync of the directory), without a lock: two saves at once
(two processes, or a pool's model persisting at its close on a worker thread
while another persists on the engine thread) may lose one's update, which
costs that model one recalibration. Like the digest
memo it uses plain `os`/`pathlib`, not the store's `Disk`: it is not a KV
entry and needs no simulated durability.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

import attrs

from kvcellar.serialization import DecodeError, from_cbor, to_cbor
from kvcellar.store.disk import fsync_path
from kvcellar.store.fingerprint import ServingFingerprint
from kvcellar.store.restore_plan import CostModel

log = logging.getLogger(__name__)

COST_MEMO_FILE_NAME = "restore-costs.cbor"
COST_MEMO_FORMAT = "kvcellar-restore-costs"
COST_MEMO_VERSION = 2
# The keys (models x devices) whose costs the file keeps, the most recently saved.
COST_MEMO_ENTRIES_MAX = 16


@attrs.frozen(kw_only=True)
class CostKey:
    """What a measured cost model is valid for: this model on this device."""

    config_sha256: str
    weights_sha256: str
    device: str
    device_architecture: str

    @classmethod
    def of(cls, fingerprint: ServingFingerprint) -> CostKey:
        return cls(
            config_sha256=fingerprint.config_sha256,
            weights_sha256=fingerprint.weights_sha256,
            device=fingerprint.device,
            device_architecture=fingerprint.device_architecture,
        )

    @classmethod
    def of_fields(cls, fields: dict[str, str]) -> CostKey:
        """The key of a fingerprint as `ServingFingerprint.as_dict` (and `SsdStore.fingerprint_fields`) hold it."""
        return cls(
            config_sha256=fields.get("config_sha256", ""),
            weights_sha256=fields.get("weights_sha256", ""),
            device=fields.get("device", ""),
            device_architecture=fields.get("device_architecture", ""),
        )


@attrs.frozen(kw_only=True)
class _CostHeader:
    """What every version of the file starts with (the rest is read by version)."""

    format: str
    version: int


@attrs.frozen(kw_only=True)
class _CostFileV1:
    """Version 1: one key's costs."""

    format: str
    version: int
    key: CostKey
    model: CostModel


@attrs.frozen(kw_only=True)
class _CostEntry:
    key: CostKey
    model: CostModel


@attrs.frozen(kw_only=True)
class _CostFile:
    """Version 2: several keys' costs, the most recently saved last."""

    format: str
    version: int
    entries: tuple[_CostEntry, ...]


def _read_entries(path: Path) -> tuple[tuple[_CostEntry, ...], str | None]:
    """The file's entries, oldest saved first, and why none are usable when the file is there but unusable."""
    try:
        data = path.read_bytes()
        header = from_cbor(data, _CostHeader)
        if header.format != COST_MEMO_FORMAT:
            return (), f"is not a {COST_MEMO_FORMAT} file"
        if header.version == 1:
            v1 = from_cbor(data, _CostFileV1)
            return (_CostEntry(key=v1.key, model=v1.model),), None
        if header.version != COST_MEMO_VERSION:
            return (), (
                f"is version {header.version}, which this kvcellar (version {COST_MEMO_VERSION}) cannot read: "
                "ignored, and replaced at the next save"
            )
        return from_cbor(data, _CostFile).entries, None
    except FileNotFoundError:
        return (), None
    except (OSError, DecodeError, ValueError) as e:
        return (), f"unusable ({e})"


def load_costs(directory: Path, key: CostKey) -> CostModel | None:
    """The persisted cost model for `key`, or None (absent, unreadable, or none measured for this model and
    device); each None is one log line saying why and that the costs are calibrated afresh."""
    path = directory / COST_MEMO_FILE_NAME
    entries, unusable = _read_entries(path)
    model = next((entry.model for entry in entries if entry.key == key), None)
    if unusable is not None:
        log.info("restore cost memo %s %s: calibrating afresh", path, unusable)
    elif model is None and not entries:
        log.info("no restore cost memo at %s yet: calibrating afresh", path)
    elif model is None:
        log.info(
            "restore cost memo %s holds no costs for this model (weights %s) on this device (%s): calibrating afresh",
            path,
            key.weights_sha256[:12],
            key.device_architecture,
        )
    return model


def save_costs(directory: Path, key: CostKey, model: CostModel) -> bool:
    """Persist `model` under `key`, beside the other keys' costs (the `COST_MEMO_ENTRIES_MAX` most recently
    saved); returns whether it was written (a failure only costs a recalibration)."""
    path = directory / COST_MEMO_FILE_NAME
    temp = directory / f".{COST_MEMO_FILE_NAME}.{secrets.token_hex(4)}.tmp"
    others = [entry for entry in _read_entries(path)[0] if entry.key != key]
    entries = (*others[max(0, len(others) - (COST_MEMO_ENTRIES_MAX - 1)) :], _CostEntry(key=key, model=model))
    payload = to_cbor(_CostFile(format=COST_MEMO_FORMAT, version=COST_MEMO_VERSION, entries=entries))
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(temp, "wb") as file:
            file.write(payload)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
        fsync_path(directory)
    except OSError as e:
        log.warning("cannot write restore cost memo %s (costs are recalibrated next start): %s", path, e)
        temp.unlink(missing_ok=True)
        return False
    return True
