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

Types are matched case-insensitively, as DeepSpeed does. ``gradient_clipping > 0`` puts
``optax.clip_by_global_norm`` first in the chain (see :func:`build_optimizer` for what it clips with the 1-bit
optimizers).

``freeze_step: "auto"`` (OneBitAdam, OneBitLamb; jonebit only, ZeRO stage 0): the optimizer decides the freeze
point by :class:`jonebit.AutoFreeze`, whose fields an optional ``auto_freeze`` object sets (``min_step``,
``max_step``, ``check_every``, ``threshold``, ``patience``, ``statistic``; update counts as jonebit counts them).
Elsewhere ``"auto"`` is the HuggingFace Trainer's placeholder and is refused with a hint to give the number.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import os
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jonebit.train import schedules

log = logging.getLogger(__name__)

_MISSING = object()


class ConfigError(ValueError):
    """A DeepSpeed config jonebit cannot honour; ``key`` is the dotted path of the offending key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _suggest(key: str, known) -> str:
    """`` Did you mean 'x'?`` for the closest known key (ignoring case, ``_`` and ``-``), or ``""``."""

    def norm(k):
        return k.lower().replace("_", "").replace("-", "")

    by_norm = {norm(k): k for k in known}
    close = difflib.get_close_matches(norm(key), list(by_norm), n=1, cutoff=0.6)
    return f" Did you mean {by_norm[close[0]]!r}?" if close else ""


def _check_keys(section: Mapping, path: str, known, ignored: Mapping[str, str] = types.MappingProxyType({})) -> None:
    """Errors on unknown keys; logs the ignored ones."""
    for key in section:
        if key in known:
            continue
        if key in ignored:
            log.warning("DeepSpeed config key %r is accepted but ignored: %s", _join(path, key), ignored[key])
            continue
        where = f"in {path!r}" if path else "at the top level"
        raise ConfigError(
            _join(path, key),
            f"unknown key {where}.{_suggest(key, [*known, *ignored])} Known keys: {', '.join(sorted(known))}"
            + (f"; accepted and ignored: {', '.join(sorted(ignored))}" if ignored else ""),
        )


def _describe(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def _auto_hint(value) -> str:
    if isinstance(value, str) and value == "auto":
        return " ('auto' is filled in by the HuggingFace Trainer's DeepSpeed integration; give the number)"
    return ""


def _int(value, key: str, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # JSON writers sometimes emit 16.0
        else:
            raise ConfigError(key, f"expected an integer, got {_describe(value)}{_auto_hint(value)}")
    if minimum is not None and value < minimum:
        raise ConfigError(key, f"expected an integer >= {minimum}, got {value}")
    return value


def _float(value, key: str, *, minimum: float | None = None, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(key, f"expected a number, got {_describe(value)}{_auto_hint(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise ConfigError(key, f"expected a finite number, got {value}")
    if positive and value <= 0:
        raise ConfigError(key, f"expected a number > 0, got {value}")
    if minimum is not None and value < minimum:
        raise ConfigError(key, f"expected a number >= {minimum}, got {value}")
    return value


def _bool(value, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, f"expected true or false, got {_describe(value)}{_auto_hint(value)}")
    return value


def _str(value, key: str, choices=None) -> str:
    if not isinstance(value, str):
        raise ConfigError(key, f"expected a string, got {_describe(value)}")
    if choices is not None and value not in choices:
        raise ConfigError(key, f"expected one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def _betas(value, key: str) -> tuple[float, float]:
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ConfigError(key, f"expected a list of two numbers [beta1, beta2], got {_describe(value)}")
    out = tuple(_float(b, f"{key}[{i}]", minimum=0.0) for i, b in enumerate(value))
    for i, b in enumerate(out):
        if b >= 1.0:
            raise ConfigError(f"{key}[{i}]", f"expected a number in [0, 1), got {b}")
    return out


def _section(value, key: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"expected an object {{...}}, got {_describe(value)}")
    return value


# ----------------------------------------------------------------------------------------------------------------
# Parameter tables: name -> (parser, default). A parser takes (value, key path) and returns the checked value.


@dataclass(frozen=True)
class Param:
    parse: Callable[[Any, str], Any]
    default: Any = _MISSING  # _MISSING: required


def _nonneg_float(v, k):
    return _float(v, k, minimum=0.0)


def _pos_float(v, k):
    return _float(v, k, positive=True)


def _opt_pos_float(v, k):
    """A number > 0, or null (off)."""
    return None if v is None else _pos_float(v, k)


def _pos_int(v, k):
    return _int(v, k, minimum=1)


def _freeze_step(v, k):
    """DeepSpeed's ``freeze_step`` (an int), or jonebit's ``"auto"`` (switch when the variance has settled)."""
    if isinstance(v, str) and v == "auto":
        return v
    if isinstance(v, str):
        raise ConfigError(k, f"expected an integer or \"auto\", got {_describe(v)}")
    return _int(v, k, minimum=1)


_AUTO_FREEZE_KEYS = ("min_step", "max_step", "check_every", "threshold", "patience", "statistic")


def _statistic(v, k):
    from jonebit.transforms.base import AUTO_STATISTICS

    if v not in AUTO_STATISTICS:
        raise ConfigError(k, f"must be one of {', '.join(repr(x) for x in AUTO_STATISTICS)}, got {v!r}")
    return v


def _auto_freeze(v, k):
    """jonebit's ``auto_freeze`` rule for ``freeze_step: "auto"`` (the fields of :class:`jonebit.AutoFreeze`)."""
    if v is None:
        return None
    v = _section(v, k)
    unknown = [name for name in v if name not in _AUTO_FREEZE_KEYS]
    if unknown:
        raise ConfigError(_join(k, str(unknown[0])), f"unknown key; auto_freeze takes {', '.join(_AUTO_FREEZE_KEYS)}")
    out = {}
    for name in _AUTO_FREEZE_KEYS:
        if name in v:
            key = _join(k, name)
            if name == "statistic":
                out[name] = _statistic(v[name], key)
            elif name == "threshold":
                out[name] = _float(v[name], key, positive=True)
            else:
                out[name] = _int(v[name], key, minimum=1)
    from jonebit.transforms.base import AutoFreeze

    rule = AutoFreeze(**out)
    if rule.max_step < rule.min_step:
        raise ConfigError(_join(k, "max_step"), f"max_step ({rule.max_step}) must be >= min_step ({rule.min_step})")
    return out


