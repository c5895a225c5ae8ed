"""Data-parallel training steps over a ``jax.shard_map`` mesh axis (ZeRO stage 0).

The forward/backward pass runs in the per-device view on the local batch shard. Replicated params are
cast to *varying* before differentiation so autodiff does not insert a full-precision all-reduce of
the gradients; the optimizer then owns all communication: ``grad_reduce=None`` hands each rank's local
gradient to the transform (1-bit optimizers), ``"mean"``/``"mean_bf16"`` average them first with a
plain allreduce (standard optax optimizers; the bf16 variant halves the traffic).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jonebit.sharding.mesh import data_mesh
from jonebit.transforms.onebit_adam import sharded_init

__all__ = ["data_mesh", "init_optimizer", "make_step", "make_update", "replicate", "shard_batch"]

_REDUCE = (None, "mean", "mean_bf16")


def replicate(tree, mesh: jax.sharding.Mesh):
    return jax.device_put(tree, jax.NamedSharding(mesh, P()))


def shard_batch(tree, mesh: jax.sharding.Mesh, axis: str = "data"):
    """Puts a global batch (leading dimension divisible by the axis size) on the mesh, split over ``axis``."""
    size = mesh.shape[axis]
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if x.shape[0] % size:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path)} has leading dimension {x.shape[0]}, "
                f"not divisible by the {size} devices of axis {axis!r}"
            )
    return jax.device_put(tree, jax.NamedSharding(mesh, P(axis)))


def init_optimizer(tx: optax.GradientTransformation, params, mesh: jax.sharding.Mesh, axis: str = "data"):
    """``(opt_state, specs)``: the optimizer state as global arrays and its shard_map specs."""
    return sharded_init(tx, params, mesh, axis)


def make_step(
    loss_fn: Callable[[Any, Any], jax.Array],
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    opt_specs,
    *,
    axis: str = "data",
    grad_reduce: str | None = None,
    donate: bool = True,
):
    """Builds ``step(params, opt_state, batch) -> (params, opt_state, loss)``, jitted.

    Args:
      loss_fn: ``loss_fn(params, local_batch) -> scalar`` mean loss of the local batch shard.
      tx: the optimizer; with ``grad_reduce=None`` it must do its own communication (``jonebit.onebit_adam``).
      mesh: mesh with the data axis ``axis``.
      opt_specs: specs of the optimizer state (from :func:`init_optimizer`).
      grad_reduce: ``None`` (local gradients to ``tx``), ``"mean"`` (fp32 allreduce) or ``"mean_bf16"``.
      donate: donate params and optimizer state buffers.

    The returned loss is the mean over all ranks.
    """
    if grad_reduce not in _REDUCE:
        raise ValueError(f"grad_reduce must be one of {_REDUCE}, got {grad_reduce!r}")

    def body(params, opt_state, batch):
        local = lax.pcast(params, axis, to="varying")
        loss, grads = jax.value_and_grad(loss_fn)(local, batch)
        if grad_reduce == "mean":
            grads = lax.pmean(grads, axis)
        elif grad_reduce == "mean_bf16":
            grads = jax.tree.map(lambda g: lax.pmean(g.astype(jnp.bfloat16), axis).astype(g.dtype), grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, lax.pmean(loss, axis)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), opt_specs, P(axis)), out_specs=(P(), opt_specs, P()))
    return jax.jit(mapped, donate_argnums=(0, 1) if donate else ())


def make_update(tx: optax.GradientTransformation, mesh: jax.sharding.Mesh, opt_specs, *, axis: str = "data",
                grad_reduce: str | None = None):
    """The optimizer step alone, ``update(params, opt_state, local_grads)``, with grads stacked per rank.

    ``local_grads`` leaves have a leading axis of the mesh size (rank ``r``'s gradient in row ``r``). Used by
    the benchmarks and the communication accounting, where no model is needed.
    """
    if grad_reduce not in _REDUCE:
        raise ValueError(f"grad_reduce must be one of {_REDUCE}, got {grad_reduce!r}")

    def body(params, opt_state, grads):
        grads = jax.tree.map(lambda g: g[0], grads)
        if grad_reduce == "mean":
            grads = lax.pmean(grads, axis)
        elif grad_reduce == "mean_bf16":
            grads = jax.tree.map(lambda g: lax.pmean(g.astype(jnp.bfloat16), axis).astype(g.dtype), grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), opt_specs, P(axis)), out_specs=(P(), opt_specs))
    return jax.jit(mapped, donate_argnums=(0, 1))
