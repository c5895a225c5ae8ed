"""Does layer-wise ZeRO-3 follow stage 0 for 20 steps, as closely as stage 0 follows itself?

Two programs of the same arithmetic sum in different orders. For Adam that moves parameters by float32 rounding,
amplified at most where ``sqrt(v)`` is small; a 1-bit step is not smooth: a coordinate whose compensated value
rounds to the other side of zero takes the mirrored step (two scales apart), and from there the runs differ by
whole steps, which the later gradients feed back. So no elementwise bound derived from rounding holds through
1-bit steps between two programs. What this measures instead is the floor such chaos sets: stage 0 against
itself started one float32 ulp away (every initial parameter moved to its next float away from zero), beside stage
3 against stage 0 from the same start. Stage 3 is as faithful as the arithmetic allows when its distance is of
the floor's order.

Setup: a 4-layer BERT (hidden 64, 4 heads, vocabulary 128) on random tokens (batch 16 x 32, 20% masked), 8
simulated CPU devices, through the engine (DeepSpeed configs): AdamW and OneBitAdam (``freeze_step`` 5, so 15
compression steps; one compression scale per layer's tensor), lr 1e-3, weight decay 0.01, float32 and bf16
compute. Arms, all in this one invocation on identical batches:

* ``stage0``: the encoder as a list of layers at ZeRO stage 0 (the reference);
* ``stage0_ulp``: the same, every initial parameter one ulp away;
* ``stage3``: the encoder stacked, ZeRO stage 3 gathering each layer inside the scan (1-bit Adam's per-layer
  buffers kept as one array per stack).

Per step: the largest and the root-mean-square distance of each arm's parameters to ``stage0``'s, and the loss
difference. Writes ``results/zero3_trajectory.json`` and ``.png``.

    python benchmarks/zero3_trajectory.py               # 2 optimizers x 2 precisions x 3 arms: ~6 min on 2 cores
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import result_path, write_json  # noqa: E402  (sets 8 CPU devices)

ARMS = ("stage0", "stage0_ulp", "stage3")
OPTIMIZERS = ("AdamW", "OneBitAdam")
PRECISIONS = ("fp32", "bf16")
BATCH, SEQ = 16, 32


def _config():
    from jonebit.models.bert import BertConfig

    return BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                      intermediate_size=128, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0)


def _batches(steps: int) -> list[dict]:
    out = []
    for i in range(steps):
        r = np.random.default_rng(1000 + i)
        ids = r.integers(1, 128, (BATCH, SEQ)).astype(np.int32)
        out.append({"input_ids": ids, "attention_mask": np.ones_like(ids),
                    "labels": np.where(r.random(ids.shape) < 0.2, ids, -100).astype(np.int32),
                    "next_sentence_label": r.integers(0, 2, BATCH).astype(np.int32)})
    return out


def _model(stacked: bool):
    """``(loss_fn, params as a plain dict)``; both forms start from the stacked model's values."""
    from flax import nnx

    from jonebit.models.bert import BertForPreTraining, pretraining_loss

    model = BertForPreTraining(_config(), scan_layers=stacked, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(p, b):
        m = nnx.merge(graphdef, p, jax.tree.map(lambda x: x, rest))
        return pretraining_loss(m(b["input_ids"], b["attention_mask"], deterministic=True), b)

    return loss_fn, nnx.to_pure_dict(params)


def _as_list(stacked: dict, layers: int) -> dict:
    from jonebit.sharding.layerwise import STACKED_KEY

    stack = stacked["bert"]["encoder"][STACKED_KEY]
    return {**stacked, "bert": {**stacked["bert"], "encoder": {
        "layer": {i: jax.tree.map(lambda x, i=i: x[i], stack) for i in range(layers)}}}}


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def _run(optimizer: str, precision: str, arm: str, steps: int, freeze: int, batches) -> tuple[list, list]:
    """The parameters (the list-of-layers form, flattened in float64) after every step, and the losses."""
    from jonebit.train.initialize import initialize

    layers = _config().num_hidden_layers
    stacked = arm == "stage3"
    loss_fn, params = _model(stacked=True)
    if not stacked:
        loss_fn, _ = _model(stacked=False)
        params = _as_list(jax.device_get(params), layers)
    if arm == "stage0_ulp":
        params = jax.tree.map(lambda x: np.nextafter(np.asarray(x), np.copysign(np.inf, x)).astype(x.dtype),
                              params)
    opt = {"type": optimizer, "params": {"lr": 1e-3, "weight_decay": 0.01}}
    if optimizer == "OneBitAdam":
        opt["params"]["freeze_step"] = freeze + 1  # DeepSpeed counts from 1: jonebit's freeze_step = this - 1
    cfg = {"train_batch_size": BATCH, "optimizer": opt, "zero_optimization": {"stage": 3 if stacked else 0},
           "bf16": {"enabled": precision == "bf16"}}
    engine = initialize(cfg, loss_fn, params, fused=False if optimizer == "OneBitAdam" else None)
    state, trees, losses = engine.state, [], []
    for b in batches[:steps]:
        state, metrics = engine.step(state, b)
        losses.append(float(metrics["loss"]))
        engine.state = state
        tree = jax.device_get(engine.params)
        trees.append(_flat(_as_list(tree, layers) if stacked else tree))
    return trees, losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--freeze", type=int, default=5, help="1-bit Adam's warmup steps (jonebit's freeze_step)")
    args = ap.parse_args(argv)
    batches = _batches(args.steps)
    start = _flat(_as_list(_model(stacked=True)[1], _config().num_hidden_layers))
    cases = []
    for optimizer in OPTIMIZERS:
        for precision in PRECISIONS:
            runs = {arm: _run(optimizer, precision, arm, args.steps, args.freeze, batches) for arm in ARMS}
            ref, ref_losses = runs["stage0"]
            case = {"optimizer": optimizer, "precision": precision,
                    "moved_rms": float(np.sqrt(np.mean((ref[-1] - start) ** 2))),
                    "moved_max": float(np.max(np.abs(ref[-1] - start))), "arms": {}}
            for arm in ("stage0_ulp", "stage3"):
                trees, losses = runs[arm]
                d = [np.abs(t - r) for t, r in zip(trees, ref, strict=True)]
                case["arms"][arm] = {
                    "max": [float(x.max()) for x in d],
                    "rms": [float(np.sqrt(np.mean(x ** 2))) for x in d],
                    "loss_diff": [float(a - b) for a, b in zip(losses, ref_losses, strict=True)],
                }
            cases.append(case)
            u, s = case["arms"]["stage0_ulp"], case["arms"]["stage3"]
            print(f"{optimizer:10s} {precision}: after {args.steps} steps, max |p - p0|: ulp start {u['max'][-1]:.2e}, "
                  f"stage 3 {s['max'][-1]:.2e}; rms: {u['rms'][-1]:.2e}, {s['rms'][-1]:.2e} "
                  f"(parameters moved rms {case['moved_rms']:.2e}, max {case['moved_max']:.2e})", flush=True)

    lines = ["| optimizer | compute | moved (rms / max) | stage 0 from 1 ulp away: rms / max | stage 3: rms / max |",
             "|---|---|---|---|---|"]
    for c in cases:
        u, s = c["arms"]["stage0_ulp"], c["arms"]["stage3"]
        lines.append(f"| {c['optimizer']} | {c['precision']} | {c['moved_rms']:.2e} / {c['moved_max']:.2e} | "
                     f"{u['rms'][-1]:.2e} / {u['max'][-1]:.2e} | {s['rms'][-1]:.2e} / {s['max'][-1]:.2e} |")
    print("\n" + "\n".join(lines))
    path = write_json("zero3_trajectory", {
        "command": " ".join(["python", "benchmarks/zero3_trajectory.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "steps": args.steps, "freeze_step": args.freeze, "batch": [BATCH, SEQ], "cases": cases})
    _plot(cases, args.freeze)
    print(f"wrote {path}")
    return 0


def _plot(cases, freeze: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(cases), figsize=(4 * len(cases), 3.4), sharey=True)
    for ax, c in zip(axes, cases, strict=True):
        for arm, style in (("stage0_ulp", "--"), ("stage3", "-")):
            rms = c["arms"][arm]["rms"]
            ax.semilogy(range(1, len(rms) + 1), [max(x, 1e-12) for x in rms], style, label=arm)
        if c["optimizer"] == "OneBitAdam":
            ax.axvline(freeze + 0.5, color="grey", lw=0.8)
        ax.set_title(f"{c['optimizer']}, {c['precision']}")
        ax.set_xlabel("step")
    axes[0].set_ylabel("rms |p - p(stage 0)|")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(result_path("zero3_trajectory").with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    sys.exit(main())
