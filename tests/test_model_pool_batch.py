"""The batch lane in a model pool (issue 41) through a real `kvcellar serve --models ... --batch 4`: a long
stream of one model gives the shared engine thread to the other model's request between two steps, and
greedy replies equal the serial lane's (`--batch 1`)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from test_model_pool_serve import PoolServer, _toml

LONG_TOKENS = 400
SHORT_TOKENS = 8
SHORT_PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def small_dir(model_dir_factory) -> Path:
    return model_dir_factory("llama")


def _rows_active(server: PoolServer, model: str) -> int:
    return httpx.get(f"{server.base}/models/{model}/stats", timeout=10).json()["scheduler"]["rows_active"]


def _load_both(server: PoolServer) -> None:
    """Both models loaded, so an overlap is the two generations' (a load is an engine job too)."""
    for model in ("small", "coder"):
        server.openai().chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def _reply(server: PoolServer, model: str, max_tokens: int) -> str:
    reply = server.openai().chat.completions.create(
        model=model, messages=[{"role": "user", "content": SHORT_PROMPT}], max_tokens=max_tokens, temperature=0
    )
    return reply.choices[0].message.content or ""


def _overlapping_replies(server: PoolServer) -> tuple[str, str, bool]:
    """A long greedy stream for `small`; once it produced text, a request for `coder`. Returns both texts and
    whether `small`'s generation was still running when `coder`'s reply came back."""
    stream = server.openai().chat.completions.create(
        model="small",
        messages=[{"role": "user", "content": SHORT_PROMPT}],
        max_tokens=LONG_TOKENS,
        temperature=0,
        stream=True,
    )
    long_text: list[str] = []
    for chunk in stream:
        long_text.extend(choice.delta.content or "" for choice in chunk.choices)
        if "".join(long_text):
            break
    short_text = _reply(server, "coder", SHORT_TOKENS)
    overlapped = _rows_active(server, "small") > 0
    for chunk in stream:
        long_text.extend(choice.delta.content or "" for choice in chunk.choices)
    return "".join(long_text), short_text, overlapped


def test_batch_lanes_of_two_models_interleave_and_reply_as_each_alone(small_dir, tmp_path):
    server = PoolServer(_toml(small_dir), tmp_path, "--batch", "4")
    try:
        _load_both(server)
        alone = (_reply(server, "small", LONG_TOKENS), _reply(server, "coder", SHORT_TOKENS))
        long_text, short_text, overlapped = _overlapping_replies(server)
        models = server.models()
    finally:
        server.kill()
    # coder's whole request ran while small's stream was still generating: small gave the thread way.
    assert overlapped and models["small"]["engine_yields"] > 0
    assert (long_text, short_text) == alone
    for stats in models.values():
        assert stats["lane"] == "batch" and stats["batch_size_history"]


@pytest.mark.slow
def test_greedy_replies_of_overlapping_batch_lanes_equal_the_serial_lanes(small_dir, tmp_path):
    replies = {}
    for rows in ("1", "4"):
        server = PoolServer(_toml(small_dir), tmp_path, "--batch", rows, ssd_dir=tmp_path / f"ssd-{rows}")
        try:
            _load_both(server)
            long_text, short_text, overlapped = _overlapping_replies(server)
            assert overlapped
            replies[rows] = (long_text, short_text)
        finally:
            server.kill()
    assert replies["4"] == replies["1"]
