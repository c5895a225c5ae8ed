"""What the 1-bit family (1-bit Adam, its ZeRO variant, 0/1 Adam, 1-bit LAMB) shares.

Each optimizer module composes these so that it reads as its own math: the communication backend of an axis name
or MPI communicator, the error-compensated compressed allreduce of a pytree (one fused buffer or one buffer per
leaf), the per-rank error buffers it needs, the refusal of already-reduced gradients, the validation of
hyperparameters, trees and masks, the freeze rule of ``freeze_step="auto"``, and the names of the phases an update
can run (:func:`phase_names`, :func:`last_phase`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jonebit.comm.backends import AxisBackend, Backend, as_varying, get_backend, varying_axes
from jonebit.comm.compressed import (
    compressed_allreduce_rows,
    compressed_mean_leaves,
    decode_segments,
    padded_size,
    stacked_error_buffers,
)

ScalarOrSchedule = float | Callable[[jax.Array], jax.Array]
log = logging.getLogger("jonebit.transforms")


def is_number(x) -> bool:
    return isinstance(x, int | float | np.number) and not isinstance(x, bool)


def check_int(name: str, value, *, minimum: int, who: str, hint: str = "") -> int:
    """``value`` as a Python int ``>= minimum``; a clear TypeError/ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{who}: {name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{who}: {name} must be >= {minimum}, got {value}{hint}")
    return int(value)


def check_betas_eps(who: str, **values) -> None:
    """b1/b2 in [0, 1), eps > 0; values that are arrays (optax.inject_hyperparams) are not checked."""
    for name in ("b1", "b2", "coeff_beta"):
        v = values.get(name)
        if v is not None and is_number(v) and not 0.0 <= v < 1.0:
            raise ValueError(f"{who}: {name} must be in [0, 1), got {v}")
    eps = values.get("eps")
    if eps is not None and is_number(eps) and eps <= 0:
        raise ValueError(f"{who}: eps must be > 0, got {eps}")
    wd = values.get("weight_decay")
    if wd is not None and is_number(wd) and wd < 0:
        raise ValueError(f"{who}: weight_decay must be >= 0, got {wd}")


def check_float_leaves(tree, what: str, who: str) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"{who}: {what} leaf {jax.tree_util.keystr(path)} has dtype {dtype}; only floating-point "
                "leaves can be optimised (keep integer buffers out of the optimised tree, e.g. with optax.masked)"
            )


def check_scalar(who: str, name: str, value, *, low: float, high: float = np.inf, open_low: bool = False,
                  open_high: bool = False, schedule: bool = False) -> None:
    """A hyperparameter: a finite number in range, an array (e.g. from ``optax.inject_hyperparams``, not checked),
    or, where ``schedule``, a function of the update count."""
    if is_number(value) and not isinstance(value, np.bool_):
        if not np.isfinite(value):
            raise ValueError(f"{who}: {name} must be a finite number, got {value}")
        if (value <= low if open_low else value < low) or (value >= high if open_high else value > high):
            bounds = [f"{'>' if open_low else '>='} {low:g}"] + ([f"{'<' if open_high else '<='} {high:g}"]
                                                                  if np.isfinite(high) else [])
            raise ValueError(f"{who}: {name} must be {' and '.join(bounds)}, got {value}")
        return
    if isinstance(value, jax.Array | np.ndarray) or (schedule and callable(value)):
        return
    kinds = "a number or a schedule (a function of the update count)" if schedule else "a number"
    raise TypeError(f"{who}: {name} must be {kinds}, got {type(value).__name__} {value!r}")


def check_bool(who: str, name: str, value) -> None:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{who}: {name} must be True or False, got {type(value).__name__} {value!r}")


