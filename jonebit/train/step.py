"""The training-step pipeline that every step builder of :mod:`jonebit.train` composes.

One step, in the per-device view of a data-parallel mesh axis::

    params --local_view--> this device's parameters (replicated: cast to varying; 0/1 Adam: its own copy;
                           1-bit ZeRO-3: the gathered chunks; standard ZeRO-3: the gathered shards)
           --local_gradients--> its gradient (micro-batches accumulated in float32, loss scale undone)
           --reduce--> none (1-bit optimizers communicate themselves), the mean, or a reduce-scatter into the
                       ZeRO layout
           --apply_optimizer--> new parameters and optimizer state, in the layout they came in
           --keep_if--> the old ones where the step is skipped (a non-finite gradient on some rank)

:func:`jonebit.train.data_parallel.make_step`, :func:`jonebit.train.zero.make_zero_step` (standard optimizers and
the 1-bit ZeRO variant) and the engine's :func:`jonebit.train.engine.make_train_step` are wrappers that choose the
stages; :func:`per_device` is the one place the package maps a function over the devices of a mesh.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jonebit.comm.backends import as_varying
from jonebit.comm.quantized_gather import quantized_all_gather
from jonebit.sharding.layerwise import FlatLayer, flat_gathering, gathering, is_stacked
from jonebit.train.onebit_zero import FlatParams
from jonebit.transforms.onebit_adam_zero import OneBitAdamZeroState

REDUCTIONS = (None, "mean", "mean_bf16")


def per_device(body: Callable, mesh: jax.sharding.Mesh, in_specs, out_specs, *, check_vma: bool = True):
    """``body`` run on every device of ``mesh`` in the per-device view (``jax.shard_map``).

    An output that ``body`` returns unchanged from an input array with the same spec (1-bit Adam's frozen variance
    after the freeze, the error buffers its warmup leaves as they are) is that input, in the layout it came in:
    under ``jit`` it no longer leaves the manual computation, which matters for compile time (Shardy's grows with
    the square of a manual computation's operands and results; at 2,000 leaves the frozen variance alone is 2,000
    of them).
    """

    def call(*args):
        forwarded: list = []  # this call's own: two traces at once cannot mix their answers

        def traced(*inner):
            out = body(*inner)
            position = {id(x): i for i, x in enumerate(jax.tree.leaves(inner))}
            forwarded[:] = [position.get(id(x)) for x in jax.tree.leaves(out)]
            return out

        out = jax.shard_map(traced, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)(*args)
        flat_in = jax.tree.leaves(args)
        flat_out, tree = jax.tree.flatten(out)
        specs_in, specs_out = _spec_leaves(in_specs, args), _spec_leaves(out_specs, out)
        if len(forwarded) != len(flat_out) or specs_in is None or specs_out is None:
            return out
        for k, i in enumerate(forwarded):
            if (i is not None and isinstance(flat_in[i], jax.Array | jax.core.Tracer)
                    and specs_in[i] == specs_out[k] and np.shape(flat_in[i]) == np.shape(flat_out[k])
                    and jnp.result_type(flat_in[i]) == jnp.result_type(flat_out[k])):
                flat_out[k] = flat_in[i]
        return tree.unflatten(flat_out)

    return call


def _spec_leaves(prefix, tree) -> list | None:
    """The spec of every leaf of ``tree`` from a prefix of specs, or None where they do not pair up one to one
    (a ``None`` spec, for a static argument: no forwarding then)."""
    try:
        specs = jax.tree.leaves(jax.tree.broadcast(prefix, tree, is_leaf=lambda x: x is None),
                                is_leaf=lambda x: isinstance(x, P))
    except (ValueError, TypeError):
        return None
    return specs if len(specs) == len(jax.tree.leaves(tree)) else None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RankParams:
    """Parameters kept one copy per data-parallel rank (0/1 Adam: its local steps move each rank's own).

    ``copies`` is the parameter tree with a leading rank axis on every leaf (``(ranks, *shape)``), split over
    the data axis, so each device holds its rank's copy. :meth:`tree` gives rank 0's copy.
    """

    copies: Any

    def tree(self):
        def first(c):
            s = getattr(c, "sharding", None)
            if isinstance(s, jax.NamedSharding):  # replicated where the copies lived (explicit axes: say so)
                return c.at[0].get(out_sharding=jax.NamedSharding(s.mesh, P()))
            return c[0]

        return jax.tree.map(first, self.copies)


def local_view(params, axis, compute_dtype=None):
    """``(local, tx_params, rewrap)`` of this device's ``params`` (per-device view).

    ``local``: what the loss differentiates (typed varying over ``axis``, so autodiff adds no collective);
    ``tx_params``: what the optimizer's ``update`` takes; ``rewrap(new_tx_params)``: the updated parameters in the
    layout ``params`` came in. 1-bit ZeRO-3 chunks are gathered here, in ``compute_dtype`` when given (the cast
    commutes with the gather and halves its bytes in bf16).
    """
    if isinstance(params, FlatParams):
        layout = params.layout
        cast = (lambda c: c) if compute_dtype is None else (lambda c: c.astype(compute_dtype))
        # Stacks of layers are gathered one layer at a time inside the model (flat_layers_loss); here they are
        # zero placeholders of their whole shape, which carry their local gradient out of autodiff.
        chunks = tuple(None if layout.stacked(g) else lax.all_gather(cast(c), axis, tiled=True)
                       for g, c in enumerate(params.chunks))
        holders = {i: as_varying(jnp.zeros(layout.shapes[i], layout.dtypes[i]), axis)
                   for i in layout.stacked_leaves()}
        local = layout.unflatten(tuple(None if c is None else c.reshape(-1) for c in chunks), given=holders)
        return local, params.chunks, lambda new: FlatParams(chunks=tuple(new), layout=layout)
    if isinstance(params, RankParams):  # this rank's own copy (already varying over the data axis)
        own = jax.tree.map(lambda x: x[0], params.copies)
        return own, own, lambda new: RankParams(jax.tree.map(lambda x: x[None], new))
    return lax.pcast(params, axis, to="varying"), params, lambda new: new


def flat_layers_loss(loss_fn, params, axis: str, compute_dtype=None):
    """``(loss_fn, uncast)`` for the loss at :func:`local_view`'s ``local``: for 1-bit ZeRO-3 parameters with
    stacked layers, ``loss_fn`` traced under :func:`jonebit.sharding.layerwise.flat_gathering` (each layer's chunks
    gathered where :func:`~jonebit.sharding.layerwise.scan_layers` runs it) and ``uncast`` marking the
    placeholders, which must reach the model as they are; otherwise ``(loss_fn, None)``."""
    if not isinstance(params, FlatParams) or not params.layout.stacked_leaves():
        return loss_fn, None
    layout = params.layout
    stacks = {idx[0]: FlatLayer(jnp.swapaxes(params.chunks[g], 0, 1), layout.size(g))  # (L, 1, C): scanned
              for g, idx in enumerate(layout.groups) if layout.stacked(g)}
    uncast = layout.treedef.unflatten([i in stacks for i in range(len(layout.shapes))])

    def wrapped(p, *args):
        leaves = jax.tree.leaves(p)
        # The loops gather each layer's chunks: make them wait for every gather outside the stacks (as
        # after_backward explains, XLA:CPU would otherwise run those and the loop in either order).
        zero = _zero_token([x for i, x in enumerate(leaves) if i not in stacks])
        table = {id(leaves[i]): s._replace(chunks=s.chunks + zero.astype(s.chunks.dtype)) for i, s in stacks.items()}
        with flat_gathering(axis, table, compute_dtype=compute_dtype):
            return loss_fn(p, *args)

    return wrapped, uncast


def _zero_token(arrays) -> jax.Array:
    """A float32 zero that depends on every array given (its first element times 0), to order work after them."""
    firsts = [lax.stop_gradient(jnp.ravel(x)[0]).astype(jnp.float32) for x in arrays if jnp.size(x)]
    return sum(firsts, jnp.float32(0.0)) * np.float32(0.0)


def after_backward(params, grads, losses, opt_state):
    """``(grads, losses, opt_state)``, made to depend on the whole backward pass, for 1-bit ZeRO-3 with stacked
    layers; otherwise as they are.

    There the forward and backward passes are loops whose bodies all-gather a layer each, and XLA:CPU runs a loop
    and an independent collective outside it concurrently, in either order: seen, seven simulated devices waiting in
    a layer's all-gather and one in the reduce-scatter of a gradient of the heads above the stack (ready before the
    backward loop starts), each side waiting for the other. Every collective the optimizer and the loss metric issue
    reads these values, so adding a zero computed from the stack's gradients (the backward loop's outputs) orders
    them all after the loop on every device. The values are unchanged (``x + 0``); nothing waits that 1-bit
    compression would not wait for anyway (it needs the whole local gradient)."""
    if not (isinstance(params, FlatParams) and params.layout.stacked_leaves()):
        return grads, losses, opt_state
    layout = params.layout
    leaves = jax.tree.leaves(grads)
    stacked = set(layout.stacked_leaves())
    zero = _zero_token([leaves[i] for i in stacked])
    grads = layout.treedef.unflatten([x if i in stacked else x + zero.astype(x.dtype) for i, x in enumerate(leaves)])

    def state(s):
        if isinstance(s, OneBitAdamZeroState):  # its first compression step all-gathers the momentum chunks
            return dataclasses.replace(s, mu=tuple(m + zero for m in s.mu))
        return s

    opt_state = jax.tree.map(state, opt_state, is_leaf=lambda s: isinstance(s, OneBitAdamZeroState))
    return grads, losses + zero.astype(losses.dtype), opt_state


def local_gradients(loss_fn, local, batch, *, axis, accumulation_steps: int = 1, compute_dtype=None, scale=None,
                    has_aux: bool = False, rng=None, uncast=None):
    """This device's gradient of ``loss_fn`` at ``local``: ``(grads, losses, auxes)``.

    ``batch`` is split into ``accumulation_steps`` micro-batches along its leading axis; their gradients are summed
    (in float32 with a ``compute_dtype``) and divided by ``accumulation_steps x scale``. With ``compute_dtype`` the
    parameters are cast to it for the loss and the loss and gradients come back in float32; without one nothing is
    cast. ``scale`` multiplies the loss before differentiation (fp16 loss scaling; ``None``: none). ``rng``: a key
    folded with the micro-batch index and passed as ``loss_fn``'s third argument. ``losses`` (and ``auxes``, with
    ``has_aux``) are stacked over the micro-batches, unscaled. ``uncast``: a tree of bools like ``local``; leaves
    marked ``True`` reach ``loss_fn`` in their own dtype (ZeRO-3 shards of stacked layers, which the model casts
    where it gathers them, so that their gradients are reduced in float32).
    """
    k = int(accumulation_steps)

    def micro_step(micro, key):
        def scaled(p):
            if compute_dtype is not None:
                keep = jax.tree.map(lambda _: False, p) if uncast is None else uncast
                p = jax.tree.map(lambda x, k: x if k else x.astype(compute_dtype), p, keep)
            out = loss_fn(p, micro) if key is None else loss_fn(p, micro, key)
            loss, aux = out if has_aux else (out, None)
            if compute_dtype is not None:
                loss = jnp.asarray(loss, jnp.float32)
            return (loss if scale is None else loss * scale), (loss, aux)

        (_, (loss, aux)), grads = jax.value_and_grad(scaled, has_aux=True)(local)
        if compute_dtype is not None:
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        return loss, aux, grads

    def key_of(i):
        return None if rng is None else jax.random.fold_in(rng, i)

    if k == 1:  # no loop to carry: one forward/backward, no zero-initialised accumulator
        loss, aux, g_sum = micro_step(batch, key_of(0))
        losses, auxes = loss[None], jax.tree.map(lambda a: jnp.asarray(a)[None], aux)
    else:
        micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)

        def accumulate(g_sum, xs):
            mb, i = xs
            loss, aux, g = micro_step(mb, key_of(i))
            return jax.tree.map(jnp.add, g_sum, g), (loss, aux)

        zeros = lax.pcast(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), local), axis, to="varying")
        # Per-micro-batch losses (and aux) come out stacked: k scalars, not k gradients.
        g_sum, (losses, auxes) = lax.scan(accumulate, zeros, (micro, jnp.arange(k)))
    if scale is None and k == 1:  # nothing to undo: skip a pass over the gradients
        return g_sum, losses, auxes
    inv = 1.0 / (k * (1.0 if scale is None else scale))
    return jax.tree.map(lambda g: g * inv, g_sum), losses, auxes


def reduce(grads, how: str | None, axis):
    """The gradient as the optimizer takes it: this device's own (``None``: a 1-bit optimizer communicates itself),
    or the mean over ``axis`` in float32 (``"mean"``) or bfloat16 (``"mean_bf16"``, half the bytes)."""
    if how is None:
        return grads
    if how == "mean":
        return lax.pmean(grads, axis)
    if how == "mean_bf16":
        return jax.tree.map(lambda g: lax.pmean(g.astype(jnp.bfloat16), axis).astype(g.dtype), grads)
    raise ValueError(f"grad_reduce must be one of {REDUCTIONS}, got {how!r}")


def axis_dim(spec, axis: str) -> int | None:
    """The dimension ``spec`` splits over ``axis`` (alone or in a tuple of axes), or None."""
    for i, entry in enumerate(tuple(spec)):
        if entry == axis or (isinstance(entry, tuple) and axis in entry):
            return i
    return None


def gathered_by_model(path, spec, axis: str) -> bool:
    """Whether the model gathers this ZeRO-3 shard itself, layer by layer (:mod:`jonebit.sharding.layerwise`):
    a partitioned leaf of a stack of layers."""
    return is_stacked(path) and axis_dim(spec, axis) is not None


def gathered_mask(params, param_specs, axis: str):
    """``True`` at the ZeRO-3 shards the model gathers itself (:func:`gathered_by_model`)."""
    return jax.tree_util.tree_map_with_path(lambda path, _, spec: gathered_by_model(path, spec, axis), params,
                                            param_specs)


def layerwise_gathering(params, param_specs, axis: str, **how):
    """``(context, mask)``: :func:`jonebit.sharding.layerwise.gathering` over ``axis`` (``how``: its dtype and
    quantization options) where some stacked shard is left to the model (:func:`gathered_mask`), else a null
    context (nothing to gather, no rematerialisation to pay); ``mask`` is :func:`gathered_mask`."""
    mask = gathered_mask(params, param_specs, axis)
    context = gathering(axis, **how) if any(jax.tree.leaves(mask)) else contextlib.nullcontext()
    return context, mask


def gather_shards(params, param_specs, axis: str, compute_dtype=None, quantize: bool = False):
    """Standard ZeRO-3: every parameter shard all-gathered over ``axis`` (in ``compute_dtype`` when given), each
    leaf typed varying so that its gradient is this device's own. The shards of stacked layers stay shards: the
    model gathers them one layer at a time (trace its loss under :func:`jonebit.sharding.layerwise.gathering`).
    ``quantize``: int8 values with a float32 scale per block on the wire
    (:func:`jonebit.comm.quantized_gather.quantized_all_gather`)."""
    def one(path, p, spec):
        d = axis_dim(spec, axis)
        if d is not None and not gathered_by_model(path, spec, axis):
            dtype = p.dtype if compute_dtype is None else compute_dtype
            if quantize:
                p = quantized_all_gather(p, axis, d, dtype)
            else:
                p = lax.all_gather(p.astype(dtype), axis, axis=d, tiled=True)
        return as_varying(p, axis)

    return jax.tree_util.tree_map_with_path(one, params, param_specs)


def reduce_scatter(grads, grad_specs, axis: str, size: int, param_specs=None):
    """The mean gradient over ``axis``, each leaf laid out by its spec: scattered where the spec splits ``axis``,
    whole elsewhere. With ``param_specs`` (ZeRO-3): the gradient of a shard the model gathered itself is already
    the sum over ``axis``, scattered like the shard (autodiff's transpose of the gather), and is only divided."""
    if param_specs is None:
        param_specs = jax.tree.map(lambda _: P(), grads)

    def one(path, g, spec, param_spec):
        d = axis_dim(spec, axis)
        if d is None:
            return lax.pmean(g, axis)
        if gathered_by_model(path, param_spec, axis):
            return g / size
        return lax.psum_scatter(g, axis, scatter_dimension=d, tiled=True) / size

    return jax.tree_util.tree_map_with_path(one, grads, grad_specs, param_specs)


def norm_sq(grads) -> jax.Array:
    """The squared L2 norm of a gradient tree, summed in float32 (a float16 gradient squared would overflow at
    norms the optimizer handles fine)."""
    return sum((jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)), jnp.float32(0))


