"""Error feedback matters: ill-conditioned least squares split over 8 workers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jonebit import onebit_adam, sharded_init
from jonebit.experimental import OneBitAdamOptions

WORKERS, ROWS, DIM, STEPS = 8, 32, 64, 400


def problem():
    rng = np.random.default_rng(0)
    # Condition number 1e2: singular values spread log-uniformly; each worker sees different rows.
    u, _ = np.linalg.qr(rng.standard_normal((WORKERS * ROWS, DIM)))
    v, _ = np.linalg.qr(rng.standard_normal((DIM, DIM)))
    a = (u * np.logspace(0, 2, DIM)) @ v.T
    x_star = rng.standard_normal(DIM)
    b = a @ x_star + 0.01 * rng.standard_normal(WORKERS * ROWS)
    opt = np.linalg.lstsq(a, b, rcond=None)[0]
    loss_opt = 0.5 * np.mean((a @ opt - b) ** 2)
    return a.astype(np.float32).reshape(WORKERS, ROWS, DIM), b.astype(np.float32).reshape(WORKERS, ROWS), loss_opt


def train(tx):
    a, b, loss_opt = problem()
    mesh = jax.make_mesh((WORKERS,), ("data",), axis_types=(AxisType.Explicit,))
    params = {"x": np.zeros(DIM, np.float32)}
    state, specs = sharded_init(tx, params, mesh)

    def loss(p, a, b):
        return 0.5 * jnp.mean((a @ p["x"] - b) ** 2)

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(), specs, P("data"), P("data")), out_specs=(P(), specs))
    def step(params, state, a, b):
        grads = jax.grad(loss)(jax.lax.pcast(params, "data", to="varying"), a[0], b[0])
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    put = lambda t: jax.device_put(t, jax.NamedSharding(mesh, P("data")))  # noqa: E731
    a_s, b_s = put(a), put(b)
    params = jax.device_put(params, jax.NamedSharding(mesh, P()))
    for _ in range(STEPS):
        params, state = step(params, state, a_s, b_s)
        # Wait for each step: queuing hundreds of collective programs at once can stall the CPU runtime's
        # rendezvous (seen with jaxlib 0.10.2 on 8 simulated devices).
        jax.block_until_ready(params)
    x = np.asarray(params["x"])
    full = 0.5 * np.mean((a.reshape(-1, DIM) @ x - b.reshape(-1)) ** 2)
    return full - loss_opt  # excess loss


def test_error_feedback_closes_the_gap_to_adam():
    lr, freeze = 3e-3, 50
    adam = train(onebit_adam(lr, freeze_step=STEPS + 1))  # never leaves warmup: plain Adam on mean grads
    onebit = train(onebit_adam(lr, freeze_step=freeze))
    no_feedback = train(onebit_adam(lr, freeze_step=freeze, experimental=OneBitAdamOptions(error_feedback=False)))
    print(f"excess loss: adam {adam:.3e}  1-bit adam {onebit:.3e}  without error feedback {no_feedback:.3e}")
    assert onebit < 3 * adam + 1e-4
    assert no_feedback > 10 * onebit
