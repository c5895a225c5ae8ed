"""The same training, three launch modes: 1 process x 4 devices, 2 x 2 (jonebit launch, jax.distributed over
gloo), 4 MPI ranks x 1 device (mpirun, mpi4jax). Final parameters after 8 steps (3 warmup + 5 compressed)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.mpi_util import ROOT, run_mpi, worker_env
from tests.train_modes_worker import run_spmd

WORKER = ROOT / "tests" / "train_modes_worker.py"


@pytest.fixture(scope="module")
def reference():
    """1 process x 4 devices, in this process (conftest gives it 8 CPU devices; the mesh takes the first 4)."""
    return {opt: run_spmd(opt) for opt in ("adam", "onebit")}


def _load(path):
    return dict(np.load(path))


@pytest.mark.multiprocess
@pytest.mark.parametrize("opt", ["adam", "onebit"])
def test_two_processes_two_devices_match(reference, opt, tmp_path):
    cmd = [sys.executable, "-m", "jonebit", "launch", "--nproc", "2", "--devices-per-proc", "2", "--",
           sys.executable, str(WORKER), "spmd", opt, str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = _load(tmp_path / f"spmd_{opt}.npz")
    # gloo sums a cross-process psum in its own order (not XLA's rank order): last-bit differences in the
    # gradient mean, which Adam's normalisation and 1-bit compression carry forward but do not grow here.
    for k, want in reference[opt].items():
        np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-5, err_msg=k)


@pytest.mark.mpi
@pytest.mark.multiprocess
@pytest.mark.parametrize("opt", ["adam", "onebit"])
def test_four_mpi_ranks_match(reference, opt, tmp_path):
    run_mpi(4, WORKER, "mpi", opt, tmp_path, timeout=240, env=worker_env(JAX_NUM_CPU_DEVICES="1"))
    got = _load(tmp_path / f"mpi_{opt}.npz")
    for k, want in reference[opt].items():
        if opt == "onebit":
            # Same local gradients, the ordered mean sums in XLA's rank order, and the compressed allreduce
            # moves bits only: bitwise.
            np.testing.assert_array_equal(got[k], want, err_msg=k)
        else:
            # optax.adam outside shard_map is fused differently by XLA than inside it: last-bit differences.
            np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-6, err_msg=k)
