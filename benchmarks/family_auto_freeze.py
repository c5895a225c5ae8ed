"""Where ``freeze_step="auto"`` lands, and what 0/1 Adam and 1-bit LAMB reach, on the demo's character LM.

A small stand-in for the pre-training setup: jonebit's demo transformer on pydoc text (no download), P = 8
simulated CPU devices, the same batches for every optimizer. Compares held-out loss of Adam, LAMB, 1-bit LAMB with
the tutorial's 20% freeze point and with the automatic one, and 0/1 Adam.

    python benchmarks/family_auto_freeze.py [--steps 300] [--devices 8]
"""

from __future__ import annotations

import argparse
import functools
import time

import common  # noqa: F401  (sets the CPU device count before jax starts)
import jax
import numpy as np
import optax
from common import table, write_json
from jax.sharding import PartitionSpec as P

import jonebit
from jonebit.apps.demo import corpus
from jonebit.models import tiny_lm
from jonebit.train.data_parallel import data_mesh


def make_step(tx, loss, mesh, specs, *, per_rank: bool, reduce: bool):
    """One jitted data-parallel step; params per rank (0/1 Adam) or replicated; grads averaged when ``reduce``."""
    pspec = P("data") if per_rank else P()

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(pspec, specs, P("data")), out_specs=(pspec, specs, P()))
    def step(params, state, batch):
        mine = jax.tree.map(lambda x: x[0], params) if per_rank else params
        local = mine if per_rank else jax.lax.pcast(mine, "data", to="varying")
        value, grads = jax.value_and_grad(loss)(local, batch)
        if reduce:
            grads = jax.lax.pmean(grads, "data")
        updates, state = tx.update(grads, state, mine)
        new = optax.apply_updates(mine, updates)
        return (jax.tree.map(lambda x: x[None], new) if per_rank else new), state, jax.lax.pmean(value, "data")

    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--batch-per-device", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--auto-thresholds", type=float, nargs="+", default=[0.05, 0.1],
                    help="one 1-bit LAMB freeze_step='auto' row per threshold of the rule")
    args = ap.parse_args()
    text = corpus()
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    ids = np.fromiter((lookup[c] for c in text), np.int32, len(text))
    split = int(0.95 * len(ids))
    cfg = tiny_lm.TinyLMConfig(vocab_size=len(chars))
    mesh = data_mesh(args.devices)
    rng = np.random.default_rng(args.seed)

    def windows(source, n):
        starts = rng.integers(0, len(source) - cfg.seq_len - 1, n)
        return np.stack([source[s:s + cfg.seq_len + 1] for s in starts])

    t = args.steps
    batches = [windows(ids[:split], args.batch_per_device * mesh.size) for _ in range(t)]
    val_batch = windows(ids[split:], 256)
    loss = functools.partial(tiny_lm.loss_fn, cfg=cfg)
    params0 = jax.device_get(tiny_lm.init_params(cfg, jax.random.key(args.seed)))
    warm = max(2, t // 15)
    adam_lr = optax.warmup_cosine_decay_schedule(0.0, 2e-3, warm, t, 2e-4)
    lamb_lr = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warm, t, 1e-3)
    auto = jonebit.AutoFreeze(min_step=warm, max_step=t // 2, check_every=10, patience=3)
    runs = {
        "Adam (optax.adamw, fp32 allreduce)": (optax.adamw(adam_lr, weight_decay=0.0), False, True),
        f"0/1 Adam (DeepSpeed semantics, var_freeze_step={warm} = lr warmup)": (
            jonebit.zero_one_adam(adam_lr, var_freeze_step=warm, var_update_scaler=4, local_step_scaler=40,
                                  local_step_clipper=4), True, False),
        f"0/1 Adam (bias_correction=True, var_freeze_step={t // 2})": (
            jonebit.zero_one_adam(adam_lr, bias_correction=True, var_freeze_step=t // 2, local_step_scaler=40,
                                  local_step_clipper=4), True, False),
        "LAMB (no compression)": (jonebit.onebit_lamb(lamb_lr, freeze_step=t + 1), False, False),
        f"1-bit LAMB, freeze_step={t // 5} (20%)": (jonebit.onebit_lamb(lamb_lr, freeze_step=t // 5), False, False),
    } | {
        f"1-bit LAMB, freeze_step='auto', threshold {th:g}": (
            jonebit.onebit_lamb(lamb_lr, freeze_step=auto._replace(threshold=th)), False, False)
        for th in args.auto_thresholds
    }
    val_loss = jax.jit(loss)
    put = lambda x, spec: jax.device_put(x, jax.NamedSharding(mesh, spec))  # noqa: E731
    rows = []
    for name, (tx, per_rank, reduce) in runs.items():
        state, specs = jonebit.sharded_init(tx, params0, mesh)
        step = make_step(tx, loss, mesh, specs, per_rank=per_rank, reduce=reduce)
        params = put(jax.tree.map(lambda x: np.stack([x] * mesh.size), params0), P("data")) if per_rank else \
            put(params0, P())
        losses, t0 = [], time.perf_counter()
        for b in batches:
            params, state, value = step(params, state, put(b, P("data")))
            losses.append(float(value))
        final = jax.tree.map(lambda x: np.asarray(x)[0], params) if per_rank else jax.device_get(params)
        freeze = int(state.freeze_at) if hasattr(state, "freeze_at") else None
        rows.append(dict(optimizer=name, train_loss=float(np.mean(losses[-20:])),
                         val_loss=float(val_loss(final, val_batch)),
                         freeze=("-" if freeze is None or freeze > t else f"{freeze} ({100 * freeze / t:.0f}%"
                                 + (", the cap)" if "auto" in name and freeze == auto.max_step else ")")),
                         seconds=round(time.perf_counter() - t0, 1)))
        print(rows[-1], flush=True)
    for r in rows:
        r["vs_adam"] = f"{100 * (r['val_loss'] / rows[0]['val_loss'] - 1):+.1f}%"
    print(f"\n{t} updates, P = {mesh.size}, {sum(x.size for x in jax.tree.leaves(params0)):,} parameters; "
          f"{auto} (threshold per row)\n")
    print(table(rows, [("optimizer", "optimizer"), ("freeze", "freeze point"), ("train_loss", "train loss (last 20)"),
                       ("val_loss", "held-out loss"), ("vs_adam", "vs Adam"), ("seconds", "seconds")]))
    print(f"\nwrote {write_json('family_auto_freeze', {'steps': t, 'world_size': mesh.size, 'rows': rows})}")


if __name__ == "__main__":
    main()
