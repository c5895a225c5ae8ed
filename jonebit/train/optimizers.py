"""The DeepSpeed optimizers jonebit builds: one frozen dataclass per ``optimizer.type``.

Each class is the single source of its options. A field is one key of ``optimizer.params``: its name is
DeepSpeed's key, its default DeepSpeed's default, and its metadata (made by :func:`option`) holds a one-line
description, the validator that checks a JSON value, and whether the key is jonebit's own. Keys DeepSpeed has
but that change nothing here are the class's ``IGNORED`` mapping (key -> reason). The class validates the
combinations (:meth:`OptimizerOptions.check`) and builds the optax transformation
(:meth:`OptimizerOptions.build`). :mod:`jonebit.train.config` derives its key tables from these fields.

The classes are registered under DeepSpeed's type names, matched case-insensitively (:data:`OPTIMIZERS`), so
DeepSpeed's spellings ``OnebitAdam`` and ``OnebitLamb`` are the same types.

This module also holds the small JSON validators the config parser shares (:class:`ConfigError`, ``_int``,
``_float``, ...), so that the parser can import the optimizers without a cycle.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp
import optax

if TYPE_CHECKING:
    from jonebit.train.config import DeepSpeedConfig

# The config module's logger: these warnings are about the user's config file, and filters set for it keep working.
log = logging.getLogger("jonebit.train.config")


# ----------------------------------------------------------------------------------------------------------------
# Validators: each takes (JSON value, dotted key path) and returns the checked value or raises ConfigError.


class ConfigError(ValueError):
    """A DeepSpeed config jonebit cannot honour; ``key`` is the dotted path of the offending key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


ConfigError.__module__ = "jonebit.train.config"  # where users import it from


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


def _nonneg_float(v, k):
    return _float(v, k, minimum=0.0)


def _pos_float(v, k):
    return _float(v, k, positive=True)


def _opt_pos_float(v, k):
    """A number > 0, or null (off)."""
    return None if v is None else _pos_float(v, k)


def _fraction(v, k):
    """A number in [0, 1): an EMA coefficient or a relative threshold."""
    v = _nonneg_float(v, k)
    if v >= 1:
        raise ConfigError(k, f"expected a fraction in [0, 1), got {v}")
    return v


def _pos_int(v, k):
    return _int(v, k, minimum=1)


def _opt_pos_int(v, k):
    return None if v is None else _int(v, k, minimum=1)


def _parse_freeze_step(v, k):
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


COMM_BACKENDS = ("nccl", "mpi")


def _comm_backend(v, k):
    return _str(v, k, COMM_BACKENDS)


# ----------------------------------------------------------------------------------------------------------------
# Options


def option(default, parse: Callable[[Any, str], Any], doc: str, *, jonebit: bool = False, experimental: bool = False,
           inert: str = ""):
    """A dataclass field that is one ``optimizer.params`` key.

    Args:
      default: DeepSpeed's default (jonebit's for a jonebit-only key).
      parse: ``parse(value, key_path)`` checks a JSON value and returns it as stored.
      doc: one line for ``describe`` and the docs.
      jonebit: the key is jonebit's own (DeepSpeed does not have it).
      experimental: a field of :class:`jonebit.experimental.OneBitAdamOptions` (1-bit Adam's research options).
      inert: DeepSpeed accepts the key but this optimizer ignores it, as DeepSpeed's does; a truthy value is
        logged with this reason when the optimizer is built.
    """
    return dataclasses.field(default=default, metadata=types.MappingProxyType(
        {"parse": parse, "doc": doc, "jonebit": jonebit, "experimental": experimental, "inert": inert}))


# Fields several optimizers share; each call makes a new field (a Field object belongs to one class).
def _lr():
    return option(1e-3, _nonneg_float, "learning rate (the base of the schedule)")


def _betas_field():
    return option((0.9, 0.999), _betas, "[beta1, beta2]: the EMA coefficients of the first and second moments")


def _eps():
    return option(1e-8, _pos_float, "added to sqrt(v) in the denominator")


def _weight_decay():
    return option(0.0, _nonneg_float, "decoupled weight decay")


