"""Applications built on the library: BERT pre-training (``jonebit pretrain``), SQuAD fine-tuning (``jonebit
squad``, ``squad-download``, ``squad-eval``) and the demo (``make demo``), each with its command line. Their
recipes (the options an application starts from) are config files in ``jonebit/configs/``."""

import os

DEFAULT_DEVICES = 8  # simulated CPU devices of a single process


def start_devices(requested: int | None) -> None:
    """Sets the simulated CPU device count (``requested``, else what `jonebit launch` set in ``JAX_NUM_CPU_DEVICES``,
    else :data:`DEFAULT_DEVICES`) and joins the processes of a launched job into one (a no-op for one process)."""
    import jax

    from jonebit.sharding.mesh import initialize_distributed

    devices = requested or (None if os.environ.get("JAX_NUM_CPU_DEVICES") else DEFAULT_DEVICES)
    if devices:
        try:  # a CPU "cluster" of N devices in this process; no effect on GPU backends or once jax has started
            jax.config.update("jax_num_cpu_devices", devices)
        except RuntimeError:
            pass
    # Under `jonebit launch`, SLURM or mpirun the processes form one job.
    initialize_distributed()
