"""1-bit Adam as an optax ``GradientTransformation``.

Two phases, switched inside one compiled step on the update count:

* **warmup**, updates ``1 .. freeze_step``: full-precision Adam on the gradient averaged over ranks
  (one mean allreduce per step)::

      g = mean_ranks(g_local)
      m = b1 m + (1 - b1) g
      v = b2 v + (1 - b2) g^2

* **compression**, updates ``freeze_step + 1 ..``: the variance is frozen; each rank folds its *local*
  gradient into the momentum, and the momentum is averaged with the error-compensated 1-bit
  :func:`~jonebit.comm.compressed_allreduce` (so it is again identical on all ranks)::

      m = compressed_allreduce(b1 m + (1 - b1) g_local) * mask

In both phases the update is ``-lr (m / (sqrt(v) + eps) + weight_decay p)`` (decoupled weight decay).
``experimental=OneBitAdamOptions(variance_refresh=K)`` adds a third phase, **refresh** (see
:mod:`jonebit.experimental.onebit_adam`). The phase of the last update is kept in the state by its index into
:data:`PHASES` (``state.phase``), which is how the engine and the loop name and cost it.

``init`` and ``update`` run in the per-device view: inside ``jax.shard_map`` over ``axis_name`` (the
usual way), in each MPI process when ``mpi_comm`` is given, or with no axis bound as one worker.
:func:`state_specs` returns the ``PartitionSpec`` tree that carries the state in and out of ``shard_map``: ``m``,
``v`` and the count are replicated, the error buffers differ per rank and live on a leading device axis.

With ``axis_name=("hosts", "local")`` (a 2-D mesh) the compression is hierarchical
(:mod:`jonebit.comm.hierarchical`): the momentum is averaged over ``local`` in float32, only each local shard is
compressed across ``hosts``, and the packed result is gathered back over ``local``. Warmup and the error buffers'
rows span both axes.

References:
  Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence Speed",
  ICML 2021, https://arxiv.org/abs/2102.02888.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jonebit.comm.backends import Backend, as_varying
from jonebit.comm.compressed import (
    buffer_groups,
    compressed_allreduce_rows,
    compressed_mean_leaves,
    decode_segments,
    padded_size,
    stacked_error_buffers,
)
from jonebit.comm.hierarchical import (
    HierarchicalBackend,
    check_axis_pair,
    decode_hierarchical,
    error_sizes,
    hierarchical_allreduce_rows_many,
)
from jonebit.experimental.onebit_adam import OneBitAdamOptions
from jonebit.sharding.zero import per_rank_rule, register_per_rank_state
from jonebit.transforms.base import (
    AutoFreeze,
    ScalarOrSchedule,
    auto_freeze_step,
    backend_for,
    check_bool,
    check_float_leaves,
    check_local_grads,
    check_matching_grads,
    check_nonempty_leaves,
    check_scalar,
    flatten,
    is_number,
    mask_leaves,
    mesh_axes,
    normalise_mask,
    where_seen,
)
from jonebit.transforms.onebit_adam_zero import OneBitAdamZeroState, step_scalars, zero_state_specs
from jonebit.transforms.phases import run_phase

WHO = "onebit_adam"
#: The phases of an update, by the index ``state.phase`` holds.
PHASES = ("warmup", "compression", "refresh")
WARMUP, COMPRESSION, REFRESH = range(3)


class OneBitAdamState(NamedTuple):
    """State of :func:`onebit_adam`.

    Attributes:
      count: number of updates applied so far (int32 scalar); ``count < freeze_step`` means warmup.
      mu: first moment, float32, like the params; identical on all ranks.
      nu: second moment, float32, like the params; identical on all ranks, frozen after warmup.
      worker_error: this rank's worker error with a leading axis of 1 (global view: one row per rank).
        ``fused=True``: one array ``(1, padded_size(N, P))``. ``fused=False``: a tuple with one array
        ``(1, k, padded_size(n, P))`` per group of the ``k`` leaves of ``n`` elements
        (:func:`jonebit.comm.compressed.buffer_groups` of the leaf sizes, in order of first appearance; row
        ``j`` belongs to the group's ``j``-th leaf in tree order): :func:`leaf_errors` gives them per leaf. On a
        hierarchical mesh, a tree like the params.
      server_error: this rank's server error, a ``P``-th of ``worker_error``'s length, same layout.
      phase: the phase the last update ran, an index into :data:`PHASES` (int32).
      next_phase: the phase the next update runs (int32), by the same rule: jonebit's step builders read it to
        run a program compiled for that phase alone (:mod:`jonebit.transforms.phases`).
      freeze_at: with ``freeze_step="auto"``: the number of warmup updates (int32), the cap until the rule fires and
        then the update it fired on (kept, so a resumed run continues the decision); ``None`` with an int
        ``freeze_step``.
      variance_norms: with ``"auto"``: per tensor, ``||v / (1 - b2^t)||`` at the rule's last check; else ``None``.
      calm_checks: with ``"auto"``: consecutive calm checks of the rule (int32); else ``None``.
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    worker_error: Any
    server_error: Any
    phase: jax.Array
    next_phase: Any = None
    freeze_at: Any = None
    variance_norms: Any = None
    calm_checks: Any = None

    PHASES = PHASES


# ---- argument checks ------------------------------------------------------------------------------------------


def _freeze_rule(freeze_step) -> tuple[int, AutoFreeze | None]:
    """``(freeze_step or the rule's cap, the rule or None)`` from an int, ``"auto"`` or an :class:`AutoFreeze`."""
    rule = None
    if isinstance(freeze_step, AutoFreeze):
        rule = freeze_step.checked(WHO)
    elif isinstance(freeze_step, str):
        if freeze_step != "auto":
            raise ValueError(f"{WHO}: freeze_step must be an int, \"auto\" or a jonebit.AutoFreeze, got "
                             f"{freeze_step!r}")
        rule = AutoFreeze().checked(WHO)
    if rule is not None:
        return rule.max_step, rule  # the cap; the decided point lives in state.freeze_at
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, int | np.integer):
        raise TypeError(f"{WHO}: freeze_step must be an int, \"auto\" or a jonebit.AutoFreeze, got {freeze_step!r}")
    if freeze_step < 0:
        raise ValueError(f"{WHO}: freeze_step must be >= 0, got {freeze_step}")
    if freeze_step == 0:
        raise ValueError(
            f"{WHO}: freeze_step=0 would freeze a variance that was never estimated (v = 0, so every update "
            "is m / eps); use at least a few hundred warmup steps (DeepSpeed recommends 15-25% of training)"
        )
    return int(freeze_step), None