def _nonneg_int(v, k):
    return _int(v, k, minimum=0)


def _opt_pos_int(v, k):
    return None if v is None else _int(v, k, minimum=1)


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


_BETAS = Param(_betas, (0.9, 0.999))

_ADAM_PARAMS = {
    "lr": Param(_nonneg_float, 1e-3),
    "betas": _BETAS,
    "eps": Param(_pos_float, 1e-8),
    "weight_decay": Param(_nonneg_float, 0.0),
    "bias_correction": Param(_bool, True),
    "adam_w_mode": Param(_bool, True),
    "amsgrad": Param(_bool, False),
    # Not a parameter of DeepSpeed's FusedAdam today, but of apex's FusedAdam that DeepSpeed's BERT fine-tuning
    # tutorial config still passes: global-norm clipping before the update.
    "max_grad_norm": Param(_nonneg_float, 0.0),
}
_ADAM_IGNORED = {"torch_adam": "torch.optim.Adam(W) and FusedAdam compute the same update"}

_LAMB_PARAMS = {
    "lr": Param(_nonneg_float, 1e-3),
    "betas": _BETAS,
    "eps": Param(_pos_float, 1e-8),
    "eps_inside_sqrt": Param(_bool, False),
    "weight_decay": Param(_nonneg_float, 0.0),
    "bias_correction": Param(_bool, True),
    "max_grad_norm": Param(_nonneg_float, 0.0),
    "max_coeff": Param(_pos_float, 10.0),
    "min_coeff": Param(_nonneg_float, 0.01),
    "amsgrad": Param(_bool, False),
}

COMM_BACKENDS = ("nccl", "mpi")

