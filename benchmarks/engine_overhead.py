"""Overhead of the engine's step over the bare data-parallel step, on the same model.

Both steps train the tiny transformer LM with the same optimizer on the same batches; the engine's step
(`jonebit.train.engine.make_train_step`, no accumulation, fp32) adds the non-finite check (one scalar
all-reduce), the skip conditional, the loss-scale bookkeeping and the metrics. The two are timed alternately,
step by step, and the ratio of medians is reported (target: within 5%). Run for Adam (fp32 allreduce) and for
1-bit Adam in its compression stage.

    python benchmarks/engine_overhead.py [--steps 30] [--dim 256] [--layers 2] [--batch 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401  (sets the CPU device count before jax starts)
import jax
import numpy as np
import optax
from common import table, write_json

from jonebit import onebit_adam
from jonebit.models import tiny_lm
from jonebit.train.data_parallel import data_mesh, init_optimizer, make_step, replicate, shard_batch
from jonebit.train.engine import init_train_state, make_train_step


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    mesh = data_mesh()
    cfg = tiny_lm.TinyLMConfig(vocab_size=256, seq_len=args.seq, dim=args.dim, heads=4, layers=args.layers)
    params0 = tiny_lm.init_params(cfg, jax.random.key(0))
    loss = lambda p, b: tiny_lm.loss_fn(p, b, cfg)  # noqa: E731
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (args.batch, args.seq + 1)).astype(np.int32)
    n_params = sum(x.size for x in jax.tree.leaves(params0))

    rows, raw = [], {}
    for name, tx, reduce in (("Adam (fp32 allreduce)", optax.adam(1e-3), "mean"),
                             ("1-bit Adam (compression stage)", onebit_adam(1e-3, freeze_step=1, fused=True), None)):
        params = replicate(jax.tree.map(np.asarray, params0), mesh)  # own buffers: the bare step donates them
        opt_state, specs = init_optimizer(tx, params, mesh)
        bare = make_step(loss, tx, mesh, specs, grad_reduce=reduce)
        state, tspecs = init_train_state(tx, params0, mesh)
        engine = make_train_step(loss, tx, mesh, tspecs, grad_reduce=reduce)
        batch = shard_batch(tokens, mesh)
        for _ in range(3):  # compile, leave 1-bit Adam's warmup
            params, opt_state, _ = jax.block_until_ready(bare(params, opt_state, batch))
            state, _ = jax.block_until_ready(engine(state, batch))
        t_bare, t_engine = [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            params, opt_state, _ = jax.block_until_ready(bare(params, opt_state, batch))
            t_bare.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            state, _ = jax.block_until_ready(engine(state, batch))
            t_engine.append(time.perf_counter() - t0)
        b, e = statistics.median(t_bare), statistics.median(t_engine)
        rows.append(dict(optimizer=name, bare_ms=1e3 * b, engine_ms=1e3 * e, ratio=e / b))
        raw[name] = {"bare_s": t_bare, "engine_s": t_engine}
    print(f"\nEngine step vs bare make_step: tiny LM, {n_params:,} params, batch {args.batch} x {args.seq}, "
          f"{mesh.size} devices ({jax.default_backend()}), median of {args.steps} alternating steps\n")
    print(table(rows, [("optimizer", "optimizer"), ("bare_ms", "bare step ms"), ("engine_ms", "engine step ms"),
                       ("ratio", "engine / bare")]))
    path = write_json("engine_overhead", {"params": n_params, "args": vars(args), "rows": rows, "times": raw})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
