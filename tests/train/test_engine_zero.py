"""jonebit.train.engine at ZeRO stages 0-3 (and optimizer offload) on 8 simulated CPU devices.

* with accumulation over 2 micro-batches, AdamW (with and without global-norm clipping) gives at stages 1-3 (and
  with offload) the parameters, losses and gradient norms of the stage-0 engine and of an independent
  single-device optax reference on the whole batch;
* the layouts: parameters partitioned at stage 3 only, optimizer state at stages >= 1, in host memory with offload;
* the compiled step (HLO): stages 1-3 reduce-scatter each gradient once per optimizer step (not per micro-batch:
  no collective inside the accumulation loop) and all-reduce nothing larger than a scalar; stage 1 sends stage
  0's bytes; stage 3 gathers each parameter once;
* a non-finite gradient on one rank (fp16, dynamic loss scaling) skips the step at every stage: parameters and
  optimizer state bit-identical, and the run continues exactly as one that never saw the bad batch; the same for
  1-bit Adam at ZeRO stages 1-3, in warmup and in compression;
* the loop resumes partitioned (and offloaded) state exactly from a checkpoint; rng keys and aux metrics are
  those of stage 0;
* 1-bit Adam at ZeRO stages 1-3 through ``initialize`` follows its stage-0 trajectory on fixed gradients, and
  trains through the loop;
* ``initialize`` accepts ``zero_optimization.stage`` 1-3 with offload; bad combinations get clear errors.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jonebit
from jonebit.comm import compressed_bytes_per_rank, padded_size
from jonebit.comm.accounting import comm_report
from jonebit.sharding.mesh import data_mesh
from jonebit.train.config import ConfigError
from jonebit.train.engine import LossScaling, init_train_state, make_train_step
from jonebit.train.initialize import initialize
from jonebit.train.onebit_zero import FlatParams
from jonebit.transforms.onebit_adam_zero import OneBitAdamZeroState
from tests.train.test_engine import _batch, _leaves_equal, _params, _poison, loss_fn
from tests.train.test_zero import _all_reduce_shapes

N = 8
K = 2  # micro-batches per optimizer step
STEPS = 4
OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1)),
}
VARIANTS = [(0, False), (1, False), (2, False), (3, False), (1, True), (3, True)]

# Tolerances (float32): the stages compute the same local gradients and differ only in the collective that
# averages them (reduce-scatter instead of all-reduce: possibly another summation order), so a few ulps of the
# O(1) parameters; the single-device reference sums the whole batch's gradient in another order, and Adam divides
# by sqrt(v), which turns rounding in near-zero gradient entries into ~1e-6 update differences at lr 1e-2.
STAGE_ATOL = 1e-6
REF_ATOL = 3e-6


@functools.cache
def mesh():
    return data_mesh(N)


@functools.cache
def batches():
    return tuple(_batch(N * K * 2, s) for s in range(STEPS))


def _host(tree):
    return jax.device_get(tree.tree() if isinstance(tree, FlatParams) else tree)


def max_abs_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
               for x, y in zip(jax.tree.leaves(_host(a)), jax.tree.leaves(_host(b)), strict=True))


@functools.cache
def engine_run(opt: str, stage: int, offload: bool):
    """STEPS engine steps: (final state, metrics per step, the step)."""
    tx = OPTIMIZERS[opt]()
    state, specs = init_train_state(tx, _params(), mesh(), zero_stage=stage, offload_optimizer=offload)
    step = make_train_step(loss_fn, tx, mesh(), specs, accumulation_steps=K, grad_reduce="mean", zero_stage=stage,
                           offload_optimizer=offload)
    metrics = []
    for b in batches():
        state, m = step(state, b)
        metrics.append(jax.device_get(m))
    return state, metrics, step


@functools.cache
def reference(opt: str):
    """One device, no mesh: the gradient of the whole batch's mean loss, then the same optax optimizer."""
    tx = OPTIMIZERS[opt]()
    p, st = _params(), tx.init(_params())
    for b in batches():
        g = jax.grad(loss_fn)(p, jax.tree.map(jnp.asarray, b))
        u, st = tx.update(g, st, p)
        p = optax.apply_updates(p, u)
    return jax.device_get(p)


def _spec_tuple(spec) -> tuple:
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


def _run_id(v):
    return f"stage{v[0]}" + ("-offload" if v[1] else "")


# ----------------------------------------------------------------------------------------------------------------
# Equivalence and layouts.

