"""Independent numpy models of 1-bit Adam and its compressed allreduce, P ranks simulated in one process.

They implement the definition in ``docs/onebit-adam.md`` (padding, RMS scales, sign of zero, worker and server
error, the two stages, fused vs per leaf, the mask) with numpy only, independently of jonebit's code, so the tests
compare the library with the documented algorithm.
"""

from __future__ import annotations

import math

import numpy as np


def np_padded(n: int, p: int) -> int:
    unit = p * (p * 8 // math.gcd(p, 8))
    return int(math.ceil(n / unit) * unit)


def np_sign(x):
    return np.where(x >= 0, 1.0, -1.0).astype(np.float32)


def np_compressed_allreduce(xs, wes, ses):
    """The spec's compressed allreduce for P ranks. xs: list of (N,), wes: list of (N_pad,), ses: list of (C,)."""
    p = len(xs)
    n = xs[0].shape[0]
    n_pad = np_padded(n, p)
    c = n_pad // p
    bufs, scales, new_wes = [], [], []
    for x, we in zip(xs, wes, strict=True):
        buf = np.zeros(n_pad, np.float32)
        buf[:n] = x
        buf = buf + we
        s = np.float32(np.sqrt(np.sum(buf.astype(np.float64) ** 2)) / np.sqrt(n_pad))
        bufs.append(np_sign(buf))
        scales.append(s)
        new_wes.append(buf - s * np_sign(buf))
    out_chunks, new_ses = [], []
    for r in range(p):
        z = np.zeros(c, np.float32)
        for j in range(p):
            z = z + np.float32(scales[j] / p) * bufs[j][r * c:(r + 1) * c]
        y = z + ses[r]
        s = np.float32(np.sqrt(np.sum(y.astype(np.float64) ** 2)) / np.sqrt(c))
        new_ses.append(y - s * np_sign(y))
        out_chunks.append(s * np_sign(y))
    out = np.concatenate(out_chunks)[:n]
    return out, new_wes, new_ses


def np_row_padded(n: int, p: int, row: int) -> int:
    # Whole rows per rank, and whole bytes: the smallest rows-per-rank count r with r * row % 8 == 0.
    per_rank = next(r for r in range(1, 9) if r * row % 8 == 0)
    rows = n // row
    return int(math.ceil(rows / (per_rank * p)) * per_rank * p) * row


def np_compressed_allreduce_rows(xs, wes, ses, row):
    """The compressed allreduce with one scale per row of ``row`` floats (``row_scales``), for P ranks."""
    p = len(xs)
    n = xs[0].shape[0]
    n_pad = np_row_padded(n, p, row)
    c = n_pad // p

    def rms(v):  # per row
        r = v.reshape(-1, row).astype(np.float64)
        return (np.sqrt(np.sum(r * r, axis=1)) / np.sqrt(row)).astype(np.float32)

    def expand(scales):
        return np.repeat(scales, row)

    signs, scales, new_wes = [], [], []
    for x, we in zip(xs, wes, strict=True):
        buf = np.zeros(n_pad, np.float32)
        buf[:n] = x
        buf = buf + we
        s = rms(buf)
        signs.append(np_sign(buf))
        scales.append(expand(s))
        new_wes.append(buf - expand(s) * np_sign(buf))
    out_chunks, new_ses = [], []
    for r in range(p):
        z = np.zeros(c, np.float32)
        for j in range(p):
            z = z + (scales[j][r * c:(r + 1) * c] / np.float32(p)) * signs[j][r * c:(r + 1) * c]
        y = z + ses[r]
        s = expand(rms(y))
        new_ses.append(y - s * np_sign(y))
        out_chunks.append(s * np_sign(y))
    return np.concatenate(out_chunks)[:n], new_wes, new_ses


class NumpyOneBitAdam:
    """1-bit Adam of the spec for P simulated ranks on a dict of arrays (independent of jonebit)."""

    def __init__(self, params, p, *, freeze_step, lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.0, mask=None, fused=True,
                 row_scales=False, preconditioned=False, refresh=None):
        self.p, self.freeze, self.lr, self.b1, self.b2, self.eps, self.wd = p, freeze_step, lr, b1, b2, eps, wd
        # refresh=K: every K-th update after the freeze is an exact step on the mean gradient whose square enters
        # the variance with weight 1 - b2^K.
        self.refresh = refresh
        self.mask, self.fused, self.row_scales, self.preconditioned = mask, fused, row_scales, preconditioned
        # row_scales: one scale per row (last axis) of every array of rank >= 2, per-leaf compression only.
        self.rows = {k: (v.shape[-1] if row_scales and np.ndim(v) >= 2 else None) for k, v in params.items()}
        self.keys = sorted(params)
        self.params = {k: np.array(v, np.float32) for k, v in params.items()}
        self.m = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.v = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.count = 0
        groups = [None] if fused else self.keys
        size = lambda g: sum(self.params[k].size for k in self.keys) if g is None else self.params[g].size  # noqa: E731
        padded = lambda g: (np_padded(size(g), p) if g is None or self.rows[g] is None  # noqa: E731
                            else np_row_padded(size(g), p, self.rows[g]))
        self.we = {g: [np.zeros(padded(g), np.float32) for _ in range(p)] for g in groups}
        self.se = {g: [np.zeros(padded(g) // p, np.float32) for _ in range(p)] for g in groups}

    def step(self, local_grads):
        """local_grads: list over ranks of dicts. Returns the new params."""
        b1, b2 = self.b1, self.b2
        refreshing = (self.refresh is not None and self.count >= self.freeze
                      and (self.count + 1 - self.freeze) % self.refresh == 0)
        if self.count < self.freeze or refreshing:
            g = {k: np.mean([lg[k] for lg in local_grads], axis=0, dtype=np.float32) for k in self.keys}
            w = b2 ** self.refresh if refreshing else b2  # Python floats, as the library computes them
            for k in self.keys:
                self.m[k] = b1 * self.m[k] + (1 - b1) * g[k]
                self.v[k] = w * self.v[k] + (1 - w) * g[k] * g[k]
        else:
            local_m = [{k: b1 * self.m[k] + (1 - b1) * lg[k] for k in self.keys} for lg in local_grads]
            if self.preconditioned:  # compress m / (sqrt(v / c2) + eps); elements with v = 0 send 0
                c2 = np.float32(self.frozen_c2())
                denom = {k: np.sqrt(self.v[k] / c2) + np.float32(self.eps) for k in self.keys}
                local_m = [{k: np.where(self.v[k] > 0, lm[k] / denom[k], np.float32(0)) for k in self.keys}
                           for lm in local_m]
            if self.p > 1:
                if self.fused:
                    flat = [np.concatenate([lm[k].ravel() for k in self.keys]) for lm in local_m]
                    out, self.we[None], self.se[None] = np_compressed_allreduce(flat, self.we[None], self.se[None])
                    offs = np.cumsum([0] + [self.m[k].size for k in self.keys])
                    for i, k in enumerate(self.keys):
                        self.m[k] = out[offs[i]:offs[i + 1]].reshape(self.m[k].shape)
                else:
                    for k in self.keys:
                        bufs = [lm[k].ravel() for lm in local_m]
                        if self.rows[k] is None:
                            out, self.we[k], self.se[k] = np_compressed_allreduce(bufs, self.we[k], self.se[k])
                        else:
                            out, self.we[k], self.se[k] = np_compressed_allreduce_rows(
                                bufs, self.we[k], self.se[k], self.rows[k])
                        self.m[k] = out.reshape(self.m[k].shape)
            else:
                self.m = local_m[0]
            if self.preconditioned:
                self.m = {k: self.m[k] * denom[k] for k in self.keys}
            if self.mask is not None:
                self.m = {k: self.m[k] * self.mask[k] for k in self.keys}
        for k in self.keys:
            u = self.m[k] / (np.sqrt(self.v[k]) + self.eps) + self.wd * self.params[k]
            self.params[k] = self.params[k] - self.lr * u
        self.count += 1
        return self.params

    def frozen_c2(self):
        """The variance's bias correction once frozen (none in DeepSpeed's arithmetic)."""
        return 1.0


class NumpyOneBitAdamFull(NumpyOneBitAdam):
    """:class:`NumpyOneBitAdam` plus a learning-rate schedule, Adam's bias correction and per-rank gradient clipping.

    ``schedule(count)`` gives the learning rate of the update that follows ``count`` updates (0-based). With
    ``bias_correction`` the update is ``(m / (1 - b1^t)) / (sqrt(v / (1 - b2^min(t, freeze_step))) + eps)`` for the
    t-th update (1-based): the variance's correction stops where the variance stops. ``clip_norm`` scales each
    rank's local gradient by ``min(1, clip_norm / ||g||)`` first (``optax.clip_by_global_norm`` chained before the
    optimizer inside ``shard_map`` sees only its own rank's gradient). With ``clip_averaged_warmup`` the warmup
    clips the gradient averaged over ranks instead (DeepSpeed's engine clips after its allreduce there); the
    compression stage still clips each rank's own gradient.
    """

    def __init__(self, params, p, *, freeze_step, schedule=None, bias_correction=False, clip_norm=None,
                 clip_averaged_warmup=False, clip_ratio=None, **kwargs):
        super().__init__(params, p, freeze_step=freeze_step, **kwargs)
        self.schedule = schedule if schedule is not None else (lambda count: kwargs["lr"])
        self.bias_correction, self.clip_norm = bias_correction, clip_norm
        self.clip_averaged_warmup = clip_averaged_warmup
        self.clip_ratio = clip_ratio  # bound on (m / c1) / (sqrt(v / c2) + eps) after the freeze

    def clip(self, grads):
        norm = np.sqrt(sum(np.sum(grads[k].astype(np.float64) ** 2) for k in self.keys))
        factor = min(1.0, self.clip_norm / norm) if norm > 0 else 1.0
        return {k: (grads[k] * np.float32(factor)).astype(np.float32) for k in self.keys}

    def frozen_c2(self):
        """The variance's correction during the compression update that follows ``self.count`` updates."""
        return self.variance_correction(self.count + 1) if self.bias_correction else 1.0

    def variance_correction(self, t):
        """``1 - b2^t`` while the variance is estimated, then fixed at its freeze_step value (with ``refresh=K``:
        at the latest refresh, ``freeze + K floor((t - freeze) / K)``)."""
        if self.refresh is not None and t > self.freeze:
            return 1.0 - self.b2 ** (self.freeze + self.refresh * ((t - self.freeze) // self.refresh))
        return 1.0 - self.b2 ** min(t, self.freeze)

    def step(self, local_grads):
        if self.clip_norm is not None and self.clip_averaged_warmup and self.count < self.freeze:
            # Every rank holds the clipped mean: the base class's warmup average of P copies is that mean.
            mean = {k: (sum(g[k].astype(np.float64) for g in local_grads) / self.p).astype(np.float32)
                    for k in self.keys}
            local_grads = [self.clip(mean)] * self.p
        elif self.clip_norm is not None:
            local_grads = [self.clip(g) for g in local_grads]
        count, lr, before = self.count, self.lr, dict(self.params)
        # The moments, error buffers and count move as in the base class; a zero learning rate leaves the params.
        self.lr = 0.0
        super().step(local_grads)
        self.lr = lr
        t = count + 1
        c1 = 1.0 - self.b1 ** t if self.bias_correction else 1.0
        c2 = self.variance_correction(t) if self.bias_correction else 1.0
        lr_t = float(self.schedule(count))
        for k in self.keys:
            ratio = (self.m[k] / c1) / (np.sqrt(self.v[k] / c2) + self.eps)
            if self.clip_ratio is not None and count >= self.freeze:  # refresh updates too
                ratio = np.clip(ratio, -self.clip_ratio, self.clip_ratio)
            u = ratio + self.wd * before[k]
            self.params[k] = (before[k] - lr_t * u).astype(np.float32)
        return self.params


class NumpyOneBitAdamAuto(NumpyOneBitAdamFull):
    """:class:`NumpyOneBitAdamFull` with ``freeze_step="auto"``: after every warmup update the rule of
    ``jonebit.AutoFreeze`` (``tests.reference_family.np_auto_freeze``, on the per-tensor ``||v||`` in float64) decides
    whether that was the last warmup update; until it fires the freeze point is the cap ``max_step``. The variance's
    bias correction then stops at the decided point."""

    def __init__(self, params, p, *, rule: dict, **kwargs):
        super().__init__(params, p, freeze_step=rule["max_step"], **kwargs)
        self.rule, self.norms, self.decided = dict(rule), [], None

    def _decide(self):
        """After the moments of a warmup update are in (``self.count`` already counts it): apply the rule once."""
        from tests.reference_family import np_auto_freeze

        if self.decided is None and len(self.norms) < self.count <= self.freeze:
            self.norms.append({k: float(np.sqrt(np.sum(self.v[k].astype(np.float64) ** 2))) for k in self.keys})
            fired = np_auto_freeze(self.norms, b2=self.b2, **self.rule)
            if fired is not None:
                self.decided = self.freeze = fired

    def variance_correction(self, t):
        self._decide()  # the correction of the update that decided already stops at the decided point
        return super().variance_correction(t)

    def step(self, local_grads):
        out = super().step(local_grads)
        self._decide()  # (without bias correction variance_correction is not called)
        return out
