"""The restore cost model kept across restarts, beside the shard digest memo (issue 44).

One file, `restore-costs.cbor`, in the directory of the digest memo
(`serve`'s `<cache>/shard-digests`). It holds the `CostModel` with the key
it was measured under: the model (config and weight digests of the serving
fingerprint) and the device (its kind and chip). A start whose key differs
finds it invalidated and calibrates afresh; a missing, malformed or foreign
file is the same as none. Written atomically (temp, fsync, rename, fsync of
the directory). Like the digest memo it uses plain `os`/`pathlib`, not the
store's `Disk`: it is not a KV entry and needs no simulated durability.
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
COST_MEMO_VERSION = 1


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
class _CostFile:
    format: str
    version: int
    key: CostKey
    model: CostModel


def load_costs(directory: Path, key: CostKey) -> CostModel | None:
    """The persisted cost model for `key`, or None (absent, unreadable, or measured for another model or device)."""
    path = directory / COST_MEMO_FILE_NAME
    try:
        saved = from_cbor(path.read_bytes(), _CostFile)
    except FileNotFoundError:
        return None
    except (OSError, DecodeError, ValueError) as e:
        log.info("restore cost memo %s unusable, calibrating afresh: %s", path, e)
        return None
    if saved.format != COST_MEMO_FORMAT or saved.version != COST_MEMO_VERSION:
        return None
    if saved.key != key:
        log.info("restore cost memo %s was measured for another model or device: calibrating afresh", path)
        return None
    return saved.model


def save_costs(directory: Path, key: CostKey, model: CostModel) -> bool:
    """Persist `model` under `key`; returns whether it was written (a failure only costs a recalibration)."""
    path = directory / COST_MEMO_FILE_NAME
    temp = directory / f".{COST_MEMO_FILE_NAME}.{secrets.token_hex(4)}.tmp"
    payload = to_cbor(_CostFile(format=COST_MEMO_FORMAT, version=COST_MEMO_VERSION, key=key, model=model))
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
