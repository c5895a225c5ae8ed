"""The three collectives the compressed allreduce and the 1-bit optimizers need.

One small protocol with two implementations: :class:`AxisBackend` over a ``jax.shard_map`` mesh axis
(``jax.lax`` collectives, any XLA backend) and :class:`MPIBackend` over an mpi4py communicator
(``mpi4jax`` collectives inside ``jit``, one process per device). The algorithm in
:mod:`jonebit.comm.compressed` only talks to this protocol, so both paths compute the same arithmetic.
"""

from __future__ import annotations

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


class AxisBackend:
    """Collectives over the ``jax.shard_map`` mesh axis ``axis_name`` (construct while tracing the body)."""

    def __init__(self, axis_name: str):
        try:
            self.size = int(lax.axis_size(axis_name))
        except NameError as e:
            raise ValueError(
                f"jonebit: mesh axis {axis_name!r} is not bound here. The compressed allreduce and the 1-bit "
                f"optimizers must run inside `jax.shard_map` over a mesh that has an axis named {axis_name!r} "
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


class MPIBackend:
    """Collectives over an mpi4py communicator, executed by mpi4jax inside ``jit`` (one process per rank)."""

    def __init__(self, comm):
        try:
            import mpi4jax  # noqa: F401
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ImportError(
                "jonebit: mpi_comm=... needs mpi4py and mpi4jax; install them with `pip install jonebit[mpi]`"
            ) from e
        self.comm = comm
        self.size = int(comm.Get_size())

    def all_to_all(self, x):
        import mpi4jax

        return mpi4jax.alltoall(x, comm=self.comm)

    def all_gather(self, x):
        import mpi4jax

        return mpi4jax.allgather(x, comm=self.comm)

    def mean(self, tree):
        import mpi4jax
        from mpi4py import MPI

        def one(g):
            total = mpi4jax.allreduce(g, op=MPI.SUM, comm=self.comm)
            return total / jnp.asarray(self.size, total.dtype)

        return jax.tree.map(one, tree)


def get_backend(axis_name: str | None = None, mpi_comm=None) -> Backend:
    """The backend for ``axis_name`` (shard_map) or ``mpi_comm`` (MPI); exactly one must be given."""
    if mpi_comm is not None:
        if axis_name is not None:
            raise ValueError("jonebit: give either axis_name (shard_map) or mpi_comm (MPI), not both")
        return MPIBackend(mpi_comm)
    if axis_name is None:
        raise ValueError("jonebit: give axis_name (a shard_map mesh axis) or mpi_comm (an mpi4py communicator)")
    return AxisBackend(axis_name)
