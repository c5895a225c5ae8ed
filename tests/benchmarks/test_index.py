"""benchmarks/index.py lists every result file, and the committed INDEX.md is what it generates."""

from __future__ import annotations

import subprocess
import sys

from tests.mpi_util import ROOT

RESULTS = ROOT / "benchmarks" / "results"


def result_files() -> list[str]:
    """Every file under a script folder of benchmarks/results, as ``<script>/<name>``."""
    return sorted(str(p.relative_to(RESULTS)) for p in RESULTS.glob("*/*") if p.is_file())


def test_index_lists_every_result_file(tmp_path):
    out = tmp_path / "INDEX.md"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "index.py"), "--out", str(out)], check=True,
                   cwd=ROOT, capture_output=True, timeout=120)
    text = out.read_text()
    files = result_files()
    assert len(files) > 50, files
    missing = [f for f in files if f"]({f})" not in text]
    assert not missing, f"INDEX.md does not list {missing}"
    # one table per script folder
    for folder in sorted({f.split("/")[0] for f in files}):
        assert f"\n## {folder}\n" in text, folder
    # the committed index is up to date (regenerate with `python benchmarks/index.py`)
    committed = (RESULTS / "INDEX.md").read_text()
    assert [f for f in files if f"]({f})" not in committed] == [], "benchmarks/results/INDEX.md is stale"


def test_results_top_level_is_small():
    """Results live in one folder per script; the top level keeps at most a few files (the index)."""
    top = [p.name for p in RESULTS.iterdir() if p.is_file()]
    assert len(top) <= 5, top
