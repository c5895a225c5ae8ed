"""Research options of the 1-bit optimizers, kept beside the core and off by default.

Each option here changed a measured result in some setting, but none has yet earned a place in the defaults: their
evidence (in ``benchmarks/BENCHMARKS.md`` and the experimental options page of the docs) is that of single studies.
The core optimizers are correct without them; pass them explicitly::

    from jonebit.experimental import OneBitAdamOptions

    tx = jonebit.onebit_adam(1e-4, freeze_step=400, max_grad_norm=1.0,
                             experimental=OneBitAdamOptions(preconditioned=True, local_clip=True))
"""

from jonebit.experimental.onebit_adam import OneBitAdamOptions, adam_ratio_bound

__all__ = ["OneBitAdamOptions", "adam_ratio_bound"]
