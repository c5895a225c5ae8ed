"""1-bit LAMB as an optax ``GradientTransformation``, with DeepSpeed's (0.16.x ``OnebitLamb``) semantics.

Two stages, switched inside one compiled step by ``lax.cond`` on the update count:

* **warmup**, updates ``1 .. freeze_step``: LAMB on the gradient averaged over ranks. Per tensor, with the trust
  ratio ``c = clip(||p|| / ||u||, min_coeff, max_coeff)`` (1 if a norm is 0)::

      m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;  u = m / (sqrt(v) + eps) + wd p;  p -= lr c u
      c_frozen = coeff_beta c_frozen + (1 - coeff_beta) c      (only where c != 1; starts at 0, no correction)

  The last warmup update copies ``v`` into ``v_fresh``.
* **compression**, afterwards: ``v`` and ``c_frozen`` are frozen. Each rank folds its local gradient into the
  momentum, every tensor's momentum is scaled to a common RMS (coefficients fixed at the first compression step),
  and the whole model's momentum is averaged by **one** error-compensated 1-bit allreduce of a fused buffer. The
  gradient reconstructed from the averaged momentum keeps ``v_fresh`` current, and the ratio of the frozen to the
  fresh preconditioner moves each tensor's coefficient within clamps::

      m = compressed_allreduce((b1 m + (1 - b1) g_local) * s) / s * mask
      g~ = (m - b1 m_prev) / (1 - b1);  v_fresh = b2 v_fresh + (1 - b2) g~^2
      f = max((sqrt(v) + eps) / (sqrt(v_fresh) + eps)), blended towards 1 by the weight-decay share of u,
          clipped to [factor_min, factor_max] and to last_factor * (1 -+ factor_threshold)
      p -= lr c_frozen f (m / (sqrt(v) + eps) + wd p)

The fused buffer is the momenta in leaf order plus a tail of padding up to a multiple of ``P * lcm(P, 8)``. As in
DeepSpeed, the tail starts at zero and afterwards holds what the previous allreduce decoded there (it enters the
next step's scales); it is part of the state.

``freeze_step="auto"`` replaces the fixed switch by a rule (:class:`jonebit.AutoFreeze`): every ``check_every``
warmup updates the per-tensor norms of the bias-corrected variance are compared with the previous check, and
compression starts once the median relative change (or the ``statistic`` chosen) stayed below ``threshold`` for
``patience`` checks (between ``min_step`` and ``max_step`` updates). The decision is taken inside the compiled step
from replicated values, so every rank takes it at the same update; it is logged once and kept in the state
(``freeze_at``), so a resumed run continues it.

Parameters and moments are identical on all ranks (params can stay replicated, ``P()``); only the two error
buffers are per rank (:func:`jonebit.state_specs`).

Differences from DeepSpeed (fixes of its defects):

* a tensor whose momentum is all zeros at the freeze gets the scaling coefficient 1 (DeepSpeed: infinite, which
  turns the whole fused buffer into NaN);
* the weight-decay blend of the factor is skipped (ratio 1) when the update norm is zero (DeepSpeed: 0/0);
* the mask is applied with one rank too;
* ``mask_unseen`` (default): elements whose frozen variance is exactly 0 keep a zero momentum
  (``mask_unseen=False`` is DeepSpeed's arithmetic, which divides their 1-bit average by ``eps``);
* checkpoints keep everything, including the error buffers and the fused buffer's tail (DeepSpeed rebuilds the
  buffer, zeroes the errors, and before ``freeze_step`` also resets the coefficients).

References:
  Li et al., "1-bit LAMB: Communication Efficient Large-Scale Large-Batch Training with LAMB's Convergence
  Speed", HiPC 2022, https://arxiv.org/abs/2104.06069.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jonebit.comm.backends import get_backend
from jonebit.comm.compressed import padded_size
from jonebit.sharding.zero import register_per_rank_state
from jonebit.transforms import base
from jonebit.transforms.base import ScalarOrSchedule
from jonebit.transforms.phases import run_phase

_WHO = "onebit_lamb"


class OneBitLambState(NamedTuple):
    """State of :func:`onebit_lamb`.

    Attributes:
      count: updates applied so far (int32); ``count < freeze_at`` means warmup.
      mu: momentum, float32, like the params; identical on all ranks.
      nu: variance, like the params; frozen after warmup.
      nu_fresh: the variance kept current from the reconstructed gradient during compression (``exp_avg_sq_fresh``).
      lamb_coeff_freeze: per tensor (a float32 scalar per leaf): the EMA of the warmup trust ratios.
      last_factor: per tensor: the previous compression step's factor (starts at 1).
      scaling_coeff: per tensor: momentum scaling in the fused buffer (1 until the first compression step).
      padding: the fused buffer's tail beyond the momenta, ``padded_size(N, P) - N`` floats.
      worker_error: this rank's worker error of the fused buffer, ``(1, padded_size(N, P))``.
      server_error: this rank's server error, ``(1, padded_size(N, P) // P)``.
      freeze_at: number of warmup updates (int32): ``freeze_step``, or with ``freeze_step="auto"`` the cap until the
        rule fires and then the update it fired on (kept, so a resumed run continues the decision).
      variance_norms: per tensor, ``||v / (1 - b2^t)||`` at the last check of the automatic rule (unused with a
        fixed freeze_step).
      calm_checks: consecutive calm checks of the automatic rule.
      phase: the phase the last update ran, an index into ``PHASES`` (int32).
      next_phase: the phase the next update runs (int32), which jonebit's step builders read to run a program
        compiled for that phase alone (:mod:`jonebit.transforms.phases`).
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    nu_fresh: optax.Updates
    lamb_coeff_freeze: Any
    last_factor: Any
    scaling_coeff: Any
    padding: jax.Array
    worker_error: jax.Array
    server_error: jax.Array
    freeze_at: jax.Array
    variance_norms: Any
    calm_checks: jax.Array
    phase: jax.Array
    next_phase: Any = None

    PHASES = ("warmup", "compression")


