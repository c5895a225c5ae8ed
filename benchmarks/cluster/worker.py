"""One host of the emulated cluster: a jax.distributed process (gloo, one CPU device) timing BERT training steps.

Started by ``run.py`` inside a network namespace. For every variant (``VARIANTS``) it compiles two steps of
the same model and batch: the data-parallel step over every process (``dist``, its collectives cross the
shaped links) and the same step on this process's devices alone (``local``: the compute, no network, run at
the same time in every process so the CPU contention matches). With several devices per host
(``XLA_FLAGS=--xla_force_host_platform_device_count``, set by the driver) the host's batch is split over them.

The run is split in phases, one per link rate, and each phase in the variants: before each variant, every
process waits at a file barrier in ``--sync-dir`` while the driver reads the qdisc counters (and, before a
phase, sets its rate). Process 0's timings and every process's step counts go to ``--out``.

With ``--launcher mpi`` the processes are MPI ranks started by mpirun (no jax.distributed), for the variants
whose collectives go through mpi4jax (``Variant.mpi``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from benchmarks.cluster.model import host_link_bytes, mpi_as_collectives, stage_collectives  # noqa: E402
from jonebit import (  # noqa: E402
    OneBitAdamState,
    OneBitLambState,
    ZeroOneAdamState,
    onebit_adam,
    onebit_lamb,
    zero_one_adam,
)
from jonebit.comm import MPIBackend  # noqa: E402
from jonebit.comm.accounting import comm_report  # noqa: E402
from jonebit.sharding.mesh import initialize_distributed  # noqa: E402
from jonebit.train.data_parallel import init_optimizer, make_step, replicate  # noqa: E402

# The compiled step's branches are the phases the optimizer's state names, in that order (1-bit LAMB's are the same).
_ONEBIT_BRANCH = {name: OneBitAdamState.PHASES.index(name) for name in ("warmup", "compression")}
assert all(OneBitLambState.PHASES.index(name) == i for name, i in _ONEBIT_BRANCH.items())
# 0/1 Adam: its phases (variance_freezing, local_steps); inside the first lax.cond(variance step?, variance, 1-bit)
# -> [1-bit, variance], inside the second lax.cond(sync?, sync, local) -> [local, sync].
_FREEZING, _LOCAL = (ZeroOneAdamState.PHASES.index(p) for p in ("variance_freezing", "local_steps"))
_ZERO_ONE_BRANCH = {"variance": (_FREEZING, 1), "onebit": (_FREEZING, 0), "local": (_LOCAL, 0), "sync": (_LOCAL, 1)}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row of the benchmark.

    Attributes:
      make_tx: ``make_tx(freeze_step) -> optax transform``.
      grad_reduce: ``make_step``'s ``grad_reduce``.
      stages: the stages timed separately, in the order they run (a staged optimizer switches at
        ``freeze_step``).
      make_mesh: the mesh of a variant that needs its own layout (e.g. hosts x local devices), built once from
        every device (the distributed step) and once from this process's devices (the local step).
      branches: stage -> the branch of the compiled step that stage takes (``model.stage_collectives``).
      per_rank: the params are per rank (0/1 Adam's local steps move each rank's own copy): a leading rank axis
        over ``axis``, and the step is :func:`per_rank_step` instead of ``make_step``.
      enter: ``enter(stage, opt_state) -> opt_state`` before a stage's first step (jitted, no communication):
        sets the schedule counters so that the compiled step takes that stage's branch; ``None``: the stages
        follow from ``freeze_step``.
      mpi: the collectives go through MPI (``make_tx(freeze_step, mpi_comm)``, one process and device per rank,
        started by mpirun: ``--launcher mpi``), the step is :func:`mpi_step`.
    """

    make_tx: object
    grad_reduce: str | None
    stages: tuple[str, ...] = ("step",)
    make_mesh: object = None  # make_mesh(devices) -> Mesh with the axes of `axis`; None: flat 1-D over the devices
    axis: str | tuple[str, str] = "data"  # the data-parallel axis (or hierarchical pair) of make_step
    branches: dict = dataclasses.field(default_factory=lambda: dict(_ONEBIT_BRANCH))
    per_rank: bool = False
    enter: object = None
    mpi: bool = False

    def mesh(self, devices):
        if self.make_mesh is not None:
            return self.make_mesh(devices)
        return jax.make_mesh((len(devices),), ("data",), axis_types=(AxisType.Explicit,), devices=devices)

    def stage_collectives(self, report, hlo_text: str | None = None) -> dict[str, tuple]:
        """The collectives of one step of each stage (unconditional ones plus the stage's branch); a nested
        branch (0/1 Adam) needs the compiled step's ``hlo_text``."""
        if self.stages == ("step",):
            return {"step": tuple(report.always)}
        return {s: stage_collectives(report, hlo_text, self.branches[s]) for s in self.stages}

    def stage_bytes(self, report, hlo_text: str | None = None) -> dict[str, float]:
        """Bytes each rank sends per step of each stage, from the compiled step's collectives."""
        return {s: sum(c.total_bytes_sent for c in cs) for s, cs in self.stage_collectives(report, hlo_text).items()}

    def stage_ops(self, report, hlo_text: str | None = None) -> dict[str, list[str]]:
        """The collectives each stage's step runs."""
        return {s: [c.op for c in cs] for s, cs in self.stage_collectives(report, hlo_text).items()}


