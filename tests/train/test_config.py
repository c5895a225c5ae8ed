"""DeepSpeed JSON configs: parsing, refusals, batch arithmetic, the optimizer mapping and ``jonebit config``.

* a table of broken configs, each refused with the key path and a message saying what was expected;
* DeepSpeed's tutorial configs (our own copies) and the example configs under ``configs/`` load, and
  ``load_config(c.to_dict()) == c`` through JSON;
* batch sizes: any two give the third for a data-parallel size, inconsistent ones are refused;
* optimizers against independent references: AdamW/Adam-L2 against optax, Adam without bias correction
  (with clipping and a WarmupLR schedule) and LAMB's clamped trust ratio against numpy, 1-bit Adam from a config
  against a directly built ``onebit_adam(freeze_step=F - 1)`` inside ``shard_map`` on 8 devices, likewise
  ZeroOneAdam (``var_freeze_step`` unchanged, params per rank) and OneBitLamb (``freeze_step=F - 1``), each with
  an off-by-one variant that must differ;
* ``comm_backend_name: "mpi"`` builds the MPI path (subprocess, skipped without mpi4py/mpi4jax);
* the CLI prints the resolved config (exit 0) or the error (exit 2).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jonebit
from jonebit.cli import main as cli_main
from jonebit.comm.compressed import padded_size
from jonebit.experimental import OneBitAdamOptions
from jonebit.train.config import ConfigError, build_optimizer, build_schedule, describe, load_config
from jonebit.train.data_parallel import data_mesh, init_optimizer, replicate, shard_batch

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "configs").glob("*.json"))

# Our copies of configs from DeepSpeed's 1-bit Adam / BERT tutorials and DeepSpeedExamples (bing_bert,
# BingBertSquad), as documented there.
TUTORIAL_CONFIGS = {
    "bing_bert_onebitadam_nccl": {
        "train_batch_size": 4096, "train_micro_batch_size_per_gpu": 16, "steps_per_print": 100,
        "prescale_gradients": False,
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 4e-4, "weight_decay": 0.01, "bias_correction": False,
                                                       "freeze_step": 23000, "cuda_aware": False,
                                                       "comm_backend_name": "nccl"}},
        "gradient_clipping": 1.0, "wall_clock_breakdown": False,
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
    },
    "bing_bert_onebitadam_mpi": {
        "train_batch_size": 4096, "train_micro_batch_size_per_gpu": 16, "steps_per_print": 100,
        "prescale_gradients": False,
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 4e-4, "weight_decay": 0.01, "bias_correction": False,
                                                       "freeze_step": 23000, "cuda_aware": False,
                                                       "comm_backend_name": "mpi"}},
        "gradient_clipping": 1.0, "wall_clock_breakdown": False,
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
    },
    "squad_onebitadam": {
        "train_batch_size": 96, "train_micro_batch_size_per_gpu": 3, "steps_per_print": 100,
        "optimizer": {"type": "OnebitAdam", "params": {"lr": 3e-5, "freeze_step": 400, "weight_decay": 0.0,
                                                       "bias_correction": False, "cuda_aware": False,
                                                       "comm_backend_name": "nccl"}},
        "gradient_clipping": 1.0, "fp16": {"enabled": True},
    },
    "onebit_tutorial_snippet": {
        "train_batch_size": 4096, "train_micro_batch_size_per_gpu": 16,
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 4e-4, "freeze_step": 23000, "cuda_aware": False,
                                                       "comm_backend_name": "nccl"}},
        "fp16": {"enabled": True},
    },
    "squad_adam_bsz24": {
        "train_batch_size": 24, "train_micro_batch_size_per_gpu": 6, "steps_per_print": 10,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-5, "max_grad_norm": 1.0, "weight_decay": 0.0,
                                                 "bias_correction": False}},
        "fp16": {"enabled": True},
    },
    "bing_bert_lamb_64k": {
        "train_batch_size": 65536, "train_micro_batch_size_per_gpu": 64, "steps_per_print": 1000,
        "prescale_gradients": False,
        "optimizer": {"type": "Lamb", "params": {"lr": 11e-3, "weight_decay": 0.01, "bias_correction": False,
                                                 "max_coeff": 0.3, "min_coeff": 0.01}},
        "gradient_clipping": 1.0, "wall_clock_breakdown": False, "fp16": {"enabled": True, "loss_scale": 0},
    },
    "config_json_doc": {
        "train_batch_size": 8, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 1000}},
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2,
                 "consecutive_hysteresis": False, "min_loss_scale": 1},
        "zero_optimization": {"stage": 0},
    },
}

BASE = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
ONEBIT = {"train_batch_size": 32, "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 10}}}
ZERO_ONE = {"train_batch_size": 32, "optimizer": {"type": "ZeroOneAdam", "params": {"lr": 1e-3}}}
AUTO1 = {"train_batch_size": 32, "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": "auto"}}}
LAMB1 = {"train_batch_size": 32, "optimizer": {"type": "OnebitLamb", "params": {"lr": 1e-3, "freeze_step": 10}}}


def edit(base, path, value):
    """A deep copy of ``base`` with ``path`` (dotted) set to ``value`` (``...``: deleted)."""
    out = copy.deepcopy(base)
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node.setdefault(key, {})
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return out


def sched(type_, **params):
    return edit(BASE, "scheduler", {"type": type_, "params": params})


BAD = [
    # unknown keys, with the closest known one
    (edit(BASE, "optimzer", {}), "optimzer", r"unknown key at the top level\. Did you mean 'optimizer'\?"),
    (edit(BASE, "train_batch_szie", 8), "train_batch_szie", r"Did you mean 'train_batch_size'\?"),
    (edit(BASE, "fp16", {"loss_scale_windw": 10}), "fp16.loss_scale_windw", r"Did you mean 'loss_scale_window'"),
    (edit(BASE, "optimizer.params.weight_decy", 0.1), "optimizer.params.weight_decy", r"Did you mean 'weight_decay'"),
    (sched("WarmupLR", warmup_max=1e-3), "scheduler.params.warmup_max", r"Did you mean 'warmup_max_lr'"),
    (edit(BASE, "zero_optimization", {"stgae": 1}), "zero_optimization.stgae", r"Did you mean 'stage'"),
    (edit(BASE, "optimizer.type", "Adamw8"), "optimizer.type", r"unknown optimizer type 'Adamw8'\. Did you mean "
     r"'AdamW'\?.*Known: Adam, AdamW, Lamb, OneBitAdam"),
    (sched("WarmupLRR"), "scheduler.type", r"unknown scheduler type 'WarmupLRR'\. Did you mean 'WarmupLR'\?"),
    # wrong types
    (edit(BASE, "train_batch_size", "auto"), "train_batch_size", r"expected an integer, got 'auto' \(str\).*Trainer"),
    (edit(BASE, "gradient_clipping", "1.0"), "gradient_clipping", r"expected a number, got '1\.0' \(str\)"),
    (edit(BASE, "prescale_gradients", "false"), "prescale_gradients", r"expected true or false, got 'false'"),
    (edit(BASE, "fp16", {"enabled": "true"}), "fp16.enabled", r"expected true or false, got 'true' \(str\)"),
    (edit(BASE, "optimizer.params.betas", [0.9]), "optimizer.params.betas", r"expected a list of two numbers"),
    (edit(BASE, "optimizer", ["Adam"]), "optimizer", r"expected an object \{\.\.\.\}, got \['Adam'\] \(list\)"),
    (edit(BASE, "optimizer.type", ...), "optimizer.type", r"required key is missing"),
    (edit(ONEBIT, "optimizer.params.comm_backend_name", "gloo"), "optimizer.params.comm_backend_name",
     r"expected one of 'nccl', 'mpi', got 'gloo'"),
    (sched("WarmupLR", warmup_type="cosine"), "scheduler.params.warmup_type",
     r"expected one of 'log', 'linear', got 'cosine'"),
    # negative / out-of-range values
    (edit(BASE, "train_batch_size", -8), "train_batch_size", r"expected an integer >= 1, got -8"),
    (edit(BASE, "gradient_clipping", -1.0), "gradient_clipping", r"expected a number >= 0\.0, got -1\.0"),
    (edit(BASE, "steps_per_print", 0), "steps_per_print", r"expected an integer >= 1, got 0"),
    (edit(BASE, "fp16", {"enabled": True, "loss_scale": -1}), "fp16.loss_scale", r">= 0\.0, got -1\.0"),
    (edit(BASE, "fp16", {"enabled": True, "hysteresis": 0}), "fp16.hysteresis", r">= 1, got 0"),
    (edit(BASE, "fp16", {"initial_scale_power": 100}), "fp16.initial_scale_power", r"at most 64, got 100"),
    (edit(BASE, "fp16", {"initial_scale_power": 2, "min_loss_scale": 8}), "fp16.min_loss_scale",
     r"above the initial scale 2\*\*2"),
    (edit(BASE, "optimizer.params.lr", -1e-3), "optimizer.params.lr", r">= 0\.0, got -0\.001"),
    (edit(BASE, "optimizer.params.eps", 0), "optimizer.params.eps", r"expected a number > 0, got 0\.0"),
    (edit(BASE, "optimizer.params.betas", [0.9, 1.0]), r"optimizer.params.betas[1]", r"in \[0, 1\), got 1\.0"),
    (edit(BASE, "zero_optimization", {"stage": 4}), "zero_optimization.stage", r"expected 0, 1, 2 or 3, got 4"),
    (sched("WarmupLR", warmup_num_steps=0), "scheduler.params.warmup_num_steps", r">= 1, got 0"),
    (sched("WarmupLinearDecayExp", total_training_steps=10, warmup_proportion=1.5),
     "scheduler.params.warmup_proportion", r"expected a fraction in \[0, 1\], got 1\.5"),
    (sched("OneCycle", cycle_min_lr=1e-3, cycle_max_lr=1e-4), "scheduler.params.cycle_max_lr",
     r"cycle_max_lr \(0\.0001\) is below cycle_min_lr \(0\.001\)"),
    # inconsistent values and combinations jonebit cannot honour
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, "train_batch_size",
     r"train_batch_size \(30\) is not divisible by train_micro_batch_size_per_gpu \(4\)"),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3},
     "train_batch_size", r"not divisible by 12"),
    ({"gradient_accumulation_steps": 4}, "train_batch_size", r"give train_batch_size or train_micro_batch_size"),
    (edit(BASE, "bf16", {"enabled": True}) | {"fp16": {"enabled": True, "loss_scale": 128}}, "bf16.enabled",
     r"fp16 and bf16 are both enabled; enable at most one"),
    (edit(BASE, "bfloat16", {"enabled": True}) | {"bf16": {"enabled": True}}, "bfloat16", r"not both"),
    (edit(ZERO_ONE, "zero_optimization", {"stage": 1}), "zero_optimization.stage",
     r"ZeroOneAdam runs at ZeRO stage 0 only.*got stage 1"),
    (edit(LAMB1, "zero_optimization", {"stage": 3}), "zero_optimization.stage", r"OneBitLamb runs at ZeRO stage 0"),
    (edit(ZERO_ONE, "optimizer.params.var_freeze_step", 0), "optimizer.params.var_freeze_step", r">= 1, got 0"),
    (edit(ZERO_ONE, "optimizer.params.local_step_clipper", 0), "optimizer.params.local_step_clipper", r">= 1"),
    (edit(LAMB1, "optimizer.params.freeze_step", 1), "optimizer.params.freeze_step",
     r"expected >= 2, got 1: DeepSpeed's freeze_step=F gives F - 1 full-precision LAMB updates"),
    (edit(LAMB1, "optimizer.params.min_coeff", 20.0), "optimizer.params.max_coeff",
     r"max_coeff \(10\.0\) is below min_coeff \(20\.0\)"),
    (edit(LAMB1, "optimizer.params.factor_min", 5.0), "optimizer.params.factor_max", r"below factor_min"),
    (edit(LAMB1, "optimizer.params.coeff_beta", 1.0), "optimizer.params.coeff_beta", r"fraction in \[0, 1\)"),
    (edit(LAMB1, "optimizer.params.amsgrad", True), "optimizer.params.amsgrad", r"OneBitLamb does not support"),
    (edit(ZERO_ONE, "optimizer.params.freeze_step", 10), "optimizer.params.freeze_step",
     r"Did you mean 'var_freeze_step'"),
    (edit(BASE, "optimizer.params.amsgrad", True), "optimizer.params.amsgrad", r"Adam does not support AMSGrad"),
    (edit(ONEBIT, "optimizer.params.freeze_step", 1), "optimizer.params.freeze_step",
     r"expected >= 2, got 1: DeepSpeed's freeze_step=F gives F - 1"),
    (edit(edit(ONEBIT, "optimizer.params.comm_backend_name", "mpi"), "zero_optimization", {"stage": 2}),
     "optimizer.params.comm_backend_name", r"runs over jax collectives only"),
    (edit(BASE, "zero_optimization", {"stage": 1, "offload_optimizer": {"device": "nvme"}}),
     "zero_optimization.offload_optimizer.device", r"NVMe offload is not supported"),
    (edit(BASE, "zero_optimization", {"stage": 0, "offload_optimizer": {"device": "cpu"}}),
     "zero_optimization.offload_optimizer.device", r"needs ZeRO stage 1, 2 or 3"),
    (edit(BASE, "zero_optimization", {"stage": 3, "offload_param": {"device": "cpu"}}),
     "zero_optimization.offload_param.device", r"parameter offload is not supported"),
    (edit(BASE, "zero_optimization", {"stage": 2, "zero_quantized_weights": True}),
     "zero_optimization.zero_quantized_weights", r"quantizes stage 3's parameter gather; set zero_optimization.stage "
     r"to 3 \(it is 2\)"),
    (edit(BASE, "zero_optimization", {"stage": 3, "zero_quantized_weights": "yes"}),
     "zero_optimization.zero_quantized_weights", r"expected true or false"),
    (sched("WarmupDecayLR", warmup_max_lr=1e-3), "scheduler.params.total_num_steps", r"required parameter is missing"),
    (sched("OneCycle", cycle_min_lr=1e-4), "scheduler.params.cycle_max_lr", r"required parameter is missing"),
    (edit(sched("WarmupCosineLR", total_num_steps=100), "optimizer", ...), "optimizer",
     r"the WarmupCosineLR scheduler scales the optimizer's lr"),
    (edit(sched("WarmupLR"), "optimizer", ...), "scheduler.params.warmup_max_lr", r"no optimizer\.params\.lr"),
    # freeze_step "auto" (jonebit only) and its auto_freeze rule
    (edit(ONEBIT, "optimizer.params.freeze_step", "never"), "optimizer.params.freeze_step",
     r"expected an integer or \"auto\", got 'never' \(str\)"),
    (edit(AUTO1, "optimizer.params.auto_freeze", {"min_stpe": 3}), "optimizer.params.auto_freeze.min_stpe",
     r"unknown key; auto_freeze takes min_step, max_step, check_every, threshold, patience, statistic"),
    (edit(AUTO1, "optimizer.params.auto_freeze", {"threshold": 0}), "optimizer.params.auto_freeze.threshold",
     r"expected a number > 0, got 0"),
    (edit(AUTO1, "optimizer.params.auto_freeze", {"patience": 0}), "optimizer.params.auto_freeze.patience",
     r"expected an integer >= 1, got 0"),
    (edit(AUTO1, "optimizer.params.auto_freeze", {"check_every": "10"}), "optimizer.params.auto_freeze.check_every",
     r"expected an integer, got '10' \(str\)"),
    (edit(ONEBIT, "optimizer.params.mask_unseen", "no"), "optimizer.params.mask_unseen",
     r"expected true or false, got 'no' \(str\)"),
    (edit(ONEBIT, "optimizer.params.row_scales", 1), "optimizer.params.row_scales",
     r"expected true or false, got 1 \(int\)"),
    (edit(ONEBIT, "optimizer.params.clip_ratio", 0), "optimizer.params.clip_ratio", r"expected a number > 0, got 0"),
    (edit(ONEBIT, "optimizer.params.variance_refresh", 0), "optimizer.params.variance_refresh", r">= 1"),
    (edit(ONEBIT, "optimizer.params.variance_refresh", 2.5), "optimizer.params.variance_refresh", r"integer"),
    (edit(ONEBIT, "optimizer.params.local_clip", "on"), "optimizer.params.local_clip", r"expected true or false"),
    (edit(ZERO_ONE, "optimizer.params.preconditioned", True), "optimizer.params.preconditioned",
     r"unknown key in .optimizer\.params.\. Known keys: amsgrad"),
    (edit(AUTO1, "optimizer.params.auto_freeze", {"statistic": "mean"}), "optimizer.params.auto_freeze.statistic",
     r"must be one of 'median', 'max', 'global', got 'mean'"),
    (edit(AUTO1, "optimizer.params.auto_freeze", {"min_step": 50, "max_step": 10}),
     "optimizer.params.auto_freeze.max_step", r"max_step \(10\) must be >= min_step \(50\)"),
    (edit(AUTO1, "optimizer.params.auto_freeze", [10, 0.3]), "optimizer.params.auto_freeze",
     r"expected an object \{\.\.\.\}"),
    (edit(ONEBIT, "optimizer.params.auto_freeze", {"min_step": 3}), "optimizer.params.auto_freeze",
     r"applies to \"freeze_step\": \"auto\" only, got freeze_step \d+"),
    (edit(AUTO1, "zero_optimization", {"stage": 1}), "optimizer.params.freeze_step",
     r"\"auto\" is available at ZeRO stage 0 only, got zero_optimization.stage = 1"),
    (edit(edit(LAMB1, "optimizer.params.freeze_step", "auto"), "optimizer.params.auto_freeze", {"max_step": 0}),
     "optimizer.params.auto_freeze.max_step", r">= 1, got 0"),
    (edit(ZERO_ONE, "optimizer.params.auto_freeze", {}), "optimizer.params.auto_freeze", r"unknown key"),
    (edit(edit(ONEBIT, "optimizer.params.row_scales", True), "zero_optimization", {"stage": 2}),
     "optimizer.params.row_scales", r"research option of 1-bit Adam at ZeRO stage 0 only, got "
     r"zero_optimization.stage = 2; drop row_scales"),
]


@pytest.mark.parametrize("config,key,match", BAD, ids=[f"{i:02d}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_configs_are_refused_by_key(config, key, match):
    with pytest.raises(ConfigError, match=match) as info:
        load_config(config)
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}: ")


def test_unknown_key_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"Known keys: .*gradient_clipping.*zero_optimization") as info:
        load_config(edit(BASE, "gradient_clip", 1.0))
    assert "Did you mean 'gradient_clipping'?" in str(info.value)


def test_bad_file(tmp_path):
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text('{"train_batch_size": 8,}')
    with pytest.raises(ConfigError, match=r"is not valid JSON"):
        load_config(tmp_path / "broken.json")


@pytest.mark.parametrize("name", sorted(TUTORIAL_CONFIGS))
def test_tutorial_configs_load_and_round_trip(name):
    config = load_config(TUTORIAL_CONFIGS[name])
    assert load_config(json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_configs_round_trip(path):
    config = load_config(path)
    assert load_config(json.loads(path.read_text())) == config
    again = load_config(json.loads(json.dumps(config.to_dict())))
    assert again == config
    assert again.to_dict() == config.to_dict()


def test_example_values():
    bing = load_config(ROOT / "configs" / "bing_bert_onebit_adam.json")
    assert bing.optimizer.type == "OneBitAdam"
    assert bing.optimizer.params["freeze_step"] == 23000 and bing.optimizer.params["lr"] == 4e-4
    assert bing.fp16.enabled and bing.fp16.dynamic and bing.fp16.initial_scale == 2.0**16
    assert bing.gradient_clipping == 1.0
    assert dataclasses.astuple(bing.batch_sizes(64)) == (4096, 16, 4, 64)
    squad = load_config(ROOT / "configs" / "bing_bert_squad_onebit_adam.json")
    assert squad.optimizer.type == "OneBitAdam"  # "OnebitAdam" in the file
    assert (squad.train_batch_size, squad.optimizer.params["lr"], squad.optimizer.params["freeze_step"]) == (
        96, 3e-5, 400)


def test_defaults_are_deepspeeds():
    c = load_config({"train_batch_size": 8, "optimizer": {"type": "adam"}})
    assert (c.steps_per_print, c.gradient_clipping, c.prescale_gradients, c.precision) == (10, 0.0, False, "fp32")
    assert c.optimizer.type == "Adam"
    p = c.optimizer.params
    assert (p["lr"], p["betas"], p["eps"], p["weight_decay"], p["bias_correction"], p["adam_w_mode"]) == (
        1e-3, (0.9, 0.999), 1e-8, 0.0, True, True)
    f = load_config({"train_batch_size": 8, "fp16": {"enabled": True}}).fp16
    assert (f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis, f.min_loss_scale) == (
        0.0, 16, 1000, 2, 1.0)
    static = load_config({"train_batch_size": 8, "fp16": {"enabled": True, "loss_scale": 128}}).fp16
    assert not static.dynamic and static.initial_scale == 128.0


def test_ignored_keys_are_logged(caplog):
    cfg = edit(BASE, "tensorboard", {"enabled": True, "output_path": "tb"})
    cfg["zero_optimization"] = {"stage": 2, "overlap_comm": True}
    cfg.update(prescale_gradients=True, wall_clock_breakdown=True)
    with caplog.at_level(logging.WARNING, logger="jonebit.train.config"):
        c = load_config(cfg)
    assert c.zero_optimization.stage == 2
    text = caplog.text
    assert "'tensorboard' is accepted but ignored" in text
    assert "'zero_optimization.overlap_comm' is accepted but ignored" in text
    assert "'prescale_gradients' is accepted but ignored" in text
    assert "'wall_clock_breakdown' is accepted but ignored" in text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jonebit.train.config"):
        load_config(edit(edit(BASE, "prescale_gradients", False), "wall_clock_breakdown", False))
    assert "ignored" not in caplog.text  # their default, false, is what DeepSpeed's sample configs carry


@pytest.mark.parametrize(
    "given,dp,want",
    [
        ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, 8, (64, 4, 2, 8)),
        ({"train_batch_size": 64, "gradient_accumulation_steps": 2}, 8, (64, 4, 2, 8)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 8, (64, 4, 2, 8)),
        ({"train_batch_size": 64}, 8, (64, 8, 1, 8)),
        ({"train_micro_batch_size_per_gpu": 4}, 8, (32, 4, 1, 8)),
        ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 8,
         (64, 4, 2, 8)),
        ({"train_batch_size": 4096, "train_micro_batch_size_per_gpu": 16}, 1, (4096, 16, 256, 1)),
    ],
)
def test_batch_arithmetic(given, dp, want):
    b = load_config(given).batch_sizes(dp)
    assert (b.train_batch_size, b.train_micro_batch_size_per_gpu, b.gradient_accumulation_steps, b.dp_size) == want
    assert b.train_batch_size == b.train_micro_batch_size_per_gpu * b.gradient_accumulation_steps * b.dp_size


@pytest.mark.parametrize(
    "given,dp,key,match",
    [
        ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, 3, "gradient_accumulation_steps",
         r"train_batch_size \(64\) is not divisible by train_micro_batch_size_per_gpu \(4\) x data-parallel "
         r"size \(3\)"),
        ({"train_batch_size": 64, "gradient_accumulation_steps": 2}, 5, "train_micro_batch_size_per_gpu",
         r"not divisible by gradient_accumulation_steps \(2\) x data-parallel size \(5\) = 10"),
        ({"train_batch_size": 64}, 6, "train_micro_batch_size_per_gpu", r"not divisible by the data-parallel size"),
        ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4,
         "train_batch_size", r"must equal .* x data-parallel size \(4\) = 32"),
        ({"train_batch_size": 64}, 0, "dp_size", r"expected an integer >= 1, got 0"),
    ],
)
def test_batch_arithmetic_errors(given, dp, key, match):
    config = load_config(given)
    with pytest.raises(ConfigError, match=match) as info:
        config.batch_sizes(dp)
    assert info.value.key == key


# ------------------------------------------------------------------------------------------------------------------
# Optimizer mapping

SHAPES = {"w": (5, 3), "b": (3,)}


def tiny_problem(steps, seed=0):
    rng = np.random.default_rng(seed)
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    grads = [{k: (rng.normal(size=s) * 2).astype(np.float32) for k, s in SHAPES.items()} for _ in range(steps)]
    return params, grads


def run_optax(tx, params, grads):
    p = jax.tree.map(jnp.asarray, params)
    state = tx.init(p)
    for g in grads:
        updates, state = tx.update(jax.tree.map(jnp.asarray, g), state, p)
        p = optax.apply_updates(p, updates)
    return jax.tree.map(np.asarray, p)


def assert_trees_close(a, b, **kw):
    for k in a:
        np.testing.assert_allclose(a[k], b[k], err_msg=k, **kw)


def test_adamw_matches_optax():
    config = load_config(edit(BASE, "optimizer", {"type": "AdamW", "params": {
        "lr": 2e-2, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1}}))
    params, grads = tiny_problem(6)
    want = run_optax(optax.adamw(2e-2, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1), params, grads)
    assert_trees_close(run_optax(build_optimizer(config), params, grads), want, rtol=1e-6, atol=1e-7)
    # DeepSpeed's "Adam" is AdamW too while adam_w_mode keeps its default (true).
    adam = load_config(edit(config.to_dict(), "optimizer.type", "Adam"))
    assert_trees_close(run_optax(build_optimizer(adam), params, grads), want, rtol=1e-6, atol=1e-7)


def test_adam_l2_mode_matches_optax():
    config = load_config(edit(BASE, "optimizer", {"type": "Adam", "params": {
        "lr": 2e-2, "weight_decay": 0.1, "adam_w_mode": False}}))
    params, grads = tiny_problem(6)
    want = run_optax(optax.chain(optax.add_decayed_weights(0.1), optax.adam(2e-2)), params, grads)
    assert_trees_close(run_optax(build_optimizer(config), params, grads), want, rtol=1e-6, atol=1e-7)
    decoupled = run_optax(optax.adamw(2e-2, weight_decay=0.1), params, grads)
    assert not np.allclose(want["w"], decoupled["w"], rtol=1e-4)  # the two modes are distinguishable here


def warmup_linear_ref(i, lo, hi, w):
    return lo if i < 0 else lo + (hi - lo) * min(i / w, 1.0)


def test_adam_without_bias_correction_with_clipping_and_schedule():
    """BingBertSquad's Adam (bias_correction false, max_grad_norm) + gradient_clipping + WarmupLR, in numpy."""
    cfg = {
        "train_batch_size": 24, "train_micro_batch_size_per_gpu": 6, "gradient_clipping": 3.0,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-2, "max_grad_norm": 2.0, "weight_decay": 0.05,
                                                 "bias_correction": False}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_num_steps": 4,
                                                     "warmup_type": "linear"}},
    }
    params, grads = tiny_problem(7, seed=1)
    got = run_optax(build_optimizer(load_config(cfg)), params, grads)
    p = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for count, g in enumerate(grads):
        norm = math.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in g.values()))
        factor = min(1.0, 2.0 / norm)  # the smaller of gradient_clipping and max_grad_norm
        lr = warmup_linear_ref(count - 1, 1e-3, 3e-2, 4)  # warmup_max_lr defaults to the optimizer's lr
        for k in p:
            gk = g[k] * factor
            m[k] = 0.9 * m[k] + 0.1 * gk
            v[k] = 0.999 * v[k] + 0.001 * gk**2
            p[k] = p[k] - lr * (m[k] / (np.sqrt(v[k]) + 1e-8) + 0.05 * p[k])
    assert_trees_close(got, p, rtol=2e-5, atol=2e-6)


