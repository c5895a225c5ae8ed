"""Where the compile time of a many-leaf 1-bit Adam step goes: XLA's passes, timed, and the cost of the arrays alone.

Two measurements, each compiled in a fresh subprocess with XLA's pass timing log switched on
(``TF_CPP_VMODULE=hlo_pass_pipeline=1,cpu_compiler=1``) and parsed:

* ``update``: the whole 1-bit Adam update (one program with every phase, as ``perleaf_compile.py`` compiles it) on
  the synthetic BERT-like tree of ``perleaf_compile.py`` with ``--leaves`` leaves, per leaf (``fused=False``) and
  fused: compile seconds, the seconds of the largest HLO passes and of LLVM code generation.
* ``boundary``: a program that only computes ``2 x + 1`` on ``N`` arrays inside ``jax.shard_map`` (or plain
  ``jax.jit``), against the same elements as one array: what the number of arrays entering and leaving a program
  costs by itself.

    python benchmarks/compile_profile.py [--leaves 200] [--arrays 400 800 1600]

Writes ``results/compile_profile/compile_profile.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from report import xla_compile_times  # noqa: E402


def _child(kind: str, size: int, form: str) -> None:
    """Compiles one case in this (fresh) process; prints ``compile SECONDS``."""
    sys.path.insert(0, str(HERE))
    import common  # noqa: F401  (8 CPU devices)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jonebit import onebit_adam
    from jonebit.train.data_parallel import data_mesh, init_optimizer, make_update, replicate, shard_batch

    mesh = data_mesh(8)
    if kind == "update":
        from perleaf_compile import bert_like

        shapes = bert_like(size, 128)
        leaf = lambda x: isinstance(x, tuple)  # noqa: E731
        rng = np.random.default_rng(0)
        params = replicate(jax.tree.map(lambda s: rng.standard_normal(s, np.float32) * 0.02, shapes, is_leaf=leaf),
                           mesh)
        grads = shard_batch(jax.tree.map(lambda s: rng.standard_normal((8, *s), np.float32), shapes, is_leaf=leaf),
                            mesh)
        tx = onebit_adam(1e-4, freeze_step=1, fused=form == "fused")
        state, specs = init_optimizer(tx, params, mesh)
        lowered = jax.jit(make_update(tx, mesh, specs, per_phase=False)).lower(params, state, grads)
    else:
        sizes = [128 * 128, 128, 128 * 512, 512]
        xs = [jnp.zeros((8, sizes[i % 4]), jnp.float32) for i in range(size)]
        if form == "flat":
            xs = [jnp.concatenate(xs, axis=1)]
        xs = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in xs]

        def body(xs):
            return [x * 2.0 + 1.0 for x in xs]

        fn = jax.jit(body) if form == "jit" else jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(P("data"),), out_specs=P("data")))
        lowered = fn.lower(xs)
    print("compiling the measured program", file=sys.stderr, flush=True)  # the log after this line is its own
    t0 = time.perf_counter()
    lowered.compile()
    print(f"compile {time.perf_counter() - t0:.3f}", flush=True)


def measure(kind: str, size: int, form: str) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="hlo_pass_pipeline=1,cpu_compiler=1")
    out = subprocess.run([sys.executable, __file__, "--child", kind, str(size), form], env=env,
                         capture_output=True, text=True, timeout=3600)
    m = re.search(r"^compile ([0-9.]+)$", out.stdout, re.M)
    if out.returncode or m is None:
        raise RuntimeError(f"{kind} {size} {form} failed:\n{(out.stdout + out.stderr)[-3000:]}")
    log = out.stderr.split("compiling the measured program", 1)[-1]
    passes, codegen, _ = xla_compile_times(log)
    top = dict(sorted(passes.items(), key=lambda kv: -kv[1])[:5])
    return {"kind": kind, "size": size, "form": form, "compile_s": float(m.group(1)),
            "passes_s": sum(passes.values()), "top_passes_s": top, "codegen_s": codegen}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--leaves", type=int, default=200)
    ap.add_argument("--arrays", type=int, nargs="+", default=[400, 800, 1600])
    args = ap.parse_args()
    sys.path.insert(0, str(HERE.parent))
    from benchmarks.report import result_path, run_meta

    rows = [measure("update", args.leaves, form) for form in ("perleaf", "fused")]
    for n in args.arrays:
        rows += [measure("boundary", n, form) for form in ("shard_map", "jit", "flat")]
    print("| case | arrays / leaves | form | compile s | HLO passes s | largest passes (s) | LLVM code s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        top = ", ".join(f"{k} {v:.1f}" for k, v in list(r["top_passes_s"].items())[:3])
        print(f"| {r['kind']} | {r['size']:,} | {r['form']} | {r['compile_s']:.1f} | {r['passes_s']:.1f} | {top} | "
              f"{r['codegen_s']:.1f} |")
    path = result_path("compile_profile")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": run_meta(), "leaves": args.leaves, "rows": rows}, indent=2) + "\n")
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