# ---- the compressed average of the momentum -------------------------------------------------------------------


def _row_of(x) -> int | None:
    """The row length of ``row_scales`` compression for a leaf: its last axis when it has two or more."""
    return int(x.shape[-1]) if len(x.shape) >= 2 else None


def error_buffers(params, backend: Backend, *, fused: bool, row_scales: bool = False):
    """Zero ``(worker_error, server_error)``, leading axis 1: one pair for the flattened tree (``fused``), else one
    per leaf (sized for per-row scales with ``row_scales``; for one local shard on a hierarchical backend)."""
    p = backend.size
    if isinstance(backend, HierarchicalBackend):  # errors of one local shard (see jonebit.comm.hierarchical)
        def lengths(n):
            return error_sizes(n, backend.hosts.size, backend.local_size)
    else:
        def lengths(n):
            return padded_size(n, p), padded_size(n, p) // p

    def pair(n):
        worker, server = lengths(n)
        return jnp.zeros((1, worker), jnp.float32), jnp.zeros((1, server), jnp.float32)

    leaves, treedef = jax.tree.flatten(params)
    if fused:
        n = sum(int(np.prod(x.shape)) for x in leaves)
        if n == 0:
            raise ValueError(f"{WHO}: the params have no elements")
        return pair(n)
    if isinstance(backend, HierarchicalBackend):
        pairs = [pair(int(np.prod(x.shape))) for x in leaves]
        return treedef.unflatten([w for w, _ in pairs]), treedef.unflatten([s for _, s in pairs])
    rows = [_row_of(x) for x in leaves] if row_scales else None
    _, worker, server = stacked_error_buffers([int(np.prod(x.shape)) for x in leaves], p, rows)
    return tuple(w[None] for w in worker), tuple(s[None] for s in server)


