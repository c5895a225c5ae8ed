"""0/1 Adam and 1-bit LAMB with ``mpi_comm`` under ``mpirun -np 2/4`` against the shard_map path."""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest

from jonebit import sharded_init, state_specs
from tests.mpi_util import run_mpi
from tests.transforms.family_util import (
    mesh_of,
    per_rank_stepper,
    put_replicated,
    put_rows,
    replicated_stepper,
    stack,
)
from tests.transforms.mpi_family_cases import CASES, STEPS, build, grads, params0

WORKER = pathlib.Path(__file__).with_name("mpi_family_worker.py")


def shard_map_run(world: int, name: str) -> tuple[dict, dict]:
    """The same updates over a shard_map mesh; returns (per-rank params, state) as numpy global arrays."""
    mesh = mesh_of(world)
    tx = build(name)
    state, specs = sharded_init(tx, params0(), mesh)
    g = grads(world)
    if CASES[name][0] == "onebit_lamb":  # replicated params (LAMB keeps them identical on all ranks)
        step = replicated_stepper(tx, mesh, specs)
        params = put_replicated(params0(), mesh)
    else:  # 0/1 Adam's local steps move each rank's params on their own
        step = per_rank_stepper(tx, mesh, specs)
        params = put_rows({k: np.stack([v] * world) for k, v in params0().items()}, mesh)
    for t in range(STEPS):
        params, state = step(params, state, put_rows(stack(g[t]), mesh))
    params = jax.device_get(params)
    if CASES[name][0] == "onebit_lamb":
        params = {k: np.stack([v] * world) for k, v in params.items()}
    return params, jax.device_get(state), state_specs(jax.eval_shape(lambda: state))


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"np{p}")
def mpi_results(request, tmp_path_factory):
    world = request.param
    outdir = tmp_path_factory.mktemp(f"family{world}")
    run_mpi(world, WORKER, outdir, timeout=300)
    return world, [dict(np.load(outdir / f"rank{r}.npz")) for r in range(world)]


@pytest.mark.mpi
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CASES))
def test_mpi_equals_shard_map_bit_for_bit(mpi_results, name):
    world, ranks = mpi_results
    params, state, specs = shard_map_run(world, name)
    assert max(np.abs(e).max() for e in jax.tree.leaves(state.worker_error)) > 0  # compression ran
    leaves = jax.tree_util.tree_leaves_with_path(state)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
    for r, got in enumerate(ranks):
        for k, v in params.items():
            np.testing.assert_array_equal(got[f"{name}/params/{k}"], v[r], err_msg=f"rank {r} params {k}")
        for (path, want), spec in zip(leaves, spec_leaves, strict=True):
            want = np.asarray(want)
            if spec == jax.sharding.PartitionSpec("data"):  # per-rank rows of the global array
                want = want[r:r + 1]
            key = f"{name}/state{jax.tree_util.keystr(path)}"
            np.testing.assert_array_equal(got[key], want, err_msg=f"rank {r} {key}")
