"""Cache namespaces: who may read, hit and evict an entry (issue 39).

Every tier keys its entries by a namespace string as well as by tokens: the RAM
prompt cache, the SSD tier (its directory is a hash of the namespace, its header
holds it), generation checkpoints, the shared tier's object keys and the KV
events. Two requests share cached KV only when their namespaces are equal. This
module is the one place that composes and reads those strings; it is pure (no
I/O, no trio, no MLX).

- `""` is the default namespace: a server without `--tenants` (with or without
  `--api-key`) keeps it, so caches written before tenants existed stay valid.
- A tenant's namespace is `tenant:<name>`. Names are restricted to
  `[A-Za-z0-9_.-]`, 1 to 64 characters, so a namespace cannot be forged from
  another tenant's name plus a separator.
- A `cache_salt` (vLLM's request field) splits a namespace further:
  `<namespace>|salt:<first 32 hex digits of sha256(salt)>`. The salt itself is
  never stored: headers and journal rows hold only its digest.

A wipe of a tenant removes every namespace `belongs_to_tenant` says is its own,
salted ones included; a wipe of one salt removes exactly `salted(tenant, salt)`.
"""

from __future__ import annotations

import hashlib
import re

from kvcellar.errors import BadNamespace

DEFAULT_NAMESPACE = ""
TENANT_PREFIX = "tenant:"
SALT_SEPARATOR = "|salt:"
SALT_DIGEST_HEX_CHARS = 32
TENANT_NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def check_tenant_name(name: str) -> str:
    """`name` when it is a valid tenant name, else `BadNamespace` naming the rule."""
    if not isinstance(name, str) or not TENANT_NAME_PATTERN.fullmatch(name):
        raise BadNamespace(f"tenant name {name!r} is not valid: use 1 to 64 of the characters A-Z a-z 0-9 _ . -")
    return name


def tenant_namespace(name: str) -> str:
    """The namespace of tenant `name` (no salt)."""
    return TENANT_PREFIX + check_tenant_name(name)


def salted(namespace: str, cache_salt: str | None) -> str:
    """`namespace` split by a request's `cache_salt`; unchanged when there is none. An empty
    salt is refused (`BadNamespace`): it is almost certainly a client bug, not a choice."""
    if cache_salt is None:
        return namespace
    if not isinstance(cache_salt, str) or not cache_salt:
        raise BadNamespace("cache_salt must be a non-empty string")
    digest = hashlib.sha256(cache_salt.encode("utf-8")).hexdigest()[:SALT_DIGEST_HEX_CHARS]
    return f"{namespace}{SALT_SEPARATOR}{digest}"


def base_of(namespace: str) -> str:
    """The namespace without its salt part."""
    return namespace.split(SALT_SEPARATOR, 1)[0]


def tenant_of(namespace: str) -> str | None:
    """The tenant a namespace belongs to, or None for the default namespace (and any
    namespace this module did not compose, such as an adapter's)."""
    base = base_of(namespace)
    if base.startswith(TENANT_PREFIX):
        return base[len(TENANT_PREFIX) :]
    return None


def belongs_to_tenant(namespace: str, name: str) -> bool:
    """Whether `namespace` is tenant `name`'s own, salted or not."""
    return tenant_of(namespace) == name


def owner_of(namespace: str) -> str:
    """The tenant an entry's bytes are billed to in a tier's per-tenant usage and quotas;
    "" for the default namespace (and any namespace no tenant owns)."""
    return tenant_of(namespace) or ""
