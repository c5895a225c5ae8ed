import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jonebit
from jonebit import onebit_lamb, sharded_init, state_specs
from jonebit.sharding.zero import zero_shardings
from tests.reference_family import NumpyOneBitLamb, np_auto_freeze
from tests.transforms.family_util import (
    check_compact_mask,
    make_params,
    mesh_of,
    put_replicated,
    put_rows,
    random_grads,
    replicated_stepper,
    stack,
)

FREEZE = 4  # jonebit's freeze_step: 4 LAMB updates (DeepSpeed's freeze_step = 5)
# Tight clamps so that every one of them acts within a short run: the warmup trust ratio hits both coefficient
# bounds, and the compression factor hits factor_min, factor_max and the per-step threshold.
HYPER = dict(b2=0.9, min_coeff=0.3, max_coeff=0.4, coeff_beta=0.5, factor_min=0.8, factor_max=1.2,
             factor_threshold=0.1)


def grad_scale(t):
    """Gradient size per update: larger after the freeze (the fresh variance grows: f < 1), then much smaller."""
    return 1.0 if t < FREEZE else 3.0 if t < FREEZE + 5 else 0.05


def run(p, *, wd=0.01, mask=None, lr=1e-2, seed=0, steps=16, hyper=HYPER, zero_leaf=None, mask_unseen=True):
    rng = np.random.default_rng(seed)
    params0 = make_params(rng)
    params0["b"][:] = 0.0  # a zero tensor: trust ratio 1 on the first update (the EMA skips it)
    mesh = mesh_of(p)
    tx = onebit_lamb(lr, freeze_step=FREEZE, weight_decay=wd, exp_avg_mask=mask, mask_unseen=mask_unseen, **hyper)
    state, specs = sharded_init(tx, params0, mesh)
    step = replicated_stepper(tx, mesh, specs)
    params = put_replicated(params0, mesh)
    ref = NumpyOneBitLamb(params0, p, lr=lr, freeze_step=FREEZE + 1, wd=wd, mask=mask, mask_unseen=mask_unseen,
                          **hyper)
    for t in range(steps):
        grads = random_grads(rng, params0, p, scale=grad_scale(t))
        if zero_leaf is not None and t < FREEZE:
            for g in grads:
                g[zero_leaf][:] = 0.0
        params, state = step(params, state, put_rows(stack(grads), mesh))
        want = dict(ref.step(grads))
        yield t, {k: np.asarray(v) for k, v in params.items()}, want, ref, state


def assert_close(got, want, t, rtol=2e-5, atol=2e-6):
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=atol, err_msg=f"update {t} leaf {k}")


