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

``init`` and ``update`` run in the per-device view: inside ``jax.shard_map`` over ``axis_name`` (the
usual way), or in each MPI process when ``mpi_comm`` is given. :func:`state_specs` returns the
``PartitionSpec`` tree that carries the state in and out of ``shard_map``: ``m``, ``v`` and the count
are replicated, the error buffers differ per rank and live on a leading device axis.

References:
  Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence Speed",
  ICML 2021, https://arxiv.org/abs/2102.02888.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jonebit.comm.backends import AxisBackend, Backend, as_varying, get_backend, varying_axes
from jonebit.comm.compressed import (
    compressed_allreduce_rows,
    compressed_allreduce_rows_many,
    decode_segments,
    padded_size,
)
from jonebit.sharding.zero import _per_rank_rule, register_per_rank_state
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
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    worker_error: Any
    server_error: Any


def _is_number(x) -> bool:
    return isinstance(x, int | float | np.number)


def _check_float_leaves(tree, what: str) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"onebit_adam: {what} leaf {jax.tree_util.keystr(path)} has dtype {dtype}; only floating-point "
                "leaves can be optimised (keep integer buffers out of the optimised tree, e.g. with optax.masked)"
            )


def _check_mask(mask, params) -> None:
    m_struct, p_struct = jax.tree.structure(mask), jax.tree.structure(params)
    if m_struct != p_struct:
        raise ValueError(
            f"onebit_adam: exp_avg_mask must have the same tree structure as the params.\n"
            f"  mask:   {m_struct}\n  params: {p_struct}"
        )
    for path, m, p in zip(
        (jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(params)),
        jax.tree.leaves(mask),
        jax.tree.leaves(params),
        strict=True,
    ):
        if tuple(np.shape(m)) != tuple(p.shape):
            raise ValueError(
                f"onebit_adam: exp_avg_mask leaf {path} has shape {tuple(np.shape(m))}, the param has {tuple(p.shape)}"
            )


def _flatten(tree) -> jax.Array:
    leaves = jax.tree.leaves(tree)
    return jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])


