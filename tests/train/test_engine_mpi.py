"""The engine over MPI: ``initialize`` with ``comm_backend_name: "mpi"`` under ``mpirun -np 2/4`` against the same
config run by the jax-collective engine on 2/4 simulated devices in this process (same data split, same keys)."""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import pytest

from jonebit.sharding.mesh import data_mesh
from jonebit.train.initialize import initialize
from jonebit.train.loop import ArrayBatches
from tests.mpi_util import run_mpi
from tests.train import mpi_engine_cases as C

WORKER = pathlib.Path(__file__).with_name("mpi_engine_worker.py")
pytestmark = [pytest.mark.mpi, pytest.mark.multiprocess, pytest.mark.slow]


def reference(world: int, opt: str) -> list[dict]:
    """The worker's ``step`` run on the jax-collective engine ("nccl") over ``world`` simulated devices: what each
    rank must save (the same for every rank but with 0/1 Adam, whose ranks keep their own parameter copies)."""
    engine = initialize(C.config(world, "nccl", opt), C.loss_fn, C.params0(), mesh=data_mesh(world), rng_seed=C.SEED)
    state, out = engine.state, [{} for _ in range(world)]
    for t in range(C.STEPS):
        state, m = engine.step(state, C.global_batch(world, t))
        m = jax.device_get(m)
        for r in range(world):
            for k in ("loss", "grad_norm", "skipped"):
                out[r][f"{k}/{t}"] = np.asarray(m[k])
            for k, v in C.rank_params(state.params, r).items():
                out[r][f"params/{t}/{k}"] = v
    for r in range(world):
        out[r]["skipped_total"] = np.asarray(state.skipped)
    return out


@pytest.fixture(scope="module", params=[(1, "OneBitAdam"), (2, "OneBitAdam"), (4, "OneBitAdam"), (2, "OneBitLamb"),
                                        (2, "ZeroOneAdam")],
                ids=lambda p: f"np{p[0]}-{p[1]}")
def step_results(request, tmp_path_factory):
    world, opt = request.param
    outdir = tmp_path_factory.mktemp(f"engine{world}")
    run_mpi(world, WORKER, "step", outdir, opt, timeout=300)
    return world, opt, [dict(np.load(outdir / f"step-{opt}-rank{r}.npz")) for r in range(world)]


WARMUP_STEPS = C.FREEZE - 1  # 0-based steps 0 .. FREEZE - 2 are full-precision updates (0/1 Adam: variance steps)