@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_matches_deepspeed_reference_through_freeze_and_clamps(p):
    mask = {"b": np.ones(13, np.float32), "w": np.ones((5, 7), np.float32), "z": np.ones((4, 6), np.float32)}
    mask["w"][3:] = 0.0
    for t, got, want, ref, state in run(p, mask=mask):  # noqa: B007 (read after the loop)
        assert_close(got, want, t)
        if t >= FREEZE:
            assert np.all(np.asarray(state.mu["w"])[3:] == 0.0)
    state = jax.device_get(state)
    # The warmup trust ratio hit both clamps, and the zero tensor's ratio of 1 was left out of the EMA.
    warm = [c for c in ref.coeffs[:FREEZE] for c in c.values()]
    assert np.float32(0.3) in warm and np.float32(0.4) in warm
    assert ref.coeffs[0]["b"] == 1.0
    # The compression factor was clamped every way: below factor_min, above factor_max, by the threshold.
    finals = [f for step in ref.factors for f in step.values()]
    assert any(raw < 0.8 for raw, _ in finals) and any(raw > 1.2 for raw, _ in finals)
    assert any(f == np.float32(1.2) for _, f in finals)
    assert any(raw != f and 0.8 < raw < 1.2 for raw, f in finals)  # only the threshold clamp moved it
    for k in ref.keys:
        np.testing.assert_allclose(state.lamb_coeff_freeze[k], ref.coeff_freeze[k], rtol=1e-6)
        np.testing.assert_allclose(state.last_factor[k], ref.last_factor[k], rtol=1e-5)
        np.testing.assert_allclose(state.scaling_coeff[k], ref.scaling[k], rtol=1e-5)
        np.testing.assert_allclose(state.nu_fresh[k], ref.v_fresh[k], rtol=1e-4, atol=1e-8)
        np.testing.assert_allclose(state.nu[k], ref.v[k], rtol=1e-5, atol=1e-9)
        np.testing.assert_allclose(state.mu[k], ref.m[k], rtol=1e-4, atol=1e-6)
    n_pad = {1: 72, 2: 80, 4: 96, 8: 128}[p]
    assert state.worker_error.shape == (p, n_pad) and state.padding.shape == (n_pad - 72,)
    if p > 1:  # the fused buffer's tail holds the last decoded values, as DeepSpeed's dummy tensor does
        assert np.abs(state.padding).max() > 0
        np.testing.assert_allclose(state.padding, ref.pad, rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(state.worker_error, np.stack(ref.comp.we[None]), rtol=1e-4, atol=1e-6)


def test_tail_of_the_fused_buffer_matters():
    """A reference that re-zeroes the padding tail each step (a plausible simplification) disagrees."""
    rows = list(run(8, steps=12))
    ref = rows[-1][3]
    wrong = NumpyOneBitLamb(make_params(np.random.default_rng(0)), 8, lr=1e-2, freeze_step=FREEZE + 1, wd=0.01,
                            **HYPER)
    wrong.params["b"][:] = 0.0
    rng = np.random.default_rng(0)
    make_params(rng)
    gap = 0.0
    for t, got, _, _, _ in rows:
        grads = random_grads(rng, wrong.params, 8, scale=grad_scale(t))
        wrong.pad[:] = 0.0
        gap = max(gap, max(np.abs(got[k] - wrong.step(grads)[k]).max() for k in got))
    assert ref.pad.size == 56 and gap > 1e-6


def test_schedule_without_weight_decay():
    sched = optax.linear_schedule(2e-2, 5e-3, 12)
    for t, got, want, _, _ in run(2, wd=0.0, lr=sched, steps=12):
        assert_close(got, want, t)


@pytest.mark.parametrize("mask_unseen", [True, False])
def test_tensor_with_zero_momentum_at_the_freeze_stays_finite(mask_unseen):
    """DeepSpeed's scaling coefficient would be U / 0 = inf (NaN everywhere); here it is 1. The tensor got no
    gradient in warmup (v = 0): with mask_unseen (default) it moves only by weight decay afterwards; with
    DeepSpeed's arithmetic the 1-bit average over eps moves it far."""
    params0 = make_params(np.random.default_rng(0))
    for t, got, want, ref, state in run(4, zero_leaf="z", steps=8, mask_unseen=mask_unseen):  # noqa: B007
        assert_close(got, want, t, atol=2e-6 * max(1.0, float(np.abs(want["z"]).max())))
        assert all(np.isfinite(v).all() for v in got.values())
    assert float(jax.device_get(state.scaling_coeff["z"])) == 1.0 and ref.scaling["z"] == 1.0
    moved = float(np.abs(got["z"] - params0["z"]).max())
    assert (moved < 0.05) if mask_unseen else (moved > 1.0)


def test_no_recompilation_across_freeze_step():
    p = 4
    mesh = mesh_of(p)
    params0 = make_params(np.random.default_rng(0))
    tx = onebit_lamb(1e-3, freeze_step=2)
    state, specs = sharded_init(tx, params0, mesh)
    step = replicated_stepper(tx, mesh, specs)
    params = put_replicated(params0, mesh)
    grads = put_rows({k: np.ones((p,) + v.shape, np.float32) for k, v in params0.items()}, mesh)
    for _ in range(2):  # the 2nd call sees the P() params come back as P(None, ...) once
        params, state = step(params, state, grads)
    compiled = step._cache_size()
    for _ in range(4):
        params, state = step(params, state, grads)
    assert int(state.count) == 6 and step._cache_size() == compiled


def test_state_layout_specs_and_zero_shardings():
    p = 8
    mesh = mesh_of(p)
    params0 = make_params(np.random.default_rng(0))
    tx = optax.chain(optax.clip_by_global_norm(1.0), onebit_lamb(1e-3, freeze_step=2))
    state, specs = sharded_init(tx, params0, mesh)
    inner, spec = state[1], specs[1]
    assert isinstance(inner, jonebit.OneBitLambState)
    assert spec.worker_error == P("data") and spec.server_error == P("data")
    assert spec.mu["w"] == P() and spec.padding == P() and spec.lamb_coeff_freeze["w"] == P()
    assert inner.worker_error.shape == (p, 128) and inner.server_error.shape == (p, 16)
    assert state_specs(jax.eval_shape(lambda: state)) == specs
    for stage in (0, 2):
        sh = zero_shardings(mesh, params0, jax.eval_shape(lambda: state), stage=stage).opt_state[1]
        assert sh.worker_error.spec == P("data") and sh.mu["w"].spec == P()


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        (dict(freeze_step=0), ValueError, "freeze_step must be >= 1.*F - 1"),
        (dict(freeze_step=1.5), TypeError, "freeze_step must be an int"),
        (dict(freeze_step=2, b1=1.0), ValueError, r"b1 must be in \[0, 1\)"),
        (dict(freeze_step=2, coeff_beta=1.0), ValueError, r"coeff_beta must be in \[0, 1\)"),
        (dict(freeze_step=2, eps=-1.0), ValueError, "eps must be > 0"),
        (dict(freeze_step=2, min_coeff=-0.1), ValueError, "min_coeff must be >= 0"),
        (dict(freeze_step=2, min_coeff=1.0, max_coeff=0.5), ValueError, r"max_coeff \(0.5\) must be >= min_coeff"),
        (dict(freeze_step=2, factor_min=2.0, factor_max=1.0), ValueError, r"factor_max \(1.0\) must be >= factor_min"),
        (dict(freeze_step=2, factor_threshold=1.5), ValueError, r"factor_threshold must be in \[0, 1\)"),
        (dict(freeze_step=2, bias_correction=True), ValueError, "bias_correction=True is not supported"),
        (dict(freeze_step=2, mask_unseen="yes"), TypeError, "mask_unseen must be True or False, got 'yes'"),
    ],
)
def test_bad_hyperparameters(kwargs, err, match):
    with pytest.raises(err, match=match):
        onebit_lamb(1e-3, **kwargs)


