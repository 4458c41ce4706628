"""`kvcellar serve --paged-kv`: a real hypercorn server on 127.0.0.1 with a tiny
model, its /stats pool, prefix reuse through the tier boundary, and the
start-up refusals (spec §6.3)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import trio
from test_serve import Server

from kvcellar.cli import main


def test_a_paged_server_batches_mixed_rows_reuses_prefixes_and_shows_its_pool(model_dir_factory, tmp_path):
    server = Server(
        model_dir_factory("llama"), "--paged-kv", "--paged-kv-block-size", "16", "--ssd-cache", str(tmp_path / "ssd")
    )
    try:
        prompts = ["a long prompt about cellars and caches " * 12, "short one", "a middling prompt " * 3, "tiny"]

        async def concurrently():
            async with httpx.AsyncClient(timeout=120) as client:
                replies = [None] * len(prompts)

                async def one(i):
                    body = {"prompt": prompts[i], "max_tokens": 8, "temperature": 0}
                    replies[i] = (await client.post(f"{server.base}/v1/completions", json=body)).json()

                async with trio.open_nursery() as nursery:
                    for i in range(len(prompts)):
                        nursery.start_soon(one, i)
                return replies

        replies = trio.run(concurrently)
        assert all(reply["usage"]["completion_tokens"] == 8 for reply in replies)
        again = httpx.post(
            f"{server.base}/v1/completions", json={"prompt": prompts[0], "max_tokens": 8, "temperature": 0}, timeout=60
        ).json()
        assert again["choices"][0]["text"] == replies[0]["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= again["usage"]["prompt_tokens"] - 1

        stats = httpx.get(f"{server.base}/stats", timeout=5).json()
        pool = stats["paged_kv"]
        assert pool["block_size"] == 16 and pool["pools_created"] >= 2 * (len(prompts) + 1)
        assert pool["blocks_free"] == pool["blocks_total"] == 0, "no request is running, so no pool is live"
        assert stats["scheduler"]["lane"] == "batch"
        assert max(int(rows) for rows in stats["scheduler"]["batch_size_history"]) >= 2
        metrics = httpx.get(f"{server.base}/metrics", timeout=5).text
        assert "kvcellar_paged_kv_blocks_free 0.0" in metrics and "kvcellar_paged_kv_pools_created_total" in metrics
        assert "not yet described" not in metrics
    finally:
        status, output = server.stop()
    assert status == 0
    assert "--paged-kv with --ssd-cache: the RAM and SSD tiers see plain KVCache entries" in output


def test_paged_kv_refuses_kv_quant_and_a_model_it_cannot_page(model_dir_factory, capsys):
    model_dir = model_dir_factory("llama")
    assert main(["serve", "--model", str(model_dir), "--paged-kv", "--kv-quant", "8"]) == 2
    assert "--paged-kv cannot run with --kv-quant 8" in capsys.readouterr().err

    chunked = model_dir_factory("llama4")
    refused = subprocess.run(
        [sys.executable, "-m", "kvcellar.cli", "serve", "--model", str(chunked), "--paged-kv", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2
    assert "--paged-kv refused for this model: layer 0 keeps a ChunkedKVCache cache" in refused.stderr
