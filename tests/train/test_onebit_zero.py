"""1-bit Adam on a real model under ZeRO stages 0-3 through init_zero / make_zero_step: trajectories, layouts and
the bytes each stage moves (from the compiled HLO, against the spec's formulas)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jonebit
from jonebit.comm import compressed_bytes_per_rank, padded_size
from jonebit.comm.accounting import comm_report
from jonebit.models import tiny_lm
from jonebit.sharding.mesh import data_mesh
from jonebit.train.onebit_zero import FlatParams
from jonebit.train.zero import init_zero, make_zero_step, zero_specs

CFG = tiny_lm.TinyLMConfig(vocab_size=64, seq_len=16, dim=32, heads=2, layers=1)
FREEZE = 3
LR, WEIGHT_DECAY = 1e-2, 0.01


def onebit(stage, learning_rate, **kw):
    """1-bit Adam at ZeRO stage 0, its partitioned variant at stages 1-3."""
    if stage:
        return jonebit.onebit_adam_zero(learning_rate, stage=stage, **kw)
    return jonebit.onebit_adam(learning_rate, **kw)


def setup(stage, *, fused=False, offload=False):
    params0 = tiny_lm.init_params(CFG, jax.random.key(0))
    mesh = data_mesh()
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        onebit(stage, LR, freeze_step=FREEZE, weight_decay=WEIGHT_DECAY, fused=fused),
    )
    params, state, sh = init_zero(tx, params0, mesh, stage=stage, offload_optimizer=offload)
    step = make_zero_step(functools.partial(tiny_lm.loss_fn, cfg=CFG), tx, mesh, sh)
    return params0, params, state, sh, step


def batches(n):
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.integers(0, CFG.vocab_size, (16, CFG.seq_len + 1))) for _ in range(n)]


def trained(stage, steps, **kw):
    """Parameters after every step (a list of float64 leaves, flattened), the final state and the losses."""
    _, params, state, sh, step = setup(stage, **kw)
    losses, trees = [], []
    for b in batches(steps):
        params, state, loss = step(params, state, b)
        losses.append(float(loss))
        tree = jax.device_get(params.tree() if isinstance(params, FlatParams) else params)
        trees.append([np.ravel(x).astype(np.float64) for x in jax.tree.leaves(tree)])
    return trees, state, losses


@pytest.fixture(scope="module")
def stage0():
    return trained(0, FREEZE + 1)


@pytest.mark.parametrize("stage,offload", [(1, False), (2, False), (3, False), (3, True)])
def test_trajectory_matches_stage0(stage0, stage, offload):
    """Stages 1-3 follow stage 0 through warmup and the first compression step.

    The programs differ only in the order of the gradient's sums (allreduce vs reduce-scatter): relative
    differences of a few float32 ulps (u = 6e-8) per step. Warmup is Adam, smooth in the gradient, so the
    parameters agree elementwise to 1e-4 relative + 2e-5 absolute (steps are up to a few lr = 1e-2, so that is
    ~1e-3 of a step: room for ulp-level differences amplified a thousandfold).

    A 1-bit step is not smooth. Its update is -lr (sign(x) * s / (sqrt(v) + eps) + wd p), s one scale per leaf.
    A coordinate whose compressed value sits within rounding of zero takes +s in one program and -s in the other
    (at the server a whole sign pattern of the 8 ranks, 1/256 of the coordinates, ties when two partial sums of rank
    scales agree to rounding). So after the compression step the test asserts what flips cannot change, on the sign
    part u = step + lr wd p:
    - per leaf, the median ratio |u_got| / |u_want| (the ratio of the two scales, norms over the whole leaf) is 1 to
      1e-3; a wrong scale formula (the mean |x| for the RMS) is off by ~20%;
    - each coordinate takes either the same step or the mirrored one, to 1% of its size: 1 / sqrt(v) carries the
      relative error of the frozen variance, which for a gradient that cancels to a small fraction of its terms'
      sizes is the sums' rounding amplified by that cancellation (measured up to 1.1e-3 here, at the largest steps,
      where v is smallest); warmup cannot show it, since Adam's m / sqrt(v) is invariant to the gradient's scale;
    - mirrored coordinates are few: <= 2% overall, a handful of sign patterns.
    """
    want, _, want_losses = stage0
    got, state, losses = trained(stage, FREEZE + 1, offload=offload)
    # Every loss is computed before its step's update, so all of them come from warmup parameters.
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    warm = FREEZE - 1  # parameters after the last warmup step
    flipped = total = 0
    for leaf, (w0, w1, g0, g1) in enumerate(zip(want[warm], want[-1], got[warm], got[-1], strict=True)):
        np.testing.assert_allclose(g0, w0, rtol=1e-4, atol=2e-5, err_msg=f"leaf {leaf} after warmup")
        u_want, u_got = w1 - w0 + LR * WEIGHT_DECAY * w0, g1 - g0 + LR * WEIGHT_DECAY * g0
        flipped += mirrored_steps(u_want, u_got, floor=2e-5, what=f"leaf {leaf}")
        total += u_want.size
    assert flipped <= 0.02 * total, f"{flipped} of {total} coordinates took the mirrored compressed step"
    if offload:
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state)}
        assert kinds == {"pinned_host"}


def mirrored_steps(u_want, u_got, *, floor: float, what: str) -> int:
    """The invariants of one compression step's sign part ``u`` in two programs (see
    :func:`test_trajectory_matches_stage0`): most coordinates moved (``|u| > floor``), the median ratio of the step
    sizes 1 to 1e-3, every coordinate the same step or the mirrored one to ``floor`` + 1% of its size. Returns how
    many took the mirrored one."""
    moved = np.abs(u_want) > floor
    assert moved.mean() > 0.9, f"{what}: the compression step left most coordinates in place"
    rho = np.median(np.abs(u_got[moved]) / np.abs(u_want[moved]))
    assert abs(rho - 1) <= 1e-3, f"{what}: scale ratio {rho}"
    tol = floor + 1e-2 * np.abs(u_want)
    same, mirrored = np.abs(u_got - u_want) <= tol, np.abs(u_got + u_want) <= tol
    assert np.all(same | mirrored), f"{what}: {np.sum(~(same | mirrored))} coordinates took another step"
    return int(np.sum(mirrored & ~same))


def test_stage3_params_are_server_chunks():
    params0, params, state, sh, step = setup(3)
    assert isinstance(params, FlatParams)
    leaves = jax.tree.leaves(params0)
    assert len(params.chunks) == len(leaves)  # fused=False: one buffer per leaf
    for c, leaf in zip(params.chunks, leaves, strict=True):
        n_pad = padded_size(leaf.size, 8)
        assert c.shape == (8, n_pad // 8) and c.sharding.spec == P("data")
        assert c.addressable_shards[0].data.shape == (1, n_pad // 8)
        np.testing.assert_array_equal(np.asarray(c).reshape(-1)[: leaf.size], np.asarray(leaf).ravel())
        assert not np.asarray(c).reshape(-1)[leaf.size:].any()
    # Training keeps the layout.
    params, state, _ = step(params, state, batches(1)[0])
    assert all(c.sharding.spec == P("data") for c in params.chunks)


def _report(stage):
    _, params, state, _, step = setup(stage, fused=True)
    return comm_report(step.lower(params, state, batches(1)[0]).compile().as_text(), 8)


def test_bytes_per_stage_from_hlo():
    params0 = tiny_lm.init_params(CFG, jax.random.key(0))
    n = sum(x.size for x in jax.tree.leaves(params0))
    n_pad = padded_size(n, 8)
    compressed = compressed_bytes_per_rank(n, 8)
    scalars = 2 * (2 * 7 / 8 * 4)  # two 4-byte all-reduces: the loss pmean and the non-finite flag's norm
    allreduce = 2 * 7 / 8 * 4 * n  # the fp32 ring allreduce stage 0's warmup sends
    gather = lambda m: 7 / 8 * 4 * m  # noqa: E731

    r0 = _report(0).phase_bytes(jonebit.OneBitAdamState.PHASES)  # warmup, compression
    assert r0["compression"] == pytest.approx(compressed + scalars)
    assert r0["warmup"] == pytest.approx(allreduce + scalars)
    zero_phases = jonebit.OneBitAdamZeroState.PHASES
    assert zero_phases == ("warmup", "first_compression", "compression")
    for stage in (1, 2, 3):
        report = _report(stage)
        r = report.phase_bytes(zero_phases)
        param_gather = gather(n_pad) if stage == 3 else 0.0
        # Steady compression: exactly stage 0's compressed bytes (+ ZeRO-3's own parameter gather).
        assert r["compression"] == pytest.approx(compressed + scalars + param_gather)
        assert "all-reduce" not in [c.op for c in report.branches[0][zero_phases.index("compression")]]
        # Warmup: reduce-scatter of the padded gradient (+ the all-gather of the updated chunks at stages 1, 2).
        warm = {1: 7 / 8 * 4 * n_pad + gather(n_pad), 2: 7 / 8 * 4 * n_pad + gather(n_pad), 3: 7 / 8 * 4 * n_pad}
        assert r["warmup"] == pytest.approx(warm[stage] + scalars + param_gather)
        # One-off at the first compression step: the float32 momentum (and, with replicated params, the variance;
        # with partitioned params the packed bits of where it is > 0, mask_unseen's, one per element).
        once = gather(n_pad) + (gather(n_pad / 32) if stage == 3 else gather(n_pad))
        assert r["first_compression"] == pytest.approx(compressed + once + scalars + param_gather)
    # Stages 1 and 2's warmup moves what stage 0's allreduce moves (reduce-scatter + all-gather), up to padding
    # (stage 1 used to all-reduce, then slice: 1.5 times as many bytes).
    for stage in (1, 2):
        warmup = _report(stage).phase_bytes(zero_phases)["warmup"]
        assert warmup == pytest.approx(r0["warmup"] * n_pad / n, rel=1e-6)
    assert "reduce-scatter" in [c.op for c in _report(1).branches[0][zero_phases.index("warmup")]]


def test_zero_shardings_keep_onebit_layouts():
    params0 = tiny_lm.init_params(CFG, jax.random.key(0))
    mesh = data_mesh()
    from jonebit.train.onebit_zero import local_abstract_state

    for stage in (0, 2):
        tx = onebit(stage, 1e-2, freeze_step=2)
        local = local_abstract_state(tx, params0, mesh)
        # The ZeRO rule must not touch 1-bit states: their layout is the transform's.
        _, _, specs = zero_specs(mesh, params0, local, stage=3)
        assert specs == jonebit.state_specs(local, "data")


def test_stage_mismatch_and_master_weights_are_refused():
    params0 = tiny_lm.init_params(CFG, jax.random.key(0))
    mesh = data_mesh()
    tx = jonebit.onebit_adam_zero(1e-2, freeze_step=2, stage=2)
    with pytest.raises(ValueError, match="stage=3"):
        init_zero(tx, params0, mesh, stage=3)
    with pytest.raises(ValueError, match="master_dtype"):
        init_zero(tx, params0, mesh, stage=2, master_dtype=jnp.float32)


def _unseen_run(stage: int, steps: int, **kw):
    """An embedding whose rows 32-63 no token ever selects (their gradient is exactly 0) and a dense read-out, trained
    by 1-bit Adam at ``stage``; the parameters after every step."""
    r = np.random.default_rng(0)
    params0 = {"embed": jnp.asarray(r.normal(size=(64, 16)), jnp.float32),
               "out": jnp.asarray(r.normal(size=(16, 8)) / 4, jnp.float32)}

    def loss_fn(p, batch):
        return jnp.mean((p["embed"][batch[:, 0]] @ p["out"] - jnp.sin(batch[:, 1:2].astype(jnp.float32))) ** 2)

    tx = onebit(stage, LR, freeze_step=FREEZE, weight_decay=WEIGHT_DECAY, **kw)
    params, state, sh = init_zero(tx, params0, data_mesh(), stage=stage)
    step = make_zero_step(loss_fn, tx, data_mesh(), sh)
    trees = []
    for t in range(steps):
        # Rows 0-31 in turn: each is selected during warmup (a row first selected later would be unseen too).
        batch = jnp.asarray(np.stack([(np.arange(16) + 16 * t) % 32, r.integers(0, 8, 16)], axis=1), jnp.int32)
        params, state, _ = step(params, state, batch)
        tree = jax.device_get(params.tree() if isinstance(params, FlatParams) else params)
        trees.append({k: np.asarray(v, np.float64) for k, v in tree.items()})
    return {k: np.asarray(v, np.float64) for k, v in params0.items()}, trees


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_mask_unseen_leaves_elements_no_gradient_reached_to_weight_decay(stage):
    """``mask_unseen`` (the default) at stages 1-3 as at stage 0: elements whose frozen variance is 0 keep a zero
    momentum through the compression steps, so their update is weight decay alone, p_k = p_0 (1 - lr wd)^k; each
    float32 step rounds twice (the decay's product and the sum), so after k steps the relative error is at most
    2 k 2^-24 (7e-7 for k = 5). The other elements follow stage 0 by the invariants of a 1-bit step between two
    programs (:func:`mirrored_steps`) in the second compression step, whose compensated buffer holds the decoded
    momentum the worker masks (unmasked, it would carry those rows' share of the scale: the scale ratio moves).
    With ``mask_unseen=False`` (DeepSpeed's arithmetic) the same rows move by about lr x scale / eps."""
    steps = FREEZE + 2
    p0, want = _unseen_run(0, steps)
    _, got = _unseen_run(stage, steps)
    decay = p0["embed"][32:] * (1 - LR * WEIGHT_DECAY) ** steps
    np.testing.assert_allclose(got[-1]["embed"][32:], decay, rtol=2 * steps * 2.0 ** -24)
    np.testing.assert_allclose(want[-1]["embed"][32:], decay, rtol=2 * steps * 2.0 ** -24)  # stage 0 alike
    flipped = total = 0
    for key in ("embed", "out"):
        seen = slice(0, 32) if key == "embed" else slice(None)
        w0, w1, g0, g1 = (t[key][seen] for t in (want[-2], want[-1], got[-2], got[-1]))
        u_want, u_got = w1 - w0 + LR * WEIGHT_DECAY * w0, g1 - g0 + LR * WEIGHT_DECAY * g0
        flipped += mirrored_steps(u_want.ravel(), u_got.ravel(), floor=2e-5, what=key)
        total += u_want.size
    assert flipped <= 0.02 * total
    if stage == 3:
        _, deepspeed = _unseen_run(3, steps, mask_unseen=False)
        assert np.abs(deepspeed[-1]["embed"][32:] - decay).max() > 1e3 * LR
