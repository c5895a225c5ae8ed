"""jonebit.train.initialize: DeepSpeed configs drive the engine (optimizer, schedule, batch arithmetic, precision)."""

from __future__ import annotations

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jonebit.sharding.mesh import data_mesh
from jonebit.train.config import ConfigError
from jonebit.train.initialize import initialize
from tests.reference import NumpyOneBitAdamFull
from tests.reference_family import NumpyOneBitLamb, NumpyZeroOneAdam
from tests.train.test_engine import _batch, _leaves_equal, _params, loss_fn

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


def test_adamw_config_with_accumulation_matches_single_device_optax():
    cfg = {
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 2,  # 8 devices -> 2 accumulation steps
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                    "warmup_num_steps": 4, "warmup_type": "linear"}},
        "gradient_clipping": 0.5,
    }
    engine = initialize(cfg, loss_fn, _params())
    assert engine.batch.gradient_accumulation_steps == 2 and engine.freeze_step is None
    batches = [_batch(32, s) for s in range(5)]
    for b in batches:
        engine.state, m = engine.step(engine.state, b)
        assert not bool(m["skipped"])
    # Reference: the same optimizer built independently (optax's AdamW, DeepSpeed WarmupLR's linear ramp with its
    # counter one behind the update count, clipping of the averaged gradient), one device, the whole batch.
    def lr(count):
        return 1e-2 * jnp.clip((count - 1) / 4, 0.0, 1.0)  # gamma = counter / warmup_num_steps, counter = count - 1

    ref_tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(lr, weight_decay=0.1))
    p, st = _params(), ref_tx.init(_params())
    for b in batches:
        u, st = ref_tx.update(jax.grad(loss_fn)(p, jax.tree.map(jnp.asarray, b)), st, p)
        p = optax.apply_updates(p, u)
    for a, r in zip(jax.tree.leaves(engine.state.params), jax.tree.leaves(p), strict=True):
        np.testing.assert_allclose(a, r, atol=3e-6)


def test_bing_bert_onebit_config_accepted_with_batch_scaled_down(tmp_path):
    cfg = json.loads((CONFIGS / "bing_bert_onebit_adam.json").read_text())
    cfg.update(train_batch_size=32, train_micro_batch_size_per_gpu=4)  # scaled down for 8 CPU devices
    cfg["optimizer"]["params"]["freeze_step"] = 3
    engine = initialize(cfg, loss_fn, _params())
    assert engine.freeze_step == 2  # DeepSpeed's freeze_step minus its initialisation step
    assert float(engine.state.loss_scale.scale) == 2.0**16  # fp16, dynamic, initial_scale_power 16
    assert engine.batch.gradient_accumulation_steps == 1
    loop = engine.loop_config(tmp_path, max_steps=4, progress_bar=False, tensorboard=False)
    engine.train(_Repeat(_batch(32, 0)), loop)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    stages = [r["stage"] for r in records]
    # fp16 from 2**16: the first steps may overflow and be skipped; once updates run, two are warmup.
    applied = [s for s in stages if s != "skipped"]
    assert applied[:2] == ["warmup", "warmup"] and set(applied[2:]) <= {"compression"}
    assert all(np.isfinite(r["loss"]) for r in records)


_ZERO_ONE = {"train_batch_size": 16, "optimizer": {"type": "ZeroOneAdam", "params": {
    "lr": 1e-2, "var_freeze_step": 4, "var_update_scaler": 2, "local_step_scaler": 3, "local_step_clipper": 4,
    "weight_decay": 0.01}}}


def test_zero_one_adam_config_trains_in_the_engine_like_deepspeed():
    """ZeroOneAdam from a DeepSpeed config: each rank keeps, differentiates at and moves its own parameter copy;
    every copy follows the numpy reference through variance, 1-bit, local and synchronising steps."""
    p = len(jax.devices())
    engine = initialize(_ZERO_ONE, loss_fn, _params(), fused=False)
    copies = engine.state.params.copies
    assert all(x.shape[0] == p and x.sharding.spec == jax.sharding.PartitionSpec("data")
               for x in jax.tree.leaves(copies))
    params0 = {k: np.asarray(v) for k, v in _params().items()}
    ref = NumpyZeroOneAdam(params0, p, lr=1e-2, var_freeze_step=4, var_update_scaler=2, local_step_scaler=3,
                           local_step_clipper=4, wd=0.01, fused=False)
    spread = []
    for s in range(14):
        batch = _batch(16, s)
        copies = jax.device_get(engine.state.params.copies)
        local = [_local_grads({k: v[r] for k, v in copies.items()}, batch, p)[r] for r in range(p)]
        engine.state, m = engine.step(engine.state, batch)
        assert not bool(m["skipped"])
        want, got = ref.step(local), jax.device_get(engine.state.params.copies)
        for r in range(p):
            for k in params0:
                np.testing.assert_allclose(got[k][r], want[r][k], rtol=5e-5, atol=5e-6,
                                           err_msg=f"update {s} rank {r} leaf {k} ({ref.log[-1]})")
        spread.append(max(float(np.ptp(got[k], axis=0).max()) for k in got))
    assert set(ref.log) == {"var", "onebit", "local", "sync"}
    # The copies part during local steps and meet again (to rounding) at every synchronisation.
    assert all(sp > 0.1 for sp, kind in zip(spread, ref.log, strict=True) if kind == "local")
    assert all(sp < 1e-5 for sp, kind in zip(spread, ref.log, strict=True) if kind == "sync")
    first = jax.device_get(engine.params)  # the model's parameters: rank 0's copy
    for k in params0:
        np.testing.assert_array_equal(first[k], got[k][0])


