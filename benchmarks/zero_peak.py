"""Per-device peak memory of ZeRO stages 0-3, read from the compiled training steps, next to the ZeRO paper.

For BERT-base (12 x 768) and a BERT-large-shaped model (24 x 1024, 336M parameters) in ``BertForPreTraining`` with
the stacked encoder (``scan_layers=True``), float32 AdamW, batch 8 x 128 over N = 8 simulated devices, MLM head at
20 masked positions per sequence: each stage's ``make_zero_step`` is compiled from abstract arguments and its
``memory_analysis()`` read. The peak per device is

    arguments + temporaries + outputs - aliased (donated) bytes

Rows:

* stages 0-3 of the stacked model: stage 3 gathers each layer's parameters inside the scan, one layer at a time
  (:mod:`jonebit.sharding.layerwise`);
* ``3 (whole tree)``: the same stage-3 step with the layers as a list, whose parameters are all gathered at the
  step's start (what every model without stacked layers gets);
* with ``--onebit``: 1-bit Adam (``onebit_adam_zero``) under stages 1-3, its compression phase's program; at
  stage 3 its parameters are flat chunks, those of the stack gathered one layer at a time inside the scan (and,
  as ``3 (whole tree)``, the list-of-layers model's, all gathered at the step's start). Its model states are its
  own table's (``jonebit.transforms.onebit_adam_zero``: the whole local gradient and worker error on every rank,
  the momentum as packed signs), its working set the gathered parameters.

Next to each, what the memory should be:

* **model states**, the ZeRO paper's per-device bytes for float32 Adam (4 / 4 / 8 bytes per parameter for params /
  grads / optimizer state; Rajbhandari et al. 2020, Fig. 1): ``16 Psi`` (stage 0), ``8 Psi + 8 Psi/N`` (1),
  ``4 Psi + 12 Psi/N`` (2), ``16 Psi/N`` (3);
* **working set** of the step as jonebit compiles it, beyond the model states: at stage 2 each device's whole
  local gradient before its reduce-scatter (``4 Psi - 4 Psi/N``; DeepSpeed reduces it bucket by bucket during the
  backward pass instead, which the formula assumes; stages 0 and 1 count whole gradients already); at stage 3,
  whole, the parameters outside the stack and their local gradients (``2 x 4 Psi_rest``) and one layer's
  parameters and gradient (``2 x 4 Psi_layer``);
* **activations**, measured: the temporaries of one device's forward + backward of its batch (the same model,
  parameters as arguments and gradients as outputs, nothing else), compiled as the stage runs it: at stage 3 with
  the scan body's rematerialisation policy (matmul outputs kept, the rest recomputed), below it without.

    python benchmarks/zero_peak.py [--models base,large] [--devices 8] [--batch 8] [--seq 128] [--onebit]
"""

from __future__ import annotations

import argparse
import math
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

import jonebit
from jonebit.models.bert import BertConfig, BertForPreTraining, pretraining_loss
from jonebit.sharding.layerwise import STACKED_KEY, gathering
from jonebit.sharding.mesh import data_mesh
from jonebit.train.engine import copied_parameters
from jonebit.train.zero import abstract_zero, make_zero_step
from jonebit.transforms.onebit_adam_zero import OneBitAdamZeroState

MB = 1e6
MASKED = 20
STATES = {0: "16Ψ", 1: "8Ψ + 8Ψ/N", 2: "4Ψ + 12Ψ/N", 3: "16Ψ/N"}


# 1-bit Adam's ZeRO variant (jonebit.transforms.onebit_adam_zero's table): the whole local gradient and worker
# error on every rank, the synchronised momentum as packed signs (Ψ/8), the rest partitioned; at stage 3 also
# mask_unseen's bit per element of where the frozen variance is > 0 (Ψ/8).
ONEBIT_STATES = {1: "16Ψ + 12Ψ/N + Ψ/8", 2: "16Ψ + 12Ψ/N + Ψ/8", 3: "8Ψ + 16Ψ/N + Ψ/4"}


def model_states(stage: int, psi: int, n: int) -> float:
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]


def onebit_states(stage: int, psi: int, n: int) -> float:
    return {1: 16 * psi + 12 * psi / n, 2: 16 * psi + 12 * psi / n, 3: 8 * psi + 16 * psi / n + psi / 8}[stage] \
        + psi / 8


