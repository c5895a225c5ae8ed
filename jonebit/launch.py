"""``jonebit launch``: start N cooperating JAX processes on this host (like ``torchrun`` / ``deepspeed``).

Each process gets ``JONEBIT_COORDINATOR`` (``127.0.0.1:<free port>`` unless given), ``JONEBIT_NUM_PROCESSES``,
``JONEBIT_PROCESS_ID`` and ``JONEBIT_LOCAL_RANK``; the program joins the job with
:func:`jonebit.sharding.mesh.initialize_distributed`. Output lines are prefixed with ``[rank R]``.

Failures: the first process to exit non-zero is named at once with its exit code (or the signal that killed
it), e.g. ``rank 1 exited with code 4``; the others are stopped (SIGTERM, then SIGKILL after
``--grace-period``) and the launcher exits with that process's code (128 + N for signal N). A process counts as
failed once it has exited: under ``jax.distributed`` leave with ``sys.exit(n)`` or an exception, which
``initialize_distributed`` turns into an immediate exit, not ``raise SystemExit(n)``, which waits in jax's
shutdown barrier (``shutdown_timeout``, 30 s) until the peers abort. Such a rank leaves a note when it starts
to exit (``JONEBIT_LAUNCH_EXIT_DIR``), so when a peer then fails (or it fails itself, in that barrier) the launcher
names it as the root cause; a peer that fails on a timeout while another rank has long been silent names that
rank. The log ends with the root cause: the other ranks' state, the first failing rank's own last stderr lines,
and one ``root cause:`` line.

Lifetime: every process runs in its own process group; SIGINT (Ctrl-C), SIGTERM and SIGHUP sent to the launcher
are forwarded to every group, so a process's own children get them too (a second signal kills at once). On Linux
each process also gets a parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``), so it dies with the
launcher even when the launcher itself is killed with SIGKILL and cannot forward anything (that covers the
processes the launcher started, not children they start themselves, which only get the forwarded signals).

Hangs: ``--timeout SECONDS`` bounds the whole job; ``--no-progress-timeout SECONDS`` stops it when no process has
printed a line (stdout or stderr) for that long, counting from the launch: let at least one rank print
regularly (e.g. a loss per step) and leave room for silent startup (imports, ``jax.distributed``, compilation).
Either way the launcher lists the processes still running with the last line each printed and how long ago,
stops them like a failure, and exits with code 124.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from jonebit.sharding.mesh import (
    ENV_COORDINATOR,
    ENV_EXIT_DIR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    free_port,
)

ENV_LOCAL_RANK = "JONEBIT_LOCAL_RANK"
TIMEOUT_EXIT_CODE = 124  # as coreutils ``timeout``: the job was stopped for running too long / going silent
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_POLL_SECONDS = 0.05
ROOT_CAUSE_LINES = 12  # stderr lines of the first failing rank repeated at the end


@dataclasses.dataclass
class _Rank:
    """One launched process and what the launcher last heard from it."""

    rank: int
    proc: subprocess.Popen
    # Its last stderr lines, for the root-cause report when it is the first to fail.
    err_tail: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=ROOT_CAUSE_LINES))
    # (time.monotonic(), line) of its last lines on either stream: what it was doing when it went quiet or another
    # rank failed.
    history: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=256))


def _pump(stream, sink: TextIO, who: _Rank, lock: threading.Lock, activity: list[float], tail=None) -> None:
    """Copies lines from a child's pipe to ``sink`` with a ``[rank R]`` prefix; one lock so lines never
    interleave. Records each line and its time for the hang reports (and in ``tail``, the stderr ones)."""
    prefix = f"[rank {who.rank}] "
    for line in iter(stream.readline, ""):
        with lock:
            try:
                sink.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
                sink.flush()
            except (OSError, ValueError):
                pass  # our own output is gone (say, piped into ``head``): keep draining so the rank never blocks
            now = time.monotonic()
            who.history.append((now, line.rstrip("\n")))
            activity[0] = now
            if tail is not None:
                tail.append(line.rstrip("\n"))
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
        os.killpg(proc.pid, sig)  # the child and whatever it started in its group
    except (ProcessLookupError, PermissionError):
        pass


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` giving the child SIGKILL when the launcher dies (Linux; None elsewhere).

    Runs in the forked child before ``exec``; the setting survives ``exec``. If the launcher already died
    between ``fork`` and ``prctl`` the signal would never come, hence the ``getppid`` check. The signal fires
    when the *thread* that started the child ends: :func:`launch` waits for its children in that same thread.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the child
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def _check_args(command, nproc, devices_per_proc, nnodes, node_rank, coordinator, grace_period, timeout,
                no_progress_timeout) -> None:
    """Raises ValueError naming the bad argument, what it must be and what was given."""
    if not command:
        raise ValueError("jonebit launch: no command given (usage: jonebit launch --nproc N -- python train.py)")
    if nproc < 1:
        raise ValueError(f"jonebit launch: --nproc must be >= 1, got {nproc}")
    if devices_per_proc is not None and devices_per_proc < 1:
        raise ValueError(f"jonebit launch: --devices-per-proc must be >= 1, got {devices_per_proc}")
    if nnodes < 1:
        raise ValueError(f"jonebit launch: --nnodes must be >= 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"jonebit launch: --node-rank must be in [0, --nnodes={nnodes}), got {node_rank}")
    if nnodes > 1 and not coordinator:
        raise ValueError("jonebit launch: --nnodes > 1 needs --coordinator host:port (process 0's host)")
    if coordinator is not None:
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"jonebit launch: --coordinator must be host:port with a port in 1..65535, "
                             f"got {coordinator!r}")
    if not grace_period >= 0:
        raise ValueError(f"jonebit launch: --grace-period must be >= 0 seconds, got {grace_period}")
    for flag, value in (("--timeout", timeout), ("--no-progress-timeout", no_progress_timeout)):
        if value is not None and not value > 0:
            raise ValueError(f"jonebit launch: {flag} must be > 0 seconds (leave it out for no limit), got {value}")


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
    timeout: float | None = None,
    no_progress_timeout: float | None = None,
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
      timeout: seconds the whole job may run (None: no limit).
      no_progress_timeout: seconds the job may go without any process printing a line (None: no limit).
      stdout, stderr: where the processes' prefixed lines and the launcher's messages go (default: sys's).

    Returns:
      0 if every process succeeded; otherwise the first failing process's exit code (128 + signal number for a
      process killed by a signal), 124 after ``timeout`` / ``no_progress_timeout``, 128 + N after the
      launcher received signal N.
    """
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    _check_args(command, nproc, devices_per_proc, nnodes, node_rank, coordinator, grace_period, timeout,
                no_progress_timeout)
    coordinator = coordinator or f"127.0.0.1:{free_port('127.0.0.1')}"
    world = nnodes * nproc
    base = dict(os.environ if env is None else env)
    base["PYTHONUNBUFFERED"] = "1"  # ranks' lines should appear as they are printed, not at exit
    exit_dir = tempfile.mkdtemp(prefix="jonebit-launch-exits-")
    base[ENV_EXIT_DIR] = exit_dir
    if devices_per_proc is not None:
        base["JAX_NUM_CPU_DEVICES"] = str(devices_per_proc)

    lock = threading.Lock()
    ranks: list[_Rank] = []
    pumps: list[threading.Thread] = []
    received: list[int] = []
    start = time.monotonic()
    activity = [start]  # when any rank last printed a line
    first_failure: list[_Failure] = []

    def forward(signum, _frame):
        received.append(signum)
        for r in ranks:
            if r.proc.poll() is None:
                _signal_group(r.proc, signal.SIGKILL if len(received) > 1 else signum)

    old_handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in FORWARDED_SIGNALS:
            old_handlers[sig] = signal.signal(sig, forward)
    preexec = _die_with_parent()
    try:
        # Every process is started before any pump thread: forking with preexec_fn is safest single-threaded.
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
                start_new_session=True,  # own process group: signals reach the rank and its children
                preexec_fn=preexec,
            )
            ranks.append(_Rank(rank, p))
        for r in ranks:
            for stream, sink, tail in ((r.proc.stdout, stdout, None), (r.proc.stderr, stderr, r.err_tail)):
                t = threading.Thread(target=_pump, args=(stream, sink, r, lock, activity, tail), daemon=True)
                t.start()
                pumps.append(t)
        limits = _Limits(start, timeout, no_progress_timeout, activity)
        return _supervise(ranks, grace_period, received, limits, _Say(stderr, lock), first_failure, exit_dir)
    finally:
        for r in ranks:
            if r.proc.poll() is None:
                _signal_group(r.proc, signal.SIGKILL)
                r.proc.wait()
        for t in pumps:
            t.join(timeout=2)
        if first_failure:  # last, after every rank's output: what a reader sees first at the end of the log
            _root_cause(first_failure[0], _Say(stderr, lock))
        shutil.rmtree(exit_dir, ignore_errors=True)
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)


