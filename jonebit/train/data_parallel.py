"""Data-parallel training steps over a ``jax.shard_map`` mesh axis (ZeRO stage 0).

``axis`` is one mesh axis name, or a pair ``("hosts", "local")`` of a :func:`hierarchical_mesh` (the batch and the
per-rank optimizer rows are split over both; ``jonebit.onebit_adam(axis_name=("hosts", "local"))`` then compresses
hierarchically).

The forward/backward pass runs in the per-device view on the local batch shard. Replicated params are
cast to *varying* before differentiation so autodiff does not insert a full-precision all-reduce of
the gradients; the optimizer then owns all communication: ``grad_reduce=None`` hands each rank's local
gradient to the transform (1-bit optimizers), ``"mean"``/``"mean_bf16"`` average them first with a
plain allreduce (standard optax optimizers; the bf16 variant halves the traffic).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jonebit.sharding.mesh import check_batch, data_mesh, hierarchical_mesh
from jonebit.sharding.zero import place_copy
from jonebit.train.step import REDUCTIONS, apply_optimizer, local_gradients, local_view, per_device, reduce
from jonebit.transforms.onebit_adam import sharded_init
from jonebit.transforms.phases import jit_per_phase

__all__ = ["data_mesh", "hierarchical_mesh", "init_optimizer", "make_step", "make_update", "replicate",
           "shard_batch"]

Axis = str | tuple[str, ...]

_REDUCE = REDUCTIONS


def replicate(tree, mesh: jax.sharding.Mesh):
    """``tree`` replicated on every device of ``mesh``, in new buffers.

    The steps donate their params: ``jax.device_put`` to a replicated sharding reuses the source buffer where
    it can (even with ``may_alias=False`` on jax 0.10), so without the copy the first step would delete the
    caller's arrays.

    Args:
      tree: pytree of arrays (host, one device, or any layout on ``mesh``); left untouched.
      mesh: the mesh to replicate over.
    """
    return place_copy(tree, jax.NamedSharding(mesh, P()))


def _axes(axis: Axis, mesh: jax.sharding.Mesh, where: str) -> tuple[str, ...]:
    """``axis`` as a tuple of mesh axis names, each checked to be in ``mesh``."""
    names = tuple(axis) if isinstance(axis, tuple | list) else (axis,)
    for name in names:
        if name not in mesh.shape:
            raise ValueError(f"{where}: mesh has no axis {name!r} (axes: {tuple(mesh.shape)})")
    return names


def _size(axis: Axis, mesh: jax.sharding.Mesh, where: str) -> int:
    size = 1
    for name in _axes(axis, mesh, where):
        size *= mesh.shape[name]
    return size


def _spec(axis: Axis) -> P:
    """The batch/rows layout: leading dimension over ``axis`` (both axes of a pair, in order)."""
    return P(tuple(axis)) if isinstance(axis, tuple | list) else P(axis)


def shard_batch(tree, mesh: jax.sharding.Mesh, axis: Axis = "data"):
    """Puts a global batch (leading dimension divisible by the axis size) on the mesh, split over ``axis``.

    The result has its own buffers (``jax.device_put`` hands back an array that already has this layout, and
    on a one-device mesh it aliases the source), so a step that donates it cannot delete the caller's batch.

    Args:
      tree: pytree of arrays, each with a leading batch dimension.
      mesh: the mesh; ``axis`` must be one of its axes.
      axis: the data-parallel axis the batch is split over, or a pair ``("hosts", "local")`` (split over both).
    """
    _axes(axis, mesh, "shard_batch")
    check_batch(tree, mesh, _spec(axis), where="shard_batch", name="tree")
    return place_copy(tree, jax.NamedSharding(mesh, _spec(axis)))


def _check_grads(grads, params, size: int) -> None:
    """``make_update``'s ``local_grads``: the params' tree, each leaf stacked over the ``size`` ranks."""
    g_def, p_def = jax.tree.structure(grads), jax.tree.structure(params)
    if g_def != p_def:
        raise ValueError(f"make_update: local_grads must have the tree structure of params; got {g_def}, "
                         f"params have {p_def}")
    for (path, g), p in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(params), strict=True):
        expected = (size, *p.shape)
        if tuple(g.shape) != expected:
            raise ValueError(
                f"make_update: local_grads{jax.tree_util.keystr(path)} has shape {tuple(g.shape)}, expected "
                f"{expected} (one row per rank of the {size}-device axis, then the parameter's shape)"
            )

def init_optimizer(tx: optax.GradientTransformation, params, mesh: jax.sharding.Mesh, axis: Axis = "data"):
    """``(opt_state, specs)``: the optimizer state as global arrays and its shard_map specs (per-rank rows over
    ``axis``: one axis, or both of a ``("hosts", "local")`` pair)."""
    _axes(axis, mesh, "init_optimizer")
    return sharded_init(tx, params, mesh, tuple(axis) if isinstance(axis, list) else axis)


def make_step(
    loss_fn: Callable[[Any, Any], jax.Array],
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    opt_specs,
    *,
    axis: Axis = "data",
    grad_reduce: str | None = None,
    donate: bool = True,
    per_phase: bool = True,
):
    """Builds ``step(params, opt_state, batch) -> (params, opt_state, loss)``, jitted.

    Args:
      loss_fn: ``loss_fn(params, local_batch) -> scalar`` mean loss of the local batch shard.
      tx: the optimizer; with ``grad_reduce=None`` it must do its own communication (``jonebit.onebit_adam``).
      mesh: mesh with the data axis ``axis``.
      axis: the data-parallel mesh axis, or the pair ``("hosts", "local")`` of a :func:`hierarchical_mesh`.
      opt_specs: specs of the optimizer state (from :func:`init_optimizer`).
      grad_reduce: ``None`` (local gradients to ``tx``), ``"mean"`` (fp32 allreduce) or ``"mean_bf16"``.
      donate: donate params and optimizer state buffers.
      per_phase: compile one program per phase of a 1-bit optimizer and pick it on the host before each step
        (:mod:`jonebit.transforms.phases`: no conditional in the program; one small device-to-host read per step).
        ``False``: one program with every phase, switched on the device.

    The returned loss is the mean over all ranks.
    """
    if grad_reduce not in _REDUCE:
        raise ValueError(f"grad_reduce must be one of {_REDUCE}, got {grad_reduce!r}")
    _axes(axis, mesh, "make_step")
    axis = tuple(axis) if isinstance(axis, list) else axis
    spec = _spec(axis)

    def body(params, opt_state, batch):
        local, tx_params, rewrap = local_view(params, axis)
        grads, losses, _ = local_gradients(loss_fn, local, batch, axis=axis)
        new, opt_state = apply_optimizer(tx, reduce(grads, grad_reduce, axis), opt_state, tx_params)
        return rewrap(new), opt_state, lax.pmean(losses[0], axis)

    mapped = per_device(body, mesh, in_specs=(P(), opt_specs, spec), out_specs=(P(), opt_specs, P()))

    def step(params, opt_state, batch):
        check_batch(batch, mesh, spec, where="make_step's step")  # shapes are static: checked while tracing
        with _local_gradients_hint("make_step", grad_reduce):
            return mapped(params, opt_state, batch)

    return jit_per_phase(step, per_phase=per_phase, donate_argnums=(0, 1) if donate else ())


@contextlib.contextmanager
def _local_gradients_hint(where: str, grad_reduce):
    """Turns shard_map's replication error for an optimizer that got local gradients into the fix, in one line."""
    try:
        yield
    except ValueError as e:
        if grad_reduce is None and "could not infer replication" in str(e):
            raise ValueError(
                f"{where}: with grad_reduce=None each rank's own gradient goes to the optimizer, and its update then "
                "differs per rank; only jonebit's communicating optimizers (1-bit Adam, 0/1 Adam, 1-bit LAMB) average "
                "it themselves. For an optax optimizer pass grad_reduce='mean' (or 'mean_bf16')") from None
        raise


