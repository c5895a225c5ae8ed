"""Flax NNX entry point: data-parallel training of an ``nnx.Module`` with an ``nnx.Optimizer``.

On one device, ``nnx.Optimizer(model, jonebit.onebit_adam(...), wrt=nnx.Param)`` with an ``nnx.jit`` step works as it
does for any optax optimizer (the 1-bit optimizer then runs as one worker). Over a mesh,
:func:`make_train_step` runs the per-device view for you::

    mesh = jonebit.train.data_parallel.data_mesh()          # every device on the axis "data"
    optimizer = nnx.Optimizer(model, jonebit.onebit_adam(1e-3, freeze_step=100), wrt=nnx.Param)
    step = jonebit.nnx.make_train_step(model, optimizer, loss_fn, mesh)
    for batch in batches:                                   # global batches, split over "data"
        loss = step(model, optimizer, batch)                # updates model and optimizer in place

``loss_fn(model, local_batch)`` returns the mean loss of one device's share of the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.training.optimizer import to_opt_state

from jonebit.train.data_parallel import shard_batch
from jonebit.train.engine import RankParams, init_train_state, model_params
from jonebit.train.engine import make_train_step as make_engine_step
from jonebit.transforms.base import takes_local_gradients

__all__ = ["make_train_step", "reseed"]


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def reseed(keys, rng):
    """``keys`` (a model's ``nnx.RngState``) with every stream key derived from ``rng``; counters kept.

    The ``i``-th key leaf becomes ``fold_in(rng, i)``, split over the leaf's shape where the streams are stacked
    (the dropout streams of scanned layers, one per layer), so no two dropout layers draw the same mask. Mapping
    the state also gives fresh Variables inside the trace, which the model's dropout layers may advance.
    """
    leaves, treedef = jax.tree.flatten(keys)
    out, i = [], 0
    for x in leaves:
        if _is_key(x):
            k = jax.random.fold_in(rng, i)
            out.append(jax.random.split(k, x.shape) if x.shape else k)
            i += 1
        else:
            out.append(x)
    return jax.tree.unflatten(treedef, out)


def make_train_step(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    loss_fn: Callable[[nnx.Module, Any], jax.Array],
    mesh: jax.sharding.Mesh,
    *,
    axis: str = "data",
    rng_seed: int = 0,
) -> Callable[[nnx.Module, nnx.Optimizer, Any], jax.Array]:
    """``step(model, optimizer, batch) -> loss``: one data-parallel training step that updates both in place.

    Each device computes the gradient of ``loss_fn`` on its share of ``batch`` (split over ``axis``). A jonebit
    optimizer (1-bit Adam, 0/1 Adam, 1-bit LAMB) receives these local gradients and does its own compressed
    communication; any other optax optimizer receives their float32 mean. The step is
    :func:`jonebit.train.engine.make_train_step`: non-finite gradients skip the step on every rank.

    Call it before the optimizer's first update: it re-creates the optimizer's state for the mesh (a 1-bit
    optimizer's error buffers depend on the number of ranks). With 0/1 Adam each rank moves its own copy of the
    parameters during its local steps: the copies live in the optimizer, and the model shows rank 0's.

    Args:
      model: the model; its ``optimizer.wrt`` variables are trained. Other state (RNG streams aside) is read but
        not written back by the step (batch statistics, for instance).
      optimizer: an ``nnx.Optimizer`` over ``model`` that has not stepped yet.
      loss_fn: ``loss_fn(model, local_batch) -> scalar``, the mean loss of the local batch.
      mesh: a mesh with the data-parallel axis ``axis`` (:func:`jonebit.train.data_parallel.data_mesh`).
      axis: the data-parallel axis; ``axis_name`` of a jonebit optimizer must name it too.
      rng_seed: seeds the dropout keys, which the step derives from the step number, the rank and this seed (so a
        model's RNG streams give fresh, reproducible masks on every step and rank).

    Returns:
      ``step(model, optimizer, batch)`` returning the loss averaged over ranks (of the step's parameters).
    """
    if not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(f"make_train_step: optimizer must be an nnx.Optimizer, got {type(optimizer).__name__}")
    if int(optimizer.step[...]) != 0:
        raise ValueError(
            f"make_train_step: the optimizer has already taken {int(optimizer.step[...])} steps; make the train "
            "step before the first update (it creates the optimizer's state for the mesh)")
    graphdef, params, keys, rest = nnx.split(model, optimizer.wrt, nnx.RngState, ...)
    params = nnx.as_pure(params)  # arrays, without the Variable boxes: what the engine's trees hold
    tx = optimizer.tx
    state, specs = init_train_state(tx, params, mesh, axis=axis)
    onebit = takes_local_gradients(state.opt_state)
    per_rank = isinstance(state.params, RankParams)
    has_keys = any(_is_key(x) for x in jax.tree.leaves(keys))

    def merged(p, rng=None):
        fresh = jax.tree.map(lambda x: x, keys) if rng is None else reseed(keys, rng)
        return nnx.merge(graphdef, p, fresh, rest)

    if has_keys:
        def engine_loss(p, batch, rng):
            return loss_fn(merged(p, rng), batch)
    else:
        def engine_loss(p, batch):
            return loss_fn(merged(p), batch)

    step_fn = make_engine_step(engine_loss, tx, mesh, specs, axis=axis, grad_reduce=None if onebit else "mean",
                               rng_seed=rng_seed if has_keys else None)
    optimizer.opt_state = nnx.data(to_opt_state(state))
    wrt = optimizer.wrt

    def step(model: nnx.Module, optimizer: nnx.Optimizer, batch) -> jax.Array:
        current = nnx.as_pure(optimizer.opt_state)
        mine = nnx.as_pure(nnx.state(model, wrt))
        if not per_rank:  # the model holds the parameters: take them as they are now
            current = current._replace(params=jax.tree.map(
                lambda new, old: jax.device_put(jnp.asarray(new, jnp.float32), old.sharding), mine, current.params))
        new, metrics = step_fn(current, shard_batch(batch, mesh, axis))
        optimizer.opt_state = nnx.data(to_opt_state(new))
        nnx.update(model, jax.tree.map(lambda x, o: x.astype(o.dtype), model_params(new.params), mine))
        optimizer.step[...] += 1
        return metrics["loss"]

    return step
