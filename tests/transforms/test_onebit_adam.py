import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jonebit
from jonebit import onebit_adam, sharded_init, state_specs
from jonebit.experimental import OneBitAdamOptions, adam_ratio_bound
from jonebit.transforms.onebit_adam import leaf_errors
from tests.reference import NumpyOneBitAdam, NumpyOneBitAdamFull


def mesh_of(p):
    return jax.make_mesh((p,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:p])


def make_params(rng):
    return {"b": rng.standard_normal(13).astype(np.float32), "w": rng.standard_normal((5, 7)).astype(np.float32)}


def stepper(tx, mesh, specs):
    """Jitted step applying the given per-rank gradients (stacked on a leading rank axis)."""

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs))
    def step(params, state, grads):
        grads = jax.tree.map(lambda g: g[0], grads)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    put = lambda t: jax.device_put(t, jax.NamedSharding(mesh, P("data")))  # noqa: E731
    return step, put


def run_both(p, *, steps, freeze_step, fused=True, mask=None, wd=0.0, lr=1e-2, seed=0, row_scales=False):
    rng = np.random.default_rng(seed)
    params0 = make_params(rng)
    mesh = mesh_of(p)
    tx = onebit_adam(lr, freeze_step=freeze_step, weight_decay=wd, exp_avg_mask=mask, fused=fused,
                     bias_correction=False,  # the reference is DeepSpeed's: no correction
                     experimental=OneBitAdamOptions(row_scales=row_scales))
    state, specs = sharded_init(tx, params0, mesh)
    step, put = stepper(tx, mesh, specs)
    params = jax.device_put(params0, jax.NamedSharding(mesh, P()))
    ref = NumpyOneBitAdam(params0, p, freeze_step=freeze_step, lr=lr, wd=wd, mask=mask, fused=fused,
                          row_scales=row_scales)
    history = []
    for _ in range(steps):
        grads = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params0.items()} for _ in range(p)]
        stacked = {k: np.stack([g[k] for g in grads]) for k in params0}
        params, state = step(params, state, put(stacked))
        expect = ref.step(grads)
        history.append(({k: np.asarray(v) for k, v in params.items()}, {k: v.copy() for k, v in expect.items()},
                        jax.device_get(state), ref))
    return history


@pytest.mark.parametrize("fused", [True, False])
def test_matches_numpy_reference_through_freeze(fused):
    history = run_both(4, steps=8, freeze_step=3, fused=fused, wd=0.01)
    for t, (got, expect, _, _) in enumerate(history):
        for k in expect:
            np.testing.assert_allclose(got[k], expect[k], rtol=2e-5, atol=2e-6, err_msg=f"step {t} leaf {k}")
    state, ref = history[-1][2], history[-1][3]
    assert int(state.count) == 8
    np.testing.assert_allclose(np.asarray(state.mu["w"]), ref.m["w"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.nu["w"]), ref.v["w"], rtol=1e-5, atol=1e-9)
    if fused:
        assert state.worker_error.shape == (4, 64)  # 13 + 35 = 48 elements, padded to a multiple of 4 * 8
    we = ref.we[None] if fused else ref.we["w"]
    got_we = state.worker_error if fused else leaf_errors(state.worker_error, state.mu)["w"]
    np.testing.assert_allclose(np.asarray(got_we), np.stack(we), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fused,row_scales", [(True, False), (False, False), (False, True)])
def test_preconditioned_compression_matches_reference(fused, row_scales):
    """preconditioned=True compresses m / (sqrt(v / c2) + eps) with c2 frozen at the freeze and multiplies the
    average back; against the numpy reference with bias correction, a schedule and weight decay."""
    p, freeze = 4, 3
    params0 = make_params(np.random.default_rng(5))
    sched = optax.linear_schedule(1e-2, 1e-3, 8)
    kw = dict(freeze_step=freeze, fused=fused, row_scales=row_scales)
    tx = onebit_adam(sched, bias_correction=True, weight_decay=0.01, freeze_step=freeze, fused=fused,
                     experimental=OneBitAdamOptions(preconditioned=True, row_scales=row_scales))
    ref = NumpyOneBitAdamFull(params0, p, lr=None, wd=0.01, schedule=lambda c: float(sched(c)),
                              bias_correction=True, preconditioned=True, **kw)
    plain = NumpyOneBitAdamFull(params0, p, lr=None, wd=0.01, schedule=lambda c: float(sched(c)),
                                bias_correction=True, **kw)
    for t, grads, got, want in run_against(tx, ref, p, steps=8, seed=6):
        other = plain.step(grads)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6, err_msg=f"step {t} leaf {k}")
        if t > freeze:  # compression: the preconditioned average is another one
            assert max(np.abs(got[k] - other[k]).max() for k in want) > 1e-4


