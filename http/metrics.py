"""`/metrics`: `System.stats()` as Prometheus exposition through prometheus_client.

Every metric is declared below with its type and a HELP line: monotonic counts
are counters (prometheus_client appends `_total`), sizes and queue depths are
gauges, units end the name (`_bytes`, `_seconds`, `_tokens`). The scheduler's
`batch_size_history` is one counter family with a `rows` label. The collector
reads `stats()` on every scrape and holds no state of its own; `stats()` reads
in-memory counters, so a scrape does no disk I/O on the Trio thread.

A numeric `/stats` field that is not declared here is still exported, as a
gauge whose HELP says so (`UNDESCRIBED_HELP`); tests keep that list empty.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import attrs
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

UNDESCRIBED_HELP = "not yet described in kvcellar/http/metrics.py; exported as a gauge"

StatsSource = Callable[[], Mapping[str, Any]]


@attrs.frozen(kw_only=True)
class MetricSpec:
    """One `/stats` field: `stats[section][field] * scale` as metric `name`."""

    section: str
    field: str
    kind: Literal["counter", "gauge"]
    name: str
    help: str
    scale: float = 1.0


def _counter(section: str, field: str, help: str, *, name: str = "") -> MetricSpec:
    return MetricSpec(
        section=section, field=field, kind="counter", name=name or f"kvcellar_{section}_{field}", help=help
    )


def _gauge(section: str, field: str, help: str, *, name: str = "", scale: float = 1.0) -> MetricSpec:
    return MetricSpec(
        section=section, field=field, kind="gauge", name=name or f"kvcellar_{section}_{field}", help=help, scale=scale
    )


_RAM, _GATEWAY, _SSD, _SCHEDULER = "prompt_cache", "gateway", "ssd_cache", "scheduler"
_SHARED = "shared_cache"
_CHECKPOINTS = "checkpoints"

SPECS: tuple[MetricSpec, ...] = (
    _gauge(_RAM, "entries", "Entries the RAM prompt cache holds."),
    _gauge(_RAM, "bytes", "Logical KV bytes the RAM prompt cache holds (rows in use, no slack)."),
    _gauge(_RAM, "max_bytes", "Byte cap of the RAM prompt cache."),
    _counter(_RAM, "hits", "Requests for which the RAM tier held a usable prefix."),
    _counter(_RAM, "misses", "Requests for which the RAM tier held no usable prefix."),
    _counter(_RAM, "cold_hits", "Prefixes served from the SSD tier (longer than any RAM candidate)."),
    _counter(_RAM, "cold_refused", "SSD entries restored but refused because they could not be cut to the prefix."),
    _counter(_RAM, "puts", "Finished generations taken into the RAM tier as entries."),
    _counter(_RAM, "evictions", "RAM entries evicted to stay under the byte cap (each spilled first)."),
    _counter(_RAM, "supersessions", "RAM entries dropped because a newer entry covers them."),
    _counter(_RAM, "spills", "Snapshots the RAM tier handed to the spill queue."),
    _counter(_RAM, "spill_failures", "Snapshots the spill queue refused; their entries left RAM without a copy."),
    _counter(_RAM, "demotions", "RAM entries spilled and dropped after being idle."),
    _counter(_RAM, "oversize", "Generations larger than the RAM cap, spilled instead of held."),
    _counter(_RAM, "wiped", "RAM entries dropped by a cache wipe (POST /admin/cache/wipe)."),
    _gauge(_RAM, "companion_bytes", "Of the RAM tier's bytes, the draft model's KV (method companion state)."),
    _gauge(_GATEWAY, "busy", "1 while the engine runs a request or background step, else 0."),
    _gauge(_GATEWAY, "waiting", "Requests queued at the gateway for the engine."),
    _gauge(_GATEWAY, "background_waiting", "Background steps (snapshots, demotions) waiting for an idle engine."),
    _gauge(_GATEWAY, "admitting", "1 while new requests are admitted, 0 once shutdown began."),
    _gauge(_SSD, "entries", "Entries the SSD tier indexes."),
    _gauge(_SSD, "bytes", "Bytes of the SSD tier's entry files."),
    _gauge(_SSD, "companion_bytes", "Of the SSD tier's bytes, the draft model's KV (method companion state)."),
    _gauge(_SSD, "max_bytes", "Byte cap of the SSD tier (absent when unbounded)."),
    _counter(_SSD, "restores", "Entries read back from the SSD tier."),
    _counter(_SSD, "spills", "Entries written to the SSD tier."),
    _gauge(
        _SSD,
        "restore_ms_last",
        "Duration of the latest SSD restore.",
        name="kvcellar_ssd_cache_last_restore_seconds",
        scale=0.001,
    ),
    _counter(_SSD, "demotions", "Idle RAM entries demoted towards the SSD tier."),
    _gauge(_SSD, "pending_snapshots", "Prefixes not yet durable, including ones waiting on a debounce timer."),
    _gauge(_SSD, "pending_spills", "Snapshots in the spill queue (queued or being written)."),
    _gauge(_SSD, "pending_spill_bytes", "Bytes of the snapshots in the spill queue."),
    _counter(_SSD, "dropped_spills", "Snapshots the spill queue dropped (full, or shut down)."),
    _counter(_SSD, "failed_spills", "Snapshots whose SSD write failed."),
    _gauge(_SSD, "longest_durable_prefix_tokens", "Tokens of the longest entry durable on the SSD tier."),
    _counter(_SSD, "quarantined", "SSD entry files moved to quarantine as unreadable or mismatched."),
    _counter(_SSD, "wiped", "SSD entries removed by a cache wipe."),
    _counter(_SSD, "wipe_dropped_commits", "SSD writes begun before a wipe and refused at their commit."),
    _gauge(
        _SCHEDULER,
        "batch_size",
        "Most rows the scheduler runs in one batch (1 on the serial lane).",
        name="kvcellar_scheduler_rows_max",
    ),
    _gauge(_SCHEDULER, "kv_budget_bytes", "KV byte budget for the active rows of a batch."),
    _gauge(_SCHEDULER, "rows_active", "Requests currently generating."),
    _gauge(_SCHEDULER, "waiting", "Requests waiting to be admitted into a batch."),
    _gauge(
        _SCHEDULER,
        "kv_bytes_active",
        "Padded KV bytes projected for the active rows.",
        name="kvcellar_scheduler_kv_active_bytes",
    ),
    _gauge(
        _SCHEDULER,
        "kv_bytes_peak",
        "Highest projected KV bytes of the active rows since start.",
        name="kvcellar_scheduler_kv_peak_bytes",
    ),
    _gauge(_SCHEDULER, "admitting", "1 while the scheduler admits new rows, 0 once shutdown began."),
    _counter(_SCHEDULER, "batches", "Batch jobs started on the engine."),
    _counter(_SCHEDULER, "admitted", "Requests admitted into a batch."),
    _counter(_SCHEDULER, "rejected", "Requests rejected because the server was shutting down."),
    _counter(_SCHEDULER, "completed", "Batch rows that finished normally."),
    _counter(_SCHEDULER, "cancelled", "Batch rows cancelled (client gone)."),
    _counter(_SCHEDULER, "failed", "Batch rows that ended with an error."),
    _counter("requests", "finished", "Requests that ended, however they ended (the recent-requests ring's count)."),
    _counter("requests", "cancelled", "Requests that ended because the client went away."),
    _counter("requests", "errors", "Requests that ended with an error."),
    _counter("requests", "prompt_tokens", "Prompt tokens of the requests that ended."),
    _counter(
        "requests",
        "cached_tokens_ram",
        "Prompt tokens served from the RAM tier instead of prefilled.",
        name="kvcellar_requests_ram_cached_tokens",
    ),
    _counter(
        "requests",
        "cached_tokens_ssd",
        "Prompt tokens served from the SSD tier instead of prefilled.",
        name="kvcellar_requests_ssd_cached_tokens",
    ),
    _counter("requests", "completion_tokens", "Tokens generated by the requests that ended."),
    _counter("prefill", "cancelled", "Prefills stopped between two chunks because the client left."),
    _counter("prefill", "kept_tokens", "Prompt tokens the stopped prefills kept in the tiers for a retry."),
    _counter("flush", "flushes", "Flushes that answered (the admin route and shutdown).", name="kvcellar_flushes"),
    _counter("wipes", "completed", "Cache wipes done in every tier (POST /admin/cache/wipe, resumed ones included)."),
    _gauge(_SSD, "verify_tensors", "1 when SSD restores check every tensor's checksum (--ssd-cache-verify on)."),
)

_MEMORY = "memory"

# The memory guard's section (engine/memory.py), appended after the others.
SPECS += (
    _gauge(_MEMORY, "budget_bytes", "What MLX may hold live, weights included (0: the guard is off)."),
    _gauge(_MEMORY, "weights_bytes", "What MLX held once the model was loaded."),
    _gauge(_MEMORY, "headroom_bytes", "The memory budget less the weights."),
    _gauge(_MEMORY, "active_bytes", "Bytes MLX holds live now (mx.get_active_memory())."),
    _gauge(_MEMORY, "peak_bytes", "Most bytes MLX held live since start (mx.get_peak_memory())."),
    _gauge(_MEMORY, "cache_bytes", "Bytes in MLX's buffer cache, freed but not returned (mx.get_cache_memory())."),
    _gauge(_MEMORY, "spill_pinned_bytes", "Bytes of snapshots the spill queue holds (live MLX buffers)."),
    _counter(_MEMORY, "relief_events", "Relief checks that found live memory over the budget and released entries."),
    _counter(_MEMORY, "relief_persisted_entries", "RAM entries relief wrote to the SSD tier before dropping them."),
    _counter(_MEMORY, "relief_persisted_bytes", "Bytes of the RAM entries relief wrote to the SSD tier."),
    _counter(_MEMORY, "relief_covered_entries", "RAM entries relief dropped because the SSD tier already held them."),
    _counter(_MEMORY, "relief_dropped_entries", "RAM entries relief dropped without an SSD copy."),
    _counter(_MEMORY, "relief_dropped_bytes", "Bytes of the RAM entries relief dropped without an SSD copy."),
    _counter(_MEMORY, "relief_failures", "Relief checks that could not get under the budget (a request failed)."),
    _counter(_MEMORY, "requests_refused", "Requests refused with insufficient_memory at admission."),
    *(
        _gauge(_SHARED, "objects", "Committed shared entries the local shared index knows."),
        _gauge(_SHARED, "bytes", "Bytes of the shared entries the local shared index knows."),
        _counter(_SHARED, "uploads", "Local entries committed to the shared store (object, then manifest)."),
        _counter(_SHARED, "restores_local_ssd", "SSD restores of entries this server stored itself."),
        _counter(_SHARED, "restores_shared_tier", "SSD restores of entries downloaded from the shared tier."),
        _counter(_SHARED, "restored_tokens_local_ssd", "Tokens restored from entries this server stored itself."),
        _counter(
            _SHARED, "restored_tokens_shared_tier", "Tokens restored from entries downloaded from the shared tier."
        ),
        _counter(_SHARED, "upload_bytes", "Bytes sent to the shared store by uploads."),
        _counter(
            _SHARED,
            "upload_companion_bytes",
            "Of the uploaded bytes, the draft model's KV (companion state, --draft-model).",
        ),
        _counter(_SHARED, "already_shared", "Uploads skipped because the entry's manifest already existed."),
        _counter(_SHARED, "conflicts_412", "Uploads whose conditional manifest put answered 412 (a lost race)."),
        _counter(_SHARED, "upload_failures", "Uploads that failed (store unreachable, 5xx, throttled)."),
        _counter(_SHARED, "upload_over_budget", "Uploads skipped as over the daily byte budget."),
        _counter(_SHARED, "upload_queue_full", "Uploads refused because the upload queue was full."),
        _counter(_SHARED, "below_admission", "Local entries not offered: too short and not hit often enough yet."),
        _counter(_SHARED, "downloads", "Shared entries downloaded, verified and adopted into the SSD tier."),
        _counter(_SHARED, "download_bytes", "Bytes received from the shared store by downloads."),
        _counter(
            _SHARED,
            "download_companion_bytes",
            "Of the downloaded bytes, the draft model's KV (companion state, --draft-model).",
        ),
        _counter(_SHARED, "download_failures", "Downloads that failed (unreachable, 5xx, partial, object gone)."),
        _counter(_SHARED, "download_timeouts", "Requests that went on without a download after the timeout."),
        _counter(_SHARED, "refused", "Shared manifests or objects refused by a check (objects quarantined)."),
        _counter(_SHARED, "listing_failures", "Refreshes of the shared index that failed."),
        _counter(_SHARED, "refreshes", "Completed refreshes of the shared index."),
        _gauge(_SHARED, "upload_queue", "Entries waiting to be uploaded."),
        _gauge(_SHARED, "upload_queue_max", "Bound of the upload queue."),
        _gauge(
            _SHARED,
            "upload_bytes_today",
            "Bytes uploaded this UTC day (against the budget).",
            name="kvcellar_shared_cache_upload_today_bytes",
        ),
        _gauge(
            _SHARED,
            "upload_bytes_per_day",
            "Daily upload byte budget.",
            name="kvcellar_shared_cache_upload_budget_bytes",
        ),
        _gauge(
            _SHARED,
            "index_age_s",
            "Seconds since the shared index was last refreshed (-1 before the first).",
            name="kvcellar_shared_cache_index_age_seconds",
        ),
    ),
)

# Fields exported by their own families below, or text that is no number.
_STRUCTURED = {(_SSD, "journal"), (_SCHEDULER, "batch_size_history")}
_STRUCTURED |= {("requests", "ttft_seconds_buckets"), ("requests", "ttft_seconds_sum"), ("requests", "ttft_count")}
_STRUCTURED |= {("flush", "last")}
# Per-tenant breakdowns (`serve --tenants`), exported by `tenant_families` with a `tenant` label.
_STRUCTURED |= {(_RAM, "by_tenant"), (_SSD, "by_tenant")}
# Issue 21's nested sections, exported by `ssd_wear_families`.
_STRUCTURED.update({(_SSD, "admission"), (_SSD, "write_budget"), (_SSD, "write_wear")})

# Generation checkpoints' section (spec §5.7), appended after the others.
SPECS += (
    _gauge(_CHECKPOINTS, "interval_tokens", "Emitted tokens between two checkpoints of a generation."),
    _counter(_CHECKPOINTS, "written", "Generation checkpoints written to the SSD tier."),
    _counter(_CHECKPOINTS, "written_bytes", "Bytes of the generation checkpoints written."),
    _counter(_CHECKPOINTS, "resumed", "Generations resumed from a checkpoint."),
    _counter(_CHECKPOINTS, "tokens_saved", "Emitted tokens resumed generations took from checkpoints."),
    _gauge(_CHECKPOINTS, "pending", "Checkpoints queued or being written."),
    _gauge(_CHECKPOINTS, "pending_bytes", "Bytes of the checkpoints queued or being written."),
    _counter(_CHECKPOINTS, "failed", "Checkpoints whose write failed."),
    _counter(_CHECKPOINTS, "dropped", "Checkpoints dropped unwritten (superseded, over the cap, completed, shutdown)."),
    _counter(_CHECKPOINTS, "invalidated", "Checkpoints of generations that completed."),
    _counter(_CHECKPOINTS, "removed", "Checkpoint files of completed generations removed."),
    _counter(_CHECKPOINTS, "quarantined", "Checkpoint files quarantined as unreadable or mismatched."),
    _counter(_CHECKPOINTS, "wiped", "Checkpoint files removed by a cache wipe."),
    _counter(_CHECKPOINTS, "restore_failures", "Checkpoint restores that failed (the request ran cold)."),
    _gauge(_CHECKPOINTS, "files", "Checkpoint files the SSD tier holds."),
    _gauge(_CHECKPOINTS, "companion_bytes", "Of the checkpoint files' bytes, the draft model's KV (companion state)."),
    _gauge(_CHECKPOINTS, "queue_max_bytes", "Byte cap of the checkpoint queue (its share of the spill queue's)."),
)
_STRUCTURED.add((_CHECKPOINTS, "skipped"))

# The restore policy's section (issue 44), exported by `restore_policy_families`.
_STRUCTURED.update({("restore_policy", "plans"), ("restore_policy", "costs")})

# Paged KV's pool section (spec §6, `--paged-kv`; `{}` when off), appended after the others.
SPECS += (
    _gauge("paged_kv", "block_size", "Tokens per paged-KV block."),
    _gauge("paged_kv", "pools", "Live paged-KV block pools (one per paged layer of each running request)."),
    _gauge("paged_kv", "blocks_total", "Blocks the live paged-KV pools reserve."),
    _gauge("paged_kv", "blocks_free", "Blocks of the live paged-KV pools that hold no token."),
    _counter("paged_kv", "pools_created", "Paged-KV block pools made since start."),
)


# The KV events' resident set (http/kv_events.py); the digests' sha256 is for replay checks, not a number.
SPECS += (
    _gauge("kv_events", "block_size", "Tokens per block of the KV events (GET /v1/kv_events)."),
    _counter("kv_events", "sequence", "KV events published (the sequence number of the last one)."),
    _gauge("kv_events", "blocks_ram", "Blocks the RAM tier holds, as the KV events publish them."),
    _gauge("kv_events", "blocks_ssd", "Blocks the SSD tier holds, as the KV events publish them."),
)
_STRUCTURED.add(("kv_events", "resident_sha256"))
_STRUCTURED.add((_SHARED, "recent_restores"))

_TOOL_GRAMMAR = "tool_call_grammar"

# The tool-call grammar's counts (http/tool_grammar.py), appended after the others.
SPECS += (
    _counter(
        _TOOL_GRAMMAR,
        "calls",
        "Tool calls the tool-call grammar constrained (each start marker it saw in a reply).",
        name="kvcellar_tool_call_grammar",
    ),
    _counter(_TOOL_GRAMMAR, "requests", "Requests generated with the tool-call grammar attached."),
    _counter(
        _TOOL_GRAMMAR,
        "fallbacks",
        "Requests whose tools' schemas did not compile even relaxed: unconstrained.",
    ),
    _counter(
        _TOOL_GRAMMAR, "relaxed", "Requests whose tools' schemas were relaxed for the grammar (keywords dropped)."
    ),
    _gauge(
        _TOOL_GRAMMAR,
        "compile_ms_last",
        "Seconds the last request's tool-call grammar took to compile (or to come from its cache).",
        name="kvcellar_tool_call_grammar_compile_last_seconds",
        scale=0.001,
    ),
)


# What requests had clamped, left out and rewritten on the way in (http/inbound.py).
SPECS += (_counter("inbound", "max_tokens_clamped", "Requests whose reply bound was clamped to the context's room."),)
_STRUCTURED.update({("inbound", "hosted_tools_left_out"), ("inbound", "prompt_rewrites")})


# Speculative decoding (`serve --draft-model`, engine/speculative.py).
_SPEC = "speculative"
SPECS += (
    _counter(_SPEC, "requests", "Requests decoded with the draft model."),
    _counter(_SPEC, "serial_fallbacks", "Speculative requests sent to the serial lane (no per-row acceptance)."),
    _counter(_SPEC, "rounds", "Draft-and-verify rounds run."),
    _counter(_SPEC, "proposed_tokens", "Tokens the draft model proposed."),
    _counter(_SPEC, "accepted_tokens", "Proposed tokens the target model accepted."),
    _gauge(_SPEC, "acceptance_rate", "Accepted over proposed draft tokens, since start."),
    _gauge(_SPEC, "accepted_tokens_per_step", "Draft tokens accepted per round, since start."),
    _gauge(_SPEC, "tokens_per_step", "Tokens emitted per round (accepted plus the target's own), since start."),
    _gauge(_SPEC, "draft_time_share", "Share of the rounds' time spent in the draft model."),
    _counter(_SPEC, "companion_restored", "Takes whose draft KV came from the tiers with the target's."),
    _counter(_SPEC, "draft_reprefill_tokens", "Tokens the draft re-prefilled because its tier state was unusable."),
)
_STRUCTURED.update({(_SPEC, "refused"), (_SPEC, "draft_reprefills")})


def speculative_families(speculative: Mapping[str, Any]) -> Iterator[CounterMetricFamily]:
    """Requests decoded without the draft, and takes that re-prefilled it, by reason."""
    for field, help in (
        ("refused", "Requests the draft model could not serve exactly, decoded plainly, by reason."),
        ("draft_reprefills", "Takes whose draft KV was missing or stale (re-prefilled), by reason."),
    ):
        family = CounterMetricFamily(f"kvcellar_speculative_{field}", help, labels=["reason"])
        for reason, count in sorted((speculative.get(field) or {}).items()):
            family.add_metric([str(reason)], float(count))
        yield family


class StatsCollector(Collector):
    """Typed families over `stats()`, read afresh on every scrape."""

    def __init__(self, stats: StatsSource) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        yield from described_families(stats)
        yield journal_degraded_family(_section(stats, _SSD).get("journal"))
        yield batch_decode_steps_family(_section(stats, _SCHEDULER).get("batch_size_history"))
        yield _serving_info_family(stats)
        yield from request_ttft_families(_section(stats, "requests"))
        yield from last_flush_families(_section(stats, "flush").get("last"))
        yield from ssd_wear_families(_section(stats, _SSD))
        yield from tenant_families(stats)
        yield checkpoints_skipped_family(_section(stats, _CHECKPOINTS).get("skipped"))
        yield from inbound_families(_section(stats, "inbound"))
        yield from restore_policy_families(_section(stats, "restore_policy"))
        yield from speculative_families(_section(stats, _SPEC))
        yield from undescribed_families(stats)


def metrics_registry(stats: StatsSource) -> CollectorRegistry:
    """A private registry (not prometheus_client's global one) for one app."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats))
    return registry


def render_metrics(registry: CollectorRegistry) -> bytes:
    """The exposition, to be served as `prometheus_client.CONTENT_TYPE_LATEST`."""
    return generate_latest(registry)


def described_families(stats: Mapping[str, Any]) -> Iterator[Metric]:
    for spec in SPECS:
        value = _number(_section(stats, spec.section).get(spec.field))
        if value is None:
            continue
        family_type = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
        yield family_type(spec.name, spec.help, value=value * spec.scale)


def journal_degraded_family(journal: Any) -> GaugeMetricFamily:
    """`journal` is "ok"/"degraded" or {"state": "ok"|"degraded"|"off", "reason": ...}."""
    state = journal.get("state") if isinstance(journal, Mapping) else journal
    return GaugeMetricFamily(
        "kvcellar_journal_degraded",
        "1 when the SSD journal is degraded (writes failed; the next start reconciles), else 0 "
        "(healthy, off, or no SSD tier).",
        value=1.0 if state == "degraded" else 0.0,
    )


def batch_decode_steps_family(history: Any) -> CounterMetricFamily:
    """`batch_size_history` ({"1": 40, "4": 120}) as one family labelled by `rows`."""
    family = CounterMetricFamily(
        "kvcellar_scheduler_decode_steps",
        "Decode steps the batch lane took, by the number of rows the batch held at that step.",
        labels=["rows"],
    )
    if isinstance(history, Mapping):
        for rows, steps in sorted(history.items(), key=lambda item: int(item[0])):
            family.add_metric([str(rows)], float(steps))
    return family


def inbound_families(inbound: Mapping[str, Any]) -> Iterator[CounterMetricFamily]:
    """The hosted tools left out by kind and the prompt rewrites by rule, as labelled counters."""
    for field, label, help in (
        ("hosted_tools_left_out", "kind", "Hosted or server tools left out of prompts, by tool type."),
        ("prompt_rewrites", "rule", "System texts a prompt-normalisation rule rewrote, by rule."),
    ):
        family = CounterMetricFamily(f"kvcellar_inbound_{field}", help, labels=[label])
        counts = inbound.get(field)
        if isinstance(counts, Mapping):
            for name, count in sorted(counts.items()):
                family.add_metric([str(name)], float(count))
        yield family


def restore_policy_families(policy: Mapping[str, Any]) -> Iterator[Metric]:
    """The plans the restore policy chose, by plan, and its cost model's tier rates, by tier (issue 44)."""
    plans = CounterMetricFamily(
        "kvcellar_restore_policy_plans",
        "Requests whose cached prefix on the SSD tier the restore policy served, by plan (restore, recompute, split).",
        labels=["plan"],
    )
    for plan, count in sorted((policy.get("plans") or {}).items()):
        plans.add_metric([str(plan)], float(count))
    yield plans
    tiers = _section(_section(policy, "costs"), "tiers")
    for field, scale, name, help in (
        ("mb_per_s", 1e6, "bytes_per_second", "The cost model's restore bandwidth of a tier, by tier."),
        ("fixed_ms", 1e-3, "fixed_seconds", "The cost model's fixed cost of one restore from a tier, by tier."),
    ):
        family = GaugeMetricFamily(f"kvcellar_restore_policy_{name}", help, labels=["tier"])
        for tier, rate in sorted(tiers.items()):
            value = _number(rate.get(field)) if isinstance(rate, Mapping) else None
            if value is not None:
                family.add_metric([str(tier)], value * scale)
        yield family


def _serving_info_family(stats: Mapping[str, Any]) -> InfoMetricFamily:
    return InfoMetricFamily(
        "kvcellar_serving",
        "How this server serves: the KV scheme and the scheduler lane (batch or serial).",
        value={"kv_scheme": str(stats.get("kv_scheme", "")), "lane": str(_section(stats, _SCHEDULER).get("lane", ""))},
    )


def undescribed_families(stats: Mapping[str, Any]) -> Iterator[GaugeMetricFamily]:
    """Numeric fields no spec names, so a new `/stats` field is never silently lost."""
    declared = {(spec.section, spec.field) for spec in SPECS} | _STRUCTURED
    declared_names = {spec.name for spec in SPECS}
    for path, value in _numeric_leaves((), stats):
        if path[:2] in declared:
            continue
        name = re.sub(r"[^a-zA-Z0-9_]", "_", "_".join(("kvcellar",) + path))
        if name not in declared_names:
            yield GaugeMetricFamily(name, f"/stats {'.'.join(path)}: {UNDESCRIBED_HELP}.", value=value)


def _numeric_leaves(prefix: tuple[str, ...], value: Any) -> Iterator[tuple[tuple[str, ...], float]]:
    if isinstance(value, Mapping):
        for key, inner in sorted(value.items()):
            yield from _numeric_leaves(prefix + (str(key),), inner)
        return
    number = _number(value)
    if number is not None:
        yield prefix, number


def _section(stats: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    section = stats.get(name)
    return section if isinstance(section, Mapping) else {}


def _number(value: Any) -> float | None:
    # bool is an int: True/False export as 1/0; text and None are no sample.
    if isinstance(value, (bool, int, float)):
        return float(value)
    return None


def request_ttft_families(requests: Mapping[str, Any]) -> Iterator[HistogramMetricFamily]:
    """`requests.ttft_seconds_buckets` ({"0.05": 3, ..., "+Inf": 9}, cumulative),
    `_sum` and `_count` as one histogram; none without the section."""
    buckets = requests.get("ttft_seconds_buckets")
    if not isinstance(buckets, Mapping) or "+Inf" not in buckets:
        return
    yield HistogramMetricFamily(
        "kvcellar_request_ttft_seconds",
        "Time from a request reaching the system to its first token (queueing included), per request.",
        buckets=[(bound, float(count)) for bound, count in buckets.items()],
        sum_value=float(requests.get("ttft_seconds_sum", 0.0)),
    )


def last_flush_families(last: Any) -> Iterator[GaugeMetricFamily]:
    """The last flush verdict (`flush.last`); none before the first flush."""
    if not isinstance(last, Mapping):
        return
    yield GaugeMetricFamily(
        "kvcellar_flush_last_durable",
        "1 when the last flush answered durable, else 0.",
        value=float(bool(last["durable"])),
    )
    yield GaugeMetricFamily(
        "kvcellar_flush_last_answered_timestamp_seconds",
        "When the last flush answered, Unix seconds.",
        value=float(last["answered_at_s"]),
    )
    yield GaugeMetricFamily(
        "kvcellar_flush_last_pending",
        "Records of the last flush's scope still dirty when it answered.",
        value=float(last["pending"]),
    )


# (section key, field, family name, kind, help) of issue 21's SSD write-wear figures.
_WEAR_SPECS = (
    (
        "write_wear",
        "bytes_written",
        "kvcellar_ssd_cache_written_bytes",
        "counter",
        "Bytes written to the SSD tier since start.",
    ),
    (
        "write_wear",
        "dead_writes",
        "kvcellar_ssd_cache_dead_writes",
        "counter",
        "SSD entries evicted without ever being restored.",
    ),
    (
        "write_wear",
        "rewrites",
        "kvcellar_ssd_cache_rewrites",
        "counter",
        "SSD entries superseded by a newer write of their prefix.",
    ),
    (
        "admission",
        "held",
        "kvcellar_ssd_cache_admission_held",
        "counter",
        "Write-behind snapshots SSD admission held back.",
    ),
    (
        "admission",
        "skipped",
        "kvcellar_ssd_cache_admission_skipped",
        "counter",
        "Spills SSD admission refused: entries left RAM unwritten.",
    ),
    (
        "write_budget",
        "level_bytes",
        "kvcellar_ssd_cache_write_budget_level_bytes",
        "gauge",
        "Bytes the SSD write budget holds now (negative: overdrawn by flushes).",
    ),
    (
        "write_budget",
        "over_budget_bytes",
        "kvcellar_ssd_cache_over_budget_bytes",
        "counter",
        "Bytes flushes wrote past the SSD write budget.",
    ),
    (
        "write_budget",
        "waits",
        "kvcellar_ssd_cache_write_budget_waits",
        "counter",
        "Background writes that waited for the SSD write budget.",
    ),
)


def ssd_wear_families(ssd: Mapping[str, Any]) -> Iterator[Metric]:
    """Admission, write-budget and write-wear figures of `/stats` `ssd_cache`,
    each present only when its section is (the budget only with one set)."""
    for section, field, name, kind, help_text in _WEAR_SPECS:
        values = _section(ssd, section)
        if section == "write_wear":
            values = _section(values, "total")
        value = _number(values.get(field))
        if value is None:
            continue
        family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        yield family_type(name, help_text, value=value)


# (section, field, family name, kind, help) of the per-tenant figures; the label is the tenant's name.
_TENANT_SPECS = (
    (_RAM, "entries", "kvcellar_prompt_cache_tenant_entries", "gauge", "Entries the RAM tier holds, by tenant."),
    (_RAM, "bytes", "kvcellar_prompt_cache_tenant_bytes", "gauge", "Bytes the RAM tier holds, by tenant."),
    (_RAM, "max_bytes", "kvcellar_prompt_cache_tenant_max_bytes", "gauge", "RAM quota, by tenant (if set)."),
    (_RAM, "hits", "kvcellar_prompt_cache_tenant_hits", "counter", "Takes that served a prefix, by tenant."),
    (_RAM, "misses", "kvcellar_prompt_cache_tenant_misses", "counter", "Takes that served nothing, by tenant."),
    (
        _RAM,
        "cached_tokens",
        "kvcellar_prompt_cache_tenant_cached_tokens",
        "counter",
        "Prompt tokens served from the tiers instead of prefilled, by tenant.",
    ),
    (_SSD, "entries", "kvcellar_ssd_cache_tenant_entries", "gauge", "Entries the SSD tier indexes, by tenant."),
    (_SSD, "bytes", "kvcellar_ssd_cache_tenant_bytes", "gauge", "Bytes of the SSD tier's entries, by tenant."),
    (_SSD, "max_bytes", "kvcellar_ssd_cache_tenant_max_bytes", "gauge", "SSD quota, by tenant (if set)."),
    (_SSD, "hits", "kvcellar_ssd_cache_tenant_hits", "counter", "SSD entries hit, by tenant."),
)


def tenant_families(stats: Mapping[str, Any]) -> Iterator[Metric]:
    """The tiers' `by_tenant` breakdowns, one family per figure labelled `tenant` (names, never keys);
    none for a tier without tenants (or absent)."""
    for section, field, name, kind, help_text in _TENANT_SPECS:
        family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        family = family_type(name, help_text, labels=["tenant"])
        for tenant, figures in sorted(_section(_section(stats, section), "by_tenant").items()):
            value = _number(figures.get(field)) if isinstance(figures, Mapping) else None
            if value is not None:
                family.add_metric([str(tenant)], value)
        if family.samples:
            yield family


def checkpoints_skipped_family(skipped: Any) -> CounterMetricFamily:
    """Requests not checkpointed, by reason (logprobs, grammar, request_processors, no_prompt_cache)."""
    family = CounterMetricFamily(
        "kvcellar_checkpoints_skipped",
        "Generations not checkpointed because a token replay cannot reconstruct them, by reason.",
        labels=["reason"],
    )
    for reason, count in sorted((skipped or {}).items()):
        family.add_metric([str(reason)], float(count))
    return family


__all__ = [
    "SPECS",
    "UNDESCRIBED_HELP",
    "MetricSpec",
    "StatsCollector",
    "batch_decode_steps_family",
    "checkpoints_skipped_family",
    "described_families",
    "journal_degraded_family",
    "last_flush_families",
    "metrics_registry",
    "render_metrics",
    "request_ttft_families",
    "ssd_wear_families",
    "tenant_families",
    "undescribed_families",
]
