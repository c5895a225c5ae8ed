"""Where arrays live: ZeRO stages as NamedSharding rules, and the data-parallel mesh."""

from jonebit.sharding.zero import STAGES, ZeroShardings, bytes_per_device, leaf_spec, zero_shardings

__all__ = ["STAGES", "ZeroShardings", "bytes_per_device", "leaf_spec", "zero_shardings"]
