"""Skip an update on every rank when any rank's gradient is not finite: robustness as a wrapper.

A NaN or inf in one rank's gradient reaches every rank through a mean (warmup) or a compressed allreduce's scales
(compression) and stays in the momentum and error buffers for good. :func:`skip_nonfinite` wraps any optimizer of
the family (or any optax transformation used in the per-device view): each update all-reduces one flag, and when
any rank's gradient, or the update computed from it, is not finite, every rank returns zero updates and keeps its
state as it was. The selection is elementwise (no conditional), so XLA fuses it into the update's loops.

The training engine (:mod:`jonebit.train.engine`) does the same for whole training states (parameters, optimizer
state, loss scale) from the gradient's global norm; this wrapper is for a step written by hand.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.experimental import io_callback

from jonebit.transforms.base import backend_for


class SkipNonfiniteState(NamedTuple):
    """State of :func:`skip_nonfinite`.

    Attributes:
      inner: the wrapped optimizer's state.
      skipped: updates skipped because some rank's gradient was not finite (int32, identical on all ranks).
    """

    inner: Any
    skipped: jax.Array


def _local_nonfinite(grads, updates) -> jax.Array:
    """True if this rank's gradient has a NaN/inf or an element whose square (which enters the variance) overflows,
    or the update it led to is not finite."""
    checks = [jnp.all(jnp.isfinite(jnp.square(g.astype(jnp.float32)))) for g in jax.tree.leaves(grads)]
    checks += [jnp.all(jnp.isfinite(u)) for u in jax.tree.leaves(updates)]
    return ~jnp.all(jnp.stack(checks))


def _raise_if_bad(bad, mine, skipped) -> None:
    if bool(bad):
        raise FloatingPointError(
            f"skip_nonfinite: non-finite gradient ({'on this rank' if mine else 'on another rank'}) after "
            f"{int(skipped)} earlier skipped updates; the update was skipped on all ranks and the optimizer state "
            "left as it was. Look for the cause (learning rate, loss scale, a bad batch), or pass "
            "raise_error=False to skip such updates and carry on (the state's `skipped` counts them)."
        )


def keep_if(bad, old, new):
    """``old`` where ``bad`` (a scalar, the same on every rank), else ``new``: a skipped step keeps every leaf bit
    for bit. A select rather than a conditional, so that it fuses into the update's elementwise loops (a
    conditional materialises its result and copies the donated buffers). A leaf the step left as it was stays that
    very value (:func:`jonebit.train.step.per_device` keeps it out of the manual computation); a select keeps
    each side's own type (error buffers typed per rank, replicated leaves)."""
    return jax.tree.map(lambda o, n: o if o is n else jnp.where(bad, o, n), old, new)


def skip_nonfinite(
    inner: optax.GradientTransformation,
    *,
    axis_name: str | tuple[str, str] | None = "data",
    mpi_comm: Any = None,
    raise_error: bool = False,
) -> optax.GradientTransformation:
    """Wraps ``inner`` so that an update with a non-finite gradient on any rank is skipped on all ranks.

    Args:
      inner: the optimizer (e.g. :func:`jonebit.onebit_adam`), used in the per-device view.
      axis_name: the ranks' mesh axis (or ``(hosts, local)`` pair), as given to ``inner``; ``None`` with
        ``mpi_comm`` or on one device.
      mpi_comm: the mpi4py communicator, as given to ``inner``.
      raise_error: also raise ``FloatingPointError`` from the host after skipping (the step call fails; with
        donated buffers the state passed in is gone: restore a checkpoint). This calls back to the host on every
        update.

    Returns:
      An ``optax.GradientTransformation`` whose state is :class:`SkipNonfiniteState`; a skipped update leaves the
      inner state bit for bit as it was and counts itself in ``skipped``.

    Example::

      tx = jonebit.skip_nonfinite(jonebit.onebit_adam(1e-3, freeze_step=100))
    """
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(f"skip_nonfinite: expected an optax.GradientTransformation, got {type(inner).__name__}")
    if not isinstance(raise_error, bool):
        raise TypeError(f"skip_nonfinite: raise_error must be True or False, got {raise_error!r}")
    if isinstance(axis_name, list):
        axis_name = tuple(axis_name)
    if mpi_comm is not None:
        axis_name = None

    def init_fn(params):
        return SkipNonfiniteState(inner=inner.init(params), skipped=jnp.zeros([], jnp.int32))

    def update_fn(grads, state, params=None):
        updates, new_inner = inner.update(grads, state.inner, params)
        mine = _local_nonfinite(grads, updates)
        bad = backend_for(axis_name, mpi_comm).max(mine.astype(jnp.int32)) > 0
        if raise_error:
            io_callback(_raise_if_bad, None, bad, mine, state.skipped)
        updates = jax.tree.map(lambda u: jnp.where(bad, jnp.zeros_like(u), u), updates)
        new_inner = keep_if(bad, state.inner, new_inner)
        return updates, SkipNonfiniteState(inner=new_inner, skipped=state.skipped + bad.astype(jnp.int32))

    return optax.GradientTransformation(init_fn, update_fn)