@dataclasses.dataclass
class _Say:
    """Writes ``jonebit launch: ...`` lines to the launcher's stderr, between the ranks' lines."""

    sink: TextIO
    lock: threading.Lock

    def __call__(self, *lines: str) -> None:
        with self.lock:
            for line in lines:
                self.sink.write(f"jonebit launch: {line}\n")
            self.sink.flush()


@dataclasses.dataclass
class _Limits:
    start: float
    timeout: float | None
    no_progress_timeout: float | None
    activity: list[float]

    def expired(self, now: float) -> str | None:
        """Why the job must stop now (a message), or None."""
        if self.timeout is not None and now - self.start > self.timeout:
            return f"job timed out after {self.timeout:g}s (--timeout)"
        if self.no_progress_timeout is not None and now - self.activity[0] > self.no_progress_timeout:
            return f"no rank printed a line for {self.no_progress_timeout:g}s (--no-progress-timeout)"
        return None


def _running_report(ranks: Sequence[_Rank], now: float) -> list[str]:
    """One line per rank still running: its last output line and how long ago it came."""
    lines = []
    for r in ranks:
        if r.proc.poll() is not None:
            continue
        if not r.history:
            lines.append(f"  rank {r.rank} (pid {r.proc.pid}): no output yet")
        else:
            at, line = r.history[-1]
            lines.append(f"  rank {r.rank} (pid {r.proc.pid}): last line {now - at:.1f}s ago: {line[:200]!r}")
    return lines


