"""Output helpers of the benchmark scripts: where results go, the ``meta`` block each result file records, and
Markdown tables. No jax import, so a script that must choose its own platform, such as ``gpu_suite.py``, can use it.

Each script writes into ``benchmarks/results/<script>/``: its untagged result as ``<script>.json``, a tagged one
(``--tag T``) as ``T.json``, a figure beside its JSON with the same stem.
"""

from __future__ import annotations

import datetime
import pathlib
import re
import shlex
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def result_path(script: str, tag: str = "", suffix: str = ".json") -> pathlib.Path:
    """``benchmarks/results/<script>/<tag or script><suffix>`` (the folder is not created here)."""
    return RESULTS / script / f"{tag or script}{suffix}"


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def spread(values) -> dict:
    """Mean, min, max and sample standard deviation (None for one value) of per-seed results."""
    values = list(values)
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else None}


def run_meta(argv: list[str] | None = None) -> dict:
    """What a result file records about the run that wrote it: the command line (``python`` + the script path
    relative to the repository + its arguments), the git commit (None outside a checkout; ``dirty`` when tracked
    files other than ``benchmarks/results`` had uncommitted changes) and the date (UTC, ISO 8601)."""
    argv = list(sys.argv if argv is None else argv)
    if argv:
        script = pathlib.Path(argv[0]).resolve()
        argv[0] = str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else argv[0]
    # Result files are outputs, not code: a sitting that rewrote one (a ledger) ran clean code all the same.
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results")
    return {"command": shlex.join(["python", *argv]), "commit": _git("rev-parse", "HEAD"),
            "dirty": bool(status) if status is not None else None,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}


def table(rows: list[dict], columns: list[tuple[str, str]], *, decimals: int = 2, whole_above: float = 1e4) -> str:
    """Markdown table; ``columns`` are (key, header). Floats get ``decimals`` digits below ``whole_above`` and none
    above it; a missing value or None prints as ``-``."""
    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.{decimals}f}" if abs(v) < whole_above else f"{v:,.0f}"
        return f"{v:,}" if isinstance(v, int) else str(v)

    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join(lines)


def xla_compile_times(log: str) -> tuple[dict[str, float], float, int]:
    """From an XLA:CPU compiler log (``TF_CPP_VMODULE=hlo_pass_pipeline=1,cpu_compiler=1``): seconds per HLO pass
    (summed over its runs), seconds of LLVM code generation, and the number of kernels LLVM compiled (XLA:CPU
    compiles a fusion once and reuses it for every fusion with the same computation; two fusions that differ in a
    constant are two kernels)."""
    passes: dict[str, float] = {}
    # Each timing line gives the time rounded in a unit that varies (us ... min) and exactly, in microseconds.
    for name, micros in re.findall(r"HLO pass: (\S+) time: [^(]*\((\d+) us\)", log):
        passes[name] = passes.get(name, 0.0) + int(micros) * 1e-6
    codegen = [int(v) * 1e-6 for v in re.findall(r"for CPU using JIT time: [^(]*\((\d+) us\)", log)]
    return passes, max(codegen, default=0.0), log.count("Running LLVM verifier")
