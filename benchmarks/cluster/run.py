"""Data-parallel BERT step times on an emulated cluster: hosts are network namespaces, links shaped with tc HTB.

For each host count it builds the cluster (``netns.py``), starts one jax.distributed process per namespace
(``worker.py``: gloo over the shaped links, one CPU device each), walks through the link rates (changing the
HTB classes between phases while the processes keep their compiled steps), reads the qdisc byte counters at
every variant's boundary, and always tears the cluster down (also on an error, Ctrl-C or SIGTERM). With
``--launcher mpi`` one mpirun (in namespace 0) starts one rank per namespace instead, each namespace a node of
its hostfile, reached through a remote-shell agent that enters the namespace (``netns.rsh_agent_script``).
Writes ``results/cluster/cluster.json`` and ``results/cluster/cluster.png`` and prints the tables.

    sudo .venv/bin/python benchmarks/cluster/run.py --hosts 2 4 --rates 1gbit 200mbit --model mini --repeats 5
    sudo .venv/bin/python benchmarks/cluster/run.py --launcher mpi --hosts 2 --rates 1gbit 200mbit --out x.json
    sudo .venv/bin/python benchmarks/cluster/run.py --cleanup      # removes leftovers of a killed run

Needs root, ``ip`` and ``tc`` (iproute2); exits with a message otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import signal
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cluster import model as bwmodel  # noqa: E402
from benchmarks.cluster.netns import (  # noqa: E402
    DEFAULT_PREFIX,
    DEFAULT_SUBNET,
    NETNS_ETC,
    Cluster,
    Layout,
    cleanup_commands,
    exec_prefix,
    find_leftovers,
    kill_namespace_processes,
    missing_requirements,
    mpi_environment,
    mpi_hostfile,
    mpirun_command,
    rate_bits,
    rsh_agent_script,
    run_command,
)
from benchmarks.report import run_meta  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "cluster"
COORDINATOR_PORT = 12355  # inside a fresh namespace nothing else listens


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, nargs="+", default=[2])
    p.add_argument("--rates", nargs="+", default=["1gbit", "200mbit"], help="tc rates, one phase each")
    p.add_argument("--model", default="mini", help="BERT preset (tiny, mini, small, ...)")
    p.add_argument("--batch", type=int, default=4, help="examples per host")
    p.add_argument("--devices-per-host", type=int, default=1, help="simulated CPU devices per process")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5, help="timed steps per stage and rate")
    p.add_argument("--variants", nargs="+", default=None,
                   help="worker.VARIANTS names (default: adam onebit; with --launcher mpi: adam_mpi onebit_mpi)")
    p.add_argument("--launcher", choices=("gloo", "mpi"), default="gloo",
                   help="gloo: one jax.distributed process per namespace; mpi: mpirun with one rank per namespace "
                        "(each namespace a node of its hostfile), for the MPI variants")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per host count (then killed)")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="name prefix of namespaces and interfaces")
    p.add_argument("--subnet", default=DEFAULT_SUBNET, help="first three octets of the /24 used")
    p.add_argument("--out", default=str(RESULTS / "cluster.json"))
    p.add_argument("--cleanup", action="store_true", help="only remove leftovers with --prefix and exit")
    p.add_argument("--from-json", help="recompute the summary of an earlier report from its raw records, print the "
                   "tables and redraw its PNG (no cluster, no root)")
    args = p.parse_args(argv)
    for r in args.rates:
        try:
            rate_bits(r)
        except ValueError as e:
            p.error(f"--rates: {e}")
    for name, value in (("--repeats", args.repeats), ("--devices-per-host", args.devices_per_host),
                        ("--batch", args.batch), ("--seq", args.seq)):
        if value < 1:
            p.error(f"{name} must be at least 1, got {value}")
    if args.batch % args.devices_per_host:
        p.error(f"--batch {args.batch} (examples per host) must be divisible by --devices-per-host "
                f"{args.devices_per_host}")
    if any(h < 1 for h in args.hosts):
        p.error(f"--hosts must all be at least 1, got {args.hosts}")
    if args.variants is None:
        args.variants = ["adam_mpi", "onebit_mpi"] if args.launcher == "mpi" else ["adam", "onebit"]
    if args.launcher == "mpi" and args.devices_per_host != 1:
        p.error("--launcher mpi runs one rank with one CPU device per host: --devices-per-host must be 1")
    return args


def leftovers(prefix: str) -> dict:
    etc = sorted(os.listdir(NETNS_ETC)) if NETNS_ETC.is_dir() else []
    return find_leftovers(prefix, run_command(["ip", "netns", "list"]), run_command(["ip", "-o", "link", "show"]),
                          etc)


def cleanup(prefix: str) -> dict:
    """Removes every namespace, interface and /etc/netns entry with this prefix (processes inside are killed)."""
    found = leftovers(prefix)
    for ns in found["netns"]:
        kill_namespace_processes(ns, run_command)
    for cmd in cleanup_commands(found):
        try:
            run_command(cmd)
        except RuntimeError as e:
            print(f"cleanup: {e}", file=sys.stderr)
    for e in found["etc"]:
        (NETNS_ETC / e / "hosts").unlink(missing_ok=True)
        (NETNS_ETC / e).rmdir()
    return found


class _Terminated(Exception):
    pass


def _on_signal(signum, frame):
    raise _Terminated(f"signal {signum}")


def _worker_args(args, sync_dir: pathlib.Path) -> list[str]:
    """The worker's arguments every host shares."""
    return ["--launcher", args.launcher, "--model", args.model, "--batch", str(args.batch), "--seq", str(args.seq),
            "--repeats", str(args.repeats), "--phases", str(len(args.rates)), "--sync-dir", str(sync_dir),
            "--variants", *args.variants]


