"""The shared cold tier (issue 20) against a real S3 API over HTTP on
127.0.0.1: moto's server mode, started here, through real boto3, with real
tiny models, real SSD directories, real SQLite journals and real hypercorn
servers. Faults come from the store itself (a deleted or replaced object, a
closed port) or from `FaultyProxy`, a real HTTP proxy in front of moto that
answers 5xx/503 SlowDown, stalls, or cuts a download short."""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
import trio
from moto.server import ThreadedMotoServer
from polling import wait_until
from test_flush import _config, serving

from kvcellar.actors.uploader import SharedCacheConfig
from kvcellar.store.journal import Journal
from kvcellar.store.shared_tier import UploadPolicyConfig

FLUSH = "/admin/cache/flush"
PROMPT = "The shared system prompt of a fleet of servers, long enough to be worth sharing across them all. " * 3


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def bucket(moto_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    name = f"kvc-{uuid.uuid4().hex[:12]}"
    _s3(moto_url).create_bucket(Bucket=name)
    return name


def _s3(endpoint: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


def _keys(endpoint: str, bucket: str) -> list[str]:
    listed = _s3(endpoint).list_objects_v2(Bucket=bucket)
    return sorted(item["Key"] for item in listed.get("Contents", ()))


def _shared(bucket: str, endpoint: str, **overrides: Any) -> SharedCacheConfig:
    values: dict[str, Any] = dict(
        url=f"s3://{bucket}/team",
        endpoint_url=endpoint,
        refresh_s=3600,
        request_timeout_s=20,
        connect_timeout_s=1,
        read_timeout_s=5,
        max_attempts=2,
        retry_s=0.05,
        idle_poll_s=0.01,
        upload=UploadPolicyConfig(min_tokens=1),
    )
    values.update(overrides)
    return SharedCacheConfig(**values)


async def _complete(client: httpx.AsyncClient, prompt: str = PROMPT) -> dict[str, Any]:
    reply = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()


async def _share(client: httpx.AsyncClient) -> dict[str, Any]:
    reply = await client.post(FLUSH, params={"shared": "true", "timeout_s": "60"})
    assert reply.status_code == 200, reply.text
    verdict = reply.json()
    assert verdict["durable"] is True and verdict["shared_durable"] is True
    return verdict


async def _first_server_shares(model_dir: Path, tmp_path: Path, bucket: str, endpoint: str) -> dict[str, Any]:
    """Server A: a cold run, shared with `?shared=true`; returns its reply."""
    config = _config(model_dir, tmp_path, ssd_dir=tmp_path / "a", shared_cache=_shared(bucket, endpoint))
    async with serving(config) as (_, client):
        cold = await _complete(client)
        verdict = await _share(client)
        assert verdict["shared"]["uploaded"] >= 1 and verdict["shared"]["committed"] == verdict["shared"]["entries"]
        stats = (await client.get("/stats")).json()["shared_cache"]
        assert stats["uploads"] >= 1 and stats["upload_bytes"] > 0 and stats["objects"] >= 1
    return cold


def test_a_second_server_restores_what_the_first_shared(model_dir_factory, tmp_path, bucket, moto_url):
    model_dir = model_dir_factory("llama")

    async def main() -> None:
        cold = await _first_server_shares(model_dir, tmp_path, bucket, moto_url)
        keys = _keys(moto_url, bucket)
        assert keys and all(key.startswith("team/") for key in keys)
        manifests = [key for key in keys if key.endswith(".manifest")]
        assert len(manifests) == len([key for key in keys if key.endswith(".kvc")]) >= 1
        config = _config(model_dir, tmp_path, ssd_dir=tmp_path / "b", shared_cache=_shared(bucket, moto_url))
        async with serving(config) as (system, client):
            warm = await _complete(client)
            usage = warm["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1
            assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
            stats = (await client.get("/stats")).json()
            assert stats["shared_cache"]["downloads"] == 1 and stats["shared_cache"]["refused"] == 0
            assert stats["ssd_cache"]["restores"] >= 1
            metrics = (await client.get("/metrics")).text
            assert "kvcellar_shared_cache_downloads_total 1.0" in metrics
            journal = system.store.journal
            assert journal is not None
            await trio.to_thread.run_sync(journal.wait_applied, 10)
        events = Journal.open_readonly(tmp_path / "b" / system.store.fingerprint / "journal.sqlite")
        kinds = [record.kind for record in events.events()]
        assert "shared.downloaded" in kinds

    trio.run(main)
