"""Hierarchical compressed allreduce: numpy model, bit-identity, and the bytes of the compiled program."""

import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jonebit import onebit_adam
from jonebit.comm import compressed_allreduce, compressed_bytes_per_rank
from jonebit.comm.accounting import _groups, comm_report, inter_host_bytes, partition_hosts
from jonebit.comm.hierarchical import error_sizes, hierarchical_bytes_per_device, hierarchical_compressed_allreduce
from jonebit.sharding.mesh import free_port
from jonebit.train.data_parallel import hierarchical_mesh, init_optimizer, make_update, replicate, shard_batch
from tests.mpi_util import ROOT, worker_env
from tests.reference import np_compressed_allreduce, np_padded
from tests.reference_hierarchical import np_hier_error_sizes, np_hierarchical_allreduce

AXES = ("hosts", "local")
ROWS = P(AXES)
DIST_WORKER = pathlib.Path(__file__).with_name("hier_dist_worker.py")


def mesh_of(hosts, local):
    return jax.make_mesh((hosts, local), AXES, axis_types=(AxisType.Explicit,) * 2,
                         devices=jax.devices()[:hosts * local])


def hier_call(mesh):
    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=ROWS, out_specs=ROWS)
    def call(x, we, se):
        out, we, se = hierarchical_compressed_allreduce(x[0], we[0], se[0], axis_name=AXES)
        return out[None], we[None], se[None]

    return call


def flat_call(p):
    mesh = jax.make_mesh((p,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:p])

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    def call(x, we, se):
        out, we, se = compressed_allreduce(x[0], we[0], se[0], axis_name="data")
        return out[None], we[None], se[None]

    return call, mesh


def nested(rows, hosts, local):
    return [list(rows[h * local:(h + 1) * local]) for h in range(hosts)]


