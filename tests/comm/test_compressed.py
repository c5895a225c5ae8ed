import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jonebit.comm import compressed_allreduce, compressed_bytes_per_rank, padded_size
from jonebit.comm.accounting import comm_report
from tests.reference import np_compressed_allreduce, np_padded


def mesh_of(p):
    return jax.make_mesh((p,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:p])


def sharded_call(mesh):
    """Runs compressed_allreduce per device on (P, ...) stacked inputs; returns (P, ...) stacked outputs."""

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    def call(x, we, se):
        out, we, se = compressed_allreduce(x[0], we[0], se[0], axis_name="data")
        return out[None], we[None], se[None]

    def run(x, we, se):
        put = lambda a: jax.device_put(a, jax.NamedSharding(mesh, P("data")))  # noqa: E731
        return [np.asarray(a) for a in call(put(x), put(we), put(se))]

    return run


@pytest.mark.parametrize("p", range(1, 17))
def test_padded_size_lcm_rule(p):
    unit = p * math.lcm(p, 8)
    for n in [0, 1, unit - 1, unit, unit + 1, 1000, 123457]:
        got = padded_size(n, p)
        assert got % unit == 0 and got >= n and got - n < unit
        assert (got // p) % 8 == 0
    assert padded_size(1, p) == unit


def test_padded_size_spec_values():
    assert [padded_size(1, p) for p in (2, 4, 8, 16)] == [16, 32, 64, 256]
    assert padded_size(1, 256) == 65536
    with pytest.raises(ValueError, match="world_size"):
        padded_size(10, 0)


@pytest.mark.parametrize("p,n", [(2, 37), (4, 1000), (8, 1001), (8, 64)])
def test_matches_numpy_simulation_over_5_calls(p, n):
    rng = np.random.default_rng(p * 1000 + n)
    n_pad = np_padded(n, p)
    c = n_pad // p
    run = sharded_call(mesh_of(p))
    we = np.zeros((p, n_pad), np.float32)
    se = np.zeros((p, c), np.float32)
    ref_we, ref_se = list(we), list(se)
    for _ in range(5):
        x = rng.standard_normal((p, n)).astype(np.float32) * rng.uniform(0.1, 3.0, (p, 1)).astype(np.float32)
        out, new_we, new_se = run(x, we, se)
        ref_out, ref_we, ref_se = np_compressed_allreduce(list(x), ref_we, ref_se)
        # Bitwise identical across ranks.
        for r in range(1, p):
            np.testing.assert_array_equal(out[r], out[0])
        np.testing.assert_allclose(out[0], ref_out, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(new_we, np.stack(ref_we), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(new_se, np.stack(ref_se), rtol=1e-5, atol=1e-5)
        # Identity 1: s_w * sgn(x) + e_w_new = pad(b) + e_w_old (per rank).
        padded = np.zeros((p, n_pad), np.float32)
        padded[:, :n] = x
        xw = padded + we
        s_w = np.sqrt((xw.astype(np.float64) ** 2).sum(1) / n_pad).astype(np.float32)
        np.testing.assert_allclose(s_w[:, None] * np.where(xw >= 0, 1, -1) + new_we, xw, rtol=1e-5, atol=1e-5)
        # Identity 2: out_chunk_r + e_s_new = z + e_s_old, where z is the scaled average of the worker signs.
        signs = np.where(xw >= 0, 1.0, -1.0)
        z = (s_w[:, None] / p * signs).sum(0).reshape(p, c)
        # The output is truncated to n, so the identity is checked on those n entries.
        lhs = out[0] + new_se.reshape(-1)[:n]
        rhs = z.reshape(-1)[:n] + se.reshape(-1)[:n]
        np.testing.assert_allclose(lhs, rhs, rtol=1e-5, atol=1e-5)
        we, se = new_we, new_se


def test_zero_error_closed_form():
    """With zero errors: compress each worker by its RMS, average, compress each 1/P chunk by its RMS."""
    p, n = 4, 256
    rng = np.random.default_rng(0)
    x = rng.standard_normal((p, n)).astype(np.float32)
    out, _, _ = sharded_call(mesh_of(p))(x, np.zeros((p, n), np.float32), np.zeros((p, n // p), np.float32))
    rms = lambda a: np.sqrt(np.mean(a.astype(np.float64) ** 2))  # noqa: E731
    avg = np.mean([rms(xi) * np.where(xi >= 0, 1, -1) for xi in x], axis=0)
    expect = np.concatenate([rms(ch) * np.where(ch >= 0, 1, -1) for ch in avg.reshape(p, -1)])
    np.testing.assert_allclose(out[0], expect, rtol=1e-5)


def test_error_feedback_tracks_the_mean():
    """Summed over calls, the compressed result tracks the exact mean (errors stay bounded)."""
    p, n, steps = 8, 512, 200
    rng = np.random.default_rng(1)
    x = rng.standard_normal((p, n)).astype(np.float32)
    run = sharded_call(mesh_of(p))
    we, se = np.zeros((p, n), np.float32), np.zeros((p, n // p), np.float32)
    total = np.zeros(n)
    for _ in range(steps):
        out, we, se = run(x, we, se)
        total += out[0]
    rel = np.linalg.norm(total / steps - x.mean(0)) / np.linalg.norm(x.mean(0))
    assert rel < 0.05, rel


def _spec_bytes(n, p):
    """The spec's count: P rows of C/8 sign bytes and a 4-byte scale per rank (C = N_pad / P); the all-to-all
    sends P - 1 of them, the all-gather sends this rank's row to the P - 1 others."""
    row = np_padded(n, p) // p // 8 + 4
    return 2 * (p - 1) * row


def test_bytes_formula_is_32x_below_fp32():
    n, p = 110_000_000, 8
    fp32 = 2 * (p - 1) / p * n * 4
    assert compressed_bytes_per_rank(n, p) == _spec_bytes(n, p)
    assert 31.5 < fp32 / compressed_bytes_per_rank(n, p) <= 32.0


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("n", [1, 37, 1000, 4099, 110_000_000])
def test_bytes_formula_written_out(p, n):
    assert compressed_bytes_per_rank(n, p) == _spec_bytes(n, p)


@pytest.mark.parametrize("p,n", [(2, 37), (4, 1000), (8, 4099)])
def test_compiled_collectives_move_uint8_and_the_formula_bytes(p, n):
    """The compiled allreduce: one all-to-all and one all-gather, only uint8 on the wire, spec byte count."""
    mesh = mesh_of(p)

    @jax.shard_map(mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    def call(x, we, se):
        out, we, se = compressed_allreduce(x[0], we[0], se[0], axis_name="data")
        return out[None], we[None], se[None]

    n_pad = np_padded(n, p)
    args = [jax.ShapeDtypeStruct((p, m), jnp.float32, sharding=jax.NamedSharding(mesh, P("data")))
            for m in (n, n_pad, n_pad // p)]
    report = comm_report(jax.jit(call).lower(*args).compile().as_text(), p)
    assert sorted(c.op for c in report.always) == ["all-gather", "all-to-all"]
    for c in report.always:
        assert c.dtypes and set(c.dtypes) == {"u8"}, c
        assert c.result_bytes == p * (n_pad // p // 8 + 4), c
    assert report.always_bytes == _spec_bytes(n, p)


def test_outside_shard_map_is_one_worker_and_a_wrong_axis_an_error():
    x = jnp.arange(1.0, 17.0)
    # No shard_map encloses it: one worker. The output is the RMS of 1..16 with x's signs (all positive); its
    # float32 evaluation (16 squares summed, a division, a square root) is within ~20 u = 1.2e-6 of float64.
    for kw in ({"axis_name": "data"}, {}):
        out, _, _ = compressed_allreduce(x, jnp.zeros(16), jnp.zeros(16), **kw)
        np.testing.assert_allclose(np.asarray(out), np.full(16, np.sqrt(np.mean(np.square(np.arange(1.0, 17.0))))),
                                   rtol=2e-6)
    mesh = jax.make_mesh((2,), ("model",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
    inside = jax.shard_map(lambda v: compressed_allreduce(v, jnp.zeros(16), jnp.zeros(8), axis_name="data")[0],
                           mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    with pytest.raises(ValueError, match="not bound"):
        inside(x)


def test_wrong_error_shape_is_a_clear_error():
    mesh = mesh_of(2)

    @jax.shard_map(mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    def call(x):
        return compressed_allreduce(x, jnp.zeros(10), jnp.zeros(8), axis_name="data")[0]

    with pytest.raises(ValueError, match=r"worker_error must have shape \(16,\)"):
        call(jax.device_put(jnp.ones(20), jax.NamedSharding(mesh, P("data"))))
