"""``jonebit.train.initialize``: a DeepSpeed config in, a ready engine out (``deepspeed.initialize``'s role).

    engine = initialize("ds_config.json", loss_fn, params)        # mesh: every device on axis "data"
    engine.train(batches, LoopConfig(output_dir="run", max_steps=1000))

The config decides the optimizer (with its schedule and clipping), the batch arithmetic (``train_batch_size =
micro x accumulation x data-parallel size``), the precision (``fp16`` with DeepSpeed's loss scaler, ``bf16``,
or fp32), the ZeRO stage (``zero_optimization.stage`` 0-3, with ``offload_optimizer.device: "cpu"`` keeping the
optimizer state in host memory; 1-bit Adam is built for the stage and keeps its own layouts) and
``steps_per_print``. What the engine does per step is described in :mod:`jonebit.train.engine`;
the loop (checkpoints, metrics, resume) in :mod:`jonebit.train.loop`.

With ``optimizer.params.comm_backend_name: "mpi"`` (OneBitAdam / OneBitLamb / ZeroOneAdam, ZeRO stage 0) the
script runs under ``mpirun``, one process per device: each process is one data-parallel rank with a one-device mesh, the
optimizer communicates over a duplicate of ``MPI.COMM_WORLD`` (mpi4jax), the batch arithmetic counts the MPI world
size, each process feeds its own slice of every global batch (``ArrayBatches(..., shard=(engine.process_index,
engine.process_count))``), and the loop checkpoints per rank (see :mod:`jonebit.train.loop`).

With ``ZeroOneAdam`` the state keeps one parameter copy per rank (:class:`~jonebit.train.engine.RankParams`),
since its local steps move each rank's own; :attr:`Engine.params` gives rank 0's copy.

Gradient clipping (``gradient_clipping``) is applied where DeepSpeed applies it: with standard optimizers to the
gradient averaged over ranks; with 1-bit Adam (ZeRO stage 0) to the averaged gradient during warmup and to each
rank's local gradient in the compression stage, where no averaged gradient exists. 0/1 Adam, 1-bit LAMB and
1-bit Adam under ZeRO stages 1-3 clip each rank's local gradient in both stages.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jonebit.sharding.mesh import data_mesh
from jonebit.train.config import (
    ONEBIT_OPTIMIZERS,
    BatchSizes,
    ConfigError,
    DeepSpeedConfig,
    build_optimizer,
    build_schedule,
    load_config,
)
from jonebit.train.engine import LossScaling, TrainState, init_train_state, make_train_step, model_params
from jonebit.train.loop import ArrayBatches, LoopConfig, ResumableIterator, train
from jonebit.transforms.base import takes_local_gradients

__all__ = ["Engine", "initialize", "loss_scaling_from_config"]


def loss_scaling_from_config(config: DeepSpeedConfig) -> LossScaling | None:
    """The engine's :class:`LossScaling` of the ``fp16`` section (``None`` without fp16)."""
    f = config.fp16
    if not f.enabled:
        return None
    if f.dynamic:
        return LossScaling(dynamic=True, initial_scale_power=int(f.initial_scale_power),
                           scale_window=int(f.loss_scale_window), hysteresis=int(f.hysteresis),
                           min_scale=float(f.min_loss_scale), consecutive_hysteresis=bool(f.consecutive_hysteresis))
    return LossScaling(dynamic=False, static_scale=float(f.loss_scale))


