"""Bytes per rank and step of 1-bit Adam vs fp32/bf16 allreduce, read from compiled HLO (P = 8).

The optimizer step alone is compiled from ShapeDtypeStructs (nothing is allocated), so the 110M tree
costs only compile time. Warmup and compression stages live in one program (``lax.cond``); the
accounting attributes each branch's collectives to its stage.

    python benchmarks/comm_bytes.py [--devices 8]
"""

from __future__ import annotations

import argparse
import time

import common  # noqa: F401  (sets the CPU device count before jax starts)
import optax
from common import abstract, abstract_state, bert_base_shapes, count, mlp_shapes, table, write_json
from jax.sharding import PartitionSpec as P

from jonebit import OneBitAdamState, onebit_adam
from jonebit.comm import compressed_bytes_per_rank
from jonebit.comm.accounting import comm_report
from jonebit.train.data_parallel import data_mesh, make_update


def step_report(tx, shapes, mesh, grad_reduce, compiled=True):
    params = abstract(shapes, mesh)
    state, specs = abstract_state(tx, params, mesh)
    grads = abstract(shapes, mesh, P("data"), lead=mesh.size)
    update = make_update(tx, mesh, specs, grad_reduce=grad_reduce)
    lowered = update.lower(params, state, grads)
    # The CPU compiler promotes bf16 all-reduces to f32; the lowered program states what a GPU would send.
    hlo = lowered.compile().as_text() if compiled else lowered.as_text(dialect="hlo")
    return comm_report(hlo, mesh.size)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=8)
    args = ap.parse_args()
    mesh = data_mesh(args.devices)
    p = mesh.size
    trees = {"1M": mlp_shapes(1_000_000), "10M": mlp_shapes(10_000_000), "BERT-base 110M": bert_base_shapes()}
    rows = []
    for name, shapes in trees.items():
        t0 = time.perf_counter()
        n = count(shapes)
        onebit = step_report(onebit_adam(1e-3, freeze_step=100, fused=True), shapes, mesh, None)
        per_leaf = step_report(onebit_adam(1e-3, freeze_step=100, fused=False), shapes, mesh, None)
        fp32 = step_report(optax.adamw(1e-3), shapes, mesh, "mean").always_bytes
        bf16 = step_report(optax.adamw(1e-3), shapes, mesh, "mean_bf16", compiled=False).always_bytes
        phases = onebit.phase_bytes(OneBitAdamState.PHASES)
        compression, warmup = phases["compression"], phases["warmup"]
        rows.append(dict(
            tree=name, params=n, warmup=warmup, compression=compression,
            compression_per_leaf=per_leaf.phase_bytes(OneBitAdamState.PHASES)["compression"],
            formula=compressed_bytes_per_rank(n, p),
            fp32_allreduce=fp32, bf16_allreduce=bf16, vs_fp32=fp32 / compression, vs_bf16=bf16 / compression,
            compression_ops=" ".join(sorted(set(onebit.ops(OneBitAdamState.PHASES.index("compression"))))),
            seconds=round(time.perf_counter() - t0, 1),
        ))
        print(f"{name}: compiled in {rows[-1]['seconds']} s", flush=True)
    cols = [("tree", "tree"), ("params", "params"), ("warmup", "warmup B/step"),
            ("compression", "compression B/step"), ("compression_per_leaf", "per-leaf compression B/step"),
            ("fp32_allreduce", "fp32 allreduce B/step"), ("bf16_allreduce", "bf16 allreduce B/step"),
            ("vs_fp32", "fp32 / compression"), ("vs_bf16", "bf16 / compression"),
            ("compression_ops", "compression-stage collectives")]
    print(f"\nBytes sent per rank per optimizer step, P = {p} (ring costs, from the compiled HLO; bf16 from the"
          " lowered HLO because the CPU compiler promotes bf16 all-reduce to f32)\n")
    print(table(rows, cols))
    path = write_json("comm_bytes", {"world_size": p, "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