def onebit_lamb(
    learning_rate: ScalarOrSchedule,
    *,
    freeze_step: int | str | base.AutoFreeze,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    bias_correction: bool = False,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
    coeff_beta: float = 0.9,
    factor_max: float = 4.0,
    factor_min: float = 0.5,
    factor_threshold: float = 0.1,
    exp_avg_mask: Any = None,
    axis_name: str | None = "data",
    mpi_comm: Any = None,
    mask_unseen: bool = True,
) -> optax.GradientTransformation:
    """1-bit LAMB (Li et al., 2021) with DeepSpeed's semantics (see the module docstring for the stages).

    Args:
      learning_rate: a float or an optax schedule of the update count (0-based).
      freeze_step: number of full-precision LAMB updates before compression starts (>= 1). DeepSpeed's
        ``freeze_step=F`` gives ``F - 1`` of them (its first ``step()`` only initialises): pass ``F - 1``.
        Keep ``1 / (1 - coeff_beta) <= freeze_step`` so that the coefficient EMA has warmed up. ``"auto"``: switch
        when the variance has settled, by the default :class:`jonebit.AutoFreeze` rule, or by the one given instead of
        a number (decided inside the compiled step identically on every rank, logged once, kept in ``freeze_at``).
      b1: momentum decay.
      b2: variance decay.
      eps: added to ``sqrt(v)``.
      weight_decay: decoupled weight decay, inside the trust ratio (LAMB); needs ``params`` in ``update``.
      bias_correction: must stay ``False`` (DeepSpeed ignores its flag; the frozen coefficients assume no correction).
      max_coeff: upper clamp of the warmup trust ratio.
      min_coeff: lower clamp of the warmup trust ratio.
      coeff_beta: decay of the EMA of the trust ratio that is frozen at ``freeze_step``.
      factor_max: upper clamp of the compression-stage factor.
      factor_min: lower clamp of the compression-stage factor.
      factor_threshold: the factor moves by at most this fraction of its previous value per step.
      exp_avg_mask: optional mask multiplied into the averaged momentum, in :func:`jonebit.onebit_adam`'s format
        (a leaf is None, or 0/1 values with the param's shape or 1 where it broadcasts, e.g. ``(rows, 1)``).
      axis_name: the ``jax.shard_map`` mesh axis of the data-parallel ranks.
      mpi_comm: an mpi4py communicator (or :class:`~jonebit.comm.MPIBackend`); the collectives then go through MPI.
      mask_unseen: in the compression stage, elements whose frozen variance is exactly 0 (no gradient reached them
        during warmup, e.g. embedding rows of tokens not yet seen) keep a zero momentum and get no update but weight
        decay (default). ``False`` is DeepSpeed's arithmetic: the 1-bit average gives them their chunk's magnitude,
        which the step divides by ``eps``.

    Returns:
      An ``optax.GradientTransformation`` whose ``update(local_grads, state, params)`` expects this rank's local
      gradient and the (replicated) params.
    """
    if not isinstance(mask_unseen, bool):
        raise TypeError(f"{_WHO}: mask_unseen must be True or False, got {mask_unseen!r}")
    if bias_correction:
        raise ValueError(
            f"{_WHO}: bias_correction=True is not supported: DeepSpeed's 1-bit LAMB ignores the flag, and its frozen "
            "trust-ratio coefficients are fitted to the uncorrected update; pass bias_correction=False"
        )
    rule = None
    if isinstance(freeze_step, base.AutoFreeze):
        rule = freeze_step.checked(_WHO)
        freeze_step = rule.max_step
    elif isinstance(freeze_step, str):
        if freeze_step != "auto":
            raise ValueError(f"{_WHO}: freeze_step must be an int, \"auto\" or a jonebit.AutoFreeze, got "
                             f"{freeze_step!r}")
        rule = base.AutoFreeze().checked(_WHO)
        freeze_step = rule.max_step
    else:
        freeze_step = base.check_int(
            "freeze_step", freeze_step, minimum=1, who=_WHO,
            hint=" (compression needs a variance estimated on at least one warmup update; DeepSpeed's freeze_step=F "
                 "is F - 1 here)")
    base.check_betas_eps(_WHO, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, coeff_beta=coeff_beta)
    _check_bounds("min_coeff", min_coeff, "max_coeff", max_coeff, floor=0.0)
    _check_bounds("factor_min", factor_min, "factor_max", factor_max, floor=0.0)
    if base.is_number(factor_threshold) and not 0.0 <= factor_threshold < 1.0:
        raise ValueError(f"{_WHO}: factor_threshold must be in [0, 1), got {factor_threshold}")
    exp_avg_mask = base.normalise_mask(exp_avg_mask, _WHO)  # values checked once
    decays = not (base.is_number(weight_decay) and weight_decay == 0)
    if mpi_comm is not None:
        axis_name = None

    def init_fn(params):
        base.check_float_leaves(params, "param", _WHO)
        n = base.num_elements(params)
        if n == 0:
            raise ValueError(f"{_WHO}: the params have no elements")
        base.mask_leaves(exp_avg_mask, params, _WHO)  # checked against the params once, at init
        backend = get_backend(axis_name, mpi_comm)
        zeros = lambda: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)  # noqa: E731
        scalars = lambda v: jax.tree.map(lambda _: jnp.full([], v, jnp.float32), params)  # noqa: E731
        worker, server = base.error_buffers(params, backend.size, fused=True)
        return OneBitLambState(
            count=jnp.zeros([], jnp.int32), mu=zeros(), nu=zeros(), nu_fresh=zeros(),
            lamb_coeff_freeze=scalars(0.0), last_factor=scalars(1.0), scaling_coeff=scalars(1.0),
            padding=jnp.zeros(padded_size(n, backend.size) - n, jnp.float32),
            worker_error=worker, server_error=server, freeze_at=jnp.full([], freeze_step, jnp.int32),
            variance_norms=scalars(0.0), calm_checks=jnp.zeros([], jnp.int32), phase=jnp.zeros([], jnp.int32),
            next_phase=_phase_at(jnp.zeros([], jnp.int32), jnp.full([], freeze_step, jnp.int32)),
        )

    def update_fn(grads, state, params=None):
        if params is None:
            raise ValueError(f"{_WHO}: LAMB's trust ratio needs params; call update(grads, state, params)")
        base.check_float_leaves(grads, "gradient", _WHO)
        mask = base.mask_leaves(exp_avg_mask, grads, _WHO)
        backend = get_backend(axis_name, mpi_comm)
        base.check_local_grads(grads, backend, _WHO)
        base.check_replicated_params(params, backend, _WHO)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        ps = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        we, se = base.per_rank(state.worker_error, backend), base.per_rank(state.server_error, backend)
        count = state.count
        lr = jnp.asarray(base.learning_rate_at(learning_rate, count), jnp.float32)
        norm = lambda x: jnp.sqrt(jnp.sum(x * x))  # noqa: E731

        def warmup(_):
            g = backend.mean(grads)
            m = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, state.mu, g)
            v = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * g * g, state.nu, g)
            freeze_at, norms, calm = state.freeze_at, state.variance_norms, state.calm_checks
            if rule is not None:
                freeze_at, norms, calm = base.auto_freeze_step(rule, count, v, norms, calm, freeze_at, backend,
                                                                 b2=b2)
            # The last warmup update starts the fresh variance from v.
            v_fresh = jax.tree.map(lambda f, v: jnp.where(count == freeze_at - 1, v, f), state.nu_fresh, v)

            def tensor(m, v, p, frozen):
                u = m / (jnp.sqrt(v) + eps) + weight_decay * p
                pn, un = norm(p), norm(u)
                c = jnp.where((pn != 0) & (un != 0),
                              jnp.clip(pn / jnp.where(un != 0, un, 1.0), min_coeff, max_coeff), 1.0)
                frozen = jnp.where(c != 1.0, coeff_beta * frozen + (1.0 - coeff_beta) * c, frozen)
                return -lr * c * u, frozen

            out = jax.tree.map(tensor, m, v, ps, state.lamb_coeff_freeze)
            updates, frozen = _unzip(out, m)
            return (updates, m, v, v_fresh, frozen, state.last_factor, state.scaling_coeff, state.padding, we, se,
                    freeze_at, norms, calm)

        def compression(_):
            m_prev = state.mu
            # The momenta's common RMS over their own RMS, fixed at the first compression step.
            rms = jax.tree.map(lambda m: norm(m) / math.sqrt(max(m.size, 1)), m_prev)
            united = sum(jax.tree.leaves(rms)) / len(jax.tree.leaves(rms))
            first = count == state.freeze_at
            scaling = jax.tree.map(lambda s, r: jnp.where(first, jnp.where(r > 0, united / jnp.where(r > 0, r, 1.0),
                                                                           1.0), s), state.scaling_coeff, rms)
            m_local = jax.tree.map(lambda m, g, s: (b1 * m + (1.0 - b1) * g) * s, m_prev, grads, scaling)
            padding, we1, se1 = state.padding, we, se
            if backend.size > 1:  # one compressed allreduce of the fused buffer, tail included
                leaves, treedef = jax.tree.flatten(m_local)
                flat = jnp.concatenate([base.flatten(m_local), padding])
                parts, we1, se1 = base.compressed_mean_flat(backend, flat, we, se,
                                                              [x.size for x in leaves] + [padding.size])
                m_avg = treedef.unflatten([q.reshape(x.shape) for q, x in zip(parts, leaves, strict=False)])
                padding = parts[-1]
                we1, se1 = base.per_rank(we1, backend), base.per_rank(se1, backend)
            else:  # nothing to average (the mean only types the result as replicated)
                m_avg = backend.mean(m_local)
            m = base.apply_mask(jax.tree.map(jnp.divide, m_avg, scaling), mask)
            if mask_unseen:  # the frozen variance is 0 exactly where no gradient has ever arrived
                m = base.where_seen(m, state.nu)
            v_fresh = jax.tree.map(
                lambda f, m, mp: b2 * f + (1.0 - b2) * jnp.square((m - b1 * mp) / (1.0 - b1)),
                state.nu_fresh, m, m_prev)

            def tensor(m, v, vf, p, frozen, last):
                denom = jnp.sqrt(v) + eps
                u0 = m / denom
                u = u0 + weight_decay * p if decays else u0
                f = jnp.max(denom / (jnp.sqrt(vf) + eps))
                if decays:  # the share of the update that is not weight decay pulls f towards 1
                    un = norm(u)
                    rho = jnp.where(un > 0, jnp.minimum(1.0, norm(u0) / jnp.where(un > 0, un, 1.0)), 1.0)
                    f = rho * f + (1.0 - rho)
                f = jnp.clip(f, factor_min, factor_max)
                f = jnp.clip(f, last * (1.0 - factor_threshold), last * (1.0 + factor_threshold))
                return -lr * (frozen * f) * u, f

            out = jax.tree.map(tensor, m, state.nu, v_fresh, ps, state.lamb_coeff_freeze, state.last_factor)
            updates, last = _unzip(out, m)
            return (updates, m, state.nu, v_fresh, state.lamb_coeff_freeze, last, scaling, padding, we1, se1,
                    state.freeze_at, state.variance_norms, state.calm_checks)

        (updates, mu, nu, nu_fresh, frozen, last, scaling, padding, we, se, freeze_at, norms, calm), phase = (
            run_phase(OneBitLambState, _phase_at(count, state.freeze_at), (warmup, compression)))
        updates = jax.tree.map(lambda d, p: d.astype(p.dtype), updates, params)
        new_count = optax.safe_int32_increment(count)
        return updates, OneBitLambState(
            count=new_count, mu=mu, nu=nu, nu_fresh=nu_fresh, lamb_coeff_freeze=frozen,
            last_factor=last, scaling_coeff=scaling, padding=padding, worker_error=we, server_error=se,
            freeze_at=freeze_at, variance_norms=norms, calm_checks=calm, phase=phase.astype(jnp.int32),
            next_phase=_phase_at(new_count, freeze_at),
        )

    return optax.GradientTransformation(init_fn, update_fn)


