"""optax GradientTransformations: one module per optimizer."""

from jonebit.transforms.common import AutoFreeze
from jonebit.transforms.onebit_adam import OneBitAdamState, onebit_adam, sharded_init, state_specs
from jonebit.transforms.onebit_lamb import OneBitLambState, onebit_lamb
from jonebit.transforms.zero_one_adam import ZeroOneAdamState, zero_one_adam

__all__ = [
    "AutoFreeze",
    "OneBitAdamState",
    "OneBitLambState",
    "ZeroOneAdamState",
    "onebit_adam",
    "onebit_lamb",
    "sharded_init",
    "state_specs",
    "zero_one_adam",
]
