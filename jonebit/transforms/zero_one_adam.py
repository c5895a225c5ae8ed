"""0/1 Adam as an optax ``GradientTransformation``, with DeepSpeed's (0.16.x ``ZeroOneAdam``) semantics.

Two phases, and every schedule decision, inside one compiled step (``lax.cond`` on integer state leaves).
``s = count + 2`` below is DeepSpeed's step counter of the update (its first ``step()`` only initialises):

* **adaptive variance freezing**, updates ``1 .. var_freeze_step``. A *variance step* (``s % var_interval == 0``)
  averages the gradients in full precision and updates both moments; any other step averages the gradients with
  the error-compensated 1-bit allreduce and updates only the momentum::

      variance step:  g = mean_ranks(g_local); m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2
      other steps:    m = b1 m + (1 - b1) mask * compressed_allreduce(g_local)

  After ``var_update_scaler`` variance steps the interval doubles (16 consecutive, 16 two apart, ...).
* **local steps**, afterwards. The variance is frozen; each rank moves its own parameters with its local
  momentum and accumulates the moves in ``u``. Every ``local_step_interval`` steps (``s % interval == 0``)
  the ranks synchronise: the local moves are undone, ``u`` is stripped of the preconditioner, averaged by the
  1-bit allreduce and applied once; the averaged ``u`` also becomes the new momentum::

      local step:  m = b1 m + (1 - b1) g_local;  d = m / (sqrt(v) + eps) + wd p;  p -= lr d;  u -= lr d
      sync step:   p -= u;  w = mask * compressed_allreduce(u * (sqrt(v) + eps));  m = -w / sum(lr);
                   p += w / (sqrt(v) + eps);  u = 0

  After ``local_step_scaler`` local-phase steps the interval doubles, up to ``local_step_clipper``.

The update is ``-lr (m / (sqrt(v) + eps) + weight_decay p)`` (decoupled weight decay; no bias correction unless
``bias_correction=True``).

Because parameters differ between ranks during the local steps, they are **per-rank** data: inside
``jax.shard_map`` carry them (and ``m`` and ``u`` in the state) with a leading rank axis, ``P(axis_name)``, as
the example in :func:`zero_one_adam` shows. :func:`state_specs` gives the state's specs.

Differences from DeepSpeed (all fixes of its defects; the arithmetic is otherwise the same):

* one rank: DeepSpeed leaves the momentum untouched on the non-variance steps of the first phase when ``P = 1``
  (it updates it only inside its ``P > 1`` branch); here the momentum takes the gradient (the exact mean).
* the mask is applied with ``P = 1`` too (DeepSpeed applies it only after a compressed allreduce).
* ``mask_unseen`` (default): elements whose variance is exactly 0 take no 1-bit average and keep a zero momentum
  (``mask_unseen=False`` is DeepSpeed's arithmetic, which divides their average by ``eps``).
* checkpoints keep everything (errors, ``u``, schedule counters and the phase): DeepSpeed resets the counters
  on load and loses the phase, which after a resume in the local phase updates the frozen variance with local
  gradients.

References:
  Lu et al., "Maximizing Communication Efficiency for Large-scale Training via 0/1 Adam", ICLR 2023,
  https://arxiv.org/abs/2202.06009.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jonebit.comm.backends import get_backend
from jonebit.sharding.zero import register_per_rank_state
from jonebit.transforms import base
from jonebit.transforms.base import ScalarOrSchedule
from jonebit.transforms.phases import run_phase

_WHO = "zero_one_adam"


class ZeroOneAdamState(NamedTuple):
    """State of :func:`zero_one_adam`.

    Attributes:
      count: updates applied so far (int32); DeepSpeed's step counter is ``count + 1``.
      mu: momentum, float32, a tree like the params with a leading axis of 1 (per rank: it differs between ranks
        during local steps).
      nu: variance, float32, like the params; identical on all ranks.
      momentum_accumulator: ``u``, the sum of local moves since the last synchronisation, per rank like ``mu``.
      lrs: sum of the learning rates since the last synchronisation (float32).
      var_interval: steps between variance updates (int32, doubles every ``var_update_scaler`` of them).
      var_counter: variance updates since the interval last doubled.
      local_step_interval: steps between synchronisations in the local phase.
      local_step_counter: local-phase steps since that interval last doubled.
      var_updates: number of variance updates so far (the variance's bias correction, ``bias_correction=True``).
      worker_error, server_error: this rank's error buffers, leading axis 1 (``fused``: one array, otherwise one
        stacked array per group of equal-size leaves, as in :class:`OneBitAdamState`). They hold the gradient's
        error before ``var_freeze_step`` and ``u``'s afterwards.
    """

    count: jax.Array
    mu: Any
    nu: Any
    momentum_accumulator: Any
    lrs: jax.Array
    var_interval: jax.Array
    var_counter: jax.Array
    local_step_interval: jax.Array
    local_step_counter: jax.Array
    var_updates: jax.Array
    worker_error: Any
    server_error: Any
    phase: jax.Array
    next_phase: Any = None

    PHASES = ("variance_freezing", "local_steps")
    PARAMS_PER_RANK = True  # the local steps move each rank's own parameters


def zero_one_adam(
    learning_rate: ScalarOrSchedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    bias_correction: bool = False,
    var_freeze_step: int = 100000,
    var_update_scaler: int = 16,
    local_step_scaler: int = 32678,
    local_step_clipper: int = 16,
    exp_avg_mask: Any = None,
    fused: bool = True,
    axis_name: str | None = "data",
    mpi_comm: Any = None,
    mask_unseen: bool = True,
) -> optax.GradientTransformation:
    r"""0/1 Adam (Lu et al., 2022) with DeepSpeed's semantics (see the module docstring for the phases).

    Args:
      learning_rate: a float or an optax schedule of the update count (0-based).
      b1: momentum decay.
      b2: variance decay.
      eps: added to ``sqrt(v)`` (outside the square root).
      weight_decay: decoupled weight decay (AdamW form); needs ``params`` in ``update``.
      bias_correction: Adam's bias correction (DeepSpeed ignores its flag: default off). The variance is corrected
        by ``1 - b2^k`` with ``k`` the variance updates so far (frozen with the variance); the momentum by
        ``1 - b1^t`` in the first phase only (the local phase re-derives m from the synchronised moves, and
        ``1 - b1^t`` > 0.99 after 44 updates). Without it the variance, updated on few steps, stays far below its
        scale on short runs (measured on the demo LM: see BENCHMARKS).
      var_freeze_step: number of updates in the variance-freezing phase (the variance may change on updates
        ``1 .. var_freeze_step``); the local-step phase follows. Same number as DeepSpeed's (whose strict ``>``
        comparison cancels its initialisation step), >= 1.
      var_update_scaler: variance updates before the variance interval doubles (DeepSpeed's kappa).
      local_step_scaler: local-phase steps before the synchronisation interval doubles (DeepSpeed's default
        32678 is kept as is).
      local_step_clipper: the largest synchronisation interval.
      exp_avg_mask: optional mask multiplied into every compressed average, in :func:`jonebit.onebit_adam`'s
        format (a leaf is None, or 0/1 values with the param's shape or 1 where it broadcasts, e.g. ``(rows, 1)``).
      fused: ``True`` compresses all leaves as one buffer (DeepSpeed's fp16 path); ``False`` each leaf on its own
        (its fp32 path).
      axis_name: the ``jax.shard_map`` mesh axis of the data-parallel ranks.
      mpi_comm: an mpi4py communicator (or :class:`~jonebit.comm.MPIBackend`); the collectives then go through MPI.
      mask_unseen: elements whose variance is exactly 0 (no variance step has seen a gradient there, e.g. the
        embedding rows of tokens not yet seen) take no compressed average and keep a zero momentum, so they move
        only by weight decay (default). ``False`` is DeepSpeed's arithmetic: the 1-bit average gives them their
        chunk's magnitude, which the step divides by ``eps``. Elements whose variance is tiny but not 0 are not
        covered: give the variance steps time, or raise ``eps``.

    Returns:
      An ``optax.GradientTransformation``; ``update(local_grads, state, params)`` takes this rank's gradient and
      parameters and returns this rank's updates (different per rank during the local steps).

    Example::

      tx = jonebit.zero_one_adam(1e-3, var_freeze_step=1000)
      state, specs = jonebit.sharded_init(tx, params, mesh)
      params = jax.tree.map(lambda x: jnp.broadcast_to(x, (P,) + x.shape), params)  # one copy per rank

      @jax.shard_map(mesh=mesh, in_specs=(P("data"), specs, P("data")), out_specs=(P("data"), specs))
      def step(params, opt_state, batch):
          params = jax.tree.map(lambda x: x[0], params)  # this rank's copy (varying: local gradients)
          grads = jax.grad(loss_fn)(params, batch)
          updates, opt_state = tx.update(grads, opt_state, params)
          return jax.tree.map(lambda x: x[None], optax.apply_updates(params, updates)), opt_state
    """
    for name, value in (("bias_correction", bias_correction), ("mask_unseen", mask_unseen)):
        if not isinstance(value, bool):
            raise TypeError(f"{_WHO}: {name} must be True or False, got {value!r}")
    var_freeze_step = base.check_int(
        "var_freeze_step", var_freeze_step, minimum=1, who=_WHO,
        hint=" (the variance must be estimated on at least one update before it is frozen)")
    kappa = base.check_int("var_update_scaler", var_update_scaler, minimum=1, who=_WHO)
    scaler = base.check_int("local_step_scaler", local_step_scaler, minimum=1, who=_WHO)
    clipper = base.check_int("local_step_clipper", local_step_clipper, minimum=1, who=_WHO)
    base.check_betas_eps(_WHO, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    exp_avg_mask = base.normalise_mask(exp_avg_mask, _WHO)  # values checked once
    decays = not (base.is_number(weight_decay) and weight_decay == 0)
    if mpi_comm is not None:
        axis_name = None

    def init_fn(params):
        base.check_float_leaves(params, "param", _WHO)
        if base.num_elements(params) == 0:
            raise ValueError(f"{_WHO}: the params have no elements")
        base.mask_leaves(exp_avg_mask, params, _WHO)  # checked against the params once, at init
        backend = get_backend(axis_name, mpi_comm)
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        rows = jax.tree.map(lambda p: jnp.zeros((1, *p.shape), jnp.float32), params)
        worker, server = base.error_buffers(params, backend.size, fused)
        one, zero = jnp.ones([], jnp.int32), jnp.zeros([], jnp.int32)
        return ZeroOneAdamState(
            count=zero, mu=rows, nu=zeros, momentum_accumulator=jax.tree.map(jnp.copy, rows),
            lrs=jnp.zeros([], jnp.float32), var_interval=one, var_counter=zero,
            local_step_interval=jnp.copy(one), local_step_counter=jnp.copy(zero), var_updates=jnp.copy(zero),
            worker_error=worker, server_error=server, phase=jnp.copy(zero),
            next_phase=jnp.where(zero < var_freeze_step, 0, 1).astype(jnp.int32),
        )

    def update_fn(grads, state, params=None):
        if decays and params is None:
            raise ValueError(f"{_WHO}: weight_decay needs params; call update(grads, state, params)")
        base.check_float_leaves(grads, "gradient", _WHO)
        mask = base.mask_leaves(exp_avg_mask, grads, _WHO)
        backend = get_backend(axis_name, mpi_comm)
        base.check_local_grads(grads, backend, _WHO)
        base.check_per_rank_params(params, backend, _WHO)
        local = lambda t: base.per_rank(t, backend)  # noqa: E731
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        row = lambda t: jax.tree.map(lambda x: x[0], t)  # noqa: E731
        mu, u = local(row(state.mu)), local(row(state.momentum_accumulator))
        nu, we, se = state.nu, local(state.worker_error), local(state.server_error)
        ps = jax.tree.map(lambda p: p.astype(jnp.float32), params) if params is not None else grads
        count = state.count
        ds_step = count + 2  # DeepSpeed's state['step'] after its increment in this call
        lr = jnp.asarray(base.learning_rate_at(learning_rate, count), jnp.float32)

        def denominator(v, var_updates):
            if not bias_correction:
                return jnp.sqrt(v) + eps
            return jnp.sqrt(v / (1.0 - b2 ** var_updates.astype(jnp.float32))) + eps

        def direction(m, v, p, var_updates, first_phase):
            if bias_correction and first_phase:
                m = m / (1.0 - b1 ** (count + 1).astype(jnp.float32))
            d = m / denominator(v, var_updates)
            return d + weight_decay * p if decays else d

        def seen(tree, v, other=None):
            """``tree`` where the variance is > 0; elsewhere 0 (or ``other``): see ``mask_unseen``."""
            return base.where_seen(tree, v, other) if mask_unseen else tree

        def compress(tree, we, se):
            if backend.size == 1:  # nothing to average (DeepSpeed skips the call too)
                return tree, we, se
            out, we, se = base.compressed_mean(backend, tree, we, se, fused=fused)
            return out, local(we), local(se)

        def variance_freezing(_):
            def variance_step(_):
                g = backend.mean(grads)
                m = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, mu, g)
                v = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * g * g, nu, g)
                return local(m), v, we, se

            def onebit_step(_):
                g, we1, se1 = compress(grads, we, se)
                g = seen(base.apply_mask(g, mask), nu)
                m = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, mu, g)
                return local(m), nu, we1, se1

            is_var = ds_step % state.var_interval == 0
            m, v, we1, se1 = lax.cond(is_var, variance_step, onebit_step, None)
            var_updates = state.var_updates + is_var.astype(jnp.int32)
            updates = jax.tree.map(lambda m, v, p: -lr * direction(m, v, p, var_updates, True), m, v, ps)
            var_counter = state.var_counter + is_var.astype(jnp.int32)
            doubled = var_counter == kappa
            # The errors switch from the gradient's to u's when the local phase starts: they restart at zero.
            freezing = count + 1 >= var_freeze_step
            we1, se1 = (jax.tree.map(lambda e: jnp.where(freezing, jnp.zeros_like(e), e), t) for t in (we1, se1))
            return (updates, m, v, u, state.lrs, we1, se1,
                    jnp.where(doubled, 2 * state.var_interval, state.var_interval),
                    jnp.where(doubled, 0, var_counter), state.local_step_interval, state.local_step_counter,
                    var_updates)

        def local_steps(_):
            m = local(seen(jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, mu, grads), nu))
            lrs = state.lrs + lr
            moves = jax.tree.map(lambda m, v, p: -lr * direction(m, v, p, state.var_updates, False), m, nu, ps)
            acc = jax.tree.map(jnp.add, u, moves)

            def sync(_):
                denom = jax.tree.map(lambda v: denominator(v, state.var_updates), nu)
                scaled = jax.tree.map(jnp.multiply, acc, denom)
                w, we1, se1 = compress(scaled, we, se)
                # Unseen elements keep their own moves (weight decay only), not the 1-bit average.
                w = seen(base.apply_mask(w, mask), nu, scaled)
                m_synced = jax.tree.map(lambda w: -w / lrs, w)
                # p - lr d - u + w / denom: undo the local moves, apply the averaged one.
                updates = jax.tree.map(lambda mv, a, w, dn: mv - a + w / dn, moves, acc, w, denom)
                zeros = jax.tree.map(jnp.zeros_like, acc)
                return updates, local(m_synced), local(zeros), jnp.zeros_like(lrs), we1, se1

            def no_sync(_):
                return moves, m, acc, lrs, we, se

            is_sync = ds_step % state.local_step_interval == 0
            updates, m, acc, lrs, we1, se1 = lax.cond(is_sync, sync, no_sync, None)
            local_counter = state.local_step_counter + 1
            doubled = local_counter == scaler
            interval = jnp.where(doubled, jnp.minimum(clipper, 2 * state.local_step_interval),
                                 state.local_step_interval)
            return (local(updates), m, nu, acc, lrs, we1, se1, state.var_interval, state.var_counter,
                    interval, jnp.where(doubled, 0, local_counter), state.var_updates)

        def phase_at(n):  # the phase of the update after n updates, an index into ZeroOneAdamState.PHASES
            return jnp.where(n < var_freeze_step, 0, 1).astype(jnp.int32)

        def typed(out):  # both phases must return the same types: updates are per rank
            return (local(out[0]), *out[1:])

        (updates, mu, nu, u, lrs, we, se, var_interval, var_counter, local_interval, local_counter,
         var_updates), phase = run_phase(
            ZeroOneAdamState, phase_at(count),
            (lambda x: typed(variance_freezing(x)), lambda x: typed(local_steps(x))))
        like = params if params is not None else grads
        updates = jax.tree.map(lambda d, p: d.astype(p.dtype), updates, like)
        rows = lambda t: jax.tree.map(lambda x: x[None], t)  # noqa: E731
        new_count = optax.safe_int32_increment(count)
        return updates, ZeroOneAdamState(
            count=new_count, mu=rows(mu), nu=nu, momentum_accumulator=rows(u), lrs=lrs,
            var_interval=var_interval, var_counter=var_counter, local_step_interval=local_interval,
            local_step_counter=local_counter, var_updates=var_updates, worker_error=we, server_error=se,
            phase=phase.astype(jnp.int32), next_phase=phase_at(new_count),
        )

    return optax.GradientTransformation(init_fn, update_fn)


def zero_one_adam_specs(state: ZeroOneAdamState, axis_name: str = "data") -> ZeroOneAdamState:
    """``PartitionSpec``s of a :class:`ZeroOneAdamState`: ``mu``, ``u`` and the errors per rank, the rest replicated."""
    from jax.sharding import PartitionSpec as P

    rows = lambda t: jax.tree.map(lambda _: P(axis_name), t)  # noqa: E731
    rep = lambda t: jax.tree.map(lambda _: P(), t)  # noqa: E731
    return ZeroOneAdamState(
        count=P(), mu=rows(state.mu), nu=rep(state.nu), momentum_accumulator=rows(state.momentum_accumulator),
        lrs=P(), var_interval=P(), var_counter=P(), local_step_interval=P(), local_step_counter=P(), var_updates=P(),
        worker_error=rows(state.worker_error), server_error=rows(state.server_error), phase=P(),
        next_phase=rep(state.next_phase),
    )


# jonebit.state_specs and the ZeRO planner (jonebit.sharding.zero_shardings) read this rule: the per-rank
# buffers carry the data axis, and m, v stay whole at every stage (the transform needs them whole).
register_per_rank_state(ZeroOneAdamState, zero_one_adam_specs)
