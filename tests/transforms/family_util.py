"""Shared harness of the 0/1 Adam and 1-bit LAMB tests: meshes, per-rank steps, random per-rank gradients."""

from __future__ import annotations

import jax
import numpy as np
import optax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P


def mesh_of(p):
    return jax.make_mesh((p,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:p])


def make_params(rng):
    # 13 + 35 + 24 = 72 elements: not a multiple of P * lcm(P, 8) for P = 2, 4, 8, so the fused buffer is padded.
    return {"b": rng.standard_normal(13).astype(np.float32), "w": rng.standard_normal((5, 7)).astype(np.float32),
            "z": rng.standard_normal((4, 6)).astype(np.float32)}


def random_grads(rng, params0, p, scale=1.0):
    return [{k: (scale * rng.standard_normal(v.shape)).astype(np.float32) for k, v in params0.items()}
            for _ in range(p)]


def stack(grads):
    return {k: np.stack([g[k] for g in grads]) for k in grads[0]}


def per_rank_stepper(tx, mesh, specs):
    """Jitted step over params carried per rank (leading rank axis) and per-rank gradients."""

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P("data"), specs, P("data")), out_specs=(P("data"), specs))
    def step(params, state, grads):
        params, grads = (jax.tree.map(lambda x: x[0], t) for t in (params, grads))
        updates, state = tx.update(grads, state, params)
        return jax.tree.map(lambda x: x[None], optax.apply_updates(params, updates)), state

    return step


def replicated_stepper(tx, mesh, specs):
    """Jitted step over replicated params: each rank differentiates at the same point, gradients per rank."""

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs))
    def step(params, state, grads):
        grads = jax.tree.map(lambda g: g[0], grads)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def put_rows(tree, mesh):
    return jax.device_put(tree, jax.NamedSharding(mesh, P("data")))


def put_replicated(tree, mesh):
    return jax.device_put(tree, jax.NamedSharding(mesh, P()))
