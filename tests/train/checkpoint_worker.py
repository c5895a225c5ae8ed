"""Saves a checkpoint in a child process that gets SIGKILLed part-way, for tests/train/test_checkpoint.py.

``python checkpoint_worker.py PATH SEED KILL`` builds ``make_state(SEED)`` and calls
``checkpoint.save(PATH, state, step=SEED, overwrite=True)``. KILL says where the process kills itself:

- ``none``: nowhere (the parent may still kill it from outside after printing ``SAVING``);
- ``phase:NAME``: at the save step NAME (``write``, ``written``, ``swap``, ``swapped``);
- ``mid-write``: as soon as orbax's temporary directory holds a data file, i.e. while orbax is writing;
- ``two-processes``: no kill; under ``jonebit launch --nproc 2``, saves twice and restores (see two_processes).

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


def make_state(seed: int, blob: int = BLOB, devices: int = 8):
    """A 1-bit Adam training state on ``devices`` devices with every float leaf (error buffers included) random.

    The same on every process of a multi-process job (values come from ``seed`` only).
    """
    from jonebit import onebit_adam
    from jonebit.train.data_parallel import data_mesh, init_optimizer, replicate

    mesh = data_mesh(devices)
    rng = np.random.default_rng(seed)
    params = replicate({"w": np.zeros((24, 10), np.float32), "b": np.zeros(7, np.float32)}, mesh)
    opt_state, _ = init_optimizer(onebit_adam(1e-2, freeze_step=2, fused=True), params, mesh)

    def put(value, sharding):
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    def fill(x):
        if not np.issubdtype(x.dtype, np.floating):
            return x
        return put(rng.standard_normal(x.shape).astype(x.dtype), x.sharding)

    state = {"params": jax.tree.map(fill, params), "opt_state": jax.tree.map(fill, opt_state)}
    state["opt_state"] = state["opt_state"]._replace(count=put(np.asarray(seed, np.int32), opt_state.count.sharding))
    if blob:
        rows = jax.NamedSharding(mesh, jax.P("data"))
        state["blob"] = put(rng.random((devices, blob // devices), dtype=np.float32), rows)
    return state


def local_values(tree):
    """Every leaf as numpy: the whole array when this process holds all of it, else its first local shard."""
    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(x.addressable_shards[0].data)
        return np.asarray(jax.device_get(x))

    return jax.tree.map(one, tree)


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


def two_processes(path: pathlib.Path) -> None:
    """Run under ``jonebit launch --nproc 2``: save, overwrite, restore; process 0 then writes ``ok`` beside the
    directory that holds ``path`` (outside it, so the other process's check for leftovers does not see it)."""
    from jonebit.sharding.mesh import initialize_distributed
    from jonebit.train import checkpoint

    initialize_distributed(timeout=60, heartbeat_timeout=20)
    devices = jax.device_count()
    states = {seed: make_state(seed, blob=1 << 12, devices=devices) for seed in (1, 2)}
    checkpoint.save(path, states[1], step=1)
    checkpoint.save(path, states[2], step=2, overwrite=True)
    restored, step = checkpoint.restore(path, states[1])
    assert step == 2, step
    for got, want in zip(jax.tree.leaves(local_values(restored)), jax.tree.leaves(local_values(states[2])),
                         strict=True):
        np.testing.assert_array_equal(got, want)
    left = sorted(p.name for p in path.parent.iterdir() if p.name != path.name)
    assert left == [], left
    print(f"process {jax.process_index()} of {jax.process_count()}: {devices} devices, restored step {step}",
          flush=True)
    if jax.process_index() == 0:
        (path.parent.parent / "ok").write_text("ok")


def main(path: str, seed: str, kill: str) -> None:
    if kill == "two-processes":
        return two_processes(pathlib.Path(path))
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
