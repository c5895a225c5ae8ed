import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

import jonebit
from jonebit import onebit_adam
from jonebit.train import checkpoint
from jonebit.train.data_parallel import data_mesh, init_optimizer, make_update, replicate, shard_batch
from tests.mpi_util import ROOT, worker_env
from tests.train.checkpoint_worker import make_state


def train(tx, mesh, params, state, specs, grads, steps):
    update = make_update(tx, mesh, specs)
    for g in grads[:steps]:
        params, state = update(params, state, shard_batch(g, mesh))
    return params, state


def setup(p, seed=0):
    rng = np.random.default_rng(seed)
    params0 = {"w": rng.standard_normal((24, 10)).astype(np.float32), "b": np.zeros(7, np.float32)}
    grads = [{k: rng.standard_normal((p,) + v.shape).astype(np.float32) for k, v in params0.items()}
             for _ in range(8)]
    return params0, grads


def test_round_trip_keeps_error_buffers_and_resumes_exactly(tmp_path):
    mesh = data_mesh(8)
    tx = onebit_adam(1e-2, freeze_step=2, fused=True)
    params0, grads = setup(8)
    params = replicate(params0, mesh)
    state, specs = init_optimizer(tx, params, mesh)
    params, state = train(tx, mesh, params, state, specs, grads, 4)  # 2 compressed steps: errors non-zero
    assert np.any(np.asarray(state.worker_error))
    snapshot = jax.device_get({"params": params, "opt_state": state})
    checkpoint.save(tmp_path / "ckpt", {"params": params, "opt_state": state}, step=4)

    restored, step = checkpoint.restore(tmp_path / "ckpt", {"params": params, "opt_state": state})
    assert step == 4
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), snapshot)
    assert restored["opt_state"].worker_error.sharding.spec[0] == "data"

    # Resuming from the restored state gives the same parameters as not stopping at all.
    cont, _ = train(tx, mesh, params, state, specs, grads[4:], 4)
    resumed, _ = train(tx, mesh, restored["params"], restored["opt_state"], specs, grads[4:], 4)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed), jax.device_get(cont))


def test_world_size_change_resets_errors(tmp_path, caplog):
    tx = onebit_adam(1e-2, freeze_step=2, fused=True)
    mesh8 = data_mesh(8)
    params0, grads = setup(8)
    params = replicate(params0, mesh8)
    state, specs = init_optimizer(tx, params, mesh8)
    params, state = train(tx, mesh8, params, state, specs, grads, 4)
    checkpoint.save(tmp_path / "ckpt", {"params": params, "opt_state": state}, step=4)

    mesh4 = data_mesh(4)
    target_params = replicate(params0, mesh4)
    target_state, _ = init_optimizer(tx, target_params, mesh4)
    with caplog.at_level(logging.WARNING):
        restored, _ = checkpoint.restore(tmp_path / "ckpt", {"params": target_params, "opt_state": target_state})
    assert "reset to zero" in caplog.text
    np.testing.assert_array_equal(np.asarray(restored["params"]["w"]), np.asarray(params["w"]))
    np.testing.assert_array_equal(np.asarray(restored["opt_state"].mu["w"]), np.asarray(state.mu["w"]))
    assert restored["opt_state"].worker_error.shape == target_state.worker_error.shape
    assert not np.any(np.asarray(restored["opt_state"].worker_error))
    assert int(restored["opt_state"].count) == 4


