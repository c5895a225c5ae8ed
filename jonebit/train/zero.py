"""Training steps for ZeRO stages 0-3 (and optimizer-state offload) with any optax optimizer.

The shardings come from :func:`jonebit.sharding.zero_shardings`; this module only applies them. One step:

1. **gradients**, inside ``jax.shard_map`` over the data axis: each device differentiates the loss of its batch
   shard and the gradients are reduced *explicitly*: an all-reduce mean (stage 0), a reduce-scatter
   (``lax.psum_scatter``) straight into each leaf's shard (stages 1-3; at stage 1 into the optimizer state's
   layout, as DeepSpeed's stage 1 does, so that with the all-gather of step 2 it moves stage 0's bytes rather
   than 1.5 times as many). At stage 3 the parameters enter as shards and are all-gathered for compute;
   autodiff turns that all-gather into the reduce-scatter of the gradient, so no device ever holds the full
   summed gradient. Inside one jitted step stages 1 and 2 thus compile alike (the full gradient is a temporary
   either way); they differ in :func:`make_zero_grads`, whose stage-1 gradients come back whole. Explicit
   collectives keep the communication the same on every backend (XLA:CPU turns a sharding constraint into
   all-reduce + slice, GPUs into reduce-scatter);
2. **optimizer update**, in the global view under ``jit``: ``tx.update`` on gradients, optimizer state and
   parameters with their ZeRO shardings, so XLA runs each element's update on the device that owns its state,
   and the new parameters are resharded to their own layout (an all-gather of the updated shards at stages 1
   and 2). Optimizers that look at the whole tree (``clip_by_global_norm``) stay correct: XLA inserts the
   reductions;
3. **offload**: with ``offload_optimizer`` the state lives in host memory between steps and is moved to the
   device inside the step and back on the way out.

Mixed precision (``master_dtype``): parameters for compute are kept in their low-precision dtype (bf16), the
optimizer keeps a float32 master copy in its state (so ZeRO partitions it with the moments, as in the ZeRO
paper's 2 + 2 + 12 bytes per parameter), and gradients are reduced in the parameters' dtype.

The 1-bit optimizers need each rank's local gradient and their own layouts (:mod:`jonebit.train.onebit_zero`):
their whole step runs in the per-device view, and :func:`make_zero_step` builds it from the same pipeline
(:mod:`jonebit.train.step`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jonebit.sharding.layerwise import is_stacked
from jonebit.sharding.mesh import check_batch
from jonebit.sharding.zero import (
    OFFLOAD_MEMORY_KIND,
    ZeroShardings,
    check_stage,
    leaf_spec,
    place_copy,
    to_shardings,
    zero_shardings,
    zero_specs,
)
from jonebit.train.onebit_zero import (
    abstract_onebit_zero,
    find_onebit_state,
    init_onebit_zero,
    uses_onebit,
)
from jonebit.train.step import (
    after_backward,
    apply_optimizer,
    flat_layers_loss,
    gather_shards,
    layerwise_gathering,
    local_gradients,
    local_view,
    nonfinite,
    norm_sq,
    per_device,
    reduce_scatter,
    sharded_norm_sq,
)
from jonebit.transforms.nonfinite import keep_if
from jonebit.transforms.onebit_adam import local_abstract_state
from jonebit.transforms.phases import jit_per_phase

P = PartitionSpec


class MasterWeightsState(NamedTuple):
    """Optimizer state with float32 master weights (mixed precision)."""

    master: Any
    inner: Any


def _spec(s) -> PartitionSpec:
    return s.spec if isinstance(s, NamedSharding) else s


def _device_shardings(shardings):
    return jax.tree.map(lambda s: s.with_memory_kind("device"), shardings)


def init_zero(
    tx: optax.GradientTransformation,
    params,
    mesh: jax.sharding.Mesh,
    *,
    stage: int,
    axis: str = "data",
    offload_optimizer: bool = False,
    master_dtype=None,
):
    """Places ``params`` and creates the optimizer state for ZeRO ``stage``.

    Args:
      tx: any optax optimizer (element-wise or not).
      params: pytree of arrays (the model's parameters, in the dtype used for compute).
      mesh: mesh with the data axis ``axis``.
      stage: 0-3 (see :func:`jonebit.sharding.zero_shardings`).
      offload_optimizer: keep the optimizer state in host memory.
      master_dtype: e.g. ``jnp.float32`` with bf16 ``params``: the optimizer updates a master copy in this dtype
        (part of the optimizer state, partitioned at stages >= 1) and the params are its cast.

    Returns:
      ``(params, opt_state, shardings)``: global arrays laid out by ``shardings`` (:class:`ZeroShardings`).
    """
    stage = check_stage(stage)
    init = _master_init(tx, master_dtype)
    if find_onebit_state(local_abstract_state(init, params, mesh)) is not None:
        if master_dtype is not None:
            raise ValueError("init_zero: master_dtype is not supported with the 1-bit optimizers (they keep float32 "
                             "moments and update the params' own dtype)")
        return init_onebit_zero(tx, params, mesh, stage=stage, axis=axis, offload_optimizer=offload_optimizer)
    abstract_state = jax.eval_shape(init, params)
    sh = zero_shardings(mesh, params, abstract_state, stage=stage, axis=axis, offload_optimizer=offload_optimizer)
    params = place_copy(params, sh.params)
    opt_state = jax.jit(init, out_shardings=sh.opt_state)(params)
    return params, opt_state, sh


def _master_init(tx, master_dtype):
    if master_dtype is None:
        return tx.init

    def init(params):
        master = jax.tree.map(lambda p: p.astype(master_dtype), params)
        return MasterWeightsState(master=master, inner=tx.init(master))

    return init


def make_zero_grads(
    loss_fn: Callable[[Any, Any], jax.Array],
    mesh: jax.sharding.Mesh,
    shardings: ZeroShardings,
    *,
    batch_spec: PartitionSpec | None = None,
    reduce_dtype=None,
):
    """``grads(params, batch) -> (grads, loss)`` with the gradients reduced into ``shardings.grads``.

    ``loss_fn(params, local_batch)`` is the mean loss of one device's batch shard. ``reduce_dtype`` (e.g.
    ``jnp.bfloat16``) casts the local gradients before the reduction to halve the traffic.
    """
    axis = shardings.axis
    param_specs = jax.tree.map(_spec, shardings.params)
    grad_specs = jax.tree.map(_spec, shardings.grads)
    return _grads_fn(loss_fn, mesh, axis, param_specs, grad_specs, batch_spec, reduce_dtype)


def _grads_fn(loss_fn, mesh, axis: str, param_specs, grad_specs, batch_spec, reduce_dtype, with_norm=False,
              quantize=False):
    size = mesh.shape[axis]
    batch_spec = P(axis) if batch_spec is None else batch_spec

    def body(params, batch):
        # Stage 3: the shards are gathered once (those of stacked layers one layer at a time, inside the model);
        # each device's gradient of the gathered tree is then reduce-scattered back into the shards, so no device
        # holds the summed full gradient.
        local = gather_shards(params, param_specs, axis, quantize=quantize)
        # Stacked layers (stage 3): each layer's shards gathered where it runs, gradients reduced in reduce_dtype.
        layerwise, _ = layerwise_gathering(params, param_specs, axis, reduce_dtype=reduce_dtype, quantize=quantize)
        with layerwise:
            grads, losses, _ = local_gradients(loss_fn, local, batch, axis=axis)
        if reduce_dtype is not None:
            grads = jax.tree.map(lambda g: g.astype(reduce_dtype), grads)
        grads = reduce_scatter(grads, grad_specs, axis, size, param_specs)
        if not with_norm:
            return grads, lax.pmean(losses[0], axis)
        # One scalar all-reduce at stages 1-3; none at stage 0, whose reduced gradient is replicated.
        return grads, lax.pmean(losses[0], axis), sharded_norm_sq(grads, grad_specs, axis)

    out_specs = (grad_specs, P(), P()) if with_norm else (grad_specs, P())
    return per_device(body, mesh, in_specs=(param_specs, batch_spec), out_specs=out_specs)


def _update_grad_specs(params, shardings: ZeroShardings, mesh):
    """Layout the step reduces the gradients into: ``shardings.grads``, except at stage 1.

    Stage 1 partitions only the optimizer state, so each device needs only its shard of the mean gradient:
    a reduce-scatter into the optimizer state's layout (the ZeRO rule on the gradient's shape) and the
    all-gather of the updated parameters move as many bytes as stage 0's all-reduce, where an all-reduce
    followed by the all-gather would move 1.5 times as many. The full gradient is a temporary of the step
    either way; :func:`make_zero_grads` still returns it replicated at stage 1.
    """
    grad_specs = jax.tree.map(_spec, shardings.grads)
    if shardings.stage != 1:
        return grad_specs
    return jax.tree_util.tree_map_with_path(
        lambda path, p, s: leaf_spec(p.shape, mesh, shardings.axis, s, what="grads", first=int(is_stacked(path))),
        params, grad_specs)


def make_zero_step(
    loss_fn: Callable[[Any, Any], jax.Array],
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    shardings: ZeroShardings,
    *,
    batch_spec: PartitionSpec | None = None,
    reduce_dtype=None,
    donate: bool = True,
    per_phase: bool = True,
    quantized_weights: bool = False,
):
    """Builds ``step(params, opt_state, batch) -> (params, opt_state, loss)`` for ``shardings``' ZeRO stage.

    Args:
      loss_fn: ``loss_fn(params, local_batch) -> scalar``, the mean loss of one device's batch shard.
      tx: the optax optimizer whose state was created by :func:`init_zero` (with or without ``master_dtype``).
      mesh: the mesh of ``shardings``.
      shardings: from :func:`init_zero` / :func:`jonebit.sharding.zero_shardings`.
      batch_spec: spec of the batch (default: leading dimension over the data axis); every dimension it splits
        must be divisible by the devices of its axes (checked, with the leaf named, when the step is traced).
      reduce_dtype: dtype for the gradient reduction (default: the gradients' own).
      donate: donate params and optimizer state.
      per_phase: with 1-bit Adam, one program per phase, picked on the host before each step
        (:mod:`jonebit.transforms.phases`); ``False``: one program with every phase.
      quantized_weights: stage 3 with a standard optimizer: gather the parameters as int8 with a float32 scale
        per block of 256 (ZeRO++'s qwZ, :mod:`jonebit.comm.quantized_gather`), about a quarter of float32's
        bytes and half of bf16's; the parameters, optimizer state and gradients themselves stay exact.

    The step is one ``jax.jit``; the loss returned is the mean over all devices.

    Non-finite gradients: a step whose gradient holds an inf or a NaN on any rank (or whose global norm
    overflows float32) is skipped on every rank alike: the parameters and the optimizer state come back bit
    for bit as they went in (a select on a flag from the gradient's global norm, as the engine does), and the
    returned loss, computed before the check, shows the bad value. The 1-bit optimizers' path does the same.
    """
    batch_spec = P(shardings.axis) if batch_spec is None else batch_spec
    if quantized_weights and (shardings.stage != 3 or uses_onebit(shardings)):
        raise ValueError("make_zero_step: quantized_weights quantizes stage 3's parameter gather; it needs stage 3 "
                         f"and a standard optimizer (got stage {shardings.stage}"
                         f"{', a 1-bit optimizer' if uses_onebit(shardings) else ''})")
    if uses_onebit(shardings):
        if reduce_dtype is not None:
            raise ValueError("make_zero_step: the 1-bit optimizers do their own communication; drop reduce_dtype")
        step = _make_onebit_step(loss_fn, tx, mesh, shardings, batch_spec, donate, per_phase)
    else:
        step = _make_step(loss_fn, tx, mesh, shardings, batch_spec, reduce_dtype, donate, quantized_weights)
    return CheckedStep(step, lambda batch: check_batch(batch, mesh, batch_spec, where="make_zero_step's step"))


class CheckedStep:
    """A jitted ``step(params, opt_state, batch)`` that checks the batch's shapes before jit sees them.

    ``jax.jit``'s ``in_shardings`` reject a batch the layout cannot split with a message about shardings and
    tiling factors; this names the leaf and the fix instead. ``lower`` checks too; every other attribute is the
    jitted function's.
    """

    def __init__(self, jitted, check):
        self._jitted = jitted
        self._check = check

    def __call__(self, params, opt_state, batch):
        self._check(batch)
        return self._jitted(params, opt_state, batch)

    def lower(self, params, opt_state, batch, **kwargs):
        self._check(batch)
        return self._jitted.lower(params, opt_state, batch, **kwargs)

    def __getattr__(self, name):
        return getattr(self._jitted, name)


def _make_step(loss_fn, tx, mesh, shardings: ZeroShardings, batch_spec, reduce_dtype, donate: bool,
               quantize: bool = False):
    axis = shardings.axis
    param_specs = jax.tree.map(_spec, shardings.params)
    state_dev = _device_shardings(shardings.opt_state) if shardings.offload_optimizer else shardings.opt_state
    batch_sharding = NamedSharding(mesh, batch_spec)

    def step(params, opt_state, batch):
        batch = jax.tree.map(lambda b: jax.sharding.reshard(b, batch_sharding), batch)
        grad_specs = _update_grad_specs(params, shardings, mesh)
        grads, loss, grad_norm_sq = _grads_fn(loss_fn, mesh, axis, param_specs, grad_specs, batch_spec, reduce_dtype,
                                              with_norm=True, quantize=quantize)(params, batch)
        if shardings.offload_optimizer:
            opt_state = jax.device_put(opt_state, state_dev)
        old_state = opt_state
        if isinstance(opt_state, MasterWeightsState):
            master = opt_state.master
            grads = jax.tree.map(lambda g, m: g.astype(m.dtype), grads, master)
            updates, inner = tx.update(grads, opt_state.inner, master)
            master = optax.apply_updates(master, updates)
            new_params = jax.tree.map(lambda m, p: m.astype(p.dtype), master, params)
            opt_state = MasterWeightsState(master=master, inner=inner)
        else:
            new_params, opt_state = apply_optimizer(tx, grads, opt_state, params)
        bad = nonfinite(grad_norm_sq)  # one value for all ranks: the norm was reduced over them
        new_params = keep_if(bad, params, jax.tree.map(jax.sharding.reshard, new_params, shardings.params))
        opt_state = keep_if(bad, old_state, jax.tree.map(jax.sharding.reshard, opt_state, state_dev))
        return new_params, opt_state, loss

    return jax.jit(
        step,
        in_shardings=(shardings.params, shardings.opt_state, batch_sharding),
        out_shardings=(shardings.params, shardings.opt_state, NamedSharding(mesh, P())),
        donate_argnums=(0, 1) if donate else (),
    )


def _make_onebit_step(loss_fn, tx, mesh, shardings: ZeroShardings, batch_spec, donate: bool, per_phase: bool):
    """A 1-bit optimizer under ZeRO: the whole step in the per-device view, local gradients to ``tx``."""
    axis = shardings.axis
    spec_of = lambda s: s.spec  # noqa: E731
    param_specs = jax.tree.map(spec_of, shardings.params)
    opt_specs = jax.tree.map(spec_of, shardings.opt_state)

    def body(params, opt_state, batch):
        local, tx_params, rewrap = local_view(params, axis)
        fn, uncast = flat_layers_loss(loss_fn, params, axis)
        grads, losses, _ = local_gradients(fn, local, batch, axis=axis, uncast=uncast)
        grads, losses, opt_in = after_backward(params, grads, losses, opt_state)
        # Each rank holds only its local gradient: one scalar reduction makes the flag the same on every rank.
        bad = nonfinite(lax.pmean(norm_sq(grads), axis))
        new, new_state = apply_optimizer(tx, grads, opt_in, tx_params)
        return (keep_if(bad, params, rewrap(new)), keep_if(bad, opt_state, new_state),
                lax.pmean(losses[0], axis))

    mapped = per_device(body, mesh, in_specs=(param_specs, opt_specs, batch_spec),
                        out_specs=(param_specs, opt_specs, P()))
    state_dev = jax.tree.map(lambda s: s.with_memory_kind("device"), shardings.opt_state)
    batch_sharding = NamedSharding(mesh, batch_spec)

    def step(params, opt_state, batch):
        batch = jax.tree.map(lambda b: jax.sharding.reshard(b, batch_sharding), batch)
        if shardings.offload_optimizer:
            opt_state = jax.device_put(opt_state, state_dev)
        return mapped(params, opt_state, batch)

    return jit_per_phase(
        step,
        per_phase=per_phase,
        in_shardings=(shardings.params, shardings.opt_state, batch_sharding),
        out_shardings=(shardings.params, shardings.opt_state, NamedSharding(mesh, P())),
        donate_argnums=(0, 1) if donate else (),
    )


def abstract_zero(tx, params, mesh, *, stage: int, axis: str = "data", offload_optimizer: bool = False,
                  master_dtype=None):
    """``(params, opt_state, shardings)`` as ``jax.ShapeDtypeStruct`` trees: plan memory without allocating."""
    init = _master_init(tx, master_dtype)
    if find_onebit_state(local_abstract_state(init, params, mesh)) is not None:
        if offload_optimizer or master_dtype is not None:
            raise ValueError("abstract_zero: plans 1-bit optimizers without offload or master weights")
        return abstract_onebit_zero(tx, params, mesh, stage=stage, axis=axis)
    abstract_state = jax.eval_shape(init, params)
    sh = zero_shardings(mesh, params, abstract_state, stage=stage, axis=axis, offload_optimizer=offload_optimizer)
    put = lambda t, s: jax.tree.map(lambda x, y: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=y), t, s)  # noqa: E731
    return put(params, sh.params), put(abstract_state, sh.opt_state), sh


__all__ = [
    "CheckedStep",
    "MasterWeightsState",
    "OFFLOAD_MEMORY_KIND",
    "place_copy",
    "abstract_zero",
    "init_zero",
    "make_zero_grads",
    "make_zero_step",
    "to_shardings",
    "zero_specs",
]
