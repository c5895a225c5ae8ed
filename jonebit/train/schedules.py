"""DeepSpeed's learning-rate schedulers (and bing_bert's) as optax schedules.

Every builder takes DeepSpeed's parameter names and returns ``schedule(count) -> lr``, a jittable function of
optax's update count (the number of updates applied before this one: 0 for the first update).

Step convention. DeepSpeed's schedulers hold ``last_batch_iteration``, which starts at ``-1``: the constructor
sets the learning rate for ``-1`` and the engine calls ``scheduler.step()`` (``last_batch_iteration += 1``)
*after* every optimizer step that was not skipped for an fp16 overflow. So the k-th applied engine step
(``k = 0, 1, ...``) runs with the learning rate of ``last_batch_iteration = k - 1``. jonebit counts updates the
same way (a skipped step leaves optax's count untouched), hence::

    schedule(count) = DeepSpeed lr at last_batch_iteration = count + init_steps - 1

``init_steps`` is the number of engine steps DeepSpeed spends before the optimizer's first real update: 0 for
Adam/AdamW/Lamb, 1 for 1-bit Adam, whose first ``step()`` only allocates its buffers (it is also why DeepSpeed's
``freeze_step=F`` gives ``F - 1`` Adam updates). :func:`jonebit.train.config.build_optimizer` passes the right
value. For :func:`warmup_linear_decay_exp` the same holds with bing_bert's ``global_step = count + init_steps``.

The schedules follow DeepSpeed's current ``deepspeed/runtime/lr_schedules.py`` (including ``max(2,
warmup_num_steps)``, the clamped cosine progress of ``WarmupCosineLR`` and the integer staircase of
``OneCycle``).

Every builder evaluates its schedule over the updates where its shape is defined (its warmup, decay or cycle,
plus a margin) and raises ``ValueError`` naming the first update whose learning rate is NaN, infinite or
negative: such a rate would be applied silently (a negative one ascends the gradient). :func:`check_schedule`
does the same for any schedule over a run's length (:func:`jonebit.train.loop.train` calls it).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

Schedule = Callable[[jnp.ndarray], jnp.ndarray]

WARMUP_TYPES = ("log", "linear")


def bad_learning_rate(counts, values) -> tuple[int, float] | None:
    """The first ``(count, lr)`` whose learning rate is NaN, infinite or negative, else ``None``."""
    values = np.asarray(values, np.float64).reshape(-1)
    bad = ~np.isfinite(values) | (values < 0)
    if not bad.any():
        return None
    i = int(np.argmax(bad))
    return int(np.asarray(counts).reshape(-1)[i]), float(values[i])


def lr_problem(count: int, lr: float) -> str:
    """Why ``lr`` at update ``count`` cannot be applied, for error messages."""
    why = "negative: the update would ascend the gradient" if lr < 0 else "not a finite number"
    return (f"the learning rate of update {count} (optax count {count}; step {count + 1} when no step was "
            f"skipped) is {lr:.6g}, {why}")


def check_schedule(schedule, num_updates: int, *, what: str = "lr_schedule") -> None:
    """Raises ``ValueError`` naming the first update in ``[0, num_updates)`` whose learning rate is NaN, infinite
    or negative.

    ``schedule`` is a constant or ``schedule(count) -> lr``; it is called once on the array of all counts (one
    vectorised evaluation, as optax schedules allow). A schedule that cannot take an array is not checked here
    (the loop still checks the value it logs).
    """
    if not callable(schedule):
        found = bad_learning_rate([0], [schedule])
    else:
        counts = np.arange(int(num_updates), dtype=np.int32)
        try:
            values = np.asarray(schedule(jnp.asarray(counts)))
        except Exception:  # noqa: BLE001 - a scalar-only schedule: the loop checks each logged value instead
            return
        if values.ndim == 0:  # a constant, whatever the count
            values = np.broadcast_to(values, counts.shape)
        if values.shape != counts.shape:
            return
        found = bad_learning_rate(counts, values)
    if found is not None:
        raise ValueError(f"{what}: {lr_problem(*found)}; fix the schedule's parameters (or the function) so that "
                         "the learning rate stays >= 0")


def _validated(schedule: Schedule, horizon: float, name: str, params: str) -> Schedule:
    """``schedule``, after checking it over ``[0, horizon]`` updates: every count up to 4096, then 4096 samples
    (each builder's pieces are monotone or periodic with breakpoints inside the horizon)."""
    horizon = int(min(max(horizon, 1), 2**40))
    counts = np.unique(np.concatenate([np.arange(min(horizon, 4096) + 1),
                                       np.linspace(0, horizon, 4097).round().astype(np.int64)]))
    found = bad_learning_rate(counts, schedule(jnp.asarray(counts, jnp.float32)))
    if found is not None:
        raise ValueError(f"{name}: {lr_problem(*found)}; check {params}")
    return schedule


def _check_warmup(warmup_num_steps, warmup_type: str) -> int:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"warmup_type must be one of {WARMUP_TYPES}, got {warmup_type!r}")
    return max(2, warmup_num_steps)  # DeepSpeed: log(1) = 0 would divide by zero