def test_per_leaf_round_trip_and_older_per_leaf_layout(tmp_path, caplog):
    """Per-leaf errors (stacked per group of equal-size leaves) round-trip exactly; a checkpoint holding them one
    array per leaf (the layout before stacking) restores everything else and resets them, with a warning."""
    from jonebit.transforms.onebit_adam import leaf_errors

    mesh = data_mesh(8)
    tx = onebit_adam(1e-2, freeze_step=2, fused=False)
    params0, grads = setup(8)
    params0["v"] = np.ones(7, np.float32)  # a second leaf of 7: one group of two
    grads = [dict(g, v=g["b"] * 0.5) for g in grads]
    params = replicate(params0, mesh)
    state, specs = init_optimizer(tx, params, mesh)
    params, state = train(tx, mesh, params, state, specs, grads, 4)
    assert [e.shape[1] for e in state.worker_error] == [2, 1]  # "b" and "v" stacked, then "w"
    assert all(np.any(np.asarray(e)) for e in state.worker_error)
    checkpoint.save(tmp_path / "new", {"params": params, "opt_state": state}, step=4)
    restored, _ = checkpoint.restore(tmp_path / "new", {"params": params, "opt_state": state})
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored),
                 jax.device_get({"params": params, "opt_state": state}))

    per_leaf = state._replace(worker_error=leaf_errors(state.worker_error, params0),
                              server_error=leaf_errors(state.server_error, params0))
    checkpoint.save(tmp_path / "old", {"params": params, "opt_state": per_leaf}, step=4)
    with caplog.at_level(logging.WARNING):
        restored, step = checkpoint.restore(tmp_path / "old", {"params": params, "opt_state": state})
    assert step == 4 and "older layout" in caplog.text
    np.testing.assert_array_equal(np.asarray(restored["opt_state"].mu["w"]), np.asarray(state.mu["w"]))
    assert [e.shape for e in restored["opt_state"].worker_error] == [e.shape for e in state.worker_error]
    assert not any(np.any(np.asarray(e)) for e in restored["opt_state"].worker_error)
    # A fused checkpoint is not an older layout of the per-leaf one: refused by name, as before.
    fused = onebit_adam(1e-2, freeze_step=2, fused=True)
    f_state, _ = init_optimizer(fused, params, mesh)
    checkpoint.save(tmp_path / "fused", {"params": params, "opt_state": f_state}, step=4)
    with pytest.raises(checkpoint.CheckpointError, match="error buffers"):
        checkpoint.restore(tmp_path / "fused", {"params": params, "opt_state": state})


def test_zero_stage3_onebit_round_trip_and_world_size_guard(tmp_path):
    import functools

    from jonebit.models import tiny_lm
    from jonebit.train.zero import init_zero, make_zero_step

    cfg = tiny_lm.TinyLMConfig(vocab_size=32, seq_len=8, dim=16, heads=2, layers=1)
    params0 = tiny_lm.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    batches = [jax.numpy.asarray(rng.integers(0, 32, (8, 9))) for _ in range(6)]
    loss = functools.partial(tiny_lm.loss_fn, cfg=cfg)

    def run(mesh, params, state, sh, bs):
        step = make_zero_step(loss, tx, mesh, sh, donate=False)
        for b in bs:
            params, state, _ = step(params, state, b)
        return params, state

    tx = jonebit.onebit_adam_zero(1e-2, freeze_step=2, fused=False, stage=3)
    mesh = data_mesh(8)
    params, state, sh = init_zero(tx, params0, mesh, stage=3)
    params, state = run(mesh, params, state, sh, batches[:3])  # past freeze_step: packed momentum in use
    assert np.any(np.asarray(state.worker_error[0]))
    checkpoint.save(tmp_path / "z3", {"params": params, "opt_state": state}, step=3)
    restored, step = checkpoint.restore(tmp_path / "z3", {"params": params, "opt_state": state})
    assert step == 3
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored),
                 jax.device_get({"params": params, "opt_state": state}))
    cont = run(mesh, params, state, sh, batches[3:])
    resumed = run(mesh, restored["params"], restored["opt_state"], sh, batches[3:])
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed), jax.device_get(cont))

    mesh4 = data_mesh(4)
    p4, s4, _ = init_zero(tx, params0, mesh4, stage=3)
    with pytest.raises(ValueError, match="server chunks"):
        checkpoint.restore(tmp_path / "z3", {"params": p4, "opt_state": s4})


# ---------------------------------------------------------------------------------------------------------------
# Atomic saves, damaged checkpoints and bad inputs.

WORKER = ROOT / "tests" / "train" / "checkpoint_worker.py"


@pytest.fixture(scope="module")
def states():
    """Three different states (seeds 1, 2, 3) of the same tree, as saved by the worker subprocess."""
    return {seed: make_state(seed) for seed in (1, 2, 3)}


def assert_same(restored, expected):
    got, want = jax.device_get(restored), jax.device_get(expected)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.asarray(g).dtype == np.asarray(w).dtype
        np.testing.assert_array_equal(g, w)


