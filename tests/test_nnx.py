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


FREEZE = 5


def test_adam_equals_the_functional_step(mesh):
    """Standard optax Adam: the same per-device gradients, averaged, the same update, through two programs."""
    tx = optax.adam(1e-2)
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = jonebit.nnx.make_train_step(model, optimizer, loss_fn, mesh)
    losses = [float(step(model, optimizer, b)) for b in batches()]
    want, want_losses = functional(tx, "mean", mesh)
    assert int(optimizer.step[...]) == STEPS
    # The programs may sum the gradient mean in another order: relative differences of a few ulps (~1e-6) in g.
    # Adam's step lr * m / sqrt(v) is at most ~lr = 1e-2 and inherits g's relative error, so 20 steps differ by at
    # most 20 * 1e-2 * 1e-6 = 2e-7; 1e-5 leaves room for coordinates where g nearly cancels (error amplified).
    for a, b in zip(jax.tree.leaves(nnx.as_pure(nnx.state(model, nnx.Param))), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
    # Losses (MSE ~ 1-10, gradients ~ 1-10 in each of 321 parameters) move by at most |grad| * |dparam| ~ 1e-3
    # absolute for 1e-5 per parameter: 1e-3 relative to the smallest loss here (~1) bounds them.
    np.testing.assert_allclose(losses, want_losses, rtol=1e-3)
    assert losses[-1] < 0.2 * losses[0]


def test_onebit_adam_follows_the_functional_step(mesh):
    """1-bit Adam through two programs: elementwise agreement is asserted only before the first 1-bit step (a sign
    that flips at 1 ulp moves a coordinate by two scales); after it, what flips cannot change."""
    tx = jonebit.onebit_adam(1e-2, freeze_step=FREEZE)
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = jonebit.nnx.make_train_step(model, optimizer, loss_fn, mesh)
    losses = [float(step(model, optimizer, b)) for b in batches()]
    _, want_losses = functional(tx, None, mesh)
    # Each loss comes from the parameters before its step: losses 1..FREEZE + 1 from warmup (Adam) parameters,
    # which agree to ~2e-7 (see test_adam_equals_the_functional_step), so to 1e-3 relative as there.
    np.testing.assert_allclose(losses[: FREEZE + 1], want_losses[: FREEZE + 1], rtol=1e-3)
    # Both trained through 15 compressed steps to the same level: a flipped sign moves one coordinate by two
    # scales for a step, after which error feedback carries the difference back; the loss stays within 10% where
    # an untrained run or a broken compression is several times higher.
    tail, want_tail = np.mean(losses[-5:]), np.mean(want_losses[-5:])
    assert abs(tail - want_tail) <= 0.1 * want_tail, (tail, want_tail)
    assert tail < 0.2 * losses[0]


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