def _amsgrad():
    return option(False, _bool, "AMSGrad; refused (DeepSpeed refuses it too)")


def _max_grad_norm(inert: str = ""):
    return option(0.0, _nonneg_float, "clip the global gradient norm to this (0: off)", inert=inert)


def _mask_unseen():
    return option(True, _bool, "false: DeepSpeed's arithmetic for elements no gradient has reached", jonebit=True)


def _freeze_step_field():
    return option(100000, _parse_freeze_step,
                  "DeepSpeed's step F of the switch to compression (F - 1 warmup updates), or \"auto\" (jonebit)")


def _auto_freeze_field():
    return option(None, _auto_freeze, "the rule of freeze_step \"auto\" (fields of jonebit.AutoFreeze)", jonebit=True)


def _cuda_aware():
    return option(False, _bool, "comm_backend_name \"mpi\": MPI takes GPU buffers directly")


def _comm_backend_name():
    return option("nccl", _comm_backend, "\"nccl\": jax collectives over a mesh axis; \"mpi\": mpi4jax")


_SQRT_EPS = "eps is added to sqrt(v)"
_USE_GRADIENT_CLIPPING = "use the top-level gradient_clipping"


@dataclasses.dataclass(frozen=True)
class OptimizerOptions:
    """Base of the registered optimizer classes. Subclasses are frozen dataclasses of :func:`option` fields.

    Class attributes:
      NAME: DeepSpeed's canonical spelling of the type.
      IGNORED: DeepSpeed keys accepted with a warning (key -> why they change nothing).
      INIT_STEPS: engine steps DeepSpeed spends before the first real update (the 1-bit optimizers: 1).
      MAX_GRAD_NORM_CLIPS: the ``max_grad_norm`` field clips the global gradient norm (the 1-bit optimizers accept
        it and ignore it, as DeepSpeed's do).
    """

    NAME: ClassVar[str] = ""
    IGNORED: ClassVar[Mapping[str, str]] = types.MappingProxyType({})
    INIT_STEPS: ClassVar[int] = 0
    MAX_GRAD_NORM_CLIPS: ClassVar[bool] = True

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The accepted ``optimizer.params`` keys, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {f.name: f.default for f in dataclasses.fields(cls)}

    @classmethod
    def jonebit_keys(cls) -> tuple[str, ...]:
        """The keys DeepSpeed does not have."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata["jonebit"])

    @classmethod
    def parse(cls, raw: Mapping, path: str = "optimizer.params"):
        """The options from a JSON ``params`` object: unknown keys refused, each value checked, defaults filled in."""
        _check_keys(raw, path, cls.keys(), cls.IGNORED)
        values = {f.name: f.metadata["parse"](raw[f.name], _join(path, f.name)) if f.name in raw else f.default
                  for f in dataclasses.fields(cls)}
        if values.get("amsgrad"):
            raise ConfigError(_join(path, "amsgrad"), f"{cls.NAME} does not support AMSGrad (DeepSpeed refuses it "
                              "too); remove it or set it to false")
        return cls(**values)

    def params(self) -> dict[str, Any]:
        """The options as ``optimizer.params`` (every key, declaration order)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def check(self, config: DeepSpeedConfig, path: str = "optimizer.params") -> None:
        """Checks that need other fields or the rest of the config; raises :class:`ConfigError`."""

    def build(self, learning_rate, options: Mapping[str, Any]) -> optax.GradientTransformation:
        """The optax transformation (without the config's gradient clipping, which ``build_optimizer`` chains).

        ``options``: ``axis_name``, ``mpi_comm``, ``exp_avg_mask``, ``fused``, ``zero_stage`` and, for 1-bit Adam
        at stage 0, ``max_grad_norm`` (see :func:`jonebit.train.config.build_optimizer`).
        """
        raise NotImplementedError

    def describe(self) -> str | None:
        """A line saying what the type maps to in jonebit (``jonebit config``), or ``None``."""
        return None

    def _warn_inert(self) -> None:
        for f in dataclasses.fields(self):
            if f.metadata["inert"] and getattr(self, f.name):
                log.warning("optimizer.params.%s: ignored, as DeepSpeed's %s does (%s)", f.name, self.NAME,
                            f.metadata["inert"])


