"""1-bit Adam as an optax ``GradientTransformation``.

Two stages, switched inside one compiled step by ``lax.cond`` on the update count:

* **warmup**, updates ``1 .. freeze_step``: full-precision Adam on the gradient averaged over ranks
  (one mean allreduce per step)::

      g = mean_ranks(g_local)
      m = b1 m + (1 - b1) g
      v = b2 v + (1 - b2) g^2

* **compression**, updates ``freeze_step + 1 ..``: the variance is frozen; each rank folds its *local*
  gradient into the momentum, and the momentum is averaged with the error-compensated 1-bit
  :func:`~jonebit.comm.compressed_allreduce` (so it is again identical on all ranks)::

      m = compressed_allreduce(b1 m + (1 - b1) g_local) * mask

In both stages the update is ``-lr (m / (sqrt(v) + eps) + weight_decay p)`` (decoupled weight decay).
Like DeepSpeed there is no bias correction unless ``bias_correction=True``.

A NaN or inf in one rank's gradient would reach every rank through the mean (warmup) or the compressed
allreduce's scales (compression) and stay in the momentum and error buffers for good. So each update first
all-reduces one flag, and when any rank's gradient is not finite every rank skips the update together
(``nonfinite="skip"``: zero updates, state unchanged, ``state.skipped`` counts it) or also raises
(``nonfinite="raise"``).

``init`` and ``update`` run in the per-device view: inside ``jax.shard_map`` over ``axis_name`` (the
usual way), or in each MPI process when ``mpi_comm`` is given. :func:`state_specs` returns the
``PartitionSpec`` tree that carries the state in and out of ``shard_map``: ``m``, ``v`` and the count
are replicated, the error buffers differ per rank and live on a leading device axis.

With ``axis_name=("hosts", "local")`` (a 2-D mesh) the compression is hierarchical
(:mod:`jonebit.comm.hierarchical`): the momentum is averaged over ``local`` in float32, only each local shard is
compressed across ``hosts``, and the packed result is gathered back over ``local``. Warmup, the non-finite flag and
the error buffers' rows span both axes.

References:
  Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence Speed",
  ICML 2021, https://arxiv.org/abs/2102.02888.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.experimental import io_callback
from jax.sharding import PartitionSpec as P

from jonebit.comm.backends import AxisBackend, Backend, as_varying, get_backend, varying_axes
from jonebit.comm.compressed import (
    buffer_padded_size,
    compressed_allreduce_groups,
    compressed_allreduce_rows,
    decode_groups,
    decode_segments,
    padded_size,
    ungroup,
)
from jonebit.comm.hierarchical import (
    HierarchicalBackend,
    check_axis_pair,
    decode_hierarchical,
    error_sizes,
    hierarchical_allreduce_rows_many,
)
from jonebit.sharding.zero import _per_rank_rule, register_per_rank_state
from jonebit.transforms.common import AutoFreeze, auto_freeze_step, mask_leaves, normalise_mask, where_seen
from jonebit.transforms.onebit_zero import (
    ZERO_STAGES,
    FlatLayout,
    OneBitAdamZeroState,
    check_flat_dtypes,
    flat_mask,
    init_zero_state,
    step_scalars,
    zero_state_specs,
    zero_update,
)

log = logging.getLogger(__name__)

ScalarOrSchedule = float | Callable[[jax.Array], jax.Array]


class OneBitAdamState(NamedTuple):
    """State of :func:`onebit_adam`.

    Attributes:
      count: number of updates applied so far (int32 scalar); ``count < freeze_step`` means warmup.
      mu: first moment, float32, like the params; identical on all ranks.
      nu: second moment, float32, like the params; identical on all ranks, frozen after warmup.
      worker_error: this rank's worker error with a leading axis of 1 (global view: one row per rank).
        ``fused=True``: one array ``(1, padded_size(N, P))``; ``fused=False``: a tree like the params.
      server_error: this rank's server error, ``(1, padded_size(n, P) // P)``, same layout as ``worker_error``.
      skipped: updates skipped because some rank's gradient was not finite (int32, replicated; not in ``count``).
      freeze_at: with ``freeze_step="auto"``: the number of warmup updates (int32), the cap until the rule fires and
        then the update it fired on (kept, so a resumed run continues the decision); ``None`` with an int
        ``freeze_step`` (the state is then exactly as before).
      variance_norms: with ``"auto"``: per tensor, ``||v / (1 - b2^t)||`` at the rule's last check; else ``None``.
      calm_checks: with ``"auto"``: consecutive calm checks of the rule (int32); else ``None``.
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    worker_error: Any
    server_error: Any
    skipped: jax.Array
    freeze_at: Any = None
    variance_norms: Any = None
    calm_checks: Any = None


NONFINITE_MODES = ("skip", "raise")


def _is_number(x) -> bool:
    return isinstance(x, int | float | np.number) and not isinstance(x, bool | np.bool_)


def _is_array(x) -> bool:
    return isinstance(x, jax.Array | np.ndarray)


def _check_scalar(name: str, value, *, low: float, high: float = np.inf, open_low: bool = False,
                  open_high: bool = False, schedule: bool = False) -> None:
    """A hyperparameter: a finite number in range, an array (e.g. from ``optax.inject_hyperparams``, not checked),
    or, where ``schedule``, a function of the update count."""
    if _is_number(value):
        if not np.isfinite(value):
            raise ValueError(f"onebit_adam: {name} must be a finite number, got {value}")
        if (value <= low if open_low else value < low) or (value >= high if open_high else value > high):
            bounds = [f"{'>' if open_low else '>='} {low:g}"] + ([f"{'<' if open_high else '<='} {high:g}"]
                                                                  if np.isfinite(high) else [])
            raise ValueError(f"onebit_adam: {name} must be {' and '.join(bounds)}, got {value}")
        return
    if _is_array(value) or (schedule and callable(value)):
        return
    kinds = "a number or a schedule (a function of the update count)" if schedule else "a number"
    raise TypeError(f"onebit_adam: {name} must be {kinds}, got {type(value).__name__} {value!r}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"onebit_adam: {name} must be True or False, got {type(value).__name__} {value!r}")


def _check_float_leaves(tree, what: str) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"onebit_adam: {what} leaf {jax.tree_util.keystr(path)} has dtype {dtype}; only floating-point "
                "leaves can be optimised (keep integer buffers out of the optimised tree, e.g. with optax.masked)"
            )


