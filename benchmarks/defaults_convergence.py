"""Which 1-bit Adam settings train like Adam: DeepSpeed's exact behaviour against jonebit's defaults.

The embedded pre-training job of ``jonebit pretrain`` (a tiny BERT, MLM + NSP, on CPython's ``pydoc_data`` text,
8 simulated CPU devices, the same data, seed, warmup-decay schedule and clipping for every run) is trained with

* ``adam``: AdamW with an fp32 gradient allreduce (the reference);
* ``onebit_deepspeed``: 1-bit Adam as DeepSpeed runs it with an fp16 optimizer: no bias correction, one
  compression scale for the whole model (``bias_correction=False, fused=True``);
* ``onebit_bias_fused``: bias correction on, still one scale for the whole model;
* ``onebit_default``: jonebit's defaults, bias correction and one scale per tensor
  (``bias_correction=True, fused=False``);
* ``onebit_auto``: the defaults with ``"freeze_step": "auto"`` and the default rule (``jonebit.AutoFreeze()``);
* ``onebit_auto_tuned`` / ``onebit_auto_strict``: the same with the rules ``AUTO_TUNED`` / ``AUTO_STRICT``
  (checks every 10 updates, the median tensor's bias-corrected variance norm moving by less than 20% / 10% per
  check, three checks in a row, at least 20 updates), for a run of a few hundred steps. The table's ``freeze at``
  column gives the update after which compression started (from the metrics' ``stage``) and its share of the run.

1-bit Adam freezes the variance after ``--freeze`` of the steps (default 20%, the benchmark's setting since its first
run; the embedded default of ``jonebit pretrain`` freezes at 40%, see BENCHMARKS.md). The table gives the held-out
MLM loss at the end and the gap to Adam; the figure the training curves. Results:
``benchmarks/results/defaults_convergence/defaults_convergence.{json,png}`` (with ``--tag T``: ``T.{json,png}``).

    python benchmarks/defaults_convergence.py                 # 300 steps, ~15-25 min on 2 busy cores
    python benchmarks/defaults_convergence.py --steps 100     # a quicker look
    python benchmarks/defaults_convergence.py --variants adam onebit_default onebit_auto onebit_auto_tuned \
        onebit_auto_strict --tag auto

The same comparison on real text (issue: BERT-mini on the SQuAD training articles with the BERT uncased vocab):

    python benchmarks/defaults_convergence.py --tag bert_mini --model mini --seq-len 128 --batch-size 64 \
        --corpus ../shared/data/corpus/squad-train-articles.txt \
        --vocab ../shared/data/vocab/bert-base-uncased-vocab.txt --heldout-documents 10 --lr 1e-3 --steps 2000
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.common import write_json  # noqa: E402  (sets 8 CPU devices)

# Rules for a run of a few hundred updates (the default checks every 50 updates, for runs of thousands): the median
# tensor's bias-corrected ||v|| moving < 20% (tuned) or < 10% (strict) per 10 updates, 3 checks in a row.
AUTO_TUNED = {"check_every": 10, "threshold": 0.2, "min_step": 20, "patience": 3}
AUTO_STRICT = dict(AUTO_TUNED, threshold=0.1)

VARIANTS = {  # name -> (optimizer type, bias_correction, fused[, auto_freeze rule ({}: the default) for "auto"])
    "adam": ("Adam", None, None),
    "onebit_deepspeed": ("OneBitAdam", False, True),
    "onebit_bias_fused": ("OneBitAdam", True, True),
    "onebit_default": ("OneBitAdam", True, False),
    "onebit_auto": ("OneBitAdam", True, False, {}),
    "onebit_auto_tuned": ("OneBitAdam", True, False, AUTO_TUNED),
    "onebit_auto_strict": ("OneBitAdam", True, False, AUTO_STRICT),
    "onebit_row_scales": ("OneBitAdam", True, False),
    "onebit_preconditioned": ("OneBitAdam", True, False),
    "onebit_preconditioned_rows": ("OneBitAdam", True, False),
    "onebit_refresh": ("OneBitAdam", True, False),
    "onebit_preconditioned_clip": ("OneBitAdam", True, False),
    "onebit_preconditioned_clip_refresh": ("OneBitAdam", True, False),
    "onebit_local_clip": ("OneBitAdam", True, False),
    "onebit_local_clip_refresh": ("OneBitAdam", True, False),
    "onebit_local_clip_preconditioned_clip": ("OneBitAdam", True, False),
}
EXTRA = {  # name -> further jonebit-only optimizer params
    "onebit_row_scales": {"row_scales": True},
    "onebit_preconditioned": {"preconditioned": True},
    "onebit_preconditioned_rows": {"preconditioned": True, "row_scales": True},
    "onebit_refresh": {"variance_refresh": 16},
    "onebit_preconditioned_clip": {"preconditioned": True, "clip_ratio": 7.27},
    "onebit_preconditioned_clip_refresh": {"preconditioned": True, "clip_ratio": 7.27, "variance_refresh": 16},
    "onebit_local_clip": {"local_clip": True},
    "onebit_local_clip_refresh": {"local_clip": True, "variance_refresh": 16},
    "onebit_local_clip_preconditioned_clip": {"local_clip": True, "preconditioned": True, "clip_ratio": 7.27},
}
DEFAULT_VARIANTS = ["adam", "onebit_deepspeed", "onebit_bias_fused", "onebit_default"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    ap.add_argument("--model", default="tiny", help="tiny|mini|small|... (default tiny)")
    ap.add_argument("--corpus", nargs="+", help="pre-training text (default: CPython's pydoc_data topics)")
    ap.add_argument("--vocab", help="BERT vocab.txt (default: a 2,000-token vocabulary trained on the corpus)")
    ap.add_argument("--heldout-documents", type=int, default=6)
    ap.add_argument("--dupe-factor", type=int, default=5)
    ap.add_argument("--freeze", type=float, default=0.2, help="1-bit Adam's warmup as a fraction of the steps")
    ap.add_argument("--eval-batches", type=int, default=20)
    ap.add_argument("--tag", default="", help="result file name (results/defaults_convergence/TAG.json)")
    ap.add_argument("--workdir", default="runs/defaults_convergence")
    ap.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint each run every N steps (0: at the end)")
    ap.add_argument("--resume", action="store_true",
                    help="continue each variant's run from its last checkpoint in --workdir instead of starting it "
                         "afresh: a long study split over several sittings (stop it, run the same command again)")
    ap.add_argument("--until-step", type=int, default=0,
                    help="stop every variant at this step (with --checkpoint-every and --resume: a long study "
                         "advanced variant by variant in the same steps, so each sitting ends with a comparison at "
                         "one step; the schedule, freeze and eval points stay those of --steps)")
    args = ap.parse_args(argv)
    if args.until_step < 0 or args.until_step > args.steps:
        ap.error(f"--until-step {args.until_step} must be between 1 and --steps {args.steps} (0: run to --steps)")
    stop = args.until_step or args.steps

    from jonebit.apps.pretrain import _prepare_data, default_configs, run
    from jonebit.plot import plot_runs

    work = pathlib.Path(args.workdir)
    prep = argparse.Namespace(corpus=args.corpus, vocab=args.vocab, vocab_size=2000, seq_len=args.seq_len,
                              max_predictions=20, dupe_factor=args.dupe_factor, seed=args.seed,
                              heldout_documents=args.heldout_documents, whole_word_mask=False, data_dir=None,
                              overwrite_data=False)
    data_dir, vocab, _ = _prepare_data(prep, work)
    configs = default_configs(args.steps, args.batch_size, lr=args.lr)
    rows, outputs = [], []
    for name in args.variants:
        kind, bias, fused, *auto = VARIANTS[name]
        cfg = json.loads(json.dumps(configs["adam" if kind == "Adam" else "onebit_adam"]))
        if kind == "OneBitAdam":
            cfg["optimizer"]["params"]["bias_correction"] = bias
            cfg["optimizer"]["params"]["freeze_step"] = max(2, int(args.steps * args.freeze)) + 1  # DeepSpeed's
            cfg["optimizer"]["params"].update(EXTRA.get(name, {}))
            if auto:
                cfg["optimizer"]["params"]["freeze_step"] = "auto"
                if auto[0]:
                    cfg["optimizer"]["params"]["auto_freeze"] = auto[0]
        out = work / name
        if not args.resume:
            shutil.rmtree(out, ignore_errors=True)  # each run starts fresh (the data cache is kept)
        print(f"\n== {name}", flush=True)
        t0 = time.perf_counter()
        result = run(cfg, data_dir=data_dir, vocab_file=vocab, model=args.model, seq_len=args.seq_len,
                     max_steps=stop, output=out, seed=args.seed, resume=args.resume, export=False, fused=fused,
                     checkpoint_every=args.checkpoint_every,
                     eval_batches=args.eval_batches, eval_every=max(1, args.steps // 10))
        last = result.records[-1]
        evals = [r for r in result.records if "eval/mlm_loss" in r]
        tail = [r["loss"] for r in result.records[-max(1, len(result.records) // 10):]]
        # The record of step n says the stage of the update after n - 1 updates.
        first = next((r["step"] for r in result.records if r.get("stage") == "compression"), None)
        # Never compressed: "at the end" for a whole run, unknown yet for one stopped early (--until-step).
        freeze_at = None if kind != "OneBitAdam" else first - 1 if first is not None else \
            args.steps if stop == args.steps else None
        rows.append({"variant": name, "bias_correction": bias, "fused": fused,
                     "freeze": "auto" if auto else None if kind != "OneBitAdam" else "fixed",
                     "auto_freeze": auto[0] if auto else None, "freeze_at": freeze_at,
                     "train_loss_tail": sum(tail) / len(tail), "heldout_mlm_loss": last.get("eval/mlm_loss"),
                     "heldout_mlm_accuracy": last.get("eval/mlm_accuracy"),
                     "nsp_accuracy": last.get("eval/nsp_accuracy"), "seconds": time.perf_counter() - t0,
                     "curve": [(r["step"], r["loss"]) for r in result.records],
                     "eval_curve": [(r["step"], r["eval/mlm_loss"]) for r in evals],
                     # (step, held-out MLM accuracy, NSP accuracy) at the same points as eval_curve
                     "eval_accuracy_curve": [(r["step"], r.get("eval/mlm_accuracy"), r.get("eval/nsp_accuracy"))
                                             for r in evals]})
        outputs.append(out)
    ref = next((r["heldout_mlm_loss"] for r in rows if r["variant"] == "adam"), None)
    lines = ["| run | bias correction | fused | freeze at | train loss (last 10%) | held-out MLM loss | vs Adam | "
             "MLM acc |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gap = f"{100 * (r['heldout_mlm_loss'] - ref) / ref:+.2f}%" if ref and r["heldout_mlm_loss"] else ""
        at = "" if r["freeze_at"] is None else f"{r['freeze_at']} ({100 * r['freeze_at'] / args.steps:.0f}%)"
        lines.append(f"| {r['variant']} | {r['bias_correction']} | {r['fused']} | {at} | {r['train_loss_tail']:.3f} | "
                     f"{r['heldout_mlm_loss']:.3f} | {gap} | {r['heldout_mlm_accuracy']:.3f} |")
    print("\n" + "\n".join(lines))
    payload = {"command": " ".join(["python", "benchmarks/defaults_convergence.py",
                                                          *(argv if argv is not None else sys.argv[1:])]),
               "steps": args.steps, "until_step": stop, "batch_size": args.batch_size, "seq_len": args.seq_len,
               "lr": args.lr,
               "model": args.model, "corpus": args.corpus or "pydoc_data", "freeze": args.freeze, "rows": rows}
    path = write_json("defaults_convergence", payload, tag=args.tag)
    png = path.with_suffix(".png")
    plot_runs(outputs, png, labels=[r["variant"] for r in rows], smooth=1)
    print(f"wrote {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