def _check_init_steps(init_steps) -> None:
    if isinstance(init_steps, bool) or not isinstance(init_steps, int) or init_steps < 0:
        raise ValueError(f"init_steps must be an int >= 0, got {init_steps!r}")


def _iteration(count, init_steps: int):
    """DeepSpeed's ``last_batch_iteration`` for optax's ``count``, as float32."""
    return jnp.asarray(count, jnp.float32) + (init_steps - 1)


def _warmup_gamma(it, warmup: int, warmup_type: str):
    """Fraction of the warmup done at iteration ``it >= 0`` (< warmup)."""
    if warmup_type == "log":
        return jnp.log(jnp.maximum(it, 0.0) + 1.0) / math.log(warmup)
    return jnp.maximum(it, 0.0) / warmup


def warmup_lr(
    warmup_min_lr: float = 0.0,
    warmup_max_lr: float = 0.001,
    warmup_num_steps: int = 1000,
    warmup_type: str = "log",
    *,
    init_steps: int = 0,
) -> Schedule:
    """DeepSpeed's ``WarmupLR``: from ``warmup_min_lr`` to ``warmup_max_lr`` in ``warmup_num_steps``, then constant.

    With ``W = max(2, warmup_num_steps)`` and ``i`` DeepSpeed's iteration (module docstring)::

        lr(i) = min + (max - min) * gamma(i),  gamma = log(i + 1) / log(W)  ("log") or i / W  ("linear")
        for 0 <= i < W;  lr(i) = max for i >= W;  lr(-1) = min

    Args:
      warmup_min_lr: learning rate at the start of the warmup.
      warmup_max_lr: learning rate after the warmup (DeepSpeed's default when absent: the optimizer's ``lr``;
        :func:`jonebit.train.config.build_schedule` fills it in).
      warmup_num_steps: warmup length in updates (> 0).
      warmup_type: ``"log"`` (DeepSpeed's default) or ``"linear"``.
      init_steps: engine steps before the first real update (module docstring).
    """
    warmup = _check_warmup(warmup_num_steps, warmup_type)
    _check_init_steps(init_steps)

    def schedule(count):
        it = _iteration(count, init_steps)
        gamma = jnp.where(it < 0, 0.0, jnp.where(it < warmup, _warmup_gamma(it, warmup, warmup_type), 1.0))
        return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma

    return _validated(schedule, warmup + 2, "WarmupLR", "warmup_min_lr and warmup_max_lr")


