"""``jonebit plot RUN_DIR [RUN_DIR ...] -o curves.png``: training curves of one or more runs.

Reads each run's ``metrics.jsonl`` (written by :func:`jonebit.train.loop.train`) and draws the loss against the
optimizer step and against the bytes each rank sent (cumulative, from ``bytes_sent``), one line per run, plus one
panel per evaluation metric present (keys starting with ``eval/``). Needs matplotlib (``pip install
'jonebit[plot]'``).
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

import numpy as np


def read_metrics(run_dir: str | pathlib.Path) -> list[dict]:
    """The records of ``RUN_DIR/metrics.jsonl`` (a path to the file itself is accepted too)."""
    path = pathlib.Path(run_dir)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path} (a run directory written by jonebit's training loop "
                                "holds metrics.jsonl)")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not a JSON line ({e.msg})") from None
        if not isinstance(record, dict) or "step" not in record:
            raise ValueError(f"{path}:{number}: a metrics record needs a 'step' field")
        records.append(record)
    if not records:
        raise ValueError(f"{path} holds no metrics records")
    return records


def _series(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    rows = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float) and not isinstance(
        r.get(key), bool)]
    if not rows:
        return np.zeros(0), np.zeros(0)
    steps, values = zip(*rows, strict=True)
    return np.asarray(steps, float), np.asarray(values, float)


def cumulative_bytes(records: list[dict]) -> np.ndarray:
    """Bytes sent up to each record, steps between logged records counted at the record's rate."""
    total, last_step, out = 0.0, 0, []
    for r in records:
        per_step = r.get("bytes_sent")
        per_step = 0.0 if not isinstance(per_step, int | float) or not np.isfinite(per_step) else per_step
        total += per_step * (r["step"] - last_step)
        last_step = r["step"]
        out.append(total)
    return np.asarray(out)


def plot_runs(run_dirs, output, *, labels=None, smooth: int = 1):
    """Writes the figure to ``output``; returns the matplotlib Figure."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("jonebit plot needs matplotlib: pip install 'jonebit[plot]'") from None
    runs = [read_metrics(d) for d in run_dirs]
    labels = list(labels) if labels else [pathlib.Path(d).name or str(d) for d in run_dirs]
    if len(labels) != len(runs):
        raise ValueError(f"{len(labels)} labels for {len(runs)} runs")
    evals = sorted({k for records in runs for r in records for k in r if k.startswith("eval/")})
    panels = 2 + len(evals)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    axes = axes[0]
    for records, label in zip(runs, labels, strict=True):
        steps, loss = _series(records, "loss")
        if smooth > 1 and len(loss) >= smooth:
            loss = np.convolve(loss, np.ones(smooth) / smooth, mode="valid")
            steps = steps[smooth - 1:]
        axes[0].plot(steps, loss, label=label)
        sent = cumulative_bytes([r for r in records if isinstance(r.get("loss"), int | float)])
        if smooth > 1 and len(sent) >= smooth:
            sent = sent[smooth - 1:]
        axes[1].plot(sent / 1e6, loss, label=label)
        for ax, key in zip(axes[2:], evals, strict=True):
            s, v = _series(records, key)
            ax.plot(s, v, marker="o", label=label)
    axes[0].set(xlabel="step", ylabel="training loss", title="loss vs step")
    axes[1].set(xlabel="MB sent per rank (cumulative)", ylabel="training loss", title="loss vs bytes sent")
    for ax, key in zip(axes[2:], evals, strict=True):
        ax.set(xlabel="step", ylabel=key[5:], title=key)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    return fig


def plain(text: str) -> str:
    """Docstring text without its Sphinx markup, for ``--help``: ``:func:`a.b``` -> a.b, double backquotes
    dropped."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    return re.sub(r"``([^`]+)``", r"\1", text)


def add_parser(subparsers) -> None:
    """Registers ``jonebit plot``."""
    p = subparsers.add_parser("plot", help="plot training curves of run directories (loss vs step and vs bytes)",
                              description=plain(__doc__.split("\n\n")[1]))
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (or metrics.jsonl files)")
    p.add_argument("-o", "--output", default="curves.png", help="output image (default: curves.png)")
    p.add_argument("--labels", nargs="+", help="one legend label per run (default: the directory names)")
    p.add_argument("--smooth", type=int, default=1, help="moving-average window over logged losses (default 1)")
    p.set_defaults(func=_main)


def _main(args) -> int:
    try:
        plot_runs(args.runs, args.output, labels=args.labels, smooth=args.smooth)
    except (FileNotFoundError, ValueError) as e:
        print(f"jonebit plot: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0
