"""The run shared by the MPI engine worker and its jax-collective reference (tests/train/test_engine_mpi.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

DIM, HID = 6, 8
MICRO, ACCUM = 2, 2  # per rank: 2 micro-batches of 2 examples
STEPS = 6
FREEZE = 3  # DeepSpeed's freeze_step: 2 warmup updates, then compression
NAN_STEP, NAN_RANK = 5, 1  # 1-based optimizer step whose batch on rank NAN_RANK holds a NaN (a compression step)
SEED = 3


def config(world: int, backend: str = "mpi", opt: str = "OneBitAdam") -> dict:
    """A DeepSpeed 1-bit Adam config as its Ethernet tutorial writes it (comm_backend_name "mpi")."""
    return {
        "train_batch_size": MICRO * ACCUM * world,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "steps_per_print": 100,
        "optimizer": {"type": opt, "params": {
            "lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "cuda_aware": False,
            "comm_backend_name": backend, **schedule(opt)}},
    }


def schedule(opt: str) -> dict:
    """The freeze point; 0/1 Adam: its variance freeze, then local steps whose sync interval doubles at once
    (updates 3-6: sync, sync, local, ...), so each rank's copy parts from the others within the run."""
    if opt == "ZeroOneAdam":
        return {"var_freeze_step": FREEZE - 1, "local_step_scaler": 1}
    return {"freeze_step": FREEZE}


def rank_params(params, rank: int) -> dict:
    """This rank's parameters: its own copy with 0/1 Adam (``RankParams``), else the replicated tree."""
    from jonebit.train.engine import RankParams

    if isinstance(params, RankParams):
        return {k: np.asarray(jax.device_get(v))[rank] for k, v in params.copies.items()}
    return {k: np.asarray(jax.device_get(v)) for k, v in params.items()}


def params0():
    r = np.random.default_rng(0)
    return {"w1": jnp.asarray(r.normal(size=(DIM, HID)) * 0.5, jnp.float32), "b1": jnp.zeros((HID,), jnp.float32),
            "w2": jnp.asarray(r.normal(size=(HID, 1)) * 0.5, jnp.float32)}


def loss_fn(p, batch, rng):
    x = batch["x"] + 0.1 * jax.random.normal(rng, batch["x"].shape)  # noise from the engine's per-rank key
    pred = (jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"])[:, 0]
    return jnp.mean((pred - batch["y"]) ** 2)


def data(n=96):
    r = np.random.default_rng(7)
    x = r.normal(size=(n, DIM)).astype(np.float32)
    return {"x": x, "y": np.sin(x.sum(1)).astype(np.float32)}


def global_batch(world: int, t: int, nan: bool = True) -> dict:
    """The global batch of 0-based step ``t``: rows in rank order; rank NAN_RANK's slice poisoned at NAN_STEP."""
    d = data()
    n = MICRO * ACCUM * world
    rows = (np.arange(n) + t * n) % len(d["x"])
    batch = {k: v[rows].copy() for k, v in d.items()}
    if nan and t + 1 == NAN_STEP and world > NAN_RANK:
        batch["x"][NAN_RANK * MICRO * ACCUM, 0] = np.nan
    return batch


def rank_slice(batch: dict, rank: int) -> dict:
    per = MICRO * ACCUM
    return {k: v[rank * per:(rank + 1) * per] for k, v in batch.items()}
