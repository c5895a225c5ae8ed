"""Fixed trajectories of every optimizer of the 1-bit family, recorded once and replayed bit for bit.

Each case builds an optimizer (at its defaults, at DeepSpeed-exact settings, with each option the family has) and
runs it for ``STEPS`` updates on 4 simulated devices over a fixed sequence of per-rank gradients: the gradients are
inputs, not computed, so nothing but the optimizer (and, for the ZeRO cases, the step builder around it) decides
the result. The recording holds the parameters after every step and the optimizer's own state at the end.

Replaying a case must give the recording exactly: code that only moves the optimizer's pieces around (one step
pipeline, research options set apart, the state's phases by name) must not change one bit of what it computes.

Both run at XLA's default optimisation level, with its CPU code generation capped at SSE4.2 (``XLA_FLAGS``, see
:data:`XLA_FLAGS`). With the host's AVX2/FMA, LLVM contracts ``a * b + c`` into a fused multiply-add where the loop's
shape allows it (a vectorised body, not the remainder elements), so two programs that state the same arithmetic but
fuse differently can round one element differently (measured: 1 ulp in one of 1,980 values, in one case). Without FMA
every elementwise operation is IEEE-rounded as written, and a 128-bit vector width is the same on every x86 machine,
so the comparison is exact by construction. Record only from code whose behaviour is the reference::

    python -m tests.transforms.golden_trajectories record   # rewrites tests/transforms/golden_trajectories.npz
    python -m tests.transforms.golden_trajectories check    # replays, prints the mismatches as JSON
    python -m tests.transforms.golden_trajectories check per_phase 0/2   # a program per phase, share 0 of 2
"""

from __future__ import annotations

import os
import pathlib  # noqa: E402
import sys  # noqa: E402

from tests.mpi_util import HANG_GUARD  # noqa: E402  (standard library only: jax is not imported yet)

XLA_FLAGS = f"--xla_force_host_platform_device_count=8 --xla_cpu_max_isa=SSE4_2 {HANG_GUARD}"
if __name__ == "__main__":  # the recording and the replay run as their own process, with these flags
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = XLA_FLAGS
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "0"  # XLA's default level, whatever the caller's (the suite's: -O0)

import json  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jonebit  # noqa: E402
from jonebit.experimental import OneBitAdamOptions  # noqa: E402
from jonebit.transforms.onebit_adam import leaf_errors  # noqa: E402
from jonebit.transforms.phases import jit_per_phase  # noqa: E402

RECORDING = pathlib.Path(__file__).with_suffix(".npz")
WORLD = 4
STEPS = 12
FREEZE = 4
UNSEEN_UNTIL = FREEZE + 2  # embedding rows 8-11 get no gradient before this step: "unseen" at the freeze
NAN_STEP, NAN_RANK = 6, 1


def params0() -> dict:
    rng = np.random.default_rng(0)
    # Sizes 96 + 40 + 5 + 24: several leaves, not multiples of the padding, one of rank 3, rows for row scales.
    return {"emb": rng.standard_normal((12, 8)).astype(np.float32),
            "w": rng.standard_normal((8, 5)).astype(np.float32),
            "b": rng.standard_normal(5).astype(np.float32),
            "k": rng.standard_normal((2, 3, 4)).astype(np.float32)}


def gradients(nan: bool = False) -> list[dict]:
    """``STEPS`` global gradients, each leaf with a leading axis of ``WORLD`` ranks."""
    rng = np.random.default_rng(1)
    out = []
    for t in range(STEPS):
        g = {k: (0.5 + 0.1 * t) * rng.standard_normal((WORLD, *v.shape)).astype(np.float32)
             for k, v in params0().items()}
        if t < UNSEEN_UNTIL:
            g["emb"][:, 8:] = 0.0
        if nan and t == NAN_STEP:
            g["w"][NAN_RANK, 0, 0] = np.nan
        out.append(g)
    return out


def mask() -> dict:
    """An exp_avg_mask in the compact form: rows 10-11 of the embedding masked, no mask on the other leaves."""
    rows = np.ones((12, 1), np.float32)
    rows[10:] = 0.0
    return {"emb": rows, "w": None, "b": None, "k": None}


