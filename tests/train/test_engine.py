"""jonebit.train.engine on 8 simulated CPU devices.

* accumulation over k micro-batches equals one step over the k-times larger batch (Adam with an averaged
  gradient, and 1-bit Adam with local gradients), and Adam's result equals an independent single-device optax
  reference;
* fp16 dynamic loss scaling follows a plain-Python transcription of DeepSpeed's rules step by step, with forced
  overflows; every skipped step leaves params and optimizer state bit-identical;
* a NaN on one rank skips the step on all ranks, in 1-bit Adam's warmup and compression stage, and the run then
  continues exactly as a run that never saw the bad batch;
* bf16 compute keeps float32 master weights and tracks the float32 run;
* bad arguments get clear errors (a table).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jonebit
from jonebit.sharding.mesh import data_mesh
from jonebit.train.engine import LossScaling, TrainState, init_train_state, make_train_step

N = 8
DIM, HID = 6, 8


def _params(seed=0):
    r = np.random.default_rng(seed)
    return {
        "w1": jnp.asarray(r.normal(size=(DIM, HID)) * 0.5, jnp.float32),
        "b1": jnp.zeros((HID,), jnp.float32),
        "w2": jnp.asarray(r.normal(size=(HID, 1)) * 0.5, jnp.float32),
    }


def loss_fn(p, batch):
    x = batch["x"].astype(p["w1"].dtype)
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    pred = (h @ p["w2"])[:, 0]
    return jnp.mean((pred.astype(jnp.float32) - batch["y"]) ** 2)


def _batch(n, seed):
    r = np.random.default_rng(1000 + seed)
    x = r.normal(size=(n, DIM)).astype(np.float32)
    y = (np.sin(x.sum(1)) + 0.1 * r.normal(size=n)).astype(np.float32)
    return {"x": x, "y": y}


def _leaves_equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                                                                              strict=True))


def _run(tx, batches, *, k=1, grad_reduce="mean", **kw):
    mesh = data_mesh()
    state, specs = init_train_state(tx, _params(), mesh, loss_scaling=kw.get("loss_scaling"))
    step = make_train_step(loss_fn, tx, mesh, specs, accumulation_steps=k, grad_reduce=grad_reduce, **kw)
    out = []
    for b in batches:
        state, m = step(state, b)
        out.append(jax.device_get(m))
    return state, out


def test_accumulation_equals_big_batch_and_single_device_reference():
    tx = optax.adam(1e-2)
    batches = [_batch(N * 2 * 4, s) for s in range(4)]
    s1, m1 = _run(tx, batches, k=1)
    s4, m4 = _run(tx, batches, k=4)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s4.params), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-6)
    np.testing.assert_allclose([m["loss"] for m in m1], [m["loss"] for m in m4], rtol=1e-5)

    # Independent reference: plain optax on one device, whole batch.
    p, st = _params(), tx.init(_params())
    for b in batches:
        g = jax.grad(loss_fn)(p, jax.tree.map(jnp.asarray, b))
        u, st = tx.update(g, st, p)
        p = optax.apply_updates(p, u)
    for a, b in zip(jax.tree.leaves(s4.params), jax.tree.leaves(p), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-6)
    assert all(not m["skipped"] for m in m4)


def test_accumulation_with_onebit_adam_local_gradients():
    tx = jonebit.onebit_adam(1e-2, freeze_step=2)
    batches = [_batch(N * 2 * 3, s) for s in range(5)]  # 2 warmup steps, 3 compressed
    s1, _ = _run(tx, batches, k=1, grad_reduce=None)
    s3, _ = _run(tx, batches, k=3, grad_reduce=None)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s3.params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert int(s3.opt_state.count) == 5


class DeepSpeedScaler:
    """DeepSpeed's DynamicLossScaler.update_scale, transcribed in plain Python (consecutive_hysteresis=False)."""

    def __init__(self, init_scale, window, hysteresis, min_scale):
        self.cur_scale, self.window, self.delayed_shift, self.min_scale = init_scale, window, hysteresis, min_scale
        self.cur_hysteresis, self.cur_iter, self.last_overflow_iter = hysteresis, 0, -1

    def update(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.window == 0:
            self.cur_hysteresis = self.delayed_shift
            self.cur_scale *= 2.0
        self.cur_iter += 1


def _poison(batch, rank):
    bad = {k: v.copy() for k, v in batch.items()}
    per = len(bad["x"]) // N
    bad["x"][rank * per] = np.inf
    return bad


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_fp16_dynamic_loss_scale_matches_deepspeed_rules(hysteresis):
    scaling = LossScaling(initial_scale_power=8, scale_window=3, hysteresis=hysteresis, min_scale=16.0)
    overflows = [0, 0, 0, 1, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 0]
    mesh = data_mesh()
    tx = optax.adam(1e-2)
    state, specs = init_train_state(tx, _params(), mesh, loss_scaling=scaling)
    step = make_train_step(loss_fn, tx, mesh, specs, compute_dtype=jnp.float16, loss_scaling=scaling,
                           grad_reduce="mean", donate=False)
    ref = DeepSpeedScaler(2.0**8, 3, hysteresis, 16.0)
    for i, bad in enumerate(overflows):
        b = _batch(N * 2, i)
        if bad:
            b = _poison(b, rank=i % N)
        before = state
        state, m = step(state, b)
        assert float(m["loss_scale"]) == ref.cur_scale, f"step {i}: scale used"
        assert bool(m["skipped"]) == bool(bad), f"step {i}"
        ref.update(bool(bad))
        assert float(state.loss_scale.scale) == ref.cur_scale, f"step {i}: scale after"
        assert int(state.loss_scale.hysteresis) == ref.cur_hysteresis, f"step {i}: hysteresis"
        if bad:
            assert _leaves_equal(before.params, state.params)
            assert _leaves_equal(before.opt_state, state.opt_state)
        else:
            assert not _leaves_equal(before.params, state.params)
    assert int(state.skipped) == sum(overflows)
    assert int(state.step) == len(overflows)
    assert state.params["w1"].dtype == jnp.float32


def test_static_loss_scale_is_constant_and_still_skips():
    scaling = LossScaling(dynamic=False, static_scale=128.0)
    _, ms = _run(optax.adam(1e-2), [_batch(16, 0), _poison(_batch(16, 1), 3), _batch(16, 2)],
                 compute_dtype=jnp.float16, loss_scaling=scaling)
    assert [float(m["loss_scale"]) for m in ms] == [128.0] * 3
    assert [bool(m["skipped"]) for m in ms] == [False, True, False]


@pytest.mark.parametrize("bad_at", [1, 4])  # warmup (count 1 < 3), compression (count 4 >= 3)
def test_nonfinite_on_one_rank_skips_everywhere_and_training_continues_exactly(bad_at):
    tx = optax.chain(jonebit.onebit_adam(1e-2, freeze_step=3, fused=True))
    good = [_batch(N * 2, s) for s in range(7)]
    mesh = data_mesh()

    def run(batches):
        state, specs = init_train_state(tx, _params(), mesh)
        step = make_train_step(loss_fn, tx, mesh, specs, grad_reduce=None, donate=False)
        states, ms = [], []
        for b in batches:
            states.append(state)
            state, m = step(state, b)
            ms.append(m)
        return state, states, ms

    with_bad = good[:bad_at] + [_poison(good[bad_at], rank=5)] + good[bad_at:]
    final, states, ms = run(with_bad)
    clean, _, _ = run(good)
    assert [bool(m["skipped"]) for m in ms] == [i == bad_at for i in range(len(with_bad))]
    # The bad step left everything (params, moments, error buffers, count) untouched ...
    after_bad = states[bad_at + 1]
    assert _leaves_equal(states[bad_at].params, after_bad.params)
    assert _leaves_equal(states[bad_at].opt_state, after_bad.opt_state)
    # ... and the run continued exactly as one that never saw it.
    assert _leaves_equal(final.params, clean.params)
    assert _leaves_equal(final.opt_state, clean.opt_state)
    assert int(final.skipped) == 1
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(final))


