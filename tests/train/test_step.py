"""jonebit.train.step.per_device: an output the body returns unchanged is the input itself (and leaves the manual
computation under jit); anything else is what ``jax.shard_map`` returns."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jonebit.sharding.mesh import data_mesh
from jonebit.train.step import per_device

N = 4


def _put(x, spec):
    return jax.device_put(x, jax.NamedSharding(data_mesh(N), spec))


def test_an_unchanged_output_is_its_input_and_leaves_the_manual_computation():
    mesh = data_mesh(N)
    x = _put(np.arange(6, dtype=np.float32), P())
    g = _put(np.arange(4 * 6, dtype=np.float32).reshape(4, 6), P("data"))

    def body(x, g):
        return x, x + jax.lax.psum(g[0], "data")

    step = per_device(body, mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))
    same, new = step(x, g)
    assert same is x
    np.testing.assert_array_equal(new, np.arange(6) + np.arange(24).reshape(4, 6).sum(0))
    text = jax.jit(step).lower(x, g).as_text()
    line = next(s for s in text.splitlines() if "sdy.manual_computation(" in s)
    assert line.split("out_shardings=", 1)[1].split("manual_axes=", 1)[0].count("<@") == 1  # `new` alone


def test_an_input_returned_under_another_spec_is_what_shard_map_makes_of_it():
    """A replicated input returned as a split output is every device's copy side by side (shape N x): not the
    input."""
    mesh = data_mesh(N)
    x = _put(np.arange(6, dtype=np.float32), P())
    step = per_device(lambda x: x, mesh, in_specs=P(), out_specs=P("data"))
    out = step(x)
    assert out is not x and out.shape == (N * 6,)
    np.testing.assert_array_equal(out, np.tile(np.arange(6), N))
    want = jax.shard_map(lambda x: x, mesh=mesh, in_specs=P(), out_specs=P("data"))(x)
    np.testing.assert_array_equal(jax.jit(step)(x), want)


def test_a_static_argument_turns_forwarding_off():
    """A ``None`` spec passes its argument as it is (not split): no pairing of specs, so nothing is forwarded, and
    the result is shard_map's."""
    mesh = data_mesh(N)
    x = _put(np.ones(3, dtype=np.float32), P())

    def body(x, scale):
        return x, x * scale

    step = per_device(body, mesh, in_specs=(P(), None), out_specs=(P(), P()))
    same, scaled = step(x, 2.0)
    np.testing.assert_array_equal(same, x)
    np.testing.assert_array_equal(scaled, 2 * np.ones(3))
    assert jnp.result_type(scaled) == jnp.float32