def check_nonempty_leaves(params, who: str) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if math.prod(leaf.shape) == 0:
            raise ValueError(
                f"{who}: param leaf {jax.tree_util.keystr(path)} has shape {tuple(leaf.shape)}, i.e. no "
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


def check_matching_grads(grads, other, what: str, who: str) -> None:
    problem = _first_mismatch(grads, other)
    if problem is not None:
        raise ValueError(f"{who}: the gradients do not match the {what}: {problem}")


class Ones:
    """An all-ones mask leaf, kept only as its shape (the step needs no multiply for it)."""

    def __init__(self, shape):
        self.shape = shape


def normalise_mask(mask, who: str):
    """Validates exp_avg_mask's values once: leaves become float32 numpy arrays of 0/1, or :class:`Ones`."""
    if mask is None:
        return None

    def leaf(path, m):
        try:
            k = np.asarray(m)
        except Exception as e:  # noqa: BLE001 - anything that is not array-like
            raise TypeError(
                f"{who}: exp_avg_mask leaf {jax.tree_util.keystr(path)} must be an array of 0/1 values or "
                f"None, got {type(m).__name__}"
            ) from e
        if not (k.dtype == np.bool_ or np.issubdtype(k.dtype, np.number)):
            raise TypeError(
                f"{who}: exp_avg_mask leaf {jax.tree_util.keystr(path)} must hold 0/1 values, got dtype {k.dtype}"
            )
        k = k.astype(np.float32)
        bad = k[(k != 0) & (k != 1)]
        if bad.size:
            raise ValueError(
                f"{who}: exp_avg_mask leaf {jax.tree_util.keystr(path)} must hold only 0 and 1 (it multiplies "
                f"the momentum), got {bad.flat[0]} among its values; use bool or 0/1 arrays"
            )
        return Ones(k.shape) if np.all(k == 1) else k

    return jax.tree_util.tree_map_with_path(leaf, mask)


def mask_leaves(mask, params, who: str) -> list | None:
    """One entry per param leaf: None (all ones) or the mask array, whose rank is the param's and whose dimensions
    are the param's or 1. Raises naming the leaf when the mask does not fit the params."""
    if mask is None:
        return None
    p_def = jax.tree.structure(params)
    try:
        leaves = p_def.flatten_up_to(mask)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{who}: exp_avg_mask must have the same tree structure as the params (a leaf may be None "
            f"for 'no mask').\n  mask:   {jax.tree.structure(mask)}\n  params: {p_def}"
        ) from e
    out = []
    for (path, p), m in zip(jax.tree_util.tree_leaves_with_path(params), leaves, strict=True):
        if m is not None and jax.tree.leaves(m) != [m]:
            raise ValueError(
                f"{who}: exp_avg_mask must have the same tree structure as the params; at leaf "
                f"{jax.tree_util.keystr(path)} it holds a {type(m).__name__} subtree"
            )
        shape, want = tuple(getattr(m, "shape", ())), tuple(p.shape)
        fits = len(shape) == len(want) and all(s in (1, w) for s, w in zip(shape, want, strict=True))
        if m is not None and not fits:
            raise ValueError(
                f"{who}: exp_avg_mask leaf {jax.tree_util.keystr(path)} has shape {shape}, the param has "
                f"{want}; give the param's shape, or its rank with 1 where the mask broadcasts (e.g. rows: (n, 1))"
            )
        out.append(None if isinstance(m, Ones) else m)
    return None if all(m is None for m in out) else out


def mesh_axes(backend) -> tuple[str, ...]:
    """The shard_map mesh axes a backend reduces over (none for MPI or one worker)."""
    from jonebit.comm.hierarchical import HierarchicalBackend

    if isinstance(backend, HierarchicalBackend):
        return backend.axis_name
    if isinstance(backend, AxisBackend):
        return (backend.axis_name,)
    return ()


_warned: set = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


def _read_check_vma() -> bool:
    """Whether the enclosing ``shard_map`` type-checks varying axes (``check_vma=True``); public jax config."""
    return bool(jax.config.check_vma)


def _vma_checked(axis_name: str | None = None) -> bool:
    """Whether varying-axis types are tracked here (``check_vma=True``), so already-reduced gradients can be told
    from local ones. False, with a warning logged once, when this jax cannot say."""
    try:
        checked = _read_check_vma()
    except AttributeError:
        _warn_once("config", "this jax has no jax.config.check_vma; the check that refuses already all-reduced "
                   "gradients is off (cast params with jax.lax.pcast(..., to='varying') before jax.grad inside "
                   "shard_map)")
        return False
    if checked and axis_name is not None and axis_name not in varying_axes(jax.lax.axis_index(axis_name)):
        # The rank index always varies over its axis: if it does not look so, varying_axes cannot read this
        # jax's types, and checking would refuse every gradient.
        _warn_once("types", "cannot read varying mesh axes from jax.typeof(x) in this jax; the check that refuses "
                   "already all-reduced gradients is off")
        return False
    return checked


def check_local_grads(grads, backend: Backend, who: str) -> None:
    """Refuses gradients typed as identical on all ranks (already all-reduced by autodiff)."""
    axes = mesh_axes(backend)
    if not axes or not _vma_checked(axes[0]):
        return
    name = axes[0] if len(axes) == 1 else axes
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        reduced = [a for a in axes if a not in varying_axes(g)]
        if reduced:
            raise ValueError(
                f"{who}: gradient {jax.tree_util.keystr(path)} is invariant over axis {reduced[0]!r}, i.e. "
                "already all-reduced. The 1-bit optimizers need each rank's local gradient: inside shard_map, cast "
                f"replicated params with jax.lax.pcast(params, {name!r}, to='varying') before jax.grad "
                "(otherwise autodiff inserts a full-precision psum)."
            )


def backend_for(axis_name, mpi_comm) -> Backend:
    """The backend of an optimizer's ``axis_name`` (a mesh axis, a ``(hosts, local)`` pair, or None) or
    ``mpi_comm``."""
    if isinstance(axis_name, tuple):
        from jonebit.comm.hierarchical import HierarchicalBackend

        return HierarchicalBackend(*axis_name)
    return get_backend(axis_name, mpi_comm)


def check_replicated_params(params, backend: Backend, who: str) -> None:
    """Refuses params typed as differing per rank where the optimizer keeps them (and its state) replicated."""
    if not isinstance(backend, AxisBackend) or not _vma_checked():
        return
    for path, p in jax.tree_util.tree_leaves_with_path(params):
        if backend.axis_name in varying_axes(p):
            raise ValueError(
                f"{who}: param {jax.tree_util.keystr(path)} varies over axis {backend.axis_name!r}, but this optimizer "
                "keeps the params identical on all ranks (its per-tensor coefficients are replicated state). Pass the "
                f"replicated params (in_specs P()) to update; cast only the copy you differentiate with "
                f"jax.lax.pcast(params, {backend.axis_name!r}, to='varying')."
            )


def check_per_rank_params(params, backend: Backend, who: str) -> None:
    """Refuses params typed as identical on all ranks where the optimizer moves each rank's params on its own."""
    if params is None or not isinstance(backend, AxisBackend) or not _vma_checked():
        return
    for path, p in jax.tree_util.tree_leaves_with_path(params):
        if backend.axis_name not in varying_axes(p):
            raise ValueError(
                f"{who}: param {jax.tree_util.keystr(path)} is replicated over axis {backend.axis_name!r}, but this "
                "optimizer's local steps move each rank's params on their own. Carry the params per rank: a leading "
                f"rank axis with in_specs/out_specs P({backend.axis_name!r}), and pass this rank's copy (x[0]) to "
                "update (see the zero_one_adam docstring)."
            )


def num_elements(params) -> int:
    return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))


