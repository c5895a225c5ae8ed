"""Orbax checkpoints that keep 1-bit Adam's per-rank error buffers, written atomically and verified on restore.

DeepSpeed saves only rank 0's optimizer state and zeroes the error-feedback buffers on every load. Here
the buffers are global arrays (one row per rank), so they are saved sharded with everything else and
restored exactly when the data-parallel world size is unchanged. When it changed, rows no longer map to
ranks: the buffers are re-zeroed (DeepSpeed's behaviour, harmless in practice) with a logged warning.
1-bit Adam partitioned for ZeRO cannot change its world size at all (its moments are laid out in chunks
per rank) and is refused.

Layout of ``save(path, ...)``: ``path`` is one orbax (v1) checkpoint directory with two checkpointables,
``state`` (the training state with the error buffers taken out) and ``errors`` (the buffers of every
1-bit Adam state, plain or ZeRO, in tree order), orbax's ``_CHECKPOINT_METADATA`` (JSON; its
``custom_metadata`` records the user's ``step`` and the world size), and ``jonebit_manifest.json``, the
size and CRC-32 of every other file, written last.

Atomic replacement: a save never touches ``path`` until the new checkpoint is complete.

1. Orbax writes to the sibling ``<path>.jonebit-new`` (itself through its own
   ``<path>.jonebit-new.orbax-checkpoint-tmp*`` directory, renamed when orbax commits), then the
   manifest is written into it.
2. Swap: ``path`` is renamed to ``<path>.jonebit-old``, ``<path>.jonebit-new`` to ``path``, and the old
   one is deleted.

Whenever a save is interrupted (exception, SIGKILL, power loss between renames), one complete checkpoint
remains: ``path`` if it exists, otherwise ``<path>.jonebit-old`` (the swap stopped between its two
renames). :func:`restore` reads that one; the next :func:`save` first moves ``.jonebit-old`` back to
``path`` and deletes the leftovers of the interrupted save (``.jonebit-new``, orbax temporary
directories), so a temporary directory is never taken for a checkpoint. Every process calls
:func:`save` (orbax writes each process's shards); only process 0 renames and deletes, between
barriers.

Restore refuses, with an error that names the file or the key path: a damaged or missing metadata
file, a data file whose size or checksum differs from the manifest, and a target whose tree (keys,
shapes, dtypes, 1-bit Adam states) differs from the saved one (no silent cast, e.g. float32 into
bfloat16). Target leaves may be ``jax.Array`` or
``jax.ShapeDtypeStruct`` with a ``sharding`` (restored onto that sharding: this is what reshards onto
another mesh), or numpy arrays (restored as whole numpy arrays on the host, e.g. to inspect a
checkpoint).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import logging
import os
import pathlib
import shutil
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jonebit.transforms.onebit_adam import is_onebit_state
from jonebit.transforms.onebit_adam_zero import OneBitAdamZeroState

log = logging.getLogger(__name__)

MANIFEST = "jonebit_manifest.json"
METADATA = "_CHECKPOINT_METADATA"
NEW_SUFFIX = ".jonebit-new"
OLD_SUFFIX = ".jonebit-old"
_ORBAX_TMP = ".orbax-checkpoint-tmp"
_FORMAT = 1

# Called with the name of each step of a save ("write", "written", "swap", "swapped"); tests set it to
# interrupt a save at a known point. None in normal use.
_on_phase: Callable[[str], None] | None = None

# orbax saves a replicated array by splitting it among its replicas (each writes a slice). Every slice is an eager
# slicing op on the host (~2.7 ms on CPU): for the small arrays of a model's state that costs far more than it saves
# (4.6 s of a 5 s save of a tiny BERT's 1-bit state, 8 devices). A replica's share below this size is not split off.
MIN_REPLICA_SLICE_BYTES = 1 << 20


def manager_handlers():
    """Handlers for an orbax ``CheckpointManager`` of a ``TrainState`` item ``"state"`` (``StandardSave``) and a
    JSON item ``"meta"``: orbax's own, except that arrays are split among replicas only in shares of at least
    :data:`MIN_REPLICA_SLICE_BYTES`. ``None`` (orbax's defaults, said in the log) where this orbax lacks the parts
    used; checkpoints are the same either way."""
    import orbax.checkpoint as ocp

    try:
        from orbax.checkpoint._src.metadata import array_metadata_store
        from orbax.checkpoint.type_handlers import ArrayHandler, create_type_handler_registry, get_type_handler

        arrays = ArrayHandler(min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES,
                              array_metadata_store=array_metadata_store.Store())
        others = [(t, get_type_handler(t)) for t in (int, float, bytes, np.number, np.ndarray, str)]
        types = create_type_handler_registry((jax.Array, arrays), *others)

        class StateHandler(ocp.StandardCheckpointHandler):
            """orbax's StandardCheckpointHandler over the registry above; recorded under orbax's name, so any
            orbax reader restores these checkpoints as its own."""

            def __init__(self):
                super().__init__()
                if type(self._impl) is not ocp.PyTreeCheckpointHandler:
                    raise TypeError("StandardCheckpointHandler holds no PyTreeCheckpointHandler")
                self._impl = ocp.PyTreeCheckpointHandler(type_handler_registry=types)

            @classmethod
            def typestr(cls) -> str:
                return ocp.StandardCheckpointHandler.typestr()

        state, meta = StateHandler(), ocp.JsonCheckpointHandler()
    except (ImportError, AttributeError, TypeError) as e:
        log.warning("checkpoints use orbax's default replica slicing (%s)", e)
        return None
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for args in (ocp.args.StandardSave, ocp.args.StandardRestore):
        registry.add("state", args, state)
    for args in (ocp.args.JsonSave, ocp.args.JsonRestore):
        registry.add("meta", args, meta)
    return registry


def _save_context(ocp):
    """The active orbax (v1) context with :data:`MIN_REPLICA_SLICE_BYTES` where it sets no minimum of its own."""
    try:
        from orbax.checkpoint.experimental.v1._src.context.context import get_context

        context = ocp.Context(get_context())
        if context.array.saving.min_slice_bytes_for_replica_parallel is None:
            context.array.saving.min_slice_bytes_for_replica_parallel = MIN_REPLICA_SLICE_BYTES
    except (ImportError, AttributeError, TypeError) as e:
        log.warning("checkpoint.save uses orbax's default replica slicing (%s)", e)
        return contextlib.nullcontext()
    return context


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored: damaged, incomplete, or saved from a different tree."""


# ----------------------------------------------------------------------------------------------------------------
# 1-bit Adam error buffers travel in their own checkpointable.


def _with_errors(node, worker, server):
    if dataclasses.is_dataclass(node):  # OneBitAdamZeroState
        return dataclasses.replace(node, worker_error=worker, server_error=server)
    return node._replace(worker_error=worker, server_error=server)


def _split(tree):
    """(tree with the error buffers set to None, list of {"worker", "server"} buffers in tree order)."""
    errors = []

    def strip(node):
        if is_onebit_state(node):
            errors.append({"worker": node.worker_error, "server": node.server_error})
            return _with_errors(node, None, None)
        return node

    return jax.tree.map(strip, tree, is_leaf=is_onebit_state), errors


def _join(stripped, target, errors):
    """Puts error buffers back into ``stripped``; ``errors`` is None to take zeros shaped like ``target``'s."""
    targets = [n for n in jax.tree.leaves(target, is_leaf=is_onebit_state) if is_onebit_state(n)]
    it = iter(zip(targets, errors or [None] * len(targets), strict=True))

    def zero(s):
        if isinstance(s, np.ndarray):
            return np.zeros(s.shape, s.dtype)
        return jax.device_put(jnp.zeros(s.shape, s.dtype), s.sharding)

    def put(node):
        if is_onebit_state(node):
            tgt, err = next(it)
            if err is None:
                return _with_errors(node, jax.tree.map(zero, tgt.worker_error), jax.tree.map(zero, tgt.server_error))
            return _with_errors(node, err["worker"], err["server"])
        return node

    return jax.tree.map(put, stripped, is_leaf=is_onebit_state)


def _onebit_states(tree) -> list:
    return [n for n in jax.tree.leaves(tree, is_leaf=is_onebit_state) if is_onebit_state(n)]


def _world_size(tree) -> int | None:
    for node in _onebit_states(tree):
        return int(jax.tree.leaves(node.worker_error)[0].shape[0])
    return None


def _older_error_layout(saved, target) -> bool:
    """Whether the saved error buffers are the target's in the layout before stacking: one ``(P, n)`` array per
    leaf where the target keeps one ``(P, k, n)`` array per group of ``k`` equal-size leaves (same arrays, other
    layout; anything else is a real mismatch, left to :func:`_compare`)."""
    if _shapes(saved).keys() == _shapes(target).keys():
        return False
    for old, new in zip(saved, target, strict=True):
        for side in ("worker", "server"):
            stacks = [shape for shape, _ in _shapes(new[side]).values()]
            if not stacks or any(len(shape) != 3 for shape in stacks):
                return False
            expanded = sorted((p, n) for p, k, n in stacks for _ in range(k))
            if sorted(shape for shape, _ in _shapes(old[side]).values()) != expanded:
                return False
    return True


def _zero_stage(tree) -> int | None:
    for node in _onebit_states(tree):
        if isinstance(node, OneBitAdamZeroState):
            return node.stage
    return None


# ----------------------------------------------------------------------------------------------------------------
# Trees: leaf checks and structure comparison.


def _keystr(key_path) -> str:
    parts = []
    for k in key_path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts) or "<root>"


