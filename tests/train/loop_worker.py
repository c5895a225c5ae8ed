"""Trains the engine's test model with the loop; run as a script by tests/train/test_loop.py.

usage: loop_worker.py OUT_DIR MAX_STEPS CHECKPOINT_EVERY SLEEP_PER_STEP RESULT.npz
"""

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.train.loop_model import make_run  # noqa: E402


def main():
    out, max_steps, every, sleep, result = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), \
        sys.argv[5]
    step, state, batches, config = make_run(out, max_steps=max_steps, checkpoint_every=every, async_checkpoint=True)

    def slow(_record):
        time.sleep(sleep)

    from jonebit.train.loop import train

    state = train(step, state, batches, config, on_log=slow)
    leaves = jax.tree.leaves(jax.device_get(state))
    np.savez(result, *[np.asarray(x) for x in leaves])


if __name__ == "__main__":
    main()
