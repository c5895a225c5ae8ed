"""Every test process sees 8 simulated CPU devices; set before jax is imported anywhere."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from tests.mpi_util import HANG_GUARD  # noqa: E402  (standard library only: jax is not imported yet)

# XLA:CPU's 40 s collective termination timeout becomes a hang guard (see HANG_GUARD), as in child processes.
for _flag in ("--xla_force_host_platform_device_count=8", HANG_GUARD):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

# Compile with XLA's optimisations mostly off (LLVM -O0, no expensive passes): the suite spends most of its time
# compiling 8-device programs that then run a few steps, and this cuts its CPU time by about a fifth. Tests assert
# semantics with bounds derived for any summation order, so the level does not change what they prove; the default
# level's exact arithmetic is pinned by the golden replay, which runs at the default level in its own process.
# Subprocesses (CLI runs, launched and MPI ranks) inherit it. Benchmarks run at the default level, and so does a test
# marked ``optimized`` (one that trains for many steps, where unoptimised code costs more than compiling saves).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# One compilation cache for the whole run, shared with the subprocesses (CLI runs, multi-process and MPI ranks):
# tests that compile a program another test already compiled load it instead (the key is the program, not the
# closure that built it, so two tests' step builders making the same step share it). Every program is stored, not
# only those that took long: at the suite's low optimisation level most compile in well under a second, and
# storing them all took tests/train from 490 to 445 CPU seconds. It lives and dies with the run, so no run
# depends on an earlier one.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE = tempfile.mkdtemp(prefix="jonebit-test-xla-cache-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
else:
    _CACHE = None

import pathlib  # noqa: E402
import shutil  # noqa: E402

import pytest  # noqa: E402

SHARED = pathlib.Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture(scope="session")
def shared_data():
    """Path of ../shared/data (SQuAD, vocab, corpora); tests that need it skip cleanly when it is absent."""
    path = SHARED / "data"
    if not path.is_dir():
        pytest.skip("../shared/data not present")
    return path


@pytest.fixture(autouse=True)
def _optimisation_level(request, monkeypatch):
    if request.node.get_closest_marker("optimized") is None:
        yield
        return
    import jax

    before = jax.config.read("jax_disable_most_optimizations")
    monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")  # and for the subprocesses it starts
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


def pytest_sessionfinish(session, exitstatus):
    if _CACHE is not None and not hasattr(session.config, "workerinput"):
        shutil.rmtree(_CACHE, ignore_errors=True)
