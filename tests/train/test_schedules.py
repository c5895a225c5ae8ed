"""DeepSpeed's schedulers as optax schedules, against the formulas written out here in float64.

Each reference is a function of DeepSpeed's ``last_batch_iteration`` ``i`` (``-1`` before the first
``scheduler.step()``); the engine runs its k-th applied step with ``i = k - 1`` and 1-bit Adam spends engine step
0 on initialisation, so optax's ``count`` maps to ``i = count - 1 + init_steps``. The counts checked include 0, the
warmup boundary and the end of the schedule.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from jonebit.train import schedules


def check(schedule, reference, counts, init_steps=0):
    got = np.array([float(schedule(c)) for c in counts])
    want = np.array([reference(c - 1 + init_steps) for c in counts])
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-12, err_msg=f"counts {counts}")


def ref_warmup(i, lo, hi, w, kind, decay_total=None):
    w = max(2, w)
    if i < 0:
        return lo
    if i < w:
        gamma = math.log(i + 1) / math.log(w) if kind == "log" else i / w
    elif decay_total is None:
        gamma = 1.0
    else:
        gamma = max(0.0, (decay_total - i) / max(1.0, decay_total - w))
    return lo + (hi - lo) * gamma


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("init_steps", [0, 1])
def test_warmup_lr(kind, init_steps):
    sched = schedules.warmup_lr(1e-5, 3e-4, 50, kind, init_steps=init_steps)
    check(sched, lambda i: ref_warmup(i, 1e-5, 3e-4, 50, kind), [0, 1, 2, 3, 25, 48, 49, 50, 51, 52, 500],
          init_steps)


def test_warmup_lr_hand_values():
    # linear, W = 10, min 0.1, max 1.1: the first two updates both run at min (iterations -1 and 0).
    sched = schedules.warmup_lr(0.1, 1.1, 10, "linear")
    np.testing.assert_allclose([float(sched(c)) for c in (0, 1, 2, 6, 11, 100)], [0.1, 0.1, 0.2, 0.6, 1.1, 1.1],
                               rtol=1e-6)
    # log with W = 1 is clamped to 2 (DeepSpeed divides by log(W)): iteration 1 is already past the warmup.
    sched = schedules.warmup_lr(0.0, 1.0, 1, "log")
    np.testing.assert_allclose([float(sched(c)) for c in (0, 1, 2, 3)], [0.0, 0.0, math.log(2) / math.log(2), 1.0])


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr(kind):
    sched = schedules.warmup_decay_lr(200, 2e-5, 4e-4, 40, kind)
    counts = [0, 1, 2, 39, 40, 41, 42, 100, 199, 200, 201, 202, 1000]
    check(sched, lambda i: ref_warmup(i, 2e-5, 4e-4, 40, kind, decay_total=200), counts)
    assert float(sched(201)) == pytest.approx(2e-5)  # i = total: back at warmup_min_lr, and stays there
    assert float(sched(5000)) == pytest.approx(2e-5)


def ref_cosine(i, base, total, r0, w, rc, kind):
    w = max(2, w)
    if i < 0:
        return 0.0
    if i < w:
        g = math.log(i + 1) / math.log(w) if kind == "log" else i / w
        return base * (r0 + (1 - r0) * g)
    p = min(1.0, (i - w + 1) / max(1, total - w))
    return base * max(0.0, rc + (1 - rc) * (1 + math.cos(math.pi * p)) / 2)


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("init_steps", [0, 1])
def test_warmup_cosine_lr(kind, init_steps):
    sched = schedules.warmup_cosine_lr(1e-3, 300, 0.05, 30, 0.01, kind, init_steps=init_steps)
    counts = [0, 1, 2, 15, 30, 31, 32, 33, 150, 299, 300, 301, 302, 2000]
    check(sched, lambda i: ref_cosine(i, 1e-3, 300, 0.05, 30, 0.01, kind), counts, init_steps)
    assert float(sched(0)) == (0.0 if init_steps == 0 else pytest.approx(5e-5))
    assert float(sched(5000)) == pytest.approx(1e-5)  # clamped at cos_min_ratio, no second cosine period


def ref_one_cycle(i, lo, hi, rate, s1, s2, n1, n2, dstep):
    total = s1 + s2
    if i < total:
        b = i + 1
        x = 1 + b / total - math.floor(1 + b / total)
        r = s1 / total
        scale = x / r if x <= r else (x - 1) / (r - 1)
        n = n1 if x <= r else n2
        if n > 0:
            c = b % total
            pos = c * n / s1 if c <= s1 else (total - c) * n / s2
            scale = math.floor(pos) / n
        return lo + (hi - lo) * scale
    if rate == 0 or dstep == 0:
        return lo
    return lo / (1 + rate * (i - total + 1) / dstep)


@pytest.mark.parametrize(
    "s1,s2,n1,n2,rate,dstep",
    [(10, 10, 0, 0, 0.0, 0), (10, 6, 0, 0, 0.5, 4), (12, 8, 4, 2, 0.1, 5), (7, 9, 3, 0, 0.0, 3)],
)
def test_one_cycle(s1, s2, n1, n2, rate, dstep):
    sched = schedules.one_cycle(1e-4, 1e-3, rate, s1, s2, n1, n2, dstep)
    total = s1 + s2
    counts = [0, 1, 2, s1 - 1, s1, s1 + 1, s1 + 2, total - 1, total, total + 1, total + 2, total + 10, 5 * total]
    check(sched, lambda i: ref_one_cycle(i, 1e-4, 1e-3, rate, s1, s2, n1, n2, dstep), counts)
    assert float(sched(s1)) == pytest.approx(1e-3)  # iteration s1 - 1, b = s1: the peak (also with stairs)


def test_one_cycle_second_defaults():
    # cycle_second_step_size defaults to the first, cycle_second_stair_count to the first stair count.
    sched = schedules.one_cycle(0.0, 1.0, cycle_first_step_size=8, cycle_first_stair_count=4)
    check(sched, lambda i: ref_one_cycle(i, 0.0, 1.0, 0.0, 8, 8, 4, 4, 0), list(range(0, 20)))


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase):
    sched = schedules.lr_range_test(1e-4, 10, 2.0, staircase)

    def ref(i):
        if i < 0:
            return 1e-4
        interval = math.floor(i / 10) if staircase else i / 10
        return 1e-4 * (1 + 2.0 * interval)

    check(sched, ref, [0, 1, 2, 9, 10, 11, 12, 55])


def ref_bing(step, lr, total, warmup, rate, dstep):
    x = step / total
    if warmup == 0.0:
        return lr
    if x < warmup:
        return lr * x / warmup
    return lr * rate ** ((step - warmup * total) / dstep)


@pytest.mark.parametrize("init_steps", [0, 1])
def test_warmup_linear_decay_exp(init_steps):
    # bing_bert BERT-large seq128 values; its global_step is the engine step (= count + init_steps).
    sched = schedules.warmup_linear_decay_exp(4e-4, 125000, 0.1, 0.99, 520, init_steps=init_steps)
    counts = [0, 1, 2, 6000, 12498, 12499, 12500, 12501, 23000, 125000, 200000]
    got = np.array([float(sched(c)) for c in counts])
    want = np.array([ref_bing(c + init_steps, 4e-4, 125000, 0.1, 0.99, 520) for c in counts])
    np.testing.assert_allclose(got, want, rtol=2e-6)
    assert float(sched(0)) == (0.0 if init_steps == 0 else pytest.approx(4e-4 / 12500))
    assert float(sched(12500 - init_steps)) == pytest.approx(4e-4)  # warmup end: decay_rate ** 0


def test_warmup_linear_decay_exp_no_warmup():
    sched = schedules.warmup_linear_decay_exp(1e-3, 100, 0.0, 0.5, 10)
    assert [float(sched(c)) for c in (0, 50, 1000)] == pytest.approx([1e-3] * 3)


def test_schedules_jit_and_vectorise():
    import jax
    import jax.numpy as jnp

    sched = schedules.warmup_decay_lr(100, 0.0, 1.0, 10, "linear")
    counts = jnp.arange(0, 120)
    got = np.asarray(jax.jit(jax.vmap(sched))(counts))
    want = [ref_warmup(int(c) - 1, 0.0, 1.0, 10, "linear", decay_total=100) for c in counts]
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: schedules.warmup_lr(warmup_num_steps=0), "warmup_num_steps must be a positive integer, got 0"),
        (lambda: schedules.warmup_lr(warmup_type="cosine"), r"warmup_type must be one of \('log', 'linear'\)"),
        (lambda: schedules.warmup_decay_lr(0), "total_num_steps must be a positive integer, got 0"),
        (lambda: schedules.warmup_cosine_lr(1e-3, 10.5), "total_num_steps must be a positive integer, got 10.5"),
        (lambda: schedules.one_cycle(0.0, 1.0, cycle_first_step_size=0), "cycle step sizes must be > 0"),
        (lambda: schedules.warmup_linear_decay_exp(1e-3, 100, decay_step=0), "decay_step must be > 0"),
        (lambda: schedules.warmup_lr(init_steps=-1), "init_steps must be an int >= 0, got -1"),
    ],
)
def test_bad_arguments(build, match):
    with pytest.raises(ValueError, match=match):
        build()
