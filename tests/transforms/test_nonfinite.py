"""skip_nonfinite: a non-finite gradient on one rank skips the step on every rank and leaves no trace in the training
(1-bit Adam at ZeRO stage 0 and its partitioned variant at stages 1-3).

Reference: the same compiled step run on the same gradient sequence without the bad step. Skipping must leave the
state bitwise as it was (but for ``skipped``), so every later step matches the reference bit for bit.

The file doubles as the MPI rank program of :func:`test_mpi_skips_on_every_process` (``python this_file OUTDIR``).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jonebit import onebit_adam, onebit_adam_zero, sharded_init, skip_nonfinite  # noqa: E402
from jonebit.transforms.onebit_adam_zero import FlatLayout  # noqa: E402

base_module = importlib.import_module("jonebit.transforms.base")
WORLD = 4
BAD_RANK = 1
STEPS = 5  # good steps; the bad one comes after the second
BAD_AT = 2


def params0():
    rng = np.random.default_rng(0)
    # 13 + 24 + 35 elements: each buffer is padded, so padding and several leaves are exercised.
    return {"b": rng.standard_normal(13).astype(np.float32), "u": rng.standard_normal((4, 6)).astype(np.float32),
            "w": rng.standard_normal((5, 7)).astype(np.float32)}


def good_grads(world, steps=STEPS, seed=1):
    rng = np.random.default_rng(seed)
    return [[{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params0().items()}
             for _ in range(world)] for _ in range(steps)]


def bad_grads(world, value, seed=2):
    """Finite gradients on every rank but ``BAD_RANK``, whose ``w`` has ``value`` in one element."""
    g = good_grads(world, steps=1, seed=seed)[0]
    g[BAD_RANK]["w"][2, 3] = value
    return g


def mesh_of(p):
    return jax.make_mesh((p,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:p])


class Runner:
    """One compiled step of ``tx`` over ``WORLD`` devices; ``run`` applies a gradient sequence from the start."""

    def __init__(self, stage, fused, freeze_step, raise_error=False, mask=None):
        self.mesh = mesh_of(WORLD)
        self.stage = stage
        kw = dict(freeze_step=freeze_step, weight_decay=0.01, fused=fused, exp_avg_mask=mask)
        inner = onebit_adam_zero(1e-2, stage=stage, **kw) if stage else onebit_adam(1e-2, **kw)
        self.tx = skip_nonfinite(inner, raise_error=raise_error)
        self.layout = FlatLayout.of(params0(), WORLD, fused)
        self.state0, specs = sharded_init(self.tx, params0(), self.mesh)
        pspec = P("data") if stage == 3 else P()

        @jax.jit
        @jax.shard_map(mesh=self.mesh, in_specs=(pspec, specs, P("data")), out_specs=(pspec, specs))
        def step(params, state, grads):
            grads = jax.tree.map(lambda g: g[0], grads)
            updates, state = self.tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        self.step = step

    def params(self):
        if self.stage == 3:
            return jax.device_put(self.layout.to_chunks(params0()), NamedSharding(self.mesh, P("data")))
        return jax.device_put(params0(), NamedSharding(self.mesh, P()))

    def apply(self, params, state, per_rank):
        stacked = {k: np.stack([g[k] for g in per_rank]) for k in per_rank[0]}
        return self.step(params, state, jax.device_put(stacked, NamedSharding(self.mesh, P("data"))))

    def run(self, sequence):
        """(params, state) after each gradient set of ``sequence``, fetched to numpy."""
        params, state = self.params(), self.state0
        out = []
        for per_rank in sequence:
            params, state = self.apply(params, state, per_rank)
            out.append(jax.device_get((params, state)))
        return out


def assert_trees_equal(a, b, what):
    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)
    assert len(la) == len(lb), what
    for (path, x), y in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype, f"{what}{jax.tree_util.keystr(path)}"
        # Bitwise: the same bytes, NaN or not.
        assert x.tobytes() == y.tobytes(), f"{what}{jax.tree_util.keystr(path)} differs"


def without_skipped(state):
    if isinstance(state, tuple):
        return state._replace(skipped=None)
    return dataclasses.replace(state, skipped=None)


def check_skip_leaves_no_trace(runner, bad_value):
    good = good_grads(WORLD)
    with_bad = good[:BAD_AT] + [bad_grads(WORLD, bad_value)] + good[BAD_AT:]
    ref = runner.run(good)
    got = runner.run(with_bad)

    before_params, before_state = got[BAD_AT - 1]
    after_params, after_state = got[BAD_AT]
    # The bad step changes nothing on any rank (the error buffers hold every rank's row) but the skip counter.
    assert int(after_state.skipped) == 1 and int(before_state.skipped) == 0
    assert int(after_state.inner.count) == BAD_AT
    assert_trees_equal(after_params, before_params, "params")
    assert_trees_equal(without_skipped(after_state), without_skipped(before_state), "state")
    # Later good steps are exactly those of a run that never saw the bad one.
    for t in range(BAD_AT, STEPS):
        got_params, got_state = got[t + 1]
        ref_params, ref_state = ref[t]
        assert_trees_equal(got_params, ref_params, f"params after good step {t + 1}: ")
        assert_trees_equal(without_skipped(got_state), without_skipped(ref_state), f"state after good step {t + 1}: ")
        assert int(got_state.skipped) == 1 and int(ref_state.skipped) == 0
        assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(got_params))


# freeze_step 4: the bad step (update 3) is in warmup. 2: it is the first compression step (ZeRO's all-gather
# branch). 1: a later compression step.
PHASES = {"warmup": (4, np.nan), "first-compression": (2, np.inf), "compression": (1, -np.inf)}


@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "per-leaf"])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_nonfinite_step_is_skipped_on_all_ranks(stage, fused, phase):
    freeze_step, bad_value = PHASES[phase]
    if stage == 0 and phase == "first-compression":
        pytest.skip("stage 0 has one compression branch; covered by 'compression'")
    check_skip_leaves_no_trace(Runner(stage, fused, freeze_step), bad_value)


def test_stage1_and_mask_skip():
    mask = {"b": None, "u": None, "w": np.array([[1], [1], [0], [1], [1]], bool)}
    check_skip_leaves_no_trace(Runner(1, True, 1, mask=mask), np.nan)


def test_gradient_whose_square_overflows_is_skipped():
    """3e19 is finite but its square (the variance's input) is not: it would make v infinite for good."""
    check_skip_leaves_no_trace(Runner(0, True, 4), 3e19)


@pytest.mark.parametrize("stage", [0, 2])
def test_raise_mode_fails_the_step_and_keeps_the_state(stage):
    runner = Runner(stage, True, 2, raise_error=True)
    good = good_grads(WORLD)
    params, state = runner.params(), runner.state0
    params, state = runner.apply(params, state, good[0])
    before = jax.device_get((params, state))
    with pytest.raises(Exception, match=r"non-finite gradient \(on (this|another) rank\)"):
        out = runner.apply(params, state, bad_grads(WORLD, np.nan))
        jax.block_until_ready(out)
    # Nothing was donated: the inputs are intact, and the next good step runs normally.
    assert_trees_equal(jax.device_get((params, state)), before, "inputs")
    params, state = runner.apply(params, state, good[1])
    jax.block_until_ready((params, state))
    assert int(state.inner.count) == 2 and int(state.skipped) == 0


def test_momentum_that_is_not_finite_is_refused():
    """A state whose momentum is already NaN (e.g. restored from a bad checkpoint) is not trained on: the update it
    leads to is not finite."""
    runner = Runner(0, True, 2)
    inner = runner.state0.inner
    mu = jax.tree.map(np.array, jax.device_get(inner.mu))
    mu["b"][0] = np.nan
    state = runner.state0._replace(inner=inner._replace(mu=jax.device_put(mu, NamedSharding(runner.mesh, P()))))
    params, new = runner.apply(runner.params(), state, good_grads(WORLD)[0])
    assert int(new.skipped) == 1 and int(new.inner.count) == 0
    assert_trees_equal(jax.device_get(params), params0(), "params")


def test_backend_max_is_one_collective_over_ranks():
    mesh = mesh_of(WORLD)

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=P("data"), out_specs=P())
    def reduce(x):
        from jonebit.comm.backends import AxisBackend

        return AxisBackend("data").max(x[0])

    flags = np.array([0, 0, 1, 0], np.int32)
    assert int(reduce(jax.device_put(flags, NamedSharding(mesh, P("data"))))) == 1
    assert int(reduce(jax.device_put(np.zeros(WORLD, np.int32), NamedSharding(mesh, P("data"))))) == 0


