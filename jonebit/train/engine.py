"""The engine's training step: gradient accumulation, mixed precision, loss scaling, skipped steps.

One call of the step built by :func:`make_train_step` is one *optimizer* step, as in DeepSpeed:

1. Inside ``jax.shard_map`` over the data axis, each rank splits its batch shard into
   ``accumulation_steps`` micro-batches and runs forward/backward on each in a ``lax.scan`` (one micro-batch
   in memory at a time). Parameters are kept in float32 (the master copy) and cast to ``compute_dtype`` for the
   forward pass, so the backward pass runs in that dtype too; each micro-batch's gradient is converted to
   float32 and summed. Nothing is communicated per micro-batch.
2. With fp16 the loss is multiplied by the current loss scale before differentiation and the summed gradient
   is divided by it (and by the number of micro-batches).
3. The squared global norm of the gradient, which every rank needs anyway (``grad_norm``, clipping) and gets
   from its one scalar reduction, tells every rank whether any rank's gradient holds an inf or a NaN (or is so
   large that its square overflows float32, as DeepSpeed's overflow check also counts). If so the
   step is skipped on every rank together: parameters and the whole optimizer state (moments, 1-bit error
   buffers, the optimizer's own count) stay bit-identical, the skip is counted, and with dynamic loss scaling
   the scale is cut. Otherwise the gradient goes to the optimizer: averaged first with ``grad_reduce="mean"``
   (standard optax optimizers), or handed over as this rank's local gradient (``grad_reduce=None``: 1-bit
   optimizers, which do their own communication).
4. The loss scale follows DeepSpeed's ``DynamicLossScaler`` (see :class:`LossScaling`).

**ZeRO stages 1-3** (``zero_stage``, :mod:`jonebit.sharding.zero`'s layouts): steps 1-3 are the same (the
micro-batch loop runs in ``shard_map`` on whole local gradients, without any communication); at stage 3 the
parameter shards are all-gathered once per optimizer step, in ``compute_dtype``, before the loop, and the gathered
copy lives for the step (stage 3 saves parameter memory between steps, not within one: DeepSpeed re-gathers each
layer per micro-batch instead, trading memory for traffic). Then, with a
standard optimizer, the summed float32 gradient is **reduce-scattered once** into its ZeRO layout (stage 1: the
optimizer state's, stages 2-3: the gradients'), and the update runs in the global view on the partitioned state
(parameters all-gathered back at stages 1-2, optimizer state moved from and to host memory with
``offload_optimizer``); a skipped step selects the old parameters and state leaf by leaf. A 1-bit optimizer made
with ``onebit_adam_zero(..., stage=k)`` keeps its own layouts and communication (stage 3: the parameters are
:class:`~jonebit.train.onebit_zero.FlatParams`), and runs in the per-device view like stage 0.

**0/1 Adam** moves each rank's parameters on their own during its local steps, so the state holds one copy per
rank (:class:`RankParams`: every leaf with a leading rank axis, split over the data axis); each rank computes its
gradient at, and updates, its own copy. :func:`model_params` gives rank 0's copy (what DeepSpeed's rank 0 saves).

The step returns the new :class:`TrainState` and a dict of scalar metrics (``loss``, ``grad_norm``,
``loss_scale``, ``skipped``). The loop (:mod:`jonebit.train.loop`) decides what to do with skipped steps
(count them, or raise with ``nonfinite="raise"``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jonebit.sharding.layerwise import is_stacked
from jonebit.sharding.zero import OFFLOAD_MEMORY_KIND, check_stage, leaf_spec, to_shardings, zero_specs
from jonebit.train.onebit_zero import FlatParams, find_onebit_state, onebit_stage
from jonebit.train.step import (
    RankParams,
    after_backward,
    apply_optimizer,
    axis_dim,
    flat_layers_loss,
    gather_shards,
    layerwise_gathering,
    local_gradients,
    local_view,
    nonfinite,
    norm_sq,
    per_device,
    reduce,
    reduce_scatter,
    sharded_norm_sq,
)
from jonebit.train.zero import init_zero
from jonebit.transforms.base import moves_params_per_rank
from jonebit.transforms.nonfinite import keep_if
from jonebit.transforms.onebit_adam import local_abstract_state, sharded_init
from jonebit.transforms.phases import fixed_phases, has_phases, next_phases

__all__ = [
    "LossScaleState",
    "LossScaling",
    "RankParams",
    "TrainState",
    "init_train_state",
    "make_train_step",
    "model_params",
    "train_state_specs",
]

_COMPUTE_DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}
_REDUCE = (None, "mean")


class LossScaleState(NamedTuple):
    """Dynamic loss-scale state (all scalars, replicated).

    Attributes:
      scale: the current loss scale (float32).
      hysteresis: overflows still tolerated before the scale is cut (DeepSpeed's ``cur_hysteresis``).
      since_overflow: DeepSpeed's ``cur_iter - last_overflow_iter``: 1 right after an overflow, +1 per step.
    """

    scale: jax.Array
    hysteresis: jax.Array
    since_overflow: jax.Array


@dataclasses.dataclass(frozen=True)
class LossScaling:
    """fp16 loss scaling with DeepSpeed's rules (``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler``).

    On an overflow (a non-finite gradient on any rank) the step is skipped and, once ``hysteresis`` overflows
    have been seen since the last reset, the scale is divided by ``scale_factor`` (never below ``min_scale``).
    On a good step the scale is multiplied by ``scale_factor`` whenever the number of steps since the last
    overflow is a multiple of ``scale_window`` (counting the overflow step itself; with no overflow yet, the
    first doubling comes after ``scale_window`` good steps), and the hysteresis is restored at that point
    (or on every good step with ``consecutive_hysteresis``).

    With ``dynamic=False`` the scale stays at ``static_scale``; overflowing steps are still skipped.

    Attributes:
      dynamic: dynamic (DeepSpeed ``loss_scale: 0``) or static scaling.
      initial_scale_power: the dynamic scale starts at ``2 ** initial_scale_power``.
      scale_window: good steps between increases (``loss_scale_window``).
      hysteresis: overflows tolerated before a decrease (DeepSpeed's ``delayed_shift``).
      min_scale: lower bound of the dynamic scale (``min_loss_scale``).
      static_scale: the scale when ``dynamic=False`` (DeepSpeed ``loss_scale > 0``).
      scale_factor: factor of each increase/decrease.
      consecutive_hysteresis: restore the hysteresis after every good step, not only at increases.
    """

    dynamic: bool = True
    initial_scale_power: int = 16
    scale_window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    static_scale: float = 1.0
    scale_factor: float = 2.0
    consecutive_hysteresis: bool = False

    def __post_init__(self):
        for name in ("dynamic", "consecutive_hysteresis"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"LossScaling.{name} must be a bool, got {getattr(self, name)!r}")
        for name, low in (("scale_window", 1), ("hysteresis", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
                raise ValueError(f"LossScaling.{name} must be an int >= {low}, got {value!r}")
        if isinstance(self.initial_scale_power, bool) or not isinstance(self.initial_scale_power, int | np.integer):
            raise ValueError(f"LossScaling.initial_scale_power must be an int, got {self.initial_scale_power!r}")
        if not 0 <= self.initial_scale_power <= 126:
            raise ValueError(
                f"LossScaling.initial_scale_power must be in [0, 126] (2**p must be a finite float32), "
                f"got {self.initial_scale_power}"
            )
        for name in ("min_scale", "static_scale"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not np.isfinite(value) or value <= 0:
                raise ValueError(f"LossScaling.{name} must be a finite number > 0, got {value!r}")
        if not isinstance(self.scale_factor, int | float) or not self.scale_factor > 1:
            raise ValueError(f"LossScaling.scale_factor must be a number > 1, got {self.scale_factor!r}")

    def init(self) -> LossScaleState:
        scale = float(2.0**self.initial_scale_power) if self.dynamic else float(self.static_scale)
        return LossScaleState(
            scale=jnp.asarray(scale, jnp.float32),
            hysteresis=jnp.asarray(self.hysteresis, jnp.int32),
            since_overflow=jnp.asarray(1, jnp.int32),
        )

    def update(self, state: LossScaleState, overflow: jax.Array) -> LossScaleState:
        """The state after a step; ``overflow`` is a boolean scalar (the same on every rank)."""
        if not self.dynamic:
            return state
        cut = (self.hysteresis == 1) | (state.hysteresis == 1)
        down = LossScaleState(
            scale=jnp.where(cut, jnp.maximum(state.scale / self.scale_factor, self.min_scale), state.scale),
            hysteresis=jnp.where(cut, state.hysteresis, state.hysteresis - 1),
            since_overflow=jnp.asarray(1, jnp.int32),
        )
        grow = state.since_overflow % self.scale_window == 0
        restored = jnp.asarray(self.hysteresis, jnp.int32)
        hyst = restored if self.consecutive_hysteresis else jnp.where(grow, restored, state.hysteresis)
        up = LossScaleState(
            scale=jnp.where(grow, state.scale * self.scale_factor, state.scale),
            hysteresis=hyst,
            since_overflow=state.since_overflow + 1,
        )
        return jax.tree.map(lambda d, u: jnp.where(overflow, d, u), down, up)


def model_params(params):
    """The ordinary parameter tree of a :class:`TrainState`'s ``params``, whatever their layout: rank 0's copy
    of :class:`RankParams`, the gathered tree of :class:`~jonebit.train.onebit_zero.FlatParams`, else as is."""
    return params.tree() if isinstance(params, RankParams | FlatParams) else params


class TrainState(NamedTuple):
    """Everything a training step changes.

    Attributes:
      step: optimizer steps taken, skipped ones included (int32).
      params: the float32 master parameters: replicated at ZeRO stages 0-2, partitioned over the data axis at
        stage 3 (:class:`~jonebit.train.onebit_zero.FlatParams` with a 1-bit optimizer), one copy per rank with
        0/1 Adam (:class:`RankParams`); :func:`model_params` gives the ordinary tree of any of them.
      opt_state: the optimizer state (1-bit error buffers one row per rank, see :func:`jonebit.state_specs`;
        partitioned at ZeRO stages 1-3, in host memory with ``offload_optimizer``).
      loss_scale: the loss-scale state (present, and constant, also without fp16).
      skipped: steps skipped for a non-finite gradient (int32).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    loss_scale: LossScaleState
    skipped: jax.Array


def train_state_specs(opt_specs) -> TrainState:
    """The ``shard_map`` specs of a :class:`TrainState` whose optimizer state has specs ``opt_specs``."""
    rep = LossScaleState(P(), P(), P())
    return TrainState(step=P(), params=P(), opt_state=opt_specs, loss_scale=rep, skipped=P())


def _check_float_tree(params) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"init_train_state: param {jax.tree_util.keystr(path)} has dtype {dtype}; the engine trains "
                "floating-point leaves only (keep integer buffers out of the parameter tree)"
            )


def _check_zero_args(zero_stage, offload_optimizer, where: str) -> int:
    try:
        stage = check_stage(zero_stage)
    except ValueError:
        raise ValueError(f"{where}: zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}") from None
    if not isinstance(offload_optimizer, bool):
        raise TypeError(f"{where}: offload_optimizer must be a bool, got {offload_optimizer!r}")
    if offload_optimizer and stage == 0:
        raise ValueError(f"{where}: offload_optimizer=True needs zero_stage 1, 2 or 3 (as in DeepSpeed), got 0")
    return stage


def init_train_state(
    tx: optax.GradientTransformation,
    params,
    mesh: jax.sharding.Mesh,
    *,
    loss_scaling: LossScaling | None = None,
    axis: str = "data",
    zero_stage: int = 0,
    offload_optimizer: bool = False,
) -> tuple[TrainState, TrainState]:
    """``(state, specs)``: a fresh :class:`TrainState` on ``mesh`` and its ``shard_map`` specs.

    The parameters are copied to float32 master weights (the caller's arrays are never donated or aliased).

    Args:
      tx: the optimizer (a 1-bit optimizer must be made with ``zero_stage`` equal to this one's).
      params: the initial parameters (any float dtype).
      mesh: mesh with the data axis ``axis``.
      loss_scaling: the :class:`LossScaling` whose initial state to use (``None``: a constant scale of 1).
      axis: the data-parallel mesh axis.
      zero_stage: 0-3, where params and optimizer state live (:func:`jonebit.sharding.zero_shardings`; the
        1-bit optimizers use their own layouts, :mod:`jonebit.transforms.onebit_adam_zero`).
      offload_optimizer: keep the optimizer state in host memory between steps (stages 1-3; the backend must
        offer ``pinned_host`` memory).
    """
    _check_float_tree(params)
    if axis not in mesh.shape:
        raise ValueError(f"init_train_state: mesh has axes {tuple(mesh.shape)}, not the data axis {axis!r}")
    stage = _check_zero_args(zero_stage, offload_optimizer, "init_train_state")
    replicated = jax.NamedSharding(mesh, P())
    master = jax.jit(lambda t: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), t), out_shardings=replicated)(
        params)
    abstract = local_abstract_state(tx, master, mesh)
    onebit, per_rank = find_onebit_state(abstract), moves_params_per_rank(abstract)
    if onebit is not None and onebit_stage(onebit) != stage:
        raise ValueError(
            f"init_train_state: zero_stage={stage} but the 1-bit optimizer was built for ZeRO stage "
            f"{onebit_stage(onebit)}: make it with jonebit.onebit_adam_zero(..., stage={stage}) (its state layout "
            "depends on the stage)"
        )
    if stage == 0:
        opt_state, opt_specs = sharded_init(tx, master, mesh, axis)
        param_specs = P()
        if per_rank:  # 0/1 Adam: every rank starts from the same copy
            ranks = int(mesh.shape[axis])
            master = RankParams(jax.jit(
                lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x[None], (ranks, *x.shape)), t),
                out_shardings=jax.NamedSharding(mesh, P(axis)))(master))
            param_specs = RankParams(P(axis))
    elif per_rank:
        raise ValueError(f"init_train_state: 0/1 Adam runs at ZeRO stage 0 only (its local steps move every rank's "
                         f"whole parameters); got zero_stage={stage}")
    else:
        master, opt_state, sh = init_zero(tx, master, mesh, stage=stage, axis=axis,
                                          offload_optimizer=offload_optimizer)
        spec_of = lambda s: s.spec  # noqa: E731
        param_specs, opt_specs = jax.tree.map(spec_of, sh.params), jax.tree.map(spec_of, sh.opt_state)
    scaling = loss_scaling if loss_scaling is not None else LossScaling(dynamic=False, static_scale=1.0)
    scalars = jax.device_put(
        (jnp.zeros([], jnp.int32), scaling.init(), jnp.zeros([], jnp.int32)), replicated)
    state = TrainState(step=scalars[0], params=master, opt_state=opt_state, loss_scale=scalars[1],
                       skipped=scalars[2])
    specs = train_state_specs(opt_specs)
    return state, specs._replace(params=param_specs)