def schedule(count):
    return 1e-2 * jnp.minimum(1.0, (count + 1) / 3.0)


# Each case: (how the state is carried, a function building the optimizer). "replicated": params identical on all
# ranks, each rank its own gradient; "per_rank": params with a leading rank axis (0/1 Adam's local steps);
# "hierarchical": a 2 x 2 hosts x local mesh; "zero<S>": jonebit.train.zero at ZeRO stage S.
def _adam(skip=False, **kw):
    def build():
        tx = jonebit.onebit_adam(kw.pop("lr", 1e-2), freeze_step=kw.pop("freeze_step", FREEZE), **kw)
        return jonebit.skip_nonfinite(tx) if skip else tx

    return build


def _options(**kw):
    return _adam(experimental=OneBitAdamOptions(**kw.pop("options")), **kw)


def _zero(stage, **kw):
    # Recorded before the ZeRO variant had mask_unseen: DeepSpeed's arithmetic for never-reached elements, as
    # recorded (tests/train/test_onebit_zero.py checks the mask against stage 0's).
    return lambda: jonebit.onebit_adam_zero(1e-2, freeze_step=FREEZE, stage=stage, mask_unseen=False, **kw)


CASES = {
    "onebit_adam/default": ("replicated", _adam()),
    "onebit_adam/deepspeed_fp32": ("replicated", _adam(bias_correction=False, mask_unseen=False)),
    "onebit_adam/deepspeed_fp16": ("replicated", _adam(bias_correction=False, fused=True, mask_unseen=False)),
    "onebit_adam/options": ("replicated", _adam(lr=schedule, weight_decay=0.01, max_grad_norm=2.0,
                                                exp_avg_mask=mask(), b1=0.8, b2=0.99, eps=1e-6)),
    "onebit_adam/fused_options": ("replicated", _adam(weight_decay=0.01, max_grad_norm=2.0, exp_avg_mask=mask(),
                                                      fused=True)),
    "onebit_adam/nonfinite_skip": ("replicated_nan", _adam(skip=True)),
    "onebit_adam/auto_freeze": ("replicated", _adam(freeze_step=jonebit.AutoFreeze(
        min_step=2, max_step=8, check_every=1, threshold=0.5, patience=1))),
    "onebit_adam/hierarchical": ("hierarchical", _adam(axis_name=("hosts", "local"))),
    "onebit_adam/hierarchical_fused": ("hierarchical", _adam(axis_name=("hosts", "local"), fused=True)),
    "onebit_adam/row_scales": ("replicated", _options(options=dict(row_scales=True))),
    "onebit_adam/preconditioned_clip_ratio": ("replicated", _options(options=dict(preconditioned=True,
                                                                                  clip_ratio=2.0))),
    "onebit_adam/variance_refresh": ("replicated", _options(options=dict(variance_refresh=3), max_grad_norm=2.0)),
    "onebit_adam/local_clip": ("replicated", _options(options=dict(local_clip=True), max_grad_norm=2.0)),
    "onebit_adam/no_error_feedback": ("replicated", _options(options=dict(error_feedback=False))),
    "onebit_adam/zero1": ("zero1", _zero(1, weight_decay=0.01)),
    "onebit_adam/zero2_fused": ("zero2", _zero(2, fused=True, exp_avg_mask=mask())),
    "onebit_adam/zero3": ("zero3", _zero(3, weight_decay=0.01)),
    "zero_one_adam/default": ("per_rank", lambda: jonebit.zero_one_adam(
        1e-2, var_freeze_step=6, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4)),
    "zero_one_adam/deepspeed": ("per_rank", lambda: jonebit.zero_one_adam(
        1e-2, var_freeze_step=6, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4, mask_unseen=False)),
    "zero_one_adam/options": ("per_rank", lambda: jonebit.zero_one_adam(
        schedule, var_freeze_step=5, var_update_scaler=1, local_step_scaler=2, local_step_clipper=2,
        weight_decay=0.01, bias_correction=True, fused=False, exp_avg_mask=mask())),
    "onebit_lamb/default": ("replicated", lambda: jonebit.onebit_lamb(1e-2, freeze_step=FREEZE)),
    "onebit_lamb/deepspeed": ("replicated", lambda: jonebit.onebit_lamb(1e-2, freeze_step=FREEZE, mask_unseen=False)),
    "onebit_lamb/options": ("replicated", lambda: jonebit.onebit_lamb(
        schedule, freeze_step=FREEZE, weight_decay=0.01, exp_avg_mask=mask(), max_coeff=2.0, factor_threshold=0.2)),
}

