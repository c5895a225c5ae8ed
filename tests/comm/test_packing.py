import numpy as np
import pytest

from jonebit.comm import pack_signs, unpack_signs


@pytest.mark.parametrize("n", [8, 64, 1000, 1024])
def test_pack_matches_numpy_packbits(n):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    packed = np.asarray(pack_signs(x))
    assert packed.dtype == np.uint8 and packed.shape == (n // 8 + (n % 8 > 0),)
    np.testing.assert_array_equal(packed, np.packbits(x >= 0))  # MSB first is numpy's default order


@pytest.mark.parametrize("n", [1, 7, 9, 13, 1001])
def test_round_trip_lengths_not_multiple_of_8(n):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    packed = np.asarray(pack_signs(x))
    assert packed.shape == (-(-n // 8),)
    np.testing.assert_array_equal(packed, np.packbits(x >= 0))  # missing trailing bits are zero
    signs = np.asarray(unpack_signs(packed, n))
    assert signs.dtype == np.float32
    np.testing.assert_array_equal(signs, np.where(x >= 0, 1.0, -1.0))


def test_zero_and_negative_zero_are_positive():
    x = np.array([0.0, -0.0, 1.0, -1.0, -1e-30, 1e-30, -0.0, 0.0], np.float32)
    packed = np.asarray(pack_signs(x))
    assert packed.tolist() == [0b11100111]
    np.testing.assert_array_equal(np.asarray(unpack_signs(packed, 8)), [1, 1, 1, -1, -1, 1, 1, 1])


def test_bf16_input():
    import jax.numpy as jnp

    x = jnp.array([-2.0, 3.0, 0.0, -0.5, 1, 1, 1, -1], jnp.bfloat16)
    assert np.asarray(pack_signs(x)).tolist() == [0b01101110]


def test_bad_inputs():
    with pytest.raises(ValueError, match="1-D"):
        pack_signs(np.zeros((2, 8), np.float32))
    with pytest.raises(TypeError, match="uint8"):
        unpack_signs(np.zeros(2, np.int32), 8)
    with pytest.raises(ValueError, match="cannot unpack 17"):
        unpack_signs(np.zeros(2, np.uint8), 17)


def test_n_must_be_a_static_int():
    """n sets the output's length: a float or a traced n is refused by name; the same n as a static argument
    works under jit and matches numpy's unpackbits."""
    import jax

    from jonebit.comm import padded_size

    packed = np.packbits(np.array([1, 0, 1, 1, 0, 0, 1, 0, 1], bool))
    with pytest.raises(TypeError, match=r"n must be a static Python int"):
        jax.jit(unpack_signs)(packed, 9)
    with pytest.raises(TypeError, match=r"n must be an int \(the number of signs\), got 9\.0"):
        unpack_signs(packed, 9.0)
    got = jax.jit(unpack_signs, static_argnums=1)(packed, 9)
    np.testing.assert_array_equal(np.asarray(got), np.unpackbits(packed)[:9] * 2.0 - 1.0)
    assert unpack_signs(packed, np.int64(9)).shape == (9,)
    # padded_size: ints (numpy too) pass, a float is refused instead of truncated.
    assert padded_size(np.int64(10), 8) == padded_size(10, 8) == 64
    with pytest.raises(TypeError, match=r"padded_size: n must be an int .* got 10\.7 \(float\)"):
        padded_size(10.7, 8)
