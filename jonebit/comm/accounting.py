"""Bytes moved by the collectives of a compiled XLA program, read from its HLO text.

Each collective's per-rank traffic uses the usual bandwidth-optimal (ring) costs for a group of ``P`` ranks
and a result of ``B`` bytes: all-reduce ``2 (P-1)/P B``; all-gather and all-to-all ``(P-1)/P B``;
reduce-scatter ``(P-1) B`` (its result is one shard); collective-permute ``B``. Collectives inside the
branches of an HLO ``conditional`` (``lax.cond``) are attributed to their branch, so one compiled step that
switches stages at run time can be costed per stage.

Forms of the HLO text that are counted (GPU programs use most of them):

- synchronous collectives, with an array or a tuple result (variadic collectives: the tuple's arrays summed);
- asynchronous pairs ``all-reduce-start``/``-done``, ``all-gather-start``/``-done``,
  ``collective-permute-start``/``-done``, ``reduce-scatter-start``/``-done``, ``all-to-all-start``/``-done``:
  counted once, at the ``-start``. Except for ``all-reduce-start`` (whose shape is its result), a ``-start``
  shape is a tuple ``(operands, results, context...)``; only its second element, the results, is counted;
- the generic ``async-start(...), calls=%wrapped`` form: the wrapped computation's collective is counted once;
  the ``async-update``/``async-done`` instructions naming the same computation are not followed;
- collectives inside ``while`` loops: multiplied by the loop's trip count when XLA knows it (the
  ``"known_trip_count":{"n":"..."}`` entry of the loop's ``backend_config``; the condition runs once more than
  the body). With an unknown trip count the collective is kept with ``trips=None`` and every byte total that
  would include it raises ``ValueError`` rather than report a per-step number that is not one; each
  ``Collective`` still gives its bytes per execution.

Which devices talk: each collective keeps its ``replica_groups`` (explicit ``{{0,1},{2,3}}`` or iota
``[2,2]<=[2,2]T(1,0)`` form), so :func:`inter_host_bytes` can count what crosses between hosts of a 2-D mesh
(:func:`partition_hosts` maps the program's device ids to hosts).
"""

from __future__ import annotations

