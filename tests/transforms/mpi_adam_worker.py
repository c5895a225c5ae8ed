"""MPI rank program: 1-bit Adam with ``mpi_comm`` on fixed local gradients; saves ``OUTDIR/rank{r}.npz``."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from mpi4py import MPI  # noqa: E402

from jonebit import onebit_adam  # noqa: E402
from jonebit.comm import MPIBackend  # noqa: E402
from jonebit.experimental import OneBitAdamOptions  # noqa: E402
from tests.transforms.mpi_cases import CONFIGS, FREEZE_STEP, STEPS, grads, params0  # noqa: E402


def main(outdir: str) -> None:
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    g = grads(world)
    results = {}
    for name, (fused, mean, wd, refresh) in CONFIGS.items():
        tx = onebit_adam(1e-2, freeze_step=FREEZE_STEP, fused=fused, weight_decay=wd,
                         experimental=OneBitAdamOptions(variance_refresh=refresh),
                         mpi_comm=MPIBackend(comm, mean=mean))
        params = jax.tree.map(np.asarray, params0())
        state = jax.jit(tx.init)(params)

        @jax.jit
        def step(params, state, grads, tx=tx):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        for t in range(STEPS):
            params, state = step(params, state, g[t][rank])
        for k, v in params.items():
            results[f"{name}/params/{k}"] = np.asarray(v)
        for field in ("mu", "nu", "worker_error", "server_error"):
            for path, v in jax.tree_util.tree_leaves_with_path(getattr(state, field)):
                results[f"{name}/{field}{jax.tree_util.keystr(path)}"] = np.asarray(v)
    np.savez(os.path.join(outdir, f"rank{rank}.npz"), **results)


if __name__ == "__main__":
    main(sys.argv[1])
