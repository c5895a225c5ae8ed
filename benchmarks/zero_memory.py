"""Per-device memory of ZeRO stages 0-3 (and optimizer offload) for BERT-base pre-training, next to the ZeRO paper.

The model is ``jonebit.models.bert.BertForPreTraining`` (BERT-base: 12 x 768, vocabulary 30522, 512 positions, MLM
head tied to the word embeddings, NSP head): Psi = 110,106,428 parameters. Its parameter tree is taken abstractly
(``nnx.eval_shape`` + ``nnx.split``), so nothing of BERT-base is allocated; the step (forward + backward of the
MLM + NSP loss on a synthetic 8 x 128 batch, reduction, AdamW update) is compiled from ShapeDtypeStructs.

Per device, for N devices, with K bytes per parameter for params / grads / optimizer state:

* mixed precision (bf16 params and grads, fp32 master + Adam m and v: 2 / 2 / 12), Rajbhandari et al. 2020 (Fig. 1):
  stage 0 ``16 Psi``; stage 1 ``4 Psi + 12 Psi / N``; stage 2 ``2 Psi + 14 Psi / N``; stage 3 ``16 Psi / N``;
* fp32 (4 / 4 / 8, Adam m and v): stage 0 ``16 Psi``; stage 1 ``8 Psi + 8 Psi / N``; stage 2 ``4 Psi + 12 Psi / N``;
  stage 3 ``16 Psi / N``;
* offload (stage 1): the optimizer state lives in host memory (``pinned_host``), the device holds params + grads:
  ``4 Psi`` (mixed) / ``8 Psi`` (fp32); the host holds the state's ``K_os Psi / N`` per device.

Columns ``params``, ``grads``, ``opt state`` are ``jonebit.sharding.bytes_per_device`` of the planned shardings
(``abstract_zero``); ``grads`` is the layout the gradients are reduced into. Adam's state also has a step counter
(one int32 scalar, replicated: 4 bytes, negligible), and leaves that have no dimension divisible by N stay replicated
(the MLM output bias, 30522 entries; the NSP bias), which is why the measured numbers sit a hair above the formulas.

From the compiled programs (``jit(...).lower(abstract args).compile().memory_analysis()``, per device): the step's
argument, output, aliased (donated) and temporary bytes, and the gradient function's (``make_zero_grads``) output
(= the reduced gradients + the 4-byte loss) and temporaries. A reduced-size real run (``--check-config``, default
BERT-tiny) allocates every variant and checks that the bytes of each device's ``addressable_shards`` equal
``bytes_per_device``, before and after a real step.

    python benchmarks/zero_memory.py [--devices 8] [--config base] [--batch 8] [--seq 128] [--layers 12]
"""

from __future__ import annotations

import argparse
import time

import common  # noqa: F401  (sets the CPU device count before jax starts)
import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import table, write_json
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jonebit.models.bert import BertConfig, BertForPreTraining, pretraining_loss
from jonebit.sharding.mesh import data_mesh
from jonebit.sharding.zero import bytes_per_device
from jonebit.train.zero import abstract_zero, init_zero, make_zero_grads, make_zero_step

MB = 1e6
# Bytes per parameter (params, grads, optimizer state).
K = {"fp32": (4, 4, 8), "mixed": (2, 2, 12)}
VARIANTS = [(0, False), (1, False), (2, False), (3, False), (1, True)]  # (stage, offload)


def formula(precision: str, stage: int, offload: bool, psi: int, n: int) -> tuple[float, str]:
    """ZeRO paper's per-device bytes (device memory; with offload the state is on the host) and the formula."""
    kp, kg, kos = K[precision]
    if offload:
        return (kp + kg) * psi, f"{kp + kg}Ψ (+ {kos}Ψ/N host)"
    if stage == 0:
        return (kp + kg + kos) * psi, f"{kp + kg + kos}Ψ"
    if stage == 1:
        return (kp + kg) * psi + kos * psi / n, f"{kp + kg}Ψ + {kos}Ψ/N"
    if stage == 2:
        return kp * psi + (kg + kos) * psi / n, f"{kp}Ψ + {kg + kos}Ψ/N"
    return (kp + kg + kos) * psi / n, f"{kp + kg + kos}Ψ/N"


def bert_parts(config: BertConfig, precision: str, *, abstract: bool, seed: int = 0):
    """(graphdef, params as a dict tree, the non-param state) of BertForPreTraining in ``precision``."""
    dtype = jnp.float32 if precision == "fp32" else jnp.bfloat16
    make = lambda: BertForPreTraining(config, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(seed))  # noqa: E731
    model = nnx.eval_shape(make) if abstract else make()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if abstract:  # RNG keys and counters (unused: the loss runs deterministic) need values to be merged
        rest = jax.tree.map(lambda s: jax.random.key(0) if jnp.issubdtype(s.dtype, jax.dtypes.prng_key)
                            else jnp.zeros(s.shape, s.dtype), rest)
    return graphdef, nnx.to_pure_dict(params), rest


