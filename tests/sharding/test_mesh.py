"""initialize_distributed / resolve_distributed / data_mesh: resolution rules and real multi-process starts."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time

import jax
import pytest
from jax.sharding import AxisType

from jonebit.sharding.mesh import data_mesh, expand_nodelist, free_port, resolve_distributed
from tests.mpi_util import ROOT, run_mpi, worker_env

WORKER = pathlib.Path(__file__).with_name("dist_worker.py")


@pytest.mark.parametrize(
    "nodelist,hosts",
    [
        ("node001", ["node001"]),
        ("a,b", ["a", "b"]),
        ("node[001-003,010]", ["node001", "node002", "node003", "node010"]),
        ("gpu[8-10]-ib,cpu1", ["gpu8-ib", "gpu9-ib", "gpu10-ib", "cpu1"]),
        ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[1-", "node[a-b]", ""])
def test_expand_nodelist_rejects_malformed(bad):
    with pytest.raises(ValueError, match="nodelist"):
        expand_nodelist(bad)


def test_resolve_single_process():
    cfg = resolve_distributed(env={})
    assert (cfg.num_processes, cfg.process_id, cfg.source, cfg.is_multi_process) == (1, 0, "single", False)


def test_resolve_explicit_args_win_over_env():
    env = {"JONEBIT_COORDINATOR": "h:1", "JONEBIT_NUM_PROCESSES": "4", "JONEBIT_PROCESS_ID": "3"}
    cfg = resolve_distributed("c:9", 2, 1, local_device_ids=[0, 1], env=env)
    assert cfg == type(cfg)("c:9", 2, 1, (0, 1), "arguments")


def test_resolve_jonebit_env():
    env = {"JONEBIT_COORDINATOR": "127.0.0.1:1234", "JONEBIT_NUM_PROCESSES": "4", "JONEBIT_PROCESS_ID": "2",
           "JONEBIT_LOCAL_DEVICE_IDS": "2,3", "SLURM_NTASKS": "8", "SLURM_PROCID": "5"}
    cfg = resolve_distributed(env=env)
    assert (cfg.coordinator_address, cfg.num_processes, cfg.process_id, cfg.local_device_ids, cfg.source) == (
        "127.0.0.1:1234", 4, 2, (2, 3), "jonebit")


def test_resolve_slurm():
    env = {"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_JOB_ID": "4100",
           "SLURM_JOB_NODELIST": "other[1-9]", "SLURM_STEP_NODELIST": "gpu[017-018,020]"}
    cfg = resolve_distributed(env=env)
    assert cfg.coordinator_address == f"gpu017:{4100 % 4096 + 61440}"
    assert (cfg.num_processes, cfg.process_id, cfg.source) == (8, 5, "slurm")
    env.pop("SLURM_STEP_NODELIST")
    env["JONEBIT_COORDINATOR_PORT"] = "7000"
    assert resolve_distributed(env=env).coordinator_address == "other1:7000"
    env["JONEBIT_COORDINATOR"] = "login:1"
    assert resolve_distributed(env=env).coordinator_address == "login:1"


def test_resolve_openmpi_and_pmi_with_coordinator_env():
    env = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1", "JONEBIT_COORDINATOR": "n0:5000"}
    cfg = resolve_distributed(env=env)
    assert (cfg.coordinator_address, cfg.num_processes, cfg.process_id, cfg.source) == ("n0:5000", 4, 1, "mpi")
    cfg = resolve_distributed(env={"PMI_SIZE": "2", "PMI_RANK": "0", "JONEBIT_COORDINATOR": "n0:5000"})
    assert (cfg.num_processes, cfg.process_id) == (2, 0)
    assert resolve_distributed(env={"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}).num_processes == 1


@pytest.mark.parametrize(
    "kwargs,env,match",
    [
        ({"num_processes": 2, "process_id": 2, "coordinator_address": "h:1"}, {}, r"outside \[0, 2\)"),
        ({"num_processes": 2, "process_id": 0}, {}, "no coordinator address"),
        ({"num_processes": 2, "coordinator_address": "h:1"}, {}, "no process_id"),
        ({"num_processes": 2, "process_id": 0, "coordinator_address": "nohostport"}, {}, "host:port"),
        ({"process_id": 1}, {}, "without num_processes"),
        ({}, {"JONEBIT_NUM_PROCESSES": "two"}, "JONEBIT_NUM_PROCESSES='two' is not an integer"),
        ({}, {"SLURM_NTASKS": "2", "SLURM_PROCID": "0"}, "SLURM_STEP_NODELIST"),
    ],
)
def test_resolve_rejects_bad_input(kwargs, env, match):
    with pytest.raises(ValueError, match=match):
        resolve_distributed(env=env, **kwargs)


def test_data_mesh_single_process():
    mesh = data_mesh()
    assert mesh.axis_names == ("data",)
    assert mesh.devices.size == jax.device_count() == 8
    assert mesh.axis_types == (AxisType.Explicit,)
    small = data_mesh(4, axis="dp")
    assert small.axis_names == ("dp",) and list(small.devices.flat) == jax.devices()[:4]
    with pytest.raises(ValueError, match="num_devices=9"):
        data_mesh(9)


def _spawn(rank, world, port, mode, timeout_s, devices=2, extra=None):
    env = worker_env(
        JONEBIT_COORDINATOR=f"127.0.0.1:{port}", JONEBIT_NUM_PROCESSES=str(world), JONEBIT_PROCESS_ID=str(rank),
        JAX_NUM_CPU_DEVICES=str(devices), TEST_INIT_TIMEOUT=str(timeout_s), **(extra or {}),
    )
    return subprocess.Popen([sys.executable, str(WORKER), mode], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.multiprocess
def test_two_processes_from_env_share_one_mesh():
    port = free_port("127.0.0.1")
    procs = [_spawn(r, 2, port, "psum", 60) for r in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("2-process psum timed out")
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
        assert "devices 2/4 psum 10.0 expect 10.0" in out, out[-3000:]


@pytest.mark.multiprocess
def test_unreachable_coordinator_fails_within_timeout():
    """Process 1 of 2 pointed at a port where nobody listens: a clear error, bounded by the 5 s init timeout (its
    DEADLINE_EXCEEDED is that timeout firing; the 90 s wait is only a hang guard, not a clock the test reads)."""
    port = free_port("127.0.0.1")
    p = _spawn(1, 2, port, "psum", 5)
    try:
        out = p.communicate(timeout=90)[0]
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("process waiting for a dead coordinator did not give up")
    assert p.returncode != 0
    assert "DEADLINE_EXCEEDED" in out or "coordination service" in out.lower(), out[-3000:]


@pytest.mark.mpi
@pytest.mark.multiprocess
def test_mpirun_autodetect_with_broadcast_coordinator(tmp_path):
    """Under mpirun with no coordinator set, rank 0 broadcasts host:port over MPI; gloo does the psum."""
    out = run_mpi(2, WORKER, "psum", tmp_path, timeout=150, env=worker_env(JAX_NUM_CPU_DEVICES="2"))
    assert "initialized from mpi" in out, out[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok0", "ok1"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_survivor_errors_when_peer_dies_without_launcher():
    """No launcher to clean up: rank 1 exits before the first collective, rank 0 must fail, not hang."""
    port = free_port("127.0.0.1")
    start = time.monotonic()
    procs = [_spawn(r, 2, port, "exit-before-collective", 30, devices=1, extra={"TEST_HEARTBEAT": "5"})
             for r in range(2)]
    outs = []
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("surviving rank hung after its peer died")
    elapsed = time.monotonic() - start
    assert procs[1].returncode == 3
    assert procs[0].returncode != 0
    # The coordination service names the dead task: "tasks are unhealthy (stopped sending heartbeats): 1".
    assert "stopped sending heartbeats" in outs[0], outs[0][-4000:]
    assert elapsed < 90, elapsed