def _worker_env(args) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if args.devices_per_host > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices_per_host}"
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    return env


def _start_workers(layout: Layout, args, sync_dir: pathlib.Path, logs: list) -> list[subprocess.Popen]:
    env = _worker_env(args)
    procs = []
    for i in range(layout.hosts):
        cmd = ["timeout", "-s", "KILL", str(int(args.timeout)), *exec_prefix(layout, i), sys.executable,
               str(HERE / "worker.py"), "--coordinator", f"{layout.address(0)}:{COORDINATOR_PORT}",
               "--num-processes", str(layout.hosts), "--process-id", str(i), *_worker_args(args, sync_dir),
               "--out", str(sync_dir / f"w{i}.json")]
        log = open(sync_dir / f"w{i}.log", "w")  # noqa: SIM115 - closed by the caller
        logs.append(log)
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                      start_new_session=True))
    return procs


MPI_ENV = ("JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES", "PYTHONPATH")  # forwarded to every rank


def _start_mpi(layout: Layout, args, sync_dir: pathlib.Path, logs: list) -> list[subprocess.Popen]:
    """One mpirun (in namespace 0) that starts one worker rank per namespace through the rsh agent."""
    hostfile, agent = sync_dir / "hostfile", sync_dir / "nsrsh"
    hostfile.write_text(mpi_hostfile(layout))
    agent.write_text(rsh_agent_script(layout))
    agent.chmod(0o755)
    venv_bin = str(pathlib.Path(sys.executable).parent)
    env = mpi_environment(_worker_env(args), venv_bin)
    env["JAX_NUM_CPU_DEVICES"] = "1"
    worker = [sys.executable, str(HERE / "worker.py"), *_worker_args(args, sync_dir),
              "--out", str(sync_dir / "w{pid}.json")]
    cmd = ["timeout", "-s", "KILL", str(int(args.timeout)),
           *mpirun_command(layout, str(hostfile), str(agent), worker, mpirun=os.path.join(venv_bin, "mpirun"),
                           env_names=MPI_ENV)]
    log = open(sync_dir / "mpirun.log", "w")  # noqa: SIM115 - closed by the caller
    logs.append(log)
    return [subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _wait_phase(sync_dir: pathlib.Path, phase: int, hosts: int, procs, logs, deadline: float) -> None:
    want = [sync_dir / f"phase{phase}.p{i}.waiting" for i in range(hosts)]
    while not all(w.exists() for w in want):
        for p, log in zip(procs, logs, strict=True):
            if p.poll() is not None:
                raise RuntimeError(f"{log.name} exited with {p.returncode} before phase {phase}:\n"
                                   f"{pathlib.Path(log.name).read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"phase {phase}: workers not ready before the --timeout")
        time.sleep(0.1)


def run_hosts(hosts: int, args) -> dict:
    """One cluster of ``hosts`` namespaces through every rate; returns the workers' records and the counters."""
    layout = Layout(hosts, args.prefix, args.subnet)
    counters, logs, procs = [], [], []
    deadline = time.monotonic() + args.timeout
    with tempfile.TemporaryDirectory(prefix="jonebit-cluster-") as tmp, Cluster(layout, args.rates[0]) as cluster:
        sync_dir = pathlib.Path(tmp)
        try:
            procs = (_start_mpi if args.launcher == "mpi" else _start_workers)(layout, args, sync_dir, logs)
            # The workers wait at a barrier before every variant of every rate (and at the end): the counters
            # are read at each, the rate changed before a rate's first variant.
            plan = [(rate, name) for rate in args.rates for name in args.variants]
            for k in range(len(plan) + 1):
                _wait_phase(sync_dir, k, hosts, procs, logs, deadline)
                counters.append(cluster.counters())
                rate, name = plan[k] if k < len(plan) else ("end", None)
                if name is not None and (k == 0 or plan[k - 1][0] != rate):
                    cluster.set_rate(rate)
                tmp = sync_dir / f".phase{k}.go.tmp"  # written, then renamed: a worker never reads half a rate
                tmp.write_text(rate)
                tmp.replace(sync_dir / f"phase{k}.go")
                print(f"  hosts={hosts} barrier {k}: {rate} {name or ''}", flush=True)
            for p, log in zip(procs, logs, strict=True):
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
                if rc:
                    raise RuntimeError(f"{log.name} exited with {rc}:\n{pathlib.Path(log.name).read_text()[-3000:]}")
            workers = [json.loads((sync_dir / f"w{i}.json").read_text()) for i in range(hosts)]
        finally:
            _stop(procs)
            for log in logs:
                log.close()
    return dict(hosts=hosts, workers=workers, counters=counters, barriers=[list(b) for b in plan])


def main(args) -> int:
    if args.from_json:
        path = pathlib.Path(args.from_json)
        report = json.loads(path.read_text())
        report.update(bwmodel.summarise(report["raw"], report["args"]["rates"]))  # the model as the code has it now
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(bwmodel.tables(report))
        print(f"wrote {path} and {bwmodel.plot(report, path.with_suffix('.png'))}")
        return 0
    why = missing_requirements()
    if why:
        print(f"benchmarks/cluster: {why}", file=sys.stderr)
        return 2
    if args.cleanup:
        print(f"removed: {cleanup(args.prefix)}")
        return 0
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    stale = leftovers(args.prefix)
    if any(stale.values()):
        raise SystemExit(f"leftovers of an earlier run with prefix {args.prefix!r}: {stale}; remove them with "
                         f"--cleanup --prefix {args.prefix}")
    runs = []
    try:
        for hosts in args.hosts:
            t0 = time.perf_counter()
            runs.append(run_hosts(hosts, args))
            print(f"hosts={hosts}: {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second Ctrl-C must not stop the clean-up
            signal.signal(sig, signal.SIG_IGN)
        left = leftovers(args.prefix)
        if any(left.values()):
            print(f"teardown left {left}; removing", file=sys.stderr)
            cleanup(args.prefix)
    report = {"meta": run_meta(), **bwmodel.summarise(runs, args.rates)}
    report.update(args=vars(args), load_average_at_end=os.getloadavg(), leftovers_after=left,
                  machine=dict(platform=platform.platform(), cpus=os.cpu_count()), raw=runs)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(bwmodel.tables(report))
    png = bwmodel.plot(report, out.with_suffix(".png"))
    print(f"wrote {out}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
