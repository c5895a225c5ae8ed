"""1-bit Adam with ZeRO partitioning against the numpy reference of the spec and against stage 0."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jonebit
from jonebit import onebit_adam, onebit_adam_zero, sharded_init, state_specs
from jonebit.transforms.onebit_adam_zero import FlatLayout, OneBitAdamZeroState
from tests.reference import NumpyOneBitAdam, np_padded

LR, WD = 1e-2, 0.01

def tx_of(learning_rate, *, stage, **kw):
    """onebit_adam at stage 0, its ZeRO variant at stages 1-3."""
    return onebit_adam_zero(learning_rate, stage=stage, **kw) if stage else onebit_adam(learning_rate, **kw)


def mesh_of(p):
    return jax.make_mesh((p,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:p])


def make_params(rng):
    # 13 + 35 + 24 = 72 elements: every buffer needs padding for P = 4 and 8.
    return {
        "b": rng.standard_normal(13).astype(np.float32),
        "u": rng.standard_normal((4, 6)).astype(np.float32),
        "w": rng.standard_normal((5, 7)).astype(np.float32),
    }


def zero_stepper(tx, mesh, specs, stage):
    """Jitted update with per-rank gradients stacked on a leading axis; stage 3 params are (P, C) chunks."""
    pspec = P("data") if stage == 3 else P()

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(pspec, specs, P("data")), out_specs=(pspec, specs))
    def step(params, state, grads):
        grads = jax.tree.map(lambda g: g[0], grads)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def run(stage, p, *, steps, freeze_step, fused, mask=None, seed=0):
    """Params after each step for ZeRO ``stage`` (0 = the plain transform), and the numpy reference."""
    rng = np.random.default_rng(seed)
    params0 = make_params(rng)
    mesh = mesh_of(p)
    tx = tx_of(LR, freeze_step=freeze_step, weight_decay=WD, exp_avg_mask=mask, fused=fused, stage=stage,
               bias_correction=False)  # the reference is DeepSpeed's
    state, specs = sharded_init(tx, params0, mesh)
    layout = FlatLayout.of(params0, p, fused)
    params = jax.device_put(params0, jax.NamedSharding(mesh, P()))
    if stage == 3:
        params = jax.device_put(layout.to_chunks(params0), jax.NamedSharding(mesh, P("data")))
    step = zero_stepper(tx, mesh, specs, stage)
    ref = NumpyOneBitAdam(params0, p, freeze_step=freeze_step, lr=LR, wd=WD, mask=mask, fused=fused)
    put = lambda t: jax.device_put(t, jax.NamedSharding(mesh, P("data")))  # noqa: E731
    got, want = [], []
    for _ in range(steps):
        grads = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params0.items()} for _ in range(p)]
        params, state = step(params, state, put({k: np.stack([g[k] for g in grads]) for k in params0}))
        tree = layout.from_chunks(jax.device_get(params)) if stage == 3 else jax.device_get(params)
        got.append({k: np.asarray(v) for k, v in tree.items()})
        want.append({k: v.copy() for k, v in ref.step(grads).items()})
    return got, want, jax.device_get(state), ref


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("fused", [True, False])
def test_matches_numpy_reference_and_stage0(stage, fused):
    got, want, state, ref = run(stage, 4, steps=9, freeze_step=3, fused=fused)
    base, _, _, _ = run(0, 4, steps=9, freeze_step=3, fused=fused)
    for t in range(9):
        for k in want[t]:
            np.testing.assert_allclose(got[t][k], want[t][k], rtol=2e-5, atol=2e-6, err_msg=f"step {t} leaf {k}")
            np.testing.assert_allclose(got[t][k], base[t][k], rtol=1e-5, atol=1e-6, err_msg=f"step {t} leaf {k}")
    assert isinstance(state, OneBitAdamZeroState) and state.stage == stage and int(state.count) == 9
    # The packed momentum decodes to the reference's synchronised momentum.
    keys = sorted(want[0])
    from jonebit.comm import decode_rows

    if fused:
        m = np.asarray(decode_rows(state.m_rows[0]))[: sum(ref.m[k].size for k in keys)]
        np.testing.assert_allclose(m, np.concatenate([ref.m[k].ravel() for k in keys]), rtol=1e-5, atol=1e-7)
    else:
        for i, k in enumerate(keys):
            m = np.asarray(decode_rows(state.m_rows[i]))[: ref.m[k].size]
            np.testing.assert_allclose(m, ref.m[k].ravel(), rtol=1e-5, atol=1e-7)
    # Worker errors are whole per rank; the variance is partitioned into the server chunks. Every buffer is
    # compared: the single fused one, or one per leaf (in sorted key order).
    groups = [(None, keys)] if fused else [(k, [k]) for k in keys]
    assert len(state.worker_error) == len(state.server_error) == len(state.nu) == len(groups)
    for i, (g, members) in enumerate(groups):
        np.testing.assert_allclose(np.asarray(state.worker_error[i]), np.stack(ref.we[g]), rtol=1e-4, atol=1e-5,
                                   err_msg=f"worker error of {members}")
        # Server errors: rank r holds chunk r of its buffer, like the reference's list over ranks.
        np.testing.assert_allclose(np.asarray(state.server_error[i]), np.stack(ref.se[g]), rtol=1e-4, atol=1e-5,
                                   err_msg=f"server error of {members}")
        v_ref = np.concatenate([ref.v[k].ravel() for k in members])
        v_chunks = np.asarray(state.nu[i]).reshape(-1)
        np.testing.assert_allclose(v_chunks[: v_ref.size], v_ref, rtol=1e-5, atol=1e-9, err_msg=f"v of {members}")
        assert not np.any(v_chunks[v_ref.size:])  # padding
        if stage != 3:
            np.testing.assert_allclose(np.asarray(state.nu_full[i])[: v_ref.size], v_ref, rtol=1e-5, atol=1e-9,
                                       err_msg=f"v of {members}")
    if stage == 3:
        assert state.nu_full == ()


def test_shapes_per_device_follow_the_chunks():
    p = 8
    params = make_params(np.random.default_rng(0))
    n = sum(v.size for v in params.values())
    n_pad = np_padded(n, p)
    for stage in (1, 3):
        tx = onebit_adam_zero(LR, freeze_step=2, stage=stage, fused=True)
        state, specs = sharded_init(tx, params, mesh_of(p))
        assert state.mu[0].shape == (p, n_pad // p) and specs.mu[0] == P("data")
        assert state.nu[0].shape == (p, n_pad // p) and specs.nu[0] == P("data")
        assert state.m_rows[0].shape == (p, n_pad // p // 8 + 4) and state.m_rows[0].dtype == np.uint8
        assert specs.m_rows[0] == P()
        assert state.worker_error[0].shape == (p, n_pad) and state.server_error[0].shape == (p, n_pad // p)
        shard = state.mu[0].addressable_shards[0].data
        assert shard.shape == (1, n_pad // p)
        assert (state.nu_full == ()) == (stage == 3)
        assert state_specs(state) == specs


def test_mask_keeps_masked_momentum_zero():
    rng = np.random.default_rng(1)
    params0 = make_params(rng)
    mask = {k: np.ones_like(v) for k, v in params0.items()}
    mask["w"][3:] = 0.0
    got, want, state, ref = run(3, 4, steps=6, freeze_step=2, fused=False, mask=mask)
    for k in want[-1]:
        np.testing.assert_allclose(got[-1][k], want[-1][k], rtol=2e-5, atol=2e-6)
    assert np.all(ref.m["w"][3:] == 0)
    keys = sorted(params0)
    from jonebit.comm import decode_rows

    i = keys.index("w")
    m = np.asarray(decode_rows(state.m_rows[i]))[:35] * mask["w"].ravel()
    assert np.all(m.reshape(5, 7)[3:] == 0)
    assert np.all(np.asarray(state.mu[i]).reshape(-1)[:35].reshape(5, 7)[3:] == 0)


def test_errors():
    params = make_params(np.random.default_rng(0))
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        onebit_adam_zero(LR, freeze_step=2, stage=4)
    with pytest.raises(ValueError, match="use jonebit.onebit_adam on a single device"):
        sharded_init(onebit_adam_zero(LR, freeze_step=2, stage=2), params, mesh_of(1))
    mixed = {"a": np.zeros(16, np.float32), "b": np.zeros(16, np.float16)}
    with pytest.raises(TypeError, match="fused=False"):
        sharded_init(onebit_adam_zero(LR, freeze_step=2, stage=3, fused=True), mixed, mesh_of(2))
    assert jonebit.onebit_adam_zero(LR, freeze_step=2, stage=3, fused=False) is not None
