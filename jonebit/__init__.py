"""jonebit: communication-compressed data-parallel training for JAX.

1-bit Adam as an optax transform with an error-compensated 1-bit compressed allreduce
(``jax.shard_map`` collectives or MPI), ZeRO-style sharding, and a Flax NNX BERT.
"""

from jonebit.transforms.common import AutoFreeze
from jonebit.transforms.onebit_adam import (
    OneBitAdamState,
    adam_ratio_bound,
    onebit_adam,
    sharded_init,
    state_specs,
)
from jonebit.transforms.onebit_lamb import OneBitLambState, onebit_lamb
from jonebit.transforms.zero_one_adam import ZeroOneAdamState, zero_one_adam

__version__ = "0.1.0"

__all__ = [
    "AutoFreeze",
    "OneBitAdamState",
    "OneBitLambState",
    "ZeroOneAdamState",
    "adam_ratio_bound",
    "onebit_adam",
    "onebit_lamb",
    "sharded_init",
    "state_specs",
    "zero_one_adam",
]
