"""Compressed 1-bit allreduce vs plain fp32 allreduce over MPI (mpi4jax inside jit), one device per rank.

    mpirun -np 2 python benchmarks/mpi_allreduce.py [--sizes 1e6,1e7,3.2e7,1e8] [--reps 5]

For each size N: the median time of one jitted call (after a compile/warm-up call) of
(a) ``mpi4jax.allreduce`` of N float32 then ``/ P`` (MPI_Allreduce, the library's algorithm),
(b) ``MPIBackend.mean`` ("ordered": all-to-all + rank-order sum + all-gather, the bitwise-reproducible mean),
(c) ``compressed_allreduce`` (1-bit signs + scales, error feedback).
Algorithmic bandwidth = 4 N bytes / time. Rank 0 prints a table and writes ``results/mpi_allreduce/mpi_allreduce.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from jonebit.comm import MPIBackend, compressed_allreduce, compressed_bytes_per_rank, padded_size  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "mpi_allreduce"


def timed(fn, args, reps, comm):
    """Median seconds of ``fn(*args)`` over ``reps`` calls, each started together on all ranks."""
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        dt = time.perf_counter() - t0
        times.append(comm.allreduce(dt, op=MPI.MAX))  # a collective ends when its slowest rank does
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1e6,1e7,3.2e7,1e8", help="comma-separated float counts")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "mpi_allreduce.json"))
    args = ap.parse_args()

    import mpi4jax

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    ordered = MPIBackend(comm, mean="ordered")
    plain = jax.jit(lambda x: mpi4jax.allreduce(x, op=MPI.SUM, comm=comm) / world)
    ordered_mean = jax.jit(ordered.mean)
    compressed = jax.jit(lambda x, we, se: compressed_allreduce(x, we, se, mpi_comm=comm))

    rows = []
    for n in (int(float(s)) for s in args.sizes.split(",")):
        x = jax.random.normal(jax.random.key(rank), (n,), jnp.float32)
        n_pad = padded_size(n, world)
        we, se = jnp.zeros(n_pad, jnp.float32), jnp.zeros(n_pad // world, jnp.float32)
        reps = args.reps if n <= 32_000_000 else max(2, args.reps // 2)
        t_plain = timed(plain, (x,), reps, comm)
        t_ordered = timed(ordered_mean, (x,), reps, comm)
        t_comp = timed(compressed, (x, we, se), reps, comm)
        row = {
            "n": n,
            "fp32_mbytes": 4 * n / 1e6,
            "allreduce_s": t_plain,
            "ordered_mean_s": t_ordered,
            "compressed_s": t_comp,
            "allreduce_algbw_gbs": 4 * n / t_plain / 1e9,
            "ordered_mean_algbw_gbs": 4 * n / t_ordered / 1e9,
            "compressed_algbw_gbs": 4 * n / t_comp / 1e9,
            "speedup_compressed_vs_allreduce": t_plain / t_comp,
            "bytes_sent_per_rank_fp32_ring": int(2 * (world - 1) * 4 * n // world),
            "bytes_sent_per_rank_compressed": compressed_bytes_per_rank(n, world),
        }
        rows.append(row)
        if rank == 0:
            print(
                f"N={n:>11,d}  allreduce {t_plain * 1e3:9.2f} ms ({row['allreduce_algbw_gbs']:6.2f} GB/s)  "
                f"ordered mean {t_ordered * 1e3:9.2f} ms ({row['ordered_mean_algbw_gbs']:6.2f} GB/s)  "
                f"compressed {t_comp * 1e3:9.2f} ms ({row['compressed_algbw_gbs']:6.2f} GB/s)  "
                f"x{row['speedup_compressed_vs_allreduce']:.2f}",
                flush=True,
            )
        del x, we, se

    if rank == 0:
        meta = {
            "ranks": world,
            "devices_per_rank": jax.local_device_count(),
            "platform": jax.devices()[0].platform,
            "host": platform.node(),
            "cpu_count": os.cpu_count(),
            "mpi": MPI.Get_library_version().splitlines()[0],
            "mpi4jax": mpi4jax.__version__,
            "jax": jax.__version__,
            "reps": args.reps,
            "note": "time = median over reps of the slowest rank; algorithmic bandwidth = 4 N bytes / time",
        }
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        existing = json.loads(out.read_text()) if out.exists() else {}
        from benchmarks.report import run_meta

        existing["meta"] = run_meta()  # the latest invocation; each world size keeps its own below
        existing[f"np{world}"] = {"meta": {**meta, **existing["meta"]}, "rows": rows}
        out.write_text(json.dumps(existing, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
