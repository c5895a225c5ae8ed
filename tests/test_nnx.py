"""``jonebit.nnx.make_train_step``: the Flax NNX entry, against the functional data-parallel step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jonebit
import jonebit.nnx
from jonebit.train.data_parallel import data_mesh, init_optimizer, make_step, replicate, shard_batch

STEPS = 20


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dropout: float = 0.0):
        self.hidden = nnx.Linear(8, 32, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.out = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(jax.nn.relu(self.hidden(x))))


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def batches(n=STEPS, size=64):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 1)).astype(np.float32)
    out = []
    for _ in range(n):
        x = rng.standard_normal((size, 8)).astype(np.float32)
        out.append({"x": x, "y": x @ w})
    return out


@pytest.fixture(scope="module")
def mesh():
    return data_mesh(8)


def functional(tx, grad_reduce, mesh):
    """The same model and data through jonebit.train.data_parallel.make_step (params as a pure tree)."""
    graphdef, params, rest = nnx.split(MLP(nnx.Rngs(0)), nnx.Param, ...)
    params = replicate(nnx.as_pure(params), mesh)
    state, specs = init_optimizer(tx, params, mesh)
    step = make_step(lambda p, b: loss_fn(nnx.merge(graphdef, p, rest), b), tx, mesh, specs, grad_reduce=grad_reduce)
    losses = []
    for b in batches():
        params, state, loss = step(params, state, shard_batch(b, mesh))
        losses.append(float(loss))
    return params, losses


@pytest.mark.parametrize("name", ["onebit_adam", "optax_adam"])
def test_equals_the_functional_step(mesh, name):
    tx, reduce = {"onebit_adam": (jonebit.onebit_adam(1e-2, freeze_step=5), None),
                  "optax_adam": (optax.adam(1e-2), "mean")}[name]
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = jonebit.nnx.make_train_step(model, optimizer, loss_fn, mesh)
    losses = [float(step(model, optimizer, b)) for b in batches()]
    want, want_losses = functional(tx, reduce, mesh)
    assert int(optimizer.step[...]) == STEPS
    # Both compute each device's gradient of the same function on the same shard, then the same update: the
    # programs differ in what surrounds them (the engine's non-finite check and counters), not in this arithmetic.
    np.testing.assert_array_equal(losses, want_losses)
    for a, b in zip(jax.tree.leaves(nnx.as_pure(nnx.state(model, nnx.Param))), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert losses[-1] < 0.2 * losses[0]


@pytest.mark.parametrize("name", ["zero_one_adam", "onebit_lamb"])
def test_trains_with_the_rest_of_the_family_and_dropout(mesh, name):
    tx = {"zero_one_adam": jonebit.zero_one_adam(1e-2, var_freeze_step=5),
          "onebit_lamb": jonebit.onebit_lamb(1e-2, freeze_step=5)}[name]
    model = MLP(nnx.Rngs(0), dropout=0.1)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = jonebit.nnx.make_train_step(model, optimizer, loss_fn, mesh)
    losses = [float(step(model, optimizer, b)) for b in batches(40)]
    assert np.isfinite(losses).all() and np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
    model.eval()
    x = batches(1)[0]
    assert float(loss_fn(model, x)) < 0.5 * losses[0]  # the model object itself holds the trained parameters


def test_bad_inputs(mesh):
    model = MLP(nnx.Rngs(0))
    with pytest.raises(TypeError, match="must be an nnx.Optimizer"):
        jonebit.nnx.make_train_step(model, optax.adam(1e-3), loss_fn, mesh)
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    optimizer.update(model, nnx.grad(lambda m: loss_fn(m, batches(1)[0]))(model))
    with pytest.raises(ValueError, match="already taken 1 steps; make the train step before the first update"):
        jonebit.nnx.make_train_step(model, optimizer, loss_fn, mesh)
