"""Issue 38, items 3 and 4: a long prefill never looks dead, and a client that
leaves stops its work. A real hypercorn server on 127.0.0.1 over a real
system and a tiny MLX model, on both lanes. The prefill is made long
deterministically through the system's `prefill_chunk_hook` seam, which holds
the engine thread between two prefill chunks until the test lets it go:
every order below is read from observable state (`/stats`, the seam's own
record), never from the wall clock."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
import trio
from polling import wait_until, wait_until_sync
from test_http_errors import InProcessServer
from test_serve import Server

from kvcellar.actors.system import SystemConfig, SystemSeams
from kvcellar.http.app import HttpSettings

STEP_TOKENS = 16
PROMPT = "The cellar keeps every prefix it has computed, row after row. " * 30
# Keep-alives come this often in these tests, so several arrive while a prefill is held.
KEEPALIVE_S = 0.02


class PrefillGate:
    """The `prefill_chunk_hook` seam: records every progress report and holds
    the engine thread at the `hold_at`-th report of the first prefill of at
    least `tokens_min` tokens, until `release()`."""

    def __init__(self, hold_at: int, tokens_min: int = 200) -> None:
        self.hold_at = hold_at
        self.tokens_min = tokens_min
        self.reports: list[tuple[int, int]] = []
        self.held_at: tuple[int, int] | None = None
        self.held = threading.Event()
        self._released = threading.Event()

    def __call__(self, tokens_done: int, tokens_total: int) -> None:
        if tokens_total < self.tokens_min:
            return
        self.reports.append((tokens_done, tokens_total))
        if len(self.reports) == self.hold_at and not self.held.is_set():
            self.held_at = (tokens_done, tokens_total)
            self.held.set()
            assert self._released.wait(120), "the test never released the prefill"

    def release(self) -> None:
        self._released.set()


class GatedServer(InProcessServer):
    """An in-process server whose exit releases the gate first (a failed test
    leaves no engine thread held)."""

    def __init__(self, config: SystemConfig, gate: PrefillGate) -> None:
        super().__init__(config, SystemSeams(prefill_chunk_hook=gate), HttpSettings(keepalive_interval_s=KEEPALIVE_S))
        self.gate = gate

    def __exit__(self, *exc: object) -> None:
        self.gate.release()
        super().__exit__(*exc)


def _server(rows: int, gate: PrefillGate, **config: Any) -> GatedServer:
    system_config = SystemConfig(
        model_dir=config.pop("model_dir"), batch_rows_max=rows, prefill_step_tokens=STEP_TOKENS, **config
    )
    return GatedServer(system_config, gate)


def _stats(server: InProcessServer) -> dict:
    return httpx.get(f"{server.base}/stats", timeout=30).json()


def _in_flight(server: InProcessServer) -> list[dict]:
    return _stats(server)["prefill"]["in_flight"]


# Each API's route, body fields, keep-alive line and the line that ends its stream.
STREAMS = {
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4},
        ": keep-alive",
        "data: [DONE]",
    ),
    "completions": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4}, ": keep-alive", "data: [DONE]"),
    "responses": (
        "/v1/responses",
        {"input": PROMPT, "max_output_tokens": 4},
        ": keep-alive",
        "event: response.incomplete",
    ),
    "messages": (
        "/v1/messages",
        {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4},
        "event: ping",
        "event: message_stop",
    ),
}


@pytest.mark.parametrize("api", sorted(STREAMS))
def test_keepalives_arrive_while_a_long_prefill_runs_and_progress_shows(model_dir_factory, api):
    path, fields, keepalive, end = STREAMS[api]
    gate = PrefillGate(hold_at=3)
    with _server(1, gate, model_dir=model_dir_factory("llama")) as server:
        body = {"model": server.config.model_dir.name, "temperature": 0, "stream": True, **fields}
        with httpx.stream("POST", f"{server.base}{path}", json=body, timeout=60) as response:
            assert response.status_code == 200, response.read()
            lines = response.iter_lines()
            keepalives = 0
            for line in lines:
                keepalives += line == keepalive
                if keepalives >= 3 and gate.held.is_set():
                    break
            # The prefill is held between two chunks: its progress is in /stats.
            (row,) = _in_flight(server)
            assert row["tokens_done"] == gate.held_at[0] > 0
            assert row["tokens_total"] == gate.held_at[1] > row["tokens_done"]
            gate.release()
            rest = [line for line in lines if line]
        assert end in rest, rest[-3:]
        assert _in_flight(server) == []
        assert _stats(server)["prefill"]["cancelled"] == 0


def _send_raw(port: int, path: str, body: dict) -> socket.socket:
    """A request on a plain socket, so the test decides when the client leaves."""
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"x-api-key: unused\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    connection = socket.create_connection(("127.0.0.1", port), timeout=60)
    connection.sendall(head + payload)
    return connection


def _leave_mid_prefill(server: InProcessServer, gate: PrefillGate, path: str, body: dict) -> None:
    """Send `body`, wait until its prefill is held, leave, and wait until the
    server saw the departure (the request's progress row is gone)."""
    connection = _send_raw(server.port, path, body)
    assert gate.held.wait(60), "the prefill never reached the held chunk"
    assert len(_in_flight(server)) == 1
    connection.close()
    wait_until_sync(lambda: _in_flight(server) == [], what="the server saw the client leave")


# Lane rows, streamed or not, and the KV the engine holds: as the model makes it, or quantized (a kept
# prefix is converted as any put is; the medium llama's 64-wide heads fit KV8's groups, the tiny one's do not).
DEPARTURES = [
    pytest.param(rows, stream, kv_quant, size, id=f"{lane}-{'streaming' if stream else 'not-streaming'}-{kv_id}")
    for rows, lane in ((1, "serial"), (4, "batch"))
    for stream, kv_quant, size, kv_id in ((True, "bf16", "tiny", "kv-model"), (False, "bf16", "tiny", "kv-model"))
    + ((False, "8", "medium", "kv8"),)
]


@pytest.mark.parametrize("rows, stream, kv_quant, size", DEPARTURES)
def test_a_client_leaving_mid_prefill_stops_it_and_its_retry_reads_the_prefix(
    model_dir_factory, rows, stream, kv_quant, size
):
    gate = PrefillGate(hold_at=4)
    with _server(rows, gate, model_dir=model_dir_factory("llama", size), kv_quant=kv_quant) as server:
        model = server.config.model_dir.name
        body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": stream}
        _leave_mid_prefill(server, gate, "/v1/completions", body)
        reports_at_release = len(gate.reports)
        gate.release()
        wait_until_sync(lambda: _stats(server)["prefill"]["cancelled"] == 1, what="the prefill was stopped")
        prefill = _stats(server)["prefill"]
        done, total = gate.held_at
        if rows == 1:
            # The serial lane checks before every chunk: the held one never ran.
            assert prefill["kept_tokens"] == done
            assert len(gate.reports) == reports_at_release
        else:
            # The batch lane sees the cancel at its next turn: at most a chunk more, far from the end.
            assert done <= prefill["kept_tokens"] <= done + STEP_TOKENS
        assert prefill["kept_tokens"] < total
        retry = httpx.post(f"{server.base}/v1/completions", json={**body, "stream": False}, timeout=60).json()
        assert retry["usage"]["prompt_tokens"] == total
        assert retry["usage"]["prompt_tokens_details"]["cached_tokens"] == prefill["kept_tokens"]


def test_a_messages_client_leaving_mid_prefill_gets_its_prefix_on_the_sdk_retry(model_dir_factory):
    """Claude Code's case: a non-streaming Messages request abandoned mid-prefill, then sent again."""
    gate = PrefillGate(hold_at=3)
    with _server(4, gate, model_dir=model_dir_factory("llama")) as server:
        messages = [{"role": "user", "content": PROMPT}]
        body = {"model": server.config.model_dir.name, "max_tokens": 4, "messages": messages}
        _leave_mid_prefill(server, gate, "/v1/messages", body)
        gate.release()
        wait_until_sync(lambda: _stats(server)["prefill"]["cancelled"] == 1, what="the prefill was stopped")
        kept = _stats(server)["prefill"]["kept_tokens"]
        assert kept >= gate.held_at[0] > 0
        client = anthropic.Anthropic(base_url=server.base, api_key="unused", max_retries=0, timeout=120)
        reply = client.messages.create(model=server.config.model_dir.name, max_tokens=4, messages=messages)
        assert reply.usage.cache_read_input_tokens == kept


def test_shutdown_does_not_wait_on_an_orphan_and_makes_its_prefix_durable(model_dir_factory, tmp_path):
    gate = PrefillGate(hold_at=3)
    config = {"model_dir": model_dir_factory("llama"), "ssd_dir": tmp_path / "ssd", "shutdown_timeout_s": 600.0}
    with _server(1, gate, **config) as server:
        model = server.config.model_dir.name
        body = {"model": model, "prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "stream": True}
        _leave_mid_prefill(server, gate, "/v1/completions", body)
        reports_at_release = len(gate.reports)

        async def shutdown_with_the_prefill_held(system):
            async with trio.open_nursery() as nursery:
                verdicts = []

                async def shut_down() -> None:
                    verdicts.append(await system.shutdown())

                nursery.start_soon(shut_down)
                # Admission is stopped and the drain waits on the held orphan: let it go.
                await wait_until(lambda: not system.admitting, what="the shutdown stopped admission")
                gate.release()
            return verdicts[0]

        verdict = server.run(shutdown_with_the_prefill_held)
        assert (verdict.durable, verdict.reason) == (True, "")
        assert len(gate.reports) == reports_at_release
        prefill = server.system.prefill_progress
        assert (prefill.cancelled, prefill.kept_tokens) == (1, gate.held_at[0])
        assert server.system.store.longest_entry_tokens() == gate.held_at[0]


def counting_client(http: Any, marker: bytes, seen: Callable[[int], None]) -> Any:
    """An `http.Client` (httpx for the openai SDK, httpx2 for the anthropic
    one) over a real transport whose response bodies are counted for `marker`
    as the SDK reads them; `seen(count)` hears every chunk."""

    class CountingStream(http.SyncByteStream):
        def __init__(self, stream: Any) -> None:
            self._stream, self._count = stream, 0

        def __iter__(self):
            for chunk in self._stream:
                self._count += chunk.count(marker)
                seen(self._count)
                yield chunk

        def close(self) -> None:
            self._stream.close()

    class CountingTransport(http.HTTPTransport):
        def handle_request(self, request: Any) -> Any:
            response = super().handle_request(request)
            response.stream = CountingStream(response.stream)
            return response

    return http.Client(transport=CountingTransport(), timeout=120)


def _sdk_text(api: str, server: InProcessServer, seen: Callable[[int], None] | None = None) -> str:
    """The reply's text through the API's official SDK, streamed; `seen` counts the keep-alives on the wire."""
    model = server.config.model_dir.name
    messages = [{"role": "user", "content": PROMPT}]
    marker = b"event: ping" if api == "messages" else b": keep-alive"
    http = httpx2 if api == "messages" else httpx
    http_client = counting_client(http, marker, seen or (lambda _: None))
    if api == "messages":
        claude = anthropic.Anthropic(base_url=server.base, api_key="unused", max_retries=0, http_client=http_client)
        events = claude.messages.create(
            model=model, max_tokens=4, messages=messages, stream=True, extra_body={"temperature": 0}
        )
        return "".join(getattr(event.delta, "text", "") for event in events if event.type == "content_block_delta")
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, http_client=http_client)
    if api == "chat":
        chunks = client.chat.completions.create(
            model=model, max_tokens=4, temperature=0, messages=messages, stream=True
        )
        return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    events = client.responses.create(model=model, max_output_tokens=4, temperature=0, input=PROMPT, stream=True)
    return "".join(event.delta for event in events if event.type == "response.output_text.delta")


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_the_official_sdks_read_through_keepalives(model_dir_factory, api):
    """The SDK reads a stream that had keep-alives in it during the held
    prefill (counted on the wire) and gets the reply the same request gets
    without them."""
    gate = PrefillGate(hold_at=2)

    def seen(count: int) -> None:
        if count >= 3 and gate.held.is_set():
            gate.release()

    with _server(1, gate, model_dir=model_dir_factory("llama")) as server:
        text = _sdk_text(api, server, seen)
        assert gate.held.is_set()
        # The prefix is cached now: the same request again has no prefill to hold, no keep-alives to skip.
        assert _sdk_text(api, server) == text


def test_sigterm_with_an_orphan_mid_prefill_exits_cleanly_and_durable(model_dir_factory, tmp_path):
    """`kvcellar serve` itself, a real SIGTERM: a client leaves a long prefill
    (one-token chunks), the server is told to stop; it exits 0 and its
    shutdown flush says durable, not timeout."""
    running = Server(
        model_dir_factory("llama"),
        *("--ssd-cache", str(tmp_path), "--prefill-step-size", "1", "--batch", "1"),
        env={"KVCELLAR_SHUTDOWN_TIMEOUT_S": "600"},
    )
    try:
        body = {"model": running.model_id, "prompt": PROMPT * 6, "max_tokens": 64, "temperature": 0}
        connection = _send_raw(running.port, "/v1/completions", body)

        def prefilling() -> bool:
            rows = httpx.get(f"{running.base}/stats", timeout=30).json()["prefill"]["in_flight"]
            return any(row["tokens_done"] > 0 for row in rows)

        wait_until_sync(prefilling, what="the prefill began")
        connection.close()
        wait_until_sync(
            lambda: httpx.get(f"{running.base}/stats", timeout=30).json()["prefill"]["in_flight"] == [],
            what="the server saw the client leave",
        )
        status, output = running.stop()
        assert status == 0, output
        assert "shutdown flush: {'durable': True, 'reason': ''" in output, output
        assert "not made durable" not in output, output
    finally:
        running.kill()


def test_a_client_leaving_while_queued_for_the_serial_lane_leaves_no_orphan(model_dir_factory):
    """A request waiting behind a held prefill whose client leaves is taken off
    the queue: the lane goes on to the next request, and shutdown drains."""
    gate = PrefillGate(hold_at=2)
    with _server(1, gate, model_dir=model_dir_factory("llama")) as server:
        model = server.config.model_dir.name
        first = _send_raw(server.port, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2})
        assert gate.held.wait(60), "the first prefill never reached the held chunk"
        queued = _send_raw(server.port, "/v1/completions", {"model": model, "prompt": "queued", "max_tokens": 2})
        wait_until_sync(lambda: _stats(server)["gateway"]["waiting"] == 1, what="the second request queued")
        queued.close()
        wait_until_sync(lambda: _stats(server)["gateway"]["waiting"] == 0, what="the queued request was withdrawn")
        gate.release()
        assert first.recv(12) == b"HTTP/1.1 200"
        first.close()
        body = {"model": model, "prompt": "after the orphan", "max_tokens": 2}
        assert httpx.post(f"{server.base}/v1/completions", json=body, timeout=60).status_code == 200
        assert _stats(server)["requests"]["cancelled"] == 1
