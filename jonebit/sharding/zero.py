"""ZeRO stages as data: where params, gradients and optimizer state live on a data-parallel mesh.

DeepSpeed's ZeRO partitions the optimizer state (stage 1), the gradients (stage 2) and the parameters
(stage 3) across the data-parallel ranks. In JAX each of these is a ``NamedSharding``; the collectives follow
from the shardings (see :mod:`jonebit.train.zero` for the step that applies them). Everything here is decided
by two tables, :data:`STAGES` and the per-leaf rule :func:`leaf_spec`:

* a leaf that is partitioned gets the data axis on its **largest dimension divisible by the axis size**
  (ties: the first such dimension); a leaf with no such dimension (scalars, odd shapes) stays replicated,
  which is logged at debug level; the leaves of a stack of layers (:mod:`jonebit.sharding.layerwise`) never
  on their leading layer axis, so that each layer's slice can be gathered where it runs;
* the per-rank buffers of the 1-bit optimizers (error feedback, rows of a leading rank axis) are always
  sharded over the data axis, at every stage, because each rank owns a different one;
* ``offload_optimizer=True`` puts the optimizer state in host memory (``memory_kind="pinned_host"``).

Works on arrays and ``jax.ShapeDtypeStruct`` trees, and on any optax state (the rule only looks at shapes).

References:
  Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC 2020,
  https://arxiv.org/abs/1910.02054.
"""

from __future__ import annotations

import logging
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jonebit.sharding.layerwise import is_stacked

log = logging.getLogger(__name__)

P = PartitionSpec

# What each stage partitions over the data axis.
STAGES: dict[int, dict[str, bool]] = {
    0: {"opt_state": False, "grads": False, "params": False},
    1: {"opt_state": True, "grads": False, "params": False},
    2: {"opt_state": True, "grads": True, "params": False},
    3: {"opt_state": True, "grads": True, "params": True},
}

OFFLOAD_MEMORY_KIND = "pinned_host"
_REPLICATED = P()


class ZeroShardings(NamedTuple):
    """Shardings of one ZeRO stage; each field is a pytree of ``NamedSharding`` like its input."""

    params: Any
    grads: Any
    opt_state: Any
    stage: int
    axis: str
    offload_optimizer: bool


def check_stage(stage) -> int:
    if isinstance(stage, bool) or not isinstance(stage, int | np.integer) or int(stage) not in STAGES:
        raise ValueError(f"ZeRO stage must be one of {sorted(STAGES)}, got {stage!r}")
    return int(stage)


def _entry_axes(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple | list) else (entry,)


def _axes_size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def base_spec(leaf, mesh, axis: str | None = None) -> PartitionSpec:
    """The spec a leaf already has on ``mesh`` (e.g. model-parallel axes), or ``P()``.

    With ``axis``, that axis is removed from the spec: where the data axis goes is the stage's decision, not the
    input's (a tree laid out for stage 3 and planned again for stage 1 must come back with replicated params).
    """
    sharding = getattr(leaf, "sharding", None)
    if not (isinstance(sharding, NamedSharding) and sharding.mesh.shape_tuple == mesh.shape_tuple):
        return P()
    if axis is None:
        return sharding.spec

    def drop(entry):
        kept = tuple(a for a in _entry_axes(entry) if a != axis)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    entries = [drop(e) for e in sharding.spec]
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def shard_dim(shape, mesh, axis: str, spec: PartitionSpec = _REPLICATED, *, first: int = 0) -> int | None:
    """The dimension that gets ``axis``: the largest one still divisible after the axes it already carries.

    Dimensions before ``first`` are never chosen (the layer axis of a stack of layers, which is scanned over).
    """
    size = mesh.shape[axis]
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    if any(axis in _entry_axes(e) for e in entries):
        return None  # already sharded over the data axis
    best, best_len = None, 0
    for d, (n, entry) in enumerate(zip(shape, entries, strict=True)):
        if d < first:
            continue
        per_shard = n // _axes_size(mesh, _entry_axes(entry))
        if per_shard % size == 0 and per_shard >= size and per_shard > best_len:
            best, best_len = d, per_shard
    return best