@pytest.mark.parametrize("grad_reduce", ["mean", None])
@pytest.mark.parametrize("bad", ["nan", "-inf", "huge"])
def test_overflow_flag_from_the_norm(bad, grad_reduce):
    """The skip decision is read from the reduced squared norm: a nan or an inf in one rank's gradient, and a
    finite gradient whose square overflows float32, skip the step on every rank; a large but representable
    gradient does not."""
    mesh = data_mesh()
    # local gradients are for the 1-bit optimizers (they communicate themselves)
    tx = optax.sgd(1e-3) if grad_reduce else jonebit.onebit_adam(1e-3, freeze_step=1)
    state, specs = init_train_state(tx, _params(), mesh)
    step = make_train_step(lambda p, b: loss_fn(p, b) * b["w"][0], tx, mesh, specs, grad_reduce=grad_reduce,
                           donate=False)
    b = dict(_batch(N * 2, 0), w=np.ones((N * 2,), np.float32))
    b["w"][6:8] = {"nan": np.nan, "-inf": -np.inf, "huge": 1e25}[bad]  # rank 3's rows (two per rank)
    new, m = step(state, b)
    assert bool(m["skipped"]) and int(new.skipped) == 1
    assert _leaves_equal(new.params, state.params)
    b["w"][6:8] = 1e6  # the norm grows by about 1e6 / 8 and stays finite: a real update
    new, m = step(state, b)
    assert not bool(m["skipped"]) and np.isfinite(float(m["grad_norm"])) and float(m["grad_norm"]) > 1e3
    assert not _leaves_equal(new.params, state.params)


