"""Stacked layers, applied one at a time: where ZeRO stage 3 gathers each layer's parameters.

A model whose identical layers are stacked (each parameter a leaf with a leading layer axis, built with
``nnx.vmap``) and applied by :func:`scan_layers` gets DeepSpeed's stage-3 schedule from
:func:`jonebit.train.zero.make_zero_step` and the engine: the stacked leaves stay partitioned over the data axis
through the forward and backward passes; inside the scanned body each layer's slice is all-gathered just before
that layer runs and dropped after it, gathered again in the backward pass (a rematerialisation policy keeps the
gathered copy out of the saved residuals), and autodiff turns the gather into the reduce-scatter of that layer's
gradient, issued as soon as the layer's backward is done. Only one layer's parameters are whole at a time.

The gather of layer ``i + 1`` reads only the stacked shards and the loop index, never layer ``i``'s output, so a
scheduler that overlaps collectives with compute (XLA's latency-hiding scheduler and collective pipeliner on GPU)
is free to issue it early.

The convention that links the two sides is the name :data:`STACKED_KEY`: the stacked module is stored under an
attribute of that name, and the ZeRO planner (:mod:`jonebit.sharding.zero`) recognises its leaves by their path:
it never partitions their layer axis, and the step leaves their gather to the model.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jonebit.comm.backends import as_varying
from jonebit.comm.quantized_gather import quantized_all_gather

STACKED_KEY = "stacked_layers"
# The rematerialisation name of a gathered layer's parameters (for policies of users' own checkpoints).
GATHERED_NAME = "zero_gathered_layer"

class _Gathering(NamedTuple):
    axis: str
    compute_dtype: Any
    reduce_dtype: Any
    quantize: bool


_GATHERING: contextvars.ContextVar[_Gathering | None] = contextvars.ContextVar("jonebit_layerwise", default=None)


class FlatLayer(NamedTuple):
    """One stacked leaf of a 1-bit ZeRO-3 model (:class:`jonebit.train.onebit_zero.FlatParams`): this rank's server
    chunk of every layer, ``(L, 1, C)``, and one layer's size before padding."""

    chunks: jax.Array
    size: int


class _FlatGathering(NamedTuple):
    axis: str
    compute_dtype: Any
    table: dict  # id of the stacked leaf the loss received -> FlatLayer


_FLAT: contextvars.ContextVar[_FlatGathering | None] = contextvars.ContextVar("jonebit_flat_layers", default=None)