def warmup_decay_lr(
    total_num_steps: int,
    warmup_min_lr: float = 0.0,
    warmup_max_lr: float = 0.001,
    warmup_num_steps: int = 1000,
    warmup_type: str = "log",
    *,
    init_steps: int = 0,
) -> Schedule:
    """DeepSpeed's ``WarmupDecayLR``: :func:`warmup_lr`, then a linear decay to 0 at ``total_num_steps``.

    After the warmup (``i >= W``)::

        lr(i) = min + (max - min) * max(0, (total_num_steps - i) / max(1, total_num_steps - W))

    Args:
      total_num_steps: the iteration at which the learning rate reaches ``warmup_min_lr``.
      warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, init_steps: as in :func:`warmup_lr`.
    """
    warmup = _check_warmup(warmup_num_steps, warmup_type)
    _check_init_steps(init_steps)
    if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) or total_num_steps <= 0:
        raise ValueError(f"total_num_steps must be a positive integer, got {total_num_steps!r}")
    span = float(max(1, total_num_steps - warmup))

    def schedule(count):
        it = _iteration(count, init_steps)
        decay = jnp.maximum(0.0, (total_num_steps - it) / span)
        gamma = jnp.where(it < 0, 0.0, jnp.where(it < warmup, _warmup_gamma(it, warmup, warmup_type), decay))
        return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma

    return _validated(schedule, max(total_num_steps, warmup) + 2, "WarmupDecayLR", "warmup_min_lr and warmup_max_lr")


def warmup_cosine_lr(
    base_lr: float,
    total_num_steps: int,
    warmup_min_ratio: float = 0.0,
    warmup_num_steps: int = 1000,
    cos_min_ratio: float = 0.0001,
    warmup_type: str = "log",
    *,
    init_steps: int = 0,
) -> Schedule:
    """DeepSpeed's ``WarmupCosineLR``: ``base_lr`` times a ratio that warms up, then follows a cosine.

    With ``r0 = warmup_min_ratio``, ``rc = cos_min_ratio``::

        ratio(-1) = 0
        ratio(i)  = r0 + (1 - r0) * gamma(i)                        for 0 <= i < W
        ratio(i)  = max(0, rc + (1 - rc) * (1 + cos(pi * p)) / 2),   p = min(1, (i - W + 1) / max(1, T - W))

    Args:
      base_lr: the optimizer's ``lr`` (DeepSpeed reads it from the optimizer).
      total_num_steps: ``T``, where the cosine reaches ``cos_min_ratio``.
      warmup_min_ratio: ratio at the start of the warmup.
      warmup_num_steps: warmup length (> 0; ``W = max(2, warmup_num_steps)``).
      cos_min_ratio: final ratio.
      warmup_type: ``"log"`` or ``"linear"``.
      init_steps: engine steps before the first real update (module docstring).
    """
    warmup = _check_warmup(warmup_num_steps, warmup_type)
    _check_init_steps(init_steps)
    if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) or total_num_steps <= 0:
        raise ValueError(f"total_num_steps must be a positive integer, got {total_num_steps!r}")
    span = float(max(1, total_num_steps - warmup))

    def schedule(count):
        it = _iteration(count, init_steps)
        warm = warmup_min_ratio + (1.0 - warmup_min_ratio) * _warmup_gamma(it, warmup, warmup_type)
        progress = jnp.clip((it - warmup + 1) / span, 0.0, 1.0)
        cos = jnp.maximum(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * (1.0 + jnp.cos(jnp.pi * progress)) / 2)
        return base_lr * jnp.where(it < 0, 0.0, jnp.where(it < warmup, warm, cos))

    return _validated(schedule, max(total_num_steps, warmup) + 2, "WarmupCosineLR",
                      "the optimizer's lr, warmup_min_ratio and cos_min_ratio")


