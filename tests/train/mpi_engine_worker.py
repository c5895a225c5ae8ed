"""MPI rank program: ``jonebit.train.initialize`` with ``comm_backend_name: "mpi"``.

``step OUTDIR [OPTIMIZER]``: STEPS engine steps on this rank's slice of each global batch (a NaN on one rank at
NAN_STEP); saves ``OUTDIR/step-OPTIMIZER-rank{r}.npz`` (params after each step, metrics).
``loop OUTDIR MAX_STEPS [SIGNAL_AT]``: ``Engine.train`` with ArrayBatches sharded by rank and a checkpoint every 2
steps (resumes when OUTDIR holds one); saves the final params. With SIGNAL_AT, rank 1 alone sends itself SIGTERM
after that step: every rank must stop after the same step (``Preempted``) with a checkpoint.
"""

import os
import signal
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jonebit.train.initialize import initialize  # noqa: E402
from jonebit.train.loop import ArrayBatches, Preempted  # noqa: E402
from tests.train import mpi_engine_cases as C  # noqa: E402


def main(mode: str, outdir: str, arg: str = "", signal_at: str = "0") -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD.Get_size()
    opt = arg if mode == "step" and arg else "OneBitAdam"
    engine = initialize(C.config(world, opt=opt), C.loss_fn, C.params0(), rng_seed=C.SEED)
    rank = engine.process_index
    assert engine.process_count == world and engine.mesh.size == 1
    assert engine.batch.train_batch_size == C.MICRO * C.ACCUM * world
    out = {}
    if mode == "step":
        state = engine.state
        for t in range(C.STEPS):
            state, m = engine.step(state, C.rank_slice(C.global_batch(world, t), rank))
            m = jax.device_get(m)
            for k in ("loss", "grad_norm", "skipped"):
                out[f"{k}/{t}"] = np.asarray(m[k])
            for k, v in C.rank_params(state.params, 0).items():  # this process's copy (its only row)
                out[f"params/{t}/{k}"] = v
        out["skipped_total"] = np.asarray(state.skipped)
    else:
        batches = ArrayBatches(C.data(), engine.batch.train_batch_size, seed=11, shard=(rank, world))
        loop = engine.loop_config(outdir, int(arg), checkpoint_every=2, async_checkpoint=False,
                                  progress_bar=False, tensorboard=rank == 0)
        def on_log(record):
            if rank == 1 and record["step"] == int(signal_at):
                os.kill(os.getpid(), signal.SIGTERM)

        try:
            state = engine.train(batches, loop, on_log=on_log)
        except Preempted:  # the checkpoint holds the stopped state
            out["preempted"] = np.asarray(True)
        else:
            for k, v in state.params.items():
                out[f"params/{k}"] = np.asarray(v)
            out["step"] = np.asarray(state.step)
    np.savez(os.path.join(outdir, f"{mode}-{opt}-rank{rank}.npz"), **out)


if __name__ == "__main__":
    main(*sys.argv[1:])
