"""``jonebit pretrain``: BERT pre-training (masked LM + next sentence) with a DeepSpeed config.

    jonebit pretrain --config configs/bing_bert_onebit_adam.json --corpus wiki.txt --vocab vocab.txt \\
        --model base --seq-len 128 --batch-size 256 --max-steps 10000 --output runs/bert

Steps: build (or reuse) the instance cache of the corpus (:mod:`jonebit.data.pretraining`), build the engine from
the config (:func:`jonebit.train.initialize.initialize`), train with checkpoints, metrics, held-out evaluation and
resume (:mod:`jonebit.train.loop`), and export the model as a HuggingFace checkpoint (``OUTPUT/hf``) that
``transformers.BertForPreTraining.from_pretrained`` loads.

With no ``--corpus`` it runs the **embedded default**: the reference text that ships with CPython
(``pydoc_data``), a WordPiece vocabulary trained on it, a tiny BERT, pre-trained once with Adam and once with 1-bit
Adam on the same data and seed, then a comparison table and ``curves.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pathlib
import sys
import time
from typing import Any

from jonebit.apps import DEFAULT_DEVICES

log = logging.getLogger(__name__)

# The embedded default's optimizers: same schedule; 1-bit Adam freezes after 40% of the steps. A short run spends a
# third of its steps on the early loss plateau, and a variance frozen there (20%, DeepSpeed's usual share of a long
# run) can leave 1-bit Adam behind for good (BENCHMARKS). bias_correction and per-tensor compression (fused=False)
# are the settings that converge on small models. variance_refresh=16 (every 16th compressed update exact, and the
# variance refreshed) won on the validation split over 3 seeds (benchmarks/pretrain_protocol.py).
_DEFAULT_STEPS = 300
_EVAL_POINTS = 5  # held-out evaluations through the embedded run (the last at its end)
# The embedded corpus's evaluation splits (documents from its end, in pydoc_data's alphabetical topic order): the
# held-out split (results) holds 20% of the text, the validation split (choices) 11%; two masking passes give each
# >= 5,000 / 2,500 masked tokens after the sentences that also occur in training are left out.
_EMBEDDED_HELDOUT, _EMBEDDED_VALIDATION, _EMBEDDED_PASSES = 11, 5, 2


def default_configs(max_steps: int, batch_size: int, lr: float = 2e-3) -> dict[str, dict]:
    """The embedded default's two DeepSpeed configs (Adam and 1-bit Adam), same schedule and batch."""
    warmup = max(2, max_steps // 10)
    sched = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                 "warmup_num_steps": warmup, "total_num_steps": max_steps + 1,
                                                 "warmup_type": "linear"}}
    base = {"train_batch_size": batch_size, "steps_per_print": max(1, max_steps // 10), "gradient_clipping": 1.0,
            "scheduler": sched}
    adam = dict(base, optimizer={"type": "Adam", "params": {"lr": lr, "weight_decay": 0.01}})
    onebit = dict(base, optimizer={"type": "OneBitAdam", "params": {
        "lr": lr, "weight_decay": 0.01, "freeze_step": max(2, 2 * max_steps // 5) + 1, "bias_correction": True,
        "variance_refresh": 16}})
    return {"adam": adam, "onebit_adam": onebit}


def embedded_corpus(path: pathlib.Path) -> pathlib.Path:
    """Writes CPython's ``pydoc_data`` topics as a corpus: one topic per document, one paragraph per line."""
    import pydoc_data.topics

    docs = []
    for text in pydoc_data.topics.topics.values():
        paragraphs = [" ".join(p.split()) for p in text.split("\n\n")]
        paragraphs = [p for p in paragraphs if len(p) > 20 and not set(p) <= set("*=-~ ")]
        if paragraphs:
            docs.append("\n".join(paragraphs))
    text = "\n\n".join(docs) + "\n"
    if not (path.is_file() and path.read_text(encoding="utf-8") == text):  # other processes may be reading it
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    return path


def _model_config(name: str, vocab_size: int, seq_len: int):
    from jonebit.models.bert import BertConfig

    if name.startswith("hf:"):
        from jonebit.models.bert.params import read_hf_checkpoint

        cfg, _ = read_hf_checkpoint(name[3:])
        return cfg
    return BertConfig.preset(name, vocab_size=vocab_size, max_position_embeddings=max(512, seq_len))


def build_model(name: str, vocab_size: int, seq_len: int, seed: int, dtype=None, scan_layers: bool = False):
    """A ``BertForPreTraining``: a preset initialised from ``seed``, or ``hf:DIR`` loaded from a checkpoint.

    ``dtype`` is the compute dtype (float32 parameters either way; None: float32). ``scan_layers``: the stacked
    encoder, which ZeRO stage 3 gathers layer by layer.
    """
    import jax.numpy as jnp
    from flax import nnx

    from jonebit.models.bert import BertForPreTraining, load_hf_checkpoint

    if name.startswith("hf:"):
        model = load_hf_checkpoint(name[3:], model_cls=BertForPreTraining, dtype=dtype or jnp.float32,
                                   scan_layers=scan_layers)
        if model.config.vocab_size != vocab_size:
            raise ValueError(f"--model {name} has vocab_size {model.config.vocab_size}, the tokenizer has "
                             f"{vocab_size}: pass the checkpoint's vocab.txt with --vocab")
        return model
    return BertForPreTraining(_model_config(name, vocab_size, seq_len), dtype=dtype or jnp.float32,
                              scan_layers=scan_layers, rngs=nnx.Rngs(params=seed, dropout=seed + 1))


# Optimizers that treat a stacked leaf as its layers' tensors: Adam and AdamW are element-wise, and 1-bit Adam's
# ZeRO variant gives each layer of a stack a buffer of its own (its own compression scales). LAMB's trust ratio is
# per tensor and would become per stack.
STACKABLE_OPTIMIZERS = ("Adam", "AdamW", "OneBitAdam")


def stacks_layers(cfg) -> bool:
    """Whether to build the stacked encoder: ZeRO stage 3 gathers it layer by layer, with an optimizer that sees
    each layer as its own tensor (for the others the layers stay separate tensors, and stage 3 gathers them at the
    step's start)."""
    return cfg.zero_optimization.stage == 3 and cfg.optimizer is not None and \
        cfg.optimizer.type in STACKABLE_OPTIMIZERS


def make_loss(graphdef, keys, rest):
    """``loss_fn(params, batch, rng)``: MLM + NSP loss, dropout drawn from the engine's key.

    ``keys`` is the model's ``nnx.RngState`` (stream keys and counters); each step derives every stream key from the
    engine's key (which depends on the step, the rank and the micro-batch only; :func:`jonebit.nnx.reseed`), so
    dropout is reproducible across restarts and each dropout layer draws its own mask.
    """
    from flax import nnx

    from jonebit.models.bert import pretraining_loss
    from jonebit.nnx import reseed

    def loss_fn(params, batch, rng):
        fresh = reseed(keys, rng)
        model = nnx.merge(graphdef, params, fresh, rest)
        # The MLM head at the masked positions only (the gather form of the batch): the same loss, and with a
        # 30k vocabulary about half the work of the step.
        out = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"],
                    masked_positions=batch["masked_lm_positions"], deterministic=False)
        return pretraining_loss(out, batch)

    return loss_fn


def make_evaluate(graphdef, keys, rest, splits: dict, batch_size: int, max_batches: int | None = None):
    """``evaluate(state)``: MLM loss and accuracy and NSP accuracy (dropout off) on each split of ``splits``
    (name -> :class:`~jonebit.data.pretraining.PretrainingData`), over all its instances (the first ``max_batches``
    batches). The ``heldout`` split's keys are ``mlm_loss``, ..., another split's are prefixed with its
    name (``validation/mlm_loss``); ``masked_tokens`` counts the predictions scored."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from jonebit.train.engine import model_params

    @jax.jit
    def sums(params, batch):
        fixed = jax.tree.map(lambda x: x, keys)  # fresh Variables in this trace
        out = nnx.merge(graphdef, params, fixed, rest)(batch["input_ids"], batch["attention_mask"],
                                                batch["token_type_ids"],
                                                masked_positions=batch["masked_lm_positions"], deterministic=True)
        labels = batch["masked_lm_ids"]
        valid = batch["masked_lm_weights"] > 0
        logits = out.prediction_logits.astype(jnp.float32)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, labels, 0))
        hit = jnp.argmax(logits, -1) == labels
        nsp_hit = jnp.argmax(out.seq_relationship_logits, -1) == batch["next_sentence_label"]
        return jnp.stack([jnp.sum(jnp.where(valid, ce, 0.0)), jnp.sum(valid & hit), jnp.sum(valid),
                          jnp.sum(nsp_hit), nsp_hit.size])

    batches = {}
    for name, data in splits.items():
        n = len(data) if max_batches is None else min(len(data), max_batches * batch_size)
        if n < 1:
            raise ValueError(f"the {name} split has no instances: hold out more documents")
        # Every instance is scored: the last, shorter batch is a second shape (one more compilation).
        batches[name] = [data.rows(np.arange(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]

    def evaluate(state) -> dict:
        params = jax.device_get(model_params(state.params))
        out = {}
        for name, split in batches.items():
            total = sum(np.asarray(sums(params, b), np.float64) for b in split)
            prefix = "" if name == "heldout" else f"{name}/"
            out |= {f"{prefix}mlm_loss": total[0] / total[2], f"{prefix}mlm_accuracy": total[1] / total[2],
                    f"{prefix}nsp_accuracy": total[3] / total[4], f"{prefix}masked_tokens": int(total[2])}
        return out

    return evaluate


@dataclasses.dataclass
class RunResult:
    name: str
    output: pathlib.Path
    records: list
    seconds: float


def run(
    config: Any,
    *,
    data_dir: pathlib.Path,
    vocab_file: pathlib.Path,
    model: str,
    seq_len: int,
    max_steps: int,
    output: pathlib.Path,
    seed: int = 0,
    eval_every: int = 0,
    eval_batches: int | None = None,
    checkpoint_every: int = 0,
    resume: bool = True,
    progress: bool = True,
    export: bool = True,
    fused: bool | None = None,
) -> RunResult:
    """Pre-trains one model; returns its metrics records (``fused``: 1-bit Adam's compression, see initialize)."""
    import jax
    from flax import nnx

    from jonebit.data.pretraining import PretrainingData
    from jonebit.data.tokenization import load_wordpiece
    from jonebit.models.bert import position_embedding_mask, save_hf_checkpoint
    from jonebit.train.config import ONEBIT_OPTIMIZERS, load_config
    from jonebit.train.initialize import compute_dtype, initialize

    tokenizer = load_wordpiece(vocab_file)
    cfg = load_config(config)
    net = build_model(model, tokenizer.vocab_size, seq_len, seed, dtype=compute_dtype(cfg),
                      scan_layers=stacks_layers(cfg))
    if net.config.max_position_embeddings < seq_len:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings "
                         f"{net.config.max_position_embeddings}")
    graphdef, params, keys, rest = nnx.split(net, nnx.Param, nnx.RngState, ...)
    onebit = cfg.optimizer is not None and cfg.optimizer.type in ONEBIT_OPTIMIZERS
    mask = position_embedding_mask(params, seq_len) if onebit else None
    engine = initialize(cfg, make_loss(graphdef, keys, rest), params, exp_avg_mask=mask, rng_seed=seed,
                        fused=fused)
    train_data = PretrainingData(data_dir, "train")
    held = {name: PretrainingData(data_dir, name) for name in ("heldout", "validation")
            if name in train_data.manifest["instances"]}
    evaluate = None
    if held:
        evaluate = make_evaluate(graphdef, keys, rest, held, engine.batch.train_batch_size, eval_batches)
    loop = engine.loop_config(output, max_steps, checkpoint_every=checkpoint_every, eval_every=eval_every,
                              tokens_per_example=seq_len, progress_bar=progress)
    t0 = time.perf_counter()
    from jonebit.train.loop import RESUME_FIXED

    # Saved with each checkpoint: a resume warns about changed settings and refuses those the state depends on.
    run_config = {**cfg.to_dict(), "pretrain": {"model": model, "seq_len": seq_len, "seed": seed}}
    engine.train(train_data.batches(engine.batch.train_batch_size, seed=seed), loop, evaluate=evaluate,
                 resume=resume, run_config=run_config, fixed=RESUME_FIXED + ("pretrain.model", "pretrain.seq_len"))
    seconds = time.perf_counter() - t0
    if export and jax.process_index() == 0:
        nnx.update(net, jax.device_get(engine.params))
        save_hf_checkpoint(net, output / "hf")
        tokenizer.save_vocab(output / "hf" / "vocab.txt")
    records = []  # written by process 0
    if jax.process_index() == 0:
        records = [json.loads(x) for x in (output / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return RunResult(name=output.name, output=output, records=records, seconds=seconds)


def _prepare_data(args, out: pathlib.Path):
    from jonebit.data.pretraining import PretrainingOptions, build_pretraining_data, read_documents, split_documents
    from jonebit.data.tokenization import load_wordpiece, train_wordpiece

    corpus = [pathlib.Path(c) for c in args.corpus] if args.corpus else [embedded_corpus(out / "corpus.txt")]
    for c in corpus:
        if not c.is_file():
            raise FileNotFoundError(f"no corpus file at {c}")
    options = PretrainingOptions(max_seq_length=args.seq_len, max_predictions_per_seq=args.max_predictions,
                                 dupe_factor=args.dupe_factor, seed=args.seed,
                                 heldout_documents=args.heldout_documents,
                                 validation_documents=getattr(args, "validation_documents", 0) or 0,
                                 heldout_dupe_factor=getattr(args, "heldout_passes", 1) or 1,
                                 whole_word_mask=args.whole_word_mask)
    if args.vocab:
        vocab = pathlib.Path(args.vocab)
        tokenizer = load_wordpiece(vocab)
    else:
        vocab = out / "vocab.txt"
        if vocab.is_file():
            tokenizer = load_wordpiece(vocab)
        else:  # on the training documents only: held-out words stay unseen, as they would be for a real vocabulary
            print(f"training a {args.vocab_size}-token WordPiece vocabulary on the training documents of "
                  f"{', '.join(map(str, corpus))}")
            train_docs = split_documents(read_documents(corpus), options)["train"]
            tokenizer = train_wordpiece((s for d in train_docs for s in d), args.vocab_size, progress=True)
            out.mkdir(parents=True, exist_ok=True)
            tokenizer.save_vocab(vocab)
    data_dir = pathlib.Path(args.data_dir) if args.data_dir else out / "data"
    build_pretraining_data(corpus, tokenizer, data_dir, options, overwrite=args.overwrite_data)
    return data_dir, vocab, tokenizer


def _default_heldout(corpus) -> int:
    """Documents held out for evaluation when --heldout-documents is not given: 11 of the embedded corpus; 5% of a
    user's corpus (at least 2, at most 1,000), or none (said) when it has fewer than 8 documents."""
    if not corpus:
        return _EMBEDDED_HELDOUT
    from jonebit.data.pretraining import read_documents

    n = len(read_documents(corpus))  # raises FileNotFoundError naming a missing file
    if n < 8:
        print(f"evaluation skipped: the corpus has {n} documents, too few to hold any out (documents are separated "
              "by blank lines; --heldout-documents N keeps N of them)")
        return 0
    held = min(1000, max(2, round(0.05 * n)))
    print(f"holding out the last {held} of {n} documents for evaluation (--heldout-documents)")
    return held


def _table(results: list[RunResult]) -> str:
    lines = ["| run | final train loss | held-out MLM loss | MLM acc | NSP acc | MB sent per rank | bytes/step "
             "warmup | bytes/step compression | seconds |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        recs = r.records
        last = recs[-1]
        tail = [x["loss"] for x in recs[-max(1, len(recs) // 10):]]
        sent = 0.0
        prev = 0
        for x in recs:
            b = x.get("bytes_sent")
            sent += (b if isinstance(b, int | float) else 0.0) * (x["step"] - prev)
            prev = x["step"]
        by_stage = {}
        for x in recs:
            by_stage.setdefault(x["stage"], x["bytes_sent"])
        warm = by_stage.get("warmup", by_stage.get("full", float("nan")))
        comp = by_stage.get("compression", float("nan"))
        held = " | ".join(f"{last[k]:.3f}" if k in last else "-"
                          for k in ("eval/mlm_loss", "eval/mlm_accuracy", "eval/nsp_accuracy"))
        number = lambda v: "-" if v != v else f"{v:,.0f}"  # noqa: E731 - nan: no step of that stage
        lines.append(f"| {r.name} | {sum(tail) / len(tail):.3f} | {held} | {sent / 1e6:.1f} | {number(warm)} | "
                     f"{number(comp)} | {r.seconds:.0f} |")
    return "\n".join(lines)


def add_parser(subparsers) -> None:
    """Registers ``jonebit pretrain``."""
    p = subparsers.add_parser("pretrain", help="pre-train BERT (MLM + NSP) with a DeepSpeed config",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="DeepSpeed JSON config (default: the embedded Adam vs 1-bit Adam comparison)")
    p.add_argument("--model", default="tiny", help="tiny|mini|small|medium|base|large or hf:DIR (default tiny)")
    p.add_argument("--corpus", nargs="+", help="text files: one paragraph per line, blank line between documents "
                   "(default: CPython's pydoc_data topics)")
    p.add_argument("--vocab", help="BERT vocab.txt (default: train one on the corpus)")
    p.add_argument("--vocab-size", type=int, default=2000, help="size of a trained vocabulary (default 2000)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per instance (default 128; 64 embedded)")
    p.add_argument("--max-steps", type=int, default=None, help=f"optimizer steps (default {_DEFAULT_STEPS} embedded)")
    p.add_argument("--batch-size", type=int, help="override train_batch_size (scales a config down to this machine)")
    p.add_argument("--micro-batch", type=int, help="override train_micro_batch_size_per_gpu")
    p.add_argument("--max-predictions", type=int, default=20, help="masked positions per instance (default 20)")
    p.add_argument("--dupe-factor", type=int, default=5, help="passes over the corpus with new masks (default 5)")
    p.add_argument("--whole-word-mask", action="store_true", help="mask whole words")
    p.add_argument("--heldout-documents", type=int, default=None,
                   help=f"documents at the corpus's end kept for evaluation, the held-out split (default: "
                        f"{_EMBEDDED_HELDOUT} of the embedded corpus, 5%% of yours, 2 to 1,000)")
    p.add_argument("--validation-documents", type=int, default=None,
                   help="documents before the held-out ones kept as a validation split, for choosing options "
                        f"(default: {_EMBEDDED_VALIDATION} of the embedded corpus, none of yours)")
    p.add_argument("--heldout-passes", type=int, default=None,
                   help=f"masking passes over the held-out and validation text (default {_EMBEDDED_PASSES} embedded, "
                        "1 otherwise)")
    p.add_argument("--eval-every", type=int, default=None,
                   help=f"steps between held-out evaluations (0: only at the end; default: {_EVAL_POINTS} points "
                        "through the embedded run, only at the end with --config)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: at the end)")
    p.add_argument("--data-dir", help="instance cache (default OUTPUT/data)")
    p.add_argument("--overwrite-data", action="store_true", help="rebuild a cache built with other options")
    p.add_argument("--output", default="runs/pretrain", help="output directory (default runs/pretrain)")
    p.add_argument("--resume", dest="resume", action="store_true", default=True,
                   help="continue from the output directory's latest checkpoint if it has one (the default)")
    p.add_argument("--no-resume", dest="resume", action="store_false", help="refuse to continue an existing run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--devices", type=int, default=None,
                   help=f"simulated CPU devices of this process when running on CPU (default {DEFAULT_DEVICES}, or "
                        "what `jonebit launch --devices-per-proc` set)")
    p.set_defaults(func=main)


def main(args) -> int:
    """Runs ``jonebit pretrain``; returns the exit code."""
    import jax

    from jonebit.apps import start_devices
    from jonebit.train.config import ConfigError

    start_devices(args.devices)
    lead = jax.process_index() == 0

    out = pathlib.Path(args.output)
    embedded = args.config is None
    if args.seq_len is None:
        args.seq_len = 64 if embedded else 128
    if args.max_steps is None:
        if not embedded:
            print("jonebit pretrain: --max-steps is required with --config", file=sys.stderr)
            return 2
        args.max_steps = _DEFAULT_STEPS
    if args.eval_every is None:  # the embedded comparison's figure shows held-out curves, not end points
        args.eval_every = -(-args.max_steps // _EVAL_POINTS) if embedded else 0
    try:
        if args.heldout_documents is None:
            args.heldout_documents = _default_heldout(args.corpus)
        if args.validation_documents is None:
            args.validation_documents = 0 if args.corpus else _EMBEDDED_VALIDATION
        if args.heldout_passes is None:
            args.heldout_passes = 1 if args.corpus else _EMBEDDED_PASSES
        if lead:  # one process builds the vocabulary and the instances; the others then reuse them
            data_dir, vocab, tokenizer = _prepare_data(args, out)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("jonebit pretrain: data ready")
            if not lead:
                data_dir, vocab, tokenizer = _prepare_data(args, out)
        if embedded:
            configs = default_configs(args.max_steps, args.batch_size or 64)
        else:
            config_path = pathlib.Path(args.config)
            if not config_path.is_file():
                raise FileNotFoundError(f"no DeepSpeed config at {config_path}")
            try:
                cfg = json.loads(config_path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{config_path} is not JSON: {e}") from None
            if args.batch_size:
                cfg["train_batch_size"] = args.batch_size
            if args.micro_batch:
                cfg["train_micro_batch_size_per_gpu"] = args.micro_batch
            elif args.batch_size and "train_micro_batch_size_per_gpu" in cfg:
                cfg.pop("train_micro_batch_size_per_gpu")  # derived from the new batch and the device count
                cfg.pop("gradient_accumulation_steps", None)
            configs = {out.name: cfg}
        results = []
        for name, cfg in configs.items():
            print(f"\n== {name}")
            results.append(run(cfg, data_dir=data_dir, vocab_file=vocab, model=args.model, seq_len=args.seq_len,
                               max_steps=args.max_steps, output=out / name if embedded else out, seed=args.seed,
                               eval_every=args.eval_every, checkpoint_every=args.checkpoint_every,
                               resume=args.resume))
    except (ConfigError, ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"jonebit pretrain: {e}", file=sys.stderr)
        return 2
    if not lead:
        return 0
    print()
    print(_table(results))
    if embedded:
        from jonebit.plot import plot_runs

        plot_runs([r.output for r in results], out / "curves.png", labels=[r.name for r in results])
        print(f"\ncurves: {out / 'curves.png'}")
        a, b = results
        la, lb = a.records[-1].get("eval/mlm_loss"), b.records[-1].get("eval/mlm_loss")
        if la and lb:
            print(f"held-out MLM loss ({int(a.records[-1].get('eval/masked_tokens', 0)):,} masked tokens): 1-bit Adam "
                  f"{lb:.3f} vs Adam {la:.3f} ({100 * (lb - la) / la:+.1f}%)")
    summary = {"tokenizer": {"vocab": str(vocab), "vocab_size": tokenizer.vocab_size,
                             "fingerprint": tokenizer.fingerprint()},
               "runs": [{"name": r.name, "seconds": r.seconds, "final": r.records[-1]} for r in results]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(prog="jonebit")
    sub = parser.add_subparsers()
    add_parser(sub)
    sys.exit(main(parser.parse_args(["pretrain", *sys.argv[1:]])))