def leaf_spec(shape, mesh, axis: str, spec: PartitionSpec = _REPLICATED, *, what: str = "leaf",
              first: int = 0) -> PartitionSpec:
    """``spec`` with ``axis`` added on :func:`shard_dim` (from dimension ``first``); unchanged (logged) when no
    dimension fits."""
    shape = tuple(shape)
    entries = list(tuple(spec) + (None,) * (len(shape) - len(spec)))
    if any(axis in _entry_axes(e) for e in entries):
        return P(*entries)
    d = shard_dim(shape, mesh, axis, spec, first=first)
    if d is None:
        if shape:
            log.debug("ZeRO: %s with shape %s has no dimension divisible by %s=%d; replicated over %r",
                      what, shape, axis, mesh.shape[axis], axis)
        return P(*entries)
    entries[d] = _entry_axes(entries[d]) + (axis,) if entries[d] is not None else axis
    return P(*entries)


# State types of the 1-bit optimizers whose per-rank buffers always carry the data axis. Each entry maps a
# state class to a function (node, axis) -> tree of "rank" markers / None for the fields that are per-rank.
_PER_RANK_RULES: list[tuple[type, Any]] = []


def register_per_rank_state(cls: type, rule) -> None:
    """Registers ``rule(state, axis) -> PartitionSpec tree`` for a state class with per-rank buffers.

    The rule returns, for every leaf of the state, either a ``PartitionSpec`` (used as is) or ``None`` (the leaf
    follows the ZeRO rule of the stage). Used by the 1-bit optimizers; a user-defined transform with per-rank
    state can register its own.
    """
    _PER_RANK_RULES.append((cls, rule))


def per_rank_rule(node):
    for cls, rule in _PER_RANK_RULES:
        if isinstance(node, cls):
            return rule
    return None


def _is_special(node) -> bool:
    return per_rank_rule(node) is not None


def _tree_specs(tree, mesh, axis: str, partition: bool, what: str, prefix: tuple = ()):
    def one(path, leaf):
        path = prefix + tuple(path)
        spec = base_spec(leaf, mesh, axis)
        shape = tuple(getattr(leaf, "shape", np.shape(leaf)))
        if not partition:
            return spec
        # A stack of layers keeps its layer axis whole: the scan slices it, each device gathers its layer's shard.
        return leaf_spec(shape, mesh, axis, spec, what=f"{what}{jax.tree_util.keystr(path)}",
                         first=1 if is_stacked(path) else 0)

    return jax.tree_util.tree_map_with_path(one, tree)


def opt_state_specs(opt_state, mesh, axis: str, partition: bool):
    """Specs of an optimizer state: the ZeRO rule per leaf, registered per-rank buffers on the data axis."""

    def node_specs(path, node):
        rule = per_rank_rule(node)
        if rule is None:
            return _tree_specs(node, mesh, axis, partition, "opt_state", tuple(path))
        fixed = rule(node, axis)
        generic = _tree_specs(node, mesh, axis, partition, "opt_state", tuple(path))
        return jax.tree.map(lambda f, g: g if f is None else f, fixed, generic,
                            is_leaf=lambda x: x is None or isinstance(x, PartitionSpec))

    return jax.tree_util.tree_map_with_path(node_specs, opt_state, is_leaf=_is_special)


def _check_offload(mesh) -> None:
    device = mesh.devices.flat[0]
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception as e:  # pragma: no cover - backends without the memories API
        raise ValueError(f"offload_optimizer: the {device.platform} backend does not report memory kinds") from e
    if OFFLOAD_MEMORY_KIND not in kinds:
        raise ValueError(
            f"offload_optimizer=True needs host memory ({OFFLOAD_MEMORY_KIND!r}) addressable from the devices, "
            f"but {device.platform} devices offer only {sorted(kinds)}; run without offload on this backend"
        )


