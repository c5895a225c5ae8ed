"""Hierarchical 1-bit compressed allreduce on a 2-D ``hosts x local`` mesh.

Flat compression sends every device's 1-bit stream across the slow network, so a host with ``L`` devices pushes
``L`` streams through its one network card. Here only the slow, inter-host step is compressed:

1. **local reduce-scatter** (full precision, fast links): every device pads its buffer ``b`` (length ``N``) to
   ``L * S`` with ``S = ceil(N / L)`` and gets shard ``l`` (its index on the ``local`` axis) of the mean over
   the ``L`` devices of its host: ``x = (1/L) sum_j b_j[l S:(l + 1) S]``;
2. **inter-host compressed allreduce** (1 bit, slow links): the ``H`` devices that hold shard ``l`` on the ``H``
   hosts run the error-compensated :func:`~jonebit.comm.compressed_allreduce` of ``x`` over the ``hosts`` axis;
   its last collective leaves every one of them with the same packed rows (signs and scales) of shard ``l``;
3. **local all-gather** (fast links): the ``L`` shards' packed rows are gathered over ``local`` and decoded, so
   every device holds the same ``N`` values, bit for bit.

Error buffers: each device ``(h, l)`` keeps the **worker error** of its local shard ``l`` (length
``padded_size(S, H)``), and the **server error** of the chunk ``h`` of that shard it serves in step 2 (length
``padded_size(S, H) // H``). Both differ per device; the full-precision local step has none.

Bytes: only ``uint8`` crosses hosts. Per device and call, ``compressed_bytes_per_rank(S, H)`` over ``hosts``, so
per host ``L`` times that: about ``2 (H - 1)/H * N/8``, ``1/L`` of what flat compression over all ``H L``
devices sends between hosts (``2 L (H - 1)/H * N/8`` per host). The local steps move ``(L - 1) S`` float32
(reduce-scatter) and ``(L - 1)`` packed shards (all-gather of uint8 rows: the decoded result is recomputed on
every device instead of gathered in float32, 32x fewer local bytes).

Example (inside ``jax.shard_map`` over a mesh with axes ``("hosts", "local")``)::

  out, we, se = hierarchical_compressed_allreduce(x, we, se, axis_name=("hosts", "local"))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jonebit.comm.backends import AxisBackend
from jonebit.comm.compressed import (
    _join_columns,
    _split_columns,
    compressed_allreduce_rows_many,
    compressed_bytes_per_rank,
    decode_rows,
    padded_size,
)


def check_axis_pair(axis_name, where: str) -> tuple[str, str]:
    """``(hosts, local)`` from a hierarchical ``axis_name``; raises naming the problem otherwise."""
    if not isinstance(axis_name, tuple | list) or len(axis_name) != 2 or not all(
            isinstance(a, str) and a for a in axis_name):
        raise ValueError(
            f"{where}: a hierarchical axis_name must be a pair of mesh axis names (slow inter-host axis, fast "
            f"local axis), e.g. ('hosts', 'local'); got {axis_name!r}. Use a single name (str) for flat compression"
        )
    hosts, local = axis_name
    if hosts == local:
        raise ValueError(f"{where}: the two axes of axis_name must differ, got {tuple(axis_name)!r}")
    return hosts, local


def shard_size(n: int, local_size: int) -> int:
    """``S = ceil(n / L)``: the length of the local shard each device compresses across hosts."""
    return -(-int(n) // int(local_size))


def error_sizes(n: int, hosts: int, local: int) -> tuple[int, int]:
    """``(worker, server)`` error lengths of one buffer of ``n`` floats on a ``hosts x local`` mesh."""
    worker = padded_size(shard_size(n, local), hosts)
    return worker, worker // hosts


def hierarchical_bytes_per_device(n: int, hosts: int, local: int) -> dict:
    """Bytes one device sends per call, by link: ``{"hosts": uint8 bytes between hosts, "local_f32": ...,
    "local_u8": ...}`` (ring costs, as :mod:`jonebit.comm.accounting` counts them)."""
    s = shard_size(n, local)
    row = padded_size(s, hosts) // hosts // 8 + 4  # one packed server chunk and its float32 scale
    return {
        "hosts": compressed_bytes_per_rank(s, hosts) if hosts > 1 else 0,
        "local_f32": (local - 1) * s * 4,  # reduce-scatter: (L - 1) times its one-shard result
        "local_u8": (local - 1) * hosts * row,  # all-gather of this device's (H, row) packed result
    }


class HierarchicalBackend:
    """The collectives of 1-bit Adam on a ``hosts x local`` mesh (construct while tracing a ``shard_map`` body).

    ``mean`` and ``max`` reduce over both axes (full precision, used by warmup and the non-finite flag); the
    compressed allreduce is :func:`hierarchical_allreduce_rows_many`.

    Args:
      hosts_axis: the slow (inter-host) mesh axis; only 1-bit data crosses it.
      local_axis: the fast (intra-host) mesh axis.
    """

    def __init__(self, hosts_axis: str, local_axis: str):
        self.hosts = AxisBackend(hosts_axis)
        self.local_size = AxisBackend(local_axis).size
        self.hosts_axis, self.local_axis = hosts_axis, local_axis
        self.axis_name = (hosts_axis, local_axis)
        self.size = self.hosts.size * self.local_size

    def mean(self, tree):
        return jax.tree.map(lambda g: lax.pmean(g, self.axis_name), tree)

    def max(self, x):
        return lax.pmax(x, self.axis_name)


def _check(x, worker_error, server_error, hosts: int, local: int):
    x = jnp.asarray(x)
    if x.ndim != 1 or x.shape[0] == 0:
        raise ValueError(f"hierarchical_compressed_allreduce expects a non-empty 1-D buffer, got shape {x.shape}")
    want = error_sizes(x.shape[0], hosts, local)
    got = (tuple(worker_error.shape), tuple(server_error.shape))
    if got != ((want[0],), (want[1],)):
        raise ValueError(
            f"hierarchical_compressed_allreduce: for {x.shape[0]} floats on {hosts} hosts x {local} local devices "
            f"the worker/server errors must have shapes ({want[0]},)/({want[1]},) (see error_sizes), got "
            f"{got[0]}/{got[1]}"
        )
    return x


def hierarchical_allreduce_rows_many(backend: HierarchicalBackend, xs, worker_errors, server_errors):
    """The two-level compressed allreduce of several buffers, sharing each of its four collectives.

    Returns ``(rows, worker_errors, server_errors)``: ``rows[k]`` is the ``(L, H, C/8 + 4)`` uint8 result of
    buffer ``k`` (``[l]``: the packed inter-host result of local shard ``l``), the same on every device; decode it
    with :func:`decode_hierarchical`.
    """
    h, loc = backend.hosts.size, backend.local_size
    xs = [_check(x, we, se, h, loc) for x, we, se in zip(xs, worker_errors, server_errors, strict=True)]
    sizes = [shard_size(x.shape[0], loc) for x in xs]
    # One reduce-scatter for all buffers: each padded to L shards of S_k and laid side by side, (L, sum S_k).
    blocks = [jnp.pad(x.astype(jnp.float32), (0, loc * s - x.shape[0])).reshape(loc, s)
              for x, s in zip(xs, sizes, strict=True)]
    summed = lax.psum_scatter(jnp.concatenate(blocks, axis=1), backend.local_axis, scatter_dimension=0, tiled=True)
    shard = summed[0] / jnp.float32(loc)
    bounds = _bounds(sizes)
    shards = [shard[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    rows, wes, ses = compressed_allreduce_rows_many(backend.hosts, shards, worker_errors, server_errors)
    # The packed results travel over the local axis as they are (uint8); every device decodes all L shards.
    gathered = lax.all_gather(_join_columns(rows), backend.local_axis, axis=0, tiled=False, to="invarying")
    return _split_columns(gathered, [(r, None) for r in rows]), wes, ses


def _bounds(sizes):
    out = [0]
    for s in sizes:
        out.append(out[-1] + int(s))
    return out


def decode_hierarchical(rows: jax.Array, n: int) -> jax.Array:
    """The ``n`` float32 values encoded by ``(L, H, C/8 + 4)`` rows of :func:`hierarchical_allreduce_rows_many`."""
    loc = rows.shape[0]
    s = shard_size(n, loc)
    shards = jax.vmap(decode_rows)(rows)  # (L, padded_size(S, H)): each shard's inter-host result
    return shards[:, :s].reshape(-1)[:n]


def hierarchical_compressed_allreduce(x, worker_error, server_error, *, axis_name: tuple[str, str]):
    """Error-compensated two-level allreduce (average over all ``H x L`` devices) of this device's 1-D buffer.

    Call it inside ``jax.shard_map`` over both axes. The result is the same on every device, bit for bit.

    Args:
      x: this device's 1-D float array of length ``N``.
      worker_error: float32 of length ``error_sizes(N, H, L)[0]`` (zeros at first).
      server_error: float32 of length ``error_sizes(N, H, L)[1]``.
      axis_name: ``(hosts_axis, local_axis)``: the slow axis (1-bit traffic only) and the fast one.

    Returns:
      ``(out, new_worker_error, new_server_error)``.
    """
    hosts, local = check_axis_pair(axis_name, "hierarchical_compressed_allreduce")
    backend = HierarchicalBackend(hosts, local)
    x = jnp.asarray(x)
    (rows,), (we,), (se,) = hierarchical_allreduce_rows_many(backend, [x], [worker_error], [server_error])
    return decode_hierarchical(rows, x.shape[0]).astype(x.dtype), we, se