import dataclasses
import re

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
}
_OPS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+(?P<op>" + "|".join(_OPS) + r")(?P<start>-start)?\("
)
# What a line needs to hold for the walk to look at it; most lines of a compiled program (the bodies of its fusions)
# hold none of it, and this one search is cheaper than the anchored patterns' backtracking over every line.
_WORTH_A_LOOK = re.compile(
    "|".join(_OPS) + r"|calls=|to_apply=|body=|condition=|branch_computations=|true_computation="
)
# Instructions whose `calls=` names a computation already followed from the matching async-start.
_ASYNC_FOLLOWUP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.+?\s+async-(?:update|done)\(")
_WHILE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.+?\s+while\(")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\dm\d\w*)?)\[([\d,]*)\]")
# Computation headers start in column 0: "%name (params) -> shape {" (optimized) or "name {" (lowered).
_COMP_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_CALLS = re.compile(r"\b(calls|to_apply|body|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_PRED_BRANCHES = re.compile(r"true_computation=%?([\w.\-]+),\s*false_computation=%?([\w.\-]+)")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_GROUPS_ALL_LIST = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_GROUPS_ALL_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the program.

    Attributes:
      op: the collective's name without ``-start`` (``"all-reduce"``, ``"all-gather"``, ...).
      result_bytes: bytes of its result arrays, one execution.
      group_size: ranks in its replica group.
      computation: the HLO computation holding the instruction.
      dtypes: element types of its result arrays (``"u8"``, ``"f32"``, ...).
      trips: executions per run of the program (product of the trip counts of the enclosing ``while`` loops);
        ``None`` when an enclosing loop's trip count is unknown.
      groups: its replica groups (device ids of the program, as in ``replica_groups``); ``None`` when the text
        names none (one group of every device).
    """

    op: str
    result_bytes: int
    group_size: int
    computation: str
    dtypes: tuple[str, ...] = ()
    trips: int | None = 1
    groups: tuple[tuple[int, ...], ...] | None = None

    @property
    def bytes_sent(self) -> float:
        """Bytes each rank sends in one execution (ring costs; see module docstring)."""
        p, b = self.group_size, self.result_bytes
        if p <= 1:
            return 0.0
        if self.op == "all-reduce":
            return 2 * (p - 1) / p * b
        if self.op in ("all-gather", "all-to-all"):
            return (p - 1) / p * b
        if self.op == "reduce-scatter":
            return (p - 1) * b
        return float(b)  # collective-permute

    @property
    def total_bytes_sent(self) -> float:
        """Bytes each rank sends in one run of the program (``bytes_sent`` times ``trips``)."""
        if self.trips is None:
            raise ValueError(
                f"comm_report: the {self.op} in computation {self.computation!r} is inside a while loop whose trip "
                "count XLA does not know, so its bytes per program run are unknown; use its bytes_sent (one "
                "execution) times the number of iterations you expect"
            )
        return self.bytes_sent * self.trips


def _total(collectives) -> float:
    return sum(c.total_bytes_sent for c in collectives)


@dataclasses.dataclass(frozen=True)
class CommReport:
    """Collectives of a program: those always executed and, per ``conditional``, those of each branch."""

    always: tuple[Collective, ...]
    branches: tuple[tuple[tuple[Collective, ...], ...], ...]  # [conditional][branch] -> collectives

    @property
    def always_bytes(self) -> float:
        """Bytes per rank of the unconditional collectives, loop trip counts included."""
        return _total(self.always)

    def branch_bytes(self, branch: int, conditional: int = 0) -> float:
        """Bytes of one step that takes ``branch`` of the given conditional (plus the unconditional ones)."""
        return self.always_bytes + _total(self.branches[conditional][branch])

    def phase_bytes(self, phases: tuple[str, ...]) -> dict[str, float]:
        """Bytes of one step per phase of an optimizer whose update switches between ``phases`` (its state's names,
        :func:`jonebit.transforms.base.phase_names`, in the order of its compiled branches): the program's first
        conditional."""
        if not self.branches:
            return {}
        branches = self.branches[0]
        if len(branches) > len(phases):
            raise ValueError(f"phase_bytes: the program's first conditional has {len(branches)} branches, more than "
                             f"the {len(phases)} phases {phases}")
        return {name: self.branch_bytes(i) for i, name in enumerate(phases[:len(branches)])}

    def ops(self, branch: int | None = None, conditional: int = 0) -> list[str]:
        """Op names executed (all unconditional ones, plus one branch's when ``branch`` is given)."""
        extra = () if branch is None else self.branches[conditional][branch]
        return [c.op for c in (*self.always, *extra)]


def _split_top_level(shape: str) -> list[str]:
    """Elements of a tuple shape ``(a, (b, c), d[2,3]{1,0})``; ``[shape]`` when it is not a tuple."""
    shape = shape.strip()
    if not shape.startswith("("):
        return [shape]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:  # the tuple's closing parenthesis
                parts.append(shape[start:i])
                break
        elif ch == "," and depth == 1:
            parts.append(shape[start:i])
            start = i + 1
    return [p.strip() for p in parts if p.strip()]


def _arrays(shape: str) -> list[tuple[str, int]]:
    """``(dtype, bytes)`` of every array in a (possibly nested tuple) shape."""
    out = []
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _DTYPE_BYTES:
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out.append((dtype, n * _DTYPE_BYTES[dtype]))
    return out


def _shape_bytes(shape: str) -> int:
    return sum(b for _, b in _arrays(shape))


def _result_shape(op: str, is_start: bool, shape: str) -> str:
    """The part of an instruction's shape that is the collective's result."""
    if not is_start or op == "all-reduce":
        return shape  # sync collectives and all-reduce-start: the shape is the result (a tuple when variadic)
    parts = _split_top_level(shape)
    if len(parts) < 2:
        raise ValueError(f"comm_report: {op}-start should have a tuple shape (operands, results, ...), got {shape}")
    return parts[1]


def _group_size(line: str, default: int) -> int:
    if m := _GROUPS_LIST.search(line):
        return len([x for x in m.group(1).split(",") if x])
    if m := _GROUPS_IOTA.search(line):
        return int(m.group(2))
    return default


def _groups(line: str) -> tuple[tuple[int, ...], ...] | None:
    """The replica groups of an instruction, from either form of ``replica_groups``; None when absent/empty."""
    if m := _GROUPS_ALL_IOTA.search(line):
        n_groups, size = int(m.group(1)), int(m.group(2))
        dims = [int(d) for d in m.group(3).split(",")]
        perm = [int(d) for d in m.group(4).split(",")] if m.group(4) else list(range(len(dims)))
        ids = _transposed_iota(dims, perm)
        return tuple(tuple(ids[g * size:(g + 1) * size]) for g in range(n_groups))
    if m := _GROUPS_ALL_LIST.search(line):
        groups = tuple(tuple(int(x) for x in g.split(",") if x) for g in re.findall(r"\{([\d,]*)\}", m.group(1)))
        return groups if groups and all(groups) else None
    return None


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def _transposed_iota(dims: list[int], perm: list[int]) -> list[int]:
    """``iota(dims).transpose(perm).ravel()`` (the iota form of replica groups), without numpy."""
    strides = [_prod(dims[i + 1:]) for i in range(len(dims))]
    out_dims = [dims[p] for p in perm]
    out = []
    for flat in range(_prod(dims)):
        rem, idx = flat, []
        for d in reversed(out_dims):
            idx.append(rem % d)
            rem //= d
        idx.reverse()
        out.append(sum(i * strides[p] for i, p in zip(idx, perm, strict=True)))
    return out


def partition_hosts(mesh, hosts_axis: str) -> list[int]:
    """``hosts[i]``: the index along ``hosts_axis`` of device ``i`` of a program compiled for ``mesh``.

    Device ids in a ``shard_map`` program's ``replica_groups`` are positions in ``mesh.devices``, row-major.
    """
    names = tuple(mesh.axis_names)
    if hosts_axis not in names:
        raise ValueError(f"partition_hosts: mesh has no axis {hosts_axis!r} (axes: {names}); pass its slow axis")
    shape = [mesh.shape[a] for a in names]
    k = names.index(hosts_axis)
    inner = _prod(shape[k + 1:])
    return [(i // inner) % shape[k] for i in range(_prod(shape))]


def inter_host_bytes(collectives, hosts: list[int]) -> float:
    """Bytes sent between hosts per run of the program, per host (the total over hosts divided by their number).

    Each device's :attr:`Collective.bytes_sent` is split evenly over the other members of its group, and the
    part addressed to members on other hosts counts. That is exact for all-to-all and for a direct all-gather
    (every member sends its piece to every other); for ring all-reduce and reduce-scatter the real share
    depends on the ring's order.

    Args:
      collectives: :class:`Collective` s (e.g. ``report.always`` plus one branch's).
      hosts: ``hosts[i]`` is the host of device ``i`` (:func:`partition_hosts`).
    """
    total = 0.0
    for c in collectives:
        groups = c.groups if c.groups is not None else (tuple(range(len(hosts))),)
        for group in groups:
            if len(group) < 2:
                continue
            for dev in group:
                off = sum(hosts[o] != hosts[dev] for o in group)
                total += c.total_bytes_sent * off / (len(group) - 1)
    return total / len(set(hosts))


def _times(trips: int | None, n: int | None) -> int | None:
    return None if trips is None or n is None else trips * n


def comm_report(hlo_text: str, num_devices: int) -> CommReport:
    """Parses the text of a compiled program (``jitted.lower(...).compile().as_text()``).

    Args:
      hlo_text: optimized HLO module text.
      num_devices: group size assumed when an instruction has no ``replica_groups`` (all devices).

    Returns:
      A :class:`CommReport`. Conditionals nested inside a branch are merged into that branch.
    """
    comps: dict[str, list[str]] = {}
    entry = None
    current = None
    for line in hlo_text.splitlines():
        if m := _COMP_HEADER.match(line):
            current = m.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None:
            comps[current].append(line)
    if entry is None:
        raise ValueError("comm_report: no ENTRY computation in the HLO text")

    def walk(name: str, seen: set, trips: int | None):
        """Collectives reachable from a computation, conditional branches kept apart."""
        direct, conds = [], []
        if name in seen or name not in comps:
            return direct, conds
        seen = seen | {name}
        for line in comps[name]:
            if not _WORTH_A_LOOK.search(line):
                continue
            if m := _INSTR.match(line):
                op, is_start = m.group("op"), m.group("start") is not None
                arrays = _arrays(_result_shape(op, is_start, m.group("shape")))
                direct.append(Collective(op, sum(b for _, b in arrays), _group_size(line, num_devices), name,
                                         tuple(d for d, _ in arrays), trips, _groups(line)))
            if b := _BRANCHES.search(line):
                names = [x.strip().lstrip("%") for x in b.group(1).split(",")]
            elif b := _PRED_BRANCHES.search(line):
                names = [b.group(1), b.group(2)]
            else:
                names = []
            if names:
                branches = []
                for branch in names:
                    inner, nested = walk(branch, seen, trips)
                    branches.append(inner + [c for cond in nested for br in cond for c in br])
                conds.append(branches)
            if _ASYNC_FOLLOWUP.match(line):
                continue
            known = None
            if _WHILE.match(line) and (t := _TRIP_COUNT.search(line)):
                known = int(t.group(1))
            for attr, callee in _CALLS.findall(line):
                inner_trips = trips
                if attr == "body":
                    inner_trips = _times(trips, known)
                elif attr == "condition":
                    inner_trips = _times(trips, None if known is None else known + 1)
                inner, nested = walk(callee, seen, inner_trips)
                direct += inner
                conds += nested
        return direct, conds

    always, conds = walk(entry, set(), 1)
    return CommReport(tuple(always), tuple(tuple(tuple(b) for b in c) for c in conds))