def to_shardings(specs, mesh, memory_kind: str | None = None):
    def make(spec):
        s = NamedSharding(mesh, spec)
        return s.with_memory_kind(memory_kind) if memory_kind else s

    return jax.tree.map(make, specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def zero_specs(mesh, params, opt_state, *, stage: int, axis: str = "data"):
    """``(param_specs, grad_specs, opt_state_specs)`` as ``PartitionSpec`` trees (see :func:`zero_shardings`)."""
    stage = check_stage(stage)
    if axis not in mesh.shape:
        raise ValueError(f"ZeRO: mesh has no axis {axis!r} (axes: {tuple(mesh.shape)})")
    rules = STAGES[stage]
    param_specs = _tree_specs(params, mesh, axis, rules["params"], "params")
    grad_specs = _tree_specs(params, mesh, axis, rules["grads"], "grads")
    state_specs = opt_state_specs(opt_state, mesh, axis, rules["opt_state"])
    return param_specs, grad_specs, state_specs


def zero_shardings(mesh, params, opt_state, *, stage: int, axis: str = "data",
                   offload_optimizer: bool = False) -> ZeroShardings:
    """Shardings of params, gradients and optimizer state for ZeRO ``stage`` over the mesh axis ``axis``.

    ======  =====================================================================================
    stage   partitioned over ``axis`` (largest divisible dimension per leaf; the rest replicated)
    ======  =====================================================================================
    0       nothing: plain data parallelism
    1       optimizer state
    2       optimizer state and gradients (gradients are reduce-scattered into their shards)
    3       optimizer state, gradients and parameters (gathered for compute)
    ======  =====================================================================================

    Args:
      mesh: a ``jax.sharding.Mesh`` with the data axis ``axis`` (other axes, e.g. model parallel ones, are
        kept where a leaf's ``NamedSharding`` on this mesh already uses them).
      params: pytree of arrays or ``jax.ShapeDtypeStruct``.
      opt_state: the optimizer state for ``params`` (e.g. ``jax.eval_shape(tx.init, params)``), any optax state.
      stage: 0, 1, 2 or 3.
      axis: the data-parallel mesh axis.
      offload_optimizer: keep the optimizer state in host memory (``pinned_host``); raises where the backend
        has no such memory.

    Returns:
      :class:`ZeroShardings` with ``params``, ``grads`` (a tree like ``params``) and ``opt_state``: pytrees of
      ``NamedSharding``.

    Example::

      abstract = jax.eval_shape(tx.init, params)
      sh = zero_shardings(mesh, params, abstract, stage=2)
      opt_state = jax.jit(tx.init, out_shardings=sh.opt_state)(params)
    """
    if offload_optimizer:
        _check_offload(mesh)
    param_specs, grad_specs, state_specs = zero_specs(mesh, params, opt_state, stage=stage, axis=axis)
    return ZeroShardings(
        params=to_shardings(param_specs, mesh),
        grads=to_shardings(grad_specs, mesh),
        opt_state=to_shardings(state_specs, mesh, OFFLOAD_MEMORY_KIND if offload_optimizer else None),
        stage=int(stage),
        axis=axis,
        offload_optimizer=bool(offload_optimizer),
    )


def place_copy(tree, shardings):
    """``tree`` laid out by ``shardings``, always in new buffers.

    The steps donate their inputs; ``jax.device_put`` from one device to a replicated sharding reuses the source
    buffer on that device (even with ``may_alias=False`` on jax 0.10), so donating the result would delete the
    caller's array. The ``device_put`` comes first so that arrays committed to other devices (e.g. one device)
    can be placed at all; the jitted copy then gives the result its own buffers.
    """
    placed = jax.device_put(tree, shardings)
    return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=shardings)(placed)


def bytes_per_device(tree, shardings) -> int:
    """Bytes one device holds of ``tree`` (arrays or ShapeDtypeStructs) laid out by ``shardings``.

    Computed from each sharding's shard shape; for live arrays compare with ``addressable_shards``.
    """
    total = 0
    for leaf, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
        shape = s.shard_shape(tuple(leaf.shape))
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total
