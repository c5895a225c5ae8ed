"""The documentation site builds without a warning (what `make docs` runs), when Sphinx and MyST are installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.mpi_util import ROOT

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sphinx") is None or importlib.util.find_spec("myst_parser") is None,
    reason="sphinx or myst-parser not installed (pip install '.[docs]')",
)


def test_sphinx_build_has_no_warnings(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "-d", str(tmp_path / "doctrees"),
         str(ROOT / "docs"), str(tmp_path / "html")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, f"sphinx-build failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    html = tmp_path / "html"
    for page in ("index", "optimizers", "experimental", "migration", "api", "benchmarks/BENCHMARKS",
                 "benchmarks/results/INDEX"):
        assert (html / f"{page}.html").is_file(), page
    api = (html / "api.html").read_text()
    for name in ("jonebit.onebit_adam", "jonebit.comm.compressed_allreduce", "jonebit.sharding.zero_shardings",
                 "jonebit.nnx.make_train_step", "jonebit.train.initialize.initialize"):
        assert f'id="{name}"' in api, f"the API reference lacks {name}"
