"""jonebit: communication-compressed data-parallel training for JAX.

1-bit Adam, 0/1 Adam and 1-bit LAMB as optax transforms with an error-compensated 1-bit compressed allreduce
(``jax.shard_map`` collectives or MPI), ZeRO-style sharding, and a Flax NNX BERT. Research options live in
:mod:`jonebit.experimental`.
"""

from jonebit.transforms import (
    AutoFreeze,
    OneBitAdamState,
    OneBitAdamZeroState,
    OneBitLambState,
    SkipNonfiniteState,
    ZeroOneAdamState,
    onebit_adam,
    onebit_adam_zero,
    onebit_lamb,
    sharded_init,
    skip_nonfinite,
    state_specs,
    zero_one_adam,
)

__version__ = "0.1.0"

__all__ = [
    "AutoFreeze",
    "OneBitAdamState",
    "OneBitAdamZeroState",
    "OneBitLambState",
    "SkipNonfiniteState",
    "ZeroOneAdamState",
    "onebit_adam",
    "onebit_adam_zero",
    "onebit_lamb",
    "sharded_init",
    "skip_nonfinite",
    "state_specs",
    "zero_one_adam",
]