def error_buffers(params, world_size: int, fused: bool):
    """Zero ``(worker_error, server_error)`` with a leading axis of 1 (one row per rank in the global view).

    ``fused``: one pair for the flattened tree; otherwise a tuple per side with one ``(1, k, n_pad)`` array per
    group of ``k`` equal-size leaves (:func:`jonebit.comm.compressed.stacked_error_buffers`, the layout
    :func:`compressed_mean` keeps; :func:`jonebit.transforms.onebit_adam.leaf_errors` views it per leaf).
    """

    def worker(p):
        return jnp.zeros((1, padded_size(max(int(np.prod(p.shape)), 1), world_size)), jnp.float32)

    def server(p):
        return jnp.zeros((1, padded_size(max(int(np.prod(p.shape)), 1), world_size) // world_size), jnp.float32)

    if fused:
        n = num_elements(params)
        whole = jax.ShapeDtypeStruct((n,), jnp.float32)
        return worker(whole), server(whole)
    sizes = [max(int(np.prod(x.shape)), 1) for x in jax.tree.leaves(params)]
    _, workers, servers = stacked_error_buffers(sizes, world_size)
    return tuple(w[None] for w in workers), tuple(s[None] for s in servers)


def per_rank(tree, backend: Backend):
    """Types every leaf as varying over the data axis (buffers that differ per rank; a no-op outside shard_map)."""
    if not isinstance(backend, AxisBackend):
        return tree
    return jax.tree.map(lambda x: as_varying(x, backend.axis_name), tree)


def flatten(tree) -> jax.Array:
    return jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in jax.tree.leaves(tree)])


