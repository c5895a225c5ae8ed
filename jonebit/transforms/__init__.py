"""optax GradientTransformations: one module per optimizer."""

from jonebit.transforms.onebit_adam import OneBitAdamState, onebit_adam, sharded_init, state_specs

__all__ = ["OneBitAdamState", "onebit_adam", "sharded_init", "state_specs"]
