"""1-bit Adam under ZeRO: which of its buffers can be partitioned without adding full-precision traffic.

1-bit Adam's compression stage needs, on every rank, the *full local* momentum ``b1 m + (1 - b1) g_local`` (each
rank compresses its whole vector), so neither the local gradient nor the worker error can be partitioned. What
can be, and how (``C = N_pad / P`` is the server chunk of the compressed allreduce; rank ``r`` owns chunk ``r``):

* **server error**: already one chunk per rank, at every stage;
* **momentum**: after each compressed allreduce the synchronised momentum *is* the phase-2 result, ``P`` rows of
  packed signs and one float32 scale each. It is stored packed (``m_rows``, ``N_pad / 8 + 4 P`` bytes, replicated:
  1/32 of float32) and decoded when the next step needs it. Its float32 form is kept only as this rank's chunk
  (``mu``, for the warmup stage, where the momentum is still full precision);
* **variance**: frozen after warmup. Rank ``r`` needs ``v`` wherever it updates parameters. With replicated
  parameters (stages 1 and 2) every rank updates every parameter, so the frozen variance is needed whole
  (``nu_full``, all-gathered once at the end of warmup); when the parameters are partitioned (stage 3) they
  follow the server chunks, rank ``r`` updates chunk ``r`` only and keeps only that chunk of ``v``;
* **parameters** (stage 3): stored as the server chunks of the flattened, padded tree (like PyTorch FSDP's flat
  parameters), all-gathered for the forward pass. The update of chunk ``r`` uses exactly the values rank ``r``
  computed as the server of chunk ``r``, so no parameter traffic is added besides ZeRO-3's own gather.

Warmup at stages >= 1 is ZeRO's own: the mean gradient is reduce-scattered into chunks (at stage 1 too, as in
DeepSpeed's stage 1: the full gradient is only a temporary of the step), Adam updates chunk ``r`` of ``m``, ``v``
and the parameters, and (stages 1, 2) the updated chunks are all-gathered: the same bytes as stage 0's allreduce.
At the first compression step the float32 momentum chunks are all-gathered once (and, at stages 1 and 2, the
variance), a one-off cost of a third ``lax.switch`` branch.

Per-device bytes (Ψ parameters, fp32, ``N`` ranks, local gradient counted once):

=====  ======  ======  ==================  ===============  ======  =========
stage  params  grads   momentum            variance         worker  server
=====  ======  ======  ==================  ===============  ======  =========
0      4Ψ      4Ψ      4Ψ                  4Ψ               4Ψ      4Ψ/N
1, 2   4Ψ      4Ψ      4Ψ/N + Ψ/8          4Ψ + 4Ψ/N        4Ψ      4Ψ/N
3      4Ψ/N    4Ψ      4Ψ/N + Ψ/8          4Ψ/N             4Ψ      4Ψ/N
=====  ======  ======  ==================  ===============  ======  =========

With ``mask_unseen`` (the default) stage 3 also keeps one bit per element of where the frozen variance is > 0
(Ψ/8, replicated; stages 1 and 2 read it from their whole variance), gathered once at the first compression step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jonebit.comm.backends import as_varying, get_backend
from jonebit.comm.compressed import (
    _SCALE_BYTES,
    buffer_groups,
    compressed_allreduce_stacks,
    decode_rows,
    padded_size,
)
from jonebit.comm.packing import pack_signs, unpack_rows
from jonebit.sharding.layerwise import is_stacked
from jonebit.transforms.base import (
    ScalarOrSchedule,
    check_bool,
    check_float_leaves,
    check_local_grads,
    check_matching_grads,
    check_nonempty_leaves,
    check_scalar,
    is_number,
    mask_leaves,
    normalise_mask,
    where_seen,
)
from jonebit.transforms.phases import run_phase

ZERO_STAGES = (1, 2, 3)
#: The phases of an update, by the index ``state.phase`` holds.
PHASES = ("warmup", "first_compression", "compression")
WARMUP, FIRST_COMPRESSION, COMPRESSION = range(3)


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """How a param tree maps to flat, padded buffers: one per leaf (``fused=False``) or one in all (``fused=True``).

    Buffer ``g`` holds ``size(g)`` values (the leaves of ``groups[g]`` raveled and concatenated), zero-padded to
    ``padded(g) = padded_size(size(g), world_size)``; its server chunk ``r`` is ``[r C_g, (r + 1) C_g)``.

    A leaf of stacked layers (under :data:`jonebit.sharding.layerwise.STACKED_KEY`, a leading layer axis of
    ``layers[g] = L``) is, with ``fused=False``, a stack of ``L`` such buffers, one per layer: each layer has its own
    compression scales and chunks, as the same model with its layers unstacked would, while the buffers stay one
    ``(L, ...)`` array (one array per stack through the optimizer, and at stage 3 the chunks
    :func:`jonebit.sharding.layerwise.scan_layers` gathers one layer at a time). ``size(g)`` is then one layer's.
    """

    treedef: Any
    shapes: tuple
    dtypes: tuple
    groups: tuple  # tuple of tuples of leaf indices
    world_size: int
    layers: tuple = ()  # per buffer: 0, or the layer count of a stacked leaf's buffers

    @classmethod
    def of(cls, tree, world_size: int, fused: bool) -> FlatLayout:
        with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
        leaves = [x for _, x in with_path]
        groups = (tuple(range(len(leaves))),) if fused else tuple((i,) for i in range(len(leaves)))
        layers = (0,) if fused else tuple(
            int(x.shape[0]) if is_stacked(path) and len(x.shape) > 1 and x.shape[0] > 0 else 0
            for path, x in with_path)
        return cls(treedef=treedef, shapes=tuple(tuple(x.shape) for x in leaves),
                   dtypes=tuple(jnp.dtype(x.dtype) for x in leaves), groups=groups, world_size=int(world_size),
                   layers=layers)

    def stacked(self, g: int) -> bool:
        """Whether buffer ``g`` is a stack of per-layer buffers (arrays with a leading layer axis)."""
        return bool(self.layers and self.layers[g])

    def stacked_leaves(self) -> tuple:
        """The leaves kept as stacks of per-layer buffers, in order."""
        return tuple(idx[0] for g, idx in enumerate(self.groups) if self.stacked(g))

    def size(self, g: int) -> int:
        if self.stacked(g):
            return math.prod(self.shapes[self.groups[g][0]][1:])
        return sum(max(math.prod(self.shapes[i]), 0) for i in self.groups[g])

    def padded(self, g: int) -> int:
        return padded_size(max(self.size(g), 1), self.world_size)

    def chunk(self, g: int) -> int:
        return self.padded(g) // self.world_size

    def lead(self, g: int) -> tuple:
        """The leading shape of buffer ``g``'s arrays: ``(L,)`` for a stack of layers, else ``()``."""
        return (self.layers[g],) if self.stacked(g) else ()

    def flatten(self, tree, dtype=jnp.float32) -> tuple:
        """Tuple of flat buffers, each zero-padded to ``padded(g)`` (``(L, padded(g))`` for a stack of layers)."""
        leaves = jax.tree.leaves(tree)
        out = []
        for g, idx in enumerate(self.groups):
            if self.stacked(g):
                flat = leaves[idx[0]].reshape(self.layers[g], -1).astype(dtype)
            else:
                parts = [jnp.ravel(leaves[i]).astype(dtype) for i in idx]
                flat = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
            pad = [(0, 0)] * (flat.ndim - 1) + [(0, self.padded(g) - flat.shape[-1])]
            out.append(jnp.pad(flat, pad))
        return tuple(out)

    def unflatten(self, bufs, given=None):
        """Tree from flat buffers (padded or not), leaves cast back to their dtypes.

        ``given``: ``{leaf: array}`` for leaves not rebuilt from ``bufs`` (their buffers may then be None).
        """
        given = {} if given is None else given
        leaves = [None] * len(self.shapes)
        for g, idx in enumerate(self.groups):
            if self.stacked(g):
                i = idx[0]
                leaves[i] = given[i] if i in given else \
                    bufs[g][:, :self.size(g)].reshape(self.shapes[i]).astype(self.dtypes[i])
                continue
            offset = 0
            for i in idx:
                n = math.prod(self.shapes[i])
                x = bufs[g][offset:offset + n].reshape(self.shapes[i])
                leaves[i] = x.astype(self.dtypes[i])
                offset += n
        return self.treedef.unflatten(leaves)

    def to_chunks(self, tree) -> tuple:
        """Global view: ``(P, C_g)`` arrays (``(P, L, C_g)`` for a stack of layers), row ``r`` = server chunk ``r``
        (of every layer); shard them with ``P(axis)``."""
        out = []
        for g, b in enumerate(self.flatten(tree, dtype=self._common_dtype())):
            out.append(jnp.swapaxes(b.reshape(self.layers[g], self.world_size, -1), 0, 1) if self.stacked(g)
                       else b.reshape(self.world_size, -1))
        return tuple(out)

    def from_chunks(self, chunks):
        """Inverse of :meth:`to_chunks` (global view, or the all-gathered rows inside shard_map)."""
        return self.unflatten(tuple(
            jnp.swapaxes(c, 0, 1).reshape(self.layers[g], -1) if self.stacked(g) else c.reshape(-1)
            for g, c in enumerate(chunks)))

    def _common_dtype(self):
        return jnp.result_type(*self.dtypes) if self.dtypes else jnp.float32