def compressed_mean_flat(backend: Backend, x, worker_error, server_error, sizes):
    """Compressed allreduce of one flat buffer; returns (pieces of the given sizes, new errors (1, ...))."""
    rows, we, se = compressed_allreduce_rows(backend, x, worker_error[0], server_error[0])
    return decode_segments(rows, sizes), we[None], se[None]


def compressed_mean(backend: Backend, tree, worker_error, server_error, *, fused: bool):
    """Error-compensated 1-bit average over ranks of a float32 pytree.

    ``fused``: the flattened tree is one buffer (one worker scale); otherwise every leaf is its own buffer (own
    scales, errors and padding), all leaves sharing the two collectives. Errors have a leading axis of 1.

    Returns ``(mean_tree, new_worker_error, new_server_error)``; the mean is identical on all ranks.
    """
    leaves, treedef = jax.tree.flatten(tree)
    if fused:
        parts, we, se = compressed_mean_flat(backend, flatten(tree), worker_error, server_error,
                                             [x.size for x in leaves])
        return treedef.unflatten([p.reshape(x.shape) for p, x in zip(parts, leaves, strict=True)]), we, se
    out, we, se = compressed_mean_leaves(backend, leaves, worker_error, server_error)
    return treedef.unflatten(out), we, se


def apply_mask(tree, mask):
    """``tree`` times the mask leaf by leaf; ``mask`` is :func:`mask_leaves`'s list (None: no mask)."""
    if mask is None:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([x if m is None else x * jnp.asarray(m, jnp.float32)
                              for x, m in zip(leaves, mask, strict=True)])


def where_seen(tree, variance, other=None):
    """``tree`` where the variance is > 0, else 0 (or ``other``'s value): the ``mask_unseen`` rule of the 1-bit
    optimizers (a variance of exactly 0 means no gradient has reached the element)."""
    if other is None:
        return jax.tree.map(lambda x, v: jnp.where(v > 0, x, 0.0), tree, variance)
    return jax.tree.map(lambda x, v, o: jnp.where(v > 0, x, o), tree, variance, other)


def learning_rate_at(learning_rate: ScalarOrSchedule, count) -> Any:
    return learning_rate(count) if callable(learning_rate) else learning_rate


AUTO_STATISTICS = ("median", "max", "global")


