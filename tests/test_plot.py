"""``jonebit plot``: the figure is written, the bytes axis is the cumulative sum, bad run directories are named."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jonebit.cli import main
from jonebit.plot import cumulative_bytes, read_metrics


def _run(path, losses, bytes_per_step, every=1, evals=None):
    path.mkdir(parents=True)
    with (path / "metrics.jsonl").open("w") as f:
        for i, loss in enumerate(losses):
            step = (i + 1) * every
            record = {"step": step, "loss": loss, "bytes_sent": bytes_per_step(step)}
            if evals and step in evals:
                record["eval/f1"] = evals[step]
            f.write(json.dumps(record) + "\n")
    return path


def test_plot_writes_png(tmp_path, capsys):
    matplotlib = pytest.importorskip("matplotlib")
    a = _run(tmp_path / "adam", [3.0, 2.5, 2.0, 1.8], lambda s: 1000.0, evals={4: 80.0})
    b = _run(tmp_path / "onebit", [3.0, 2.6, 2.1, 1.9], lambda s: 1000.0 if s <= 2 else 31.0, evals={4: 79.5})
    out = tmp_path / "curves.png"
    assert main(["plot", str(a), str(b), "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    image = matplotlib.image.imread(out)
    assert image.shape[1] > 3 * image.shape[0] / 2  # three panels side by side (loss/step, loss/bytes, eval/f1)
    assert image.std() > 0.05  # not blank


def test_cumulative_bytes_counts_unlogged_steps():
    records = [{"step": 10, "bytes_sent": 5.0}, {"step": 20, "bytes_sent": 2.0}, {"step": 25, "bytes_sent": 1.0}]
    np.testing.assert_allclose(cumulative_bytes(records), [50.0, 70.0, 75.0])


@pytest.mark.parametrize("content, pattern", [
    (None, r"no metrics file at .*metrics.jsonl"),
    ("", r"holds no metrics records"),
    ('{"step": 1, "loss": 2}\n{"step": 2, "loss"\n', r"metrics.jsonl:2: not a JSON line"),
    ('{"loss": 2}\n', r"metrics.jsonl:1: a metrics record needs a 'step' field"),
])
def test_bad_run_dirs(tmp_path, capsys, content, pattern):
    run = tmp_path / "run"
    run.mkdir()
    if content is not None:
        (run / "metrics.jsonl").write_text(content)
    with pytest.raises((FileNotFoundError, ValueError), match=pattern):
        read_metrics(run)
    assert main(["plot", str(run), "-o", str(tmp_path / "x.png")]) == 2
    assert "jonebit plot:" in capsys.readouterr().err


def test_help_is_plain_text(capsys):
    """--help shows the docstring's words without Sphinx markup (double backquotes, :func: roles)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse rewraps
    assert "``" not in text and ":func:" not in text and "`" not in text
    assert "Reads each run's metrics.jsonl (written by jonebit.train.loop.train)" in text
    assert "(pip install 'jonebit[plot]')" in text
