"""Error-compensated 1-bit compressed allreduce (DeepSpeed's algorithm, backend-agnostic).

Every rank holds a vector ``b`` of ``N`` floats and two persistent error buffers. One call:

1. worker side: ``x = pad(b) + e_w``, one scale ``s_w = ||x|| / sqrt(N_pad)``, ``e_w <- x - s_w sgn(x)``;
   the signs are packed 8 per byte and split into ``P`` chunks of ``C = N_pad / P`` signs; chunk ``j``
   goes to rank ``j`` (all-to-all), the scales to everyone (all-gather);
2. server side (rank ``r`` owns chunk ``r``): ``z = sum_j (s_w[j] / P) unpack(chunk_j)``, ``y = z + e_s``,
   ``s_s = ||y|| / sqrt(C)``, ``e_s <- y - s_s sgn(y)``;
3. the packed server signs and scales are all-gathered; chunk ``j`` of the output is
   ``s_s[j] unpack(server_chunk_j)``, identical on every rank.

Only ``uint8`` crosses the wire: the float32 scales travel as 4 bytes appended to each packed row, which
keeps one collective per phase. Bytes sent per rank and call: ``2 (P-1)/P N_pad/8 + 8 (P-1)``.

Reference: Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence
Speed", ICML 2021 (arXiv:2102.02888); DeepSpeed ``runtime/comm/nccl.py``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jonebit.comm.backends import Backend, get_backend
from jonebit.comm.packing import _WEIGHTS as _BIT_WEIGHTS
from jonebit.comm.packing import pack_signs, select_signs, sign_bits, unpack_rows

_SCALE_BYTES = 4  # one float32 scale, bit-cast to uint8


def _count(value, name: str) -> int:
    """``value`` as an int; ``int()`` would truncate a float (10.7 -> 10) into a wrong size without a word."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"padded_size: {name} must be an int (a number of elements or ranks), got "
                        f"{value!r} ({type(value).__name__})")
    return int(value)