def test_clip_ratio_bounds_the_compression_stage_step():
    """clip_ratio clips (m / c1) / (sqrt(v / c2) + eps) after the freeze only; gradients 30x larger after the freeze
    push the frozen-variance ratio far past the bound, which the reference and the library then cut alike."""
    p, freeze, bound = 4, 3, adam_ratio_bound(0.9, 0.999)
    assert bound == pytest.approx(7.2703, abs=1e-3)
    params0 = make_params(np.random.default_rng(5))
    tx = onebit_adam(1e-2, freeze_step=freeze, weight_decay=0.01, fused=False,
                     experimental=OneBitAdamOptions(clip_ratio=bound))
    ref = NumpyOneBitAdamFull(params0, p, freeze_step=freeze, lr=1e-2, wd=0.01, fused=False, bias_correction=True,
                              clip_ratio=bound)
    free = NumpyOneBitAdamFull(params0, p, freeze_step=freeze, lr=1e-2, wd=0.01, fused=False, bias_correction=True)
    rng = np.random.default_rng(7)
    mesh = mesh_of(p)
    state, specs = sharded_init(tx, params0, mesh)
    step, put = stepper(tx, mesh, specs)
    params = jax.device_put(params0, jax.NamedSharding(mesh, P()))
    for t in range(7):
        scale = 1.0 if t < freeze else 30.0
        grads = [{k: (scale * rng.standard_normal(v.shape)).astype(np.float32) for k, v in params0.items()}
                 for _ in range(p)]
        before = dict(ref.params)
        params, state = step(params, state, put({k: np.stack([g[k] for g in grads]) for k in params0}))
        want, other = ref.step(grads), free.step(grads)
        for k in want:
            np.testing.assert_allclose(np.asarray(params[k]), want[k], rtol=2e-5, atol=2e-6, err_msg=f"{t} {k}")
            # No element moves more than lr (bound + wd |p|) after the freeze.
            if t >= freeze:
                assert np.all(np.abs(want[k] - before[k]) <= 1e-2 * (bound + 0.01 * np.abs(before[k])) * 1.0001)
    assert max(np.abs(other[k] - want[k]).max() for k in want) > 1e-2  # unclipped, the steps are larger


@pytest.mark.parametrize("p", [2, 4])
def test_row_scales_match_numpy_reference_through_freeze(p):
    history = run_both(p, steps=7, freeze_step=2, fused=False, wd=0.01, row_scales=True)
    for t, (got, expect, _, _) in enumerate(history):
        for k in expect:
            np.testing.assert_allclose(got[k], expect[k], rtol=2e-5, atol=2e-6, err_msg=f"step {t} leaf {k}")
    state, ref = history[-1][2], history[-1][3]
    # "w" (5, 7): 5 rows of 7, padded to 8p rows; "b" (13,) keeps one scale per leaf and chunk.
    we = leaf_errors(state.worker_error, state.mu, row_scales=True)
    se = leaf_errors(state.server_error, state.mu, row_scales=True)
    assert we["w"].shape == (p, 8 * p * 7)  # 7 floats a row: 8 rows a rank for whole bytes
    assert se["w"].shape == (p, 8 * 7)
    for name in ("w", "b"):
        np.testing.assert_allclose(np.asarray(we[name]), np.stack(ref.we[name]), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(se[name]), np.stack(ref.se[name]), rtol=1e-4, atol=1e-5)
    # The rows really have their own scales: the per-leaf compression gives other momenta.
    per_leaf = run_both(p, steps=7, freeze_step=2, fused=False, wd=0.01)
    assert not np.allclose(np.asarray(per_leaf[-1][2].mu["w"]), np.asarray(state.mu["w"]), rtol=1e-3)