_ONEBIT_ADAM_PARAMS = {
    "lr": Param(_nonneg_float, 1e-3),
    "freeze_step": Param(_freeze_step, 100000),
    "auto_freeze": Param(_auto_freeze, None),  # jonebit only: the rule of freeze_step "auto"
    "mask_unseen": Param(_bool, True),  # jonebit only: false is DeepSpeed's arithmetic for never-seen elements
    "row_scales": Param(_bool, False),  # jonebit only: one compression scale per row of each matrix
    "preconditioned": Param(_bool, False),  # jonebit only: compress m / (sqrt(v) + eps) instead of m
    "clip_ratio": Param(_opt_pos_float, None),  # jonebit only: bound on |m| / sqrt(v) after the freeze
    "variance_refresh": Param(_opt_pos_int, None),  # jonebit only: an exact step refreshing v every K updates
    "local_clip": Param(_bool, False),  # jonebit only: gradient_clipping on each rank's gradient in warmup too
    "betas": _BETAS,
    "eps": Param(_pos_float, 1e-8),
    "weight_decay": Param(_nonneg_float, 0.0),
    "bias_correction": Param(_bool, True),
    "eps_inside_sqrt": Param(_bool, False),
    "max_grad_norm": Param(_nonneg_float, 0.0),
    "amsgrad": Param(_bool, False),
    "cuda_aware": Param(_bool, False),
    "comm_backend_name": Param(lambda v, k: _str(v, k, COMM_BACKENDS), "nccl"),
}

# DeepSpeed's ZeroOneAdam and OnebitLamb take 1-bit Adam's common params (bias_correction is accepted and ignored by
# both, so it defaults to false here) plus their schedules.
_ONEBIT_COMMON = {k: v for k, v in _ONEBIT_ADAM_PARAMS.items()
                  if k not in ("freeze_step", "auto_freeze", "row_scales", "preconditioned", "clip_ratio",
                               "variance_refresh", "local_clip")} | {
    "bias_correction": Param(_bool, False),
}
_ZERO_ONE_ADAM_PARAMS = _ONEBIT_COMMON | {
    "var_freeze_step": Param(_pos_int, 100000),
    "var_update_scaler": Param(_pos_int, 16),
    "local_step_scaler": Param(_pos_int, 32678),
    "local_step_clipper": Param(_pos_int, 16),
}
_ONEBIT_LAMB_PARAMS = _ONEBIT_COMMON | {
    "freeze_step": Param(_freeze_step, 100000),
    "auto_freeze": Param(_auto_freeze, None),
    "max_coeff": Param(_pos_float, 10.0),
    "min_coeff": Param(_nonneg_float, 0.01),
    "coeff_beta": Param(_nonneg_float, 0.9),
    "factor_max": Param(_pos_float, 4.0),
    "factor_min": Param(_nonneg_float, 0.5),
    "factor_threshold": Param(_nonneg_float, 0.1),
}


@dataclass(frozen=True)
class OptimizerSpec:
    """One row of :data:`OPTIMIZERS`.

    Attributes:
      name: DeepSpeed's spelling of the type.
      params: the accepted ``optimizer.params`` with parsers and DeepSpeed's defaults.
      build: ``build(params, learning_rate, options) -> GradientTransformation``; ``None``: not available yet.
      init_steps: engine steps DeepSpeed spends before the first real update (1-bit Adam: 1).
      check: extra validation of the parsed params and the whole config.
      unavailable: the reason given when ``build`` is ``None``.
      ignored: params accepted with a warning.
      max_grad_norm_clips: its ``max_grad_norm`` param clips the global gradient norm (DeepSpeed's 1-bit Adam
        accepts the param but ignores it).
    """

    name: str
    params: Mapping[str, Param]
    build: Callable[..., optax.GradientTransformation] | None
    init_steps: int = 0
    check: Callable[[dict, DeepSpeedConfig, str], None] | None = None
    unavailable: str = ""
    ignored: Mapping[str, str] = field(default_factory=dict)
    max_grad_norm_clips: bool = True


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
    """``zero_optimization``: the ZeRO ``stage`` (0-3) and optimizer offload."""

    stage: int = 0
    offload_optimizer: OffloadConfig = OffloadConfig()


@dataclass(frozen=True)
class OptimizerConfig:
    """``optimizer``: ``type`` in DeepSpeed's canonical spelling, ``params`` with every default filled in."""

    type: str
    params: Mapping[str, Any]

    @property
    def spec(self) -> OptimizerSpec:
        return OPTIMIZERS[self.type.lower()]


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
    optimizer = _parse_optimizer(raw["optimizer"]) if raw.get("optimizer") is not None else None
    config = dataclasses.replace(config, optimizer=optimizer)
    if optimizer is not None and optimizer.spec.check is not None:
        optimizer.spec.check(dict(optimizer.params), config, "optimizer.params")
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
    _check_keys(raw, "zero_optimization", ("stage", "offload_optimizer", "offload_param"), _ZERO_IGNORED)
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
    return ZeroConfig(stage, offload)