OPTIMIZERS_BY_NAME: dict[str, type[OptimizerOptions]] = {}


def register(*names: str):
    """Registers the class under DeepSpeed's type ``names`` (the first is canonical), matched case-insensitively."""

    def wrap(cls):
        cls.NAME = names[0]
        for name in names:
            if OPTIMIZERS_BY_NAME.setdefault(name.lower(), cls) is not cls:
                raise ValueError(f"optimizer type {name!r} is registered twice")
        return cls

    return wrap


# ----------------------------------------------------------------------------------------------------------------
# Optimizer math shared by the plain optimizers


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


# ----------------------------------------------------------------------------------------------------------------
# Adam, AdamW, Lamb


@register("Adam")
@dataclasses.dataclass(frozen=True)
class Adam(OptimizerOptions):
    """DeepSpeed's ``Adam`` (FusedAdam): decoupled weight decay unless ``adam_w_mode: false`` (then L2 decay added
    to the gradient), bias correction unless ``bias_correction: false``."""

    IGNORED: ClassVar[Mapping[str, str]] = types.MappingProxyType(
        {"torch_adam": "torch.optim.Adam(W) and FusedAdam compute the same update"})
    DECOUPLED: ClassVar[bool] = False  # AdamW decouples whatever adam_w_mode says

    lr: float = _lr()
    betas: tuple[float, float] = _betas_field()
    eps: float = _eps()
    weight_decay: float = _weight_decay()
    bias_correction: bool = option(True, _bool, "divide the moments by (1 - beta^t)")
    adam_w_mode: bool = option(True, _bool, "decoupled weight decay (false: L2 decay added to the gradient)")
    amsgrad: bool = _amsgrad()
    # Not a parameter of DeepSpeed's FusedAdam today, but of apex's FusedAdam that DeepSpeed's BERT fine-tuning
    # tutorial config still passes: global-norm clipping before the update.
    max_grad_norm: float = _max_grad_norm()

    def build(self, learning_rate, options) -> optax.GradientTransformation:
        b1, b2 = self.betas
        decoupled = self.DECOUPLED or self.adam_w_mode
        moments = _adam_moments(b1, b2, self.eps, 0.0, self.bias_correction)
        wd = self.weight_decay
        if decoupled:  # FusedAdam adam_w_mode: p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)
            parts = [moments, optax.add_decayed_weights(wd)] if wd else [moments]
        else:  # L2: the decay joins the gradient before the moments
            parts = [optax.add_decayed_weights(wd), moments] if wd else [moments]
        return optax.chain(*parts, optax.scale_by_learning_rate(learning_rate))


@register("AdamW")
@dataclasses.dataclass(frozen=True)
class AdamW(Adam):
    """DeepSpeed's ``AdamW``: :class:`Adam` with decoupled weight decay."""

    DECOUPLED: ClassVar[bool] = True


@register("Lamb")
@dataclasses.dataclass(frozen=True)
class Lamb(OptimizerOptions):
    """optax's LAMB with DeepSpeed's trust-ratio clamp ``[min_coeff, max_coeff]``."""

    lr: float = _lr()
    betas: tuple[float, float] = _betas_field()
    eps: float = _eps()
    eps_inside_sqrt: bool = option(False, _bool, "add eps to v under the square root instead")
    weight_decay: float = _weight_decay()
    bias_correction: bool = option(True, _bool, "divide the moments by (1 - beta^t)")
    max_grad_norm: float = _max_grad_norm()
    max_coeff: float = option(10.0, _pos_float, "upper clamp of the trust ratio ||p|| / ||u||")
    min_coeff: float = option(0.01, _nonneg_float, "lower clamp of the trust ratio")
    amsgrad: bool = _amsgrad()

    def build(self, learning_rate, options) -> optax.GradientTransformation:
        b1, b2 = self.betas
        eps, eps_root = (0.0, self.eps) if self.eps_inside_sqrt else (self.eps, 0.0)
        parts = [_adam_moments(b1, b2, eps, eps_root, self.bias_correction)]
        if self.weight_decay:
            parts.append(optax.add_decayed_weights(self.weight_decay))
        parts += [_clamped_trust_ratio(self.min_coeff, self.max_coeff), optax.scale_by_learning_rate(learning_rate)]
        return optax.chain(*parts)


