"""Process program for tests/sharding/test_mesh.py and tests/test_launch.py.

``python dist_worker.py MODE [OUTDIR]``; every mode first calls ``initialize_distributed()`` from the
environment (jonebit launcher, mpirun or explicit JONEBIT_* variables).
"""

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jonebit.sharding.mesh import data_mesh, initialize_distributed  # noqa: E402


def psum_check(outdir: str | None) -> None:
    """Each device contributes (global index + 1); every shard must see the same total."""
    mesh = data_mesh()
    n = jax.device_count()
    me = jax.process_index()
    local = np.array([i + 1 for i, d in enumerate(mesh.devices.flat) if d.process_index == me], np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local)
    total = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "data"), mesh=mesh, in_specs=P("data"), out_specs=P()))(x)
    got = float(np.asarray(jax.device_get(total.addressable_shards[0].data))[0])
    expect = n * (n + 1) / 2
    print(f"process {jax.process_index()}/{jax.process_count()} devices {jax.local_device_count()}/{n} "
          f"psum {got} expect {expect}", flush=True)
    assert got == expect, (got, expect)
    if outdir:
        with open(os.path.join(outdir, f"ok{jax.process_index()}"), "w") as f:
            f.write(f"{jax.process_count()} {n} {got}")


def main() -> None:
    mode = sys.argv[1]
    outdir = sys.argv[2] if len(sys.argv) > 2 else None
    timeout = int(os.environ.get("TEST_INIT_TIMEOUT", "60"))
    if mode == "exit-before-init" and int(os.environ.get("JONEBIT_PROCESS_ID", "0")) == 1:
        sys.exit(3)
    cfg = initialize_distributed(timeout=timeout, heartbeat_timeout=int(os.environ.get("TEST_HEARTBEAT", "10")))
    print(f"initialized from {cfg.source}: {cfg}", flush=True)
    if mode == "psum":
        psum_check(outdir)
    elif mode == "exit-before-init":
        psum_check(outdir)
    elif mode == "exit-before-collective":
        if jax.process_index() == 1:
            sys.exit(3)
        time.sleep(1)
        psum_check(outdir)
    elif mode == "raise-before-collective":
        if jax.process_index() == 1:
            raise RuntimeError("rank 1 fails on purpose")
        time.sleep(1)
        psum_check(outdir)
    elif mode == "sleep":
        time.sleep(600)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
