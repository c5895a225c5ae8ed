"""``scripts/``: the copyable entry points run as written (a subprocess, as a user starts them) and resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jonebit.apps.pretrain import embedded_corpus
from jonebit.data.pretraining import iter_texts
from jonebit.data.tokenization import train_wordpiece
from tests.mpi_util import ROOT, SUITE_FLAGS


def _run(argv, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
               XLA_FLAGS=" ".join(["--xla_force_host_platform_device_count=8", *SUITE_FLAGS]))
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "pretrain_bert.py"), *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_pretrain_script_trains_with_a_deepspeed_config_and_resumes(tmp_path):
    corpus = embedded_corpus(tmp_path / "corpus.txt")
    vocab = tmp_path / "vocab.txt"
    train_wordpiece(iter_texts([corpus]), 400).save_vocab(vocab)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({
        "train_batch_size": 4096, "train_micro_batch_size_per_gpu": 64, "gradient_clipping": 1.0,
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 3, "weight_decay": 0.01}},
    }))
    argv = ["--config", str(config), "--corpus", str(corpus), "--vocab", str(vocab), "--model", "tiny",
            "--seq-len", "32", "--batch-size", "16", "--output", str(tmp_path / "run")]
    first = _run([*argv, "--max-steps", "4"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    config.write_text(config.read_text().replace('"lr": 0.001', '"lr": 0.0005'))
    second = _run([*argv, "--max-steps", "6"], tmp_path)  # continues from the checkpoint written at the end
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resuming from step 4 of {tmp_path / 'run' / 'checkpoints'}" in second.stdout
    # Said, with the key and both values: the rest of the run differs from what the checkpoint's run did.
    assert "with changed settings: optimizer.params.lr: 0.001 -> 0.0005" in second.stdout, second.stdout[-2000:]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    # DeepSpeed's freeze_step 3 -> 2 warmup updates, then compression, also after the resume.
    assert [r["stage"] for r in records] == ["warmup"] * 2 + ["compression"] * 4
    assert all(r["bytes_sent"] > 0 for r in records)
    assert (tmp_path / "run" / "hf" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "hf" / "vocab.txt").read_text() == vocab.read_text()
