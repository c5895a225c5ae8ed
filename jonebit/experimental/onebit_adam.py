r"""Research options of :func:`jonebit.onebit_adam` (passed as ``experimental=OneBitAdamOptions(...)``).

All act after the freeze, on the compression stage, and all are stage-0 only (the ZeRO variant,
:func:`jonebit.onebit_adam_zero`, has none of them). Where each was measured, and what it did:
``benchmarks/BENCHMARKS.md`` (sections "SQuAD fine-tuning" and "Defaults") and the docs' experimental page.

* ``row_scales``: one compression scale per row of each rank-2+ leaf instead of one per leaf and chunk, on the
  worker and the server side. A small row (a rare token's embedding) stays small after compression; with one scale
  per tensor it gets the tensor's typical magnitude, which its small frozen variance then magnifies. Costs
  ``32 / row`` more bytes (8% at rows of 384 floats). Per-leaf compression on a single data axis only.
* ``preconditioned``: compress the update direction :math:`m / (\sqrt{v / c_2} + \epsilon)` (variance and its
  correction frozen) and multiply the average back, instead of compressing :math:`m`. The map is fixed after the
  freeze, so error feedback works as before, but the compression error becomes relative to the update: an element
  whose frozen variance is far below its chunk's no longer sees the chunk's momentum error divided by its small
  :math:`\sqrt v`. Same bytes.
* ``clip_ratio``: clip each element's :math:`(m / c_1) / (\sqrt{v / c_2} + \epsilon)` to ``[-clip_ratio,
  clip_ratio]`` before weight decay. Adam's own ratio is bounded by :func:`adam_ratio_bound` (7.27 at the default
  betas); with the variance frozen it is not.
* ``variance_refresh``: ``K``: every ``K``-th update after the freeze averages the gradient in float32 instead (an
  Adam step with the exact mean, error buffers kept) and refreshes the variance with it as the sample of ``K``
  updates, :math:`v \leftarrow \beta_2^K v + (1 - \beta_2^K)\bar g^2`, its bias correction advancing to that
  update. With ``K = 16`` the compression stage sends about 3x plain 1-bit Adam's bytes, 11x fewer than Adam's.
* ``local_clip``: with ``max_grad_norm``, clip each rank's local gradient in warmup too (DeepSpeed clips the mean
  there), so both stages average gradients of the same scale.
* ``error_feedback=False``: drop the error buffers' content every step (to study their effect; not an algorithm).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"OneBitAdamOptions: {name} must be True or False, got {type(value).__name__} {value!r}")


@dataclasses.dataclass(frozen=True)
class OneBitAdamOptions:
    """Research options of :func:`jonebit.onebit_adam` (see the module docstring for each one's math).

    Attributes:
      row_scales: one compression scale per row of every rank >= 2 leaf (``fused=False``, single data axis).
      preconditioned: compress the frozen-preconditioned momentum instead of the momentum.
      clip_ratio: bound on ``|m_hat / (sqrt(v_hat) + eps)|`` after the freeze (``None``: no bound).
      variance_refresh: refresh the variance with a float32 average every ``K`` updates after the freeze.
      local_clip: with ``max_grad_norm``, clip the local gradient in warmup too.
      error_feedback: keep the error buffers (the algorithm); ``False`` only to study their effect.
    """

    row_scales: bool = False
    preconditioned: bool = False
    clip_ratio: float | None = None
    variance_refresh: int | None = None
    local_clip: bool = False
    error_feedback: bool = True

    def __post_init__(self):
        for name in ("row_scales", "preconditioned", "local_clip", "error_feedback"):
            _check_flag(name, getattr(self, name))
        if self.clip_ratio is not None:
            ok = isinstance(self.clip_ratio, int | float | np.number) and not isinstance(self.clip_ratio, bool)
            if not ok or not np.isfinite(self.clip_ratio) or self.clip_ratio <= 0:
                raise ValueError(f"OneBitAdamOptions: clip_ratio must be a finite number > 0 or None, got "
                                 f"{self.clip_ratio!r} (adam_ratio_bound() gives Adam's own bound)")
        k = self.variance_refresh
        if k is not None:
            if isinstance(k, bool) or not isinstance(k, int | np.integer):
                raise TypeError(f"OneBitAdamOptions: variance_refresh must be a whole number of updates (or None), "
                                f"got {k!r}")
            if k < 1:
                raise ValueError(f"OneBitAdamOptions: variance_refresh must be >= 1 (refresh the variance every K "
                                 f"updates of the compression stage) or None (never), got {k}")
            object.__setattr__(self, "variance_refresh", int(k))

    def check_for(self, *, fused: bool, hierarchical: bool) -> None:
        """Refuses options that the optimizer's layout cannot apply."""
        if self.row_scales and (fused or hierarchical):
            why = "fused=True" if fused else "hierarchical compression"
            raise ValueError(f"onebit_adam: OneBitAdamOptions(row_scales=True) compresses each tensor on its own; it "
                             f"is not available with {why}: use fused=False on a single data axis, or drop row_scales")

    # The math each option adds to the compression stage; jonebit.transforms.onebit_adam calls these.

    def variance_clock(self, count, limit):
        """The update whose bias correction the variance carries: the freeze, or the latest refresh."""
        if self.variance_refresh is None:
            return limit
        k = self.variance_refresh
        since = count + 1 - limit  # > 0 after the freeze; the refreshes are its multiples of K
        return jnp.where(since <= 0, limit, limit + k * (since // k))

    def is_refresh(self, count, limit):
        """Whether the update after ``count`` updates (past the freeze) is a refresh."""
        return (count + 1 - limit) % self.variance_refresh == 0

    @staticmethod
    def preconditioner(nu, c2, eps):
        """The frozen denominator of the update, by which ``preconditioned`` divides the momentum."""
        return jax.tree.map(lambda v: jnp.sqrt(v / c2) + eps, nu)

    def clip(self, u, after_freeze):
        """``u`` clipped to ``clip_ratio`` where ``after_freeze`` (warmup is Adam, whose ratio is bounded)."""
        if self.clip_ratio is None:
            return u
        return jnp.where(after_freeze, jnp.clip(u, -self.clip_ratio, self.clip_ratio), u)


def adam_ratio_bound(b1: float = 0.9, b2: float = 0.999) -> float:
    """The largest ``|m| / sqrt(v)`` Adam's moment EMAs can reach (``b1^2 < b2``), by Cauchy-Schwarz over the
    gradient history: ``(1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2))``; 7.27 for the default betas. A value for
    ``OneBitAdamOptions(clip_ratio=...)``."""
    if not b1 * b1 < b2:
        raise ValueError(f"adam_ratio_bound needs b1^2 < b2, got b1={b1}, b2={b2}")
    return (1.0 - b1) / math.sqrt((1.0 - b2) * (1.0 - b1 * b1 / b2))
