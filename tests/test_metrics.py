"""`/metrics` through prometheus_client: typed families with HELP lines over
`System.stats()`, parsed back with prometheus_client's own parser."""

from __future__ import annotations

import copy

import prometheus_client
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from kvcellar.actors.system import SystemConfig, open_system
from kvcellar.engine.engine import SamplingParams
from kvcellar.engine.generation import GenerationDone, GenerationRequest
from kvcellar.http.metrics import SPECS, UNDESCRIBED_HELP, metrics_registry, render_metrics

# The shape `System.stats()` returns on the batch lane with an SSD tier.
STATS = {
    "prompt_cache": {
        "entries": 3,
        "bytes": 31232,
        "max_bytes": 8_000_000_000,
        "hits": 5,
        "misses": 2,
        "cold_hits": 1,
        "cold_refused": 0,
        "puts": 7,
        "evictions": 4,
        "supersessions": 2,
        "spills": 6,
        "spill_failures": 0,
        "demotions": 1,
        "oversize": 0,
    },
    "gateway": {"busy": True, "lane": "batching", "waiting": 2, "background_waiting": 1, "admitting": True},
    "ssd_cache": {
        "entries": 4,
        "bytes": 73344,
        "max_bytes": None,
        "restores": 2,
        "spills": 5,
        "restore_ms_last": 12.5,
        "demotions": 1,
        "pending_snapshots": 3,
        "pending_spills": 2,
        "pending_spill_bytes": 4096,
        "dropped_spills": 0,
        "failed_spills": 1,
        "longest_durable_prefix_tokens": 61,
        "quarantined": 0,
        "journal": "ok",
    },
    "kv_scheme": "bf16",
    "scheduler": {
        "lane": "batch",
        "reason": "",
        "batch_size": 4,
        "kv_budget_bytes": 4_000_000_000,
        "state": "idle",
        "rows_active": 3,
        "waiting": 1,
        "kv_bytes_active": 2048,
        "kv_bytes_peak": 31232,
        "admitting": True,
        "batches": 2,
        "admitted": 9,
        "rejected": 0,
        "completed": 8,
        "cancelled": 1,
        "failed": 0,
        "batch_size_history": {"1": 40, "4": 120, "10": 3},
    },
}

COUNTERS = (
    "kvcellar_prompt_cache_hits",
    "kvcellar_prompt_cache_misses",
    "kvcellar_prompt_cache_puts",
    "kvcellar_prompt_cache_evictions",
    "kvcellar_ssd_cache_restores",
    "kvcellar_ssd_cache_spills",
    "kvcellar_scheduler_completed",
    "kvcellar_scheduler_decode_steps",
)
GAUGES = (
    "kvcellar_prompt_cache_entries",
    "kvcellar_prompt_cache_bytes",
    "kvcellar_ssd_cache_entries",
    "kvcellar_ssd_cache_bytes",
    "kvcellar_ssd_cache_pending_spills",
    "kvcellar_ssd_cache_pending_spill_bytes",
    "kvcellar_ssd_cache_pending_snapshots",
    "kvcellar_scheduler_waiting",
    "kvcellar_scheduler_rows_active",
    "kvcellar_gateway_waiting",
    "kvcellar_journal_degraded",
)


def _families(stats):
    text = render_metrics(metrics_registry(lambda: stats)).decode("utf-8")
    return {family.name: family for family in text_string_to_metric_families(text)}


def _value(family, **labels):
    matches = [s.value for s in family.samples if s.labels == labels]
    assert len(matches) == 1, (family.name, labels, family.samples)
    return matches[0]


def _assert_matches_stats(families, stats):
    """Every declared field present in `stats` is its family, of its type, with its value."""
    for spec in SPECS:
        raw = stats.get(spec.section, {}).get(spec.field)
        if raw is None:
            assert spec.name not in families, spec.name
            continue
        family = families[spec.name]
        assert family.type == spec.kind, spec.name
        assert _value(family) == pytest.approx(float(raw) * spec.scale), spec.name
    history = stats.get("scheduler", {}).get("batch_size_history", {})
    steps = families["kvcellar_scheduler_decode_steps"]
    assert {s.labels["rows"]: s.value for s in steps.samples} == {rows: float(n) for rows, n in history.items()}


def test_counts_are_counters_and_depths_are_gauges_each_with_help_and_the_stats_value():
    families = _families(STATS)
    for name in COUNTERS:
        assert families[name].type == "counter", name
    for name in GAUGES:
        assert families[name].type == "gauge", name
    assert all(family.documentation.strip() for family in families.values())
    _assert_matches_stats(families, STATS)
    assert _value(families["kvcellar_ssd_cache_pending_spills"]) == 2.0
    assert _value(families["kvcellar_ssd_cache_last_restore_seconds"]) == pytest.approx(0.0125)
    assert _value(families["kvcellar_gateway_busy"]) == 1.0
    assert "kvcellar_ssd_cache_max_bytes" not in families, "an unbounded SSD tier has no cap sample"
    assert _value(families["kvcellar_serving_info"], kv_scheme="bf16", lane="batch") == 1.0
    assert not [f.name for f in families.values() if UNDESCRIBED_HELP in f.documentation]


def test_units_end_the_names():
    for spec in SPECS:
        if "bytes" in spec.field:
            assert spec.name.endswith("_bytes"), spec.name
        assert "_ms" not in spec.name, spec.name