def test_lamb_matches_optax_without_clamp_and_numpy_with_clamp():
    params, grads = tiny_problem(5, seed=2)
    free = load_config(edit(BASE, "optimizer", {"type": "Lamb", "params": {
        "lr": 1e-2, "weight_decay": 0.01, "min_coeff": 0.0, "max_coeff": 1e9}}))
    want = run_optax(optax.lamb(1e-2, weight_decay=0.01), params, grads)
    assert_trees_close(run_optax(build_optimizer(free), params, grads), want, rtol=1e-5, atol=1e-7)

    # bing_bert's LAMB: max_coeff 0.3 clamps the trust ratio (||p|| / ||u|| is ~1 here), no bias correction.
    clamped = load_config(TUTORIAL_CONFIGS["bing_bert_lamb_64k"])
    got = run_optax(build_optimizer(clamped, clip=False), params, grads)
    p = {k: x.astype(np.float64) for k, x in params.items()}
    m = {k: np.zeros_like(x) for k, x in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    ratios = []
    for g in grads:
        for k in p:
            m[k] = 0.9 * m[k] + 0.1 * g[k]
            v[k] = 0.999 * v[k] + 0.001 * g[k] ** 2
            u = m[k] / (np.sqrt(v[k]) + 1e-8) + 0.01 * p[k]
            raw = np.linalg.norm(p[k]) / np.linalg.norm(u)
            ratios.append(raw)
            p[k] = p[k] - 11e-3 * min(max(raw, 0.01), 0.3) * u
    assert max(ratios) > 0.3  # the clamp is active in this test
    assert_trees_close(got, p, rtol=2e-5, atol=1e-6)


N_DEV = 8


def run_sharded(tx, params, grads_per_rank):
    """Steps ``tx`` inside shard_map over 8 devices; ``grads_per_rank[t]`` has a leading axis of 8 (one per rank)."""
    mesh = data_mesh()
    p = replicate(jax.tree.map(jnp.asarray, params), mesh)
    state, specs = init_optimizer(tx, p, mesh)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs))
    def step(p, s, g):
        g = jax.tree.map(lambda x: x[0], g)
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    for g in grads_per_rank:
        p, state = step(p, state, shard_batch(g, mesh))
    return jax.tree.map(np.asarray, p), state