def per_rank_step(loss_fn, tx, mesh, opt_specs, axis="data"):
    """``step(params, opt_state, batch)`` for an optimizer with per-rank params (0/1 Adam): the params carry a
    leading rank axis over ``axis``; each rank differentiates and updates its own copy (as its docstring shows)."""

    def body(params, opt_state, batch):
        own = jax.tree.map(lambda x: x[0], params)
        loss, grads = jax.value_and_grad(loss_fn)(own, batch)
        updates, opt_state = tx.update(grads, opt_state, own)
        new = jax.tree.map(lambda x: x[None], optax.apply_updates(own, updates))
        return new, opt_state, jax.lax.pmean(loss, axis)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axis), opt_specs, P(axis)),
                                 out_specs=(P(axis), opt_specs, P())), donate_argnums=(0, 1))


def mpi_step(loss_fn, tx, mean=None):
    """``step(params, opt_state, batch)`` of one MPI rank: its own gradient to ``tx``, which averages over MPI
    (or, with ``mean``, e.g. ``MPIBackend.mean``, the gradient averaged first, for a plain optax optimizer)."""

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        if mean is not None:
            grads = mean(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


# 0/1 Adam's phases are reached by setting its counters (state surgery) rather than by running 100s of steps:
# the count picks the phase (variance freezing below ZO_FREEZE), an interval of 1 makes every step a variance
# (or sync) step, a huge one none. The moments are left as the stages before made them.
ZO_FREEZE, _NEVER = 1000, 1 << 30
_ZO_COUNTERS = {"variance": (0, 1, _NEVER), "onebit": (0, _NEVER, _NEVER), "local": (ZO_FREEZE, 1, _NEVER),
                "sync": (ZO_FREEZE, 1, 1)}


def zero_one_enter(stage: str, state):
    count, var_interval, local_interval = _ZO_COUNTERS[stage]
    at = lambda x, v: jnp.zeros_like(x) + v  # noqa: E731 - keeps x's sharding
    return state._replace(count=at(state.count, count), var_interval=at(state.var_interval, var_interval),
                          var_counter=at(state.var_counter, 0),
                          local_step_interval=at(state.local_step_interval, local_interval),
                          local_step_counter=at(state.local_step_counter, 0))


HIER_AXES = ("hosts", "local")


def hosts_mesh(devices):
    """``hosts x local``: one row per process, so the ``local`` axis never leaves a host."""
    procs = sorted({d.process_index for d in devices})
    rows = [sorted((d for d in devices if d.process_index == q), key=lambda d: d.id) for q in procs]
    return jax.sharding.Mesh(np.array(rows), ("hosts", "local"), axis_types=(AxisType.Explicit,) * 2)


LR = 1e-4
VARIANTS = {
    "adam": Variant(lambda freeze: optax.adam(LR), "mean"),
    # XLA:CPU promotes a bf16 all-reduce to f32, so on this backend the bytes are fp32's (the accounting of the
    # compiled program and the qdisc counters both show it); a GPU sends bf16.
    "adam_bf16": Variant(lambda freeze: optax.adam(LR), "mean_bf16"),
    "onebit": Variant(lambda freeze: onebit_adam(LR, freeze_step=freeze, fused=True), None, ("warmup", "compression")),
    # Hierarchical: fp32 reduce-scatter inside a host, 1-bit allreduce across hosts, all-gathers back.
    "onebit_hier": Variant(lambda freeze: onebit_adam(LR, freeze_step=freeze, fused=True, axis_name=HIER_AXES),
                           None, ("warmup", "compression"), make_mesh=hosts_mesh, axis=HIER_AXES),
    # One fused compressed allreduce of the scaled momentum per compression step, like 1-bit Adam's.
    "onebit_lamb": Variant(lambda freeze: onebit_lamb(LR, freeze_step=freeze), None, ("warmup", "compression")),
    # Variance steps (fp32 all-reduce of the gradient), 1-bit gradient steps, local steps (no communication)
    # and 1-bit syncs of the accumulated moves; the scalers are huge so no interval doubles within a stage. eps
    # 1e-3: after a few variance steps v is still 0 on embedding rows no token hit, and with eps 1e-8 the 1-bit
    # momentum there drives the params to inf within the timed steps (same compute, but NaNs are no benchmark).
    "zero_one_adam": Variant(lambda freeze: zero_one_adam(LR, eps=1e-3, var_freeze_step=ZO_FREEZE,
                                                          var_update_scaler=_NEVER, local_step_scaler=_NEVER),
                             None,
                             ("variance", "onebit", "local", "sync"), branches=dict(_ZERO_ONE_BRANCH), per_rank=True,
                             enter=zero_one_enter),
    # Over MPI (mpi4jax), one process per rank: Adam on the gradient averaged by MPIBackend.mean ("ordered":
    # all-to-all + all-gather, a ring all-reduce's bytes), and 1-bit Adam, whose warmup averages the same way.
    "adam_mpi": Variant(lambda freeze, comm: optax.adam(LR), "mean", mpi=True),
    "onebit_mpi": Variant(lambda freeze, comm: onebit_adam(LR, freeze_step=freeze, fused=True, mpi_comm=comm), None,
                          ("warmup", "compression"), mpi=True),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launcher", choices=("gloo", "mpi"), default="gloo",
                   help="gloo: jax.distributed (--coordinator ...); mpi: started by mpirun, MPI variants only")
    p.add_argument("--coordinator")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--process-id", type=int)
    p.add_argument("--model", default="mini")
    p.add_argument("--batch", type=int, default=4, help="examples per host")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5, help="timed steps per stage")
    p.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS))
    p.add_argument("--phases", type=int, required=True, help="number of link rates the driver will set")
    p.add_argument("--sync-dir", required=True)
    p.add_argument("--out", required=True, help="record path; '{pid}' is replaced by the process id")
    p.add_argument("--barrier-timeout", type=float, default=300)
    args = p.parse_args(argv)
    if args.variants is None:
        args.variants = ["adam_mpi", "onebit_mpi"] if args.launcher == "mpi" else ["adam", "onebit"]
    wrong = [v for v in args.variants if VARIANTS[v].mpi != (args.launcher == "mpi")]
    if wrong:
        p.error(f"--variants {wrong} do not run with --launcher {args.launcher} (MPI variants need mpi, the others "
                "gloo)")
    if args.launcher == "gloo" and None in (args.coordinator, args.num_processes, args.process_id):
        p.error("--launcher gloo needs --coordinator, --num-processes and --process-id")
    return args


