"""Placement of the 1-bit optimizers' state and parameters under ZeRO stages 1-3 (see
:mod:`jonebit.transforms.onebit_adam_zero`).

The 1-bit optimizers own their communication and need each rank's local gradient, so their whole step runs in the
per-device view (:mod:`jonebit.train.step`). At stage 3 the parameters live as :class:`FlatParams`, the server
chunks of the flattened tree (rank ``r`` holds chunk ``r`` of every buffer), all-gathered for the forward pass.

Normally reached through :func:`jonebit.train.zero.init_zero` and :func:`jonebit.train.zero.make_zero_step`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jonebit.sharding.zero import OFFLOAD_MEMORY_KIND, ZeroShardings, _check_offload, place_copy, to_shardings
from jonebit.transforms.onebit_adam import (
    OneBitAdamState,
    is_onebit_state,
    local_abstract_state,
    per_device_init,
    state_specs,
)
from jonebit.transforms.onebit_adam_zero import FlatLayout, OneBitAdamZeroState

P = PartitionSpec


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FlatParams:
    """Parameters partitioned as the server chunks of a :class:`FlatLayout` (ZeRO stage 3 with 1-bit Adam).

    ``chunks[g]`` is a ``(P, C_g)`` global array sharded over the data axis (``(P, L, C_g)`` for a stack of ``L``
    layers: each layer's chunks, gathered one layer at a time by
    :func:`jonebit.sharding.layerwise.scan_layers`). :meth:`tree` gives the ordinary
    parameter tree (all-gathered), e.g. for evaluation or export.
    """

    chunks: tuple
    layout: FlatLayout = dataclasses.field(metadata=dict(static=True))

    def tree(self):
        shardings = [getattr(c, "sharding", None) for c in self.chunks]
        if not all(isinstance(s, NamedSharding) for s in shardings):
            return self.layout.from_chunks(self.chunks)
        return _gather_tree(self.layout, tuple(NamedSharding(s.mesh, P()) for s in shardings))(self.chunks)


@functools.cache
def _gather_tree(layout: FlatLayout, whole: tuple):
    """One program that gathers every chunk and rebuilds the tree. (Gathering the chunks eagerly, one dispatch each,
    queued so many collective programs at once that XLA:CPU's simulated devices deadlocked: one never joined.)"""
    return jax.jit(lambda chunks: layout.from_chunks(tuple(
        jax.sharding.reshard(c, s) for c, s in zip(chunks, whole, strict=True))))


def find_onebit_state(local_state):
    """The single 1-bit state in an (abstract) optimizer state tree, or None."""
    found = [n for n in jax.tree.leaves(local_state, is_leaf=is_onebit_state) if is_onebit_state(n)]
    if len(found) > 1:
        raise ValueError("the optimizer contains more than one 1-bit transform; use one per optimizer")
    return found[0] if found else None


def uses_onebit(shardings: ZeroShardings) -> bool:
    """Whether the optimizer state planned in ``shardings`` belongs to a 1-bit optimizer."""
    return find_onebit_state(shardings.opt_state) is not None


def onebit_stage(state) -> int:
    if isinstance(state, OneBitAdamZeroState):
        return state.stage
    if isinstance(state, OneBitAdamState):
        return 0
    raise TypeError(f"not a 1-bit optimizer state: {type(state).__name__}")


def plan_onebit_zero(tx, params, mesh, *, stage: int, axis: str = "data", offload_optimizer: bool = False):
    """``(shardings, state_specs, layout)`` of a 1-bit optimizer made with ``onebit_adam_zero(..., stage=stage)``.

    ``layout`` is the :class:`FlatLayout` of the stage-3 parameters (None below stage 3). Works on arrays and
    ``ShapeDtypeStruct`` params alike; allocates nothing.
    """
    local = local_abstract_state(tx, params, mesh)
    state = find_onebit_state(local)
    if state is None:
        raise ValueError("the optimizer contains no 1-bit transform")
    tx_stage = onebit_stage(state)
    if tx_stage != stage:
        raise ValueError(
            f"ZeRO stage {stage} was requested but the 1-bit optimizer was built for stage {tx_stage}: make it "
            f"with jonebit.onebit_adam_zero(..., stage={stage}) (its state layout depends on the stage)"
        )
    if offload_optimizer:
        _check_offload(mesh)
    specs = state_specs(local, axis)
    replicated = NamedSharding(mesh, P())
    layout = None
    if stage == 3:
        layout = FlatLayout.of(params, mesh.shape[axis],
                               fused=len(state.mu) == 1 and len(jax.tree.leaves(params)) > 1)
        param_sh = FlatParams(chunks=tuple(NamedSharding(mesh, P(axis)) for _ in layout.groups), layout=layout)
    else:
        param_sh = jax.tree.map(lambda _: replicated, params)
    sh = ZeroShardings(
        params=param_sh,
        # Local gradients are whole on every rank (each compresses its full momentum): nothing to partition.
        grads=jax.tree.map(lambda _: replicated, params),
        opt_state=to_shardings(specs, mesh, OFFLOAD_MEMORY_KIND if offload_optimizer else None),
        stage=stage, axis=axis, offload_optimizer=bool(offload_optimizer),
    )
    return sh, specs, layout


def init_onebit_zero(tx, params, mesh, *, stage: int, axis: str = "data", offload_optimizer: bool = False):
    """``(params, opt_state, shardings)`` for a 1-bit optimizer made with ``onebit_adam_zero(..., stage=stage)``.

    ``params`` come back replicated (stages 1, 2) or as :class:`FlatParams` (stage 3).
    """
    sh, specs, layout = plan_onebit_zero(tx, params, mesh, stage=stage, axis=axis,
                                         offload_optimizer=offload_optimizer)
    params = place_copy(params, sh.grads)  # replicated, in new buffers
    opt_state = jax.jit(per_device_init(tx, mesh, specs), out_shardings=sh.opt_state)(params)
    if layout is not None:
        chunks = jax.jit(layout.to_chunks, out_shardings=sh.params.chunks)(params)
        params = FlatParams(chunks=chunks, layout=layout)
    return params, opt_state, sh


def abstract_onebit_zero(tx, params, mesh, *, stage: int, axis: str = "data"):
    """``(params, opt_state, shardings)`` as ``jax.ShapeDtypeStruct`` trees, without allocating (memory planning)."""
    sh, specs, layout = plan_onebit_zero(tx, params, mesh, stage=stage, axis=axis)
    glob = jax.eval_shape(per_device_init(tx, mesh, specs), params)
    sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    opt_state = jax.tree.map(sds, glob, sh.opt_state)
    if layout is not None:
        dtype = layout._common_dtype()
        chunks = tuple(jax.ShapeDtypeStruct((layout.world_size, *layout.lead(g), layout.chunk(g)), dtype, sharding=s)
                       for g, s in enumerate(sh.params.chunks))
        return FlatParams(chunks=chunks, layout=layout), opt_state, sh
    return jax.tree.map(sds, params, sh.params), opt_state, sh