def _canonical(type_name, table: Mapping[str, Any], key: str, what: str) -> str:
    if not isinstance(type_name, str):
        raise ConfigError(key, f"expected the {what} name as a string, got {_describe(type_name)}")
    norm = type_name.lower()
    if norm not in table:
        names = sorted({v.name for v in table.values()})
        raise ConfigError(key, f"unknown {what} {type_name!r}.{_suggest(type_name, names)} "
                          f"Known: {', '.join(names)} (case-insensitive)")
    return table[norm].name


def _parse_optimizer(raw) -> OptimizerConfig:
    raw = _section(raw, "optimizer")
    _check_keys(raw, "optimizer", ("type", "params"))
    if "type" not in raw:
        raise ConfigError("optimizer.type", "required key is missing (e.g. \"type\": \"OneBitAdam\")")
    name = _canonical(raw["type"], OPTIMIZERS, "optimizer.type", "optimizer type")
    spec = OPTIMIZERS[name.lower()]
    if spec.build is None:
        raise ConfigError("optimizer.type", f"{raw['type']!r} is not available in jonebit yet ({spec.unavailable}); "
                          "use OneBitAdam, ZeroOneAdam, OneBitLamb, Adam, AdamW or Lamb")
    params = _parse_params(_section(raw.get("params", {}), "optimizer.params"), "optimizer.params", spec.params,
                           spec.ignored)
    if params.get("amsgrad"):
        raise ConfigError("optimizer.params.amsgrad", f"{name} does not support AMSGrad (DeepSpeed refuses it too); "
                          "remove it or set it to false")
    return OptimizerConfig(name, types.MappingProxyType(params))


def _check_auto_freeze(params: dict, config: DeepSpeedConfig, path: str, name: str) -> None:
    if params["auto_freeze"] is not None and params["freeze_step"] != "auto":
        raise ConfigError(f"{path}.auto_freeze", f"applies to \"freeze_step\": \"auto\" only, got freeze_step "
                          f"{params['freeze_step']!r}; set freeze_step to \"auto\" or drop auto_freeze")
    if params["freeze_step"] == "auto" and config.zero_optimization.stage:
        raise ConfigError(f"{path}.freeze_step", f"\"auto\" is available at ZeRO stage 0 only, got "
                          f"zero_optimization.stage = {config.zero_optimization.stage}; give {name} an integer "
                          "freeze_step, or set zero_optimization.stage to 0")


def _check_onebit_adam(params: dict, config: DeepSpeedConfig, path: str) -> None:
    _check_auto_freeze(params, config, path, "OneBitAdam")
    if params["freeze_step"] != "auto" and params["freeze_step"] < 2:
        raise ConfigError(f"{path}.freeze_step", f"expected >= 2, got {params['freeze_step']}: DeepSpeed's "
                          "freeze_step=F gives F - 1 full-precision Adam updates before compression, and 1-bit Adam "
                          "needs at least one to estimate the variance (use 15-25% of the training steps)")
    if params["comm_backend_name"] == "mpi" and config.zero_optimization.stage:
        raise ConfigError(f"{path}.comm_backend_name", "1-bit Adam under ZeRO (zero_optimization.stage = "
                          f"{config.zero_optimization.stage}) runs over jax collectives only; use \"nccl\" or stage 0")
    if params["comm_backend_name"] == "mpi" and config.zero_optimization.offload_optimizer.enabled:
        raise ConfigError(f"{path}.comm_backend_name", "the MPI path does not offload the optimizer state")