def _compute_dtype(dtype):
    if dtype is None:
        return jnp.float32
    name = jnp.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in _COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be one of {sorted(_COMPUTE_DTYPES)}, got {dtype!r}")
    return _COMPUTE_DTYPES[name]


def _spec_tuple(spec) -> tuple:
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


def _same_specs(a, b) -> bool:
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    la, ta = jax.tree.flatten(a, is_leaf=is_spec)
    lb, tb = jax.tree.flatten(b, is_leaf=is_spec)
    return ta == tb and all(_spec_tuple(x) == _spec_tuple(y) for x, y in zip(la, lb, strict=True))


def copied_parameters(hlo_text: str) -> set[int]:
    """The entry parameters (by number) that an optimised HLO module copies whole: ``copy(%p)`` of a parameter."""
    entry = hlo_text[hlo_text.find("\nENTRY "):]
    names = dict(re.findall(r"%([\w.\-]+) = [^\n=]*? parameter\((\d+)\)", entry))
    return {int(names[p]) for p in re.findall(r"\bcopy\(%([\w.\-]+)\)", entry) if p in names}


def copied_fraction(hlo_text: str, arrays, first: int) -> float:
    """The fraction of the bytes of ``arrays`` (a tree whose leaves are the program's entry parameters ``first``,
    ``first + 1``, ...) that an optimised HLO module copies whole (0 for a tree of no bytes)."""
    sizes = [np.size(x) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(arrays)]
    copied = copied_parameters(hlo_text)
    return sum(b for i, b in enumerate(sizes) if first + i in copied) / sum(sizes) if sum(sizes) else 0.0


