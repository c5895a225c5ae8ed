import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jonebit
from jonebit import sharded_init, state_specs, zero_one_adam
from jonebit.sharding.zero import zero_shardings
from jonebit.transforms.onebit_adam import leaf_errors
from tests.reference_family import NumpyZeroOneAdam
from tests.transforms.family_util import (
    check_compact_mask,
    make_params,
    mesh_of,
    per_rank_stepper,
    put_replicated,
    put_rows,
    random_grads,
    stack,
)

# Small schedules so that 30 updates pass every switch: 2 variance steps, then variance steps 2, 4 and 8 apart with
# 1-bit gradient steps between them; the freeze after 12 updates; local steps whose sync interval doubles every 3
# steps up to the clipper 4 (syncs at intervals 1, 2, 4, 4).
SCHEDULE = dict(var_freeze_step=12, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4)
STEPS = 30


def run(p, *, fused=True, wd=0.01, mask=None, lr=1e-2, seed=0, steps=STEPS, schedule=SCHEDULE, tx_kwargs=None,
        unseen_rows=0, **ref_kwargs):
    """Runs zero_one_adam and the numpy reference on the same per-rank gradients; yields per-update results."""
    rng = np.random.default_rng(seed)
    params0 = make_params(rng)
    mesh = mesh_of(p)
    tx = zero_one_adam(lr, weight_decay=wd, exp_avg_mask=mask, fused=fused, **schedule, **(tx_kwargs or {}))
    state, specs = sharded_init(tx, params0, mesh)
    step = per_rank_stepper(tx, mesh, specs)
    params = put_rows({k: np.stack([v] * p) for k, v in params0.items()}, mesh)
    ref = NumpyZeroOneAdam(params0, p, lr=lr, wd=wd, mask=mask, fused=fused, **schedule, **ref_kwargs)
    for t in range(steps):
        grads = random_grads(rng, params0, p)
        for g in grads:  # rows of "z" no gradient ever reaches (an embedding's unseen tokens)
            g["z"][:unseen_rows] = 0.0
        params, state = step(params, state, put_rows(stack(grads), mesh))
        want = ref.step(grads)
        yield t, {k: np.asarray(v) for k, v in params.items()}, [dict(w) for w in want], ref, state, grads


def assert_close(got, want, t, rtol=5e-5, atol=5e-5):
    for r, w in enumerate(want):
        for k in w:
            np.testing.assert_allclose(got[k][r], w[k], rtol=rtol, atol=atol, err_msg=f"update {t} rank {r} leaf {k}")


@pytest.mark.parametrize("mask_unseen", [True, False])
def test_elements_without_gradient_stay_put_unless_deepspeed_arithmetic(mask_unseen):
    """Rows whose variance stays 0: with mask_unseen (default) they take no 1-bit average and no momentum, so
    with wd=0 they never move; DeepSpeed's arithmetic moves them by the average's magnitude over eps. Both against
    the numpy reference, through every phase."""
    p, rows = 4, 2
    params0 = make_params(np.random.default_rng(0))
    last = None
    for t, got, want, ref, _, _ in run(p, wd=0.0, unseen_rows=rows, tx_kwargs=dict(mask_unseen=mask_unseen),
                                       mask_unseen=mask_unseen):
        scale = max(1.0, float(np.abs(want[0]["z"][:rows]).max()))  # DeepSpeed's rows grow to ~lr / eps
        assert_close(got, want, t, rtol=5e-5, atol=5e-5 * scale)
        last = got, ref
    got, ref = last
    assert set(ref.log) == {"var", "onebit", "local", "sync"}
    moved = np.abs(got["z"][:, :rows] - params0["z"][:rows]).max()
    if mask_unseen:
        assert moved == 0.0
        assert np.abs(got["z"][:, rows:] - params0["z"][rows:]).max() > 1e-3  # the other rows train
    else:
        assert moved > 1.0