def _check_onebit_family(name: str):
    """Checks shared by ZeroOneAdam and OneBitLamb: ZeRO stage 0 only, and their freeze points."""

    def check(params: dict, config: DeepSpeedConfig, path: str) -> None:
        if config.zero_optimization.stage:
            raise ConfigError("zero_optimization.stage", f"{name} runs at ZeRO stage 0 only (its moments, and for 0/1 "
                              f"Adam the parameters during local steps, are whole on every rank); got stage "
                              f"{config.zero_optimization.stage}. Set zero_optimization.stage to 0, or use OneBitAdam "
                              "for stages 1-3")
        if name == "OneBitLamb":
            _check_auto_freeze(params, config, path, name)
        if name == "OneBitLamb" and params["freeze_step"] != "auto" and params["freeze_step"] < 2:
            raise ConfigError(f"{path}.freeze_step", f"expected >= 2, got {params['freeze_step']}: DeepSpeed's "
                              "freeze_step=F gives F - 1 full-precision LAMB updates before compression, and 1-bit "
                              "LAMB needs at least one to estimate the variance and the trust-ratio coefficients")
        if name == "OneBitLamb" and params["min_coeff"] > params["max_coeff"]:
            raise ConfigError(f"{path}.max_coeff", f"max_coeff ({params['max_coeff']}) is below min_coeff "
                              f"({params['min_coeff']})")
        if name == "OneBitLamb" and params["factor_min"] > params["factor_max"]:
            raise ConfigError(f"{path}.factor_max", f"factor_max ({params['factor_max']}) is below factor_min "
                              f"({params['factor_min']})")
        for key in ("coeff_beta", "factor_threshold"):
            if key in params and params[key] >= 1:
                raise ConfigError(f"{path}.{key}", f"expected a fraction in [0, 1), got {params[key]}")

    return check


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
    name = _canonical(type_name, SCHEDULERS, "scheduler.type", "scheduler type")
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
        init_steps = optimizer.spec.init_steps if optimizer is not None else 0
    spec = SCHEDULERS[scheduler.type.lower()]
    try:
        return spec.build(dict(scheduler.params), base_lr, init_steps)
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError("scheduler.params", str(e)) from None


def _adam_moments(b1: float, b2: float, eps: float, eps_root: float, bias_correction: bool):
    """Adam's scaling; without bias correction (DeepSpeed's ``bias_correction: false``) ``m / (sqrt(v) + eps)``."""
    if bias_correction:
        return optax.scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root)

    def init_fn(params):
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros, nu=jax.tree.map(jnp.copy, zeros))

    def update_fn(updates, state, params=None):
        del params
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g), state.nu, updates)
        out = jax.tree.map(lambda m, v, g: (m / (jnp.sqrt(v + eps_root) + eps)).astype(g.dtype), mu, nu, updates)
        return out, optax.ScaleByAdamState(count=optax.safe_increment(state.count), mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)


def _clamped_trust_ratio(min_coeff: float, max_coeff: float) -> optax.GradientTransformation:
    """LAMB's per-tensor ``||p|| / ||u||`` clamped to ``[min_coeff, max_coeff]`` (1 if either norm is 0)."""

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("Lamb needs params: call update(grads, state, params)")

        def scale(u, p):
            pn, un = jnp.linalg.norm(p.astype(jnp.float32)), jnp.linalg.norm(u.astype(jnp.float32))
            ratio = jnp.where((pn > 0) & (un > 0), jnp.clip(pn / jnp.where(un > 0, un, 1.0), min_coeff, max_coeff), 1.0)
            return (u * ratio).astype(u.dtype)

        return jax.tree.map(scale, updates, params), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def _build_adam(params: dict, learning_rate, options: dict, *, decoupled_default: bool) -> optax.GradientTransformation:
    b1, b2 = params["betas"]
    decoupled = decoupled_default or params["adam_w_mode"]
    moments = _adam_moments(b1, b2, params["eps"], 0.0, params["bias_correction"])
    wd = params["weight_decay"]
    if decoupled:  # FusedAdam adam_w_mode: p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)
        parts = [moments, optax.add_decayed_weights(wd)] if wd else [moments]
    else:  # L2: the decay joins the gradient before the moments
        parts = [optax.add_decayed_weights(wd), moments] if wd else [moments]
    return optax.chain(*parts, optax.scale_by_learning_rate(learning_rate))


def _build_lamb(params: dict, learning_rate, options: dict) -> optax.GradientTransformation:
    b1, b2 = params["betas"]
    eps, eps_root = (0.0, params["eps"]) if params["eps_inside_sqrt"] else (params["eps"], 0.0)
    parts = [_adam_moments(b1, b2, eps, eps_root, params["bias_correction"])]
    if params["weight_decay"]:
        parts.append(optax.add_decayed_weights(params["weight_decay"]))
    parts += [_clamped_trust_ratio(params["min_coeff"], params["max_coeff"]),
              optax.scale_by_learning_rate(learning_rate)]
    return optax.chain(*parts)