def leaf_errors(errors, params, *, row_scales: bool = False):
    """Per-leaf 1-bit Adam error buffers (``state.worker_error`` or ``state.server_error``) as a tree like ``params``.

    Without ``fused``, the state keeps one stacked array per group of equal-size leaves; this returns leaf ``i``'s
    rows of it: ``(R, length)`` with ``R`` the leading (rank) axis, 1 inside a step. ``row_scales``: as given to
    :func:`onebit_adam`. A fused error buffer or a hierarchical (already per-leaf) tree is returned as it is.
    """
    if not isinstance(errors, tuple) or any(len(e.shape) != 3 for e in errors):  # (R, k, n) stacks, or as it is
        return errors
    leaves, treedef = jax.tree.flatten(params)
    rows = [_row_of(x) for x in leaves] if row_scales else None
    groups = buffer_groups([int(np.prod(x.shape)) for x in leaves], rows)
    if len(groups) != len(errors):
        raise ValueError(f"leaf_errors: the params make {len(groups)} groups of equal-size leaves but the state "
                         f"holds {len(errors)} error arrays; pass the params (and row_scales) the optimizer was "
                         "initialised with")
    out = [None] * len(leaves)
    for idx, stack in zip(groups, errors, strict=True):
        for j, i in enumerate(idx):
            out[i] = stack[:, j]
    return treedef.unflatten(out)


def _unflatten_like(parts, leaves, treedef):
    return treedef.unflatten([p.reshape(x.shape).astype(x.dtype) for p, x in zip(parts, leaves, strict=True)])


def compress(backend, m_local, worker_error, server_error, *, fused: bool, row_scales: bool = False,
             error_feedback: bool = True):
    """The error-compensated 1-bit average of the momentum tree: ``(m, worker_error, server_error)``."""
    if isinstance(backend, HierarchicalBackend):
        return _compress_hierarchical(backend, m_local, worker_error, server_error, fused=fused,
                                      error_feedback=error_feedback)
    leaves, treedef = jax.tree.flatten(m_local)
    if fused:
        # One compressed allreduce of the flattened tree, decoded straight into the leaves (no full-length
        # decoded vector to split).
        rows, we, se = compressed_allreduce_rows(backend, flatten(m_local), worker_error[0], server_error[0])
        if not error_feedback:
            we, se = jnp.zeros_like(we), jnp.zeros_like(se)
        parts = decode_segments(rows, [x.size for x in leaves])
        return _unflatten_like(parts, leaves, treedef), we[None], se[None]
    # Per leaf: each leaf is its own compressed allreduce (own scales, errors, padding), but all leaves share one
    # all-to-all and one all-gather (same bytes, two collectives instead of two per leaf). Leaves of the same size
    # are compressed as one stacked batch (own scales per leaf, bit for bit), their errors kept stacked in the state.
    rows = [_row_of(x) for x in leaves] if row_scales else None
    decoded, wes, ses = compressed_mean_leaves(backend, leaves, worker_error, server_error, rows)
    if not error_feedback:
        wes, ses = jax.tree.map(jnp.zeros_like, wes), jax.tree.map(jnp.zeros_like, ses)
    return _unflatten_like(decoded, leaves, treedef), wes, ses


def _compress_hierarchical(backend, m_local, worker_error, server_error, *, fused: bool, error_feedback: bool):
    """:func:`compress` on a hosts x local mesh: one buffer (fused) or one per leaf, sharing the collectives."""
    leaves, treedef = jax.tree.flatten(m_local)
    if fused:
        bufs, wes, ses = [flatten(m_local)], [worker_error[0]], [server_error[0]]
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
        return _unflatten_like(parts, leaves, treedef), wes[0][None], ses[0][None]
    m = _unflatten_like(decoded, leaves, treedef)
    return m, treedef.unflatten([we[None] for we in wes]), treedef.unflatten([se[None] for se in ses])