_SAVEABLE = (jax.Array, np.ndarray, np.generic, int, float, bool)


def _saveable(state):
    """``state`` with numbers as 0-d numpy arrays (orbax stores arrays reliably, not every scalar type)."""

    def leaf(kp, x):
        if not isinstance(x, _SAVEABLE):
            raise TypeError(
                f"checkpoint.save: state leaf {_keystr(kp)!r} is a {type(x).__name__}; only arrays and numbers "
                "are saved (jax.Array, numpy arrays and scalars, Python int/float/bool). Convert it to an array "
                "or keep it out of the saved state"
            )
        return x if isinstance(x, jax.Array | np.ndarray) else np.asarray(x)

    return jax.tree_util.tree_map_with_path(leaf, state)


def _abstract(target):
    """The load target: ``ShapeDtypeStruct`` with sharding for device leaves, numpy arrays for host leaves."""

    def leaf(kp, x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, jax.ShapeDtypeStruct):
            if x.sharding is None:
                raise TypeError(
                    f"checkpoint.restore: target leaf {_keystr(kp)!r} is a jax.ShapeDtypeStruct without a sharding; "
                    "give it sharding= (where the restored array should live) or pass a numpy array to restore "
                    "the whole array on the host"
                )
            return x
        if isinstance(x, np.ndarray | np.generic | int | float | bool):
            return np.asarray(x)
        raise TypeError(
            f"checkpoint.restore: target leaf {_keystr(kp)!r} is a {type(x).__name__}; expected a jax.Array, a "
            "jax.ShapeDtypeStruct with a sharding, or a numpy array shaped like the saved leaf"
        )

    return jax.tree_util.tree_map_with_path(leaf, target)