def _apply_cuda_aware(cuda_aware: bool) -> None:
    """Maps DeepSpeed's ``cuda_aware`` to mpi4jax's ``MPI4JAX_USE_CUDA_MPI``.

    ``true``: MPI gets GPU buffers directly (needs an MPI built with CUDA support and mpi4jax's CUDA bridge).
    ``false``: mpi4jax copies each buffer to host memory and back around every collective (what DeepSpeed does with
    ``cuda_aware: false``), without mpi4jax's warning. CPU runs are unaffected. mpi4jax reads the variable once, when
    it compiles its first collective for a GPU, so build the optimizer before compiling any mpi4jax program. The
    variable is set when unset; an environment setting that disagrees wins over ``false`` and is overridden by
    ``true``, with a warning either way.
    """
    env = os.environ.get("MPI4JAX_USE_CUDA_MPI")
    want = "1" if cuda_aware else "0"
    truthy = env is not None and env.lower() in ("true", "1", "on")
    if env is None:
        os.environ["MPI4JAX_USE_CUDA_MPI"] = want
    elif cuda_aware and not truthy:
        log.warning("optimizer.params.cuda_aware is true: overriding MPI4JAX_USE_CUDA_MPI=%s with 1", env)
        os.environ["MPI4JAX_USE_CUDA_MPI"] = "1"
    elif not cuda_aware and truthy:
        log.warning("optimizer.params.cuda_aware is false but MPI4JAX_USE_CUDA_MPI=%s is set: keeping the "
                    "environment's CUDA-aware MPI", env)


RESEARCH_KEYS = ("row_scales", "preconditioned", "clip_ratio", "variance_refresh", "local_clip")


def _build_onebit_adam(params: dict, learning_rate, options: dict) -> optax.GradientTransformation:
    from jonebit.experimental import OneBitAdamOptions
    from jonebit.transforms.onebit_adam import onebit_adam
    from jonebit.transforms.onebit_adam_zero import onebit_adam_zero

    if params["eps_inside_sqrt"]:
        log.warning("optimizer.params.eps_inside_sqrt: ignored, as DeepSpeed's 1-bit Adam does (eps is added to "
                    "sqrt(v))")
    if params["max_grad_norm"]:
        log.warning("optimizer.params.max_grad_norm: ignored, as DeepSpeed's 1-bit Adam does; use the top-level "
                    "gradient_clipping")
    mpi_comm = _onebit_comm(params, options)
    b1, b2 = params["betas"]
    research = {k: params[k] for k in RESEARCH_KEYS if params[k] not in (None, False)}
    stage = options["zero_stage"]
    if stage:
        unsupported = [*research, *(["freeze_step \"auto\""] if params["freeze_step"] == "auto" else []),
                       *(["comm_backend_name \"mpi\""] if mpi_comm is not None else [])]
        if unsupported:
            raise ValueError(f"onebit_adam_zero: {', '.join(unsupported)} is available at ZeRO stage 0 only, got "
                             f"zero_optimization.stage {stage}; use stage 0 or drop it")
        return onebit_adam_zero(
            learning_rate, freeze_step=params["freeze_step"] - 1, stage=stage, b1=b1, b2=b2, eps=params["eps"],
            weight_decay=params["weight_decay"], exp_avg_mask=options.get("exp_avg_mask"),
            bias_correction=params["bias_correction"], fused=options["fused"],
            axis_name=options.get("axis_name", "data"),
        )
    return onebit_adam(
        learning_rate,
        freeze_step=_freeze_step(params),
        b1=b1, b2=b2, eps=params["eps"], weight_decay=params["weight_decay"],
        bias_correction=params["bias_correction"], mask_unseen=params["mask_unseen"],
        exp_avg_mask=options.get("exp_avg_mask"),
        fused=options["fused"],
        max_grad_norm=options.get("max_grad_norm"),
        axis_name=None if mpi_comm is not None else options.get("axis_name", "data"),
        mpi_comm=mpi_comm,
        experimental=OneBitAdamOptions(**research) if research else None,
    )


def _freeze_step(params: dict):
    """``freeze_step`` (DeepSpeed's ``F`` is ``F - 1`` here: its first ``step()`` only initialises, see the module
    docstring), or with ``"auto"`` its rule (jonebit's update counts, not shifted)."""
    if params["freeze_step"] == "auto":
        from jonebit.transforms.base import AutoFreeze

        rule = params.get("auto_freeze")
        return AutoFreeze(**rule) if rule is not None else "auto"
    return params["freeze_step"] - 1