def test_zero_one_adam_state_beyond_stage_0_is_refused():
    """Built by hand (not from a config): per-rank parameters cannot be partitioned, so ZeRO stages 1-3 are refused."""
    from jonebit import zero_one_adam
    from jonebit.train.engine import init_train_state

    with pytest.raises(ValueError, match=r"0/1 Adam runs at ZeRO stage 0 only.*zero_stage=1"):
        init_train_state(zero_one_adam(1e-3, var_freeze_step=4), _params(), data_mesh(), zero_stage=1)


def test_zero_one_adam_engine_resumes_exactly_in_the_local_phase(tmp_path):
    """A run stopped in 0/1 Adam's local phase (copies apart, u accumulating) and resumed from its checkpoint ends
    bit-identical to an uninterrupted one: every rank's copy, momentum, u, errors and schedule counters."""
    def run(out, max_steps, resume):
        engine = initialize(_ZERO_ONE, loss_fn, _params())
        loop = engine.loop_config(out, max_steps=max_steps, progress_bar=False, tensorboard=False,
                                  checkpoint_every=0, async_checkpoint=False)
        return engine.train(_Cycle(), loop, resume=resume)

    whole = run(tmp_path / "whole", 12, False)
    run(tmp_path / "split", 8, False)  # ends after update 8: a local step (the reference's log, test above)
    resumed = run(tmp_path / "split", 12, True)
    assert _leaves_equal(whole, resumed)
    copies = jax.device_get(resumed.params.copies)
    assert max(float(np.ptp(v, axis=0).max()) for v in copies.values()) > 0  # really per rank at the end


class _Cycle:
    """A different batch every step, by position (the loop checkpoints the position)."""

    def __init__(self):
        self.n = 0

    def __next__(self):
        self.n += 1
        return _batch(16, self.n)

    def get_state(self):
        return {"n": self.n}

    def set_state(self, state):
        self.n = state["n"]


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


@pytest.mark.parametrize("update, pattern", [
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     r"offload_optimizer.device.*needs ZeRO stage 1, 2 or 3"),
    ({"train_batch_size": 30}, r"train_batch_size"),
    ({"optimizer": {"type": "ZeroOneAdam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}},
     r"zero_optimization.stage.*ZeroOneAdam runs at ZeRO stage 0 only"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 5}},
      "zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
     r"zero_quantized_weights.*1-bit optimizers gather their stage-3 parameters themselves"),
])
def test_refused_configs(update, pattern):
    cfg = {"train_batch_size": 32, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    cfg.update(update)
    with pytest.raises(ConfigError, match=pattern):
        initialize(cfg, loss_fn, _params())


_MPI_ADAM = {"train_batch_size": 32, "optimizer": {"type": "OneBitAdam", "params": {
    "lr": 1e-3, "freeze_step": 5, "comm_backend_name": "mpi"}}}


@pytest.mark.parametrize("kw, pattern", [
    ({"tx": "adam"}, r"comm_backend_name is \"mpi\".*drop tx"),
    ({"mesh": "all"}, r"one data-parallel rank with one device; the mesh has 8 devices.*mpirun -np"),
])
def test_refused_mpi_arguments(kw, pattern):
    """comm_backend_name "mpi" (the engine over mpirun, tests/train/test_engine_mpi.py): refused arguments. Checked
    before MPI is initialised, so this process stays MPI-free."""
    kw = {"tx": optax.adam(1e-3)} if "tx" in kw else {"mesh": data_mesh()}
    with pytest.raises(ValueError, match=pattern):
        initialize(_MPI_ADAM, loss_fn, _params(), **kw)


def test_mpi_config_without_mpi4jax_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4jax", None)
    with pytest.raises(ConfigError, match=r"comm_backend_name.*needs mpi4py and mpi4jax.*mpirun -np"):
        initialize(_MPI_ADAM, loss_fn, _params())


def _local_grads(params, batch, p):
    """Each rank's gradient of its own rows (shard_batch gives rank r the r-th contiguous slice)."""
    n = len(batch["y"]) // p
    grad = jax.jit(jax.grad(loss_fn))
    rows = [{k: v[r * n:(r + 1) * n] for k, v in batch.items()} for r in range(p)]
    return [{k: np.asarray(v) for k, v in grad(params, b).items()} for b in rows]


def _engine_against(engine, ref, steps):
    p = len(jax.devices())
    for s in range(steps):
        batch = _batch(16, s)
        local = _local_grads(jax.device_get(engine.state.params), batch, p)
        engine.state, m = engine.step(engine.state, batch)
        assert not bool(m["skipped"])
        want = ref.step(local)
        got = jax.device_get(engine.state.params)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=5e-5, atol=5e-6, err_msg=f"update {s} leaf {k}")


