"""Compression's pack-and-error pass as one Pallas (Triton) kernel: the measured alternative to XLA's program.

After the scale ``s`` of a compensated buffer ``x`` is known, compression writes the packed signs (8 per byte,
:mod:`jonebit.comm.packing`'s order) and the new error ``x - s sgn(x)``. The kernel reads each element once and
writes both. Measured on two H200s (``gpu_suite.py``'s ``kernels`` section, ``results/gpu_suite/h200_pallas.json``,
``h200_engine.json``): XLA already emits this pass as one kernel at 0.96 of a copy's bandwidth, and the kernel ran
at 0.96x and 0.89x XLA's speed, so jonebit keeps XLA's program (``jonebit.comm.compressed._compress``). The kernel
also differed from XLA on a buffer whose last block is partial (24,016 elements, in both runs; equal at 8, 2^20 + 8
and 2^28): not investigated, since the kernel is not used. Kept here so that the measurement can be rerun.

Both compute the same values by construction where they agree on the block: the bits are exact, and ``s * (+-1)``
is exact, so ``x - s * sgn(x)`` is one rounding of the same subtraction (also when contracted into an FMA).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jonebit.comm.packing import pack_signs, sign_bits

IMPLS = ("xla", "pallas", "pallas_interpret")
# Rows of 8 elements per kernel instance: 16,384 elements, 64 KiB of float32 in, per program.
_BLOCK_ROWS = 2048


def _xla(x: jax.Array, scale: jax.Array):
    signs = jnp.where(sign_bits(x), jnp.float32(1.0), jnp.float32(-1.0))
    return pack_signs(x), x - scale * signs


def _kernel(x_ref, scale_ref, packed_ref, error_ref):
    x = x_ref[...]  # (rows, 8)
    positive = x >= 0  # the rule of packing.sign_bits: -0.0 and 0.0 count as +1
    weights = jnp.left_shift(1, 7 - lax.broadcasted_iota(jnp.int32, (1, 8), 1))  # MSB first
    packed_ref[...] = jnp.sum(jnp.where(positive, weights, 0), axis=1).astype(jnp.uint8)
    error_ref[...] = x - scale_ref[0] * jnp.where(positive, jnp.float32(1.0), jnp.float32(-1.0))


@functools.partial(jax.jit, static_argnames=("interpret",))
def _pallas(x: jax.Array, scale: jax.Array, interpret: bool = False):
    from jax.experimental import pallas as pl  # imported on use: the CPU path never needs it
    from jax.experimental.pallas import triton as pl_triton

    n = x.shape[0]
    rows = n // 8
    block = min(_BLOCK_ROWS, pl.next_power_of_2(rows))
    packed, error = pl.pallas_call(
        _kernel,
        grid=(pl.cdiv(rows, block),),
        in_specs=[pl.BlockSpec((block, 8), lambda i: (i, 0)), pl.BlockSpec((1,), lambda i: (0,))],
        out_specs=[pl.BlockSpec((block,), lambda i: (i,)), pl.BlockSpec((block, 8), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((rows,), jnp.uint8), jax.ShapeDtypeStruct((rows, 8), jnp.float32)],
        interpret=interpret,
        compiler_params=None if interpret else pl_triton.CompilerParams(num_warps=4),
        name="jonebit_pack_with_error",
    )(x.reshape(rows, 8), scale.reshape(1))
    return packed, error.reshape(n)


def pack_with_error(x: jax.Array, scale: jax.Array, *, impl: str = "xla"):
    """``(pack_signs(x), x - scale * sgn(x))`` of a 1-D float32 buffer and a float32 scalar.

    Args:
      x: ``(n,)`` float32, ``n`` a multiple of 8 (compression pads its buffers to that).
      scale: float32 scalar.
      impl: ``"xla"``, ``"pallas"`` (the Triton kernel, GPU only) or ``"pallas_interpret"`` (the kernel in
        Pallas' interpreter, any device; slow).
    """
    if impl not in IMPLS:
        raise ValueError(f"pack_with_error: impl must be one of {IMPLS}, got {impl!r}")
    x = jnp.asarray(x)
    if x.ndim != 1 or x.dtype != jnp.float32 or x.shape[0] % 8:
        raise ValueError(f"pack_with_error expects a 1-D float32 buffer whose length is a multiple of 8, got "
                         f"{x.dtype}{list(x.shape)}")
    scale = jnp.asarray(scale, jnp.float32)
    if impl == "xla":
        return _xla(x, scale)
    return _pallas(x, scale, interpret=impl == "pallas_interpret")


def compress_with(impl: str):
    """A stand-in for ``jonebit.comm.compressed._compress`` whose pack-and-error pass is ``impl``'s."""
    from jonebit.comm.compressed import _rms_scale

    def compress(x):
        scale = _rms_scale(x)
        packed, error = pack_with_error(x, scale, impl=impl)
        return scale, packed, error

    return compress