class AutoFreeze(NamedTuple):
    """The rule that picks the freeze point when ``freeze_step="auto"``.

    The rule watches the bias-corrected variance ``v_hat = v / (1 - b2^t)`` after ``t`` warmup updates: the raw EMA
    ``v`` grows for about ``1 / (1 - b2)`` updates just by filling up (its norm changes by about ``check_every / t``
    per check even for a stationary gradient), so only ``v_hat`` says whether the gradient's second moment has
    settled (``v_hat`` is read whatever the optimizer's ``bias_correction``: only the rule uses it). Every
    ``check_every`` updates each tensor's ``||v_hat_i||`` is compared with its value at the previous
    check, ``c_i = |Δ||v_hat_i||| / ||v_hat_i||_prev``, and the check is *calm* when ``statistic`` of the changes is
    below ``threshold``:

    * ``"median"`` (default): the median of ``c_i`` over the tensors (one volatile tensor, e.g. an embedding whose
      rare rows keep arriving, does not hold the whole model back);
    * ``"max"``: the largest ``c_i`` (every tensor must have settled; on short runs it may never fire);
    * ``"global"``: the relative change of the whole model's ``||v_hat||`` (dominated by the largest tensors).

    Compression starts after the update on which ``patience`` consecutive checks were calm, but not before
    ``min_step`` updates, and at the latest after ``max_step`` updates. ``v`` is identical on all ranks, so every
    rank decides the same.

    Attributes:
      min_step: fewest warmup updates (keep ``>= 1 / (1 - coeff_beta)`` for LAMB's coefficient EMA).
      max_step: most warmup updates (the hard cap).
      check_every: updates between checks.
      threshold: the largest change (of ``statistic``) that counts as calm.
      patience: consecutive calm checks needed.
      statistic: ``"median"``, ``"max"`` or ``"global"`` (above).
    """

    min_step: int = 100
    max_step: int = 100000
    check_every: int = 50
    threshold: float = 0.05
    patience: int = 3
    statistic: str = "median"

    def checked(self, who: str) -> AutoFreeze:
        for name in ("min_step", "max_step", "check_every", "patience"):
            check_int(f"auto_freeze.{name}", getattr(self, name), minimum=1, who=who)
        if self.max_step < self.min_step:
            raise ValueError(f"{who}: auto_freeze.max_step ({self.max_step}) must be >= min_step ({self.min_step})")
        if not (is_number(self.threshold) and self.threshold > 0):
            raise ValueError(f"{who}: auto_freeze.threshold must be a number > 0, got {self.threshold!r}")
        if self.statistic not in AUTO_STATISTICS:
            raise ValueError(f"{who}: auto_freeze.statistic must be one of {', '.join(AUTO_STATISTICS)}, got "
                             f"{self.statistic!r}")
        return self


def variance_norms(nu):
    """Per-tensor ``||v||`` (float32 scalars, a tree like ``nu``)."""
    return jax.tree.map(lambda v: jnp.sqrt(jnp.sum(v * v)), nu)


def _relative_change(new, old):
    """``|new - old| / old``; infinite where ``old`` is 0 and ``new`` is not, 0 where both are."""
    return jnp.abs(new - old) / jnp.where(old > 0, old, 1.0) + jnp.where((old == 0) & (new > 0), jnp.inf, 0.0)


