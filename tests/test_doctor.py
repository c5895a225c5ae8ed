"""``jonebit doctor`` in a subprocess, checked against facts this test obtains on its own."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jax
import jaxlib
import pytest

from jonebit.cli import main
from tests.mpi_util import ROOT, mpirun_path, worker_env

PY = sys.executable


def doctor(*args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "jonebit", "doctor", *args], cwd=ROOT, env=worker_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def by_name(report: dict) -> dict:
    return {c["name"]: c for c in report["checks"]}


def imports_in_child(module: str) -> bool:
    """Whether ``module`` imports in a fresh interpreter (MPI_Init stays out of the pytest process)."""
    return subprocess.run([PY, "-c", f"import {module}"], env=worker_env(), capture_output=True,
                          timeout=300).returncode == 0


@pytest.mark.slow
def test_json_report_matches_the_environment():
    proc = doctor("--json", JAX_NUM_CPU_DEVICES="3")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    checks = by_name(report)
    assert report["core_ok"] is True
    assert checks["jax"]["data"] == {"version": jax.__version__, "jaxlib": jaxlib.__version__}
    devices = checks["devices"]["data"]
    assert (devices["count"], devices["platform"], devices["backends"]) == (3, "cpu", {"cpu": 3})
    assert checks["python"]["data"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert checks["python"]["data"]["executable"] == PY

    has_mpi4jax = imports_in_child("mpi4jax")
    assert checks["mpi4jax"]["ok"] is has_mpi4jax
    if has_mpi4jax:
        cuda = subprocess.run([PY, "-c", "import mpi4jax; print(mpi4jax.has_cuda_support())"], env=worker_env(),
                              capture_output=True, text=True, timeout=300).stdout.strip()
        assert str(checks["mpi4jax"]["data"]["has_cuda_support"]) == cuda
    assert checks["mpirun"]["ok"] is (mpirun_path() is not None)
    assert checks["gloo (CPU multi-process)"]["data"]["implementation"] == jax.config.jax_cpu_collectives_implementation
    assert checks["tokenizers (BERT)"]["ok"] is imports_in_child("tokenizers")
    # Every piece that is not there comes with the command that installs it, for this interpreter.
    for c in report["checks"]:
        if not c["ok"] and c["name"] != "gpu backend":
            assert c["fix"] and PY in c["fix"], c


@pytest.mark.slow
def test_broken_optional_piece_gets_a_fix_and_core_still_passes(tmp_path):
    # A module named mpi4jax that fails to import shadows the real one, in the doctor and its MPI probe alike.
    (tmp_path / "mpi4jax.py").write_text("raise ImportError('simulated: mpi4jax was built against another MPI')\n")
    proc = doctor("--json", PYTHONPATH=f"{tmp_path}:{ROOT}")
    assert proc.returncode == 0, proc.stderr
    checks = by_name(json.loads(proc.stdout))
    assert checks["mpi4jax"]["ok"] is False
    assert "simulated: mpi4jax was built against another MPI" in checks["mpi4jax"]["detail"]
    assert "pip install" in checks["mpi4jax"]["fix"] and "'mpi4jax>=0.7'" in checks["mpi4jax"]["fix"]
    # mpi4jax builds against the first mpicc on PATH: the fix puts this interpreter's bin directory first.
    assert checks["mpi4jax"]["fix"].startswith(f'PATH="{pathlib.Path(PY).parent}:')


@pytest.mark.slow
def test_broken_core_exits_1_and_says_why():
    proc = doctor(JAX_PLATFORMS="no_such_platform")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL devices" in proc.stdout
    assert "no_such_platform" in proc.stdout
    assert "core: BROKEN" in proc.stdout


@pytest.mark.slow
def test_text_report_lists_core_checks_and_verdict():
    proc = doctor("--mpi-timeout", "60")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for name in ("python", "jax", "devices", "optax", "flax", "orbax-checkpoint", "jonebit"):
        assert any(ln.startswith("ok") and ln.split()[1] == name for ln in lines), (name, proc.stdout)
    assert "core: OK" in lines


def test_bad_timeout_is_refused():
    with pytest.raises(SystemExit, match=r"--mpi-timeout must be > 0 seconds, got -1"):
        main(["doctor", "--mpi-timeout", "-1"])


def test_cpu_devices_line_says_how_to_simulate_more():
    """The note's two settings do what it says: a fresh interpreter given either sees N CPU devices."""
    from jonebit.doctor import check_devices, format_report

    check = check_devices()
    assert check.data["platform"] == "cpu"
    report = format_report([check])
    assert ("note: to simulate N CPU devices (data parallelism on one machine), set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N or JAX_NUM_CPU_DEVICES=N") in report
    count = "import jax; print(jax.device_count())"
    env = worker_env(XLA_FLAGS="--xla_force_host_platform_device_count=3", JAX_PLATFORMS="cpu")
    env.pop("JAX_NUM_CPU_DEVICES", None)
    assert subprocess.run([PY, "-c", count], env=env, capture_output=True, text=True,
                          timeout=300).stdout.strip() == "3"
    env = worker_env(JAX_NUM_CPU_DEVICES="5", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    assert subprocess.run([PY, "-c", count], env=env, capture_output=True, text=True,
                          timeout=300).stdout.strip() == "5"
