"""The shared tier with an encryption key ring, against moto's S3 server over
HTTP: a server with a key shares sealed objects under sealed manifests (no
16-token run of the prompt's ids in any object), another with the same key
restores them, and one with a wrong key serves cold without a crash."""

from __future__ import annotations

import numpy as np
import trio
from test_flush import _config, serving
from test_shared_tier import _complete, _keys, _s3, _share, _shared, bucket, moto_url  # noqa: F401 (fixtures)

RUN_TOKENS = 16


def test_sealed_shared_objects_restore_with_the_key_and_serve_cold_without(
    model_dir_factory,
    tmp_path,
    bucket,  # noqa: F811 (the imported fixture)
    moto_url,  # noqa: F811 (the imported fixture)
    rings,
):
    right, wrong = rings
    model_dir = model_dir_factory("llama")

    def config(name, ring):
        return _config(
            model_dir, tmp_path, ssd_dir=tmp_path / name, shared_cache=_shared(bucket, moto_url), ssd_keyring=ring
        )

    async def main() -> None:
        async with serving(config("a", right)) as (system, client):
            cold = await _complete(client)
            verdict = await _share(client)
            assert verdict["shared"]["uploaded"] >= 1
            prompts = [system.store.entry(entry_id).tokens for entry_id in system.store.entry_ids()]
        runs = [
            np.asarray(tokens[i : i + RUN_TOKENS], dtype="<u4").tobytes()
            for tokens in prompts
            for i in range(len(tokens) - RUN_TOKENS + 1)
        ]
        assert runs
        s3 = _s3(moto_url)
        bodies = [s3.get_object(Bucket=bucket, Key=key)["Body"].read() for key in _keys(moto_url, bucket)]
        assert len(bodies) >= 2 and not any(run in body for body in bodies for run in runs)

        async with serving(config("b", right)) as (system, client):
            warm = await _complete(client)
            usage = warm["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1
            assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
            stats = (await client.get("/stats")).json()["shared_cache"]
            assert stats["downloads"] == 1 and stats["refused"] == 0

        async with serving(config("c", wrong)) as (system, client):
            other = await _complete(client)
            assert other["choices"][0]["text"] == cold["choices"][0]["text"]
            assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            stats = (await client.get("/stats")).json()["shared_cache"]
            assert stats["downloads"] == 0 and stats["refused"] >= 1

    trio.run(main)
