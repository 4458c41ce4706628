"""Trio's scheduler, made deterministic for one seed.

Trio shuffles each batch of runnable tasks with its module-level
`random.Random` (`trio._core._run._r`) once the deterministic-scheduling
flag is set (the flag Hypothesis sets through Trio's plugin). Both are
private, so the Trio version is pinned in pyproject.toml and checked here:
an upgrade that renames them fails loudly instead of silently losing
reproducibility.
"""

from __future__ import annotations

import trio
import trio._core._run as trio_run

from kvcellar.errors import DeterminismUnavailable

TRIO_VERSION_PINNED = "0.35.0"


def check_trio() -> None:
    missing = [name for name in ("_r", "_ALLOW_DETERMINISTIC_SCHEDULING") if not hasattr(trio_run, name)]
    if missing:
        raise DeterminismUnavailable(
            f"trio {trio.__version__} lacks {', '.join(missing)}; the simulator needs trio {TRIO_VERSION_PINNED}"
        )


def seed_trio(seed: int) -> None:
    """Seed Trio's scheduler and switch its deterministic ordering on (process-wide)."""
    check_trio()
    trio_run._ALLOW_DETERMINISTIC_SCHEDULING = True  # type: ignore[misc]  # Final in trio; set on purpose (pinned)
    trio_run._r.seed(f"trio-{seed}")