def test_bad_trees_and_contexts():
    mesh = mesh_of(2)
    with pytest.raises(TypeError, match=r"onebit_lamb: param leaf \['i'\] has dtype int32"):
        sharded_init(onebit_lamb(1e-3, freeze_step=2), {"w": jnp.ones(4), "i": jnp.ones(3, jnp.int32)}, mesh)
    params = {"w": jnp.ones((4, 4))}
    with pytest.raises(ValueError, match=r"exp_avg_mask leaf \['w'\] has shape \(4,\)"):
        sharded_init(onebit_lamb(1e-3, freeze_step=2, exp_avg_mask={"w": jnp.ones(4)}), params, mesh)
    with pytest.raises(ValueError, match="'model' is not bound"):  # outside shard_map it is one worker
        sharded_init(onebit_lamb(1e-3, freeze_step=2, axis_name="model"), params, mesh)
    tx = onebit_lamb(1e-3, freeze_step=2)
    state, specs = sharded_init(tx, params, mesh)

    @jax.shard_map(mesh=mesh, in_specs=(P("data"), specs), out_specs=P())
    def no_params(grads, state):
        return tx.update(jax.tree.map(lambda g: g[0], grads), state)[0]

    with pytest.raises(ValueError, match="trust ratio needs params"):
        no_params(put_rows({"w": np.ones((2, 4, 4), np.float32)}, mesh), state)

    @jax.shard_map(mesh=mesh, in_specs=(P("data"), specs, P("data")), out_specs=P("data"))
    def per_rank_params(params, state, grads):
        params, grads = (jax.tree.map(lambda x: x[0], t) for t in (params, grads))
        return tx.update(grads, state, params)[0]

    rows = put_rows({"w": np.ones((2, 4, 4), np.float32)}, mesh)
    with pytest.raises(ValueError, match=r"onebit_lamb: param \['w'\] varies over axis 'data'.*in_specs P\(\)"):
        per_rank_params(rows, state, rows)


def test_checkpoint_round_trip_resumes_bit_identically(tmp_path):
    from jonebit.train import checkpoint

    p = 4
    mesh = mesh_of(p)
    rng = np.random.default_rng(2)
    params0 = make_params(rng)
    tx = onebit_lamb(1e-2, freeze_step=3, weight_decay=0.01)
    state, specs = sharded_init(tx, params0, mesh)
    step = replicated_stepper(tx, mesh, specs)
    params = put_replicated(params0, mesh)
    grads = [put_rows(stack(random_grads(rng, params0, p)), mesh) for _ in range(10)]
    for g in grads[:6]:  # past the freeze: errors, tail, coefficients and factors all non-trivial
        params, state = step(params, state, g)
    assert np.abs(np.asarray(state.worker_error)).max() > 0 and np.abs(np.asarray(state.padding)).max() > 0
    snapshot = jax.device_get({"params": params, "opt_state": state})
    checkpoint.save(tmp_path / "ckpt", {"params": params, "opt_state": state}, step=6)
    restored, at = checkpoint.restore(tmp_path / "ckpt", {"params": params, "opt_state": state})
    assert at == 6
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), snapshot)
    assert restored["opt_state"].worker_error.sharding.spec[0] == "data"
    cont, resumed = (params, state), (restored["params"], restored["opt_state"])
    for g in grads[6:]:
        cont = step(*cont, g)
        resumed = step(*resumed, g)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed), jax.device_get(cont))