def _error_buffers(sizes, world_size: int):
    """Zero worker/server errors, leading axis 1, for buffers of the given lengths."""

    def worker(n):
        return jnp.zeros((1, padded_size(n, world_size)), jnp.float32)

    def server(n):
        return jnp.zeros((1, padded_size(n, world_size) // world_size), jnp.float32)

    return jax.tree.map(worker, sizes), jax.tree.map(server, sizes)


def _check_local_grads(grads, backend: Backend) -> None:
    """Refuses gradients that are typed as identical on all ranks (already all-reduced)."""
    if not isinstance(backend, AxisBackend):
        return
    try:
        from jax._src import config as jax_config

        vma_checked = bool(jax_config._check_vma.value)
    except (ImportError, AttributeError):  # pragma: no cover - older/newer jax internals
        return
    if not vma_checked:
        return
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        if backend.axis_name not in varying_axes(g):
            raise ValueError(
                f"onebit_adam: gradient {jax.tree_util.keystr(path)} is invariant over axis "
                f"{backend.axis_name!r}, i.e. already all-reduced. 1-bit Adam needs each rank's local gradient: "
                f"inside shard_map, cast replicated params with jax.lax.pcast(params, {backend.axis_name!r}, "
                "to='varying') before jax.grad (otherwise autodiff inserts a full-precision psum)."
            )


def onebit_adam(
    learning_rate: ScalarOrSchedule,
    *,
    freeze_step: int,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    exp_avg_mask: Any = None,
    bias_correction: bool = False,
    fused: bool = True,
    axis_name: str | None = "data",
    mpi_comm: Any = None,
    error_feedback: bool = True,
    amsgrad: bool = False,
    zero_stage: int | None = None,
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
        ``step()`` only initialises; to reproduce a DeepSpeed config pass ``F - 1``.
      b1: momentum decay.
      b2: variance decay.
      eps: added to ``sqrt(v)`` (outside the square root).
      weight_decay: decoupled weight decay (AdamW form); needs ``params`` in ``update``.
      exp_avg_mask: optional pytree of 0/1 arrays like the params; the momentum is multiplied by it after
        each compressed allreduce (e.g. to keep BERT's unused position embeddings at exactly zero).
      bias_correction: apply Adam's bias correction (DeepSpeed ignores its flag: default off). After
        freeze_step the variance correction stays at its freeze_step value.
      fused: ``True`` compresses all leaves as one flat buffer (one collective and one worker scale per step,
        DeepSpeed's fp16 path); ``False`` compresses each leaf separately (DeepSpeed's fp32 path).
      axis_name: the ``jax.shard_map`` mesh axis of the data-parallel ranks.
      mpi_comm: an mpi4py communicator; when given, the collectives go through MPI (mpi4jax) instead.
      error_feedback: keep the error buffers (the algorithm). ``False`` is for studying their effect only.
      amsgrad: not supported by 1-bit Adam; ``True`` raises.
      zero_stage: ZeRO partitioning of the optimizer (0-3, default 0, shard_map only). ``1``/``2``: momentum and
        variance partitioned during warmup, the synchronised momentum kept as packed signs, the frozen variance whole;
        ``3``: also the parameters, as the server chunks of the flattened tree (``update`` then takes and returns
        this rank's chunks). See :mod:`jonebit.transforms.onebit_zero`; build the step with
        :func:`jonebit.train.zero.make_zero_step`.

    Returns:
      An ``optax.GradientTransformation`` whose ``update(local_grads, state, params)`` expects this rank's
      local gradient.

    Example::

      tx = optax.chain(optax.clip_by_global_norm(1.0), jonebit.onebit_adam(1e-3, freeze_step=100))

      @jax.shard_map(mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs))
      def step(params, opt_state, batch):
          local = jax.lax.pcast(params, "data", to="varying")  # local grads, no implicit psum
          grads = jax.grad(loss_fn)(local, batch)
          updates, opt_state = tx.update(grads, opt_state, params)
          return optax.apply_updates(params, updates), opt_state
    """
    if amsgrad:
        raise ValueError("onebit_adam: amsgrad is not supported by 1-bit Adam (the variance is frozen after warmup)")
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, int | np.integer):
        raise TypeError(f"onebit_adam: freeze_step must be an int, got {freeze_step!r}")
    if freeze_step < 0:
        raise ValueError(f"onebit_adam: freeze_step must be >= 0, got {freeze_step}")
    if freeze_step == 0:
        raise ValueError(
            "onebit_adam: freeze_step=0 would freeze a variance that was never estimated (v = 0, so every update "
            "is m / eps); use at least a few hundred warmup steps (DeepSpeed recommends 15-25% of training)"
        )
    # Values may be arrays under optax.inject_hyperparams; only plain numbers are checked here.
    for name, value in (("b1", b1), ("b2", b2)):
        if _is_number(value) and not 0.0 <= value < 1.0:
            raise ValueError(f"onebit_adam: {name} must be in [0, 1), got {value}")
    if _is_number(eps) and eps <= 0:
        raise ValueError(f"onebit_adam: eps must be > 0, got {eps}")
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
    if zero_stage and mpi_comm is not None:
        raise ValueError("onebit_adam: zero_stage >= 1 runs over a shard_map axis; it is not available with mpi_comm")

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
        return zero_update(
            backend=backend, layout=layout, stage=zero_stage, freeze_step=freeze_step, b1=b1, b2=b2, eps=eps,
            weight_decay=weight_decay, decays=decays, mask_bufs=flat_mask(exp_avg_mask, layout),
            bias_correction=bias_correction, learning_rate=learning_rate, error_feedback=error_feedback,
            grads=grads, state=state, params=params,
        )

    def init_fn(params):
        _check_float_leaves(params, "param")
        if exp_avg_mask is not None:
            _check_mask(exp_avg_mask, params)
        backend = get_backend(axis_name, mpi_comm)
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        if fused:
            n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
            if n == 0:
                raise ValueError("onebit_adam: the params have no elements")
            worker, server = _error_buffers(n, backend.size)
        else:
            sizes = jax.tree.map(lambda p: max(int(np.prod(p.shape)), 1), params)
            worker, server = _error_buffers(sizes, backend.size)
        return OneBitAdamState(
            count=jnp.zeros([], jnp.int32), mu=zeros, nu=jax.tree.map(jnp.copy, zeros),
            worker_error=worker, server_error=server,
        )

    def compress(backend, m_local, worker_error, server_error):
        """Compressed allreduce of the momentum tree; returns (m, worker_error, server_error)."""

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
        leaves, treedef = jax.tree.flatten(m_local)
        wes, ses = treedef.flatten_up_to(worker_error), treedef.flatten_up_to(server_error)
        rows, wes, ses = compressed_allreduce_rows_many(
            backend, [jnp.ravel(x) for x in leaves], [we[0] for we in wes], [se[0] for se in ses])
        if not error_feedback:
            wes, ses = [jnp.zeros_like(we) for we in wes], [jnp.zeros_like(se) for se in ses]
        m = [decode_segments(r, [x.size])[0].reshape(x.shape).astype(x.dtype)
             for r, x in zip(rows, leaves, strict=True)]
        return (treedef.unflatten(m), treedef.unflatten([we[None] for we in wes]),
                treedef.unflatten([se[None] for se in ses]))

    def update_fn(grads, state, params=None):
        if decays and params is None:
            raise ValueError("onebit_adam: weight_decay needs params; call update(grads, state, params)")
        _check_float_leaves(grads, "gradient")
        backend = get_backend(axis_name, mpi_comm)
        _check_local_grads(grads, backend)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        worker_error, server_error = state.worker_error, state.server_error
        if isinstance(backend, AxisBackend):
            # Errors differ per rank; fresh zeros from init in the same body are still typed invariant.
            worker_error = jax.tree.map(lambda e: as_varying(e, backend.axis_name), worker_error)
            server_error = jax.tree.map(lambda e: as_varying(e, backend.axis_name), server_error)

        def warmup(_):
            g = backend.mean(grads)
            mu = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, state.mu, g)
            nu = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * g * g, state.nu, g)
            return mu, nu, worker_error, server_error

        def compression(_):
            mu = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, state.mu, grads)
            we, se = worker_error, server_error
            if backend.size > 1:
                mu, we, se = compress(backend, mu, we, se)
            else:  # one rank has nothing to compress (DeepSpeed skips it too); the mean only fixes the type
                mu = backend.mean(mu)
            if exp_avg_mask is not None:
                mu = jax.tree.map(lambda m, k: m * jnp.asarray(k, jnp.float32), mu, exp_avg_mask)
            return mu, state.nu, we, se

        count = state.count
        mu, nu, worker_error, server_error = lax.cond(count < freeze_step, warmup, compression, None)

        c1, c2, lr = step_scalars(count, b1=b1, b2=b2, freeze_step=freeze_step, bias_correction=bias_correction,
                                  learning_rate=learning_rate)

        def direction(m, v, p):
            u = (m / c1) / (jnp.sqrt(v / c2) + eps)
            if decays:
                u = u + weight_decay * p.astype(jnp.float32)
            return u

        ps = params if params is not None else grads
        updates = jax.tree.map(
            lambda m, v, p, g: (-lr * direction(m, v, p)).astype(p.dtype if params is not None else g.dtype),
            mu, nu, ps, grads,
        )
        new_state = OneBitAdamState(
            count=optax.safe_int32_increment(count), mu=mu, nu=nu,
            worker_error=worker_error, server_error=server_error,
        )
        return updates, new_state

    if zero_stage:
        def checked_zero_init(params):
            _check_float_leaves(params, "param")
            if exp_avg_mask is not None:
                _check_mask(exp_avg_mask, params)
            return zero_init(params)

        return optax.GradientTransformation(checked_zero_init, zero_update_fn)
    return optax.GradientTransformation(init_fn, update_fn)


def _is_state(x) -> bool:
    return isinstance(x, OneBitAdamState | OneBitAdamZeroState)


def is_onebit_state(x) -> bool:
    """Whether ``x`` is the state of a 1-bit optimizer (whose error buffers are per rank)."""
    return isinstance(x, OneBitAdamState | OneBitAdamZeroState)


def state_specs(opt_state, axis_name: str = "data"):
    """``PartitionSpec`` tree that carries an optimizer state in and out of ``shard_map`` as global arrays.

    Error buffers of every :class:`OneBitAdamState` in the tree get ``P(axis_name)`` (one row per rank on the
    leading axis); states registered with :func:`jonebit.sharding.zero.register_per_rank_state` (0/1 Adam, 1-bit
    LAMB) get their rule's specs; everything else, here and in other transforms of an ``optax.chain``, is
    replicated ``P()``.
    Works on arrays and ``jax.ShapeDtypeStruct`` trees alike.
    """

    def spec(node):
        if isinstance(node, OneBitAdamZeroState):
            return zero_state_specs(node, axis_name)
        if _is_state(node):
            rows = lambda t: jax.tree.map(lambda _: P(axis_name), t)  # noqa: E731
            rep = lambda t: jax.tree.map(lambda _: P(), t)  # noqa: E731
            return OneBitAdamState(
                count=P(), mu=rep(node.mu), nu=rep(node.nu),
                worker_error=rows(node.worker_error), server_error=rows(node.server_error),
            )
        rule = _per_rank_rule(node)  # other transforms with per-rank buffers (the 1-bit family)
        if rule is not None:
            return jax.tree.map(lambda s: P() if s is None else s, rule(node, axis_name),
                                is_leaf=lambda s: s is None or isinstance(s, P))
        return P()

    return jax.tree.map(spec, opt_state, is_leaf=lambda x: is_onebit_state(x) or _per_rank_rule(x) is not None)


def sharded_init(tx: optax.GradientTransformation, params, mesh: jax.sharding.Mesh, axis_name: str = "data"):
    """Runs ``tx.init`` in the per-device view and returns the state as global arrays.

    Replicated leaves come back replicated over ``mesh``; per-rank error buffers come back as
    ``(P, ...)`` arrays sharded over ``axis_name``. Returns ``(opt_state, specs)`` with ``specs`` from
    :func:`state_specs`, ready for the ``in_specs``/``out_specs`` of a ``shard_map`` training step.
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