def test_batch_sizes_are_one_counter_family_labelled_by_rows():
    families = _families(STATS)
    steps = families["kvcellar_scheduler_decode_steps"]
    assert steps.type == "counter" and "rows" in steps.documentation
    assert [(s.name, s.labels, s.value) for s in steps.samples] == [
        ("kvcellar_scheduler_decode_steps_total", {"rows": "1"}, 40.0),
        ("kvcellar_scheduler_decode_steps_total", {"rows": "4"}, 120.0),
        ("kvcellar_scheduler_decode_steps_total", {"rows": "10"}, 3.0),
    ]
    assert not [name for name in families if "history" in name or name[-1].isdigit()]


@pytest.mark.parametrize(
    ("journal", "degraded"),
    [
        ("ok", 0.0),
        ("degraded", 1.0),
        ({"state": "ok", "reason": None}, 0.0),
        ({"state": "degraded", "reason": "disk I/O error"}, 1.0),
        ({"state": "off", "reason": "the journal could not be opened"}, 0.0),
    ],
)
def test_both_journal_shapes_map_to_the_degraded_gauge(journal, degraded):
    stats = copy.deepcopy(STATS)
    stats["ssd_cache"]["journal"] = journal
    families = _families(stats)
    assert families["kvcellar_journal_degraded"].type == "gauge"
    assert _value(families["kvcellar_journal_degraded"]) == degraded
    assert not [name for name in families if name.startswith("kvcellar_ssd_cache_journal")]


def test_without_an_ssd_tier_the_journal_gauge_is_zero_and_no_ssd_family_appears():
    stats = copy.deepcopy(STATS)
    stats["ssd_cache"] = {}
    families = _families(stats)
    assert _value(families["kvcellar_journal_degraded"]) == 0.0
    assert not [name for name in families if name.startswith("kvcellar_ssd_cache_")]


def test_an_undescribed_numeric_field_is_still_exported_as_a_gauge_that_says_so():
    stats = copy.deepcopy(STATS)
    stats["scheduler"]["new_depth"] = 5
    stats["gateway"]["note"] = "text is no sample"
    families = _families(stats)
    family = families["kvcellar_scheduler_new_depth"]
    assert family.type == "gauge" and UNDESCRIBED_HELP in family.documentation and _value(family) == 5.0
    assert "kvcellar_gateway_note" not in families


def test_each_registry_is_private_and_reads_stats_only_when_scraped():
    calls = []

    def stats():
        calls.append(1)
        return STATS

    registry = metrics_registry(stats)
    other = metrics_registry(lambda: {})
    assert calls == [], "registering must not read stats"
    assert prometheus_client.REGISTRY.get_sample_value("kvcellar_prompt_cache_entries") is None
    assert registry.get_sample_value("kvcellar_prompt_cache_entries") == 3.0
    assert other.get_sample_value("kvcellar_prompt_cache_entries") is None
    render_metrics(registry)
    assert len(calls) == 2


def _request(prompt, max_tokens=6):
    return GenerationRequest(prompt_ids=tuple(prompt), params=SamplingParams(temperature=0.0, max_tokens=max_tokens))


async def _drain(system, request):
    async for item in system.generate(request):
        if isinstance(item, GenerationDone):
            return item
    raise AssertionError("the generation ended without GenerationDone")


def _scrape(system):
    """The exposition and the very stats dict the collector rendered it from."""
    seen = []

    def recorded():
        seen.append(system.stats())
        return seen[-1]

    text = render_metrics(metrics_registry(recorded)).decode("utf-8")
    return {family.name: family for family in text_string_to_metric_families(text)}, seen[-1]


@pytest.mark.parametrize("lane", ["batch", "serial"])
def test_a_real_system_exports_every_stats_number_typed_and_described(model_dir_factory, tmp_path, lane):
    model_dir = model_dir_factory("llama")
    prompts = [tuple((11 * i + 7 * k) % 1000 + 3 for i in range(48)) for k in range(3)]
    config = SystemConfig(
        model_dir=model_dir,
        ssd_dir=tmp_path / "ssd" if lane == "batch" else None,
        debounce_s=0.05,
        busy_rearm_s=0.05,
        demote_idle_s=0,
        shutdown_timeout_s=60,
        batch_rows_max=4 if lane == "batch" else 1,
    )

    async def main():
        async with open_system(config) as system:
            async with trio.open_nursery() as nursery:
                for prompt in prompts:
                    nursery.start_soon(_drain, system, _request(prompt))
            await _drain(system, _request(prompts[0] + (5, 6, 7)))
            if lane == "batch":
                assert (await system.flush()).durable
            return _scrape(system)

    families, stats = trio.run(main)
    assert all(family.documentation.strip() for family in families.values())
    assert not [f.name for f in families.values() if UNDESCRIBED_HELP in f.documentation], (
        "every /stats number needs a MetricSpec in http/metrics.py"
    )
    _assert_matches_stats(families, stats)
    assert _value(families["kvcellar_prompt_cache_misses"]) >= 3.0
    assert _value(families["kvcellar_journal_degraded"]) == 0.0
    assert _value(families["kvcellar_serving_info"], kv_scheme=stats["kv_scheme"], lane=lane) == 1.0
    if lane == "batch":
        assert families["kvcellar_ssd_cache_pending_spills"].type == "gauge"
        assert _value(families["kvcellar_ssd_cache_spills"]) >= 1.0
        assert sum(s.value for s in families["kvcellar_scheduler_decode_steps"].samples) > 0
    else:
        assert families["kvcellar_scheduler_decode_steps"].samples == []
