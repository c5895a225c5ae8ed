"""Fixed cases of the 0/1 Adam and 1-bit LAMB MPI-vs-shard_map test (shared by the worker and the test)."""

from __future__ import annotations

import numpy as np

STEPS = 10
# name -> (optimizer, keyword arguments); schedules short enough that 10 updates pass every phase.
CASES = {
    "zero_one_fused": ("zero_one_adam", dict(var_freeze_step=4, var_update_scaler=2, local_step_scaler=2,
                                             local_step_clipper=2, weight_decay=0.01, fused=True)),
    "zero_one_perleaf": ("zero_one_adam", dict(var_freeze_step=4, var_update_scaler=2, local_step_scaler=2,
                                               local_step_clipper=2, fused=False)),
    "lamb": ("onebit_lamb", dict(freeze_step=3, weight_decay=0.01, max_coeff=0.5)),
}


def params0() -> dict:
    rng = np.random.default_rng(7)
    return {"w": rng.standard_normal((5, 7)).astype(np.float32), "b": rng.standard_normal(13).astype(np.float32)}


def grads(world: int) -> list[list[dict]]:
    """``grads[t][r]``: rank r's local gradient at update t."""
    rng = np.random.default_rng(200 + world)
    return [[{"w": rng.standard_normal((5, 7)).astype(np.float32), "b": rng.standard_normal(13).astype(np.float32)}
             for _ in range(world)] for _ in range(STEPS)]


def build(name: str, **extra):
    import jonebit

    opt, kwargs = CASES[name]
    return getattr(jonebit, opt)(1e-2, **kwargs, **extra)
