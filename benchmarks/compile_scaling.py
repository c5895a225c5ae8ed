"""Compile time and peak compile memory of the 1-bit Adam step as the number of leaves grows, per leaf and fused.

Each case compiles in a fresh subprocess, so its peak memory is its own (the child's maximum resident set size,
with the resident size just before compiling beside it): the synthetic BERT-like tree of ``perleaf_compile.py``
with ``N`` leaves (hidden 128), 8 simulated CPU devices, and the **compression-stage program** of
``make_update`` (the program jonebit's step builders run on every step after the freeze; the warmup program is
plain Adam and smaller) for 1-bit Adam per leaf (the default) and fused, lowered from abstract arguments (no
gradient buffers held) and compiled. ``optax.adamw`` with an fp32 mean allreduce is the scale.

    python benchmarks/compile_scaling.py [--leaves 200 2000] [--forms perleaf fused adamw]
    python benchmarks/compile_scaling.py --src /path/to/older/checkout --tag before   # the same cases, older code
    python benchmarks/compile_scaling.py --leaves 2000 --forms perleaf_gspmd slices_distinct slices_same --tag probes

The probes: ``perleaf_gspmd`` is the per-leaf program compiled with JAX's older GSPMD partitioner instead of Shardy
(a global JAX setting; jonebit does not change it); ``slices_distinct`` / ``slices_same`` what LLVM's code
generation costs per kernel; ``shardmap_one`` / ``shardmap_chunks`` what Shardy costs per ``shard_map`` operand
(``_probe``):

    python benchmarks/compile_scaling.py --leaves 500 1000 2000 --forms shardmap_one shardmap_chunks --tag shardy

Writes ``results/compile_scaling/<tag or compile_scaling>.json``; prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from report import xla_compile_times  # noqa: E402

FORMS = ("perleaf", "fused", "adamw", "perleaf_gspmd")
# Probes of the compiler, not of an optimizer (results/compile_scaling/probes.json).
PROBES = ("slices_distinct", "slices_same", "shardmap_one", "shardmap_chunks")
_CHUNK = 100  # leaves per shard_map in the shardmap_chunks probe
_MARK = "compiling the measured program"


def _child(leaves: int, form: str) -> None:
    """Compiles one case in this (fresh) process; prints one JSON line."""
    src = os.environ.get("JONEBIT_SRC")
    sys.path.insert(0, str(HERE))
    if src:
        sys.path.insert(0, src)
    import common  # noqa: F401  (8 CPU devices)
    import jax
    import optax
    from common import abstract, abstract_state
    from jax.sharding import PartitionSpec as P
    from perleaf_compile import bert_like

    import jonebit
    from jonebit.train.data_parallel import data_mesh, make_update

    if form in PROBES:
        t0 = time.perf_counter()
        lowered, arguments = _probe(leaves, form), leaves
    else:
        if form == "perleaf_gspmd":
            jax.config.update("jax_use_shardy_partitioner", False)
        mesh = data_mesh(8)
        shapes = bert_like(leaves, 128)
        params = abstract(shapes, mesh)
        grads = abstract(shapes, mesh, spec=P("data"), lead=8)
        if form == "adamw":
            tx, reduce, phases = optax.adamw(1e-4), "mean", None
        else:
            tx = jonebit.onebit_adam(1e-4, freeze_step=1, fused=form == "fused")
            reduce, phases = None, ((jonebit.OneBitAdamState, "compression"),)
        state, specs = abstract_state(tx, params, mesh)
        update = make_update(tx, mesh, specs, grad_reduce=reduce)
        t0 = time.perf_counter()
        lowered = update.lower(params, state, grads, phases=phases) if phases else update.lower(params, state, grads)
        arguments = len(jax.tree.leaves((params, state, grads)))
    t1 = time.perf_counter()
    print(_MARK, file=sys.stderr, flush=True)  # XLA's log after this line is the measured program's
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    compiled = lowered.compile()
    t2 = time.perf_counter()
    text = compiled.as_text()
    ops = sum(1 for line in text.splitlines() if " = " in line and not line.lstrip().startswith(("HloModule", "//")))
    print(json.dumps({"leaves": leaves, "form": form, "lower_s": t1 - t0, "compile_s": t2 - t1,
                      "rss_before_gib": rss_before,
                      "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                      "hlo_ops": ops, "arguments": arguments}))


def _probe(n: int, form: str):
    """What a kernel costs to generate: ``n`` outputs, each ``where(y_j > 0, x_j, 0)`` of 4,096 floats, with ``x_j``
    row ``j`` of one ``(n, 4096)`` array (``slices_distinct``: the row offset is a constant of each kernel, so ``n``
    kernels) or its own array (``slices_same``: one kernel, reused ``n`` times); lowered, to be compiled."""
    import jax
    import jax.numpy as jnp

    def distinct(x, ys):
        return [jnp.where(ys[j] > 0, x[j], 0.0) for j in range(n)]

    def same(xs, ys):
        return [jnp.where(ys[j] > 0, xs[j], 0.0) for j in range(n)]

    if form.startswith("shardmap"):
        return _shardmap_probe(n, form == "shardmap_chunks")
    row = jax.ShapeDtypeStruct((4096,), jnp.float32)
    if form == "slices_distinct":
        return jax.jit(distinct).lower(jax.ShapeDtypeStruct((n, 4096), jnp.float32), [row] * n)
    return jax.jit(same).lower([row] * n, [row] * n)


def _shardmap_probe(n: int, chunked: bool):
    """SGD with an fp32 mean allreduce on the ``n``-leaf tree of ``perleaf_compile.py`` (``x - 0.1 pmean(g)`` per
    leaf, 8 devices): the whole tree in one ``shard_map`` (``2n`` operands, ``n`` results), or the same computation
    as one ``shard_map`` per ``_CHUNK`` leaves. Per leaf the two programs are the same; only how many operands one
    manual computation carries differs."""
    import jax
    from common import abstract
    from jax.sharding import PartitionSpec as P
    from perleaf_compile import bert_like

    from jonebit.train.data_parallel import data_mesh

    mesh = data_mesh(8)
    shapes = bert_like(n, 128)
    params, grads = abstract(shapes, mesh), abstract(shapes, mesh, spec=P("data"), lead=8)

    def body(xs, gs):
        return [x - 0.1 * jax.lax.pmean(g[0], "data") for x, g in zip(xs, gs, strict=True)]

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())

    def step(xs, gs):
        xs, gs = jax.tree.leaves(xs), jax.tree.leaves(gs)
        size = _CHUNK if chunked else len(xs)
        return [y for i in range(0, len(xs), size) for y in mapped(xs[i:i + size], gs[i:i + size])]

    return jax.jit(step, donate_argnums=0).lower(params, grads)


def _where_the_time_goes(log: str) -> dict:
    """The row's share of XLA's log: HLO passes (Shardy and the SPMD partitioner among them), LLVM, kernels."""
    passes, codegen, kernels = xla_compile_times(log)
    return {"passes_s": sum(passes.values()), "shardy_s": passes.get("shardy-xla", 0.0),
            "spmd_s": passes.get("spmd-partitioning", 0.0), "codegen_s": codegen, "kernels": kernels}


def measure(leaves: int, form: str, src: str | None, timeout: float) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="hlo_pass_pipeline=1,cpu_compiler=1")
    if src:
        env["JONEBIT_SRC"] = src
    out = subprocess.run([sys.executable, __file__, "--child", str(leaves), form], env=env, capture_output=True,
                         text=True, timeout=timeout)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{leaves} leaves, {form}: exit {out.returncode}\n{(out.stdout + out.stderr)[-3000:]}")
    return {**json.loads(lines[-1]), **_where_the_time_goes(out.stderr.split(_MARK, 1)[-1])}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(int(sys.argv[2]), sys.argv[3])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--leaves", type=int, nargs="+", default=[200, 2000])
    ap.add_argument("--forms", nargs="+", choices=FORMS + PROBES, default=list(FORMS[:3]),
                    help="perleaf_gspmd: perleaf compiled with JAX's older GSPMD partitioner instead of Shardy")
    ap.add_argument("--src", help="a jonebit checkout to measure instead of this one (its jonebit package is used)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per case before it is abandoned")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from common import table, write_json

    src = None
    if args.src:
        head = subprocess.run(["git", "-C", args.src, "rev-parse", "HEAD"], capture_output=True, text=True)
        src = {"path": args.src, "commit": head.stdout.strip() or None}
    rows = []
    for leaves in args.leaves:
        for form in args.forms:
            print(f"compiling {leaves} leaves, {form} ...", flush=True)
            rows.append(measure(leaves, form, args.src, args.timeout))
            for row in rows:
                fused = next((r for r in rows if r["leaves"] == row["leaves"] and r["form"] == "fused"), None)
                row["vs_fused"] = row["compile_s"] / fused["compile_s"] if fused else None
            print(json.dumps(rows[-1]), flush=True)
            # Rewritten after every case: an interrupted study keeps what it measured.
            path = write_json("compile_scaling", tag=args.tag, payload={"source": src, "rows": rows,
                                                                        "complete": False})
    columns = [("leaves", "leaves"), ("form", "form"), ("arguments", "program arguments"),
               ("lower_s", "lower s"), ("compile_s", "compile s"), ("vs_fused", "x fused"),
               ("peak_rss_gib", "peak RSS GiB"), ("rss_before_gib", "RSS before compile GiB"), ("hlo_ops", "HLO ops"),
               ("passes_s", "HLO passes s"), ("shardy_s", "Shardy s"), ("spmd_s", "SPMD s"),
               ("codegen_s", "LLVM s"), ("kernels", "kernels")]
    print(table(rows, columns))
    path = write_json("compile_scaling", tag=args.tag, payload={"source": src, "rows": rows, "complete": True})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