@dataclasses.dataclass
class _Failure:
    rank: _Rank
    code: int
    suspect: str | None  # a rank whose earlier behaviour likely caused this failure, in words
    others: list[str]  # each other rank's state when the failure was seen


# Errors of a rank that timed out waiting for its peers (jax's coordination service, Gloo, NCCL).
_TIMEOUT_WORDS = ("DEADLINE_EXCEEDED", "timed out", "Timeout", "heartbeat")
_SECONDARY_WINDOW = 1.0  # s: lines printed this close to the failure are likely its consequences, not the cause
_SILENT_SUSPECT = 10.0  # s: a peer silent this long before a timeout is named as the one that may have hung


def _read_exit_notes(exit_dir: str | None) -> dict[int, float]:
    """``rank -> time.monotonic()`` when that rank began a normal-looking exit (see ``ENV_EXIT_DIR``)."""
    notes = {}
    if not exit_dir or not os.path.isdir(exit_dir):
        return notes
    offset = time.time() - time.monotonic()
    for name in os.listdir(exit_dir):
        if name.startswith("rank") and name[4:].isdigit():
            try:
                with open(os.path.join(exit_dir, name)) as f:
                    notes[int(name[4:])] = float(f.read()) - offset
            except (OSError, ValueError):
                pass
    return notes


