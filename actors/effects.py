"""The effects and messages every actor shares, Trio-free so that the pure
cores can emit them: timers (`ArmTimer`, `CancelTimer`, answered by
`TimerFired`) and journal lines (`JournalEvent`). The shell
(`actors/runtime.py`, which re-exports them) carries them out itself.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class ArmTimer:
    """Send `TimerFired(key)` to this actor after `delay_s` (re-arming replaces)."""

    key: Hashable
    delay_s: float


@attrs.frozen(kw_only=True)
class CancelTimer:
    key: Hashable


@attrs.frozen(kw_only=True)
class TimerFired:
    key: Hashable


@attrs.frozen(kw_only=True)
class JournalEvent:
    """Append `event` (an attrs event registered in `store.events`) to the journal."""

    event: Any
