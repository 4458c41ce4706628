"""The live dashboard: the recent-requests ring, `/stats/requests`,
`/stats/journal`, the Grafana dashboard over `/metrics`, and the page itself
in a real headless Chromium (Playwright over the system's `chromium`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tomllib
from contextlib import aclosing
from pathlib import Path

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families
from test_serve import Server

from kvcellar.actors.recent_requests import TTFT_BUCKETS_S, RecentRequests, RequestRecord, recorded
from kvcellar.engine.generation import GenerationDone, TokenDelta
from kvcellar.errors import UsageError
from kvcellar.http.dashboard import DASHBOARD_PATH, json_safe
from kvcellar.http.metrics import UNDESCRIBED_HELP, metrics_registry, render_metrics

REPO = Path(__file__).resolve().parents[1]
GRAFANA_PATH = REPO / "docs" / "grafana" / "kvcellar.json"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TOKEN = "dash-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _record(**overrides) -> RequestRecord:
    fields = {
        "finished_at_s": 1.0,
        "prompt_tokens": 100,
        "cached_tokens": 60,
        "cache_tier": "ram",
        "completion_tokens": 5,
        "ttft_s": 0.03,
        "decode_tokens_per_s": 100.0,
        "duration_s": 0.07,
        "finish_reason": "stop",
    }
    return RequestRecord(**{**fields, **overrides})


# -- the ring, without a server ---------------------------------------------------------------


def test_the_ring_keeps_the_newest_records_and_totals_count_every_one():
    ring = RecentRequests(capacity=3)
    for index in range(5):
        tier = ("ram", "ssd", "none")[index % 3]
        ring.record(_record(cache_tier=tier, cached_tokens=0 if tier == "none" else 10 * index, ttft_s=0.02 * index))
    snapshot = ring.snapshot()
    assert snapshot["capacity"] == 3 and snapshot["last_seq"] == 5
    assert [r["seq"] for r in snapshot["requests"]] == [3, 4, 5], "oldest dropped first"
    assert [r["seq"] for r in ring.snapshot(after_seq=4)["requests"]] == [5]
    stats = ring.stats()
    assert stats["finished"] == 5 and stats["prompt_tokens"] == 500
    assert stats["cached_tokens_ram"] == 0 + 30 and stats["cached_tokens_ssd"] == 10 + 40
    assert stats["ttft_count"] == 5 and stats["ttft_seconds_sum"] == pytest.approx(0.2)
    buckets = stats["ttft_seconds_buckets"]
    assert list(buckets) == [repr(bound) for bound in TTFT_BUCKETS_S] + ["+Inf"]
    # 0, 0.02, 0.04, 0.06, 0.08: a value on a bound counts in it (Prometheus `le`).
    assert buckets["0.01"] == 1 and buckets["0.025"] == 2 and buckets["0.05"] == 3 and buckets["0.1"] == 5
    assert buckets["+Inf"] == 5
    with pytest.raises(UsageError, match="room for one"):
        RecentRequests(capacity=0)


class _Clock:
    def __init__(self) -> None:
        self.now_s = 10.0

    def __call__(self) -> float:
        return self.now_s


def _done(**overrides) -> GenerationDone:
    fields = {"finish_reason": "length", "prompt_tokens": 40, "completion_tokens": 3, "cached_tokens": 32}
    return GenerationDone(**{**fields, "cache_tier": "ssd", **overrides})


def test_recorded_times_first_token_and_end_and_records_cancelled_and_failed_requests():
    clock = _Clock()

    async def tokens(fail: bool = False):
        clock.now_s += 0.5  # prefill
        yield TokenDelta(token_id=1, text="a")
        clock.now_s += 1.0
        yield TokenDelta(token_id=2, text="b")
        yield TokenDelta(token_id=3, text="c")
        if fail:
            raise RuntimeError("the engine stopped")
        yield _done()

    async def main():
        ring = RecentRequests()
        kwargs = {"prompt_tokens": 40, "clock_s": clock, "wall_clock_s": lambda: 1234.5}
        items = [item async for item in recorded(tokens(), ring, **kwargs)]
        assert isinstance(items[-1], GenerationDone) and len(items) == 4
        async with aclosing(recorded(tokens(), ring, **kwargs)) as stream:
            await stream.__anext__()  # the client goes away after one token
        with pytest.raises(RuntimeError, match="engine stopped"):
            async for _ in recorded(tokens(fail=True), ring, **kwargs):
                pass
        return ring.snapshot()["requests"]

    done, cancelled, failed = trio.run(main)
    assert done["finished_at_s"] == 1234.5 and done["cache_tier"] == "ssd" and done["cached_tokens"] == 32
    assert done["ttft_s"] == pytest.approx(0.5) and done["duration_s"] == pytest.approx(1.5)
    assert done["decode_tokens_per_s"] == pytest.approx(2 / 1.0) and done["finish_reason"] == "length"
    assert cancelled["finish_reason"] == "cancelled" and cancelled["ttft_s"] == pytest.approx(0.5)
    assert cancelled["completion_tokens"] == 0 and cancelled["cache_tier"] == "none"
    assert cancelled["prompt_tokens"] == 40 and cancelled["decode_tokens_per_s"] is None
    assert failed["finish_reason"] == "error"


def test_request_and_flush_totals_are_typed_described_metrics():
    ring = RecentRequests()
    ring.record(_record(ttft_s=0.04))
    ring.record(_record(ttft_s=3.0, cache_tier="ssd", cached_tokens=80))
    stats = {
        "requests": ring.stats(),
        "flush": {
            "flushes": 2,
            "last": {"answered_at_s": 1700.0, "durable": False, "reason": "timeout", "pending": 3, "entries": 4},
        },
    }
    text = render_metrics(metrics_registry(lambda: stats)).decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    ttft = families["kvcellar_request_ttft_seconds"]
    assert ttft.type == "histogram"
    samples = {(s.name, s.labels.get("le")): s.value for s in ttft.samples}
    assert samples[("kvcellar_request_ttft_seconds_bucket", "0.05")] == 1.0
    assert samples[("kvcellar_request_ttft_seconds_bucket", "+Inf")] == 2.0
    assert samples[("kvcellar_request_ttft_seconds_count", None)] == 2.0
    assert samples[("kvcellar_request_ttft_seconds_sum", None)] == pytest.approx(3.04)
    assert families["kvcellar_requests_ssd_cached_tokens"].type == "counter"
    assert families["kvcellar_flushes"].samples[0].value == 2.0
    assert families["kvcellar_flush_last_durable"].samples[0].value == 0.0
    assert families["kvcellar_flush_last_pending"].samples[0].value == 3.0
    assert not [f.name for f in families.values() if UNDESCRIBED_HELP in f.documentation]
    before_any_flush = {"requests": RecentRequests().stats(), "flush": {"flushes": 0, "last": None}}
    text = render_metrics(metrics_registry(lambda: before_any_flush)).decode()
    assert "kvcellar_flush_last_durable" not in text and "kvcellar_flushes_total 0.0" in text


def test_journal_payloads_are_made_fit_for_json():
    assert json_safe({"ids": b"\x00" * 12, "few": (1, 2), "many": list(range(20)), "x": float("nan")}) == {
        "ids": "<12 bytes>",
        "few": [1, 2],
        "many": "<20 items>",
        "x": "nan",
    }


def test_the_page_ships_as_package_data():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["kvcellar.http"]
    relative = DASHBOARD_PATH.relative_to(REPO / "http")
    assert any(relative.match(pattern) for pattern in patterns), (relative, patterns)
    page = DASHBOARD_PATH.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page), "no CDN: the page must work offline"


# -- a real server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(model_dir_factory, tmp_path_factory):
    running = Server(
        model_dir_factory("llama"),
        "--ssd-cache",
        str(tmp_path_factory.mktemp("ssd")),
        "--ssd-cache-max",
        "1",
        "--ssd-demote-idle",
        "0",
        env={"KVCELLAR_ADMIN_TOKEN": TOKEN},
    )
    yield running
    running.kill()


def _chat(server, content):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0}
    response = httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


@pytest.fixture(scope="module")
def served(server):
    """A few requests sharing prefixes (so the RAM tier serves some), then a durable flush."""
    usages = [_chat(server, f"the cellar keeps the warm caches {'and more ' * n}") for n in (4, 1, 4, 2)]
    flushed = httpx.post(f"{server.base}/admin/cache/flush", headers=AUTH, timeout=120)
    assert flushed.status_code == 200 and flushed.json()["durable"], flushed.text
    return usages


def test_recent_requests_match_each_reply_and_need_the_admin_token(server, served):
    assert httpx.get(f"{server.base}/stats/requests", timeout=5).status_code == 401
    assert httpx.get(f"{server.base}/stats/journal", timeout=5).status_code == 401
    ring = httpx.get(f"{server.base}/stats/requests", headers=AUTH, timeout=5).json()
    records = ring["requests"][-len(served) :]
    assert [r["prompt_tokens"] for r in records] == [u["prompt_tokens"] for u in served]
    assert [r["cached_tokens"] for r in records] == [u["prompt_tokens_details"]["cached_tokens"] for u in served]
    assert [r["completion_tokens"] for r in records] == [u["completion_tokens"] for u in served]
    assert records[0]["cache_tier"] == "none" and any(r["cache_tier"] == "ram" for r in records[1:])
    assert all(r["ttft_s"] > 0 and r["duration_s"] >= r["ttft_s"] for r in records)
    newer = httpx.get(f"{server.base}/stats/requests?after_seq={ring['last_seq'] - 1}", headers=AUTH, timeout=5)
    assert [r["seq"] for r in newer.json()["requests"]] == [ring["last_seq"]]
    stats = httpx.get(f"{server.base}/stats", headers=AUTH, timeout=5).json()
    assert stats["requests"]["finished"] == ring["last_seq"]
    assert stats["flush"]["flushes"] >= 1 and stats["flush"]["last"]["durable"] is True


def test_recent_journal_events_are_the_journals_last_ones_and_a_bad_limit_is_a_400(server, served):
    answer = httpx.get(f"{server.base}/stats/journal?limit=5", headers=AUTH, timeout=10).json()
    assert answer["journal"] == "ok" and len(answer["events"]) == 5
    seqs = [event["seq"] for event in answer["events"]]
    assert seqs == sorted(seqs) and len(set(seqs)) == 5
    everything = httpx.get(f"{server.base}/stats/journal?limit=1000", headers=AUTH, timeout=10).json()["events"]
    assert seqs[-1] <= everything[-1]["seq"]
    kinds = {event["kind"] for event in everything}
    assert {"entry.stored", "flush.verdict"} <= kinds, kinds
    stored = next(event for event in everything if event["kind"] == "entry.stored")
    assert stored["data"]["entry"]["token_ids"].endswith("bytes>") and stored["entry_id"]
    for bad in ("0", "1001", "ten"):
        response = httpx.get(f"{server.base}/stats/journal?limit={bad}", headers=AUTH, timeout=5)
        assert response.status_code == 400 and response.json()["error"]["param"] == "limit", bad


def _expression_metrics(dashboard: dict) -> set[str]:
    names: set[str] = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            names |= set(re.findall(r"\bkvcellar_[A-Za-z0-9_]+", target["expr"]))
    return names


def test_every_metric_the_grafana_dashboard_names_is_in_metrics(server, served):
    dashboard = json.loads(GRAFANA_PATH.read_text())
    assert dashboard["title"] == "kvcellar" and dashboard["panels"]
    assert all(panel["targets"] and panel["title"] for panel in dashboard["panels"])
    response = httpx.get(f"{server.base}/metrics", headers=AUTH, timeout=5)
    exposed = {sample.name for family in text_string_to_metric_families(response.text) for sample in family.samples}
    named = _expression_metrics(dashboard)
    assert len(named) >= 20
    assert sorted(named - exposed) == []


# -- the page in a real browser -------------------------------------------------------------------


def _browser_or_skip():
    """Playwright's sync API over the system's Chromium; a skip with the reason
    when either is missing, except under CI (CI=true), where that is a failure."""
    problem = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        problem = "playwright is not installed (pip install -e '.[dev]')"
    if problem is None and not (CHROMIUM.is_file() and shutil.which(str(CHROMIUM))):
        problem = f"{CHROMIUM} is missing (apt-get install -y chromium)"
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser test: {problem}")
        pytest.skip(problem)
    return sync_playwright


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", header[16:24])


# What the page must show once it has polled: element id -> the /stats value, as the page's data-value.
def _expected_values(stats: dict) -> dict[str, str]:
    ram, ssd, scheduler = stats["prompt_cache"], stats["ssd_cache"], stats["scheduler"]
    return {
        "ram-entries": str(ram["entries"]),
        "ram-bytes": str(ram["bytes"]),
        "ram-hits": str(ram["hits"]),
        "ssd-entries": str(ssd["entries"]),
        "ssd-bytes": str(ssd["bytes"]),
        "spill-written": str(ssd["spills"]),
        "spill-pending": str(ssd["pending_spills"]),
        "dirty": str(ssd["pending_snapshots"]),
        "longest-durable": str(ssd["longest_durable_prefix_tokens"]),
        "rows-max": str(scheduler["batch_size"]),
        "rows-completed": str(scheduler["completed"]),
        "requests-count": str(stats["requests"]["finished"]),
    }


SHOWN_VALUES_JS = "ids => Object.fromEntries(ids.map(id => [id, document.getElementById(id).dataset.value]))"
SHOWN_MATCHES_JS = (
    "([ids, want]) => JSON.stringify(ids.map(id => document.getElementById(id).dataset.value)) === JSON.stringify(want)"
)


MEMORY = {"state": "ok", "budget_bytes": 8_000_000_000, "used_bytes": 123_456_789}


def _memory_section_is_shown_when_stats_has_one(page) -> None:
    """The memory guard's `/stats` `memory` section, whatever its fields, as a list:
    the server's real /stats with one added, through Playwright's request routing."""

    def with_memory(route) -> None:
        response = route.fetch()
        route.fulfill(response=response, json={**response.json(), "memory": MEMORY})

    page.route("**/stats", with_memory)
    # The real /stats has a memory section too: wait for the routed one's own field.
    page.wait_for_function(
        "document.querySelector('#memory-body dd[data-field=\"used_bytes\"]') !== null", timeout=30_000
    )
    shown = page.eval_on_selector_all("#memory-body dd", "dds => dds.map(dd => [dd.dataset.field, dd.dataset.value])")
    assert dict(shown) == {key: str(value) for key, value in MEMORY.items()}
    assert "123.5 MB" in page.inner_text("#memory-body")
    page.unroute("**/stats")


SPECULATIVE = {
    "rounds": 4,
    "acceptance_rate": 0.75,
    "accepted_tokens_per_step": 2.5,
    "draft_time_share": 0.2,
    "companion_restored": 1,
    "draft_reprefills": {},
    "refused": {},
}
SHARED_COMPANION = {"uploads": 1, "upload_companion_bytes": 4_500_000, "download_companion_bytes": 2_250_000}


def _shared_companion_bytes_are_shown_with_a_draft_model(page) -> None:
    """The speculative panel's companion bytes per tier, the shared tier's uploaded and downloaded
    share among them (issue 42): the real /stats with a draft's and a shared tier's fields added."""

    def with_draft(route) -> None:
        response = route.fetch()
        route.fulfill(
            response=response, json={**response.json(), "speculative": SPECULATIVE, "shared_cache": SHARED_COMPANION}
        )

    page.route("**/stats", with_draft)
    shared_row = '#speculative-body dd[data-field="companion to / from shared"]'
    page.wait_for_function(f"document.querySelector('{shared_row}') !== null", timeout=30_000)
    assert page.inner_text(shared_row) == "4.50 MB / 2.25 MB"
    page.unroute("**/stats")


def test_the_dashboard_in_a_headless_browser(server, served, tmp_path):
    sync_playwright = _browser_or_skip()
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    problems: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
            page.goto(f"{server.base}/dashboard?poll_ms=300")
            # The server wants a token: the page asks before its first read.
            page.wait_for_selector("#token-form.shown", timeout=30_000)
            page.fill("#token-input", TOKEN)
            page.click("#token-form button[type=submit]")
            page.wait_for_function("Number(document.body.dataset.polls || 0) >= 1", timeout=30_000)
            assert page.evaluate("sessionStorage.getItem('kvcellar-admin-token')") == TOKEN

            stats = httpx.get(f"{server.base}/stats", headers=AUTH, timeout=5).json()
            expected = _expected_values(stats)
            try:
                page.wait_for_function(SHOWN_MATCHES_JS, arg=[list(expected), list(expected.values())], timeout=30_000)
            except PlaywrightTimeout:
                shown = page.evaluate(SHOWN_VALUES_JS, list(expected))
                pytest.fail(f"the page shows {shown}, /stats says {expected}")
            ring = httpx.get(f"{server.base}/stats/requests", headers=AUTH, timeout=5).json()["requests"]
            assert page.locator("#chart-cached .request-bar").count() == len(ring)
            assert page.locator("#chart-ttft .ttft-point").count() == len(ring)
            assert page.locator("#requests-body tr").count() == len(ring)
            assert page.locator("#journal-body tr.journal-event").count() > 0
            assert page.get_attribute("#memory-body", "data-configured") == ("true" if "memory" in stats else "false")
            cached = stats["requests"]["cached_tokens_ram"] + stats["requests"]["cached_tokens_ssd"]
            shown_ratio = float(page.get_attribute("#cached-ratio", "data-value"))
            assert shown_ratio == pytest.approx(cached / stats["requests"]["prompt_tokens"])

            page.click("#flush-button")
            page.wait_for_function("document.getElementById('flush-verdict').dataset.durable !== ''", timeout=60_000)
            assert page.get_attribute("#flush-verdict", "data-durable") == "true"
            assert page.inner_text("#flush-verdict").startswith("durable")
            page.wait_for_function("document.getElementById('last-flush').textContent.startsWith('durable')")

            screenshot = tmp_path / "dashboard.png"
            page.screenshot(path=str(screenshot), full_page=True)
            _memory_section_is_shown_when_stats_has_one(page)
            _shared_companion_bytes_are_shown_with_a_draft_model(page)
        finally:
            browser.close()
    assert problems == []
    width, height = _png_size(screenshot)
    assert width == 1400 and 1000 <= height <= 4000, (width, height)
    assert 30_000 <= screenshot.stat().st_size <= 3_000_000