def padded_size(n: int, world_size: int) -> int:
    """Length ``n`` rounded up to a multiple of ``P * lcm(P, 8)``.

    That makes every rank's chunk ``C = N_pad / P`` a multiple of 8 (whole bytes) and equal across ranks.
    """
    n, world_size = _count(n, "n"), _count(world_size, "world_size")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    unit = world_size * math.lcm(world_size, 8)
    return -(-n // unit) * unit


def compressed_bytes_per_rank(n: int, world_size: int) -> int:
    """Bytes one rank sends in one :func:`compressed_allreduce` of ``n`` floats (spec formula)."""
    p = world_size
    return (2 * (p - 1) * padded_size(n, p) // 8) // p + 8 * (p - 1)


def row_padded_size(n: int, world_size: int, row: int) -> int:
    """Padded length of ``n = rows * row`` floats compressed with one scale per row of ``row`` floats.

    The rows are rounded up to a multiple of ``P * 8 / gcd(row, 8)``, so every rank's chunk holds whole rows and
    whole bytes.
    """
    n, world_size, row = int(n), int(world_size), int(row)
    if row < 1 or n % row:
        raise ValueError(f"a buffer of {n} floats cannot be split into rows of {row}")
    unit = world_size * (8 // math.gcd(row, 8))
    return -(-(n // row) // unit) * unit * row


def buffer_padded_size(n: int, world_size: int, row: int | None = None) -> int:
    """:func:`padded_size` (``row=None``: one scale per buffer and chunk) or :func:`row_padded_size`."""
    return padded_size(n, world_size) if row is None else row_padded_size(n, world_size, row)


def row_compressed_bytes_per_rank(n: int, world_size: int, row: int) -> int:
    """Bytes one rank sends in one compressed allreduce of ``n`` floats with one scale per row of ``row``."""
    p = world_size
    n_pad = row_padded_size(n, p, row)
    per_rank = n_pad // p // 8 + _SCALE_BYTES * (n_pad // row // p)
    return 2 * (p - 1) * per_rank


def _rms_scale(x: jax.Array) -> jax.Array:
    # ||x||_2 / sqrt(len): the scale that makes scale * sgn(x) have the same norm as x.
    return jnp.linalg.norm(x) / np.float32(math.sqrt(x.shape[0]))


def _compress(x: jax.Array):
    """(scale, packed signs, new error) of one vector."""
    scale = _rms_scale(x)
    signs = jnp.where(sign_bits(x), jnp.float32(1.0), jnp.float32(-1.0))
    return scale, pack_signs(x), x - scale * signs


def _row_scales(x: jax.Array, row: int) -> jax.Array:
    """One rms scale per row of ``row`` consecutive elements of the 1-D ``x``."""
    rows = x.reshape(-1, row)
    return jnp.sqrt(jnp.sum(rows * rows, axis=1)) / np.float32(math.sqrt(row))


def _compress_rows(x: jax.Array, row: int):
    """:func:`_compress` with one scale per row: (scales, packed signs, new error)."""
    scales = _row_scales(x, row)
    signs = jnp.where(sign_bits(x), jnp.float32(1.0), jnp.float32(-1.0))
    err = (x.reshape(-1, row) - scales[:, None] * signs.reshape(-1, row)).reshape(-1)
    return scales, pack_signs(x), err


def _with_row_scales(packed: jax.Array, scales: jax.Array) -> jax.Array:
    """Appends ``(..., k)`` float32 scales to ``(..., b)`` uint8 rows as ``4 k`` raw bytes."""
    raw = lax.bitcast_convert_type(scales.astype(jnp.float32), jnp.uint8)  # (..., k, 4)
    return jnp.concatenate([packed, raw.reshape(*scales.shape[:-1], -1)], axis=-1)


def _split_row_scales(rows: jax.Array, count: int):
    """Inverse of :func:`_with_row_scales`: ``(..., b)`` bytes and ``(..., count)`` scales."""
    raw = rows[..., rows.shape[-1] - _SCALE_BYTES * count:]
    scales = lax.bitcast_convert_type(raw.reshape(*raw.shape[:-1], count, _SCALE_BYTES), jnp.float32)
    return rows[..., :rows.shape[-1] - _SCALE_BYTES * count], scales


def _with_scale(packed: jax.Array, scale: jax.Array) -> jax.Array:
    """Appends the float32 scale to the last axis of a uint8 array as 4 raw bytes."""
    raw = lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint8)  # (4,)
    raw = jnp.broadcast_to(raw, packed.shape[:-1] + (_SCALE_BYTES,))
    return jnp.concatenate([packed, raw], axis=-1)


def _split_scale(rows: jax.Array):
    """Inverse of :func:`_with_scale` for a ``(..., P, k + 4)`` array: ``(..., P, k)`` bytes and ``(..., P)`` scales."""
    scales = lax.bitcast_convert_type(rows[..., -_SCALE_BYTES:], jnp.float32)
    return rows[..., :-_SCALE_BYTES], scales


def _signed(scales: jax.Array):
    """``(scales * 1, scales * -1)``: the two values ``scales * sgn`` takes, computed exactly like that product."""
    return scales * np.float32(1.0), scales * np.float32(-1.0)


def _sum_rows(row, p: int):
    """``row(0) + row(1) + ... + row(p-1)``, added in that order."""
    if p <= 64:
        total = row(0)
        for j in range(1, p):
            total = total + row(j)
        return total
    return lax.fori_loop(1, p, lambda j, acc: acc + row(j), row(0))


def _check_buffers(x, worker_error, server_error, p: int, row: int | None = None):
    x = jnp.asarray(x)
    if x.ndim != 1:
        raise ValueError(f"compressed_allreduce expects a 1-D buffer, got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"compressed_allreduce expects a float buffer, got {x.dtype}")
    n = x.shape[0]
    if n == 0:
        raise ValueError("compressed_allreduce got an empty buffer")
    n_pad = buffer_padded_size(n, p, row)
    chunk = n_pad // p
    size = f"padded_size({n}, {p})" if row is None else f"row_padded_size({n}, {p}, {row})"
    if tuple(worker_error.shape) != (n_pad,):
        raise ValueError(f"worker_error must have shape ({n_pad},) = {size}, got {tuple(worker_error.shape)}")
    if tuple(server_error.shape) != (chunk,):
        raise ValueError(f"server_error must have shape ({chunk},) = {size} // {p}, got {tuple(server_error.shape)}")
    return x, n, n_pad, chunk


def _worker_rows(x, n: int, worker_error, p: int, row: int | None = None):
    """Worker side: ``(rows, new_worker_error)``; row ``j`` of the ``(P, C/8 + 4)`` rows goes to rank ``j``.

    With ``row``: one scale per ``row`` floats, rows ``(P, C/8 + 4 C/row)`` (each rank gets its chunk's scales).
    """
    buf = jnp.pad(x.astype(jnp.float32), (0, worker_error.shape[0] - n)) + worker_error
    if row is not None:
        s_w, packed, new_worker_error = _compress_rows(buf, row)
        return _with_row_scales(packed.reshape(p, -1), s_w.reshape(p, -1)), new_worker_error
    s_w, packed, new_worker_error = _compress(buf)
    return _with_scale(packed.reshape(p, -1), s_w), new_worker_error


def _server_row(received, server_error, p: int, row: int | None = None):
    """Server side of the ``(P, C/8 + 4)`` rows received from the workers: ``(row, new_server_error)``."""
    if row is not None:  # one scale per row of `row` floats, for the workers' and this rank's signs alike
        count = server_error.shape[0] // row
        bits_from, s_w_all = _split_row_scales(received, count)  # (P, C/8), (P, C/row)
        signs = unpack_rows(bits_from).reshape(p, count, row)
        w = s_w_all / np.float32(p)
        z = _sum_rows(lambda j: signs[j] * w[j][:, None], p).reshape(-1)
        s_s, server_packed, new_server_error = _compress_rows(z + server_error, row)
        return _with_row_scales(server_packed, s_s), new_server_error
    bits_from, s_w_all = _split_scale(received)
    # This rank's chunk, averaged over workers, summed in rank order. Row by row (not a reduction over the
    # rank axis, which XLA's CPU backend runs an order of magnitude slower). Kept as unpacked signs times the
    # weights: XLA:CPU recomputes this sum inside the fused norm of y when the chunk is small, and the
    # rounding of that fused reduction depends on how the sum is written (a select of +-w, bitwise equal
    # element by element, changed the norm's last bit there).
    signs = unpack_rows(bits_from)  # (P, C/8, 8), exact +-1
    w = s_w_all / np.float32(p)
    z = _sum_rows(lambda j: signs[j] * w[j], p).reshape(-1)
    y = z + server_error
    s_s, server_packed, new_server_error = _compress(y)
    return _with_scale(server_packed, s_s), new_server_error


def compressed_allreduce_rows(backend: Backend, x, worker_error, server_error):
    """The compressed allreduce up to (and including) its last collective, without decoding the result.

    Returns ``(rows, new_worker_error, new_server_error)``: ``rows`` is the ``(P, C/8 + 4)`` uint8 array every
    rank receives in phase 2 (row ``j``: rank ``j``'s packed server signs and its float32 scale as 4 raw bytes),
    identical on all ranks. :func:`decode_rows` turns it into the averaged vector. The synchronised result is
    exactly these bits and scales, so it can be kept packed (1/32 of its float32 size) and decoded when needed.
    """
    (rows,), (new_worker_error,), (new_server_error,) = compressed_allreduce_rows_many(
        backend, [x], [worker_error], [server_error])
    return rows, new_worker_error, new_server_error


# Buffers of the same length are compressed together (one stacked computation per length, see
# :func:`compressed_allreduce_groups`). Private switch: False emits every buffer's computation on its own (the
# implementation before grouping, kept for benchmarks/perleaf_compile.py and the tests that compare the two).
_GROUP_BUFFERS = True


def buffer_groups(lengths, rows=None) -> list[list[int]]:
    """Indices of the buffers grouped by length (and row length, where given), groups in order of first
    appearance, indices ascending."""
    if not _GROUP_BUFFERS:
        return [[i] for i in range(len(lengths))]
    rows = [None] * len(lengths) if rows is None else rows
    groups: dict[tuple, list[int]] = {}
    for i, (n, r) in enumerate(zip(lengths, rows, strict=True)):
        groups.setdefault((int(n), r), []).append(i)
    return list(groups.values())


def compressed_allreduce_rows_many(backend: Backend, xs, worker_errors, server_errors):
    """:func:`compressed_allreduce_rows` of several independent buffers, sharing its two collectives.

    Buffer ``k`` gets exactly what its own call would give (its own scales, errors and chunking); only the
    transport is shared: the rows of all buffers travel side by side in one all-to-all and one all-gather,
    the same bytes as separate calls in two collectives instead of two per buffer. Returns three lists.
    """
    groups = compressed_allreduce_groups(backend, xs, worker_errors, server_errors)
    return tuple(ungroup(groups, field, len(xs)) for field in (1, 2, 3))


def compressed_allreduce_groups(backend: Backend, xs, worker_errors, server_errors, rows=None):
    """:func:`compressed_allreduce_rows_many`, its results per group of equal-length buffers.

    Returns a list of ``(indices, rows, worker_errors, server_errors)``, one per group of :func:`buffer_groups`:
    the buffers ``indices`` (``k`` of them) stacked on a leading axis, ``rows`` ``(k, P, C/8 + 4)``. A group is
    one batched computation (``jax.vmap`` of the single-buffer one: the same operations, each reduction over one
    buffer's own elements), so the number of operations the program holds grows with the number of distinct
    lengths, not of buffers; a group of one is the single-buffer computation itself.

    ``rows``: per buffer ``None`` (one scale per buffer and chunk) or a row length that divides it (one scale per
    row; the error buffers then have :func:`row_padded_size`). Decode with :func:`decode_groups` and the same rows.
    """
    p = backend.size
    rows = [None] * len(xs) if rows is None else list(rows)
    for x, we, se, r in zip(xs, worker_errors, server_errors, rows, strict=True):
        _check_buffers(x, we, se, p, r)
    groups = buffer_groups([jnp.shape(x)[0] for x in xs], rows)
    worker = [jnp.stack([worker_errors[i] for i in idx]) for idx in groups]
    server = [jnp.stack([server_errors[i] for i in idx]) for idx in groups]
    return compressed_allreduce_stacked(backend, xs, groups, worker, server, rows)


def stacked_error_buffers(lengths, world_size: int, rows=None):
    """Zero error buffers for :func:`compressed_allreduce_stacked`: ``(groups, worker, server)``.

    ``groups`` is :func:`buffer_groups` of ``lengths`` (and ``rows``); group ``g`` of ``k`` buffers of length
    ``n`` gets a worker error ``(k, buffer_padded_size(n, P, row))`` and a server error of a ``P``-th of that.
    """
    rows = [None] * len(lengths) if rows is None else list(rows)
    groups = buffer_groups(lengths, rows)
    worker, server = [], []
    for idx in groups:
        n_pad = buffer_padded_size(int(lengths[idx[0]]), world_size, rows[idx[0]])
        worker.append(jnp.zeros((len(idx), n_pad), jnp.float32))
        server.append(jnp.zeros((len(idx), n_pad // world_size), jnp.float32))
    return groups, worker, server


def compressed_allreduce_stacked(backend: Backend, xs, groups, worker_stacks, server_stacks, rows=None):
    """:func:`compressed_allreduce_groups` with each group's errors kept as one stacked array.

    ``groups``: :func:`buffer_groups` of the buffers' lengths (and ``rows``); ``worker_stacks[g]`` is
    ``(k, n_pad)`` for the ``k`` buffers of group ``g`` (row ``j``: buffer ``groups[g][j]``'s worker error),
    ``server_stacks[g]`` ``(k, n_pad / P)``. Keeping the errors stacked the way they are computed spares the
    program a concatenation and ``k`` slices per group and step, and takes two arrays per group, not per buffer,
    in and out of it. Same results as :func:`compressed_allreduce_groups`, bit for bit.
    """
    rows = [None] * len(xs) if rows is None else list(rows)
    if len(worker_stacks) != len(groups) or len(server_stacks) != len(groups):
        raise ValueError(f"compressed_allreduce: {len(groups)} groups of buffers but {len(worker_stacks)} worker "
                         f"and {len(server_stacks)} server error stacks")
    x_stacks = []
    for idx in groups:
        if jnp.ndim(xs[idx[0]]) != 1:
            raise ValueError(f"compressed_allreduce expects a 1-D buffer, got shape {jnp.shape(xs[idx[0]])}")
        n = jnp.shape(xs[idx[0]])[0]
        others = [i for i in idx[1:] if jnp.shape(xs[i]) != (n,) or rows[i] != rows[idx[0]]]
        if others:
            raise ValueError(f"compressed_allreduce: buffer {others[0]} has shape {jnp.shape(xs[others[0]])}, not "
                             f"({n},) like the rest of its group; build the groups with buffer_groups")
        x_stacks.append(jnp.asarray(xs[idx[0]]) if len(idx) == 1 else
                        jnp.stack([jnp.asarray(xs[i]).astype(jnp.float32) for i in idx]))
    out = compressed_allreduce_stacks(backend, x_stacks, worker_stacks, server_stacks,
                                      [rows[idx[0]] for idx in groups])
    return [(idx, *o) for idx, o in zip(groups, out, strict=True)]


def compressed_allreduce_stacks(backend: Backend, x_stacks, worker_stacks, server_stacks, rows=None):
    """The core of :func:`compressed_allreduce_stacked`: stack ``g`` is ``k`` buffers of one length, given as a
    ``(k, n)`` array (or, for ``k = 1``, the buffer itself, ``(n,)``), with error stacks ``(k, n_pad)`` and
    ``(k, n_pad / P)``; each buffer of a stack is compressed on its own (its own scales). All stacks share one
    all-to-all and one all-gather. Returns per stack ``(rows (k, P, w), worker (k, n_pad), server (k, C))``.
    """
    p = backend.size
    rows = [None] * len(x_stacks) if rows is None else list(rows)
    worker = []
    for x, we, se, row in zip(x_stacks, worker_stacks, server_stacks, rows, strict=True):
        k = 1 if jnp.ndim(x) == 1 else jnp.shape(x)[0]
        x0, n, n_pad, chunk = _check_buffers(x if jnp.ndim(x) == 1 else x[0], we[0], se[0], p, row)
        if tuple(we.shape) != (k, n_pad) or tuple(se.shape) != (k, chunk):
            raise ValueError(f"compressed_allreduce: a group of {k} buffers of {n} elements needs error "
                             f"stacks ({k}, {n_pad}) and ({k}, {chunk}), got {tuple(we.shape)} and "
                             f"{tuple(se.shape)}")
        if k == 1:
            out, new_we = _worker_rows(x0, n, we[0], p, row)
            worker.append((out[None], new_we[None]))
        else:
            x = jnp.asarray(x).astype(jnp.float32)
            worker.append(jax.vmap(lambda x, we, n=n, row=row: _worker_rows(x, n, we, p, row))(x, we))
    # (k, P, w) -> (P, k w): the rows of a group side by side, so row j (rank j's) stays one row.
    sent = [jnp.moveaxis(out, 0, 1).reshape(p, -1) for out, _ in worker]
    received = _split_columns(backend.all_to_all(_join_columns(sent)), [(a, None) for a in sent])
    server = []
    for (out, _), r, se, row in zip(worker, received, server_stacks, rows, strict=True):
        k = out.shape[0]
        r = jnp.moveaxis(r.reshape(p, k, -1), 1, 0)  # (k, P, w)
        if k == 1:
            o, new_se = _server_row(r[0], se[0], p, row)
            server.append((o[None], new_se[None]))
        else:
            server.append(jax.vmap(lambda r, se, row=row: _server_row(r, se, p, row))(r, se))
    flat = [row.reshape(-1) for row, _ in server]
    gathered = _split_columns(backend.all_gather(_join_columns(flat)), [(a, None) for a in flat])
    out = []
    for g, (o, we), (row, se) in zip(gathered, worker, server, strict=True):
        out.append((jnp.moveaxis(g.reshape(p, o.shape[0], row.shape[-1]), 1, 0), we, se))  # (k, P, w)
    return out


def ungroup(groups, field: int, count: int) -> list:
    """Per-buffer list of one field of :func:`compressed_allreduce_groups` (1: rows, 2: worker, 3: server errors)."""
    out = [None] * count
    for group in groups:
        stacked = group[field]
        for j, i in enumerate(group[0]):
            out[i] = stacked[j]
    return out


def compressed_mean_leaves(backend: Backend, leaves, worker_stacks, server_stacks, rows=None):
    """Each array of ``leaves`` through its own compressed allreduce, the errors kept stacked per group of
    equal-size leaves (:func:`stacked_error_buffers` of the leaf sizes, with a leading axis of 1 as optimizer
    states hold them): ``(decoded leaves, worker stacks, server stacks)``, the stacks with that axis again."""
    sizes = [int(np.prod(jnp.shape(x))) for x in leaves]
    groups = compressed_allreduce_stacked(backend, [jnp.ravel(x) for x in leaves], buffer_groups(sizes, rows),
                                          [we[0] for we in worker_stacks], [se[0] for se in server_stacks], rows)
    decoded = [d.reshape(jnp.shape(x)) for d, x in zip(decode_groups(groups, sizes, rows), leaves, strict=True)]
    return decoded, tuple(g[2][None] for g in groups), tuple(g[3][None] for g in groups)


def decode_groups(groups, sizes, rows=None) -> list[jax.Array]:
    """The decoded float32 buffers of :func:`compressed_allreduce_groups` (buffer ``i``: ``sizes[i]`` values).

    One batched decode per group; the elements are those of :func:`decode_segments` (a select between
    ``scale_j * 1`` and ``scale_j * -1``), bit for bit. ``rows``: as given to :func:`compressed_allreduce_groups`.
    """
    out = [None] * len(sizes)
    for idx, grouped, _, _ in groups:
        n = int(sizes[idx[0]])
        row = None if rows is None else rows[idx[0]]
        # Decoded rank-major, (P, k, ...): the layout the all-gather delivers (the (k, P, w) view is its
        # transpose, which cancels here), so buffer j is the strided slice [:, j] and no leaf's decode
        # carries a transpose of its whole group.
        by_rank = jnp.swapaxes(grouped, 0, 1)
        if row is not None:
            count = row_padded_size(n, by_rank.shape[0], row) // row // by_rank.shape[0]
            bits, scales = _split_row_scales(by_rank, count)  # (P, k, C/8), (P, k, C/row)
            dec = unpack_rows(bits).reshape(*scales.shape, row) * scales[..., None]
        elif len(idx) == 1:
            out[idx[0]] = decode_segments(grouped[0], [n])[0]
            continue
        else:
            bits, scales = _split_scale(by_rank)  # (P, k, C/8), (P, k)
            pos, neg = _signed(scales)
            dec = jnp.where((bits[..., None] & _BIT_WEIGHTS) != 0, pos[..., None, None], neg[..., None, None])
        for i, j in zip(idx, shared_kernel_indices(len(idx), scales), strict=True):
            out[i] = lax.dynamic_index_in_dim(dec, j, axis=1, keepdims=False).reshape(-1)[:n]
    return out


def shared_kernel_indices(count: int, anchor: jax.Array) -> list:
    """``0, 1, ..., count - 1``, as indices of the leaves of a group to read each one's rows with.

    On XLA:CPU they are run-time values: XLA:CPU generates code once for all fused kernels with the same
    computation, but an index that is a constant is part of the computation, so a group of ``k`` leaves would get
    ``k`` kernels (each ~10 ms of code generation and ~0.9 MB of compile memory: most of what a model with
    thousands of leaves costs to compile beyond AdamW, benchmarks/BENCHMARKS.md). The values come out of a loop
    whose trip count depends on ``anchor`` (any float array of the step; the loop runs once, twice where its first
    element is a NaN) and which adds 0 on every trip, so the compiler cannot fold them back into constants, and
    every leaf of a size shares one kernel. Elsewhere (GPU: a loop would cost a device-to-host read of its
    condition) plain integers. The backend is JAX's default one, read while tracing: a CPU mesh on a GPU machine
    gets the plain integers (the same values, one kernel per leaf).
    """
    if count <= 1 or jax.default_backend() != "cpu":
        return list(range(count))
    first = jnp.ravel(anchor)[0]
    trips = 1 + (first != first).astype(jnp.int32)

    def body(carry):
        trip, values = carry
        zero = (trip >= 1 << 30).astype(jnp.uint32)  # 0 on every trip this loop makes
        return trip + 1, tuple(v + zero for v in values)

    # Unsigned: an index that cannot be negative needs no wrapping code in every kernel that reads with it.
    init = (jnp.int32(0), tuple(jnp.uint32(j) for j in range(count)))
    return list(lax.while_loop(lambda carry: carry[0] < trips, body, init)[1])


def _join_columns(arrays):
    return arrays[0] if len(arrays) == 1 else jnp.concatenate(arrays, axis=-1)


def _split_columns(joined, like):
    """Inverse of :func:`_join_columns` on the last axis, widths taken from ``like[k][0]``."""
    if len(like) == 1:
        return [joined]
    widths = [a.shape[-1] for a, _ in like]
    bounds = np.cumsum([0, *widths])
    return [joined[..., int(a):int(b)] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def decode_rows(rows: jax.Array, n: int | None = None) -> jax.Array:
    """Float32 vector encoded by ``(..., C/8 + 4)`` rows of packed signs and a trailing float32 scale.

    Row ``j`` decodes to ``scale_j * unpack(signs_j)`` (``C`` values); the rows are concatenated and the result
    truncated to ``n`` (default: all ``rows.shape[-2] * C`` values). Also decodes a single row ``(C/8 + 4,)``.
    """
    rows = jnp.asarray(rows)
    if rows.dtype != jnp.uint8:
        raise TypeError(f"decode_rows expects uint8 rows, got {rows.dtype}")
    single = rows.ndim == 1
    if single:
        rows = rows[None]
    bits, scales = _split_scale(rows)
    out = (unpack_rows(bits) * scales[:, None, None]).reshape(-1)
    return out if n is None else out[:n]


def decode_segments(rows: jax.Array, sizes) -> list[jax.Array]:
    """:func:`decode_rows` of ``(P, C/8 + 4)`` rows, split into consecutive 1-D pieces of the given sizes.

    Every piece is decoded on its own from the bytes that cover it, row by row, as a select between
    ``scale_j * 1`` and ``scale_j * -1`` (element for element the bits of ``scale_j * unpack(bits)``), so each
    output element is written once, in its final place: no full-length decoded vector is materialised and
    then split (on XLA:CPU such a split re-derives each element's row and bit from its flat index with
    divisions and costs more than the decoding). The elements are those of :func:`decode_rows`; a reduction
    XLA fuses over them may still round differently (XLA:CPU contracts and vectorises fused arithmetic by
    its form), so the 1-bit Adam step uses this only where the decoded values leave the step as they are.
    """
    bits, scales = _split_scale(rows)
    pos, neg = _signed(scales)
    k = bits.shape[-1]  # bytes per row
    out, offset = [], 0
    for n in sizes:
        n = int(n)
        lo, hi = offset // 8, -(-(offset + n) // 8)  # bytes covering [offset, offset + n)
        pieces = []
        while lo < hi:
            r = lo // k
            end = min(hi, (r + 1) * k)
            pieces.append(select_signs(bits[r, lo - r * k:end - r * k], pos[r], neg[r]))
            lo = end
        piece = (jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0]).reshape(-1) if pieces \
            else jnp.zeros((0,), jnp.float32)
        if offset % 8 or n % 8:
            piece = piece[offset % 8:offset % 8 + n]
        out.append(piece)
        offset += n
    return out


def compressed_allreduce_with(backend: Backend, x, worker_error, server_error):
    """:func:`compressed_allreduce` over an explicit :class:`~jonebit.comm.backends.Backend`."""
    rows, new_worker_error, new_server_error = compressed_allreduce_rows(backend, x, worker_error, server_error)
    x = jnp.asarray(x)
    return decode_rows(rows, x.shape[0]).astype(x.dtype), new_worker_error, new_server_error


def compressed_allreduce(x, worker_error, server_error, *, axis_name: str | None = None, mpi_comm=None):
    """Error-compensated 1-bit allreduce (average) of this rank's 1-D buffer.

    Call it inside ``jax.shard_map`` over ``axis_name`` (per-device view), or in each MPI process with
    ``mpi_comm``. The result is the same on every rank, bit for bit.

    Args:
      x: this rank's 1-D float32 array of length ``N``.
      worker_error: this rank's worker error, float32 of length ``padded_size(N, P)`` (zeros at first).
      server_error: this rank's server error, float32 of length ``padded_size(N, P) // P``.
      axis_name: mesh axis to reduce over (shard_map backend).
      mpi_comm: mpi4py communicator (MPI backend, needs ``jonebit[mpi]``).

    Returns:
      ``(out, new_worker_error, new_server_error)``; ``out`` approximates the mean of ``x`` over ranks.

    Example::

      def body(x, we, se):
          return compressed_allreduce(x[0], we[0], se[0], axis_name="data")
    """
    return compressed_allreduce_with(get_backend(axis_name, mpi_comm), x, worker_error, server_error)
