"""Per-buffer compression grouped by length (compressed_allreduce_groups): numerics and program size.

Buffers of one length are compressed as one stacked (vmapped) computation. Each keeps its own scales, errors and
chunking; the only numerical difference from compressing it alone is the order XLA:CPU picks for the scale's
sum of squares (a reduction's order there depends on the operand's total size), a few ulp of a scale.
"""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jonebit.comm.compressed as compressed
from jonebit.comm.backends import get_backend
from jonebit.comm.compressed import buffer_groups, padded_size
from jonebit.transforms import base as common
from tests.reference import np_compressed_allreduce

# Size-1 buffers, buffers shorter than P, repeated and unique lengths, interleaved.
SIZES = [1, 3, 5, 37, 37, 1, 64, 37, 5, 1000, 1000, 3, 1, 257]
ULP = 4  # largest scale difference allowed between the grouped and the per-buffer computation (seen: 3)


def mesh_of(p):
    return jax.make_mesh((p,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:p])


class grouping:
    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        self.saved, compressed._GROUP_BUFFERS = compressed._GROUP_BUFFERS, self.on

    def __exit__(self, *exc):
        compressed._GROUP_BUFFERS = self.saved


def runner(p, grouped: bool):
    mesh = mesh_of(p)

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    def call(xs, wes, ses):
        with grouping(grouped):
            groups = compressed.compressed_allreduce_groups(
                get_backend("data", None), [x[0] for x in xs], [e[0] for e in wes], [e[0] for e in ses])
            out = compressed.decode_groups(groups, [x.shape[-1] for x in xs])
        n = len(xs)
        return tuple([a[None] for a in compressed.ungroup(groups, f, n)] for f in (1, 2, 3)) + ([o[None] for o in out],)

    def run(xs, wes, ses):
        put = lambda t: jax.device_put(t, jax.NamedSharding(mesh, P("data")))  # noqa: E731
        return jax.tree.map(np.asarray, call(put(xs), put(wes), put(ses)))

    return run