def _same_run(got, want, key):
    """The MPI engine and the jax engine compile different programs (mpi4jax's calls against XLA's collectives), so
    the compiler may order or contract the same float32 operations differently: each may round differently by 1 ulp
    (6e-8 relative). Flags and counts are exact. Floats are compared only up to the first 1-bit step: over at most
    2 steps of ~20 operations per element the difference stays below 1e-5 relative. After a 1-bit step a 1-ulp
    difference can flip a sign and move an element by two scales, so the two programs' later values are not
    compared element by element (the recorded golden trajectories check the compressed arithmetic exactly, and
    the ranks of one MPI run are compared bit for bit below)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype == np.bool_ or np.issubdtype(got.dtype, np.integer):
        np.testing.assert_array_equal(got, want, err_msg=key)
        return
    step = int(key.split("/")[1])  # "rank R loss/T", "rank R params/T/leaf"
    if step < WARMUP_STEPS:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=key)
    else:
        assert np.isfinite(got).all() == np.isfinite(want).all(), key  # the NaN step's loss on both


def test_mpi_engine_equals_jax_engine(step_results):
    world, opt, ranks = step_results
    refs = reference(world, opt)
    assert not np.allclose(refs[0][f"params/{C.STEPS - 1}/w1"], C.params0()["w1"])
    for r, got in enumerate(ranks):
        assert set(got) == set(refs[r])
        for key, want in refs[r].items():
            _same_run(got[key], want, f"rank {r} {key}")
    last = f"params/{C.STEPS - 1}/w1"
    if opt == "ZeroOneAdam":  # the run ends in a local step: each rank's own copy
        assert world == 1 or not np.array_equal(ranks[0][last], ranks[1][last])
        return
    # Every rank of the MPI run (one program) ends, and is at every step, bit-identical.
    for got in ranks[1:]:
        for key in refs[0]:
            np.testing.assert_array_equal(got[key], ranks[0][key], err_msg=key)


def test_mpi_engine_nan_on_one_rank_skips_everywhere(step_results):
    world, _, ranks = step_results
    if world <= C.NAN_RANK:
        pytest.skip(f"the NaN goes to rank {C.NAN_RANK}")
    t = C.NAN_STEP - 1
    for got in ranks:
        assert bool(got[f"skipped/{t}"]) and int(got["skipped_total"]) == 1
        assert not any(bool(got[f"skipped/{s}"]) for s in range(C.STEPS) if s != t)
        for k in C.params0():  # the skipped step left the params bit-identical
            np.testing.assert_array_equal(got[f"params/{t}/{k}"], got[f"params/{t - 1}/{k}"])
        assert np.isfinite(got[f"params/{C.STEPS - 1}/w1"]).all()


def test_mpi_engine_loop_checkpoints_per_rank_and_resumes(tmp_path):
    """Engine.train under mpirun -np 2: metrics from rank 0 only, checkpoints per rank; a run that one rank's
    SIGTERM stops (every rank after the same step, with a checkpoint), resumed by a second mpirun, ends where an
    uninterrupted one (and the jax engine's loop) does."""
    world = 2
    full, split = tmp_path / "full", tmp_path / "split"
    full.mkdir()
    split.mkdir()
    run_mpi(world, WORKER, "loop", full, 4, timeout=300)
    run_mpi(world, WORKER, "loop", split, 4, 1, timeout=300)  # rank 1 alone is signalled after step 1
    for r in range(world):
        assert bool(np.load(split / f"loop-OneBitAdam-rank{r}.npz")["preempted"])
        assert sorted(int(p.name) for p in (split / "checkpoints" / f"rank-{r}").iterdir() if p.name.isdigit()) \
            in ([1], [2])
    steps = [sorted(p.name for p in (split / "checkpoints" / f"rank-{r}").iterdir()) for r in range(world)]
    assert steps[0] == steps[1], steps  # stopped together
    first = (split / "metrics.jsonl").read_text().splitlines()
    run_mpi(world, WORKER, "loop", split, 4, timeout=300)
    # Resumed, not rerun: the first run's records (wall times included) are still there.
    assert first and (split / "metrics.jsonl").read_text().splitlines()[:len(first)] == first
    for d in (full, split):
        assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["rank-0", "rank-1"]
        lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        assert [x["step"] for x in lines] == [1, 2, 3, 4]  # rank 0 alone writes (no duplicated lines)
    a = [dict(np.load(full / f"loop-OneBitAdam-rank{r}.npz")) for r in range(world)]
    b = [dict(np.load(split / f"loop-OneBitAdam-rank{r}.npz")) for r in range(world)]
    for r in range(world):
        assert int(a[r]["step"]) == int(b[r]["step"]) == 4
        for k in C.params0():
            np.testing.assert_array_equal(b[r][f"params/{k}"], a[r][f"params/{k}"])
            np.testing.assert_array_equal(a[r][f"params/{k}"], a[0][f"params/{k}"])
    # The same run on the jax-collective engine's loop.
    engine = initialize(C.config(world, "nccl"), C.loss_fn, C.params0(), mesh=data_mesh(world), rng_seed=C.SEED)
    batches = ArrayBatches(C.data(), engine.batch.train_batch_size, seed=11)
    state = engine.train(batches, engine.loop_config(tmp_path / "ref", 4, async_checkpoint=False,
                                                     progress_bar=False, tensorboard=False))
    ref_lines = [json.loads(x) for x in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    for k in C.params0():
        np.testing.assert_allclose(a[0][f"params/{k}"], np.asarray(jax.device_get(state.params[k])),
                                   rtol=1e-6, atol=1e-7)
    for got, want in zip(lines, ref_lines, strict=True):
        assert got["stage"] == want["stage"]
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)


def test_mpi_engine_resume_needs_the_same_world_size(tmp_path):
    """Checkpoints written by 2 MPI ranks are refused by a 1-rank run, with the reason."""
    import subprocess
    import sys

    from tests.mpi_util import require_mpi, worker_env

    run_mpi(2, WORKER, "loop", tmp_path, 2, timeout=300)
    mpirun = require_mpi()
    proc = subprocess.run([mpirun, "--oversubscribe", "-np", "1", sys.executable, str(WORKER), "loop", str(tmp_path),
                           "4"], cwd=WORKER.parents[2], env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "written by 2 data-parallel ranks, this run has 1" in proc.stdout + proc.stderr
