"""The 1-bit optimizers with no mesh axis bound: one worker (DeepSpeed with one rank), so that the code Flax and
optax users already write (``nnx.Optimizer``, ``nnx.jit``, one device) works unchanged."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jonebit
from jonebit.comm import backends, compressed_allreduce

FREEZE = 10
OPTIMIZERS = {
    "onebit_adam": lambda: jonebit.onebit_adam(1e-2, freeze_step=FREEZE),
    "onebit_lamb": lambda: jonebit.onebit_lamb(1e-2, freeze_step=FREEZE),
    "zero_one_adam": lambda: jonebit.zero_one_adam(1e-2, var_freeze_step=FREEZE),
}


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(8, 32, rngs=rngs)
        self.out = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))


def regression(n=256):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 8)).astype(np.float32)
    return x, x @ rng.standard_normal((8, 1)).astype(np.float32)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_nnx_optimizer_trains_past_the_freeze_on_one_device(name, caplog):
    """The natural Flax code: nnx.Optimizer over optax.chain(clip, jonebit optimizer), an nnx.jit step."""
    backends._told_local = False  # the log line comes once per process
    caplog.set_level(logging.WARNING, logger="jonebit")
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0), OPTIMIZERS[name]()), wrt=nnx.Param)
    x, y = regression()

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, x, y)) for _ in range(4 * FREEZE)]
    said = [r.getMessage() for r in caplog.records if "runs as one worker" in r.getMessage()]
    assert len(said) == 1 and "jonebit.nnx.make_train_step" in said[0]  # once, naming the data-parallel entry
    # Trained, and still training after the freeze (30 compressed steps): an untrained or diverged model is not.
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.1 * losses[0], losses
    assert losses[-1] < losses[FREEZE], losses


def test_one_worker_equals_a_one_device_mesh():
    """Outside shard_map the optimizer computes what it computes on a one-device mesh: bitwise equal updates.

    Fixed gradients make this exact by construction: both sides run the same float32 operations on the same
    inputs, and a 1-bit step could only differ where a compensated value sits within rounding of zero, which for
    these normal draws has a probability of ~1e-7 per element and step."""
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.standard_normal((5, 7)), jnp.float32), "b": jnp.zeros(7, jnp.float32)}
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params) for _ in range(6)]
    tx = jonebit.onebit_adam(1e-2, freeze_step=2)
    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])

    def run(update, state):
        p = params
        for g in grads:
            u, state = update(g, state, p)
            p = optax.apply_updates(p, u)
        return p

    local = run(jax.jit(tx.update), jax.jit(tx.init)(params))
    state, specs = jonebit.sharded_init(tx, params, mesh)
    on_mesh = jax.jit(jax.shard_map(tx.update, mesh=mesh, in_specs=(P(), specs, P()), out_specs=(P(), specs),
                                    check_vma=False))
    meshed = run(on_mesh, state)
    for a, b in zip(jax.tree.leaves(local), jax.tree.leaves(meshed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.allclose(np.asarray(local["w"]), np.asarray(params["w"]))  # it moved


def test_compressed_allreduce_of_one_worker():
    """One worker: x + e compressed to sign * RMS, the error kept; the server step repeats it on the average."""
    x = jnp.asarray(np.random.default_rng(2).standard_normal(16), jnp.float32)
    out, we, se = compressed_allreduce(x, jnp.zeros(16), jnp.zeros(16))
    scale = np.sqrt(np.mean(np.square(np.asarray(x, np.float64))))
    # float32 scale: a sum of 16 squares (relative error <= 16 u), a division and a square root (a few u more):
    # below 1e-6 = 17 u relative against the float64 value; the error x - out inherits that absolute error.
    np.testing.assert_allclose(np.asarray(out), np.where(np.asarray(x) >= 0, scale, -scale), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(we), np.asarray(x) - np.asarray(out), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(se), 0, atol=1e-6)  # a vector of equal magnitudes compresses exactly


def test_a_shard_map_without_the_axis_is_an_error():
    """Inside shard_map a mistyped axis must not silently train every device on its own."""
    mesh = jax.make_mesh((2,), ("model",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
    params = {"w": jnp.ones(8)}
    tx = jonebit.onebit_adam(1e-3, freeze_step=2)  # axis_name="data"
    with pytest.raises(ValueError, match=r"mesh axis 'data' is not bound here \(the enclosing shard_map binds "
                                         r"\['model'\]\)"):
        jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)(params)