@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_matches_deepspeed_reference_through_every_phase(p):
    mask = {"b": np.ones(13, np.float32), "w": np.ones((5, 7), np.float32), "z": np.ones((4, 6), np.float32)}
    mask["w"][3:] = 0.0
    for t, got, want, ref, state, _ in run(p, mask=mask):
        assert_close(got, want, t)
        if p > 1 and ref.log[-1] == "local":  # local steps: every rank moved on its own
            assert np.abs(got["w"][0] - got["w"][1]).max() > 1e-4
        for r in range(1, p):
            if ref.log[-1] in ("var", "onebit"):  # before the local phase the ranks agree bit for bit
                np.testing.assert_array_equal(got["b"][r], got["b"][0])
            elif ref.log[-1] == "sync":  # p - u rounds differently per rank (so does DeepSpeed): ulps apart
                np.testing.assert_allclose(got["b"][r], got["b"][0], rtol=1e-6, atol=1e-7)
        if ref.log[-1] == "sync":  # the synchronised momentum is masked (local steps then fold g in unmasked)
            assert np.all(np.asarray(state.mu["w"])[:, 3:] == 0.0)
    # Every phase and schedule switch happened (the reference logs what each update did).
    assert ref.log[:4] == ["var", "var", "var", "onebit"]
    assert ref.log.count("var") == 6 and ref.log.count("onebit") == 6 and ref.log[12:15] == ["sync"] * 3
    sync_at = [i for i, kind in enumerate(ref.log) if kind == "sync"]
    assert np.diff(sync_at).tolist() == [1, 1, 2, 2, 4, 4]
    state = jax.device_get(state)
    assert int(state.count) == STEPS and int(state.var_interval) == 8 and int(state.local_step_interval) == 4
    assert int(state.var_counter) == ref.var_counter and int(state.local_step_counter) == ref.local_counter
    np.testing.assert_allclose(float(state.lrs), ref.lrs, rtol=1e-6)
    for r in range(p):
        np.testing.assert_allclose(state.mu["w"][r], ref.m[r]["w"], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(state.momentum_accumulator["w"][r], ref.u[r]["w"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(state.nu["w"], ref.v["w"], rtol=1e-5, atol=1e-9)
    if p > 1:
        np.testing.assert_allclose(state.worker_error, np.stack(ref.comp.we[None]), rtol=1e-4, atol=1e-5)
        # 72 elements padded to a multiple of P * lcm(P, 8)
        assert state.worker_error.shape == (p, {2: 80, 4: 96, 8: 128}[p])


def test_per_leaf_compression_and_learning_rate_schedule():
    sched = optax.linear_schedule(2e-2, 5e-3, STEPS)
    for t, got, want, _, _, _ in run(4, fused=False, lr=sched, wd=0.0):
        assert_close(got, want, t)


def test_bias_correction_through_every_phase():
    """Variance corrected by 1 - b2^(variance updates), frozen with it; momentum by 1 - b1^t in the first phase."""
    plain = NumpyZeroOneAdam(make_params(np.random.default_rng(0)), 4, lr=1e-2, wd=0.01, **SCHEDULE)
    gap = 0.0
    for t, got, want, ref, state, grads in run(4, tx_kwargs=dict(bias_correction=True), bias_correction=True):  # noqa: B007
        assert_close(got, want, t, rtol=1e-4, atol=1e-4)
        gap = max(gap, np.abs(got["w"][0] - plain.step(grads)[0]["w"]).max())
    assert int(state.var_updates) == ref.var_updates == 6 and gap > 1e-2


def test_local_steps_and_schedule_are_deepspeed_counted():
    """A reference that counts steps from 1 at the first real update (no initialisation call) must disagree."""
    off = NumpyZeroOneAdam(make_params(np.random.default_rng(0)), 2, lr=1e-2, wd=0.01, **SCHEDULE)
    off.ds_step = 0  # wrong offset: every modulo decision moves by one update
    gap = 0.0
    for t, got, want, _, _, grads in run(2, steps=16):
        assert_close(got, want, t)
        gap = max(gap, np.abs(got["w"][0] - off.step(grads)[0]["w"]).max())
    assert gap > 1e-3


def test_one_rank_updates_the_momentum_unlike_deepspeed():
    """P = 1: the 1-bit steps of the first phase fold the gradient into m (DeepSpeed's P = 1 branch skips it)."""
    quirk = NumpyZeroOneAdam(make_params(np.random.default_rng(0)), 1, lr=1e-2, wd=0.01, p1_momentum=False,
                             **SCHEDULE)
    gap = 0.0
    for t, got, want, ref, _, grads in run(1, steps=8):  # noqa: B007 (ref is read after the loop)
        assert_close(got, want, t)
        gap = max(gap, np.abs(got["w"][0] - quirk.step(grads)[0]["w"]).max())
    assert "onebit" in ref.log and gap > 1e-4


def test_no_recompilation_across_phases():
    p = 2
    mesh = mesh_of(p)
    params0 = make_params(np.random.default_rng(0))
    tx = zero_one_adam(1e-3, **SCHEDULE)
    state, specs = sharded_init(tx, params0, mesh)
    step = per_rank_stepper(tx, mesh, specs)
    params = put_rows({k: np.stack([v] * p) for k, v in params0.items()}, mesh)
    grads = put_rows({k: np.ones((p,) + v.shape, np.float32) for k, v in params0.items()}, mesh)
    for _ in range(2):  # the 2nd call sees the outputs' shardings (P() comes back as P(None, ...)) once
        params, state = step(params, state, grads)
    compiled = step._cache_size()
    for _ in range(20):  # variance steps, 1-bit steps, the freeze, local and sync steps
        params, state = step(params, state, grads)
    assert int(state.count) == 22 and int(state.local_step_interval) > 1
    assert step._cache_size() == compiled


def test_state_layout_specs_and_zero_shardings():
    p = 4
    mesh = mesh_of(p)
    params0 = make_params(np.random.default_rng(0))
    tx = optax.chain(optax.clip_by_global_norm(1.0), zero_one_adam(1e-3, fused=False, **SCHEDULE))
    state, specs = sharded_init(tx, params0, mesh)
    inner, spec = state[1], specs[1]
    assert isinstance(inner, jonebit.ZeroOneAdamState)
    assert spec.mu["w"] == P("data") and spec.momentum_accumulator["w"] == P("data")
    assert spec.worker_error == (P("data"),) * 3 and spec.nu["w"] == P() and spec.count == P() and spec.lrs == P()
    assert inner.mu["w"].shape == (p, 5, 7) and inner.nu["w"].shape == (5, 7)
    # Per leaf, one stacked error array per group of equal-size leaves ("b" 13, "w" 35, "z" 24: three groups of one).
    we, se = leaf_errors(inner.worker_error, params0), leaf_errors(inner.server_error, params0)
    assert we["w"].shape == (p, 64) and se["b"].shape == (p, 8)
    assert state_specs(jax.eval_shape(lambda: state)) == specs
    # The ZeRO planner keeps the per-rank rows on the data axis and m, v whole, at every stage.
    for stage in (0, 1, 3):
        sh = zero_shardings(mesh, params0, jax.eval_shape(lambda: state), stage=stage).opt_state[1]
        assert sh.mu["w"].spec == P("data") and sh.nu["w"].spec == P() and sh.worker_error[0].spec == P("data")


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        (dict(var_freeze_step=0), ValueError, "var_freeze_step must be >= 1"),
        (dict(var_freeze_step=2.5), TypeError, "var_freeze_step must be an int"),
        (dict(var_freeze_step=True), TypeError, "var_freeze_step must be an int"),
        (dict(var_update_scaler=0), ValueError, "var_update_scaler must be >= 1"),
        (dict(local_step_scaler=-3), ValueError, "local_step_scaler must be >= 1"),
        (dict(local_step_clipper=0), ValueError, "local_step_clipper must be >= 1"),
        (dict(b1=1.0), ValueError, r"b1 must be in \[0, 1\)"),
        (dict(b2=-0.1), ValueError, r"b2 must be in \[0, 1\)"),
        (dict(eps=0.0), ValueError, "eps must be > 0"),
        (dict(weight_decay=-1e-2), ValueError, "weight_decay must be >= 0"),
        (dict(bias_correction="yes"), TypeError, "bias_correction must be True or False"),
        (dict(mask_unseen=1), TypeError, "mask_unseen must be True or False, got 1"),
    ],
)
def test_bad_hyperparameters(kwargs, err, match):
    with pytest.raises(err, match=match):
        zero_one_adam(1e-3, **kwargs)


def test_bad_trees_and_contexts():
    mesh = mesh_of(2)
    with pytest.raises(TypeError, match=r"zero_one_adam: param leaf \['i'\] has dtype int32"):
        sharded_init(zero_one_adam(1e-3), {"w": jnp.ones(4), "i": jnp.ones(3, jnp.int32)}, mesh)
    params = {"w": jnp.ones((4, 4))}
    with pytest.raises(ValueError, match="same tree structure"):
        sharded_init(zero_one_adam(1e-3, exp_avg_mask={"v": jnp.ones((4, 4))}), params, mesh)
    with pytest.raises(ValueError, match=r"exp_avg_mask leaf \['w'\] has shape \(4,\), the param has \(4, 4\)"):
        sharded_init(zero_one_adam(1e-3, exp_avg_mask={"w": jnp.ones(4)}), params, mesh)
    with pytest.raises(ValueError, match="'model' is not bound"):
        sharded_init(zero_one_adam(1e-3, axis_name="model"), params, mesh)
    with pytest.raises(ValueError, match="params have no elements"):
        sharded_init(zero_one_adam(1e-3), {"w": jnp.ones((0,))}, mesh)
    tx = zero_one_adam(1e-3, weight_decay=0.1)
    state, specs = sharded_init(tx, params, mesh)

    @jax.shard_map(mesh=mesh, in_specs=(P("data"), specs), out_specs=P("data"))
    def no_params(grads, state):
        return tx.update(jax.tree.map(lambda g: g[0], grads), state)[0]

    with pytest.raises(ValueError, match="weight_decay needs params"):
        no_params(put_rows({"w": np.ones((2, 4, 4), np.float32)}, mesh), state)


def test_already_reduced_gradients_are_refused():
    mesh = mesh_of(2)
    params = {"w": jnp.ones(16)}
    tx = zero_one_adam(1e-3)
    state, specs = sharded_init(tx, params, mesh)

    @jax.shard_map(mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=P("data"))
    def bad(params, state, x):
        grads = jax.grad(lambda p: jnp.sum(p["w"] * x))(params)  # replicated params: autodiff psums
        return tx.update(grads, state, params)[0]

    with pytest.raises(ValueError, match="zero_one_adam: gradient .* already all-reduced"):
        bad(put_replicated(params, mesh), state, put_rows(jnp.ones(32), mesh))


def test_replicated_params_are_refused():
    """The local steps move each rank's params: a replicated params tree (in_specs P()) cannot hold them."""
    mesh = mesh_of(2)
    params = {"w": jnp.ones(16)}
    tx = zero_one_adam(1e-3)
    state, specs = sharded_init(tx, params, mesh)

    @jax.shard_map(mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=P("data"))
    def replicated(params, state, x):
        local = jax.lax.pcast(params, "data", to="varying")
        grads = jax.grad(lambda p: jnp.sum(p["w"] * x))(local)
        return tx.update(grads, state, params)[0]

    with pytest.raises(ValueError, match=r"zero_one_adam: param \['w'\] is replicated over axis 'data'.*per rank"):
        replicated(put_replicated(params, mesh), state, put_rows(jnp.ones(32), mesh))


def test_checkpoint_round_trip_resumes_bit_identically(tmp_path):
    from jonebit.train import checkpoint

    p = 4
    mesh = mesh_of(p)
    rng = np.random.default_rng(1)
    params0 = make_params(rng)
    tx = zero_one_adam(1e-2, weight_decay=0.01, **SCHEDULE)
    state, specs = sharded_init(tx, params0, mesh)
    step = per_rank_stepper(tx, mesh, specs)
    params = put_rows({k: np.stack([v] * p) for k, v in params0.items()}, mesh)
    grads = [put_rows(stack(random_grads(rng, params0, p)), mesh) for _ in range(24)]
    for g in grads[:18]:  # stop inside a local interval: u, m and params differ per rank, errors non-zero
        params, state = step(params, state, g)
    assert np.abs(np.asarray(state.momentum_accumulator["w"])).max() > 0
    assert np.abs(np.asarray(state.worker_error)).max() > 0
    snapshot = jax.device_get({"params": params, "opt_state": state})
    checkpoint.save(tmp_path / "ckpt", {"params": params, "opt_state": state}, step=18)
    restored, at = checkpoint.restore(tmp_path / "ckpt", {"params": params, "opt_state": state})
    assert at == 18
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), snapshot)
    assert restored["opt_state"].momentum_accumulator["w"].sharding.spec[0] == "data"
    cont, resumed = (params, state), (restored["params"], restored["opt_state"])
    for g in grads[18:]:
        cont = step(*cont, g)
        resumed = step(*resumed, g)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed), jax.device_get(cont))


def test_compact_mask_gives_the_full_masks_updates():
    """onebit_adam's mask format works here too (what jonebit.models.bert.position_embedding_mask builds)."""
    check_compact_mask(lambda mask: zero_one_adam(1e-2, exp_avg_mask=mask, fused=False, **SCHEDULE), per_rank=True)