# ----------------------------------------------------------------------------------------------------------------
# The 1-bit family: communication set-up


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


def _onebit_comm(comm_backend_name: str, cuda_aware: bool, options: Mapping):
    """The mpi4py communicator the 1-bit optimizers should use (``None``: jax collectives over a mesh axis)."""
    mpi_comm = options.get("mpi_comm")
    if comm_backend_name == "mpi":
        _apply_cuda_aware(cuda_aware)
        if mpi_comm is None:
            try:
                from mpi4py import MPI
            except ImportError as e:
                raise ImportError("optimizer.params.comm_backend_name is \"mpi\": it needs mpi4py and mpi4jax "
                                  "(pip install 'jonebit[mpi]') and a launch under mpirun") from e
            mpi_comm = MPI.COMM_WORLD
    else:
        if cuda_aware:
            log.warning("optimizer.params.cuda_aware applies to comm_backend_name \"mpi\" only; ignored with \"nccl\"")
        if mpi_comm is not None:
            raise ValueError("build_optimizer: mpi_comm was given but optimizer.params.comm_backend_name is "
                             f"{comm_backend_name!r}; set it to \"mpi\" or drop mpi_comm")
    return mpi_comm


class _OneBitMixin:
    """What the 1-bit optimizers share: the freeze-step checks and arguments, communication, describe text."""

    INIT_STEPS: ClassVar[int] = 1
    MAX_GRAD_NORM_CLIPS: ClassVar[bool] = False
    WARMUP: ClassVar[str] = ""  # what the warmup updates are, for messages: "Adam" or "LAMB"

    def _check_freeze(self, config: DeepSpeedConfig, path: str, why: str) -> None:
        if self.auto_freeze is not None and self.freeze_step != "auto":
            raise ConfigError(f"{path}.auto_freeze", f"applies to \"freeze_step\": \"auto\" only, got freeze_step "
                              f"{self.freeze_step!r}; set freeze_step to \"auto\" or drop auto_freeze")
        if self.freeze_step == "auto" and config.zero_optimization.stage:
            raise ConfigError(f"{path}.freeze_step", f"\"auto\" is available at ZeRO stage 0 only, got "
                              f"zero_optimization.stage = {config.zero_optimization.stage}; give {self.NAME} an "
                              "integer freeze_step, or set zero_optimization.stage to 0")
        if self.freeze_step != "auto" and self.freeze_step < 2:
            raise ConfigError(f"{path}.freeze_step", f"expected >= 2, got {self.freeze_step}: DeepSpeed's "
                              f"freeze_step=F gives F - 1 full-precision {self.WARMUP} updates before compression, "
                              f"and {why}")

    def _check_stage0(self, config: DeepSpeedConfig) -> None:
        if config.zero_optimization.stage:
            raise ConfigError("zero_optimization.stage", f"{self.NAME} runs at ZeRO stage 0 only (its moments, and for "
                              "0/1 Adam the parameters during local steps, are whole on every rank); got stage "
                              f"{config.zero_optimization.stage}. Set zero_optimization.stage to 0, or use OneBitAdam "
                              "for stages 1-3")

    def _freeze_arg(self):
        """``freeze_step`` for the transform: DeepSpeed's ``F`` is ``F - 1`` here (its first ``step()`` only
        initialises), or with ``"auto"`` its rule (jonebit's update counts, not shifted)."""
        if self.freeze_step == "auto":
            from jonebit.transforms.base import AutoFreeze

            return AutoFreeze(**self.auto_freeze) if self.auto_freeze is not None else "auto"
        return self.freeze_step - 1

    def _comm(self, options: Mapping) -> dict:
        """``axis_name`` and ``mpi_comm`` for the transform."""
        mpi_comm = _onebit_comm(self.comm_backend_name, self.cuda_aware, options)
        return dict(axis_name=None if mpi_comm is not None else options.get("axis_name", "data"), mpi_comm=mpi_comm)

    def _warmup_text(self, call: str) -> str:
        f = self.freeze_step
        if f == "auto":
            return (f"{call}(freeze_step=\"auto\"): {self.WARMUP} updates until the variance settles "
                    f"({_auto_text(self.auto_freeze)})")
        return f"{call}(freeze_step={f - 1}): {f - 1} {self.WARMUP} updates"