def test_row_scales_keep_a_small_row_small():
    """A row whose momentum is 1000x smaller than the others' comes out of the 1-bit average at its own size
    with row scales; with one scale per tensor it gets the tensor's typical magnitude."""
    p, rows, width = 4, 64, 32
    mesh = mesh_of(p)
    rng = np.random.default_rng(3)
    params0 = {"emb": np.zeros((rows, width), np.float32)}
    grads = rng.standard_normal((p, rows, width)).astype(np.float32)
    grads[:, 5] *= 1e-3
    result = {}
    for row_scales in (False, True):
        # b1=0: the momentum is the gradient
        tx = onebit_adam(1e-3, freeze_step=1, b1=0.0, experimental=OneBitAdamOptions(row_scales=row_scales))
        state, specs = sharded_init(tx, params0, mesh)
        step, put = stepper(tx, mesh, specs)
        params = jax.device_put(params0, jax.NamedSharding(mesh, P()))
        for _ in range(2):  # one warmup update, then one compressed
            params, state = step(params, state, put({"emb": grads}))
        result[row_scales] = np.asarray(state.mu["emb"])
    small = np.sqrt(np.mean(grads[:, 5].mean(0) ** 2))
    assert np.sqrt(np.mean(result[True][5] ** 2)) < 10 * small
    assert np.sqrt(np.mean(result[False][5] ** 2)) > 100 * small


def test_warmup_is_plain_adam_on_mean_gradient():
    """During warmup the params follow optax-free numpy Adam without bias correction on averaged grads."""
    history = run_both(8, steps=4, freeze_step=10, fused=True)
    for got, expect, _, _ in history:
        for k in expect:
            np.testing.assert_allclose(got[k], expect[k], rtol=1e-6, atol=1e-7)
    state = history[-1][2]
    assert not np.any(np.asarray(state.worker_error))  # nothing compressed yet


def test_mask_keeps_momentum_exactly_zero():
    mask = {"b": np.ones(13, np.float32), "w": np.ones((5, 7), np.float32)}
    mask["w"][3:] = 0.0
    history = run_both(4, steps=6, freeze_step=2, mask=mask)
    state = history[-1][2]
    assert np.all(np.asarray(state.mu["w"])[3:] == 0.0)
    assert np.any(np.asarray(state.mu["w"])[:3] != 0.0)
    for got, expect, _, _ in history:
        for k in expect:
            np.testing.assert_allclose(got[k], expect[k], rtol=2e-5, atol=2e-6)