@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("variant", VARIANTS, ids=_run_id)
def test_stage_matches_stage0_and_single_device_reference(opt, variant):
    state, metrics, _ = engine_run(opt, *variant)
    base, base_metrics, _ = engine_run(opt, 0, False)
    assert max_abs_diff(state.params, base.params) < STAGE_ATOL
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([m[key] for m in metrics], [m[key] for m in base_metrics], rtol=1e-6)
    ref = reference(opt)
    assert max_abs_diff(state.params, ref) < REF_ATOL
    assert max_abs_diff(ref, _params()) > 1000 * REF_ATOL  # the run moved the parameters
    assert not any(bool(m["skipped"]) for m in metrics)
    assert int(state.step) == STEPS and int(state.skipped) == 0


def test_grad_norm_is_that_of_the_mean_gradient():
    """At stage 3 the norm is assembled from reduce-scattered shards: it must equal the whole batch's."""
    _, metrics, _ = engine_run("adamw", 3, False)
    g = jax.grad(loss_fn)(_params(), jax.tree.map(jnp.asarray, batches()[0]))
    np.testing.assert_allclose(metrics[0]["grad_norm"], optax.tree.norm(g), rtol=1e-5)


def _dropout_loss(p, batch, rng):
    """Drops input features with a mask drawn from the step's key (a different mask per rank and micro-batch)."""
    keep = jax.random.bernoulli(rng, 0.7, batch["x"].shape)
    loss = loss_fn(p, {"x": jnp.where(keep, batch["x"] / 0.7, 0.0), "y": batch["y"]})
    return loss, {"kept": jnp.mean(keep.astype(jnp.float32))}


@functools.cache
def _dropout_run(stage: int):
    tx = OPTIMIZERS["adamw"]()
    state, specs = init_train_state(tx, _params(), mesh(), zero_stage=stage)
    step = make_train_step(_dropout_loss, tx, mesh(), specs, accumulation_steps=K, grad_reduce="mean",
                           zero_stage=stage, rng_seed=3, has_aux=True)
    metrics = []
    for b in batches():
        state, m = step(state, b)
        metrics.append(jax.device_get(m))
    return state, metrics


@pytest.mark.parametrize("stage", [2, 3])
def test_rng_keys_and_aux_are_those_of_stage0(stage):
    """Keys depend on (seed, step, rank, micro-batch) only: every stage draws the same masks as stage 0."""
    state, metrics = _dropout_run(stage)
    base, base_metrics = _dropout_run(0)
    assert max_abs_diff(state.params, base.params) < STAGE_ATOL
    np.testing.assert_allclose([m["aux"]["kept"] for m in metrics], [m["aux"]["kept"] for m in base_metrics],
                               rtol=1e-7)
    assert 0.6 < metrics[0]["aux"]["kept"] < 0.8
    # The masks did something: the run differs from the one without dropout.
    assert max_abs_diff(state.params, engine_run("adamw", stage, False)[0].params) > 100 * STAGE_ATOL


def _expected(shape, partitioned: bool) -> tuple:
    """The ZeRO rule, stated independently: the largest dim divisible by 8 (first on ties), else replicated."""
    ok = [d for d, n in enumerate(shape) if n % N == 0 and n >= N]
    if not partitioned or not ok:
        return ()
    best = max(ok, key=lambda d: (shape[d], -d))
    return tuple("data" if d == best else None for d in range(best + 1))


