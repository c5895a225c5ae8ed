"""One BERT pre-training step (forward + backward + AdamW) on CPU: jonebit (JAX, Flax NNX) vs transformers (PyTorch).

Both frameworks train BertForPreTraining of the same configuration on the same batch (masked LM + next sentence
loss, dropout on), pinned to the same cores with the same thread count. Reports tokens/s (median of the timed steps)
and the jonebit / PyTorch ratio measured in this one run (timed steps alternate between the two, so that load from
other processes falls on both alike), prints a table and writes JSON.

    python benchmarks/bert_step.py --config base --batch 8 --seq 128 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="base", help="BertConfig preset (tiny, mini, small, medium, base, large)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (the first one compiles)")
    p.add_argument("--steps", type=int, default=5, help="timed steps; the median is reported")
    p.add_argument("--threads", type=int, default=2, help="cores both frameworks are pinned to")
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "bert_step" / "bert_step.json"))
    return p.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    # Same cores and thread count for both: XLA's CPU thread pool sizes itself from the affinity mask, PyTorch is
    # told explicitly. Must happen before jax / torch are imported.
    cores = sorted(os.sched_getaffinity(0))[: ARGS.threads]
    os.sched_setaffinity(0, cores)
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)
    os.environ["MKL_NUM_THREADS"] = str(ARGS.threads)

import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def make_batch(vocab: int, batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tokens, a padded tail on half the rows, 15% MLM targets (label -100 elsewhere), NSP labels."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, vocab, (batch, seq), dtype=np.int64)
    ids[:, 0] = 101
    mask = np.ones((batch, seq), np.int64)
    mask[::2, seq - seq // 8 :] = 0
    ids[mask == 0] = 0
    types = np.zeros((batch, seq), np.int64)
    types[:, seq // 2 :] = 1
    labels = np.where((rng.random((batch, seq)) < 0.15) & (mask == 1), ids, -100)
    nsp = rng.integers(0, 2, (batch,), dtype=np.int64)
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels, next_sentence_label=nsp)


def run_interleaved(steps_by_name: dict, warmup: int, steps: int) -> dict[str, list[float]]:
    """Warm every framework up, then alternate their timed steps so that load from other processes on the machine
    falls on both alike."""
    for step in steps_by_name.values():
        for _ in range(warmup - 1):  # the first (compiling) step already ran
            step()
    times: dict[str, list[float]] = {name: [] for name in steps_by_name}
    for i in range(steps):
        for name, step in steps_by_name.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
            print(f"  step {i + 1}/{steps} {name}: {times[name][-1]:.3f} s", flush=True)
    return times


def bench_jonebit(args, batch) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jonebit.models.bert import BertConfig, BertForPreTraining, pretraining_loss

    config = BertConfig.preset(args.config)
    model = BertForPreTraining(config, rngs=nnx.Rngs(params=0, dropout=1))
    model.train()
    optimizer = nnx.Optimizer(model, optax.adamw(1e-4, weight_decay=0.01), wrt=nnx.Param)
    data = {k: jnp.asarray(v, jnp.int32) for k, v in batch.items()}

    def loss_fn(model, data):
        out = model(data["input_ids"], data["attention_mask"], data["token_type_ids"])
        return pretraining_loss(out, data)

    @nnx.jit
    def train_step(model, optimizer, data):
        loss, grads = nnx.value_and_grad(loss_fn)(model, data)
        optimizer.update(model, grads)
        return loss

    step = lambda: float(train_step(model, optimizer, data))
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    return step, dict(first_step_s=first, version=f"jax {jax.__version__}")


def bench_torch(args, batch) -> dict:
    import torch
    import transformers

    from jonebit.models.bert import BertConfig

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = transformers.BertConfig(**BertConfig.preset(args.config).to_hf_dict())
    model = transformers.BertForPreTraining(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    data = {k: torch.from_numpy(v) for k, v in batch.items()}

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = model(**data).loss
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    return step, dict(first_step_s=first, version=f"torch {torch.__version__}, transformers {transformers.__version__}")


def main(args) -> None:
    if args.warmup < 1 or args.steps < 1:
        raise SystemExit("--warmup and --steps must be at least 1")
    from jonebit.models.bert import BertConfig

    config = BertConfig.preset(args.config)
    if args.seq > config.max_position_embeddings:
        raise SystemExit(f"--seq {args.seq} exceeds max_position_embeddings {config.max_position_embeddings}")
    batch = make_batch(config.vocab_size, args.batch, args.seq)
    tokens = args.batch * args.seq
    print("jonebit (JAX): building and compiling", flush=True)
    steps, results = {}, {}
    steps["jonebit"], results["jonebit"] = bench_jonebit(args, batch)
    if not args.skip_torch:
        print("transformers (PyTorch): building, first step", flush=True)
        steps["pytorch"], results["pytorch"] = bench_torch(args, batch)
    times = run_interleaved(steps, args.warmup, args.steps)
    for name, r in results.items():
        r["times_s"] = times[name]
        r["loss"] = steps[name]()  # one more step: the loss after warmup + timed steps, a sanity check
        r["median_step_s"] = statistics.median(r["times_s"])
        r["tokens_per_s"] = tokens / r["median_step_s"]
        r["min_step_s"] = min(r["times_s"])  # the least disturbed step: closest to an idle machine

    report = dict(
        benchmark="BertForPreTraining forward+backward+AdamW step, CPU",
        load_average_at_end=os.getloadavg(),
        config=args.config, batch=args.batch, seq=args.seq, threads=args.threads, warmup=args.warmup,
        steps=args.steps, cpu=platform.processor() or platform.machine(), results=results,
    )
    if "pytorch" in results:
        report["ratio_jonebit_over_pytorch"] = results["jonebit"]["tokens_per_s"] / results["pytorch"]["tokens_per_s"]
        report["ratio_of_min_steps"] = results["pytorch"]["min_step_s"] / results["jonebit"]["min_step_s"]

    print(f"\nBertForPreTraining ({args.config}), batch {args.batch} x seq {args.seq}, {args.threads} CPU threads")
    print(f"{'framework':<10} {'median step s':>14} {'tokens/s':>10} {'first step s':>13} {'loss':>8}  version")
    for name, r in results.items():
        print(f"{name:<10} {r['median_step_s']:>14.3f} {r['tokens_per_s']:>10.1f} {r['first_step_s']:>13.1f} "
              f"{r['loss']:>8.3f}  {r['version']}")
    if "ratio_jonebit_over_pytorch" in report:
        print(f"ratio jonebit / pytorch (tokens/s of median steps): {report['ratio_jonebit_over_pytorch']:.2f}x, "
              f"of fastest steps: {report['ratio_of_min_steps']:.2f}x")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from benchmarks.report import run_meta

    out.write_text(json.dumps({"meta": run_meta(), **report}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(ARGS)