def test_onebit_adam_from_config_equals_direct_onebit_adam():
    """DeepSpeed freeze_step=3 -> onebit_adam(freeze_step=2); WarmupLR shifted by 1-bit Adam's init step."""
    assert jax.device_count() == N_DEV
    cfg = {
        "train_batch_size": 8 * N_DEV, "gradient_clipping": 4.0,
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": 3, "weight_decay": 0.01,
                                                       "bias_correction": False, "betas": [0.85, 0.99]}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 4, "warmup_type": "linear"}},
        "fp16": {"enabled": True},
    }
    config = load_config(cfg)
    rng = np.random.default_rng(3)
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    grads = [{k: rng.normal(size=(N_DEV, *s)).astype(np.float32) for k, s in SHAPES.items()} for _ in range(4)]

    # DeepSpeed: engine step 0 initialises (lr of iteration -1 unused); real update c runs at iteration c.
    lrs = jnp.asarray([warmup_linear_ref(c, 1e-3, 1e-2, 4) for c in range(8)], jnp.float32)

    def direct(freeze_step):
        # gradient_clipping goes inside 1-bit Adam (the averaged gradient in warmup, the local one after).
        return jonebit.onebit_adam(lambda count: lrs[count], freeze_step=freeze_step, b1=0.85, b2=0.99,
                                   weight_decay=0.01, bias_correction=False, fused=True, max_grad_norm=4.0)

    got, state = run_sharded(build_optimizer(config), params, grads)
    want, _ = run_sharded(direct(2), params, grads)
    assert_trees_close(got, want, rtol=1e-6, atol=1e-7)
    assert int(state.count) == 4
    # The offset matters: F updates of Adam instead of F - 1 gives other parameters after the switch.
    off_by_one, _ = run_sharded(direct(3), params, grads)
    assert not np.allclose(got["w"], off_by_one["w"], rtol=1e-5, atol=1e-6)


