"""Bad arguments to onebit_adam (its ZeRO variant, its experimental options and the non-finite wrapper) fail early
with a message naming the argument (or leaf), and sparse masks work."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jonebit import onebit_adam, onebit_adam_zero, sharded_init, skip_nonfinite, state_specs
from jonebit.experimental import OneBitAdamOptions
from jonebit.transforms.onebit_adam_zero import FlatLayout


def tx_of(learning_rate, *, freeze_step, stage=0, **kw):
    """onebit_adam at stage 0, its ZeRO variant at stages 1-3."""
    if stage:
        return onebit_adam_zero(learning_rate, freeze_step=freeze_step, stage=stage, **kw)
    return onebit_adam(learning_rate, freeze_step=freeze_step, **kw)


def mesh_of(p):
    return jax.make_mesh((p,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:p])


def params0():
    rng = np.random.default_rng(0)
    return {"b": rng.standard_normal(13).astype(np.float32), "w": rng.standard_normal((5, 7)).astype(np.float32)}


# Bad argument -> (exception, fragment of its message).
CONSTRUCTION = [
    (dict(learning_rate=-1e-3), ValueError, r"learning_rate must be >= 0, got -0.001"),
    (dict(learning_rate=float("nan")), ValueError, r"learning_rate must be a finite number, got nan"),
    (dict(learning_rate=float("inf")), ValueError, r"learning_rate must be a finite number, got inf"),
    (dict(learning_rate="1e-3"), TypeError, r"learning_rate must be a number or a schedule .*got str '1e-3'"),
    (dict(learning_rate=None), TypeError, r"learning_rate must be a number or a schedule .*got NoneType"),
    (dict(learning_rate=True), TypeError, r"learning_rate must be a number or a schedule"),
    (dict(weight_decay=-0.1), ValueError, r"weight_decay must be >= 0, got -0.1"),
    (dict(weight_decay=float("nan")), ValueError, r"weight_decay must be a finite number"),
    (dict(weight_decay="0.01"), TypeError, r"weight_decay must be a number, got str"),
    (dict(b1=1.0), ValueError, r"b1 must be >= 0 and < 1, got 1.0"),
    (dict(b2=float("nan")), ValueError, r"b2 must be a finite number"),
    (dict(b1="0.9"), TypeError, r"b1 must be a number"),
    (dict(eps=0.0), ValueError, r"eps must be > 0, got 0.0"),
    (dict(eps=float("nan")), ValueError, r"eps must be a finite number"),
    (dict(fused="yes"), TypeError, r"fused must be True or False, got str 'yes'"),
    (dict(fused=None), TypeError, r"fused must be True or False, got NoneType"),
    (dict(bias_correction=1), TypeError, r"bias_correction must be True or False, got int 1"),
    (dict(mask_unseen=0), TypeError, r"mask_unseen must be True or False, got int 0"),
    (dict(freeze_step="later"), ValueError, r"freeze_step must be an int, \"auto\" or a jonebit.AutoFreeze"),
    (dict(experimental={"row_scales": True}), TypeError, r"experimental must be a jonebit.experimental.OneBit"),
    (dict(experimental=OneBitAdamOptions(row_scales=True), fused=True), ValueError,
     r"row_scales=True\) .* not available with fused=True"),
    (dict(experimental=OneBitAdamOptions(row_scales=True), axis_name=("hosts", "local")), ValueError,
     r"row_scales=True\) .* not available with hierarchical compression"),
    (dict(axis_name=0), TypeError, r"axis_name must be a mesh axis name \(str\), got 0"),
    (dict(exp_avg_mask={"b": None, "w": np.full((5, 7), 0.5)}), ValueError,
     r"exp_avg_mask leaf \['w'\] must hold only 0 and 1 .*got 0.5"),
    (dict(exp_avg_mask={"b": np.full(13, np.nan), "w": None}), ValueError,
     r"exp_avg_mask leaf \['b'\] must hold only 0 and 1 .*got nan"),
    (dict(exp_avg_mask={"b": np.array(["1"] * 13), "w": None}), TypeError,
     r"exp_avg_mask leaf \['b'\] must hold 0/1 values, got dtype <U1"),
]


@pytest.mark.parametrize("kwargs,err,match", CONSTRUCTION, ids=lambda x: None)
def test_bad_arguments_fail_at_construction(kwargs, err, match):
    kwargs = {"learning_rate": 1e-3, "freeze_step": 2, **kwargs}
    with pytest.raises(err, match=match):
        onebit_adam(**kwargs)


OPTIONS = [
    (dict(error_feedback="no"), TypeError, r"error_feedback must be True or False, got str 'no'"),
    (dict(row_scales="rows"), TypeError, r"row_scales must be True or False, got str 'rows'"),
    (dict(preconditioned=None), TypeError, r"preconditioned must be True or False, got NoneType"),
    (dict(clip_ratio=0.0), ValueError, r"clip_ratio must be a finite number > 0 or None, got 0.0"),
    (dict(clip_ratio="adam"), ValueError, r"clip_ratio must be a finite number > 0 or None, got 'adam'"),
    (dict(local_clip="yes"), TypeError, r"local_clip must be True or False, got str 'yes'"),
    (dict(variance_refresh=0), ValueError, r"variance_refresh must be >= 1 \(refresh the variance every K"),
    (dict(variance_refresh=2.5), TypeError, r"variance_refresh must be a whole number of updates"),
    (dict(variance_refresh=True), TypeError, r"variance_refresh must be a whole number of updates"),
    (dict(error_feedback=1.5), TypeError, r"error_feedback must be True or False, got float 1.5"),
]


@pytest.mark.parametrize("kwargs,err,match", OPTIONS, ids=lambda x: None)
def test_bad_experimental_options(kwargs, err, match):
    with pytest.raises(err, match="OneBitAdamOptions: " + match):
        OneBitAdamOptions(**kwargs)


ZERO = [
    (dict(stage=0), ValueError, r"stage must be 1, 2 or 3, got 0 \(stage 0 is jonebit.onebit_adam\)"),
    (dict(stage=4), ValueError, r"stage must be 1, 2 or 3, got 4"),
    (dict(stage=2.0), TypeError, r"stage must be a Python int"),
    (dict(stage=2, freeze_step="auto"), ValueError, r"freeze_step must be an int >= 1, got 'auto'"),
    (dict(stage=2, axis_name=("hosts", "local")), TypeError, r"axis_name must be the data axis of a shard_map mesh"),
    (dict(stage=1, eps=0.0), ValueError, r"eps must be > 0, got 0.0"),
    (dict(stage=3, fused="yes"), TypeError, r"fused must be True or False"),
]


@pytest.mark.parametrize("kwargs,err,match", ZERO, ids=lambda x: None)
def test_bad_zero_arguments(kwargs, err, match):
    kwargs = {"learning_rate": 1e-3, "freeze_step": 2, **kwargs}
    with pytest.raises(err, match="onebit_adam_zero: " + match):
        onebit_adam_zero(**kwargs)


def test_bad_skip_nonfinite_arguments():
    with pytest.raises(TypeError, match="skip_nonfinite: expected an optax.GradientTransformation, got function"):
        skip_nonfinite(onebit_adam)
    with pytest.raises(TypeError, match="skip_nonfinite: raise_error must be True or False, got 'yes'"):
        skip_nonfinite(onebit_adam(1e-3, freeze_step=2), raise_error="yes")


def test_good_arguments_still_accepted():
    onebit_adam(optax.linear_schedule(1e-3, 0.0, 100), freeze_step=2)  # schedules
    onebit_adam(jnp.float32(1e-3), freeze_step=2, weight_decay=np.float32(0.1), b1=np.float64(0.8))
    onebit_adam(0.0, freeze_step=2, fused=np.bool_(False))
    onebit_adam(1e-3, freeze_step="auto", experimental=OneBitAdamOptions(clip_ratio=7, variance_refresh=np.int64(4)))


# Problems that need the params: (params, tx kwargs, exception, fragment).
ZERO_SIZE = {"b": np.ones(13, np.float32), "e": np.ones((0, 3), np.float32)}
INIT = [
    (ZERO_SIZE, dict(fused=True), ValueError, r"param leaf \['e'\] has shape \(0, 3\), i.e. no elements"),
    (ZERO_SIZE, dict(fused=False), ValueError, r"param leaf \['e'\] has shape \(0, 3\)"),
    (ZERO_SIZE, dict(stage=2), ValueError, r"param leaf \['e'\] has shape \(0, 3\)"),
    (params0(), dict(exp_avg_mask={"b": None, "w": np.ones(7)}), ValueError,
     r"exp_avg_mask leaf \['w'\] has shape \(7,\), the param has \(5, 7\).*\(n, 1\)"),
    (params0(), dict(exp_avg_mask={"b": None, "w": np.ones((5, 2))}), ValueError,
     r"exp_avg_mask leaf \['w'\] has shape \(5, 2\)"),
    (params0(), dict(exp_avg_mask={"b": None}), ValueError, r"exp_avg_mask must have the same tree structure"),
    (params0(), dict(exp_avg_mask={"b": None, "w": {"x": np.ones((5, 7))}}), ValueError,
     r"at leaf \['w'\] it holds a dict subtree"),
    (params0(), dict(exp_avg_mask={"b": None, "w": np.ones((5, 7)), "z": None}), ValueError,
     r"exp_avg_mask must have the same tree structure"),
]


@pytest.mark.parametrize("params,kwargs,err,match", INIT, ids=lambda x: None)
def test_bad_params_or_masks_fail_at_init(params, kwargs, err, match):
    with pytest.raises(err, match=match):
        sharded_init(tx_of(1e-3, freeze_step=2, **kwargs), params, mesh_of(2))


def trace_update(tx, params, grads, stage=0):
    """Traces one update in the per-device view (no compile): argument errors surface here."""
    mesh = mesh_of(2)
    state, specs = sharded_init(tx, params0(), mesh)
    pspec = P("data") if stage == 3 else P()

    @jax.shard_map(mesh=mesh, in_specs=(pspec, specs, P()), out_specs=(pspec, specs), check_vma=False)
    def step(params, state, grads):
        return tx.update(grads, state, params)

    return jax.eval_shape(step, params, state, grads)


WRONG_GRADS = [
    ({"b": np.ones(13, np.float32)}, r"\['w'\] is missing from the gradients"),
    ({"b": np.ones(13, np.float32), "w": np.ones((5, 6), np.float32)},
     r"\['w'\] has shape \(5, 6\) in the gradients, \(5, 7\) here"),
    ({"b": np.ones(13, np.float32), "w": np.ones((5, 7), np.float32), "x": np.ones(2, np.float32)},
     r"\['x'\] is only in the gradients"),
]


@pytest.mark.parametrize("grads,match", WRONG_GRADS, ids=lambda x: None)
@pytest.mark.parametrize("fused", [True, False])
def test_gradients_that_do_not_match_the_state(grads, match, fused):
    tx = onebit_adam(1e-3, freeze_step=2, fused=fused)
    with pytest.raises(ValueError, match=r"the gradients do not match the optimizer state .*" + match):
        trace_update(tx, params0(), grads)


@pytest.mark.parametrize("grads,match", WRONG_GRADS, ids=lambda x: None)
def test_gradients_that_do_not_match_the_params_zero(grads, match):
    tx = onebit_adam_zero(1e-3, freeze_step=2, stage=2)
    with pytest.raises(ValueError, match=r"the gradients do not match the params: .*" + match):
        trace_update(tx, params0(), grads, stage=2)


def test_gradients_that_do_not_match_the_state_zero3():
    tx = onebit_adam_zero(1e-3, freeze_step=2, stage=3, fused=False)
    chunks = jax.device_put(FlatLayout.of(params0(), 2, False).to_chunks(params0()),
                            NamedSharding(mesh_of(2), P("data")))
    grads = {"b": np.ones(13, np.float32), "w": np.ones((5, 6), np.float32)}
    with pytest.raises(ValueError, match=r"chunks \(\(1, 8\), \(1, 16\)\), the state \(\(1, 8\), \(1, 24\)\)"):
        trace_update(tx, chunks, grads, stage=3)


def test_state_specs_refuses_what_is_not_a_state():
    tx = onebit_adam(1e-3, freeze_step=2)
    with pytest.raises(TypeError, match="got an optax.GradientTransformation; pass its state"):
        state_specs(tx)
    with pytest.raises(TypeError, match="found a leaf of type str"):
        state_specs({"lr": "1e-3"})
    with pytest.raises(TypeError, match=r"axis_name must be a mesh axis name \(str\), got 0"):
        state_specs({"w": jnp.ones(3)}, 0)
    # Plain optax states are still fine: everything replicated.
    assert state_specs(optax.adam(1e-3).init({"w": jnp.ones(3)}))[0].mu == {"w": P()}


# --- sparse masks ---------------------------------------------------------------------------------------------------


def run_masked(mask, stage, fused, steps=5, freeze_step=2, p=4):
    mesh = mesh_of(p)
    tx = tx_of(1e-2, freeze_step=freeze_step, weight_decay=0.01, fused=fused, stage=stage, exp_avg_mask=mask)
    state, specs = sharded_init(tx, params0(), mesh)
    layout = FlatLayout.of(params0(), p, fused)
    pspec = P("data") if stage == 3 else P()
    params = jax.device_put(layout.to_chunks(params0()) if stage == 3 else params0(), NamedSharding(mesh, pspec))

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(pspec, specs, P("data")), out_specs=(pspec, specs))
    def step(params, state, grads):
        updates, state = tx.update(jax.tree.map(lambda g: g[0], grads), state, params)
        return optax.apply_updates(params, updates), state

    rng = np.random.default_rng(5)
    for _ in range(steps):
        g = {k: rng.standard_normal((p,) + v.shape).astype(np.float32) for k, v in params0().items()}
        params, state = step(params, state, jax.device_put(g, NamedSharding(mesh, P("data"))))
    return jax.device_get((params, state))


@pytest.mark.parametrize("stage,fused", [(0, True), (0, False), (2, True), (3, False)])
def test_sparse_masks_equal_dense_masks(stage, fused):
    """None leaves, bool values and (rows, 1) row masks give bitwise the result of the dense float32 mask."""
    rows = np.array([1, 0, 1, 1, 0], bool)
    dense = {"b": np.ones(13, np.float32), "w": np.broadcast_to(rows[:, None], (5, 7)).astype(np.float32)}
    sparse = {"b": None, "w": rows[:, None]}
    got, want = run_masked(sparse, stage, fused), run_masked(dense, stage, fused)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    if stage == 0:  # the masked rows' momentum is exactly zero, the others are not
        mu = np.asarray(got[1].mu["w"])
        assert np.all(mu[~rows] == 0) and np.all(mu[rows] != 0)


def test_all_ones_mask_equals_no_mask():
    ones = {"b": np.ones(13, np.float32), "w": np.ones((5, 7), np.float32)}
    got, want = run_masked(ones, 0, True), run_masked(None, 0, True)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
