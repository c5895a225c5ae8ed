"""One program per phase (jonebit.transforms.phases): the host picks the phase the state names, the program holds
no conditional, and it computes what the one-program form's branch computes."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import jonebit
from jonebit.experimental import OneBitAdamOptions
from jonebit.sharding.mesh import data_mesh
from jonebit.train.data_parallel import init_optimizer, make_update, replicate, shard_batch
from jonebit.train.engine import init_train_state, make_train_step
from jonebit.train.loop import ArrayBatches, LoopConfig, train
from jonebit.transforms.onebit_adam import PHASES, OneBitAdamState
from jonebit.transforms.phases import next_phases
from tests.train import loop_model

N = 4


def _params():
    r = np.random.default_rng(0)
    return {"w": r.normal(size=(37, 5)).astype(np.float32), "b": r.normal(size=(11,)).astype(np.float32)}


def _grads(step):
    """Rank r's gradient in row r, on the mesh."""
    r = np.random.default_rng(100 + step)
    return shard_batch(jax.tree.map(lambda p: r.normal(size=(N, *p.shape)).astype(np.float32), _params()),
                       data_mesh(N))


def _run(per_phase, steps=7):
    mesh = data_mesh(N)
    # freeze 2, a variance refresh every 3rd compressed update: warmup, warmup, compression, compression,
    # refresh, compression, compression.
    tx = jonebit.onebit_adam(1e-2, freeze_step=2, experimental=OneBitAdamOptions(variance_refresh=3))
    params = replicate(_params(), mesh)
    state, specs = init_optimizer(tx, params, mesh)
    update = make_update(tx, mesh, specs, per_phase=per_phase)
    trail = []
    for t in range(steps):
        params, state = update(params, state, _grads(t))
        trail.append((PHASES[int(state.phase)], jax.device_get(params)))
    return update, trail


@pytest.fixture(scope="module")
def runs():
    return _run(True), _run(False)


def test_the_host_runs_the_phase_the_state_names(runs):
    (update, trail), (_, generic) = runs
    expected = ["warmup", "warmup", "compression", "compression", "refresh", "compression", "compression"]
    assert [p for p, _ in trail] == [p for p, _ in generic] == expected
    assert update.phases == [((OneBitAdamState, name),) for name in ("warmup", "compression", "refresh")]


def test_a_phase_program_has_no_conditional():
    mesh = data_mesh(N)
    tx = jonebit.onebit_adam(1e-2, freeze_step=1)
    params = replicate(_params(), mesh)
    state, specs = init_optimizer(tx, params, mesh)
    generic = make_update(tx, mesh, specs, per_phase=False).lower(params, state, _grads(0)).compile().as_text()
    assert " conditional(" in generic
    update = make_update(tx, mesh, specs)
    for phase in ("warmup", "compression"):
        assert next_phases(state) == ((OneBitAdamState, phase),)
        program = update.program(params, state, _grads(0))
        assert " conditional(" not in program.lower(params, state, _grads(0)).compile().as_text()
        params, state = update(params, state, _grads(0))


def _manual_results(lowered) -> int:
    """How many results the program's manual computation (its shard_map) returns."""
    line = next(x for x in lowered.as_text().splitlines() if "sdy.manual_computation(" in x)
    return line.split("out_shardings=", 1)[1].split("manual_axes=", 1)[0].count("<@")


def test_the_frozen_variance_stays_out_of_the_compression_program():
    """After the freeze the variance is read, not written: the compression program returns it as it came in (bit
    for bit, through a donated state) and its manual computation has no result for it (one per leaf fewer, which
    Shardy's compile time at thousands of leaves needs). Warmup writes the variance but leaves the error buffers
    as they are: there they are the ones left out."""
    mesh = data_mesh(N)
    tx = jonebit.onebit_adam(1e-2, freeze_step=1)
    params = replicate(_params(), mesh)
    state, specs = init_optimizer(tx, params, mesh)
    update = make_update(tx, mesh, specs)
    outputs = len(jax.tree.leaves((params, state)))  # what the step returns
    errors = len(jax.tree.leaves((state.worker_error, state.server_error)))
    warmup = _manual_results(update.program(params, state, _grads(0)).lower(params, state, _grads(0)))
    assert warmup == outputs - errors
    params, state = update(params, state, _grads(0))
    assert next_phases(state) == ((OneBitAdamState, "compression"),)
    compression = _manual_results(update.program(params, state, _grads(1)).lower(params, state, _grads(1)))
    assert compression == outputs - len(jax.tree.leaves(state.nu))
    nu = jax.device_get(state.nu)
    params, state = update(params, state, _grads(1))
    assert PHASES[int(state.phase)] == "compression"
    for a, b in zip(jax.tree.leaves(jax.device_get(state.nu)), jax.tree.leaves(nu), strict=True):
        np.testing.assert_array_equal(a, b)