def test_onebit_adam_options():
    config = load_config(edit(ONEBIT, "zero_optimization", {"stage": 2}))
    tx = build_optimizer(config, fused=False)
    # zero_stage comes from the config: the stage-2 state keeps the synchronised momentum as packed signs.
    state = jax.eval_shape(lambda: jonebit.sharded_init(tx, replicate({"w": jnp.ones((64, 8))}, data_mesh()),
                                                         data_mesh(), "data")[0])
    assert type(state).__name__ == "OneBitAdamZeroState"
    with pytest.raises(ValueError, match=r"mpi_comm was given but optimizer\.params\.comm_backend_name is 'nccl'"):
        build_optimizer(load_config(ONEBIT), mpi_comm=object())
    with pytest.raises(ConfigError, match=r"optimizer: the config has no optimizer section"):
        build_optimizer(load_config({"train_batch_size": 8}))


def test_row_scales_from_config_equals_direct_onebit_adam():
    """"row_scales": true builds onebit_adam(experimental=OneBitAdamOptions(row_scales=True)), per leaf even with fp16
    (whose default is fused)."""
    cfg = {"train_batch_size": 8 * N_DEV, "fp16": {"enabled": True},
           "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": 3, "row_scales": True}}}
    rng = np.random.default_rng(4)
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    grads = [{k: rng.normal(size=(N_DEV, *s)).astype(np.float32) for k, s in SHAPES.items()} for _ in range(5)]
    got, _ = run_sharded(build_optimizer(load_config(cfg)), params, grads)
    want, _ = run_sharded(jonebit.onebit_adam(1e-2, freeze_step=2, experimental=OneBitAdamOptions(row_scales=True)),
                          params, grads)
    assert_trees_close(got, want, rtol=0, atol=0)
    per_tensor, _ = run_sharded(jonebit.onebit_adam(1e-2, freeze_step=2), params, grads)
    assert not np.allclose(got["w"], per_tensor["w"], rtol=1e-6, atol=0)