@dataclasses.dataclass
class Engine:
    """What :func:`initialize` builds; ``state`` changes as the engine trains.

    Attributes:
      config: the parsed DeepSpeed config.
      batch: the resolved batch sizes.
      tx: the optimizer (schedule and clipping included).
      step: ``step(state, global_batch) -> (state, metrics)`` (see :func:`jonebit.train.engine.make_train_step`).
      state: the current :class:`~jonebit.train.engine.TrainState` (at ZeRO stage 3 with 1-bit Adam its params
        are :class:`~jonebit.train.onebit_zero.FlatParams`, with 0/1 Adam one copy per rank,
        :class:`~jonebit.train.engine.RankParams`; :attr:`params` gives the ordinary tree in every case).
      learning_rate: the schedule (a function of the optimizer's update count) or a constant.
      freeze_step: jonebit's ``freeze_step`` of a 1-bit optimizer (DeepSpeed's minus one), ``"auto"`` when the
        optimizer decides it (its state's ``freeze_at`` holds the decision), else ``None``.
      mesh: the data-parallel mesh (under MPI: this process's one device).
      mpi_comm: with ``comm_backend_name: "mpi"``, the engine's duplicate of ``MPI.COMM_WORLD`` (each process is
        one data-parallel rank and feeds its own slice of every global batch); else ``None``.
    """

    config: DeepSpeedConfig
    batch: BatchSizes
    tx: optax.GradientTransformation
    step: Callable
    state: TrainState
    learning_rate: Any
    freeze_step: int | str | None
    mesh: jax.sharding.Mesh
    mpi_comm: Any = None

    @property
    def params(self):
        """The model's parameter tree (float32 master weights; with 0/1 Adam rank 0's copy, which is what
        DeepSpeed's rank 0 saves), e.g. for evaluation or export."""
        return model_params(self.state.params)

    @property
    def process_index(self) -> int:
        """This process's MPI rank (0 without MPI)."""
        return 0 if self.mpi_comm is None else int(self.mpi_comm.Get_rank())

    @property
    def process_count(self) -> int:
        """The MPI world size (1 without MPI)."""
        return 1 if self.mpi_comm is None else int(self.mpi_comm.Get_size())

    def train(self, batches: ResumableIterator, loop: LoopConfig, **kw) -> TrainState:
        """Runs :func:`jonebit.train.loop.train` from ``self.state``; keeps the final state.

        Unless ``run_config`` is given, the DeepSpeed config is the run's config that each checkpoint keeps: a
        resumed run warns about each changed key and refuses a changed optimizer type, ZeRO stage or precision.

        Under MPI, ``batches`` yields this process's slice of each global batch, e.g.
        ``ArrayBatches(arrays, engine.batch.train_batch_size, shard=(engine.process_index, engine.process_count))``.
        """
        shard = getattr(batches, "shard", None)
        if self.mpi_comm is not None and isinstance(batches, ArrayBatches) and shard != (
                self.process_index, self.process_count):
            raise ValueError(
                f"Engine.train under MPI: ArrayBatches has shard={shard}, but this process is rank "
                f"{self.process_index} of {self.process_count} and must read only its slice of each global batch; "
                "pass shard=(engine.process_index, engine.process_count)")
        kw.setdefault("lr_schedule", self.learning_rate)
        # Saved with each checkpoint, so a resume says which settings changed and refuses those the state needs.
        kw.setdefault("run_config", self.config.to_dict())
        self.state = train(self.step, self.state, batches, loop, **kw)
        return self.state

    def loop_config(self, output_dir, max_steps: int, **kw) -> LoopConfig:
        """A :class:`LoopConfig` with the config's ``steps_per_print``."""
        kw.setdefault("steps_per_print", self.config.steps_per_print)
        return LoopConfig(output_dir=output_dir, max_steps=max_steps, **kw)


def compute_dtype(config):
    """The forward/backward dtype a config asks for: float16 (``fp16``), bfloat16 (``bf16``) or float32.

    Build the model in this dtype too (``BertForPreTraining(..., dtype=compute_dtype(config))``): the engine casts
    the float32 master parameters to it, but a Flax layer built with ``dtype=float32`` casts them back and runs its
    matmuls in float32.
    """
    return jnp.float16 if config.fp16.enabled else jnp.bfloat16 if config.bf16.enabled else jnp.float32


