"""Compile time and step time of per-leaf 1-bit Adam (``fused=False``), per-buffer programs vs grouped.

OLD: every leaf's compress / scale / decode work is emitted on its own (``jonebit.comm.compressed._GROUP_BUFFERS =
False``, the implementation before grouping). NEW: leaves of the same size are compressed as one stacked batch
(``jax.vmap`` of the same computation), so the program grows with the number of distinct leaf sizes.

A synthetic BERT-like tree (per layer: 4 [H,H] kernels, 4 [H] biases, 4 [H] layer-norm vectors, [H,4H], [4H],
[4H,H], [H]; cycled and truncated to the leaf count) on simulated CPU devices; the full onebit_adam update in
its compression stage. OLD and NEW are compiled (``lower().compile()``) and timed alternately, several repeats
(the machine is shared: medians and spread). Also checks that OLD and NEW give the same bits.

    python benchmarks/perleaf_compile.py [--leaves 50 400] [--hidden 128] [--compiles 3] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401  (sets the CPU device count before jax starts)
import jax
import numpy as np
from common import count, table, write_json

import jonebit.comm.compressed as compressed
from jonebit import onebit_adam
from jonebit.train.data_parallel import data_mesh, init_optimizer, make_update, replicate, shard_batch


def bert_like(leaves: int, hidden: int) -> dict:
    h, ff = hidden, 4 * hidden
    layer = [*[(f"{n}_kernel", (h, h)) for n in "qkvo"], *[(f"{n}_bias", (h,)) for n in "qkvo"],
             ("ln1_scale", (h,)), ("ln1_bias", (h,)), ("ln2_scale", (h,)), ("ln2_bias", (h,)),
             ("ff1_kernel", (h, ff)), ("ff1_bias", (ff,)), ("ff2_kernel", (ff, h)), ("ff2_bias", (h,))]
    tree, i = {}, 0
    while i < leaves:
        name, shape = layer[i % len(layer)]
        tree.setdefault(f"layer_{i // len(layer):03d}", {})[name] = shape
        i += 1
    return tree


def hlo_ops(text: str) -> int:
    """Instructions in an HLO module's text (lines ``name = type op(...)``, all computations)."""
    return sum(1 for line in text.splitlines() if " = " in line and not line.lstrip().startswith(("HloModule", "//")))


class Mode:
    def __init__(self, grouped: bool, shapes, mesh, seed: int):
        self.grouped = grouped
        rng = np.random.default_rng(seed)
        leaf = lambda x: isinstance(x, tuple)  # noqa: E731
        with self.active():
            tx = onebit_adam(1e-4, freeze_step=1, fused=False)
            self.params = replicate(jax.tree.map(lambda s: rng.standard_normal(s, np.float32) * 0.02, shapes,
                                                 is_leaf=leaf), mesh)
            self.state, specs = init_optimizer(tx, self.params, mesh)
            self.grads = shard_batch(jax.tree.map(lambda s: rng.standard_normal((mesh.size, *s), np.float32),
                                                  shapes, is_leaf=leaf), mesh)
            self.update = make_update(tx, mesh, specs)
        self.compile_s, self.step_s = [], []

    def active(self):
        mode = self

        class _Ctx:
            def __enter__(self):
                self.saved = compressed._GROUP_BUFFERS
                compressed._GROUP_BUFFERS = mode.grouped

            def __exit__(self, *exc):
                compressed._GROUP_BUFFERS = self.saved

        return _Ctx()

    def compile(self):
        jax.clear_caches()  # otherwise a second compile of the same program is a cache hit
        with self.active():
            t0 = time.perf_counter()
            lowered = jax.jit(self.update).lower(self.params, self.state, self.grads)
            t1 = time.perf_counter()
            compiled = lowered.compile()
            self.compile_s.append(time.perf_counter() - t1)
            self.lower_s = t1 - t0
            self.ops = hlo_ops(compiled.as_text())
            self.stablehlo_ops = sum(1 for line in lowered.as_text().splitlines() if " = " in line)

    def step(self, timed: bool):
        with self.active():
            t0 = time.perf_counter()
            self.params, self.state = jax.block_until_ready(self.update(self.params, self.state, self.grads))
            if timed:
                self.step_s.append(time.perf_counter() - t0)