def run_worker(path, seed, kill, *, kill_after=None):
    """Runs checkpoint_worker.py; returns its exit code (-9 when SIGKILLed) and output."""
    env = worker_env(XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.Popen([sys.executable, str(WORKER), str(path), str(seed), kill], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        if kill_after is not None:
            for line in proc.stdout:
                lines.append(line)
                if line.startswith("SAVING"):
                    time.sleep(kill_after)
                    proc.send_signal(signal.SIGKILL)
                    break
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, "".join(lines) + (out or "")


def siblings(path):
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


def check_next_save(path, states):
    """A save after an interrupted one succeeds, leaves only ``path``, and restores exactly."""
    checkpoint.save(path, states[3], step=3, overwrite=True)
    assert siblings(path) == []
    restored, step = checkpoint.restore(path, states[3])
    assert step == 3
    assert_same(restored, states[3])


# phase -> (what restore returns afterwards, leftovers expected beside the checkpoint)
KILL_POINTS = {
    "phase:write": (1, []),
    "mid-write": (1, ["ckpt.jonebit-new.orbax-checkpoint-tmp"]),
    "phase:written": (1, ["ckpt.jonebit-new"]),
    "phase:swap": (1, ["ckpt.jonebit-new", "ckpt.jonebit-old"]),
    "phase:swapped": (2, ["ckpt.jonebit-old"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("kill", list(KILL_POINTS))
def test_sigkill_at_each_save_phase_keeps_a_valid_checkpoint(tmp_path, states, kill):
    path = tmp_path / "ckpt"
    checkpoint.save(path, states[1], step=1)
    rc, out = run_worker(path, 2, kill)
    assert rc == -signal.SIGKILL, out
    expected, left = KILL_POINTS[kill]
    assert [re.sub(r"(orbax-checkpoint-tmp).*", r"\1", n) for n in siblings(path)] == left
    restored, step = checkpoint.restore(path, states[1])
    assert step == expected
    assert_same(restored, states[expected])
    if kill == "phase:swap":  # the previous checkpoint still counts as existing
        with pytest.raises(FileExistsError, match="overwrite=True"):
            checkpoint.save(path, states[3], step=3)
    check_next_save(path, states)


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.05, 0.2, 0.5, 1.0, 1.5, 2.5])
def test_sigkill_after_delay_keeps_old_or_new_checkpoint(tmp_path, states, delay):
    path = tmp_path / "ckpt"
    checkpoint.save(path, states[1], step=1)
    rc, out = run_worker(path, 2, "none", kill_after=delay)
    restored, step = checkpoint.restore(path, states[1])
    if rc == 0:  # the save finished before the kill
        assert step == 2, out
    assert step in (1, 2)
    assert_same(restored, states[step])
    check_next_save(path, states)


@pytest.mark.slow
@pytest.mark.parametrize("kill, message", [
    ("mid-write", r"only ckpt\.jonebit-new\.orbax-checkpoint-tmp\S* exist there.*did not complete"),
    ("phase:written", r"only ckpt\.jonebit-new exist there.*did not complete"),
])
def test_first_save_killed_leaves_no_checkpoint(tmp_path, states, kill, message):
    path = tmp_path / "ckpt"
    rc, out = run_worker(path, 2, kill)
    assert rc == -signal.SIGKILL, out
    with pytest.raises(FileNotFoundError, match=message):
        checkpoint.restore(path, states[1])
    for leftover in tmp_path.iterdir():
        with pytest.raises(checkpoint.CheckpointError, match="temporary directory of a save that did not complete"):
            checkpoint.restore(leftover, states[1])
    check_next_save(path, states)


@pytest.mark.parametrize("phase", ["write", "written", "swap", "swapped"])
def test_exception_during_save_keeps_previous_checkpoint(tmp_path, states, phase, monkeypatch):
    path = tmp_path / "ckpt"
    checkpoint.save(path, states[1], step=1)

    def fail(name):
        if name == phase:
            raise RuntimeError(f"disk full at {name}")

    monkeypatch.setattr(checkpoint, "_on_phase", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        checkpoint.save(path, states[2], step=2, overwrite=True)
    monkeypatch.setattr(checkpoint, "_on_phase", None)
    expected = 2 if phase == "swapped" else 1  # after "swapped" the new checkpoint is in place
    restored, step = checkpoint.restore(path, states[1])
    assert step == expected
    assert_same(restored, states[expected])
    check_next_save(path, states)


@pytest.mark.parametrize("leaf, kind", [(object(), "object"), ("text", "str")])
def test_unsaveable_leaf_is_refused_and_previous_checkpoint_kept(tmp_path, states, leaf, kind):
    path = tmp_path / "ckpt"
    checkpoint.save(path, states[1], step=1)
    with pytest.raises(TypeError, match=rf"state leaf 'params/bad' is a {kind}; only arrays and numbers"):
        checkpoint.save(path, {**states[2], "params": {**states[2]["params"], "bad": leaf}}, step=2, overwrite=True)
    assert siblings(path) == []
    restored, step = checkpoint.restore(path, states[1])
    assert step == 1
    assert_same(restored, states[1])


@pytest.fixture(scope="module")
def saved(tmp_path_factory, states):
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    checkpoint.save(path, states[1], step=1)
    return path


def damaged_copies(saved, tmp_path, damage):
    """Yields (relative file name, copy of ``saved`` with that one file damaged by ``damage``)."""
    names = sorted(p.relative_to(saved).as_posix() for p in saved.rglob("*") if p.is_file())
    assert {checkpoint.METADATA, checkpoint.MANIFEST, "state/_METADATA", "errors/_METADATA"} <= set(names)
    for i, name in enumerate(names):
        copy = tmp_path / f"c{i}"
        shutil.copytree(saved, copy)
        damage(copy / name)
        yield name, copy


def truncate(file):
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if data else b"\0")


def flip_byte(file):
    data = bytearray(file.read_bytes() or b"\0")
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def expected_damage_message(name, how, size):
    name = re.escape(name)
    if name in (re.escape(checkpoint.METADATA), re.escape(checkpoint.MANIFEST)):
        # A flipped byte (XOR 0xFF) is never valid UTF-8, so flipping reads as bad JSON too.
        return f"{name} is missing" if how == "delete" else f"{name} is not valid JSON"
    if how == "delete":
        return f"data file {name} is missing"
    if how == "truncate" or size == 0:  # damaging an empty file changes its size
        return f"file {name} has \\d+ bytes, {size} were written"
    return f"file {name} is damaged \\(CRC-32"


@pytest.mark.parametrize("how, damage", [("truncate", truncate), ("delete", os.remove), ("flip", flip_byte)])
def test_every_damaged_file_is_refused_by_name(saved, tmp_path, states, how, damage):
    sizes = {p.relative_to(saved).as_posix(): p.stat().st_size for p in saved.rglob("*") if p.is_file()}
    for name, copy in damaged_copies(saved, tmp_path, damage):
        message = expected_damage_message(name, how, sizes[name])
        if how == "delete" and name == checkpoint.MANIFEST:
            message += r".*verify=False"
        with pytest.raises(checkpoint.CheckpointError, match=message):
            checkpoint.restore(copy, states[1])
    assert len(sizes) >= 10


def edit_metadata(path, edit):
    meta = json.loads((path / checkpoint.METADATA).read_text())
    edit(meta)
    (path / checkpoint.METADATA).write_text(json.dumps(meta))


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("edit, message", [
    (lambda m: m["custom_metadata"].pop("step"), r"_CHECKPOINT_METADATA has no integer 'step' .*got None"),
    (lambda m: m["custom_metadata"].update(step="7"), r"no integer 'step' .*got '7'"),
    (lambda m: m.pop("custom_metadata"), r"_CHECKPOINT_METADATA has no custom_metadata"),
    (lambda m: m["custom_metadata"].update(world_size=8.5), r"non-integer 'world_size' 8.5"),
])
def test_metadata_without_step_is_refused_even_unverified(saved, tmp_path, states, edit, message, verify):
    copy = tmp_path / "c"
    shutil.copytree(saved, copy)
    edit_metadata(copy, edit)
    with pytest.raises(checkpoint.CheckpointError, match=message):
        checkpoint.restore(copy, states[1], verify=verify)


def test_metadata_with_another_valid_step_is_caught_by_the_manifest(saved, tmp_path, states):
    copy = tmp_path / "c"
    shutil.copytree(saved, copy)
    edit_metadata(copy, lambda m: m["custom_metadata"].update(step=2))  # valid JSON, same size, wrong step
    with pytest.raises(checkpoint.CheckpointError, match=r"file _CHECKPOINT_METADATA is damaged \(CRC-32"):
        checkpoint.restore(copy, states[1])
    restored, step = checkpoint.restore(copy, states[1], verify=False)  # unchecked: the edit goes through
    assert step == 2
    assert_same(restored, states[1])


def test_unverified_restore_of_damaged_array_metadata_names_the_checkpoint(saved, tmp_path, states):
    copy = tmp_path / "c"
    shutil.copytree(saved, copy)
    truncate(copy / "state" / "_METADATA")
    message = f"checkpoint {copy}: cannot read the tree metadata of 'state': state/_METADATA is"
    with pytest.raises(checkpoint.CheckpointError, match=message):
        checkpoint.restore(copy, states[1], verify=False)


def replace_leaf(state, key, value):
    return {**state, "params": {**state["params"], key: value}}


def without(tree, key):
    return {k: v for k, v in tree.items() if k != key}


def adamw_state(states):
    params = states[1]["params"]
    return {**states[1], "opt_state": optax.adamw(1e-3).init(params)}


def save_adamw(tmp_path, states):
    path = tmp_path / "adamw"
    checkpoint.save(path, adamw_state(states), step=5)
    return path


def write_file(path, text="x"):
    path.write_text(text)
    return path


def make_dir(path, *files):
    path.mkdir()
    for f in files:
        (path / f).write_text("x")
    return path


# id -> (call(tmp_path, saved, states), exception, message fragment)
BAD_INPUTS = {
    "restore: other model, other shape": (
        lambda t, c, s: checkpoint.restore(c, replace_leaf(s[1], "w", jax.numpy.zeros((12, 10)))),
        checkpoint.CheckpointError,
        r"state leaf 'params/w' was saved with shape \(24, 10\) float32, the target has shape \(12, 10\) float32"),
    "restore: float32 checkpoint, bfloat16 target": (
        lambda t, c, s: checkpoint.restore(c, replace_leaf(s[1], "w", s[1]["params"]["w"].astype(jax.numpy.bfloat16))),
        checkpoint.CheckpointError,
        r"state leaf 'params/w' was saved as float32, the target has dtype bfloat16; restore into a target of the "
        r"saved dtype \(float32\) and cast afterwards"),
    "restore: other model, other key": (
        lambda t, c, s: checkpoint.restore(c, {**s[1], "params": {"w": s[1]["params"]["w"], "c": s[1]["params"]["b"]}}),
        checkpoint.CheckpointError,
        r"the target's state has 'params/c' shape \(7,\) float32, which the checkpoint does not hold "
        r"\(the checkpoint holds 'params/b' shape \(7,\) float32 instead\)"),
    "restore: target lacks a saved leaf": (
        lambda t, c, s: checkpoint.restore(c, without(s[1], "blob")),
        checkpoint.CheckpointError, r"its state holds 'blob' shape \(8, 524288\) float32, which the target lacks"),
    "restore: adamw target, onebit_adam checkpoint": (
        lambda t, c, s: checkpoint.restore(c, adamw_state(s)),
        checkpoint.CheckpointError, r"error buffers of 1 1-bit Adam state\(s\), the target has 0 .*optimizer differs"),
    "restore: onebit_adam target, adamw checkpoint": (
        lambda t, c, s: checkpoint.restore(save_adamw(t, s), s[1]),
        checkpoint.CheckpointError, r"error buffers of 0 1-bit Adam state\(s\), the target has 1 .*optimizer differs"),
    "restore: ShapeDtypeStruct without sharding": (
        lambda t, c, s: checkpoint.restore(c, {**s[1], "blob": jax.ShapeDtypeStruct((8, 524288), np.float32)}),
        TypeError, r"target leaf 'blob' is a jax.ShapeDtypeStruct without a sharding; give it sharding="),
    "restore: string target leaf": (
        lambda t, c, s: checkpoint.restore(c, replace_leaf(s[1], "w", "w")),
        TypeError, r"target leaf 'params/w' is a str; expected a jax.Array"),
    "restore: empty directory": (
        lambda t, c, s: checkpoint.restore(make_dir(t / "empty"), s[1]),
        checkpoint.CheckpointError, r"empty is an empty directory, not a checkpoint"),
    "restore: directory of other files": (
        lambda t, c, s: checkpoint.restore(make_dir(t / "other", "notes.txt"), s[1]),
        checkpoint.CheckpointError, r"not a checkpoint written by .*no _CHECKPOINT_METADATA; it holds notes.txt"),
    "restore: path is a file": (
        lambda t, c, s: checkpoint.restore(write_file(t / "file"), s[1]),
        NotADirectoryError, r"checkpoint path .*file is a file; pass the directory that save\(\) wrote"),
    "restore: missing path": (
        lambda t, c, s: checkpoint.restore(t / "nothing", s[1]),
        FileNotFoundError, r"no checkpoint directory at .*nothing"),
    "restore: orbax temporary directory": (
        lambda t, c, s: checkpoint.restore(make_dir(t / "ckpt.orbax-checkpoint-tmp-123", "x"), s[1]),
        checkpoint.CheckpointError, r"temporary directory of a save that did not complete.*restore .*ckpt \("),
    "restore: only a temporary directory": (
        lambda t, c, s: checkpoint.restore(t / "ckpt", s[1]) if make_dir(t / "ckpt.orbax-checkpoint-tmp-9") else 0,
        FileNotFoundError, r"no checkpoint at .*ckpt: only ckpt.orbax-checkpoint-tmp-9 exist there"),
    "save: object leaf": (
        lambda t, c, s: checkpoint.save(t / "n", replace_leaf(s[1], "x", object()), step=1),
        TypeError, r"state leaf 'params/x' is a object; only arrays and numbers are saved"),
    "save: step not an int": (
        lambda t, c, s: checkpoint.save(t / "n", s[1], step="3"),
        TypeError, r"step must be an int, got str '3'"),
    "save: missing parent": (
        lambda t, c, s: checkpoint.save(t / "no" / "n", s[1], step=1),
        FileNotFoundError, r"parent directory .*no of .*n does not exist"),
    "save: path is a file": (
        lambda t, c, s: checkpoint.save(write_file(t / "file"), s[1], step=1, overwrite=True),
        FileExistsError, r"file is a file, not a checkpoint directory"),
    "save: exists, no overwrite": (
        lambda t, c, s: checkpoint.save(c, s[1], step=1),
        FileExistsError, r"already exists; pass overwrite=True"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_table(tmp_path, saved, states, case):
    call, exc, message = BAD_INPUTS[case]
    with pytest.raises(exc, match=message):
        call(tmp_path, saved, states)
    # The saved checkpoint is untouched by any of these.
    restored, step = checkpoint.restore(saved, states[1])
    assert step == 1


def test_numpy_target_restores_whole_numpy_arrays(saved, states):
    target = jax.device_get(states[1])
    restored, step = checkpoint.restore(saved, target)
    assert step == 1
    assert all(type(x) is np.ndarray for x in jax.tree.leaves(restored))
    assert restored["opt_state"].worker_error.shape == (8, target["opt_state"].worker_error.shape[1])
    assert_same(restored, states[1])


def test_zero_state_error_buffers_are_saved_apart(tmp_path):
    """Both 1-bit state types go through one predicate: ZeRO buffers are split off like plain ones."""
    from jonebit.transforms.onebit_adam import is_onebit_state
    from jonebit.transforms.onebit_adam_zero import OneBitAdamZeroState

    zero = OneBitAdamZeroState(
        count=np.int32(3), mu=(np.ones((8, 4), np.float32),), nu=(np.ones((8, 4), np.float32),), nu_full=(),
        m_rows=(np.zeros((8, 4), np.uint8),), worker_error=(np.full((8, 32), 2.0, np.float32),),
        server_error=(np.full((8, 4), 3.0, np.float32),), stage=3, phase=np.int32(0))
    assert is_onebit_state(zero)
    checkpoint.save(tmp_path / "z", {"opt": zero}, step=3)
    from orbax.checkpoint import v1 as ocp

    saved = ocp.checkpointables_metadata(tmp_path / "z").metadata
    assert [e["worker"][0].shape for e in saved["errors"]] == [(8, 32)]
    restored, _ = checkpoint.restore(tmp_path / "z", {"opt": zero})
    assert restored["opt"].stage == 3
    assert_same(restored, {"opt": zero})


@pytest.mark.multiprocess
def test_two_processes_overwrite_and_restore(tmp_path):
    """Every process saves, only process 0 swaps (between barriers); both restore their shards exactly."""
    (tmp_path / "ckpts").mkdir()
    path = tmp_path / "ckpts" / "ckpt"
    cmd = [sys.executable, "-m", "jonebit", "launch", "--nproc", "2", "--devices-per-proc", "2", "--",
           sys.executable, str(WORKER), str(path), "0", "two-processes"]
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert (tmp_path / "ok").exists()
    assert "process 1 of 2: 4 devices, restored step 2" in proc.stdout + proc.stderr
