"""DeepSpeed JSON configs, accepted unchanged, as a frozen dataclass tree; optimizer and schedule builders.

:func:`load_config` reads a DeepSpeed ``ds_config.json`` (a path or a dict) into :class:`DeepSpeedConfig`.
Every key is checked: an unknown key is an error naming it, its closest known sibling and the known keys;
a wrong type, a negative or inconsistent value names the key path, what was expected and what was given.
Keys that DeepSpeed has but that do not change what is computed (logging, profilers, bucket sizes, ...) are
accepted with a logged warning; :data:`IGNORED_KEYS` lists them with the reason.

:func:`build_optimizer` turns the ``optimizer`` / ``scheduler`` / ``gradient_clipping`` sections into an
optax ``GradientTransformation``:

==============================  ==================================================================
DeepSpeed ``optimizer.type``    jonebit
==============================  ==================================================================
``Adam``, ``AdamW``             Adam with decoupled weight decay (DeepSpeed's FusedAdam with its
                                default ``adam_w_mode: true``; ``Adam`` + ``adam_w_mode: false``:
                                L2 decay added to the gradient), bias correction unless
                                ``bias_correction: false``
``Lamb``                        optax's LAMB with DeepSpeed's trust-ratio clamp ``[min_coeff,
                                max_coeff]``
``OneBitAdam`` / ``OnebitAdam``  :func:`jonebit.onebit_adam` with ``freeze_step = F - 1``
``ZeroOneAdam``                 :func:`jonebit.zero_one_adam` with the same ``var_freeze_step`` (DeepSpeed's
                                strict ``>`` comparison cancels its initialisation step); ZeRO stage 0 only
``OneBitLamb`` / ``OnebitLamb``  :func:`jonebit.onebit_lamb` with ``freeze_step = F - 1``; ZeRO stage 0 only
==============================  ==================================================================

Each type is a registered class of :mod:`jonebit.train.optimizers` whose fields are its ``optimizer.params``
(keys, defaults, validation), which checks their combinations and builds the transformation; the accepted keys
and defaults here are read from those fields. Types are matched case-insensitively, as DeepSpeed does.
``gradient_clipping > 0`` puts
``optax.clip_by_global_norm`` first in the chain (see :func:`build_optimizer` for what it clips with the 1-bit
optimizers).

``freeze_step: "auto"`` (OneBitAdam, OneBitLamb; jonebit only, ZeRO stage 0): the optimizer decides the freeze
point by :class:`jonebit.AutoFreeze`, whose fields an optional ``auto_freeze`` object sets (``min_step``,
``max_step``, ``check_every``, ``threshold``, ``patience``, ``statistic``; update counts as jonebit counts them).
Elsewhere ``"auto"`` is the HuggingFace Trainer's placeholder and is refused with a hint to give the number.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import optax

from jonebit.train import schedules
from jonebit.train.optimizers import (
    COMM_BACKENDS,  # noqa: F401  (re-exported: imported from jonebit.train.config elsewhere)
    ONEBIT_OPTIMIZERS,  # noqa: F401
    OPTIMIZERS,
    ConfigError,
    OneBitAdam,
    OptimizerOptions,
    _bool,
    _check_keys,
    _describe,
    _float,
    _int,
    _join,
    _nonneg_float,
    _opt_pos_int,
    _pos_float,
    _pos_int,
    _section,
    _str,
    _suggest,
)

log = logging.getLogger(__name__)

_MISSING = object()

# 1-bit Adam's research options (jonebit.experimental.OneBitAdamOptions), as its config keys.
RESEARCH_KEYS = OneBitAdam.experimental_keys()


# ----------------------------------------------------------------------------------------------------------------
# Scheduler parameter tables: name -> (parser, default). A parser takes (value, key path) and returns the checked
# value. (The optimizers' tables are the fields of their classes in jonebit.train.optimizers.)


@dataclass(frozen=True)
class Param:
    parse: Callable[[Any, str], Any]
    default: Any = _MISSING  # _MISSING: required


def _nonneg_int(v, k):
    return _int(v, k, minimum=0)


def _warmup_type(v, k):
    return _str(v, k, schedules.WARMUP_TYPES)


def _parse_params(params: Mapping, path: str, table: Mapping[str, Param], ignored: Mapping[str, str]) -> dict:
    _check_keys(params, path, table, ignored)
    out = {}
    for name, spec in table.items():
        key = _join(path, name)
        if name in params:
            out[name] = spec.parse(params[name], key)
        elif spec.default is _MISSING:
            raise ConfigError(key, f"required parameter is missing (give {name!r} in {path!r})")
        else:
            out[name] = spec.default
    return out


# ----------------------------------------------------------------------------------------------------------------
# Config dataclasses


@dataclass(frozen=True)
class FP16Config:
    """``fp16``: mixed precision with loss scaling (DeepSpeed's names and defaults).

    ``loss_scale = 0`` selects dynamic loss scaling starting at ``2 ** initial_scale_power``; a positive value is a
    static scale.
    """

    enabled: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0.0

    @property
    def initial_scale(self) -> float:
        return float(2.0**self.initial_scale_power) if self.dynamic else self.loss_scale


@dataclass(frozen=True)
class BF16Config:
    """``bf16``: bfloat16 compute with fp32 master weights, no loss scaling."""

    enabled: bool = False


@dataclass(frozen=True)
class OffloadConfig:
    """``zero_optimization.offload_optimizer``: ``device`` ``"none"`` or ``"cpu"`` (host memory)."""

    device: str = "none"
    pin_memory: bool = False

    @property
    def enabled(self) -> bool:
        return self.device == "cpu"


@dataclass(frozen=True)
class ZeroConfig:
    """``zero_optimization``: the ZeRO ``stage`` (0-3), optimizer offload, and ``zero_quantized_weights``
    (ZeRO++'s int8 parameter gather at stage 3)."""

    stage: int = 0
    offload_optimizer: OffloadConfig = OffloadConfig()
    zero_quantized_weights: bool = False


@dataclass(frozen=True)
class OptimizerConfig:
    """``optimizer``: ``type`` in DeepSpeed's canonical spelling, ``params`` with every default filled in.

    ``params`` is the plain mapping the rest of the package reads; :attr:`options` is the same values as the
    type's :class:`jonebit.train.optimizers.OptimizerOptions`, which builds the transformation.
    """

    type: str
    params: Mapping[str, Any]

    @property
    def spec(self) -> type[OptimizerOptions]:
        """The registered options class of ``type``."""
        return OPTIMIZERS[self.type.lower()]

    @property
    def options(self) -> OptimizerOptions:
        return self.spec(**self.params)


@dataclass(frozen=True)
class SchedulerConfig:
    """``scheduler``: ``type`` in canonical spelling, ``params`` with every default filled in."""

    type: str
    params: Mapping[str, Any]


@dataclass(frozen=True)
class BatchSizes:
    """The resolved batch arithmetic: ``train_batch_size = micro x accumulation x dp_size``."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    dp_size: int


@dataclass(frozen=True)
class DeepSpeedConfig:
    """A parsed DeepSpeed config. Build it with :func:`load_config`; :meth:`to_dict` gives the JSON back.

    Batch sizes are kept as given (``None`` when absent); :meth:`batch_sizes` resolves them for a data-parallel
    size.
    """

    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int | None = None
    steps_per_print: int = 10
    gradient_clipping: float = 0.0
    prescale_gradients: bool = False
    wall_clock_breakdown: bool = False
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    fp16: FP16Config = FP16Config()
    bf16: BF16Config = BF16Config()
    zero_optimization: ZeroConfig = ZeroConfig()

    @property
    def precision(self) -> str:
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    def batch_sizes(self, dp_size: int) -> BatchSizes:
        """Resolves the three batch sizes for ``dp_size`` data-parallel ranks (DeepSpeed's rules).

        Any two of ``train_batch_size``, ``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps``
        give the third; one of the first two alone implies ``gradient_accumulation_steps = 1``. All must satisfy
        ``train = micro * accumulation * dp_size`` exactly.
        """
        dp = _int(dp_size, "dp_size", minimum=1)
        train, micro, gas = self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        if train is None and micro is None:
            raise ConfigError(
                "train_batch_size",
                "give train_batch_size or train_micro_batch_size_per_gpu (with gradient_accumulation_steps, or "
                "alone for no accumulation)",
            )
        if train is not None and micro is not None and gas is not None:
            if train != micro * gas * dp:
                raise ConfigError(
                    "train_batch_size",
                    f"train_batch_size ({train}) must equal train_micro_batch_size_per_gpu ({micro}) x "
                    f"gradient_accumulation_steps ({gas}) x data-parallel size ({dp}) = {micro * gas * dp}",
                )
        elif train is not None and micro is not None:
            gas = _divide(train, micro * dp, "gradient_accumulation_steps", f"train_batch_size ({train})",
                          f"train_micro_batch_size_per_gpu ({micro}) x data-parallel size ({dp})")
        elif train is not None and gas is not None:
            micro = _divide(train, gas * dp, "train_micro_batch_size_per_gpu", f"train_batch_size ({train})",
                            f"gradient_accumulation_steps ({gas}) x data-parallel size ({dp})")
        elif train is not None:
            gas = 1
            micro = _divide(train, dp, "train_micro_batch_size_per_gpu", f"train_batch_size ({train})",
                            f"the data-parallel size ({dp})")
        else:
            gas = 1 if gas is None else gas
            train = micro * gas * dp
        return BatchSizes(train, micro, gas, dp)

    def to_dict(self) -> dict:
        """The config as DeepSpeed JSON (defaults filled in); ``load_config(c.to_dict()) == c``."""
        out: dict[str, Any] = {}
        for name in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        out.update(
            steps_per_print=self.steps_per_print,
            gradient_clipping=self.gradient_clipping,
            prescale_gradients=self.prescale_gradients,
            wall_clock_breakdown=self.wall_clock_breakdown,
        )
        for name in ("optimizer", "scheduler"):
            section = getattr(self, name)
            if section is not None:
                out[name] = {"type": section.type, "params": {k: _jsonable(v) for k, v in section.params.items()}}
        out["fp16"] = dataclasses.asdict(self.fp16)
        out["bf16"] = dataclasses.asdict(self.bf16)
        out["zero_optimization"] = dataclasses.asdict(self.zero_optimization)
        return out


def _jsonable(value):
    return list(value) if isinstance(value, tuple) else value


def _divide(total: int, by: int, what: str, total_desc: str, by_desc: str) -> int:
    if total % by:
        raise ConfigError(
            what, f"{total_desc} is not divisible by {by_desc} = {by}; change the batch sizes so that "
            "train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel size",
        )
    return total // by


# ----------------------------------------------------------------------------------------------------------------
# Which DeepSpeed keys are accepted but have no effect here, and why (decided per key).

IGNORED_KEYS: Mapping[str, str] = types.MappingProxyType({
    "memory_breakdown": "DeepSpeed's memory logging; use jax.profiler or the compiled memory analysis",
    "dump_state": "DeepSpeed's debug dump of its own engine state",
    "flops_profiler": "DeepSpeed's profiler; use jax.profiler",
    "tensorboard": "jonebit's training loop writes its own TensorBoard events",
    "wandb": "jonebit's training loop writes metrics.jsonl and TensorBoard events",
    "csv_monitor": "jonebit's training loop writes metrics.jsonl",
    "comms_logger": "collective bytes are read from the compiled program instead",
    "zero_allow_untested_optimizer": "every jonebit optimizer works with every ZeRO stage",
    "gradient_predivide_factor": "only changes where fp16 gradients are divided by the rank count, not the mean",
    "communication_data_type": "jonebit reduces gradients in their own dtype (the 1-bit optimizers send signs)",
    "seq_parallel_communication_data_type": "no sequence parallelism",
    "steps_per_print_timing": "timing lines come from the training loop",
    "timers": "DeepSpeed's internal timers",
})
_ZERO_IGNORED = types.MappingProxyType({
    k: "a DeepSpeed bucketing/overlap knob; XLA schedules the collectives"
    for k in (
        "contiguous_gradients", "overlap_comm", "reduce_scatter", "reduce_bucket_size", "allgather_partitions",
        "allgather_bucket_size", "round_robin_gradients", "sub_group_size", "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
        "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
        "elastic_checkpoint", "load_from_fp32_weights", "cpu_offload",
    )
})
_OFFLOAD_IGNORED = types.MappingProxyType({
    "buffer_count": "NVMe offload tuning", "fast_init": "NVMe offload tuning",
    "ratio": "partial offload is not supported; the whole optimizer state is offloaded",
})
_FP16_IGNORED = types.MappingProxyType({
    "auto_cast": "jonebit's step casts the compute to fp16 itself",
    "fp16_master_weights_and_grads": "jonebit always keeps fp32 master weights",
})

_TOP_KEYS = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print",
    "gradient_clipping", "prescale_gradients", "wall_clock_breakdown", "optimizer", "scheduler", "fp16", "bf16",
    "bfloat16", "zero_optimization",
)


# ----------------------------------------------------------------------------------------------------------------
# Parsing


def load_config(source: str | os.PathLike | Mapping) -> DeepSpeedConfig:
    """Parses and validates a DeepSpeed config.

    Args:
      source: a path to a JSON file, or the already-loaded dict.

    Returns:
      The :class:`DeepSpeedConfig`.

    Raises:
      ConfigError: a bad key or value; the message names the key path, what was expected and what was given.
    """
    if isinstance(source, Mapping):
        raw = source
    else:
        path = os.fspath(source)
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise ConfigError("", f"config file {path!r} does not exist") from None
        except json.JSONDecodeError as e:
            raise ConfigError("", f"config file {path!r} is not valid JSON: {e}") from None
    raw = _section(raw, "(config)")
    _check_keys(raw, "", _TOP_KEYS, IGNORED_KEYS)
    if "bf16" in raw and "bfloat16" in raw:
        raise ConfigError("bfloat16", "give 'bf16' or its old name 'bfloat16', not both")

    batch = {
        name: _int(raw[name], name, minimum=1) if name in raw and raw[name] is not None else None
        for name in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    }
    train, micro, gas = batch.values()
    if train is None and micro is None:
        raise ConfigError(
            "train_batch_size",
            "give train_batch_size or train_micro_batch_size_per_gpu (DeepSpeed needs at least one of them)",
        )
    if train is not None and micro is not None and gas is not None and train % (micro * gas):
        raise ConfigError(
            "train_batch_size",
            f"train_batch_size ({train}) must be train_micro_batch_size_per_gpu ({micro}) x "
            f"gradient_accumulation_steps ({gas}) x the data-parallel size, but it is not divisible by "
            f"{micro * gas}",
        )
    if train is not None and micro is not None and train % micro:
        raise ConfigError(
            "train_batch_size", f"train_batch_size ({train}) is not divisible by train_micro_batch_size_per_gpu "
            f"({micro})",
        )

    fp16 = _parse_fp16(_section(raw.get("fp16", {}), "fp16"))
    bf16_key = "bfloat16" if "bfloat16" in raw else "bf16"
    bf16_raw = _section(raw.get(bf16_key, {}), bf16_key)
    _check_keys(bf16_raw, bf16_key, ("enabled",), {"immediate_grad_update": "a DeepSpeed memory/perf knob",
                                                   "check_grad_overflow": "bf16 does not overflow like fp16"})
    bf16 = BF16Config(enabled=_bool(bf16_raw.get("enabled", False), f"{bf16_key}.enabled"))
    if fp16.enabled and bf16.enabled:
        raise ConfigError("bf16.enabled", "fp16 and bf16 are both enabled; enable at most one of them")

    config = DeepSpeedConfig(
        **batch,
        steps_per_print=_int(raw.get("steps_per_print", 10), "steps_per_print", minimum=1),
        gradient_clipping=_float(raw.get("gradient_clipping", 0.0), "gradient_clipping", minimum=0.0),
        prescale_gradients=_bool(raw.get("prescale_gradients", False), "prescale_gradients"),
        wall_clock_breakdown=_bool(raw.get("wall_clock_breakdown", False), "wall_clock_breakdown"),
        fp16=fp16,
        bf16=bf16,
        zero_optimization=_parse_zero(_section(raw.get("zero_optimization", {}), "zero_optimization")),
    )
    # Typed (a wrong value is an error), but they change nothing here: said when they are turned on.
    for key, why in (("prescale_gradients", "dividing by the rank count before or after the sum gives the same mean"),
                     ("wall_clock_breakdown", "timings come from the training loop (seconds, tokens_per_s)")):
        if getattr(config, key):
            log.warning("DeepSpeed config key %r is accepted but ignored: %s", key, why)
    optimizer = _parse_optimizer(raw["optimizer"]) if raw.get("optimizer") is not None else None
    config = dataclasses.replace(config, optimizer=optimizer)
    if optimizer is not None:
        optimizer.options.check(config, "optimizer.params")
    scheduler = _parse_scheduler(raw["scheduler"], optimizer) if raw.get("scheduler") is not None else None
    return dataclasses.replace(config, scheduler=scheduler)


def _parse_fp16(raw: Mapping) -> FP16Config:
    fields = {
        "enabled": _bool, "loss_scale": _nonneg_float, "initial_scale_power": _nonneg_int,
        "loss_scale_window": _pos_int, "hysteresis": _pos_int, "consecutive_hysteresis": _bool,
        "min_loss_scale": _pos_float,
    }
    _check_keys(raw, "fp16", fields, _FP16_IGNORED)
    config = FP16Config(**{k: parse(raw[k], f"fp16.{k}") for k, parse in fields.items() if k in raw})
    if config.initial_scale_power > 64:
        raise ConfigError("fp16.initial_scale_power", f"expected at most 64, got {config.initial_scale_power} "
                          "(a scale of 2**64 already overflows every fp16 gradient)")
    if config.dynamic and config.min_loss_scale > config.initial_scale:
        raise ConfigError("fp16.min_loss_scale", f"min_loss_scale ({config.min_loss_scale}) is above the initial "
                          f"scale 2**{config.initial_scale_power}; lower it or raise initial_scale_power")
    return config


ZERO_STAGES = (0, 1, 2, 3)


def _parse_zero(raw: Mapping) -> ZeroConfig:
    _check_keys(raw, "zero_optimization", ("stage", "offload_optimizer", "offload_param", "zero_quantized_weights"),
                _ZERO_IGNORED)
    stage = _int(raw.get("stage", 0), "zero_optimization.stage")
    if stage not in ZERO_STAGES:
        raise ConfigError("zero_optimization.stage", f"expected 0, 1, 2 or 3, got {stage}")
    off_raw = raw.get("offload_optimizer")
    offload = OffloadConfig()
    if off_raw is not None:
        off_raw = _section(off_raw, "zero_optimization.offload_optimizer")
        _check_keys(off_raw, "zero_optimization.offload_optimizer", ("device", "pin_memory", "nvme_path"),
                    _OFFLOAD_IGNORED)
        device = _str(off_raw.get("device", "none"), "zero_optimization.offload_optimizer.device",
                      ("none", "cpu", "nvme"))
        if device == "nvme":
            raise ConfigError("zero_optimization.offload_optimizer.device",
                              "NVMe offload is not supported; use \"cpu\" (host memory) or \"none\"")
        if "nvme_path" in off_raw:
            raise ConfigError("zero_optimization.offload_optimizer.nvme_path", "NVMe offload is not supported")
        offload = OffloadConfig(device, _bool(off_raw.get("pin_memory", False),
                                              "zero_optimization.offload_optimizer.pin_memory"))
        if offload.enabled and stage == 0:
            raise ConfigError("zero_optimization.offload_optimizer.device",
                              "optimizer offload needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is 0)")
    param_raw = raw.get("offload_param")
    if param_raw is not None:
        param_raw = _section(param_raw, "zero_optimization.offload_param")
        device = param_raw.get("device", "none")
        if device != "none":
            raise ConfigError("zero_optimization.offload_param.device",
                              f"parameter offload is not supported; expected \"none\", got {device!r}")
    quantized = _bool(raw.get("zero_quantized_weights", False), "zero_optimization.zero_quantized_weights")
    if quantized and stage != 3:
        raise ConfigError("zero_optimization.zero_quantized_weights",
                          f"quantizes stage 3's parameter gather; set zero_optimization.stage to 3 (it is {stage}) "
                          "or drop the key")
    return ZeroConfig(stage, offload, quantized)


def _canonical(type_name, names: Mapping[str, str], key: str, what: str) -> str:
    """The canonical spelling of ``type_name``; ``names`` maps lower-case names (aliases too) to it."""
    if not isinstance(type_name, str):
        raise ConfigError(key, f"expected the {what} name as a string, got {_describe(type_name)}")
    norm = type_name.lower()
    if norm not in names:
        known = sorted(set(names.values()))
        raise ConfigError(key, f"unknown {what} {type_name!r}.{_suggest(type_name, known)} "
                          f"Known: {', '.join(known)} (case-insensitive)")
    return names[norm]


def _parse_optimizer(raw) -> OptimizerConfig:
    raw = _section(raw, "optimizer")
    _check_keys(raw, "optimizer", ("type", "params"))
    if "type" not in raw:
        raise ConfigError("optimizer.type", "required key is missing (e.g. \"type\": \"OneBitAdam\")")
    name = _canonical(raw["type"], {k: cls.NAME for k, cls in OPTIMIZERS.items()}, "optimizer.type", "optimizer type")
    options = OPTIMIZERS[name.lower()].parse(_section(raw.get("params", {}), "optimizer.params"), "optimizer.params")
    return OptimizerConfig(name, types.MappingProxyType(options.params()))


# Schedulers: canonical name -> (param table, builder(params, base_lr, init_steps)).


@dataclass(frozen=True)
class SchedulerSpec:
    name: str
    params: Mapping[str, Param]
    build: Callable[[dict, float | None, int], schedules.Schedule]
    ignored: Mapping[str, str] = field(default_factory=dict)


_WARMUP_PARAMS = {
    "warmup_min_lr": Param(_nonneg_float, 0.0),
    "warmup_max_lr": Param(lambda v, k: None if v is None else _nonneg_float(v, k), None),
    "warmup_num_steps": Param(_pos_int, 1000),
    "warmup_type": Param(_warmup_type, "log"),
}


def _max_lr(params: dict, base_lr: float | None, default: float | None) -> float:
    if params["warmup_max_lr"] is not None:
        return params["warmup_max_lr"]
    if default is not None:
        return default
    if base_lr is None:
        raise ConfigError("scheduler.params.warmup_max_lr", "not given and there is no optimizer.params.lr to take "
                          "it from; give warmup_max_lr")
    return base_lr


def _needs_lr(base_lr, name: str) -> float:
    if base_lr is None:
        raise ConfigError("optimizer", f"the {name} scheduler scales the optimizer's lr; add an optimizer section")
    return base_lr


_MOMENTUM_IGNORED = {
    k: "jonebit keeps the optimizer's betas constant (OneCycle's momentum cycle is not applied)"
    for k in ("cycle_momentum", "cycle_min_mom", "cycle_max_mom", "decay_mom_rate")
}

SCHEDULERS: Mapping[str, SchedulerSpec] = types.MappingProxyType({
    "warmuplr": SchedulerSpec(
        "WarmupLR", _WARMUP_PARAMS,
        # WarmupLR defaults warmup_max_lr to the optimizer's lr.
        lambda p, lr, n: schedules.warmup_lr(p["warmup_min_lr"], _max_lr(p, lr, None), p["warmup_num_steps"],
                                             p["warmup_type"], init_steps=n),
    ),
    "warmupdecaylr": SchedulerSpec(
        "WarmupDecayLR", {"total_num_steps": Param(_pos_int), **_WARMUP_PARAMS},
        # WarmupDecayLR's own default for warmup_max_lr is 0.001 (not the optimizer's lr).
        lambda p, lr, n: schedules.warmup_decay_lr(p["total_num_steps"], p["warmup_min_lr"], _max_lr(p, lr, 0.001),
                                                   p["warmup_num_steps"], p["warmup_type"], init_steps=n),
    ),
    "warmupcosinelr": SchedulerSpec(
        "WarmupCosineLR",
        {
            "total_num_steps": Param(_pos_int),
            "warmup_min_ratio": Param(_nonneg_float, 0.0),
            "warmup_num_steps": Param(_pos_int, 1000),
            "cos_min_ratio": Param(_nonneg_float, 0.0001),
            "warmup_type": Param(_warmup_type, "log"),
        },
        lambda p, lr, n: schedules.warmup_cosine_lr(_needs_lr(lr, "WarmupCosineLR"), init_steps=n, **p),
    ),
    "onecycle": SchedulerSpec(
        "OneCycle",
        {
            "cycle_min_lr": Param(_nonneg_float),
            "cycle_max_lr": Param(_nonneg_float),
            "decay_lr_rate": Param(_nonneg_float, 0.0),
            "cycle_first_step_size": Param(_pos_int, 2000),
            "cycle_second_step_size": Param(_opt_pos_int, None),
            "cycle_first_stair_count": Param(_nonneg_int, 0),
            "cycle_second_stair_count": Param(lambda v, k: None if v is None else _nonneg_int(v, k), None),
            "decay_step_size": Param(_nonneg_int, 0),
        },
        lambda p, lr, n: schedules.one_cycle(init_steps=n, **p),
        ignored=_MOMENTUM_IGNORED,
    ),
    "lrrangetest": SchedulerSpec(
        "LRRangeTest",
        {
            "lr_range_test_min_lr": Param(_nonneg_float, 1e-3),
            "lr_range_test_step_size": Param(_pos_int, 2000),
            "lr_range_test_step_rate": Param(_nonneg_float, 1.0),
            "lr_range_test_staircase": Param(_bool, False),
        },
        lambda p, lr, n: schedules.lr_range_test(init_steps=n, **p),
    ),
    # bing_bert's schedule (DeepSpeedExamples computes it in the training script); jonebit's extension of the
    # config format. The peak learning rate is the optimizer's lr.
    "warmuplineardecayexp": SchedulerSpec(
        "WarmupLinearDecayExp",
        {
            "total_training_steps": Param(_pos_int),
            "warmup_proportion": Param(lambda v, k: _float(v, k, minimum=0.0), 0.002),
            "decay_rate": Param(_pos_float, 0.99),
            "decay_step": Param(_pos_int, 1000),
        },
        lambda p, lr, n: schedules.warmup_linear_decay_exp(_needs_lr(lr, "WarmupLinearDecayExp"), init_steps=n, **p),
    ),
})
_SCHEDULER_ALIASES = {"warmup_linear_decay_exp": "warmuplineardecayexp"}


def _parse_scheduler(raw, optimizer: OptimizerConfig | None) -> SchedulerConfig:
    raw = _section(raw, "scheduler")
    _check_keys(raw, "scheduler", ("type", "params"))
    if "type" not in raw:
        raise ConfigError("scheduler.type", "required key is missing (e.g. \"type\": \"WarmupLR\")")
    type_name = raw["type"]
    if isinstance(type_name, str):
        type_name = _SCHEDULER_ALIASES.get(type_name.lower(), type_name)
    name = _canonical(type_name, {k: v.name for k, v in SCHEDULERS.items()}, "scheduler.type", "scheduler type")
    spec = SCHEDULERS[name.lower()]
    params = _parse_params(_section(raw.get("params", {}), "scheduler.params"), "scheduler.params", spec.params,
                           spec.ignored)
    if name == "WarmupLinearDecayExp" and params["warmup_proportion"] > 1:
        raise ConfigError("scheduler.params.warmup_proportion",
                          f"expected a fraction in [0, 1], got {params['warmup_proportion']}")
    if name == "OneCycle" and params["cycle_max_lr"] < params["cycle_min_lr"]:
        raise ConfigError("scheduler.params.cycle_max_lr", f"cycle_max_lr ({params['cycle_max_lr']}) is below "
                          f"cycle_min_lr ({params['cycle_min_lr']})")
    if name == "OneCycle" and raw.get("params", {}).get("cycle_momentum", True):
        log.warning("scheduler OneCycle: DeepSpeed would also cycle Adam's beta1 (cycle_momentum defaults to true); "
                    "jonebit keeps the optimizer's betas constant")
    config = SchedulerConfig(name, types.MappingProxyType(params))
    # Fail now, not at the first step, when the schedule cannot be built (e.g. no lr to scale).
    build_schedule(config, optimizer)
    return config


# ----------------------------------------------------------------------------------------------------------------
# Builders


def build_schedule(
    scheduler: SchedulerConfig | None, optimizer: OptimizerConfig | None, *, init_steps: int | None = None
) -> schedules.Schedule | float:
    """The learning rate as an optax schedule (or the constant ``optimizer.params.lr`` without a scheduler).

    Args:
      scheduler: the config's ``scheduler`` section, or ``None``.
      optimizer: the config's ``optimizer`` section (its ``lr`` is the base of some schedules).
      init_steps: engine steps DeepSpeed spends before the first real update; default: the optimizer's (1 for
        1-bit Adam, else 0). See :mod:`jonebit.train.schedules` for the step convention.
    """
    base_lr = optimizer.params["lr"] if optimizer is not None else None
    if scheduler is None:
        if base_lr is None:
            raise ConfigError("optimizer", "no optimizer and no scheduler: there is no learning rate")
        return base_lr
    if init_steps is None:
        init_steps = optimizer.spec.INIT_STEPS if optimizer is not None else 0
    spec = SCHEDULERS[scheduler.type.lower()]
    try:
        return spec.build(dict(scheduler.params), base_lr, init_steps)
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError("scheduler.params", str(e)) from None


def build_optimizer(
    config: DeepSpeedConfig,
    *,
    axis_name: str = "data",
    mpi_comm: Any = None,
    exp_avg_mask: Any = None,
    fused: bool | None = None,
    zero_stage: int | None = None,
    clip: bool = True,
) -> optax.GradientTransformation:
    """The config's optimizer, learning-rate schedule and gradient clipping as one optax transformation.

    Args:
      config: from :func:`load_config`; must have an ``optimizer`` section.
      axis_name: the ``shard_map`` axis of the data-parallel ranks (1-bit Adam with ``comm_backend_name: "nccl"``).
      mpi_comm: an mpi4py communicator for ``comm_backend_name: "mpi"`` (default ``MPI.COMM_WORLD``, imported only
        then).
      exp_avg_mask: 1-bit Adam's momentum mask (DeepSpeed sets it in the training script, not in the config).
      fused: 1-bit Adam: compress all leaves as one buffer. Default: DeepSpeed's choice, ``True`` with fp16
        (its fp16 optimizer flattens the parameters) and ``False`` otherwise (one compression per tensor), and
        ``False`` with ``row_scales``.
      zero_stage: 1-bit Adam's ZeRO stage (default ``zero_optimization.stage``). Other optimizers are
        partitioned by the step builder (:func:`jonebit.train.zero.init_zero`), not here.
      clip: apply ``gradient_clipping`` when it is > 0 (also an Adam/Lamb ``max_grad_norm``; the smaller bound
        wins): ``optax.clip_by_global_norm`` first in the chain; for 1-bit Adam at ZeRO stage 0 its
        ``max_grad_norm``, which clips the averaged gradient during warmup and each rank's local gradient in the
        compression stage, where DeepSpeed's engine clips. In front of the other 1-bit optimizers (and 1-bit Adam
        under ZeRO) the chained clip sees each rank's local gradient in both stages.

    Returns:
      ``optax.GradientTransformation``; for 1-bit Adam its ``update`` expects this rank's local gradient.

    ``freeze_step``: DeepSpeed's ``freeze_step=F`` gives ``F - 1`` Adam updates (its first ``step()`` only
    initialises), so ``onebit_adam`` gets ``freeze_step=F - 1``; the schedule is shifted by the same step.
    """
    if config.optimizer is None:
        raise ConfigError("optimizer", "the config has no optimizer section; add one, e.g. {\"type\": \"AdamW\", "
                          "\"params\": {\"lr\": 1e-4}}")
    opt = config.optimizer
    spec, params = opt.spec, opt.params
    if fused is None:  # DeepSpeed's choice, but row scales need one compression per tensor
        fused = config.fp16.enabled and not (spec is OneBitAdam and params["row_scales"])
    options = {
        "axis_name": axis_name, "mpi_comm": mpi_comm, "exp_avg_mask": exp_avg_mask,
        "fused": fused,
        "zero_stage": config.zero_optimization.stage if zero_stage is None else zero_stage,
    }
    # 1-bit Adam at stage 0 clips inside: the averaged gradient in warmup, the local one after (DeepSpeed's places).
    inner_clip = clip and spec is OneBitAdam and options["zero_stage"] == 0 and config.gradient_clipping > 0
    if inner_clip:
        options["max_grad_norm"] = config.gradient_clipping
    learning_rate = build_schedule(config.scheduler, opt, init_steps=spec.INIT_STEPS)
    tx = opt.options.build(learning_rate, options)
    max_grad_norm = params.get("max_grad_norm", 0.0) if spec.MAX_GRAD_NORM_CLIPS else 0.0
    bounds = [b for b in (config.gradient_clipping, max_grad_norm) if b > 0]
    if clip and bounds and not inner_clip:
        tx = optax.chain(optax.clip_by_global_norm(min(bounds)), tx)
    return tx


def _describe_clipping(config: DeepSpeedConfig) -> str:
    """The clipping build_optimizer applies: the bound, its source and where it acts."""
    opt = config.optimizer
    if opt is None:
        if config.gradient_clipping > 0:
            return (f"gradient clipping: {config.gradient_clipping:g} (gradient_clipping; not applied: there is no "
                    "optimizer section, bring your own optax transformation)")
        return "gradient clipping: off\noptimizer: none (bring your own optax transformation)"
    given = opt.params.get("max_grad_norm", 0.0)
    max_grad_norm = given if opt.spec.MAX_GRAD_NORM_CLIPS else 0.0
    bounds = {k: v for k, v in (("gradient_clipping", config.gradient_clipping),
                                ("optimizer.params.max_grad_norm", max_grad_norm)) if v > 0}
    ignored = (f"; optimizer.params.max_grad_norm={given:g} is ignored by {opt.type}, as in DeepSpeed"
               if given and not opt.spec.MAX_GRAD_NORM_CLIPS else "")
    if not bounds:
        return "gradient clipping: off" + ignored
    bound = min(bounds.values())
    source = " and ".join(bounds) + (", the smaller wins" if len(bounds) > 1 else "")
    if opt.spec is OneBitAdam and config.zero_optimization.stage == 0:
        where = ("inside 1-bit Adam: the averaged gradient during warmup, each rank's local gradient in the "
                 "compression stage")
    elif opt.type in ONEBIT_OPTIMIZERS:
        where = "optax.clip_by_global_norm before the optimizer, on each rank's local gradient"
    else:
        where = "optax.clip_by_global_norm on the averaged gradient, before the optimizer"
    return f"gradient clipping: global norm <= {bound:g} (from {source}); {where}{ignored}"


def describe(config: DeepSpeedConfig, dp_size: int, *, steps=None) -> str:
    """A human-readable summary of the resolved config (what ``jonebit config`` prints)."""
    b = config.batch_sizes(dp_size)
    lines = [
        f"batch: train_batch_size {b.train_batch_size} = micro {b.train_micro_batch_size_per_gpu} x accumulation "
        f"{b.gradient_accumulation_steps} x data-parallel {b.dp_size}",
        f"precision: {config.precision}",
    ]
    if config.fp16.enabled:
        f = config.fp16
        lines.append(
            f"  loss scale: dynamic from 2**{f.initial_scale_power}, window {f.loss_scale_window}, hysteresis "
            f"{f.hysteresis}, min {f.min_loss_scale:g}" if f.dynamic else f"  loss scale: static {f.loss_scale:g}"
        )
    z = config.zero_optimization
    lines.append(f"zero: stage {z.stage}" + (", optimizer offloaded to host memory" if z.offload_optimizer.enabled
                                              else ""))
    lines.append(_describe_clipping(config))
    if config.optimizer is None:
        return "\n".join(lines)
    opt = config.optimizer
    # max_grad_norm is on the clipping line, as applied (the 1-bit optimizers accept and ignore it).
    lines.append(f"optimizer: {opt.type} " + ", ".join(f"{k}={_jsonable(v)}" for k, v in opt.params.items()
                                                       if k != "max_grad_norm"))
    mapping = opt.options.describe()
    if mapping:
        lines.append(mapping)
    if opt.spec is OneBitAdam:  # build_optimizer's default for `fused`
        if config.fp16.enabled and not opt.params["row_scales"]:
            lines.append("  compression: fused, all parameters in one flat buffer (fp16: DeepSpeed's fp16 optimizer "
                         "flattens them)")
        else:
            why = "row_scales needs one per tensor" if opt.params["row_scales"] else "fp16 off; fp16 fuses"
            lines.append(f"  compression: per tensor, one compressed allreduce per parameter ({why})")
    sched = build_schedule(config.scheduler, opt)
    name = config.scheduler.type if config.scheduler else "constant"
    lines.append(f"schedule: {name}" + (" " + ", ".join(f"{k}={v}" for k, v in config.scheduler.params.items())
                                        if config.scheduler else ""))
    if steps is None:
        steps = [0, 1, 2, 10, 100, 1000, 10000, 100000]
    lines.append("  (update 0 is the optimizer's first update" + (
        "; DeepSpeed's initialisation step of the 1-bit optimizer is accounted for)" if opt.spec.INIT_STEPS else ")"))
    for s in steps:
        lr = sched(s) if callable(sched) else sched
        lines.append(f"  update {s:>7d}: lr {float(lr):.6g}")
    return "\n".join(lines)
