"""The bandwidth model and the summary of an emulated-cluster run (pure functions: tested without a cluster).

    step time = compute + wire bytes / bandwidth + latency x message rounds

``compute`` is the same step on one device with no network (measured in the same processes, at the same
time, so the CPU contention matches); ``wire bytes`` are the bytes the compiled program's collectives send
per host (``jonebit.comm.accounting``) times the framing overhead measured on the links (qdisc bytes over
accounted bytes: Ethernet + IP + TCP headers, about 4.6% at MTU 1500); ``bandwidth`` is the HTB rate. The
kernel here has no netem, so the emulated links add no latency worth counting (a veth hop is microseconds);
the latency term is there for extrapolation to real networks, where it is computed, not measured.
"""

from __future__ import annotations

import pathlib
import re
import statistics

from benchmarks.cluster.netns import rate_bits


def message_rounds(ops: list[str], group: int) -> int:
    """Sequential point-to-point rounds of a ring implementation of ``ops`` over ``group`` ranks (each round
    pays one latency): all-reduce ``2 (P-1)``, all-gather / all-to-all / reduce-scatter ``P-1``, permute 1."""
    if group < 2:
        return 0
    per_op = {"all-reduce": 2 * (group - 1), "collective-permute": 1}
    return sum(per_op.get(op, group - 1) for op in ops)


# gloo runs these as rings over the group's order (each member sends to the next); all-to-all goes directly
# from every member to every other.
RING_OPS = ("all-reduce", "reduce-scatter", "all-gather")


def host_link_bytes(collectives, hosts: list[int]) -> float:
    """Bytes one host sends over its link per run of the collectives (the mean over hosts).

    ``hosts[i]`` is the host of device ``i`` (device ids as in the collectives' replica groups). A ring op's
    member sends its whole :attr:`bytes_sent` to the next member of its group, which crosses the link only when
    that member is on another host; an all-to-all member splits its bytes evenly over the other members. With one
    device per host this is the per-device accounting; with several, the part of a ring that stays inside a
    host does not count.
    """
    sent = dict.fromkeys(hosts, 0.0)
    for c in collectives:
        groups = c.groups if c.groups is not None else (tuple(range(len(hosts))),)
        for group in groups:
            if len(group) < 2:
                continue
            for k, dev in enumerate(group):
                if c.op in RING_OPS:
                    crossing = float(hosts[group[(k + 1) % len(group)]] != hosts[dev])
                else:
                    crossing = sum(hosts[o] != hosts[dev] for o in group) / (len(group) - 1)
                sent[hosts[dev]] += c.total_bytes_sent * crossing
    return sum(sent.values()) / len(sent)