def make_loss(graphdef, rest):
    """BERT pre-training loss: masked-LM cross-entropy over the labelled positions + next-sentence prediction."""

    def loss_fn(params, data):
        model = nnx.merge(graphdef, params, rest)
        out = model(data["input_ids"], data["attention_mask"], data["token_type_ids"], deterministic=True)
        return pretraining_loss(out, data)

    return loss_fn


def synthetic_batch(vocab: int, batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tokens, a padded tail on half the rows, 15% MLM targets (-100 elsewhere), NSP labels."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000 % vocab, vocab, (batch, seq)).astype(np.int32)
    ids[:, 0] = 101 % vocab
    mask = np.ones((batch, seq), np.int32)
    mask[::2, seq - seq // 8:] = 0
    ids[mask == 0] = 0
    types = np.zeros((batch, seq), np.int32)
    types[:, seq // 2:] = 1
    labels = np.where((rng.random((batch, seq)) < 0.15) & (mask == 1), ids, -100).astype(np.int32)
    nsp = rng.integers(0, 2, (batch,)).astype(np.int32)
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels, next_sentence_label=nsp)


def abstract_batch(batch: dict, mesh) -> dict:
    sharding = NamedSharding(mesh, P("data"))
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in batch.items()}


def tx_for() -> optax.GradientTransformation:
    return optax.adamw(1e-4, weight_decay=0.01)


def planned(precision, stage, offload, params, mesh):
    """Abstract params / state / shardings and the per-device bytes of params, grads, optimizer state."""
    master = jnp.float32 if precision == "mixed" else None
    a_params, a_state, sh = abstract_zero(tx_for(), params, mesh, stage=stage, offload_optimizer=offload,
                                          master_dtype=master)
    return a_params, a_state, sh, dict(
        params=bytes_per_device(a_params, sh.params),
        grads=bytes_per_device(params, sh.grads),  # reduced in the params' dtype (bf16 for mixed)
        state=bytes_per_device(a_state, sh.opt_state),
    )


def compiled_memory(loss_fn, mesh, a_params, a_state, sh, batch, precision):
    reduce_dtype = jnp.bfloat16 if precision == "mixed" else None
    step = make_zero_step(loss_fn, tx_for(), mesh, sh, reduce_dtype=reduce_dtype)
    t0 = time.perf_counter()
    m = step.lower(a_params, a_state, batch).compile().memory_analysis()
    grads_fn = jax.jit(make_zero_grads(loss_fn, mesh, sh, reduce_dtype=reduce_dtype))
    g = grads_fn.lower(a_params, batch).compile().memory_analysis()
    return dict(
        step_args=m.argument_size_in_bytes, step_out=m.output_size_in_bytes, step_alias=m.alias_size_in_bytes,
        step_temp=m.temp_size_in_bytes, step_host_args=m.host_argument_size_in_bytes,
        step_host_temp=m.host_temp_size_in_bytes,
        grads_out=g.output_size_in_bytes - 4, grads_temp=g.temp_size_in_bytes,
        compile_s=round(time.perf_counter() - t0, 1),
    )


def per_device_shard_bytes(tree) -> set[int]:
    per_device: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return set(per_device.values())


def real_check(config: BertConfig, mesh, batch_size: int, seq: int) -> list[dict]:
    """Allocates every variant at reduced size: addressable shard bytes == bytes_per_device, before and after a
    real step (the step donates and re-lays out its outputs)."""
    rows = []
    batch = synthetic_batch(config.vocab_size, batch_size, seq, seed=1)
    for precision in ("fp32", "mixed"):
        graphdef, params, rest = bert_parts(config, precision, abstract=False)
        loss_fn = make_loss(graphdef, rest)
        master = jnp.float32 if precision == "mixed" else None
        reduce_dtype = jnp.bfloat16 if precision == "mixed" else None
        for stage, offload in VARIANTS:
            p, s, sh = init_zero(tx_for(), params, mesh, stage=stage, offload_optimizer=offload, master_dtype=master)
            want = (bytes_per_device(p, sh.params), bytes_per_device(s, sh.opt_state))
            before = (per_device_shard_bytes(p), per_device_shard_bytes(s))
            step = make_zero_step(loss_fn, tx_for(), mesh, sh, reduce_dtype=reduce_dtype)
            p, s, loss = step(p, s, batch)
            after = (per_device_shard_bytes(p), per_device_shard_bytes(s))
            ok = before == after == ({want[0]}, {want[1]}) and bool(np.isfinite(float(loss)))
            rows.append(dict(precision=precision, stage=stage, offload=offload, params=want[0], state=want[1],
                             shards_params=sorted(after[0]), shards_state=sorted(after[1]), loss=float(loss),
                             state_memory=sorted({x.sharding.memory_kind for x in jax.tree.leaves(s)}), ok=ok))
            print(f"  check {precision} stage {stage}{' offload' if offload else ''}: params {want[0]:,} B, "
                  f"state {want[1]:,} B per device, shards agree: {ok}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--config", default="base", help="BertConfig preset of the planned/compiled model")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count of the compiled model")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--check-config", default="tiny", help="preset of the real-allocation check ('' to skip)")
    ap.add_argument("--skip-compiled", action="store_true", help="only the planned bytes")
    args = ap.parse_args()
    mesh = data_mesh(args.devices)
    n = mesh.size
    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    config = BertConfig.preset(args.config, **overrides)
    batch = abstract_batch(synthetic_batch(config.vocab_size, args.batch, args.seq), mesh)

    rows = []
    psi = None
    t_all = time.perf_counter()
    for precision in ("fp32", "mixed"):
        graphdef, params, rest = bert_parts(config, precision, abstract=True)
        psi = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
        loss_fn = make_loss(graphdef, rest)
        for stage, offload in VARIANTS:
            a_params, a_state, sh, b = planned(precision, stage, offload, params, mesh)
            device = b["params"] + b["grads"] + (0 if offload else b["state"])
            want, text = formula(precision, stage, offload, psi, n)
            row = dict(precision=precision, stage=stage, offload=offload,
                       variant=f"{stage}{' + offload' if offload else ''}",
                       params_mb=b["params"] / MB, grads_mb=b["grads"] / MB, state_mb=b["state"] / MB,
                       state_where="host" if offload else "device",
                       device_mb=device / MB, formula=text, formula_mb=want / MB, ratio=device / want,
                       bytes_per_param=device / psi)
            if not args.skip_compiled:
                c = compiled_memory(loss_fn, mesh, a_params, a_state, sh, batch, precision)
                row.update({k: (v / MB if k != "compile_s" else v) for k, v in c.items()})
            rows.append(row)
            extra = "" if args.skip_compiled else (f", step args {row['step_args']:,.1f} MB temp "
                                                   f"{row['step_temp']:,.1f} MB ({row['compile_s']} s)")
            print(f"{precision} stage {row['variant']}: {device / MB:,.1f} MB/device vs {text} = {want / MB:,.1f} MB "
                  f"(ratio {device / want:.4f}){extra}", flush=True)

    print(f"\nBertForPreTraining {args.config} ({config.num_hidden_layers} layers): Psi = {psi:,} parameters, "
          f"N = {n} devices, batch {args.batch} x {args.seq}; MB = 1e6 bytes per device\n")
    cols = [("precision", "precision"), ("variant", "stage"), ("params_mb", "params MB"), ("grads_mb", "grads MB"),
            ("state_mb", "opt state MB"), ("state_where", "state in"), ("device_mb", "device total MB"),
            ("formula", "formula"), ("formula_mb", "formula MB"), ("ratio", "ratio")]
    print(table([{**r, "ratio": f"{r['ratio']:.4f}"} for r in rows], cols))
    worst = max(abs(r["ratio"] - 1) for r in rows)
    print(f"\nlargest deviation from the formula: {100 * worst:.2f}% (target: within 10%)")
    if not args.skip_compiled:
        print("\nCompiled programs (memory_analysis, per device, MB)\n")
        ccols = [("precision", "precision"), ("variant", "stage"), ("step_args", "step args"),
                 ("step_out", "step out"), ("step_alias", "step alias"), ("step_temp", "step temp"),
                 ("step_host_args", "step host args"), ("grads_out", "grad fn out (grads)"),
                 ("grads_temp", "grad fn temp")]
        print(table(rows, ccols))

    checks = []
    if args.check_config:
        check_config = BertConfig.preset(args.check_config)
        print(f"\nReal allocation at reduced size (BertForPreTraining {args.check_config}, batch 8 x 32):", flush=True)
        checks = real_check(check_config, mesh, 8, 32)
        assert all(c["ok"] for c in checks), "addressable_shards bytes differ from bytes_per_device"
    path = write_json("zero_memory", {
        "config": args.config, "layers": config.num_hidden_layers, "psi": psi, "devices": n,
        "batch": [args.batch, args.seq], "rows": rows, "real_check": checks,
        "seconds": round(time.perf_counter() - t_all, 1),
    })
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