def _onebit_comm(params: dict, options: dict):
    """The mpi4py communicator the 1-bit optimizers should use (``None``: jax collectives over a mesh axis)."""
    mpi_comm = options.get("mpi_comm")
    if params["comm_backend_name"] == "mpi":
        _apply_cuda_aware(params["cuda_aware"])
        if mpi_comm is None:
            try:
                from mpi4py import MPI
            except ImportError as e:
                raise ImportError("optimizer.params.comm_backend_name is \"mpi\": it needs mpi4py and mpi4jax "
                                  "(pip install 'jonebit[mpi]') and a launch under mpirun") from e
            mpi_comm = MPI.COMM_WORLD
    else:
        if params["cuda_aware"]:
            log.warning("optimizer.params.cuda_aware applies to comm_backend_name \"mpi\" only; ignored with \"nccl\"")
        if mpi_comm is not None:
            raise ValueError("build_optimizer: mpi_comm was given but optimizer.params.comm_backend_name is "
                             f"{params['comm_backend_name']!r}; set it to \"mpi\" or drop mpi_comm")
    return mpi_comm


def _family_common(name: str, params: dict, options: dict) -> dict:
    """Keyword arguments ZeroOneAdam and OneBitLamb share, with DeepSpeed's ignored params logged."""
    for key, why in (("eps_inside_sqrt", "eps is added to sqrt(v)"), ("bias_correction", "no bias correction"),
                     ("max_grad_norm", "use the top-level gradient_clipping")):
        if params[key]:
            log.warning("optimizer.params.%s: ignored, as DeepSpeed's %s does (%s)", key, name, why)
    mpi_comm = _onebit_comm(params, options)
    b1, b2 = params["betas"]
    return dict(b1=b1, b2=b2, eps=params["eps"], weight_decay=params["weight_decay"],
                exp_avg_mask=options.get("exp_avg_mask"), mask_unseen=params["mask_unseen"],
                axis_name=None if mpi_comm is not None else options.get("axis_name", "data"), mpi_comm=mpi_comm)


def _build_zero_one_adam(params: dict, learning_rate, options: dict) -> optax.GradientTransformation:
    from jonebit.transforms.zero_one_adam import zero_one_adam

    return zero_one_adam(
        learning_rate,
        # Same number: DeepSpeed freezes once its step counter (one ahead, for the init call) exceeds it.
        var_freeze_step=params["var_freeze_step"],
        var_update_scaler=params["var_update_scaler"], local_step_scaler=params["local_step_scaler"],
        local_step_clipper=params["local_step_clipper"], fused=options["fused"],
        **_family_common("ZeroOneAdam", params, options),
    )


def _build_onebit_lamb(params: dict, learning_rate, options: dict) -> optax.GradientTransformation:
    from jonebit.transforms.onebit_lamb import onebit_lamb

    return onebit_lamb(
        learning_rate,
        freeze_step=_freeze_step(params),  # as for OneBitAdam
        max_coeff=params["max_coeff"], min_coeff=params["min_coeff"], coeff_beta=params["coeff_beta"],
        factor_max=params["factor_max"], factor_min=params["factor_min"],
        factor_threshold=params["factor_threshold"],
        **_family_common("OneBitLamb", params, options),
    )


# The optimizers that take each rank's local gradient and communicate themselves (compressed).
ONEBIT_OPTIMIZERS = ("OneBitAdam", "OneBitLamb", "ZeroOneAdam")

