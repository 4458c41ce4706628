"""`/stats` as Prometheus text exposition (version 0.0.4)."""

from __future__ import annotations

import re
from typing import Any

_COUNTER_WORDS = ("hits", "misses", "restores", "spills", "evictions", "supersessions", "demotions",
                  "puts", "dropped", "failed", "failures", "quarantined", "oversize", "cold_hits", "cold_refused",
                  "batches", "admitted", "completed", "cancelled", "rejected")


def _metric_name(*parts: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", "_".join(("kvcellar",) + parts))


def _samples(prefix: tuple[str, ...], value: Any) -> list[tuple[str, float]]:
    if isinstance(value, dict):
        out: list[tuple[str, float]] = []
        for key, inner in sorted(value.items()):
            out.extend(_samples(prefix + (str(key),), inner))
        return out
    if isinstance(value, bool):
        return [(_metric_name(*prefix), 1.0 if value else 0.0)]
    if isinstance(value, (int, float)):
        return [(_metric_name(*prefix), float(value))]
    return []


def prometheus_text(stats: dict[str, Any]) -> str:
    """Every numeric (or boolean) field of `stats`, one gauge or counter each."""
    lines = []
    for name, value in _samples((), stats):
        if any(name.endswith(word) for word in _COUNTER_WORDS):
            kind, name = "counter", f"{name}_total"
        else:
            kind = "gauge"
        lines.append(f"# TYPE {name} {kind}")
        lines.append(f"{name} {value:g}" if value == int(value) else f"{name} {value}")
    return "\n".join(lines) + "\n"