# Float32's unit roundoff.
U32 = float(np.finfo(np.float32).eps) / 2


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("mask_unseen", [True, False])
def test_elements_no_gradient_reached_before_the_freeze(mask_unseen, fused):
    """Rows of "w" get no gradient on any rank until after the freeze (tokens not yet seen): their frozen variance
    is 0. DeepSpeed's arithmetic (``mask_unseen=False``) gives them the 1-bit average's magnitude divided by eps, as
    the numpy reference of the spec does; the default keeps their momentum at 0 and the rows where they are, the
    reference with those rows masked."""
    p, steps, freeze, lr = 4, 7, 3, 1e-2
    rng = np.random.default_rng(5)
    params0 = make_params(rng)
    unseen = np.zeros((5, 7), bool)
    unseen[3:] = True
    mesh = mesh_of(p)
    tx = onebit_adam(lr, freeze_step=freeze, fused=fused, bias_correction=False, mask_unseen=mask_unseen)
    state, specs = sharded_init(tx, params0, mesh)
    step, put = stepper(tx, mesh, specs)
    params = jax.device_put(params0, jax.NamedSharding(mesh, P()))
    mask = {"b": np.ones(13, np.float32), "w": (~unseen).astype(np.float32)} if mask_unseen else None
    ref = NumpyOneBitAdam(params0, p, freeze_step=freeze, lr=lr, mask=mask, fused=fused)
    # Tolerance. The gradients are given (they do not depend on the parameters), so each program's parameter is
    # p_T = p_0 - sum_t lr u_t rounded once per step, and the two differ by at most
    #   sum_t (U |p_t| + delta |lr u_t|)  <=  64 U S_T,   S_T = sum_t (|p_t| + |lr u_t|)  (per element),
    # where delta bounds the relative difference of one step's update between the programs: a scale is a root of a
    # sum of at most 48 squares (relative error <= (48/2 + 2) U, summed in any order), taken once by the worker and
    # once by the server, plus the divisions and the momentum's update: delta <= 2 (26 + 4) U <= 64 U. The bound
    # is on the accumulated magnitude, not on the result: DeepSpeed's unseen rows add updates of ~1e5 (divided by
    # eps) of both signs, so an element ending near 450 carries the rounding of the 1e5 partial sums.
    accumulated = {k: np.zeros_like(v) for k, v in params0.items()}
    for t in range(steps):
        grads = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params0.items()} for _ in range(p)]
        if t < freeze:
            for g in grads:
                g["w"][unseen] = 0.0
        params, state = step(params, state, put({k: np.stack([g[k] for g in grads]) for k in params0}))
        before = dict(ref.params)  # the reference replaces its arrays, never writes into them
        expect = ref.step(grads)
        for k in expect:
            accumulated[k] += np.abs(expect[k]) + np.abs(expect[k] - before[k])
            diff = np.abs(np.asarray(params[k]) - expect[k])
            assert np.all(diff <= 64 * U32 * accumulated[k]), (
                f"step {t} leaf {k}: {diff.max():.3g} against {(64 * U32 * accumulated[k]).min():.3g}")
    moved = np.abs(np.asarray(params["w"]) - params0["w"])
    if mask_unseen:
        assert np.all(moved[unseen] == 0.0) and np.all(np.asarray(state.mu["w"])[unseen] == 0.0)
        assert np.all(moved[~unseen] > 0.0)
    else:
        assert moved[unseen].min() > 1e3 * moved[~unseen].max()  # divided by eps: DeepSpeed's blow-up


def test_single_rank_works_and_skips_compression():
    history = run_both(1, steps=5, freeze_step=2)
    for got, expect, _, _ in history:
        for k in expect:
            np.testing.assert_allclose(got[k], expect[k], rtol=1e-6, atol=1e-7)


def test_no_recompilation_across_freeze_step():
    p = 4
    mesh = mesh_of(p)
    params0 = make_params(np.random.default_rng(0))
    tx = onebit_adam(1e-3, freeze_step=2)
    state, specs = sharded_init(tx, params0, mesh)
    step, put = stepper(tx, mesh, specs)
    params = jax.device_put(params0, jax.NamedSharding(mesh, P()))
    grads = put({k: np.ones((p,) + v.shape, np.float32) for k, v in params0.items()})
    for _ in range(2):  # warmup; the 2nd call sees the P() params come back as P(None, ...) once
        params, state = step(params, state, grads)
    compiled = step._cache_size()
    for _ in range(4):  # crosses freeze_step into compression
        params, state = step(params, state, grads)
    assert int(state.count) == 6
    assert step._cache_size() == compiled


def test_state_specs_and_sharding():
    p = 8
    mesh = mesh_of(p)
    params0 = make_params(np.random.default_rng(0))
    tx = optax.chain(optax.clip_by_global_norm(1.0), onebit_adam(1e-3, freeze_step=2, fused=False))
    state, specs = sharded_init(tx, params0, mesh)
    inner = state[1]
    assert isinstance(inner, jonebit.OneBitAdamState)
    # Per leaf, the errors of equal-size leaves are stacked: "b" (13) and "w" (35) are two groups of one.
    assert specs[1].worker_error == (P("data"), P("data")) and specs[1].mu["w"] == P() and specs[1].count == P()
    assert leaf_errors(inner.worker_error, params0)["w"].shape == (p, 64)  # padded_size(35, 8) = 64
    assert leaf_errors(inner.server_error, params0)["b"].shape == (p, 8)
    assert [e.shape for e in inner.worker_error] == [(p, 1, 64), (p, 1, 64)]  # tree order: "b", then "w"
    assert all(e.sharding.spec[0] == "data" for e in inner.worker_error)
    assert state_specs(jax.eval_shape(lambda: state)) == specs


