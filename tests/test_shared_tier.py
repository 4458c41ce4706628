"""The shared cold tier (issue 20) against a real S3 API over HTTP on
127.0.0.1: moto's server mode, started here, through real boto3, with real
tiny models, real SSD directories, real SQLite journals and real hypercorn
servers. Faults come from the store itself (a deleted or replaced object, a
closed port) or from `FaultyProxy`, a real HTTP proxy in front of moto that
answers 5xx/503 SlowDown, stalls, or cuts a download short."""

from __future__ import annotations

import http.client
import socket
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs
import boto3
import httpx
import pytest
import trio
from moto.server import ThreadedMotoServer
from polling import wait_until
from test_flush import _config, serving

from kvcellar.actors.system import SystemConfig
from kvcellar.actors.uploader import SharedCacheConfig
from kvcellar.cli.serve import shared_cache_config
from kvcellar.errors import UsageError
from kvcellar.http.app import HttpSettings
from kvcellar.store.journal import Journal
from kvcellar.store.shared_tier import UploadPolicyConfig
from kvcellar.store.tenants import parse_tenants

FLUSH = "/admin/cache/flush"
PROMPT = "The shared system prompt of a fleet of servers, long enough to be worth sharing across them all. " * 6


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def bucket(moto_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    return _credentials_and_bucket(moto_url, monkeypatch)


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


def test_the_shared_tier_counts_the_draft_models_kv_it_moves(model_dir_factory, tmp_path, bucket, moto_url):
    """Speculative decoding (issue 42): the entries carry the draft's KV (the
    target is its own draft), the shared tier counts that share of what it
    uploads and downloads, and the second server restores the draft's KV
    with the target's instead of prefilling the draft again."""
    model_dir = model_dir_factory("llama")

    def config(ssd_name: str):
        shared = _shared(bucket, moto_url)
        return _config(model_dir, tmp_path, ssd_dir=tmp_path / ssd_name, shared_cache=shared, draft_model_dir=model_dir)

    async def main() -> None:
        async with serving(config("a")) as (_, client):
            cold = await _complete(client)
            await _share(client)
            uploaded = await _shared_stats(client)
            assert uploaded["uploads"] >= 1 and 0 < uploaded["upload_companion_bytes"] < uploaded["upload_bytes"]
            metrics = (await client.get("/metrics")).text
            assert (
                f"kvcellar_shared_cache_upload_companion_bytes_total {float(uploaded['upload_companion_bytes'])}"
                in metrics
            )
        async with serving(config("b")) as (_, client):
            warm = await _complete(client)
            assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
            stats = (await client.get("/stats")).json()
            downloaded = stats["shared_cache"]
            assert (
                downloaded["downloads"] == 1
                and 0 < downloaded["download_companion_bytes"] < downloaded["download_bytes"]
            )
            assert stats["speculative"]["companion_restored"] >= 1 and stats["speculative"]["draft_reprefills"] == {}

    trio.run(main)


# -- faults ---------------------------------------------------------------------

FAULT_PROMPTS = tuple(
    f"{word} opens this prompt, and every fleet server shares what follows it word for word. " * 3
    for word in ("Amber", "Basalt", "Cobalt", "Dune")
)


@attrs.frozen
class Seeded:
    """What a first server shared: every object's bytes, the keys each prompt
    added, and each prompt's cold greedy reply."""

    objects: dict[str, bytes]
    keys_by_prompt: tuple[tuple[str, ...], ...]
    cold_texts: tuple[str, ...]


@pytest.fixture(scope="module")
def seeded(model_dir_factory, tmp_path_factory, moto_url) -> Seeded:
    tmp_path = tmp_path_factory.mktemp("seed")
    with pytest.MonkeyPatch.context() as monkeypatch:
        name = _credentials_and_bucket(moto_url, monkeypatch)

        async def main() -> Seeded:
            config = _config(
                model_dir_factory("llama"), tmp_path, ssd_dir=tmp_path / "a", shared_cache=_shared(name, moto_url)
            )
            groups: list[tuple[str, ...]] = []
            texts: list[str] = []
            async with serving(config) as (_, client):
                for prompt in FAULT_PROMPTS:
                    before = set(_keys(moto_url, name))
                    texts.append((await _complete(client, prompt))["choices"][0]["text"])
                    await _share(client)
                    groups.append(tuple(sorted(set(_keys(moto_url, name)) - before)))
            s3 = _s3(moto_url)
            objects = {key: s3.get_object(Bucket=name, Key=key)["Body"].read() for key in _keys(moto_url, name)}
            return Seeded(objects=objects, keys_by_prompt=tuple(groups), cold_texts=tuple(texts))

        return trio.run(main)


def _credentials_and_bucket(moto_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
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


def _restock(moto_url: str, bucket: str, seeded: Seeded) -> None:
    s3 = _s3(moto_url)
    for key, data in seeded.objects.items():
        s3.put_object(Bucket=bucket, Key=key, Body=data)


def _second_server(model_dir: Path, tmp_path: Path, bucket: str, endpoint: str, **overrides: Any):
    shared = _shared(bucket, endpoint, download_min_gain_tokens=1, **overrides)
    shared = attrs.evolve(shared, upload=UploadPolicyConfig(min_tokens=10**9, hits_min=10**9))
    return serving(_config(model_dir, tmp_path, ssd_dir=tmp_path / "b", shared_cache=shared))


async def _shared_stats(client: httpx.AsyncClient) -> dict[str, Any]:
    return (await client.get("/stats")).json()["shared_cache"]


async def _refreshed(client: httpx.AsyncClient) -> None:
    stats: dict[str, Any] = {}

    async def poll() -> bool:
        stats.update(await _shared_stats(client))
        return stats["refreshes"] >= 1

    with trio.fail_after(60):
        while not await poll():
            await trio.sleep(0.01)


def test_bad_or_missing_shared_objects_are_never_restored(model_dir_factory, tmp_path, bucket, moto_url, seeded):
    """Prompt 0's objects corrupted (same size), prompt 1's objects deleted
    with their manifests left, prompt 2's manifests deleted with their objects
    left, prompt 3 intact: every request is served, only prompt 3 warm."""
    _restock(moto_url, bucket, seeded)
    s3 = _s3(moto_url)
    groups = seeded.keys_by_prompt
    for key in groups[0]:
        if key.endswith(".kvc"):
            data = bytearray(seeded.objects[key])
            data[len(data) // 2] ^= 0xFF
            s3.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    for key in groups[1]:
        if key.endswith(".kvc"):
            s3.delete_object(Bucket=bucket, Key=key)
    for key in groups[2]:
        if key.endswith(".manifest"):
            s3.delete_object(Bucket=bucket, Key=key)

    async def main() -> None:
        async with _second_server(model_dir_factory("llama"), tmp_path, bucket, moto_url) as (system, client):
            await _refreshed(client)
            replies = [await _complete(client, prompt) for prompt in FAULT_PROMPTS]
            for reply, cold_text in zip(replies, seeded.cold_texts, strict=True):
                assert reply["choices"][0]["text"] == cold_text
            cached = [reply["usage"]["prompt_tokens_details"]["cached_tokens"] for reply in replies]
            assert cached[:3] == [0, 0, 0]
            assert cached[3] >= replies[3]["usage"]["prompt_tokens"] - 1
            stats = await _shared_stats(client)
            assert (stats["downloads"], stats["refused"], stats["download_failures"]) == (1, 1, 1)
            quarantine = system.store.directory / "quarantine"
            assert len(list(quarantine.iterdir())) == 1
            assert system.store.stats()["quarantined"] == 1

    trio.run(main)


class FaultyProxy:
    """A real HTTP proxy in front of moto. `faults[(method, key part)]` is
    "slowdown" (503 SlowDown), "error500" (500 InternalError), "truncate" (the
    full Content-Length, half the body, then the connection closes) or
    "stall" (held until `release` is set)."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.faults: dict[tuple[str, str], str] = {}
        self.release = threading.Event()
        self.stalled = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _proxy_handler(self))
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def fault_for(self, method: str, path: str) -> str:
        return next((kind for (verb, part), kind in self.faults.items() if verb == method and part in path), "")

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def _proxy_handler(proxy: FaultyProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            return None

        def relay(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            kind = proxy.fault_for(self.command, self.path)
            if kind in ("slowdown", "error500"):
                code, status = ("SlowDown", 503) if kind == "slowdown" else ("InternalError", 500)
                self._answer(status, [("Content-Type", "application/xml")], _s3_error(code), len(_s3_error(code)))
                return
            if kind == "stall":
                proxy.stalled.set()
                proxy.release.wait(60)
            upstream = http.client.HTTPConnection(*proxy.upstream, timeout=60)
            headers = {name: value for name, value in self.headers.items() if name.lower() != "connection"}
            upstream.request(self.command, self.path, body=body, headers=headers)
            reply = upstream.getresponse()
            data = reply.read()
            kept = [(name, value) for name, value in reply.getheaders() if name.lower() not in _HOP_HEADERS]
            length = int(reply.getheader("Content-Length") or len(data))
            upstream.close()
            if kind == "truncate":
                data = data[: len(data) // 2]
                self.close_connection = True
            self._answer(reply.status, kept, data, length)

        def _answer(self, status: int, headers: list[tuple[str, str]], data: bytes, length: int) -> None:
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(length))
            self.end_headers()
            if self.command != "HEAD":
                try:
                    self.wfile.write(data)
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True  # the client gave up (its read timeout)

        do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = relay

    return Handler


_HOP_HEADERS = frozenset({"connection", "content-length", "transfer-encoding", "keep-alive"})


def _s3_error(code: str) -> bytes:
    return f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{code}</Message></Error>'.encode()


@pytest.fixture
def proxy(moto_url: str) -> Iterator[FaultyProxy]:
    faulty = FaultyProxy(moto_url)
    yield faulty
    faulty.close()


def _object_part(seeded: Seeded, prompt_index: int) -> str:
    """A part of the path of prompt `prompt_index`'s objects: their tokens digest."""
    keys = [key for key in seeded.keys_by_prompt[prompt_index] if key.endswith(".manifest")]
    return keys[0].rsplit("/", 2)[1]


def test_store_faults_never_block_serving_longer_than_the_timeout(
    model_dir_factory, tmp_path, bucket, moto_url, seeded, proxy
):
    """Through the proxy: prompt 0's object GETs answer 503 SlowDown, prompt
    1's 500, prompt 2's stream is cut short, prompt 3's stalls past the
    request's timeout. Each request is served cold; botocore's bounded
    retries give up, a cut stream keeps nothing, the stalled download
    finishes in the background once released and serves the next request."""
    _restock(moto_url, bucket, seeded)
    for index, kind in enumerate(("slowdown", "error500", "truncate")):
        for key in seeded.keys_by_prompt[index]:
            if key.endswith(".kvc"):
                proxy.faults[("GET", key.rsplit("/", 1)[1])] = kind
    for key in seeded.keys_by_prompt[3]:
        if key.endswith(".kvc"):
            proxy.faults[("GET", key.rsplit("/", 1)[1])] = "stall"

    async def main() -> None:
        server = _second_server(
            model_dir_factory("llama"), tmp_path, bucket, proxy.url, request_timeout_s=0.5, read_timeout_s=30
        )
        async with server as (system, client):
            await _refreshed(client)
            replies = [await _complete(client, prompt) for prompt in FAULT_PROMPTS]
            for reply, cold_text in zip(replies, seeded.cold_texts, strict=True):
                assert reply["choices"][0]["text"] == cold_text
                assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            counters = system.shared.counters
            # SlowDown's retries back off for longer than the request waits: it may end after its request.
            await wait_until(lambda: counters.download_failures == 3, what="three failed downloads")
            assert counters.download_timeouts >= 1 and counters.refused == 0 and counters.downloads == 0
            assert proxy.stalled.is_set()
            proxy.release.set()
            await wait_until(lambda: system.shared.counters.downloads == 1, what="the stalled download finishing")
            assert not any(path.name.endswith(".tmp") for path in system.store.directory.rglob("*"))
            warm = await _complete(client, FAULT_PROMPTS[3])
            assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= warm["usage"]["prompt_tokens"] - 1

    trio.run(main)


def _closed_port_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


@pytest.mark.parametrize("fault", ["unreachable", "throttled"])
def test_a_failing_store_never_stops_serving_and_the_shared_flush_says_so(
    model_dir_factory, tmp_path, bucket, proxy, fault
):
    """An unreachable store (a closed port), or one that throttles every
    upload (503 SlowDown on PUT): requests are served, the local flush is
    durable, the shared verdict is not, with the failures as its evidence."""
    if fault == "unreachable":
        endpoint = _closed_port_url()
    else:
        endpoint = proxy.url
        proxy.faults[("PUT", "/team/")] = "slowdown"

    async def main() -> None:
        config = _config(model_dir_factory("llama"), tmp_path, shared_cache=_shared(bucket, endpoint))
        async with serving(config) as (_, client):
            reply = await _complete(client)
            assert reply["choices"][0]["text"]
            flushed = await client.post(FLUSH, params={"shared": "true", "timeout_s": "60"})
            assert flushed.status_code == 503, flushed.text
            verdict = flushed.json()
            assert verdict["durable"] is True and verdict["shared_durable"] is False
            assert verdict["shared"]["reason"] == "failed" and verdict["shared"]["committed"] == 0
            assert verdict["shared"]["failed"] >= verdict["shared"]["entries"] >= 1
            stats = await _shared_stats(client)
            assert stats["upload_failures"] >= 1 and stats["uploads"] == 0
            assert (stats["listing_failures"] >= 1) == (fault == "unreachable")
            bad = await client.post(FLUSH, params={"shared": "maybe"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "shared"

    trio.run(main)


def test_the_serve_flags_check_the_url_and_need_the_ssd_tier(tmp_path):
    flags = dict(endpoint_url=None, min_tokens=5, bytes_per_day=7, request_timeout_s=2.0, refresh_s=9.0)
    assert shared_cache_config(None, tmp_path, **flags) is None
    with pytest.raises(UsageError, match="s3://BUCKET/PREFIX"):
        shared_cache_config("https://bucket/prefix", tmp_path, **flags)
    with pytest.raises(UsageError, match="--ssd-cache"):
        shared_cache_config("s3://bucket/prefix", None, **flags)
    config = shared_cache_config("s3://bucket/prefix", tmp_path, **{**flags, "endpoint_url": "http://127.0.0.1:9"})
    assert config is not None and (config.url, config.endpoint_url) == ("s3://bucket/prefix", "http://127.0.0.1:9")
    assert (config.upload.min_tokens, config.upload.bytes_per_day) == (5, 7)
    assert (config.request_timeout_s, config.refresh_s) == (2.0, 9.0)


# -- tenants ----------------------------------------------------------------------

SHARED_TENANTS = """
[tenants.common]
api_keys = ["sk-common"]
shared = true

[tenants.alice]
api_keys = ["sk-alice"]
"""


def test_a_shared_tenants_prefix_reaches_another_server_through_the_bucket(
    model_dir_factory, tmp_path, bucket, moto_url
):
    """Server A serves the `shared = true` tenant `common` and shares its prefix; server B has never
    seen it, and alice's request there downloads common's entry (a namespace alice may read) and
    reads it from the cache."""
    model_dir = model_dir_factory("llama")
    tenants = parse_tenants(SHARED_TENANTS)
    settings = HttpSettings(tenants=tenants)
    answers: list = []

    def config(name: str) -> SystemConfig:
        shared = _shared(bucket, moto_url)
        return _config(model_dir, tmp_path, ssd_dir=tmp_path / name, shared_cache=shared, tenants=tenants)

    async def complete(client: httpx.AsyncClient, key: str) -> dict[str, Any]:
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        reply = await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert reply.status_code == 200, reply.text
        return reply.json()

    async def main() -> None:
        async with serving(config("a"), settings=settings) as (_, client):
            answers.append(await complete(client, "sk-common"))
            await _share(client)
        async with serving(config("b"), settings=settings) as (_, client):
            answers.append(await complete(client, "sk-alice"))
            answers.append((await client.get("/stats")).json()["shared_cache"])

    trio.run(main)
    cold, warm, stats = answers
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= warm["usage"]["prompt_tokens"] - 1
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert stats["downloads"] == 1