def one_cycle(
    cycle_min_lr: float,
    cycle_max_lr: float,
    decay_lr_rate: float = 0.0,
    cycle_first_step_size: int = 2000,
    cycle_second_step_size: int | None = None,
    cycle_first_stair_count: int = 0,
    cycle_second_stair_count: int | None = None,
    decay_step_size: int = 0,
    *,
    init_steps: int = 0,
) -> Schedule:
    """DeepSpeed's ``OneCycle`` learning rate (the momentum cycle is not applied, see below).

    With ``S1, S2`` the step sizes, ``S = S1 + S2`` and ``b = i + 1``: for ``i < S`` (the cycle)::

        x = b / S - floor(b / S)
        scale = x / (S1 / S)  if x <= S1 / S  else  (x - 1) / (S1 / S - 1)
        lr = cycle_min_lr + (cycle_max_lr - cycle_min_lr) * scale

    With a stair count ``n > 0`` for the current half, ``scale = floor(c * n / S1) / n`` on the way up and
    ``floor((S - c) * n / S2) / n`` on the way down (``c = b mod S``). After the cycle, with
    ``d = i - S + 1``: ``lr = cycle_min_lr / (1 + decay_lr_rate * d / decay_step_size)``, or ``cycle_min_lr``
    when ``decay_lr_rate`` or ``decay_step_size`` is 0.

    DeepSpeed also cycles Adam's ``beta1`` between ``cycle_min_mom`` and ``cycle_max_mom`` (and sets ``beta2``
    to 0.99) when ``cycle_momentum`` is true; optax's momentum is not a schedule here, so jonebit keeps the
    optimizer's betas constant and :func:`jonebit.train.config.build_schedule` logs a warning.

    Args:
      cycle_min_lr, cycle_max_lr: the cycle's bounds.
      decay_lr_rate: post-cycle decay rate.
      cycle_first_step_size: updates in the increasing half.
      cycle_second_step_size: updates in the decreasing half (default: ``cycle_first_step_size``).
      cycle_first_stair_count, cycle_second_stair_count: stairs per half (0: continuous; the second defaults to
        the first).
      decay_step_size: interval of the post-cycle decay (0: no decay).
      init_steps: engine steps before the first real update (module docstring).
    """
    _check_init_steps(init_steps)
    s1 = float(cycle_first_step_size)
    s2 = float(cycle_second_step_size) if cycle_second_step_size is not None else s1
    if s1 <= 0 or s2 <= 0:
        raise ValueError(f"cycle step sizes must be > 0, got {cycle_first_step_size!r} and {cycle_second_step_size!r}")
    n1 = cycle_first_stair_count
    n2 = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
    total = s1 + s2
    ratio = s1 / total
    decays = not (math.isclose(decay_step_size, 0) or math.isclose(decay_lr_rate, 0))

    def scale_at(b):
        x = b / total - jnp.floor(b / total)
        up = x <= ratio
        scale = jnp.where(up, x / ratio, (x - 1.0) / (ratio - 1.0))
        c = jnp.mod(b, total)
        first = c <= s1
        if n1 > 0:
            scale = jnp.where(first, jnp.floor(c * n1 / s1) / n1, scale)
        if n2 > 0:
            scale = jnp.where(first, scale, jnp.floor((total - c) * n2 / s2) / n2)
        return scale

    def schedule(count):
        it = _iteration(count, init_steps)
        cycle = cycle_min_lr + (cycle_max_lr - cycle_min_lr) * scale_at(it + 1.0)
        if decays:
            after = cycle_min_lr / (1.0 + decay_lr_rate * (it - total + 1.0) / decay_step_size)
        else:
            after = jnp.full_like(it, cycle_min_lr)
        return jnp.where(it < total, cycle, after)

    # The post-cycle decay is monotone: 100 decay intervals past the cycle show its direction.
    return _validated(schedule, total + 2 + (100 * abs(decay_step_size) if decays else 0), "OneCycle",
                      "cycle_min_lr, cycle_max_lr and decay_lr_rate")


