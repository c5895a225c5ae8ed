"""``jonebit squad``: SQuAD v1.1 fine-tuning of BERT with a DeepSpeed config, then prediction and evaluation.

    jonebit squad --train-file train-v1.1.json --predict-file dev-v1.1.json --init hf:bert-base-uncased/ \\
        --config configs/bing_bert_squad_onebit_adam.json --output runs/squad

Steps: read both files (:func:`jonebit.data.squad.load_squad`) and build the windows
(:func:`~jonebit.data.squad.convert_examples_to_features`), load ``BertForQuestionAnswering`` from a HuggingFace
checkpoint (``hf:DIR``) or a ``jonebit pretrain`` run (``ckpt:RUN``, its ``RUN/hf`` export), build the engine from
the config (:func:`jonebit.train.initialize.initialize`) and train with checkpoints, metrics and resume
(:mod:`jonebit.train.loop`). Then a jitted, deterministic forward pass over the evaluation windows gives start/end
logits, run_squad's post-processing gives the answers, and the official v1.1 metric scores them. Written to
``OUTPUT``: ``predictions.json``, ``nbest_predictions.json``, ``eval.json`` (``exact_match``, ``f1``),
``metrics.jsonl`` and ``hf/`` (``config.json``, ``model.safetensors``, ``vocab.txt``; loads in transformers'
``BertForQuestionAnswering``).

Without ``--config`` the run starts from the recipe ``configs/squad_onebit_adam.json`` (shipped in the package as
``jonebit/configs/squad_onebit_adam.json``, :func:`recipe`): BingBertSQuAD's batch, learning rate, gradient clipping
and weight decay, and 1-bit Adam with bias correction, one compression per tensor and the jonebit-only options that
fine-tuned closest to Adam. The run adds what depends on its length: a linear warmup over 10% of the steps and a
linear decay to 0, and for ``--optimizer onebit_adam`` (the default) the freeze after 20% of the steps;
``--optimizer adam`` swaps in Adam with the recipe's learning rate and weight decay. The command line's flags override
the recipe's values. A config without a ``scheduler`` section gets the same warmup and decay, as BingBertSQuAD's
script sets the learning rate itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.resources
import json
import logging
import os
import pathlib
import sys
import time
from typing import Any

from jonebit.apps import DEFAULT_DEVICES

log = logging.getLogger(__name__)

RECIPE_FILE = "squad_onebit_adam.json"


class _FromRecipe:
    """The default of an argument whose value comes from the recipe (``None`` means "off" for some of them)."""

    def __repr__(self):
        return f"<the value in {RECIPE_FILE}>"


RECIPE: Any = _FromRecipe()


@functools.cache
def _recipe_text() -> str:
    # Package data, so the recipe is found from an installed jonebit too; configs/ at the repository root links here.
    return (importlib.resources.files("jonebit") / "configs" / RECIPE_FILE).read_text(encoding="utf-8")


def recipe() -> dict:
    """The SQuAD recipe (``configs/squad_onebit_adam.json``) as a fresh dict: a DeepSpeed config without the values
    that depend on the run's length (scheduler, ``freeze_step``, ``steps_per_print``)."""
    return json.loads(_recipe_text())


def recipe_params() -> dict:
    """The recipe's ``optimizer.params``."""
    return recipe()["optimizer"]["params"]


# ----------------------------------------------------------------------------------------------------------------
# Configs