def inputs(p, rng):
    xs = [rng.standard_normal((p, n)).astype(np.float32) * np.float32(rng.uniform(0.01, 10)) for n in SIZES]
    wes = [np.zeros((p, padded_size(n, p)), np.float32) for n in SIZES]
    ses = [np.zeros((p, padded_size(n, p) // p), np.float32) for n in SIZES]
    return xs, wes, ses


def ulps(a, b):
    a = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    b = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
    return int(np.max(np.abs(a - b))) if a.size else 0


def test_buffer_groups_by_length_in_order_of_first_appearance():
    assert buffer_groups(SIZES) == [[0, 5, 12], [1, 11], [2, 8], [3, 4, 7], [6], [9, 10], [13]]
    with grouping(False):
        assert buffer_groups(SIZES) == [[i] for i in range(len(SIZES))]


@pytest.mark.parametrize("p", [1, 2, 8])
def test_grouped_matches_numpy_per_buffer_reference_over_3_calls(p):
    rng = np.random.default_rng(p)
    run = runner(p, grouped=True)
    xs, wes, ses = inputs(p, rng)
    ref_wes, ref_ses = [list(e) for e in wes], [list(e) for e in ses]
    for _ in range(3):
        xs = inputs(p, rng)[0]
        rows, wes, ses, out = run(xs, wes, ses)
        for k, n in enumerate(SIZES):
            ref_out, ref_wes[k], ref_ses[k] = np_compressed_allreduce(list(xs[k]), ref_wes[k], ref_ses[k])
            for r in range(1, p):  # the same bits on every rank
                np.testing.assert_array_equal(out[k][r], out[k][0])
            np.testing.assert_allclose(out[k][0], ref_out, rtol=1e-5, atol=1e-6, err_msg=f"buffer {k} (n={n})")
            np.testing.assert_allclose(wes[k], np.stack(ref_wes[k]), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(ses[k], np.stack(ref_ses[k]), rtol=1e-5, atol=1e-5)
            assert rows[k].shape == (p, p, padded_size(n, p) // p // 8 + 4)


@pytest.mark.parametrize("p", [1, 2, 8])
def test_grouped_matches_the_per_buffer_computation(p):
    """Same inputs: the same sign bits, scales within ULP ulp, errors within the scales' rounding."""
    rng = np.random.default_rng(10 + p)
    old, new = runner(p, grouped=False), runner(p, grouped=True)
    for _ in range(3):
        xs, _, _ = inputs(p, rng)
        wes = [rng.standard_normal((p, padded_size(n, p))).astype(np.float32) * 0.1 for n in SIZES]
        ses = [rng.standard_normal((p, padded_size(n, p) // p)).astype(np.float32) * 0.1 for n in SIZES]
        a, b = old(xs, wes, ses), new(xs, wes, ses)
        for k in range(len(SIZES)):
            ra, rb = a[0][k], b[0][k]
            np.testing.assert_array_equal(ra[..., :-4], rb[..., :-4])  # the sign bits of every rank's result
            scale = np.abs(ra[..., -4:].copy().view(np.float32)).max()
            assert ulps(ra[..., -4:].copy().view(np.float32), rb[..., -4:].copy().view(np.float32)) <= ULP
            assert ulps(a[3][k], b[3][k]) <= ULP  # decoded: +-scale
            tol = ULP * np.spacing(np.float32(max(scale, np.abs(wes[k]).max(), np.abs(xs[k]).max()) * 4))
            np.testing.assert_allclose(a[1][k], b[1][k], rtol=0, atol=tol)
            np.testing.assert_allclose(a[2][k], b[2][k], rtol=0, atol=tol)


def _compiled_reduces(leaves: int, grouped: bool, p: int = 8) -> int:
    """Reductions in the compiled per-leaf compressed_mean of a tree of ``leaves`` leaves of 3 distinct sizes."""
    mesh = mesh_of(p)
    shapes = [((32, 32), (32,), (3,))[i % 3] for i in range(leaves)]
    spec = jax.NamedSharding(mesh, P("data"))
    tree = {f"l{i:03d}": jax.ShapeDtypeStruct((p, *s), np.float32, sharding=spec) for i, s in enumerate(shapes)}
    local = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in tree.items()}
    with grouping(grouped):  # the error layout follows the grouping: one stacked array per group
        errors = common.error_buffers(local, p, fused=False)
    we, se = jax.tree.map(lambda e: jax.ShapeDtypeStruct((p, *e.shape[1:]), e.dtype, sharding=spec), errors)

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    def mean(t, we, se):
        with grouping(grouped):
            m, we, se = common.compressed_mean(get_backend("data", None), jax.tree.map(lambda x: x[0], t), we, se,
                                               fused=False)
        return jax.tree.map(lambda x: x[None], m), we, se

    text = mean.lower(tree, we, se).compile().as_text()
    return sum(" reduce(" in line for line in text.splitlines())


def test_program_does_not_grow_a_reduction_per_leaf():
    # Grouped: the scales and the sign packing are reduced once per distinct length, whatever the leaf count.
    assert _compiled_reduces(12, grouped=True) == _compiled_reduces(48, grouped=True)
    # The per-buffer computation (before grouping) fails that bound: its reductions grow with every leaf.
    assert _compiled_reduces(48, grouped=False) > 3 * _compiled_reduces(12, grouped=True)


def test_stacked_errors_are_the_groups_rows_in_order():
    """compressed_allreduce_stacked with the errors of each group stacked (row j: the group's j-th buffer) computes
    what compressed_allreduce_groups computes from the same errors given per buffer, bit for bit (the same
    program), and hands the new errors back in that layout."""
    p = 2
    mesh = mesh_of(p)
    rng = np.random.default_rng(3)
    xs, _, _ = inputs(p, rng)
    wes = [rng.standard_normal((p, padded_size(n, p))).astype(np.float32) for n in SIZES]
    ses = [rng.standard_normal((p, padded_size(n, p) // p)).astype(np.float32) for n in SIZES]
    groups, zero_w, zero_s = compressed.stacked_error_buffers(SIZES, p)
    assert groups == buffer_groups(SIZES)
    assert [z.shape for z in zero_w] == [(len(g), padded_size(SIZES[g[0]], p)) for g in groups]
    assert [z.shape for z in zero_s] == [(len(g), padded_size(SIZES[g[0]], p) // p) for g in groups]
    stacked_w = [np.stack([wes[i] for i in g], axis=1) for g in groups]  # (P, k, n): rank rows, then the group
    stacked_s = [np.stack([ses[i] for i in g], axis=1) for g in groups]

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    def call(xs, sw, ss):
        out = compressed.compressed_allreduce_stacked(
            get_backend("data", None), [x[0] for x in xs], groups, [w[0] for w in sw], [s[0] for s in ss])
        return [o[1][None] for o in out], [o[2][None] for o in out], [o[3][None] for o in out]

    put = lambda t: jax.device_put(t, jax.NamedSharding(mesh, P("data")))  # noqa: E731
    rows, new_w, new_s = jax.tree.map(np.asarray, call(put(xs), put(stacked_w), put(stacked_s)))
    want_rows, want_w, want_s, _ = runner(p, grouped=True)(xs, wes, ses)
    for g, idx in enumerate(groups):
        for j, i in enumerate(idx):
            np.testing.assert_array_equal(rows[g][:, j], want_rows[i])
            np.testing.assert_array_equal(new_w[g][:, j], want_w[i])
            np.testing.assert_array_equal(new_s[g][:, j], want_s[i])


def test_stacked_errors_of_the_wrong_shape_are_a_clear_error():
    backend = get_backend(None, None)  # one rank, outside shard_map
    xs = [np.ones(5, np.float32), np.ones(5, np.float32), np.ones(3, np.float32)]
    groups, w, s = compressed.stacked_error_buffers([5, 5, 3], 1)
    with pytest.raises(ValueError, match=r"2 groups of buffers but 1 worker and 2 server error stacks"):
        compressed.compressed_allreduce_stacked(backend, xs, groups, w[:1], s)
    with pytest.raises(ValueError, match=r"a group of 2 buffers of 5 elements needs error stacks \(2, 8\)"):
        compressed.compressed_allreduce_stacked(backend, xs, groups, [w[0][:1], w[1]], s)
    swapped = [xs[0], xs[2], xs[1]]  # groups no longer match the lengths
    with pytest.raises(ValueError, match=r"buffer 1 has shape \(3,\), not \(5,\) like the rest of its group"):
        compressed.compressed_allreduce_stacked(backend, swapped, groups, w, s)


def _decode_kernels(k: int, n: int = 1000, p: int = 4) -> tuple[int, list[np.ndarray]]:
    """Distinct fused computations XLA:CPU compiles for decoding a group of ``k`` buffers of ``n`` values (the
    kernels it generates: identical computations share one), and the decoded buffers."""
    import re

    rng = np.random.default_rng(k)
    width = padded_size(n, p) // p // 8
    bits = rng.integers(0, 256, (k, p, width), dtype=np.uint8)
    scales = rng.uniform(0.5, 2.0, (k, p, 1)).astype(np.float32)
    grouped = np.concatenate([bits, scales.view(np.uint8)], axis=-1)
    decode = jax.jit(lambda g: compressed.decode_groups([(list(range(k)), g, None, None)], [n] * k))
    text = decode.lower(grouped).compile().as_text()
    bodies = re.findall(r"^%fused_computation[^\n]*\{\n(.*?)^\}", text, flags=re.S | re.M)
    normal = {re.sub(r"%[\w.\-]+|param_[\d.]+|, metadata=\{[^}]*\}", "", b) for b in bodies}
    return len(normal), [np.asarray(x) for x in decode(grouped)]


def test_a_groups_leaves_share_one_decode_kernel(monkeypatch):
    """Each buffer of a group is read out of the group's gathered rows with an index XLA:CPU cannot fold
    (shared_kernel_indices), so the decode of every buffer of a length is one kernel, however many buffers; with
    the indices as constants each buffer gets its own. The decoded values are the same either way, bit for bit."""
    shared = {k: _decode_kernels(k) for k in (4, 16)}
    assert shared[4][0] == shared[16][0]
    monkeypatch.setattr(compressed, "shared_kernel_indices", lambda count, anchor: list(range(count)))
    constant = {k: _decode_kernels(k) for k in (4, 16)}
    assert constant[16][0] >= constant[4][0] + 12
    for k in (4, 16):
        for a, b in zip(shared[k][1], constant[k][1], strict=True):
            np.testing.assert_array_equal(a, b)