# --- issue 15: the check that refuses already-reduced gradients must not switch itself off silently -------------


def _reduced_grads_step():
    mesh = mesh_of(2)
    params = {"w": jnp.ones(16)}
    tx = onebit_adam(1e-3, freeze_step=2)
    state, specs = sharded_init(tx, params, mesh)

    def run():
        @jax.shard_map(mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=P())
        def bad(params, state, x):
            grads = jax.grad(lambda p: jnp.sum(p["w"] * x))(params)  # replicated params: autodiff psums
            return tx.update(grads, state, params)[0]

        x = jax.device_put(jnp.ones(32), NamedSharding(mesh, P("data")))
        return bad(jax.device_put(params, NamedSharding(mesh, P())), state, x)

    return run


def test_check_vma_is_read_through_public_config():
    assert base_module._read_check_vma() is False  # outside shard_map
    with pytest.raises(ValueError, match="already all-reduced"):
        _reduced_grads_step()()


def test_check_vma_lookup_failing_warns_once(monkeypatch, caplog):
    def missing():
        raise AttributeError("no such option")

    monkeypatch.setattr(base_module, "_read_check_vma", missing)
    monkeypatch.setattr(base_module, "_warned", set())
    run = _reduced_grads_step()
    with caplog.at_level(logging.WARNING, logger="jonebit.transforms"):
        run()  # the check is off: no error, but said so
        run()
    warnings = [r for r in caplog.records if "already all-reduced gradients is off" in r.getMessage()]
    assert len(warnings) == 1 and "jax.config.check_vma" in warnings[0].getMessage()


