"""Sign packing: 8 signs per byte, most significant bit first (numpy ``packbits`` order).

A bit is 1 when the value is ``>= 0`` and 0 otherwise, so exact zeros and ``-0.0`` both count as +1:
1-bit compression cannot represent zero and DeepSpeed makes the same choice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Bit weights of one byte, MSB first.
_WEIGHTS = np.array([128, 64, 32, 16, 8, 4, 2, 1], dtype=np.uint8)
# Row b holds the signs of byte value b, MSB first: +1.0 for a 1 bit, -1.0 for a 0 bit.
_SIGN_TABLE = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(np.float32) * 2.0 - 1.0


def sign_bits(x: jnp.ndarray) -> jnp.ndarray:
    """Boolean array, True where ``x >= 0`` (so ``0.0`` and ``-0.0`` are positive)."""
    # `x >= 0` is already True for -0.0 under IEEE comparison; NaN gives False (-1).
    return x >= 0


def pack_signs(x: jnp.ndarray) -> jnp.ndarray:
    """Packs the signs of a 1-D float array into bytes.

    Args:
      x: 1-D array of any float dtype.

    Returns:
      ``uint8`` array of length ``ceil(len(x) / 8)``. Byte ``i`` holds the signs of ``x[8i:8i+8]``, the first
      element in the most significant bit. When ``len(x)`` is not a multiple of 8, the missing trailing bits
      are 0; :func:`unpack_signs` with the original length drops them.
    """
    x = jnp.asarray(x)
    if x.ndim != 1:
        raise ValueError(f"pack_signs expects a 1-D array, got shape {x.shape}")
    n = x.shape[0]
    bits = sign_bits(x).astype(jnp.uint8)
    pad = (-n) % 8
    if pad:
        bits = jnp.concatenate([bits, jnp.zeros((pad,), jnp.uint8)])
    # A weighted sum of 8 bits never exceeds 255, so uint8 arithmetic is exact.
    return jnp.sum(bits.reshape(-1, 8) * _WEIGHTS, axis=1, dtype=jnp.uint8)


def unpack_signs(packed: jnp.ndarray, n: int) -> jnp.ndarray:
    """Inverse of :func:`pack_signs`: ``float32`` array of ``n`` values in ``{-1, +1}``.

    Args:
      packed: 1-D ``uint8`` array.
      n: number of signs to return, a static Python int (it sets the output's shape); at most
        ``8 * len(packed)``.
    """
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise TypeError(f"unpack_signs expects uint8 bytes, got {packed.dtype}")
    if packed.ndim != 1:
        raise ValueError(f"unpack_signs expects a 1-D array, got shape {packed.shape}")
    if isinstance(n, jax.core.Tracer):
        raise TypeError("unpack_signs: n must be a static Python int (it sets the output's length), got a traced "
                        "value; pass it from a shape or mark it static (jax.jit's static_argnums)")
    if isinstance(n, bool) or not isinstance(n, int | np.integer):
        raise TypeError(f"unpack_signs: n must be an int (the number of signs), got {n!r} ({type(n).__name__})")
    if not 0 <= n <= 8 * packed.shape[0]:
        raise ValueError(f"cannot unpack {n} signs from {packed.shape[0]} bytes")
    return unpack_rows(packed).reshape(-1)[:n]


def select_signs(packed: jnp.ndarray, positive, negative) -> jnp.ndarray:
    """``(k,)`` bytes to ``(k, 8)`` float32: ``positive`` where a bit is 1, ``negative`` where it is 0.

    With ``positive = s * 1`` and ``negative = s * -1`` this is ``s * unpack(packed)`` bit for bit, as one
    elementwise select: each byte is broadcast over its 8 outputs and tested against a constant mask, which
    XLA:CPU vectorises (no gather, and no division in the index arithmetic when the result is reshaped).
    """
    return jnp.where((packed[:, None] & _WEIGHTS) != 0, positive, negative)


def unpack_rows(packed: jnp.ndarray) -> jnp.ndarray:
    """``(..., k)`` bytes to ``(..., k, 8)`` float32 signs, by table lookup.

    A 256 x 8 table gathered per byte is several times faster on XLA:CPU than shifting and masking each
    bit (whose byte-to-bit interleave fuses into expensive index arithmetic).
    """
    return jnp.take(_SIGN_TABLE, packed.astype(jnp.int32), axis=0)