def test_freeze_step_auto_from_config_equals_direct_onebit_adam_and_lamb(capsys):
    """"freeze_step": "auto" with an auto_freeze rule builds onebit_adam/onebit_lamb(freeze_step="auto") with that
    rule (jonebit's update counts); the describe text names it."""
    rule = {"min_step": 2, "max_step": 6, "check_every": 1, "threshold": 0.5, "patience": 1, "statistic": "max"}
    cfg = {"train_batch_size": 8 * N_DEV,
           "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": "auto", "auto_freeze": rule}}}
    config = load_config(cfg)
    assert config.optimizer.params["freeze_step"] == "auto" and config.optimizer.params["auto_freeze"] == rule
    rng = np.random.default_rng(3)
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    grads = [{k: rng.normal(size=(N_DEV, *s)).astype(np.float32) for k, s in SHAPES.items()} for _ in range(8)]
    got, state = run_sharded(build_optimizer(config, fused=True), params, grads)
    direct = jonebit.onebit_adam(1e-2, freeze_step=jonebit.AutoFreeze(**rule), fused=True)
    want, want_state = run_sharded(direct, params, grads)
    assert_trees_close(got, want, rtol=0, atol=0)
    assert 2 <= int(state.freeze_at) == int(want_state.freeze_at) <= 6
    assert "onebit_adam(freeze_step=\"auto\"): Adam updates until the variance settles" in describe(config, N_DEV)
    # The default rule when auto_freeze is left out.
    no_rule = load_config(edit(cfg, "optimizer.params.auto_freeze", ...))
    assert no_rule.optimizer.params["auto_freeze"] is None
    assert int(jax.eval_shape(lambda: jonebit.sharded_init(
        build_optimizer(no_rule), replicate(params, data_mesh()), data_mesh())[0]).freeze_at.size) == 1
    lamb = load_config(edit(cfg, "optimizer.type", "OneBitLamb"))
    got, state = run_sharded(build_optimizer(lamb), params, grads)
    want, want_state = run_sharded(jonebit.onebit_lamb(1e-2, freeze_step=jonebit.AutoFreeze(**rule)), params, grads)
    assert_trees_close(got, want, rtol=0, atol=0)
    assert int(state.freeze_at) == int(want_state.freeze_at)
    assert "onebit_lamb(freeze_step=\"auto\")" in describe(lamb, N_DEV)


