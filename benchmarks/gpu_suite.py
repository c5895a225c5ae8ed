"""One-command GPU benchmark suite: sign packing, the optimizer step and the BERT-base bf16 pre-training step.

Sections (each runs on its own: a failing one records ``{"error": ...}`` and the others still run):

1. ``packing``: ``jonebit.comm.pack_signs`` / ``unpack_signs`` throughput on a large float32 vector, against the
   device's HBM peak and against a plain on-device copy (the achievable bandwidth).
2. ``kernels``: compression's pack-and-error pass, XLA's program (jonebit's) against a Pallas kernel
   (``pallas_pack.py``, the measured alternative): bitwise equality on several sizes, and time, alone and with
   the buffer's norm before it.
3. ``optimizer_step``: 1-bit Adam in its compression stage (per-leaf and fused, each with XLA's pass and the Pallas
   kernel) vs ``optax.adamw`` + fp32 mean allreduce on the BERT-base parameter tree, world size 1 (one-device
   mesh), timed alternately.
4. ``bert_step``: BertForPreTraining (BERT-base, bf16 compute) forward + backward + optimizer, tokens/s and MFU:
   optax.adamw and 1-bit Adam through ``data_parallel.make_step``, 1-bit Adam through the engine's step (on the
   bf16-dtype model, and on a float32-dtype model as ``jonebit pretrain`` builds it).
5. ``environment``: versions, device, command line, seconds per section.

Timed arms alternate step by step and medians are reported, so drift in clocks or load falls on all arms alike.

    python benchmarks/gpu_suite.py                      # GPU, about 6.5 minutes on one H200 (378 s with every section)
    python benchmarks/gpu_suite.py --dry-run --out x.json  # CPU, tiny sizes, same code paths (tens of seconds)
    python benchmarks/gpu_suite.py --sections bert_step    # only the named sections; the others read "skipped"

Writes one JSON file (default ``benchmarks/results/gpu_suite/gpu_suite.json``; the dry run defaults to a temporary
file), rewritten after every section so that an interrupted run keeps what it measured. With ``$OUT`` set and no
``--out``, the JSON is also copied to ``$OUT/gpu_suite.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback

START = time.perf_counter()
ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_suite" / "gpu_suite.json"

# Peaks by jax.devices()[0].device_kind: HBM bytes/s and dense bf16 FLOP/s (vendor datasheets, SXM parts).
PEAKS = {
    "NVIDIA H200": {"hbm_bytes_per_s": 4.8e12, "bf16_flops_per_s": 989e12},
    "NVIDIA H100 80GB HBM3": {"hbm_bytes_per_s": 3.35e12, "bf16_flops_per_s": 989e12},
}

# Problem sizes: the GPU run and the dry run take the same code paths.
SIZES = {
    "gpu": dict(pack_elements=256 * 2**20, tree_config="base", bert_config="base", bert_batch=32, bert_seq=128,
                vocab=None, layers=None, repeats=20, warmup=3),
    "dry": dict(pack_elements=2**20, tree_config="tiny", bert_config="tiny", bert_batch=2, bert_seq=16,
                vocab=2048, layers=1, repeats=3, warmup=3),
}

# Model FLOPs of one training step: 2 per multiply-add, backward = 2x forward, so 6 per parameter per token for the
# dense layers; attention's two s x s products per layer on top; padding and dropout not discounted.
FLOPS_FORMULA = (
    "6 * n_encoder_params * batch * seq  (encoder matmuls, forward + backward)"
    " + 12 * layers * hidden * seq^2 * batch  (attention scores QK^T and PV, forward + backward)"
    " + 6 * batch * masked_per_seq * (hidden^2 + hidden * vocab)  (MLM head at the masked positions)"
    " + 6 * batch * (hidden^2 + 2 * hidden)  (pooler and next-sentence head on [CLS])"
)


SECTIONS = ("packing", "kernels", "optimizer_step", "bert_step")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, same code paths")
    p.add_argument("--out", help=f"JSON path (default {DEFAULT_OUT.relative_to(ROOT)}; dry run: a temporary file)")
    p.add_argument("--repeats", type=int, help="timed repeats per arm (default 20, dry run 3)")
    p.add_argument("--budget-s", type=float, default=420.0, help="skip what is left once this much time has passed")
    p.add_argument("--bert-batch", type=int, help="BERT sequences per step (default 32, dry run 2)")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), metavar="NAME",
                   help=f"run only these sections (default all: {' '.join(SECTIONS)})")
    p.add_argument("--bert-arms", nargs="+", default=None, metavar="ARM",
                   help="run only these arms of the bert_step section (default all)")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.dry_run:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # report.py; common.py is not imported: it would force the CPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pallas_pack as kernels  # noqa: E402
import report as report_md  # noqa: E402
from flax import nnx  # noqa: E402

import jonebit  # noqa: E402
from jonebit.apps.pretrain import make_loss  # noqa: E402
from jonebit.comm import compressed, pack_signs, unpack_signs  # noqa: E402
from jonebit.models.bert import BertConfig, BertForPreTraining  # noqa: E402
from jonebit.train.data_parallel import (  # noqa: E402
    data_mesh,
    init_optimizer,
    make_step,
    make_update,
    replicate,
    shard_batch,
)
from jonebit.train.engine import init_train_state, make_train_step  # noqa: E402
from jonebit.transforms.onebit_adam import OneBitAdamState  # noqa: E402

LR = 1e-4


# ------------------------------------------------------------------------------------------------ helpers
class Clock:
    """Wall time since the process started, against ``--budget-s``."""

    def __init__(self, budget_s: float):
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - START

    def over(self) -> bool:
        return self.elapsed() > self.budget_s


def peaks() -> dict:
    return PEAKS.get(jax.devices()[0].device_kind, {"hbm_bytes_per_s": None, "bf16_flops_per_s": None})


def ratio(a, b):
    return None if a is None or b is None or not b else a / b


def interleave(arms: dict, warmup: int, repeats: int, clock: Clock | None = None):
    """Runs every arm ``warmup`` times (the first call compiles), then times them alternately.

    Each arm is a zero-argument callable that runs one step and blocks until its results are ready. Returns
    ``(times, first)``: the timed seconds per arm, and the seconds of each arm's first call (compilation).
    """
    first = {}
    for name, fn in arms.items():
        for i in range(warmup):
            t0 = time.perf_counter()
            fn()
            if i == 0:
                first[name] = time.perf_counter() - t0
    times: dict[str, list[float]] = {name: [] for name in arms}
    for i in range(repeats):
        if clock is not None and i >= 3 and clock.over():
            break  # a few repeats are enough for a median; keep the rest of the budget for later sections
        for name, fn in arms.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times, first


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    return report_md.table(rows, columns, decimals=3, whole_above=100)


def say(text: str = "") -> None:
    print(text, flush=True)


def finite(obj):
    """``obj`` with non-finite floats replaced by None (strict JSON)."""
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    if isinstance(obj, float | np.floating):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def model_config(size: dict, name: str) -> BertConfig:
    """A BertConfig preset; the dry run shrinks its vocabulary and depth (compile time)."""
    extra = {k: v for k, v in (("vocab_size", size["vocab"]), ("num_hidden_layers", size["layers"])) if v}
    return BertConfig.preset(name, max_position_embeddings=max(512, size["bert_seq"]), **extra)


# ------------------------------------------------------------------------------------------------ 1. packing
def bench_packing(size: dict, repeats: int, clock: Clock) -> dict:
    n = size["pack_elements"]
    x = jax.block_until_ready(jax.random.normal(jax.random.key(0), (n,), jnp.float32))
    pack = jax.jit(pack_signs)
    unpack = jax.jit(unpack_signs, static_argnums=1)
    copy = jax.jit(lambda v: v * 2.0)  # a new buffer: one read and one write of every element
    packed = jax.block_until_ready(pack(x))
    ok = bool(jnp.all(unpack(packed, n) == jnp.where(x >= 0, 1.0, -1.0)))
    arms = {
        "pack": lambda: jax.block_until_ready(pack(x)),
        "unpack": lambda: jax.block_until_ready(unpack(packed, n)),
        "copy": lambda: jax.block_until_ready(copy(x)),
    }
    times, _ = interleave(arms, 2, repeats, clock)
    moved = {"pack": 4 * n + n // 8, "unpack": n // 8 + 4 * n, "copy": 8 * n}  # bytes read + written
    peak = peaks()["hbm_bytes_per_s"]
    copy_bw = moved["copy"] / statistics.median(times["copy"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        bw = moved[name] / med
        rows.append(dict(op=name, ms=1e3 * med, bytes=moved[name], gb_per_s=bw / 1e9,
                         fraction_of_hbm_peak=ratio(bw, peak), fraction_of_copy=ratio(bw, copy_bw)))
    say(f"\n## Sign packing, {n:,} float32 elements (median of {len(times['pack'])})\n")
    say(table(rows, [("op", "op"), ("ms", "median ms"), ("gb_per_s", "GB/s (read + written)"),
                     ("fraction_of_hbm_peak", "of HBM peak"), ("fraction_of_copy", "of copy")]))
    return dict(elements=n, hbm_peak_bytes_per_s=peak, copy_bytes_per_s=copy_bw, roundtrip_ok=ok,
                bytes_counted="float32 input read + uint8 output written (pack), the reverse (unpack), "
                              "float32 read + float32 written (copy: jit(x * 2.0))",
                rows=rows, times_s=times)


# ------------------------------------------------------------------------------------------------ 2. kernels
def with_gpu_impl(impl: str, fn):
    """``fn`` run with compression's pack-and-error pass replaced by ``impl``'s (:mod:`pallas_pack`): a step traced
    inside (its first call) keeps it; ``"pallas"`` on a GPU, the interpreter elsewhere."""
    impl = impl if jax.default_backend() == "gpu" else "pallas_interpret"

    def run():
        old, compressed._compress = compressed._compress, kernels.compress_with(impl)
        try:
            return fn()
        finally:
            compressed._compress = old

    return run


def entry_fusions(compiled_text: str) -> int:
    """Kernels XLA launches for a program: fusions and custom calls in its ENTRY computation."""
    entry = compiled_text[compiled_text.index("ENTRY"):]
    body = entry[:entry.index("\n}")]
    return sum(1 for line in body.splitlines() if " fusion(" in line or "custom-call(" in line)


def bench_kernels(size: dict, repeats: int, clock: Clock) -> dict:
    """The compression pass after the scale: XLA's program against the Pallas kernel, bits and speed."""
    gpu = jax.default_backend() == "gpu"
    pallas = "pallas" if gpu else "pallas_interpret"
    n = size["pack_elements"]
    checks = {}
    for m in (8, 24_016, 2**20 + 8, n):  # a partial last block, a 2^k + 8 tail, the timed size
        x = jax.random.normal(jax.random.key(m), (m,), jnp.float32).at[:2].set(jnp.array([0.0, -0.0]))
        s = jnp.linalg.norm(x) / np.float32(math.sqrt(m))
        a = jax.jit(lambda x, s: kernels.pack_with_error(x, s, impl="xla"))(x, s)
        b = jax.jit(lambda x, s, i=pallas: kernels.pack_with_error(x, s, impl=i))(x, s)
        checks[str(m)] = same_bits(a, b)
    xs = jax.random.normal(jax.random.key(7), (3, 24_016), jnp.float32)
    ss = jnp.array([0.5, 1.0, 2.0], jnp.float32)
    va = jax.vmap(lambda x, s: kernels.pack_with_error(x, s, impl="xla"))(xs, ss)
    vb = jax.vmap(lambda x, s: kernels.pack_with_error(x, s, impl=pallas))(xs, ss)
    checks["vmap_3x24016"] = same_bits(va, vb)

    x = jax.block_until_ready(jax.random.normal(jax.random.key(0), (n,), jnp.float32))
    e = jax.block_until_ready(jax.random.normal(jax.random.key(1), (n,), jnp.float32) * 0.01)
    s = jnp.float32(0.8)
    fns = {
        "pass_xla": jax.jit(lambda x, s: kernels.pack_with_error(x, s, impl="xla")),
        "pass_pallas": jax.jit(lambda x, s: kernels.pack_with_error(x, s, impl=pallas)),
    }

    def compress(impl):  # the whole worker compression of one buffer: x + e, its norm, signs and new error
        def f(x, e):
            buf = x + e
            scale = jnp.linalg.norm(buf) / np.float32(math.sqrt(n))
            packed, err = kernels.pack_with_error(buf, scale, impl=impl)
            return scale, packed, err
        return jax.jit(f)

    fns["compress_xla"], fns["compress_pallas"] = compress("xla"), compress(pallas)
    args = {"pass_xla": (x, s), "pass_pallas": (x, s), "compress_xla": (x, e), "compress_pallas": (x, e)}
    fusions = {k: entry_fusions(f.lower(*args[k]).compile().as_text()) for k, f in fns.items()}
    arms = {k: (lambda k=k: jax.block_until_ready(fns[k](*args[k]))) for k in fns}
    times, _ = interleave(arms, 2, repeats, clock)
    minimum = {"pass_xla": 4 * n + 4 * n + n // 8, "compress_xla": 8 * n + 4 * n + n // 8}
    minimum["pass_pallas"], minimum["compress_pallas"] = minimum["pass_xla"], minimum["compress_xla"]
    rows = []
    for k, ts in times.items():
        med = statistics.median(ts)
        rows.append(dict(arm=k, ms=1e3 * med, kernels=fusions[k], gb_per_s=minimum[k] / med / 1e9,
                         fraction_of_hbm_peak=ratio(minimum[k] / med, peaks()["hbm_bytes_per_s"])))
    say(f"\n## Pack-and-error pass, {n:,} float32 elements (median of {len(times['pass_xla'])}); bits equal: "
        f"{checks}\n")
    say(table(rows, [("arm", "arm"), ("ms", "median ms"), ("kernels", "kernels"),
                     ("gb_per_s", "GB/s (minimum bytes)"), ("fraction_of_hbm_peak", "of HBM peak")]))
    med = {k: statistics.median(v) for k, v in times.items()}
    return dict(elements=n, pallas_impl=pallas, bitwise_equal=checks, all_bitwise_equal=all(checks.values()),
                bytes_counted="the least a pass can move: pass = x read, error written (4 + 4 bytes per element) "
                              "and packed bits written; compress = x and e read, error and bits written",
                rows=rows, speedup_pass=ratio(med["pass_xla"], med["pass_pallas"]),
                speedup_compress=ratio(med["compress_xla"], med["compress_pallas"]), times_s=times)


def same_bits(a, b) -> bool:
    """Whether two trees hold the same values bit for bit (floats compared as their bits: NaN equals itself)."""
    def bits(x):
        return jax.lax.bitcast_convert_type(x, jnp.uint32) if x.dtype == jnp.float32 else x

    return all(bool(jnp.array_equal(bits(x), bits(y)))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


# ------------------------------------------------------------------------------------------------ 3. optimizer
def param_shapes(config: BertConfig) -> dict:
    """Parameter shapes of BertForPreTraining by parameter path, a flat tree (nothing allocated)."""
    abstract = nnx.eval_shape(lambda: BertForPreTraining(config, rngs=nnx.Rngs(0)))
    params = nnx.split(abstract, nnx.Param, ...)[1]
    return {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(params)}


def random_tree(shapes: dict, key, lead: tuple = (), scale: float = 1.0) -> dict:
    keys = jax.random.split(key, len(shapes))
    return {name: jax.random.normal(k, lead + s, jnp.float32) * scale
            for k, (name, s) in zip(keys, shapes.items(), strict=True)}


def onebit_count(opt_state) -> int | None:
    is_state = lambda n: isinstance(n, OneBitAdamState)
    found = [n for n in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(n)]
    return int(np.max(np.asarray(found[0].count))) if found else None


def bench_optimizer(size: dict, repeats: int, clock: Clock) -> dict:
    mesh = data_mesh(1)
    shapes = param_shapes(model_config(size, size["tree_config"]))
    n_params = sum(math.prod(s) for s in shapes.values())
    base = random_tree(shapes, jax.random.key(1), scale=0.02)
    grads = shard_batch(random_tree(shapes, jax.random.key(2), lead=(mesh.size,)), mesh)
    specs_arms = {
        "onebit_adam": (jonebit.onebit_adam(LR, freeze_step=1), None),
        "onebit_adam_fused": (jonebit.onebit_adam(LR, freeze_step=1, fused=True), None),
        "adamw_allreduce_fp32": (optax.adamw(LR), "mean"),
        # The same two 1-bit steps with the pack-and-error pass as the Pallas kernel (on a GPU; XLA elsewhere).
        "onebit_adam_pallas": (jonebit.onebit_adam(LR, freeze_step=1), None),
        "onebit_adam_fused_pallas": (jonebit.onebit_adam(LR, freeze_step=1, fused=True), None),
    }
    carry, arms, updates = {}, {}, {}
    for name, (tx, reduce) in specs_arms.items():
        params = replicate(base, mesh)
        state, specs = init_optimizer(tx, params, mesh)
        updates[name] = make_update(tx, mesh, specs, grad_reduce=reduce)
        carry[name] = (params, state)

        def run(name=name):
            carry[name] = jax.block_until_ready(updates[name](*carry[name], grads))

        arms[name] = with_gpu_impl("pallas", run) if name.endswith("_pallas") else run
    times, first = interleave(arms, size["warmup"], repeats, clock)
    base_ms = statistics.median(times["adamw_allreduce_fp32"])
    rows = [dict(arm=k, ms=1e3 * statistics.median(v), ratio_to_adamw=statistics.median(v) / base_ms,
                 first_call_s=first[k]) for k, v in times.items()]
    counts = {k: onebit_count(carry[k][1]) for k in carry}
    # Every arm ran the same steps on the same gradients: the kernel's arms must hold the same parameters, bit for bit.
    same = {f"{k}_vs_{k}_pallas": same_bits(carry[k][0], carry[f"{k}_pallas"][0])
            for k in ("onebit_adam", "onebit_adam_fused")}
    say(f"parameters bit for bit equal with the Pallas pass: {same}")
    say(f"\n## Optimizer step, {n_params:,} params ({size['tree_config']} BertForPreTraining tree), world size "
        f"{mesh.size}, median of {len(times['adamw_allreduce_fp32'])}\n")
    say(table(rows, [("arm", "arm"), ("ms", "median ms"), ("ratio_to_adamw", "ratio to adamw + allreduce"),
                     ("first_call_s", "first call s")]))
    return dict(params=n_params, tree=f"BertForPreTraining {size['tree_config']}", world_size=mesh.size,
                freeze_step=1, onebit_count_after=counts, pallas_params_bitwise_equal=same,
                note="world size 1: the collectives are trivial, so this is the compression's compute overhead",
                rows=rows, times_s=times,
                **{f"ratio_{k.replace('onebit_adam', 'onebit')}_over_adamw": r["ratio_to_adamw"]
                   for k, r in zip(times, rows, strict=True) if k != "adamw_allreduce_fp32"})


# ------------------------------------------------------------------------------------------------ 4. BERT step
def pretraining_batch(config: BertConfig, batch: int, seq: int, seed: int = 0) -> dict:
    """A random batch in the gather form of ``jonebit.data.pretraining.collate`` (the pre-training pipeline's)."""
    rng = np.random.default_rng(seed)
    per_seq = min(20, max(2, math.ceil(0.15 * seq)))  # max_predictions_per_seq: Google's 20 at seq 128
    lengths = rng.integers(seq // 2, seq + 1, batch)
    lengths[0] = seq
    ids = rng.integers(min(1000, config.vocab_size // 2), config.vocab_size, (batch, seq)).astype(np.int32)
    attention = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int32)
    types = (np.arange(seq)[None, :] >= (lengths[:, None] // 2)).astype(np.int32) * attention
    positions = np.zeros((batch, per_seq), np.int32)
    weights = np.zeros((batch, per_seq), np.float32)
    for r, length in enumerate(lengths):
        k = min(per_seq, max(1, round(0.15 * length)), int(length) - 1)  # as the pipeline masks
        positions[r, :k] = np.sort(rng.choice(np.arange(1, length), k, replace=False))
        weights[r, :k] = 1.0
    return {
        "input_ids": ids * attention,
        "attention_mask": attention,
        "token_type_ids": types,
        "next_sentence_label": rng.integers(0, 2, batch).astype(np.int32),
        "masked_lm_positions": positions,
        "masked_lm_ids": np.take_along_axis(ids, positions, axis=1),
        "masked_lm_weights": weights,
    }


def model_flops(config: BertConfig, n_encoder: int, batch: int, seq: int, per_seq: int) -> float:
    """Training FLOPs of one step; see FLOPS_FORMULA."""
    h, v = config.hidden_size, config.vocab_size
    return (6 * n_encoder * batch * seq + 12 * config.num_hidden_layers * h * seq**2 * batch
            + 6 * batch * per_seq * (h * h + h * v) + 6 * batch * (h * h + 2 * h))


def forward_dots(loss_rng, params, batch, cast=None) -> dict[str, int]:
    """How many matmuls (``dot_general``) of each operand-dtype pair the forward pass traces, params cast to
    ``cast`` first (as the engine's ``compute_dtype`` does): what precision an arm really computes in."""
    def loss(p):
        p = p if cast is None else jax.tree.map(lambda x: x.astype(cast), p)
        return loss_rng(p, batch, jax.random.key(0))

    found: dict[str, int] = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                key = " x ".join(str(v.aval.dtype) for v in eqn.invars)
                found[key] = found.get(key, 0) + 1
            for value in eqn.params.values():
                for sub in value if isinstance(value, list | tuple) else (value,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        walk(sub)

    try:
        walk(jax.make_jaxpr(loss)(params).jaxpr)
    except Exception as e:  # informative only: never lose the section's timings to it
        return {"error": f"{type(e).__name__}: {e}"}
    return found


def split_model(config: BertConfig, dtype):
    model = BertForPreTraining(config, dtype=dtype, rngs=nnx.Rngs(params=0, dropout=1))
    graphdef, params, keys, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
    return graphdef, params, keys, rest


def make_step_arm(loss_rng, params, tx, reduce, mesh, batch):
    """A ``data_parallel.make_step`` arm: fp32 master params, the model's own bf16 casts."""
    p = replicate(params, mesh)
    state, specs = init_optimizer(tx, p, mesh)
    step = make_step(lambda prm, b: loss_rng(prm, b, jax.random.key(0)), tx, mesh, specs, grad_reduce=reduce)
    carry = {"c": (p, state), "loss": None}

    def run():
        prm, st, loss = jax.block_until_ready(step(*carry["c"], batch))
        carry["c"], carry["loss"] = (prm, st), loss

    return run, carry, lambda: onebit_count(carry["c"][1])


def engine_arm(loss_rng, params, tx, mesh, batch, grad_reduce=None, compute_dtype="bfloat16", rng_seed=0):
    """The engine's step (``make_train_step``) with ``compute_dtype="bfloat16"``, dropout keys from the engine;
    ``grad_reduce="mean"`` for a standard optimizer (1-bit Adam reduces its own gradient). ``compute_dtype=None``:
    the parameters reach the model in float32 and its layers cast them (as in ``make_step``); ``rng_seed=None``:
    one fixed dropout key (as in ``make_step``), not one derived per step and rank."""
    state, specs = init_train_state(tx, params, mesh)
    loss = loss_rng if rng_seed is not None else (lambda p, b: loss_rng(p, b, jax.random.key(0)))
    step = make_train_step(loss, tx, mesh, specs, compute_dtype=compute_dtype, rng_seed=rng_seed,
                           grad_reduce=grad_reduce)
    carry = {"c": state, "loss": None}

    def run():
        st, metrics = jax.block_until_ready(step(carry["c"], batch))
        carry["c"], carry["loss"] = st, metrics["loss"]

    return run, carry, lambda: onebit_count(carry["c"].opt_state)


def pallas_arm(built):
    run, carry, count = built
    return with_gpu_impl("pallas", run), carry, count


BERT_ARMS = ("adamw_make_step", "onebit_make_step", "onebit_make_step_pallas", "onebit_engine", "adamw_engine",
             "adamw_engine_model_casts", "adamw_engine_fixed_key")


def bench_bert(size: dict, repeats: int, clock: Clock, batch_size: int, only=BERT_ARMS) -> dict:
    mesh = data_mesh(1)
    seq = size["bert_seq"]
    config = model_config(size, size["bert_config"])
    host_batch = pretraining_batch(config, batch_size, seq)
    batch = shard_batch(host_batch, mesh)
    bf16 = split_model(config, jnp.bfloat16)
    loss_bf16 = make_loss(bf16[0], bf16[2], bf16[3])  # (graphdef, keys, rest): the pre-training loss, dropout on
    # Two warmup steps before the freeze: with the variance of a single step, a fixed batch and bf16, 1-bit Adam's
    # loss went to nan (first H200 run). The arms' untimed calls cover the warmup, so every timed step compresses.
    onebit = lambda: jonebit.onebit_adam(LR, freeze_step=2)
    mixed = ("model dtype bfloat16, param_dtype float32: fp32 master params, every dense layer casts its kernel and "
             "input to bf16 (LayerNorm statistics, attention softmax and head logits fp32)")
    # name: (precision, builder, forward matmul dtypes)
    specs = {
        "adamw_make_step": (mixed + "; optax.adamw + fp32 mean allreduce",
                            lambda: make_step_arm(loss_bf16, bf16[1], optax.adamw(LR), "mean", mesh, batch),
                            lambda: forward_dots(loss_bf16, bf16[1], host_batch)),
        "onebit_make_step": (mixed + "; 1-bit Adam (compression stage)",
                             lambda: make_step_arm(loss_bf16, bf16[1], onebit(), None, mesh, batch),
                             lambda: forward_dots(loss_bf16, bf16[1], host_batch)),
        "onebit_make_step_pallas": (mixed + "; 1-bit Adam (compression stage), pack-and-error pass as the Pallas "
                                    "kernel",
                                    lambda: pallas_arm(make_step_arm(loss_bf16, bf16[1], onebit(), None, mesh, batch)),
                                    lambda: forward_dots(loss_bf16, bf16[1], host_batch)),
        "onebit_engine": ("engine compute_dtype=bfloat16 (params cast to bf16 before the forward, grads summed in "
                          "fp32) on the bf16-dtype model; 1-bit Adam (compression stage)",
                          lambda: engine_arm(loss_bf16, bf16[1], onebit(), mesh, batch),
                          lambda: forward_dots(loss_bf16, bf16[1], host_batch, jnp.bfloat16)),
        "adamw_engine": ("engine compute_dtype=bfloat16 on the bf16-dtype model; optax.adamw + fp32 mean allreduce",
                         lambda: engine_arm(loss_bf16, bf16[1], optax.adamw(LR), mesh, batch, "mean"),
                         lambda: forward_dots(loss_bf16, bf16[1], host_batch, jnp.bfloat16)),
        # Where the engine's time goes beyond make_step's: its up-front cast of the parameters, its dropout keys.
        "adamw_engine_model_casts": (mixed + "; engine without compute_dtype (the model's own casts, as make_step); "
                                     "optax.adamw + fp32 mean allreduce",
                                     lambda: engine_arm(loss_bf16, bf16[1], optax.adamw(LR), mesh, batch, "mean",
                                                        compute_dtype=None),
                                     lambda: forward_dots(loss_bf16, bf16[1], host_batch)),
        "adamw_engine_fixed_key": ("engine compute_dtype=bfloat16, one fixed dropout key (as make_step); optax.adamw "
                                   "+ fp32 mean allreduce",
                                   lambda: engine_arm(loss_bf16, bf16[1], optax.adamw(LR), mesh, batch, "mean",
                                                      rng_seed=None),
                                   lambda: forward_dots(loss_bf16, bf16[1], host_batch, jnp.bfloat16)),
    }
    assert tuple(specs) == BERT_ARMS
    arms, carries, counts, first, skipped, failed = {}, {}, {}, {}, [], {}
    for name, (_, build, _) in specs.items():
        if name not in only:
            continue
        if clock.over():
            skipped.append(name)
            continue
        t0 = time.perf_counter()
        try:
            arm, carries[name], counts[name] = build()
            arm()  # compiles now, so that the time guard sees it
        except Exception as e:  # the other arms still run
            traceback.print_exc()
            failed[name] = f"{type(e).__name__}: {e}"
            say(f"  {name}: FAILED, {failed[name]}")
            continue
        arms[name] = arm
        first[name] = time.perf_counter() - t0
        say(f"  {name}: built and compiled in {first[name]:.1f} s")
    times, _ = interleave(arms, size["warmup"] - 1, repeats, clock)

    params = bf16[1]
    leaves = jax.tree_util.tree_leaves_with_path(params)
    n_params = sum(x.size for _, x in leaves)
    n_encoder = sum(x.size for p, x in leaves if "encoder" in jax.tree_util.keystr(p))
    per_seq = host_batch["masked_lm_positions"].shape[1]
    flops = model_flops(config, n_encoder, batch_size, seq, per_seq)
    peak = peaks()["bf16_flops_per_s"]
    tokens = batch_size * seq
    results, rows = {}, []
    for name, ts in times.items():
        med = statistics.median(ts)
        results[name] = dict(precision=specs[name][0], median_step_s=med, step_ms=1e3 * med,
                             tokens_per_s=tokens / med, flops_per_s=flops / med, mfu=ratio(flops / med, peak),
                             loss=float(carries[name]["loss"]), build_and_first_step_s=first[name],
                             onebit_count_after=counts[name](), forward_dot_dtypes=specs[name][2](), times_s=ts)
        rows.append(dict(arm=name, **{k: results[name][k] for k in ("step_ms", "tokens_per_s", "mfu", "loss")}))
    say(f"\n## BertForPreTraining ({size['bert_config']}, {n_params:,} params), batch {batch_size} x seq {seq}, "
        f"{per_seq} masked per seq, median of {len(next(iter(times.values()), []))}\n")
    say(table(rows, [("arm", "arm"), ("step_ms", "median ms"), ("tokens_per_s", "tokens/s"), ("mfu", "MFU"),
                     ("loss", "loss")]))
    tps = {k: v["tokens_per_s"] for k, v in results.items()}
    return dict(config=size["bert_config"], vocab_size=config.vocab_size, batch=batch_size, seq=seq,
                masked_per_seq=per_seq, params=n_params, encoder_params=n_encoder, world_size=mesh.size,
                flops_per_step=flops, flops_formula=FLOPS_FORMULA, peak_bf16_flops_per_s=peak,
                dropout="on (the pre-training loss of jonebit.apps.pretrain.make_loss)", arms=results,
                skipped_arms=skipped, failed_arms=failed,
                ratio_onebit_over_adamw_tokens=ratio(tps.get("onebit_make_step"), tps.get("adamw_make_step")),
                ratio_engine_over_make_step_tokens=ratio(tps.get("onebit_engine"), tps.get("onebit_make_step")),
                ratio_onebit_over_adamw_engine_tokens=ratio(tps.get("onebit_engine"), tps.get("adamw_engine")))


# ------------------------------------------------------------------------------------------------ driver
def environment(argv: list[str]) -> dict:
    import flax

    dev = jax.devices()[0]
    return dict(jax=jax.__version__, jaxlib=_jaxlib_version(),
                flax=flax.__version__, optax=optax.__version__, python=platform.python_version(),
                backend=jax.default_backend(), device_kind=dev.device_kind, device_count=jax.device_count(),
                platform=platform.platform(), command=" ".join([sys.executable, *argv]),
                peaks=peaks(), section_seconds={})


def _jaxlib_version():
    try:
        import jaxlib

        return jaxlib.__version__
    except ImportError:
        return None


def write(report: dict, out: pathlib.Path, extra: pathlib.Path | None) -> None:
    text = json.dumps(finite(report), indent=2, allow_nan=False) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    if extra is not None:
        extra.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out, extra)


def main(args: argparse.Namespace, argv: list[str]) -> dict:
    size = dict(SIZES["dry" if args.dry_run else "gpu"])
    repeats = args.repeats or size["repeats"]
    batch_size = args.bert_batch or size["bert_batch"]
    if repeats < 1 or batch_size < 1:
        raise SystemExit("--repeats and --bert-batch must be at least 1")
    bert_arms = tuple(args.bert_arms or BERT_ARMS)
    if set(bert_arms) - set(BERT_ARMS):
        raise SystemExit(f"--bert-arms: unknown {sorted(set(bert_arms) - set(BERT_ARMS))}; choose from "
                         f"{' '.join(BERT_ARMS)}")
    if args.out:
        out, extra = pathlib.Path(args.out), None
    else:
        out = pathlib.Path(tempfile.gettempdir()) / "gpu_suite_dry_run.json" if args.dry_run else DEFAULT_OUT
        extra = pathlib.Path(os.environ["OUT"]) / "gpu_suite.json" if os.environ.get("OUT") else None
    clock = Clock(args.budget_s)
    env = environment(argv)
    report = {"meta": report_md.run_meta(argv), "suite": "gpu_suite", "dry_run": args.dry_run,
              "sizes": {**size, "repeats": repeats, "bert_batch": batch_size, "bert_arms": list(bert_arms)},
              "budget_s": args.budget_s, "environment": env}
    say(f"jonebit GPU suite{' (dry run)' if args.dry_run else ''}: {env['device_kind']} x {env['device_count']} "
        f"({env['backend']}), jax {env['jax']}")
    sections = {
        "packing": lambda: bench_packing(size, repeats, clock),
        "kernels": lambda: bench_kernels(size, repeats, clock),
        "optimizer_step": lambda: bench_optimizer(size, repeats, clock),
        "bert_step": lambda: bench_bert(size, repeats, clock, batch_size, bert_arms),
    }
    for name, run in sections.items():
        t0 = time.perf_counter()
        if name not in args.sections:
            report[name] = {"skipped": "not selected (--sections)"}
            write(report, out, extra)
            continue
        if clock.over():
            report[name] = {"skipped": f"time budget of {args.budget_s:.0f} s spent ({clock.elapsed():.0f} s)"}
            say(f"\n## {name}: skipped, {report[name]['skipped']}")
        else:
            try:
                report[name] = run()
            except Exception as e:  # one failing section must not lose the others
                traceback.print_exc()
                report[name] = {"error": f"{type(e).__name__}: {e}"}
                say(f"\n## {name}: FAILED, {report[name]['error']}")
        env["section_seconds"][name] = time.perf_counter() - t0
        env["total_seconds"] = clock.elapsed()
        write(report, out, extra)
    say("\nseconds per section: " + ", ".join(f"{k} {v:.1f}" for k, v in env["section_seconds"].items())
        + f"; total {env['total_seconds']:.1f}")
    say(f"wrote {out}" + (f" and {extra}" if extra else ""))
    return report


if __name__ == "__main__":
    main(ARGS, sys.argv)
