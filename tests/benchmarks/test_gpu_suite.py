"""benchmarks/gpu_suite.py: the dry run (CPU, tiny sizes, the GPU run's code paths) end to end in a subprocess,
its JSON checked section by section; the time guard; the synthetic pre-training batch's format."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_suite.py"
SECTIONS = ("packing", "kernels", "optimizer_step", "bert_step")


def _positive(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _run(tmp_path, *argv, timeout=300, out_dir=None):
    """Runs the dry run; with ``out_dir`` it is given as ``$OUT`` instead of passing ``--out``."""
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "xla_force_host_platform_device_count" not in f)  # one CPU device
    if out_dir is None:
        out = tmp_path / "suite.json"
        argv = ("--out", str(out), *argv)
    else:
        env["OUT"], out = str(out_dir), out_dir / "gpu_suite.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", *argv], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


CORE_ARMS = ("adamw_make_step", "onebit_make_step", "onebit_engine", "adamw_engine")
DIAGNOSTIC_ARMS = ("onebit_make_step_pallas", "adamw_engine_model_casts", "adamw_engine_fixed_key")


# Three parts, each one subprocess under a minute on a loaded 2-core machine; together they cover every section and
# every arm of the BERT step.
@pytest.mark.slow
@pytest.mark.parametrize("selected,arms", [(("packing", "kernels", "optimizer_step"), CORE_ARMS),
                                           (("bert_step",), CORE_ARMS), (("bert_step",), DIAGNOSTIC_ARMS)],
                         ids=["kernels", "bert", "bert_diagnostics"])
def test_dry_run_writes_the_selected_sections(tmp_path, selected, arms):
    report, stdout = _run(tmp_path, "--repeats", "2", "--sections", *selected, "--bert-arms", *arms)
    assert report["sizes"]["bert_arms"] == list(arms)
    assert report["dry_run"] is True
    for name in SECTIONS:
        if name not in selected:
            assert report[name] == {"skipped": "not selected (--sections)"}
            continue
        assert "error" not in report[name] and "skipped" not in report[name], report[name]
        assert _positive(report["environment"]["section_seconds"][name])

    env = report["environment"]
    assert env["backend"] == "cpu" and env["device_count"] == 1 and env["jax"]
    assert "--dry-run" in env["command"]
    assert env["peaks"] == {"hbm_bytes_per_s": None, "bf16_flops_per_s": None}  # CPU: no peak to compare with
    for name in selected:
        CHECKS[name](report[name], stdout, arms)


def _check_packing(pack, stdout, _arms):
    assert pack["roundtrip_ok"] is True
    assert [r["op"] for r in pack["rows"]] == ["pack", "unpack", "copy"]
    for r in pack["rows"]:
        assert all(_positive(r[k]) for k in ("ms", "bytes", "gb_per_s", "fraction_of_copy")), r
        assert r["fraction_of_hbm_peak"] is None
    assert _positive(pack["copy_bytes_per_s"])
    assert "## Sign packing" in stdout


def _check_kernels(kern, stdout, _arms):
    # The Pallas kernel in the interpreter against XLA's pass: the bits and errors must match exactly (both compute
    # x - s * (+-1), one rounding of the same subtraction), for every size, a partial last block and vmap among them.
    assert kern["pallas_impl"] == "pallas_interpret"
    assert set(kern["bitwise_equal"]) == {"8", "24016", "1048584", str(kern["elements"]), "vmap_3x24016"}
    assert kern["all_bitwise_equal"] is True, kern["bitwise_equal"]
    assert [r["arm"] for r in kern["rows"]] == ["pass_xla", "pass_pallas", "compress_xla", "compress_pallas"]
    for r in kern["rows"]:
        assert _positive(r["ms"]) and _positive(r["gb_per_s"]) and r["kernels"] >= 1, r
    assert _positive(kern["speedup_pass"]) and _positive(kern["speedup_compress"])
    assert "## Pack-and-error pass" in stdout


def _check_optimizer_step(opt, stdout, _arms):
    assert [r["arm"] for r in opt["rows"]] == ["onebit_adam", "onebit_adam_fused", "adamw_allreduce_fp32",
                                               "onebit_adam_pallas", "onebit_adam_fused_pallas"]
    assert opt["pallas_params_bitwise_equal"] == {"onebit_adam_vs_onebit_adam_pallas": True,
                                                  "onebit_adam_fused_vs_onebit_adam_fused_pallas": True}
    for r in opt["rows"]:
        assert all(_positive(r[k]) for k in ("ms", "ratio_to_adamw", "first_call_s")), r
        assert len(opt["times_s"][r["arm"]]) == 2
    assert _positive(opt["ratio_onebit_over_adamw"]) and _positive(opt["ratio_onebit_fused_over_adamw"])
    for arm in ("onebit_adam", "onebit_adam_fused", "onebit_adam_pallas"):  # timed in the compression stage
        assert opt["onebit_count_after"][arm] > opt["freeze_step"]
    assert "## Optimizer step" in stdout and "| arm | median ms |" in stdout


def _check_bert_step(bert, stdout, arms):
    assert set(bert["arms"]) == set(arms)
    assert bert["skipped_arms"] == [] and bert["failed_arms"] == {}
    assert all(_positive(bert[k]) for k in ("flops_per_step", "params", "encoder_params", "batch", "seq"))
    assert "12 * layers * hidden * seq^2 * batch" in bert["flops_formula"]
    for name, arm in bert["arms"].items():
        for k in ("median_step_s", "step_ms", "tokens_per_s", "flops_per_s", "loss", "build_and_first_step_s"):
            assert _positive(arm[k]), (name, k, arm[k])
        assert arm["mfu"] is None  # no bf16 peak for a CPU
        assert arm["precision"]
        if name.startswith("onebit"):
            assert arm["onebit_count_after"] > 1, name
        dots = arm["forward_dot_dtypes"]
        assert set(dots) == {"bfloat16 x bfloat16"}
    if set(arms) == set(CORE_ARMS):
        assert _positive(bert["ratio_onebit_over_adamw_tokens"])
        assert _positive(bert["ratio_engine_over_make_step_tokens"])
    assert "## BertForPreTraining" in stdout


CHECKS = {"packing": _check_packing, "kernels": _check_kernels, "optimizer_step": _check_optimizer_step,
          "bert_step": _check_bert_step}


def test_time_budget_skips_sections_and_out_gets_a_copy(tmp_path):
    report, stdout = _run(tmp_path, "--budget-s", "0", timeout=120, out_dir=tmp_path / "collected")
    for name in SECTIONS:
        assert "time budget" in report[name]["skipped"]
    assert "skipped" in stdout and str(tmp_path / "collected" / "gpu_suite.json") in stdout


def test_synthetic_batch_has_the_pipelines_format():
    from benchmarks import gpu_suite
    from jonebit.models.bert import BertConfig

    config = BertConfig.preset("tiny", vocab_size=500)
    batch = gpu_suite.pretraining_batch(config, batch=4, seq=32)
    assert set(batch) == {"input_ids", "attention_mask", "token_type_ids", "next_sentence_label",
                          "masked_lm_positions", "masked_lm_ids", "masked_lm_weights"}
    assert batch["masked_lm_positions"].shape == (4, 5) and batch["masked_lm_weights"].dtype == np.float32
    assert batch["input_ids"].max() < 500
    lengths = batch["attention_mask"].sum(1)
    for r in range(4):
        pos = batch["masked_lm_positions"][r][batch["masked_lm_weights"][r] > 0]
        assert len(set(pos.tolist())) == len(pos) and 0 < pos.min() and pos.max() < lengths[r]  # never [CLS]
        np.testing.assert_array_equal(batch["masked_lm_ids"][r][: len(pos)], batch["input_ids"][r][pos])


def test_an_unknown_bert_arm_is_refused_by_name(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--sections", "bert_step", "--bert-arms", "nope",
                           "--out", str(tmp_path / "x.json")], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "--bert-arms: unknown ['nope']; choose from adamw_make_step" in proc.stderr
    assert not (tmp_path / "x.json").exists()
