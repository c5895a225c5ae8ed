"""MPI rank program: 1-bit Adam with ``freeze_step="auto"`` and ``mpi_comm``; saves ``OUTDIR/rank{r}.npz``."""

import logging
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from mpi4py import MPI  # noqa: E402

import jonebit  # noqa: E402
from jonebit import onebit_adam  # noqa: E402
from tests.transforms.test_onebit_adam_auto import B2, RULE, gradients, make_params, sched  # noqa: E402


def main(outdir: str, steps: int, fused: bool) -> None:
    logging.basicConfig(level=logging.WARNING, format="rank%(rank)s %(message)s")
    logging.getLogger("jonebit.transforms").setLevel(logging.INFO)
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    old = logging.getLogRecordFactory()

    def factory(*a, **kw):
        record = old(*a, **kw)
        record.rank = rank
        return record

    logging.setLogRecordFactory(factory)
    rng = np.random.default_rng(0)
    params = make_params(rng)
    grads = gradients(rng, params, world, steps)
    tx = onebit_adam(sched, freeze_step=jonebit.AutoFreeze(**RULE), b2=B2, weight_decay=0.01,
                     fused=fused, mpi_comm=comm)
    state = jax.jit(tx.init)(params)

    @jax.jit
    def step(params, state, g):
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    for g in grads:
        params, state = step(params, state, g[rank])
    np.savez(os.path.join(outdir, f"rank{rank}.npz"), freeze_at=np.asarray(state.freeze_at),
             **{f"params/{k}": np.asarray(v) for k, v in params.items()})


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "fused")