def clip_by_global_norm(g, max_norm):
    """optax.clip_by_global_norm's rule: scale by ``max_norm / norm`` only when the norm exceeds it."""
    if max_norm is None:
        return g
    norm = optax.tree.norm(g)
    factor = jnp.where(norm > max_norm, max_norm / jnp.where(norm > 0, norm, 1.0), 1.0)
    return jax.tree.map(lambda x: x * factor, g)


# ---- the factory ----------------------------------------------------------------------------------------------


def onebit_adam(
    learning_rate: ScalarOrSchedule,
    *,
    freeze_step: int | str | AutoFreeze,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    exp_avg_mask: Any = None,
    bias_correction: bool = True,
    fused: bool = False,
    max_grad_norm: float | None = None,
    mask_unseen: bool = True,
    axis_name: str | tuple[str, str] | None = "data",
    mpi_comm: Any = None,
    experimental: OneBitAdamOptions | None = None,
) -> optax.GradientTransformation:
    r"""1-bit Adam (Tang et al., 2021) with DeepSpeed's semantics.

    Warmup (``count < freeze_step``), with :math:`\bar g` the mean of the ranks' gradients:

    .. math::
      m \leftarrow \beta_1 m + (1-\beta_1)\bar g, \qquad v \leftarrow \beta_2 v + (1-\beta_2)\bar g^2

    Compression (afterwards), with :math:`C` the error-compensated 1-bit allreduce and :math:`M` the mask:

    .. math::
      m \leftarrow M \odot C\big(\beta_1 m + (1-\beta_1) g_{\mathrm{local}}\big), \qquad v \text{ frozen}

    Update in both phases: :math:`u = -\eta_t\,(\hat m / (\sqrt{\hat v} + \epsilon) + \lambda p)`, with
    :math:`\hat m = m / (1 - \beta_1^t)` and :math:`\hat v = v / (1 - \beta_2^{\min(t, F)})` under
    ``bias_correction`` (the variance's correction frozen with it), :math:`\hat m = m, \hat v = v` without.

    Args:
      learning_rate: a float or an optax schedule of the update count (0-based).
      freeze_step: number of full-precision Adam updates before the variance is frozen and compression starts
        (>= 1). DeepSpeed's ``freeze_step=F`` gives ``F - 1`` real Adam updates, because its first ``step()`` only
        initialises; to reproduce a DeepSpeed config pass ``F - 1``. ``"auto"`` or a :class:`jonebit.AutoFreeze`:
        switch when the variance has settled, by that rule (the default rule for ``"auto"``), decided inside the
        compiled step identically on every rank, logged once and kept in the state (``state.freeze_at``; a resumed
        run continues the decision).
      b1: momentum decay.
      b2: variance decay.
      eps: added to ``sqrt(v)`` (outside the square root).
      weight_decay: decoupled weight decay (AdamW form); needs ``params`` in ``update``.
      exp_avg_mask: optional pytree like the params; the momentum is multiplied by it after each compressed
        allreduce (e.g. to keep BERT's unused position embeddings at exactly zero). A leaf is None (no mask) or
        a bool or 0/1 array with the param's rank whose dimensions are the param's or 1 (``(rows, 1)`` masks
        rows), so the mask need not be as large as the params.
      bias_correction: apply Adam's bias correction (default). DeepSpeed's 1-bit Adam has none (it ignores its
        flag): ``False`` reproduces it.
      fused: ``True`` compresses all leaves as one flat buffer (one collective and one worker scale per step,
        DeepSpeed's fp16 path); ``False`` (default) compresses each leaf separately with its own scales
        (DeepSpeed's fp32 path). One scale for the whole model lets the largest tensors decide the step size of
        all others; per-tensor scales track Adam more closely (``benchmarks/defaults_convergence.py``).
      max_grad_norm: clip the gradient to this global L2 norm before it enters the momentum, where DeepSpeed's
        engine clips: during warmup the gradient averaged over ranks (so every rank clips alike), in the
        compression phase each rank's local gradient (no averaged gradient exists there). ``None``/``0``: none.
      mask_unseen: in the compression phase, elements whose frozen variance is exactly 0 (no gradient reached
        them during warmup, e.g. embedding rows of tokens not yet seen) keep a zero momentum and get no update
        (default). ``False`` is DeepSpeed's arithmetic: the 1-bit average gives them their chunk's magnitude, which
        the step divides by ``eps`` (fine-tuning MiniLM on SQuAD moved such rows by up to 28 against an
        embedding scale of 0.04).
      axis_name: the ``jax.shard_map`` mesh axis of the data-parallel ranks, or a pair ``(hosts, local)`` of axes
        of a 2-D mesh for hierarchical compression (:mod:`jonebit.comm.hierarchical`; build the mesh with
        :func:`jonebit.sharding.mesh.hierarchical_mesh` and shard the batch and the state's rows over both axes,
        ``P(("hosts", "local"))``). ``None``, or no ``shard_map`` binding the axis: one worker.
      mpi_comm: an mpi4py communicator; when given, the collectives go through MPI (mpi4jax) instead.
      experimental: research options (:class:`jonebit.experimental.OneBitAdamOptions`); ``None``: none.

    Returns:
      An ``optax.GradientTransformation`` whose ``update(local_grads, state, params)`` expects this rank's
      local gradient. Wrap it in :func:`jonebit.skip_nonfinite` to skip updates whose gradient is not finite on
      some rank (the training engine does so itself). Partitioned over ranks (ZeRO): :func:`onebit_adam_zero`.

    Defaults are the settings that train like Adam on small and large models (bias correction, one scale per
    tensor); ``bias_correction=False, fused=True, mask_unseen=False`` is DeepSpeed's 1-bit Adam with an fp16
    optimizer, ``fused=False`` its fp32 path.

    Example::

      tx = jonebit.onebit_adam(1e-3, freeze_step=100, max_grad_norm=1.0)

      @jax.shard_map(mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs))
      def step(params, opt_state, batch):
          local = jax.lax.pcast(params, "data", to="varying")  # local grads, no implicit psum
          grads = jax.grad(loss_fn)(local, batch)
          updates, opt_state = tx.update(grads, opt_state, params)
          return optax.apply_updates(params, updates), opt_state
    """
    freeze_step, rule = _freeze_rule(freeze_step)
    # Values may be arrays under optax.inject_hyperparams; only plain numbers are range-checked here.
    check_scalar(WHO, "learning_rate", learning_rate, low=0.0, schedule=True)
    check_scalar(WHO, "b1", b1, low=0.0, high=1.0, open_high=True)
    check_scalar(WHO, "b2", b2, low=0.0, high=1.0, open_high=True)
    check_scalar(WHO, "eps", eps, low=0.0, open_low=True)
    check_scalar(WHO, "weight_decay", weight_decay, low=0.0)
    if max_grad_norm is not None:
        check_scalar(WHO, "max_grad_norm", max_grad_norm, low=0.0)
        if is_number(max_grad_norm) and max_grad_norm == 0:
            max_grad_norm = None
    for name, value in (("bias_correction", bias_correction), ("fused", fused), ("mask_unseen", mask_unseen)):
        check_bool(WHO, name, value)
    hierarchical = isinstance(axis_name, tuple | list)
    if hierarchical:
        axis_name = check_axis_pair(axis_name, WHO)
        if mpi_comm is not None:
            raise ValueError(
                f"{WHO}: hierarchical compression (axis_name={axis_name!r}) runs over the two axes of a "
                "shard_map mesh and cannot be combined with mpi_comm; pass axis_name=None with mpi_comm for flat "
                "MPI compression, or drop mpi_comm"
            )
    elif axis_name is not None and not isinstance(axis_name, str):
        raise TypeError(
            f"{WHO}: axis_name must be a mesh axis name (str), got {axis_name!r}; or a pair (hosts_axis, "
            "local_axis) for hierarchical compression"
        )
    if experimental is None:
        opts = OneBitAdamOptions()
    elif isinstance(experimental, OneBitAdamOptions):
        opts = experimental
    else:
        raise TypeError(f"{WHO}: experimental must be a jonebit.experimental.OneBitAdamOptions or None, got "
                        f"{type(experimental).__name__}")
    opts.check_for(fused=fused, hierarchical=hierarchical)
    exp_avg_mask = normalise_mask(exp_avg_mask, WHO)
    decays = not (is_number(weight_decay) and weight_decay == 0)
    if mpi_comm is not None:
        axis_name = None
    hp = _Hyper(learning_rate=learning_rate, freeze_step=freeze_step, rule=rule, b1=b1, b2=b2, eps=eps,
                weight_decay=weight_decay if decays else None, bias_correction=bias_correction, fused=fused,
                max_grad_norm=max_grad_norm, mask_unseen=mask_unseen, opts=opts)

    def init_fn(params):
        check_float_leaves(params, "param", WHO)
        check_nonempty_leaves(params, WHO)
        mask_leaves(exp_avg_mask, params, WHO)
        backend = backend_for(axis_name, mpi_comm)
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        worker, server = error_buffers(params, backend, fused=fused, row_scales=opts.row_scales)
        auto = {}
        if rule is not None:
            auto = dict(freeze_at=jnp.full([], rule.max_step, jnp.int32),
                        variance_norms=jax.tree.map(lambda p: jnp.zeros([], jnp.float32), params),
                        calm_checks=jnp.zeros([], jnp.int32))
        count = jnp.zeros([], jnp.int32)
        first = _phase_at(hp, count, auto["freeze_at"] if rule is not None else hp.freeze_step)
        return OneBitAdamState(
            count=count, mu=zeros, nu=jax.tree.map(jnp.copy, zeros), worker_error=worker, server_error=server,
            phase=jnp.zeros([], jnp.int32), next_phase=first, **auto,
        )

    def update_fn(grads, state, params=None):
        if decays and params is None:
            raise ValueError(f"{WHO}: weight_decay needs params; call update(grads, state, params)")
        check_float_leaves(grads, "gradient", WHO)
        check_matching_grads(grads, state.mu, "optimizer state (the params given to init)", WHO)
        if params is not None:
            check_matching_grads(grads, params, "params", WHO)
        backend = backend_for(axis_name, mpi_comm)
        check_local_grads(grads, backend, WHO)
        mask = mask_leaves(exp_avg_mask, grads, WHO)
        return _update(hp, backend, jax.tree.map(lambda g: g.astype(jnp.float32), grads), state, params, mask)

    return optax.GradientTransformation(init_fn, update_fn)