def run_per_rank(tx, params, grads_per_rank):
    """Like :func:`run_sharded` with the params carried per rank (0/1 Adam's local steps move them apart)."""
    from tests.transforms.family_util import per_rank_stepper

    mesh = data_mesh()
    state, specs = jonebit.sharded_init(tx, params, mesh)
    step = per_rank_stepper(tx, mesh, specs)
    p = shard_batch({k: np.stack([v] * N_DEV) for k, v in params.items()}, mesh)
    for g in grads_per_rank:
        p, state = step(p, state, shard_batch(g, mesh))
    return jax.tree.map(np.asarray, p), state


def test_zero_one_adam_from_config_equals_direct_zero_one_adam():
    """var_freeze_step passes unchanged (DeepSpeed's strict > cancels its init step); WarmupLR shifted by one."""
    cfg = {
        "train_batch_size": 8 * N_DEV,
        "optimizer": {"type": "ZeroOneAdam", "params": {
            "lr": 1e-2, "weight_decay": 0.01, "betas": [0.85, 0.99], "var_freeze_step": 4, "var_update_scaler": 2,
            "local_step_scaler": 2, "local_step_clipper": 2, "cuda_aware": False, "comm_backend_name": "nccl"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 4, "warmup_type": "linear"}},
        "fp16": {"enabled": True},
    }
    config = load_config(cfg)
    assert "jonebit.zero_one_adam(var_freeze_step=4)" in describe(config, N_DEV)
    rng = np.random.default_rng(4)
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    grads = [{k: rng.normal(size=(N_DEV, *s)).astype(np.float32) for k, s in SHAPES.items()} for _ in range(9)]
    lrs = jnp.asarray([warmup_linear_ref(c, 1e-3, 1e-2, 4) for c in range(10)], jnp.float32)

    def direct(var_freeze_step):
        return jonebit.zero_one_adam(lambda count: lrs[count], var_freeze_step=var_freeze_step, b1=0.85, b2=0.99,
                                     weight_decay=0.01, var_update_scaler=2, local_step_scaler=2,
                                     local_step_clipper=2, fused=True)

    got, state = run_per_rank(build_optimizer(config), params, grads)
    want, _ = run_per_rank(direct(4), params, grads)
    assert_trees_close(got, want, rtol=1e-6, atol=1e-7)
    assert int(state.count) == 9 and int(state.local_step_interval) == 2
    off_by_one, _ = run_per_rank(direct(3), params, grads)
    assert not np.allclose(got["w"], off_by_one["w"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["ZeroOneAdam", "OneBitLamb"])
def test_mask_unseen_from_config_for_the_family(kind):
    """"mask_unseen": false (DeepSpeed's arithmetic) reaches zero_one_adam / onebit_lamb; the default is true. The
    leaf "b" never gets a gradient, so the two differ."""
    # LAMB: weight decay gives the zero leaf a trust ratio, so its frozen coefficient is not 0.
    params_cfg = {"lr": 1e-2, "var_freeze_step": 2} if kind == "ZeroOneAdam" else \
        {"lr": 1e-2, "freeze_step": 3, "weight_decay": 0.01}
    rng = np.random.default_rng(6)
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    grads = [{k: rng.normal(size=(N_DEV, *s)).astype(np.float32) * (k != "b") for k, s in SHAPES.items()}
             for _ in range(5)]
    run = run_per_rank if kind == "ZeroOneAdam" else run_sharded
    direct = (lambda m: jonebit.zero_one_adam(1e-2, var_freeze_step=2, mask_unseen=m, fused=True)) \
        if kind == "ZeroOneAdam" \
        else (lambda m: jonebit.onebit_lamb(1e-2, freeze_step=2, weight_decay=0.01, mask_unseen=m))
    results = {}
    for mask_unseen in (None, False):
        cfg = {"train_batch_size": 8 * N_DEV, "optimizer": {"type": kind, "params": dict(params_cfg)}}
        if mask_unseen is not None:
            cfg["optimizer"]["params"]["mask_unseen"] = mask_unseen
        # fused: the zero leaf shares a 1-bit chunk with the others (alone, its average would be exactly 0)
        results[mask_unseen], _ = run(build_optimizer(load_config(cfg), fused=True), params, grads)
    want_default, _ = run(direct(True), params, grads)
    want_deepspeed, _ = run(direct(False), params, grads)
    assert_trees_close(results[None], want_default, rtol=0, atol=0)
    assert_trees_close(results[False], want_deepspeed, rtol=0, atol=0)
    moved = {k: np.abs(np.asarray(r["b"]).reshape(-1, 3) - params["b"]).max() for k, r in results.items()}
    assert moved[None] < 1e-2 and moved[False] > 0.1, moved  # weight decay only / the 1-bit average over eps


def test_onebit_lamb_from_config_equals_direct_onebit_lamb(caplog):
    """DeepSpeed freeze_step=3 -> onebit_lamb(freeze_step=2); DeepSpeed's ignored params only warn."""
    cfg = {
        "train_batch_size": 8 * N_DEV,
        "optimizer": {"type": "OnebitLamb", "params": {
            "lr": 1e-2, "freeze_step": 3, "weight_decay": 0.01, "max_coeff": 0.3, "min_coeff": 0.01,
            "coeff_beta": 0.5, "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1,
            "bias_correction": True, "max_grad_norm": 1.0}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 4, "warmup_type": "linear"}},
    }
    config = load_config(cfg)
    assert config.optimizer.type == "OneBitLamb"
    assert "jonebit.onebit_lamb(freeze_step=2)" in describe(config, N_DEV)
    rng = np.random.default_rng(5)
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    grads = [{k: rng.normal(size=(N_DEV, *s)).astype(np.float32) for k, s in SHAPES.items()} for _ in range(6)]
    lrs = jnp.asarray([warmup_linear_ref(c, 1e-3, 1e-2, 4) for c in range(8)], jnp.float32)

    def direct(freeze_step):
        return jonebit.onebit_lamb(lambda count: lrs[count], freeze_step=freeze_step, weight_decay=0.01,
                                   max_coeff=0.3, coeff_beta=0.5)

    with caplog.at_level(logging.WARNING, logger="jonebit.train.config"):
        tx = build_optimizer(config)
    assert "bias_correction: ignored" in caplog.text and "max_grad_norm: ignored" in caplog.text
    got, state = run_sharded(tx, params, grads)
    want, _ = run_sharded(direct(2), params, grads)
    assert_trees_close(got, want, rtol=1e-6, atol=1e-7)
    assert int(state.count) == 6
    off_by_one, _ = run_sharded(direct(3), params, grads)
    assert not np.allclose(got["w"], off_by_one["w"], rtol=1e-5, atol=1e-6)