class _KeptOptState:
    """A step compiled with the optimizer state passed apart and not donated, called like the plain one."""

    def __init__(self, program):
        self.program = program

    def __call__(self, state: TrainState, batch):
        return self.program(state._replace(opt_state=None), state.opt_state, batch)

    def as_text(self) -> str:
        return self.program.as_text()


def make_train_step(
    loss_fn: Callable[[Any, Any], Any],
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    specs: TrainState,
    *,
    accumulation_steps: int = 1,
    compute_dtype: Any = None,
    loss_scaling: LossScaling | None = None,
    grad_reduce: str | None = None,
    axis: str = "data",
    has_aux: bool = False,
    rng_seed: int | None = None,
    donate: bool = True,
    zero_stage: int = 0,
    offload_optimizer: bool = False,
    mpi_comm: Any = None,
    per_phase: bool = True,
    quantized_weights: bool = False,
):
    """Builds ``step(state, batch) -> (state, metrics)``, jitted.

    Args:
      loss_fn: ``loss_fn(params, micro_batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``): the mean loss of a
        micro-batch of this rank's shard; ``params`` arrive in ``compute_dtype``.
      tx: the optimizer. With ``grad_reduce=None`` it receives each rank's local gradient and must communicate
        itself (``jonebit.onebit_adam``); with ``"mean"`` it receives the gradient averaged over ranks.
      mesh: mesh with the data axis ``axis``.
      specs: the specs returned by :func:`init_train_state`.
      accumulation_steps: micro-batches per optimizer step; the batch's leading dimension, per rank, must be a
        multiple of it. Gradients are summed in float32 and averaged.
      compute_dtype: ``float32`` (default), ``bfloat16`` or ``float16`` for the forward/backward pass.
      loss_scaling: a :class:`LossScaling` (fp16); ``None`` means a constant scale of 1.
      grad_reduce: ``None`` (local gradients to ``tx``) or ``"mean"`` (fp32 all-reduce first; at ZeRO stages
        1-3 a reduce-scatter into the ZeRO layout).
      has_aux: ``loss_fn`` returns ``(loss, aux)``; the aux pytree, averaged over micro-batches and ranks, is
        returned in ``metrics["aux"]``.
      rng_seed: when given, ``loss_fn(params, micro_batch, rng)`` receives a PRNG key (dropout, masking) derived
        from the seed, the optimizer step, the rank and the micro-batch index. It depends on nothing else, so a
        run resumed from a checkpoint draws exactly the keys of an uninterrupted one.
      donate: donate the state's buffers to the step.
      zero_stage: the ZeRO stage the state was made with (:func:`init_train_state`); standard optimizers need
        ``grad_reduce="mean"`` at stages 1-3, 1-bit optimizers ``grad_reduce=None``.
      offload_optimizer: the optimizer state lives in host memory (as made by :func:`init_train_state`).
      mpi_comm: an mpi4py communicator (or :class:`~jonebit.comm.MPIBackend`) when this process is one rank of
        an MPI job (``mpirun``) and ``tx`` communicates over the same communicator (``onebit_adam(...,
        mpi_comm=...)``). Needs ``grad_reduce=None``, ZeRO stage 0 and a mesh of this process's one device. The
        step's scalars (loss, aux, and the squared gradient norm, whose finiteness decides the skip) are then
        also averaged over the MPI processes, in one small MPI collective, so metrics are global and every
        rank skips together; ``batch`` is this process's slice of the global batch.
      per_phase: compile one program per phase of a 1-bit optimizer, picked on the host before each step from
        the phase the state says comes next (:mod:`jonebit.transforms.phases`); ``False``: one program with
        every phase, switched on the device.
      quantized_weights: at ZeRO stage 3 with a standard optimizer, gather the parameters as int8 with a float32
        scale per block of 256 (ZeRO++'s qwZ; :mod:`jonebit.comm.quantized_gather`): about a quarter of
        float32's bytes and half of bf16's; the master parameters and the gradients stay exact.

    Returns:
      ``step(state, batch)``: ``batch`` is the global batch (leaves with a leading dimension of
      ``ranks x accumulation_steps x micro-batch``), split over ``axis`` by the step. ``metrics`` holds
      ``loss`` (mean over micro-batches and ranks, unscaled), ``grad_norm`` (of the averaged gradient with
      ``grad_reduce="mean"``; with local gradients, the root mean square over ranks of the local norms),
      ``loss_scale`` (the scale this step used) and ``skipped`` (bool).
    """
    if grad_reduce not in _REDUCE:
        raise ValueError(f"grad_reduce must be one of {_REDUCE}, got {grad_reduce!r}")
    if quantized_weights and (zero_stage != 3 or grad_reduce is None):
        raise ValueError("make_train_step: quantized_weights quantizes ZeRO stage 3's parameter gather: it needs "
                         f"zero_stage=3 and a standard optimizer (grad_reduce=\"mean\"); got zero_stage="
                         f"{zero_stage}, grad_reduce={grad_reduce!r}")
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int | np.integer) \
            or accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be an int >= 1, got {accumulation_steps!r}")
    if axis not in mesh.shape:
        raise ValueError(f"mesh has axes {tuple(mesh.shape)}, not the data axis {axis!r}")
    if not isinstance(specs, TrainState):
        raise TypeError("specs must be the TrainState of specs returned by init_train_state(...)")
    dtype = _compute_dtype(compute_dtype)
    if loss_scaling is not None and not isinstance(loss_scaling, LossScaling):
        raise TypeError(f"loss_scaling must be a LossScaling or None, got {type(loss_scaling).__name__}")
    scaling = loss_scaling if loss_scaling is not None else LossScaling(dynamic=False, static_scale=1.0)
    k = int(accumulation_steps)
    unit_scale = not scaling.dynamic and scaling.static_scale == 1.0  # fp32 / bf16: no loss scaling to apply
    ranks = mesh.shape[axis]
    stage = _check_zero_args(zero_stage, offload_optimizer, "make_train_step")

    if rng_seed is not None and (isinstance(rng_seed, bool) or not isinstance(rng_seed, int | np.integer)):
        raise TypeError(f"rng_seed must be an int or None, got {rng_seed!r}")

    onebit = find_onebit_state(specs.opt_state)
    if onebit is not None and onebit_stage(onebit) != stage:
        raise ValueError(
            f"make_train_step: zero_stage={stage} but specs hold the state of a 1-bit optimizer built for ZeRO "
            f"stage {onebit_stage(onebit)}; pass the zero_stage given to init_train_state"
        )
    if stage and onebit is not None and grad_reduce is not None:
        raise ValueError("make_train_step: 1-bit optimizers communicate themselves and take local gradients: "
                         f"use grad_reduce=None (got {grad_reduce!r})")
    if stage and onebit is None and grad_reduce is None:
        raise ValueError(
            f"make_train_step: at ZeRO stage {stage} the step reduce-scatters the averaged gradient into the "
            "optimizer's partitions: use grad_reduce=\"mean\" (local gradients, grad_reduce=None, are for 1-bit "
            "optimizers, which communicate themselves)"
        )
    flat = isinstance(specs.params, FlatParams)
    per_rank = isinstance(specs.params, RankParams)
    mpi = _mpi_backend(mpi_comm, grad_reduce, stage, mesh)
    # The rank id of this device among all data-parallel ranks (MPI processes x local devices), for the rng.
    rank_offset = 0 if mpi is None else mpi.rank * ranks

    def local_grads(local, step_count, scale, batch, uncast=None, fn=loss_fn):
        """This rank's gradient, summed in float32 over the micro-batches and divided by ``k x scale``."""
        rng = None
        if rng_seed is not None:
            rng = jax.random.fold_in(jax.random.fold_in(jax.random.key(int(rng_seed)), step_count),
                                     lax.axis_index(axis) + rank_offset)
        return local_gradients(fn, local, batch, axis=axis, accumulation_steps=k, compute_dtype=dtype,
                               scale=None if unit_scale else scale, has_aux=has_aux, rng=rng, uncast=uncast)

    def loss_metrics(losses, auxes, scale, overflow, grad_norm):
        metrics = {
            "loss": lax.pmean(jnp.mean(losses), axis),
            "grad_norm": grad_norm,
            "loss_scale": scale,
            "skipped": overflow,
        }
        if has_aux:
            metrics["aux"] = jax.tree.map(lambda a: lax.pmean(jnp.mean(jnp.asarray(a, jnp.float32), 0), axis), auxes)
        return metrics

    def taken_and_norm_sq(grads):
        """The gradient the optimizer takes (the mean over the ranks with ``grad_reduce="mean"``, else this rank's
        own) and the squared norm the skip decision reads (of that mean, or the ranks' mean of their own)."""
        if grad_reduce == "mean":
            grads = reduce(grads, grad_reduce, axis)
            return grads, norm_sq(grads)
        return grads, lax.pmean(norm_sq(grads), axis)

    def update_unless(overflow, params, opt_state, grads, opt_in, tx_params, rewrap):
        """``(params, opt_state)`` after one update, or both as they came in where ``overflow``."""
        new, new_opt = apply_optimizer(tx, grads, opt_in, tx_params)
        return keep_if(overflow, params, rewrap(new)), keep_if(overflow, opt_state, new_opt)

    def body(state: TrainState, batch):
        """Stage 0, and the 1-bit optimizers at every stage: the whole step in the per-device view."""
        # 1-bit ZeRO-3's chunks are gathered in the compute dtype (the cast commutes with the gather).
        local, tx_params, rewrap = local_view(state.params, axis, dtype)
        fn, uncast = flat_layers_loss(loss_fn, state.params, axis, dtype)
        scale = state.loss_scale.scale
        grads, losses, auxes = local_grads(local, state.step, scale, batch, uncast, fn)
        grads, losses, opt_in = after_backward(state.params, grads, losses, state.opt_state)

        grads, grad_norm_sq = taken_and_norm_sq(grads)
        if grad_reduce != "mean" and mpi is not None:  # the scalars, over the MPI processes too (one collective)
            grad_norm_sq, losses, auxes = _mpi_scalars(mpi, grad_norm_sq, losses, auxes)
        grad_norm = jnp.sqrt(grad_norm_sq)
        overflow = nonfinite(grad_norm_sq)

        params, opt_state = update_unless(overflow, state.params, state.opt_state, grads, opt_in, tx_params, rewrap)
        new = TrainState(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            loss_scale=scaling.update(state.loss_scale, overflow),
            skipped=state.skipped + overflow.astype(jnp.int32),
        )
        return new, loss_metrics(losses, auxes, scale, overflow, grad_norm)

    batch_sharding = jax.NamedSharding(mesh, P(axis))
    replicated = jax.NamedSharding(mesh, P())
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    state_shardings = TrainState(
        step=replicated,
        params=to_shardings(specs.params, mesh),
        opt_state=to_shardings(specs.opt_state, mesh, OFFLOAD_MEMORY_KIND if offload_optimizer else None),
        loss_scale=jax.tree.map(lambda _: replicated, specs.loss_scale, is_leaf=is_spec),
        skipped=replicated,
    )
    state_dev = jax.tree.map(lambda s: s.with_memory_kind("device"), state_shardings.opt_state)
    donated = (0,) if donate else ()

    if stage == 0:
        # Under MPI the mesh is one device and the transform's collectives are mpi4jax's, outside jax's
        # varying-axis types (with one rank its mean is the identity, which leaves the update "varying").
        fn = per_device(body, mesh, in_specs=(specs, P(axis)), out_specs=(specs, P()), check_vma=mpi is None)
        jit_kw = dict(donate_argnums=donated)
    elif onebit is not None:
        mapped = per_device(body, mesh, in_specs=(specs, P(axis)), out_specs=(specs, P()))

        def fn(state: TrainState, batch):
            if offload_optimizer:
                state = state._replace(opt_state=jax.device_put(state.opt_state, state_dev))
            return mapped(state, batch)

        jit_kw = dict(in_shardings=(state_shardings, batch_sharding), out_shardings=(state_shardings, replicated),
                      donate_argnums=donated)
    else:
        fn = _zero_step(local_grads, loss_metrics, tx, mesh, specs, scaling, dtype, axis, state_dev,
                        state_shardings, offload_optimizer, quantized_weights)
        jit_kw = dict(in_shardings=(state_shardings, batch_sharding), out_shardings=(state_shardings, replicated),
                      donate_argnums=donated)

    programs: dict = {}
    # Read once: a state without phases (every standard optimizer) needs no walk of its tree on every step.
    phased = has_phases(specs.opt_state)

    def jitted_for(phases):
        """``(jitted, keep_state)`` for the phases (``None``: every phase in one program), built once each: a jit
        object traces once per shape, so each phase needs its own."""
        if phases not in programs:
            def traced(state: TrainState, batch):
                with fixed_phases(phases):
                    return fn(state, batch)

            # At stage 0 also the same step with the optimizer state passed apart and not donated (``compiled``),
            # for a standard optimizer: the 1-bit family's states (those with phases) keep their donation. (Under MPI
            # the step runs the jit object itself, never a program ``compiled`` chose.)
            keep = jax.jit(lambda rest, opt_state, batch: traced(rest._replace(opt_state=opt_state), batch),
                           donate_argnums=(0,)) if stage == 0 and donate and mpi is None and not phased else None
            programs[phases] = jax.jit(traced, **jit_kw), keep
        return programs[phases]

    def donation_copies_state(state: TrainState) -> bool:
        """Whether a donating step of a standard optimizer would copy at least 90% of the optimizer state's bytes
        whole, judged from the part of the step where such copies come from: the optimizer's update and the skip's
        decision and selects, compiled alone from the gradients with the parameters and optimizer state donated (an
        elementwise program, a fraction of the whole step's compile; its parameters: those of params, then those of
        the state)."""
        if not any(np.size(x) for x in jax.tree.leaves(state.opt_state)):  # nothing to copy (e.g. plain SGD)
            return False

        def update_alone(params, opt_state, grads):
            grads, grad_norm_sq = taken_and_norm_sq(jax.tree.map(lambda g: g[0], grads))
            return update_unless(nonfinite(grad_norm_sq), params, opt_state, grads, opt_state, params, lambda x: x)

        mapped = per_device(update_alone, mesh, in_specs=(specs.params, specs.opt_state, P(axis)),
                            out_specs=(specs.params, specs.opt_state))
        sds = lambda x, sharding: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)  # noqa: E731
        params, opt_state = (jax.tree.map(lambda x: sds(x, getattr(x, "sharding", replicated)), t)
                             for t in (state.params, state.opt_state))
        grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct((ranks, *np.shape(p)), p.dtype, sharding=batch_sharding),
                             state.params)  # one gradient per rank
        text = jax.jit(mapped, donate_argnums=(0, 1)).lower(params, opt_state, grads).compile().as_text()
        return copied_fraction(text, state.opt_state, first=len(jax.tree.leaves(state.params))) >= 0.9

    def phases_of(state: TrainState):
        """The phases the next update runs (read from the state), or None for the one program with every phase."""
        return next_phases(state.opt_state) if per_phase and phased else None

    jitted = jitted_for(None)[0]

    def step(state: TrainState, batch):
        for path, x in jax.tree_util.tree_leaves_with_path(batch):
            shape = np.shape(x)
            if len(shape) == 0 or shape[0] % (ranks * k):
                raise ValueError(
                    f"batch leaf {jax.tree_util.keystr(path)} has shape {tuple(shape)}: its leading dimension must "
                    f"be a multiple of ranks x accumulation_steps = {ranks} x {k} = {ranks * k}"
                )
        batch = jax.device_put(batch, batch_sharding)
        if mpi is not None:  # mpi4jax's ordered effects thread a token that only jit's own dispatch supplies
            return jitted_for(phases_of(state))[0](state, batch)
        return compiled(state, batch)(state, batch)

    cache: dict = {}

    def check_layout(state: TrainState):
        """The state must be laid out for this step's ZeRO stage (jit would reshard it silently, or fail deep)."""
        if stage == 0 or onebit is not None:  # 1-bit layouts: checked by the stage recorded in the state
            return
        want = zero_specs(mesh, state.params, state.opt_state, stage=stage, axis=axis)
        if not (_same_specs(want[0], specs.params) and _same_specs(want[2], specs.opt_state)):
            raise ValueError(
                f"make_train_step(zero_stage={stage}): specs do not hold the stage-{stage} layout of this state; "
                f"make state and specs with init_train_state(..., zero_stage={stage})"
            )
        kinds = {getattr(x.sharding, "memory_kind", None) for x in jax.tree.leaves(state.opt_state)}
        if kinds and (OFFLOAD_MEMORY_KIND in kinds) != offload_optimizer:
            raise ValueError(
                f"make_train_step(offload_optimizer={offload_optimizer}): the optimizer state lives in "
                f"{sorted(str(x) for x in kinds)} memory; pass the offload_optimizer given to init_train_state"
            )

    def compiled(state: TrainState, batch):
        """The compiled step for these argument shapes (compiled once; its HLO text gives the traffic).

        At stage 0 a donated optimizer state can cost more than it saves: where the compiler recomputes the new
        moments inside both of their consumers (the skip's select, written in place, and the parameter update),
        it first copies every donated moment whole (XLA:CPU does, for optax's Adam). A program whose copies hold
        at least 90% of the optimizer state's bytes is replaced by the same step with the optimizer state not
        donated: nearly the same peak memory (the copies were that large) without the copying. Other programs
        keep the donation; the 1-bit family's always do (their error buffers, most of their state, are updated in
        place, never copied). Which of the two a standard optimizer's step is, is judged before the step is
        compiled (``donation_copies_state``): it compiles once.
        """
        phases = phases_of(state)
        # One walk of the tree per step (this runs on the host before every step; dtypes hash as they are).
        leaves, treedef = jax.tree.flatten((state, batch))
        key = phases, treedef, tuple((np.shape(x), getattr(x, "dtype", type(x))) for x in leaves)
        if key not in cache:
            check_layout(state)
            batch = jax.device_put(batch, batch_sharding)
            jitted, keep_state = jitted_for(phases)
            if keep_state is not None and donation_copies_state(state):
                kept = keep_state.lower(state._replace(opt_state=None), state.opt_state, batch).compile()
                program = _KeptOptState(kept)
            else:
                program = jitted.lower(state, batch).compile()
            cache[key] = program
        return cache[key]

    def tx_report(state: TrainState):
        """The optimizer's own collectives (per stage branch), from its compiled update alone."""
        from jonebit.comm.accounting import comm_report
        from jonebit.train.data_parallel import make_update

        update = make_update(tx, mesh, specs.opt_state, axis=axis, grad_reduce=None)
        stacked = jax.tree.map(
            lambda p: jax.ShapeDtypeStruct((ranks, *p.shape), jnp.float32, sharding=batch_sharding), state.params)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                (state.params, state.opt_state))
        return comm_report(update.lower(*abstract, stacked).compile().as_text(), mesh.size)

    def onebit_zero_report(state: TrainState):
        """Like ``tx_report`` for 1-bit Adam under ZeRO (its branches are the phases its state names)."""
        from jonebit.comm.accounting import comm_report

        def body(params, opt_state, grads):
            return apply_optimizer(tx, jax.tree.map(lambda g: g[0], grads), opt_state,
                                   params.chunks if flat else params)

        out_params = specs.params.chunks if flat else specs.params
        mapped = per_device(body, mesh, in_specs=(specs.params, specs.opt_state, P(axis)),
                            out_specs=(out_params, specs.opt_state))
        if flat:
            layout = state.params.layout
            whole = layout.treedef.unflatten([jax.ShapeDtypeStruct(s, jnp.float32) for s in layout.shapes])
        else:
            whole = state.params
        stacked = jax.tree.map(
            lambda p: jax.ShapeDtypeStruct((ranks, *p.shape), jnp.float32, sharding=batch_sharding), whole)
        sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
        params = jax.tree.map(lambda x: sds(x, x.sharding), state.params)
        opt_state = jax.tree.map(sds, state.opt_state, state_dev)
        return comm_report(jax.jit(mapped).lower(params, opt_state, stacked).compile().as_text(), mesh.size)

    step.jitted = jitted
    step.compiled = compiled
    step.phases_of = phases_of
    step.mpi = mpi  # the loop reads the MPI rank and world size from it
    # The loop's bytes_sent reads the compiled programs. Not counted (NaN): mpi4jax's traffic, which is not in
    # them, and 0/1 Adam's, whose nested phases (variance, 1-bit, local, sync) the per-stage report does not
    # model (benchmarks/family_bytes.py has their bytes).
    step.counts_bytes = mpi is None and not per_rank
    # With grad_reduce="mean" the optimizer is a local computation; its only traffic is the engine's own (the
    # ZeRO path's parameter all-gathers included: its update is not inside a conditional).
    step.tx_report = None if grad_reduce is not None or mpi is not None else (
        tx_report if stage == 0 else onebit_zero_report)
    return step