class _Hyper(NamedTuple):
    """The factory's checked arguments, as the update's phases read them."""

    learning_rate: Any
    freeze_step: int
    rule: AutoFreeze | None
    b1: Any
    b2: Any
    eps: Any
    weight_decay: Any  # None: no decay
    bias_correction: bool
    fused: bool
    max_grad_norm: Any
    mask_unseen: bool
    opts: OneBitAdamOptions


# ---- the phases -----------------------------------------------------------------------------------------------


def _moments(hp: _Hyper, state: OneBitAdamState, g, w):
    """Adam's moments on an exact mean gradient ``g``, the variance's weight ``w``."""
    mu = jax.tree.map(lambda m, g: hp.b1 * m + (1.0 - hp.b1) * g, state.mu, g)
    return mu, jax.tree.map(lambda v, g: w * v + (1.0 - w) * g * g, state.nu, g)


def _warmup(hp: _Hyper, backend, grads, state, errors, decision):
    clip = lambda g: clip_by_global_norm(g, hp.max_grad_norm)  # noqa: E731
    g = backend.mean(clip(grads)) if hp.opts.local_clip else clip(backend.mean(grads))
    mu, nu = _moments(hp, state, g, hp.b2)
    if hp.rule is not None:
        decision = auto_freeze_step(hp.rule, state.count, nu, state.variance_norms, state.calm_checks,
                                    state.freeze_at, backend, b2=hp.b2)
    return (mu, nu, *errors, *decision)