@pytest.mark.parametrize("variant", VARIANTS, ids=_run_id)
def test_layouts_after_steps(variant):
    stage, offload = variant
    state, _, _ = engine_run("adamw", stage, offload)
    for p in jax.tree.leaves(state.params):
        assert p.dtype == jnp.float32
        assert _spec_tuple(p.sharding.spec) == _expected(p.shape, stage == 3)
        assert p.addressable_shards[0].data.size == (p.size // N if stage == 3 else p.size)
    adam = state.opt_state[0]
    for mu in jax.tree.leaves((adam.mu, adam.nu)):
        assert _spec_tuple(mu.sharding.spec) == _expected(mu.shape, stage >= 1)
        assert mu.addressable_shards[0].data.size == (mu.size // N if stage >= 1 else mu.size)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)}
    assert kinds == {"pinned_host" if offload else "device"}


# ----------------------------------------------------------------------------------------------------------------
# Communication in the compiled step.

def _grad_bytes() -> int:
    return sum(int(np.asarray(p).nbytes) for p in jax.tree.leaves(_params()))


@functools.cache
def _report(opt: str, stage: int):
    state, _, step = engine_run(opt, stage, False)
    hlo = step.compiled(state, batches()[0]).as_text()
    return hlo, comm_report(hlo, N)


def _sent(report, *ops) -> float:
    return sum(c.bytes_sent for c in report.always if c.op in ops)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stages_1_3_reduce_scatter_once_per_optimizer_step(opt, stage):
    hlo, report = _report(opt, stage)
    assert "reduce-scatter" in hlo
    scatters = [c for c in report.always if c.op == "reduce-scatter"]
    # Each device receives its 1/8 of every gradient, once per optimizer step: not inside the loop over the
    # micro-batches (trips would be 2), and nowhere in a conditional.
    assert sum(c.result_bytes for c in scatters) == _grad_bytes() // N
    assert all(c.trips == 1 and c.group_size == N for c in report.always)
    assert not report.branches
    # Nothing larger than a scalar is all-reduced (loss, overflow flag, squared norms).
    assert _all_reduce_shapes(hlo) and all(shape == () for shape in _all_reduce_shapes(hlo))
    gathered = sum(c.result_bytes for c in report.always if c.op == "all-gather")
    # Stages 1-2: the updated parameters are all-gathered; stage 3: the parameter shards, once for all
    # micro-batches (and nothing after the update: the new parameters stay partitioned).
    assert gathered == _grad_bytes()
    if stage == 1:  # DeepSpeed's stage 1: reduce-scatter + all-gather = stage 0's all-reduce bytes
        assert _sent(report, "reduce-scatter", "all-gather") == pytest.approx(2 * (N - 1) / N * _grad_bytes())


def test_stage_0_all_reduces_gradients_once():
    hlo, report = _report("adamw", 0)
    assert "reduce-scatter" not in hlo
    assert sorted(s for s in _all_reduce_shapes(hlo) if s) == sorted(np.shape(p) for p in jax.tree.leaves(_params()))
    assert all(c.trips == 1 for c in report.always)
    # The stage-1 step sends stage 0's bytes, plus one float32 scalar all-reduce: the squared norm of the
    # scattered gradient (stage 0 computes it from the all-reduced gradient).
    _, report1 = _report("adamw", 1)
    assert report1.always_bytes == pytest.approx(report.always_bytes + 2 * (N - 1) / N * 4)


# ----------------------------------------------------------------------------------------------------------------
# Skipped steps.

@pytest.mark.parametrize("variant", [(0, False), (1, False), (2, False), (3, False), (2, True)], ids=_run_id)
def test_nonfinite_on_one_rank_skips_at_every_stage(variant):
    stage, offload = variant
    scaling = LossScaling(initial_scale_power=8, hysteresis=2)
    tx = OPTIMIZERS["clip_adamw"]()
    good = [_batch(N * K * 2, 10 + s) for s in range(4)]

    def run(data):
        state, specs = init_train_state(tx, _params(), mesh(), loss_scaling=scaling, zero_stage=stage,
                                        offload_optimizer=offload)
        step = make_train_step(loss_fn, tx, mesh(), specs, accumulation_steps=K, compute_dtype=jnp.float16,
                               loss_scaling=scaling, grad_reduce="mean", donate=False, zero_stage=stage,
                               offload_optimizer=offload)
        states, skipped = [state], []
        for b in data:
            state, m = step(state, b)
            states.append(state)
            skipped.append(bool(m["skipped"]))
        return states, skipped

    bad_at = 1
    states, skipped = run(good[:bad_at] + [_poison(good[bad_at], rank=5)] + good[bad_at:])
    clean, _ = run(good)
    assert skipped == [i == bad_at for i in range(len(good) + 1)]
    before, after = states[bad_at], states[bad_at + 1]
    assert _leaves_equal(before.params, after.params)
    assert _leaves_equal(before.opt_state, after.opt_state)
    assert float(after.loss_scale.scale) == float(before.loss_scale.scale) == 2.0**8  # hysteresis 2: not cut yet
    assert int(after.loss_scale.hysteresis) == 1 and int(after.skipped) == 1 and int(after.step) == bad_at + 1
    # The layouts survive the skipped step.
    old, new = jax.tree.leaves((before.params, before.opt_state)), jax.tree.leaves((after.params, after.opt_state))
    assert [a.sharding for a in old] == [b.sharding for b in new]
    # The run then continues exactly as one that never saw the bad batch.
    assert _leaves_equal(states[-1].params, clean[-1].params)
    assert _leaves_equal(states[-1].opt_state, clean[-1].opt_state)
    assert not _leaves_equal(states[-1].params, states[0].params)


@functools.cache
def _onebit_zero_run(stage: int, bad_at: int | None):
    """1-bit Adam at ZeRO ``stage`` (freeze_step 3) on 6 good batches, with a poisoned one inserted at ``bad_at``."""
    tx = (jonebit.onebit_adam_zero(1e-2, freeze_step=3, stage=stage) if stage
          else jonebit.onebit_adam(1e-2, freeze_step=3))
    good = [_batch(N * K * 2, 20 + s) for s in range(6)]
    data = good if bad_at is None else good[:bad_at] + [_poison(good[bad_at], rank=2)] + good[bad_at:]
    state, specs = init_train_state(tx, _params(), mesh(), zero_stage=stage)
    step = make_train_step(loss_fn, tx, mesh(), specs, accumulation_steps=K, grad_reduce=None, donate=False,
                           zero_stage=stage)
    states, skipped = [state], []
    for b in data:
        state, m = step(state, b)
        states.append(state)
        skipped.append(bool(m["skipped"]))
    return states, skipped


@pytest.mark.parametrize("stage, bad_at", [(1, 4), (2, 1), (3, 1), (3, 4)])  # warmup: count 1 < 3; compression: 4
def test_nonfinite_skips_onebit_zero_steps(stage, bad_at):
    states, skipped = _onebit_zero_run(stage, bad_at)
    clean, _ = _onebit_zero_run(stage, None)
    assert skipped == [i == bad_at for i in range(7)]
    # Parameters (stage 3: the server chunks), moments, packed momentum, error buffers and count untouched ...
    assert _leaves_equal(states[bad_at].params, states[bad_at + 1].params)
    assert _leaves_equal(states[bad_at].opt_state, states[bad_at + 1].opt_state)
    # ... and the run continues exactly as one that never saw the bad batch.
    assert _leaves_equal(states[-1].params, clean[-1].params)
    assert _leaves_equal(states[-1].opt_state, clean[-1].opt_state)
    assert int(states[-1].opt_state.count) == 6 and int(states[-1].skipped) == 1


# ----------------------------------------------------------------------------------------------------------------
# 1-bit Adam under ZeRO through initialize.

def _onebit_config(stage: int) -> dict:
    return {
        "train_batch_size": N * K * 2, "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": 3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
    }


def fixed_grad_loss(p, batch):
    """A loss linear in the parameters: each rank's gradient is its micro-batches' mean of ``batch``'s leaves,
    whatever the parameters (fixed gradients, so trajectories differ only by the optimizer's arithmetic)."""
    return sum(jnp.sum(p[k] * jnp.mean(batch[k], 0)) for k in p)


def _fixed_grad_batches(steps: int):
    r = np.random.default_rng(7)
    return [{k: r.normal(size=(N * K * 2, *np.shape(v))).astype(np.float32) for k, v in _params().items()}
            for _ in range(steps)]


@functools.cache
def onebit_trajectory(stage: int):
    engine = initialize(_onebit_config(stage), fixed_grad_loss, _params())
    assert engine.freeze_step == 2 and engine.batch.gradient_accumulation_steps == K
    out = []
    for b in _fixed_grad_batches(8):  # 2 warmup steps, the first compression step, 5 more
        engine.state, m = engine.step(engine.state, b)
        assert not bool(m["skipped"])
        out.append(_host(engine.state.params))
    return engine.state, out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_onebit_zero_through_initialize_follows_stage0(stage):
    state, got = onebit_trajectory(stage)
    _, want = onebit_trajectory(0)
    assert isinstance(state.opt_state, OneBitAdamZeroState) and state.opt_state.stage == stage
    assert int(state.opt_state.count) == 8
    assert isinstance(state.params, FlatParams) == (stage == 3)
    # The tolerances of tests/transforms/test_onebit_zero.py (stage k against stage 0 on fixed gradients).
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        for k in w:
            np.testing.assert_allclose(g[k], w[k], rtol=1e-5, atol=1e-6, err_msg=f"step {t} leaf {k}")
    assert max_abs_diff(got[-1], _params()) > 1e-2


class _Repeat:
    def __init__(self, batch):
        self.batch, self.n = batch, 0

    def __next__(self):
        self.n += 1
        return self.batch

    def get_state(self):
        return {"n": self.n}

    def set_state(self, state):
        self.n = state["n"]


def test_onebit_zero3_trains_through_the_loop(tmp_path):
    engine = initialize(_onebit_config(3), loss_fn, _params())
    loop = engine.loop_config(tmp_path, max_steps=6, progress_bar=False, tensorboard=False, checkpoint_every=3)
    state = engine.train(_Repeat(_batch(N * K * 2, 0)), loop)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # The phases the optimizer's state names: the first compression step gathers the float32 momentum once.
    assert [r["stage"] for r in records] == ["warmup"] * 2 + ["first_compression"] + ["compression"] * 3
    losses = [r["loss"] for r in records]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    # bytes_sent per stage: the engine's own collectives (parameter gather, scalars) are common to both, so the
    # difference is the optimizer's: per buffer (one per leaf, fp32 config: not fused) a compressed allreduce in
    # compression, a reduce-scatter of the padded float32 gradient in warmup (stage 3 keeps parameters
    # partitioned: no all-gather of updates).
    sent = {r["stage"]: r["bytes_sent"] for r in records}
    sizes = [int(np.size(p)) for p in jax.tree.leaves(_params())]
    want = sum(compressed_bytes_per_rank(n, N) - (N - 1) / N * 4 * padded_size(n, N) for n in sizes)
    assert sent["compression"] - sent["warmup"] == pytest.approx(want)
    assert sent["compression"] > 0
    # The one-off all-gather of the momentum chunks (stage 3: the variance stays in chunks; mask_unseen gathers one
    # bit per element of where it is > 0).
    once = sum((N - 1) / N * (4 + 1 / 8) * padded_size(n, N) for n in sizes)
    assert sent["first_compression"] - sent["compression"] == pytest.approx(once)
    assert isinstance(state.params, FlatParams)
    # Resuming from the last checkpoint restores the partitioned state as it was (other initial parameters: only
    # the restore can make the states equal).
    again = initialize(_onebit_config(3), loss_fn, _params(1))
    resumed = again.train(_Repeat(_batch(N * K * 2, 0)), loop)
    assert _leaves_equal(resumed, state)


# ----------------------------------------------------------------------------------------------------------------
# initialize with standard optimizers, and bad combinations.

@pytest.mark.parametrize("stage, offload", [(1, False), (2, False), (3, True)])
def test_initialize_adamw_zero_matches_stage0(stage, offload):
    def cfg(s, off):
        zero = {"stage": s}
        if off:
            zero["offload_optimizer"] = {"device": "cpu"}
        return {"train_batch_size": N * K * 2, "gradient_accumulation_steps": K, "gradient_clipping": 0.5,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
                "zero_optimization": zero}

    runs = []
    for s, off in ((0, False), (stage, offload)):
        engine = initialize(cfg(s, off), loss_fn, _params())
        for b in batches():
            engine.state, _ = engine.step(engine.state, b)
        runs.append(engine.state)
    assert max_abs_diff(runs[1].params, runs[0].params) < STAGE_ATOL
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(runs[1].opt_state)}
    assert kinds == {"pinned_host" if offload else "device"}


@pytest.mark.parametrize("stage, offload", [(2, False), (3, True)])
def test_loop_resumes_zero_state_exactly(tmp_path, stage, offload):
    """Stop after a checkpoint, resume in a new engine: the partitioned (and offloaded) state is restored in its
    layout and the run ends bit-identical to an uninterrupted one."""
    zero = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    cfg = {"train_batch_size": N * K * 2, "gradient_accumulation_steps": K,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}, "zero_optimization": zero}

    def train(out, max_steps, seed=0):
        engine = initialize(cfg, loss_fn, _params(seed))
        loop = engine.loop_config(out, max_steps=max_steps, progress_bar=False, tensorboard=False,
                                  checkpoint_every=2)
        return engine.train(_Cycle(batches()), loop)

    straight = train(tmp_path / "straight", 4)
    train(tmp_path / "resumed", 2)
    # Other initial parameters: only the restored checkpoint can make this run end like the straight one.
    resumed = train(tmp_path / "resumed", 4, seed=1)
    assert _leaves_equal(resumed, straight)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight), strict=True):
        assert a.sharding == b.sharding
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(resumed.opt_state)}
    assert kinds == {"pinned_host" if offload else "device"}