def initialize(
    config: str | os.PathLike | Mapping | DeepSpeedConfig,
    loss_fn: Callable,
    params: Any,
    *,
    mesh: jax.sharding.Mesh | None = None,
    axis: str = "data",
    exp_avg_mask: Any = None,
    has_aux: bool = False,
    rng_seed: int | None = None,
    tx: optax.GradientTransformation | None = None,
    fused: bool | None = None,
) -> Engine:
    """Builds an :class:`Engine` from a DeepSpeed config (a path, a dict or a parsed config).

    Args:
      config: the DeepSpeed config, accepted unchanged.
      loss_fn: ``loss_fn(params, micro_batch) -> loss`` (``(loss, aux)`` with ``has_aux``; a third argument
        ``rng`` with ``rng_seed``).
      params: the initial parameters (any float dtype; kept as float32 master weights).
      mesh: the data-parallel mesh (default: every device on one axis ``axis``; under MPI, this process's one
        device, chosen by its node-local rank; a given mesh must then have one device).
      exp_avg_mask: 1-bit Adam's momentum mask (e.g. :func:`jonebit.models.bert.position_embedding_mask`).
      has_aux, rng_seed: see :func:`jonebit.train.engine.make_train_step`.
      tx: an optax transformation replacing the config's optimizer section (the config may then omit it).
      fused: 1-bit Adam: one compression scale for the whole model (``True``) or one per tensor (``False``);
        default as :func:`jonebit.train.config.build_optimizer` decides (DeepSpeed's: fused with fp16).
    """
    if not isinstance(config, DeepSpeedConfig):
        config = load_config(config)
    opt = config.optimizer
    mpi_comm = None
    if opt is not None and opt.type in ONEBIT_OPTIMIZERS and opt.params.get("comm_backend_name") == "mpi":
        if tx is not None:
            raise ValueError(
                "initialize: optimizer.params.comm_backend_name is \"mpi\": the engine builds the MPI optimizer from "
                "the config (tx=... would bypass its communicator); drop tx, or set comm_backend_name to \"nccl\"")
        if mesh is not None and mesh.size != 1:
            raise ValueError(
                f"initialize: with comm_backend_name \"mpi\" each MPI process is one data-parallel rank with one "
                f"device; the mesh has {mesh.size} devices. Launch one process per device (mpirun -np <devices> "
                "python train.py) and leave mesh=None (each process then takes one of its local devices, by its "
                "node-local rank)")
        mpi_comm = _mpi_world()
        if mesh is None:
            mesh = _process_mesh(mpi_comm, axis)
    mesh = mesh if mesh is not None else data_mesh(axis=axis)
    if axis not in mesh.shape:
        raise ValueError(f"initialize: mesh has axes {tuple(mesh.shape)}, not the data axis {axis!r}")
    dp = int(mesh.shape[axis]) * (1 if mpi_comm is None else int(mpi_comm.Get_size()))
    batch = config.batch_sizes(dp)
    if tx is None:
        tx = build_optimizer(config, axis_name=axis, mpi_comm=mpi_comm, exp_avg_mask=exp_avg_mask, fused=fused)
        learning_rate = build_schedule(config.scheduler, opt)
    else:
        learning_rate = build_schedule(config.scheduler, opt) if opt is not None else None
    scaling = loss_scaling_from_config(config)
    compute = compute_dtype(config)
    zero = config.zero_optimization
    stage, offload = int(zero.stage), bool(zero.offload_optimizer.enabled)
    try:
        state, specs = init_train_state(tx, params, mesh, loss_scaling=scaling, axis=axis, zero_stage=stage,
                                        offload_optimizer=offload)
    except ValueError as e:  # the backend cannot offload, or a given tx was built for another stage: name the key
        if "offload" in str(e):
            raise ConfigError("zero_optimization.offload_optimizer.device", str(e)) from e
        if "zero_stage" in str(e):
            raise ConfigError("zero_optimization.stage", str(e)) from e
        raise
    # A 1-bit optimizer (from the config or given) does its own communication on local gradients.
    onebit = takes_local_gradients(state.opt_state)
    if onebit and zero.zero_quantized_weights:
        raise ConfigError("zero_optimization.zero_quantized_weights",
                          "the 1-bit optimizers gather their stage-3 parameters themselves, unquantized; drop the key")
    freeze_step = None
    if onebit and opt is not None and opt.type in ONEBIT_OPTIMIZERS and "freeze_step" in opt.params:
        f = opt.params["freeze_step"]
        freeze_step = "auto" if f == "auto" else int(f) - 1
    step = make_train_step(
        loss_fn, tx, mesh, specs, accumulation_steps=batch.gradient_accumulation_steps, compute_dtype=compute,
        loss_scaling=scaling, grad_reduce=None if onebit else "mean", axis=axis, has_aux=has_aux,
        rng_seed=rng_seed, zero_stage=stage, offload_optimizer=offload, mpi_comm=mpi_comm,
        quantized_weights=bool(zero.zero_quantized_weights),
    )
    return Engine(config=config, batch=batch, tx=tx, step=step, state=state, learning_rate=learning_rate,
                  freeze_step=freeze_step, mesh=mesh, mpi_comm=mpi_comm)


def _mpi_world():
    """A duplicate of ``MPI.COMM_WORLD`` (the engine's collectives stay apart from the script's own MPI calls)."""
    try:
        import mpi4jax  # noqa: F401
        from mpi4py import MPI
    except ImportError as e:
        raise ConfigError(
            "optimizer.params.comm_backend_name",
            f"\"mpi\" needs mpi4py and mpi4jax ({e}): pip install 'jonebit[mpi]', then launch with "
            "mpirun -np <ranks> python train.py; or use \"nccl\" (jax collectives over this process's devices)",
        ) from e
    return MPI.COMM_WORLD.Dup()


def _process_mesh(comm, axis: str) -> jax.sharding.Mesh:
    """A one-device mesh for this MPI process: local device ``node-local rank mod local device count``."""
    from jax.sharding import AxisType
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        local_rank = int(local.Get_rank())
    finally:
        local.Free()
    devices = jax.local_devices()
    device = devices[local_rank % len(devices)]
    return jax.make_mesh((1,), (axis,), axis_types=(AxisType.Explicit,), devices=[device])