def _refresh(hp: _Hyper, backend, grads, state, errors, decision):
    # The mean of the locally clipped gradients: what the compressed updates around it average, so that v follows
    # the scale of the gradients m is made of (the clipped mean of warmup is larger).
    g = backend.mean(clip_by_global_norm(grads, hp.max_grad_norm))
    mu, nu = _moments(hp, state, g, hp.b2 ** hp.opts.variance_refresh)
    return (mu, nu, *errors, *decision)


def _compression(hp: _Hyper, backend, grads, state, errors, decision, mask, clock):
    opts = hp.opts
    mu = jax.tree.map(lambda m, g: hp.b1 * m + (1.0 - hp.b1) * g, state.mu,
                      clip_by_global_norm(grads, hp.max_grad_norm))
    we, se = errors
    if opts.preconditioned:  # the frozen denominator of the update (the variance's correction frozen too)
        _, c2, _ = step_scalars(state.count, b1=hp.b1, b2=hp.b2, freeze_step=clock, bias_correction=hp.bias_correction,
                                learning_rate=hp.learning_rate)
        denom = opts.preconditioner(state.nu, c2, hp.eps)
        mu = jax.tree.map(jnp.divide, mu, denom)
        if hp.mask_unseen:  # nothing reached these elements: keep them out of the scales
            mu = where_seen(mu, state.nu)
    if backend.size > 1:
        mu, we, se = compress(backend, mu, we, se, fused=hp.fused, row_scales=opts.row_scales,
                              error_feedback=opts.error_feedback)
    else:  # one rank has nothing to compress (DeepSpeed skips it too); the mean only fixes the type
        mu = backend.mean(mu)
    if opts.preconditioned:
        mu = jax.tree.map(jnp.multiply, mu, denom)
    if mask is not None:
        leaves, treedef = jax.tree.flatten(mu)
        mu = treedef.unflatten([m if k is None else m * jnp.asarray(k, jnp.float32)
                                for m, k in zip(leaves, mask, strict=True)])
    if hp.mask_unseen:  # the frozen variance is 0 exactly where no gradient has ever arrived
        mu = where_seen(mu, state.nu)
    return (mu, state.nu, we, se, *decision)


