"""1-bit Adam with ``freeze_step="auto"``: the freeze point decided inside the step by :class:`jonebit.AutoFreeze`."""

import logging

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jonebit
from jonebit import onebit_adam, sharded_init
from jonebit.experimental import OneBitAdamOptions
from jonebit.train import checkpoint
from tests.reference import NumpyOneBitAdamAuto
from tests.transforms.test_onebit_adam import make_params, mesh_of, stepper
from tests.transforms.test_onebit_hierarchical import AXES
from tests.transforms.test_onebit_hierarchical import mesh_of as hier_mesh
from tests.transforms.test_onebit_hierarchical import stepper as hier_stepper

# Fires on the rule itself (between min_step and max_step) on these random gradients: b2 = 0.9 lets ||v|| settle
# within a few checks.
RULE = dict(min_step=6, max_step=60, check_every=3, threshold=0.2, patience=2)
B2 = 0.9


def sched(count):
    return 1e-2 * (1.0 - 0.02 * count)


def gradients(rng, params0, p, steps):
    return [[{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params0.items()} for _ in range(p)]
            for _ in range(steps)]


def run_auto(p, *, rule=RULE, fused=False, steps=30, seed=0, bias_correction=True, refresh=None):
    """jonebit's auto 1-bit Adam and the numpy reference on the same per-rank gradients; per-step params."""
    rng = np.random.default_rng(seed)
    params0 = make_params(rng)
    mesh = mesh_of(p)
    tx = onebit_adam(sched, freeze_step=jonebit.AutoFreeze(**rule), b2=B2, weight_decay=0.01,
                     fused=fused, bias_correction=bias_correction,
                     experimental=OneBitAdamOptions(variance_refresh=refresh))
    state, specs = sharded_init(tx, params0, mesh)
    step, put = stepper(tx, mesh, specs)
    params = jax.device_put(params0, jax.NamedSharding(mesh, P()))
    ref = NumpyOneBitAdamAuto(params0, p, rule=rule, lr=None, schedule=lambda c: float(sched(c)), b2=B2, wd=0.01,
                              fused=fused, bias_correction=bias_correction)
    grads = gradients(rng, params0, p, steps)
    trace = []
    for g in grads:
        params, state = step(params, state, put({k: np.stack([x[k] for x in g]) for k in params0}))
        want = ref.step(g)
        trace.append(({k: np.asarray(v) for k, v in params.items()}, {k: v.copy() for k, v in want.items()},
                      int(state.freeze_at)))
    return params0, grads, params, state, ref, trace


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("p", [1, 2, 4])
def test_auto_switch_and_trajectory_match_numpy_reference(p, fused, caplog):
    with caplog.at_level(logging.INFO, logger="jonebit.transforms"):
        *_, state, ref, trace = run_auto(p, fused=fused)
    want = ref.decided
    assert want is not None and RULE["min_step"] < want < 20, want  # the rule itself fired, mid-run
    assert int(state.freeze_at) == want
    assert caplog.text.count("compression starts after update") == 1 and f"after update {want}" in caplog.text
    for t, (got, expect, freeze_at) in enumerate(trace):
        assert freeze_at == (want if t + 1 >= want else RULE["max_step"]), t
        for k in expect:
            np.testing.assert_allclose(got[k], expect[k], rtol=3e-5, atol=3e-6, err_msg=f"update {t} leaf {k}")
    np.testing.assert_allclose(np.asarray(state.nu["w"]), ref.v["w"], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("fused,refresh", [(True, None), (False, None), (False, 3)])
def test_auto_equals_the_fixed_freeze_step_it_decided(fused, refresh):
    """Bit for bit: from the decided point on it is 1-bit Adam with that int freeze_step (bias correction included;
    with variance_refresh the refreshes count from the decided point)."""
    p = 4
    params0, grads, params, state, ref, _ = run_auto(p, fused=fused, steps=24, refresh=refresh)
    want = int(state.freeze_at)
    assert want < 24 - 3  # the compression stage (and with refresh=3, refreshes) ran
    mesh = mesh_of(p)
    tx = onebit_adam(sched, freeze_step=want, b2=B2, weight_decay=0.01, fused=fused,
                     experimental=OneBitAdamOptions(variance_refresh=refresh))
    fixed_state, specs = sharded_init(tx, params0, mesh)
    step, put = stepper(tx, mesh, specs)
    fixed = jax.device_put(params0, jax.NamedSharding(mesh, P()))
    for g in grads:
        fixed, fixed_state = step(fixed, fixed_state, put({k: np.stack([x[k] for x in g]) for k in params0}))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), jax.device_get(fixed))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.worker_error),
                 jax.device_get(fixed_state.worker_error))