def _zero_step(local_grads, loss_metrics, tx, mesh, specs: TrainState, scaling: LossScaling, dtype, axis: str,
               state_dev, state_shardings: TrainState, offload: bool, quantize: bool = False):
    """The step of a standard optimizer at ZeRO stage 1-3 (global view around one ``shard_map``)."""
    size = mesh.shape[axis]

    def grad_spec(path, p, pspec):
        """Where this rank's share of the mean gradient lands: the param's shard (stage 3), else the optimizer
        state's layout (stages 1 and 2; at stage 1 a reduce-scatter plus the update's all-gather moves stage 0's
        bytes, see :func:`jonebit.train.zero._update_grad_specs`)."""
        if axis_dim(pspec, axis) is not None:
            return pspec
        return leaf_spec(p.shape, mesh, axis, pspec, what="grads", first=int(is_stacked(path)))

    def step(state: TrainState, batch):
        param_specs = specs.params
        grad_specs = jax.tree_util.tree_map_with_path(grad_spec, state.params, param_specs)

        def grads_body(params, step_count, scale, batch):
            # Stage 3: gather each shard once per optimizer step, in the compute dtype (the cast commutes with
            # the gather); all-gather results already vary over the axis, so autodiff adds no collective.
            local = gather_shards(params, param_specs, axis, dtype, quantize)
            # Stacked layers (stage 3): each layer's shards cast and gathered where it runs, gradients reduced in
            # float32.
            layerwise, mine = layerwise_gathering(params, param_specs, axis, compute_dtype=dtype,
                                                  reduce_dtype=jnp.float32, quantize=quantize)
            with layerwise:
                grads, losses, auxes = local_grads(local, step_count, scale, batch, mine)
            grads = reduce_scatter(grads, grad_specs, axis, size, param_specs)
            grad_norm_sq = sharded_norm_sq(grads, grad_specs, axis)
            return grads, loss_metrics(losses, auxes, scale, nonfinite(grad_norm_sq), jnp.sqrt(grad_norm_sq))

        grads, metrics = per_device(
            grads_body, mesh, in_specs=(param_specs, P(), P(), P(axis)), out_specs=(grad_specs, P()),
        )(state.params, state.step, state.loss_scale.scale, batch)
        overflow = metrics["skipped"]

        opt_state = jax.device_put(state.opt_state, state_dev) if offload else state.opt_state
        new_params, new_opt = apply_optimizer(tx, grads, opt_state, state.params)
        # A skipped step keeps every leaf bit-identical (a select, not a conditional: the parameter all-gather of
        # stages 1-2 then runs unconditionally and the compiled program's accounting sees it every step).
        params = keep_if(overflow, state.params, jax.tree.map(jax.sharding.reshard, new_params, state_shardings.params))
        opt_state = keep_if(overflow, opt_state, jax.tree.map(jax.sharding.reshard, new_opt, state_dev))
        new = TrainState(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            loss_scale=scaling.update(state.loss_scale, overflow),
            skipped=state.skipped + overflow.astype(jnp.int32),
        )
        return new, metrics

    return step