# The call graph of an optimized HLO module, as jonebit.comm.accounting walks it.
_HLO_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_HLO_CALLEE = re.compile(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_HLO_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_HLO_PRED = re.compile(r"true_computation=%?([\w.\-]+),\s*false_computation=%?([\w.\-]+)")


def _hlo_graph(hlo_text: str) -> tuple[str, dict[str, list[tuple[str, list[str]]]]]:
    """``(entry, {computation: [("call" | "cond", callee names), ...] in line order})``."""
    graph: dict[str, list] = {}
    entry = current = None
    for line in hlo_text.splitlines():
        if m := _HLO_HEADER.match(line):
            current = m.group(1)
            graph[current] = []
            entry = current if line.startswith("ENTRY") else entry
        elif current is not None:
            if b := _HLO_BRANCHES.search(line):
                graph[current].append(("cond", [x.strip().lstrip("%") for x in b.group(1).split(",")]))
            elif b := _HLO_PRED.search(line):
                graph[current].append(("cond", [b.group(1), b.group(2)]))
            if callees := _HLO_CALLEE.findall(line):
                graph[current].append(("call", callees))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return entry, graph


def _first_conditional(graph, name: str, seen=frozenset()) -> list[str] | None:
    """Branches of the first conditional met depth-first from ``name`` (the order ``comm_report`` numbers them)."""
    if name in seen or name not in graph:
        return None
    for kind, names in graph[name]:
        if kind == "cond":
            return names
        for callee in names:
            if (found := _first_conditional(graph, callee, seen | {name})) is not None:
                return found
    return None


def _reachable(graph, name: str) -> set[str]:
    out, todo = set(), [name]
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo += [c for _, names in graph.get(n, ()) for c in names]
    return out


def stage_collectives(report, hlo_text: str | None, branch: int | tuple[int, int]) -> tuple:
    """The collectives one step of a stage runs: the unconditional ones and those of the stage's branch.

    ``branch``: a branch of the step's first conditional (``report.branches[0]``), or ``(outer, inner)`` for a
    stage nested one level deeper: branch ``inner`` of the first conditional inside branch ``outer`` (0/1 Adam
    picks variance vs 1-bit steps, or sync vs local steps, inside its phase's branch). ``comm_report`` merges a
    nested conditional into its branch; the HLO text (``hlo_text``) tells which computation a collective of
    that branch lives in, so the collectives of the other inner branches are left out.
    """
    if isinstance(branch, int):
        return (*report.always, *report.branches[0][branch])
    outer, inner = branch
    entry, graph = _hlo_graph(hlo_text)
    top = _first_conditional(graph, entry)
    nested = _first_conditional(graph, top[outer]) if top else None
    if nested is None:
        raise ValueError(f"no conditional inside branch {outer} of the step's first conditional")
    mine = _reachable(graph, nested[inner])
    others = set().union(*(_reachable(graph, b) for k, b in enumerate(nested) if k != inner)) - mine
    return (*report.always, *(c for c in report.branches[0][outer] if c.computation not in others))


# mpi4jax's collectives are custom calls in the compiled program; their result is ``(array, token)``.
_MPI_CALL = re.compile(r"^(?P<head>\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*)"
                       r"\((?P<shape>\w+\[[\d,]*\](?:\{[\d,]*\})?),\s*token\[\]\)\s+custom-call\((?P<rest>.*custom_call_target=\"mpi_(?P<op>allreduce|alltoall|allgather)"
                       r"(?:_ffi)?\".*)$")
_MPI_OPS = {"allreduce": "all-reduce", "alltoall": "all-to-all", "allgather": "all-gather"}


def mpi_as_collectives(hlo_text: str) -> str:
    """The compiled program's mpi4jax calls rewritten as the XLA collectives they stand for, so that
    ``comm_report(text, ranks)`` costs them like the shard_map programs' (a call's result array, over all
    ranks: an MPI allreduce as a ring all-reduce, alltoall and allgather with ``(P-1)/P`` of the result)."""
    out = []
    for line in hlo_text.splitlines():
        if m := _MPI_CALL.match(line):
            line = f"{m.group('head')}{m.group('shape')} {_MPI_OPS[m.group('op')]}({m.group('rest')}"
        out.append(line)
    return "\n".join(out)


def predict(compute_s: float, wire_bytes: float, rate: str | float, latency_s: float = 0.0, rounds: int = 0) -> float:
    """Step time of the model. ``rate``: a tc rate string or bits per second."""
    bits = rate_bits(rate) if isinstance(rate, str) else float(rate)
    return compute_s + 8.0 * wire_bytes / bits + latency_s * rounds


def fit_two_term(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``t = c + s x`` through ``(x, t)`` points (x = ideal seconds on the wire); ``(c, s)``.

    ``c`` is the compute the rates imply, ``s`` how much slower than the nominal rate the bytes really move
    (1 = at the HTB rate exactly)."""
    if len(points) < 2:
        raise ValueError(f"fit_two_term needs at least 2 points at different rates, got {len(points)}")
    xs, ts = [p[0] for p in points], [p[1] for p in points]
    mx, mt = statistics.fmean(xs), statistics.fmean(ts)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("fit_two_term: every point has the same wire time; use at least two different rates")
    s = sum((x - mx) * (t - mt) for x, t in zip(xs, ts, strict=True)) / sxx
    return mt - s * mx, s


def spread(times: list[float]) -> dict:
    med = statistics.median(times)
    return dict(median=med, min=min(times), max=max(times), spread=(max(times) - min(times)) / med, n=len(times))


def host_bytes(worker: dict, variant: str, stage: str) -> float:
    """Bytes one host sends over its link per step: the workers' ring-aware count where they made one, else the
    per-device accounting (exact with one device per host)."""
    per_host = worker.get("host_bytes_per_step")
    return per_host[variant][stage] if per_host else worker["comm_bytes_per_step"][variant][stage]


def expected_phase_bytes(worker: dict, phase: int, variant: str | None = None) -> float:
    """Bytes one host should send in a phase (or in one variant's part of it): every step it ran times its
    stage's bytes over the link."""
    total = 0.0
    for name, rec in worker["phases"][phase]["variants"].items():
        if variant is not None and name != variant:
            continue
        for stage, n in rec["dist_steps"].items():
            total += n * host_bytes(worker, name, stage)
    return total


def summarise(runs: list[dict], rates: list[str]) -> dict:
    """Rows (one per hosts x rate x variant stage) with measured and modelled times, and the link checks (per
    variant where the run read the counters between variants, else per rate)."""
    rows, links = [], []
    for run in runs:
        hosts, w0, counters = run["hosts"], run["workers"][0], run["counters"]
        plan = run.get("barriers") or [[rate, None] for rate in rates]  # older runs: one barrier per rate
        sums: dict = {}  # rate -> per host [accounted, qdisc up]
        for k, (rate, variant) in enumerate(plan):
            per_host = []
            for i, w in enumerate(run["workers"]):
                # Per-device accounting is what crosses a host's link only with one device per host; with
                # several the workers' ring-aware per-host count is needed (older records lack it).
                exact = w.get("devices", hosts) == hosts or "host_bytes_per_step" in w
                want = expected_phase_bytes(w, rates.index(rate), variant) if exact else 0.0
                up = counters[k + 1]["up"][i] - counters[k]["up"][i]
                down = counters[k + 1]["down"][i] - counters[k]["down"][i]
                per_host.append(dict(host=i, accounted=want, qdisc_up=up, qdisc_down=down,
                                     ratio_up=up / want if want else None))
                acc = sums.setdefault(rate, [[0.0, 0.0] for _ in run["workers"]])[i]
                acc[0], acc[1] = acc[0] + want, acc[1] + up
            ratios = [h["ratio_up"] for h in per_host if h["ratio_up"]]
            links.append(dict(hosts=hosts, rate=rate, variant=variant, per_host=per_host,
                              mean_ratio=statistics.fmean(ratios) if ratios else None))
        # The framing overhead of a rate: all its bytes on the wire over all its accounted bytes, mean over hosts.
        overhead = {rate: statistics.fmean([up / want for want, up in per if want] or [1.0])
                    for rate, per in sums.items()}
        for k, rate in enumerate(rates):
            for name, rec in w0["phases"][k]["variants"].items():
                for stage, times in rec["dist_s"].items():
                    acct = host_bytes(w0, name, stage)
                    compute = statistics.median(rec["local_s"][stage])
                    m = spread(times)
                    model = predict(compute, acct * overhead[rate], rate)
                    rows.append(dict(hosts=hosts, rate=rate, variant=name, stage=stage, bytes_per_step=acct,
                                     wire_bytes_per_step=acct * overhead[rate], compute_s=compute,
                                     measured=m, model_s=model, measured_over_model=m["median"] / model))
    _add_fits(rows)
    _add_unshaped(rows)
    _add_speedups(rows)
    return dict(rows=rows, links=links, whole_run=whole_run(rows), model=__doc__.split("\n\n")[1].strip())


def baseline(variant: str) -> str:
    """The Adam row a variant is compared with: the one over the same transport (``_mpi`` rows: over MPI)."""
    return "adam_mpi" if variant.endswith("_mpi") else "adam"


def whole_run(rows: list[dict], warmup_fraction: float = 0.15) -> list[dict]:
    """Time of a run with ``warmup_fraction`` of its steps in a staged optimizer's warmup stage, relative to
    Adam's (from the per-step medians, measured and modelled), for every staged variant."""
    out = []
    by = {(r["hosts"], r["rate"], r["variant"], r["stage"]): r for r in rows}
    mix = lambda w, c: warmup_fraction * w + (1 - warmup_fraction) * c  # noqa: E731
    staged = list(dict.fromkeys(r["variant"] for r in rows if r["stage"] == "compression"))
    for (hosts, rate, variant, _), adam in by.items():
        for name in (n for n in staged if baseline(n) == variant):
            warm, comp = by.get((hosts, rate, name, "warmup")), by.get((hosts, rate, name, "compression"))
            if warm is None or comp is None:
                continue
            measured = mix(warm["measured"]["median"], comp["measured"]["median"])
            row = dict(hosts=hosts, rate=rate, variant=name, warmup_fraction=warmup_fraction,
                       speedup=adam["measured"]["median"] / measured,
                       model_speedup=adam["model_s"] / mix(warm["model_s"], comp["model_s"]))
            if all("model_unshaped_s" in r for r in (adam, warm, comp)):
                row["model_unshaped_speedup"] = adam["model_unshaped_s"] / mix(warm["model_unshaped_s"],
                                                                              comp["model_unshaped_s"])
            out.append(row)
    return out


def _key(r):
    return r["hosts"], r["variant"], r["stage"]


def _add_fits(rows: list[dict]) -> None:
    groups: dict = {}
    for r in rows:
        groups.setdefault(_key(r), []).append(r)
    for group in groups.values():
        pts = [(8 * r["wire_bytes_per_step"] / rate_bits(r["rate"]), r["measured"]["median"]) for r in group]
        xs = [p[0] for p in pts]
        noise = max(r["measured"]["max"] - r["measured"]["min"] for r in group)
        if max(xs) - min(xs) <= noise:  # the rates move the wire time less than the steps scatter: no line
            continue
        c, s = fit_two_term(pts)
        for r in group:
            r["fit_compute_s"], r["fit_slope"] = c, s


UNSHAPED_BITS = 5e9  # a phase at least this fast is taken as "unshaped": gloo is CPU-bound well below it here


def _add_unshaped(rows: list[dict]) -> None:
    """Second model: the compute taken from the fastest phase (rate >= ``UNSHAPED_BITS``), which includes what
    the local step lacks (gloo's CPU work, waiting for the slower process), plus the wire time at each rate."""
    fast: dict = {}
    for r in rows:
        bits = rate_bits(r["rate"])
        if bits >= UNSHAPED_BITS and bits > fast.get(_key(r), (0, None))[0]:
            fast[_key(r)] = bits, r
    for r in rows:
        if _key(r) not in fast:
            continue
        bits, f = fast[_key(r)]
        compute = f["measured"]["median"] - 8 * f["wire_bytes_per_step"] / bits
        r["unshaped_compute_s"] = compute
        r["model_unshaped_s"] = predict(compute, r["wire_bytes_per_step"], r["rate"])


def _add_speedups(rows: list[dict]) -> None:
    """Each row's speedup over the full-precision Adam step at the same hosts and rate (measured, and model)."""
    base = {(r["hosts"], r["rate"], r["variant"]): r for r in rows if r["variant"] in ("adam", "adam_mpi")}
    for r in rows:
        b = base.get((r["hosts"], r["rate"], baseline(r["variant"])))
        if b is not None:
            r["speedup_vs_adam"] = b["measured"]["median"] / r["measured"]["median"]
            r["model_speedup_vs_adam"] = b["model_s"] / r["model_s"]
            if "model_unshaped_s" in r and "model_unshaped_s" in b:
                r["model_unshaped_speedup_vs_adam"] = b["model_unshaped_s"] / r["model_unshaped_s"]
                r["measured_over_model_unshaped"] = r["measured"]["median"] / r["model_unshaped_s"]


def _label(r) -> str:
    return r["variant"] if r["stage"] == "step" else f"{r['variant']} {r['stage']}"


def _opt(r: dict, key: str, fmt: str, suffix: str = "") -> str:
    return format(r[key], fmt) + suffix if key in r else "-"


def tables(report: dict) -> str:
    """Markdown: the step-time table (measured next to both models) and the link check.

    Model A takes the compute from the local (no network) step, model B from the unshaped phase."""
    out = ["| hosts | rate | step | MB sent/step/host | local compute s | measured median s [min-max] | model A s | "
           "model B s | measured / B | fit: compute s, slope | speedup vs Adam: measured (A, B) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        m = r["measured"]
        fit = f"{r['fit_compute_s']:.3f}, {r['fit_slope']:.2f}" if "fit_compute_s" in r else "-"
        sp = "-"
        if "speedup_vs_adam" in r:
            sp = (f"{r['speedup_vs_adam']:.2f}x ({r['model_speedup_vs_adam']:.2f}x, "
                  f"{_opt(r, 'model_unshaped_speedup_vs_adam', '.2f', 'x')})")
        out.append(f"| {r['hosts']} | {r['rate']} | {_label(r)} | {r['bytes_per_step'] / 1e6:.2f} | "
                   f"{r['compute_s']:.3f} | {m['median']:.3f} [{m['min']:.3f}-{m['max']:.3f}] | {r['model_s']:.3f} | "
                   f"{_opt(r, 'model_unshaped_s', '.3f')} | {_opt(r, 'measured_over_model_unshaped', '.2f')} | "
                   f"{fit} | {sp} |")
    out += ["", "| hosts | rate | optimizer | whole-run speedup over Adam, 15% warmup: measured (A, B) |",
            "|---|---|---|---|"]
    out += [f"| {w['hosts']} | {w['rate']} | {w.get('variant', 'onebit')} | {w['speedup']:.2f}x "
            f"({w['model_speedup']:.2f}x, "
            f"{_opt(w, 'model_unshaped_speedup', '.2f', 'x')}) |" for w in report["whole_run"]]
    out += ["", "| hosts | rate | variant | host | accounted MB sent | qdisc MB up | qdisc MB down | up / accounted |"
                " down / accounted |", "|---|---|---|---|---|---|---|---|---|"]
    for link in report["links"]:
        for h in link["per_host"]:
            ratio = f"{h['ratio_up']:.3f}" if h["ratio_up"] else "-"
            down = f"{h['qdisc_down'] / h['accounted']:.3f}" if h["accounted"] else "-"
            out.append(f"| {link['hosts']} | {link['rate']} | {link.get('variant') or 'all'} | {h['host']} | "
                       f"{h['accounted'] / 1e6:.2f} | {h['qdisc_up'] / 1e6:.2f} | {h['qdisc_down'] / 1e6:.2f} | "
                       f"{ratio} | {down} |")
    return "\n".join(out)


def plot(report: dict, path: pathlib.Path) -> pathlib.Path | None:
    """Bars of the measured medians (min-max whiskers) with the model as markers, one panel per host count."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    hosts = sorted({r["hosts"] for r in report["rows"]})
    fig, axes = plt.subplots(1, len(hosts), figsize=(6 * len(hosts), 4), squeeze=False)
    for ax, h in zip(axes[0], hosts, strict=True):
        rows = [r for r in report["rows"] if r["hosts"] == h]
        rates = list(dict.fromkeys(r["rate"] for r in rows))
        labels = list(dict.fromkeys(_label(r) for r in rows))
        width = 0.8 / len(labels)
        for j, lab in enumerate(labels):
            sel = [next(r for r in rows if r["rate"] == rate and _label(r) == lab) for rate in rates]
            xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(rates))]
            med = [r["measured"]["median"] for r in sel]
            err = [[m - r["measured"]["min"] for m, r in zip(med, sel, strict=True)],
                   [r["measured"]["max"] - m for m, r in zip(med, sel, strict=True)]]
            ax.bar(xs, med, width, yerr=err, capsize=3, label=lab)
            ax.scatter(xs, [r["model_s"] for r in sel], color="black", marker="_", s=200, zorder=3,
                       label="model (local compute)" if j == 0 else None)
            unshaped = [(x, r["model_unshaped_s"]) for x, r in zip(xs, sel, strict=True) if "model_unshaped_s" in r]
            if unshaped:
                ax.scatter(*zip(*unshaped, strict=True), color="dimgray", marker="x", s=40, zorder=3,
                           label="model (unshaped compute)" if j == 0 else None)
        ax.set_xticks(range(len(rates)), rates)
        ax.set_ylabel("step time (s)")
        ax.set_title(f"BERT data-parallel step, {h} emulated hosts")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
