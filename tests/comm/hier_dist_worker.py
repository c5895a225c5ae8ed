"""Process program for tests/comm/test_hierarchical.py: the hierarchical allreduce across jax.distributed processes.

``python hier_dist_worker.py OUTDIR``: joins the job from the JONEBIT_* environment, builds the default
``hierarchical_mesh()`` (one row per process), runs 3 calls of the hierarchical compressed allreduce on inputs every
process generates alike (seed 0, one row per device), and saves what this process's devices hold.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jonebit.comm.hierarchical import error_sizes, hierarchical_compressed_allreduce  # noqa: E402
from jonebit.sharding.mesh import hierarchical_mesh, initialize_distributed  # noqa: E402

N, CALLS = 301, 3
AXES = ("hosts", "local")


def main() -> None:
    outdir = sys.argv[1]
    initialize_distributed(timeout=60, heartbeat_timeout=10)
    mesh = hierarchical_mesh()
    hosts, local = mesh.shape["hosts"], mesh.shape["local"]
    me = jax.process_index()
    rows_of_me = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == me]
    spec = NamedSharding(mesh, P(AXES))

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=P(AXES), out_specs=P(AXES))
    def call(x, we, se):
        out, we, se = hierarchical_compressed_allreduce(x[0], we[0], se[0], axis_name=AXES)
        return out[None], we[None], se[None]

    def put(rows):  # this process's rows of a (H * L, ...) global array
        return jax.make_array_from_process_local_data(spec, rows[rows_of_me])

    rng = np.random.default_rng(0)
    w_len, s_len = error_sizes(N, hosts, local)
    we = put(np.zeros((hosts * local, w_len), np.float32))
    se = put(np.zeros((hosts * local, s_len), np.float32))
    outs = []
    for _ in range(CALLS):
        scales = np.float32(1 + np.arange(hosts * local))[:, None]  # a different scale per device
        x = rng.standard_normal((hosts * local, N)).astype(np.float32) * scales
        out, we, se = call(put(x), we, se)
        outs.append(np.stack([np.asarray(s.data)[0] for s in out.addressable_shards]))
    np.savez(os.path.join(outdir, f"proc{me}.npz"), outs=np.stack(outs), rows=np.array(rows_of_me),
             shape=np.array([hosts, local]))
    print(f"process {me}: mesh {hosts}x{local} rows {rows_of_me} done", flush=True)


if __name__ == "__main__":
    main()
