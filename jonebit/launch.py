"""``jonebit launch``: start N cooperating JAX processes on this host (like ``torchrun`` / ``deepspeed``).

Each process gets ``JONEBIT_COORDINATOR`` (``127.0.0.1:<free port>`` unless given), ``JONEBIT_NUM_PROCESSES``,
``JONEBIT_PROCESS_ID`` and ``JONEBIT_LOCAL_RANK``; the program joins the job with
:func:`jonebit.sharding.mesh.initialize_distributed`. Output lines are prefixed with ``[rank R]``. When one
process fails the others are stopped (SIGTERM, then SIGKILL after a grace period) and the launcher exits with
that process's code, naming the rank. SIGINT/SIGTERM sent to the launcher are forwarded to every process.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from jonebit.sharding.mesh import (
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    free_port,
)

ENV_LOCAL_RANK = "JONEBIT_LOCAL_RANK"


def _pump(stream, sink: TextIO, prefix: str, lock: threading.Lock) -> None:
    """Copies lines from a child's pipe to ``sink`` with ``prefix``; one lock so lines never interleave."""
    for line in iter(stream.readline, ""):
        with lock:
            sink.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            sink.flush()
    stream.close()


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the child and whatever it started
    except (ProcessLookupError, PermissionError):
        pass


def launch(
    command: Sequence[str],
    nproc: int,
    *,
    devices_per_proc: int | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    coordinator: str | None = None,
    env: Mapping[str, str] | None = None,
    grace_period: float = 5.0,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Runs ``command`` as ``nproc`` processes on this host and returns the job's exit code.

    Args:
      command: program and arguments, e.g. ``["python", "train.py"]``.
      nproc: processes on this host.
      devices_per_proc: CPU devices per process (sets ``JAX_NUM_CPU_DEVICES``); ignored by GPU/TPU backends.
      nnodes, node_rank: for a job spanning several hosts: run ``jonebit launch`` once per host with the same
        ``coordinator`` (process 0's host); ranks are ``node_rank * nproc + local_rank``.
      coordinator: ``host:port``; default: a free port on 127.0.0.1 (single host only).
      env: base environment (default ``os.environ``).
      grace_period: seconds between SIGTERM and SIGKILL when stopping processes.

    Returns:
      0 if every process succeeded; otherwise the first failing process's exit code (128 + signal number for a
      process killed by a signal).
    """
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    if not command:
        raise ValueError("jonebit launch: no command given (usage: jonebit launch --nproc N -- python train.py)")
    if nproc < 1:
        raise ValueError(f"jonebit launch: --nproc must be >= 1, got {nproc}")
    if devices_per_proc is not None and devices_per_proc < 1:
        raise ValueError(f"jonebit launch: --devices-per-proc must be >= 1, got {devices_per_proc}")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(f"jonebit launch: need nnodes >= 1 and 0 <= node_rank < nnodes, got {nnodes}, {node_rank}")
    if nnodes > 1 and not coordinator:
        raise ValueError("jonebit launch: --nnodes > 1 needs --coordinator host:port (process 0's host)")
    coordinator = coordinator or f"127.0.0.1:{free_port('127.0.0.1')}"
    world = nnodes * nproc
    base = dict(os.environ if env is None else env)
    base["PYTHONUNBUFFERED"] = "1"  # ranks' lines should appear as they are printed, not at exit
    if devices_per_proc is not None:
        base["JAX_NUM_CPU_DEVICES"] = str(devices_per_proc)

    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)
        for p in procs:
            if p.poll() is None:
                _signal_group(p, signum)

    old_handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old_handlers[sig] = signal.signal(sig, forward)
    try:
        for local in range(nproc):
            rank = node_rank * nproc + local
            child_env = dict(base)
            child_env.update(
                {
                    ENV_COORDINATOR: coordinator,
                    ENV_NUM_PROCESSES: str(world),
                    ENV_PROCESS_ID: str(rank),
                    ENV_LOCAL_RANK: str(local),
                }
            )
            p = subprocess.Popen(
                list(command),
                env=child_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                errors="replace",
                bufsize=1,
                start_new_session=True,  # own process group: we decide who gets which signal
            )
            procs.append(p)
            for stream, sink in ((p.stdout, stdout), (p.stderr, stderr)):
                t = threading.Thread(target=_pump, args=(stream, sink, f"[rank {rank}] ", lock), daemon=True)
                t.start()
                pumps.append(t)
        return _supervise(procs, node_rank * nproc, grace_period, received, stderr, lock)
    finally:
        for p in procs:
            if p.poll() is None:
                _signal_group(p, signal.SIGKILL)
                p.wait()
        for t in pumps:
            t.join(timeout=2)
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)


def _supervise(procs, first_rank, grace_period, received, stderr, lock) -> int:
    """Waits for all processes; on the first failure stops the rest and returns that failure's code."""

    def say(msg):
        with lock:
            stderr.write(f"jonebit launch: {msg}\n")
            stderr.flush()

    signalled_at = None
    while True:
        codes = [p.poll() for p in procs]
        if received:
            # Forwarded SIGINT/SIGTERM: give the processes the grace period to finish, then kill them.
            # (jax installs a SIGTERM handler for preemption notices, so SIGTERM alone may not end a rank.)
            signalled_at = signalled_at or time.monotonic()
            name = signal.Signals(received[0]).name
            if all(c is not None for c in codes):
                say(f"stopped by {name}")
                return 128 + received[0]
            if time.monotonic() - signalled_at > grace_period or len(received) > 1:
                say(f"stopped by {name}; killing ranks still running after {grace_period:g}s")
                _stop(procs, 0.0)
                return 128 + received[0]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed and not received:
            # Several may have failed by now; report the earliest rank among them (the others are fallout).
            i, code = failed[0]
            others = [first_rank + j for j, c in enumerate(codes) if c is None]
            say(f"rank {first_rank + i} {_describe(code)}" + (f"; stopping ranks {others}" if others else ""))
            _stop(procs, grace_period)
            return code if code > 0 else 128 + (-code)
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.05)


def _stop(procs, grace_period) -> None:
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_period
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def add_parser(subparsers) -> None:
    """Registers ``jonebit launch`` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "launch",
        help="run a program as N cooperating JAX processes on this host",
        description=__doc__.split("\n\n")[0],
        epilog="example: jonebit launch --nproc 2 --devices-per-proc 2 -- python train.py --steps 10",
    )
    p.add_argument("--nproc", "--nproc-per-node", type=int, required=True, help="processes on this host")
    p.add_argument("--devices-per-proc", type=int, default=None, help="CPU devices per process (JAX_NUM_CPU_DEVICES)")
    p.add_argument("--nnodes", type=int, default=1, help="hosts in the job (run the launcher once per host)")
    p.add_argument("--node-rank", type=int, default=0, help="this host's index in [0, nnodes)")
    p.add_argument("--coordinator", default=None, help="host:port of process 0 (default: free port on 127.0.0.1)")
    p.add_argument("--grace-period", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- program [args...]")
    p.set_defaults(func=_run)


def _run(args) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        return launch(
            command,
            args.nproc,
            devices_per_proc=args.devices_per_proc,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            coordinator=args.coordinator,
            grace_period=args.grace_period,
        )
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"jonebit launch: cannot start {command[0]!r}: {e.strerror}", file=sys.stderr)
        return 127