# The optimizer's own state: the first node of one of these types in the state tree (optax.chain nests them).
STATE_TYPES = ("OneBitAdamState", "OneBitAdamZeroState", "ZeroOneAdamState", "OneBitLambState")
NOT_RECORDED = ("skipped", "stage")  # counters that a wrapper may own instead; the layout's static stage
# Fields added since the recording (layout, not arithmetic): the index of the phase the last update ran, and of
# the phase the next one runs.
ADDED = ("state/phase", "state/next_phase")
# Per-leaf error buffers kept since the recording as one stacked array per group of equal-size leaves (layout, not
# arithmetic): compared per leaf, as recorded. The ZeRO variant's tuple of groups is its own, older layout.
STACKED_ERRORS = {name: ("OneBitAdamState", "ZeroOneAdamState") for name in ("worker_error", "server_error")}


def optimizer_fields(state) -> dict[str, np.ndarray]:
    """``{"field/leaf path": array}`` of the optimizer's own state, found by type name anywhere in ``state``."""
    nodes = [n for n in jax.tree.leaves(state, is_leaf=lambda n: type(n).__name__ in STATE_TYPES)
             if type(n).__name__ in STATE_TYPES]
    if len(nodes) != 1:
        raise ValueError(f"expected one 1-bit family state in the tree, found {len(nodes)}")
    node = nodes[0]
    names = node._fields if hasattr(node, "_fields") else [f for f in vars(node) if not f.startswith("_")]
    out = {}
    for name in names:
        if name in NOT_RECORDED:
            continue
        value = getattr(node, name)
        if name in STACKED_ERRORS and type(node).__name__ in STACKED_ERRORS[name]:
            value = leaf_errors(value, params0())  # layout since the recording: stacked per group of equal sizes
        for path, leaf in jax.tree_util.tree_leaves_with_path(value):
            out[f"{name}{jax.tree_util.keystr(path)}"] = np.asarray(jax.device_get(leaf))
    return out


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(jax.device_get(tree))])


def _stepper(tx, mesh, specs, axes, per_rank: bool, per_phase: bool):
    rows = P(axes)
    pspec = rows if per_rank else P()

    @jax.shard_map(mesh=mesh, in_specs=(pspec, specs, rows), out_specs=(pspec, specs))
    def body(params, state, grads):
        grads = jax.tree.map(lambda g: g[0], grads)
        local = jax.tree.map(lambda p: p[0], params) if per_rank else params
        updates, state = tx.update(grads, state, local)
        new = optax.apply_updates(local, updates)
        return (jax.tree.map(lambda p: p[None], new) if per_rank else new), state

    return jit_per_phase(body, per_phase=per_phase)