def make_update(tx: optax.GradientTransformation, mesh: jax.sharding.Mesh, opt_specs, *, axis: Axis = "data",
                grad_reduce: str | None = None, per_phase: bool = True):
    """The optimizer step alone, ``update(params, opt_state, local_grads)``, with grads stacked per rank.

    ``local_grads`` leaves have a leading axis of the mesh size (rank ``r``'s gradient in row ``r``). Used by
    the benchmarks and the communication accounting, where no model is needed. ``per_phase`` as in
    :func:`make_step`.
    """
    if grad_reduce not in _REDUCE:
        raise ValueError(f"grad_reduce must be one of {_REDUCE}, got {grad_reduce!r}")
    size = _size(axis, mesh, "make_update")
    axis = tuple(axis) if isinstance(axis, list) else axis
    spec = _spec(axis)

    def body(params, opt_state, grads):
        grads = reduce(jax.tree.map(lambda g: g[0], grads), grad_reduce, axis)
        return apply_optimizer(tx, grads, opt_state, params)

    mapped = per_device(body, mesh, in_specs=(P(), opt_specs, spec), out_specs=(P(), opt_specs))

    def update(params, opt_state, local_grads):
        _check_grads(local_grads, params, size)
        with _local_gradients_hint("make_update", grad_reduce):
            return mapped(params, opt_state, local_grads)

    return jit_per_phase(update, per_phase=per_phase, donate_argnums=(0, 1))
