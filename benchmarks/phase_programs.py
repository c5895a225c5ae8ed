"""1-bit Adam's compression stage on BERT-mini: one program per phase (what jonebit's step builders run) against one
program with every phase, and against AdamW + an fp32 mean allreduce.

Two measurements on the BERT-mini parameter tree (4 layers x 256, 11.3M parameters, its real leaves), 8 simulated
CPU devices, everything in this one process and timed alternately step by step (the machine is shared: only the
side-by-side ratios mean something):

* the optimizer step alone (``make_update`` with each rank's gradient given), and
* the whole training step of the engine (forward + backward + update; MLM + NSP loss, batch 16 x 64).

1-bit Adam runs in its compression stage, with its defaults (per-tensor compression) and fused.

    python benchmarks/phase_programs.py [--repeats 15] [--batch 16] [--seq 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401  (sets the CPU device count before jax starts)
import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import table, write_json
from flax import nnx

from jonebit import onebit_adam
from jonebit.apps.pretrain import make_loss
from jonebit.models.bert import BertConfig, BertForPreTraining
from jonebit.train.data_parallel import data_mesh, init_optimizer, make_update, replicate, shard_batch
from jonebit.train.engine import init_train_state, make_train_step

ADAMW = "optax.adamw + fp32 mean allreduce"


def bert_mini(seq: int):
    config = BertConfig(vocab_size=30522, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024, max_position_embeddings=max(512, seq))
    return BertForPreTraining(config, rngs=nnx.Rngs(0))


def arms():
    """name -> (optimizer, grad_reduce, per_phase)."""
    return {
        "1-bit Adam, per phase": (onebit_adam(1e-4, freeze_step=1), None, True),
        "1-bit Adam, one program": (onebit_adam(1e-4, freeze_step=1), None, False),
        "1-bit Adam fused, per phase": (onebit_adam(1e-4, freeze_step=1, fused=True), None, True),
        "1-bit Adam fused, one program": (onebit_adam(1e-4, freeze_step=1, fused=True), None, False),
        ADAMW: (optax.adamw(1e-4), "mean", True),
    }


def alternate(runs: dict, repeats: int) -> dict:
    """runs: name -> (call, state). Two untimed calls each (compile; 1-bit Adam leaves its warmup), then
    ``repeats`` rounds, one timed call of each per round."""
    times = {k: [] for k in runs}
    state = {k: s for k, (_, s) in runs.items()}
    for k, (call, _) in runs.items():
        for _ in range(2):
            state[k] = jax.block_until_ready(call(state[k]))
    for _ in range(repeats):
        for k, (call, _) in runs.items():
            t0 = time.perf_counter()
            state[k] = jax.block_until_ready(call(state[k]))
            times[k].append(time.perf_counter() - t0)
    return times


def rows_of(times: dict) -> list[dict]:
    base = statistics.median(times[ADAMW])
    return [dict(step=k, ms=1e3 * statistics.median(v), ratio=statistics.median(v) / base) for k, v in times.items()]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--predictions", type=int, default=10, help="masked positions per sequence")
    args = ap.parse_args()
    mesh = data_mesh(8)
    model = bert_mini(args.seq)
    graphdef, params, keys, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    n_params = sum(int(np.size(x)) for x in jax.tree.leaves(params))
    n_leaves = len(jax.tree.leaves(params))
    rng = np.random.default_rng(0)

    # The optimizer step alone.
    grads = shard_batch(jax.tree.map(lambda p: rng.standard_normal((mesh.size, *p.shape), np.float32) * 1e-3,
                                     params), mesh)
    runs = {}
    for name, (tx, reduce, per_phase) in arms().items():
        placed = replicate(params, mesh)
        state, specs = init_optimizer(tx, placed, mesh)
        update = make_update(tx, mesh, specs, grad_reduce=reduce, per_phase=per_phase)
        runs[name] = (lambda s, u=update: u(*s, grads), (placed, state))
    update_rows = rows_of(alternate(runs, args.repeats))

    # The engine's whole step.
    b, t, k = args.batch, args.seq, args.predictions
    batch = {
        "input_ids": rng.integers(5, 30522, (b, t)).astype(np.int32),
        "token_type_ids": (np.arange(t)[None] >= t // 2).astype(np.int32).repeat(b, 0),
        "attention_mask": np.ones((b, t), np.int32),
        "masked_lm_positions": np.sort(rng.choice(np.arange(1, t), (b, k)), axis=1).astype(np.int32),
        "masked_lm_ids": rng.integers(5, 30522, (b, k)).astype(np.int32),
        "masked_lm_weights": np.ones((b, k), np.float32),
        "next_sentence_label": rng.integers(0, 2, (b,)).astype(np.int32),
    }
    loss = make_loss(graphdef, keys, rest)
    runs = {}
    for name, (tx, reduce, per_phase) in arms().items():
        state, specs = init_train_state(tx, params, mesh)
        step = make_train_step(loss, tx, mesh, specs, grad_reduce=reduce, rng_seed=0, per_phase=per_phase)
        runs[name] = (lambda s, st=step: st(s, batch)[0], state)
    train_rows = rows_of(alternate(runs, args.repeats))

    cols = [("step", "step"), ("ms", "median ms"), ("ratio", "ratio to adamw + allreduce")]
    print(f"\nBERT-mini tree ({n_params:,} params, {n_leaves} leaves), {mesh.size} devices "
          f"({jax.default_backend()}), median of {args.repeats}, 1-bit Adam in its compression stage\n")
    print("Optimizer step\n")
    print(table(update_rows, cols))
    print(f"\nWhole training step (engine; forward + backward + update, batch {b} x {t})\n")
    print(table(train_rows, cols))
    path = write_json("phase_programs", {"params": n_params, "leaves": n_leaves, "devices": mesh.size,
                                         "repeats": args.repeats, "batch": b, "seq": t,
                                         "optimizer_step": update_rows, "train_step": train_rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