def test_bf16_compute_keeps_fp32_master_and_tracks_fp32():
    batches = [_batch(N * 4, s) for s in range(6)]
    s32, m32 = _run(optax.adam(1e-2), batches)
    s16, m16 = _run(optax.adam(1e-2), batches, compute_dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(s16.params))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(s16.opt_state) if jnp.issubdtype(x.dtype, jnp.floating))
    l32, l16 = np.array([m["loss"] for m in m32]), np.array([m["loss"] for m in m16])
    np.testing.assert_allclose(l16, l32, rtol=0.05)
    assert not np.array_equal(l16, l32)  # it really computed in bf16
    assert l16[-1] < l16[0]


def test_aux_and_grad_norm_metrics():
    def with_aux(p, b):
        loss = loss_fn(p, b)
        return loss, {"twice": 2 * loss}

    mesh = data_mesh()
    tx = optax.sgd(0.0)
    state, specs = init_train_state(tx, _params(), mesh)
    step = make_train_step(with_aux, tx, mesh, specs, grad_reduce="mean", has_aux=True, accumulation_steps=2)
    b = _batch(N * 4, 0)
    _, m = step(state, b)
    full = jax.tree.map(jnp.asarray, b)
    np.testing.assert_allclose(m["loss"], loss_fn(_params(), full), rtol=1e-5)
    np.testing.assert_allclose(m["aux"]["twice"], 2 * m["loss"], rtol=1e-6)
    g = jax.grad(loss_fn)(_params(), full)
    np.testing.assert_allclose(m["grad_norm"], optax.global_norm(g), rtol=1e-5)


def test_caller_params_survive_donation():
    mesh = data_mesh()
    params = _params()
    tx = optax.adam(1e-2)
    state, specs = init_train_state(tx, params, mesh)
    step = make_train_step(loss_fn, tx, mesh, specs, grad_reduce="mean")
    for s in range(2):
        state, _ = step(state, _batch(16, s))
    assert _leaves_equal(params, _params())


def _bad_calls():
    mesh = data_mesh()
    tx = optax.adam(1e-2)
    state, specs = init_train_state(tx, _params(), mesh)
    build = lambda **kw: make_train_step(loss_fn, tx, mesh, specs, **kw)  # noqa: E731
    return [
        ("accumulation zero", lambda: build(accumulation_steps=0), ValueError,
         r"accumulation_steps must be an int >= 1, got 0"),
        ("accumulation str", lambda: build(accumulation_steps="2"), ValueError, r"accumulation_steps .* got '2'"),
        ("compute dtype", lambda: build(compute_dtype="int8"), ValueError,
         r"compute_dtype must be one of .* got 'int8'"),
        ("grad_reduce", lambda: build(grad_reduce="sum"), ValueError, r"grad_reduce must be one of .* got 'sum'"),
        ("axis", lambda: build(axis="model"), ValueError, r"not the data axis 'model'"),
        ("specs", lambda: make_train_step(loss_fn, tx, mesh, specs.opt_state), TypeError,
         r"specs must be the TrainState"),
        ("loss_scaling type", lambda: build(loss_scaling={"dynamic": True}), TypeError,
         r"loss_scaling must be a LossScaling"),
        ("batch not divisible", lambda: build(accumulation_steps=2)(state, _batch(24, 0)), ValueError,
         r"batch leaf \['x'\] has shape \(24, 6\).*multiple of ranks x accumulation_steps = 8 x 2 = 16"),
        ("batch scalar leaf", lambda: build()(state, {"x": 1.0, "y": np.zeros(8)}), ValueError,
         r"batch leaf \['x'\] has shape \(\)"),
        ("window", lambda: LossScaling(scale_window=0), ValueError, r"scale_window must be an int >= 1, got 0"),
        ("hysteresis", lambda: LossScaling(hysteresis=1.5), ValueError, r"hysteresis must be an int >= 1"),
        ("scale power", lambda: LossScaling(initial_scale_power=200), ValueError,
         r"initial_scale_power must be in \[0, 126\]"),
        ("min scale", lambda: LossScaling(min_scale=0), ValueError, r"min_scale must be a finite number > 0"),
        ("static nan", lambda: LossScaling(dynamic=False, static_scale=float("nan")), ValueError, r"static_scale"),
        ("dynamic str", lambda: LossScaling(dynamic="yes"), TypeError, r"LossScaling.dynamic must be a bool"),
        ("int params", lambda: init_train_state(tx, {"w": jnp.zeros(3, jnp.int32)}, mesh), TypeError,
         r"param \['w'\] has dtype int32"),
        ("mesh axis", lambda: init_train_state(tx, _params(), mesh, axis="dp"), ValueError, r"not the data axis 'dp'"),
        # mpi_comm (the engine under mpirun, tests/train/test_engine_mpi.py): refused before MPI is touched.
        ("mpi mean", lambda: build(grad_reduce="mean", mpi_comm=object()), ValueError,
         r"mpi_comm is for 1-bit optimizers .* got grad_reduce='mean'"),
        ("mpi mesh", lambda: build(mpi_comm=object()), ValueError,
         r"with mpi_comm each MPI process is one data-parallel rank and owns one device; the mesh has 8"),
    ]


