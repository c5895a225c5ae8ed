"""Independent numpy references of DeepSpeed's 0/1 Adam and 1-bit LAMB (P ranks simulated in one process).

Written from shared/reference/onebit-family-details.md sections 2.2 and 2.3, step by step, with DeepSpeed's own
step counter (``self.ds_step``: 1 after its initialisation call). The differences jonebit makes on purpose are
the documented fixes, each behind an explicit switch here so that a test can show it matters:

* ``p1_momentum``: with one rank, 0/1 Adam's first phase also updates the momentum on non-variance steps
  (DeepSpeed does not);
* the mask is applied with one rank as well;
* 1-bit LAMB's scaling coefficient is 1 (not infinite) for a tensor whose momentum is all zeros at the freeze, and
  the weight-decay blend of its factor is skipped (rho = 1) when the update norm is zero.
"""

from __future__ import annotations

import numpy as np

from tests.reference import np_compressed_allreduce, np_padded

f32 = np.float32


def _norm(x) -> np.float32:
    return f32(np.sqrt(np.sum(np.asarray(x, np.float64) ** 2)))


class _Compressor:
    """Error-compensated 1-bit averaging of per-rank dicts: fused (one buffer) or one buffer per key."""

    def __init__(self, shapes: dict, p: int, fused: bool, extra: int = 0):
        self.keys, self.shapes, self.p, self.fused = sorted(shapes), shapes, p, fused
        size = lambda g: (sum(int(np.prod(shapes[k])) for k in self.keys) + extra) if g is None \
            else int(np.prod(shapes[g]))  # noqa: E731
        self.groups = [None] if fused else self.keys
        self.we = {g: [np.zeros(np_padded(size(g), p), f32) for _ in range(p)] for g in self.groups}
        self.se = {g: [np.zeros(np_padded(size(g), p) // p, f32) for _ in range(p)] for g in self.groups}

    def reset(self):
        for g in self.groups:
            self.we[g] = [np.zeros_like(e) for e in self.we[g]]
            self.se[g] = [np.zeros_like(e) for e in self.se[g]]

    def flat(self, per_rank: list[np.ndarray]) -> np.ndarray:
        """Averages already-flat per-rank buffers (fused layout only)."""
        out, self.we[None], self.se[None] = np_compressed_allreduce(per_rank, self.we[None], self.se[None])
        return out

    def __call__(self, per_rank: list[dict]) -> dict:
        if self.fused:
            out = self.flat([np.concatenate([d[k].ravel() for k in self.keys]) for d in per_rank])
            offs = np.cumsum([0] + [int(np.prod(self.shapes[k])) for k in self.keys])
            return {k: out[offs[i]:offs[i + 1]].reshape(self.shapes[k]) for i, k in enumerate(self.keys)}
        res = {}
        for k in self.keys:
            out, self.we[k], self.se[k] = np_compressed_allreduce([d[k].ravel() for d in per_rank], self.we[k],
                                                                  self.se[k])
            res[k] = out.reshape(self.shapes[k])
        return res


class NumpyZeroOneAdam:
    """DeepSpeed's ZeroOneAdam (section 2.2) for P simulated ranks, each with its own params, m and u."""

    def __init__(self, params, p, *, lr, var_freeze_step, var_update_scaler=16, local_step_scaler=32678,
                 local_step_clipper=16, b1=0.9, b2=0.999, eps=1e-8, wd=0.0, mask=None, fused=True,
                 p1_momentum=True, bias_correction=False, mask_unseen=False):
        self.p, self.lr, self.b1, self.b2, self.eps, self.wd = p, lr, b1, b2, eps, wd
        self.mask_unseen = mask_unseen  # elements with v == 0: no 1-bit average, no momentum
        self.V, self.kappa, self.scaler, self.clipper = var_freeze_step, var_update_scaler, local_step_scaler, \
            local_step_clipper
        self.mask, self.p1_momentum, self.bias_correction = mask, p1_momentum, bias_correction
        self.var_updates = 0
        self.keys = sorted(params)
        self.params = [{k: np.array(params[k], f32) for k in self.keys} for _ in range(p)]
        self.m = [{k: np.zeros_like(v) for k, v in self.params[0].items()} for _ in range(p)]
        self.u = [{k: np.zeros_like(v) for k, v in self.params[0].items()} for _ in range(p)]
        self.v = {k: np.zeros_like(v) for k, v in self.params[0].items()}
        self.comp = _Compressor({k: v.shape for k, v in self.params[0].items()}, p, fused)
        self.ds_step = 1  # the initialisation call
        self.var_interval, self.var_counter = 1, 0
        self.local_interval, self.local_counter, self.lrs = 1, 0, f32(0.0)
        self.freeze_key = False
        self.log = []  # per update: "var", "onebit", "local" or "sync"

    def _lr(self):
        return f32(self.lr(self.ds_step - 2) if callable(self.lr) else self.lr)

    def _denom(self):
        """sqrt(v) + eps, with the variance corrected by 1 - b2^(variance updates) when asked."""
        eps = f32(self.eps)
        if not self.bias_correction:
            return {key: np.sqrt(self.v[key]) + eps for key in self.keys}
        c2 = f32(1) - f32(self.b2) ** f32(self.var_updates)
        return {key: np.sqrt(self.v[key] / c2) + eps for key in self.keys}

    def _masked(self, d):
        return d if self.mask is None else {k: d[k] * self.mask[k] for k in self.keys}

    def step(self, local_grads):
        """local_grads: list over ranks of dicts. Returns the list of per-rank params."""
        b1, b2, P = f32(self.b1), f32(self.b2), self.p
        ob1, ob2 = f32(1 - self.b1), f32(1 - self.b2)  # DeepSpeed: 1 - beta in Python floats
        self.ds_step += 1
        s, lr = self.ds_step, self._lr()
        if not self.freeze_key:
            var_step = s % self.var_interval == 0
            if var_step:
                g = {k: np.mean([lg[k] for lg in local_grads], axis=0, dtype=f32) for k in self.keys}
                for r in range(P):
                    self.m[r] = {k: b1 * self.m[r][k] + ob1 * g[k] for k in self.keys}
                self.v = {k: b2 * self.v[k] + ob2 * g[k] * g[k] for k in self.keys}
                self.var_updates += 1
                self.log.append("var")
            else:
                if P > 1:
                    ghat = self._masked(self.comp(local_grads))
                elif self.p1_momentum:
                    ghat = self._masked(local_grads[0])
                else:
                    ghat = None  # DeepSpeed: m untouched with one rank
                if ghat is not None and self.mask_unseen:
                    ghat = {k: np.where(self.v[k] > 0, ghat[k], f32(0)) for k in self.keys}
                if ghat is not None:
                    for r in range(P):
                        self.m[r] = {k: b1 * self.m[r][k] + ob1 * ghat[k] for k in self.keys}
                self.log.append("onebit")
            denom = self._denom()
            c1 = f32(1) - f32(self.b1) ** f32(s - 1) if self.bias_correction else f32(1)
            for r in range(P):
                for k in self.keys:
                    m = self.m[r][k] / c1 if self.bias_correction else self.m[r][k]
                    d = m / denom[k] + f32(self.wd) * self.params[r][k]
                    self.params[r][k] = self.params[r][k] - lr * d
            if var_step:
                self.var_counter += 1
                if self.var_counter == self.kappa:
                    self.var_counter, self.var_interval = 0, 2 * self.var_interval
        else:
            self.lrs = f32(self.lrs + lr)
            denom = self._denom()
            for r in range(P):
                for k in self.keys:
                    self.m[r][k] = b1 * self.m[r][k] + ob1 * local_grads[r][k]
                    if self.mask_unseen:
                        self.m[r][k] = np.where(self.v[k] > 0, self.m[r][k], f32(0))
                    d = self.m[r][k] / denom[k] + f32(self.wd) * self.params[r][k]
                    self.params[r][k] = self.params[r][k] - lr * d
                    self.u[r][k] = self.u[r][k] - lr * d
            if s % self.local_interval == 0:
                for r in range(P):
                    for k in self.keys:
                        self.params[r][k] = self.params[r][k] - self.u[r][k]
                        self.u[r][k] = self.u[r][k] * denom[k]
                avg = self.comp(self.u) if P > 1 else self.u[0]
                avg = self._masked(avg)
                for r in range(P):
                    for k in self.keys:
                        mine = np.where(self.v[k] > 0, avg[k], self.u[r][k]) if self.mask_unseen else avg[k]
                        self.m[r][k] = -mine / self.lrs
                        self.params[r][k] = self.params[r][k] + mine / denom[k]
                        self.u[r][k] = np.zeros_like(self.u[r][k])
                self.lrs = f32(0.0)
                self.log.append("sync")
            else:
                self.log.append("local")
            self.local_counter += 1
            if self.local_counter == self.scaler:
                self.local_counter, self.local_interval = 0, min(self.clipper, 2 * self.local_interval)
        if s > self.V and not self.freeze_key:
            self.freeze_key = True
            self.comp.reset()
        return self.params


class NumpyOneBitLamb:
    """DeepSpeed's OnebitLamb (section 2.3) for P simulated ranks; params and moments are identical on all ranks.

    ``freeze_step`` is DeepSpeed's (its initialisation call counts): warmup covers DeepSpeed steps 2..freeze_step.
    """

    def __init__(self, params, p, *, lr, freeze_step, b1=0.9, b2=0.999, eps=1e-8, wd=0.0, max_coeff=10.0,
                 min_coeff=0.01, coeff_beta=0.9, factor_max=4.0, factor_min=0.5, factor_threshold=0.1, mask=None,
                 mask_unseen=False):
        self.p, self.lr, self.F, self.b1, self.b2, self.eps, self.wd = p, lr, freeze_step, b1, b2, eps, wd
        self.max_coeff, self.min_coeff, self.coeff_beta = max_coeff, min_coeff, coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        self.mask, self.mask_unseen = mask, mask_unseen  # mask_unseen: momentum 0 where the frozen v is 0
        self.keys = sorted(params)  # DeepSpeed's parameter order = jax's leaf order of a dict
        self.params = {k: np.array(params[k], f32) for k in self.keys}
        zeros = lambda: {k: np.zeros_like(v) for k, v in self.params.items()}  # noqa: E731
        self.m, self.v, self.v_fresh = zeros(), zeros(), zeros()
        self.coeff_freeze = {k: f32(0.0) for k in self.keys}
        self.last_factor = {k: f32(1.0) for k in self.keys}
        self.scaling = None
        self.n = sum(v.size for v in self.params.values())
        self.pad = np.zeros(np_padded(self.n, p) - self.n, f32)  # the fused buffer's dummy tail
        self.comp = _Compressor({k: v.shape for k, v in self.params.items()}, p, True, extra=self.pad.size)
        self.ds_step = 1
        self.freeze_key = False
        self.coeffs = []  # per update: {key: coefficient applied}
        self.factors = []  # per compression update: {key: factor before/after clamps}

    def _lr(self):
        return f32(self.lr(self.ds_step - 2) if callable(self.lr) else self.lr)

    def step(self, local_grads):
        b1, b2, eps, wd = f32(self.b1), f32(self.b2), f32(self.eps), f32(self.wd)
        ob1, ob2 = f32(1 - self.b1), f32(1 - self.b2)  # DeepSpeed: 1 - beta in Python floats
        self.ds_step += 1
        lr = self._lr()
        applied = {}
        if not self.freeze_key:
            g = {k: np.mean([lg[k] for lg in local_grads], axis=0, dtype=f32) for k in self.keys}
            for k in self.keys:
                self.m[k] = b1 * self.m[k] + ob1 * g[k]
                self.v[k] = b2 * self.v[k] + ob2 * g[k] * g[k]
                if self.ds_step == self.F:
                    self.v_fresh[k] = self.v[k].copy()
                u = self.m[k] / (np.sqrt(self.v[k]) + eps) + wd * self.params[k]
                pn, un = _norm(self.params[k]), _norm(u)
                c = f32(1.0)
                if pn != 0 and un != 0:
                    c = f32(min(max(pn / un, self.min_coeff), self.max_coeff))
                if c != 1.0:
                    self.coeff_freeze[k] = f32(self.coeff_beta * self.coeff_freeze[k] + (1 - self.coeff_beta) * c)
                self.params[k] = self.params[k] - lr * c * u
                applied[k] = c
            if self.ds_step >= self.F:
                self.freeze_key = True
        else:
            m_prev = {k: self.m[k].copy() for k in self.keys}
            if self.scaling is None:
                rms = {k: _norm(self.m[k]) / f32(np.sqrt(self.m[k].size)) for k in self.keys}
                united = f32(np.mean([rms[k] for k in self.keys]))
                self.scaling = {k: (united / rms[k]) if rms[k] > 0 else f32(1.0) for k in self.keys}
            per_rank = [{k: (b1 * m_prev[k] + ob1 * local_grads[r][k]) * self.scaling[k] for k in self.keys}
                        for r in range(self.p)]
            if self.p > 1:  # one compressed allreduce of the fused buffer, dummy tail included
                flat = [np.concatenate([d[k].ravel() for k in self.keys] + [self.pad]) for d in per_rank]
                out = self.comp.flat(flat)
                offs = np.cumsum([0] + [self.params[k].size for k in self.keys])
                for i, k in enumerate(self.keys):
                    self.m[k] = out[offs[i]:offs[i + 1]].reshape(self.params[k].shape)
                self.pad = out[self.n:].copy()  # the decoded tail stays in the buffer for the next step
            else:
                self.m = per_rank[0]
            factors = {}
            for k in self.keys:
                m = self.m[k] / self.scaling[k]
                if self.mask is not None:
                    m = m * self.mask[k]
                if self.mask_unseen:
                    m = np.where(self.v[k] > 0, m, f32(0))
                self.m[k] = m
                g_rec = (m - b1 * m_prev[k]) / ob1
                self.v_fresh[k] = b2 * self.v_fresh[k] + ob2 * g_rec * g_rec
                denom = np.sqrt(self.v[k]) + eps
                u0 = m / denom
                u = u0 + wd * self.params[k] if self.wd > 0 else u0
                f = f32(np.max(denom / (np.sqrt(self.v_fresh[k]) + eps)))
                raw = f
                if self.wd > 0:
                    un = _norm(u)
                    rho = f32(min(1.0, _norm(u0) / un)) if un > 0 else f32(1.0)
                    f = f32(rho * f + (1 - rho))
                f = f32(min(max(f, self.factor_min), self.factor_max))
                last = self.last_factor[k]
                f = f32(min(max(f, last * f32(1 - self.factor_threshold)), last * f32(1 + self.factor_threshold)))
                self.last_factor[k] = f
                c = f32(self.coeff_freeze[k] * f)
                self.params[k] = self.params[k] - lr * c * u
                applied[k] = c
                factors[k] = (raw, f)
            self.factors.append(factors)
        self.coeffs.append(applied)
        return self.params



def np_auto_freeze(norm_history, *, b2, min_step, max_step, check_every, threshold, patience, statistic="median"):
    """The automatic freeze point from per-update variance norms (``norm_history[t]``: dict of the raw ``||v||`` after
    update ``t + 1``), by the rule stated in ``jonebit.AutoFreeze`` (on ``||v|| / (1 - b2^(t + 1))``); ``None`` if it
    fires after the history ends."""

    def rel(new, old):
        return abs(new - old) / old if old > 0 else (np.inf if new > 0 else 0.0)

    reference, calm = None, 0
    for t, raw in enumerate(norm_history):
        done = t + 1
        norms = {k: n / (1.0 - b2 ** done) for k, n in raw.items()}
        if done % check_every == 0:
            if reference is not None:
                if statistic == "global":
                    change = rel(np.sqrt(sum(n * n for n in norms.values())),
                                 np.sqrt(sum(n * n for n in reference.values())))
                else:
                    changes = [rel(norms[k], reference[k]) for k in norms]
                    change = max(changes) if statistic == "max" else float(np.median(changes))
                calm = calm + 1 if change < threshold else 0
            reference = dict(norms)
            if calm >= patience and done >= min_step:
                return done
        if done >= max_step:
            return done
    return None