def run_against(tx, ref, p, *, steps, grad_scale=1.0, seed=0):
    """Applies the same random per-rank gradients to ``tx`` (sharded) and to the numpy ``ref``; yields both."""
    rng = np.random.default_rng(seed)
    params0 = {k: v.copy() for k, v in ref.params.items()}
    mesh = mesh_of(p)
    state, specs = sharded_init(tx, params0, mesh)
    step, put = stepper(tx, mesh, specs)
    params = jax.device_put(params0, jax.NamedSharding(mesh, P()))
    for t in range(steps):
        grads = [{k: (grad_scale * rng.standard_normal(v.shape)).astype(np.float32) for k, v in params0.items()}
                 for _ in range(p)]
        params, state = step(params, state, put({k: np.stack([g[k] for g in grads]) for k in params0}))
        yield t, grads, {k: np.asarray(v) for k, v in params.items()}, {k: v.copy() for k, v in ref.step(grads).items()}


def test_chain_with_clipping_matches_reference():
    """clip_by_global_norm before 1-bit Adam clips each rank's local gradient, in both stages."""
    p, clip = 4, 0.5
    params0 = make_params(np.random.default_rng(0))
    tx = optax.chain(optax.clip_by_global_norm(clip),
                     onebit_adam(1e-2, freeze_step=2, weight_decay=0.01, bias_correction=False, fused=True))
    ref = NumpyOneBitAdamFull(params0, p, freeze_step=2, lr=1e-2, wd=0.01, clip_norm=clip)
    unclipped = NumpyOneBitAdam(params0, p, freeze_step=2, lr=1e-2, wd=0.01)
    for t, grads, got, want in run_against(tx, ref, p, steps=6, grad_scale=3.0):
        # Every rank's gradient norm (~3 * sqrt(48)) is far above the threshold: the clip is active.
        assert all(np.sqrt(sum(np.sum(g[k] ** 2) for k in g)) > 10 * clip for g in grads)
        free = unclipped.step(grads)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6, err_msg=f"step {t} leaf {k}")
            if t >= 2:  # in both stages the clipped run differs from the unclipped one
                assert np.abs(want[k] - free[k]).max() > 1e-3


@pytest.mark.parametrize("fused", [True, False])
def test_max_grad_norm_clips_the_averaged_gradient_in_warmup_and_the_local_one_after(fused):
    """DeepSpeed's places: the engine clips after its allreduce in warmup, the local gradient once compressing."""
    p, clip, freeze = 4, 0.5, 3
    params0 = make_params(np.random.default_rng(0))
    kw = dict(freeze_step=freeze, weight_decay=0.01, bias_correction=True, fused=fused)
    tx = onebit_adam(1e-2, max_grad_norm=clip, **kw)
    ref = NumpyOneBitAdamFull(params0, p, lr=1e-2, wd=0.01, clip_norm=clip, clip_averaged_warmup=True,
                              freeze_step=freeze, bias_correction=True, fused=fused)
    local = NumpyOneBitAdamFull(params0, p, lr=1e-2, wd=0.01, clip_norm=clip, freeze_step=freeze,
                                bias_correction=True, fused=fused)
    for t, grads, got, want in run_against(tx, ref, p, steps=6, grad_scale=3.0):
        mean_norm = np.sqrt(sum(np.sum(np.mean([g[k] for g in grads], 0) ** 2) for k in params0))
        assert mean_norm > 4 * clip  # the clip binds on the averaged gradient too
        other = local.step(grads)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6, err_msg=f"step {t} leaf {k}")
        if t == 0:  # clipping the mean is not clipping each rank's gradient, then averaging
            assert max(np.abs(want[k] - other[k]).max() for k in want) > 1e-4