def _shapes(tree) -> dict[str, tuple[tuple[int, ...], str]]:
    out = {}
    for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dtype = getattr(leaf, "dtype", None)
        out[_keystr(kp)] = (tuple(getattr(leaf, "shape", ())), str(dtype) if dtype is not None else "?")
    return out


def _describe(shape_dtype) -> str:
    shape, dtype = shape_dtype
    return f"shape {shape} {dtype}"


def _compare(saved_tree, target_tree, *, what: str, src: pathlib.Path) -> None:
    """Raises CheckpointError naming the first key path where ``target_tree`` differs from the saved tree."""
    saved, want = _shapes(saved_tree), _shapes(target_tree)
    hint = ("; restore into a target built like the saved state (same model config, optimizer and ZeRO stage, "
            "and the same data-parallel world size for the 1-bit Adam error buffers)")
    extra = [k for k in saved if k not in want]
    for key, sd in want.items():
        if key not in saved:
            near = f" (the checkpoint holds {extra[0]!r} {_describe(saved[extra[0]])} instead)" if extra else ""
            raise CheckpointError(
                f"checkpoint {src}: the target's {what} has {key!r} {_describe(sd)}, which the checkpoint does not "
                f"hold{near}{hint}"
            )
        if saved[key][0] != sd[0]:
            raise CheckpointError(
                f"checkpoint {src}: {what} leaf {key!r} was saved with {_describe(saved[key])}, the target has "
                f"{_describe(sd)}{hint}"
            )
        if "?" not in (saved[key][1], sd[1]) and saved[key][1] != sd[1]:
            # orbax would cast silently (float32 -> bfloat16 drops 16 bits of every value, and a resumed run
            # then differs from the saved one); a cast has to be the caller's explicit choice.
            raise CheckpointError(
                f"checkpoint {src}: {what} leaf {key!r} was saved as {saved[key][1]}, the target has dtype "
                f"{sd[1]}; restore into a target of the saved dtype ({saved[key][1]}) and cast afterwards if a "
                f"different precision is intended (e.g. jax.tree.map(lambda x: x.astype(...), state))"
            )
    if extra:
        raise CheckpointError(
            f"checkpoint {src}: its {what} holds {extra[0]!r} {_describe(saved[extra[0]])}, which the target lacks "
            f"({len(extra)} saved leaves missing from the target){hint}"
        )