def _failure(ranks: Sequence[_Rank], failed: _Rank, code: int, exit_dir: str | None) -> _Failure:
    """What the other ranks were doing when ``failed`` failed, and which of them most likely caused it: one that
    began to exit while its peers still ran (it waits in jax's shutdown barrier, so its exit is seen last), or,
    when the failure is a timeout, one that had gone silent long before."""
    now = time.monotonic()
    notes = _read_exit_notes(exit_dir)
    others, suspect, silent_longest = [], None, None
    for r in ranks:
        if r is failed:
            continue
        before = [(t, line) for t, line in r.history if t < now - _SECONDARY_WINDOW]
        last = f"last line {now - before[-1][0]:.1f}s before: {before[-1][1][:200]!r}" if before else "no output"
        state = "still running" if r.proc.poll() is None else _describe(r.proc.returncode)
        if r.rank in notes and notes[r.rank] < now:
            others.append(f"  rank {r.rank}: began to exit {now - notes[r.rank]:.1f}s before, {state}; {last}")
            if suspect is None or notes[r.rank] < suspect[0]:
                suspect = (notes[r.rank], r.rank)
        else:
            others.append(f"  rank {r.rank}: {state}; {last}")
            silence = now - before[-1][0] if before else now - 0.0
            if r.proc.poll() is None and (silent_longest is None or silence > silent_longest[0]):
                silent_longest = (silence, r.rank, before[-1][1][:200] if before else None)
    if suspect is not None:
        t, who = suspect
        words = (f"rank {who} began to exit {now - t:.1f}s before rank {failed.rank} failed, while its peers still "
                 f"ran, and waited in jax's shutdown barrier: rank {failed.rank}'s failure most likely follows from "
                 f"it. A rank that leaves early (its own code is not visible: `raise SystemExit(n)` instead of "
                 f"`sys.exit(n)`, or a normal end on that rank only) leaves its peers waiting in a collective.")
        return _Failure(failed, code, words, others)
    if failed.rank in notes and notes[failed.rank] < now:
        # It began to exit while its peers ran and failed in jax's shutdown barrier: a peer that has been silent
        # since (waiting for it in a collective) is a consequence, not the cause.
        words = (f"rank {failed.rank} began to exit {now - notes[failed.rank]:.1f}s before it failed, while its "
                 f"peers still ran, and failed waiting in jax's shutdown barrier: a rank that leaves early leaves "
                 f"its peers waiting in a collective.")
        return _Failure(failed, code, words, others)
    timed_out = any(w in line for line in failed.err_tail for w in _TIMEOUT_WORDS)
    if timed_out and silent_longest is not None and silent_longest[0] >= _SILENT_SUSPECT:
        silence, who, line = silent_longest
        said = f" (its last line: {line!r})" if line is not None else ""
        words = (f"rank {failed.rank} failed on a timeout, and rank {who} had printed nothing for {silence:.1f}s"
                 f"{said}: rank {who} may be the one that stopped answering.")
        return _Failure(failed, code, words, others)
    return _Failure(failed, code, None, others)


def _root_cause(failure: _Failure, say) -> None:
    """At the very end, below the errors of the ranks stopped after it (which fail in their collectives, with long
    tracebacks that are only consequences): the other ranks' state when it failed, the first failing rank's own
    last stderr lines, and one line naming the root cause (another rank where one can be named)."""
    rank = failure.rank
    if failure.others:
        say(f"the other ranks when rank {rank.rank} failed:", *failure.others)
    lines = [f"  {line}" for line in rank.err_tail] or ["  (nothing on stderr)"]
    say(f"rank {rank.rank} {_describe(failure.code)}, the first to fail; errors printed by the ranks stopped "
        f"after it are secondary. Its last {len(rank.err_tail)} lines on stderr:", *lines)
    if failure.suspect:
        say(f"root cause: {failure.suspect}")
    else:
        say(f"root cause: rank {rank.rank} {_describe(failure.code)} (its error above)")