def _auto_text(rule: Mapping | None) -> str:
    from jonebit.transforms.base import AutoFreeze

    rule = AutoFreeze(**(rule or {}))
    what = {"median": "the median tensor's", "max": "every tensor's", "global": "the global"}[rule.statistic]
    return (f"every {rule.check_every} updates, {rule.patience} checks with {what} bias-corrected ||v|| moving < "
            f"{rule.threshold:g}; between {rule.min_step} and {rule.max_step} updates")


# ----------------------------------------------------------------------------------------------------------------
# OneBitAdam, ZeroOneAdam, OneBitLamb


@register("OneBitAdam", "OnebitAdam")
@dataclasses.dataclass(frozen=True)
class OneBitAdam(_OneBitMixin, OptimizerOptions):
    """:func:`jonebit.onebit_adam` with ``freeze_step = F - 1`` (:func:`jonebit.onebit_adam_zero` at ZeRO stages
    1-3); the ``experimental`` fields are :class:`jonebit.experimental.OneBitAdamOptions`."""

    WARMUP: ClassVar[str] = "Adam"

    lr: float = _lr()
    freeze_step: int | str = _freeze_step_field()
    auto_freeze: Mapping | None = _auto_freeze_field()
    mask_unseen: bool = _mask_unseen()
    row_scales: bool = option(False, _bool, "one compression scale per row of each matrix", jonebit=True,
                              experimental=True)
    preconditioned: bool = option(False, _bool, "compress m / (sqrt(v) + eps) instead of m", jonebit=True,
                                  experimental=True)
    clip_ratio: float | None = option(None, _opt_pos_float, "bound on |m| / sqrt(v) after the freeze (null: none)",
                                      jonebit=True, experimental=True)
    variance_refresh: int | None = option(None, _opt_pos_int, "an exact step refreshing v every K updates after the "
                                          "freeze (null: v stays frozen)", jonebit=True, experimental=True)
    local_clip: bool = option(False, _bool, "gradient_clipping on each rank's gradient in warmup too", jonebit=True,
                              experimental=True)
    betas: tuple[float, float] = _betas_field()
    eps: float = _eps()
    weight_decay: float = _weight_decay()
    bias_correction: bool = option(True, _bool, "divide the moments by (1 - beta^t)")
    eps_inside_sqrt: bool = option(False, _bool, "accepted; DeepSpeed's 1-bit Adam ignores it", inert=_SQRT_EPS)
    max_grad_norm: float = _max_grad_norm(inert=_USE_GRADIENT_CLIPPING)
    amsgrad: bool = _amsgrad()
    cuda_aware: bool = _cuda_aware()
    comm_backend_name: str = _comm_backend_name()

    @classmethod
    def experimental_keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata["experimental"])

    def _research(self) -> dict:
        """The research options this config turns on (``OneBitAdamOptions``'s arguments)."""
        return {k: getattr(self, k) for k in self.experimental_keys() if getattr(self, k) not in (None, False)}

    def check(self, config: DeepSpeedConfig, path: str = "optimizer.params") -> None:
        self._check_freeze(config, path, "1-bit Adam needs at least one to estimate the variance (use 15-25% of the "
                           "training steps)")
        stage = config.zero_optimization.stage
        research = list(self._research())
        if stage and research:
            raise ConfigError(f"{path}.{research[0]}", f"a research option of 1-bit Adam at ZeRO stage 0 only, got "
                              f"zero_optimization.stage = {stage}; drop {', '.join(research)} or set "
                              "zero_optimization.stage to 0 (see docs/experimental.md)")
        if self.comm_backend_name == "mpi" and config.zero_optimization.stage:
            raise ConfigError(f"{path}.comm_backend_name", "1-bit Adam under ZeRO (zero_optimization.stage = "
                              f"{config.zero_optimization.stage}) runs over jax collectives only; use \"nccl\" or "
                              "stage 0")
        if self.comm_backend_name == "mpi" and config.zero_optimization.offload_optimizer.enabled:
            raise ConfigError(f"{path}.comm_backend_name", "the MPI path does not offload the optimizer state")

    def build(self, learning_rate, options) -> optax.GradientTransformation:
        from jonebit.experimental import OneBitAdamOptions
        from jonebit.transforms.onebit_adam import onebit_adam
        from jonebit.transforms.onebit_adam_zero import onebit_adam_zero

        self._warn_inert()
        comm = self._comm(options)
        b1, b2 = self.betas
        research = self._research()
        stage = options["zero_stage"]  # may differ from the checked config's (build_optimizer's zero_stage)
        if stage:
            unsupported = [*research, *(["freeze_step \"auto\""] if self.freeze_step == "auto" else []),
                           *(["comm_backend_name \"mpi\""] if comm["mpi_comm"] is not None else [])]
            if unsupported:
                raise ValueError(f"onebit_adam_zero: {', '.join(unsupported)} is available at ZeRO stage 0 only, "
                                 f"got zero_optimization.stage {stage}; use stage 0 or drop it")
            return onebit_adam_zero(
                learning_rate, freeze_step=self.freeze_step - 1, stage=stage, b1=b1, b2=b2, eps=self.eps,
                weight_decay=self.weight_decay, exp_avg_mask=options.get("exp_avg_mask"),
                bias_correction=self.bias_correction, fused=options["fused"], mask_unseen=self.mask_unseen,
                axis_name=options.get("axis_name", "data"),
            )
        return onebit_adam(
            learning_rate, freeze_step=self._freeze_arg(), b1=b1, b2=b2, eps=self.eps,
            weight_decay=self.weight_decay, bias_correction=self.bias_correction, mask_unseen=self.mask_unseen,
            exp_avg_mask=options.get("exp_avg_mask"), fused=options["fused"],
            max_grad_norm=options.get("max_grad_norm"), **comm,
            experimental=OneBitAdamOptions(**research) if research else None,
        )

    def describe(self) -> str:
        backend = "MPI (mpi4jax)" if self.comm_backend_name == "mpi" else "jax collectives"
        return f"  -> jonebit.{self._warmup_text('onebit_adam')}, then 1-bit compression; collectives: {backend}"