def default_config(optimizer: str, batch_size: int, max_steps: int, *, lr: float = RECIPE,
                   warmup_proportion: float = 0.1, freeze_proportion: float = 0.2,
                   weight_decay: float = RECIPE, row_scales: bool = RECIPE, preconditioned: bool = RECIPE,
                   clip_ratio: float | None = RECIPE, variance_refresh: int | None = RECIPE,
                   local_clip: bool = RECIPE) -> dict:
    """The built-in DeepSpeed config: the recipe (:func:`recipe`) for ``max_steps`` steps.

    Each keyword left at ``RECIPE`` keeps the recipe's value. The recipe turns on the jonebit-only options of 1-bit
    Adam that fine-tuned closest to Adam on SQuAD in the study before the evidence protocol (``local_clip``,
    ``preconditioned``, ``clip_ratio`` at Adam's own bound: F1 61.26 against 55.77 without them and Adam's 61.94 on
    the first 1,000 dev questions, one seed; ``benchmarks/squad_protocol.py`` chooses on a validation slice
    instead); ``False``/``None`` gives DeepSpeed's 1-bit Adam.

    Args:
      optimizer: ``"adam"`` or ``"onebit_adam"``.
      batch_size: ``train_batch_size``.
      max_steps: optimizer steps of the run (sets the schedule and 1-bit Adam's ``freeze_step``).
      lr: peak learning rate.
      warmup_proportion: fraction of the steps of linear warmup.
      freeze_proportion: 1-bit Adam: fraction of the steps run as uncompressed Adam before compression.
      weight_decay: decoupled weight decay.
      row_scales: 1-bit Adam: one compression scale per row of each matrix (``onebit_adam(row_scales=True)``).
      preconditioned: 1-bit Adam: compress the update direction, not the momentum
        (``onebit_adam(preconditioned=True)``).
      clip_ratio: 1-bit Adam: bound on each element's ``|m| / sqrt(v)`` after the freeze
        (``onebit_adam(clip_ratio=...)``; ``None``: no bound).
      variance_refresh: 1-bit Adam: every K-th update after the freeze is exact and refreshes the variance
        (``onebit_adam(variance_refresh=K)``; ``None``: the variance stays frozen).
      local_clip: 1-bit Adam: clip each rank's gradient in warmup too (``onebit_adam(local_clip=True)``; ``False``:
        the averaged gradient, DeepSpeed's placement).
    """
    if optimizer not in ("adam", "onebit_adam"):
        raise ValueError(f"--optimizer must be adam or onebit_adam, got {optimizer!r}")
    config = recipe()
    params = config["optimizer"]["params"]
    given = {"lr": lr, "weight_decay": weight_decay}
    if optimizer == "adam":  # the baseline: Adam with the recipe's learning rate and weight decay
        config["optimizer"] = {"type": "Adam", "params": {k: params[k] if v is RECIPE else v for k, v in given.items()
                                                          if v is not RECIPE or k in params}}
    else:
        # DeepSpeed's freeze_step F runs F - 1 Adam updates; keep at least one of them.
        given |= {"freeze_step": max(1, round(freeze_proportion * max_steps)) + 1, "row_scales": row_scales,
                  "preconditioned": preconditioned, "clip_ratio": clip_ratio, "variance_refresh": variance_refresh,
                  "local_clip": local_clip}
        for key, value in given.items():
            if value is None:  # null is off, as the key's absence
                params.pop(key, None)
            elif value is not RECIPE:
                params[key] = value
    lr = config["optimizer"]["params"]["lr"]
    config.update(train_batch_size=batch_size, steps_per_print=max(1, max_steps // 10),
                  scheduler=bing_schedule(lr, max_steps, warmup_proportion))
    return config


def bing_schedule(lr: float, max_steps: int, warmup_proportion: float) -> dict:
    """BingBertSQuAD's learning rate (linear warmup, then linear decay to 0) as a DeepSpeed ``scheduler``."""
    warmup = max(1, round(warmup_proportion * max_steps))
    return {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                "warmup_num_steps": warmup, "total_num_steps": max_steps + 1,
                                                "warmup_type": "linear"}}


