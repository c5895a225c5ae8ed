"""Bytes per rank of every phase of 0/1 Adam and 1-bit LAMB (from compiled HLO), and totals over a run.

Each optimizer's step is compiled from ShapeDtypeStructs (nothing is allocated) at P = 8. All phases live in one
program; :mod:`jonebit.comm.accounting` attributes each ``lax.cond`` branch's collectives to its phase, and the
two kinds of first-phase step of 0/1 Adam are told apart by their collectives (a float32 all-reduce for a
variance step, the 1-bit all-to-all/all-gather otherwise). Totals over a run count how many steps of each kind
the schedules take (DeepSpeed's rules, simulated here), against fp32 Adam and 1-bit Adam.

    python benchmarks/family_bytes.py [--devices 8] [--steps 10000] [--warmup-fraction 0.1]
"""

from __future__ import annotations

import argparse

import common  # noqa: F401  (sets the CPU device count before jax starts)
from common import abstract, abstract_state, bert_base_shapes, count, table, write_json
from jax.sharding import PartitionSpec as P

import jonebit
from jonebit.comm.accounting import comm_report
from jonebit.train.data_parallel import data_mesh
from jonebit.transforms.base import phase_names


def phase_bytes(tx, shapes, mesh, per_rank_params: bool) -> dict[str, dict]:
    """Bytes by op of each phase the optimizer's state names (its compiled step's branches), for one step."""
    import jax
    import optax

    params = abstract(shapes, mesh, P("data"), lead=mesh.size) if per_rank_params else abstract(shapes, mesh)
    state, specs = abstract_state(tx, abstract(shapes, mesh), mesh)
    grads = abstract(shapes, mesh, P("data"), lead=mesh.size)
    pspec = P("data") if per_rank_params else P()

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(pspec, specs, P("data")), out_specs=(pspec, specs))
    def step(p, s, g):
        g = jax.tree.map(lambda x: x[0], g)
        p = jax.tree.map(lambda x: x[0], p) if per_rank_params else p
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
        return (jax.tree.map(lambda x: x[None], p) if per_rank_params else p), s

    r = comm_report(step.lower(params, state, grads).compile().as_text(), mesh.size)
    out = {}
    for name, branch in zip(phase_names(state), r.branches[0], strict=True):
        ops: dict = {}
        for c in branch:
            ops[c.op] = ops.get(c.op, 0.0) + c.total_bytes_sent
        out[name] = ops
    return out


def zero_one_counts(steps: int, var_freeze_step: int, kappa: int = 16, scaler: int = 32678, clipper: int = 16):
    """Steps of each kind 0/1 Adam takes in ``steps`` updates (DeepSpeed's counter is one ahead of the updates)."""
    var_interval, var_counter, interval, counter = 1, 0, 1, 0
    kinds = {"variance": 0, "onebit": 0, "local": 0, "sync": 0}
    for update in range(steps):
        s = update + 2
        if update < var_freeze_step:
            if s % var_interval == 0:
                kinds["variance"] += 1
                var_counter += 1
                if var_counter == kappa:
                    var_counter, var_interval = 0, 2 * var_interval
            else:
                kinds["onebit"] += 1
        else:
            kinds["sync" if s % interval == 0 else "local"] += 1
            counter += 1
            if counter == scaler:
                counter, interval = 0, min(clipper, 2 * interval)
    return kinds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10000)
    ap.add_argument("--warmup-fraction", type=float, default=0.1,
                    help="learning-rate warmup = 0/1 Adam's var_freeze_step (the tutorial's advice)")
    args = ap.parse_args()
    mesh = data_mesh(args.devices)
    shapes = bert_base_shapes()
    n = count(shapes)
    zo = phase_bytes(jonebit.zero_one_adam(1e-3), shapes, mesh, True)
    zo_first, zo_local = zo["variance_freezing"], zo["local_steps"]
    lamb = phase_bytes(jonebit.onebit_lamb(1e-3, freeze_step=100), shapes, mesh, False)
    lamb_warm, lamb_comp = lamb["warmup"], lamb["compression"]
    fp32 = zo_first.pop("all-reduce")
    onebit = sum(zo_first.values())
    per_step = [
        dict(optimizer="0/1 Adam", phase="variance step", bytes=fp32),
        dict(optimizer="0/1 Adam", phase="1-bit gradient step", bytes=onebit),
        dict(optimizer="0/1 Adam", phase="local step", bytes=0.0),
        dict(optimizer="0/1 Adam", phase="sync step", bytes=sum(zo_local.values())),
        dict(optimizer="1-bit LAMB", phase="warmup", bytes=sum(lamb_warm.values())),
        dict(optimizer="1-bit LAMB", phase="compression", bytes=sum(lamb_comp.values())),
    ]
    print(f"\nBytes sent per rank per step, BERT-base ({n:,} parameters), P = {mesh.size}, from the compiled HLO\n")
    print(table(per_step, [("optimizer", "optimizer"), ("phase", "phase"), ("bytes", "bytes/step")]))

    t = args.steps
    warm = max(1, int(args.warmup_fraction * t))
    freeze = max(1, t // 5)  # 1-bit Adam / 1-bit LAMB: the tutorial's 15-25% rule
    runs = []
    for name, scaler, clipper in (("0/1 Adam, DeepSpeed defaults", 32678, 16), ("0/1 Adam, local_step_scaler=1000",
                                                                                   1000, 16)):
        kinds = zero_one_counts(t, warm, scaler=scaler, clipper=clipper)
        total = kinds["variance"] * fp32 + (kinds["onebit"] + kinds["sync"]) * per_step[3]["bytes"]
        runs.append(dict(optimizer=name, fp32_rounds=kinds["variance"], onebit_rounds=kinds["onebit"] + kinds["sync"],
                         silent_steps=kinds["local"], total=total))
    runs.append(dict(optimizer="1-bit Adam / 1-bit LAMB (freeze at 20%)", fp32_rounds=freeze, onebit_rounds=t - freeze,
                     silent_steps=0, total=freeze * fp32 + (t - freeze) * per_step[5]["bytes"]))
    runs.append(dict(optimizer="Adam (fp32 allreduce)", fp32_rounds=t, onebit_rounds=0, silent_steps=0, total=t * fp32))
    for r in runs:
        r["vs_adam"] = runs[-1]["total"] / r["total"]
        r["total_gb"] = r["total"] / 1e9
    print(f"\nTotal over {t} updates (0/1 Adam: var_freeze_step = {warm}, the learning-rate warmup)\n")
    print(table(runs, [("optimizer", "optimizer"), ("fp32_rounds", "fp32 rounds"), ("onebit_rounds", "1-bit rounds"),
                       ("silent_steps", "steps without communication"), ("total_gb", "GB per rank"),
                       ("vs_adam", "Adam / this")]))
    path = write_json("family_bytes", {"world_size": mesh.size, "params": n, "per_step": per_step, "runs": runs,
                                       "steps": t, "var_freeze_step": warm, "freeze_step": freeze})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