OPTIMIZERS: Mapping[str, OptimizerSpec] = types.MappingProxyType({
    "adam": OptimizerSpec("Adam", _ADAM_PARAMS, lambda p, lr, o: _build_adam(p, lr, o, decoupled_default=False),
                          ignored=_ADAM_IGNORED),
    "adamw": OptimizerSpec("AdamW", _ADAM_PARAMS, lambda p, lr, o: _build_adam(p, lr, o, decoupled_default=True),
                           ignored=_ADAM_IGNORED),
    "lamb": OptimizerSpec("Lamb", _LAMB_PARAMS, _build_lamb),
    "onebitadam": OptimizerSpec("OneBitAdam", _ONEBIT_ADAM_PARAMS, _build_onebit_adam, init_steps=1,
                                check=_check_onebit_adam, max_grad_norm_clips=False),
    "zerooneadam": OptimizerSpec("ZeroOneAdam", _ZERO_ONE_ADAM_PARAMS, _build_zero_one_adam, init_steps=1,
                                 check=_check_onebit_family("ZeroOneAdam"), max_grad_norm_clips=False),
    "onebitlamb": OptimizerSpec("OneBitLamb", _ONEBIT_LAMB_PARAMS, _build_onebit_lamb, init_steps=1,
                                check=_check_onebit_family("OneBitLamb"), max_grad_norm_clips=False),
})


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
    spec = opt.spec
    params = dict(opt.params)
    if fused is None:  # DeepSpeed's choice, but row scales need one compression per tensor
        fused = config.fp16.enabled and not (spec.name == "OneBitAdam" and params.get("row_scales"))
    options = {
        "axis_name": axis_name, "mpi_comm": mpi_comm, "exp_avg_mask": exp_avg_mask,
        "fused": fused,
        "zero_stage": config.zero_optimization.stage if zero_stage is None else zero_stage,
    }
    # 1-bit Adam at stage 0 clips inside: the averaged gradient in warmup, the local one after (DeepSpeed's places).
    inner_clip = clip and spec.name == "OneBitAdam" and options["zero_stage"] == 0 and config.gradient_clipping > 0
    if inner_clip:
        options["max_grad_norm"] = config.gradient_clipping
    learning_rate = build_schedule(config.scheduler, opt, init_steps=spec.init_steps)
    tx = spec.build(params, learning_rate, options)
    max_grad_norm = params.get("max_grad_norm", 0.0) if spec.max_grad_norm_clips else 0.0
    bounds = [b for b in (config.gradient_clipping, max_grad_norm) if b > 0]
    if clip and bounds and not inner_clip:
        tx = optax.chain(optax.clip_by_global_norm(min(bounds)), tx)
    return tx


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
    lines.append(f"gradient clipping: {config.gradient_clipping:g}" if config.gradient_clipping else
                 "gradient clipping: off")
    if config.optimizer is None:
        lines.append("optimizer: none (bring your own optax transformation)")
        return "\n".join(lines)
    opt = config.optimizer
    lines.append(f"optimizer: {opt.type} " + ", ".join(f"{k}={_jsonable(v)}" for k, v in opt.params.items()))
    if opt.type == "OneBitAdam":
        f = opt.params["freeze_step"]
        backend = "MPI (mpi4jax)" if opt.params["comm_backend_name"] == "mpi" else "jax collectives"
        warm = (f"freeze_step=\"auto\"): Adam updates until the variance settles ({_auto_text(opt.params)})"
                if f == "auto" else f"freeze_step={f - 1}): {f - 1} Adam updates")
        lines.append(f"  -> jonebit.onebit_adam({warm}, then 1-bit compression; collectives: {backend}")
    if opt.type == "ZeroOneAdam":
        lines.append(f"  -> jonebit.zero_one_adam(var_freeze_step={opt.params['var_freeze_step']}): variance frozen "
                     "after that many updates, then local steps with 1-bit synchronisation")
    if opt.type == "OneBitLamb":
        f = opt.params["freeze_step"]
        warm = (f"freeze_step=\"auto\"): LAMB updates until the variance settles ({_auto_text(opt.params)})"
                if f == "auto" else f"freeze_step={f - 1}): {f - 1} LAMB updates")
        lines.append(f"  -> jonebit.onebit_lamb({warm}, then 1-bit compression")
    sched = build_schedule(config.scheduler, opt)
    name = config.scheduler.type if config.scheduler else "constant"
    lines.append(f"schedule: {name}" + (" " + ", ".join(f"{k}={v}" for k, v in config.scheduler.params.items())
                                        if config.scheduler else ""))
    if steps is None:
        steps = [0, 1, 2, 10, 100, 1000, 10000, 100000]
    lines.append("  (update 0 is the optimizer's first update" + (
        "; DeepSpeed's initialisation step of the 1-bit optimizer is accounted for)" if opt.spec.init_steps else ")"))
    for s in steps:
        lr = sched(s) if callable(sched) else sched
        lines.append(f"  update {s:>7d}: lr {float(lr):.6g}")
    return "\n".join(lines)


def _auto_text(params) -> str:
    from jonebit.transforms.base import AutoFreeze

    rule = AutoFreeze(**(params.get("auto_freeze") or {}))
    what = {"median": "the median tensor's", "max": "every tensor's", "global": "the global"}[rule.statistic]
    return (f"every {rule.check_every} updates, {rule.patience} checks with {what} bias-corrected ||v|| moving < "
            f"{rule.threshold:g}; between {rule.min_step} and {rule.max_step} updates")
