"""Test helper: where an MLX array's bytes live, to tell a step that writes in place from one that copies."""

import mlx.core as mx
import numpy as np


def buffer_address(array: mx.array) -> int:
    """The address of the array's bytes (a step that copies moves them)."""
    view = memoryview(array)
    try:
        return np.frombuffer(view, dtype=np.uint8).ctypes.data
    finally:
        view.release()
