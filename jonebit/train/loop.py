"""The training loop: checkpoints that resume exactly, metrics, progress.

:func:`train` runs a step built by :func:`jonebit.train.engine.make_train_step` until ``max_steps``:

* **checkpoints** with orbax's ``CheckpointManager`` every ``checkpoint_every`` steps (asynchronously, the last
  ``keep_checkpoints`` kept), at the end, and when the process receives SIGTERM or SIGINT (the step in flight
  finishes, a checkpoint is written, then :class:`Preempted` is raised). A checkpoint holds the whole
  :class:`~jonebit.train.engine.TrainState` (params, optimizer state with the per-rank 1-bit error buffers, step,
  skip count, loss-scale state) and, as JSON, the data iterator's position and the world size. The engine's random
  keys are derived from the step, so restoring these gives bit-identical continuation.
* **metrics**: one JSON line per logged step in ``OUTPUT/metrics.jsonl`` (``step``, ``loss``, ``lr``,
  ``loss_scale``, ``skipped``, ``grad_norm``, ``stage``, ``bytes_sent``, ``tokens_per_s``, ``seconds``, and any
  ``aux`` scalars; ``seconds`` is the mean wall time per step since the previous line, the first line
  includes compilation), the same scalars as TensorBoard event files in ``OUTPUT/tensorboard`` (tensorboardX), a tqdm
  bar, and a console line every ``steps_per_print`` steps.
* **MPI** (a step built with ``mpi_comm``, e.g. ``initialize`` with ``comm_backend_name: "mpi"`` under
  ``mpirun``): rank 0 alone writes metrics, TensorBoard and the bar (``bytes_sent`` is NaN: mpi4jax's traffic is
  not in the compiled program); each rank checkpoints into ``checkpoints/rank-<r>/`` (its error buffers and data
  position are its own), resumes from the newest step all ranks hold, and only with the same world size; a
  signal stops every rank after the same step.
* **non-finite steps**: the engine skips them on every rank; ``nonfinite="raise"`` stops the run instead, with
  the step number (checked every step, which costs one device-to-host sync per step).

``bytes_sent`` is this rank's collective traffic for the step, read once per compiled program from its HLO
(:mod:`jonebit.comm.accounting`): the engine's own collectives plus the optimizer's in the phase the step ran (1-bit
optimizers compile one program per phase, e.g. ``"warmup"`` or ``"compression"``, the ``stage`` of the record;
other optimizers: ``"full"``). A skipped step sends what its program sends (the skip is a select after the update;
the one program with every phase, ``per_phase=False``, reports only the engine's own bytes for it).
It is NaN under MPI and with 0/1 Adam, whose variance, 1-bit, local and sync steps the loop does not tell apart
(``benchmarks/family_bytes.py`` has their bytes).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import pathlib
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import jax
import numpy as np

from jonebit.train.checkpoint import manager_handlers
from jonebit.train.engine import TrainState
from jonebit.train.schedules import bad_learning_rate, check_schedule, lr_problem
from jonebit.transforms.base import last_phase, phase_names

log = logging.getLogger(__name__)

__all__ = ["ArrayBatches", "LoopConfig", "Preempted", "RESUME_FIXED", "ResumableIterator", "train"]

# Settings of a ``run_config`` (dotted paths into the DeepSpeed config) that a checkpoint cannot be resumed
# under when changed: the optimizer state, its partitioning and the loss-scale state were built for them.
RESUME_FIXED = ("optimizer.type", "zero_optimization.stage", "fp16.enabled", "bf16.enabled")


class ResumableIterator(Protocol):
    """A batch iterator whose position can be saved and restored (JSON-serialisable)."""

    def __next__(self) -> Any: ...

    def get_state(self) -> dict: ...

    def set_state(self, state: dict) -> None: ...


class ArrayBatches:
    """Global batches drawn from in-memory arrays, reshuffled each epoch from ``seed`` (deterministic).

    Args:
      arrays: a dict of arrays with the same leading dimension (the examples).
      batch_size: global batch size (examples per optimizer step, all ranks and micro-batches together).
      seed: shuffling seed; epoch ``e`` uses the permutation of ``default_rng([seed, e])``.
      shuffle: shuffle each epoch (``False``: the stored order).
      collate: turns the selected rows (a dict of arrays) into the batch (e.g. padding masks, label arrays).
      shard: ``(process_index, process_count)``: each process of a multi-host job reads only its contiguous
        ``batch_size / process_count`` rows of every global batch (all processes draw the same permutation).

    The position is ``(epoch, index)``; incomplete final batches of an epoch are dropped. ``arrays`` may be
    memory-mapped: only the rows of each batch are read.
    """

    def __init__(self, arrays: dict[str, np.ndarray], batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 collate: Callable[[dict], Any] | None = None, shard: tuple[int, int] = (0, 1)):
        if not isinstance(arrays, dict) or not arrays:
            raise ValueError("ArrayBatches: arrays must be a non-empty dict of arrays")
        sizes = {k: len(v) for k, v in arrays.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"ArrayBatches: arrays have different lengths {sizes}")
        self.n = next(iter(sizes.values()))
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= self.n:
            raise ValueError(f"ArrayBatches: batch_size must be an int in [1, {self.n}] (the examples), "
                             f"got {batch_size!r}")
        index, count = shard
        if not (isinstance(count, int) and count >= 1 and isinstance(index, int) and 0 <= index < count):
            raise ValueError(f"ArrayBatches: shard must be (process_index, process_count) with 0 <= index < count, "
                             f"got {shard!r}")
        if batch_size % count:
            raise ValueError(f"ArrayBatches: batch_size {batch_size} is not divisible by the {count} processes")
        self.arrays, self.batch_size, self.seed, self.shuffle = arrays, batch_size, int(seed), shuffle
        self.collate, self.shard = collate, (index, count)
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n)
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self.index + self.batch_size > self.n:
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        rows = self._order[self.index:self.index + self.batch_size]
        self.index += self.batch_size
        index, count = self.shard
        per = self.batch_size // count
        rows = rows[index * per:(index + 1) * per]
        batch = {k: np.asarray(v[rows]) for k, v in self.arrays.items()}
        return self.collate(batch) if self.collate is not None else batch

    def get_state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "n": self.n,
                "batch_size": self.batch_size}

    def set_state(self, state: dict) -> None:
        for key in ("seed", "n", "batch_size"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"ArrayBatches: the checkpoint's data position was saved with {key}={state.get(key)!r}, this "
                    f"iterator has {key}={getattr(self, key)!r}; resume with the same data and batch size"
                )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)


class Preempted(RuntimeError):
    """Raised by :func:`train` after it saved a checkpoint on SIGTERM/SIGINT."""


class NonFiniteStep(FloatingPointError):
    """Raised by :func:`train` with ``nonfinite="raise"`` when a step had a non-finite gradient."""


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """What :func:`train` does around the step.

    Attributes:
      output_dir: run directory: ``checkpoints/``, ``metrics.jsonl``, ``tensorboard/``.
      max_steps: optimizer steps to reach (a resumed run continues up to it).
      checkpoint_every: steps between checkpoints (0: only at the end and on a signal).
      keep_checkpoints: how many recent checkpoints to keep.
      log_every: steps between metrics lines (each costs one device-to-host copy of a few scalars).
      steps_per_print: steps between console lines (DeepSpeed's ``steps_per_print``; 0: none).
      nonfinite: ``"skip"`` (count skipped steps and go on) or ``"raise"``.
      async_checkpoint: write checkpoints in the background while training continues.
      progress_bar: show a tqdm bar.
      tensorboard: write TensorBoard event files.
      tokens_per_example: multiplies examples/s into ``tokens_per_s`` (e.g. the sequence length).
      eval_every: steps between calls of ``train``'s ``evaluate`` (0: only at the end when one is given); their
        results go into that step's metrics record as ``eval/<name>``.
    """

    output_dir: str | pathlib.Path
    max_steps: int
    checkpoint_every: int = 1000
    keep_checkpoints: int = 3
    log_every: int = 1
    steps_per_print: int = 10
    nonfinite: str = "skip"
    async_checkpoint: bool = True
    progress_bar: bool = True
    tensorboard: bool = True
    tokens_per_example: int = 1
    eval_every: int = 0

    def __post_init__(self):
        for name, low in (("max_steps", 1), ("checkpoint_every", 0), ("keep_checkpoints", 1), ("log_every", 1),
                          ("steps_per_print", 0), ("tokens_per_example", 1), ("eval_every", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
                raise ValueError(f"LoopConfig.{name} must be an int >= {low}, got {value!r}")
        if self.nonfinite not in ("skip", "raise"):
            raise ValueError(f"LoopConfig.nonfinite must be 'skip' or 'raise', got {self.nonfinite!r}")
        for name in ("async_checkpoint", "progress_bar", "tensorboard"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"LoopConfig.{name} must be a bool, got {getattr(self, name)!r}")


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _world_size(state: TrainState, mpi=None) -> int:
    """Data-parallel ranks: the mesh's devices, times the MPI processes for a step built with ``mpi_comm``."""
    return int(jax.tree.leaves(state.params)[0].sharding.mesh.size) * (1 if mpi is None else int(mpi.size))


class _Checkpoints:
    """orbax CheckpointManager of ``TrainState`` + JSON (data position, world size)."""

    def __init__(self, directory: pathlib.Path, config: LoopConfig, mpi=None, host_comm=None):
        import orbax.checkpoint as ocp
        from orbax.checkpoint import checkpoint_managers as policies

        self.ocp, self.mpi, self.host_comm = ocp, mpi, host_comm
        if mpi is not None:  # every MPI rank has its own error buffers and data position: its own directory
            directory = directory / f"rank-{mpi.rank}"
        self.manager = ocp.CheckpointManager(
            directory.absolute(),
            options=ocp.CheckpointManagerOptions(
                enable_async_checkpointing=config.async_checkpoint,
                preservation_policy=policies.LatestN(config.keep_checkpoints),
                cleanup_tmp_directories=True,
                create=True,
            ),
            handler_registry=manager_handlers(),
        )

    def latest(self) -> int | None:
        if self.mpi is None:
            return self.manager.latest_step()
        # Under MPI: the newest step every rank holds (a kill may have left one rank a checkpoint ahead).
        steps = self.host_comm.allgather(sorted(self.manager.all_steps()))
        common = set(steps[0]).intersection(*map(set, steps[1:]))
        if not common and any(steps):
            raise ValueError(
                f"{self.manager.directory.parent}: the MPI ranks hold no common checkpoint step (per rank: "
                f"{[s[-3:] for s in steps]}); each rank resumes from its own rank-<r>/ directory, so all of them "
                "must be present, written by a run with the same number of processes")
        return max(common) if common else None

    def save(self, step: int, state: TrainState, meta: dict) -> None:
        if step in self.manager.all_steps():
            return
        ocp = self.ocp
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)

    def restore(self, step: int, target: TrainState, check_meta=None) -> tuple[TrainState, dict]:
        ocp = self.ocp
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if check_meta is not None:  # before the state: a changed optimizer would only fail as a tree mismatch
            check_meta(meta)
        saved, current = meta.get("world_size"), _world_size(target, self.mpi)
        if saved != current:
            raise ValueError(
                f"checkpoint step {step} in {self.manager.directory} was written by {saved} data-parallel ranks, this "
                f"run has {current}: the engine resumes on the same world size only (the 1-bit error buffers and "
                "the data position are per rank). Restart on the original device count, or restore the parameters "
                "alone with jonebit.train.checkpoint"
            )
        self._check_dtypes(step, target)
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(_abstract(target))))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"checkpoint step {step} in {self.manager.directory} does not fit this run's model/optimizer "
                f"state: {e}") from e
        return out["state"], meta

    def _check_dtypes(self, step: int, target: TrainState) -> None:
        """orbax casts each leaf to the target's dtype without a word (float32 into bfloat16 loses 16 bits of
        every value): refuse, naming the leaf. Trees that do not match are left to the restore's own error."""
        try:  # the item's own metadata, whatever handlers this process's manager holds
            saved = self.ocp.StandardCheckpointer().metadata(self.manager.directory / str(step) / "state")
        except Exception:  # noqa: BLE001 - no metadata to compare: the restore itself reports what is wrong
            return
        saved = getattr(saved, "item_metadata", saved)
        saved = _dtypes(getattr(saved, "tree", saved))
        want = _dtypes(target)
        if saved.keys() != want.keys():
            return
        for key, dtype in want.items():
            if saved[key] != dtype:
                raise ValueError(
                    f"checkpoint step {step} in {self.manager.directory}: state leaf {key!r} was saved as "
                    f"{saved[key]}, this run has {dtype}; resume with the dtypes the run was saved with (e.g. the "
                    "same fp16/bf16 settings and model dtype)")

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def _dtypes(tree) -> dict[str, str]:
    def name(k):
        return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))

    return {"/".join(map(name, kp)): str(getattr(x, "dtype", "?"))
            for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


class _Traffic:
    """This rank's collective bytes per step, read from the HLO of the compiled program that runs the step, once per
    program. A program compiled for one phase (the engine's default with the 1-bit optimizers) and the step of any
    other optimizer send what the program holds outside conditionals, every step. Only the single program with
    every phase as a branch (``per_phase=False``) needs the optimizer's update compiled alone, which tells its
    branches apart by phase."""

    def __init__(self, step):
        self.step = step
        self.counts = getattr(step, "counts_bytes", True) and getattr(step, "compiled", None) is not None
        self.known: dict[int, tuple[Any, float | dict[str, float]]] = {}

    def before_step(self, state: TrainState, batch) -> int | None:
        """Reads the traffic of the program the next step runs (before the step donates ``state``); its key."""
        if not self.counts:
            return None
        program = self.step.compiled(state, batch)
        if id(program) not in self.known:
            from jonebit.comm.accounting import comm_report

            mesh = jax.tree.leaves(state.params)[0].sharding.mesh
            report = comm_report(program.as_text(), mesh.size)
            if not any(c for cond in report.branches for branch in cond for c in branch):
                value = report.always_bytes
            else:
                value = _phase_bytes(self.step, report, state)
            self.known[id(program)] = (program, value)  # the program kept: its id stays its own
        return id(program)

    def sent(self, key: int | None, stage: str) -> float:
        """The bytes of the step whose program :meth:`before_step` returned ``key``, recorded as ``stage``."""
        if key is None:
            return math.nan
        value = self.known[key][1]
        return float(value.get(stage, value.get("full", math.nan))) if isinstance(value, dict) else value


def _phase_bytes(step, report, state: TrainState) -> dict[str, float]:
    """Bytes per phase of a program whose optimizer runs its phases as the branches of a conditional."""
    base = report.always_bytes
    out = {"skipped": base, "full": base}
    tx_report = getattr(step, "tx_report", None)
    if tx_report is not None:
        tx_report = tx_report(state)
        names = phase_names(state.opt_state)
        if names is not None and tx_report.branches:
            out.update({name: base + sent for name, sent in tx_report.phase_bytes(names).items()})
        out["full"] = base + tx_report.always_bytes
    return out


def _scalar(x) -> float | bool:
    x = np.asarray(x)
    return bool(x) if x.dtype == np.bool_ else float(x)


def _flatten_aux(aux, prefix="aux") -> dict[str, float]:
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(aux):
        if np.ndim(leaf) == 0:
            name = prefix + "/" + "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
            out[name] = float(leaf)
    return out


def summary_writer(logdir: pathlib.Path, purge_step: int | None = None):
    """tensorboardX's ``SummaryWriter``, imported without PyTorch.

    tensorboardX imports torch, where it is installed, only to accept torch tensors; the loop logs Python floats.
    That import costs about 1.2 s of every run's start-up (2.4 s of CPU), more than jax's, so it is kept out.
    """
    if "tensorboardX" not in sys.modules and "torch" not in sys.modules:
        # For this import only (another thread importing torch meanwhile would get the ImportError too), `import
        # torch` raises ImportError: tensorboardX takes its numpy-only path.
        sys.modules["torch"] = None
        try:
            import tensorboardX  # noqa: F401
        finally:
            del sys.modules["torch"]
    from tensorboardX import SummaryWriter

    return SummaryWriter(str(logdir), purge_step=purge_step)


def train(
    step: Callable,
    state: TrainState,
    batches: ResumableIterator,
    config: LoopConfig,
    *,
    lr_schedule: Callable[[int], float] | float | None = None,
    resume: bool = True,
    on_log: Callable[[dict], None] | None = None,
    evaluate: Callable[[TrainState], dict] | None = None,
    run_config: dict | None = None,
    fixed: tuple[str, ...] = RESUME_FIXED,
) -> TrainState:
    """Trains until ``config.max_steps``; returns the final state.

    Args:
      step: from :func:`jonebit.train.engine.make_train_step`.
      state: the initial state (from :func:`~jonebit.train.engine.init_train_state`); with ``resume`` and a
        checkpoint in ``output_dir``, it only serves as the restore target (shapes, dtypes, shardings).
      batches: a :class:`ResumableIterator` of global batches.
      config: a :class:`LoopConfig`.
      lr_schedule: the learning rate as a function of the optimizer's update count (for the metrics only).
        Checked before the first step over every update of the run (one vectorised call; a schedule that takes
        only scalars is checked at each logged step instead): a NaN, infinite or negative learning rate raises
        ``ValueError`` naming the update and the value.
      resume: continue from the latest checkpoint in ``output_dir/checkpoints`` if there is one.
      on_log: called with each metrics record.
      evaluate: ``evaluate(state) -> {name: float}``, run every ``config.eval_every`` steps and at the end; the
        values are logged as ``eval/<name>``.
      run_config: the run's settings as a JSON-serialisable dict (e.g. the DeepSpeed config's ``to_dict()``),
        saved with every checkpoint. Resuming compares it with the checkpoint's: changed settings are printed
        as a warning naming each key (old -> new); a change of a ``fixed`` key raises ``ValueError`` before
        anything is restored.
      fixed: dotted keys of ``run_config`` that cannot change across a resume (default :data:`RESUME_FIXED`).
    """
    if not isinstance(config, LoopConfig):
        raise TypeError(f"config must be a LoopConfig, got {type(config).__name__}")
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be the TrainState from init_train_state, got {type(state).__name__}")
    for name in ("get_state", "set_state", "__next__"):
        if not callable(getattr(batches, name, None)):
            raise TypeError(f"batches must be a resumable iterator (with __next__, get_state, set_state); "
                            f"{type(batches).__name__} has no {name}()")
    if lr_schedule is not None:
        # Before anything is written: a rate the optimizer would apply silently (a negative one ascends).
        check_schedule(lr_schedule, config.max_steps, what="train: lr_schedule")
    out = pathlib.Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    mpi = getattr(step, "mpi", None)  # a step built with mpi_comm: this process is one rank of an MPI job
    host_comm = None
    if mpi is not None:
        # The loop's own MPI calls (checkpoint steps, signals) run on the host while mpi4jax's run inside the
        # compiled steps: a communicator of their own, made while no step is in flight.
        jax.block_until_ready(state)
        host_comm = mpi.comm.Dup()
    ckpt = _Checkpoints(out / "checkpoints", config, mpi, host_comm)
    lead = jax.process_index() == 0 and (mpi is None or mpi.rank == 0)

    if run_config is not None:
        try:
            run_config = json.loads(json.dumps(run_config))  # as it will read back from the checkpoint
        except (TypeError, ValueError) as e:
            raise TypeError(f"train: run_config must be JSON-serialisable ({e})") from None

    def check_meta(meta):
        if run_config is not None and meta.get("run_config") is not None:
            _compare_run_configs(meta["run_config"], run_config, fixed, out / "checkpoints", lead)

    start = 0
    if resume and (latest := ckpt.latest()) is not None:
        state, meta = ckpt.restore(latest, state, check_meta)
        batches.set_state(meta["data"])
        start = int(meta["step"])
        if lead:  # said, not only logged: it changes the run
            print(f"resuming from step {start} of {out / 'checkpoints'} (to start over, use another output "
                  "directory)", flush=True)
    elif not resume and ckpt.latest() is not None:
        raise FileExistsError(
            f"{out / 'checkpoints'} already holds checkpoints (latest step {ckpt.latest()}); pass resume=True to "
            "continue that run, or choose another output directory"
        )
    metrics_path = out / "metrics.jsonl"
    if lead:
        _truncate_metrics(metrics_path, start)

    writer = None
    if config.tensorboard and lead:
        writer = summary_writer(out / "tensorboard", purge_step=start + 1 if start else None)

    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    bar = None
    try:
        if start >= config.max_steps:
            return state
        if config.progress_bar and lead:
            from tqdm.auto import tqdm

            bar = tqdm(total=config.max_steps, initial=start, unit="step", dynamic_ncols=True)
        traffic = _Traffic(step)
        t_last, examples, logged = time.perf_counter(), 0, start
        for i in range(start, config.max_steps):
            batch = next(batches)
            n = i + 1
            evaluating = evaluate is not None and (n == config.max_steps or (
                config.eval_every and n % config.eval_every == 0))
            logging_step = n % config.log_every == 0 or n == config.max_steps or evaluating
            if logging_step:  # the program this step runs, and the state it starts from, give its traffic
                program = traffic.before_step(state, batch)
            examples += len(next(iter(jax.tree.leaves(batch))))
            state, metrics = step(state, batch)
            if config.nonfinite == "raise" and bool(metrics["skipped"]):
                ckpt.wait()
                raise NonFiniteStep(
                    f"step {n}: a rank's gradient held an inf or a NaN (the step was not applied). With "
                    "nonfinite='skip' such steps are skipped and counted instead"
                )
            if logging_step:
                jax.block_until_ready(metrics)  # dispatch is asynchronous: time the finished steps, not their launch
                elapsed = max(time.perf_counter() - t_last, 1e-9)
                record = _record(n, state, metrics, config, lr_schedule, examples / elapsed, elapsed / (n - logged))
                record["bytes_sent"] = traffic.sent(program, record["stage"])
                if evaluating:
                    t_eval = time.perf_counter()
                    record.update({f"eval/{k}": float(v) for k, v in evaluate(state).items()})
                    record["eval_seconds"] = time.perf_counter() - t_eval
                t_last, examples, logged = time.perf_counter(), 0, n
                if lead:
                    with metrics_path.open("a") as f:
                        f.write(json.dumps(record) + "\n")
                    if writer is not None:
                        for key, value in record.items():
                            if key not in ("step", "stage") and isinstance(value, int | float):
                                writer.add_scalar(f"train/{key}", float(value), n)
                    if config.steps_per_print and n % config.steps_per_print == 0 and bar is not None:
                        bar.write(_console(record))
                    elif config.steps_per_print and n % config.steps_per_print == 0:
                        print(_console(record), flush=True)
                if bar is not None:
                    bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.3g}", stage=record["stage"])
                if on_log is not None:
                    on_log(record)
            if bar is not None:
                bar.update(1)
            if mpi is not None and mpi.size > 1:  # ranks see signals at different steps: stop together
                from mpi4py import MPI

                signum = host_comm.allreduce(int(stop["signal"] or 0), op=MPI.MAX)
                stop["signal"] = signum or None
            if (config.checkpoint_every and n % config.checkpoint_every == 0) or n == config.max_steps \
                    or stop["signal"] is not None:
                ckpt.save(n, state, {"step": n, "data": batches.get_state(), "world_size": _world_size(state, mpi),
                                     "run_config": run_config})
            if stop["signal"] is not None:
                ckpt.wait()
                raise Preempted(f"stopped by {signal.Signals(stop['signal']).name} after step {n}; checkpoint "
                                f"written to {out / 'checkpoints'}, run again to resume")
        ckpt.wait()
        return state
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if bar is not None:
            bar.close()
        if writer is not None:
            writer.close()
        ckpt.close()
        if host_comm is not None:
            host_comm.Free()