@pytest.mark.parametrize("hosts,local,n", [(2, 4, 1001), (4, 2, 1001), (2, 4, 37), (4, 2, 6400), (2, 2, 5)])
def test_matches_numpy_two_level_model_over_5_calls(hosts, local, n):
    rng = np.random.default_rng(hosts * 100 + local * 10 + n)
    mesh = mesh_of(hosts, local)
    call = hier_call(mesh)
    put = lambda a: jax.device_put(a, jax.NamedSharding(mesh, ROWS))  # noqa: E731
    w_len, s_len = np_hier_error_sizes(n, hosts, local)
    assert error_sizes(n, hosts, local) == (w_len, s_len)
    p = hosts * local
    we, se = np.zeros((p, w_len), np.float32), np.zeros((p, s_len), np.float32)
    ref_we, ref_se = nested(we, hosts, local), nested(se, hosts, local)
    for t in range(5):
        # Different scales per device, so the local mean and the per-host scales both matter.
        x = rng.standard_normal((p, n)).astype(np.float32) * rng.uniform(0.1, 3.0, (p, 1)).astype(np.float32)
        out, we, se = [np.asarray(a) for a in call(put(x), put(we), put(se))]
        ref_out, ref_we, ref_se = np_hierarchical_allreduce(nested(x, hosts, local), ref_we, ref_se)
        for r in range(1, p):  # every device holds the same result, bit for bit
            np.testing.assert_array_equal(out[r], out[0], err_msg=f"call {t}: device {r} differs from device 0")
        np.testing.assert_allclose(out[0], ref_out, rtol=1e-5, atol=1e-6, err_msg=f"call {t}")
        np.testing.assert_allclose(we, np.stack([e for row in ref_we for e in row]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(se, np.stack([e for row in ref_se for e in row]), rtol=1e-5, atol=1e-5)
        # It is not flat compression: on the same inputs the flat reference gives another answer.
        if t == 0:
            flat, _, _ = np_compressed_allreduce(list(x), [np.zeros(np_padded(n, p), np.float32)] * p,
                                                 [np.zeros(np_padded(n, p) // p, np.float32)] * p)
            assert np.abs(flat - out[0]).max() > 1e-3


def test_one_host_is_the_exact_mean_compressed_once_per_shard():
    """H = 1: nothing to compress across; the hosts allreduce of one rank still signs each shard by its RMS."""
    mesh = mesh_of(1, 4)
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    w_len, s_len = error_sizes(64, 1, 4)
    put = lambda a: jax.device_put(a, jax.NamedSharding(mesh, ROWS))  # noqa: E731
    out, _, _ = hier_call(mesh)(put(x), put(np.zeros((4, w_len), np.float32)), put(np.zeros((4, s_len), np.float32)))
    mean = x.mean(0).reshape(4, 16)
    rms = np.sqrt((mean.astype(np.float64) ** 2).mean(1, keepdims=True))
    np.testing.assert_allclose(np.asarray(out)[0], (rms * np.where(mean >= 0, 1, -1)).reshape(-1), rtol=1e-5)


def inter_host(mesh, hosts_of, fn, *args):
    report = comm_report(jax.jit(fn).lower(*args).compile().as_text(), int(np.prod(list(mesh.shape.values()))))
    return report, inter_host_bytes(report.always, hosts_of)


@pytest.mark.parametrize("hosts,local", [(2, 4), (4, 2)])
def test_bytes_between_hosts_are_uint8_and_one_over_local_of_flat(hosts, local):
    n, p = 6400, hosts * local  # n / L is a multiple of H * lcm(H, 8) and n of P * lcm(P, 8): no padding
    assert np_padded(n, p) == n and np_padded(n // local, hosts) == n // local
    mesh = mesh_of(hosts, local)
    hosts_of = partition_hosts(mesh, "hosts")
    assert hosts_of == [i // local for i in range(p)]
    w_len, s_len = error_sizes(n, hosts, local)
    put = lambda a: jax.device_put(a, jax.NamedSharding(mesh, ROWS))  # noqa: E731
    report, hier_bytes = inter_host(mesh, hosts_of, hier_call(mesh), put(np.zeros((p, n), np.float32)),
                                    put(np.zeros((p, w_len), np.float32)), put(np.zeros((p, s_len), np.float32)))
    crossing = [c for c in report.always if any(len({hosts_of[d] for d in g}) > 1 for g in c.groups)]
    inside = [c for c in report.always if c not in crossing]
    # Across hosts: the all-to-all and all-gather of the compressed allreduce, uint8 only, groups of H.
    assert sorted(c.op for c in crossing) == ["all-gather", "all-to-all"]
    assert all(set(c.dtypes) == {"u8"} and c.group_size == hosts for c in crossing), crossing
    # Inside a host: the float32 reduce-scatter of the momentum and the uint8 all-gather of the packed result.
    assert sorted((c.op, c.dtypes[0]) for c in inside) == [("all-gather", "u8"), ("reduce-scatter", "f32")]
    assert all(c.group_size == local for c in inside)
    expect = hierarchical_bytes_per_device(n, hosts, local)
    s = n // local
    row = s // hosts // 8 + 4
    assert expect["hosts"] == 2 * (hosts - 1) * row == compressed_bytes_per_rank(s, hosts)
    assert sum(c.bytes_sent for c in crossing) == expect["hosts"]
    assert {c.op: c.bytes_sent for c in inside} == {"reduce-scatter": expect["local_f32"],
                                                     "all-gather": expect["local_u8"]}
    assert hier_bytes == local * expect["hosts"]  # per host: its L devices each talk to the other hosts

    # Flat compression over all P devices, hosts = consecutive blocks of L devices.
    call, flat_mesh = flat_call(p)
    put_flat = lambda a: jax.device_put(a, jax.NamedSharding(flat_mesh, P("data")))  # noqa: E731
    _, flat_bytes = inter_host(flat_mesh, hosts_of, call, put_flat(np.zeros((p, n), np.float32)),
                               put_flat(np.zeros((p, n), np.float32)), put_flat(np.zeros((p, n // p), np.float32)))
    # The formulas written out, per host: flat, each of its L devices sends N/8 sign bytes in each of the two
    # phases, the share (H-1)L/(P-1) of it to other hosts, plus 8 scale bytes per off-host peer; hierarchical,
    # each device sends the N/(L 8) sign bytes of its shard in each phase, (H-1)/H of it off host, plus 8 per peer.
    flat_formula = local * ((2 * (p - 1) * (n // p // 8 + 4)) * (hosts - 1) * local / (p - 1))
    hier_formula = local * (2 * (hosts - 1) * (n // local // hosts // 8 + 4))
    assert flat_bytes == pytest.approx(flat_formula) and hier_bytes == pytest.approx(hier_formula)
    assert hier_bytes == pytest.approx(flat_bytes / local)


@pytest.mark.parametrize("hosts,local", [(2, 4), (4, 2)])
def test_onebit_adam_step_bytes_on_a_hierarchical_mesh(hosts, local):
    """make_update on hierarchical_mesh: compression sends only uint8 across hosts, 1/L of flat's; warmup fp32."""
    p = hosts * local
    mesh = hierarchical_mesh(hosts=hosts)
    assert dict(mesh.shape) == {"hosts": hosts, "local": local}
    hosts_of = partition_hosts(mesh, "hosts")
    shapes = {"w": (64, 50), "b": (64,)}  # 3264 floats: fused, one buffer
    n = 64 * 50 + 64
    params = replicate({k: np.zeros(s, np.float32) for k, s in shapes.items()}, mesh)
    grads = shard_batch({k: np.zeros((p, *s), np.float32) for k, s in shapes.items()}, mesh, AXES)
    totals = {}
    for name, axis, tx in (("hier", AXES, onebit_adam(1e-3, freeze_step=2, fused=True, axis_name=AXES)),
                           ("flat", "data", onebit_adam(1e-3, freeze_step=2, fused=True))):
        m = mesh if name == "hier" else jax.make_mesh((p,), ("data",), axis_types=(AxisType.Explicit,))
        prm = params if name == "hier" else replicate({k: np.zeros(s, np.float32) for k, s in shapes.items()}, m)
        g = grads if name == "hier" else shard_batch({k: np.zeros((p, *s), np.float32) for k, s in shapes.items()}, m)
        state, specs = init_optimizer(tx, prm, m, axis)
        hlo = make_update(tx, m, specs, axis=axis).lower(prm, state, g).compile().as_text()
        report = comm_report(hlo, p)
        warmup, compression = report.branches[0]  # OneBitAdamState.PHASES order
        assert all(set(c.dtypes) == {"f32"} for c in warmup)  # warmup: fp32 mean over every device
        assert [c.group_size for c in warmup] == [p]
        crossing = [c for c in compression if any(len({hosts_of[d] for d in grp}) > 1 for grp in c.groups)]
        if name == "hier":
            assert all(set(c.dtypes) == {"u8"} for c in crossing), crossing  # no float crosses hosts
            assert [c.op for c in compression if c not in crossing] == ["reduce-scatter", "all-gather"]
            assert report.always == ()  # everything the optimizer sends is in its phases
        totals[name] = inter_host_bytes(compression, hosts_of)
    s = -(-n // local)
    assert totals["hier"] == local * compressed_bytes_per_rank(s, hosts)
    # Padding aside (n = 3264 is not a multiple of every unit), the ratio is L.
    assert totals["flat"] / totals["hier"] == pytest.approx(local, rel=0.03)


def test_iota_replica_groups_are_read():
    line = "%a = f32[4]{0} all-reduce(%x), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add"
    assert _groups(line) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert _groups("all-gather(%x), replica_groups=[2,4]<=[8], dimensions={0}") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert _groups("all-gather(%x), replica_groups={{0,2},{1,3}}, dimensions={0}") == ((0, 2), (1, 3))
    assert _groups("all-reduce(%x), replica_groups={}, to_apply=%add") is None
    expect = np.arange(24).reshape(2, 3, 4).transpose(2, 0, 1).reshape(4, 6)
    assert _groups("x, replica_groups=[4,6]<=[2,3,4]T(2,0,1), y") == tuple(map(tuple, expect.tolist()))


def test_bad_inputs_are_clear_errors():
    mesh = mesh_of(2, 4)
    put = lambda a: jax.device_put(a, jax.NamedSharding(mesh, ROWS))  # noqa: E731
    with pytest.raises(ValueError, match=r"worker/server errors must have shapes \(256,\)/\(128,\)"):
        hier_call(mesh)(put(np.zeros((8, 1001), np.float32)), put(np.zeros((8, 64), np.float32)),
                        put(np.zeros((8, 64), np.float32)))

    def with_axes(axes):
        @jax.jit
        @jax.shard_map(mesh=mesh, in_specs=ROWS, out_specs=ROWS)
        def call(x):
            out, _, _ = hierarchical_compressed_allreduce(x[0], jnp.zeros(16), jnp.zeros(8), axis_name=axes)
            return out[None]
        return call(put(np.zeros((8, 5), np.float32)))

    with pytest.raises(ValueError, match="pair of mesh axis names"):
        with_axes("hosts")
    with pytest.raises(ValueError, match="pair of mesh axis names"):
        with_axes(("hosts", "local", "data"))
    with pytest.raises(ValueError, match="mesh axis 'nodes' is not bound here"):
        with_axes(("nodes", "local"))
    with pytest.raises(ValueError, match="hosts=3 x local=4 needs 12 devices, there are 8"):
        hierarchical_mesh(hosts=3, local=4)
    with pytest.raises(ValueError, match="local must be a positive int"):
        hierarchical_mesh(local=0)
    with pytest.raises(ValueError, match="two different axis names"):
        hierarchical_mesh(local=4, axes=("a", "a"))
    with pytest.raises(ValueError, match="partition_hosts: mesh has no axis 'nodes'"):
        partition_hosts(mesh, "nodes")


@pytest.mark.multiprocess
def test_two_processes_are_the_hosts_of_the_default_mesh(tmp_path):
    """2 jax.distributed processes x 2 CPU devices: hierarchical_mesh() has one row per process, and the allreduce
    across them gives the numpy model's result on every device of both processes."""
    procs = []
    port = free_port("127.0.0.1")
    for rank in range(2):
        env = worker_env(JONEBIT_COORDINATOR=f"127.0.0.1:{port}", JONEBIT_NUM_PROCESSES="2",
                         JONEBIT_PROCESS_ID=str(rank), JAX_NUM_CPU_DEVICES="2")
        procs.append(subprocess.Popen([sys.executable, str(DIST_WORKER), str(tmp_path)], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        try:
            out = p.communicate(timeout=180)[0]
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("2-process hierarchical allreduce timed out")
        assert p.returncode == 0, out[-3000:]
    results = [np.load(tmp_path / f"proc{r}.npz") for r in range(2)]
    for r, res in enumerate(results):
        assert res["shape"].tolist() == [2, 2] and res["rows"].tolist() == [2 * r, 2 * r + 1]  # process r = host r
    rng = np.random.default_rng(0)
    w_len, s_len = np_hier_error_sizes(301, 2, 2)
    we = [[np.zeros(w_len, np.float32)] * 2 for _ in range(2)]
    se = [[np.zeros(s_len, np.float32)] * 2 for _ in range(2)]
    for t in range(3):
        x = rng.standard_normal((4, 301)).astype(np.float32) * np.float32(1 + np.arange(4))[:, None]
        want, we, se = np_hierarchical_allreduce(nested(x, 2, 2), we, se)
        got = np.concatenate([res["outs"][t] for res in results])  # (4 devices, 301)
        for d in range(4):
            np.testing.assert_array_equal(got[d], got[0], err_msg=f"call {t}: device {d} differs")
        np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-6, err_msg=f"call {t}")


def test_hierarchical_mesh_layouts_and_batch_errors():
    one = hierarchical_mesh()  # one process: a single host holding every device
    assert dict(one.shape) == {"hosts": 1, "local": 8} and one.axis_types == (AxisType.Explicit,) * 2
    mesh = hierarchical_mesh(local=4)
    assert dict(mesh.shape) == {"hosts": 2, "local": 4}
    assert [[d.id for d in row] for row in mesh.devices] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dict(hierarchical_mesh(hosts=2, local=2, axes=("node", "gpu")).shape) == {"node": 2, "gpu": 2}
    batch = {"x": np.arange(16 * 3, dtype=np.float32).reshape(16, 3)}
    placed = shard_batch(batch, mesh, AXES)
    assert placed["x"].sharding.spec == P(AXES)
    # Device (h, l) holds rows [2 (h L + l), 2 (h L + l) + 2): split over both axes, hosts outermost.
    for shard in placed["x"].addressable_shards:
        h, l_ = np.argwhere(mesh.devices == shard.device)[0]
        np.testing.assert_array_equal(np.asarray(shard.data), batch["x"][2 * (4 * h + l_):2 * (4 * h + l_) + 2])
    with pytest.raises(ValueError, match="shard_batch: mesh has no axis 'gpus'"):
        shard_batch(batch, mesh, ("hosts", "gpus"))
    with pytest.raises(ValueError, match=r"must be divisible by the 8 devices of mesh axis 'hosts'/'local'"):
        shard_batch({"x": np.zeros((12, 3), np.float32)}, mesh, AXES)