# ----------------------------------------------------------------------------------------------------------------
# Files: manifest, metadata, location of the valid checkpoint.


def _crc32(file: pathlib.Path) -> int:
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _data_files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def _fsync_dir(path: pathlib.Path) -> None:
    """Makes renames and new entries in ``path`` durable; best effort (some file systems refuse it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_manifest(root: pathlib.Path, step: int, world_size: int | None) -> None:
    files = {p.relative_to(root).as_posix(): {"size": p.stat().st_size, "crc32": _crc32(p)} for p in _data_files(root)}
    body = {"format": _FORMAT, "step": step, "world_size": world_size, "files": files}
    with open(root / MANIFEST, "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(root)


def _read_json(file: pathlib.Path, src: pathlib.Path) -> dict:
    name = file.relative_to(src).as_posix()
    if not file.is_file():
        raise CheckpointError(f"checkpoint {src}: {name} is missing; the checkpoint is incomplete or damaged")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"checkpoint {src}: {name} is not valid JSON ({e}, {file.stat().st_size} bytes): the file is truncated "
            "or damaged"
        ) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"checkpoint {src}: {name} holds a JSON {type(data).__name__}, expected an object")
    return data


def _read_metadata(src: pathlib.Path) -> dict:
    """``custom_metadata`` ({"step": int, "world_size": int | None}) from orbax's metadata file, checked."""
    meta = _read_json(src / METADATA, src).get("custom_metadata")
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {src}: {METADATA} has no custom_metadata object (written by another tool?)")
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise CheckpointError(f"checkpoint {src}: {METADATA} has no integer 'step' in custom_metadata (got {step!r})")
    world = meta.get("world_size")
    if world is not None and (isinstance(world, bool) or not isinstance(world, int)):
        raise CheckpointError(f"checkpoint {src}: {METADATA} has a non-integer 'world_size' {world!r}")
    return meta


def _verify_files(src: pathlib.Path, meta: dict) -> None:
    if not (src / MANIFEST).exists():
        raise CheckpointError(
            f"checkpoint {src}: {MANIFEST} is missing, so its files cannot be checked (a checkpoint written before "
            "manifests existed, or by another tool); pass verify=False to restore it unchecked"
        )
    manifest = _read_json(src / MANIFEST, src)
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"checkpoint {src}: {MANIFEST} has no file table; the file is damaged")
    for name, want in files.items():
        file = src / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {src}: data file {name} is missing")
        size = file.stat().st_size
        if size != want.get("size"):
            raise CheckpointError(
                f"checkpoint {src}: file {name} has {size} bytes, {want.get('size')} were written "
                "(truncated or damaged)"
            )
        if _crc32(file) != want.get("crc32"):
            raise CheckpointError(f"checkpoint {src}: file {name} is damaged (CRC-32 differs from the one written)")
    if manifest.get("step") != meta["step"]:
        raise CheckpointError(
            f"checkpoint {src}: {MANIFEST} records step {manifest.get('step')!r}, {METADATA} {meta['step']!r}"
        )


