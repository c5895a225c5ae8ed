"""jonebit.train.loop: exact resume after SIGKILL and SIGTERM, metrics, checkpoints kept, bad inputs."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

from jonebit.sharding.mesh import data_mesh
from jonebit.train.engine import init_train_state, make_train_step
from jonebit.train.loop import ArrayBatches, LoopConfig, NonFiniteStep, Preempted, train
from tests.train import loop_model

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = pathlib.Path(__file__).with_name("loop_worker.py")


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))]


def _worker(out, max_steps, every, sleep, result):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, str(WORKER), str(out), str(max_steps), str(every), str(sleep),
                             str(result)], env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(proc, timeout=300):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, out
    return out


def _committed_steps(ckpt_dir: pathlib.Path) -> list[int]:
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit())


def _logged_steps(run: pathlib.Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError):
            pass
    return steps


@pytest.mark.multiprocess
def test_sigkill_then_resume_is_bitwise_identical(tmp_path):
    max_steps = 12
    clean = _worker(tmp_path / "clean", max_steps, 4, 0.0, tmp_path / "clean.npz")
    _finish(clean)

    run = tmp_path / "killed"
    proc = _worker(run, max_steps, 4, 0.4, tmp_path / "unused.npz")
    deadline = time.time() + 240
    try:
        # Kill after the step-4 checkpoint is committed and a few more steps ran (not at a checkpoint boundary).
        while not (4 in _committed_steps(run / "checkpoints") and max(_logged_steps(run) or [0]) >= 6):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.time() < deadline, "the worker made no progress"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    killed_at = max(_logged_steps(run))
    assert 6 <= killed_at < max_steps
    resumed = _worker(run, max_steps, 4, 0.0, tmp_path / "resumed.npz")
    _finish(resumed)

    a, b = np.load(tmp_path / "clean.npz"), np.load(tmp_path / "resumed.npz")
    assert len(a.files) == len(b.files) > 5
    for key in a.files:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    # metrics.jsonl holds every step once: lines written after the checkpoint were replaced on resume.
    assert _logged_steps(run) == list(range(1, max_steps + 1))
    assert _committed_steps(run / "checkpoints") == [4, 8, 12][-3:]


def test_sigterm_checkpoints_and_resumes_exactly(tmp_path):
    step, state, batches, config = loop_model.make_run(tmp_path / "ref", max_steps=9, checkpoint_every=0)
    ref = train(step, state, batches, config)

    step, state, batches, config = loop_model.make_run(tmp_path / "run", max_steps=9, checkpoint_every=0)

    def term_at_5(record):
        if record["step"] == 5:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Preempted, match=r"stopped by SIGTERM after step 5; checkpoint written"):
        train(step, state, batches, config, on_log=term_at_5)
    assert _committed_steps(tmp_path / "run" / "checkpoints") == [5]
    step, state, batches, config = loop_model.make_run(tmp_path / "run", max_steps=9, checkpoint_every=0)
    final = train(step, state, batches, config)
    for x, y in zip(_leaves(ref), _leaves(final), strict=True):
        np.testing.assert_array_equal(x, y)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler was put back


def test_metrics_stages_bytes_and_tensorboard(tmp_path):
    step, state, batches, config = loop_model.make_run(tmp_path, max_steps=6, checkpoint_every=2,
                                                       keep_checkpoints=2)
    train(step, state, batches, config, lr_schedule=lambda count: 1e-2)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    keys = {"step", "loss", "lr", "loss_scale", "skipped", "grad_norm", "stage", "bytes_sent", "tokens_per_s",
            "seconds"}
    assert keys <= set(records[0])
    # The phases the optimizer's state names (freeze_step = 3), not a number the loop was told.
    assert [r["stage"] for r in records] == ["warmup"] * 3 + ["compression"] * 3
    warm, comp = records[0]["bytes_sent"], records[-1]["bytes_sent"]
    n = sum(x.size for x in jax.tree.leaves(loop_model.params0()))
    # Warmup: an fp32 all-reduce of the n gradients (ring: 2 (P-1)/P x 4n bytes) dominates.
    assert warm >= 2 * 7 / 8 * 4 * n
    assert comp < warm / 4
    assert all(r["lr"] == 1e-2 and not r["skipped"] for r in records)
    assert _committed_steps(tmp_path / "checkpoints") == [4, 6]  # keep_checkpoints=2
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 200


def test_nonfinite_raise(tmp_path):
    mesh = data_mesh()
    tx = optax.sgd(0.1)
    state, specs = init_train_state(tx, loop_model.params0(), mesh)
    step = make_train_step(loop_model.loss_fn, tx, mesh, specs, grad_reduce="mean", rng_seed=0)
    d = loop_model.data()
    d["x"][40] = np.nan
    batches = ArrayBatches(d, batch_size=32, shuffle=False)  # the NaN row is in the second batch
    config = LoopConfig(tmp_path, max_steps=3, progress_bar=False, tensorboard=False, nonfinite="raise")
    with pytest.raises(NonFiniteStep, match=r"step 2: a rank's gradient held an inf or a NaN"):
        train(step, state, batches, config)


def test_array_batches_deterministic_and_resumable():
    d = loop_model.data(10)
    a = ArrayBatches(d, batch_size=4, seed=5)
    seq = [next(a)["x"] for _ in range(7)]  # 2 batches per epoch (10 // 4), 3.5 epochs
    b = ArrayBatches(d, batch_size=4, seed=5)
    for _ in range(3):
        next(b)
    saved = b.get_state()
    c = ArrayBatches(d, batch_size=4, seed=5)
    c.set_state(saved)
    for i in range(3, 7):
        np.testing.assert_array_equal(next(c)["x"], seq[i])
    epoch0 = np.concatenate(seq[:2])
    assert len({tuple(r) for r in epoch0.round(6).tolist()}) == 8  # no repeats inside an epoch
    assert not np.array_equal(seq[0], seq[2])  # reshuffled per epoch


def _bad_loop_inputs(tmp_path):
    step, state, batches, config = loop_model.make_run(tmp_path / "a", max_steps=2, checkpoint_every=0)
    return [
        ("max_steps", lambda: LoopConfig(tmp_path, max_steps=0), ValueError,
         r"LoopConfig.max_steps must be an int >= 1"),
        ("every", lambda: LoopConfig(tmp_path, max_steps=2, checkpoint_every=-1), ValueError, r"checkpoint_every"),
        ("nonfinite", lambda: LoopConfig(tmp_path, max_steps=2, nonfinite="ignore"), ValueError,
         r"nonfinite must be 'skip' or 'raise', got 'ignore'"),
        ("bool flag", lambda: LoopConfig(tmp_path, max_steps=2, tensorboard="yes"), TypeError,
         r"LoopConfig.tensorboard must be a bool"),
        ("config type", lambda: train(step, state, batches, {"max_steps": 2}), TypeError,
         r"config must be a LoopConfig"),
        ("state type", lambda: train(step, state.params, batches, config), TypeError,
         r"state must be the TrainState"),
        ("iterator", lambda: train(step, state, iter([]), config), TypeError, r"batches must be a resumable iterator"),
        ("batch size", lambda: ArrayBatches(loop_model.data(8), batch_size=9), ValueError,
         r"batch_size must be an int in \[1, 8\]"),
        ("lengths", lambda: ArrayBatches({"x": np.zeros(3), "y": np.zeros(4)}, 2), ValueError, r"different lengths"),
        ("position", lambda: ArrayBatches(loop_model.data(8), 2).set_state({"seed": 1, "n": 8, "batch_size": 2}),
         ValueError, r"saved with seed=1, this iterator has seed=0"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_bad_loop_inputs(tmp_path, case):
    name, call, exc, pattern = _bad_loop_inputs(tmp_path)[case]
    with pytest.raises(exc, match=pattern):
        call()


def test_refuses_existing_run_without_resume_and_other_world_size(tmp_path):
    step, state, batches, config = loop_model.make_run(tmp_path, max_steps=2, checkpoint_every=0)
    train(step, state, batches, config)
    step, state, batches, config = loop_model.make_run(tmp_path, max_steps=4, checkpoint_every=0)
    with pytest.raises(FileExistsError, match=r"already holds checkpoints \(latest step 2\); pass resume=True"):
        train(step, state, batches, config, resume=False)
    step, state, batches, config = loop_model.make_run(tmp_path, max_steps=4, checkpoint_every=0,
                                                       mesh=data_mesh(4))
    with pytest.raises(ValueError, match=r"written by 8 data-parallel ranks, this run has 4"):
        train(step, state, batches, config)


# ----------------------------------------------------------------------------------------------------------------
# Learning rates the optimizer would apply silently.

def test_negative_or_nan_schedule_is_refused_before_the_first_step(tmp_path):
    step, state, batches, config = loop_model.make_run(tmp_path, max_steps=6, checkpoint_every=0)
    decay = optax.linear_schedule(1e-2, -1e-2, 4)  # crosses zero: update 3 has -5e-3
    with pytest.raises(ValueError, match=r"train: lr_schedule: the learning rate of update 3 \(optax count 3; step 4 "
                                         r"when no step was skipped\) is -0\.005, negative: the update would "
                                         r"ascend the gradient"):
        train(step, state, batches, config, lr_schedule=decay)
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
    with pytest.raises(ValueError, match=r"update 0 .* is nan, not a finite number"):
        train(step, state, batches, config, lr_schedule=lambda count: float("nan"))
    assert float(decay(3)) < 0  # the reference: optax's own value at the update named


def test_scalar_only_schedule_is_checked_at_the_logged_step(tmp_path):
    """A schedule that cannot take an array of counts is checked where the loop evaluates it: the message names
    the step and the value."""
    step, state, batches, config = loop_model.make_run(tmp_path, max_steps=6, checkpoint_every=0)

    def scalar_only(count):
        count = int(count)  # raises for an array of counts
        return 1e-2 if count < 2 else -1e-3

    with pytest.raises(ValueError, match=r"train: step 3: lr_schedule\(2\) = -0\.001: the learning rate of update "
                                         r"2 .* negative"):
        train(step, state, batches, config, lr_schedule=scalar_only)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in records] == [1e-2, 1e-2]


# ----------------------------------------------------------------------------------------------------------------
# Resuming with another config.

DS = {"train_batch_size": 32, "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": 3}},
      "zero_optimization": {"stage": 0}}


def test_resume_warns_about_changed_keys_and_refuses_fixed_ones(tmp_path, capsys):
    step, state, batches, config = loop_model.make_run(tmp_path, max_steps=2, checkpoint_every=0)
    train(step, state, batches, config, run_config=DS)
    changed = {**DS, "train_batch_size": 64, "optimizer": {"type": "OneBitAdam", "params": {"lr": 2e-2,
                                                                                            "freeze_step": 3}}}
    # A fixed key: refused before anything is restored, and the run directory is left as it was.
    other = {**DS, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    step, state, batches, config = loop_model.make_run(tmp_path, max_steps=4, checkpoint_every=0)
    with pytest.raises(ValueError, match=r"cannot resume the run in .*checkpoints: .* \(optimizer\.type: "
                                         r"'OneBitAdam' -> 'AdamW'\)\. Resume with the saved values"):
        train(step, state, batches, config, run_config=other)
    # Other keys: a warning that names each of them, then the run continues from step 2.
    capsys.readouterr()
    train(step, state, batches, config, run_config=changed)
    out = capsys.readouterr().out
    assert ("warning: resuming the run in " in out and "optimizer.params.lr: 0.01 -> 0.02, "
            "train_batch_size: 32 -> 64" in out)
    assert "optimizer.type" not in out and "resuming from step 2" in out
    # The new config is what the new checkpoint holds: resuming with it again says nothing.
    step, state, batches, config = loop_model.make_run(tmp_path, max_steps=5, checkpoint_every=0)
    train(step, state, batches, config, run_config=changed)
    assert "warning" not in capsys.readouterr().out


def test_resume_refuses_a_state_of_another_dtype(tmp_path):
    """orbax would cast the saved float32 parameters into a bfloat16 target without a word."""
    step, state, batches, config = loop_model.make_run(tmp_path, max_steps=2, checkpoint_every=0)
    train(step, state, batches, config)
    step, state, batches, config = loop_model.make_run(tmp_path, max_steps=4, checkpoint_every=0)
    params = {**state.params, "b1": state.params["b1"].astype(jax.numpy.bfloat16)}
    with pytest.raises(ValueError, match=r"checkpoint step 2 in .*: state leaf 'params/b1' was saved as float32, "
                                         r"this run has bfloat16; resume with the dtypes the run was saved with"):
        train(step, state._replace(params=params), batches, config)


def test_the_tensorboard_writer_leaves_torch_unimported(tmp_path):
    """tensorboardX imports torch where it is installed (2.4 s of CPU at every run's start); the loop's writer keeps
    it out and still writes scalars TensorBoard reads, and torch stays importable afterwards."""
    import importlib.util
    import subprocess
    import sys
    import textwrap

    from tests.mpi_util import worker_env

    code = textwrap.dedent(f"""
        import pathlib, struct, sys
        from jonebit.train.loop import summary_writer
        w = summary_writer(pathlib.Path({str(tmp_path)!r}))
        w.add_scalar("train/loss", 2.5, 3)
        w.close()
        print("torch" in sys.modules)
        from tensorboardX.proto.event_pb2 import Event
        data = next(pathlib.Path({str(tmp_path)!r}).glob("events.out.tfevents.*")).read_bytes()
        records, i = [], 0
        while i < len(data):  # TFRecord framing: length (8 bytes), its CRC (4), the record, its CRC (4)
            (n,) = struct.unpack("<Q", data[i:i + 8])
            records.append(Event.FromString(data[i + 12:i + 12 + n]))
            i += 16 + n
        print([(e.step, v.tag, v.simple_value) for e in records for v in e.summary.value])
        import importlib.util
        if importlib.util.find_spec("torch") is None:
            print("not installed")
        else:
            import torch  # noqa: F401  (the ImportError the writer's import needed is gone)
            print("importable")
    """)
    out = subprocess.run([sys.executable, "-c", code], env=worker_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    imported, scalars, torch_after = out.stdout.strip().splitlines()
    assert imported == "False"
    assert scalars == "[(3, 'train/loss', 2.5)]"
    assert torch_after == ("not installed" if importlib.util.find_spec("torch") is None else "importable")


def test_checkpoints_split_only_large_arrays_among_replicas(tmp_path, monkeypatch):
    """orbax writes a replicated array in slices, one per replica; the loop's checkpoints (and
    ``jonebit.train.checkpoint.save``) do so only where a replica's slice holds at least MIN_REPLICA_SLICE_BYTES (each
    slice is an eager op: for the many small arrays of a model's state the split cost seconds per save). The state
    comes back bit for bit."""
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from orbax.checkpoint._src.serialization import replica_slices

    from jonebit.train import checkpoint
    from jonebit.train.checkpoint import MIN_REPLICA_SLICE_BYTES
    from jonebit.train.engine import TrainState
    from jonebit.train.loop import _Checkpoints

    slices = []
    original = replica_slices.get_replica_slices

    def counted(arr, *args, **kwargs):
        out = original(arr, *args, **kwargs)
        slices.append((arr.nbytes, len(out.replica_slices)))
        return out

    monkeypatch.setattr(replica_slices, "get_replica_slices", counted)
    mesh = data_mesh()
    n = mesh.size
    replicated = NamedSharding(mesh, P())
    big = n * MIN_REPLICA_SLICE_BYTES // 4  # float32 elements: each replica's slice is MIN_REPLICA_SLICE_BYTES
    rng = np.random.default_rng(0)
    scalar = jax.device_put(np.int32(3), replicated)
    state = TrainState(step=scalar, params={"small": jax.device_put(rng.standard_normal((16, 8), np.float32),
                                                                    replicated),
                                            "big": jax.device_put(rng.standard_normal(big, np.float32), replicated)},
                       opt_state=(), loss_scale=(), skipped=scalar)
    ckpt = _Checkpoints(tmp_path / "run", LoopConfig(tmp_path / "run", max_steps=1, async_checkpoint=False))
    try:
        ckpt.save(1, state, {"step": 1, "world_size": n})
        ckpt.wait()
        want = [(4, 1), (4, 1), (16 * 8 * 4, 1), (big * 4, n)]  # (bytes, slices) of each array
        assert sorted(slices) == want, slices
        restored, _ = ckpt.restore(1, state)
    finally:
        ckpt.close()
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Recorded under orbax's own handler name: orbax alone (no jonebit) restores the checkpoint.
    recorded = json.loads((tmp_path / "run" / "1" / "_CHECKPOINT_METADATA").read_text())["item_handlers"]
    assert recorded["state"] == ocp.StandardCheckpointHandler.typestr(), recorded
    alone = ocp.CheckpointManager((tmp_path / "run").absolute()).restore(1)
    np.testing.assert_array_equal(np.asarray(alone["state"]["params"]["big"]), np.asarray(state.params["big"]))
    slices.clear()
    checkpoint.save(tmp_path / "alone", state, step=1)
    assert sorted(slices) == want, slices
