"""Orbax checkpoints that keep 1-bit Adam's per-rank error buffers.

DeepSpeed saves only rank 0's optimizer state and zeroes the error-feedback buffers on every load. Here
the buffers are global arrays (one row per rank), so they are saved sharded with everything else and
restored exactly when the data-parallel world size is unchanged. When it changed, rows no longer map to
ranks: the buffers are re-zeroed (DeepSpeed's behaviour, harmless in practice) with a logged warning.

Layout: one orbax (v1) checkpoint directory per call with two checkpointables, ``state`` (the training
state with the error buffers taken out) and ``errors`` (the buffers), plus JSON metadata that records
the world size and the user's step.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import jax
import jax.numpy as jnp

from jonebit.transforms.onebit_adam import OneBitAdamState, is_onebit_state
from jonebit.transforms.onebit_zero import OneBitAdamZeroState

log = logging.getLogger(__name__)


def _is_state(x) -> bool:
    return isinstance(x, OneBitAdamState)


def _split(tree):
    """(tree with the error buffers set to None, list of (worker_error, server_error) in tree order)."""
    errors = []

    def strip(node):
        if _is_state(node):
            errors.append({"worker": node.worker_error, "server": node.server_error})
            return node._replace(worker_error=None, server_error=None)
        return node

    return jax.tree.map(strip, tree, is_leaf=_is_state), errors


def _join(stripped, target, errors):
    """Puts error buffers back into ``stripped``; ``errors`` is None to take zeros shaped like ``target``'s."""
    targets = [n for n in jax.tree.leaves(target, is_leaf=_is_state) if _is_state(n)]
    it = iter(zip(targets, errors or [None] * len(targets), strict=True))

    def zeros(like):
        return jax.tree.map(lambda s: jax.device_put(jnp.zeros(s.shape, s.dtype), s.sharding), like)

    def put(node):
        if _is_state(node):
            tgt, err = next(it)
            if err is None:
                return node._replace(worker_error=zeros(tgt.worker_error), server_error=zeros(tgt.server_error))
            return node._replace(worker_error=err["worker"], server_error=err["server"])
        return node

    return jax.tree.map(put, stripped, is_leaf=_is_state)


def _world_size(tree) -> int | None:
    for node in jax.tree.leaves(tree, is_leaf=is_onebit_state):
        if is_onebit_state(node):
            return int(jax.tree.leaves(node.worker_error)[0].shape[0])
    return None


def _zero_stage(tree) -> int | None:
    for node in jax.tree.leaves(tree, is_leaf=is_onebit_state):
        if isinstance(node, OneBitAdamZeroState):
            return node.stage
    return None


def save(path: str | pathlib.Path, state: Any, *, step: int, overwrite: bool = False) -> pathlib.Path:
    """Saves a training-state pytree (params, optimizer state, ...) to ``path`` (a new directory).

    Call it on every process of a multi-host job (orbax writes each process's shards).
    """
    from orbax.checkpoint import v1 as ocp

    path = pathlib.Path(path)
    stripped, errors = _split(state)
    items = {"state": stripped, "errors": errors} if errors else {"state": stripped}  # orbax refuses empty items
    ocp.save_checkpointables(
        path, items, overwrite=overwrite,
        custom_metadata={"step": int(step), "world_size": _world_size(state)},
    )
    return path


def restore(path: str | pathlib.Path, target: Any) -> tuple[Any, int]:
    """Restores ``(state, step)`` onto the shardings of ``target``.

    Args:
      path: a directory written by :func:`save`.
      target: a pytree like the saved state whose leaves are arrays or ``jax.ShapeDtypeStruct`` with the
        ``sharding`` the restored arrays should have (this is what reshards onto a different mesh).
    """
    from orbax.checkpoint import v1 as ocp

    path = pathlib.Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {path}")
    meta = ocp.checkpointables_metadata(path).custom_metadata or {}
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target,
    )
    stripped, errors = _split(abstract)
    saved, current = meta.get("world_size"), _world_size(target)
    if saved != current and _zero_stage(target) is not None:
        raise ValueError(
            f"checkpoint {path} holds 1-bit Adam partitioned for ZeRO stage {_zero_stage(target)} over {saved} ranks; "
            f"its momentum, variance (and at stage 3 the parameters) are laid out in server chunks of that world "
            f"size and cannot be restored on {current} ranks. Restore it on {saved} ranks, or save the parameter "
            "tree (FlatParams.tree()) and restart the optimizer"
        )
    if saved == current:
        items = {"state": stripped, "errors": errors} if errors else {"state": stripped}
        loaded = ocp.load_checkpointables(path, items)
        state = _join(loaded["state"], abstract, loaded.get("errors", []))
    else:
        log.warning(
            "checkpoint %s was written with %s data-parallel ranks, restoring on %s: 1-bit Adam's error "
            "buffers are reset to zero (everything else is restored)", path, saved, current,
        )
        loaded = ocp.load_checkpointables(path, {"state": stripped})
        state = _join(loaded["state"], abstract, None)
    return state, int(meta.get("step", 0))
