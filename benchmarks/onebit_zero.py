"""1-bit Adam under ZeRO stages 0-3 next to plain ZeRO with AdamW: per-device memory and bytes per step.

BERT-base-shaped parameter tree (110M, fp32) on 8 simulated devices. Nothing is allocated: each training step is
compiled from ShapeDtypeStructs with a stand-in loss (the squared norm of every parameter times the batch mean;
communication and state sizes depend only on the parameter tree). Per device:

* ``params``, ``opt state``: bytes of one device's shards (from the shardings), the state split into its parts;
* ``grads``: the gradient a device holds after the backward pass (AdamW: reduced into its ZeRO layout; 1-bit
  Adam: the whole local gradient, which it must compress);
* the compiled step's ``memory_analysis()`` (arguments + temporaries);
* bytes each device sends per step, summed over the collectives of the compiled HLO (ring costs), per stage of
  1-bit Adam (warmup, the one-off first compression step, compression).

    python benchmarks/onebit_zero.py [--devices 8] [--layers 12]
"""

from __future__ import annotations

import argparse
import time

import common  # noqa: F401  (sets the CPU device count before jax starts)
import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import bert_base_shapes, count, table, write_json

import jonebit
from jonebit.comm.accounting import comm_report
from jonebit.sharding.mesh import data_mesh
from jonebit.sharding.zero import bytes_per_device
from jonebit.train.onebit_zero import FlatParams
from jonebit.train.zero import abstract_zero, make_zero_step

MB = 1e6


def loss_fn(params, batch):
    return sum(jnp.vdot(x, x) for x in jax.tree.leaves(params)) * jnp.mean(batch)


def _state_parts(state) -> dict:
    """Per-device bytes of the named parts of an optimizer state (1-bit or optax Adam)."""
    from jonebit.transforms.onebit_adam_zero import OneBitAdamZeroState

    parts = {}
    for node in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, OneBitAdamZeroState | jonebit.OneBitAdamState
                                                                     | optax.ScaleByAdamState)):
        fields = node._asdict() if hasattr(node, "_asdict") else {k: getattr(node, k) for k in
                                                                    ("count", "mu", "nu", "nu_full", "m_rows",
                                                                     "worker_error", "server_error")}
        for name, sub in fields.items():
            leaves = jax.tree.leaves(sub)
            if leaves:
                parts[name] = parts.get(name, 0) + bytes_per_device(leaves, [x.sharding for x in leaves])
    return parts


def run(tx, shapes, mesh, stage):
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(tuple(s), np.float32), shapes,
                          is_leaf=lambda x: isinstance(x, tuple))
    a_params, a_state, sh = abstract_zero(tx, params, mesh, stage=stage)
    batch = jax.ShapeDtypeStruct((mesh.size * 4,), np.float32, sharding=jax.NamedSharding(mesh, jax.P("data")))
    step = make_zero_step(loss_fn, tx, mesh, sh, donate=False)
    compiled = step.lower(a_params, a_state, batch).compile()
    report = comm_report(compiled.as_text(), mesh.size)
    mem = compiled.memory_analysis()
    p_leaves = a_params.chunks if isinstance(a_params, FlatParams) else jax.tree.leaves(a_params)
    grads = jax.tree.leaves(params)
    return {
        "params": bytes_per_device(p_leaves, [x.sharding for x in p_leaves]),
        "grads": bytes_per_device(grads, jax.tree.leaves(sh.grads)),
        "state": bytes_per_device(jax.tree.leaves(a_state), [x.sharding for x in jax.tree.leaves(a_state)]),
        "parts": _state_parts(a_state),
        "args": mem.argument_size_in_bytes, "temp": mem.temp_size_in_bytes,
        "report": report,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--layers", type=int, default=12)
    args = ap.parse_args()
    mesh = data_mesh(args.devices)
    n_dev = mesh.size
    shapes = bert_base_shapes(layers=args.layers)
    psi = count(shapes)
    print(f"BERT-base-shaped tree: {psi:,} parameters, {n_dev} devices", flush=True)
    rows = []
    for opt in ("adamw", "onebit"):
        for stage in (0, 1, 2, 3):
            t0 = time.perf_counter()
            if opt == "adamw":
                tx = optax.adamw(1e-4, weight_decay=0.01)
            else:
                kw = dict(freeze_step=100, weight_decay=0.01, fused=False)
                tx = jonebit.onebit_adam_zero(1e-4, stage=stage, **kw) if stage else jonebit.onebit_adam(1e-4, **kw)
            r = run(tx, shapes, mesh, stage)
            rep = r["report"]
            if opt == "adamw":
                warm = first = comp = rep.always_bytes
            elif stage == 0:
                sent = rep.phase_bytes(jonebit.OneBitAdamState.PHASES)
                warm, first, comp = sent["warmup"], sent["compression"], sent["compression"]
            else:
                sent = rep.phase_bytes(jonebit.OneBitAdamZeroState.PHASES)
                warm, first, comp = sent["warmup"], sent["first_compression"], sent["compression"]
            total = r["params"] + r["grads"] + r["state"]
            row = dict(
                optimizer="AdamW" if opt == "adamw" else "1-bit Adam", stage=stage,
                params_mb=r["params"] / MB, grads_mb=r["grads"] / MB, state_mb=r["state"] / MB,
                total_mb=total / MB, bytes_per_param=total / psi,
                args_mb=r["args"] / MB, temp_mb=r["temp"] / MB,
                warmup_mb=warm / MB, first_mb=first / MB, compression_mb=comp / MB,
                parts={k: v / MB for k, v in r["parts"].items()},
            )
            rows.append(row)
            print(f"  {row['optimizer']} stage {stage}: {total / MB:,.1f} MB/device, compression step "
                  f"{comp / MB:,.2f} MB sent ({time.perf_counter() - t0:.0f} s)", flush=True)
    print()
    print(table(rows, [("optimizer", "optimizer"), ("stage", "stage"), ("params_mb", "params MB"),
                       ("grads_mb", "grads MB"), ("state_mb", "opt state MB"), ("total_mb", "total MB"),
                       ("bytes_per_param", "bytes / param"), ("args_mb", "compiled args MB"),
                       ("temp_mb", "compiled temp MB"), ("warmup_mb", "sent/step warmup MB"),
                       ("first_mb", "sent first compressed step MB"), ("compression_mb", "sent/step compression MB")]))
    print()
    print("1-bit Adam optimizer state per device (MB):")
    for row in rows:
        if row["optimizer"] != "AdamW":
            print(f"  stage {row['stage']}: " + ", ".join(f"{k} {v:,.1f}" for k, v in row["parts"].items()))
    path = write_json("onebit_zero", {"params": psi, "devices": n_dev, "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
