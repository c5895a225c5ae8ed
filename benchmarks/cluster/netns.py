"""An emulated cluster on one machine: network namespaces on a bridge, each link shaped with ``tc`` HTB.

Host ``i`` is the namespace ``{prefix}{i}`` with address ``10.77.0.{i+1}/24`` on the veth ``{prefix}n{i}``; its
peer ``{prefix}h{i}`` is a port of the bridge ``{prefix}br`` in the root namespace. Both ends carry an HTB
qdisc with one class at the link's rate, so the host's upload (egress of ``n{i}``) and its download (egress of
``h{i}``) are each limited, like a full-duplex NIC. The bridge itself is not shaped (the switch is not the
bottleneck).

gloo (jax's CPU collectives) advertises the address its host name resolves to. ``ip netns exec`` bind-mounts
``/etc/netns/<ns>/hosts`` over ``/etc/hosts``, so each namespace gets one mapping the machine's host name to
its own address; that is all gloo needs to connect across namespaces.

Everything here builds argv lists (pure functions, tested without root); :class:`Cluster` runs them and always
tears down what it made. Only names that start with the prefix and addresses in the chosen ``/24`` are touched.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Sequence

DEFAULT_PREFIX = "jbc"
DEFAULT_SUBNET = "10.77.0"
NETNS_ETC = pathlib.Path("/etc/netns")
_IFNAMSIZ = 15  # longest interface name Linux accepts
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$")
_RATE_SCALE = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_SENT = re.compile(r"Sent (\d+) bytes (\d+) pkt")

Runner = Callable[[Sequence[str]], str]


def rate_bits(rate: str) -> float:
    """Bits per second of a ``tc`` rate such as ``"1gbit"`` or ``"200mbit"`` (decimal units, as tc uses)."""
    m = _RATE.match(rate.strip().lower()) if isinstance(rate, str) else None
    if m is None:
        raise ValueError(f"rate must look like '1gbit', '200mbit' or '500kbit' (tc's decimal units), got {rate!r}")
    value = float(m.group(1)) * _RATE_SCALE[m.group(2)]
    if value <= 0:
        raise ValueError(f"rate must be positive, got {rate!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Layout:
    """Names and addresses of an emulated cluster of ``hosts`` namespaces."""

    hosts: int
    prefix: str = DEFAULT_PREFIX
    subnet: str = DEFAULT_SUBNET

    def __post_init__(self):
        if isinstance(self.hosts, bool) or not isinstance(self.hosts, int) or not 1 <= self.hosts <= 250:
            raise ValueError(f"hosts must be an int in [1, 250] (one address each in a /24), got {self.hosts!r}")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", self.prefix):
            raise ValueError(f"prefix must be 1-8 lowercase letters/digits starting with a letter (it starts every "
                             f"namespace and interface name), got {self.prefix!r}")
        parts = self.subnet.split(".")
        if len(parts) != 3 or not all(p.isdigit() and 0 <= int(p) <= 255 for p in parts):
            raise ValueError(f"subnet must be the first three octets of a /24, e.g. '10.77.0', got {self.subnet!r}")
        if len(self.host_veth(self.hosts - 1)) > _IFNAMSIZ:
            raise ValueError(f"prefix {self.prefix!r} makes interface names longer than {_IFNAMSIZ} characters")

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    def netns(self, i: int) -> str:
        return f"{self.prefix}{i}"

    def host_veth(self, i: int) -> str:
        """Bridge side of host ``i``'s link (root namespace): its egress is the host's download."""
        return f"{self.prefix}h{i}"

    def ns_veth(self, i: int) -> str:
        """Namespace side of host ``i``'s link: its egress is the host's upload."""
        return f"{self.prefix}n{i}"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def hosts_file(self, i: int, hostname: str) -> str:
        """``/etc/hosts`` seen inside namespace ``i``: the machine's host name resolves to the namespace's address."""
        return f"127.0.0.1 localhost\n{self.address(i)} {hostname}\n"


def setup_commands(layout: Layout) -> list[list[str]]:
    """argv lists that create the namespaces, the bridge and the (unshaped) links, in order."""
    br = layout.bridge
    cmds = [["ip", "link", "add", br, "type", "bridge"], ["ip", "link", "set", br, "up"]]
    for i in range(layout.hosts):
        ns, h, n = layout.netns(i), layout.host_veth(i), layout.ns_veth(i)
        cmds += [
            ["ip", "netns", "add", ns],
            ["ip", "link", "add", h, "type", "veth", "peer", "name", n],
            ["ip", "link", "set", n, "netns", ns],
            ["ip", "link", "set", h, "master", br],
            ["ip", "link", "set", h, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "addr", "add", f"{layout.address(i)}/24", "dev", n],
            ["ip", "-n", ns, "link", "set", n, "up"],
        ]
    return cmds


def rps_commands(layout: Layout, cpu_mask: str) -> list[list[str]]:
    """Spread receive processing of every veth over the CPUs in ``cpu_mask`` (hex), both ends.

    A veth has no hardware queues: without RPS all its receive work lands on the sending CPU.
    """
    cmds = []
    for i in range(layout.hosts):
        h, n = layout.host_veth(i), layout.ns_veth(i)
        cmds.append(["sh", "-c", f"echo {cpu_mask} > /sys/class/net/{h}/queues/rx-0/rps_cpus"])
        cmds.append(["ip", "netns", "exec", layout.netns(i), "sh", "-c",
                     f"echo {cpu_mask} > /sys/class/net/{n}/queues/rx-0/rps_cpus"])
    return cmds


def _link_ends(layout: Layout, i: int) -> list[list[str]]:
    """``[prefix-args, device]`` of both ends of host ``i``'s link (the namespace end needs ``-n ns``)."""
    return [[layout.host_veth(i)], ["-n", layout.netns(i), layout.ns_veth(i)]]


