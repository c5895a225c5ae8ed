"""Bytes moved by the collectives of a compiled XLA program, read from its HLO text.

Each collective's per-rank traffic uses the usual bandwidth-optimal (ring) costs for a group of ``P`` ranks
and a result of ``B`` bytes: all-reduce ``2 (P-1)/P B``; all-gather and all-to-all ``(P-1)/P B``;
reduce-scatter ``(P-1) B`` (its result is one shard); collective-permute ``B``. Collectives inside the
branches of an HLO ``conditional`` (``lax.cond``) are attributed to their branch, so one compiled step that
switches stages at run time can be costed per stage.
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
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+(?P<op>" + "|".join(_OPS) + r")(?:-start)?\((?P<rest>.*)$"
)
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\dm\d\w*)?)\[([\d,]*)\]")
# Computation headers start in column 0: "%name (params) -> shape {" (optimized) or "name {" (lowered).
_COMP_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the program."""

    op: str
    result_bytes: int
    group_size: int
    computation: str

    @property
    def bytes_sent(self) -> float:
        """Bytes each rank sends (ring costs; see module docstring)."""
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


@dataclasses.dataclass(frozen=True)
class CommReport:
    """Collectives of a program: those always executed and, per ``conditional``, those of each branch."""

    always: tuple[Collective, ...]
    branches: tuple[tuple[tuple[Collective, ...], ...], ...]  # [conditional][branch] -> collectives

    @property
    def always_bytes(self) -> float:
        return sum(c.bytes_sent for c in self.always)

    def branch_bytes(self, branch: int, conditional: int = 0) -> float:
        """Bytes of one step that takes ``branch`` of the given conditional (plus the unconditional ones)."""
        return self.always_bytes + sum(c.bytes_sent for c in self.branches[conditional][branch])

    def ops(self, branch: int | None = None, conditional: int = 0) -> list[str]:
        """Op names executed (all unconditional ones, plus one branch's when ``branch`` is given)."""
        extra = () if branch is None else self.branches[conditional][branch]
        return [c.op for c in (*self.always, *extra)]


def _shape_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _DTYPE_BYTES:
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _DTYPE_BYTES[dtype]
    return total


def _group_size(line: str, default: int) -> int:
    if m := _GROUPS_LIST.search(line):
        return len([x for x in m.group(1).split(",") if x])
    if m := _GROUPS_IOTA.search(line):
        return int(m.group(2))
    return default


def comm_report(hlo_text: str, num_devices: int) -> CommReport:
    """Parses the text of a compiled program (``jitted.lower(...).compile().as_text()``).

    Args:
      hlo_text: optimized HLO module text.
      num_devices: group size assumed when an instruction has no ``replica_groups`` (all devices).
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

    def walk(name: str, seen: set) -> tuple[list[Collective], list[list[list[Collective]]]]:
        """Collectives reachable from a computation, conditional branches kept apart."""
        direct, conds = [], []
        if name in seen or name not in comps:
            return direct, conds
        seen = seen | {name}
        for line in comps[name]:
            if m := _INSTR.match(line):
                direct.append(Collective(m.group("op"), _shape_bytes(m.group("shape")),
                                         _group_size(line, num_devices), name))
            if b := _BRANCHES.search(line):
                branches = []
                for branch in (x.strip().lstrip("%") for x in b.group(1).split(",")):
                    inner, nested = walk(branch, seen)
                    branches.append(inner + [c for cond in nested for br in cond for c in br])
                conds.append(branches)
            for callee in _CALLS.findall(line):
                inner, nested = walk(callee, seen)
                direct += inner
                conds += nested
        return direct, conds

    always, conds = walk(entry, set())
    return CommReport(tuple(always), tuple(tuple(tuple(b) for b in c) for c in conds))
