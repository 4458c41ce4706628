"""The namespace contract (store/namespaces.py): tenants and salts compose namespaces that never collide."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcellar.errors import BadNamespace
from kvcellar.store.namespaces import (
    DEFAULT_NAMESPACE,
    base_of,
    belongs_to_tenant,
    salted,
    tenant_namespace,
    tenant_of,
)

names = st.from_regex(r"[A-Za-z0-9_.-]{1,64}", fullmatch=True)


@given(names, names, st.none() | st.text(min_size=1), st.none() | st.text(min_size=1))
def test_namespaces_of_different_tenants_or_salts_differ(a, b, salt_a, salt_b):
    ns_a, ns_b = salted(tenant_namespace(a), salt_a), salted(tenant_namespace(b), salt_b)
    assert (ns_a == ns_b) == (a == b and salt_a == salt_b)
    assert tenant_of(ns_a) == a and belongs_to_tenant(ns_a, a)
    assert belongs_to_tenant(ns_b, a) == (a == b)
    assert base_of(ns_a) == tenant_namespace(a)


@given(st.text(min_size=1))
def test_the_salt_itself_is_never_in_the_namespace(salt):
    namespace = salted(tenant_namespace("alice"), salt)
    prefix, digest = namespace.split("|salt:")
    assert prefix == "tenant:alice" and len(digest) == 32 and set(digest) <= set("0123456789abcdef")


def test_the_default_namespace_belongs_to_no_tenant():
    assert tenant_of(DEFAULT_NAMESPACE) is None
    assert tenant_of(salted(DEFAULT_NAMESPACE, "s")) is None
    assert salted(DEFAULT_NAMESPACE, None) == DEFAULT_NAMESPACE


@pytest.mark.parametrize("name", ["", "a|salt:b", "a b", "x" * 65, "tenant:a", "ü"])
def test_a_bad_tenant_name_is_refused_with_the_rule(name):
    with pytest.raises(BadNamespace, match="A-Z a-z 0-9"):
        tenant_namespace(name)


def test_an_empty_salt_is_refused():
    with pytest.raises(BadNamespace, match="cache_salt"):
        salted(tenant_namespace("a"), "")
