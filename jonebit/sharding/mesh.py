"""Multi-process start-up and the global data-parallel mesh.

:func:`initialize_distributed` starts ``jax.distributed`` from, in this order of precedence:

1. explicit arguments;
2. ``JONEBIT_COORDINATOR`` / ``JONEBIT_NUM_PROCESSES`` / ``JONEBIT_PROCESS_ID`` (set by ``jonebit launch``);
3. SLURM (``SLURM_PROCID``, ``SLURM_NTASKS``, first host of ``SLURM_STEP_NODELIST`` or ``SLURM_JOB_NODELIST``);
4. an MPI launcher (OpenMPI ``OMPI_COMM_WORLD_RANK/SIZE``, MPICH/Intel ``PMI_RANK/SIZE``); the coordinator comes
   from ``JONEBIT_COORDINATOR`` or, with mpi4py, rank 0 broadcasts its host name and a free port.

Without any of these it is a single process and nothing is initialised. :func:`data_mesh` then builds the mesh
over every device of every process.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import operator
import os
import re
import socket
import sys
import time
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import AxisType, Mesh

ENV_COORDINATOR = "JONEBIT_COORDINATOR"
ENV_NUM_PROCESSES = "JONEBIT_NUM_PROCESSES"
ENV_PROCESS_ID = "JONEBIT_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JONEBIT_LOCAL_DEVICE_IDS"
ENV_COORDINATOR_PORT = "JONEBIT_COORDINATOR_PORT"  # port only (SLURM/MPI: host is derived)
# Set by ``jonebit launch``: a process that starts to exit with no known failure writes ``rank{R}`` there (the time),
# so the launcher can name a rank that left early, waiting in jax's shutdown barrier, when its peers then fail.
ENV_EXIT_DIR = "JONEBIT_LAUNCH_EXIT_DIR"


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins the job; ``source`` says where the values came from."""

    coordinator_address: str | None
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None = None
    source: str = "single"

    @property
    def is_multi_process(self) -> bool:
        return self.num_processes > 1


