"""How bits travel: sign packing, the compressed allreduce and its collective backends."""

from jonebit.comm.backends import AxisBackend, Backend, MPIBackend, get_backend
from jonebit.comm.compressed import (
    compressed_allreduce,
    compressed_allreduce_rows,
    compressed_allreduce_with,
    compressed_bytes_per_rank,
    decode_rows,
    padded_size,
)
from jonebit.comm.hierarchical import HierarchicalBackend, hierarchical_compressed_allreduce
from jonebit.comm.packing import pack_signs, unpack_signs

__all__ = [
    "AxisBackend",
    "Backend",
    "HierarchicalBackend",
    "MPIBackend",
    "compressed_allreduce",
    "compressed_allreduce_rows",
    "compressed_allreduce_with",
    "compressed_bytes_per_rank",
    "decode_rows",
    "get_backend",
    "hierarchical_compressed_allreduce",
    "pack_signs",
    "padded_size",
    "unpack_signs",
]