def check_flat_dtypes(layout: FlatLayout) -> None:
    groups_dtypes = {jnp.dtype(layout.dtypes[i]) for idx in layout.groups for i in idx}
    if len(groups_dtypes) > 1 and any(len(idx) > 1 for idx in layout.groups):
        raise TypeError(
            f"onebit_adam(zero_stage=3, fused=True) stores the params as one flat buffer and needs one dtype for "
            f"all of them, got {sorted(str(d) for d in groups_dtypes)}; use fused=False"
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OneBitAdamZeroState:
    """State of :func:`onebit_adam_zero` (per-device view).

    Per buffer ``g`` of the :class:`FlatLayout` (chunk ``C_g``, padded length ``N_g``; a stack of ``L`` layers'
    buffers has an ``L`` axis after the leading ``1``, or first where there is none: ``(1, L, C_g)``, ``(L, N_g)``):

    Attributes:
      count: updates applied so far.
      mu: ``(1, C_g)`` float32, this rank's chunk of the momentum (global: ``(P, C_g)`` over the data axis).
      nu: ``(1, C_g)`` float32, this rank's chunk of the variance.
      nu_full: stages 1, 2: ``(N_g,)`` float32, the whole frozen variance (zeros during warmup); stage 3: ``()``.
      m_rows: ``(P, C_g / 8 + 4)`` uint8, the synchronised momentum as packed signs and per-chunk scales
        (replicated; valid from the first compression step on).
      seen: stage 3 with ``mask_unseen``: ``(N_g / 8,)`` uint8, one bit per element, set where the frozen
        variance is > 0 (replicated; gathered at the first compression step); else ``()`` (stages 1, 2 read
        ``nu_full``).
      worker_error: ``(1, N_g)`` float32, this rank's worker error.
      server_error: ``(1, C_g)`` float32, this rank's server error.
      phase: the phase the last update ran, an index into :data:`PHASES` (int32).
      next_phase: the phase the next update runs (int32), which jonebit's step builders read to run a program
        compiled for that phase alone (:mod:`jonebit.transforms.phases`).
      stage: the ZeRO stage (static).
    """

    count: jax.Array
    mu: tuple
    nu: tuple
    nu_full: tuple
    m_rows: tuple
    worker_error: tuple
    server_error: tuple
    phase: jax.Array
    seen: tuple = ()
    next_phase: Any = None
    stage: int = dataclasses.field(default=1, metadata=dict(static=True))

    PHASES = PHASES


def zero_state_specs(state: OneBitAdamZeroState, axis_name: str) -> OneBitAdamZeroState:
    rows = lambda t: tuple(P(axis_name) for _ in t)  # noqa: E731
    rep = lambda t: tuple(P() for _ in t)  # noqa: E731
    return OneBitAdamZeroState(
        count=P(), mu=rows(state.mu), nu=rows(state.nu), nu_full=rep(state.nu_full), m_rows=rep(state.m_rows),
        worker_error=rows(state.worker_error), server_error=rows(state.server_error), phase=P(),
        seen=rep(state.seen), next_phase=None if state.next_phase is None else P(), stage=state.stage,
    )


def phase_at(count, freeze_step: int) -> jax.Array:
    """The phase of the update after ``count`` updates, an index into :data:`PHASES` (int32)."""
    return jnp.where(count < freeze_step, WARMUP,
                     jnp.where(count == freeze_step, FIRST_COMPRESSION, COMPRESSION)).astype(jnp.int32)


def init_zero_state(layout: FlatLayout, stage: int, freeze_step: int | None = None,
                    mask_unseen: bool = True) -> OneBitAdamZeroState:
    p = layout.world_size
    n = range(len(layout.groups))
    z = lambda *shape: jnp.zeros(shape, jnp.float32)  # noqa: E731
    lead = layout.lead
    return OneBitAdamZeroState(
        count=jnp.zeros([], jnp.int32),
        mu=tuple(z(1, *lead(g), layout.chunk(g)) for g in n),
        nu=tuple(z(1, *lead(g), layout.chunk(g)) for g in n),
        nu_full=tuple(z(*lead(g), layout.padded(g)) for g in n) if stage in (1, 2) else (),
        m_rows=tuple(jnp.zeros((*lead(g), p, layout.chunk(g) // 8 + _SCALE_BYTES), jnp.uint8) for g in n),
        worker_error=tuple(z(1, *lead(g), layout.padded(g)) for g in n),
        server_error=tuple(z(1, *lead(g), layout.chunk(g)) for g in n),
        phase=jnp.zeros([], jnp.int32),
        seen=tuple(jnp.zeros((*lead(g), layout.padded(g) // 8), jnp.uint8) for g in n)
        if stage == 3 and mask_unseen else (),
        next_phase=None if freeze_step is None else phase_at(jnp.zeros([], jnp.int32), freeze_step),
        stage=stage,
    )


def step_scalars(count, *, b1, b2, freeze_step: int, bias_correction: bool, learning_rate):
    """``(c1, c2, lr)`` of the update that follows ``count`` updates (bias corrections are 1 unless asked for; the
    variance's stays at its freeze_step value once the variance is frozen)."""
    step = count + 1
    if bias_correction:
        c1 = 1.0 - b1 ** step.astype(jnp.float32)
        c2 = 1.0 - b2 ** jnp.minimum(step, freeze_step).astype(jnp.float32)
    else:
        c1 = c2 = jnp.float32(1.0)
    lr = learning_rate(count) if callable(learning_rate) else learning_rate
    return c1, c2, lr


def zero_update(
    *, backend, layout: FlatLayout, stage: int, freeze_step: int, b1, b2, eps, weight_decay, decays: bool,
    mask_bufs, bias_correction: bool, learning_rate, grads, state: OneBitAdamZeroState, params,
    mask_unseen: bool = True,
):
    """One 1-bit Adam update with ZeRO partitioning (per-device view, inside shard_map over the data axis).

    ``grads``: this rank's local gradient tree. ``params``: the full tree (stages 1, 2) or this rank's ``(1, C_g)``
    chunks (stage 3). Returns ``(updates, new_state)``, updates shaped like ``params``.

    Every buffer's arithmetic runs on its last axis, so a stack of layers' buffers (a leading ``L`` axis) is the
    same computation per layer; only its compression and decoding are batched explicitly (:func:`_decode`).

    ``mask_unseen`` (as :func:`jonebit.onebit_adam`'s): in the compression phases an element whose frozen variance is
    exactly 0 (no gradient reached it during warmup) keeps a zero momentum, on the worker side (the decoded
    momentum it compensates) and in the update (which then is weight decay alone).
    """
    axis = backend.axis_name
    p = backend.size
    r = lax.axis_index(axis)
    ngroups = len(layout.groups)
    g_flat = layout.flatten(grads)  # padded, float32, local
    if stage == 3:
        p_chunk = tuple(c[0].astype(jnp.float32) for c in params)
    else:
        p_flat = layout.flatten(params)
        p_chunk = tuple(lax.dynamic_slice_in_dim(p_flat[g], r * layout.chunk(g), layout.chunk(g), axis=-1)
                        for g in range(ngroups))
    valid = tuple((r * layout.chunk(g) + jnp.arange(layout.chunk(g))) < layout.size(g) for g in range(ngroups))

    count = state.count
    c1, c2, lr = step_scalars(count, b1=b1, b2=b2, freeze_step=freeze_step, bias_correction=bias_correction,
                              learning_rate=learning_rate)

    def direction(m, v, w):
        u = (m / c1) / (jnp.sqrt(v / c2) + eps)
        if decays:
            u = u + weight_decay * w
        return -lr * u

    def chunk_of(x, g):
        return lax.dynamic_slice_in_dim(x, r * layout.chunk(g), layout.chunk(g), axis=-1)

    def masked(x, g, chunk=False):
        """``x`` times the mask of buffer ``g`` (whole, cut to ``x``'s length, or this rank's chunk)."""
        if mask_bufs is None or mask_bufs[g] is None:
            return x
        k = mask_bufs[g]()
        return x * (chunk_of(k, g) if chunk else k[..., :x.shape[-1]])

    def decode(rows, g, n=None):
        """:func:`decode_rows` of buffer ``g``'s rows, per layer for a stack of layers."""
        if layout.stacked(g):
            return jax.vmap(lambda x: decode_rows(x, n))(rows)
        return decode_rows(rows, n)

    def finish(u_chunks, u_full):
        """Updates shaped like params: chunks (stage 3) or a tree (stages 1, 2)."""
        if stage == 3:
            return tuple(jnp.where(valid[g], u_chunks[g], 0.0)[None] for g in range(ngroups))
        return layout.unflatten(u_full)

    def varying(t):
        return jax.tree.map(lambda e: as_varying(e, axis), t)

    mu, nu = varying(state.mu), varying(state.nu)
    we, se = varying(state.worker_error), varying(state.server_error)
    nu_full, m_rows, seen = state.nu_full, state.m_rows, state.seen

    def seen_bits(g):
        """Buffer ``g``'s packed bits of ``v > 0``, gathered from every rank's variance chunk (stage 3)."""
        v = nu[g][0]
        bits = pack_signs(jnp.where(v > 0, 1.0, -1.0).reshape(-1)).reshape(*v.shape[:-1], -1)
        return lax.all_gather(bits, axis, axis=bits.ndim - 1, tiled=True, to="invarying")

    def keep_seen(m, g, n):
        """``m``, buffer ``g``'s first ``n`` elements, where their frozen variance is > 0, else 0 (after the first
        compression; stage 3 reads the signs of its packed bits, +1 where seen)."""
        if stage != 3:
            return where_seen(m, nu_full[g][..., :n])
        signs = unpack_rows(seen[g])
        return where_seen(m, signs.reshape(*signs.shape[:-2], -1)[..., :n])

    def warmup(_):
        new_mu, new_nu, u_chunks = [], [], []
        for g in range(ngroups):
            # Every stage reduce-scatters: stage 1 keeps no gradient partition between steps, but within the step
            # each rank needs only its chunk of the mean, and with the all-gather below this moves stage 0's bytes
            # (an all-reduce then a slice would move 1.5 times as many).
            gc = lax.psum_scatter(g_flat[g], axis, scatter_dimension=g_flat[g].ndim - 1, tiled=True) / p
            m = b1 * mu[g][0] + (1.0 - b1) * gc
            v = b2 * nu[g][0] + (1.0 - b2) * gc * gc
            new_mu.append(m[None])
            new_nu.append(v[None])
            u_chunks.append(direction(m, v, p_chunk[g]))
        u_full = None
        if stage != 3:  # replicated params: everyone needs every updated chunk (ZeRO-1/2's all-gather)
            u_full = tuple(lax.all_gather(jnp.where(valid[g], u_chunks[g], 0.0), axis, axis=u_chunks[g].ndim - 1,
                                          tiled=True, to="invarying") for g in range(ngroups))
        return finish(u_chunks, u_full), (tuple(new_mu), tuple(new_nu), nu_full, m_rows, we, se, seen)

    def compression(first: bool):
        def branch(_):
            xs = []
            for g in range(ngroups):
                n = layout.size(g)
                if first:  # the momentum is still float32 chunks: gather it once (no gradient: exactly 0)
                    m_prev = lax.all_gather(mu[g][0], axis, axis=mu[g].ndim - 2, tiled=True)[..., :n]
                else:
                    m_prev = masked(decode(m_rows[g], g, n), g)
                    if mask_unseen:
                        m_prev = keep_seen(m_prev, g, n)
                xs.append(b1 * m_prev + (1.0 - b1) * g_flat[g][..., :n])
            # One compressed allreduce per buffer (per layer of a stack), all sharing one all-to-all and one
            # all-gather.
            new_rows, new_we, new_se = _compressed_allreduce(backend, layout, xs, we, se)
            new_mu, new_nfull, u_chunks, u_full = [], [], [], []
            for g, rows in enumerate(new_rows):
                m_own = masked(decode(lax.dynamic_index_in_dim(rows, r, axis=rows.ndim - 2, keepdims=False), g),
                               g, chunk=True)
                if mask_unseen:
                    m_own = where_seen(m_own, nu[g][0])
                new_mu.append(m_own[None])
                if stage == 3:
                    u_chunks.append(direction(m_own, nu[g][0], p_chunk[g]))
                else:
                    v_full = lax.all_gather(nu[g][0], axis, axis=nu[g].ndim - 2, tiled=True, to="invarying") \
                        if first else nu_full[g]
                    new_nfull.append(v_full)
                    m_full = masked(decode(rows, g), g)
                    if mask_unseen:
                        m_full = where_seen(m_full, v_full)
                    u_full.append(direction(m_full, v_full, p_flat[g]))
            nf = tuple(new_nfull) if stage != 3 else nu_full
            new_seen = tuple(seen_bits(g) for g in range(ngroups)) if first and seen else seen
            return finish(u_chunks, tuple(u_full)), (tuple(new_mu), nu, nf, tuple(new_rows), tuple(new_we),
                                                     tuple(new_se), new_seen)

        return branch

    (updates, (mu, nu, nu_full, m_rows, we, se, seen)), phase = run_phase(
        OneBitAdamZeroState, phase_at(count, freeze_step), (warmup, compression(True), compression(False)))
    if stage == 3:
        updates = tuple(u.astype(c.dtype) for u, c in zip(updates, params, strict=True))
    new_count = optax.safe_int32_increment(count)
    new_state = OneBitAdamZeroState(
        count=new_count, mu=mu, nu=nu, nu_full=nu_full, m_rows=m_rows, worker_error=we, server_error=se,
        phase=phase.astype(jnp.int32), seen=seen,
        next_phase=None if state.next_phase is None else phase_at(new_count, freeze_step), stage=stage,
    )
    return updates, new_state


def _compressed_allreduce(backend, layout: FlatLayout, xs, worker_errors, server_errors):
    """The compressed allreduce of every buffer: ``(rows, worker errors, server errors)``, per buffer as the state
    holds them (``(P, w)``, ``(1, N)``, ``(1, C)``; a stack of layers with its ``L`` axis: ``(L, P, w)``,
    ``(1, L, N)``, ``(1, L, C)``). Single buffers of equal length are compressed as one batch
    (:func:`jonebit.comm.compressed.compressed_allreduce_rows_many`); a stack of layers is its own batch, as it is."""
    singles = [g for g in range(len(xs)) if not layout.stacked(g)]
    stacks = [g for g in range(len(xs)) if layout.stacked(g)]
    groups = [[singles[j] for j in idx] for idx in buffer_groups([layout.size(g) for g in singles])] + \
        [[g] for g in stacks]
    x_stacks = [xs[idx[0]] if len(idx) == 1 else jnp.stack(
        [xs[g].astype(jnp.float32) for g in idx]) for idx in groups]

    def stack(errors, idx):  # a group's error buffers as one (k, ...) array (a stack of layers already is one)
        return errors[idx[0]][0] if layout.stacked(idx[0]) else jnp.stack([errors[g][0] for g in idx])

    out = compressed_allreduce_stacks(backend, x_stacks, [stack(worker_errors, idx) for idx in groups],
                                      [stack(server_errors, idx) for idx in groups])
    rows, worker, server = [None] * len(xs), [None] * len(xs), [None] * len(xs)
    for idx, (r, w, s) in zip(groups, out, strict=True):
        if layout.stacked(idx[0]):
            rows[idx[0]], worker[idx[0]], server[idx[0]] = r, w[None], s[None]
            continue
        for j, g in enumerate(idx):
            rows[g], worker[g], server[g] = r[j], w[j][None], s[j][None]
    return rows, worker, server


def flat_mask(mask_leaves, layout: FlatLayout):
    """The momentum mask of each flat buffer, or None when nothing is masked.

    Args:
      mask_leaves: one entry per param leaf: None (all ones) or a float32 numpy array of the leaf's rank whose
        dimensions are the leaf's or 1 (e.g. a ``(rows, 1)`` row mask); or None for no mask at all.
      layout: the flat layout of the params.

    Returns:
      None, or a tuple with, per buffer, None (nothing masked) or a function that builds the padded flat mask
      inside the traced step. The function broadcasts the small per-leaf masks there, so the step captures only
      them, not a float32 constant as large as the params.
    """
    if mask_leaves is None:
        return None

    def builder(g, idx, padded):
        def build():
            if layout.stacked(g):  # (L, padded): every layer's own mask
                i = idx[0]
                flat = jnp.broadcast_to(jnp.asarray(mask_leaves[i]), layout.shapes[i]).reshape(layout.layers[g], -1)
                return jnp.pad(flat, ((0, 0), (0, padded - flat.shape[-1])))
            parts = [jnp.ones(math.prod(layout.shapes[i]), jnp.float32) if mask_leaves[i] is None
                     else jnp.broadcast_to(jnp.asarray(mask_leaves[i]), layout.shapes[i]).ravel() for i in idx]
            flat = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
            return jnp.pad(flat, (0, padded - flat.shape[0]))

        return build

    out = tuple(None if all(mask_leaves[i] is None for i in idx) else builder(g, idx, layout.padded(g))
                for g, idx in enumerate(layout.groups))
    return None if all(b is None for b in out) else out


WHO = "onebit_adam_zero"


def onebit_adam_zero(
    learning_rate: ScalarOrSchedule,
    *,
    freeze_step: int,
    stage: int,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    exp_avg_mask: Any = None,
    bias_correction: bool = True,
    fused: bool = False,
    mask_unseen: bool = True,
    axis_name: str = "data",
) -> optax.GradientTransformation:
    """1-bit Adam with its state partitioned over the ranks of ``axis_name`` (ZeRO ``stage`` 1, 2 or 3).

    The same algorithm as :func:`jonebit.onebit_adam` (see the module docstring for which buffers each stage
    partitions and what it costs), over a single ``jax.shard_map`` axis. Build the step with
    :func:`jonebit.train.zero.make_zero_step` (or the engine's ``zero_optimization.stage``); clip the local gradient
    in front if needed: ``optax.chain(optax.clip_by_global_norm(norm), onebit_adam_zero(...))``.

    Args:
      learning_rate: a float or an optax schedule of the update count (0-based).
      freeze_step: number of full-precision Adam updates before compression starts (>= 1).
      stage: 1 or 2 (momentum and variance partitioned during warmup, the synchronised momentum kept as packed
        signs, the frozen variance whole) or 3 (also the parameters, as the server chunks of the flattened tree:
        ``update`` then takes and returns this rank's chunks).
      b1: momentum decay.
      b2: variance decay.
      eps: added to ``sqrt(v)``.
      weight_decay: decoupled weight decay; needs ``params`` in ``update``.
      exp_avg_mask: as :func:`jonebit.onebit_adam`'s.
      bias_correction: Adam's bias correction (the variance's frozen with it); ``False`` is DeepSpeed's.
      fused: one flat buffer for all leaves (``True``) or one per leaf (``False``).
      mask_unseen: as :func:`jonebit.onebit_adam`'s: in the compression phases elements whose frozen variance is
        exactly 0 (no gradient reached them during warmup, e.g. embedding rows of tokens not yet seen) keep a zero
        momentum and get no update but weight decay (default). ``False`` is DeepSpeed's arithmetic, which divides
        their share of the 1-bit average by ``eps``. At stage 3 it keeps one bit per element (``N / 8`` bytes,
        replicated), gathered once at the first compression step.
      axis_name: the data-parallel mesh axis (at least 2 ranks).
    """
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
        raise ValueError(f"{WHO}: freeze_step must be an int >= 1, got {freeze_step!r}")
    if isinstance(stage, bool) or not isinstance(stage, int):
        raise TypeError(f"{WHO}: stage must be a Python int (it decides the state layout), got "
                        f"{type(stage).__name__}; under optax.inject_hyperparams list it in static_args")
    if stage not in ZERO_STAGES:
        raise ValueError(f"{WHO}: stage must be 1, 2 or 3, got {stage!r} (stage 0 is jonebit.onebit_adam)")
    check_scalar(WHO, "learning_rate", learning_rate, low=0.0, schedule=True)
    check_scalar(WHO, "b1", b1, low=0.0, high=1.0, open_high=True)
    check_scalar(WHO, "b2", b2, low=0.0, high=1.0, open_high=True)
    check_scalar(WHO, "eps", eps, low=0.0, open_low=True)
    check_scalar(WHO, "weight_decay", weight_decay, low=0.0)
    check_bool(WHO, "bias_correction", bias_correction)
    check_bool(WHO, "fused", fused)
    check_bool(WHO, "mask_unseen", mask_unseen)
    if not isinstance(axis_name, str):
        raise TypeError(f"{WHO}: axis_name must be the data axis of a shard_map mesh (str), got {axis_name!r}")
    exp_avg_mask = normalise_mask(exp_avg_mask, WHO)
    decays = not (is_number(weight_decay) and weight_decay == 0)

    def backend_of():
        backend = get_backend(axis_name)
        if backend.size < 2:
            raise ValueError(
                f"{WHO}: stage={stage} partitions over the ranks of axis {axis_name!r}, which has "
                f"{backend.size}; use jonebit.onebit_adam on a single device"
            )
        return backend

    def init_fn(params):
        check_float_leaves(params, "param", WHO)
        check_nonempty_leaves(params, WHO)
        mask_leaves(exp_avg_mask, params, WHO)
        layout = FlatLayout.of(params, backend_of().size, fused)
        if stage == 3:
            check_flat_dtypes(layout)
        return init_zero_state(layout, stage, freeze_step, mask_unseen)

    def update_fn(grads, state, params=None):
        if params is None:
            raise ValueError(f"{WHO}(stage={stage}) needs params: call update(grads, state, params)")
        check_float_leaves(grads, "gradient", WHO)
        backend = backend_of()
        check_local_grads(grads, backend, WHO)
        layout = FlatLayout.of(grads if stage == 3 else params, backend.size, fused)
        if stage != 3:
            check_matching_grads(grads, params, "params", WHO)
        # The state's chunks follow the layout of the tree given to init: a different gradient tree shows here.
        want = tuple((1, *layout.lead(g), layout.chunk(g)) for g in range(len(layout.groups)))
        have = tuple(tuple(m.shape) for m in state.mu)
        if want != have:
            raise ValueError(
                f"{WHO}: the gradients do not match the params the optimizer state was made for: their flat "
                f"buffers have chunks {want}, the state {have} (same tree, shapes and fused={fused} as in init)"
            )
        mask = mask_leaves(exp_avg_mask, grads, WHO)
        return zero_update(
            backend=backend, layout=layout, stage=stage, freeze_step=freeze_step, b1=b1, b2=b2, eps=eps,
            weight_decay=weight_decay, decays=decays, mask_bufs=flat_mask(mask, layout),
            bias_correction=bias_correction, learning_rate=learning_rate, grads=grads, state=state, params=params,
            mask_unseen=mask_unseen,
        )

    return optax.GradientTransformation(init_fn, update_fn)