def shape_commands(layout: Layout, rate: str, *, change: bool = False) -> list[list[str]]:
    """HTB at ``rate`` on both ends of every link: ``add`` a root qdisc and one default class, or ``change``
    the class's rate (counters keep running).

    Args:
      layout: the cluster.
      rate: a tc rate, e.g. ``"1gbit"``; ceil equals rate (no borrowing).
      change: change the rate of the existing classes instead of creating them.
    """
    rate_bits(rate)  # validates
    cmds = []
    for i in range(layout.hosts):
        for *ns, dev in _link_ends(layout, i):
            if not change:
                cmds.append(["tc", *ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"])
            # quantum: one full-size frame per round is enough for a single class and keeps tc from warning.
            cmds.append(["tc", *ns, "class", "change" if change else "add", "dev", dev, "parent", "1:",
                         "classid", "1:10", "htb", "rate", rate, "ceil", rate, "quantum", "1514"])
    return cmds


def counter_commands(layout: Layout) -> dict[tuple[int, str], list[str]]:
    """``(host, "up"|"down") -> argv`` printing that end's qdisc statistics."""
    out = {}
    for i in range(layout.hosts):
        (h,), (*ns, n) = _link_ends(layout, i)
        out[(i, "down")] = ["tc", "-s", "qdisc", "show", "dev", h]
        out[(i, "up")] = ["tc", *ns, "-s", "qdisc", "show", "dev", n]
    return out


def parse_sent_bytes(tc_output: str) -> int:
    """Bytes sent through the root qdisc, from ``tc -s qdisc show dev D`` (its first ``Sent N bytes`` line)."""
    in_root = False
    for line in tc_output.splitlines():
        if line.startswith("qdisc"):
            in_root = " root " in line
            continue
        m = _SENT.search(line)
        if m and in_root:
            return int(m.group(1))
    raise ValueError(f"no 'Sent N bytes' line for a root qdisc in tc output:\n{tc_output}")


def exec_prefix(layout: Layout, i: int) -> list[str]:
    """argv prefix that runs a command inside host ``i``'s namespace (with its ``/etc/hosts``)."""
    return ["ip", "netns", "exec", layout.netns(i)]


# ------------------------------------------------------------------------------------------------- MPI launch
#
# mpirun treats each namespace as a node: the hostfile lists the namespaces' addresses (one slot each), and its
# remote-shell agent is a script that runs the command inside the namespace of the address it is given, as ssh
# would on that host. Every node also gets its own UTS namespace with the namespace's name as host name: with
# one shared host name OpenMPI takes all ranks for one node (its HAN collectives then crashed in the tcp BTL
# here), while distinct names make it see one rank per node, as on a real cluster.


def mpi_hostfile(layout: Layout) -> str:
    """OpenMPI hostfile: one line per host, its address with one slot."""
    return "".join(f"{layout.address(i)} slots=1\n" for i in range(layout.hosts))


def rsh_agent_script(layout: Layout) -> str:
    """``plm_rsh_agent`` for mpirun: ``agent HOST COMMAND...`` runs COMMAND (one shell string, as ssh gets it)
    inside HOST's namespace, under the namespace's name as host name."""
    cases = "".join(f"  {layout.address(i)}|{layout.netns(i)}) ns={layout.netns(i)};;\n" for i in range(layout.hosts))
    return ("#!/bin/sh\n# mpirun's remote shell into the emulated cluster's namespaces: nsrsh HOST COMMAND...\n"
            "host=$1; shift\ncase $host in\n" + cases
            + '  *) echo "nsrsh: $host is no host of this cluster" >&2; exit 255;;\nesac\n'
            'exec ip netns exec "$ns" unshare --uts sh -c "hostname $ns && $*"\n')


def mpirun_command(layout: Layout, hostfile: str, agent: str, argv: Sequence[str], *,
                   mpirun: str = "mpirun", env_names: Sequence[str] = ()) -> list[str]:
    """argv that starts ``argv`` once per host with mpirun, itself running in namespace 0 (host name ``{ns0}``);
    MPI's own traffic (TCP BTL and the runtime's out-of-band channel) is pinned to the cluster's subnet.

    Args:
      layout: the cluster.
      hostfile: path of :func:`mpi_hostfile`'s text.
      agent: path of the executable :func:`rsh_agent_script`.
      argv: the rank program.
      mpirun: the mpirun executable.
      env_names: environment variables forwarded to every rank (``-x``).
    """
    subnet = f"{layout.subnet}.0/24"
    forward = [a for name in env_names for a in ("-x", name)]
    return [*exec_prefix(layout, 0), "unshare", "--uts", "sh", "-c", f'hostname {layout.netns(0)} && exec "$@"',
            "sh", mpirun, "-np", str(layout.hosts), "--hostfile", hostfile, "--bind-to", "none",
            "--mca", "plm_rsh_agent", agent, "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", subnet,
            "--mca", "oob_tcp_if_include", subnet, *forward, *argv]


def mpi_environment(env: dict, venv_bin: str) -> dict:
    """mpirun's environment: ``venv_bin`` first on PATH (its mpirun, prted and python), and as root OpenMPI's
    consent to run as root."""
    env = dict(env, PATH=os.pathsep.join(filter(None, [venv_bin, env.get("PATH")])))
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def teardown_commands(layout: Layout) -> list[list[str]]:
    """argv lists that remove everything :func:`setup_commands` makes. Deleting a namespace deletes its veth
    pair only once the kernel has finished with the namespace (asynchronously), so each pair is also deleted
    by its bridge end; the qdiscs go with the veths. Each may fail harmlessly if that piece is already gone."""
    return ([["ip", "netns", "del", layout.netns(i)] for i in range(layout.hosts)]
            + [["ip", "link", "del", layout.host_veth(i)] for i in range(layout.hosts)]
            + [["ip", "link", "del", layout.bridge]])


def find_leftovers(prefix: str, netns_list: str, link_list: str, etc_entries: Sequence[str] = ()) -> dict:
    """Namespaces, interfaces and ``/etc/netns`` entries of a cluster with this prefix that still exist.

    Args:
      prefix: the cluster's name prefix.
      netns_list: output of ``ip netns list``.
      link_list: output of ``ip -o link show`` (root namespace).
      etc_entries: names in ``/etc/netns``.
    """
    ours = re.compile(rf"^{re.escape(prefix)}(\d+|br|h\d+|n\d+)$")
    netns = [w for line in netns_list.splitlines() if line.split() and ours.match(w := line.split()[0])]
    links = []
    for line in link_list.splitlines():
        m = re.match(r"^\d+:\s+([^:@\s]+)", line)
        if m and ours.match(m.group(1)):
            links.append(m.group(1))
    etc = [e for e in etc_entries if ours.match(e)]
    return {"netns": netns, "links": links, "etc": etc}


def cleanup_commands(leftovers: dict) -> list[list[str]]:
    """argv lists that remove :func:`find_leftovers`'s findings: namespaces first (their veths go with them),
    then interfaces left in the root namespace."""
    cmds = [["ip", "netns", "del", ns] for ns in leftovers["netns"]]
    cmds += [["ip", "link", "del", link] for link in leftovers["links"]]
    return cmds


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie has already left its namespaces)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def kill_namespace_processes(netns: str, runner: Runner) -> list[str]:
    """SIGKILLs every process still inside ``netns`` (started there by this cluster's run: a namespace with a
    live process outlives ``ip netns del`` and keeps its veth). Returns errors instead of raising."""
    errors, killed = [], set()
    deadline = time.monotonic() + 5  # a killed process holds the namespace until it has fully exited
    while True:
        # Scanned again until nothing is left: a process can enter (``ip netns exec``) while we kill the others.
        try:
            pids = [int(p) for p in runner(["ip", "netns", "pids", netns]).split()]
        except Exception as e:  # noqa: BLE001
            if "No such file" in str(e) or "Cannot open" in str(e):
                return errors
            return [*errors, str(e)]
        live = [pid for pid in pids if _alive(pid)]
        if not live or time.monotonic() > deadline:
            return errors + [f"pid {pid} still alive in {netns}" for pid in live]
        for pid in live:
            if pid in killed:
                continue
            killed.add(pid)
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
            except OSError as e:
                errors.append(f"kill {pid} in {netns}: {e}")
        time.sleep(0.02)


def run_command(argv: Sequence[str], timeout: float = 30) -> str:
    """Runs one command; raises ``RuntimeError`` with its stderr on failure."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(argv)}\n{proc.stderr.strip()}")
    return proc.stdout


def missing_requirements() -> str | None:
    """Why an emulated cluster cannot be built here (``None`` when it can): needs root, ``ip`` and ``tc``."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc); run with sudo"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs '{tool}' (iproute2); install it, e.g. apt-get install iproute2"
    return None


class Cluster:
    """Builds the emulated cluster on entry and always removes it on exit.

    Args:
      layout: names and addresses.
      rate: initial HTB rate of every link.
      runner: runs one argv and returns stdout (tests pass a recorder).
      cpu_mask: RPS mask for the veths; ``None``: all CPUs of this machine.
      hostname: the name gloo resolves (default: this machine's host name).
      etc_dir: where the per-namespace ``hosts`` files go (``ip netns exec`` reads ``/etc/netns``).
    """

    def __init__(self, layout: Layout, rate: str, *, runner: Runner = run_command, cpu_mask: str | None = None,
                 hostname: str | None = None, etc_dir: pathlib.Path = NETNS_ETC):
        self.layout, self.rate, self.run = layout, rate, runner
        self.cpu_mask = cpu_mask or format((1 << (os.cpu_count() or 1)) - 1, "x")
        self.hostname = hostname or socket.gethostname()
        self.etc_dir = pathlib.Path(etc_dir)
        self._made_etc_dir = False
        self.torn_down = False

    def __enter__(self) -> Cluster:
        rate_bits(self.rate)
        try:
            self._write_hosts_files()
            for cmd in setup_commands(self.layout) + rps_commands(self.layout, self.cpu_mask):
                self.run(cmd)
            for cmd in shape_commands(self.layout, self.rate):
                self.run(cmd)
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _write_hosts_files(self) -> None:
        if not self.etc_dir.exists():
            self.etc_dir.mkdir(parents=True)
            self._made_etc_dir = True
        for i in range(self.layout.hosts):
            d = self.etc_dir / self.layout.netns(i)
            d.mkdir(exist_ok=True)
            (d / "hosts").write_text(self.layout.hosts_file(i, self.hostname))

    def set_rate(self, rate: str) -> None:
        """Changes every link's rate in place (the qdisc counters keep counting)."""
        for cmd in shape_commands(self.layout, rate, change=True):
            self.run(cmd)
        self.rate = rate

    def counters(self) -> dict[str, list[int]]:
        """Bytes through each host's upload and download qdisc so far: ``{"up": [...], "down": [...]}``."""
        out = {"up": [0] * self.layout.hosts, "down": [0] * self.layout.hosts}
        for (i, direction), cmd in counter_commands(self.layout).items():
            out[direction][i] = parse_sent_bytes(self.run(cmd))
        return out

    def teardown(self) -> list[str]:
        """Removes every namespace, the bridge and the hosts files; returns the errors it met (never raises:
        it runs from ``finally`` blocks and signal handlers)."""
        errors = []
        for i in range(self.layout.hosts):
            errors += kill_namespace_processes(self.layout.netns(i), self.run)
        for cmd in teardown_commands(self.layout):
            try:
                self.run(cmd)
            except Exception as e:  # noqa: BLE001 - a piece that was never made is not an error here
                if "No such file" not in str(e) and "Cannot find device" not in str(e):
                    errors.append(str(e))
        for i in range(self.layout.hosts):
            shutil.rmtree(self.etc_dir / self.layout.netns(i), ignore_errors=True)
        if self._made_etc_dir:
            try:
                self.etc_dir.rmdir()
            except OSError:
                pass
        self.torn_down = True
        return errors
