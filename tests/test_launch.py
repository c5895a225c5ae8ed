"""``jonebit launch``: environment, rank-prefixed output, failure propagation, signal forwarding."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from jonebit.cli import main
from tests.mpi_util import ROOT, worker_env

WORKER = ROOT / "tests" / "sharding" / "dist_worker.py"
PY = sys.executable


def launcher(*args, timeout=120):
    """Runs ``python -m jonebit launch ARGS`` as a subprocess; returns (code, stdout, stderr, seconds)."""
    start = time.monotonic()
    proc = subprocess.run(
        [PY, "-m", "jonebit", "launch", *args], cwd=ROOT, env=worker_env(), capture_output=True, text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start


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
        (["--nproc", "0", "--", PY, "-c", "pass"], "--nproc must be >= 1"),
        (["--nproc", "2"], "no command given"),
        (["--nproc", "2", "--nnodes", "2", "--", PY], "needs --coordinator"),
        (["--nproc", "1", "--devices-per-proc", "0", "--", PY], "--devices-per-proc must be >= 1"),
    ],
)
def test_bad_arguments(capsys, argv, match):
    assert main(["launch", *argv]) == 2
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
    assert seconds < 45, seconds  # startup + failure + grace period; never jax's 300 s shutdown timeout


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