def run(name: str, per_phase: bool = False) -> dict[str, np.ndarray]:
    """Runs one case: ``{"params": (STEPS, n) after each step, "state/<field>": the final state}``, as one program
    with every phase (how the recording was made) or as a program per phase picked on the host (``per_phase``,
    what jonebit's step builders run)."""
    kind, build = CASES[name]
    tx = build()
    grads = gradients(nan=kind == "replicated_nan")
    devices = jax.devices()[:WORLD]
    trajectory = []
    if kind.startswith("zero"):
        from jonebit.train.zero import init_zero, make_zero_step

        mesh = jax.make_mesh((WORLD,), ("data",), axis_types=(AxisType.Explicit,), devices=devices)
        params, state, shardings = init_zero(tx, params0(), mesh, stage=int(kind[-1]))

        def loss_fn(p, batch):  # linear: the gradient is the batch row itself, exactly
            return sum(jnp.sum(p[k] * batch[k][0]) for k in p)

        step = make_zero_step(loss_fn, tx, mesh, shardings, per_phase=per_phase)
        for g in grads:
            params, state, _ = step(params, state, jax.device_put(g, NamedSharding(mesh, P("data"))))
            trajectory.append(_flat(params.tree() if hasattr(params, "tree") else params))
    else:
        if kind == "hierarchical":
            mesh = jax.make_mesh((2, 2), ("hosts", "local"), axis_types=(AxisType.Explicit,) * 2, devices=devices)
            axes = ("hosts", "local")
        else:
            mesh = jax.make_mesh((WORLD,), ("data",), axis_types=(AxisType.Explicit,), devices=devices)
            axes = "data"
        per_rank = kind == "per_rank"
        state, specs = jonebit.sharded_init(tx, params0(), mesh, axis_name=axes)
        step = _stepper(tx, mesh, specs, axes, per_rank, per_phase)
        p = params0()
        if per_rank:
            p = {k: np.stack([v] * WORLD) for k, v in p.items()}
        params = jax.device_put(p, NamedSharding(mesh, P(axes) if per_rank else P()))
        for g in grads:
            params, state = step(params, state, jax.device_put(g, NamedSharding(mesh, P(axes))))
            trajectory.append(_flat(params))
    out = {"params": np.stack(trajectory)}
    out.update({f"state/{k}": v for k, v in optimizer_fields(state).items()})
    return out


def record() -> None:
    arrays = {}
    for name in CASES:
        for key, value in run(name).items():
            arrays[f"{name}:{key}"] = value
        print(f"recorded {name}")
    np.savez_compressed(RECORDING, **arrays)
    print(f"wrote {RECORDING} ({RECORDING.stat().st_size / 1e3:.0f} kB)")


def recorded(name: str) -> dict[str, np.ndarray]:
    with np.load(RECORDING) as data:
        prefix = f"{name}:"
        return {k[len(prefix):]: data[k] for k in data.files if k.startswith(prefix)}


def share(part: int, parts: int) -> list[str]:
    """The cases of share ``part`` (0 to ``parts`` - 1) of ``parts`` interleaved shares (the suite replays each in a
    process of its own)."""
    if not 0 <= part < parts:
        raise ValueError(f"share {part}/{parts}: the share must be 0 to {parts - 1}")
    return list(CASES)[part::parts]


def check(per_phase: bool = False, names=tuple(CASES)) -> list[tuple[str, str, int]]:
    """Replays the cases ``names``, in the form ``per_phase`` says (see :func:`run`): ``(case, key, mismatched
    elements)`` for each array that differs from the recording, and ``(case, key, -1)`` for a key present on one
    side only (other than :data:`ADDED`)."""
    bad = []
    for name in names:
        want, got = recorded(name), run(name, per_phase)
        for key in sorted((set(got) ^ set(want)) - set(ADDED)):
            bad.append((name, key, -1))
        for key in sorted(set(want) & set(got)):
            a, b = np.asarray(got[key]), np.asarray(want[key])
            if a.shape != b.shape or not np.array_equal(a, b):
                bad.append((name, key, int(a.size if a.shape != b.shape else np.sum(a != b))))
    return bad


if __name__ == "__main__":
    if sys.argv[1:] == ["record"]:
        record()
    elif sys.argv[1:2] == ["check"] and all(a == "per_phase" or re.fullmatch(r"\d+/\d+", a) for a in sys.argv[2:]):
        # check [per_phase] [K/N]: share K (from 0) of N interleaved shares of the cases (all of them without one)
        shares = [tuple(map(int, a.split("/"))) for a in sys.argv[2:] if a != "per_phase"]
        names = share(*shares[0]) if shares else list(CASES)
        print(json.dumps({"cases": names, "mismatches": check("per_phase" in sys.argv[2:], names)}))
    else:
        sys.exit("usage: python -m tests.transforms.golden_trajectories record|check [per_phase] [K/N]")