def read_config(path: str | os.PathLike, *, batch_size: int | None, micro_batch: int | None,
                lr: float | None) -> dict:
    """A DeepSpeed JSON config with the command line's overrides (batch sizes, learning rate)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--config: no DeepSpeed config at {path}")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--config: {path} is not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--config: {path} holds a JSON {type(cfg).__name__}, expected a DeepSpeed config object")
    if batch_size:
        cfg["train_batch_size"] = batch_size
    if micro_batch:
        cfg["train_micro_batch_size_per_gpu"] = micro_batch
    elif batch_size and "train_micro_batch_size_per_gpu" in cfg:
        cfg.pop("train_micro_batch_size_per_gpu")  # derived from the new batch and the device count
        cfg.pop("gradient_accumulation_steps", None)
    if lr is not None and isinstance(cfg.get("optimizer"), dict):
        cfg["optimizer"] = dict(cfg["optimizer"], params=dict(cfg["optimizer"].get("params", {}), lr=lr))
    sched = cfg.get("scheduler")
    if lr is not None and isinstance(sched, dict) and "warmup_max_lr" in sched.get("params", {}):
        cfg["scheduler"] = dict(sched, params=dict(sched["params"], warmup_max_lr=lr))  # the schedule's peak
    return cfg


# ----------------------------------------------------------------------------------------------------------------
# Data and model


def resolve_init(init: str) -> pathlib.Path:
    """The HuggingFace checkpoint directory of ``--init``: ``hf:DIR`` or ``ckpt:RUN`` (a ``jonebit pretrain`` run)."""
    kind, sep, where = init.partition(":")
    if not sep or kind not in ("hf", "ckpt") or not where:
        raise ValueError(f"--init must be hf:DIR (a HuggingFace BERT checkpoint) or ckpt:RUN (a `jonebit pretrain` "
                         f"output directory), got {init!r}")
    path = pathlib.Path(where)
    if not path.is_dir():
        raise FileNotFoundError(f"--init {init}: no directory at {path}")
    if kind == "ckpt":
        if (path / "hf" / "config.json").is_file():
            return path / "hf"
        if (path / "config.json").is_file():
            return path
        raise FileNotFoundError(f"--init {init}: {path} has no hf/config.json; expected the output directory of a "
                                "finished `jonebit pretrain` run (it exports RUN/hf), or use hf:DIR")
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"--init {init}: {path} should hold config.json and model.safetensors "
                                "(a HuggingFace BERT checkpoint)")
    return path


def subset_questions(data: dict, limit: int | None) -> dict:
    """The SQuAD JSON ``data`` cut to its first ``limit`` questions (file order); the whole of it for ``None``."""
    if limit is None:
        return data
    articles, left = [], limit
    for article in data.get("data", []):
        if left <= 0:
            break
        paragraphs = []
        for par in article.get("paragraphs", []):
            if left <= 0:
                break
            qas = par.get("qas", [])[:left]
            left -= len(qas)
            if qas:
                paragraphs.append(dict(par, qas=qas))
        if paragraphs:
            articles.append(dict(article, paragraphs=paragraphs))
    return dict(data, data=articles)


def read_squad_json(path: str | os.PathLike, flag: str) -> dict:
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{flag}: no SQuAD file at {path}; get the official files with "
                                "`jonebit squad-download DIR`")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag}: {path} is not JSON ({e}); expected a SQuAD v1.1 file") from None
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise ValueError(f"{flag}: {path} is not SQuAD v1.1 JSON (expected an object with a 'data' list)")
    return data


def build_model(hf_dir: pathlib.Path, seed: int = 0, dtype=None):
    """``BertForQuestionAnswering`` from ``hf_dir``; a head the checkpoint lacks is initialised from ``seed``.

    ``dtype`` is the compute dtype (float32 parameters either way; None: float32).
    """
    import jax.numpy as jnp
    from flax import nnx
    from safetensors import safe_open

    from jonebit.models.bert import BertForQuestionAnswering, load_hf_checkpoint

    with safe_open(str(hf_dir / "model.safetensors"), framework="numpy") as f:
        has_head = any(k.endswith("qa_outputs.weight") for k in f.keys())  # noqa: SIM118 (safe_open has no __iter__)
    model = load_hf_checkpoint(hf_dir, model_cls=BertForQuestionAnswering, dtype=dtype or jnp.float32,
                               rngs=nnx.Rngs(params=seed, dropout=seed + 1))
    if not has_head:
        print(f"{hf_dir} has no question-answering head: qa_outputs initialised fresh (seed {seed})")
    return model


def squad_loss(start_logits, end_logits, start_positions, end_positions):
    """HuggingFace's span loss: the mean of the start and end cross-entropies (each averaged over the batch)."""
    import jax.numpy as jnp
    import optax

    start = optax.softmax_cross_entropy_with_integer_labels(start_logits.astype(jnp.float32), start_positions)
    end = optax.softmax_cross_entropy_with_integer_labels(end_logits.astype(jnp.float32), end_positions)
    return (jnp.mean(start) + jnp.mean(end)) / 2


def make_loss(graphdef, keys, rest):
    """``loss_fn(params, batch, rng)``: the span loss with dropout drawn from the engine's key (see ``pretrain``)."""
    from flax import nnx

    from jonebit.nnx import reseed

    def loss_fn(params, batch, rng):
        fresh = reseed(keys, rng)
        model = nnx.merge(graphdef, params, fresh, rest)
        out = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], deterministic=False)
        return squad_loss(out.start_logits, out.end_logits, batch["start_positions"], batch["end_positions"])

    return loss_fn