@pytest.mark.parametrize("fused", [True, False])
def test_local_clip_clips_each_ranks_gradient_in_both_stages(fused):
    """local_clip=True: warmup averages the locally clipped gradients too (the reference without
    clip_averaged_warmup), so the scale does not change at the freeze; DeepSpeed's placement differs."""
    p, clip, freeze = 4, 0.5, 3
    params0 = make_params(np.random.default_rng(0))
    kw = dict(freeze_step=freeze, bias_correction=True, fused=fused)
    tx = onebit_adam(1e-2, max_grad_norm=clip, weight_decay=0.01, experimental=OneBitAdamOptions(local_clip=True),
                     **kw)
    ref = NumpyOneBitAdamFull(params0, p, lr=1e-2, wd=0.01, clip_norm=clip, **kw)
    deepspeed = NumpyOneBitAdamFull(params0, p, lr=1e-2, wd=0.01, clip_norm=clip, clip_averaged_warmup=True, **kw)
    for t, grads, got, want in run_against(tx, ref, p, steps=6, grad_scale=3.0):
        other = deepspeed.step(grads)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6, err_msg=f"step {t} leaf {k}")
        if t == 0:
            assert max(np.abs(want[k] - other[k]).max() for k in want) > 1e-4


def test_max_grad_norm_zero_is_off():
    params0 = make_params(np.random.default_rng(1))
    off = NumpyOneBitAdamFull(params0, 2, lr=1e-2, freeze_step=2, bias_correction=True, fused=False)
    for _, _, got, want in run_against(onebit_adam(1e-2, freeze_step=2, max_grad_norm=0.0), off, 2, steps=4,
                                       grad_scale=3.0):
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6)
    with pytest.raises(ValueError, match="max_grad_norm must be >= 0"):
        onebit_adam(1e-2, freeze_step=2, max_grad_norm=-1.0)


def test_learning_rate_schedule_and_bias_correction():
    p = 2
    mesh = mesh_of(p)
    params0 = {"w": np.zeros(16, np.float32)}
    sched = optax.linear_schedule(1.0, 0.0, 10)
    tx = onebit_adam(sched, freeze_step=3, bias_correction=True)
    state, specs = sharded_init(tx, params0, mesh)
    step, put = stepper(tx, mesh, specs)
    params = jax.device_put(params0, jax.NamedSharding(mesh, P()))
    g = np.full((p, 16), 0.5, np.float32)
    prev = np.zeros(16)
    for t in range(1, 3):
        params, state = step(params, state, put({"w": g}))
        # With bias correction and a constant gradient, m_hat/sqrt(v_hat) = 1 exactly (up to eps).
        delta = np.asarray(params["w"]) - prev
        np.testing.assert_allclose(delta, -sched(t - 1) * 0.5 / (0.5 + 1e-8), rtol=1e-4)  # float32 1 - b2**t
        prev = np.asarray(params["w"])


class _UnfrozenCorrection(NumpyOneBitAdamFull):
    """A wrong variant: the variance correction keeps following the update count after freeze_step."""

    def variance_correction(self, t):
        return 1.0 - self.b2 ** t


@pytest.mark.parametrize("fused", [True, False])
def test_schedule_and_frozen_bias_correction_through_compression_match_reference(fused):
    """lr = schedule(count) with count 0-based; after freeze_step the variance correction stays at its
    freeze_step value while the momentum's keeps growing. Random gradients, so the compression stage is real."""
    p, freeze = 4, 3
    params0 = make_params(np.random.default_rng(5))
    sched = optax.linear_schedule(1e-2, 1e-3, 8)
    tx = onebit_adam(sched, freeze_step=freeze, bias_correction=True, weight_decay=0.01, fused=fused)
    ref = NumpyOneBitAdamFull(params0, p, freeze_step=freeze, lr=None, wd=0.01, fused=fused,
                              schedule=lambda c: float(sched(c)), bias_correction=True)
    # Two wrong references the comparison must tell apart: the schedule read one update late, and the
    # variance correction left running after freeze_step.
    late = NumpyOneBitAdamFull(params0, p, freeze_step=freeze, lr=None, wd=0.01, fused=fused,
                               schedule=lambda c: float(sched(c + 1)), bias_correction=True)
    unfrozen = _UnfrozenCorrection(params0, p, freeze_step=freeze, lr=None, wd=0.01, fused=fused,
                                   schedule=lambda c: float(sched(c)), bias_correction=True)
    for t, grads, got, want in run_against(tx, ref, p, steps=8, seed=6):
        wrong_lr = late.step(grads)
        wrong_c2 = unfrozen.step(grads)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6, err_msg=f"step {t} leaf {k}")
            assert np.abs(got[k] - wrong_lr[k]).max() > 1e-4
            if t >= freeze:  # update t + 1 > freeze_step: compression
                assert np.abs(got[k] - wrong_c2[k]).max() > 1e-4


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        (dict(freeze_step=-1), ValueError, "freeze_step must be >= 0"),
        (dict(freeze_step=0), ValueError, "freeze_step=0"),
        (dict(freeze_step=2.5), TypeError, "freeze_step must be an int"),
        (dict(freeze_step=True), TypeError, "freeze_step must be an int"),
        (dict(freeze_step=2, b2=1.0), ValueError, "b2"),
    ],
)
def test_bad_hyperparameters(kwargs, err, match):
    with pytest.raises(err, match=match):
        onebit_adam(1e-3, **kwargs)