def test_cap_and_minimum():
    never_calm = dict(RULE, threshold=1e-9, max_step=10)
    *_, state, ref, trace = run_auto(2, rule=never_calm, steps=14)
    assert int(state.freeze_at) == 10 == ref.decided  # the hard cap
    always_calm = dict(RULE, threshold=10.0, min_step=15)
    *_, state, ref, trace = run_auto(2, rule=always_calm, steps=20)
    assert int(state.freeze_at) == 15 == ref.decided  # calm from the second check, but not before min_step
    assert [f for *_, f in trace][:14] == [RULE["max_step"]] * 14


def test_decision_identical_on_every_device():
    p = 4
    rng = np.random.default_rng(0)
    params0 = make_params(rng)
    mesh = mesh_of(p)
    tx = onebit_adam(1e-2, freeze_step=jonebit.AutoFreeze(**RULE), b2=B2)
    state, specs = sharded_init(tx, params0, mesh)

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs, P("data")))
    def step(params, state, grads):
        updates, state = tx.update(jax.tree.map(lambda g: g[0], grads), state, params)
        # Each device's own copy of the decision, one row per device.
        mine = jax.lax.pcast(state.freeze_at, "data", to="varying")[None]
        return optax.apply_updates(params, updates), state, mine

    params = jax.device_put(params0, jax.NamedSharding(mesh, P()))
    put = lambda t: jax.device_put(t, jax.NamedSharding(mesh, P("data")))  # noqa: E731
    seen = []
    for g in gradients(rng, params0, p, 24):
        params, state, rows = step(params, state, put({k: np.stack([x[k] for x in g]) for k in params0}))
        rows = np.asarray(rows)
        assert np.all(rows == rows[0])
        seen.append(int(rows[0]))
    assert RULE["min_step"] < seen[-1] < RULE["max_step"]


@pytest.mark.parametrize("fused", [True, False])
def test_hierarchical_axes_decide_once_and_log_once(fused, caplog):
    """On a hosts x local mesh: the same decision as the flat reference (warmup is the same mean), logged on one
    device only, and afterwards bit-identical to hierarchical 1-bit Adam with that int freeze_step."""
    hosts, local = 2, 2
    rng = np.random.default_rng(0)
    params0 = make_params(rng)
    mesh = hier_mesh(hosts, local)
    grads = gradients(rng, params0, hosts * local, 24)
    ref = NumpyOneBitAdamAuto(params0, hosts * local, rule=RULE, lr=1e-2, b2=B2, fused=fused, bias_correction=True)
    for g in grads:
        ref.step(g)

    def train(**kw):
        tx = onebit_adam(1e-2, b2=B2, fused=fused, axis_name=AXES, **kw)
        state, specs = sharded_init(tx, params0, mesh, AXES)
        step, put = hier_stepper(tx, mesh, specs)
        params = jax.device_put(params0, jax.NamedSharding(mesh, P()))
        for g in grads:
            params, state = step(params, state, put({k: np.stack([x[k] for x in g]) for k in params0}))
        return jax.device_get(params), state

    with caplog.at_level(logging.INFO, logger="jonebit.transforms"):
        auto, state = train(freeze_step=jonebit.AutoFreeze(**RULE))
    assert int(state.freeze_at) == ref.decided and RULE["min_step"] < ref.decided < 20
    assert caplog.text.count("compression starts after update") == 1  # not once per device
    fixed, _ = train(freeze_step=ref.decided)
    jax.tree.map(np.testing.assert_array_equal, auto, fixed)


def test_checkpoint_mid_warmup_resumes_the_decision(tmp_path):
    """Saved before the rule fires (calm checks under way), restored and continued: the same decision and the same
    final state as an uninterrupted run, bit for bit."""
    p = 4
    rng = np.random.default_rng(0)
    params0 = make_params(rng)
    mesh = mesh_of(p)
    tx = onebit_adam(sched, freeze_step=jonebit.AutoFreeze(**RULE), b2=B2, weight_decay=0.01)
    state0, specs = sharded_init(tx, params0, mesh)
    step, put = stepper(tx, mesh, specs)
    grads = [put({k: np.stack([x[k] for x in g]) for k in params0}) for g in gradients(rng, params0, p, 24)]

    def train(params, state, gs):
        for g in gs:
            params, state = step(params, state, g)
        return params, state

    start = jax.device_put(params0, jax.NamedSharding(mesh, P()))
    cont = train(start, state0, grads)
    decided = int(cont[1].freeze_at)
    cut = decided - 2  # mid-warmup, after at least one calm check
    params, state = train(start, state0, grads[:cut])
    assert int(state.freeze_at) == RULE["max_step"] and int(state.calm_checks) >= 1
    checkpoint.save(tmp_path / "ckpt", {"params": params, "opt_state": state}, step=cut)
    restored, at = checkpoint.restore(tmp_path / "ckpt", {"params": params, "opt_state": state})
    assert at == cut
    resumed = train(restored["params"], restored["opt_state"], grads[cut:])
    assert int(resumed[1].freeze_at) == decided
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed), jax.device_get(cont))


