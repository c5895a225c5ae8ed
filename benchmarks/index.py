"""Writes ``benchmarks/results/INDEX.md``: one table per result folder (one folder per script).

Each row is one result (a JSON file, with the figure of the same name beside it, or a file on its own) with its
date, commit and command line, read from the file's ``meta`` block where the script recorded one (see
``report.run_meta``). Older files have no ``meta``: their date is that of the last commit that changed the file,
and their commit is "not recorded"; their command is the ``command`` field some scripts wrote, else "not recorded".
The last column is the script's headline figure, by the rules in ``HEADLINES`` ("-" for a script without a rule or
a file the rule cannot read).

    python benchmarks/index.py                 # writes benchmarks/results/INDEX.md
    python benchmarks/index.py --out /tmp/x.md
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def _defaults_convergence(d: dict) -> str:
    rows = {r["variant"]: r["heldout_mlm_loss"] for r in d["rows"]}
    adam = rows.pop("adam", None)
    parts = [f"{k} {v:.3f}" + (f" ({_pct(v / adam - 1)})" if adam else "") for k, v in rows.items()]
    return "held-out MLM loss: " + (f"adam {adam:.3f}; " if adam else "") + "; ".join(parts)


def _squad_finetune(d: dict) -> str:
    return "dev F1: " + ", ".join(f"{r['optimizer']} {r['f1']:.2f}" for r in d["runs"])


def _cluster(d: dict) -> str:
    slowest = d["args"]["rates"][-1]
    rows = [r for r in d["rows"] if r["stage"] == "compression" and r["rate"] == slowest]
    return f"compression stage vs Adam at {slowest}: " + ", ".join(
        f"{r['variant']} {r['speedup_vs_adam']:.2f}x ({r['hosts']} hosts)" for r in rows)


def _extrapolate(d: dict) -> str:
    flat = [r["onebit_flat_stage_speedup"] for r in d["rows"]]
    hier = [r["onebit_hier_stage_speedup"] for r in d["rows"]]
    return (f"compression stage vs Adam: flat {min(flat):.1f}-{max(flat):.1f}x, "
            f"hierarchical {min(hier):.1f}-{max(hier):.1f}x")


def _mpi_ratios(d: dict) -> str:
    """compressed / allreduce time at the largest buffer, per world size."""
    return ", ".join(f"{k[2:]} ranks {d[k]['rows'][-1]['compressed_s'] / d[k]['rows'][-1]['allreduce_s']:.2f}x"
                     for k in sorted(k for k in d if k.startswith("np")))


def _mpi_allreduce(d: dict) -> str:
    if "runs" in d:  # several runs in one file
        return "compressed / allreduce time, largest buffer: " + "; ".join(
            f"{name}: {_mpi_ratios(run)}" for name, run in d["runs"].items())
    return "compressed / allreduce time, largest buffer: " + _mpi_ratios(d)


def _gpu_suite(d: dict) -> str:
    step = d["optimizer_step"]
    return (f"{d['environment']['device_kind']}: 1-bit Adam step / adamw {step['ratio_onebit_over_adamw']:.2f}x "
            f"(fused {step['ratio_onebit_fused_over_adamw']:.2f}x)")


def _bert_step(d: dict) -> str:
    runs = d.get("runs", [d])
    return "jonebit / PyTorch tokens/s: " + ", ".join(f"{r['ratio_jonebit_over_pytorch']:.2f}x" for r in runs)


def _perleaf_compile(d: dict) -> str:
    most = max(r["leaves"] for r in d["rows"])
    s = {r["impl"]: r["compile_s"] for r in d["rows"] if r["leaves"] == most}
    return f"compile at {most} leaves: {s['OLD']:.0f} s (old) -> {s['NEW']:.0f} s"


# script folder -> function of the parsed JSON giving its headline figure
HEADLINES: dict[str, Callable[[dict], str]] = {
    "auto_freeze_trace": lambda d: "median rule fires at (threshold: update) "
    + ", ".join(f"{k}: {v}" for k, v in d["fires_at"]["median"].items()),
    "bert_step": _bert_step,
    "cluster": _cluster,
    "comm_bytes": lambda d: f"fp32 / compression bytes: {d['rows'][-1]['vs_fp32']:.2f}x ({d['rows'][-1]['tree']})",
    "defaults_convergence": _defaults_convergence,
    "engine_overhead": lambda d: "engine / bare step: " + ", ".join(f"{r['optimizer']} {r['ratio']:.2f}x"
                                                                    for r in d["rows"]),
    "extrapolate": _extrapolate,
    "family_auto_freeze": lambda d: "held-out vs Adam: " + ", ".join(f"{r['optimizer']} {r['vs_adam']}"
                                                                     for r in d["rows"][1:]),
    "family_bytes": lambda d: "Adam / this over the run: " + ", ".join(f"{r['optimizer']} {r['vs_adam']:.1f}x"
                                                                       for r in d["runs"]),
    "gpu_suite": _gpu_suite,
    "mlm_head": lambda d: f"masked-positions head {d['speedup']:.2f}x faster",
    "mpi_allreduce": _mpi_allreduce,
    "onebit_zero": lambda d: "1-bit Adam bytes/param by stage: " + ", ".join(
        f"{r['stage']}: {r['bytes_per_param']:.2f}" for r in d["rows"] if r["optimizer"] != "AdamW"),
    "perleaf_compile": _perleaf_compile,
    "squad_finetune": _squad_finetune,
    "squad_inference": lambda d: f"jonebit / PyTorch at each one's fastest batch: {d['fastest_ratio']:.2f}x",
    "step_cost": lambda d: "step / adamw + allreduce: " + ", ".join(f"{r['step']} {r['ratio']:.2f}x"
                                                                   for r in d["rows"] if r["ratio"] != 1),
    "zero_memory": lambda d: "largest device bytes / ZeRO formula: "
    + f"{max(r['ratio'] for r in d['rows'] if r.get('ratio')):.4f}",
}


def headline(script: str, data: dict | None) -> str:
    rule = HEADLINES.get(script)
    if rule is None or data is None:
        return "-"
    try:
        return rule(data).replace("|", "/")
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError):
        return "-"


def last_change_date(path: pathlib.Path) -> str:
    """Date (YYYY-MM-DD) of the last commit that added or changed ``path``: renames are followed and a commit that
    only renamed it (R100) is skipped."""
    out = subprocess.run(["git", "log", "--follow", "--format=date %cs", "--name-status", "--", str(path)],
                         cwd=ROOT, capture_output=True, text=True)
    date = None
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        if line.startswith("date "):
            date = line[5:]
        elif line.strip() and date and not line.startswith("R100"):
            return date
    return "not committed"


def row(script: str, folder: pathlib.Path, stem: str, files: list[pathlib.Path]) -> str:
    data = None
    main = next((f for f in files if f.suffix == ".json"), None)
    if main is not None:
        try:
            data = json.loads(main.read_text())
        except (OSError, ValueError):
            data = None
    meta = data.get("meta") if isinstance(data, dict) else None
    meta = meta if isinstance(meta, dict) and "command" in meta else None
    first = main or files[0]
    if meta:
        date, commit = meta["date"][:10], (meta.get("commit") or "unknown")[:10] + (" (dirty)" if meta.get("dirty")
                                                                                     else "")
        command = meta["command"]
    else:
        date, commit = last_change_date(first), "not recorded"
        command = data.get("command", "not recorded") if isinstance(data, dict) else "not recorded"
    names = ", ".join(f"[{f.name}]({script}/{f.name})" for f in files)
    command = f"`{command}`" if command not in ("not recorded",) else command
    return f"| {names} | {date} | {commit} | {command.replace('|', '/')} | {headline(script, data)} |"


def index() -> str:
    lines = ["# Benchmark results", "",
             "Generated by `python benchmarks/index.py` from the files below; do not edit by hand. One table per "
             "script, one row per result (a JSON file and the figure of the same name). Date, commit and command "
             "come from the file's `meta` block; files written before scripts recorded one show the date of the "
             "last commit that changed them. What the numbers mean: [BENCHMARKS.md](../BENCHMARKS.md).", ""]
    for folder in sorted(p for p in RESULTS.iterdir() if p.is_dir()):
        script = folder.name
        groups: dict[str, list[pathlib.Path]] = {}
        for f in sorted(p for p in folder.iterdir() if p.is_file()):
            groups.setdefault(f.name[: -len(f.suffix)] if f.suffix else f.name, []).append(f)
        if not groups:
            continue
        lines += [f"## {script}", "", "| files | date | commit | command | headline |", "|---|---|---|---|---|"]
        for stem, files in groups.items():
            files.sort(key=lambda f: f.suffix != ".json")  # the JSON first
            lines.append(row(script, folder, stem, files))
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS / "INDEX.md"))
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    out.write_text(index())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
