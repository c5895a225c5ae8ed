import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jonebit import onebit_adam
from jonebit.comm import compressed_bytes_per_rank
from jonebit.comm.accounting import comm_report
from jonebit.train.data_parallel import data_mesh, init_optimizer, make_update, replicate, shard_batch


def compiled_text(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def test_psum_and_all_gather_bytes_follow_ring_formulas():
    mesh = data_mesh(8)
    x = shard_batch(jnp.ones(8000), mesh)

    def f(x):
        return lax.psum(x, "data"), lax.all_gather(x, "data", tiled=True)

    body = jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=(P("data"), P("data")))
    report = comm_report(compiled_text(body, x), 8)
    ops = sorted((c.op, c.result_bytes, c.group_size) for c in report.always)
    assert ops == [("all-gather", 32000, 8), ("all-reduce", 4000, 8)]
    assert report.always_bytes == 2 * 7 / 8 * 4000 + 7 / 8 * 32000


def test_group_size_from_a_sub_axis():
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    x = jax.device_put(jnp.ones((2, 4, 100)), jax.NamedSharding(mesh, P("a", "b")))
    body = jax.shard_map(lambda x: lax.psum(x, "b"), mesh=mesh, in_specs=P("a", "b"), out_specs=P("a", "b"))
    (c,) = comm_report(compiled_text(body, x), 8).always
    assert (c.op, c.group_size, c.result_bytes) == ("all-reduce", 4, 400)
    assert c.bytes_sent == 2 * 3 / 4 * 400


def test_onebit_adam_stage_bytes_match_the_spec_formula():
    mesh = data_mesh(8)
    params = replicate({"w": np.zeros((37, 29), np.float32), "b": np.zeros(11, np.float32)}, mesh)
    n = 37 * 29 + 11
    tx = onebit_adam(1e-3, freeze_step=5)
    state, specs = init_optimizer(tx, params, mesh)
    grads = shard_batch({"w": np.zeros((8, 37, 29), np.float32), "b": np.zeros((8, 11), np.float32)}, mesh)
    hlo = make_update(tx, mesh, specs).lower(params, state, grads).compile().as_text()
    report = comm_report(hlo, 8)
    # Always: the 4-byte all-reduce of the non-finite flag; nothing else outside the two branches.
    assert [(c.op, c.result_bytes) for c in report.always] == [("all-reduce", 4)]
    flag = 2 * 7 / 8 * 4
    compression, warmup, skip = report.branches[0]
    assert skip == ()  # a step skipped for a non-finite gradient sends nothing more
    assert sorted(c.op for c in compression) == ["all-gather", "all-to-all"]  # no full-precision all-reduce
    assert all(c.op == "all-reduce" for c in warmup)
    assert report.branch_bytes(0) == compressed_bytes_per_rank(n, 8) + flag
    assert report.branch_bytes(1) == 2 * 7 / 8 * 4 * n + flag


def test_adamw_with_mean_allreduce():
    mesh = data_mesh(4)
    params = replicate({"w": np.zeros(1000, np.float32)}, mesh)
    tx = optax.adamw(1e-3)
    state, specs = init_optimizer(tx, params, mesh)
    grads = shard_batch({"w": np.zeros((4, 1000), np.float32)}, mesh)
    hlo = make_update(tx, mesh, specs, grad_reduce="mean").lower(params, state, grads).compile().as_text()
    assert comm_report(hlo, 4).always_bytes == 2 * 3 / 4 * 4000