def test_bad_trees_and_contexts():
    mesh = mesh_of(2)
    params = {"w": jnp.ones((4, 4)), "i": jnp.ones(3, jnp.int32)}
    with pytest.raises(TypeError, match=r"\['i'\].*int32"):
        sharded_init(onebit_adam(1e-3, freeze_step=2), params, mesh)
    params = {"w": jnp.ones((4, 4))}
    with pytest.raises(ValueError, match="same tree structure"):
        sharded_init(onebit_adam(1e-3, freeze_step=2, exp_avg_mask={"v": jnp.ones((4, 4))}), params, mesh)
    with pytest.raises(ValueError, match=r"\['w'\] has shape \(4,\)"):
        sharded_init(onebit_adam(1e-3, freeze_step=2, exp_avg_mask={"w": jnp.ones(4)}), params, mesh)
    # Outside shard_map the optimizer is one worker (tests/transforms/test_one_worker.py); inside one that does not
    # bind its axis it is an error.
    with pytest.raises(ValueError, match="'model' is not bound"):
        sharded_init(onebit_adam(1e-3, freeze_step=2, axis_name="model"), params, mesh)


def test_already_reduced_gradients_are_refused():
    mesh = mesh_of(2)
    params = {"w": jnp.ones(16)}
    tx = onebit_adam(1e-3, freeze_step=2)
    state, specs = sharded_init(tx, params, mesh)

    @jax.shard_map(mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=P())
    def bad(params, state, x):
        grads = jax.grad(lambda p: jnp.sum(p["w"] * x))(params)  # replicated params: autodiff psums
        return tx.update(grads, state, params)[0]

    x = jax.device_put(jnp.ones(32), jax.NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match="already all-reduced"):
        bad(jax.device_put(params, jax.NamedSharding(mesh, P())), state, x)


def test_inject_hyperparams_matches_plain():
    p = 4
    mesh = mesh_of(p)
    params0 = make_params(np.random.default_rng(3))
    grads = {k: np.random.default_rng(4).standard_normal((p,) + v.shape).astype(np.float32) for k, v in params0.items()}
    finals = []
    for tx in (
        onebit_adam(1e-2, freeze_step=2, weight_decay=0.1),
        optax.inject_hyperparams(onebit_adam, static_args=("freeze_step",))(
            learning_rate=1e-2, freeze_step=2, weight_decay=0.1),
    ):
        state, specs = sharded_init(tx, params0, mesh)
        step, put = stepper(tx, mesh, specs)
        params = jax.device_put(params0, jax.NamedSharding(mesh, P()))
        for _ in range(4):
            params, state = step(params, state, put(grads))
        finals.append(jax.device_get(params))
    for k in params0:
        # Injected hyperparameters are float32 arrays (1 - b1 rounds differently than in Python floats).
        np.testing.assert_allclose(finals[1][k], finals[0][k], rtol=1e-4, atol=1e-5)


