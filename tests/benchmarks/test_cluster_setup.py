"""The emulated cluster of benchmarks/cluster: command construction, teardown and the bandwidth model without
root; with root and iproute2, a real two-namespace cluster whose shaped links carry a known number of bytes."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from benchmarks.cluster import model
from benchmarks.cluster.netns import (
    Cluster,
    Layout,
    cleanup_commands,
    counter_commands,
    exec_prefix,
    find_leftovers,
    missing_requirements,
    mpi_hostfile,
    mpirun_command,
    parse_sent_bytes,
    rate_bits,
    rsh_agent_script,
    run_command,
    setup_commands,
    shape_commands,
    teardown_commands,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]

TC_OUTPUT = """qdisc htb 1: root refcnt 3 r2q 10 default 0x10 direct_packets_stat 0 direct_qlen 1000
 Sent 5228614 bytes 3612 pkt (dropped 0, overlimits 1203 requeues 0)
 backlog 0b 0p requeues 0
"""


# ----------------------------------------------------------------------------------------------- pure functions


@pytest.mark.parametrize("rate,bits", [("1gbit", 1e9), ("200mbit", 2e8), ("500kbit", 5e5), ("2.5Gbit", 2.5e9)])
def test_rate_bits(rate, bits):
    assert rate_bits(rate) == bits


@pytest.mark.parametrize("rate", ["1gb", "fast", "", "-1mbit", "0mbit", 100])
def test_rate_bits_rejects(rate):
    with pytest.raises(ValueError, match="rate must"):
        rate_bits(rate)


@pytest.mark.parametrize("kwargs,match", [
    (dict(hosts=0), "hosts must be"), (dict(hosts=251), "hosts must be"), (dict(hosts=True), "hosts must be"),
    (dict(hosts=2, prefix="Bad"), "prefix must be"), (dict(hosts=2, prefix="abcdefghi"), "prefix must be"),
    (dict(hosts=2, subnet="10.77"), "subnet must be"), (dict(hosts=2, subnet="10.300.0"), "subnet must be"),
])
def test_layout_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Layout(**kwargs)


def _created_names(cmds):
    """Namespaces and interfaces the setup commands create, read back from the argv lists."""
    netns, links = set(), set()
    for c in cmds:
        if c[:3] == ["ip", "netns", "add"]:
            netns.add(c[3])
        if c[:3] == ["ip", "link", "add"]:
            links.add(c[3])
            if "peer" in c:
                links.add(c[c.index("name") + 1])
    return netns, links


def test_setup_commands_layout():
    layout = Layout(4, prefix="jbx", subnet="10.77.0")
    cmds = setup_commands(layout)
    netns, links = _created_names(cmds)
    assert netns == {"jbx0", "jbx1", "jbx2", "jbx3"}
    assert links == {"jbxbr"} | {f"jbxh{i}" for i in range(4)} | {f"jbxn{i}" for i in range(4)}
    addrs = [c[c.index("add") + 1] for c in cmds if c[:2] == ["ip", "-n"] and "addr" in c]
    assert addrs == ["10.77.0.1/24", "10.77.0.2/24", "10.77.0.3/24", "10.77.0.4/24"]
    for i in range(4):
        ns, n, h = f"jbx{i}", f"jbxn{i}", f"jbxh{i}"
        # each namespace end is moved into its own namespace before it is addressed there, and its peer joins
        # the bridge
        moved = cmds.index(["ip", "link", "set", n, "netns", ns])
        addressed = next(k for k, c in enumerate(cmds) if c[:3] == ["ip", "-n", ns] and "addr" in c)
        assert moved < addressed
        assert ["ip", "link", "set", h, "master", "jbxbr"] in cmds
        assert cmds.index(["ip", "netns", "add", ns]) < moved
    # the bridge exists before any port joins it
    assert cmds.index(["ip", "link", "add", "jbxbr", "type", "bridge"]) == 0


def test_teardown_removes_everything_setup_makes():
    """Every namespace, the bridge, and every veth pair (by its bridge end: deleting one end deletes both) are
    deleted by name; namespaces first."""
    layout = Layout(3, prefix="jbx")
    netns, links = _created_names(setup_commands(layout))
    down = teardown_commands(layout)
    deleted_ns = {c[3] for c in down if c[:3] == ["ip", "netns", "del"]}
    deleted_links = {c[3] for c in down if c[:3] == ["ip", "link", "del"]}
    assert deleted_ns == netns
    assert links - deleted_links == {f"jbxn{i}" for i in range(3)}  # the peers of deleted ends
    assert deleted_links == {"jbxbr"} | {f"jbxh{i}" for i in range(3)}
    assert all(c[1] == "netns" for c in down[:3])


def test_shape_commands_both_ends():
    layout = Layout(2, prefix="jbx")
    cmds = shape_commands(layout, "200mbit")
    for i in range(2):
        for ends in (["dev", f"jbxh{i}"], ["-n", f"jbx{i}"]):
            qdisc = [c for c in cmds if "qdisc" in c and all(e in c for e in ends)]
            klass = [c for c in cmds if "class" in c and all(e in c for e in ends)]
            assert len(qdisc) == 1 and "htb" in qdisc[0] and "root" in qdisc[0]
            assert len(klass) == 1
            assert klass[0][klass[0].index("rate") + 1] == "200mbit" == klass[0][klass[0].index("ceil") + 1]
    assert len(cmds) == 2 * 2 * 2
    change = shape_commands(layout, "1gbit", change=True)
    assert len(change) == 4 and all("change" in c and "qdisc" not in c for c in change)
    with pytest.raises(ValueError, match="rate must"):
        shape_commands(layout, "1 gigabit")


def test_counter_commands_and_parse():
    layout = Layout(2, prefix="jbx")
    cmds = counter_commands(layout)
    assert cmds[(1, "down")] == ["tc", "-s", "qdisc", "show", "dev", "jbxh1"]
    assert cmds[(1, "up")] == ["tc", "-n", "jbx1", "-s", "qdisc", "show", "dev", "jbxn1"]
    assert parse_sent_bytes(TC_OUTPUT) == 5228614
    # a child qdisc's counters are not the root's
    child_first = "qdisc fq_codel 10: parent 1:10 limit 10240p\n Sent 7 bytes 1 pkt\n" + TC_OUTPUT
    assert parse_sent_bytes(child_first) == 5228614
    with pytest.raises(ValueError, match="no 'Sent N bytes'"):
        parse_sent_bytes("qdisc noqueue 0: root refcnt 2\n")


def test_exec_prefix():
    assert exec_prefix(Layout(2, prefix="jbx"), 1) == ["ip", "netns", "exec", "jbx1"]
    assert Layout(2).hosts_file(1, "vm") == "127.0.0.1 localhost\n10.77.0.2 vm\n"


def test_find_leftovers_only_ours():
    netns = "jbx1 (id: 3)\njbx0\njbxy\nother0\njbx12\n"
    links = ("1: lo: <LOOPBACK,UP> mtu 65536\n2: eth0: <BROADCAST> mtu 1500\n"
             "7: jbxbr: <BROADCAST,MULTICAST,UP> mtu 1500\n9: jbxh1@if8: <BROADCAST> mtu 1500\n"
             "11: jbxhh@if3: <BROADCAST> mtu 1500\n12: jbxbrother: <BROADCAST> mtu 1500\n")
    found = find_leftovers("jbx", netns, links, ["jbx0", "other", "jbx1x"])
    assert found == {"netns": ["jbx1", "jbx0", "jbx12"], "links": ["jbxbr", "jbxh1"], "etc": ["jbx0"]}
    assert cleanup_commands(found) == [["ip", "netns", "del", "jbx1"], ["ip", "netns", "del", "jbx0"],
                                       ["ip", "netns", "del", "jbx12"], ["ip", "link", "del", "jbxbr"],
                                       ["ip", "link", "del", "jbxh1"]]


def test_mpi_hostfile_and_command():
    layout = Layout(3, prefix="jbx", subnet="10.77.5")
    assert mpi_hostfile(layout) == "10.77.5.1 slots=1\n10.77.5.2 slots=1\n10.77.5.3 slots=1\n"
    cmd = mpirun_command(layout, "/t/hosts", "/t/nsrsh", ["python", "w.py"], env_names=["PYTHONPATH"])
    # mpirun runs in namespace 0 under that namespace's name as host name, then starts 3 ranks
    assert cmd[:4] == exec_prefix(layout, 0) and cmd[4:6] == ["unshare", "--uts"] and "hostname jbx0" in cmd[8]
    i = cmd.index("mpirun")
    assert cmd[i + 1:i + 5] == ["-np", "3", "--hostfile", "/t/hosts"] and cmd[-2:] == ["python", "w.py"]
    mca = {cmd[k + 1]: cmd[k + 2] for k in range(len(cmd) - 2) if cmd[k] == "--mca"}
    assert mca == {"plm_rsh_agent": "/t/nsrsh", "btl": "tcp,self", "btl_tcp_if_include": "10.77.5.0/24",
                   "oob_tcp_if_include": "10.77.5.0/24"}
    assert cmd[cmd.index("-x") + 1] == "PYTHONPATH"


def test_rsh_agent_enters_the_hosts_namespace(tmp_path):
    """The agent, run with a stand-in ``ip`` that prints its argv: the host's address (or namespace name) picks
    its namespace, the command string reaches ``sh -c`` whole; an unknown host fails like an unreachable one."""
    agent = tmp_path / "nsrsh"
    agent.write_text(rsh_agent_script(Layout(2, prefix="jbx", subnet="10.77.5")))
    agent.chmod(0o755)
    (tmp_path / "ip").write_text('#!/bin/sh\nfor a in "$@"; do echo "[$a]"; done\n')
    (tmp_path / "ip").chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}")
    for host in ("10.77.5.2", "jbx1"):
        out = subprocess.run([str(agent), host, "A=1;export A;prted", "--x", "y z"], env=env, capture_output=True,
                             text=True, check=True).stdout
        assert out.splitlines() == ["[netns]", "[exec]", "[jbx1]", "[unshare]", "[--uts]", "[sh]", "[-c]",
                                    "[hostname jbx1 && A=1;export A;prted --x y z]"]
    bad = subprocess.run([str(agent), "10.77.5.9", "true"], env=env, capture_output=True, text=True)
    assert bad.returncode == 255 and "no host of this cluster" in bad.stderr


class Recorder:
    """Stands in for the command runner: records argv lists, fails on the ``fail_at``-th call."""

    def __init__(self, fail_at: int | None = None, fail_teardown: bool = False):
        self.calls, self.fail_at, self.fail_teardown = [], fail_at, fail_teardown

    def __call__(self, argv):
        self.calls.append(list(argv))
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise RuntimeError("command failed (2): simulated")
        if self.fail_teardown and argv[:3] in (["ip", "netns", "del"], ["ip", "link", "del"]):
            raise RuntimeError("command failed (1): Device or resource busy")
        if argv[:3] == ["ip", "netns", "pids"]:
            return ""
        return TC_OUTPUT if "-s" in argv else ""


def test_cluster_setup_and_teardown_order(tmp_path):
    layout = Layout(2, prefix="jbx")
    rec = Recorder()
    etc = tmp_path / "netns"
    with Cluster(layout, "1gbit", runner=rec, hostname="node", etc_dir=etc) as c:
        assert (etc / "jbx1" / "hosts").read_text() == "127.0.0.1 localhost\n10.77.0.2 node\n"
        assert rec.calls[: len(setup_commands(layout))] == setup_commands(layout)
        assert rec.calls[-len(shape_commands(layout, "1gbit")):] == shape_commands(layout, "1gbit")
        assert c.counters() == {"up": [5228614, 5228614], "down": [5228614, 5228614]}
        c.set_rate("200mbit")
        assert rec.calls[-4:] == shape_commands(layout, "200mbit", change=True)
        n_before = len(rec.calls)
    down = rec.calls[n_before:]
    assert down[:2] == [["ip", "netns", "pids", "jbx0"], ["ip", "netns", "pids", "jbx1"]]
    assert down[2:] == teardown_commands(layout)
    assert not etc.exists()  # made by the cluster, so removed by it


@pytest.mark.parametrize("fail_at", [1, 5, 13, 19])
def test_cluster_tears_down_when_setup_fails(tmp_path, fail_at):
    layout = Layout(2, prefix="jbx")
    rec = Recorder(fail_at=fail_at)
    etc = tmp_path / "netns"
    etc.mkdir()
    (etc / "unrelated").mkdir()
    with pytest.raises(RuntimeError, match="simulated"):
        with Cluster(layout, "1gbit", runner=rec, etc_dir=etc):
            pytest.fail("the body must not run when setup failed")
    assert rec.calls[-len(teardown_commands(layout)):] == teardown_commands(layout)
    assert sorted(os.listdir(etc)) == ["unrelated"]  # its own files only; a directory it did not make stays


def test_cluster_tears_down_on_error_in_body_and_never_raises(tmp_path):
    layout = Layout(2, prefix="jbx")
    rec = Recorder(fail_teardown=True)
    with pytest.raises(KeyboardInterrupt):
        with Cluster(layout, "1gbit", runner=rec, etc_dir=tmp_path / "netns") as c:
            raise KeyboardInterrupt
    assert c.torn_down
    # every teardown command ran although each one failed; the errors are returned, not raised
    n = len(teardown_commands(layout))
    assert rec.calls[-n:] == teardown_commands(layout)
    assert len(c.teardown()) == n


# ---------------------------------------------------------------------------------------------- bandwidth model


def test_host_link_bytes_rings_and_all_to_all():
    """Per-host link bytes, by hand: a ring member sends everything to the next member, an all-to-all member an
    equal share to every other; groups inside a host cost nothing on the link."""
    from jonebit.comm.accounting import Collective

    two_by_two = [0, 0, 1, 1]  # devices 0, 1 on host 0; 2, 3 on host 1
    ar = Collective("all-reduce", 4000, 4, "main")  # each member sends 2 * 3/4 * 4000 = 6000
    # ring 0 -> 1 -> 2 -> 3 -> 0: one crossing edge out of each host
    assert model.host_link_bytes([ar], two_by_two) == pytest.approx(6000)
    # one device per host: every edge crosses, the per-device accounting
    assert model.host_link_bytes([ar], [0, 1, 2, 3]) == pytest.approx(6000)
    # interleaved hosts (0, 1, 0, 1): every edge crosses, both devices of a host send
    assert model.host_link_bytes([ar], [0, 1, 0, 1]) == pytest.approx(12000)
    a2a = Collective("all-to-all", 4000, 4, "main")  # each member sends 3/4 * 4000 = 3000, 1000 to each other
    assert model.host_link_bytes([a2a], two_by_two) == pytest.approx(2 * 2000)
    local = Collective("reduce-scatter", 1000, 2, "main", groups=((0, 1), (2, 3)))
    across = Collective("all-gather", 1000, 2, "main", groups=((0, 2), (1, 3)))  # each sends 500, all crossing
    assert model.host_link_bytes([local], two_by_two) == 0
    assert model.host_link_bytes([across, local], two_by_two) == pytest.approx(2 * 500)
    looped = Collective("all-to-all", 4000, 4, "main", trips=3)
    assert model.host_link_bytes([looped], two_by_two) == pytest.approx(3 * 4000)


# A conditional whose branch 1 holds a nested one: the shape of 0/1 Adam's step (phase, then kind of step).
NESTED_HLO = """%inner_a (p: f32[8]) -> f32[8] {
  %ar = f32[8]{0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
}

%inner_b (p: f32[8]) -> f32[8] {
  %a2a = u8[2,4]{1,0} all-to-all(%p), replica_groups={{0,1}}
}

%outer_0 (p: f32[8]) -> f32[8] {
  %ag = u8[2,2]{1,0} all-gather(%p), replica_groups={{0,1}}
}

%outer_1 (p: f32[8]) -> f32[8] {
  %rs = f32[4]{0} reduce-scatter(%p), replica_groups={{0,1}}, to_apply=%add
  %c = f32[8]{0} conditional(%i, %p, %p), branch_computations={%inner_a, %inner_b}
}

ENTRY %main (p: f32[8]) -> f32[8] {
  %loss = f32[]{} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
  %c = f32[8]{0} conditional(%j, %p, %p), branch_computations={%outer_0, %outer_1}
}
"""


def test_stage_collectives_of_nested_branches():
    from jonebit.comm.accounting import comm_report

    report = comm_report(NESTED_HLO, 2)
    ops = lambda branch: sorted(c.op for c in model.stage_collectives(report, NESTED_HLO, branch))  # noqa: E731
    assert ops(0) == ["all-gather", "all-reduce"]
    # comm_report merges the nested conditional into branch 1; a stage takes one inner branch, plus what branch 1
    # runs unconditionally (the reduce-scatter) and the step's unconditional loss all-reduce
    assert ops(1) == ["all-reduce", "all-reduce", "all-to-all", "reduce-scatter"]
    assert ops((1, 0)) == ["all-reduce", "all-reduce", "reduce-scatter"]
    assert ops((1, 1)) == ["all-reduce", "all-to-all", "reduce-scatter"]
    with pytest.raises(ValueError, match="no conditional inside branch 0"):
        model.stage_collectives(report, NESTED_HLO, (0, 0))


# Lines of a compiled 1-bit Adam step with mpi_comm (mpi4jax 0.9, trimmed): the calls return (array, token).
MPI_HLO = """%comp (a: u8[2,139]) -> u8[2,139] {
  %alltoall_mpi.3 = (u8[2,139]{1,0}, token[]) custom-call(%concatenate.5, %t), custom_call_target="mpi_alltoall_ffi", \
operand_layout_constraints={u8[2,139]{1,0}, token[]}, custom_call_has_side_effect=true
  %allgather_mpi.3 = (u8[2,139]{1,0}, token[]) custom-call(%f, %alltoall_mpi.5), custom_call_target="mpi_allgather_ffi"
}

%warm (a: f32[2,1073]) -> f32[2,1073] {
  %alltoall_mpi.9 = (f32[2,1073]{1,0}, token[]) custom-call(%p, %t), custom_call_target="mpi_alltoall_ffi"
  %allgather_mpi.9 = (f32[2,1073]{1,0}, token[]) custom-call(%a, %t), custom_call_target="mpi_allgather_ffi"
}

ENTRY %main.29 (Arg_0.31: token[]) -> f32[] {
  %allreduce_mpi.3 = (s32[], token[]) custom-call(%n, %Arg_0.31), custom_call_target="mpi_allreduce_ffi"
  %cond.14 = (token[], f32[33]{0}) conditional(%s, %c11, %c12), branch_computations={%comp, %warm}
  %other = (f32[4]{0}, token[]) custom-call(%x), custom_call_target="something_else"
}
"""


def test_mpi_calls_costed_as_collectives():
    from jonebit.comm.accounting import comm_report

    report = comm_report(model.mpi_as_collectives(MPI_HLO), 2)
    assert [(c.op, c.result_bytes) for c in report.always] == [("all-reduce", 4)]
    (comp, warm), = report.branches
    assert [(c.op, c.result_bytes) for c in comp] == [("all-to-all", 278), ("all-gather", 278)]
    # 2 ranks: the alltoall and the allgather each send half their result: the fp32 buffer once in all
    assert sum(c.bytes_sent for c in warm) == 2 * 1073 * 4


def test_predict_and_rounds():
    # 10 MB at 200 Mbit/s is 0.4 s on the wire
    assert model.predict(0.25, 10e6, "200mbit") == pytest.approx(0.65)
    assert model.predict(0.25, 10e6, 2e8, latency_s=1e-3, rounds=6) == pytest.approx(0.656)
    assert model.message_rounds(["all-reduce"], 4) == 6
    assert model.message_rounds(["all-to-all", "all-gather"], 4) == 6
    assert model.message_rounds(["all-reduce", "collective-permute"], 8) == 15
    assert model.message_rounds(["all-reduce"], 1) == 0


def test_fit_two_term_recovers_line():
    pts = [(x, 0.3 + 1.2 * x) for x in (0.1, 0.5, 2.0)]
    c, s = model.fit_two_term(pts)
    assert (c, s) == (pytest.approx(0.3), pytest.approx(1.2))
    with pytest.raises(ValueError, match="at least 2 points"):
        model.fit_two_term(pts[:1])
    with pytest.raises(ValueError, match="same wire time"):
        model.fit_two_term([(1.0, 2.0), (1.0, 3.0)])


def _fake_run(hosts=2, times=((0.5, 0.2), (1.9, 0.25))):
    """Worker records shaped like worker.py's, with round numbers; ``times``: (adam, compression) per rate."""
    phases = []
    for adam, comp in times:
        phases.append(dict(variants={
            "adam": dict(dist_s={"step": [adam, adam * 1.1, adam * 0.9]}, local_s={"step": [0.1, 0.1, 0.1]},
                         dist_steps={"step": 4}),
            "onebit": dict(dist_s={"warmup": [adam] * 3, "compression": [comp, comp, comp * 1.2]},
                           local_s={"warmup": [0.1] * 3, "compression": [0.15] * 3},
                           dist_steps={"warmup": 4, "compression": 4})}))
    worker = dict(comm_bytes_per_step={"adam": {"step": 40e6}, "onebit": {"warmup": 40e6, "compression": 1.25e6}},
                  phases=phases)
    per_phase = 4 * 40e6 + 4 * 40e6 + 4 * 1.25e6
    counters = [dict(up=[k * per_phase * 1.05] * hosts, down=[k * per_phase * 1.05] * hosts)
                for k in range(len(times) + 1)]
    return dict(hosts=hosts, workers=[worker] * hosts, counters=counters)


def test_summarise_rows_links_and_speedups():
    report = model.summarise([_fake_run()], ["1gbit", "200mbit"])
    assert all(link["mean_ratio"] == pytest.approx(1.05) for link in report["links"])
    rows = {(r["rate"], r["variant"], r["stage"]): r for r in report["rows"]}
    adam = rows[("200mbit", "adam", "step")]
    assert adam["measured"]["median"] == pytest.approx(1.9)
    assert adam["measured"]["spread"] == pytest.approx((1.9 * 1.1 - 1.9 * 0.9) / 1.9)
    assert adam["model_s"] == pytest.approx(0.1 + 8 * 40e6 * 1.05 / 2e8)
    comp = rows[("200mbit", "onebit", "compression")]
    assert comp["model_s"] == pytest.approx(0.15 + 8 * 1.25e6 * 1.05 / 2e8)
    assert comp["speedup_vs_adam"] == pytest.approx(1.9 / 0.25)
    # the two rates give the line through both adam points
    x1, x2 = 8 * 42e6 / 1e9, 8 * 42e6 / 2e8
    slope = (1.9 - 0.5) / (x2 - x1)
    assert adam["fit_slope"] == pytest.approx(slope)
    assert adam["fit_compute_s"] == pytest.approx(0.5 - slope * x1)
    # 15% of the steps in warmup (adam's time), 85% compressed
    (w,) = [w for w in report["whole_run"] if w["rate"] == "200mbit"]
    assert w["speedup"] == pytest.approx(1.9 / (0.15 * 1.9 + 0.85 * 0.25))
    assert "model_unshaped_s" not in adam  # no phase fast enough to count as unshaped
    text = model.tables(report)
    assert "| 2 | 200mbit | onebit compression | 1.25 |" in text


def test_summarise_unshaped_compute():
    """A 10gbit phase gives the second model's compute: its median minus its own (small) wire time."""
    report = model.summarise([_fake_run(times=((0.9, 0.3), (1.0, 0.3), (2.5, 0.35)))], ["10gbit", "1gbit", "200mbit"])
    rows = {(r["rate"], r["variant"], r["stage"]): r for r in report["rows"]}
    wire = 40e6 * 1.05
    compute = 0.9 - 8 * wire / 1e10
    assert rows[("200mbit", "adam", "step")]["unshaped_compute_s"] == pytest.approx(compute)
    assert rows[("200mbit", "adam", "step")]["model_unshaped_s"] == pytest.approx(compute + 8 * wire / 2e8)
    # the compression stage's rates change its wire time by less than the noise: no line is fitted
    assert "fit_slope" not in rows[("200mbit", "onebit", "compression")]


# ------------------------------------------------------------------------------------- real cluster (root only)

needs_root = pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements()))