class _Cycle:
    """The batches in order, repeated; its position is its state."""

    def __init__(self, data):
        self.data, self.n = data, 0

    def __next__(self):
        self.n += 1
        return self.data[(self.n - 1) % len(self.data)]

    def get_state(self):
        return {"n": self.n}

    def set_state(self, state):
        self.n = state["n"]


def _bad_calls():
    m = mesh()
    adamw = optax.adamw(1e-2)
    onebit2 = jonebit.onebit_adam_zero(1e-2, freeze_step=2, stage=2)
    state0, specs0 = init_train_state(adamw, _params(), m)
    state_off, specs_off = init_train_state(adamw, _params(), m, zero_stage=1, offload_optimizer=True)
    _, specs_ob = init_train_state(onebit2, _params(), m, zero_stage=2)
    build = lambda tx, specs, **kw: make_train_step(loss_fn, tx, m, specs, **kw)  # noqa: E731
    return [
        ("stage 4", lambda: init_train_state(adamw, _params(), m, zero_stage=4), ValueError,
         r"init_train_state: zero_stage must be 0, 1, 2 or 3, got 4"),
        ("offload at stage 0", lambda: init_train_state(adamw, _params(), m, offload_optimizer=True), ValueError,
         r"offload_optimizer=True needs zero_stage 1, 2 or 3 \(as in DeepSpeed\), got 0"),
        ("offload not bool", lambda: init_train_state(adamw, _params(), m, zero_stage=1, offload_optimizer="cpu"),
         TypeError, r"offload_optimizer must be a bool, got 'cpu'"),
        ("1-bit stage mismatch", lambda: init_train_state(onebit2, _params(), m, zero_stage=3), ValueError,
         r"zero_stage=3 but the 1-bit optimizer was built for ZeRO stage 2.*onebit_adam_zero\(\.\.\., stage=3\)"),
        ("1-bit at stage 0", lambda: init_train_state(onebit2, _params(), m), ValueError,
         r"zero_stage=0 but the 1-bit optimizer was built for ZeRO stage 2"),
        ("step stage 5", lambda: build(adamw, specs0, zero_stage=5), ValueError,
         r"make_train_step: zero_stage must be 0, 1, 2 or 3, got 5"),
        ("local grads at stage 2", lambda: build(adamw, specs0, zero_stage=2), ValueError,
         r"at ZeRO stage 2 the step reduce-scatters .* use grad_reduce=\"mean\""),
        ("mean grads for 1-bit", lambda: build(onebit2, specs_ob, zero_stage=2, grad_reduce="mean"), ValueError,
         r"1-bit optimizers communicate themselves .* use grad_reduce=None \(got 'mean'\)"),
        ("1-bit specs of another stage", lambda: build(onebit2, specs_ob, zero_stage=1), ValueError,
         r"zero_stage=1 but specs hold the state of a 1-bit optimizer built for ZeRO stage 2"),
        ("stage-0 state at stage 2", lambda: build(adamw, specs0, zero_stage=2, grad_reduce="mean")(
            state0, _batch(16, 0)), ValueError,
         r"make_train_step\(zero_stage=2\): specs do not hold the stage-2 layout.*init_train_state\(\.\.\., "
         r"zero_stage=2\)"),
        ("offloaded state without offload", lambda: build(adamw, specs_off, zero_stage=1, grad_reduce="mean")(
            state_off, _batch(16, 0)), ValueError,
         r"make_train_step\(offload_optimizer=False\): the optimizer state lives in \['pinned_host'\] memory"),
        ("initialize: given 1-bit tx of another stage", lambda: initialize(
            {"train_batch_size": 16, "zero_optimization": {"stage": 1}}, loss_fn, _params(),
            tx=jonebit.onebit_adam(1e-2, freeze_step=2)), ConfigError,
         r"zero_optimization.stage: .*zero_stage=1 but the 1-bit optimizer was built for ZeRO stage 0"),
    ]


@pytest.mark.parametrize("case", range(12))
def test_bad_inputs(case):
    name, call, exc, pattern = _bad_calls()[case]
    with pytest.raises(exc, match=pattern):
        call()


def test_bad_input_table_is_complete():
    assert len(_bad_calls()) == 12


class _Memory:
    def __init__(self, kind):
        self.kind = kind


def test_initialize_offload_without_host_memory_names_the_key(monkeypatch):
    """Devices that offer only device memory: the config's offload is refused by name, not deep in jit."""
    monkeypatch.setattr(type(jax.devices()[0]), "addressable_memories", lambda self: [_Memory("device")])
    cfg = {"train_batch_size": 16, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(ConfigError, match=r"zero_optimization.offload_optimizer.device: .*needs host memory "
                                          r"\('pinned_host'\)"):
        initialize(cfg, loss_fn, _params())
