"""``jonebit pretrain``: the embedded default end to end (tiny settings), its HF export in transformers, bad inputs."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from jonebit.cli import main
from jonebit.data.tokenization import load_wordpiece

# The embedded default at tiny sizes. Fewer evaluation documents than the default's 11 + 5 (checked on their own
# below): at these sizes scoring the full splits at every evaluation point costs more than the training does.
HELDOUT, VALIDATION = 3, 2
TINY = ["--max-steps", "8", "--seq-len", "32", "--vocab-size", "400", "--dupe-factor", "1", "--batch-size", "32",
        "--heldout-documents", str(HELDOUT), "--validation-documents", str(VALIDATION)]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("pretrain")
    assert main(["pretrain", "--output", str(out), *TINY]) == 0
    return out


def test_embedded_default_holds_out_its_evaluation_splits():
    from jonebit.apps.pretrain import _EMBEDDED_HELDOUT, _EMBEDDED_VALIDATION, _default_heldout

    assert (_default_heldout(None), _EMBEDDED_HELDOUT, _EMBEDDED_VALIDATION) == (11, 11, 5)


def test_embedded_default_writes_runs_table_and_curves(run_dir, capsys):
    for name in ("adam", "onebit_adam"):
        records = [json.loads(x) for x in (run_dir / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == list(range(1, 9))
        assert {"eval/mlm_loss", "eval/mlm_accuracy", "eval/nsp_accuracy"} <= set(records[-1])
        # The embedded default evaluates at 5 points (every ceil(8 / 5) = 2 steps), so the figure has curves.
        evaluated = [r["step"] for r in records if "eval/mlm_loss" in r]
        assert evaluated == [2, 4, 6, 8] and all(np.isfinite(r["eval/mlm_loss"]) for r in records
                                                  if "eval/mlm_loss" in r)
        assert records[-1]["loss"] < records[0]["loss"]  # it trains
        assert (run_dir / name / "hf" / "model.safetensors").is_file()
    stages = [json.loads(x)["stage"] for x in (run_dir / "onebit_adam" / "metrics.jsonl").read_text().splitlines()]
    assert stages == ["warmup"] * 3 + ["compression"] * 5  # freeze at 40% of 8 steps -> 3 (DeepSpeed's 4 - 1)
    assert (run_dir / "curves.png").stat().st_size > 10_000
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [s["name"] for s in summary["runs"]] == ["adam", "onebit_adam"]
    vocab = load_wordpiece(run_dir / "vocab.txt")
    assert summary["tokenizer"] == {"vocab": str(run_dir / "vocab.txt"), "vocab_size": vocab.vocab_size,
                                    "fingerprint": vocab.fingerprint()}
    # Both evaluation splits are scored, each on its own masked tokens.
    last = summary["runs"][0]["final"]
    assert {"eval/validation/mlm_loss", "eval/masked_tokens", "eval/validation/masked_tokens"} <= set(last)
    assert last["eval/masked_tokens"] > 0 and last["eval/validation/masked_tokens"] > 0


def test_embedded_vocabulary_is_trained_on_the_training_documents_only(run_dir):
    """The vocabulary is what train_wordpiece gives on the training split's sentences, not on the whole corpus
    (held-out words would otherwise be in it: the held-out loss would score text the vocabulary was fitted to)."""
    from jonebit.data.pretraining import PretrainingOptions, iter_texts, read_documents, split_documents
    from jonebit.data.tokenization import train_wordpiece

    corpus = run_dir / "corpus.txt"
    options = PretrainingOptions(heldout_documents=HELDOUT, validation_documents=VALIDATION)
    train = split_documents(read_documents([corpus]), options)["train"]
    ours = load_wordpiece(run_dir / "vocab.txt").fingerprint()
    assert train_wordpiece((s for d in train for s in d), 400, progress=False).fingerprint() == ours
    assert train_wordpiece(iter_texts([corpus]), 400, progress=False).fingerprint() != ours


def test_hf_export_matches_in_transformers(run_dir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jonebit.models.bert import BertForPreTraining, load_hf_checkpoint

    hf = run_dir / "onebit_adam" / "hf"
    ours = load_hf_checkpoint(hf, model_cls=BertForPreTraining)
    theirs = transformers.BertForPreTraining.from_pretrained(hf).eval()
    vocab = (hf / "vocab.txt").read_text().splitlines()
    assert len(vocab) == ours.config.vocab_size
    rng = np.random.default_rng(0)
    ids = rng.integers(5, len(vocab), (2, 16)).astype(np.int64)
    types = np.zeros_like(ids)
    types[:, 8:] = 1
    mask = np.ones_like(ids)
    out = ours(ids, mask, types, deterministic=True)
    with torch.no_grad():
        ref = theirs(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), token_type_ids=torch.tensor(types))
    np.testing.assert_allclose(np.asarray(out.prediction_logits), ref.prediction_logits.numpy(), atol=1e-4)
    np.testing.assert_allclose(np.asarray(out.seq_relationship_logits), ref.seq_relationship_logits.numpy(),
                               atol=1e-4)


def _pretrain_with(tmp_path, cfg: dict, steps: int):
    """``jonebit pretrain`` of a small run with the DeepSpeed config ``cfg``: (output directory, metrics records,
    one per step)."""
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "run"
    assert main(["pretrain", "--config", str(tmp_path / "config.json"), "--output", str(out), "--max-steps",
                 str(steps), "--seq-len", "32", "--vocab-size", "400", "--dupe-factor", "1",
                 "--heldout-documents", "4"]) == 0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    return out, records


def test_zero_one_adam_config_pretrains_and_exports(tmp_path):
    """A ZeroOneAdam DeepSpeed config through ``jonebit pretrain``, into its local steps (each rank moves its own
    parameter copy): it trains, evaluates, and exports a checkpoint (rank 0's copy) that loads. eps is 1e-3: with
    DeepSpeed's 1e-8 this run diverges (loss 6.7 -> 9.9 at update 8, also with mask_unseen): elements whose
    variance is still tiny after so few variance steps are divided by sqrt(v) + eps (see docs/optimizers.md, 0/1 Adam
    notes)."""
    from jonebit.models.bert import BertForPreTraining, load_hf_checkpoint

    cfg = {"train_batch_size": 32, "gradient_clipping": 1.0, "optimizer": {"type": "ZeroOneAdam", "params": {
        "lr": 1e-3, "eps": 1e-3, "var_freeze_step": 6, "var_update_scaler": 4, "local_step_scaler": 1,
        "local_step_clipper": 4}}}
    out, records = _pretrain_with(tmp_path, cfg, steps=10)
    assert records[-1]["loss"] < records[0]["loss"]
    assert np.isfinite(records[-1]["eval/mlm_loss"]) and records[-1]["eval/mlm_loss"] < np.log(400)
    assert all(np.isnan(r["bytes_sent"]) for r in records)  # not attributed to steps: NaN, not the scalars' bytes
    exported = load_hf_checkpoint(out / "hf", model_cls=BertForPreTraining)
    assert np.isfinite(np.asarray(exported.bert.encoder.layer[0].attention.self.query.kernel[...])).all()


@pytest.mark.parametrize("optimizer,zero", [
    ({"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}}, {"stage": 3, "zero_quantized_weights": True}),
    ({"type": "OneBitAdam", "params": {"lr": 2e-3, "freeze_step": 3}}, {"stage": 3}),
], ids=["adamw_quantized_weights", "onebit_adam"])
def test_zero_stage_3_config_pretrains_the_stacked_encoder_and_exports_per_layer_tensors(tmp_path, optimizer, zero):
    """A ZeRO stage-3 config through ``jonebit pretrain`` (AdamW with ZeRO++'s quantized weights; 1-bit Adam into
    its compression stage): the model is built with the stacked encoder (gathered layer by layer), trains, and its
    export has HuggingFace's per-layer tensors."""
    import safetensors.numpy as stnp

    cfg = {"train_batch_size": 32, "gradient_clipping": 1.0, "optimizer": optimizer, "zero_optimization": zero}
    out, records = _pretrain_with(tmp_path, cfg, steps=6)
    assert records[-1]["loss"] < records[0]["loss"]
    if optimizer["type"] == "OneBitAdam":
        # Its state is flat chunks (no tree names to look for): the stacked model is pretrain's choice for it,
        # and the run went through its compression steps.
        from jonebit.apps.pretrain import stacks_layers
        from jonebit.train.config import load_config

        assert stacks_layers(load_config(cfg))
        assert records[-1]["stage"] == "compression", records[-1]
    else:
        # The trained state held the stacked encoder (the checkpoint's tree names it), exported per layer.
        saved = [p for p in (out / "checkpoints").rglob("*") if p.is_file() and "metadata" in p.name.lower()]
        assert any(b"stacked_layers" in p.read_bytes() for p in saved), [p.name for p in saved]
    tensors = stnp.load_file(out / "hf" / "model.safetensors")
    assert {"bert.encoder.layer.0.attention.self.query.weight", "bert.encoder.layer.1.output.dense.weight"} <= set(
        tensors)
    assert not any("stacked" in name for name in tensors)


def test_a_run_refuses_a_changed_model_and_no_resume_over_checkpoints(run_dir, capsys):
    """The resume wiring of ``jonebit pretrain`` on the embedded run's output: a changed model is refused (the
    saved state depends on it), and so is --no-resume where checkpoints exist. (Resuming, and the warning about a
    changed learning rate, are checked through the script in tests/test_scripts.py.)"""
    common = ["pretrain", "--output", str(run_dir), *TINY]
    assert main([*common, "--model", "mini"]) == 2
    assert re.search(r"cannot resume the run in .*: its checkpoint was written with other settings that the saved "
                     r"state depends on \(.*pretrain\.model: 'tiny' -> 'mini'", capsys.readouterr().err)
    assert main([*common, "--no-resume"]) == 2
    assert "already holds checkpoints (latest step 8)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--config", "missing.json", "--max-steps", "2"], r"no DeepSpeed config at missing.json"),
    (["--config", "{cfg}"], r"--max-steps is required with --config"),
    (["--corpus", "nowhere.txt", "--max-steps", "2"], r"no corpus file at nowhere.txt"),
    (["--vocab", "nowhere-vocab.txt", "--max-steps", "2"], r"no vocabulary file at nowhere-vocab.txt"),
    (["--model", "huge", "--max-steps", "2"], r"unknown BERT preset 'huge'"),
    (["--config", "{cfg}", "--max-steps", "2", "--batch-size", "12"], r"train_batch_size"),
])
def test_bad_arguments_exit_2_with_a_message(tmp_path, capsys, argv, message):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 32, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}))
    argv = [a.replace("{cfg}", str(cfg)) for a in argv]
    code = main(["pretrain", "--output", str(tmp_path / "out"), "--seq-len", "32", "--vocab-size", "200",
                 "--dupe-factor", "1", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert re.search(message, err), err


@pytest.mark.parametrize("precision,dtype", [("bf16", "bfloat16"), ("fp16", "float16"), (None, "float32")])
def test_model_runs_its_matmuls_in_the_configured_precision(precision, dtype):
    """The engine casts the float32 master parameters to the config's dtype; the model must be built in that dtype
    too, or every Flax layer casts them back and the matmuls run in float32."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jonebit.apps.pretrain import build_model, make_loss
    from jonebit.train.config import load_config
    from jonebit.train.initialize import compute_dtype

    raw = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    if precision is not None:
        raw[precision] = {"enabled": True}
    want = compute_dtype(load_config(raw))
    assert jnp.dtype(want).name == dtype
    net = build_model("tiny", vocab_size=64, seq_len=16, seed=0, dtype=want)
    graphdef, params, keys, rest = nnx.split(net, nnx.Param, nnx.RngState, ...)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}  # float32 master parameters
    batch = {"input_ids": jnp.ones((2, 16), jnp.int32), "attention_mask": jnp.ones((2, 16), jnp.int32),
             "token_type_ids": jnp.zeros((2, 16), jnp.int32), "masked_lm_positions": jnp.zeros((2, 3), jnp.int32),
             "masked_lm_ids": jnp.ones((2, 3), jnp.int32), "masked_lm_weights": jnp.ones((2, 3), jnp.float32),
             "next_sentence_label": jnp.zeros((2,), jnp.int32)}
    cast = jax.tree.map(lambda x: x.astype(want), params)  # what the engine hands the loss
    jaxpr = jax.make_jaxpr(make_loss(graphdef, keys, rest))(cast, batch, jax.random.key(0))
    dots = [e for e in _equations(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) >= 6  # q, k, v, attention output, two feed-forward matmuls at least
    assert all(v.aval.dtype == jnp.dtype(want) for e in dots for v in e.invars), \
        sorted({str(v.aval.dtype) for e in dots for v in e.invars})


def _equations(jaxpr):
    """Every equation of a jaxpr, sub-jaxprs (remat, custom derivatives, control flow) included."""
    from jax.extend import core

    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, list | tuple) else [param]:
                if isinstance(sub, core.ClosedJaxpr):
                    yield from _equations(sub.jaxpr)
                elif isinstance(sub, core.Jaxpr):
                    yield from _equations(sub)


def test_a_users_corpus_is_evaluated_by_default(tmp_path, capsys, run_dir):
    """``--corpus FILE`` with no --heldout-documents holds out 5% of the documents and reports a held-out loss.
    One arm (the embedded default's Adam, as a config file) is enough: the split is the corpus's, made before and
    apart from the arms (run_dir's run covers the two-arm comparison, on the embedded corpus)."""
    from jonebit.apps.pretrain import default_configs, embedded_corpus
    from jonebit.data.pretraining import read_documents

    corpus = embedded_corpus(tmp_path / "mine.txt")  # the same sizes as run_dir's run: its programs are cached
    (tmp_path / "adam.json").write_text(json.dumps(default_configs(max_steps=8, batch_size=32)["adam"]))
    n = len(read_documents([corpus]))
    code = main(["pretrain", "--corpus", str(corpus), "--config", str(tmp_path / "adam.json"), "--output",
                 str(tmp_path / "run"), "--max-steps", "8", "--seq-len", "32", "--vocab-size", "400",
                 "--dupe-factor", "1", "--batch-size", "32"])
    assert code == 0
    held = min(1000, max(2, round(0.05 * n)))
    assert f"holding out the last {held} of {n} documents for evaluation" in capsys.readouterr().out
    (arm,) = json.loads((tmp_path / "run" / "summary.json").read_text())["runs"]
    assert np.isfinite(arm["final"]["eval/mlm_loss"]) and arm["final"]["eval/mlm_loss"] > 0


def test_too_small_a_corpus_says_evaluation_is_skipped(tmp_path, capsys):
    from jonebit.apps.pretrain import _default_heldout

    small = tmp_path / "small.txt"
    small.write_text("One sentence. Another one.\n\nA second document here.\n")
    assert _default_heldout([str(small)]) == 0
    assert "evaluation skipped: the corpus has 2 documents" in capsys.readouterr().out


def test_launched_processes_form_one_job(tmp_path, run_dir):
    """``jonebit launch --nproc 2 --devices-per-proc 4 -- jonebit pretrain`` is one data-parallel job over 8 devices,
    not two jobs: its metrics match the same config run in this process on its 8 devices (``run_dir``'s Adam arm:
    the embedded default's Adam config, given here as a file, on the same data, seed, sizes and evaluation points).

    - The bytes each rank sends per step are the 8-rank allreduce's, exactly (two independent 4-device jobs
      would send the 4-rank amount, and both would write the run directory).
    - Step 1's loss: each device computes the same forward on the same rows in both runs (the same per-device
      program); the logged loss is the mean of the 8 device losses, summed in an order each program chooses, so the
      two differ by at most 7 roundings: |diff| <= 7 * 2^-24 * loss.
    - Later steps: the gradients are also means of 8 device gradients in different orders (relative differences of
      a few ulp per element, ~1e-6 at most). Adam's update is at most lr (<= 2e-3 here) per element and moves by
      that relative amount where the gradient is well above the rounding of its sum; an element whose update flips
      sign between the runs has a gradient at that rounding, so its first-order effect on the loss (gradient x
      2 lr) is of the same order. Over eight steps the loss moves by a few 1e-6 relative at most from the first
      kind and negligibly from the second: 1e-5 relative is that estimate's bound, not a measured value. The
      held-out and validation losses are of the same parameters, so the same bound holds for them.
    """
    import subprocess
    import sys

    from jonebit.apps.pretrain import default_configs
    from tests.mpi_util import worker_env

    (tmp_path / "adam.json").write_text(json.dumps(default_configs(max_steps=8, batch_size=32)["adam"]))
    launched = subprocess.run(
        [sys.executable, "-m", "jonebit", "launch", "--nproc", "2", "--devices-per-proc", "4", "--timeout", "600",
         "--", sys.executable, "-m", "jonebit", "pretrain", "--config", str(tmp_path / "adam.json"), *TINY,
         "--eval-every", "2", "--output", str(tmp_path / "two")],
        env=worker_env(), capture_output=True, text=True, timeout=900)
    assert launched.returncode == 0, launched.stderr[-3000:]
    one, two = ([json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
                for d in (run_dir / "adam", tmp_path / "two"))
    assert [r["step"] for r in two] == list(range(1, 9))
    evaluated = [[r["step"] for r in run if "eval/mlm_loss" in r] for run in (one, two)]
    assert evaluated == [[2, 4, 6, 8]] * 2, evaluated
    assert [r["bytes_sent"] for r in two] == [r["bytes_sent"] for r in one]
    assert abs(two[0]["loss"] - one[0]["loss"]) <= 7 * 2.0**-24 * one[0]["loss"]
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "eval/mlm_loss", "eval/validation/mlm_loss"):
            assert (key in a) == (key in b), key
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-5 * a[key], (a["step"], key, a[key], b[key])
    assert (tmp_path / "two" / "hf" / "model.safetensors").is_file()  # exported once, by process 0