def bert(config: BertConfig, scan: bool):
    """(loss_fn, abstract params, params outside the stack, params of one layer) of the abstract model."""
    model = nnx.eval_shape(lambda: BertForPreTraining(config, scan_layers=scan, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rest = jax.tree.map(lambda s: jax.random.split(jax.random.key(0), s.shape)
                        if jnp.issubdtype(s.dtype, jax.dtypes.prng_key) else jnp.zeros(s.shape, s.dtype), rest)
    params = nnx.to_pure_dict(params)

    def loss_fn(p, batch):
        m = nnx.merge(graphdef, p, jax.tree.map(lambda x: x, rest))  # fresh Variables in this trace
        out = m(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"],
                masked_positions=batch["masked_lm_positions"], deterministic=True)
        return pretraining_loss(out, batch)

    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    stack = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params["bert"]["encoder"].get(STACKED_KEY, {})))
    return loss_fn, params, total, stack


def abstract_batch(mesh, batch: int, seq: int, per_device: bool = False):
    spec = P() if per_device else P("data")
    sh = NamedSharding(mesh, spec)
    shapes = dict(input_ids=((batch, seq), jnp.int32), attention_mask=((batch, seq), jnp.int32),
                  token_type_ids=((batch, seq), jnp.int32), masked_lm_positions=((batch, MASKED), jnp.int32),
                  masked_lm_ids=((batch, MASKED), jnp.int32), masked_lm_weights=((batch, MASKED), jnp.float32),
                  next_sentence_label=((batch,), jnp.int32))
    return {k: jax.ShapeDtypeStruct(s, d, sharding=sh) for k, (s, d) in shapes.items()}


def peak(compiled) -> dict:
    m = compiled.memory_analysis()
    return dict(args=m.argument_size_in_bytes, temp=m.temp_size_in_bytes, out=m.output_size_in_bytes,
                alias=m.alias_size_in_bytes,
                peak=m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


def compiled_step(loss_fn, tx, params, mesh, stage: int, batch, phases=None) -> tuple[dict, float]:
    a_params, a_state, sh = abstract_zero(tx, params, mesh, stage=stage)
    t0 = time.perf_counter()
    step = make_zero_step(loss_fn, tx, mesh, sh)
    lowered = step.lower(a_params, a_state, batch) if phases is None else step.lower(a_params, a_state, batch,
                                                                                      phases=phases)
    c = lowered.compile()
    return {**peak(c), "copied": copied_argument_bytes(c, (a_params, a_state, batch))}, time.perf_counter() - t0


def copied_argument_bytes(compiled, args) -> int:
    """Per-device bytes of the arguments the program copies whole before using them (XLA:CPU copies a donated
    buffer it reads after writing its new value: ``jonebit.train.engine.copied_parameters``)."""
    sizes = [math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(args)]
    return sum(sizes[i] for i in copied_parameters(compiled.as_text()) if i < len(sizes))


def activations(loss_fn, params, batch_per_device: int, seq: int, layerwise: bool) -> int:
    """Temporaries of one device's forward + backward (no optimizer, no communication). ``layerwise``: traced as
    stage 3 traces it (:func:`jonebit.sharding.layerwise.gathering` on a one-device axis: nothing to gather, the
    scan body under the same rematerialisation policy)."""
    mesh1 = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    rep = NamedSharding(mesh1, P())
    a_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), params)
    batch = abstract_batch(mesh1, batch_per_device, seq, per_device=True)

    def grads(p, b):
        if not layerwise:
            return jax.grad(loss_fn)(p, b)
        with gathering("data"):
            return jax.grad(loss_fn)(p, b)

    fn = jax.shard_map(grads, mesh=mesh1, in_specs=(P(), P()), out_specs=P(), check_vma=False)
    return peak(jax.jit(fn).lower(a_params, batch).compile())["temp"]