def _mpi_backend(mpi_comm, grad_reduce, stage: int, mesh):
    """The :class:`MPIBackend` of ``make_train_step(mpi_comm=...)`` (``None`` without one), its arguments checked."""
    if mpi_comm is None:
        return None
    from jonebit.comm.backends import MPIBackend

    if grad_reduce is not None or stage:
        raise ValueError(
            "make_train_step: mpi_comm is for 1-bit optimizers that communicate over MPI themselves, at ZeRO stage 0 "
            f"(grad_reduce=None, zero_stage=0); got grad_reduce={grad_reduce!r}, zero_stage={stage}")
    if mesh.size != 1:
        raise ValueError(
            f"make_train_step: with mpi_comm each MPI process is one data-parallel rank and owns one device; the mesh "
            f"has {mesh.size} ({dict(mesh.shape)}). Start one process per device (mpirun -np <devices>) and give "
            "each a mesh of its own device")
    return mpi_comm if isinstance(mpi_comm, MPIBackend) else MPIBackend(mpi_comm)


def _mpi_scalars(mpi, norm_sq, losses, auxes):
    """Averages the step's scalars over the MPI processes in one collective (after the mesh axis's own mean).

    Returns ``(norm_sq, losses, auxes)`` with ``losses``/``auxes`` reduced to one global entry each
    (``loss_metrics`` then averages a single row). A rank's inf/NaN makes the mean of the squared norms
    non-finite, so :func:`_overflow` skips the step on every rank.
    """
    tree = {"norm_sq": norm_sq, "loss": jnp.mean(losses),
            "aux": jax.tree.map(lambda a: jnp.mean(jnp.asarray(a, jnp.float32), 0), auxes)}
    out = mpi.mean(tree)
    aux = jax.tree.map(lambda a: a[None], out["aux"])
    return out["norm_sq"], out["loss"][None], aux