def _supervise(ranks: Sequence[_Rank], grace_period: float, received: list[int], limits: _Limits, say,
               first_failure: list | None = None, exit_dir: str | None = None) -> int:
    """Waits for all processes; on the first failure, signal or expired limit stops the rest and returns the
    job's code (the first failing rank and its code go to ``first_failure``)."""
    signalled_at = None
    while True:
        codes = [r.proc.poll() for r in ranks]
        if received:
            # Forwarded SIGINT/SIGTERM/SIGHUP: give the processes the grace period to finish, then kill them.
            # (jax installs a SIGTERM handler for preemption notices, so SIGTERM alone may not end a rank.)
            signalled_at = signalled_at or time.monotonic()
            name = signal.Signals(received[0]).name
            if all(c is not None for c in codes):
                say(f"stopped by {name}")
                return 128 + received[0]
            if time.monotonic() - signalled_at > grace_period or len(received) > 1:
                say(f"stopped by {name}; killing ranks still running after {grace_period:g}s")
                _stop(ranks, 0.0)
                return 128 + received[0]
        failed = [(r, c) for r, c in zip(ranks, codes, strict=True) if c not in (None, 0)]
        if failed and not received:
            # Polled every 50 ms: several failures seen at once are near-simultaneous; the lowest rank is named.
            r, code = failed[0]
            others = [o.rank for o, c in zip(ranks, codes, strict=True) if c is None]
            say(f"rank {r.rank} {_describe(code)}" + (f"; stopping ranks {others}" if others else ""))
            failure = _failure(ranks, r, code, exit_dir)
            if failure.suspect:
                say(failure.suspect)
            if first_failure is not None:
                first_failure.append(failure)
            _stop(ranks, grace_period)
            return code if code > 0 else 128 + (-code)
        if all(c == 0 for c in codes):
            return 0
        now = time.monotonic()
        reason = limits.expired(now) if not received else None
        if reason:
            report = _running_report(ranks, now)
            say(f"{reason}; stopping {len(report)} rank(s) still running:", *report)
            _stop(ranks, grace_period)
            return TIMEOUT_EXIT_CODE
        time.sleep(_POLL_SECONDS)


def _stop(ranks: Sequence[_Rank], grace_period: float) -> None:
    """SIGTERM to every running process group, SIGKILL to those still running ``grace_period`` s later."""
    for r in ranks:
        if r.proc.poll() is None:
            _signal_group(r.proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_period
    for r in ranks:
        try:
            r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(r.proc, signal.SIGKILL)
            r.proc.wait()


_EPILOG = """\
example:
  jonebit launch --nproc 2 --devices-per-proc 2 --timeout 3600 -- python train.py --steps 10

exit codes:
  0        every process succeeded
  N        the first process to fail exited with N (128+S if killed by signal S); the others were stopped
  124      --timeout or --no-progress-timeout expired; the running processes' last lines were printed
  128+S    the launcher received signal S (SIGINT, SIGTERM or SIGHUP) and forwarded it to every process
  2, 127   bad arguments; program not found

The processes die with the launcher, even when it is killed with SIGKILL (Linux: parent-death signal).
"""


def add_parser(subparsers) -> None:
    """Registers ``jonebit launch`` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "launch",
        help="run a program as N cooperating JAX processes on this host",
        description=__doc__.split("\n\n")[0],
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nproc", "--nproc-per-node", type=int, required=True, help="processes on this host")
    p.add_argument("--devices-per-proc", type=int, default=None, help="CPU devices per process (JAX_NUM_CPU_DEVICES)")
    p.add_argument("--nnodes", type=int, default=1, help="hosts in the job (run the launcher once per host)")
    p.add_argument("--node-rank", type=int, default=0, help="this host's index in [0, nnodes)")
    p.add_argument("--coordinator", default=None, help="host:port of process 0 (default: free port on 127.0.0.1)")
    p.add_argument("--grace-period", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping the processes (default 5)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="stop the whole job after SECONDS, report each running rank's last line, exit 124")
    p.add_argument("--no-progress-timeout", type=float, default=None, metavar="SECONDS",
                   help="stop the job when no rank has printed a line (stdout or stderr) for SECONDS, counting "
                   "from the launch (leave room for startup and compilation); report each running rank's last "
                   "line, exit 124")
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
            timeout=args.timeout,
            no_progress_timeout=args.no_progress_timeout,
        )
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"jonebit launch: cannot start {command[0]!r}: {e.strerror}", file=sys.stderr)
        return 127