def test_warmup_computes_what_the_branch_computes(runs):
    """Up to the first 1-bit step the two forms are float Adam in two different programs, which may sum and contract
    in different orders: each of the ~10 elementwise operations per element and step, and the 4-way mean, may round
    differently by 1 ulp, so after 2 steps the parameters agree within ~40 ulp of their scale (rtol 1e-5). Later
    steps are not compared element by element across the two programs (a 1-ulp difference can flip a sign and move
    an element by two scales): the golden replay checks every phase of both forms exactly
    (``tests/transforms/test_golden_trajectories.py``, where no contraction can differ)."""
    (_, trail), (_, generic) = runs
    warmup = [(p1, p2) for (phase, p1), (_, p2) in zip(trail, generic, strict=True) if phase == "warmup"]
    assert len(warmup) == 2
    for p1, p2 in warmup:
        for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_engine_reports_the_same_stages_and_bytes_in_both_forms(tmp_path):
    """The loop's per-stage bytes come from the compiled programs: a phase's own program holds its collectives
    outside any conditional, which the accounting must not count twice."""
    mesh = data_mesh()
    records = {}
    for per_phase in (True, False):
        tx = jonebit.onebit_adam(1e-2, freeze_step=loop_model.FREEZE, fused=True)
        state, specs = init_train_state(tx, loop_model.params0(), mesh)
        step = make_train_step(loop_model.loss_fn, tx, mesh, specs, rng_seed=3, per_phase=per_phase)
        out = tmp_path / str(per_phase)
        train(step, state, ArrayBatches(loop_model.data(), batch_size=mesh.size * 4, seed=11),
              LoopConfig(output_dir=out, max_steps=5, progress_bar=False, steps_per_print=0, tensorboard=False))
        records[per_phase] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    fast, one = records[True], records[False]
    assert [r["stage"] for r in fast] == [r["stage"] for r in one] == ["warmup"] * 3 + ["compression"] * 2
    assert [r["bytes_sent"] for r in fast] == [r["bytes_sent"] for r in one]
    assert fast[0]["bytes_sent"] > fast[-1]["bytes_sent"] > 0  # fp32 mean vs packed signs


def test_onebit_lamb_runs_one_program_per_phase():
    """1-bit LAMB through make_update: the phase sequence is the one-program form's, and each phase got its own
    program."""
    mesh = data_mesh(N)
    tx = jonebit.onebit_lamb(1e-2, freeze_step=2)
    names = {}
    for per_phase in (True, False):
        params = replicate(_params(), mesh)
        state, specs = init_optimizer(tx, params, mesh)
        update = make_update(tx, mesh, specs, per_phase=per_phase)
        seq = []
        for t in range(4):
            params, state = update(params, state, _grads(t))
            node = next(x for x in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "next_phase"))
                        if hasattr(x, "next_phase"))
            seq.append(type(node).PHASES[int(node.phase)])
        names[per_phase] = seq
        if per_phase:
            assert update.phases == [((type(node), "warmup"),), ((type(node), "compression"),)]
    assert names[True] == names[False] == ["warmup"] * 2 + ["compression"] * 2


def test_zero_one_adam_in_the_engine_runs_its_phases_in_order(tmp_path):
    """0/1 Adam (per-rank parameters: the engine's path) with a program per phase: the same stages as the one
    program. (Its schedule decisions inside a phase stay conditionals.)"""
    mesh = data_mesh()
    stages = {}
    for per_phase in (True, False):
        tx = jonebit.zero_one_adam(1e-2, var_freeze_step=2)
        state, specs = init_train_state(tx, loop_model.params0(), mesh)
        step = make_train_step(loop_model.loss_fn, tx, mesh, specs, rng_seed=3, per_phase=per_phase)
        out = tmp_path / str(per_phase)
        train(step, state, ArrayBatches(loop_model.data(), batch_size=mesh.size * 4, seed=11),
              LoopConfig(output_dir=out, max_steps=4, progress_bar=False, steps_per_print=0, tensorboard=False))
        stages[per_phase] = [json.loads(x)["stage"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert stages[True] == stages[False] == ["variance_freezing"] * 2 + ["local_steps"] * 2
