"""``jonebit pretrain``'s embedded default under the evidence protocol: Adam against 1-bit Adam over several seeds.

The protocol (benchmarks/BENCHMARKS.md, "The evidence protocol"), on the embedded job of ``jonebit pretrain`` (the
tiny BERT on CPython's ``pydoc_data`` text, 300 steps, 8 simulated devices):

* **Splits.** The corpus's last 11 documents are the held-out split (results), the 5 before them the validation
  split (choices); their sentences that also occur in the training documents are left out, and the vocabulary is
  trained on the training documents only (``jonebit pretrain``'s own data path).
* **Arms.** Per seed, in this one invocation: ``adam`` and each 1-bit Adam candidate (``CANDIDATES``: the embedded
  1-bit Adam without and with ``variance_refresh=16``; the latter is the embedded default since this study chose
  it), on the same instances, initial weights and batch order.
* **Choice.** The 1-bit Adam default is the candidate with the lowest mean *validation* MLM loss over the seeds,
  except that one sending more bytes must beat a cheaper one by more than the standard error of their paired
  difference (otherwise the cheaper stays). The held-out loss of every arm is reported beside it, never used to
  choose.

    python benchmarks/pretrain_protocol.py                    # 3 seeds x 3 arms, ~15 min on 2 idle cores

Rerunning the command skips finished runs. Result: ``benchmarks/results/pretrain_protocol/pretrain_protocol.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.common import write_json  # noqa: E402  (sets 8 CPU devices)
from benchmarks.report import spread  # noqa: E402

# 1-bit Adam candidates for the embedded default: name -> optimizer params set in the embedded 1-bit Adam config (None:
# removed), cheapest (fewest bytes) first. "onebit_default" is the embedded default before this study chose refresh.
CANDIDATES = {"onebit_default": {"variance_refresh": None}, "onebit_refresh16": {"variance_refresh": 16}}


def paired_se(a: list[float], b: list[float]) -> float:
    """Standard error of the mean of the paired differences a - b."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    return statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("inf")


