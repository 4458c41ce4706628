"""Python scalars from one-element MLX arrays, typed.

MLX's stubs give `array.item()` as `int | float | complex` whatever the
dtype; these say which one the caller knows it is (a token id, a logit), so
every call site does not repeat the cast.
"""

from __future__ import annotations

from typing import cast

import mlx.core as mx


def item_int(array: mx.array) -> int:
    """The integer in a one-element integer array (a sampled token id)."""
    return int(cast(int, array.item()))


def item_float(array: mx.array) -> float:
    """The number in a one-element floating-point array (a logit, a logprob)."""
    return float(cast(float, array.item()))
