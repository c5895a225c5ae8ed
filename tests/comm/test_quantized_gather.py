"""Blockwise int8 quantized all-gather (ZeRO++'s qwZ) against a float64 numpy reference, on 8 CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jonebit.comm.quantized_gather import (
    BLOCK,
    block_size,
    dequantize_blockwise,
    quantize_blockwise,
    quantized_all_gather,
    wire_bytes_per_element,
)
from jonebit.sharding.mesh import data_mesh


def _reference(x: np.ndarray) -> np.ndarray:
    """Quantize-dequantize in float64: per block of the flattened array, scale max|x|/127, round to nearest."""
    flat = x.astype(np.float64).reshape(-1)
    block = block_size(flat.size)
    out = np.empty_like(flat)
    for i in range(0, flat.size, block):
        b = flat[i:i + block]
        s = np.abs(b).max() / 127
        out[i:i + block] = 0.0 if s == 0 else np.clip(np.round(b / s), -127, 127) * s
    return out.reshape(x.shape)


def _step_bound(x: np.ndarray) -> np.ndarray:
    """Half a quantization step of each element's block, max|block| / 254, broadcast to x's shape."""
    flat = np.abs(x.astype(np.float64)).reshape(-1)
    block = block_size(flat.size)
    pad = -flat.size % block
    half = np.repeat(np.pad(flat, (0, pad)).reshape(-1, block).max(1) / 254, block)[:flat.size]
    return half.reshape(x.shape)


@pytest.mark.parametrize("shape", [(1000,), (37, 64), (3, 5, 7), (256,)])
def test_round_trip_is_within_half_a_step_and_matches_float64(shape):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32) * np.float32(3.0)
    x.reshape(-1)[:5] = 0.0
    q, scale = quantize_blockwise(jnp.asarray(x))
    blocks = -(-x.size // BLOCK)
    assert q.dtype == jnp.int8 and scale.dtype == jnp.float32 and q.shape == (blocks, -(-x.size // blocks))
    assert q.size - x.size < blocks  # equal blocks of at most 256: less than one element of padding per block
    assert int(jnp.max(jnp.abs(q.astype(jnp.int32)))) == 127  # the largest element of a block maps to +-127
    back = np.asarray(dequantize_blockwise(q, scale, shape, jnp.float32), np.float64)
    half = _step_bound(x)
    # Rounding to nearest moves each element by at most half a step; the float32 scale and product add a few
    # ulps of the element itself (2**-22 relative covers them).
    assert np.all(np.abs(back - x) <= half * (1 + 1e-6) + 2.0**-22 * np.abs(x))
    # Against the float64 quantizer: the same integers except where x/scale lies within float32 rounding of a
    # half-way point, where the two may round apart by one step.
    ref = _reference(x)
    assert np.mean(np.abs(back - ref) <= 2.0**-22 * np.abs(x) + 1e-30) > 0.999
    assert np.all(np.abs(back - ref) <= 2 * half * (1 + 1e-6) + 2.0**-22 * np.abs(x))


def test_all_zero_blocks_stay_zero():
    q, scale = quantize_blockwise(jnp.zeros((300,)))
    assert not np.any(np.asarray(q)) and not np.any(np.asarray(scale))
    np.testing.assert_array_equal(dequantize_blockwise(q, scale, (300,), jnp.float32), np.zeros(300))


@pytest.mark.parametrize("dim", [0, 1])
def test_gather_over_eight_devices_concatenates_the_quantized_shards(dim):
    mesh = data_mesh(8)
    shape = (64, 40) if dim == 0 else (24, 80)
    x = np.random.default_rng(dim).standard_normal(shape).astype(np.float32)
    spec = P("data") if dim == 0 else P(None, "data")
    gathered = jax.jit(jax.shard_map(lambda s: quantized_all_gather(s, "data", dim, jnp.float32), mesh=mesh,
                                     in_specs=spec, out_specs=P(), check_vma=False))(
        jax.device_put(x, jax.NamedSharding(mesh, spec)))
    shards = np.split(x, 8, axis=dim)
    want = np.concatenate([_reference(s) for s in shards], axis=dim)
    bound = np.concatenate([_step_bound(s) for s in shards], axis=dim)
    got = np.asarray(gathered, np.float64)
    assert got.shape == x.shape
    assert np.all(np.abs(got - x) <= bound * (1 + 1e-6) + 2.0**-22 * np.abs(x))
    assert np.mean(np.abs(got - want) <= 2.0**-22 * np.abs(x) + 1e-30) > 0.999


def test_block_sizes():
    assert wire_bytes_per_element() == pytest.approx(1 + 4 / 256)
    assert [block_size(n) for n in (1, 32, 256, 257, 512, 1000)] == [1, 32, 256, 129, 256, 250]
