"""MPI rank program for tests/comm/test_mpi_backend.py: ``mpirun -np P python mpi_worker.py OUTDIR``.

Each rank runs the compressed allreduce and both means through :class:`MPIBackend` inside ``jit`` and saves
its results to ``OUTDIR/rank{r}.npz``; the pytest process compares them with the shard_map backend.
"""

import functools
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from jonebit.comm import MPIBackend, compressed_allreduce, padded_size  # noqa: E402
from tests.comm.mpi_cases import ALLREDUCE_CASES, allreduce_inputs, mean_inputs  # noqa: E402


def main(outdir: str) -> None:
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    assert jax.device_count() == 1, jax.devices()
    results = {}
    step = jax.jit(functools.partial(compressed_allreduce, mpi_comm=comm))
    for n, steps in ALLREDUCE_CASES:
        x = allreduce_inputs(n, world, steps)[:, rank]
        n_pad = padded_size(n, world)
        we, se = np.zeros(n_pad, np.float32), np.zeros(n_pad // world, np.float32)
        outs = []
        for t in range(steps):
            out, we, se = step(x[t], we, se)
            outs.append(np.asarray(out))
        results[f"ar{n}_out"] = np.stack(outs)
        results[f"ar{n}_we"] = np.asarray(we)
        results[f"ar{n}_se"] = np.asarray(se)

    tree = mean_inputs(world)[rank]
    for mode in ("ordered", "allreduce"):
        backend = MPIBackend(comm, mean=mode)
        got = jax.jit(backend.mean)(tree)
        for k, v in got.items():
            results[f"mean_{mode}_{k}"] = np.asarray(v)
    np.savez(os.path.join(outdir, f"rank{rank}.npz"), **results)


if __name__ == "__main__":
    main(sys.argv[1])