def _siblings(path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    return path.with_name(path.name + NEW_SUFFIX), path.with_name(path.name + OLD_SUFFIX)


def _leftovers(path: pathlib.Path) -> list[pathlib.Path]:
    """Temporary directories an interrupted save of ``path`` may leave (never a valid checkpoint)."""
    new, _ = _siblings(path)
    found = set(path.parent.glob(f"{glob.escape(path.name)}{_ORBAX_TMP}*"))
    found |= set(path.parent.glob(f"{glob.escape(new.name)}*"))
    return sorted(found)


def _rmtree(path: pathlib.Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _recover(path: pathlib.Path) -> None:
    """Process 0, before a save: brings back a checkpoint left in ``.jonebit-old`` and removes leftovers."""
    _, old = _siblings(path)
    if old.exists() and not path.exists():
        log.warning("checkpoint %s: a previous save stopped while swapping; restoring %s to its place", path, old)
        old.rename(path)
        _fsync_dir(path.parent)
    for p in _leftovers(path) + ([old] if old.exists() else []):
        log.info("checkpoint %s: removing %s left by an interrupted save", path, p)
        _rmtree(p)


def _swap(path: pathlib.Path, new: pathlib.Path, old: pathlib.Path) -> None:
    if path.exists():
        path.rename(old)
    _phase("swap")
    new.rename(path)
    _fsync_dir(path.parent)
    _phase("swapped")
    if old.exists():
        shutil.rmtree(old)


def _locate(path: pathlib.Path) -> pathlib.Path:
    """The directory that holds the valid checkpoint of ``path``, or a clear error."""
    if _ORBAX_TMP in path.name or path.name.endswith(NEW_SUFFIX):
        final = path.name.split(_ORBAX_TMP)[0].removesuffix(NEW_SUFFIX)
        raise CheckpointError(
            f"{path} is the temporary directory of a save that did not complete, not a checkpoint; restore "
            f"{path.with_name(final)} (the last complete checkpoint) instead"
        )
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"checkpoint path {path} is a file; pass the directory that save() wrote")
    if not path.exists():
        _, old = _siblings(path)
        if old.is_dir():
            log.warning("checkpoint %s: a save stopped while swapping; restoring the previous checkpoint %s", path, old)
            return old
        left = _leftovers(path)
        if left:
            raise FileNotFoundError(
                f"no checkpoint at {path}: only {', '.join(p.name for p in left)} exist there, left by a save that "
                "did not complete (nothing was ever committed under this name)"
            )
        raise FileNotFoundError(f"no checkpoint directory at {path}")
    if not any(path.iterdir()):
        raise CheckpointError(f"checkpoint path {path} is an empty directory, not a checkpoint written by save()")
    if not (path / METADATA).exists() and not (path / MANIFEST).exists():
        names = ", ".join(sorted(p.name for p in path.iterdir())[:5])
        raise CheckpointError(
            f"{path} is not a checkpoint written by jonebit.train.checkpoint.save (no {METADATA}; it holds {names})"
        )
    return path


# ----------------------------------------------------------------------------------------------------------------
# Multi-process coordination.


def _primary() -> bool:
    return jax.process_index() == 0


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"jonebit_checkpoint_{name}")


def _phase(name: str) -> None:
    if _on_phase is not None:
        _on_phase(name)


# ----------------------------------------------------------------------------------------------------------------


def save(path: str | pathlib.Path, state: Any, *, step: int, overwrite: bool = False) -> pathlib.Path:
    """Saves a training-state pytree (params, optimizer state, ...) to the directory ``path``.

    Call it on every process of a multi-host job (orbax writes each process's shards). The previous
    checkpoint at ``path`` stays valid until the new one is complete (see the module docstring).

    Args:
      path: the checkpoint directory; its parent must exist.
      state: a pytree whose leaves are arrays (``jax.Array``, numpy) or numbers (saved as 0-d numpy arrays).
      step: the training step, returned by :func:`restore`.
      overwrite: replace an existing checkpoint at ``path``; without it an existing one is an error.

    Returns:
      ``path`` as a ``pathlib.Path``.
    """
    from orbax.checkpoint import v1 as ocp

    path = pathlib.Path(path)
    if isinstance(step, bool) or not isinstance(step, int | np.integer):
        raise TypeError(f"checkpoint.save: step must be an int, got {type(step).__name__} {step!r}")
    state = _saveable(state)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"checkpoint.save: parent directory {path.parent} of {path} does not exist")
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"checkpoint.save: {path} is a file, not a checkpoint directory; choose another path")
    new, old = _siblings(path)
    if _primary():
        _recover(path)
    _sync("recovered")
    if path.exists() and not overwrite:
        raise FileExistsError(f"checkpoint {path} already exists; pass overwrite=True to replace it")

    stripped, errors = _split(state)
    items = {"state": stripped, "errors": errors} if errors else {"state": stripped}  # orbax refuses empty items
    world = _world_size(state)
    _phase("write")
    try:
        with _save_context(ocp):
            ocp.save_checkpointables(new, items, custom_metadata={"step": int(step), "world_size": world})
        if _primary():
            _write_manifest(new, int(step), world)
        _sync("written")
        _phase("written")
        if _primary():
            _swap(path, new, old)
    except BaseException:
        if jax.process_count() == 1:  # with several processes, the next save cleans up
            for p in _leftovers(path):
                _rmtree(p)
            if old.exists() and not path.exists():
                old.rename(path)
        raise
    _sync("swapped")
    return path


