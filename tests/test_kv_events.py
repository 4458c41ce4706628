"""KV events (store/kv_events.py, GET /v1/kv_events): replaying them rebuilds the resident set.

The core is checked by hypothesis over random stores, removals and clears in both media
(prefixes sharing blocks included), resuming from every sequence number and from behind
what is retained; the route against a real server with RAM evictions and SSD spills,
compared with /stats' `kv_events` (block counts and the sha256 of the sorted digests)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from polling import wait_until
from test_flush import _config, serving

from kvcellar.store.kv_events import KvEventLog, block_digests, replay, resident_sha256

BLOCK = 4

operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("store"),
            st.sampled_from(["RAM", "SSD"]),
            st.integers(0, 5),
            st.lists(st.integers(0, 3), max_size=14),
            st.sampled_from(["", "ns"]),
        ),
        st.tuples(st.just("remove"), st.sampled_from(["RAM", "SSD"]), st.integers(0, 5)),
        st.tuples(st.just("clear"), st.sampled_from(["RAM", "SSD"])),
    ),
    max_size=40,
)


def _apply(log: KvEventLog, operation: tuple[Any, ...]) -> None:
    if operation[0] == "store":
        _, medium, entry, tokens, namespace = operation
        log.entry_stored(medium, f"e{entry}", [7, 7, 7, *tokens], namespace)
    elif operation[0] == "remove":
        log.entry_removed(operation[1], f"e{operation[2]}")
    else:
        log.tier_cleared(operation[1])


def _as_sets(resident: dict[str, list[int]]) -> dict[str, set[int]]:
    return {medium: set(digests) for medium, digests in resident.items()}


@settings(max_examples=150, deadline=None)
@given(operations, st.integers(1, 8))
def test_replaying_from_any_sequence_rebuilds_the_resident_set(ops, retain):
    log = KvEventLog(block_size=BLOCK, retain=retain)
    states: dict[int, dict[str, set[int]]] = {0: _as_sets(log.resident())}
    for operation in ops:
        _apply(log, operation)
        states[log.sequence] = _as_sets(log.resident())
    final = _as_sets(log.resident())
    for since, state in states.items():
        events, reset = log.since(since)
        rebuilt = replay([e.as_json() for e in events], {m: set(s) for m, s in state.items()})
        assert rebuilt == final, (since, reset)
    # A reader that was never here (or is ahead: the server restarted) starts from a reset.
    events, reset = log.since(-1)
    assert reset and replay([e.as_json() for e in events]) == final
    assert log.since(log.sequence + 5)[1]


def test_digests_chain_over_whole_blocks_and_namespaces():
    tokens = list(range(10))
    digests = block_digests(tokens, 4)
    assert len(digests) == 2, "the partial last block is not published"
    assert block_digests(tokens[:8], 4) == digests and block_digests(tokens[:4], 4) == digests[:1]
    assert block_digests([99, *tokens[1:]], 4)[1] != digests[1], "a block's digest depends on its parents"
    assert block_digests(tokens, 4, "other")[0] != digests[0]
    log = KvEventLog(block_size=4)
    (first,) = log.entry_stored("RAM", "a", tokens[:8])
    (second,) = log.entry_stored("RAM", "b", tokens + [10, 11])
    assert first.block_hashes == tuple(digests) and first.parent_block_hash is None
    assert second.parent_block_hash == digests[1] and second.token_ids == (8, 9, 10, 11)
    (removed,) = log.entry_removed("RAM", "b")
    assert removed.block_hashes == second.block_hashes, "only the blocks no other entry holds"


def _parse_sse(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: ")]


async def _events_since(client: httpx.AsyncClient, since: int) -> list[dict[str, Any]]:
    reply = await client.get("/v1/kv_events", params={"since": since, "follow": "false"})
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    return _parse_sse(reply.text)


def test_the_route_replays_to_the_servers_resident_set(model_dir_factory, tmp_path):
    # A RAM tier of a few entries: puts evict, and write-behind spills them to SSD.
    config = _config(model_dir_factory("llama"), tmp_path, prompt_cache_bytes=300_000)

    async def main() -> None:
        async with serving(config) as (_, client):
            followed: list[dict[str, Any]] = []

            async def follow() -> None:
                async with client.stream("GET", "/v1/kv_events", headers={"Last-Event-ID": "0"}) as stream:
                    async for line in stream.aiter_lines():
                        if line.startswith("data: "):
                            followed.append(json.loads(line[len("data: ") :]))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(follow)
                resident: dict[str, set[int]] = replay(await _events_since(client, 0))
                sequence = 0
                for i in range(6):
                    prompt = f"session {i % 3}: a conversation about cellars and their tiers, turn {i}. " * 6
                    reply = await client.post(
                        "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0}
                    )
                    assert reply.status_code == 200, reply.text
                    events = await _events_since(client, sequence)
                    replay(events, resident)
                    sequence = events[-1]["sequence"] if events else sequence
                assert (await client.post("/admin/cache/flush", params={"timeout_s": "60"})).status_code == 200
                while True:
                    events = await _events_since(client, sequence)
                    replay(events, resident)
                    sequence = events[-1]["sequence"] if events else sequence
                    stats = (await client.get("/stats")).json()["kv_events"]
                    if stats["sequence"] == sequence:
                        break
                ram = (await client.get("/stats")).json()["prompt_cache"]
                assert stats["blocks_ssd"] > 0 and stats["blocks_ram"] > 0 and ram["evictions"] > 0, (stats, ram)
                assert {"BlockStored", "BlockRemoved"} <= {e["type"] for e in followed} | {
                    e["type"] for e in await _events_since(client, 0)
                }
                for medium, digests in resident.items():
                    assert len(digests) == stats[f"blocks_{medium.lower()}"]
                    assert resident_sha256(digests) == stats["resident_sha256"][medium]
                await wait_until(
                    lambda: bool(followed) and followed[-1]["sequence"] >= sequence,
                    what="the following stream caught up",
                )
                assert replay(followed) == resident
                nursery.cancel_scope.cancel()

    trio.run(main)
