import logging

import jax
import numpy as np

from jonebit import onebit_adam
from jonebit.train import checkpoint
from jonebit.train.data_parallel import data_mesh, init_optimizer, make_update, replicate, shard_batch


def train(tx, mesh, params, state, specs, grads, steps):
    update = make_update(tx, mesh, specs)
    for g in grads[:steps]:
        params, state = update(params, state, shard_batch(g, mesh))
    return params, state


def setup(p, seed=0):
    rng = np.random.default_rng(seed)
    params0 = {"w": rng.standard_normal((24, 10)).astype(np.float32), "b": np.zeros(7, np.float32)}
    grads = [{k: rng.standard_normal((p,) + v.shape).astype(np.float32) for k, v in params0.items()}
             for _ in range(8)]
    return params0, grads


def test_round_trip_keeps_error_buffers_and_resumes_exactly(tmp_path):
    mesh = data_mesh(8)
    tx = onebit_adam(1e-2, freeze_step=2)
    params0, grads = setup(8)
    params = replicate(params0, mesh)
    state, specs = init_optimizer(tx, params, mesh)
    params, state = train(tx, mesh, params, state, specs, grads, 4)  # 2 compressed steps: errors non-zero
    assert np.any(np.asarray(state.worker_error))
    snapshot = jax.device_get({"params": params, "opt_state": state})
    checkpoint.save(tmp_path / "ckpt", {"params": params, "opt_state": state}, step=4)

    restored, step = checkpoint.restore(tmp_path / "ckpt", {"params": params, "opt_state": state})
    assert step == 4
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), snapshot)
    assert restored["opt_state"].worker_error.sharding.spec[0] == "data"

    # Resuming from the restored state gives the same parameters as not stopping at all.
    cont, _ = train(tx, mesh, params, state, specs, grads[4:], 4)
    resumed, _ = train(tx, mesh, restored["params"], restored["opt_state"], specs, grads[4:], 4)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed), jax.device_get(cont))


def test_world_size_change_resets_errors(tmp_path, caplog):
    tx = onebit_adam(1e-2, freeze_step=2)
    mesh8 = data_mesh(8)
    params0, grads = setup(8)
    params = replicate(params0, mesh8)
    state, specs = init_optimizer(tx, params, mesh8)
    params, state = train(tx, mesh8, params, state, specs, grads, 4)
    checkpoint.save(tmp_path / "ckpt", {"params": params, "opt_state": state}, step=4)

    mesh4 = data_mesh(4)
    target_params = replicate(params0, mesh4)
    target_state, _ = init_optimizer(tx, target_params, mesh4)
    with caplog.at_level(logging.WARNING):
        restored, _ = checkpoint.restore(tmp_path / "ckpt", {"params": target_params, "opt_state": target_state})
    assert "reset to zero" in caplog.text
    np.testing.assert_array_equal(np.asarray(restored["params"]["w"]), np.asarray(params["w"]))
    np.testing.assert_array_equal(np.asarray(restored["opt_state"].mu["w"]), np.asarray(state.mu["w"]))
    assert restored["opt_state"].worker_error.shape == target_state.worker_error.shape
    assert not np.any(np.asarray(restored["opt_state"].worker_error))
    assert int(restored["opt_state"].count) == 4


def test_zero_stage3_onebit_round_trip_and_world_size_guard(tmp_path):
    import functools

    import pytest

    from jonebit.models import tiny_lm
    from jonebit.train.zero import init_zero, make_zero_step

    cfg = tiny_lm.TinyLMConfig(vocab_size=32, seq_len=8, dim=16, heads=2, layers=1)
    params0 = tiny_lm.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    batches = [jax.numpy.asarray(rng.integers(0, 32, (8, 9))) for _ in range(6)]
    loss = functools.partial(tiny_lm.loss_fn, cfg=cfg)

    def run(mesh, params, state, sh, bs):
        step = make_zero_step(loss, tx, mesh, sh, donate=False)
        for b in bs:
            params, state, _ = step(params, state, b)
        return params, state

    tx = onebit_adam(1e-2, freeze_step=2, fused=False, zero_stage=3)
    mesh = data_mesh(8)
    params, state, sh = init_zero(tx, params0, mesh, stage=3)
    params, state = run(mesh, params, state, sh, batches[:3])  # past freeze_step: packed momentum in use
    assert np.any(np.asarray(state.worker_error[0]))
    checkpoint.save(tmp_path / "z3", {"params": params, "opt_state": state}, step=3)
    restored, step = checkpoint.restore(tmp_path / "z3", {"params": params, "opt_state": state})
    assert step == 3
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored),
                 jax.device_get({"params": params, "opt_state": state}))
    cont = run(mesh, params, state, sh, batches[3:])
    resumed = run(mesh, restored["params"], restored["opt_state"], sh, batches[3:])
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed), jax.device_get(cont))

    mesh4 = data_mesh(4)
    p4, s4, _ = init_zero(tx, params0, mesh4, stage=3)
    with pytest.raises(ValueError, match="server chunks"):
        checkpoint.restore(tmp_path / "z3", {"params": p4, "opt_state": s4})