def _phase_at(count, freeze_at) -> jax.Array:
    """The phase of the update after ``count`` updates, an index into ``OneBitLambState.PHASES`` (int32)."""
    return jnp.where(count < freeze_at, 0, 1).astype(jnp.int32)


def _check_bounds(lo_name: str, lo, hi_name: str, hi, *, floor: float) -> None:
    if base.is_number(lo) and lo < floor:
        raise ValueError(f"{_WHO}: {lo_name} must be >= {floor}, got {lo}")
    if base.is_number(lo) and base.is_number(hi) and hi < lo:
        raise ValueError(f"{_WHO}: {hi_name} ({hi}) must be >= {lo_name} ({lo})")


def _unzip(pairs, like):
    """A tree of ``(a, b)`` tuples at the leaves of ``like`` -> ``(tree of a, tree of b)``."""
    treedef = jax.tree.structure(like)
    flat = treedef.flatten_up_to(pairs)
    return treedef.unflatten([a for a, _ in flat]), treedef.unflatten([b for _, b in flat])


def onebit_lamb_specs(state: OneBitLambState, axis_name: str = "data") -> OneBitLambState:
    """``PartitionSpec``s of a :class:`OneBitLambState`: the two error buffers per rank, the rest replicated."""
    rep = lambda t: jax.tree.map(lambda _: P(), t)  # noqa: E731
    return OneBitLambState(
        count=P(), mu=rep(state.mu), nu=rep(state.nu), nu_fresh=rep(state.nu_fresh),
        lamb_coeff_freeze=rep(state.lamb_coeff_freeze), last_factor=rep(state.last_factor),
        scaling_coeff=rep(state.scaling_coeff), padding=P(), worker_error=P(axis_name), server_error=P(axis_name),
        freeze_at=P(), variance_norms=rep(state.variance_norms), calm_checks=P(), phase=P(),
        next_phase=rep(state.next_phase),
    )


# jonebit.state_specs and the ZeRO planner read this rule: errors per rank, the moments whole at every stage.
register_per_rank_state(OneBitLambState, onebit_lamb_specs)
