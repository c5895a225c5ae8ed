"""Numpy model of the hierarchical (hosts x local) compressed allreduce and of 1-bit Adam built on it.

Independent of jonebit: H hosts of L devices are simulated as nested lists, the inter-host step is the flat
reference :func:`tests.reference.np_compressed_allreduce` (same sign, scales, padding, worker and server errors).
"""

from __future__ import annotations

import math

import numpy as np

from tests.reference import NumpyOneBitAdam, np_compressed_allreduce, np_padded


def np_hier_error_sizes(n: int, hosts: int, local: int) -> tuple[int, int]:
    s = math.ceil(n / local)
    return np_padded(s, hosts), np_padded(s, hosts) // hosts


def np_hierarchical_allreduce(xs, wes, ses):
    """Two-level allreduce. ``xs[h][l]``: device (h, l)'s buffer (N,); ``wes``/``ses`` the same nesting.

    1. host h, device l: x = mean over the host's L devices of their shard l (S = ceil(N / L) values, zero-padded);
    2. for every l, the H devices (h, l) run the flat compressed allreduce of their shards with their own errors;
    3. every device concatenates the L shard results (truncated to S) and the first N values are the output.
    Returns (out, new_wes, new_ses) with out identical for all devices.
    """
    hosts, local = len(xs), len(xs[0])
    n = xs[0][0].shape[0]
    s = math.ceil(n / local)
    shards = []  # shards[h][l]
    for h in range(hosts):
        padded = [np.concatenate([x, np.zeros(local * s - n, np.float32)]).astype(np.float32) for x in xs[h]]
        total = [np.zeros(s, np.float32) for _ in range(local)]
        for j in range(local):  # summed device by device, then divided (a mean over the host)
            for l_ in range(local):
                total[l_] = total[l_] + padded[j][l_ * s:(l_ + 1) * s]
        shards.append([t / np.float32(local) for t in total])
    new_wes = [[None] * local for _ in range(hosts)]
    new_ses = [[None] * local for _ in range(hosts)]
    pieces = []
    for l_ in range(local):
        out, we, se = np_compressed_allreduce([shards[h][l_] for h in range(hosts)],
                                              [wes[h][l_] for h in range(hosts)], [ses[h][l_] for h in range(hosts)])
        for h in range(hosts):
            new_wes[h][l_], new_ses[h][l_] = we[h], se[h]
        pieces.append(out)
    return np.concatenate(pieces)[:n], new_wes, new_ses


class NumpyHierarchicalOneBitAdam(NumpyOneBitAdam):
    """1-bit Adam of the spec on H x L simulated devices with the hierarchical compressed allreduce.

    ``step`` takes the local gradients as a flat list over devices in mesh order (device (h, l) at h * L + l).
    Bias correction as jonebit's default (``1 - b1^t``; the variance's stops at freeze_step) when asked.
    """

    def __init__(self, params, hosts, local, *, freeze_step, lr, bias_correction=False, **kwargs):
        super().__init__(params, hosts * local, freeze_step=freeze_step, lr=lr, **kwargs)
        self.hosts, self.local, self.bias_correction = hosts, local, bias_correction
        groups = [None] if self.fused else self.keys
        size = lambda g: sum(self.params[k].size for k in self.keys) if g is None else self.params[g].size  # noqa: E731
        self.we, self.se = {}, {}
        for g in groups:
            w, sv = np_hier_error_sizes(size(g), hosts, local)
            self.we[g] = [[np.zeros(w, np.float32) for _ in range(local)] for _ in range(hosts)]
            self.se[g] = [[np.zeros(sv, np.float32) for _ in range(local)] for _ in range(hosts)]

    def _allreduce(self, group, vectors):
        nested = [vectors[h * self.local:(h + 1) * self.local] for h in range(self.hosts)]
        out, self.we[group], self.se[group] = np_hierarchical_allreduce(nested, self.we[group], self.se[group])
        return out

    def step(self, local_grads):
        b1, b2 = self.b1, self.b2
        t = self.count + 1
        if self.count < self.freeze:
            g = {k: np.mean([lg[k] for lg in local_grads], axis=0, dtype=np.float32) for k in self.keys}
            for k in self.keys:
                self.m[k] = b1 * self.m[k] + (1 - b1) * g[k]
                self.v[k] = b2 * self.v[k] + (1 - b2) * g[k] * g[k]
        else:
            local_m = [{k: b1 * self.m[k] + (1 - b1) * lg[k] for k in self.keys} for lg in local_grads]
            if self.fused:
                out = self._allreduce(None, [np.concatenate([lm[k].ravel() for k in self.keys]) for lm in local_m])
                offs = np.cumsum([0] + [self.m[k].size for k in self.keys])
                for i, k in enumerate(self.keys):
                    self.m[k] = out[offs[i]:offs[i + 1]].reshape(self.m[k].shape)
            else:
                for k in self.keys:
                    self.m[k] = self._allreduce(k, [lm[k].ravel() for lm in local_m]).reshape(self.m[k].shape)
        c1 = 1.0 - b1 ** t if self.bias_correction else 1.0
        c2 = 1.0 - b2 ** min(t, self.freeze) if self.bias_correction else 1.0
        for k in self.keys:
            u = (self.m[k] / c1) / (np.sqrt(self.v[k] / c2) + self.eps) + self.wd * self.params[k]
            self.params[k] = (self.params[k] - self.lr * u).astype(np.float32)
        self.count += 1
        return self.params
