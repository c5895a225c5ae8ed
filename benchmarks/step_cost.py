"""Cost of one optimizer step: 1-bit Adam in its compression stage vs optax.adamw + fp32 mean allreduce.

1-bit Adam runs as jonebit's step builders run it (a program compiled for the compression phase alone, picked on
the host) and as one program holding every phase (``per_phase=False``: what a user's own ``jit`` of the transform
compiles).

Same tree, same devices, same process; the two steps are timed alternately and the ratio of medians is
reported (the machine is shared, so only side-by-side ratios mean something). On CPU-simulated devices
the collectives are memory copies, so this measures the compute overhead of compression (sign packing,
unpacking, scales), not a network win.

    python benchmarks/step_cost.py [--params 4000000] [--repeats 15] [--devices 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401  (sets the CPU device count before jax starts)
import jax
import numpy as np
import optax
from common import count, mlp_shapes, table, write_json

from jonebit import onebit_adam
from jonebit.train.data_parallel import data_mesh, init_optimizer, make_update, replicate, shard_batch


def build(tx, shapes, mesh, grad_reduce, rng, per_phase=True):
    params = replicate(jax.tree.map(lambda s: rng.standard_normal(s, np.float32) * 0.02, shapes,
                                    is_leaf=lambda x: isinstance(x, tuple)), mesh)
    state, specs = init_optimizer(tx, params, mesh)
    grads = shard_batch(jax.tree.map(lambda s: rng.standard_normal((mesh.size, *s), np.float32), shapes,
                                     is_leaf=lambda x: isinstance(x, tuple)), mesh)
    update = make_update(tx, mesh, specs, grad_reduce=grad_reduce, per_phase=per_phase)
    return update, params, state, grads


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=4_000_000)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--devices", type=int, default=8)
    args = ap.parse_args()
    mesh = data_mesh(args.devices)
    shapes = mlp_shapes(args.params, width=1000)
    rng = np.random.default_rng(0)
    runs = {
        "1-bit Adam (compression stage)": build(onebit_adam(1e-4, freeze_step=1, fused=True), shapes, mesh, None, rng),
        "1-bit Adam per-leaf (compression stage)":
            build(onebit_adam(1e-4, freeze_step=1, fused=False), shapes, mesh, None, rng),
        # The same two, in the one program that holds every phase (switched on the device, as a user's jit has it).
        "1-bit Adam, one program (compression stage)":
            build(onebit_adam(1e-4, freeze_step=1, fused=True), shapes, mesh, None, rng, per_phase=False),
        "1-bit Adam per-leaf, one program (compression stage)":
            build(onebit_adam(1e-4, freeze_step=1, fused=False), shapes, mesh, None, rng, per_phase=False),
        "optax.adamw + fp32 mean allreduce": build(optax.adamw(1e-4), shapes, mesh, "mean", rng),
    }
    state = {k: (p, s) for k, (_, p, s, _) in runs.items()}
    times = {k: [] for k in runs}
    for k, (update, _, _, grads) in runs.items():  # compile + warmup (1-bit Adam leaves its warmup stage here)
        for _ in range(2):
            state[k] = jax.block_until_ready(update(*state[k], grads))
    for _ in range(args.repeats):
        for k, (update, _, _, grads) in runs.items():
            t0 = time.perf_counter()
            state[k] = jax.block_until_ready(update(*state[k], grads))
            times[k].append(time.perf_counter() - t0)
    base = statistics.median(times["optax.adamw + fp32 mean allreduce"])
    rows = [dict(step=k, ms=1e3 * statistics.median(v), ratio=statistics.median(v) / base) for k, v in times.items()]
    print(f"\nOptimizer step, {count(shapes):,} params, {mesh.size} devices ({jax.default_backend()}), "
          f"median of {args.repeats}\n")
    print(table(rows, [("step", "step"), ("ms", "median ms"), ("ratio", "ratio to adamw + allreduce")]))
    path = write_json("step_cost", {"params": count(shapes), "devices": mesh.size, "repeats": args.repeats,
                                    "rows": rows, "times_s": times})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