def lr_range_test(
    lr_range_test_min_lr: float = 1e-3,
    lr_range_test_step_size: int = 2000,
    lr_range_test_step_rate: float = 1.0,
    lr_range_test_staircase: bool = False,
    *,
    init_steps: int = 0,
) -> Schedule:
    """DeepSpeed's ``LRRangeTest``: ``lr(i) = min_lr * (1 + step_rate * i / step_size)`` (``floor`` of the
    interval when ``staircase``); ``lr(-1) = min_lr``.

    Args:
      lr_range_test_min_lr: starting learning rate.
      lr_range_test_step_size: updates per unit of increase (> 0).
      lr_range_test_step_rate: increase per unit.
      lr_range_test_staircase: increase in steps instead of continuously.
      init_steps: engine steps before the first real update (module docstring).
    """
    _check_init_steps(init_steps)
    if lr_range_test_step_size <= 0:
        raise ValueError(f"lr_range_test_step_size must be > 0, got {lr_range_test_step_size!r}")

    def schedule(count):
        it = _iteration(count, init_steps)
        interval = it / lr_range_test_step_size
        if lr_range_test_staircase:
            interval = jnp.floor(interval)
        rising = lr_range_test_min_lr * (1.0 + lr_range_test_step_rate * interval)
        return jnp.where(it < 0, lr_range_test_min_lr, rising)

    # Linear in the update: 100 step sizes show where a negative rate takes it below zero.
    return _validated(schedule, 100 * lr_range_test_step_size, "LRRangeTest",
                      "lr_range_test_min_lr and lr_range_test_step_rate")


def warmup_linear_decay_exp(
    learning_rate: float,
    total_training_steps: int,
    warmup_proportion: float = 0.002,
    decay_rate: float = 0.99,
    decay_step: int = 1000,
    *,
    init_steps: int = 0,
) -> Schedule:
    """bing_bert's ``warmup_linear_decay_exp`` (DeepSpeedExamples' BERT pre-training), times ``learning_rate``.

    With ``s = global_step = count + init_steps``, ``T = total_training_steps``, ``w = warmup_proportion``::

        factor(s) = s / (w T)                          if s / T < w   (linear warmup from 0)
        factor(s) = decay_rate ** ((s - w T) / decay_step)   otherwise   (continuous exponential decay)
        factor(s) = 1                                  if w == 0

    bing_bert advances ``global_step`` on every engine step, also on steps skipped for an fp16 overflow; here
    it follows the update count like the other schedules (a skipped step does not move the schedule).

    Args:
      learning_rate: peak learning rate (bing_bert's ``training.learning_rate``).
      total_training_steps: ``T``; the warmup lasts ``warmup_proportion * T`` steps.
      warmup_proportion: fraction of ``T`` spent warming up (0: no warmup, constant ``learning_rate``).
      decay_rate: multiplicative decay per ``decay_step`` steps after the warmup.
      decay_step: steps per factor of ``decay_rate`` (> 0).
      init_steps: engine steps before the first real update (module docstring).
    """
    _check_init_steps(init_steps)
    if isinstance(total_training_steps, bool) or not isinstance(total_training_steps, int) or total_training_steps <= 0:
        raise ValueError(f"total_training_steps must be a positive integer, got {total_training_steps!r}")
    if decay_step <= 0:
        raise ValueError(f"decay_step must be > 0, got {decay_step!r}")
    warmup_end = warmup_proportion * total_training_steps

    def schedule(count):
        s = jnp.asarray(count, jnp.float32) + init_steps
        if warmup_proportion == 0.0:
            return jnp.full_like(s, learning_rate)
        warm = s / warmup_end
        # exp(log(rate) * k) with log(rate) in float64: float32 pow loses ~3e-6 relative at k ~ 200.
        decay = jnp.exp(math.log(decay_rate) * ((s - warmup_end) / decay_step))
        return learning_rate * jnp.where(s / total_training_steps < warmup_proportion, warm, decay)

    return _validated(schedule, total_training_steps + 2, "WarmupLinearDecayExp",
                      "learning_rate, warmup_proportion and decay_rate")