@pytest.mark.parametrize("statistic", jonebit.transforms.base.AUTO_STATISTICS)
def test_each_statistic_decides_as_the_reference(statistic):
    rule = dict(RULE, statistic=statistic)
    *_, state, ref, trace = run_auto(2, rule=rule, steps=24)
    assert ref.decided is not None and RULE["min_step"] < ref.decided < RULE["max_step"], ref.decided
    assert int(state.freeze_at) == ref.decided


def test_rule_reads_the_bias_corrected_variance():
    """A constant gradient: v = (1 - b2^t) g^2, so the raw ||v|| keeps growing for ~1/(1 - b2) updates while the
    corrected one is constant from the first update. The rule must fire at its first chance: the first check only
    records, then ``patience`` calm checks (a rule on the raw ||v|| would wait hundreds of updates here)."""
    p, b2 = 2, 0.999
    rule = dict(min_step=1, max_step=500, check_every=4, threshold=0.01, patience=2)
    rng = np.random.default_rng(1)
    params0 = make_params(rng)
    g = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params0.items()}
    mesh = mesh_of(p)
    tx = onebit_adam(1e-3, freeze_step=jonebit.AutoFreeze(**rule), b2=b2)
    state, specs = sharded_init(tx, params0, mesh)
    step, put = stepper(tx, mesh, specs)
    params = jax.device_put(params0, jax.NamedSharding(mesh, P()))
    for _ in range(16):
        params, state = step(params, state, put({k: np.stack([v] * p) for k, v in g.items()}))
    assert int(state.freeze_at) == rule["check_every"] * (rule["patience"] + 1) == 12
    # The raw norms of the same run would not have been calm: their change per check is about check_every / t.
    raw = [{k: float(np.sqrt(np.sum(v.astype(np.float64) ** 4))) * (1 - b2 ** t) for k, v in g.items()}
           for t in range(1, 17)]
    from tests.reference_family import np_auto_freeze

    assert np_auto_freeze(raw, b2=b2, **rule) == 12
    assert np_auto_freeze(raw, b2=0.0, **rule) is None  # b2=0 in the correction: the raw norms, never calm


def test_int_freeze_step_state_is_unchanged():
    """With an int freeze_step the state holds no auto fields: count, the two moments and the two error buffers
    (2 leaves each), the phase of the last update and of the next."""
    params0 = make_params(np.random.default_rng(0))
    state, _ = sharded_init(onebit_adam(1e-2, freeze_step=3), params0, mesh_of(2))
    assert state.freeze_at is None and state.variance_norms is None and state.calm_checks is None
    assert len(jax.tree.leaves(state)) == 1 + 2 + 2 + 2 + 2 + 1 + 1


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        (dict(freeze_step="never"), ValueError, r"freeze_step must be an int, \"auto\" or a jonebit.AutoFreeze, got"),
        (dict(freeze_step=jonebit.AutoFreeze(min_step=50, max_step=10)), ValueError,
         r"auto_freeze.max_step \(10\) must be >= min_step \(50\)"),
        (dict(freeze_step=jonebit.AutoFreeze(threshold=0.0)), ValueError,
         r"auto_freeze.threshold must be"),
        (dict(freeze_step={"min_step": 3}), TypeError, r"freeze_step must be an int, \"auto\" or a jonebit.AutoFreeze"),
        (dict(freeze_step=jonebit.AutoFreeze(statistic="mean")), ValueError,
         r"auto_freeze.statistic must be one of median, max, global, got 'mean'"),
    ],
)
def test_bad_auto_arguments(kwargs, err, match):
    with pytest.raises(err, match=match):
        onebit_adam(1e-3, **kwargs)


@pytest.mark.mpi
@pytest.mark.multiprocess
def test_mpi_decides_like_shard_map_and_logs_on_rank_zero(tmp_path):
    """mpi_comm with "auto" under mpirun -np 2: the same decision and parameters as the shard_map run (bitwise: two
    ranks sum in the same order), identical on both ranks, logged by rank 0 only."""
    from tests.mpi_util import run_mpi

    world, steps = 2, 24
    out = run_mpi(world, __file__.replace("test_onebit_adam_auto.py", "mpi_adam_auto_worker.py"), tmp_path, steps,
                  "perleaf", timeout=240)
    *_, params, state, ref, _ = run_auto(world, fused=False, steps=steps)
    assert out.count("compression starts after update") == 1 and "rank0 freeze_step='auto'" in out
    for r in range(world):
        got = np.load(tmp_path / f"rank{r}.npz")
        assert int(got["freeze_at"]) == int(state.freeze_at) == ref.decided
        for k, v in params.items():
            np.testing.assert_array_equal(got[f"params/{k}"], np.asarray(v), err_msg=f"rank {r} {k}")