def auto_freeze_step(rule: AutoFreeze, count, nu, reference, calm_checks, freeze_at, backend: Backend | None = None,
                     *, b2):
    """One warmup update's freeze decision: ``(freeze_at, reference, calm_checks)`` after update ``count`` (0-based).

    ``freeze_at`` becomes ``count + 1`` (this was the last warmup update) when the rule fires; otherwise it keeps its
    value (initially ``rule.max_step``, the cap). ``reference`` holds the bias-corrected variance norms of the last
    check; ``b2`` is the variance's EMA rate.
    """
    done = count + 1
    is_check = done % rule.check_every == 0
    correction = 1.0 - jnp.asarray(b2, jnp.float32) ** jnp.asarray(done, jnp.float32)
    norms = jax.tree.map(lambda n: n / correction, variance_norms(nu))
    new, old = jnp.stack(jax.tree.leaves(norms)), jnp.stack(jax.tree.leaves(reference))
    if rule.statistic == "global":
        statistic = _relative_change(jnp.sqrt(jnp.sum(new * new)), jnp.sqrt(jnp.sum(old * old)))
    else:
        change = _relative_change(new, old)
        statistic = jnp.max(change) if rule.statistic == "max" else jnp.median(change)
    calm = statistic < rule.threshold
    # The first check has nothing to compare with: it only records the reference.
    first = done == rule.check_every
    calm_checks = jnp.where(is_check, jnp.where(calm & ~first, calm_checks + 1, 0), calm_checks)
    reference = jax.tree.map(lambda n, r: jnp.where(is_check, n, r), norms, reference)
    fire = (is_check & (calm_checks >= rule.patience) & (done >= rule.min_step)) | (done >= rule.max_step)
    new_freeze_at = jnp.where(fire & (freeze_at > done), done, freeze_at)
    if backend is not None:
        _log_freeze(new_freeze_at != freeze_at, done, backend)
    return new_freeze_at, reference, calm_checks


def _log_freeze(fired, done, backend: Backend) -> None:
    """Logs the automatic freeze point once: on the device at index 0 of every mesh axis the backend reduces over
    (one axis, or the ``(hosts, local)`` pair of hierarchical compression), or on MPI rank 0."""
    import logging

    axes = getattr(backend, "axis_name", None)
    if isinstance(axes, str):
        axes = (axes,)
    if axes:  # shard_map axes: the sum of the indices is 0 on one device only
        rank = sum(jax.lax.axis_index(a) for a in axes)
    else:  # MPI (one process per rank) or a single device
        rank = jnp.asarray(int(getattr(backend, "rank", 0)), jnp.int32)

    def emit(fired, done, rank):
        if bool(fired) and int(rank) == 0:
            logging.getLogger("jonebit.transforms").info(
                "freeze_step='auto': variance settled, compression starts after update %d", int(done))

    # Only the update that fires pays for the host callback.
    jax.lax.cond(fired, lambda: jax.debug.callback(emit, fired, done, rank), lambda: None)


def _phased_states(opt_state) -> list:
    """The states in ``opt_state`` (an ``optax.chain`` nests them) that name their phases: a ``PHASES`` tuple on
    the class and a ``phase`` leaf, the index of the phase the last update ran."""
    def named(node):
        return isinstance(getattr(type(node), "PHASES", None), tuple) and hasattr(node, "phase")

    return [n for n in jax.tree.leaves(opt_state, is_leaf=named) if named(n)]


def takes_local_gradients(opt_state) -> bool:
    """Whether the optimizer whose state this is takes each rank's local gradient and communicates itself (every
    optimizer of the 1-bit family does; the step builders then reduce nothing)."""
    return bool(_phased_states(opt_state))


def moves_params_per_rank(opt_state) -> bool:
    """Whether the optimizer moves each rank's parameters on their own (0/1 Adam's local steps), so that the step
    must carry one copy per rank (its state class says so with ``PARAMS_PER_RANK = True``)."""
    return any(getattr(type(n), "PARAMS_PER_RANK", False) for n in _phased_states(opt_state))


def phase_names(opt_state) -> tuple[str, ...] | None:
    """The names of the phases an update of this optimizer state can run, in the order of its compiled branches;
    ``None`` for an optimizer without phases (optax's own)."""
    nodes = _phased_states(opt_state)
    return type(nodes[0]).PHASES if nodes else None


def last_phase(opt_state) -> str | None:
    """The name of the phase the last update ran (read from the device), or ``None`` without phases."""
    nodes = _phased_states(opt_state)
    if not nodes:
        return None
    return type(nodes[0]).PHASES[int(jax.device_get(nodes[0].phase))]
