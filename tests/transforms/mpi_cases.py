"""Fixed per-rank gradient sequences for the 1-bit Adam MPI-vs-shard_map test."""

from __future__ import annotations

import numpy as np

STEPS = 6
FREEZE_STEP = 2
CONFIGS = {  # name -> (fused, mean mode of the MPI backend, weight decay, variance_refresh)
    "fused": (True, "ordered", 0.0, None),
    "perleaf": (False, "ordered", 0.01, None),
    "fused_allreduce": (True, "allreduce", 0.0, None),
    "perleaf_refresh": (False, "ordered", 0.01, 2),  # updates 3 and 5 exact (MPI_Allreduce), 2 and 4 compressed
}


def params0() -> dict:
    rng = np.random.default_rng(0)
    return {"w": rng.standard_normal((5, 7)).astype(np.float32), "b": rng.standard_normal(13).astype(np.float32)}


def grads(world: int) -> list[list[dict]]:
    """``grads[t][r]``: rank r's local gradient at step t (different per rank, wide range)."""
    rng = np.random.default_rng(100 + world)
    return [
        [
            {
                "w": (rng.standard_normal((5, 7)) * 10.0 ** rng.uniform(-3, 1)).astype(np.float32),
                "b": (rng.standard_normal(13) * 10.0 ** rng.uniform(-3, 1)).astype(np.float32),
            }
            for _ in range(world)
        ]
        for _ in range(STEPS)
    ]