@dataclasses.dataclass(frozen=True)
class _OneBitCommon(_OneBitMixin, OptimizerOptions):
    """The params DeepSpeed's ZeroOneAdam and OnebitLamb share with its 1-bit Adam (both accept bias_correction and
    ignore it, so it defaults to false); each subclass adds its schedule."""

    lr: float = _lr()
    mask_unseen: bool = _mask_unseen()
    betas: tuple[float, float] = _betas_field()
    eps: float = _eps()
    weight_decay: float = _weight_decay()
    bias_correction: bool = option(False, _bool, "accepted; ignored (no bias correction)",
                                   inert="no bias correction")
    eps_inside_sqrt: bool = option(False, _bool, "accepted; ignored", inert=_SQRT_EPS)
    max_grad_norm: float = _max_grad_norm(inert=_USE_GRADIENT_CLIPPING)
    amsgrad: bool = _amsgrad()
    cuda_aware: bool = _cuda_aware()
    comm_backend_name: str = _comm_backend_name()

    def _common_kwargs(self, options: Mapping) -> dict:
        """Keyword arguments zero_one_adam and onebit_lamb share, with DeepSpeed's ignored params logged."""
        self._warn_inert()
        comm = self._comm(options)
        b1, b2 = self.betas
        return dict(b1=b1, b2=b2, eps=self.eps, weight_decay=self.weight_decay,
                    exp_avg_mask=options.get("exp_avg_mask"), mask_unseen=self.mask_unseen, **comm)