def _check_nonempty_leaves(params) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if math.prod(leaf.shape) == 0:
            raise ValueError(
                f"onebit_adam: param leaf {jax.tree_util.keystr(path)} has shape {tuple(leaf.shape)}, i.e. no "
                "elements; there is nothing to optimise in it: leave it out of the optimised tree (e.g. with "
                "optax.masked or by filtering the params)"
            )


def _first_mismatch(a, b) -> str | None:
    """Describes the first leaf path at which trees ``a`` and ``b`` differ in presence or shape, or None."""
    la = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(a)}
    lb = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(b)}
    for path in dict.fromkeys([*la, *lb]):
        if path not in lb:
            return f"{path} is only in the gradients"
        if path not in la:
            return f"{path} is missing from the gradients"
        if tuple(np.shape(la[path])) != tuple(np.shape(lb[path])):
            return f"{path} has shape {tuple(np.shape(la[path]))} in the gradients, {tuple(np.shape(lb[path]))} here"
    if jax.tree.structure(a) != jax.tree.structure(b):
        return f"the tree types differ:\n  gradients: {jax.tree.structure(a)}\n  other:     {jax.tree.structure(b)}"
    return None


def _check_matching_grads(grads, other, what: str) -> None:
    problem = _first_mismatch(grads, other)
    if problem is not None:
        raise ValueError(f"onebit_adam: the gradients do not match the {what}: {problem}")


def _row_of(x) -> int | None:
    """The row length of ``row_scales`` compression for a leaf: its last axis when it has two or more."""
    return int(x.shape[-1]) if len(x.shape) >= 2 else None


def _flatten(tree) -> jax.Array:
    leaves = jax.tree.leaves(tree)
    return jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])


