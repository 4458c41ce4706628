"""A wipe's shared-tier part (issue 39 part 3) against moto's S3 server over HTTP: a tenant's
manifests and objects are deleted, another namespace's stay."""

from __future__ import annotations

import trio
from test_flush import _config, serving
from test_shared_tier import _complete, _keys, _share, _shared, bucket, moto_url  # noqa: F401 (fixtures)
from test_wipe_serve import _put_tenant_entries

from kvcellar.store.namespaces import salted, tenant_namespace
from kvcellar.store.ssd import namespace_dir_name

ALICE = tenant_namespace("alice")


def test_a_wipe_deletes_the_tenants_shared_objects_and_keeps_the_others(model_dir_factory, tmp_path, bucket, moto_url):  # noqa: F811
    config = _config(model_dir_factory("llama"), tmp_path, shared_cache=_shared(bucket, moto_url))
    answers: list = []

    async def main() -> None:
        async with serving(config) as (system, client):
            await _complete(client)
            await system.engine.call(lambda loaded: _put_tenant_entries(loaded, system), label="test")
            await _share(client)
            answers.append(_keys(moto_url, bucket))
            answers.append(await client.post("/admin/cache/wipe", json={"tenant": "alice"}))

    trio.run(main)
    before, wiped = answers
    alice_dirs = [f"/{namespace_dir_name(ns)}/" for ns in (ALICE, salted(ALICE, "s"))]
    default_dir = f"/{namespace_dir_name('')}/"
    assert all(any(d in key for key in before) for d in alice_dirs) and any(default_dir in key for key in before)
    assert wiped.status_code == 200, wiped.text
    assert wiped.json()["removed"]["shared"]["entries"] >= 1
    after = _keys(moto_url, bucket)
    assert not any(d in key for d in alice_dirs for key in after), "the tenant's manifests and objects are gone"
    assert [key for key in before if default_dir in key] == [key for key in after if default_dir in key]