def test_onebit_adam_engine_clips_the_averaged_gradient_in_warmup_like_deepspeed():
    """gradient_clipping with 1-bit Adam: clip the mean in warmup (after DeepSpeed's allreduce), the local gradient
    in the compression stage; the engine's result equals the numpy reference of exactly that."""
    p = len(jax.devices())
    cfg = {"train_batch_size": 16, "gradient_clipping": 0.05,
           "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": 4, "weight_decay": 0.01}}}
    engine = initialize(cfg, loss_fn, _params())
    assert engine.freeze_step == 3
    params0 = {k: np.asarray(v) for k, v in _params().items()}
    ref = NumpyOneBitAdamFull(params0, p, freeze_step=3, lr=1e-2, wd=0.01, bias_correction=True, fused=False,
                              clip_norm=0.05, clip_averaged_warmup=True)
    norms = [np.sqrt(sum(np.sum(np.mean([g[k] for g in local], 0) ** 2) for k in params0))
             for local in [_local_grads(_params(), _batch(16, 0), p)]]
    assert norms[0] > 2 * 0.05  # the clip binds on the averaged gradient
    _engine_against(engine, ref, steps=6)


def test_onebit_lamb_config_trains_in_the_engine_like_deepspeed():
    """OneBitLamb from a DeepSpeed config: local gradients in, its own compressed allreduce, the reference's params."""
    p = len(jax.devices())
    cfg = {"train_batch_size": 16,
           "optimizer": {"type": "OneBitLamb", "params": {"lr": 1e-2, "freeze_step": 4, "weight_decay": 0.01}}}
    engine = initialize(cfg, loss_fn, _params())
    assert engine.freeze_step == 3
    params0 = {k: np.asarray(v) for k, v in _params().items()}
    ref = NumpyOneBitLamb(params0, p, lr=1e-2, freeze_step=4, wd=0.01)
    _engine_against(engine, ref, steps=7)


class _Repeat:
    """The same batch every step, with the state the loop checkpoints."""

    def __init__(self, batch):
        self.batch, self.n = batch, 0

    def __next__(self):
        self.n += 1
        return self.batch

    def get_state(self):
        return {"n": self.n}

    def set_state(self, state):
        self.n = state["n"]


def test_freeze_step_auto_engine_reports_the_stage_from_the_state(tmp_path):
    """"freeze_step": "auto" in the config: the engine's loop names each step's stage by the freeze point the
    optimizer decided (state.freeze_at), not by a static freeze_step."""
    rule = {"min_step": 3, "max_step": 7, "check_every": 1, "threshold": 10.0, "patience": 1}
    cfg = {"train_batch_size": 16, "steps_per_print": 1,
           "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": "auto", "auto_freeze": rule}}}
    engine = initialize(cfg, loss_fn, _params())
    assert engine.freeze_step == "auto"
    loop = engine.loop_config(tmp_path, max_steps=8, progress_bar=False, tensorboard=False, checkpoint_every=0)
    state = engine.train(_Repeat(_batch(16, 0)), loop)
    opt = next(n for n in jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "freeze_at"))
               if hasattr(n, "freeze_at"))
    decided = int(opt.freeze_at)
    assert decided == 3  # calm from the second check on: the minimum decides, well before the cap of 7
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    # The record of step n is the update after n - 1 updates.
    assert [r["stage"] for r in records] == ["warmup"] * decided + ["compression"] * (8 - decided)


def test_variance_refresh_config_trains_like_the_reference_and_names_the_refresh_steps(tmp_path):
    """"variance_refresh": K in a OneBitAdam config: the engine equals the numpy reference (every K-th update after
    the freeze exact, the variance refreshed), and its loop names those steps "refresh" with the warmup's bytes."""
    p = len(jax.devices())
    cfg = {"train_batch_size": 16, "steps_per_print": 1,
           "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": 3, "weight_decay": 0.01,
                                                          "variance_refresh": 3, "preconditioned": True}}}
    engine = initialize(cfg, loss_fn, _params())
    assert engine.freeze_step == 2
    params0 = {k: np.asarray(v) for k, v in _params().items()}
    ref = NumpyOneBitAdamFull(params0, p, freeze_step=2, lr=1e-2, wd=0.01, bias_correction=True, fused=False,
                              refresh=3, preconditioned=True)
    _engine_against(engine, ref, steps=6)

    engine = initialize(cfg, loss_fn, _params())
    loop = engine.loop_config(tmp_path, max_steps=9, progress_bar=False, tensorboard=False, checkpoint_every=0)
    engine.train(_Repeat(_batch(16, 0)), loop)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    # Updates 0-1 warmup; then every third update counted from the freeze (counts 4 and 7) refreshes.
    assert [r["stage"] for r in records] == ["warmup"] * 2 + ["compression", "compression", "refresh"] * 2 + [
        "compression"]
    sent = {r["stage"]: r["bytes_sent"] for r in records}
    assert sent["refresh"] == sent["warmup"] > sent["compression"] > 0