def make_batch(vocab: int, batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    """Random tokens, 15% MLM targets (-100 elsewhere), NSP labels: the shapes and dtypes of pre-training."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, vocab, (batch, seq), dtype=np.int32)
    types = np.zeros((batch, seq), np.int32)
    types[:, seq // 2:] = 1
    labels = np.where(rng.random((batch, seq)) < 0.15, ids, -100).astype(np.int32)
    return dict(input_ids=ids, attention_mask=np.ones((batch, seq), np.int32), token_type_ids=types, labels=labels,
                next_sentence_label=rng.integers(0, 2, (batch,), dtype=np.int32))


def build_model(name: str, seq: int):
    """``(loss_fn(params, batch), params, vocab)`` of a BertForPreTraining preset (dropout off: timing only)."""
    from flax import nnx

    from jonebit.models.bert import BertConfig, BertForPreTraining, pretraining_loss

    config = BertConfig.preset(name, max_position_embeddings=max(512, seq))
    graphdef, params, rest = nnx.split(BertForPreTraining(config, rngs=nnx.Rngs(0)), nnx.Param, ...)

    def loss_fn(p, batch):
        out = nnx.merge(graphdef, p, rest)(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"],
                                          deterministic=True)
        return pretraining_loss(out, batch)

    return loss_fn, jax.device_get(params), config.vocab_size


class Runner:
    """A compiled step with its own parameters and optimizer state on one mesh."""

    def __init__(self, loss_fn, variant: Variant, params, mesh, local_batch, freeze_step: int, mpi_comm=None):
        self.variant = variant
        if variant.mpi:  # one device per process, no mesh: the transform's collectives are MPI calls
            tx = variant.make_tx(freeze_step, mpi_comm)
            start, self.batch = jax.tree.map(jnp.array, params), jax.tree.map(jnp.asarray, local_batch)
            mean = MPIBackend(mpi_comm).mean if variant.grad_reduce == "mean" else None
            state, step = jax.jit(tx.init)(start), mpi_step(loss_fn, tx, mean)
        else:
            tx = variant.make_tx(freeze_step)
            state, specs = init_optimizer(tx, params, mesh, axis=variant.axis)
            sharding = jax.NamedSharding(mesh, P(variant.axis))
            if variant.per_rank:  # one copy per rank, each process placing its own devices' rows
                step = per_rank_step(loss_fn, tx, mesh, specs, variant.axis)
                rows = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
                start = jax.tree.map(lambda x: jax.make_array_from_process_local_data(
                    sharding, np.broadcast_to(np.asarray(x), (rows, *np.shape(x)))), params)
            else:
                # One program with every phase: the worker enters each stage by setting the state, and reads every
                # stage's collectives from the one compiled program's branches.
                step = make_step(loss_fn, tx, mesh, specs, grad_reduce=variant.grad_reduce, axis=variant.axis,
                                 per_phase=False)
                start = replicate(params, mesh)
            self.batch = {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local_batch.items()}
        self.initial = start, state
        self.compiled = step.lower(*self.initial, self.batch).compile()
        # A compiled program with mpi4jax's ordered effects takes a token argument that only the jitted function
        # supplies ("Execution supplied 147 arguments but compiled program expected 148"): MPI steps run through
        # it (one more compile, at its first call).
        self._run = step if variant.mpi else self.compiled
        # Copies on the devices, layout kept: resetting moves no bytes across hosts (placing host arrays on a
        # multi-process mesh would), so the qdisc counters see the steps' collectives only.
        self._copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))
        shardings = jax.tree.map(lambda x: x.sharding, state)
        self._enter = {s: jax.jit(functools.partial(variant.enter, s), out_shardings=shardings)
                       for s in variant.stages} if variant.enter else {}
        if variant.mpi:  # compile the jitted step now, before the phases (every rank runs this step here)
            self.reset()
            self.step()
        self.reset()

    def reset(self):
        """Fresh params and optimizer state (a staged optimizer starts again in its first stage)."""
        self.params, self.state = self._copy(self.initial)

    def step(self) -> float:
        t0 = time.perf_counter()
        self.params, self.state, loss = self._run(self.params, self.state, self.batch)
        jax.block_until_ready((self.params, self.state, loss))
        return time.perf_counter() - t0

    def run_stages(self, repeats: int) -> tuple[dict[str, list[float]], dict[str, int]]:
        """Per stage: one untimed step (first of the stage), then ``repeats`` timed ones."""
        times, counts = {}, {}
        for stage in self.variant.stages:
            if stage in self._enter:
                self.state = self._enter[stage](self.state)
            self.step()
            times[stage] = [self.step() for _ in range(repeats)]
            counts[stage] = repeats + 1
        return times, counts


def barrier(sync_dir: pathlib.Path, phase: int, pid: int, timeout: float) -> str:
    """Tells the driver this process reached ``phase`` and waits for its go (the file holds the link rate)."""
    (sync_dir / f"phase{phase}.p{pid}.waiting").write_text(str(time.time()))
    go = sync_dir / f"phase{phase}.go"
    deadline = time.monotonic() + timeout
    # Polled on its content, not its existence: a driver that creates the file before filling it is not misread.
    while not (rate := go.read_text().strip() if go.exists() else ""):
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {pid}: no go for phase {phase} from the driver after {timeout} s")
        time.sleep(0.05)
    return rate


def main(args) -> None:
    world = self_comm = None
    if args.launcher == "mpi":
        from mpi4py import MPI

        world, self_comm = MPI.COMM_WORLD, MPI.COMM_SELF
        pid, nproc = world.Get_rank(), world.Get_size()
    else:
        initialize_distributed(args.coordinator, args.num_processes, args.process_id, timeout=120,
                               heartbeat_timeout=60)
        pid, nproc = jax.process_index(), jax.process_count()
    sync_dir = pathlib.Path(args.sync_dir)
    loss_fn, params, vocab = build_model(args.model, args.seq)
    local_batch = make_batch(vocab, args.batch, args.seq, seed=pid)
    if args.batch % jax.local_device_count():
        raise SystemExit(f"--batch {args.batch} must be divisible by the {jax.local_device_count()} devices per host")
    freeze = args.repeats + 1  # the warmup stage: one untimed step, then `repeats` timed ones
    runners, comm, ops, host_bytes = {}, {}, {}, {}
    t0 = time.perf_counter()
    for name in args.variants:
        v = VARIANTS[name]
        mesh = v.mesh(jax.devices())
        dist = Runner(loss_fn, v, params, mesh, local_batch, freeze, mpi_comm=world)
        local = Runner(loss_fn, v, params, v.mesh(jax.local_devices()), local_batch, freeze, mpi_comm=self_comm)
        runners[name] = dist, local
        hlo = dist.compiled.as_text()
        if v.mpi:  # its collectives are mpi4jax calls; one rank per process
            hlo, hosts = mpi_as_collectives(hlo), list(range(nproc))
        else:
            hosts = [d.process_index for d in mesh.devices.flat]
        report = comm_report(hlo, len(hosts))
        comm[name], ops[name] = v.stage_bytes(report, hlo), v.stage_ops(report, hlo)
        host_bytes[name] = {s: host_link_bytes(c, hosts) for s, c in v.stage_collectives(report, hlo).items()}
    compile_s = time.perf_counter() - t0
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    result = dict(process_id=pid, num_processes=nproc, devices=len(hosts), launcher=args.launcher, model=args.model,
                  params=n_params, batch_per_host=args.batch, seq=args.seq, repeats=args.repeats,
                  compile_s=compile_s, comm_bytes_per_step=comm, host_bytes_per_step=host_bytes, collectives=ops,
                  phases=[])
    barriers = 0
    for _ in range(args.phases):
        record = dict(rate=None, variants={})
        for name, (dist, local) in runners.items():
            # A barrier before every variant: the driver reads the qdisc counters (each variant's bytes on their
            # own) and, before a phase's first variant, sets the phase's rate.
            record["rate"] = rate = barrier(sync_dir, barriers, pid, args.barrier_timeout)
            barriers += 1
            local.reset()
            local_times, _ = local.run_stages(args.repeats)
            dist.reset()
            dist_times, counts = dist.run_stages(args.repeats)
            record["variants"][name] = dict(dist_s=dist_times, local_s=local_times, dist_steps=counts)
            print(f"[p{pid}] {rate} {name}: " + ", ".join(
                f"{s} {np.median(dist_times[s]):.3f}s (local {np.median(local_times[s]):.3f}s)" for s in dist_times),
                flush=True)
        result["phases"].append(record)
    barrier(sync_dir, barriers, pid, args.barrier_timeout)  # the driver reads the final counters
    out = pathlib.Path(args.out.replace("{pid}", str(pid)))
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main(parse_args())