def _phase_at(hp: _Hyper, count, limit) -> jax.Array:
    """The phase of the update after ``count`` updates (int32), with ``limit`` warmup updates."""
    phase = jnp.where(count < limit, WARMUP, COMPRESSION)
    if hp.opts.variance_refresh is not None:
        phase = jnp.where((phase == COMPRESSION) & hp.opts.is_refresh(count, limit), REFRESH, phase)
    return phase.astype(jnp.int32)


def _update(hp: _Hyper, backend, grads, state: OneBitAdamState, params, mask):
    errors = state.worker_error, state.server_error
    for axis in mesh_axes(backend):
        # Errors differ per rank; fresh zeros from init in the same body are still typed invariant.
        errors = tuple(jax.tree.map(lambda e, a=axis: as_varying(e, a), t) for t in errors)
    # With freeze_step="auto" the decision so far (else the static freeze_step and nothing to carry).
    decision = (state.freeze_at, state.variance_norms, state.calm_checks) if hp.rule is not None else ()
    limit = state.freeze_at if hp.rule is not None else hp.freeze_step
    count = state.count
    # The variance's clock: the update whose bias correction the variance carries (the freeze, or the latest
    # refresh); step_scalars takes it as the point where the correction stops. During warmup the update is before
    # the clock, so the correction follows the update whatever the (auto) freeze point decides.
    clock = hp.opts.variance_clock(count, limit)
    args = (hp, backend, grads, state, errors, decision)
    branches = [lambda _: _warmup(*args), lambda _: _compression(*args, mask, clock)]
    if hp.opts.variance_refresh is not None:
        branches.append(lambda _: _refresh(*args))
    (mu, nu, worker_error, server_error, *decision), phase = run_phase(
        OneBitAdamState, _phase_at(hp, count, limit), branches)
    c1, c2, lr = step_scalars(count, b1=hp.b1, b2=hp.b2, freeze_step=clock, bias_correction=hp.bias_correction,
                              learning_rate=hp.learning_rate)

    def direction(m, v, p):
        u = hp.opts.clip((m / c1) / (jnp.sqrt(v / c2) + hp.eps), phase != WARMUP)
        if hp.weight_decay is not None:
            u = u + hp.weight_decay * p.astype(jnp.float32)
        return u

    ps = params if params is not None else grads
    updates = jax.tree.map(lambda m, v, p: (-lr * direction(m, v, p)).astype(p.dtype), mu, nu, ps)
    new_count = optax.safe_int32_increment(count)
    new_state = OneBitAdamState(
        count=new_count, mu=mu, nu=nu, worker_error=worker_error, server_error=server_error,
        phase=phase.astype(jnp.int32), next_phase=_phase_at(hp, new_count, decision[0] if hp.rule is not None
                                                            else hp.freeze_step),
        **(dict(zip(("freeze_at", "variance_norms", "calm_checks"), decision, strict=True))
           if hp.rule is not None else {}),
    )
    return updates, new_state


