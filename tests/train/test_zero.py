"""jonebit.train.zero on 8 simulated CPU devices with the tiny transformer LM.

* stages 0-3 (and offload at stages 1 and 3) give the parameters of an independent single-device reference
  (plain ``jax.value_and_grad`` of the whole batch + the same optax optimizer, no mesh) after 20 steps;
* the layouts survive the steps (stage 1/2 params stay replicated: google/flax#5172);
* communication read from the compiled HLO: reduce-scatter at stages 1-3 (no gradient-sized all-reduce),
  all-reduce of all gradients at stage 0; stage 1 sends stage 0's bytes (reduce-scatter + all-gather);
* offload errors where the backend has no pinned_host memory; bf16 params with fp32 master weights;
  the caller's parameters survive the donating step.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jonebit.comm.accounting import comm_report
from jonebit.models import tiny_lm
from jonebit.sharding.mesh import data_mesh
from jonebit.train.zero import MasterWeightsState, abstract_zero, init_zero, make_zero_grads, make_zero_step

N = 8
STEPS = 20
CFG = tiny_lm.TinyLMConfig(vocab_size=64, seq_len=16, dim=32, heads=4, layers=1)
BATCH = 16  # 2 sequences per device

# Float tolerances (float32 everywhere; the model's parameters are O(0.02)-O(1)):
# - ZeRO stages against the single-device reference: the gradient of the whole batch is summed in a different
#   order (per device, then across devices), and Adam divides by sqrt(v), which turns float32 rounding in
#   near-zero gradient entries into update differences of a few 1e-6 at lr 3e-3 over 20 steps.
REF_ATOL = 2e-5
# - ZeRO stages among themselves: the same local gradients and the same reduction order up to the collective.
STAGE_ATOL = 1e-6

OPTIMIZERS = {
    "adamw": lambda: optax.adamw(3e-3, weight_decay=0.1),
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(3e-3, weight_decay=0.1)),
}
VARIANTS = {  # (stage, offload)
    "adamw": [(0, False), (1, False), (2, False), (3, False), (1, True), (3, True)],
    "clip_adamw": [(0, False), (1, True), (2, False), (3, False)],
}


@functools.cache
def mesh():
    return data_mesh(N)


@functools.cache
def init_params():
    return jax.device_get(tiny_lm.init_params(CFG, jax.random.key(0)))


@functools.cache
def batches() -> np.ndarray:
    """Learnable synthetic data: each sequence counts up modulo the vocabulary with a stride of 1, 2 or 3."""
    rng = np.random.default_rng(0)
    start = rng.integers(0, CFG.vocab_size, (STEPS, BATCH, 1))
    stride = rng.integers(1, 4, (STEPS, BATCH, 1))
    return ((start + stride * np.arange(CFG.seq_len + 1)) % CFG.vocab_size).astype(np.int32)


def loss_fn(params, batch):
    return tiny_lm.loss_fn(params, batch, CFG)


@functools.cache
def reference(opt: str):
    """Single device, no mesh, no shard_map: grad of the mean loss of the whole batch, then optax."""
    tx = OPTIMIZERS[opt]()
    device = jax.devices()[0]
    params = jax.device_put(init_params(), device)
    state = tx.init(params)

    @jax.jit
    def step(params, state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for batch in batches():
        params, state, loss = step(params, state, jax.device_put(batch, device))
        losses.append(float(loss))
    return jax.device_get(params), np.array(losses)


@functools.cache
def zero_run(opt: str, stage: int, offload: bool):
    """20 ZeRO steps: (params, opt_state, shardings, losses, the jitted step)."""
    tx = OPTIMIZERS[opt]()
    params, state, sh = init_zero(tx, init_params(), mesh(), stage=stage, offload_optimizer=offload)
    step = make_zero_step(loss_fn, tx, mesh(), sh)
    losses = []
    for batch in batches():
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return params, state, sh, np.array(losses), step


def max_abs_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
               for x, y in zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b)), strict=True))


def spec_tuple(spec) -> tuple:
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


ALL_RUNS = [(opt, stage, offload) for opt, variants in VARIANTS.items() for stage, offload in variants]


def run_id(run):
    opt, stage, offload = run
    return f"{opt}-stage{stage}" + ("-offload" if offload else "")


# ----------------------------------------------------------------------------------------------------------------
# Equivalence.

def test_reference_learns():
    _, losses = reference("adamw")
    assert losses[0] > 3.9  # ~ log(64) at init
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize("run", ALL_RUNS, ids=run_id)
def test_stage_matches_single_device_reference(run):
    opt, stage, offload = run
    params, _, _, losses, _ = zero_run(opt, stage, offload)
    ref_params, ref_losses = reference(opt)
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=0)
    assert max_abs_diff(params, ref_params) < REF_ATOL
    # The run moved the parameters far more than the tolerance.
    assert max_abs_diff(ref_params, init_params()) > 1000 * REF_ATOL


@pytest.mark.parametrize("run", [r for r in ALL_RUNS if r[1:] != (0, False)], ids=run_id)
def test_stages_agree_with_stage0(run):
    opt = run[0]
    params, _, _, losses, _ = zero_run(*run)
    base_params, _, _, base_losses, _ = zero_run(opt, 0, False)
    assert max_abs_diff(params, base_params) < STAGE_ATOL
    np.testing.assert_allclose(losses, base_losses, atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------------------------------------------
# Layouts after the steps.

def _expected(shape, partitioned: bool) -> tuple:
    """The rule, stated independently: the largest dim divisible by 8 (first on ties), else replicated."""
    if not partitioned:
        return ()
    ok = [d for d, n in enumerate(shape) if n % N == 0 and n >= N]
    if not ok:
        return ()
    best = max(ok, key=lambda d: (shape[d], -d))
    return tuple("data" if d == best else None for d in range(best + 1))


@pytest.mark.parametrize("run", ALL_RUNS, ids=run_id)
def test_layout_survives_steps(run):
    opt, stage, offload = run
    params, state, sh, _, _ = zero_run(opt, stage, offload)
    for p in jax.tree.leaves(params):
        assert isinstance(p.sharding, NamedSharding)
        assert spec_tuple(p.sharding.spec) == _expected(p.shape, stage >= 3), (stage, p.shape, p.sharding.spec)
        assert p.sharding.memory_kind == "device"
    if stage in (1, 2):  # regression for google/flax#5172: the update must not leave params sharded
        assert all(spec_tuple(p.sharding.spec) == () for p in jax.tree.leaves(params))
    for s, planned in zip(jax.tree.leaves(state), jax.tree.leaves(sh.opt_state), strict=True):
        assert spec_tuple(s.sharding.spec) == _expected(s.shape, stage >= 1)
        assert s.sharding.memory_kind == ("pinned_host" if offload else "device")
        assert s.sharding == planned
    # Every moment leaf of the tiny LM has a divisible dim, so at stage >= 1 each device holds 1/8 of it.
    adam = state[-1][0] if opt == "clip_adamw" else state[0]
    for mu in jax.tree.leaves(adam.mu):
        assert mu.addressable_shards[0].data.size == (mu.size // N if stage >= 1 else mu.size)


# ----------------------------------------------------------------------------------------------------------------
# Communication in the compiled program.

@functools.cache
def compiled_report(opt: str, stage: int):
    """HLO of the step that ran in zero_run, lowered from abstract_zero's ShapeDtypeStructs (same avals and
    shardings as the real arrays, so jax reuses the compiled program)."""
    tx = OPTIMIZERS[opt]()
    params, state, _ = abstract_zero(tx, init_params(), mesh(), stage=stage)
    step = zero_run(opt, stage, False)[-1]
    batch = jax.ShapeDtypeStruct((BATCH, CFG.seq_len + 1), jnp.int32)
    hlo = step.lower(params, state, batch).compile().as_text()
    return hlo, comm_report(hlo, N)


_ALL_REDUCE = re.compile(r"=\s*(?P<shape>.+?)\s+all-reduce(?:-start)?\(")
_ARRAY = re.compile(r"\b[a-z]+\d*\[([\d,]*)\]")


def _all_reduce_shapes(hlo: str) -> list[tuple[int, ...]]:
    """Shapes of every array an all-reduce of the program returns (tuple all-reduces give several)."""
    shapes = []
    for line in hlo.splitlines():
        if m := _ALL_REDUCE.search(line):
            shapes += [tuple(int(d) for d in dims.split(",") if d) for dims in _ARRAY.findall(m.group("shape"))]
    return shapes


def _grad_bytes() -> list[int]:
    return [int(np.asarray(p).nbytes) for p in jax.tree.leaves(init_params())]


@pytest.mark.parametrize("opt", ["adamw", "clip_adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage_1_2_3_reduce_scatter_gradients(opt, stage):
    hlo, report = compiled_report(opt, stage)
    assert "reduce-scatter" in hlo
    scatters = [c for c in report.always if c.op == "reduce-scatter"]
    reduces = [c for c in report.always if c.op == "all-reduce"]
    grads = _grad_bytes()
    # One reduce-scatter result per gradient leaf: each device receives exactly its 1/8 of every gradient
    # (XLA may combine several leaves into one instruction, hence the sums).
    assert sum(c.result_bytes for c in scatters) == sum(g // N for g in grads)
    assert all(c.group_size == N for c in scatters)
    # What is still all-reduced are scalars (the loss; with clipping, each leaf's squared norm for the global
    # norm, combined by XLA into one tuple all-reduce), never a gradient-sized operand.
    for shape in _all_reduce_shapes(hlo):
        assert shape == (), f"all-reduce of a non-scalar {shape} at stage {stage}"
    assert 0 < sum(c.result_bytes for c in reduces) < min(grads)
    # Ring bytes sent for the gradients: (P-1)/P of the gradient bytes, half of an all-reduce's 2 (P-1)/P.
    assert sum(c.bytes_sent for c in scatters) == pytest.approx((N - 1) / N * sum(grads))


def test_stage_0_all_reduces_gradients():
    hlo, report = compiled_report("adamw", 0)
    assert "reduce-scatter" not in hlo
    reduces = [c for c in report.always if c.op == "all-reduce"]
    # All gradients (plus the scalar loss; XLA combines them) are all-reduced, and nothing is gathered.
    assert sum(c.result_bytes for c in reduces) >= sum(_grad_bytes())
    assert sorted(s for s in _all_reduce_shapes(hlo) if s) == sorted(np.shape(p) for p in jax.tree.leaves(
        init_params()))
    assert not [c for c in report.always if c.op == "all-gather"]


def _sent(report, *ops) -> float:
    return sum(c.bytes_sent for c in report.always if c.op in ops)


@pytest.mark.parametrize("opt", ["adamw", "clip_adamw"])
def test_stage_1_moves_stage_0_bytes(opt):
    """DeepSpeed's stage 1: reduce-scatter of the gradients + all-gather of the updated parameters,
    (P-1)/P G + (P-1)/P G = 2 (P-1)/P G bytes sent per device for G bytes of gradients: stage 0's all-reduce.
    (An all-reduce followed by the all-gather, as before, sends 3 (P-1)/P G, 1.5 times as much.)"""
    grads = sum(_grad_bytes())
    _, report0 = compiled_report(opt, 0)
    _, report1 = compiled_report(opt, 1)
    # Stage 0: the gradients and the float32 loss, all-reduced (however XLA groups them).
    assert _sent(report0, "all-reduce") == pytest.approx(2 * (N - 1) / N * (grads + 4))
    assert sum(c.result_bytes for c in report1.always if c.op == "all-gather") == grads
    assert _sent(report1, "reduce-scatter", "all-gather") == pytest.approx(2 * (N - 1) / N * grads)
    # What stage 1 still all-reduces is scalars: the loss, the squared norm of the skip check, and with clipping
    # the per-leaf squared norms.
    assert sum(c.result_bytes for c in report1.always if c.op == "all-reduce") <= 4 * (len(_grad_bytes()) + 2)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="documents an XLA:CPU behaviour")
def test_cpu_turns_a_sharding_constraint_into_all_reduce_and_slice():
    """Why make_zero_grads uses lax.psum_scatter: on XLA:CPU, gradients of a data-sharded batch constrained to a
    sharded layout (the global-view way to ask for ZeRO-2) compile to a full all-reduce followed by a dynamic
    slice, not a reduce-scatter (a GPU backend forms reduce-scatter from the same program). If this fails, XLA:CPU
    has learned to form reduce-scatter and the note in jonebit.train.zero can be updated."""
    w = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh(), P()))
    x = jax.device_put(jnp.ones((16, 64)), NamedSharding(mesh(), P("data")))

    @jax.jit
    def grads(w, x):
        g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
        return jax.sharding.reshard(g, NamedSharding(mesh(), P("data")))

    hlo = grads.lower(w, x).compile().as_text()
    ops = [c.op for c in comm_report(hlo, N).always]
    assert "all-reduce" in ops and "reduce-scatter" not in ops
    # The whole gradient (64 x 32; XLA may transpose its layout) is all-reduced ...
    assert [int(np.prod(shape)) for shape in _all_reduce_shapes(hlo)] == [64 * 32]
    assert "dynamic-slice" in hlo                  # ... and each device then slices its shard


def test_stage_3_gathers_parameters_once():
    _, report = compiled_report("adamw", 3)
    gathers = sum(c.result_bytes for c in report.always if c.op == "all-gather")
    # Every parameter is gathered for compute once (the forward keeps the gathered copies for the backward).
    assert gathers == sum(_grad_bytes())


def test_gradients_of_make_zero_grads_are_the_reference_mean():
    """The reduced gradients (stage 2: reduce-scatter into shards; stage 3: from sharded params) equal the
    single-device gradient of the whole batch, and come out in the grads layout."""
    batch = batches()[0]
    ref_loss, ref = jax.jit(jax.value_and_grad(loss_fn))(jax.device_put(init_params(), jax.devices()[0]), batch)
    ref = jax.device_get(ref)
    tx = optax.adamw(1e-3)
    for stage in (2, 3):
        params, _, sh = init_zero(tx, init_params(), mesh(), stage=stage)
        # make_zero_grads is the raw shard_map: the batch must already be split over the data axis.
        sharded = jax.device_put(batch, NamedSharding(mesh(), P("data")))
        grads, loss = jax.jit(make_zero_grads(loss_fn, mesh(), sh))(params, sharded)
        assert max_abs_diff(grads, ref) < 1e-6
        assert float(loss) == pytest.approx(float(ref_loss), abs=1e-5)
        for g, planned in zip(jax.tree.leaves(grads), jax.tree.leaves(sh.grads), strict=True):
            assert spec_tuple(g.sharding.spec) == spec_tuple(planned.spec) == _expected(g.shape, True)


# ----------------------------------------------------------------------------------------------------------------
# Offload errors, mixed precision, donation.

class _Memory:
    def __init__(self, kind):
        self.kind = kind


def test_offload_error_when_backend_has_no_pinned_host(monkeypatch):
    """Devices that offer only device memory (as some backends do): init_zero refuses offload, clearly."""
    monkeypatch.setattr(type(jax.devices()[0]), "addressable_memories", lambda self: [_Memory("device")])
    with pytest.raises(ValueError, match=r"offload_optimizer=True needs host memory \('pinned_host'\)"):
        init_zero(optax.adamw(1e-3), init_params(), mesh(), stage=1, offload_optimizer=True)
    with pytest.raises(ValueError, match="pinned_host"):
        abstract_zero(optax.adamw(1e-3), init_params(), mesh(), stage=3, offload_optimizer=True)


def test_cpu_backend_offers_pinned_host():
    """Why the offload runs above: XLA:CPU devices expose pinned_host memory (it saves nothing there)."""
    assert "pinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()}


@functools.cache
def master_run(stage: int):
    tx = OPTIMIZERS["adamw"]()
    bf16 = jax.tree.map(lambda p: jnp.asarray(p, jnp.bfloat16), init_params())
    params, state, sh = init_zero(tx, bf16, mesh(), stage=stage, master_dtype=jnp.float32)
    step = make_zero_step(loss_fn, tx, mesh(), sh)
    losses = []
    for batch in batches():
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return params, state, sh, np.array(losses)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_master_weights_mixed_precision(stage):
    """bf16 params, fp32 master copy in the optimizer state.

    Tolerances: the forward/backward run in bf16 (8-bit mantissa), so losses differ from the fp32 run by up to
    ~0.05 per step here; Adam normalises each update to ~lr, so the bf16 gradient noise moves individual
    entries by up to ~lr per step (max |master - fp32| < 20 * lr = 0.06) while the parameter tree as a whole
    stays within 10% (relative L2) of the fp32 run's change from the initial values.
    """
    params, state, sh, losses = master_run(stage)
    ref_params, ref_losses = reference("adamw")
    assert isinstance(state, MasterWeightsState)
    assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    assert {m.dtype for m in jax.tree.leaves(state.master)} == {jnp.dtype(jnp.float32)}
    # Adam's moments are kept for the fp32 master.
    assert {m.dtype for m in jax.tree.leaves(state.inner[0].mu)} == {jnp.dtype(jnp.float32)}
    # Params are exactly the cast of the master weights.
    for p, m in zip(jax.tree.leaves(jax.device_get(params)), jax.tree.leaves(jax.device_get(state.master)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(p), np.asarray(m).astype(jnp.bfloat16))
    # Trains, and stays close to the fp32 run.
    assert losses[-1] < losses[0] - 0.5
    np.testing.assert_allclose(losses, ref_losses, atol=0.05, rtol=0)
    assert max_abs_diff(state.master, ref_params) < 20 * 3e-3
    flat = lambda t: np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in jax.tree.leaves(t)])  # noqa: E731
    moved = flat(ref_params) - flat(init_params())
    assert np.linalg.norm(flat(jax.device_get(state.master)) - flat(ref_params)) < 0.1 * np.linalg.norm(moved)
    # The master copy is partitioned like optimizer state at stage >= 1, the params by the stage.
    for m in jax.tree.leaves(state.master):
        assert spec_tuple(m.sharding.spec) == _expected(m.shape, stage >= 1)
        assert m.addressable_shards[0].data.size == (m.size // N if stage >= 1 else m.size)
    for p in jax.tree.leaves(params):
        assert spec_tuple(p.sharding.spec) == _expected(p.shape, stage >= 3)
    # The stages agree with each other far more closely than with the fp32 run.
    if stage:
        _, state0, _, losses0 = master_run(0)
        assert max_abs_diff(state.master, state0.master) < STAGE_ATOL
        np.testing.assert_allclose(losses, losses0, atol=1e-6, rtol=0)


def test_callers_params_survive_donation():
    """init_zero copies: the step donates its inputs, the caller's arrays stay alive, also when they are
    committed to one device (which init_zero failed to place before its device_put-then-copy fix)."""
    tx = OPTIMIZERS["adamw"]()
    mine = jax.device_put(init_params(), jax.devices()[0])
    snapshot = jax.device_get(mine)
    for stage in (0, 3):
        step = zero_run("adamw", stage, False)[-1]  # same layouts, so the compiled step is reused
        params, state, _ = init_zero(tx, mine, mesh(), stage=stage)
        new_params, _, _ = step(params, state, batches()[0])
        assert all(p.is_deleted() for p in jax.tree.leaves(params))  # donation does happen
        assert not any(p.is_deleted() for p in jax.tree.leaves(mine))
        assert max_abs_diff(mine, snapshot) == 0.0
        assert max_abs_diff(new_params, snapshot) > 0.0
    # Uncommitted host arrays too.
    host = init_params()
    params, state, _ = init_zero(tx, host, mesh(), stage=1)
    zero_run("adamw", 1, False)[-1](params, state, batches()[0])
    assert max_abs_diff(host, snapshot) == 0.0


def test_batch_not_divisible_by_devices_is_rejected():
    tx = optax.adamw(1e-3)
    params, state, sh = init_zero(tx, init_params(), mesh(), stage=2)
    step = make_zero_step(loss_fn, tx, mesh(), sh, donate=False)
    with pytest.raises(ValueError, match=r"make_zero_step's step: batch has shape \(12, 17\); its dimension 0 "
                                         r"\(12\) must be divisible by the 8 devices of mesh axis 'data'"):
        step(params, state, batches()[0][:12])


# ----------------------------------------------------------------------------------------------------------------
# A non-finite gradient on one rank: the step is skipped on every rank.

def _lin_params():
    rng = np.random.default_rng(1)
    return {"w": rng.normal(size=(16, 8)).astype(np.float32), "b": np.zeros(8, np.float32)}


def _lin_loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def _lin_batch(seed: int, nan_row: int | None = None):
    rng = np.random.default_rng(seed)
    b = {"x": rng.normal(size=(BATCH, 16)).astype(np.float32), "y": rng.normal(size=(BATCH, 8)).astype(np.float32)}
    if nan_row is not None:
        b["x"][nan_row, 3] = np.nan  # row 6 of 16: the shard of rank 3 only
    return b


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(jax.device_get(tree))]


NAN_CASES = {  # id -> (optimizer, stage, offload)
    "adamw-0": ("adamw", 0, False), "adamw-1": ("adamw", 1, False), "adamw-2": ("adamw", 2, False),
    "adamw-3": ("adamw", 3, False), "adamw-1-offload": ("adamw", 1, True), "clip_adamw-2": ("clip_adamw", 2, False),
    "onebit-1": ("onebit", 1, False), "onebit-2": ("onebit", 2, False), "onebit-3": ("onebit", 3, False),
}


@pytest.mark.parametrize("case", list(NAN_CASES))
def test_nonfinite_gradient_on_one_rank_skips_the_step_everywhere(case):
    """A NaN in one rank's batch: params and optimizer state come back bit for bit, and the following good steps
    give exactly what a run that never saw the bad batch gives (1-bit: past its freeze step, compressing)."""
    import jonebit

    opt, stage, offload = NAN_CASES[case]
    tx = jonebit.onebit_adam_zero(1e-2, freeze_step=2, stage=stage) if opt == "onebit" else OPTIMIZERS[opt]()
    params, state, sh = init_zero(tx, _lin_params(), mesh(), stage=stage, offload_optimizer=offload)
    step = make_zero_step(_lin_loss, tx, mesh(), sh, donate=False)
    clean_p, clean_s = params, state
    for seed in range(4):
        params, state, _ = step(params, state, _lin_batch(seed))
        if seed == 2:  # the bad batch comes after 3 good steps (1-bit: in the compression stage)
            before = _bits((params, state))
            params, state, loss = step(params, state, _lin_batch(99, nan_row=6))
            assert np.isnan(float(loss))
            assert _bits((params, state)) == before
    for seed in range(4):
        clean_p, clean_s, _ = step(clean_p, clean_s, _lin_batch(seed))
    assert _bits((params, state)) == _bits((clean_p, clean_s))
    tree = params.tree() if hasattr(params, "tree") else params  # 1-bit stage 3: FlatParams
    assert np.all(np.isfinite(np.asarray(tree["w"])))
    assert max_abs_diff(tree, _lin_params()) > 0.0  # the good steps did move the parameters
