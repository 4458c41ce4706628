"""`SimDisk`'s fault rates (`FaultConfig`) and deterministic clock (`TickClock`)."""

from __future__ import annotations

from typing import Any

import attrs

_CLOCK_START_NS = 1_700_000_000_000_000_000
_CLOCK_STEP_NS = 1_000


def _rate(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{attribute.name} must be in [0, 1], got {value}")


@attrs.frozen(kw_only=True)
class FaultConfig:
    """Probability per call of each injected fault; all 0 by default."""

    fsync_eio_rate: float = attrs.field(default=0.0, validator=_rate)
    write_enospc_rate: float = attrs.field(default=0.0, validator=_rate)
    write_eio_rate: float = attrs.field(default=0.0, validator=_rate)
    read_bitflip_rate: float = attrs.field(default=0.0, validator=_rate)
    misdirected_write_rate: float = attrs.field(default=0.0, validator=_rate)


class TickClock:
    """A deterministic clock: each call is `step_ns` later than the last."""

    def __init__(self, start_ns: int = _CLOCK_START_NS, step_ns: int = _CLOCK_STEP_NS) -> None:
        self._next_ns = start_ns
        self._step_ns = step_ns

    def __call__(self) -> int:
        now_ns = self._next_ns
        self._next_ns += self._step_ns
        return now_ns