@pytest.mark.parametrize("case", range(19))
def test_bad_inputs(case):
    name, call, exc, pattern = _bad_calls()[case]
    with pytest.raises(exc, match=pattern):
        call()


def test_bad_input_table_is_complete():
    assert len(_bad_calls()) == 19
    assert isinstance(init_train_state(optax.sgd(0.1), _params(), data_mesh())[0], TrainState)


def test_optimizer_state_is_not_donated_where_donation_would_copy_it():
    """XLA:CPU recomputes Adam's new moments inside both of their consumers (the skip's select, which writes them in
    place, and the parameter update) and therefore copies every donated moment whole first. The engine then passes
    the optimizer state undonated: its program copies no optimizer-state parameter, the parameters are still
    donated, and every step equals the never-donating step bit for bit, a skipped one included. The engine judges a
    standard optimizer from its update compiled alone (one compile of the step); the whole donating step is compiled
    here to check that judgement against it. The 1-bit family keeps its state donated without a judgement: their
    error buffers, updated in place, are never copied, so their programs (one per phase, each checked here) copy
    well under the 90% that the rule asks for (here 0.1-25%: warmup copies the moments, compression a server
    error)."""
    from jonebit.train.engine import copied_fraction, copied_parameters

    mesh = data_mesh()
    tx = optax.adam(1e-2)
    state, specs = init_train_state(tx, _params(), mesh)
    ref_state, _ = init_train_state(tx, _params(), mesh)
    step = make_train_step(loss_fn, tx, mesh, specs, grad_reduce="mean")
    ref = make_train_step(loss_fn, tx, mesh, specs, grad_reduce="mean", donate=False)
    n_opt = len(jax.tree.leaves(state.opt_state))
    first = len(jax.tree.leaves((state.step, state.params)))
    placed = jax.device_put(_batch(N * 2, 0), jax.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
    donating = step.jitted.lower(state, placed).compile().as_text()
    assert copied_fraction(donating, state.opt_state, first) >= 0.9  # what the engine works around
    rest = len(jax.tree.leaves(state._replace(opt_state=None)))
    chosen = step.compiled(state, _batch(N * 2, 0)).as_text()
    assert not copied_parameters(chosen) & set(range(rest, rest + n_opt))
    for i in range(4):
        b = _batch(N * 2, i) if i != 2 else _poison(_batch(N * 2, i), rank=3)
        old = state
        state, m = step(state, b)
        ref_state, ref_m = ref(ref_state, b)
        assert bool(m["skipped"]) == (i == 2) == bool(ref_m["skipped"])
        assert _leaves_equal(state, ref_state), f"step {i}"
        assert all(x.is_deleted() for x in jax.tree.leaves(old.params))
        assert not any(x.is_deleted() for x in jax.tree.leaves(old.opt_state))

    family = {"onebit_adam": jonebit.onebit_adam(1e-2, freeze_step=1),  # warmup, then compression
              "onebit_lamb": jonebit.onebit_lamb(1e-2, freeze_step=1),
              "zero_one_adam": jonebit.zero_one_adam(1e-2, var_freeze_step=1, local_step_scaler=1)}
    for name, tx in family.items():
        state, specs = init_train_state(tx, _params(), mesh)
        step = make_train_step(loss_fn, tx, mesh, specs, grad_reduce=None)
        stages = set()
        for i in range(3):
            b = _batch(N * 2, i)
            assert copied_fraction(step.compiled(state, b).as_text(), state.opt_state, first) < 0.9, (name, i)
            stages.add(step.phases_of(state))
            old = state
            state, _ = step(state, b)
            assert all(x.is_deleted() for x in jax.tree.leaves(old.opt_state)), (name, i)
        assert len(stages) == 2, (name, stages)  # the programs of two phases were checked