def run_model(name: str, mesh, batch: int, seq: int, onebit: bool) -> list[dict]:
    n = mesh.size
    config = BertConfig.preset(name)
    loss_fn, params, psi, psi_stack = bert(config, scan=True)
    psi_layer = psi_stack // config.num_hidden_layers
    psi_rest = psi - psi_stack
    act = {stage: activations(loss_fn, params, batch // n, seq, layerwise=stage == 3) for stage in (0, 3)}
    gbatch = abstract_batch(mesh, batch, seq)
    tx = optax.adamw(1e-4, weight_decay=0.01)
    rows = []

    def add(stage: int, variant: str, optimizer: str, measured: dict, seconds: float, working: float,
            layerwise: bool = True):
        onebit = optimizer == "onebit_adam"
        states = (onebit_states if onebit else model_states)(stage, psi, n)
        a = act[3 if stage == 3 and layerwise else 0]
        expected = states + working + a
        rows.append(dict(model=name, layers=config.num_hidden_layers, hidden=config.hidden_size, psi=psi,
                         stage=stage, variant=variant, optimizer=optimizer, **{k: v / MB for k, v in measured.items()},
                         states_formula=(ONEBIT_STATES if onebit else STATES)[stage], states=states / MB,
                         working=working / MB,
                         activations=a / MB, expected=expected / MB, ratio=measured["peak"] / expected,
                         compile_s=round(seconds, 1)))
        r = rows[-1]
        print(f"{name} {optimizer} stage {variant}: peak {r['peak']:,.0f} MB (args {r['args']:,.0f}, temp "
              f"{r['temp']:,.0f}); expected {r['expected']:,.0f} = states {r['states']:,.0f} + working "
              f"{r['working']:,.0f} + activations {r['activations']:,.0f} (x{r['ratio']:.2f}; {seconds:.0f} s)",
              flush=True)

    working = {0: 0, 1: 0, 2: 4 * psi - 4 * psi / n, 3: 2 * 4 * (psi_rest + psi_layer)}
    for stage in range(4):
        measured, seconds = compiled_step(loss_fn, tx, params, mesh, stage, gbatch)
        add(stage, str(stage), "adamw", measured, seconds, working[stage])
    whole_loss, whole_params, _, _ = bert(config, scan=False)
    measured, seconds = compiled_step(whole_loss, tx, whole_params, mesh, 3, gbatch)
    add(3, "3 (whole tree)", "adamw", measured, seconds, 2 * 4 * psi, layerwise=False)
    if onebit:
        # The compression phase's own program, as the step runs it after the freeze. Working set beyond the model
        # states (which count the whole local gradient): at stage 3 the parameters outside the stack, gathered at
        # the step's start, and two of the stack's layers (the one running and the next one's gather), gathered
        # inside the scan; with the layers as a list, every parameter, gathered at the start.
        compression = ((OneBitAdamZeroState, "compression"),)
        for stage in (1, 2, 3):
            otx = jonebit.onebit_adam_zero(1e-4, freeze_step=1, stage=stage)
            measured, seconds = compiled_step(loss_fn, otx, params, mesh, stage, gbatch, phases=compression)
            add(stage, str(stage), "onebit_adam", measured, seconds,
                4 * (psi_rest + 2 * psi_layer) if stage == 3 else 0)
        otx = jonebit.onebit_adam_zero(1e-4, freeze_step=1, stage=3)
        measured, seconds = compiled_step(whole_loss, otx, whole_params, mesh, 3, gbatch, phases=compression)
        add(3, "3 (whole tree)", "onebit_adam", measured, seconds, 4 * psi, layerwise=False)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="base,large", help="BertConfig presets, comma-separated")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--onebit", action="store_true", help="also 1-bit Adam's ZeRO variant at stages 1-3")
    args = ap.parse_args()
    mesh = data_mesh(args.devices)
    t0 = time.perf_counter()
    rows = []
    for name in args.models.split(","):
        rows += run_model(name, mesh, args.batch, args.seq, args.onebit)
    cols = [("model", "model"), ("optimizer", "optimizer"), ("variant", "stage"), ("peak", "compiled peak MB"),
            ("args", "args MB"), ("temp", "temp MB"), ("states_formula", "model states"), ("states", "states MB"),
            ("working", "working set MB"), ("activations", "activations MB"), ("expected", "expected MB"),
            ("ratio", "peak / expected")]
    print(f"\nper device, N = {args.devices}, batch {args.batch} x {args.seq}, float32; MB = 1e6 bytes\n")
    print(table([{**r, "ratio": f"{r['ratio']:.2f}"} for r in rows], cols))
    for name in args.models.split(","):
        by = {r["variant"]: r for r in rows if r["model"] == name and r["optimizer"] == "adamw"}
        print(f"\n{name}: stage 3 / stage 2 = {by['3']['peak'] / by['2']['peak']:.2f} "
              f"(whole-tree gather: {by['3 (whole tree)']['peak'] / by['2']['peak']:.2f})")
    path = write_json("zero_peak", {"devices": args.devices, "batch": [args.batch, args.seq], "masked": MASKED,
                                    "rows": rows, "seconds": round(time.perf_counter() - t0, 1)})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