def sharded_norm_sq(grads, grad_specs, axis: str) -> jax.Array:
    """The squared norm of a gradient laid out by ``grad_specs``: whole leaves counted once, the shards of the
    split ones summed over ``axis`` (one scalar all-reduce, none when nothing is split)."""
    pairs = list(zip(jax.tree.leaves(grads), jax.tree.leaves(grad_specs, is_leaf=lambda x: isinstance(x, P)),
                     strict=True))
    total = norm_sq([g for g, s in pairs if axis_dim(s, axis) is None])
    sharded = [g for g, s in pairs if axis_dim(s, axis) is not None]
    return total + lax.psum(norm_sq(sharded), axis) if sharded else total


def nonfinite(grad_norm_sq) -> jax.Array:
    """Whether to skip the step: the gradient's squared norm, which every rank holds after its one scalar reduction,
    is not finite exactly when some rank's gradient holds an inf or a NaN, or is so large that its square overflows
    float32 (norm > ~1.8e19; DeepSpeed's overflow check also counts that). Reading it from the norm saves a pass
    over the gradients and a collective."""
    return ~jnp.isfinite(grad_norm_sq)


def apply_optimizer(tx: optax.GradientTransformation, grads, opt_state, params):
    """``(new_params, new_opt_state)`` after one update of ``tx``."""
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