def _error_buffers(sizes, backend):
    """Zero worker/server errors, leading axis 1, for buffers of the given lengths."""
    if isinstance(backend, HierarchicalBackend):  # errors of one local shard (see jonebit.comm.hierarchical)
        lengths = lambda n: error_sizes(n, backend.hosts.size, backend.local_size)  # noqa: E731
    else:
        lengths = lambda n: (padded_size(n, backend.size), padded_size(n, backend.size) // backend.size)  # noqa: E731

    def worker(n):
        return jnp.zeros((1, lengths(n)[0]), jnp.float32)

    def server(n):
        return jnp.zeros((1, lengths(n)[1]), jnp.float32)

    return jax.tree.map(worker, sizes), jax.tree.map(server, sizes)


_warned: set = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


def _read_check_vma() -> bool:
    """Whether the enclosing ``shard_map`` type-checks varying axes (``check_vma=True``); public jax config."""
    return bool(jax.config.check_vma)


def _vma_checked(axis_name: str) -> bool:
    """Whether VMA types are tracked here, so already-reduced gradients can be told from local ones.

    Falls back to False (the check is off) with a warning logged once when this jax cannot say.
    """
    try:
        checked = _read_check_vma()
    except AttributeError:
        _warn_once("config", "onebit_adam: this jax has no jax.config.check_vma; the check that refuses "
                   "already all-reduced gradients is off (make sure you cast params with jax.lax.pcast(..., "
                   "to='varying') before jax.grad inside shard_map)")
        return False
    if checked and axis_name not in varying_axes(lax.axis_index(axis_name)):
        # The rank index always varies over its axis: if it does not look so, varying_axes cannot read this
        # jax's types, and checking would refuse every gradient.
        _warn_once("types", "onebit_adam: cannot read varying mesh axes from jax.typeof(x) in this jax; the "
                   "check that refuses already all-reduced gradients is off")
        return False
    return checked


def _mesh_axes(backend) -> tuple[str, ...]:
    """The shard_map mesh axes a backend reduces over (none for MPI)."""
    if isinstance(backend, HierarchicalBackend):
        return backend.axis_name
    if isinstance(backend, AxisBackend):
        return (backend.axis_name,)
    return ()


def _check_local_grads(grads, backend: Backend) -> None:
    """Refuses gradients that are typed as identical on all ranks (already all-reduced)."""
    axes = _mesh_axes(backend)
    if not axes or not _vma_checked(axes[0]):
        return
    name = axes[0] if len(axes) == 1 else axes
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        reduced = [a for a in axes if a not in varying_axes(g)]
        if reduced:
            raise ValueError(
                f"onebit_adam: gradient {jax.tree_util.keystr(path)} is invariant over axis "
                f"{reduced[0]!r}, i.e. already all-reduced. 1-bit Adam needs each rank's local gradient: "
                f"inside shard_map, cast replicated params with jax.lax.pcast(params, {name!r}, "
                "to='varying') before jax.grad (otherwise autodiff inserts a full-precision psum)."
            )


def _local_nonfinite(grads, momentum) -> jax.Array:
    """True if this rank's gradient has a NaN/inf (or an element whose square, which enters the variance,
    overflows) or the momentum it holds is not finite."""
    checks = [jnp.all(jnp.isfinite(jnp.square(g.astype(jnp.float32)))) for g in jax.tree.leaves(grads)]
    checks += [jnp.all(jnp.isfinite(m)) for m in jax.tree.leaves(momentum)]
    return ~jnp.all(jnp.stack(checks))


def _raise_nonfinite(count, mine) -> None:
    raise FloatingPointError(
        f"onebit_adam: non-finite gradient or momentum at update {int(count)} "
        f"({'on this rank' if mine else 'on another rank'}); the update was skipped on all ranks and the optimizer "
        "state left as it was. Look for the cause (learning rate, loss scale, a bad batch), or pass "
        "nonfinite='skip' to skip such steps and carry on (the state's `skipped` counts them)."
    )


def _nonfinite_flag(backend, grads, momentum, mode: str):
    """``(bad, on_skip)``: ``bad`` is True on every rank when any rank's gradient or momentum is not finite (one
    all-reduced int32); ``on_skip()``, called in the step's skip branch, raises on the host when ``mode='raise'``."""
    mine = _local_nonfinite(grads, momentum)
    bad = backend.max(mine.astype(jnp.int32)) > 0

    def on_skip(count):
        if mode == "raise":
            io_callback(_raise_nonfinite, None, count, mine)

    return bad, on_skip


def onebit_adam(
    learning_rate: ScalarOrSchedule,
    *,
    freeze_step: int | str,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    exp_avg_mask: Any = None,
    bias_correction: bool = True,
    fused: bool = False,
    max_grad_norm: float | None = None,
    axis_name: str | tuple[str, str] | None = "data",
    mpi_comm: Any = None,
    error_feedback: bool = True,
    amsgrad: bool = False,
    zero_stage: int | None = None,
    nonfinite: str = "skip",
    auto_freeze: AutoFreeze | None = None,
    mask_unseen: bool = True,
    row_scales: bool = False,
    preconditioned: bool = False,
    clip_ratio: float | None = None,
    variance_refresh: int | None = None,
    local_clip: bool = False,
) -> optax.GradientTransformation:
    r"""1-bit Adam (Tang et al., 2021) with DeepSpeed's semantics.

    Warmup (``count < freeze_step``), with :math:`\bar g` the mean of the ranks' gradients:

    .. math::
      m \leftarrow \beta_1 m + (1-\beta_1)\bar g, \qquad v \leftarrow \beta_2 v + (1-\beta_2)\bar g^2

    Compression (afterwards), with :math:`C` the error-compensated 1-bit allreduce and :math:`M` the mask:

    .. math::
      m \leftarrow M \odot C\big(\beta_1 m + (1-\beta_1) g_{\mathrm{local}}\big), \qquad v \text{ frozen}

    Update in both stages: :math:`u = -\eta_t\,(m / (\sqrt{v} + \epsilon) + \lambda p)`.

    Args:
      learning_rate: a float or an optax schedule of the update count (0-based).
      freeze_step: number of full-precision Adam updates before the variance is frozen and compression
        starts (>= 1). DeepSpeed's ``freeze_step=F`` gives ``F - 1`` real Adam updates, because its first
        ``step()`` only initialises; to reproduce a DeepSpeed config pass ``F - 1``. ``"auto"``: switch when the
        variance has settled, by the rule of ``auto_freeze`` (:class:`jonebit.AutoFreeze`, the rule 1-bit LAMB
        uses), decided inside the compiled step identically on every rank, logged once and kept in the state
        (``state.freeze_at``; a resumed run continues the decision). ZeRO stage 0 only.
      b1: momentum decay.
      b2: variance decay.
      eps: added to ``sqrt(v)`` (outside the square root).
      weight_decay: decoupled weight decay (AdamW form); needs ``params`` in ``update``.
      exp_avg_mask: optional pytree like the params; the momentum is multiplied by it after each compressed
        allreduce (e.g. to keep BERT's unused position embeddings at exactly zero). A leaf is None (no mask) or
        a bool or 0/1 array with the param's rank whose dimensions are the param's or 1 (``(rows, 1)`` masks
        rows), so the mask need not be as large as the params.
      mask_unseen: in the compression stage, elements whose frozen variance is exactly 0 (no gradient reached
        them during warmup, e.g. embedding rows of tokens not yet seen) keep a zero momentum and get no update
        (default). ``False`` is DeepSpeed's arithmetic: the 1-bit average gives them their chunk's magnitude, which
        the step divides by ``eps`` (fine-tuning MiniLM on SQuAD moved such rows by up to 28 against an
        embedding scale of 0.04). ZeRO stage 0 only (at stages 1-3 the arithmetic is DeepSpeed's).
      row_scales: compress every leaf of rank >= 2 with one scale per row (a vector along its last axis, e.g. one
        token's embedding) instead of one per leaf and chunk, on the worker and the server side alike. A row that
        is small stays small after compression (with one scale per tensor, a rarely seen embedding row gets the
        tensor's typical magnitude, which its small frozen variance then magnifies). Costs ``32 / row`` more
        bytes (8% at a row of 384 floats). Per-leaf compression only (``fused=False``, a single data axis, ZeRO
        stage 0); leaves of rank 0 or 1 keep one scale.
      preconditioned: compress the preconditioned momentum ``m / (sqrt(v / c2) + eps)`` (the update direction, with
        the variance and its correction frozen) and multiply the average back, instead of compressing ``m``. The
        map is fixed after the freeze, so the error feedback works as before, but the compression error is then
        relative to the update instead of the momentum: an element whose frozen variance is far below its chunk's
        (a rare token's embedding) no longer sees the chunk's momentum error divided by its small ``sqrt(v)``.
        Same bytes. ZeRO stage 0 only.
      clip_ratio: in the compression stage, clip each element's ``(m / c1) / (sqrt(v / c2) + eps)`` to
        ``[-clip_ratio, clip_ratio]`` before weight decay. Adam's own ratio never exceeds
        ``(1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2))`` (:func:`adam_ratio_bound`, 7.27 for the default betas), but with
        the variance frozen it is unbounded: an element whose variance was tiny at the freeze (a rare token's
        embedding) takes a huge step when its gradient returns. ``None`` (default): no clipping. ZeRO stage 0.
      variance_refresh: ``K``: every ``K``-th update of the compression stage averages the gradient in float32
        instead (an Adam step with the exact mean, the error buffers kept) and refreshes the variance with it as
        the sample of ``K`` updates: :math:`v \leftarrow \beta_2^K v + (1 - \beta_2^K)\bar g^2`, the bias
        correction advancing to :math:`1 - \beta_2^{t}` at that update :math:`t`. This keeps ``v`` on the scale of
        the gradient, which goes on changing after the freeze (a variance frozen early makes every later step too
        large or too small); with ``K = 1`` on one rank it is Adam. With ``max_grad_norm`` the refresh averages the
        locally clipped gradients, as the compressed updates do. Costs one float32 allreduce per ``K`` updates
        (with ``K = 16`` the compression stage sends about 3x the bytes of plain 1-bit Adam, 11x fewer than Adam).
        ``None`` (default): the variance stays frozen. ZeRO stage 0 only.
      bias_correction: apply Adam's bias correction (default). After freeze_step the variance correction stays
        at its freeze_step value. DeepSpeed's 1-bit Adam has none (it ignores its flag): ``False`` reproduces it.
      fused: ``True`` compresses all leaves as one flat buffer (one collective and one worker scale per step,
        DeepSpeed's fp16 path); ``False`` (default) compresses each leaf separately with its own scales
        (DeepSpeed's fp32 path). One scale for the whole model lets the largest tensors decide the step size of
        all others; per-tensor scales track Adam more closely (``benchmarks/defaults_convergence.py``).
      max_grad_norm: clip the gradient to this global L2 norm before it enters the momentum, where DeepSpeed's
        engine clips: during warmup the gradient averaged over ranks (so every rank clips alike), in the
        compression stage each rank's local gradient (no averaged gradient exists there). ``None``/``0``: no
        clipping. Not available with ``zero_stage >= 1`` (put ``optax.clip_by_global_norm`` in front instead,
        which clips the local gradient in both stages).
      local_clip: with ``max_grad_norm``, clip each rank's local gradient in warmup too, so that both stages
        average gradients of the same scale. DeepSpeed's placement (``False``) changes the scale at the freeze
        whenever the clip binds: a local gradient's norm exceeds the mean's by the noise that averaging removes,
        so after the freeze the clipped gradients are smaller than warmup's (a third of them on a tiny BERT with
        8 ranks), and so is every step, which the frozen variance does not follow.
      axis_name: the ``jax.shard_map`` mesh axis of the data-parallel ranks, or a pair ``(hosts, local)`` of
        axes of a 2-D mesh for hierarchical compression (:mod:`jonebit.comm.hierarchical`): the first is the slow
        inter-host axis, crossed only by 1-bit data, the second the fast axis inside a host, over which the
        momentum is averaged in float32 first (build the mesh with :func:`jonebit.sharding.mesh.hierarchical_mesh`;
        shard the batch and the state's rows over both axes, ``P(("hosts", "local"))``). Stage 0 only
        (``zero_stage=0``, no ``mpi_comm``). Warmup averages over both axes in float32 as usual.
      mpi_comm: an mpi4py communicator; when given, the collectives go through MPI (mpi4jax) instead.
      error_feedback: keep the error buffers (the algorithm). ``False`` is for studying their effect only.
      amsgrad: not supported by 1-bit Adam; ``True`` raises.
      zero_stage: ZeRO partitioning of the optimizer (0-3, default 0, shard_map only). ``1``/``2``: momentum and
        variance partitioned during warmup, the synchronised momentum kept as packed signs, the frozen variance whole;
        ``3``: also the parameters, as the server chunks of the flattened tree (``update`` then takes and returns
        this rank's chunks). See :mod:`jonebit.transforms.onebit_zero`; build the step with
        :func:`jonebit.train.zero.make_zero_step`.
      nonfinite: what an update does when any rank's gradient (or the momentum) holds a NaN or inf, or a value
        whose square overflows float32: ``"skip"`` (default) skips it on all ranks together (zero updates, the
        state untouched but for ``state.skipped + 1``; one all-reduced flag per step decides); ``"raise"`` skips
        it as well and raises ``FloatingPointError`` from the host, so the step call fails (with donated
        buffers the state passed in is gone: restore a checkpoint). Without it one bad element would spread to
        every parameter, moment and error buffer on every rank.
      auto_freeze: the rule for ``freeze_step="auto"`` (default ``AutoFreeze()``): every ``check_every`` warmup
        updates each tensor's bias-corrected ``||v / (1 - b2^t)||`` is compared with the previous check; after
        ``patience`` consecutive checks whose median relative change (``statistic``) is below ``threshold``
        compression starts, not before ``min_step`` and at the latest after ``max_step`` updates. With
        ``bias_correction`` the variance correction is frozen at the decided point. Only with
        ``freeze_step="auto"``.

    Returns:
      An ``optax.GradientTransformation`` whose ``update(local_grads, state, params)`` expects this rank's
      local gradient.

    Defaults are the settings that train like Adam on small and large models (bias correction, one scale per
    tensor); ``bias_correction=False, fused=True`` is DeepSpeed's 1-bit Adam with an fp16 optimizer bit for bit.

    Example::

      tx = jonebit.onebit_adam(1e-3, freeze_step=100, max_grad_norm=1.0)

      @jax.shard_map(mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs))
      def step(params, opt_state, batch):
          local = jax.lax.pcast(params, "data", to="varying")  # local grads, no implicit psum
          grads = jax.grad(loss_fn)(local, batch)
          updates, opt_state = tx.update(grads, opt_state, params)
          return optax.apply_updates(params, updates), opt_state
    """
    _check_bool("amsgrad", amsgrad)
    if amsgrad:
        raise ValueError("onebit_adam: amsgrad is not supported by 1-bit Adam (the variance is frozen after warmup)")
    rule = None
    if isinstance(freeze_step, str):
        if freeze_step != "auto":
            raise ValueError(f"onebit_adam: freeze_step must be an int or \"auto\", got {freeze_step!r}")
        if auto_freeze is not None and not isinstance(auto_freeze, AutoFreeze):
            raise TypeError(f"onebit_adam: auto_freeze must be a jonebit.AutoFreeze, got {type(auto_freeze).__name__}")
        rule = (auto_freeze if auto_freeze is not None else AutoFreeze()).checked("onebit_adam")
        if zero_stage:
            raise ValueError(
                f"onebit_adam: freeze_step=\"auto\" is available with zero_stage=0 only, got zero_stage={zero_stage!r} "
                "(the ZeRO layout keeps the variance in chunks); use zero_stage=0, or an int freeze_step with ZeRO")
        freeze_step = rule.max_step  # the cap; the decided point lives in state.freeze_at
    elif auto_freeze is not None:
        raise ValueError(f"onebit_adam: auto_freeze applies to freeze_step=\"auto\" only, got "
                         f"freeze_step={freeze_step!r}")
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, int | np.integer):
        raise TypeError(f"onebit_adam: freeze_step must be an int or \"auto\", got {freeze_step!r}")
    if freeze_step < 0:
        raise ValueError(f"onebit_adam: freeze_step must be >= 0, got {freeze_step}")
    if freeze_step == 0:
        raise ValueError(
            "onebit_adam: freeze_step=0 would freeze a variance that was never estimated (v = 0, so every update "
            "is m / eps); use at least a few hundred warmup steps (DeepSpeed recommends 15-25% of training)"
        )
    # Values may be arrays under optax.inject_hyperparams; only plain numbers are range-checked here.
    _check_scalar("learning_rate", learning_rate, low=0.0, schedule=True)
    _check_scalar("b1", b1, low=0.0, high=1.0, open_high=True)
    _check_scalar("b2", b2, low=0.0, high=1.0, open_high=True)
    _check_scalar("eps", eps, low=0.0, open_low=True)
    _check_scalar("weight_decay", weight_decay, low=0.0)
    if max_grad_norm is not None:
        _check_scalar("max_grad_norm", max_grad_norm, low=0.0)
        if _is_number(max_grad_norm) and max_grad_norm == 0:
            max_grad_norm = None
    for name, value in (("bias_correction", bias_correction), ("fused", fused), ("error_feedback", error_feedback),
                        ("mask_unseen", mask_unseen), ("row_scales", row_scales),
                        ("preconditioned", preconditioned), ("local_clip", local_clip)):
        _check_bool(name, value)
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"onebit_adam: nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}")
    hierarchical = isinstance(axis_name, tuple | list)
    if hierarchical:
        axis_name = check_axis_pair(axis_name, "onebit_adam")
        if mpi_comm is not None:
            raise ValueError(
                f"onebit_adam: hierarchical compression (axis_name={axis_name!r}) runs over the two axes of a "
                "shard_map mesh and cannot be combined with mpi_comm; pass axis_name=None with mpi_comm for flat "
                "MPI compression, or drop mpi_comm"
            )
        if zero_stage:
            raise ValueError(
                f"onebit_adam: hierarchical compression (axis_name={axis_name!r}) is available with zero_stage=0 "
                f"only, got zero_stage={zero_stage!r}; use zero_stage=0, or a single data axis name for ZeRO"
            )
    elif axis_name is not None and not isinstance(axis_name, str):
        raise TypeError(
            f"onebit_adam: axis_name must be a mesh axis name (str), got {axis_name!r}; or a pair (hosts_axis, "
            "local_axis) for hierarchical compression"
        )
    exp_avg_mask = normalise_mask(exp_avg_mask, "onebit_adam")
    decays = not (_is_number(weight_decay) and weight_decay == 0)
    if mpi_comm is not None:
        axis_name = None
    freeze_step = int(freeze_step)
    if zero_stage is None:  # None, not 0, as the default: optax.inject_hyperparams would turn an int into an array
        zero_stage = 0
    if not isinstance(zero_stage, int | np.integer) or isinstance(zero_stage, bool):
        raise TypeError(
            "onebit_adam: zero_stage must be a Python int (it decides the state layout), got "
            f"{type(zero_stage).__name__}; under optax.inject_hyperparams list it in static_args"
        )
    if zero_stage not in (0, *ZERO_STAGES):
        raise ValueError(f"onebit_adam: zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    zero_stage = int(zero_stage)
    if row_scales and (fused or hierarchical or zero_stage):
        why = "fused=True" if fused else ("hierarchical compression" if hierarchical else f"zero_stage={zero_stage}")
        raise ValueError(f"onebit_adam: row_scales=True compresses each tensor on its own; it is not available with "
                         f"{why}: use fused=False on a single data axis at ZeRO stage 0, or drop row_scales")
    if clip_ratio is not None:
        _check_scalar("clip_ratio", clip_ratio, low=0.0, open_low=True)
        if zero_stage:
            raise ValueError(f"onebit_adam: clip_ratio is available at ZeRO stage 0 only, got zero_stage={zero_stage}")
    if variance_refresh is not None:
        if isinstance(variance_refresh, bool) or not isinstance(variance_refresh, int | np.integer):
            raise TypeError(f"onebit_adam: variance_refresh must be a whole number of updates (or None), got "
                            f"{variance_refresh!r}")
        if variance_refresh < 1:
            raise ValueError(f"onebit_adam: variance_refresh must be >= 1 (refresh the variance every K updates of "
                             f"the compression stage) or None (never), got {variance_refresh}")
        if zero_stage:
            raise ValueError(f"onebit_adam: variance_refresh is available at ZeRO stage 0 only, got "
                             f"zero_stage={zero_stage}; use zero_stage=0 or drop variance_refresh")
        variance_refresh = int(variance_refresh)
    if preconditioned and zero_stage:
        raise ValueError(f"onebit_adam: preconditioned=True is available at ZeRO stage 0 only, got "
                         f"zero_stage={zero_stage}; use zero_stage=0 or drop preconditioned")
    if zero_stage and mpi_comm is not None:
        raise ValueError("onebit_adam: zero_stage >= 1 runs over a shard_map axis; it is not available with mpi_comm")
    if zero_stage and max_grad_norm is not None:
        raise ValueError(
            f"onebit_adam: max_grad_norm is not available with zero_stage={zero_stage}; clip the local gradient "
            "in front instead: optax.chain(optax.clip_by_global_norm(norm), onebit_adam(...))"
        )

    def make_backend():
        if hierarchical:
            return HierarchicalBackend(*axis_name)
        return get_backend(axis_name, mpi_comm)

    def _check_params(params):
        _check_float_leaves(params, "param")
        _check_nonempty_leaves(params)
        mask_leaves(exp_avg_mask, params, "onebit_adam")

    def zero_backend():
        backend = get_backend(axis_name, mpi_comm)
        if backend.size < 2:
            raise ValueError(
                f"onebit_adam: zero_stage={zero_stage} partitions over the ranks of axis {axis_name!r}, which has "
                f"{backend.size}; use zero_stage=0 on a single device"
            )
        return backend

    def zero_init(params):
        backend = zero_backend()
        layout = FlatLayout.of(params, backend.size, fused)
        if zero_stage == 3:
            check_flat_dtypes(layout)
        return init_zero_state(layout, zero_stage)

    def zero_update_fn(grads, state, params):
        if params is None:
            raise ValueError(f"onebit_adam(zero_stage={zero_stage}) needs params: call update(grads, state, params)")
        _check_float_leaves(grads, "gradient")
        backend = zero_backend()
        _check_local_grads(grads, backend)
        layout = FlatLayout.of(grads if zero_stage == 3 else params, backend.size, fused)
        if zero_stage != 3:
            _check_matching_grads(grads, params, "params")
        # The state's chunks follow the layout of the tree given to init: a different gradient tree shows here.
        want = tuple((1, layout.chunk(g)) for g in range(len(layout.groups)))
        have = tuple(tuple(m.shape) for m in state.mu)
        if want != have:
            raise ValueError(
                f"onebit_adam: the gradients do not match the params the optimizer state was made for: their "
                f"flat buffers have chunks {want}, the state {have} (same tree, shapes and fused={fused} as in init)"
            )
        mask = mask_leaves(exp_avg_mask, grads, "onebit_adam")

        bad, on_skip = _nonfinite_flag(backend, grads, state.mu, nonfinite)
        return zero_update(
            backend=backend, layout=layout, stage=zero_stage, freeze_step=freeze_step, b1=b1, b2=b2, eps=eps,
            weight_decay=weight_decay, decays=decays, mask_bufs=flat_mask(mask, layout),
            bias_correction=bias_correction, learning_rate=learning_rate, error_feedback=error_feedback,
            grads=grads, state=state, params=params, skip=bad, on_skip=on_skip,
        )

    def init_fn(params):
        _check_params(params)
        backend = make_backend()
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        if fused:
            n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
            if n == 0:
                raise ValueError("onebit_adam: the params have no elements")
            worker, server = _error_buffers(n, backend)
        elif row_scales:
            p = backend.size
            lengths = [buffer_padded_size(x.size, p, _row_of(x)) for x in jax.tree.leaves(params)]
            treedef = jax.tree.structure(params)
            worker = treedef.unflatten([jnp.zeros((1, n), jnp.float32) for n in lengths])
            server = treedef.unflatten([jnp.zeros((1, n // p), jnp.float32) for n in lengths])
        else:
            sizes = jax.tree.map(lambda p: int(np.prod(p.shape)), params)
            worker, server = _error_buffers(sizes, backend)
        auto = {}
        if rule is not None:
            auto = dict(freeze_at=jnp.full([], rule.max_step, jnp.int32),
                        variance_norms=jax.tree.map(lambda p: jnp.zeros([], jnp.float32), params),
                        calm_checks=jnp.zeros([], jnp.int32))
        return OneBitAdamState(
            count=jnp.zeros([], jnp.int32), mu=zeros, nu=jax.tree.map(jnp.copy, zeros),
            worker_error=worker, server_error=server, skipped=jnp.zeros([], jnp.int32), **auto,
        )

    def compress(backend, m_local, worker_error, server_error):
        """Compressed allreduce of the momentum tree; returns (m, worker_error, server_error)."""

        if isinstance(backend, HierarchicalBackend):
            return compress_hierarchical(backend, m_local, worker_error, server_error)
        if fused:
            # One compressed allreduce of the flattened tree, decoded straight into the leaves (no full-length
            # decoded vector to split).
            leaves, treedef = jax.tree.flatten(m_local)
            rows, we, se = compressed_allreduce_rows(backend, _flatten(m_local), worker_error[0], server_error[0])
            if not error_feedback:
                we, se = jnp.zeros_like(we), jnp.zeros_like(se)
            parts = decode_segments(rows, [x.size for x in leaves])
            m = treedef.unflatten([p.reshape(x.shape).astype(x.dtype) for p, x in zip(parts, leaves, strict=True)])
            return m, we[None], se[None]
        # Per leaf: each leaf is its own compressed allreduce (own scales, errors, padding), but all leaves
        # share one all-to-all and one all-gather (same bytes, two collectives instead of two per leaf).
        # Leaves of the same size are compressed as one stacked batch (own scales per leaf, bit for bit).
        leaves, treedef = jax.tree.flatten(m_local)
        wes, ses = treedef.flatten_up_to(worker_error), treedef.flatten_up_to(server_error)
        rows = [_row_of(x) for x in leaves] if row_scales else None
        groups = compressed_allreduce_groups(
            backend, [jnp.ravel(x) for x in leaves], [we[0] for we in wes], [se[0] for se in ses], rows)
        wes, ses = ungroup(groups, 2, len(leaves)), ungroup(groups, 3, len(leaves))
        if not error_feedback:
            wes, ses = [jnp.zeros_like(we) for we in wes], [jnp.zeros_like(se) for se in ses]
        m = [d.reshape(x.shape).astype(x.dtype)
             for d, x in zip(decode_groups(groups, [x.size for x in leaves], rows), leaves, strict=True)]
        return (treedef.unflatten(m), treedef.unflatten([we[None] for we in wes]),
                treedef.unflatten([se[None] for se in ses]))

    def compress_hierarchical(backend, m_local, worker_error, server_error):
        """:func:`compress` on a hosts x local mesh: one buffer (fused) or one per leaf, sharing the collectives."""
        leaves, treedef = jax.tree.flatten(m_local)
        if fused:
            bufs, wes, ses = [_flatten(m_local)], [worker_error[0]], [server_error[0]]
        else:
            bufs = [jnp.ravel(x) for x in leaves]
            wes = [we[0] for we in treedef.flatten_up_to(worker_error)]
            ses = [se[0] for se in treedef.flatten_up_to(server_error)]
        rows, wes, ses = hierarchical_allreduce_rows_many(backend, bufs, wes, ses)
        if not error_feedback:
            wes, ses = [jnp.zeros_like(we) for we in wes], [jnp.zeros_like(se) for se in ses]
        decoded = [decode_hierarchical(r, b.shape[0]) for r, b in zip(rows, bufs, strict=True)]
        if fused:
            bounds = np.cumsum([0, *[x.size for x in leaves]])
            parts = [decoded[0][int(a):int(b)] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
            m = treedef.unflatten([p.reshape(x.shape).astype(x.dtype) for p, x in zip(parts, leaves, strict=True)])
            return m, wes[0][None], ses[0][None]
        m = treedef.unflatten([d.reshape(x.shape).astype(x.dtype) for d, x in zip(decoded, leaves, strict=True)])
        return m, treedef.unflatten([we[None] for we in wes]), treedef.unflatten([se[None] for se in ses])

    def update_fn(grads, state, params=None):
        if decays and params is None:
            raise ValueError("onebit_adam: weight_decay needs params; call update(grads, state, params)")
        _check_float_leaves(grads, "gradient")
        _check_matching_grads(grads, state.mu, "optimizer state (the params given to init)")
        if params is not None:
            _check_matching_grads(grads, params, "params")
        backend = make_backend()
        _check_local_grads(grads, backend)
        mask = mask_leaves(exp_avg_mask, grads, "onebit_adam")
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        worker_error, server_error = state.worker_error, state.server_error
        for axis in _mesh_axes(backend):
            # Errors differ per rank; fresh zeros from init in the same body are still typed invariant.
            worker_error = jax.tree.map(lambda e, a=axis: as_varying(e, a), worker_error)
            server_error = jax.tree.map(lambda e, a=axis: as_varying(e, a), server_error)

        # With freeze_step="auto" the decision so far (else the static freeze_step and nothing to carry).
        decision = (state.freeze_at, state.variance_norms, state.calm_checks) if rule is not None else ()
        limit = state.freeze_at if rule is not None else freeze_step

        def moments(g, w):  # Adam's moments on an exact mean gradient, the variance's weight w
            mu = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, state.mu, g)
            return mu, jax.tree.map(lambda v, g: w * v + (1.0 - w) * g * g, state.nu, g)

        def warmup(_):
            g = backend.mean(_clip(grads)) if local_clip else _clip(backend.mean(grads))
            mu, nu = moments(g, b2)
            if rule is None:
                return mu, nu, worker_error, server_error
            freeze_at, norms, calm = auto_freeze_step(rule, count, nu, state.variance_norms, state.calm_checks,
                                                      state.freeze_at, backend, b2=b2)
            return mu, nu, worker_error, server_error, freeze_at, norms, calm

        def refresh(_):  # variance_refresh: an exact step whose gradient stands for the K updates since the last
            # The mean of the locally clipped gradients: what the compressed updates around it average, so that
            # v follows the scale of the gradients m is made of (the clipped mean of warmup is larger).
            mu, nu = moments(backend.mean(_clip(grads)), b2 ** variance_refresh)
            return (mu, nu, worker_error, server_error, *decision)

        def compression(_):
            mu = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, state.mu, _clip(grads))
            we, se = worker_error, server_error
            if preconditioned:  # the frozen denominator of the update (the variance's correction frozen too)
                _, c2, _ = step_scalars(count, b1=b1, b2=b2, freeze_step=clock, bias_correction=bias_correction,
                                        learning_rate=learning_rate)
                denom = jax.tree.map(lambda v: jnp.sqrt(v / c2) + eps, state.nu)
                mu = jax.tree.map(jnp.divide, mu, denom)
                if mask_unseen:  # nothing reached these elements: keep them out of the scales
                    mu = where_seen(mu, state.nu)
            if backend.size > 1:
                mu, we, se = compress(backend, mu, we, se)
            else:  # one rank has nothing to compress (DeepSpeed skips it too); the mean only fixes the type
                mu = backend.mean(mu)
            if preconditioned:
                mu = jax.tree.map(jnp.multiply, mu, denom)
            if mask is not None:
                leaves, treedef = jax.tree.flatten(mu)
                mu = treedef.unflatten([m if k is None else m * jnp.asarray(k, jnp.float32)
                                        for m, k in zip(leaves, mask, strict=True)])
            if mask_unseen:  # the frozen variance is 0 exactly where no gradient has ever arrived
                mu = where_seen(mu, state.nu)
            return (mu, state.nu, we, se, *decision)

        def _clip(g):
            if max_grad_norm is None:
                return g
            norm = optax.tree.norm(g)
            # optax.clip_by_global_norm's rule: scale by max_norm / norm only when the norm exceeds it.
            factor = jnp.where(norm > max_grad_norm, max_grad_norm / jnp.where(norm > 0, norm, 1.0), 1.0)
            return jax.tree.map(lambda x: x * factor, g)

        count = state.count
        bad, on_skip = _nonfinite_flag(backend, grads, state.mu, nonfinite)
        # The variance's clock: the update whose bias correction the variance carries (the freeze, or the latest
        # refresh); step_scalars takes it as the point where the correction stops. During warmup the update is
        # before the clock, so the correction follows the update whatever the (auto) freeze point decides.
        clock = limit
        if variance_refresh is not None:
            since = count + 1 - limit  # > 0 after the freeze; the refreshes are its multiples of K
            clock = jnp.where(since <= 0, limit, limit + variance_refresh * (since // variance_refresh))

        def skip(_):  # some rank's gradient is not finite: every rank keeps its state
            on_skip(count)
            return (state.mu, state.nu, worker_error, server_error, *decision)

        # Branch order as lax.cond(warmup?, warmup, compression) had it, the skip branch last.
        index = jnp.where(bad, 2, jnp.where(count < limit, 1, 0))
        branches = (compression, warmup, skip)
        if variance_refresh is not None:
            index = jnp.where((index == 0) & (since % variance_refresh == 0), 3, index)
            branches = (*branches, refresh)
        mu, nu, worker_error, server_error, *decision = lax.switch(index, branches, None)
        c1, c2, lr = step_scalars(count, b1=b1, b2=b2, freeze_step=clock, bias_correction=bias_correction,
                                  learning_rate=learning_rate)

        def direction(m, v, p):
            u = (m / c1) / (jnp.sqrt(v / c2) + eps)
            if clip_ratio is not None:  # after the freeze only: warmup is Adam, whose ratio is bounded already
                u = jnp.where((index == 0) | (index == 3), jnp.clip(u, -clip_ratio, clip_ratio), u)
            if decays:
                u = u + weight_decay * p.astype(jnp.float32)
            return u

        ps = params if params is not None else grads
        updates = jax.tree.map(
            lambda m, v, p: jnp.where(bad, 0.0, -lr * direction(m, v, p)).astype(p.dtype), mu, nu, ps)
        new_state = OneBitAdamState(
            count=jnp.where(bad, count, optax.safe_int32_increment(count)), mu=mu, nu=nu,
            worker_error=worker_error, server_error=server_error, skipped=state.skipped + bad.astype(jnp.int32),
            **(dict(zip(("freeze_at", "variance_norms", "calm_checks"), decision, strict=True))
               if rule is not None else {}),
        )
        return updates, new_state

    if zero_stage:
        def checked_zero_init(params):
            _check_params(params)
            return zero_init(params)

        return optax.GradientTransformation(checked_zero_init, zero_update_fn)
    return optax.GradientTransformation(init_fn, update_fn)


def adam_ratio_bound(b1: float = 0.9, b2: float = 0.999) -> float:
    """The largest ``|m| / sqrt(v)`` Adam's moment EMAs can reach (``b1^2 < b2``), by Cauchy-Schwarz over the
    gradient history: ``(1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2))``; 7.27 for the default betas. A value for
    ``onebit_adam(clip_ratio=...)``."""
    if not b1 * b1 < b2:
        raise ValueError(f"adam_ratio_bound needs b1^2 < b2, got b1={b1}, b2={b2}")
    return (1.0 - b1) / math.sqrt((1.0 - b2) * (1.0 - b1 * b1 / b2))


def is_onebit_state(x) -> bool:
    """Whether ``x`` is the state of a 1-bit optimizer (whose error buffers are per rank)."""
    return isinstance(x, OneBitAdamState | OneBitAdamZeroState)


def state_specs(opt_state, axis_name: str | tuple[str, str] = "data"):
    """``PartitionSpec`` tree that carries an optimizer state in and out of ``shard_map`` as global arrays.

    Error buffers of every :class:`OneBitAdamState` in the tree get ``P(axis_name)`` (one row per rank on the
    leading axis; for a hierarchical pair ``("hosts", "local")``, ``P(("hosts", "local"))``: one row per device,
    in mesh order); states registered with :func:`jonebit.sharding.zero.register_per_rank_state` (0/1 Adam, 1-bit
    LAMB) get their rule's specs; everything else, here and in other transforms of an ``optax.chain``, is
    replicated ``P()``.
    Works on arrays and ``jax.ShapeDtypeStruct`` trees alike.
    """

    def spec(node):
        if isinstance(node, OneBitAdamZeroState):
            return zero_state_specs(node, axis_name)
        if is_onebit_state(node):
            rows = lambda t: jax.tree.map(lambda _: P(axis_name), t)  # noqa: E731
            rep = lambda t: jax.tree.map(lambda _: P(), t)  # noqa: E731
            return OneBitAdamState(
                count=P(), mu=rep(node.mu), nu=rep(node.nu),
                worker_error=rows(node.worker_error), server_error=rows(node.server_error), skipped=P(),
                freeze_at=rep(node.freeze_at), variance_norms=rep(node.variance_norms),
                calm_checks=rep(node.calm_checks),
            )
        rule = _per_rank_rule(node)  # other transforms with per-rank buffers (the 1-bit family)
        if rule is not None:
            return jax.tree.map(lambda s: P() if s is None else s, rule(node, axis_name),
                                is_leaf=lambda s: s is None or isinstance(s, P))
        if not hasattr(node, "shape") or isinstance(node, P):
            raise TypeError(
                f"state_specs: expected an optimizer state (arrays or jax.ShapeDtypeStruct leaves, e.g. from "
                f"tx.init(params) or jax.eval_shape of it), found a leaf of type {type(node).__name__}: {node!r:.80}"
            )
        return P()

    if isinstance(axis_name, tuple | list):
        axis_name = check_axis_pair(axis_name, "state_specs")
    elif not isinstance(axis_name, str):
        raise TypeError(
            f"state_specs: axis_name must be a mesh axis name (str), got {axis_name!r}; or a pair (hosts_axis, "
            "local_axis) for hierarchical compression"
        )
    if isinstance(opt_state, optax.GradientTransformation):
        raise TypeError("state_specs: got an optax.GradientTransformation; pass its state (tx.init(params)) instead")
    def is_leaf(x):
        return is_onebit_state(x) or _per_rank_rule(x) is not None or isinstance(x, P)

    return jax.tree.map(spec, opt_state, is_leaf=is_leaf)


def sharded_init(tx: optax.GradientTransformation, params, mesh: jax.sharding.Mesh,
                 axis_name: str | tuple[str, str] = "data"):
    """Runs ``tx.init`` in the per-device view and returns the state as global arrays.

    Replicated leaves come back replicated over ``mesh``; per-rank error buffers come back as
    ``(P, ...)`` arrays sharded over ``axis_name`` (both axes of a hierarchical pair: ``P = H * L`` rows).
    Returns ``(opt_state, specs)`` with ``specs`` from :func:`state_specs`, ready for the
    ``in_specs``/``out_specs`` of a ``shard_map`` training step.
    """
    replicated = jax.NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    local = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False), params)
    specs = state_specs(local, axis_name)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
    return init(params), specs


# ZeRO planning (jonebit.sharding.zero_shardings) must not apply its per-leaf rule to these states: the plain
# transform needs m and v whole, the ZeRO variant has its own chunk layout, and error buffers are per rank.
register_per_rank_state(OneBitAdamState, state_specs)
register_per_rank_state(OneBitAdamZeroState, zero_state_specs)