# ---- specs and initialisation in the global view --------------------------------------------------------------


def is_onebit_state(x) -> bool:
    """Whether ``x`` is the state of 1-bit Adam (whose error buffers are per rank)."""
    return isinstance(x, OneBitAdamState | OneBitAdamZeroState)


def onebit_adam_specs(node: OneBitAdamState, axis_name) -> OneBitAdamState:
    rows = lambda t: jax.tree.map(lambda _: P(axis_name), t)  # noqa: E731
    rep = lambda t: jax.tree.map(lambda _: P(), t)  # noqa: E731
    return OneBitAdamState(
        count=P(), mu=rep(node.mu), nu=rep(node.nu), worker_error=rows(node.worker_error),
        server_error=rows(node.server_error), phase=P(), next_phase=rep(node.next_phase), freeze_at=rep(node.freeze_at),
        variance_norms=rep(node.variance_norms), calm_checks=rep(node.calm_checks),
    )


def state_specs(opt_state, axis_name: str | tuple[str, str] = "data"):
    """``PartitionSpec`` tree that carries an optimizer state in and out of ``shard_map`` as global arrays.

    Error buffers of every 1-bit family state in the tree get ``P(axis_name)`` (one row per rank on the leading
    axis; for a hierarchical pair ``("hosts", "local")``, ``P(("hosts", "local"))``: one row per device, in mesh
    order), by the rule each state registered with :func:`jonebit.sharding.zero.register_per_rank_state`;
    everything else, here and in other transforms of an ``optax.chain``, is replicated ``P()``.
    Works on arrays and ``jax.ShapeDtypeStruct`` trees alike.
    """

    def spec(node):
        rule = per_rank_rule(node)
        if rule is not None:  # None in a rule's tree: replicated, unless the state has no leaf there either
            return jax.tree.map(lambda s, x: s if s is not None else (None if x is None else P()),
                                rule(node, axis_name), node, is_leaf=lambda s: s is None or isinstance(s, P))
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
        return per_rank_rule(x) is not None or isinstance(x, P)

    return jax.tree.map(spec, opt_state, is_leaf=is_leaf)


def local_abstract_state(tx_or_init, params, mesh: jax.sharding.Mesh):
    """``tx.init`` traced in the per-device view (shapes only); takes a transform or its init function."""
    init = getattr(tx_or_init, "init", tx_or_init)
    return jax.eval_shape(jax.shard_map(init, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False), params)


def per_device_init(tx: optax.GradientTransformation, mesh: jax.sharding.Mesh, specs):
    """``tx.init`` run in the per-device view on replicated params, its state returned as global arrays laid out by
    ``specs`` (from :func:`state_specs`)."""
    return jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)


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
    specs = state_specs(local_abstract_state(tx, params, mesh), axis_name)
    return jax.jit(per_device_init(tx, mesh, specs))(params), specs


# ZeRO planning (jonebit.sharding.zero_shardings) must not apply its per-leaf rule to these states: the plain
# transform needs m and v whole, the ZeRO variant has its own chunk layout, and error buffers are per rank.
register_per_rank_state(OneBitAdamState, onebit_adam_specs)
register_per_rank_state(OneBitAdamZeroState, zero_state_specs)
