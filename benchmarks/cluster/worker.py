"""One host of the emulated cluster: a jax.distributed process (gloo, one CPU device) timing BERT training steps.

Started by ``run.py`` inside a network namespace. For every variant (``VARIANTS``) it compiles two steps of
the same model and batch: the data-parallel step over every process (``dist``, its collectives cross the
shaped links) and the same step on this process's devices alone (``local``: the compute, no network, run at
the same time in every process so the CPU contention matches). With several devices per host
(``XLA_FLAGS=--xla_force_host_platform_device_count``, set by the driver) the host's batch is split over them.

The run is split in phases, one per link rate: before each, every process waits at a file barrier in
``--sync-dir`` while the driver reads the qdisc counters and sets the next rate. Process 0's timings and every
process's step counts go to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
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

from benchmarks.cluster.model import host_link_bytes  # noqa: E402
from jonebit import onebit_adam  # noqa: E402
from jonebit.comm.accounting import comm_report  # noqa: E402
from jonebit.sharding.mesh import initialize_distributed  # noqa: E402
from jonebit.train.data_parallel import init_optimizer, make_step, replicate  # noqa: E402

# lax.cond(count < freeze_step, warmup, compression) lowers to the branches [compression, warmup].
_ONEBIT_BRANCH = {"warmup": 1, "compression": 0}


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
    """

    make_tx: object
    grad_reduce: str | None
    stages: tuple[str, ...] = ("step",)
    make_mesh: object = None  # make_mesh(devices) -> Mesh with the axes of `axis`; None: flat 1-D over the devices
    axis: str | tuple[str, str] = "data"  # the data-parallel axis (or hierarchical pair) of make_step

    def mesh(self, devices):
        if self.make_mesh is not None:
            return self.make_mesh(devices)
        return jax.make_mesh((len(devices),), ("data",), axis_types=(AxisType.Explicit,), devices=devices)

    def stage_collectives(self, report) -> dict[str, tuple]:
        """The collectives of one step of each stage (unconditional ones plus the stage's branch)."""
        if self.stages == ("step",):
            return {"step": tuple(report.always)}
        return {s: (*report.always, *report.branches[0][_ONEBIT_BRANCH[s]]) for s in self.stages}

    def stage_bytes(self, report) -> dict[str, float]:
        """Bytes each rank sends per step of each stage, from the compiled step's collectives."""
        if self.stages == ("step",):
            return {"step": report.always_bytes}
        return {s: report.branch_bytes(_ONEBIT_BRANCH[s]) for s in self.stages}

    def stage_ops(self, report) -> dict[str, list[str]]:
        """The collectives each stage's step runs."""
        if self.stages == ("step",):
            return {"step": report.ops()}
        return {s: report.ops(_ONEBIT_BRANCH[s]) for s in self.stages}


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
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--coordinator", required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--model", default="mini")
    p.add_argument("--batch", type=int, default=4, help="examples per host")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5, help="timed steps per stage")
    p.add_argument("--variants", nargs="+", default=["adam", "onebit"], choices=list(VARIANTS))
    p.add_argument("--phases", type=int, required=True, help="number of link rates the driver will set")
    p.add_argument("--sync-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--barrier-timeout", type=float, default=300)
    return p.parse_args(argv)


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

    def __init__(self, loss_fn, variant: Variant, params, mesh, local_batch, freeze_step: int):
        self.variant = variant
        state, specs = init_optimizer(variant.make_tx(freeze_step), params, mesh, axis=variant.axis)
        step = make_step(loss_fn, variant.make_tx(freeze_step), mesh, specs, grad_reduce=variant.grad_reduce,
                         axis=variant.axis)
        sharding = jax.NamedSharding(mesh, P(variant.axis))
        self.batch = {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local_batch.items()}
        self.initial = replicate(params, mesh), state
        self.compiled = step.lower(*self.initial, self.batch).compile()
        # Copies on the devices, layout kept: resetting moves no bytes across hosts (placing host arrays on a
        # multi-process mesh would), so the qdisc counters see the steps' collectives only.
        self._copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))
        self.reset()

    def reset(self):
        """Fresh params and optimizer state (a staged optimizer starts again in its first stage)."""
        self.params, self.state = self._copy(self.initial)

    def step(self) -> float:
        t0 = time.perf_counter()
        self.params, self.state, loss = self.compiled(self.params, self.state, self.batch)
        jax.block_until_ready((self.params, self.state, loss))
        return time.perf_counter() - t0

    def run_stages(self, repeats: int) -> tuple[dict[str, list[float]], dict[str, int]]:
        """Per stage: one untimed step (first of the stage), then ``repeats`` timed ones."""
        times, counts = {}, {}
        for stage in self.variant.stages:
            self.step()
            times[stage] = [self.step() for _ in range(repeats)]
            counts[stage] = repeats + 1
        return times, counts


def barrier(sync_dir: pathlib.Path, phase: int, pid: int, timeout: float) -> str:
    """Tells the driver this process reached ``phase`` and waits for its go (the file holds the link rate)."""
    (sync_dir / f"phase{phase}.p{pid}.waiting").write_text(str(time.time()))
    go = sync_dir / f"phase{phase}.go"
    deadline = time.monotonic() + timeout
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {pid}: no go for phase {phase} from the driver after {timeout} s")
        time.sleep(0.05)
    return go.read_text().strip()


def main(args) -> None:
    initialize_distributed(args.coordinator, args.num_processes, args.process_id, timeout=120,
                           heartbeat_timeout=60)
    pid, sync_dir = jax.process_index(), pathlib.Path(args.sync_dir)
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
        dist = Runner(loss_fn, v, params, mesh, local_batch, freeze)
        local = Runner(loss_fn, v, params, v.mesh(jax.local_devices()), local_batch, freeze)
        runners[name] = dist, local
        report = comm_report(dist.compiled.as_text(), mesh.size)
        comm[name], ops[name] = v.stage_bytes(report), v.stage_ops(report)
        hosts = [d.process_index for d in mesh.devices.flat]
        host_bytes[name] = {s: host_link_bytes(c, hosts) for s, c in v.stage_collectives(report).items()}
    compile_s = time.perf_counter() - t0
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    result = dict(process_id=pid, num_processes=jax.process_count(), devices=jax.device_count(), model=args.model,
                  params=n_params, batch_per_host=args.batch, seq=args.seq, repeats=args.repeats,
                  compile_s=compile_s, comm_bytes_per_step=comm, host_bytes_per_step=host_bytes, collectives=ops,
                  phases=[])
    for phase in range(args.phases):
        rate = barrier(sync_dir, phase, pid, args.barrier_timeout)
        record = dict(rate=rate, variants={})
        for name, (dist, local) in runners.items():
            local.reset()
            local_times, _ = local.run_stages(args.repeats)
            dist.reset()
            dist_times, counts = dist.run_stages(args.repeats)
            record["variants"][name] = dict(dist_s=dist_times, local_s=local_times, dist_steps=counts)
            print(f"[p{pid}] {rate} {name}: " + ", ".join(
                f"{s} {np.median(dist_times[s]):.3f}s (local {np.median(local_times[s]):.3f}s)" for s in dist_times),
                flush=True)
        result["phases"].append(record)
    barrier(sync_dir, args.phases, pid, args.barrier_timeout)  # the driver reads the final counters
    out = pathlib.Path(args.out)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main(parse_args())
