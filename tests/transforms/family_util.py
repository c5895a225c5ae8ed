"""Shared harness of the 0/1 Adam and 1-bit LAMB tests: meshes, per-rank steps, random per-rank gradients."""

from __future__ import annotations

import jax
import numpy as np
import optax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jonebit import sharded_init


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


def check_compact_mask(make_tx, grad_scale=lambda t: 1.0, steps=20, per_rank=False):
    """``make_tx(exp_avg_mask)`` with a mask on rows 3+ of "w" in onebit_adam's compact form (None leaves, a
    ``(rows, 1)`` column) ends bit-identical to the full 0/1 mask, and unlike no mask at all (2 ranks)."""
    full = {"b": np.ones(13, np.float32), "w": np.ones((5, 7), np.float32), "z": np.ones((4, 6), np.float32)}
    full["w"][3:] = 0.0
    compact = {"b": None, "w": full["w"][:, :1].copy(), "z": None}
    rng = np.random.default_rng(0)
    params0, mesh = make_params(rng), mesh_of(2)
    grads = [stack(random_grads(rng, params0, 2, scale=grad_scale(t))) for t in range(steps)]
    ends = []
    for mask in (full, compact, None):
        tx = make_tx(mask)
        state, specs = sharded_init(tx, params0, mesh)
        if per_rank:
            step, params = per_rank_stepper(tx, mesh, specs), put_rows(stack([params0] * 2), mesh)
        else:
            step, params = replicated_stepper(tx, mesh, specs), put_replicated(params0, mesh)
        for g in grads:
            params, state = step(params, state, put_rows(g, mesh))
        ends.append((jax.device_get(params), jax.device_get(state.mu)))
    assert not np.allclose(ends[2][0]["w"], ends[0][0]["w"])  # the mask matters in this run
    for a, b in zip(jax.tree.leaves(ends[0]), jax.tree.leaves(ends[1]), strict=True):
        np.testing.assert_array_equal(a, b)