RECEIVER = """
import socket, sys
s = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
c, _ = s.accept()
n = 0
while (d := c.recv(1 << 20)):
    n += len(d)
print(n, flush=True)
"""


def _no_leftovers(prefix):
    found = find_leftovers(prefix, run_command(["ip", "netns", "list"]), run_command(["ip", "-o", "link", "show"]),
                           os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else [])
    return not any(found.values()), found


@needs_root
@pytest.mark.slow
def test_real_cluster_shapes_and_counts_bytes():
    """5 MB from host 0 to host 1 over 40 Mbit/s links: takes at least the wire time, the sender's upload and the
    receiver's download qdiscs each count the payload plus TCP/IP framing, nothing else moves, and nothing is
    left after teardown (not even with a process still running inside a namespace)."""
    layout, payload, rate = Layout(2, prefix="jbt", subnet="10.77.9"), 5_000_000, "40mbit"
    assert _no_leftovers("jbt")[0], "leftovers of an earlier run: python benchmarks/cluster/run.py --cleanup " \
                                    "--prefix jbt"
    with Cluster(layout, rate) as cluster:
        # gloo's rule: the machine's host name resolves, inside each namespace, to that namespace's address
        seen = run_command(exec_prefix(layout, 1) + ["getent", "hosts", socket.gethostname()])
        assert seen.split()[0] == "10.77.9.2"
        before = cluster.counters()
        rx = subprocess.Popen(exec_prefix(layout, 1) + [sys.executable, "-c", RECEIVER, "9100"],
                              stdout=subprocess.PIPE, text=True)
        assert rx.stdout.readline().strip() == "ready"
        send = f"import socket; s = socket.create_connection(('10.77.9.2', 9100)); s.sendall(b'x' * {payload})"
        t0 = time.perf_counter()
        run_command(exec_prefix(layout, 0) + [sys.executable, "-c", send], timeout=60)
        got = int(rx.communicate(timeout=60)[0].strip())
        elapsed = time.perf_counter() - t0
        after = cluster.counters()
        sleeper = subprocess.Popen(exec_prefix(layout, 0) + ["sleep", "300"])
        # Inside the namespace before teardown starts (``ip netns exec`` joins it, then becomes ``sleep``).
        deadline = time.monotonic() + 60  # a hang guard
        while str(sleeper.pid) not in run_command(["ip", "netns", "pids", layout.netns(0)]).split():
            assert time.monotonic() < deadline, "the sleeper never entered the namespace"
            time.sleep(0.02)
    assert got == payload
    assert elapsed >= 0.9 * 8 * payload / rate_bits(rate)
    up0, down1 = after["up"][0] - before["up"][0], after["down"][1] - before["down"][1]
    # At least the payload plus Ethernet/IP/TCP headers: 66 bytes per full 1448-byte segment at MTU 1500 (4.6%).
    # At most that plus retransmissions, which a loaded machine can cause when the shaper's queue overflows; a
    # second copy of the payload is far above the 10% allowed here, so a double count still fails.
    framed = payload + -(-payload // 1448) * 66
    for sent in (up0, down1):
        assert framed <= sent < 1.10 * framed, (sent, framed)
    # The reverse direction carries only ACKs: 66 bytes each, at most one per data segment (delayed ACKs halve
    # that; a slow receiver adds window updates but never more than one per segment it reads).
    assert after["up"][1] - before["up"][1] <= -(-payload // 1448) * 66 * 1.5
    assert sleeper.wait(timeout=120) == -signal.SIGKILL  # a hang guard; teardown kills it at once
    ok, found = _no_leftovers("jbt")
    assert ok, found


@needs_root
@pytest.mark.slow
def test_run_script_tears_down_on_sigterm():
    """The benchmark driver killed while its workers start leaves no namespace, interface or hosts file."""
    assert _no_leftovers("jbs")[0]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cluster" / "run.py"), "--hosts", "2", "--rates", "100mbit",
           "--model", "tiny", "--repeats", "1", "--prefix", "jbs", "--subnet", "10.77.8", "--timeout", "120",
           "--out", "/dev/null"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while "jbs1" not in run_command(["ip", "netns", "list"]):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
            time.sleep(0.1)
        time.sleep(1.0)  # workers are starting inside the namespaces
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "signal 15" in out
    ok, found = _no_leftovers("jbs")
    assert ok, found


# ------------------------------------------------------------------------------------------- worker (no root)


def test_variant_stage_bytes_match_formulas():
    """The stages' bytes come from the right branches of the compiled 1-bit step: warmup is the fp32 ring
    all-reduce of the gradients, compression the spec's 1-bit formula; Adam's step is the fp32 all-reduce."""
    import jax
    import numpy as np

    from benchmarks.cluster import worker
    from jonebit.comm import compressed_bytes_per_rank
    from jonebit.comm.accounting import comm_report

    p = 4
    params = {"w": np.ones((64, 33), np.float32), "b": np.zeros((33,), np.float32)}
    n = 64 * 33 + 33

    def loss_fn(q, batch):
        return jax.numpy.mean((batch @ q["w"] + q["b"]) ** 2)

    batch = {"x": np.ones((p * 2, 64), np.float32)}
    got = {}
    for name in ("adam", "onebit"):
        v = worker.VARIANTS[name]
        runner = worker.Runner(lambda q, b: loss_fn(q, b["x"]), v, params, v.mesh(jax.devices()[:p]), batch,
                               freeze_step=2)
        got[name] = v.stage_bytes(comm_report(runner.compiled.as_text(), p))
        assert runner.step() > 0
    ring = 2 * (p - 1) / p * 4  # fp32 all-reduce, bytes per element
    loss = ring * 1  # the step also averages the loss (one f32)
    assert got["adam"] == {"step": pytest.approx(ring * n + loss)}
    # The bare optimizer sends nothing else (non-finite skipping is the engine's, or skip_nonfinite's).
    assert got["onebit"]["warmup"] == pytest.approx(ring * n + loss)
    assert got["onebit"]["compression"] == pytest.approx(compressed_bytes_per_rank(n, p) + loss)


def test_hierarchical_variant_sends_only_one_bit_between_hosts():
    """The hierarchical row on 2 hosts x 2 devices: in compression only the 1-bit exchange of each device's
    half crosses hosts (plus the loss scalar), 1/2 of what flat compression over 4 devices sends
    out of a host; warmup crosses like the flat fp32 all-reduce."""
    import dataclasses

    import jax
    import numpy as np

    from benchmarks.cluster import worker
    from jonebit.comm import compressed_bytes_per_rank
    from jonebit.comm.accounting import comm_report
    from jonebit.comm.hierarchical import shard_size

    params = {"w": np.ones((64, 33), np.float32), "b": np.zeros((33,), np.float32)}
    n = 64 * 33 + 33
    devices = jax.devices()[:4]
    two_by_two = [0, 0, 1, 1]
    hier = dataclasses.replace(
        worker.VARIANTS["onebit_hier"],
        make_mesh=lambda devs: jax.sharding.Mesh(np.array(devs).reshape(2, 2), worker.HIER_AXES,
                                                 axis_types=(jax.sharding.AxisType.Explicit,) * 2))
    got = {}
    for name, v in (("flat", worker.VARIANTS["onebit"]), ("hier", hier)):
        runner = worker.Runner(lambda q, b: jax.numpy.mean((b["x"] @ q["w"] + q["b"]) ** 2), v, params,
                               v.mesh(devices), {"x": np.ones((8, 64), np.float32)}, freeze_step=2)
        report = comm_report(runner.compiled.as_text(), 4)
        got[name] = {s: model.host_link_bytes(c, two_by_two) for s, c in v.stage_collectives(report).items()}
        assert runner.step() > 0
    scalars = 2 * 3 / 4 * 4  # the loss mean: a 4-byte ring over 4 devices, one edge per host
    assert got["hier"]["compression"] == pytest.approx(2 * compressed_bytes_per_rank(shard_size(n, 2), 2) + scalars)
    # flat: the all-to-all's and all-gather's bytes, 2 devices per host; the all-gather is a ring (one edge out)
    assert got["hier"]["compression"] < 0.6 * got["flat"]["compression"]
    assert got["hier"]["warmup"] == pytest.approx(got["flat"]["warmup"])


def test_zero_one_adam_and_lamb_variants():
    """0/1 Adam's four stages, each entered by setting its counters: their bytes come from the right nested
    branches (variance: the fp32 all-reduce; 1-bit and sync: the 1-bit exchange; local: only the loss), and the
    steps really take them: ranks' params part during local steps and are equal again after a sync. 1-bit LAMB's
    stages are 1-bit Adam's."""
    import jax
    import numpy as np

    from benchmarks.cluster import worker
    from jonebit.comm import compressed_bytes_per_rank
    from jonebit.comm.accounting import comm_report

    p, n = 2, 64 * 33 + 33
    params = {"w": np.ones((64, 33), np.float32) / 64, "b": np.zeros((33,), np.float32)}
    batch = {"x": np.random.default_rng(0).normal(size=(2 * p, 64)).astype(np.float32)}  # differs per rank

    def loss_fn(q, b):
        return jax.numpy.mean((b["x"] @ q["w"] + q["b"] - 1.0) ** 2)

    ring, loss = 2 * (p - 1) / p * 4, 2 * (p - 1) / p * 4
    zo = worker.VARIANTS["zero_one_adam"]
    runner = worker.Runner(loss_fn, zo, params, zo.mesh(jax.devices()[:p]), batch, freeze_step=2)
    hlo = runner.compiled.as_text()
    got = zo.stage_bytes(comm_report(hlo, p), hlo)
    one_bit = compressed_bytes_per_rank(n, p) + loss
    assert got == {"variance": pytest.approx(ring * n + loss), "onebit": pytest.approx(one_bit),
                   "local": pytest.approx(loss), "sync": pytest.approx(one_bit)}
    apart = {}
    for stage in zo.stages:
        runner.state = runner._enter[stage](runner.state)
        runner.step(), runner.step()
        w = np.asarray(runner.params["w"])
        apart[stage] = float(np.abs(w[0] - w[1]).max())
        if stage == "onebit":
            assert int(runner.state.var_updates) == 2  # the variance moved in the variance stage only
    assert apart["variance"] == apart["onebit"] == 0 < apart["local"]
    assert apart["sync"] < 1e-2 * apart["local"]  # equal up to rounding (p - u + w / denom)
    assert np.isfinite(np.asarray(runner.params["w"])).all()

    lamb = worker.VARIANTS["onebit_lamb"]
    runner = worker.Runner(loss_fn, lamb, params, lamb.mesh(jax.devices()[:p]), batch, freeze_step=2)
    hlo = runner.compiled.as_text()
    got = lamb.stage_bytes(comm_report(hlo, p), hlo)
    assert got["warmup"] == pytest.approx(ring * n + loss)
    assert got["compression"] == pytest.approx(one_bit)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_worker_protocol_on_loopback(tmp_path):
    """Two workers on 127.0.0.1 (no namespaces, no root) go through a phase at the driver's file barrier, time
    every stage and write their records; the driver's side is played here."""
    import json

    from jonebit.sharding.mesh import free_port
    from tests.mpi_util import worker_env

    cmd = [sys.executable, str(ROOT / "benchmarks" / "cluster" / "worker.py"), "--coordinator",
           f"127.0.0.1:{free_port()}", "--num-processes", "2", "--model", "tiny", "--batch", "2", "--seq", "16",
           "--repeats", "2", "--phases", "1", "--sync-dir", str(tmp_path), "--barrier-timeout", "200",
           "--variants", "adam", "onebit"]  # the two this test checks; the others have their own tests
    procs = [subprocess.Popen(cmd + ["--process-id", str(i), "--out", str(tmp_path / f"w{i}.json")], cwd=ROOT,
                              env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
        for phase, go in ((0, "1gbit"), (1, "1gbit"), (2, "end")):  # a barrier before each variant, one at the end
            deadline = time.monotonic() + 240
            while not all((tmp_path / f"phase{phase}.p{i}.waiting").exists() for i in range(2)):
                assert all(p.poll() is None for p in procs), [p.communicate()[0][-2000:] for p in procs]
                assert time.monotonic() < deadline, "workers did not reach the barrier"
                time.sleep(0.2)
            (tmp_path / f".phase{phase}.go.tmp").write_text(go)  # as run.py: written, then renamed
            (tmp_path / f".phase{phase}.go.tmp").replace(tmp_path / f"phase{phase}.go")
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [o[-2000:] for o in outs]
    for i in range(2):
        rec = json.loads((tmp_path / f"w{i}.json").read_text())
        assert rec["process_id"] == i and rec["num_processes"] == 2 and rec["devices"] == 2
        (phase,) = rec["phases"]
        assert phase["rate"] == "1gbit"
        assert phase["variants"]["adam"]["dist_steps"] == {"step": 3}
        assert phase["variants"]["onebit"]["dist_steps"] == {"warmup": 3, "compression": 3}
        assert all(len(t) == 2 and min(t) > 0 for v in phase["variants"].values() for t in v["dist_s"].values())
        comm = rec["comm_bytes_per_step"]
        # 2 ranks: a ring all-reduce sends the whole array once; plus the loss (one f32) and, for 1-bit Adam, its
        # non-finite flag (one f32)
        assert comm["adam"]["step"] == pytest.approx(4 * rec["params"] + 4)
        assert comm["onebit"]["warmup"] == pytest.approx(4 * rec["params"] + 4 + 4)
        assert comm["onebit"]["compression"] < comm["adam"]["step"] / 30


@pytest.mark.parametrize("argv,match", [
    (["--rates", "1gb"], "--rates: rate must look like"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--batch", "3", "--devices-per-host", "2"], "must be divisible by --devices-per-host 2"),
    (["--hosts", "2", "0"], "--hosts must all be at least 1"),
])
def test_run_rejects_bad_arguments(argv, match, capsys):
    from benchmarks.cluster import run

    with pytest.raises(SystemExit, match="^2$"):  # argparse's usage error; the message goes to stderr
        run.parse_args(argv)
    assert match in capsys.readouterr().err