def make_predict(graphdef, keys, rest, mesh=None):
    """``predict(params, features, batch_size) -> (start_logits, end_logits)``: dropout off, jitted, batched.

    With ``mesh`` the rows of each batch are split over its first axis (``batch_size`` is rounded up to a
    multiple of its size); the last batch is padded so that one program serves every batch.
    """
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from tqdm.auto import tqdm

    def logits(params, ids, mask, types):
        fixed = jax.tree.map(lambda x: x, keys)  # fresh Variables in this trace
        out = nnx.merge(graphdef, params, fixed, rest)(ids, mask, types, deterministic=True)
        return out.start_logits, out.end_logits

    if mesh is not None:  # each rank runs its rows with the (replicated) parameters: no communication
        rows_spec = P(mesh.axis_names[0])
        logits = jax.shard_map(logits, mesh=mesh, in_specs=(P(), rows_spec, rows_spec, rows_spec),
                               out_specs=(rows_spec, rows_spec))
    forward = jax.jit(logits)

    def predict(params, features, batch_size: int, progress: bool = True):
        ranks = int(mesh.shape[mesh.axis_names[0]]) if mesh is not None else 1
        batch_size = -(-batch_size // ranks) * ranks
        sharding = NamedSharding(mesh, P(mesh.axis_names[0])) if mesh is not None else None
        inputs = features.model_inputs()
        n = len(features)
        starts, ends = [], []
        for lo in tqdm(range(0, n, batch_size), desc="predict", unit="batch", disable=not progress, leave=False):
            rows = {k: v[lo:lo + batch_size] for k, v in inputs.items()}
            pad = batch_size - len(rows["input_ids"])
            if pad:
                rows = {k: np.concatenate([v, np.zeros((pad, v.shape[1]), v.dtype)]) for k, v in rows.items()}
            if sharding is not None:
                rows = jax.device_put(rows, sharding)
            s, e = forward(params, rows["input_ids"], rows["attention_mask"], rows["token_type_ids"])
            starts.append(np.asarray(s)[:batch_size - pad])
            ends.append(np.asarray(e)[:batch_size - pad])
        width = features.input_ids.shape[1]
        if not starts:
            return np.zeros((0, width), np.float32), np.zeros((0, width), np.float32)
        return np.concatenate(starts), np.concatenate(ends)

    return predict


@dataclasses.dataclass
class EvalSet:
    """What evaluation needs: the (possibly cut) data set, its examples, windows and tokenizer."""

    data: dict
    examples: list
    features: Any
    tokenizer: Any
    n_best_size: int = 20
    max_answer_length: int = 30

    def answers(self, start_logits, end_logits):
        """``(predictions, nbest)`` from the logits of every window (run_squad's post-processing)."""
        from jonebit.data.squad import postprocess_predictions

        return postprocess_predictions(self.examples, self.features, start_logits, end_logits, self.tokenizer,
                                       n_best_size=self.n_best_size, max_answer_length=self.max_answer_length)

    def score(self, predictions) -> dict:
        """The official v1.1 exact match and F1 (percent)."""
        from jonebit.data.squad_metric import evaluate

        return evaluate(self.data, predictions)


# ----------------------------------------------------------------------------------------------------------------
# The run


@dataclasses.dataclass
class SquadResult:
    output: pathlib.Path
    eval: dict
    records: list
    train_seconds: float
    predict_seconds: float
    train_features: int
    eval_features: int


def run(
    *,
    train_file: str | os.PathLike,
    predict_file: str | os.PathLike,
    init: str,
    output: str | os.PathLike,
    config: str | os.PathLike | None = None,
    optimizer: str = "onebit_adam",
    vocab: str | os.PathLike | None = None,
    max_seq_length: int = 384,
    doc_stride: int = 128,
    max_query_length: int = 64,
    epochs: float = 2.0,
    batch_size: int | None = None,
    micro_batch: int | None = None,
    max_steps: int | None = None,
    max_train_examples: int | None = None,
    max_eval_examples: int | None = None,
    learning_rate: float | None = None,
    warmup_proportion: float = 0.1,
    freeze_proportion: float = 0.2,
    weight_decay: float = RECIPE,
    row_scales: bool = RECIPE,
    preconditioned: bool = RECIPE,
    clip_ratio: float | None = RECIPE,
    variance_refresh: int | None = RECIPE,
    local_clip: bool = RECIPE,
    predict_batch_size: int = 64,
    n_best_size: int = 20,
    max_answer_length: int = 30,
    eval_every: int = 0,
    checkpoint_every: int = 0,
    data_parallel: int | None = None,
    seed: int = 0,
    resume: bool = True,
    progress: bool = True,
) -> SquadResult:
    """Fine-tunes, predicts and evaluates (see the module docstring); the arguments are the command's flags (those
    left at ``RECIPE`` take the recipe's value, see :func:`default_config`)."""
    import jax
    from flax import nnx

    from jonebit.data.squad import convert_examples_to_features, load_squad, write_predictions
    from jonebit.data.tokenization import load_wordpiece
    from jonebit.models.bert import position_embedding_mask, save_hf_checkpoint
    from jonebit.sharding.mesh import data_mesh
    from jonebit.train.config import ONEBIT_OPTIMIZERS, load_config
    from jonebit.train.engine import model_params
    from jonebit.train.initialize import compute_dtype, initialize
    from jonebit.train.loop import ArrayBatches

    _check_positive(max_train_examples=max_train_examples, max_eval_examples=max_eval_examples, max_steps=max_steps,
                    batch_size=batch_size, micro_batch=micro_batch, predict_batch_size=predict_batch_size,
                    data_parallel=data_parallel, n_best_size=n_best_size, max_answer_length=max_answer_length)
    if not 0 <= warmup_proportion <= 1:
        raise ValueError(f"--warmup-proportion must be a fraction of the steps in [0, 1], got {warmup_proportion}")
    if not 0 < freeze_proportion <= 1:
        raise ValueError(f"--freeze-proportion must be a fraction of the steps in (0, 1], got {freeze_proportion}")
    if clip_ratio is not None and clip_ratio is not RECIPE and not clip_ratio > 0:
        raise ValueError(f"--clip-ratio must be > 0 (or 0 for no bound), got {clip_ratio}")
    if variance_refresh not in (None, RECIPE) and (isinstance(variance_refresh, bool) or variance_refresh < 1):
        raise ValueError(f"--variance-refresh must be a number of updates >= 1 (or 0 for none), got {variance_refresh}")
    if data_parallel is not None and data_parallel > jax.device_count():
        raise ValueError(f"--data-parallel {data_parallel}: there are only {jax.device_count()} devices")
    if not epochs > 0:
        raise ValueError(f"--epochs must be > 0, got {epochs}")
    out = pathlib.Path(output)
    hf_dir = resolve_init(init)
    vocab_file = pathlib.Path(vocab) if vocab else hf_dir / "vocab.txt"
    if not vocab_file.is_file():
        raise FileNotFoundError(f"no vocab.txt at {vocab_file}: pass the checkpoint's vocabulary with --vocab")
    tokenizer = load_wordpiece(vocab_file)

    train_json = subset_questions(read_squad_json(train_file, "--train-file"), max_train_examples)
    eval_json = subset_questions(read_squad_json(predict_file, "--predict-file"), max_eval_examples)
    train_examples = load_squad(train_json, is_training=True).examples
    eval_examples = load_squad(eval_json).examples
    if not train_examples:
        raise ValueError(f"--train-file {train_file}: no usable training questions")
    if not eval_examples:
        raise ValueError(f"--predict-file {predict_file}: no questions to predict")
    lengths = dict(max_seq_length=max_seq_length, doc_stride=doc_stride, max_query_length=max_query_length)
    train_features = convert_examples_to_features(train_examples, tokenizer, **lengths)
    eval_features = convert_examples_to_features(eval_examples, tokenizer, **lengths)
    print(f"train: {len(train_examples)} questions, {len(train_features)} windows; predict: {len(eval_examples)} "
          f"questions, {len(eval_features)} windows (max_seq_length {max_seq_length})")

    # The batch size decides the steps, which the built-in config's schedule needs: resolve it first.
    mesh = data_mesh(data_parallel)
    dp = mesh.size
    lr = learning_rate or RECIPE
    if config is None:
        train_batch = batch_size or recipe()["train_batch_size"]
        cfg = default_config(optimizer, train_batch, 1, lr=lr)
    else:
        cfg = read_config(config, batch_size=batch_size, micro_batch=micro_batch, lr=learning_rate)
    train_batch = load_config(cfg).batch_sizes(dp).train_batch_size
    if train_batch > len(train_features):
        raise ValueError(f"the train batch ({train_batch}) is larger than the {len(train_features)} training windows; "
                         "lower --batch-size or use more training questions (--max-train-examples)")
    steps = max_steps or max(1, int(epochs * (len(train_features) // train_batch)))
    if config is None:
        cfg = default_config(optimizer, train_batch, steps, lr=lr,
                             warmup_proportion=warmup_proportion, freeze_proportion=freeze_proportion,
                             weight_decay=weight_decay, row_scales=row_scales, preconditioned=preconditioned,
                             clip_ratio=clip_ratio, variance_refresh=variance_refresh,
                             local_clip=local_clip)
    elif "scheduler" not in cfg:
        lr = cfg.get("optimizer", {}).get("params", {}).get("lr", recipe_params()["lr"])
        cfg["scheduler"] = bing_schedule(lr, steps, warmup_proportion)
        print(f"the config has no scheduler: BingBertSQuAD's linear warmup over {warmup_proportion:.0%} of the "
              f"{steps} steps and linear decay (peak lr {lr:g})")
    ds = load_config(cfg)
    onebit = ds.optimizer is not None and ds.optimizer.type in ONEBIT_OPTIMIZERS
    freeze = ds.optimizer.params["freeze_step"] if onebit else None
    if onebit and freeze != "auto" and freeze - 1 >= steps:
        print(f"note: 1-bit Adam's freeze_step {ds.optimizer.params['freeze_step']} is past the {steps} steps of "
              "this run: it never reaches the compression stage (lower freeze_step or train longer)")
    if (config is not None and onebit and ds.optimizer.type == "OneBitAdam" and ds.gradient_clipping > 0
            and "local_clip" not in cfg.get("optimizer", {}).get("params", {})):
        print("note: the config clips 1-bit Adam's averaged gradient in warmup and each rank's own after the freeze "
              "(DeepSpeed's placement), which shrinks every compressed step when the clip binds; on SQuAD "
              "\"local_clip\": true in optimizer.params gained 3.6 F1 (benchmarks/BENCHMARKS.md)")

    net = build_model(hf_dir, seed, dtype=compute_dtype(ds))
    if net.config.vocab_size != tokenizer.vocab_size:
        raise ValueError(f"--init {init} has vocab_size {net.config.vocab_size}, {vocab_file} has "
                         f"{tokenizer.vocab_size} tokens: pass the checkpoint's own vocab.txt with --vocab")
    if net.config.max_position_embeddings < max_seq_length:
        raise ValueError(f"--max-seq-length {max_seq_length} exceeds the model's max_position_embeddings "
                         f"{net.config.max_position_embeddings}")
    graphdef, params, keys, rest = nnx.split(net, nnx.Param, nnx.RngState, ...)
    mask = position_embedding_mask(params, max_seq_length) if onebit else None
    engine = initialize(ds, make_loss(graphdef, keys, rest), params, mesh=mesh, exp_avg_mask=mask, rng_seed=seed)
    # One process: the predictions are split over the mesh's ranks. Several (`jonebit launch`): each process
    # predicts every question on its own first device, from the replicated parameters (no logits to gather).
    multiprocess = jax.process_count() > 1
    predict = make_predict(graphdef, keys, rest, None if multiprocess else engine.mesh)
    evalset = EvalSet(eval_json, eval_examples, eval_features, tokenizer, n_best_size, max_answer_length)
    last = {}

    def evaluate(state) -> dict:
        t0 = time.perf_counter()
        params = model_params(state.params)
        start, end = predict(jax.device_get(params) if multiprocess else params, eval_features, predict_batch_size,
                             progress)
        last.update(seconds=time.perf_counter() - t0, step=int(jax.device_get(state.step)))
        last["total"] = last.get("total", 0.0) + last["seconds"]
        last["answers"] = evalset.answers(start, end)
        last["score"] = evalset.score(last["answers"][0])
        return last["score"]

    loop = engine.loop_config(out, steps, checkpoint_every=checkpoint_every, eval_every=eval_every,
                              tokens_per_example=max_seq_length, progress_bar=progress)
    t0 = time.perf_counter()
    batches = ArrayBatches(train_features.training_arrays(), train_batch, seed=seed)
    engine.train(batches, loop, evaluate=evaluate, resume=resume)
    train_seconds = time.perf_counter() - t0 - last.get("total", 0.0)
    if last.get("step") != int(jax.device_get(engine.state.step)):  # a finished run resumed: nothing evaluated
        evaluate(engine.state)

    predictions, nbest = last["answers"]
    score = dict(last["score"], questions=len(eval_examples), windows=len(eval_features),
                 predict_seconds=last["seconds"], examples_per_second=len(eval_examples) / last["seconds"])
    if jax.process_index() == 0:
        write_predictions(out, predictions, nbest)
        if max_eval_examples is not None:  # what `jonebit squad-eval` needs to reproduce eval.json
            (out / "predict_subset.json").write_text(json.dumps(eval_json, ensure_ascii=False), encoding="utf-8")
            score["data_file"] = str(out / "predict_subset.json")
        else:
            score["data_file"] = str(pathlib.Path(predict_file))
        (out / "eval.json").write_text(json.dumps(score, indent=2) + "\n")
        nnx.update(net, jax.device_get(engine.params))
        save_hf_checkpoint(net, out / "hf")
        tokenizer.save_vocab(out / "hf" / "vocab.txt")
    records = []  # written by process 0
    if jax.process_index() == 0:
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return SquadResult(out, score, records, train_seconds, last["seconds"], len(train_features), len(eval_features))


def _check_positive(**values) -> None:
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")


# ----------------------------------------------------------------------------------------------------------------
# Command line


def add_parser(subparsers) -> None:
    """Registers ``jonebit squad``."""
    try:
        base = recipe()
    except FileNotFoundError:  # a broken install: keep the other commands working; `jonebit squad` then says why
        base = {"train_batch_size": "(the recipe's)", "optimizer": {"params": {}}}
    opts = base["optimizer"]["params"]

    def on(key):
        return "on" if opts.get(key) else "off"
    p = subparsers.add_parser("squad", help="fine-tune BERT on SQuAD v1.1, predict and evaluate",
                              description=__doc__.split("\n\n")[0],
                              epilog="example: jonebit squad --train-file train-v1.1.json --predict-file "
                                     "dev-v1.1.json --init hf:bert-base-uncased --output runs/squad",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-file", required=True, help="SQuAD v1.1 training JSON (train-v1.1.json)")
    p.add_argument("--predict-file", required=True, help="SQuAD v1.1 JSON to predict and evaluate (dev-v1.1.json)")
    p.add_argument("--init", required=True, help="hf:DIR (HuggingFace BERT checkpoint) or ckpt:RUN (a `jonebit "
                   "pretrain` output directory)")
    p.add_argument("--vocab", help="vocab.txt (default: the checkpoint's)")
    p.add_argument("--config", help="DeepSpeed JSON config, accepted unchanged (default: built-in, see --optimizer)")
    p.add_argument("--optimizer", choices=("adam", "onebit_adam"), default="onebit_adam",
                   help="optimizer of the built-in config (default onebit_adam)")
    p.add_argument("--output", default="runs/squad", help="output directory (default runs/squad)")
    p.add_argument("--max-seq-length", type=int, default=384, help="tokens per window (default 384)")
    p.add_argument("--doc-stride", type=int, default=128, help="context tokens between windows (default 128)")
    p.add_argument("--max-query-length", type=int, default=64, help="question tokens kept (default 64)")
    p.add_argument("--epochs", type=float, default=2.0, help="passes over the training windows (default 2)")
    p.add_argument("--max-steps", type=int, help="optimizer steps (overrides --epochs)")
    p.add_argument("--batch-size", type=int, help=f"train_batch_size (default {base['train_batch_size']} built-in, "
                   "else the config's; scales a config down to this machine)")
    p.add_argument("--micro-batch", type=int, help="override train_micro_batch_size_per_gpu")
    p.add_argument("--learning-rate", type=float, help=f"peak learning rate (default {opts.get('lr', 'the recipe')}, "
                   "or the config's)")
    p.add_argument("--warmup-proportion", type=float, default=0.1, help="fraction of warmup steps (default 0.1)")
    p.add_argument("--freeze-proportion", type=float, default=0.2,
                   help="built-in 1-bit Adam: fraction of uncompressed steps (default 0.2)")
    # The built-in config's options default to None: the recipe's value (shown in the help).
    p.add_argument("--weight-decay", type=float,
                   help=f"built-in config's weight decay (default {opts.get('weight_decay', 0.0):g})")
    p.add_argument("--row-scales", action="store_true", default=None,
                   help="built-in 1-bit Adam: one compression scale per row of each matrix (8%% more bytes; default "
                   f"{on('row_scales')})")
    p.add_argument("--preconditioned", action=argparse.BooleanOptionalAction,
                   help="built-in 1-bit Adam: compress the update direction m / (sqrt(v) + eps), not m (default "
                   f"{on('preconditioned')})")
    ratio = opts.get("clip_ratio")
    p.add_argument("--clip-ratio", type=float,
                   help="built-in 1-bit Adam: bound on |m| / sqrt(v) after the freeze (default "
                   f"{'none' if ratio is None else f'{ratio:.2f}'}; 0: none)")
    p.add_argument("--variance-refresh", type=int, metavar="K",
                   help="built-in 1-bit Adam: every K-th update after the freeze is exact and refreshes the variance "
                   f"(default {opts.get('variance_refresh') or 'none'}; 0: none)")
    p.add_argument("--local-clip", action=argparse.BooleanOptionalAction,
                   help="built-in 1-bit Adam: clip each rank's gradient in warmup too, the same scale as after the "
                   f"freeze (default {on('local_clip')}; --no-local-clip: the averaged gradient, as DeepSpeed)")
    p.add_argument("--max-train-examples", type=int, help="use the first N training questions")
    p.add_argument("--max-eval-examples", type=int, help="predict the first N questions of --predict-file")
    p.add_argument("--predict-batch-size", type=int, default=64, help="windows per prediction batch (default 64)")
    p.add_argument("--n-best-size", type=int, default=20, help="answers kept per question (default 20)")
    p.add_argument("--max-answer-length", type=int, default=30, help="longest answer in tokens (default 30)")
    p.add_argument("--eval-every", type=int, default=0, help="steps between evaluations (0: at the end)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: at the end)")
    p.add_argument("--resume", dest="resume", action="store_true", default=True,
                   help="continue from the output directory's latest checkpoint if it has one (the default)")
    p.add_argument("--no-resume", dest="resume", action="store_false", help="refuse to continue an existing run")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    p.add_argument("--data-parallel", type=int, help="train on the first N devices (default: all of them)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--devices", type=int, default=None,
                   help=f"simulated CPU devices of this process when running on CPU (default {DEFAULT_DEVICES}, or "
                        "what `jonebit launch --devices-per-proc` set)")
    p.set_defaults(func=main)


def _recipe_overrides(args) -> dict:
    """The built-in config's options the command line gave (0 turns a bound off); the rest stay the recipe's."""
    out = {}
    for name in ("weight_decay", "row_scales", "preconditioned", "clip_ratio", "variance_refresh", "local_clip"):
        value = getattr(args, name)
        if value is not None:
            out[name] = None if name in ("clip_ratio", "variance_refresh") and value == 0 else value
    return out


def main(args) -> int:
    """Runs ``jonebit squad``; returns the exit code."""
    import jax

    from jonebit.apps import start_devices
    from jonebit.train.config import ConfigError

    start_devices(args.devices)

    try:
        result = run(
            train_file=args.train_file, predict_file=args.predict_file, init=args.init, output=args.output,
            config=args.config, optimizer=args.optimizer, vocab=args.vocab, max_seq_length=args.max_seq_length,
            doc_stride=args.doc_stride, max_query_length=args.max_query_length, epochs=args.epochs,
            batch_size=args.batch_size, micro_batch=args.micro_batch, max_steps=args.max_steps,
            max_train_examples=args.max_train_examples, max_eval_examples=args.max_eval_examples,
            learning_rate=args.learning_rate, warmup_proportion=args.warmup_proportion,
            freeze_proportion=args.freeze_proportion, **_recipe_overrides(args),
            predict_batch_size=args.predict_batch_size,
            n_best_size=args.n_best_size,
            max_answer_length=args.max_answer_length, eval_every=args.eval_every,
            checkpoint_every=args.checkpoint_every, data_parallel=args.data_parallel, seed=args.seed,
            resume=args.resume, progress=args.progress)
    except (ConfigError, ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"jonebit squad: {e}", file=sys.stderr)
        return 2
    if jax.process_index() != 0:
        return 0
    ev = result.eval
    print(json.dumps({"exact_match": ev["exact_match"], "f1": ev["f1"]}))
    print(f"{ev['questions']} questions in {result.predict_seconds:.1f} s ({ev['examples_per_second']:.1f}/s); "
          f"trained {result.records[-1]['step']} steps in {result.train_seconds:.0f} s; outputs in {result.output}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(prog="jonebit")
    sub = parser.add_subparsers()
    add_parser(sub)
    sys.exit(main(parser.parse_args(["squad", *sys.argv[1:]])))
