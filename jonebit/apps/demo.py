"""Demo job: train a small character-level transformer data-parallel with Adam and with 1-bit Adam.

Runs on CPU-simulated devices with text that ships with Python (``pydoc_data.topics``), so it needs no
download. Both runs see the same batches; the table compares losses and the bytes each rank sends per
step, read from the compiled programs.

    python -m jonebit.apps.demo [--steps 200] [--freeze-step 40] [--devices 8]
"""

from __future__ import annotations

import argparse
import functools
import time


def corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--freeze-step", type=int, default=40, help="Adam warmup updates before compression")
    ap.add_argument("--devices", type=int, default=8, help="simulated CPU devices (data-parallel ranks)")
    ap.add_argument("--batch-per-device", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not 0 < args.freeze_step < args.steps:
        ap.error("--freeze-step must be between 1 and --steps - 1")

    import jax

    # Must happen before any device is touched: a CPU "cluster" of N devices in this process. When the
    # backend is already up (e.g. called from tests), use the devices it has.
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.devices)
    except RuntimeError:
        pass
    if jax.device_count() < args.devices:
        raise SystemExit(f"--devices {args.devices}: only {jax.device_count()} devices available")

    import numpy as np
    import optax
    from tqdm import tqdm

    from jonebit import onebit_adam
    from jonebit.comm.accounting import comm_report
    from jonebit.models import tiny_lm
    from jonebit.train.data_parallel import data_mesh, init_optimizer, make_step, replicate, shard_batch
    from jonebit.transforms.base import phase_names

    text = corpus()
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    ids = np.fromiter((lookup[c] for c in text), np.int32, len(text))
    split = int(0.95 * len(ids))
    train_ids, val_ids = ids[:split], ids[split:]
    cfg = tiny_lm.TinyLMConfig(vocab_size=len(chars))
    mesh = data_mesh(args.devices)
    global_batch = args.batch_per_device * mesh.size
    rng = np.random.default_rng(args.seed)

    def windows(source, n):
        starts = rng.integers(0, len(source) - cfg.seq_len - 1, n)
        return np.stack([source[s:s + cfg.seq_len + 1] for s in starts])

    batches = [windows(train_ids, global_batch) for _ in range(args.steps)]
    val_batch = windows(val_ids, 256)
    warmup = min(20, args.steps // 4)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps, args.lr / 10)
    loss = functools.partial(tiny_lm.loss_fn, cfg=cfg)
    val_loss = jax.jit(loss)
    params0 = jax.device_get(tiny_lm.init_params(cfg, jax.random.key(args.seed)))  # host copy: steps donate
    n_params = sum(x.size for x in jax.tree.leaves(params0))
    print(f"jonebit demo: {n_params:,}-parameter char transformer, {len(text):,} characters of pydoc text, "
          f"{mesh.size} data-parallel CPU devices, global batch {global_batch} x {cfg.seq_len}")

    runs = {
        "Adam (fp32 allreduce)": (optax.adamw(schedule, weight_decay=0.0), "mean"),
        f"1-bit Adam (freeze_step={args.freeze_step})": (onebit_adam(schedule, freeze_step=args.freeze_step), None),
    }
    rows = []
    for name, (tx, reduce) in runs.items():
        params = replicate(params0, mesh)
        opt_state, specs = init_optimizer(tx, params, mesh)
        step = make_step(loss, tx, mesh, specs, grad_reduce=reduce)
        first = shard_batch(batches[0], mesh)
        report = comm_report(step.lower(params, opt_state, first).compile().as_text(), mesh.size)
        # The loss report is a 4-byte all-reduce in every program; 1-bit Adam's phases are its switch's branches.
        names = phase_names(opt_state)
        if names is not None and report.branches:
            sent = report.phase_bytes(names)
            warm, comp = sent["warmup"], sent["compression"]
        else:
            warm = comp = report.always_bytes
        losses = []
        t0 = time.perf_counter()
        bar = tqdm(range(args.steps), desc=name, unit="step", dynamic_ncols=True)
        for i in bar:
            params, opt_state, value = step(params, opt_state, shard_batch(batches[i], mesh))
            losses.append(float(value))  # also paces the loop: one step in flight at a time
            bar.set_postfix(loss=f"{losses[-1]:.3f}", stage="adam" if i < args.freeze_step or reduce is not None
                            else "1-bit")
        seconds = time.perf_counter() - t0
        sent = sum(warm if (reduce is not None or i < args.freeze_step) else comp for i in range(args.steps))
        rows.append(dict(
            optimizer=name, train_loss=float(np.mean(losses[-20:])),
            val_loss=float(val_loss(jax.device_get(params), val_batch)),
            warm=warm, comp=comp, total_mb=sent / 1e6, seconds=seconds,
        ))

    print("\n| optimizer | train loss (last 20) | held-out loss | bytes/step warmup | bytes/step compressed "
          "| MB sent per rank | seconds |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['optimizer']} | {r['train_loss']:.3f} | {r['val_loss']:.3f} | {r['warm']:,.0f} "
              f"| {r['comp']:,.0f} | {r['total_mb']:.2f} | {r['seconds']:.1f} |")
    adam, onebit = rows
    print(f"\n1-bit Adam sent {adam['total_mb'] / onebit['total_mb']:.1f}x fewer bytes in total "
          f"({adam['comp'] / onebit['comp']:.1f}x fewer per step after freeze_step); "
          f"held-out loss {onebit['val_loss']:.3f} vs {adam['val_loss']:.3f} with Adam.")
    return {"rows": rows}


if __name__ == "__main__":
    main()
