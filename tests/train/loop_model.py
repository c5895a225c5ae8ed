"""A small run for the loop tests: an MLP with input noise (uses the engine's keys), 1-bit Adam, ArrayBatches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jonebit
from jonebit.sharding.mesh import data_mesh
from jonebit.train.engine import init_train_state, make_train_step
from jonebit.train.loop import ArrayBatches, LoopConfig

DIM, HID, FREEZE = 6, 8, 3


def params0():
    r = np.random.default_rng(0)
    return {"w1": jnp.asarray(r.normal(size=(DIM, HID)) * 0.5, jnp.float32), "b1": jnp.zeros((HID,), jnp.float32),
            "w2": jnp.asarray(r.normal(size=(HID, 1)) * 0.5, jnp.float32)}


def loss_fn(p, batch, rng):
    x = batch["x"] + 0.1 * jax.random.normal(rng, batch["x"].shape)  # noise drawn from the engine's key
    pred = (jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"])[:, 0]
    return jnp.mean((pred - batch["y"]) ** 2)


def data(n=96):
    r = np.random.default_rng(7)
    x = r.normal(size=(n, DIM)).astype(np.float32)
    return {"x": x, "y": np.sin(x.sum(1)).astype(np.float32)}


def make_run(out, *, max_steps, checkpoint_every, async_checkpoint=False, mesh=None, **loop_kw):
    mesh = mesh or data_mesh()
    tx = jonebit.onebit_adam(1e-2, freeze_step=FREEZE, fused=True)
    state, specs = init_train_state(tx, params0(), mesh)
    step = make_train_step(loss_fn, tx, mesh, specs, accumulation_steps=2, rng_seed=3)
    batches = ArrayBatches(data(), batch_size=mesh.size * 4, seed=11)
    config = LoopConfig(output_dir=out, max_steps=max_steps, checkpoint_every=checkpoint_every,
                        async_checkpoint=async_checkpoint, progress_bar=False,
                        steps_per_print=0, **loop_kw)
    return step, state, batches, config