def test_build_schedule_uses_the_optimizer_lr_and_offset():
    config = load_config(edit(ONEBIT, "scheduler", {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 100, "warmup_num_steps": 10, "warmup_type": "linear", "warmup_min_ratio": 0.1}}))
    s = build_schedule(config.scheduler, config.optimizer)  # 1-bit Adam: count 0 runs at iteration 0
    assert float(s(0)) == pytest.approx(1e-3 * 0.1)
    s0 = build_schedule(config.scheduler, config.optimizer, init_steps=0)  # standard: count 0 at iteration -1
    assert float(s0(0)) == 0.0 and float(s0(1)) == pytest.approx(1e-4)


MPI_SCRIPT = """
import os, json
os.environ.pop("MPI4JAX_USE_CUDA_MPI", None)
import jax, jax.numpy as jnp
from jonebit.train.config import load_config, build_optimizer
cfg = json.loads(os.environ["CFG"])
tx = build_optimizer(load_config(cfg))
state = tx.init({"w": jnp.ones((6, 4))})  # no shard_map: only the MPI backend can run here
shapes = [list(e.shape) for e in state.worker_error]
print(json.dumps({"env": os.environ.get("MPI4JAX_USE_CUDA_MPI"), "worker": shapes}))
"""


@pytest.mark.parametrize("cuda_aware,env", [(False, "0"), (True, "1")])
def test_mpi_backend_is_selected(cuda_aware, env):
    pytest.importorskip("mpi4py")
    pytest.importorskip("mpi4jax")
    cfg = edit(ONEBIT, "optimizer.params.comm_backend_name", "mpi")
    cfg["optimizer"]["params"]["cuda_aware"] = cuda_aware
    proc = subprocess.run(
        [sys.executable, "-c", MPI_SCRIPT], capture_output=True, text=True, timeout=240,
        env={**os.environ, "CFG": json.dumps(cfg), "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
             "XLA_FLAGS": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # A singleton MPI run (1 rank) built the MPI backend outside shard_map; without fp16 the config compresses
    # per tensor (DeepSpeed's fp32 path): one stacked error array per group of equal-size leaves, here one leaf.
    assert out["env"] == env  # cuda_aware set mpi4jax's mode
    assert out["worker"] == [[1, 1, padded_size(24, 1)]]


@pytest.mark.parametrize(
    "env,cuda_aware,want,warns",
    [(None, False, "0", False), (None, True, "1", False), ("0", True, "1", True), ("1", False, "1", True),
     ("true", True, "true", False), ("off", False, "off", False)],
)
def test_cuda_aware_sets_mpi4jax_mode(monkeypatch, caplog, env, cuda_aware, want, warns):
    from jonebit.train.optimizers import _apply_cuda_aware

    if env is None:
        monkeypatch.delenv("MPI4JAX_USE_CUDA_MPI", raising=False)
    else:
        monkeypatch.setenv("MPI4JAX_USE_CUDA_MPI", env)
    with caplog.at_level(logging.WARNING, logger="jonebit.train.config"):
        _apply_cuda_aware(cuda_aware)
    assert os.environ["MPI4JAX_USE_CUDA_MPI"] == want
    assert ("MPI4JAX_USE_CUDA_MPI" in caplog.text) == warns


# ------------------------------------------------------------------------------------------------------------------
# CLI


def test_cli_prints_the_resolved_config(capsys):
    rc = cli_main(["config", "check", str(ROOT / "configs" / "bing_bert_onebit_adam.json"), "--dp-size", "64",
                   "--steps", "0", "12499"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "train_batch_size 4096 = micro 16 x accumulation 4 x data-parallel 64" in out
    assert "jonebit.onebit_adam(freeze_step=22999)" in out
    assert "precision: fp16" in out and "dynamic from 2**16" in out
    assert "update       0: lr 3.2e-08" in out  # bing_bert's global_step 1 of a 12500-step warmup
    assert "update   12499: lr 0.0004" in out


def test_cli_refuses_a_bad_config(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(edit(BASE, "optimizer.params.weight_decy", 0.1)))
    rc = cli_main(["config", str(path), "--world-size", "8"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "optimizer.params.weight_decy: unknown key" in err and "Did you mean 'weight_decay'?" in err
    path.write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}))
    assert cli_main(["config", "check", str(path), "--dp-size", "3"]) == 2
    assert "not divisible" in capsys.readouterr().err


def test_cli_gives_one_verdict_when_the_dp_size_breaks_the_batch(tmp_path, capsys):
    """A config valid on its own but not for --world-size: only the error, on stderr, and exit code 2."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 16,
                                "gradient_accumulation_steps": 2, "optimizer": {"type": "AdamW",
                                                                                "params": {"lr": 1e-3}}}))
    rc = cli_main(["config", str(path), "--world-size", "4"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert "invalid DeepSpeed config" in captured.err and "x data-parallel size (4) = 128" in captured.err
    assert cli_main(["config", str(path), "--world-size", "2"]) == 0  # 16 x 2 x 2 = 64
    assert "valid DeepSpeed config" in capsys.readouterr().out


@pytest.mark.parametrize("changes, clipping, compression", [
    # 1-bit Adam at stage 0 clips inside; its max_grad_norm is accepted and ignored (DeepSpeed's behaviour).
    ({}, "gradient clipping: global norm <= 1 (from gradient_clipping); inside 1-bit Adam: the averaged gradient "
         "during warmup", "compression: fused, all parameters in one flat buffer"),
    ({"optimizer.params.max_grad_norm": 0.5}, "; optimizer.params.max_grad_norm=0.5 is ignored by OneBitAdam",
     "compression: fused"),
    ({"fp16.enabled": False}, "gradient clipping: global norm <= 1", "compression: per tensor, one compressed "
                                                                     "allreduce per parameter (fp16 off; fp16 fuses)"),
    ({"gradient_clipping": 0.0}, "gradient clipping: off", "compression: fused"),
    ({"optimizer.type": "AdamW", "optimizer.params.max_grad_norm": 0.5, "optimizer.params.freeze_step": ...},
     "gradient clipping: global norm <= 0.5 (from gradient_clipping and optimizer.params.max_grad_norm, the "
     "smaller wins); optax.clip_by_global_norm on the averaged gradient", None),
])
def test_cli_shows_the_clipping_and_compression_applied(tmp_path, capsys, changes, clipping, compression):
    raw = json.loads((ROOT / "configs" / "bing_bert_onebit_adam.json").read_text())
    for key, value in changes.items():
        raw = edit(raw, key, value)
    if raw["optimizer"]["type"] == "AdamW":
        for k in ("cuda_aware", "comm_backend_name"):
            raw["optimizer"]["params"].pop(k)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    assert cli_main(["config", str(path), "--dp-size", "64"]) == 0
    out = capsys.readouterr().out
    assert clipping in out
    assert "max_grad_norm" not in next(ln for ln in out.splitlines() if ln.startswith("optimizer:"))
    if compression is None:
        assert "compression:" not in out
    else:
        assert compression in out
    if raw["optimizer"]["type"] == "AdamW":
        # The reference: the unclipped optimizer on gradients clipped by hand at the bound the line shows.
        config = load_config(raw)
        grads = {"w": jnp.arange(4.0) * 10.0}
        bound = float(clipping.split("<= ")[1].split(" ")[0])
        tx, bare = build_optimizer(config), build_optimizer(config, clip=False)
        # Adam's first moment holds the gradient it was given (its first update is scale-invariant).
        got = jax.tree.leaves(tx.update(grads, tx.init(grads), grads)[1])
        ref = jax.tree.leaves(bare.update(optax.clip_by_global_norm(bound).update(grads, None)[0],
                                          bare.init(grads), grads)[1])
        raw_state = jax.tree.leaves(bare.update(grads, bare.init(grads), grads)[1])
        assert len(got) == len(ref)
        for g, r in zip(got, ref, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6)
        assert not all(np.allclose(np.asarray(g), np.asarray(r)) for g, r in zip(got, raw_state, strict=True))