def test_row_scales_bytes_from_the_compiled_step():
    """The compression stage sends the signs plus one float32 per row, as row_compressed_bytes_per_rank says."""
    from jonebit.comm import compressed_bytes_per_rank
    from jonebit.comm.accounting import comm_report
    from jonebit.comm.compressed import row_compressed_bytes_per_rank

    p = 4
    mesh = mesh_of(p)
    params0 = {"b": np.zeros(40, np.float32), "emb": np.zeros((100, 64), np.float32)}
    tx = onebit_adam(1e-3, freeze_step=2, experimental=OneBitAdamOptions(row_scales=True))
    state, specs = sharded_init(tx, params0, mesh)
    step, put = stepper(tx, mesh, specs)
    params = jax.device_put(params0, jax.NamedSharding(mesh, P()))
    grads = put({k: np.zeros((p, *v.shape), np.float32) for k, v in params0.items()})
    report = comm_report(step.lower(params, state, grads).compile().as_text(), p)
    want = row_compressed_bytes_per_rank(100 * 64, p, 64) + compressed_bytes_per_rank(40, p)
    assert report.phase_bytes(jonebit.OneBitAdamState.PHASES)["compression"] == pytest.approx(want)
    # 100 rows of 64 signs (8 bytes) and a 4-byte scale each: 1.5x the signs alone.
    assert row_compressed_bytes_per_rank(100 * 64, p, 64) == 2 * (p - 1) * (100 // p) * (8 + 4)


@pytest.mark.parametrize("fused,preconditioned,clip,norm", [(True, False, None, None), (False, True, 2.0, None),
                                                             (False, False, None, 3.0)])
def test_variance_refresh_matches_reference(fused, preconditioned, clip, norm):
    """variance_refresh=K: every K-th compression update is an exact step on the mean gradient that refreshes the
    variance with weight 1 - b2^K and advances its bias correction; against the numpy reference, which must also
    differ from the frozen variance. With max_grad_norm the refresh averages the locally clipped gradients."""
    p, freeze, k = 4, 3, 2
    params0 = make_params(np.random.default_rng(5))
    sched = optax.linear_schedule(1e-2, 1e-3, 10)
    kw = dict(freeze_step=freeze, fused=fused, preconditioned=preconditioned, clip_ratio=clip)
    options = OneBitAdamOptions(variance_refresh=k, preconditioned=preconditioned, clip_ratio=clip)
    tx = onebit_adam(sched, bias_correction=True, weight_decay=0.01, freeze_step=freeze, fused=fused,
                     max_grad_norm=norm, experimental=options)
    common = dict(lr=None, wd=0.01, schedule=lambda c: float(sched(c)), bias_correction=True, clip_norm=norm,
                  clip_averaged_warmup=norm is not None, **kw)
    ref = NumpyOneBitAdamFull(params0, p, refresh=k, **common)
    frozen = NumpyOneBitAdamFull(params0, p, **common)
    if norm is not None:  # the clip binds on every local gradient (norm ~ sqrt(48)), less often on the mean
        assert norm < np.sqrt(48) * 0.6
    for t, grads, got, want in run_against(tx, ref, p, steps=10, seed=6):
        other = frozen.step(grads)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=2e-5, atol=2e-6, err_msg=f"step {t} leaf {name}")
        if t >= freeze + k - 1:  # the first refresh is update freeze + k
            assert max(np.abs(got[n] - other[n]).max() for n in want) > 1e-4


def test_variance_refresh_every_update_on_one_rank_is_adam():
    """With one rank nothing is compressed; refreshing every update (K = 1) is then optax.adam exactly."""
    params0 = make_params(np.random.default_rng(1))
    tx = onebit_adam(1e-2, freeze_step=2, experimental=OneBitAdamOptions(variance_refresh=1))
    adam = optax.adam(1e-2)
    state, specs = sharded_init(tx, params0, mesh_of(1))
    step, put = stepper(tx, mesh_of(1), specs)
    params = jax.device_put(params0, jax.NamedSharding(mesh_of(1), P()))
    want, adam_state = params0, adam.init(params0)
    rng = np.random.default_rng(2)
    for _ in range(8):
        grads = {k: (rng.standard_normal(v.shape) * rng.uniform(0.1, 3.0)).astype(np.float32)
                 for k, v in params0.items()}
        params, state = step(params, state, put({k: g[None] for k, g in grads.items()}))
        updates, adam_state = adam.update(grads, adam_state, want)
        want = optax.apply_updates(want, updates)
        for k in want:
            np.testing.assert_allclose(np.asarray(params[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-7)