def spread(v, scale=1.0, digits=1):
    return f"{scale * min(v):.{digits}f}-{scale * max(v):.{digits}f}"


def sci(x):
    return f"{x:.1e}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--leaves", type=int, nargs="+", default=[50, 400])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--compiles", type=int, default=3, help="compilations per mode (alternating)")
    ap.add_argument("--repeats", type=int, default=15, help="timed steps per mode (alternating)")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--tag", default="", help="result file name (results/perleaf_compile/TAG.json)")
    args = ap.parse_args()
    mesh = data_mesh(args.devices)
    rows, raw = [], {}
    for leaves in args.leaves:
        shapes = bert_like(leaves, args.hidden)
        modes = {"OLD": Mode(False, shapes, mesh, 0), "NEW": Mode(True, shapes, mesh, 0)}
        for _ in range(args.compiles):
            for m in modes.values():
                m.compile()
        # Warmup (the first update is 1-bit Adam's warmup stage) and the first compression step, then the two
        # runs must agree bit for bit: same seeds, same data.
        for _ in range(3):
            for m in modes.values():
                m.step(False)
        same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
            jax.tree.leaves((modes["OLD"].params, modes["OLD"].state)),
            jax.tree.leaves((modes["NEW"].params, modes["NEW"].state)), strict=True))
        # Largest relative difference of the params after the warmup and two compression steps.
        rel = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b)))
                        / max(float(np.max(np.abs(np.asarray(a)))), 1e-30))
                  for a, b in zip(jax.tree.leaves(modes["OLD"].params), jax.tree.leaves(modes["NEW"].params),
                                  strict=True))
        for _ in range(args.repeats):
            for m in modes.values():
                m.step(True)
        distinct = len({int(np.prod(s)) for s in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))})
        for name, m in modes.items():
            rows.append(dict(leaves=leaves, sizes=distinct, params=count(shapes), impl=name,
                             compile_s=statistics.median(m.compile_s), compile_spread=spread(m.compile_s),
                             lower_s=m.lower_s, ops=m.ops, stablehlo_ops=m.stablehlo_ops,
                             step_ms=1e3 * statistics.median(m.step_s), step_spread=spread(m.step_s, 1e3, 0),
                             bit_identical="yes" if same else "no", params_rel_diff=sci(rel)))
            raw[f"{leaves}/{name}"] = {"compile_s": m.compile_s, "step_s": m.step_s}
        print(table(rows[-2:], COLUMNS), flush=True)
    print(f"\nfused=False onebit_adam update (compression stage), H={args.hidden}, {mesh.size} devices "
          f"({jax.default_backend()}); medians of {args.compiles} compiles / {args.repeats} steps, min-max\n")
    print(table(rows, COLUMNS))
    path = write_json("perleaf_compile", tag=args.tag, payload={
        "hidden": args.hidden, "devices": mesh.size, "compiles": args.compiles, "repeats": args.repeats,
        "rows": rows, "raw": raw})
    print(f"\nwrote {path}")


COLUMNS = [("leaves", "leaves"), ("sizes", "distinct sizes"), ("params", "params"), ("impl", "impl"),
           ("compile_s", "compile s"), ("compile_spread", "min-max"), ("ops", "HLO ops (compiled)"),
           ("stablehlo_ops", "StableHLO ops"), ("step_ms", "step ms"), ("step_spread", "min-max ms"),
           ("bit_identical", "OLD == NEW bits"), ("params_rel_diff", "params max rel diff")]


if __name__ == "__main__":
    main()