def test_unreadable_varying_types_warn_instead_of_refusing(monkeypatch, caplog):
    """If varying axes cannot be read, every gradient would look reduced: warn and do not refuse local ones."""
    monkeypatch.setattr(base_module, "varying_axes", lambda x: frozenset())
    monkeypatch.setattr(base_module, "_warned", set())
    mesh = mesh_of(2)
    runner_tx = onebit_adam(1e-3, freeze_step=2)
    state, specs = sharded_init(runner_tx, {"w": jnp.ones(16)}, mesh)

    @jax.shard_map(mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=P())
    def good(params, state, x):
        local = jax.lax.pcast(params, "data", to="varying")
        grads = jax.grad(lambda p: jnp.sum(p["w"] * x))(local)
        return runner_tx.update(grads, state, params)[0]

    x = jax.device_put(jnp.ones(32), NamedSharding(mesh, P("data")))
    with caplog.at_level(logging.WARNING, logger="jonebit.transforms"):
        good(jax.device_put({"w": jnp.ones(16)}, NamedSharding(mesh, P())), state, x)
    assert sum("cannot read varying mesh axes" in r.getMessage() for r in caplog.records) == 1


# --- MPI: every process skips together ---------------------------------------------------------------------------

MPI_WORLD = 2


def _mpi_main(outdir: str) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    tx = skip_nonfinite(onebit_adam(1e-2, freeze_step=2, fused=True, mpi_comm=comm), mpi_comm=comm)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    good = good_grads(MPI_WORLD)
    bad = bad_grads(MPI_WORLD, np.nan)
    results = {}
    for name, seq in (("ref", good), ("bad", good[:BAD_AT] + [bad] + good[BAD_AT:])):
        params = params0()
        state = jax.jit(tx.init)(params)
        for t, per_rank in enumerate(seq):
            params, state = step(params, state, per_rank[rank])
            if name == "bad" and t == BAD_AT:
                results["bad/skipped_at_bad"] = np.asarray(state.skipped)
        for k, v in params.items():
            results[f"{name}/params/{k}"] = np.asarray(v)
        results[f"{name}/skipped"] = np.asarray(state.skipped)
        for field in ("count", "mu", "nu", "worker_error", "server_error"):
            for path, v in jax.tree_util.tree_leaves_with_path(getattr(state.inner, field)):
                results[f"{name}/{field}{jax.tree_util.keystr(path)}"] = np.asarray(v)
    np.savez(os.path.join(outdir, f"rank{rank}.npz"), **results)


@pytest.mark.mpi
@pytest.mark.multiprocess
def test_mpi_skips_on_every_process(tmp_path):
    from tests.mpi_util import run_mpi

    run_mpi(MPI_WORLD, pathlib.Path(__file__), tmp_path, timeout=240)
    for r in range(MPI_WORLD):
        res = dict(np.load(tmp_path / f"rank{r}.npz"))
        assert int(res["bad/skipped_at_bad"]) == 1 and int(res["bad/skipped"]) == 1 and int(res["ref/skipped"]) == 0
        for key in (k[len("ref/"):] for k in res if k.startswith("ref/")):
            if key != "skipped":
                assert res[f"bad/{key}"].tobytes() == res[f"ref/{key}"].tobytes(), f"rank {r} {key}"


if __name__ == "__main__":
    _mpi_main(sys.argv[1])
