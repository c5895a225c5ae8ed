"""Saves a checkpoint in a child process that gets SIGKILLed part-way, for tests/train/test_checkpoint.py.

``python checkpoint_worker.py PATH SEED KILL`` builds ``make_state(SEED)`` and calls
``checkpoint.save(PATH, state, step=SEED, overwrite=True)``. KILL says where the process kills itself:

- ``none``: nowhere (the parent may still kill it from outside after printing ``SAVING``);
- ``phase:NAME``: at the save step NAME (``write``, ``written``, ``swap``, ``swapped``);
- ``mid-write``: as soon as orbax's temporary directory holds a data file, i.e. while orbax is writing.

It prints ``SAVING`` just before the save and ``SAVED`` after it.
"""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

BLOB = 1 << 22  # float32 elements of an extra array that makes the write last long enough to be interrupted


def make_state(seed: int, blob: int = BLOB):
    """A 1-bit Adam training state on 8 devices with every float leaf (error buffers included) random."""
    from jonebit import onebit_adam
    from jonebit.train.data_parallel import data_mesh, init_optimizer, replicate

    mesh = data_mesh(8)
    rng = np.random.default_rng(seed)
    params = replicate({"w": np.zeros((24, 10), np.float32), "b": np.zeros(7, np.float32)}, mesh)
    opt_state, _ = init_optimizer(onebit_adam(1e-2, freeze_step=2), params, mesh)

    def fill(x):
        if not np.issubdtype(x.dtype, np.floating):
            return x
        return jax.device_put(rng.standard_normal(x.shape).astype(x.dtype), x.sharding)

    state = {"params": jax.tree.map(fill, params), "opt_state": jax.tree.map(fill, opt_state)}
    state["opt_state"] = state["opt_state"]._replace(count=jax.device_put(np.int32(seed), opt_state.count.sharding))
    if blob:
        rows = jax.NamedSharding(mesh, jax.P("data"))
        state["blob"] = jax.device_put(rng.random((8, blob // 8), dtype=np.float32), rows)
    return state


def _kill():
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_while_orbax_writes(path: pathlib.Path):
    pattern = f"{path.name}.jonebit-new.orbax-checkpoint-tmp*"

    def watch():
        while True:
            for tmp in path.parent.glob(pattern):
                if any(p.is_file() for p in tmp.rglob("*")):
                    _kill()
            time.sleep(0.0005)

    threading.Thread(target=watch, daemon=True).start()


def main(path: str, seed: str, kill: str) -> None:
    from jonebit.train import checkpoint

    path = pathlib.Path(path)
    state = make_state(int(seed))
    if kill.startswith("phase:"):
        target = kill.removeprefix("phase:")
        checkpoint._on_phase = lambda name: _kill() if name == target else None
    elif kill == "mid-write":
        _kill_while_orbax_writes(path)
    print("SAVING", flush=True)
    checkpoint.save(path, state, step=int(seed), overwrite=True)
    print("SAVED", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