def restore(path: str | pathlib.Path, target: Any, *, verify: bool = True) -> tuple[Any, int]:
    """Restores ``(state, step)`` shaped and placed like ``target``.

    Args:
      path: a directory written by :func:`save`. If a save was interrupted while swapping, the previous
        checkpoint is read from ``<path>.jonebit-old``.
      target: a pytree like the saved state. Leaves: ``jax.Array`` or ``jax.ShapeDtypeStruct`` with the
        ``sharding`` the restored array should have (this is what reshards onto a different mesh), or numpy
        arrays (restored as numpy arrays holding the whole saved array).
      verify: check every file's size and CRC-32 against the manifest written at save time (reads the
        checkpoint once more); ``False`` skips it, e.g. for a checkpoint written before manifests existed.

    Raises:
      CheckpointError: damaged or incomplete files, or a target whose tree differs from the saved one.
      FileNotFoundError, NotADirectoryError: no checkpoint at ``path``.
    """
    from orbax.checkpoint import v1 as ocp

    path = pathlib.Path(path)
    src = _locate(path)
    meta = _read_metadata(src)
    if verify:
        _verify_files(src, meta)
    abstract = _abstract(target)
    stripped, errors = _split(abstract)
    try:
        saved = ocp.checkpointables_metadata(src).metadata
    except Exception as e:
        raise CheckpointError(f"checkpoint {src}: cannot read its tree metadata ({type(e).__name__}: {e})") from e
    for name in ("state", "errors") if (src / "errors").exists() else ("state",):
        if saved.get(name) is None:  # orbax logs the reason and returns None
            raise CheckpointError(
                f"checkpoint {src}: cannot read the tree metadata of '{name}': {name}/_METADATA is missing, "
                "unreadable or damaged"
            )

    saved_world, current = meta.get("world_size"), _world_size(abstract)
    n_saved = len(saved.get("errors") or [])
    if n_saved != len(errors):
        raise CheckpointError(
            f"checkpoint {src} holds the error buffers of {n_saved} 1-bit Adam state(s), the target has "
            f"{len(errors)} 1-bit Adam state(s): the optimizer differs (e.g. adamw vs onebit_adam); build the "
            "target with the optimizer the checkpoint was saved with"
        )
    if saved_world != current and _zero_stage(abstract) is not None:
        raise ValueError(
            f"checkpoint {src} holds 1-bit Adam partitioned for ZeRO stage {_zero_stage(abstract)} over {saved_world} "
            f"ranks; its momentum, variance (and at stage 3 the parameters) are laid out in server chunks of that "
            f"world size and cannot be restored on {current} ranks. Restore it on {saved_world} ranks, or save the "
            "parameter tree (FlatParams.tree()) and restart the optimizer"
        )
    _compare(saved["state"], stripped, what="state", src=src)
    same_layout = not (errors and _older_error_layout(saved["errors"], errors))
    keep_errors = saved_world == current and same_layout
    if saved_world != current:
        log.warning(
            "checkpoint %s was written with %s data-parallel ranks, restoring on %s: 1-bit Adam's error "
            "buffers are reset to zero (everything else is restored)", src, saved_world, current,
        )
    elif not same_layout:
        log.warning(
            "checkpoint %s keeps 1-bit Adam's per-leaf error buffers in an older layout (one array per leaf, "
            "now one per group of equal-size leaves): they are reset to zero (everything else is restored)", src,
        )
    elif errors:
        _compare(saved["errors"], errors, what="1-bit Adam error buffers", src=src)
    items = {"state": stripped, "errors": errors} if errors and keep_errors else {"state": stripped}
    try:
        loaded = ocp.load_checkpointables(src, items)
    except Exception as e:
        raise CheckpointError(f"checkpoint {src}: reading its data failed ({type(e).__name__}: {e})") from e
    errs = loaded.get("errors", []) if keep_errors else None
    return _join(loaded["state"], abstract, errs), int(meta["step"])