AUTO = dict(min_step=6, max_step=60, check_every=3, threshold=0.06, patience=2)


def auto_run(rule, steps, *, seed=3, p=2):
    """onebit_lamb(freeze_step="auto") and the numpy reference's variance norms on the same gradients."""
    rng = np.random.default_rng(seed)
    params0 = make_params(rng)
    mesh = mesh_of(p)
    tx = onebit_lamb(1e-2, freeze_step=jonebit.AutoFreeze(**rule), b2=0.9)
    state, specs = sharded_init(tx, params0, mesh)
    step = replicated_stepper(tx, mesh, specs)
    params = put_replicated(params0, mesh)
    ref = NumpyOneBitLamb(params0, p, lr=1e-2, freeze_step=10**6, b2=0.9)  # warmup only: the variance trajectory
    grads, norms = [], []
    for _ in range(steps):
        g = random_grads(rng, params0, p)
        grads.append(g)
        params, state = step(params, state, put_rows(stack(g), mesh))
        ref.step(g)
        norms.append({k: float(np.sqrt(np.sum(ref.v[k].astype(np.float64) ** 2))) for k in ref.keys})
    return params0, grads, params, state, norms


def test_auto_freeze_fires_by_the_stated_rule_and_equals_that_fixed_freeze_step(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="jonebit.transforms"):
        params0, grads, params, state, norms = auto_run(AUTO, 36)
    want = np_auto_freeze(norms, b2=0.9, **AUTO)
    assert want is not None and AUTO["min_step"] < want < 30  # the rule itself decided, not a bound
    assert int(state.freeze_at) == want
    assert caplog.text.count("compression starts after update") == 1
    assert f"after update {want}" in caplog.text
    # From there on it is exactly 1-bit LAMB with that freeze_step.
    p = 2
    mesh = mesh_of(p)
    tx = onebit_lamb(1e-2, freeze_step=want, b2=0.9)
    fixed_state, specs = sharded_init(tx, params0, mesh)
    step = replicated_stepper(tx, mesh, specs)
    fixed = put_replicated(params0, mesh)
    for g in grads:
        fixed, fixed_state = step(fixed, fixed_state, put_rows(stack(g), mesh))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), jax.device_get(fixed))
    np.testing.assert_array_equal(np.asarray(state.worker_error), np.asarray(fixed_state.worker_error))


def test_auto_freeze_bounds():
    strict = dict(AUTO, threshold=1e-9)  # never calm: the cap decides
    *_, state, norms = auto_run(dict(strict, max_step=10), 12, p=1)
    assert int(state.freeze_at) == 10 and np_auto_freeze(norms, b2=0.9, **dict(strict, max_step=10)) == 10
    lax_rule = dict(AUTO, threshold=10.0, min_step=15)  # calm from the second check: the minimum decides
    *_, state, norms = auto_run(lax_rule, 20, p=1)
    assert int(state.freeze_at) == 15 == np_auto_freeze(norms, b2=0.9, **lax_rule)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(freeze_step="never"), r"freeze_step must be an int, \"auto\" or a jonebit.AutoFreeze, got 'never'"),
        (dict(freeze_step=jonebit.AutoFreeze(min_step=50, max_step=10)),
         r"auto_freeze.max_step \(10\) must be >= min_step \(50\)"),
        (dict(freeze_step=jonebit.AutoFreeze(threshold=0.0)), r"auto_freeze.threshold must be"),
        (dict(freeze_step=jonebit.AutoFreeze(check_every=0)), r"auto_freeze.check_every must be"),
    ],
)
def test_bad_auto_freeze(kwargs, match):
    with pytest.raises(ValueError, match=match):
        onebit_lamb(1e-3, **kwargs)


def test_compact_mask_gives_the_full_masks_updates():
    """onebit_adam's mask format works here too (what jonebit.models.bert.position_embedding_mask builds)."""
    check_compact_mask(lambda mask: onebit_lamb(1e-2, freeze_step=FREEZE, exp_avg_mask=mask, **HYPER),
                       grad_scale=grad_scale, steps=FREEZE + 6)
