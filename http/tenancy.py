"""Who a request is: its API key names a tenant, the tenant a cache namespace (issue 39).

One lookup serves every API. A key comes as `Authorization: Bearer KEY` or as
`x-api-key: KEY` (Anthropic's header), on any route. Without `--api-key` and
`--tenants` every request is the default tenant (namespace ""); with
`--api-key` alone the one key is the default tenant, so caches and behaviour
stay what they were; with `--tenants FILE` the key selects its tenant
(store/tenants.py) and no key or an unknown one is refused. The tenant found
is kept on the request (`request.state.tenant`) for the route that serves it.

The request's `cache_salt` (vLLM's field) splits the tenant's namespace
further (`store.namespaces.salted`); a bad salt is a 400 naming `cache_salt`.
"""

from __future__ import annotations

import hmac
from typing import Any

from starlette.requests import Request

from kvcellar.errors import BadNamespace, BadRequest
from kvcellar.store.namespaces import salted
from kvcellar.store.tenants import DEFAULT_TENANT, Tenant, Tenants


def supplied_keys(request: Request) -> tuple[str, ...]:
    """The keys a request carries: the bearer token and the `x-api-key` header, when present."""
    keys = []
    authorization = request.headers.get("authorization", "")
    if authorization.startswith("Bearer "):
        keys.append(authorization[len("Bearer ") :])
    api_key = request.headers.get("x-api-key")
    if api_key:
        keys.append(api_key)
    return tuple(keys)


class Access:
    """The server's API keys: `tenant_for(request)` is the caller's tenant, or None (a 401)."""

    def __init__(self, *, api_key: str | None = None, tenants: Tenants | None = None) -> None:
        self.api_key = api_key or None
        self.tenants = tenants

    @property
    def open(self) -> bool:
        """Whether requests need no key at all."""
        return self.api_key is None and self.tenants is None

    def tenant_for(self, request: Request) -> Tenant | None:
        tenant = self._lookup(supplied_keys(request))
        if tenant is not None:
            request.state.tenant = tenant
        return tenant

    def _lookup(self, keys: tuple[str, ...]) -> Tenant | None:
        if self.open:
            return DEFAULT_TENANT
        for key in keys:
            if self.tenants is not None:
                tenant = self.tenants.tenant_for_key(key)
                if tenant is not None:
                    return tenant
            elif self.api_key is not None and hmac.compare_digest(key.encode(), self.api_key.encode()):
                return DEFAULT_TENANT
        return None


def request_tenant(request: Request) -> Tenant:
    """The tenant `Access.tenant_for` found for this request (the default one when unchecked)."""
    tenant = getattr(request.state, "tenant", None)
    return tenant if isinstance(tenant, Tenant) else DEFAULT_TENANT


def body_namespace(body: Any, namespace: str) -> str:
    """`namespace` split by the body's `cache_salt` when it has one; `BadRequest` naming
    `cache_salt` for an empty or non-string salt. The salt itself is never echoed."""
    if not isinstance(body, dict) or "cache_salt" not in body:
        return namespace
    try:
        return salted(namespace, body["cache_salt"])
    except BadNamespace:
        raise BadRequest("'cache_salt' must be a non-empty string", param="cache_salt") from None