def _flat(tree, prefix="") -> dict[str, Any]:
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree}
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


_ABSENT = "<absent>"


def _compare_run_configs(saved: dict, new: dict, fixed, where: pathlib.Path, lead: bool) -> None:
    """Refuses changed ``fixed`` keys; warns (naming each key) about any other change."""
    old, cur = _flat(saved), _flat(new)
    changed = {k: (old.get(k, _ABSENT), cur.get(k, _ABSENT)) for k in sorted(old.keys() | cur.keys())
               if old.get(k, _ABSENT) != cur.get(k, _ABSENT)}
    if not changed:
        return
    show = lambda ks: ", ".join(f"{k}: {changed[k][0]!r} -> {changed[k][1]!r}" for k in ks)  # noqa: E731
    blocked = [k for k in changed if any(k == f or k.startswith(f + ".") for f in fixed)]
    if blocked:
        raise ValueError(
            f"cannot resume the run in {where}: its checkpoint was written with other settings that the saved "
            f"state depends on ({show(blocked)}). Resume with the saved values, or start a new run in another "
            "output directory")
    msg = f"resuming the run in {where} with changed settings: {show(changed)}"
    log.warning(msg)
    if lead:  # said, not only logged: the rest of the run differs from what the checkpoint's run did
        print(f"warning: {msg}", flush=True)


