"""Inputs shared by the MPI workers and the in-process shard_map reference (identical on both sides)."""

from __future__ import annotations

import numpy as np

# (buffer length, consecutive calls with the error buffers carried over)
ALLREDUCE_CASES = [(1, 2), (37, 3), (1000, 3), (4099, 4)]


def allreduce_inputs(n: int, world: int, steps: int) -> np.ndarray:
    """``(steps, world, n)`` float32 with a wide dynamic range and some exact zeros."""
    rng = np.random.default_rng(1000 * n + world)
    x = rng.standard_normal((steps, world, n)).astype(np.float32)
    x *= np.logspace(-4, 2, n, dtype=np.float32)
    x[..., ::7] = 0.0
    return x


def mean_inputs(world: int) -> list[dict]:
    """Per-rank pytrees with two dtypes and several shapes (exercises the per-dtype fusion)."""
    rng = np.random.default_rng(7 + world)
    return [
        {
            "w": rng.standard_normal((3, 5)).astype(np.float32) * 1e3,
            "b": rng.standard_normal((7,)).astype(np.float32),
            "s": np.float32(rng.standard_normal()),
            "h": rng.standard_normal((4,)).astype(np.float16),
        }
        for _ in range(world)
    ]