def _key_name(k) -> str | None:
    for attr in ("key", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return None


def is_stacked(path) -> bool:
    """Whether a leaf at ``path`` (a ``jax.tree_util`` key path) belongs to a stack of layers (:data:`STACKED_KEY`)."""
    return any(_key_name(k) == STACKED_KEY for k in path)


@contextlib.contextmanager
def gathering(axis: str, *, compute_dtype=None, reduce_dtype=None, quantize: bool = False) -> Iterator[None]:
    """While tracing inside ``shard_map`` over ``axis``: stacked layers arrive as shards and :func:`scan_layers`
    all-gathers each layer's slice over ``axis`` where it runs. Set by the ZeRO stage-3 steps.

    ``compute_dtype``: the shards are cast to it before the gather (half the bytes of float32 in bf16).
    ``reduce_dtype``: the dtype the gradient is reduce-scattered in (default: the shard's own, float32 for float32
    master parameters, as the other leaves' gradients are reduced).
    ``quantize``: gather int8 values with a scale per block (:mod:`jonebit.comm.quantized_gather`); the gradient
    flows straight through to the exact shard.
    """
    token = _GATHERING.set(_Gathering(axis, compute_dtype, reduce_dtype, quantize))
    try:
        yield
    finally:
        _GATHERING.reset(token)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _gather(x, axis: str, dim: int, compute_dtype, reduce_dtype, quantize: bool):
    if quantize:
        return quantized_all_gather(x, axis, dim, compute_dtype)
    return lax.all_gather(x.astype(compute_dtype), axis, axis=dim, tiled=True)


def _gather_fwd(x, axis, dim, compute_dtype, reduce_dtype, quantize):
    return _gather(x, axis, dim, compute_dtype, reduce_dtype, quantize), jnp.zeros((), x.dtype)


def _gather_bwd(axis, dim, compute_dtype, reduce_dtype, quantize, like, ct):
    # The transpose of the gather, but summed in reduce_dtype: a bf16 cotangent summed over the ranks in bf16
    # would round the gradient at every partial sum, where the other leaves' gradients are reduced in float32.
    summed = lax.psum_scatter(ct.astype(reduce_dtype), axis, scatter_dimension=dim, tiled=True)
    return (summed.astype(like.dtype),)


_gather.defvjp(_gather_fwd, _gather_bwd)


@contextlib.contextmanager
def flat_gathering(axis: str, table: dict, *, compute_dtype=None) -> Iterator[None]:
    """While tracing a loss inside ``shard_map`` over ``axis`` (1-bit Adam at ZeRO stage 3): the stacked leaves the
    loss received are zero placeholders of their full shape, and ``table`` maps each (by ``id``) to its
    :class:`FlatLayer`. :func:`scan_layers` all-gathers each layer's chunks where the layer runs, and the placeholder's
    gradient is the layer's whole local gradient, which 1-bit compression needs (nothing is reduce-scattered)."""
    token = _FLAT.set(_FlatGathering(axis, compute_dtype, table))
    try:
        yield
    finally:
        _FLAT.reset(token)


class _FlatMeta(NamedTuple):
    axis: str
    size: int  # one layer's elements
    compute_dtype: Any
    chunk_shape: tuple
    chunk_dtype: Any
    placeholder_dtype: Any


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gather_flat(chunk, placeholder, meta: _FlatMeta):
    dtype = chunk.dtype if meta.compute_dtype is None else meta.compute_dtype
    rows = lax.all_gather(chunk.astype(dtype), meta.axis, tiled=True)  # (1, C) per rank -> (P, C)
    return rows.reshape(-1)[:meta.size].reshape(placeholder.shape)


def _gather_flat_fwd(chunk, placeholder, meta):
    return _gather_flat(chunk, placeholder, meta), None


def _gather_flat_bwd(meta, _, ct):
    # The layer's whole local gradient goes to the placeholder; the chunks get none (1-bit Adam's update reaches
    # them through its own compressed allreduce, not through autodiff).
    zero = as_varying(jnp.zeros(meta.chunk_shape, meta.chunk_dtype), meta.axis)
    return zero, ct.astype(meta.placeholder_dtype)


_gather_flat.defvjp(_gather_flat_fwd, _gather_flat_bwd)


def _flat_layers(params, how: _FlatGathering):
    """The :class:`FlatLayer` of every leaf of a stack's parameters, or an error naming the fix."""
    found = [how.table.get(id(x)) for x in jax.tree.leaves(params)]
    if not all(found):
        raise ValueError(
            "scan_layers under 1-bit Adam at ZeRO stage 3: a stacked parameter reached the model as another array "
            "than the step passed to the loss (cast, copied or computed inside loss_fn?). Pass the parameters to the "
            "model unchanged; the step gathers each layer in the compute dtype itself")
    return found


def _gather_layer(params, full, how: _Gathering):
    """Each leaf of one layer's ``params`` whole: all-gathered over the axis on the one dimension where its local
    shape is short of ``full`` (the layer's unpartitioned shapes); leaves already whole pass through."""
    size = lax.axis_size(how.axis)

    def one(x, f):
        short = [d for d, (a, b) in enumerate(zip(x.shape, f.shape, strict=True)) if a != b]
        if not short:
            return x
        if len(short) > 1:
            raise ValueError(f"stacked layer leaf of local shape {x.shape} is split on several dimensions of its "
                             f"{f.shape}; layer-wise gathering supports a stack split over the data axis {how.axis!r} "
                             "alone (no model-parallel axes)")
        (d,) = short
        if x.shape[d] * size != f.shape[d]:
            raise ValueError(f"stacked layer leaf of local shape {x.shape} cannot be gathered over {how.axis!r} "
                             f"(size {size}) into {f.shape}")
        compute = x.dtype if how.compute_dtype is None else jnp.dtype(how.compute_dtype)
        reduce = x.dtype if how.reduce_dtype is None else jnp.dtype(how.reduce_dtype)
        return checkpoint_name(_gather(x, how.axis, d, compute, reduce, how.quantize), GATHERED_NAME)

    return jax.tree.map(one, params, full)


def scan_layers(stack: nnx.Module, x, fn: Callable, *, layer_shapes, remat: bool = False):
    """``x`` through every layer of ``stack`` in order: ``x = fn(layer, x)`` with ``layer`` one slice of the stack.

    Args:
      stack: a module whose ``nnx.Param`` leaves have a leading layer axis (e.g. built under ``nnx.vmap``); its
        other state (RNG streams) is stacked too and advanced per layer.
      x: the carry (activations).
      fn: ``fn(layer, x) -> x``; ``layer`` is a module of the stack's class holding one layer's parameters.
      layer_shapes: one layer's ``nnx.Param`` state as ``ShapeDtypeStruct``s (what ``nnx.eval_shape`` of the
        layer's constructor gives): under :func:`gathering`, the shapes the slices are gathered to.
      remat: recompute each layer's activations in the backward pass.

    Returns:
      ``fn`` applied layer by layer.
    """
    graphdef, params, rest = nnx.split(stack, nnx.Param, ...)
    how = _GATHERING.get()
    flat = _FLAT.get()
    chunks = None
    if flat is not None:
        layers = _flat_layers(params, flat)
        chunks = [f.chunks for f in layers]

    def body(h, slices):
        p, r, c = slices
        if flat is not None:
            leaves, treedef = jax.tree.flatten(p)
            p = treedef.unflatten([
                checkpoint_name(_gather_flat(chunk, x, _FlatMeta(flat.axis, f.size, flat.compute_dtype,
                                                                 tuple(chunk.shape), chunk.dtype, x.dtype)),
                                GATHERED_NAME)
                for x, chunk, f in zip(leaves, c, layers, strict=True)])
        elif how is not None:
            p = _gather_layer(p, layer_shapes, how)
        layer = nnx.merge(graphdef, p, r)
        h = fn(layer, h)
        return h, nnx.state(layer, nnx.Not(nnx.Param))

    if remat:
        body = jax.checkpoint(body, prevent_cse=False)
    elif how is not None or flat is not None:
        # Keep the matmul outputs for the backward pass, but not the gathered parameters: gathered again there.
        # (Saving everything but the named gathered values keeps values derived from them instead: measured, a
        # stacked copy of every gathered kernel, the whole model again.)
        body = jax.checkpoint(body, prevent_cse=False, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    x, rest = lax.scan(body, x, (params, rest, chunks))
    nnx.update(stack, rest)
    return x


__all__ = ["GATHERED_NAME", "STACKED_KEY", "FlatLayer", "flat_gathering", "gathering", "is_stacked", "scan_layers"]