def expand_nodelist(nodelist: str) -> list[str]:
    """Expands a SLURM host list: ``"n[01-03,07],gpu[1-2]-ib"`` -> ``n01 n02 n03 n07 gpu1-ib gpu2-ib``."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        parts = re.split(r"(\[[^\]]*\])", item)
        choices = []
        for part in parts:
            if part.startswith("["):
                if not part.endswith("]"):
                    raise ValueError(f"malformed SLURM nodelist {nodelist!r}")
                choices.append(_expand_ranges(part[1:-1], nodelist))
            elif part:
                choices.append([part])
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    if not hosts:
        raise ValueError(f"empty SLURM nodelist {nodelist!r}")
    return hosts


def _split_top_level(s: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in s:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise ValueError(f"malformed SLURM nodelist {s!r} (unbalanced brackets)")
    out.append(cur)
    return [x for x in out if x]


def _expand_ranges(spec: str, whole: str) -> list[str]:
    out = []
    for r in spec.split(","):
        lo, _, hi = r.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"malformed range {r!r} in SLURM nodelist {whole!r}")
        width = len(lo)  # zero padding is part of the host name: node[001-010]
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi or lo) + 1))
    return out


def free_port(host: str = "") -> int:
    """A TCP port free right now on this host (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _int_env(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _device_ids(value) -> tuple[int, ...] | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        return tuple(int(v) for v in value.split(","))
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _slurm_port(env: Mapping[str, str]) -> int:
    if ENV_COORDINATOR_PORT in env:
        return _int_env(env, ENV_COORDINATOR_PORT)
    # Same rule as jax's own SLURM detection: every task of a job derives the same port without talking.
    return _int_env(env, "SLURM_JOB_ID") % 4096 + 61440 if "SLURM_JOB_ID" in env else 61440


def _mpi_coordinator(env: Mapping[str, str], rank: int) -> str:
    """Rank 0's host and a free port there, broadcast over MPI (needs mpi4py)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise RuntimeError(
            f"jonebit: launched by mpirun but no coordinator: set {ENV_COORDINATOR}=host:port or install mpi4py "
            "(pip install 'jonebit[mpi]') so rank 0 can broadcast one"
        ) from None
    address = None
    if rank == 0:
        host = env.get("JONEBIT_COORDINATOR_HOST") or socket.gethostname()
        port = _int_env(env, ENV_COORDINATOR_PORT) if ENV_COORDINATOR_PORT in env else free_port()
        address = f"{host}:{port}"
    return MPI.COMM_WORLD.bcast(address, root=0)


def resolve_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: int | Sequence[int] | None = None,
    env: Mapping[str, str] | None = None,
) -> DistributedConfig:
    """Works out how this process joins the job (see the module docstring), without starting anything."""
    env = os.environ if env is None else env
    source = "arguments"
    if num_processes is None and ENV_NUM_PROCESSES in env:
        source = "jonebit"
        num_processes = _int_env(env, ENV_NUM_PROCESSES)
        process_id = _int_env(env, ENV_PROCESS_ID) if process_id is None and ENV_PROCESS_ID in env else process_id
        coordinator_address = coordinator_address or env.get(ENV_COORDINATOR)
    elif num_processes is None and "SLURM_NTASKS" in env and "SLURM_PROCID" in env:
        source = "slurm"
        num_processes = _int_env(env, "SLURM_NTASKS")
        process_id = _int_env(env, "SLURM_PROCID") if process_id is None else process_id
        if coordinator_address is None:
            coordinator_address = env.get(ENV_COORDINATOR)
        if coordinator_address is None and num_processes > 1:
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
            if not nodelist:
                raise ValueError(
                    f"jonebit: SLURM job without SLURM_STEP_NODELIST/SLURM_JOB_NODELIST; set {ENV_COORDINATOR}"
                )
            coordinator_address = f"{expand_nodelist(nodelist)[0]}:{_slurm_port(env)}"
    elif num_processes is None and ("OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env):
        source = "mpi"
        size_var, rank_var = (
            ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")
            if "OMPI_COMM_WORLD_SIZE" in env
            else ("PMI_SIZE", "PMI_RANK")
        )
        num_processes = _int_env(env, size_var)
        process_id = _int_env(env, rank_var) if process_id is None else process_id
        if coordinator_address is None:
            coordinator_address = env.get(ENV_COORDINATOR)
        if coordinator_address is None and num_processes > 1:
            coordinator_address = _mpi_coordinator(env, process_id)
    elif num_processes is None:
        if coordinator_address is not None or process_id is not None:
            raise ValueError("jonebit: coordinator_address/process_id given without num_processes")
        return DistributedConfig(None, 1, 0, _device_ids(local_device_ids), "single")

    if local_device_ids is None:
        local_device_ids = env.get(ENV_LOCAL_DEVICE_IDS)
    num_processes = int(num_processes)
    if num_processes < 1:
        raise ValueError(f"jonebit: num_processes must be >= 1, got {num_processes} (from {source})")
    if process_id is None:
        raise ValueError(f"jonebit: num_processes={num_processes} given but no process_id (from {source})")
    if not 0 <= int(process_id) < num_processes:
        raise ValueError(f"jonebit: process_id={process_id} is outside [0, {num_processes}) (from {source})")
    if num_processes > 1 and not coordinator_address:
        raise ValueError(
            f"jonebit: {num_processes} processes but no coordinator address (from {source}); "
            f"pass coordinator_address='host:port' or set {ENV_COORDINATOR}"
        )
    if coordinator_address and not re.fullmatch(r"\S+:\d+", coordinator_address):
        raise ValueError(f"jonebit: coordinator address must look like 'host:port', got {coordinator_address!r}")
    return DistributedConfig(
        coordinator_address, num_processes, int(process_id), _device_ids(local_device_ids), source
    )


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: int | Sequence[int] | None = None,
    timeout: int = 300,
    heartbeat_timeout: int = 100,
    shutdown_timeout: int = 30,
    fail_fast: bool = True,
    env: Mapping[str, str] | None = None,
) -> DistributedConfig:
    """Starts ``jax.distributed`` for this process (a no-op for a single process); call before using JAX.

    Args:
      coordinator_address: ``"host:port"`` of process 0's coordination service.
      num_processes, process_id: the job's size and this process's index.
      local_device_ids: accelerators this process owns (default: all visible ones).
      timeout: seconds to wait for every process to reach the coordinator before failing.
      heartbeat_timeout: seconds without a heartbeat after which the job is declared dead (and every
        process stops with an error instead of hanging in a collective).
      shutdown_timeout: at exit every process waits at most this long for the others (jax's shutdown
        barrier keeps process 0, which hosts the coordinator, alive until the rest are done).
      fail_fast: after an uncaught exception (exit code 1) or ``sys.exit(nonzero)`` the process skips the
        shutdown barrier, so the launcher and the peers learn of the failure at once instead of after
        ``shutdown_timeout`` (``raise SystemExit(n)`` is not seen; use ``sys.exit``).
      env: environment to read instead of ``os.environ``.

    Returns:
      The :class:`DistributedConfig` used. Calling it again after a successful start returns the same values.
    """
    cfg = resolve_distributed(
        coordinator_address, num_processes, process_id, local_device_ids=local_device_ids, env=env
    )
    if not cfg.is_multi_process:
        return cfg
    if jax.distributed.is_initialized():
        if (jax.process_count(), jax.process_index()) != (cfg.num_processes, cfg.process_id):
            raise RuntimeError(
                f"jonebit: jax.distributed already runs as process {jax.process_index()}/{jax.process_count()}, "
                f"not {cfg.process_id}/{cfg.num_processes}"
            )
        return cfg
    jax.distributed.initialize(
        cfg.coordinator_address,
        cfg.num_processes,
        cfg.process_id,
        local_device_ids=list(cfg.local_device_ids) if cfg.local_device_ids is not None else None,
        initialization_timeout=int(timeout),
        heartbeat_timeout_seconds=int(heartbeat_timeout),
        shutdown_timeout_seconds=int(shutdown_timeout),
    )
    if fail_fast:
        _install_fail_fast_hook(cfg.process_id)
    return cfg


_failure_code: list[int] = []


def _install_fail_fast_hook(process_id: int) -> None:
    """On an uncaught exception or ``sys.exit(nonzero)``, leave at once after Python's own clean-up.

    A failed rank would otherwise sit in jax's shutdown barrier waiting for peers that are themselves stuck
    waiting for it in a collective (until ``shutdown_timeout``); ending it right away lets the launcher (or
    mpirun / srun) see the real failure and its code, and stop the rest. ``finally`` blocks and context
    managers still run: only the barrier is skipped. Successful exits are untouched, except that under
    ``jonebit launch`` they leave a note of when they began (``raise SystemExit(n)`` looks like one: its code is not
    visible before the barrier).
    """
    if getattr(sys.excepthook, "_jonebit_fail_fast", False):
        return
    previous_hook, previous_exit = sys.excepthook, sys.exit

    def excepthook(exc_type, exc, tb):
        _failure_code.append(1)
        previous_hook(exc_type, exc, tb)

    def exit_(code=None):
        if code not in (None, 0):
            _failure_code.append(code if isinstance(code, int) else 1)
        previous_exit(code)

    def leave_now():
        # Registered after jax's atexit shutdown, so it runs first (atexit is last-in, first-out).
        if _failure_code:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(_failure_code[-1])
        exit_dir = os.environ.get(ENV_EXIT_DIR)
        if exit_dir and os.path.isdir(exit_dir):
            tmp = os.path.join(exit_dir, f".rank{process_id}.tmp")
            with open(tmp, "w") as f:
                f.write(repr(time.time()))
            os.replace(tmp, os.path.join(exit_dir, f"rank{process_id}"))  # never read half-written

    excepthook._jonebit_fail_fast = True
    sys.excepthook, sys.exit = excepthook, exit_
    atexit.register(leave_now)


def data_mesh(num_devices: int | None = None, axis: str = "data") -> Mesh:
    """A 1-D mesh, axis ``axis`` with explicit sharding, over every device of every process (or the first
    ``num_devices`` of ``jax.devices()``, which lists all processes' devices in process order)."""
    if not isinstance(axis, str) or not axis:
        raise ValueError(f"data_mesh: axis must be a non-empty string (the mesh axis name), got {axis!r}")
    if num_devices is None:
        return jax.make_mesh((jax.device_count(),), (axis,), axis_types=(AxisType.Explicit,))
    if isinstance(num_devices, bool) or not hasattr(num_devices, "__index__"):
        raise TypeError(f"data_mesh: num_devices must be an int or None, got {num_devices!r}")
    num_devices = operator.index(num_devices)
    if not 1 <= num_devices <= jax.device_count():
        raise ValueError(f"data_mesh: num_devices={num_devices} but there are {jax.device_count()} devices")
    devices = jax.devices()[:num_devices]
    return jax.make_mesh((num_devices,), (axis,), axis_types=(AxisType.Explicit,), devices=devices)


def hierarchical_mesh(hosts: int | None = None, local: int | None = None,
                      axes: tuple[str, str] = ("hosts", "local")) -> Mesh:
    """A 2-D ``hosts x local`` mesh for hierarchical 1-bit compression (``onebit_adam(axis_name=axes)``).

    Row ``h`` holds the devices of host ``h``: by default one row per ``jax.distributed`` process
    (``hosts = jax.process_count()``, ``local = jax.local_device_count()``), each row that process's devices.
    Give ``hosts`` and/or ``local`` to split the devices otherwise (e.g. to emulate hosts in one process): the
    first ``hosts * local`` devices of ``jax.devices()`` (process order) are laid out row by row; a missing one
    of the two is the device count divided by the other.

    Args:
      hosts: number of hosts (the slow axis, crossed only by 1-bit data).
      local: devices per host (the fast axis).
      axes: the two axis names, slow first.

    Example::

      mesh = hierarchical_mesh(local=4)  # 8 devices: 2 "hosts" x 4
      tx = jonebit.onebit_adam(1e-3, freeze_step=100, axis_name=("hosts", "local"))
    """
    if (not isinstance(axes, tuple | list) or len(axes) != 2 or not all(isinstance(a, str) and a for a in axes)
            or axes[0] == axes[1]):
        raise ValueError(f"hierarchical_mesh: axes must be two different axis names (slow, fast), got {axes!r}")
    for name, value in (("hosts", hosts), ("local", local)):
        if value is not None and (isinstance(value, bool) or not hasattr(value, "__index__")
                                  or operator.index(value) < 1):
            raise ValueError(f"hierarchical_mesh: {name} must be a positive int or None, got {value!r}")
    total = jax.device_count()
    if hosts is None and local is None:
        hosts, local = jax.process_count(), jax.local_device_count()
    elif hosts is None:
        hosts = total // operator.index(local)
    elif local is None:
        local = total // operator.index(hosts)
    hosts, local = operator.index(hosts), operator.index(local)
    if hosts < 1 or local < 1 or hosts * local > total:
        raise ValueError(
            f"hierarchical_mesh: hosts={hosts} x local={local} needs {hosts * local} devices, there are {total}; "
            "choose hosts * local <= the device count"
        )
    # Process order first, so that with one row per process each row is one host's devices.
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))[:hosts * local]
    return jax.make_mesh((hosts, local), tuple(axes), axis_types=(AxisType.Explicit,) * 2, devices=devices)


def check_batch(tree, mesh: Mesh, spec, *, where: str, name: str = "batch") -> None:
    """Raises a ``ValueError`` naming the leaf unless every leaf of ``tree`` can be laid out by ``spec``.

    Each leaf needs at least as many dimensions as ``spec`` has entries, and every dimension that ``spec``
    splits over mesh axes must be divisible by their total size. Works on arrays and tracers (shapes are
    static), so a jitted step can call it while tracing.

    Args:
      tree: the batch (pytree of arrays).
      mesh: the mesh the batch is split over.
      spec: its ``PartitionSpec`` (e.g. ``P("data")``: leading dimension over the data axis).
      where: the function the batch was given to, for the message.
      name: the argument's name, for the message.
    """
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        shape = tuple(getattr(x, "shape", ()))
        leaf = f"{name}{jax.tree_util.keystr(path)}"
        if len(shape) < len(spec):
            raise ValueError(
                f"{where}: {leaf} has shape {shape} but the batch layout {spec} splits {len(spec)} dimension(s); "
                "give every batch leaf a leading batch dimension (a scalar cannot be split over devices)"
            )
        for d, entry in enumerate(spec):
            axes = () if entry is None else tuple(entry) if isinstance(entry, tuple | list) else (entry,)
            if not axes:
                continue
            size = 1
            for a in axes:
                size *= mesh.shape[a]
            if shape[d] % size:
                raise ValueError(
                    f"{where}: {leaf} has shape {shape}; its dimension {d} ({shape[d]}) must be divisible by the "
                    f"{size} devices of mesh axis {'/'.join(map(repr, axes))}. Use a global batch size that is a "
                    f"multiple of {size} (drop or pad the last partial batch)"
                )
