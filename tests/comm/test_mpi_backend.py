"""MPIBackend under ``mpirun -np 2/4`` against AxisBackend (shard_map over P simulated devices): bitwise."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jonebit.comm import compressed_allreduce, padded_size
from tests.comm.mpi_cases import ALLREDUCE_CASES, allreduce_inputs, mean_inputs
from tests.mpi_util import run_mpi

WORKER = pathlib.Path(__file__).with_name("mpi_worker.py")


def _mesh(world):
    return jax.make_mesh((world,), ("data",), devices=jax.devices()[:world])


def _shard(mesh, x):
    return jax.device_put(np.asarray(x), NamedSharding(mesh, P("data")))


def shard_map_allreduce(world, n, steps):
    """Reference: the same calls through the shard_map backend, error buffers carried across steps."""
    mesh = _mesh(world)

    def body(x, we, se):
        out, we, se = compressed_allreduce(x[0], we[0], se[0], axis_name="data")
        return out[None], we[None], se[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    x = allreduce_inputs(n, world, steps)
    n_pad = padded_size(n, world)
    we = _shard(mesh, np.zeros((world, n_pad), np.float32))
    se = _shard(mesh, np.zeros((world, n_pad // world), np.float32))
    outs = []
    for t in range(steps):
        out, we, se = f(_shard(mesh, x[t]), we, se)
        outs.append(np.asarray(jax.device_get(out)))
    return np.stack(outs, axis=1), np.asarray(jax.device_get(we)), np.asarray(jax.device_get(se))


def shard_map_mean(world):
    mesh = _mesh(world)
    trees = mean_inputs(world)
    stacked = jax.tree.map(lambda *xs: _shard(mesh, np.stack(xs)), *trees)
    f = jax.jit(
        jax.shard_map(
            lambda t: jax.tree.map(lambda v: jax.lax.pmean(v[0], "data")[None], t),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P("data"),
        )
    )
    return jax.tree.map(lambda v: np.asarray(jax.device_get(v)), f(stacked))


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"np{p}")
def mpi_results(request, tmp_path_factory):
    world = request.param
    outdir = tmp_path_factory.mktemp(f"mpi{world}")
    run_mpi(world, WORKER, outdir, timeout=180)
    return world, [dict(np.load(outdir / f"rank{r}.npz")) for r in range(world)]


@pytest.mark.mpi
@pytest.mark.multiprocess
@pytest.mark.parametrize("n,steps", ALLREDUCE_CASES)
def test_compressed_allreduce_mpi_bitwise_equals_shard_map(mpi_results, n, steps):
    world, ranks = mpi_results
    ref_out, ref_we, ref_se = shard_map_allreduce(world, n, steps)
    for r, got in enumerate(ranks):
        np.testing.assert_array_equal(got[f"ar{n}_out"], ref_out[r], err_msg=f"rank {r} output")
        np.testing.assert_array_equal(got[f"ar{n}_we"], ref_we[r], err_msg=f"rank {r} worker error")
        np.testing.assert_array_equal(got[f"ar{n}_se"], ref_se[r], err_msg=f"rank {r} server error")
    # Independent sanity check: identical on every rank, and close to the true mean after error feedback.
    for got in ranks[1:]:
        np.testing.assert_array_equal(got[f"ar{n}_out"], ranks[0][f"ar{n}_out"])
    # Error feedback telescopes: summed over the calls, output + what the final errors still hold equals the
    # summed true mean (mean over ranks of the worker errors, plus the server error chunks rank by rank).
    # Measured within 1.5e-5 for inputs up to 300; each output alone is up to ~300 away from the true mean.
    x = allreduce_inputs(n, world, steps).astype(np.float64)
    held = np.mean([r[f"ar{n}_we"] for r in ranks], axis=0, dtype=np.float64)[:n]
    held += np.concatenate([r[f"ar{n}_se"] for r in ranks]).astype(np.float64)[:n]
    total = ranks[0][f"ar{n}_out"].astype(np.float64).sum(0)
    np.testing.assert_allclose(total + held, x.mean(1).sum(0), rtol=0, atol=1e-6 * steps * max(np.abs(x).max(), 1.0))


@pytest.mark.mpi
@pytest.mark.multiprocess
def test_mean_ordered_bitwise_equals_pmean(mpi_results):
    world, ranks = mpi_results
    ref = shard_map_mean(world)
    trees = mean_inputs(world)
    for r, got in enumerate(ranks):
        for k in ref:
            np.testing.assert_array_equal(got[f"mean_ordered_{k}"], ref[k][r], err_msg=f"rank {r} leaf {k}")
            assert got[f"mean_ordered_{k}"].dtype == trees[0][k].dtype
    # numpy reference: left-to-right sum in rank order, divided by P.
    for k in ("w", "b"):
        acc = trees[0][k]
        for t in trees[1:]:
            acc = acc + t[k]
        np.testing.assert_array_equal(ranks[0][f"mean_ordered_{k}"], acc / np.float32(world))


@pytest.mark.mpi
@pytest.mark.multiprocess
def test_mean_allreduce_close_to_pmean(mpi_results):
    """MPI_Allreduce sums in the library's order: bitwise for P=2 (a+b == b+a), within rounding for P=4."""
    world, ranks = mpi_results
    ref = shard_map_mean(world)
    for r, got in enumerate(ranks):
        for k in ref:
            a, b = got[f"mean_allreduce_{k}"], ref[k][r]
            if world == 2:
                np.testing.assert_array_equal(a, b)
            else:
                tol = 1e-2 if a.dtype == np.float16 else 1e-5
                np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
        np.testing.assert_array_equal(got["mean_allreduce_w"], ranks[0]["mean_allreduce_w"])


def test_mpi_backend_rejects_bad_input():
    mpi4py = pytest.importorskip("mpi4py")
    pytest.importorskip("mpi4jax")
    from jonebit.comm import MPIBackend, get_backend

    with pytest.raises(TypeError, match="mpi4py communicator"):
        MPIBackend(object())
    from mpi4py import MPI

    assert mpi4py is not None
    with pytest.raises(ValueError, match="mean must be one of"):
        MPIBackend(MPI.COMM_SELF, mean="fast")
    with pytest.raises(ValueError, match="not both"):
        get_backend("data", MPI.COMM_SELF)
    backend = MPIBackend(MPI.COMM_SELF, mean="allreduce")
    assert get_backend(mpi_comm=backend) is backend
    # A world of one: the compressed allreduce still runs (single process, no mpirun needed).
    x = jnp.arange(16, dtype=jnp.float32) - 7.5
    out, we, se = jax.jit(lambda x, a, b: compressed_allreduce(x, a, b, mpi_comm=MPI.COMM_SELF))(
        x, jnp.zeros(padded_size(16, 1)), jnp.zeros(padded_size(16, 1))
    )
    # Spec identities with P=1: z = x - e_w_new and out + e_s_new = z.
    np.testing.assert_allclose(np.asarray(out + se + we), np.asarray(x), rtol=1e-6, atol=1e-6)
