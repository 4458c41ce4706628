"""What a cache wipe removes (issue 39): the selector, pure.

A wipe names a set of namespaces and, optionally, a token prefix:

- `{"tenant": NAME}`: every namespace `belongs_to_tenant(ns, NAME)`, salted ones included;
- `{"tenant": NAME, "cache_salt": S}`: exactly `salted(tenant_namespace(NAME), S)`;
- `{"namespace": NS}`: exactly the namespace `NS` (`""`, the default namespace of a server
  without tenants, is the useful case; `cache_salt` splits it like a tenant's);
- any of these with `"prefix_tokens": [...]`: only the entries whose tokens start with them.

The selector keeps only namespace strings and a prefix's length and digest, never a salt or a
token id: what is journaled and written to the intent file is the salted namespace (the salt's
digest only) and the prefix's digest. No I/O, no trio, no MLX.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import xxhash

from kvcellar.errors import BadNamespace, BadRequest
from kvcellar.store.namespaces import belongs_to_tenant, check_tenant_name, salted, tenant_namespace

WIPE_FIELDS = ("tenant", "namespace", "cache_salt", "prefix_tokens")
# Token ids are uint32 in every tier.
TOKEN_ID_MAX = 0xFFFFFFFF


def prefix_digest(tokens: Sequence[int] | np.ndarray) -> str:
    """xxh3-128 (hex) of token ids as little-endian uint32: the journal's `tokens_digest`."""
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(np.asarray(tokens, dtype=np.int64), dtype="<u4").tobytes())


@attrs.frozen(kw_only=True)
class WipeSelector:
    """Exactly one of `tenant` (all its namespaces) and `namespace` (that one) is set.
    A prefix is held as its length and digest, never as token ids: the selector is
    journaled and written to the intent file, and neither may hold a prompt."""

    tenant: str | None = None
    namespace: str | None = None
    prefix_token_count: int | None = None
    prefix_digest: str | None = None

    def __attrs_post_init__(self) -> None:
        if (self.tenant is None) == (self.namespace is None):
            raise BadNamespace("a wipe selector names exactly one of a tenant and a namespace")
        if (self.prefix_token_count is None) != (self.prefix_digest is None):
            raise BadNamespace("a wipe selector's prefix has both a length and a digest, or neither")

    @classmethod
    def of(
        cls, *, tenant: str | None = None, namespace: str | None = None, prefix_tokens: Sequence[int] | None = None
    ) -> WipeSelector:
        if prefix_tokens is None:
            return cls(tenant=tenant, namespace=namespace)
        return cls(
            tenant=tenant,
            namespace=namespace,
            prefix_token_count=len(prefix_tokens),
            prefix_digest=prefix_digest(prefix_tokens),
        )

    def matches_namespace(self, namespace: str) -> bool:
        if self.tenant is not None:
            return belongs_to_tenant(namespace, self.tenant)
        return namespace == self.namespace

    def matches(self, namespace: str, tokens: Sequence[int] | np.ndarray) -> bool:
        """Whether the entry of `namespace` holding `tokens` is wiped by this selector."""
        if not self.matches_namespace(namespace):
            return False
        if self.prefix_token_count is None:
            return True
        if len(tokens) < self.prefix_token_count:
            return False
        return prefix_digest(tokens[: self.prefix_token_count]) == self.prefix_digest

    def to_record(self) -> dict[str, Any]:
        """The selector as plain data (the route's answer): only the fields set."""
        return {k: v for k, v in attrs.asdict(self).items() if v is not None}


def selector_from_body(body: Any) -> WipeSelector:
    """The selector a `POST /admin/cache/wipe` body asks for; `BadRequest` naming the field otherwise."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object", param=None)
    unknown = sorted(set(body) - set(WIPE_FIELDS))
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}; a wipe takes {', '.join(WIPE_FIELDS)}", param=unknown[0])
    if ("tenant" in body) == ("namespace" in body):
        raise BadRequest("name exactly one of 'tenant' and 'namespace'", param="tenant")
    base = _base_namespace(body)
    salt = body.get("cache_salt")
    if "cache_salt" in body:
        try:
            namespace: str | None = salted(base, salt)
        except BadNamespace as e:
            raise BadRequest(str(e), param="cache_salt") from e
        tenant = None
    else:
        namespace, tenant = (None, body["tenant"]) if "tenant" in body else (base, None)
    return WipeSelector.of(tenant=tenant, namespace=namespace, prefix_tokens=_prefix_tokens(body))


def _base_namespace(body: dict[str, Any]) -> str:
    if "tenant" in body:
        try:
            return tenant_namespace(check_tenant_name(body["tenant"]))
        except BadNamespace as e:
            raise BadRequest(str(e), param="tenant") from e
    namespace = body["namespace"]
    if not isinstance(namespace, str):
        raise BadRequest("'namespace' must be a string ('' is the default namespace)", param="namespace")
    return namespace


def _prefix_tokens(body: dict[str, Any]) -> tuple[int, ...] | None:
    if "prefix_tokens" not in body:
        return None
    tokens = body["prefix_tokens"]
    if (
        not isinstance(tokens, list)
        or not tokens
        or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= TOKEN_ID_MAX for t in tokens)
    ):
        raise BadRequest("'prefix_tokens' must be a non-empty list of token ids", param="prefix_tokens")
    return tuple(tokens)
