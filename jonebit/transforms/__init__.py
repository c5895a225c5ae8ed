"""optax GradientTransformations: one module per optimizer, the shared machinery in :mod:`.base`."""

from jonebit.transforms.base import AutoFreeze
from jonebit.transforms.nonfinite import SkipNonfiniteState, skip_nonfinite
from jonebit.transforms.onebit_adam import OneBitAdamState, onebit_adam, sharded_init, state_specs
from jonebit.transforms.onebit_adam_zero import OneBitAdamZeroState, onebit_adam_zero
from jonebit.transforms.onebit_lamb import OneBitLambState, onebit_lamb
from jonebit.transforms.zero_one_adam import ZeroOneAdamState, zero_one_adam

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
