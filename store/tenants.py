"""The `serve --tenants FILE` configuration: who may call, under which namespace (issue 39).

A TOML file maps tenant names to their API keys and optional quotas:

    [tenants.alice]
    api_keys = ["sk-alice"]           # or api_key_sha256 = ["<64 hex digits>"]
    ram_gb = 2                        # optional: alice's share of the RAM prompt cache
    ssd_gb = 20                       # optional: alice's share of the SSD tier
    shared = false                    # optional: true makes alice's namespace readable by all

This module is pure (no I/O but `load_tenants`'s one read, no trio, no MLX). Keys are
kept only as sha256 digests, and a caller's key is matched against every digest with
`hmac.compare_digest` (no early exit), so neither the digest set nor the timing of a
lookup says which tenant, if any, a key belongs to. No message here ever holds a key.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from kvcellar.errors import BadNamespace, TenantsFileError
from kvcellar.store.namespaces import check_tenant_name, tenant_namespace

GB = 1_000_000_000
SHA256_HEX_PATTERN = re.compile(r"[0-9a-fA-F]{64}")
TENANT_FIELDS = frozenset({"api_keys", "api_key_sha256", "ram_gb", "ssd_gb", "shared"})


@attrs.frozen(kw_only=True)
class Tenant:
    """One caller identity: its name, its namespace and its quotas (None: no quota)."""

    name: str
    namespace: str
    ram_bytes_max: int | None = None
    ssd_bytes_max: int | None = None
    shared: bool = False


# The identity of a request on a server without `--tenants`: the default namespace,
# so caches written before tenants existed stay valid.
DEFAULT_TENANT = Tenant(name="", namespace="")


@attrs.frozen(kw_only=True)
class Tenants:
    """The parsed file: tenants by name and the sha256 digests of their keys."""

    tenants: tuple[Tenant, ...]
    key_digests: tuple[tuple[bytes, str], ...]  # (sha256 of a key, tenant name)

    def by_name(self, name: str) -> Tenant | None:
        return next((tenant for tenant in self.tenants if tenant.name == name), None)

    def tenant_for_key(self, key: str | None) -> Tenant | None:
        """The tenant whose key `key` is, or None. Compares against every digest in
        constant time per digest and never stops early."""
        if not key:
            return None
        supplied = hashlib.sha256(key.encode("utf-8")).digest()
        found: str | None = None
        for digest, name in self.key_digests:
            if hmac.compare_digest(supplied, digest):
                found = name
        return None if found is None else self.by_name(found)

    def ram_quotas(self) -> Mapping[str, int]:
        """Tenant name -> RAM bytes, for the tenants that have a RAM quota."""
        return {t.name: t.ram_bytes_max for t in self.tenants if t.ram_bytes_max is not None}

    def ssd_quotas(self) -> Mapping[str, int]:
        """Tenant name -> SSD bytes, for the tenants that have an SSD quota."""
        return {t.name: t.ssd_bytes_max for t in self.tenants if t.ssd_bytes_max is not None}

    def shared_namespaces(self) -> tuple[str, ...]:
        return tuple(t.namespace for t in self.tenants if t.shared)


def load_tenants(path: Path) -> Tenants:
    """Read and parse `path`; `TenantsFileError` names the file and the fix."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise TenantsFileError(f"{path}: cannot read the tenants file ({reason}), give a readable TOML file") from e
    return parse_tenants(text, source=str(path))


def parse_tenants(text: str, *, source: str = "<tenants>") -> Tenants:
    """Parse the TOML text of a tenants file; `TenantsFileError` says `<source>: <what>, <fix>`."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TenantsFileError(f"{source}: not valid TOML ({e}), fix the syntax") from e
    unknown = sorted(set(document) - {"tenants"})
    if unknown:
        raise TenantsFileError(f"{source}: unknown top-level field {unknown[0]!r}, only [tenants.NAME] tables belong")
    table = document.get("tenants")
    if not isinstance(table, dict) or not table:
        raise TenantsFileError(f"{source}: no tenants, add at least one [tenants.NAME] table with api_keys")
    tenants: list[Tenant] = []
    key_digests: list[tuple[bytes, str]] = []
    for name, fields in table.items():
        tenant, digests = _parse_tenant(name, fields, source)
        tenants.append(tenant)
        for digest in digests:
            owner = next((other for known, other in key_digests if known == digest), None)
            if owner is not None:
                raise TenantsFileError(
                    f"{source}: tenants {owner!r} and {name!r} share an API key, give each tenant its own keys"
                )
            key_digests.append((digest, name))
    return Tenants(tenants=tuple(tenants), key_digests=tuple(key_digests))


def _parse_tenant(name: str, fields: Any, source: str) -> tuple[Tenant, list[bytes]]:
    where = f"{source}: [tenants.{name}]"
    try:
        check_tenant_name(name)
    except BadNamespace as e:
        raise TenantsFileError(f"{source}: {e}") from e
    if not isinstance(fields, dict):
        raise TenantsFileError(f"{where} is not a table, write it as [tenants.{name}] with api_keys = [...]")
    unknown = sorted(set(fields) - TENANT_FIELDS)
    if unknown:
        raise TenantsFileError(f"{where}: unknown field {unknown[0]!r}, use {', '.join(sorted(TENANT_FIELDS))}")
    digests = _key_digests(fields, where)
    shared = fields.get("shared", False)
    if not isinstance(shared, bool):
        raise TenantsFileError(f"{where}: shared must be true or false")
    tenant = Tenant(
        name=name,
        namespace=tenant_namespace(name),
        ram_bytes_max=_quota_bytes(fields, "ram_gb", where),
        ssd_bytes_max=_quota_bytes(fields, "ssd_gb", where),
        shared=shared,
    )
    return tenant, digests


def _key_digests(fields: dict[str, Any], where: str) -> list[bytes]:
    plain = _string_list(fields, "api_keys", where)
    hashed = _string_list(fields, "api_key_sha256", where)
    if not plain and not hashed:
        raise TenantsFileError(f'{where}: no API key, add api_keys = ["..."] or api_key_sha256 = ["<hex>"]')
    digests = []
    for position, key in enumerate(plain):
        if not key:
            raise TenantsFileError(f"{where}: api_keys[{position}] is empty, give a non-empty key")
        digests.append(hashlib.sha256(key.encode("utf-8")).digest())
    for position, hex_digest in enumerate(hashed):
        # The message names the position only: a malformed digest may be a key pasted in the wrong field.
        if not SHA256_HEX_PATTERN.fullmatch(hex_digest):
            raise TenantsFileError(
                f"{where}: api_key_sha256[{position}] is not 64 hex digits, give sha256(key) as hex"
                " (e.g. printf %s KEY | sha256sum)"
            )
        digests.append(bytes.fromhex(hex_digest))
    if len(set(digests)) != len(digests):
        raise TenantsFileError(f"{where}: the same API key is listed twice, list each key once")
    return digests


def _string_list(fields: dict[str, Any], name: str, where: str) -> list[str]:
    value = fields.get(name, [])
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise TenantsFileError(f'{where}: {name} must be a list of strings, write {name} = ["..."]')
    return value


def _quota_bytes(fields: dict[str, Any], name: str, where: str) -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 or value == float("inf"):
        raise TenantsFileError(f"{where}: {name} = {value!r} is not a size, give a number of GB > 0 or leave it out")
    return int(value * GB)