@register("ZeroOneAdam")
@dataclasses.dataclass(frozen=True)
class ZeroOneAdam(_OneBitCommon):
    """:func:`jonebit.zero_one_adam` with the same ``var_freeze_step`` (DeepSpeed's strict ``>`` comparison cancels
    its initialisation step); ZeRO stage 0 only."""

    var_freeze_step: int = option(100000, _pos_int, "updates after which the variance is frozen")
    var_update_scaler: int = option(16, _pos_int, "the variance-update interval doubles every this many updates")
    local_step_scaler: int = option(32678, _pos_int, "the local-step interval doubles every this many updates")
    local_step_clipper: int = option(16, _pos_int, "the largest local-step interval")

    def check(self, config: DeepSpeedConfig, path: str = "optimizer.params") -> None:
        self._check_stage0(config)

    def build(self, learning_rate, options) -> optax.GradientTransformation:
        from jonebit.transforms.zero_one_adam import zero_one_adam

        return zero_one_adam(
            learning_rate,
            # Same number: DeepSpeed freezes once its step counter (one ahead, for the init call) exceeds it.
            var_freeze_step=self.var_freeze_step, var_update_scaler=self.var_update_scaler,
            local_step_scaler=self.local_step_scaler, local_step_clipper=self.local_step_clipper,
            fused=options["fused"], **self._common_kwargs(options),
        )

    def describe(self) -> str:
        return (f"  -> jonebit.zero_one_adam(var_freeze_step={self.var_freeze_step}): variance frozen after that many "
                "updates, then local steps with 1-bit synchronisation")


@register("OneBitLamb", "OnebitLamb")
@dataclasses.dataclass(frozen=True)
class OneBitLamb(_OneBitCommon):
    """:func:`jonebit.onebit_lamb` with ``freeze_step = F - 1``; ZeRO stage 0 only."""

    WARMUP: ClassVar[str] = "LAMB"

    freeze_step: int | str = _freeze_step_field()
    auto_freeze: Mapping | None = _auto_freeze_field()
    max_coeff: float = option(10.0, _pos_float, "upper clamp of the warmup trust ratio")
    min_coeff: float = option(0.01, _nonneg_float, "lower clamp of the warmup trust ratio")
    coeff_beta: float = option(0.9, _fraction, "EMA coefficient of the trust ratio frozen for the compression stage")
    factor_max: float = option(4.0, _pos_float, "upper bound of the compression stage's scaling factor")
    factor_min: float = option(0.5, _nonneg_float, "lower bound of the compression stage's scaling factor")
    factor_threshold: float = option(0.1, _fraction, "largest relative change of the scaling factor per update")

    def check(self, config: DeepSpeedConfig, path: str = "optimizer.params") -> None:
        self._check_stage0(config)
        self._check_freeze(config, path, "1-bit LAMB needs at least one to estimate the variance and the trust-ratio "
                           "coefficients")
        if self.min_coeff > self.max_coeff:
            raise ConfigError(f"{path}.max_coeff", f"max_coeff ({self.max_coeff}) is below min_coeff "
                              f"({self.min_coeff})")
        if self.factor_min > self.factor_max:
            raise ConfigError(f"{path}.factor_max", f"factor_max ({self.factor_max}) is below factor_min "
                              f"({self.factor_min})")

    def build(self, learning_rate, options) -> optax.GradientTransformation:
        from jonebit.transforms.onebit_lamb import onebit_lamb

        return onebit_lamb(
            learning_rate, freeze_step=self._freeze_arg(), max_coeff=self.max_coeff, min_coeff=self.min_coeff,
            coeff_beta=self.coeff_beta, factor_max=self.factor_max, factor_min=self.factor_min,
            factor_threshold=self.factor_threshold, **self._common_kwargs(options),
        )

    def describe(self) -> str:
        return f"  -> jonebit.{self._warmup_text('onebit_lamb')}, then 1-bit compression"


OPTIMIZERS: Mapping[str, type[OptimizerOptions]] = types.MappingProxyType(OPTIMIZERS_BY_NAME)

# The optimizers that take each rank's local gradient and communicate themselves (compressed).
ONEBIT_OPTIMIZERS = tuple(cls.NAME for cls in (OneBitAdam, OneBitLamb, ZeroOneAdam))
