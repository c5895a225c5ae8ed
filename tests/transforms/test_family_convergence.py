"""0/1 Adam and 1-bit LAMB reach their full-precision counterparts' loss on an ill-conditioned least-squares problem
split over 8 workers (each worker sees different rows, so local gradients really differ)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jonebit import onebit_lamb, sharded_init, zero_one_adam
from tests.transforms.family_util import mesh_of
from tests.transforms.test_convergence import DIM, STEPS, WORKERS, problem


def train(tx, per_rank: bool, start: int | None = None):
    a, b, loss_opt = problem()
    mesh = mesh_of(WORKERS)
    # LAMB starts away from zero: its trust ratio ||p|| / ||u|| is frozen at the freeze point, which assumes ||p||
    # has settled (from zero it grows throughout the run).
    x0 = np.random.default_rng(start).standard_normal(DIM).astype(np.float32) if start is not None else \
        np.zeros(DIM, np.float32)
    params = {"x": x0}
    state, specs = sharded_init(tx, params, mesh)
    pspec = P("data") if per_rank else P()

    def loss(p, a, b):
        return 0.5 * jnp.mean((a @ p["x"] - b) ** 2)

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(pspec, specs, P("data"), P("data")), out_specs=(pspec, specs))
    def step(params, state, a, b):
        if per_rank:  # 0/1 Adam: each rank's own params (they move apart during local steps)
            mine = jax.tree.map(lambda x: x[0], params)
            updates, state = tx.update(jax.grad(loss)(mine, a[0], b[0]), state, mine)
            return jax.tree.map(lambda x: x[None], optax.apply_updates(mine, updates)), state
        grads = jax.grad(loss)(jax.lax.pcast(params, "data", to="varying"), a[0], b[0])
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    put = lambda t: jax.device_put(t, jax.NamedSharding(mesh, P("data")))  # noqa: E731
    a_s, b_s = put(a), put(b)
    params = put({"x": np.stack([x0] * WORKERS)}) if per_rank else \
        jax.device_put(params, jax.NamedSharding(mesh, P()))
    for _ in range(STEPS):
        params, state = step(params, state, a_s, b_s)
        jax.block_until_ready(params)  # see test_convergence: keeps the CPU runtime's rendezvous from stalling
    x = np.asarray(params["x"])
    x = x[0] if per_rank else x
    return 0.5 * np.mean((a.reshape(-1, DIM) @ x - b.reshape(-1)) ** 2) - loss_opt  # excess loss


def test_zero_one_adam_with_local_steps_matches_adam():
    """300 updates after the freeze with sync intervals 1, 2, 4 (doubling every 50): 0.113 vs Adam's 0.085."""
    lr = 3e-2
    # Never leaving the first phase with every step a variance step: Adam (no bias correction) on mean gradients.
    adam = train(zero_one_adam(lr, var_freeze_step=STEPS + 1, var_update_scaler=STEPS + 1), True)
    zero_one = train(zero_one_adam(lr, var_freeze_step=100, var_update_scaler=8, local_step_scaler=50,
                                   local_step_clipper=4), True)
    print(f"excess loss: adam {adam:.3e}  0/1 adam {zero_one:.3e}")
    assert zero_one < 2 * adam


def test_onebit_lamb_matches_lamb_from_every_start():
    """Within 3x of LAMB's excess loss from each of six random starts, freezing after a quarter of the run, with the
    trust ratio clamped at max_coeff=1 for both (measured: 1.3-1.8x; excess 0.30-0.68 against 0.23-0.43, from
    210-521 at the start).

    Why the clamp: LAMB's trust ratio ||p|| / ||u|| grows as the update shrinks near the optimum (to ~9 of the default
    max_coeff 10 by update 100 here). LAMB recomputes it every step, so it falls again as soon as the steps grow;
    1-bit LAMB freezes its EMA, and a frozen 9x step on a frozen preconditioner oscillates and diverges from some
    starts (default max_coeff, freeze 100: two of six starts end at 72 and 767). DeepSpeed's arithmetic, checked
    against its own code by the golden tests; docs/optimizers.md tells users to clamp or to freeze earlier."""
    lr = 3e-2
    for start in range(1, 7):
        # LAMB throughout (never frozen), on mean gradients.
        lamb = train(onebit_lamb(lr, freeze_step=STEPS + 1, max_coeff=1.0), False, start)
        onebit = train(onebit_lamb(lr, freeze_step=100, max_coeff=1.0), False, start)
        print(f"start {start}: excess loss lamb {lamb:.3e}  1-bit lamb {onebit:.3e}")
        assert onebit < 3 * lamb, start
