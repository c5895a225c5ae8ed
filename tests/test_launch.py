"""``jonebit launch``: environment, rank-prefixed output, bad arguments, failure reports, signal forwarding,
ranks dying with the launcher, --timeout / --no-progress-timeout."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from jonebit.cli import main
from tests.mpi_util import ROOT, worker_env

WORKER = ROOT / "tests" / "sharding" / "dist_worker.py"
PY = sys.executable


def launcher(*args, timeout=120):
    """Runs ``python -m jonebit launch ARGS``; returns (code, stdout, stderr, seconds). Kills the launcher's
    process group on timeout (its ranks die with it: parent-death signal)."""
    run = Run(*args)
    code = run.wait(timeout)
    return code, run.text("out"), run.text("err"), run.seconds


@pytest.fixture(autouse=True)
def _no_leftover_launchers():
    """A test that fails half-way leaves no launcher behind (its ranks then die with it)."""
    yield
    while Run.started:
        Run.started.pop().kill()


class Run:
    """``python -m jonebit launch ARGS`` in its own session, every output line time-stamped as it arrives."""

    started: list[Run] = []

    def __init__(self, *args):
        Run.started.append(self)
        self.start = time.monotonic()
        self.proc = subprocess.Popen(
            [PY, "-m", "jonebit", "launch", *map(str, args)], cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        self.lines = {"out": [], "err": []}  # (time.monotonic(), line)
        self.readers = [
            threading.Thread(target=self._read, args=(stream, self.lines[key]), daemon=True)
            for key, stream in (("out", self.proc.stdout), ("err", self.proc.stderr))
        ]
        for t in self.readers:
            t.start()
        self.seconds = None

    @staticmethod
    def _read(stream, sink):
        for line in iter(stream.readline, ""):
            sink.append((time.monotonic(), line.rstrip("\n")))

    def wait(self, timeout):
        """The launcher's exit code; fails the test (after killing the process group) past ``timeout``."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"jonebit launch still running after {timeout}s:\n{self.text('err')[-3000:]}")
        self.seconds = time.monotonic() - self.start
        for t in self.readers:
            t.join(timeout=5)
        return code

    def kill(self):
        if self.proc.poll() is None:  # once reaped, its pid (and group id) may belong to someone else
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def text(self, key):
        return "".join(line + "\n" for _, line in self.lines[key])

    def when(self, key, needle, timeout=60):
        """Time the first line containing ``needle`` arrived, waiting for it up to ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            for t, line in list(self.lines[key]):
                if needle in line:
                    return t
            if time.monotonic() > deadline or (self.proc.poll() is not None and not self.readers[0].is_alive()
                                               and not self.readers[1].is_alive()):
                self.kill()
                pytest.fail(f"no line with {needle!r} on std{key} within {timeout}s:\n{self.text(key)[-3000:]}")
            time.sleep(0.02)


def test_env_and_rank_prefixes(capsys):
    code = main(["launch", "--nproc", "3", "--devices-per-proc", "2", "--", PY, "-c",
                 "import os, sys; e = os.environ; print(e['JONEBIT_PROCESS_ID'], e['JONEBIT_NUM_PROCESSES'], "
                 "e['JONEBIT_LOCAL_RANK'], e['JAX_NUM_CPU_DEVICES'], e['JONEBIT_COORDINATOR']); "
                 "print('err', file=sys.stderr)"])
    out, err = capsys.readouterr()
    assert code == 0
    lines = sorted(out.splitlines())
    assert [ln.split()[:6] for ln in lines] == [["[rank", f"{r}]", str(r), "3", str(r), "2"] for r in range(3)]
    coordinators = {ln.split()[-1] for ln in lines}
    assert len(coordinators) == 1 and coordinators.pop().startswith("127.0.0.1:")
    assert sorted(err.splitlines()) == [f"[rank {r}] err" for r in range(3)]


def test_multi_node_ranks(capsys):
    code = main(["launch", "--nproc", "2", "--nnodes", "3", "--node-rank", "1", "--coordinator", "head:1234", "--",
                 PY, "-c", "import os; print(os.environ['JONEBIT_PROCESS_ID'], os.environ['JONEBIT_COORDINATOR'])"])
    assert code == 0
    assert sorted(capsys.readouterr().out.splitlines()) == ["[rank 2] 2 head:1234", "[rank 3] 3 head:1234"]


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--nproc", "0", "--", PY, "-c", "pass"], "--nproc must be >= 1, got 0"),
        (["--nproc", "2"], "no command given (usage: jonebit launch --nproc N -- python train.py)"),
        (["--nproc", "2", "--"], "no command given"),
        (["--nproc", "2", "--nnodes", "2", "--", PY], "--nnodes > 1 needs --coordinator host:port"),
        (["--nproc", "1", "--devices-per-proc", "0", "--", PY], "--devices-per-proc must be >= 1, got 0"),
        (["--nproc", "1", "--nnodes", "0", "--", PY], "--nnodes must be >= 1, got 0"),
        (["--nproc", "1", "--nnodes", "2", "--node-rank", "2", "--coordinator", "h:1", "--", PY],
         "--node-rank must be in [0, --nnodes=2), got 2"),
        (["--nproc", "1", "--node-rank", "-1", "--", PY], "--node-rank must be in [0, --nnodes=1), got -1"),
        (["--nproc", "1", "--coordinator", "head", "--", PY],
         "--coordinator must be host:port with a port in 1..65535, got 'head'"),
        (["--nproc", "1", "--coordinator", "head:99999", "--", PY],
         "--coordinator must be host:port with a port in 1..65535, got 'head:99999'"),
        (["--nproc", "1", "--coordinator", ":1234", "--", PY],
         "--coordinator must be host:port with a port in 1..65535, got ':1234'"),
        (["--nproc", "1", "--grace-period", "-1", "--", PY], "--grace-period must be >= 0 seconds, got -1.0"),
        (["--nproc", "1", "--timeout", "0", "--", PY],
         "--timeout must be > 0 seconds (leave it out for no limit), got 0.0"),
        (["--nproc", "1", "--timeout", "nan", "--", PY], "--timeout must be > 0 seconds"),
        (["--nproc", "1", "--no-progress-timeout", "-5", "--", PY], "--no-progress-timeout must be > 0 seconds"),
    ],
)
def test_bad_arguments(capsys, argv, match):
    assert main(["launch", *argv]) == 2
    assert "jonebit launch: " + match in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--nproc", "two", "--", PY], "argument --nproc/--nproc-per-node: invalid int value: 'two'"),
        (["--", PY], "the following arguments are required: --nproc"),
        (["--nproc", "1", "--timeout", "soon", "--", PY], "argument --timeout: invalid float value: 'soon'"),
    ],
)
def test_unparsable_arguments(capsys, argv, match):
    with pytest.raises(SystemExit) as exc:
        main(["launch", *argv])
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def test_missing_program(capsys):
    assert main(["launch", "--nproc", "1", "--", "/nonexistent/program"]) == 127
    assert "cannot start '/nonexistent/program'" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_two_processes_jax_distributed_through_launcher():
    code, out, err, _ = launcher("--nproc", "2", "--devices-per-proc", "2", "--", PY, str(WORKER), "psum")
    assert code == 0, err[-3000:]
    for r in range(2):
        assert f"[rank {r}] process {r}/2 devices 2/4 psum 10.0 expect 10.0" in out, out


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "mode,code,message",
    [
        ("exit-before-collective", 3, "rank 1 exited with code 3; stopping ranks [0]"),
        ("raise-before-collective", 1, "rank 1 exited with code 1; stopping ranks [0]"),
        ("exit-before-init", 3, "rank 1 exited with code 3"),
    ],
)
def test_failing_rank_stops_the_job(mode, code, message):
    """A rank failing before a collective: the launcher names it and exits with its code, no hang."""
    rc, out, err, seconds = launcher(
        "--nproc", "2", "--devices-per-proc", "1", "--grace-period", "2", "--", PY, str(WORKER), mode
    )
    assert rc == code, (out[-2000:], err[-3000:])
    assert f"jonebit launch: {message}" in err, err[-3000:]
    assert seconds < 150, seconds  # a hang guard: never jax's 300 s shutdown timeout
    # The end of the log names the root cause, below rank 0's secondary errors from its interrupted collective:
    # rank 1's own stderr lines, then one line.
    lines = err.splitlines()
    assert lines[-1] == f"jonebit launch: root cause: rank 1 exited with code {code} (its error above)", lines[-14:]
    assert any(line.startswith(f"jonebit launch: rank 1 exited with code {code}, the first to fail")
               for line in lines[-14:]), lines[-14:]
    if mode == "raise-before-collective":
        assert any("RuntimeError: rank 1 fails on purpose" in line for line in lines[-8:]), lines[-14:]


def test_signal_is_forwarded_and_children_end():
    marker = "started"
    proc = subprocess.Popen(
        [PY, "-m", "jonebit", "launch", "--nproc", "2", "--grace-period", "2", "--", PY, "-c",
         f"import time; print('{marker}', flush=True); time.sleep(600)"],
        cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        seen = 0
        deadline = time.monotonic() + 60
        while seen < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            seen += marker in line
        assert seen == 2
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in err


# --- process lifetime, failure reports and hang detection (tests/launch_worker.py) ---------------------------

LAUNCH_WORKER = ROOT / "tests" / "launch_worker.py"
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal and /proc: Linux")


def alive(pid: int, marker: str) -> bool:
    """Whether ``pid`` is a live (not zombie) process whose command line holds ``marker``: a pid recycled by an
    unrelated process does not count."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X") and marker.encode() in cmdline


