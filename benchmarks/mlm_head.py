"""The masked-LM head at the masked positions only against the head over every position (forward + backward).

``jonebit pretrain`` calls ``BertForPreTraining(..., masked_positions=batch["masked_lm_positions"])``: the head's
decoder (hidden x vocabulary) runs on the ``max_predictions_per_seq`` masked positions of each sequence instead of all
of them, as Google's and DeepSpeed's BERT pre-training do. Both give the same loss and gradient
(``tests/models/bert/test_modeling.py``); this times them side by side, the timed calls alternating so that load from
other processes falls on both alike, and reports the best of the repeats and their ratio.

    python benchmarks/mlm_head.py                          # BERT-mini, batch 64 x 128, 20 predictions, 30,522 tokens
    python benchmarks/mlm_head.py --config base --batch 8
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="mini", help="BertConfig preset (default mini)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--predictions", type=int, default=20, help="masked positions per sequence")
    ap.add_argument("--vocab-size", type=int, default=30522)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tag", default="", help="result file name (results/mlm_head/TAG.json)")
    args = ap.parse_args(argv)
    if not 0 < args.predictions <= args.seq - 2:
        ap.error(f"--predictions {args.predictions} must be between 1 and --seq - 2 ({args.seq - 2})")

    import jax
    import numpy as np
    from flax import nnx

    from benchmarks.common import write_json  # sets XLA_FLAGS before the first jax call
    from jonebit.data.pretraining import collate
    from jonebit.models.bert import BertConfig, BertForPreTraining, pretraining_loss

    cfg = BertConfig.preset(args.config, vocab_size=args.vocab_size, max_position_embeddings=max(512, args.seq))
    graphdef, params, rest = nnx.split(BertForPreTraining(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    rng = np.random.default_rng(0)
    n, L, P = args.batch, args.seq, args.predictions
    positions = np.stack([np.sort(rng.choice(np.arange(1, L - 1), P, replace=False)) for _ in range(n)])
    batch = collate({"input_ids": rng.integers(5, args.vocab_size, (n, L)),
                     "token_type_ids": np.zeros((n, L), np.uint8), "lengths": np.full(n, L),
                     "masked_lm_positions": positions,
                     "masked_lm_ids": rng.integers(5, args.vocab_size, (n, P)), "masked_lm_count": np.full(n, P),
                     "next_sentence_labels": rng.integers(0, 2, n)})

    def step(gathered: bool):
        def loss(p):
            kw = {"masked_positions": batch["masked_lm_positions"]} if gathered else {}
            out = nnx.merge(graphdef, p, rest)(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"],
                                               deterministic=True, **kw)
            return pretraining_loss(out, batch)

        return jax.jit(jax.value_and_grad(loss))

    steps = {"every position": step(False), "masked positions": step(True)}
    losses = {k: float(jax.block_until_ready(f(params))[0]) for k, f in steps.items()}  # compiles
    times = {k: [] for k in steps}
    for _ in range(args.repeats):
        for k, f in steps.items():
            t = time.perf_counter()
            jax.block_until_ready(f(params))
            times[k].append(time.perf_counter() - t)
    best = {k: min(v) for k, v in times.items()}
    tokens = n * L
    print(f"BERT {args.config}, batch {n} x {L}, {P} masked positions per sequence, vocabulary {args.vocab_size}, "
          f"forward + backward, best of {args.repeats}")
    print("| MLM head at | seconds | tokens/s | loss |\n|---|---|---|---|")
    for k in steps:
        print(f"| {k} | {best[k]:.3f} | {tokens / best[k]:,.0f} | {losses[k]:.5f} |")
    ratio = best["every position"] / best["masked positions"]
    print(f"masked positions only: {ratio:.2f}x faster")
    path = write_json("mlm_head", tag=args.tag, payload={
        "command": " ".join(["python", "benchmarks/mlm_head.py", *(argv if argv is not None else sys.argv[1:])]),
        "config": args.config, "batch": n, "seq": L, "predictions": P, "vocab_size": args.vocab_size,
        "seconds": times, "best": best, "loss": losses, "speedup": ratio})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
