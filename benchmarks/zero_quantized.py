"""Does ZeRO++'s int8 parameter gather (``zero_quantized_weights``) train like stage 3's exact gather?

The pre-training job of ``jonebit pretrain`` (MLM + NSP on CPython's ``pydoc_data`` text, a 2,000-token
vocabulary, the corpus's last 6 documents held out; 8 simulated CPU devices) with BERT-mini (4 x 256, stacked
encoder) at ZeRO stage 3, AdamW with the embedded default's warmup-decay schedule and clipping, is trained twice
per seed in this one invocation, on identical data:

* ``exact``: stage 3 gathering each layer's float32 parameters;
* ``quantized``: the same with ``"zero_quantized_weights": true`` (int8 values with a float32 scale per block of
  at most 256 on the wire; the master parameters, optimizer state and gradients exact).

The table gives the held-out MLM loss at the end per seed, the mean and spread over seeds, and the gap of the
quantized run to the exact one; both arms of a seed share the data order and the initial parameters, so the gap
is the quantizer's effect plus the float-order chaos of two different programs (measured by nothing else here;
the seeds' spread shows the scale of run-to-run variation).

    python benchmarks/zero_quantized.py                         # 3 seeds x 2 arms, 150 steps: ~10 min on 2 cores
    python benchmarks/zero_quantized.py --seeds 0 --steps 50    # a quick look
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.common import write_json  # noqa: E402  (sets 8 CPU devices)

ARMS = ("exact", "quantized")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--model", default="mini")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--eval-batches", type=int, default=20)
    ap.add_argument("--workdir", default="runs/zero_quantized")
    args = ap.parse_args(argv)

    from jonebit.apps.pretrain import _prepare_data, default_configs, run

    work = pathlib.Path(args.workdir)
    rows = []
    for seed in args.seeds:
        prep = argparse.Namespace(corpus=None, vocab=None, vocab_size=2000, seq_len=args.seq_len, max_predictions=20,
                                  dupe_factor=5, seed=seed, heldout_documents=6, whole_word_mask=False,
                                  data_dir=None, overwrite_data=False)
        data_dir, vocab, _ = _prepare_data(prep, work / f"seed{seed}")
        base = default_configs(args.steps, args.batch_size, lr=args.lr)["adam"]
        for arm in ARMS:
            cfg = json.loads(json.dumps(base))
            cfg["zero_optimization"] = {"stage": 3, **({"zero_quantized_weights": True} if arm == "quantized" else {})}
            out = work / f"seed{seed}" / arm
            shutil.rmtree(out, ignore_errors=True)
            print(f"\n== seed {seed}, {arm}", flush=True)
            t0 = time.perf_counter()
            result = run(cfg, data_dir=data_dir, vocab_file=vocab, model=args.model, seq_len=args.seq_len,
                         max_steps=args.steps, output=out, seed=seed, export=False, progress=False,
                         eval_batches=args.eval_batches, eval_every=max(1, args.steps // 5))
            last = result.records[-1]
            rows.append({"seed": seed, "arm": arm, "heldout_mlm_loss": last["eval/mlm_loss"],
                         "heldout_mlm_accuracy": last["eval/mlm_accuracy"], "train_loss": last["loss"],
                         "seconds": time.perf_counter() - t0,
                         "curve": [(r["step"], r["loss"]) for r in result.records]})
            print(f"held-out MLM loss {last['eval/mlm_loss']:.4f} ({rows[-1]['seconds']:.0f} s)", flush=True)

    by = {(r["seed"], r["arm"]): r["heldout_mlm_loss"] for r in rows}
    lines = ["| seed | exact | quantized | gap |", "|---|---|---|---|"]
    gaps = []
    for seed in args.seeds:
        e, q = by[seed, "exact"], by[seed, "quantized"]
        gaps.append(100 * (q - e) / e)
        lines.append(f"| {seed} | {e:.4f} | {q:.4f} | {gaps[-1]:+.2f}% |")
    summary = {}
    for arm in ARMS:
        vals = [by[s, arm] for s in args.seeds]
        summary[arm] = {"mean": statistics.fmean(vals), "min": min(vals), "max": max(vals)}
    lines.append(f"| mean (min-max) | {summary['exact']['mean']:.4f} ({summary['exact']['min']:.4f}-"
                 f"{summary['exact']['max']:.4f}) | {summary['quantized']['mean']:.4f} "
                 f"({summary['quantized']['min']:.4f}-{summary['quantized']['max']:.4f}) | "
                 f"{statistics.fmean(gaps):+.2f}% ({min(gaps):+.2f}% to {max(gaps):+.2f}%) |")
    print("\n" + "\n".join(lines))
    path = write_json("zero_quantized", {
        "command": " ".join(["python", "benchmarks/zero_quantized.py", *(argv if argv is not None else sys.argv[1:])]),
        "model": args.model, "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "lr": args.lr, "seeds": args.seeds, "rows": rows, "summary": summary, "gaps_percent": gaps})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