def _truncate_metrics(path: pathlib.Path, step: int) -> None:
    """Drops lines past ``step`` (written after the checkpoint a resumed run starts from)."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    keep = []
    for ln in lines:
        try:
            if json.loads(ln)["step"] <= step:
                keep.append(ln)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line cut by a kill
    path.write_text("".join(k + "\n" for k in keep))


def _record(n, state, metrics, config, lr_schedule, examples_per_s, seconds_per_step) -> dict:
    m = jax.device_get(metrics)
    skipped = bool(m["skipped"])
    count = int(jax.device_get(state.step - state.skipped)) - (0 if skipped else 1)  # updates before this step
    # The phase the optimizer's state says its last update ran (1-bit optimizers), else one "full" kind of step.
    stage = "skipped" if skipped else (last_phase(state.opt_state) or "full")
    if callable(lr_schedule):
        lr = float(np.asarray(lr_schedule(count)))
    else:
        lr = float(lr_schedule) if lr_schedule is not None else math.nan
    if lr_schedule is not None and bad_learning_rate([count], [lr]) is not None:
        raise ValueError(f"train: step {n}: lr_schedule({count}) = {lr:.6g}: {lr_problem(count, lr)}; fix the "
                         "schedule (the steps before this one used it as it was)")
    record = {
        "step": n,
        "loss": float(m["loss"]),
        "lr": lr,
        "loss_scale": float(m["loss_scale"]),
        "skipped": skipped,
        "grad_norm": float(m["grad_norm"]),
        "stage": stage,
        "bytes_sent": math.nan,  # filled in by the loop, which knows the program that ran the step
        "tokens_per_s": examples_per_s * config.tokens_per_example,
        "seconds": seconds_per_step,
    }
    if "aux" in m:
        record.update(_flatten_aux(m["aux"]))
    return record


def _console(r: dict) -> str:
    evals = "".join(f" {k} {v:.4g}" for k, v in r.items() if k.startswith("eval/"))
    return (f"step {r['step']}: loss {r['loss']:.4f} lr {r['lr']:.3g} stage {r['stage']} "
            f"grad_norm {r['grad_norm']:.3g} loss_scale {r['loss_scale']:g} tokens/s {r['tokens_per_s']:.0f}"
            + evals)