def choose(validation: dict[str, list[float]]) -> str:
    """The candidate chosen by the rule of the module docstring (``validation``: name -> per-seed losses, in the
    order of ``CANDIDATES``, cheapest first)."""
    names = list(validation)
    best = min(names, key=lambda n: statistics.fmean(validation[n]))
    for name in names:  # the cheapest one that the best does not beat by more than the noise
        if name == best or statistics.fmean(validation[name]) - statistics.fmean(validation[best]) <= \
                paired_se(validation[name], validation[best]):
            return name
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the embedded default's)")
    ap.add_argument("--workdir", default="runs/pretrain_protocol")
    ap.add_argument("--tag", default="", help="result file name (results/pretrain_protocol/TAG.json)")
    args = ap.parse_args(argv)

    from jonebit.apps import pretrain
    from jonebit.plot import cumulative_bytes, plot_runs

    steps = args.steps or pretrain._DEFAULT_STEPS
    work = pathlib.Path(args.workdir)
    configs = pretrain.default_configs(steps, 64)
    arms = {"adam": configs["adam"]}
    for name, extra in CANDIDATES.items():
        cfg = json.loads(json.dumps(configs["onebit_adam"]))
        cfg["optimizer"]["params"].update(extra)
        cfg["optimizer"]["params"] = {k: v for k, v in cfg["optimizer"]["params"].items() if v is not None}
        arms[name] = cfg
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    for seed in args.seeds:
        prep = argparse.Namespace(corpus=None, vocab=None, vocab_size=2000, seq_len=64, max_predictions=20,
                                  dupe_factor=5, seed=seed, heldout_documents=pretrain._EMBEDDED_HELDOUT,
                                  validation_documents=pretrain._EMBEDDED_VALIDATION,
                                  heldout_passes=pretrain._EMBEDDED_PASSES, whole_word_mask=False, data_dir=None,
                                  overwrite_data=False)
        seed_dir = work / f"seed{seed}"
        data_dir, vocab, _ = pretrain._prepare_data(prep, seed_dir)
        for name, cfg in arms.items():
            out = seed_dir / name
            done = out / "summary.json"
            if done.is_file():
                print(f"== seed {seed} {name}: finished earlier", flush=True)
                runs[name].append(json.loads(done.read_text()))
                continue
            print(f"\n== seed {seed} {name}", flush=True)
            t0 = time.perf_counter()
            result = pretrain.run(cfg, data_dir=data_dir, vocab_file=vocab, model="tiny", seq_len=64,
                                  max_steps=steps, output=out, seed=seed, export=False,
                                  eval_every=-(-steps // pretrain._EVAL_POINTS), progress=False)
            last = result.records[-1]
            sent = float(cumulative_bytes(result.records)[-1])
            row = {"seed": seed, "seconds": time.perf_counter() - t0, "bytes_sent_per_rank": sent,
                   "heldout_mlm_loss": last["eval/mlm_loss"], "heldout_masked_tokens": int(last["eval/masked_tokens"]),
                   "validation_mlm_loss": last["eval/validation/mlm_loss"],
                   "validation_masked_tokens": int(last["eval/validation/masked_tokens"]),
                   "heldout_mlm_accuracy": last["eval/mlm_accuracy"], "nsp_accuracy": last["eval/nsp_accuracy"],
                   "eval_curve": [(r["step"], r["eval/mlm_loss"], r["eval/validation/mlm_loss"])
                                  for r in result.records if "eval/mlm_loss" in r]}
            done.write_text(json.dumps(row, indent=2) + "\n")
            runs[name].append(row)
    chosen = choose({n: [r["validation_mlm_loss"] for r in runs[n]] for n in CANDIDATES})
    adam = runs["adam"]
    summary = {}
    for name, rows in runs.items():
        gaps = [100 * (r["heldout_mlm_loss"] - a["heldout_mlm_loss"]) / a["heldout_mlm_loss"]
                for r, a in zip(rows, adam, strict=True)]
        vgaps = [100 * (r["validation_mlm_loss"] - a["validation_mlm_loss"]) / a["validation_mlm_loss"]
                 for r, a in zip(rows, adam, strict=True)]
        summary[name] = {"heldout_mlm_loss": spread([r["heldout_mlm_loss"] for r in rows]),
                         "validation_mlm_loss": spread([r["validation_mlm_loss"] for r in rows]),
                         "heldout_gap_percent": gaps, "heldout_gap_percent_spread": spread(gaps),
                         "validation_gap_percent": vgaps,
                         "bytes_vs_adam": statistics.fmean(r["bytes_sent_per_rank"] for r in rows) /
                         statistics.fmean(a["bytes_sent_per_rank"] for a in adam)}
    lines = ["| arm | validation loss (mean) | held-out loss (mean) | held-out gap to Adam per seed | mean gap | "
             "bytes vs Adam |", "|---|---|---|---|---|---|"]
    for name, s in summary.items():
        per = ", ".join(f"{g:+.2f}%" for g in s["heldout_gap_percent"])
        lines.append(f"| {name}{' (chosen)' if name == chosen else ''} | {s['validation_mlm_loss']['mean']:.3f} | "
                     f"{s['heldout_mlm_loss']['mean']:.3f} | {per} | {s['heldout_gap_percent_spread']['mean']:+.2f}% "
                     f"| {s['bytes_vs_adam']:.3f} |")
    print("\n" + "\n".join(lines))
    masked = {"heldout": adam[0]["heldout_masked_tokens"], "validation": adam[0]["validation_masked_tokens"]}
    payload = {"steps": steps, "seeds": args.seeds, "arms": {n: runs[n] for n in runs}, "summary": summary,
               "chosen": chosen, "masked_tokens": masked, "candidates": CANDIDATES,
               "rule": "lowest mean validation MLM loss; a candidate sending more bytes must beat a cheaper one by "
                       "more than the standard error of their paired difference"}
    path = write_json("pretrain_protocol", payload, tag=args.tag)
    png = path.with_suffix(".png")
    plot_runs([work / f"seed{args.seeds[0]}" / n for n in runs], png, labels=list(runs), smooth=1)
    print(f"wrote {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
