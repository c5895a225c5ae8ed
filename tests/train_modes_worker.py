"""One small training run, launched three ways for tests/test_launch_modes.py.

``python train_modes_worker.py MODE OPT OUTDIR`` with MODE ``spmd`` (one or more jax.distributed processes,
shard_map over every device; launch with ``jonebit launch``) or ``mpi`` (``mpirun``, one device per rank,
``mpi_comm``), OPT ``adam`` (optax Adam on averaged gradients) or ``onebit`` (1-bit Adam). Process 0 saves the
final parameters to ``OUTDIR/{MODE}_{OPT}.npz``. ``run_spmd`` is also called in-process as the 1 x 4 reference.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jonebit import onebit_adam  # noqa: E402

WORLD, LOCAL_BATCH, STEPS, FREEZE = 4, 4, 8, 3


def problem():
    rng = np.random.default_rng(0)
    params = {
        "w1": (rng.standard_normal((6, 16)) / np.sqrt(6)).astype(np.float32),
        "b1": np.zeros(16, np.float32),
        "w2": (rng.standard_normal((16, 3)) / 4).astype(np.float32),
        "b2": np.zeros(3, np.float32),
    }
    x = rng.standard_normal((STEPS, WORLD * LOCAL_BATCH, 6)).astype(np.float32)
    y = np.tanh(x @ rng.standard_normal((6, 3)).astype(np.float32))
    return params, x, y


def loss_fn(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


def make_tx(opt, **kw):
    if opt == "adam":
        return optax.adam(1e-2)
    return onebit_adam(1e-2, freeze_step=FREEZE, **kw)


def run_spmd(opt: str):
    """shard_map over every device of every process (jax.distributed when launched with several)."""
    from jonebit.sharding.mesh import data_mesh
    from jonebit.train.data_parallel import init_optimizer, make_step, replicate, shard_batch

    mesh = data_mesh(WORLD)
    params0, x, y = problem()
    tx = make_tx(opt)
    state, specs = init_optimizer(tx, params0, mesh)
    step = make_step(loss_fn, tx, mesh, specs, grad_reduce="mean" if opt == "adam" else None)
    params = replicate(params0, mesh)
    for t in range(STEPS):
        params, state, _ = step(params, state, shard_batch((x[t], y[t]), mesh))
    return {k: np.asarray(v.addressable_shards[0].data) for k, v in params.items()}


def run_mpi(opt: str):
    """One device per MPI rank; the collectives go through mpi4jax."""
    from mpi4py import MPI

    from jonebit.comm import MPIBackend

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    assert comm.Get_size() == WORLD
    params0, x, y = problem()
    backend = MPIBackend(comm)
    tx = make_tx(opt, mpi_comm=backend) if opt == "onebit" else make_tx(opt)

    @jax.jit
    def step(params, state, batch):
        grads = jax.grad(loss_fn)(params, batch)
        if opt == "adam":
            grads = backend.mean(grads)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = jax.tree.map(jnp.asarray, params0)
    state = jax.jit(tx.init)(params)
    lo, hi = rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH
    for t in range(STEPS):
        params, state = step(params, state, (x[t, lo:hi], y[t, lo:hi]))
    return {k: np.asarray(v) for k, v in params.items()}


def main(mode: str, opt: str, outdir: str) -> None:
    if mode == "spmd":
        from jonebit.sharding.mesh import initialize_distributed

        initialize_distributed(timeout=60, heartbeat_timeout=20)
        params = run_spmd(opt)
        is_zero = jax.process_index() == 0
    else:
        params = run_mpi(opt)
        from mpi4py import MPI

        is_zero = MPI.COMM_WORLD.Get_rank() == 0
    if is_zero:
        np.savez(os.path.join(outdir, f"{mode}_{opt}.npz"), **params)
    print(f"{mode} {opt} done", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