def _pid_in(path) -> int | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return int(text) if text.strip().isdigit() else None


def read_pids(directory, names, timeout=120) -> list[int]:
    """Polls on content, not existence (a writer may have created a file without filling it); the timeout is
    only a hang guard."""
    deadline = time.monotonic() + timeout
    paths = [directory / n for n in names]
    while None in (pids := [_pid_in(p) for p in paths]):
        assert time.monotonic() < deadline, f"pid files {names} not all written within {timeout}s"
        time.sleep(0.05)
    return pids


def still_alive_after(pids, marker, seconds) -> list[int]:
    """Polls until every pid is gone or ``seconds`` pass; returns those still alive."""
    deadline = time.monotonic() + seconds
    while True:
        left = [p for p in pids if alive(p, marker)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


@pytest.fixture
def job_dir(tmp_path):
    """Directory for the workers' pid files; at teardown any process of ours still alive is SIGKILLed by pid."""
    yield tmp_path
    for path in tmp_path.rglob("*.pid"):
        pid = int(path.read_text())
        if alive(pid, str(tmp_path)):
            os.kill(pid, signal.SIGKILL)


@linux_only
def test_sigkill_of_launcher_kills_every_rank(job_dir):
    run = Run("--nproc", "3", "--", PY, LAUNCH_WORKER, "sleep", job_dir)
    for r in range(3):
        run.when("out", f"[rank {r}] ready {r}")
    pids = read_pids(job_dir, [f"rank{r}.pid" for r in range(3)])
    assert all(alive(p, str(job_dir)) for p in pids)
    os.kill(run.proc.pid, signal.SIGKILL)  # the launcher alone: no chance to forward anything
    assert run.wait(timeout=10) == -signal.SIGKILL
    assert still_alive_after(pids, str(job_dir), 5) == []


@linux_only
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_launcher_stops_ranks_and_their_children(job_dir, sig):
    run = Run("--nproc", "2", "--grace-period", "2", "--", PY, LAUNCH_WORKER, "sleep", job_dir, "child")
    for r in range(2):
        run.when("out", f"[rank {r}] ready {r}")
    pids = read_pids(job_dir, [f"{kind}{r}.pid" for kind in ("rank", "child") for r in range(2)])
    assert all(alive(p, str(job_dir)) for p in pids)
    os.kill(run.proc.pid, sig)
    assert run.wait(timeout=30) == 128 + sig
    assert f"jonebit launch: stopped by {signal.Signals(sig).name}" in run.text("err")
    assert still_alive_after(pids, str(job_dir), 2) == []


@linux_only
@pytest.mark.parametrize(
    "worker_args,code,message",
    [
        (["fail", "1", "4"], 4, "rank 1 exited with code 4; stopping ranks [0, 2]"),
        (["kill", "1"], 128 + signal.SIGKILL, "rank 1 was killed by signal SIGKILL; stopping ranks [0, 2]"),
        (["fail", "2", "7", "stubborn"], 7, "rank 2 exited with code 7; stopping ranks [0, 1]"),
    ],
    ids=["exit-4", "sigkill", "others-ignore-sigterm"],
)
def test_failing_rank_is_named_at_once(job_dir, worker_args, code, message):
    """The report comes within ~1 s of the rank's exit; the others are stopped (SIGKILL after the grace period
    when they ignore SIGTERM) and the launcher returns the failing rank's code."""
    grace = 1.5
    run = Run("--nproc", "3", "--grace-period", grace, "--", PY, LAUNCH_WORKER, worker_args[0], job_dir,
              *worker_args[1:])
    failing = message.split()[1]
    exited = run.when("out", f"[rank {failing}] exiting at")
    reported = run.when("err", "jonebit launch: rank")
    assert run.wait(timeout=60) == code, run.text("err")[-3000:]
    assert f"jonebit launch: {message}" in run.text("err")
    # "At once" against the alternative of waiting out the other ranks' 600 s sleep; normally ~0.1 s, and the
    # bound is only a guard against that wait (load on the machine must not fail the test).
    assert reported - exited < 60, reported - exited
    finished = run.start + run.seconds
    if "stubborn" in worker_args:
        # SIGTERM ignored, so SIGKILL comes only after the grace period (a lower bound load cannot break).
        assert grace - 0.1 < finished - reported < grace + 60, finished - reported
    else:
        assert finished - reported < 60, finished - reported  # not the ranks' 600 s sleep
    pids = read_pids(job_dir, [f"rank{r}.pid" for r in range(3)])
    assert still_alive_after(pids, str(job_dir), 2) == []


@linux_only
@pytest.mark.multiprocess
def test_jax_rank_exit_code_is_named_at_once(job_dir):
    """A jax.distributed rank leaving with sys.exit(4) while its peer waits in a psum: named with code 4 at once
    (not after jax's 30 s shutdown barrier as rank 0 killed by SIGABRT)."""
    run = Run("--nproc", "2", "--devices-per-proc", "1", "--grace-period", "1", "--",
              PY, LAUNCH_WORKER, "jax", job_dir, "exit", "4")
    run.when("out", "[rank 1] exiting at", timeout=90)
    assert run.wait(timeout=60) == 4, run.text("err")[-3000:]
    assert "jonebit launch: rank 1 exited with code 4; stopping ranks [0]" in run.text("err")
    assert "[rank 0] entering psum" in run.text("out")
    # Not after jax's 30 s shutdown barrier: that path would name rank 0 killed by SIGABRT (checked above).
    assert still_alive_after(read_pids(job_dir, ["rank0.pid", "rank1.pid"]), str(job_dir), 2) == []


@linux_only
@pytest.mark.multiprocess
def test_the_rank_that_left_or_hung_is_named_not_its_peer(job_dir):
    """Rank 1 leaves with ``raise SystemExit(4)`` (its code is not visible before jax's shutdown barrier, so it
    waits there) in one job, and hangs in another, while rank 0 waits for it in a psum; in both rank 0 is the first
    process to fail (jax's 30 s collective timeout; the worker's shutdown barrier waits 120 s, so the order does not
    depend on load). The launcher still names rank 1 as the root cause, on the last line. (The two jobs run at
    once: each spends its time waiting.)"""
    runs = {}
    for how, args in (("raise", ["raise", "4"]), ("hang", ["hang"])):
        (job_dir / how).mkdir()
        runs[how] = Run("--nproc", "2", "--devices-per-proc", "1", "--grace-period", "1", "--",
                        PY, LAUNCH_WORKER, "jax", job_dir / how, *args)
    for how, run in runs.items():
        assert run.wait(timeout=150) == 1, run.text("err")[-3000:]  # rank 0's own code: rank 1's is not known
        lines = run.text("err").splitlines()
        assert "jonebit launch: rank 0 exited with code 1; stopping ranks [1]" in lines
        if how == "raise":
            assert re.fullmatch(r"jonebit launch: root cause: rank 1 began to exit \d+\.\ds before rank 0 failed, "
                                r".*waited in jax's shutdown barrier.*", lines[-1]), lines[-14:]
        else:
            assert re.fullmatch(r"jonebit launch: root cause: rank 0 failed on a timeout, and rank 1 had printed "
                                r"nothing for \d+\.\ds \(its last line: 'hanging'\): rank 1 may be the one that "
                                r"stopped answering\.", lines[-1]), lines[-14:]
        assert any(re.fullmatch(r"jonebit launch: {3}rank 1: .*still running; last line \d+\.\ds before: "
                                r"'(exiting at .*|hanging)'", line) for line in lines), lines[-16:]
        pids = read_pids(job_dir / how, ["rank0.pid", "rank1.pid"])
        assert still_alive_after(pids, str(job_dir / how), 2) == []


@linux_only
@pytest.mark.multiprocess
def test_jax_rank_hanging_before_a_collective_is_reported(job_dir):
    """Rank 1 hangs while rank 0 waits for it in a psum: --no-progress-timeout stops the job before jax's own
    30 s timeouts and shows where each rank was (rank 0: entering the psum; rank 1: its last words)."""
    run = Run("--nproc", "2", "--devices-per-proc", "1", "--no-progress-timeout", "8", "--grace-period", "1",
              "--", PY, LAUNCH_WORKER, "jax", job_dir, "hang")
    hung = run.when("out", "[rank 1] hanging", timeout=90)
    reported = run.when("err", "jonebit launch: no rank printed a line for 8s")
    assert run.wait(timeout=60) == 124, run.text("err")[-3000:]
    err = run.text("err")
    pids = read_pids(job_dir, ["rank0.pid", "rank1.pid"])
    assert re.search(rf"rank 0 \(pid {pids[0]}\): last line \d+\.\ds ago: 'entering psum'", err), err
    assert re.search(rf"rank 1 \(pid {pids[1]}\): last line \d+\.\ds ago: 'hanging'", err), err
    assert reported - hung >= 7.8, reported - hung  # never before the 8 s of silence (stamps read ~0.1 s late)
    assert still_alive_after(pids, str(job_dir), 2) == []


@linux_only
def test_timeout_stops_job_and_reports_last_lines(job_dir):
    """--timeout fires although the ranks keep printing (so --no-progress-timeout does not); the report names
    each rank with the last line it printed."""
    run = Run("--nproc", "2", "--timeout", "5", "--no-progress-timeout", "2.5", "--grace-period", "1", "--",
              PY, LAUNCH_WORKER, "chatty", job_dir)
    assert run.wait(timeout=60) == 124, run.text("err")[-3000:]
    err, out = run.text("err"), run.text("out")
    assert "jonebit launch: job timed out after 5s (--timeout); stopping 2 rank(s) still running:" in err, err
    assert "--no-progress-timeout" not in err
    pids = read_pids(job_dir, ["rank0.pid", "rank1.pid"])
    for r, pid in enumerate(pids):
        last = [ln for ln in out.splitlines() if ln.startswith(f"[rank {r}] ")][-1].removeprefix(f"[rank {r}] ")
        assert last.startswith("step ")
        assert f"jonebit launch:   rank {r} (pid {pid}): last line " in err
        assert f"s ago: {last!r}" in err, (last, err)
    assert run.seconds >= 5, run.seconds  # not before --timeout; the chatty ranks would otherwise never stop
    assert still_alive_after(pids, str(job_dir), 2) == []


@linux_only
def test_no_progress_timeout_reports_last_lines(job_dir):
    run = Run("--nproc", "2", "--no-progress-timeout", "3", "--grace-period", "1", "--",
              PY, LAUNCH_WORKER, "quiet", job_dir)
    last_output = run.when("err", "[rank 0] step 2 on rank 0")
    reported = run.when("err", "jonebit launch: no rank printed a line")
    assert run.wait(timeout=60) == 124, run.text("err")[-3000:]
    err = run.text("err")
    assert "jonebit launch: no rank printed a line for 3s (--no-progress-timeout); stopping 2 rank(s)" in err
    pids = read_pids(job_dir, ["rank0.pid", "rank1.pid"])
    silent = re.search(rf"rank 0 \(pid {pids[0]}\): last line (\d+\.\d)s ago: 'step 2 on rank 0'", err)
    assert silent and float(silent[1]) >= 3.0, err  # at least the 3 s of silence; later only under load
    assert f"rank 1 (pid {pids[1]}): last line " in err and "s ago: 'step 1 on rank 1'" in err, err
    # Stamped as this test reads the lines, a little after the launcher saw them: a small slack below 3 s.
    assert reported - last_output >= 2.8, reported - last_output
    assert still_alive_after(pids, str(job_dir), 2) == []


def test_closed_launcher_output_does_not_block_ranks(job_dir):
    """``jonebit launch ... | head -1``: once the reader is gone the launcher keeps draining the ranks' pipes, so
    a rank printing more than a pipe holds still runs to its end (and the job still succeeds)."""
    proc = subprocess.Popen(
        [PY, "-m", "jonebit", "launch", "--nproc", "2", "--", PY, str(LAUNCH_WORKER), "flood", str(job_dir)],
        cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout.readline().startswith("[rank ")
        proc.stdout.close()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert sorted(p.name for p in job_dir.glob("done*")) == ["done0", "done1"]


RACE = """
import os, sys, time
from jonebit.launch import _die_with_parent
directory, launcher = sys.argv[1], os.getpid()
preexec = _die_with_parent()
if os.fork() == 0:
    while os.getppid() == launcher:  # the launcher dies between fork and prctl ...
        time.sleep(0.01)
    tmp = os.path.join(directory, ".child.pid.tmp")
    with open(tmp, "w") as f:  # written, then renamed: the test never reads a half-written file
        f.write(str(os.getpid()))
    os.replace(tmp, os.path.join(directory, "child.pid"))
    preexec()  # ... so no parent-death signal will ever come: the child must end itself
    open(os.path.join(directory, "survived"), "w").close()
    os._exit(0)
os._exit(0)
"""


@linux_only
def test_child_whose_launcher_died_before_prctl_ends_itself(job_dir):
    subprocess.run([PY, "-c", RACE, str(job_dir)], cwd=ROOT, env=worker_env(), timeout=60, check=True)
    (pid,) = read_pids(job_dir, ["child.pid"], timeout=20)
    assert still_alive_after([pid], str(job_dir), 120) == []  # gone: whatever it wrote is on disk by now
    assert not (job_dir / "survived").exists()


def test_a_rank_that_began_to_exit_and_then_timed_out_is_the_root_cause_not_its_silent_peer(tmp_path):
    """Rank 1 began to exit 20 s ago (its exit note) and has now failed on a timeout in jax's shutdown barrier,
    while rank 0, waiting for it in a collective, printed nothing for 25 s: the launcher names rank 1's early exit,
    not rank 0's silence (which the timeout rule alone would name)."""
    from jonebit.launch import _failure, _Rank

    waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    left = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    try:
        left.wait(timeout=60)
        (tmp_path / "rank1").write_text(f"{time.time() - 20.0:.3f}")
        ranks = [_Rank(0, waiting), _Rank(1, left)]
        ranks[0].history.append((time.monotonic() - 25.0, "entering psum"))
        ranks[1].history.append((time.monotonic() - 20.0, "exiting"))
        ranks[1].err_tail.append("DEADLINE_EXCEEDED: Barrier timed out. Id: Shutdown::")
        failure = _failure(ranks, ranks[1], 1, str(tmp_path))
    finally:
        waiting.kill()
        waiting.wait()
    assert re.fullmatch(r"rank 1 began to exit 2\d\.\ds before it failed, .*shutdown barrier.*", failure.suspect), (
        failure.suspect)
    assert "rank 0 may be" not in failure.suspect
