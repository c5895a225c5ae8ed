"""HuggingFace checkpoints <-> NNX BERT state, and the 1-bit Adam momentum mask of unused positions.

HuggingFace directories hold ``config.json`` and ``model.safetensors`` with PyTorch names and layouts: dense weights
are ``[out, in]`` (NNX kernels are ``[in, out]``), LayerNorm parameters are ``weight``/``bias`` (older checkpoints:
``gamma``/``beta``), embeddings are ``weight``. Only ``safetensors.numpy`` is used: no torch at runtime.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jonebit.models.bert.config import BertConfig
from jonebit.models.bert.modeling import BertForPreTraining, BertForQuestionAnswering, BertModel
from jonebit.sharding.layerwise import STACKED_KEY

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"

# Buffers some checkpoints carry that are not parameters.
_IGNORED_SUFFIXES = ("embeddings.position_ids",)
# Names of the encoder proper; a checkpoint that lacks any of them cannot be used.
_ENCODER_PREFIXES = ("embeddings.", "encoder.")
_BASE_PREFIXES = ("embeddings.", "encoder.", "pooler.")
_TIED_DECODER = "cls.predictions.decoder.weight"
_TIED_DECODER_BIAS = "cls.predictions.decoder.bias"


def _safetensors_numpy():
    try:
        import safetensors.numpy as stnp
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("HuggingFace checkpoints need `safetensors` (pip install jonebit[hf])") from e
    return stnp


def _key_names(keypath: Iterable[Any]) -> tuple:
    """The module path of a leaf of an ``nnx.State`` (dict keys; the trailing ``.value`` attribute dropped)."""
    out = []
    for k in keypath:
        if isinstance(k, jax.tree_util.DictKey):
            out.append(k.key)
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(k.idx)
    return tuple(out)


def hf_name(path: tuple) -> tuple[str, bool]:
    """PyTorch name of an NNX parameter path and whether its array is transposed between the two layouts.

    ``('bert', 'encoder', 'layer', 0, 'attention', 'self', 'query', 'kernel')`` ->
    ``('bert.encoder.layer.0.attention.self.query.weight', True)``.
    """
    *parents, leaf = (str(p) for p in path)
    if leaf == "kernel":
        return ".".join([*parents, "weight"]), True
    if leaf in ("embedding", "scale"):
        return ".".join([*parents, "weight"]), False
    if leaf == "bias":
        return ".".join([*parents, "bias"]), False
    raise ValueError(f"no HuggingFace name for parameter {'.'.join(map(str, path))}")


def per_layer_paths(path: tuple, num_layers: int) -> list[tuple]:
    """The list-form paths of a leaf: ``[path]`` for an ordinary leaf; for a leaf of the stacked encoder
    (``..., 'stacked_layers', ...``, leading layer axis) the path of each layer's slice, ``..., 'layer', i, ...``."""
    if STACKED_KEY not in path:
        return [path]
    k = path.index(STACKED_KEY)
    return [(*path[:k], "layer", i, *path[k + 1:]) for i in range(num_layers)]


def _normalise_name(name: str) -> str:
    """Map legacy TensorFlow-era LayerNorm names (gamma/beta) to the current ones."""
    if name.endswith(".gamma"):
        return name[: -len(".gamma")] + ".weight"
    if name.endswith(".beta"):
        return name[: -len(".beta")] + ".bias"
    return name


def _base_prefix(model: nnx.Module) -> str:
    return "bert." if isinstance(getattr(model, "bert", None), BertModel) else ""


def _align_prefix(tensors: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """Rename checkpoint tensors so that encoder names carry ``prefix`` ('bert.' or '')."""
    out = {}
    for name, arr in tensors.items():
        if prefix == "" and name.startswith("bert."):
            name = name[len("bert."):]
        elif prefix == "bert." and name.startswith(_BASE_PREFIXES):
            name = prefix + name
        out[name] = arr
    return out


def read_hf_checkpoint(path: str | os.PathLike) -> tuple[BertConfig, dict[str, np.ndarray]]:
    """Read ``config.json`` and ``model.safetensors`` of a HuggingFace directory.

    Returns:
      the config and the tensors by (normalised) PyTorch name, buffers such as ``position_ids`` dropped.
    """
    path = os.fspath(path)
    if os.path.isfile(path):
        raise NotADirectoryError(f"HuggingFace checkpoint path {path} is a file; pass the directory that holds "
                                 f"{CONFIG_NAME} and {WEIGHTS_NAME}")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"HuggingFace checkpoint directory not found: {path}")
    config_file = os.path.join(path, CONFIG_NAME)
    weights_file = os.path.join(path, WEIGHTS_NAME)
    for name, file in ((CONFIG_NAME, config_file), (WEIGHTS_NAME, weights_file)):
        # "not found" would send the user looking for a file that is there, only as a directory.
        if os.path.isdir(file):
            raise IsADirectoryError(f"{file} is a directory, not a file; the checkpoint directory {path} must hold "
                                    f"{name} as a file (was it unpacked or downloaded into a folder of that name?)")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{name} not found in checkpoint directory {path}")
    config = BertConfig.from_json(config_file)
    stnp = _safetensors_numpy()
    try:
        raw = stnp.load_file(weights_file)
    except Exception as e:  # safetensors' own errors name neither the file nor the format
        raise ValueError(f"cannot read {weights_file} as a safetensors file ({type(e).__name__}: {e}); "
                         "re-download or re-save the checkpoint") from None
    tensors = {_normalise_name(k): v for k, v in raw.items() if not k.endswith(_IGNORED_SUFFIXES)}
    return config, tensors


def load_hf_checkpoint(
    path: str | os.PathLike,
    model_cls: type[nnx.Module] = BertModel,
    *,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    remat: bool = False,
    scan_layers: bool = False,
    rngs: nnx.Rngs | None = None,
    strict: bool = False,
) -> nnx.Module:
    """Build ``model_cls`` from a HuggingFace BERT directory (``config.json`` + ``model.safetensors``).

    Works with or without the ``bert.`` prefix. Heads (pooler, ``cls.*``, ``qa_outputs``) missing from the
    checkpoint keep their fresh initialisation (logged); missing embedding or encoder tensors are an error.

    Args:
      path: the checkpoint directory.
      model_cls: ``BertModel``, ``BertForPreTraining`` or ``BertForQuestionAnswering``.
      dtype: compute dtype of the model.
      param_dtype: dtype the parameters are stored in.
      remat: rematerialise layers in the backward pass.
      scan_layers: build the stacked encoder (see :class:`~jonebit.models.bert.BertEncoder`); each layer's
        tensors fill one slice of the stacked leaves.
      rngs: initialisation of missing heads and the dropout stream (default ``nnx.Rngs(0)``).
      strict: raise on checkpoint tensors the model does not use instead of warning.

    Returns:
      the model, in train mode (call ``model.eval()`` for inference).
    """
    config, tensors = read_hf_checkpoint(path)
    rngs = nnx.Rngs(0) if rngs is None else rngs
    model = model_cls(config, dtype=dtype, param_dtype=param_dtype, remat=remat, scan_layers=scan_layers, rngs=rngs)
    tensors = _align_prefix(tensors, _base_prefix(model))
    if _TIED_DECODER_BIAS in tensors:
        # HuggingFace ties the decoder bias to cls.predictions.bias; accept either spelling.
        tensors.setdefault("cls.predictions.bias", tensors[_TIED_DECODER_BIAS])
        del tensors[_TIED_DECODER_BIAS]

    used: set[str] = set()
    fresh: list[str] = []
    missing_encoder: dict[str, tuple] = {}

    def one(name: str, transpose: bool, shape: tuple, dtype):
        if name not in tensors:
            bare = name[len("bert."):] if name.startswith("bert.") else name
            if bare.startswith(_ENCODER_PREFIXES):
                missing_encoder[name] = shape[::-1] if transpose else shape
            else:
                fresh.append(name)
            return None
        arr = tensors[name]
        if transpose:
            arr = arr.T
        if arr.shape != shape:
            raise ValueError(
                f"shape mismatch for tensor {name!r}: checkpoint has {tensors[name].shape}, "
                f"the model expects {shape[::-1] if transpose else shape} (PyTorch layout)"
            )
        used.add(name)
        return np.asarray(arr, dtype=dtype)

    def assign(keypath, current):
        path = _key_names(keypath)
        paths = per_layer_paths(path, config.num_hidden_layers)
        shape = current.shape if len(paths) == 1 else current.shape[1:]
        got = [one(*hf_name(p), shape, current.dtype) for p in paths]
        if any(g is None for g in got):
            return current
        return jnp.asarray(got[0] if len(paths) == 1 else np.stack(got), dtype=current.dtype)

    state = jax.tree_util.tree_map_with_path(assign, nnx.state(model, nnx.Param))
    if missing_encoder:
        names = sorted(missing_encoder)
        listed = ", ".join(f"{n} {missing_encoder[n]}" for n in names[:5])
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        raise ValueError(
            f"checkpoint {os.fspath(path)} lacks encoder tensors {model_cls.__name__} needs (PyTorch name and "
            f"shape): {listed}{more}; {len(tensors)} tensors present, e.g. {sorted(tensors)[:3]}"
        )

    unexpected = sorted(set(tensors) - used)
    if _TIED_DECODER in unexpected and "bert.embeddings.word_embeddings.weight" in used:
        unexpected.remove(_TIED_DECODER)
        if not np.array_equal(tensors[_TIED_DECODER], tensors["bert.embeddings.word_embeddings.weight"]):
            logger.warning("%s differs from the word embeddings; the decoder stays tied to them", _TIED_DECODER)
    if unexpected:
        msg = f"checkpoint {os.fspath(path)} has tensors {model_cls.__name__} does not use: {unexpected}"
        if strict:
            raise ValueError(msg)
        logger.warning(msg)
    if fresh:
        logger.warning(
            "%s: tensors not in checkpoint %s, freshly initialised: %s", model_cls.__name__, os.fspath(path), fresh
        )
    nnx.update(model, state)
    return model


def _architecture(model: nnx.Module) -> str:
    for cls in (BertForPreTraining, BertForQuestionAnswering, BertModel):
        if isinstance(model, cls):
            return cls.__name__
    raise TypeError(f"not a jonebit BERT model: {type(model).__name__}")


def hf_state_dict(model: nnx.Module) -> dict[str, np.ndarray]:
    """The model's parameters as float32 numpy arrays by PyTorch name and layout (tied decoder not repeated)."""
    out = {}
    for keypath, value in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        paths = per_layer_paths(_key_names(keypath), model.config.num_hidden_layers)
        arr = np.asarray(jax.device_get(value), dtype=np.float32)
        for i, path in enumerate(paths):
            name, transpose = hf_name(path)
            one = arr if len(paths) == 1 else arr[i]
            out[name] = np.ascontiguousarray(one.T if transpose else one)
    return out


def save_hf_checkpoint(model: nnx.Module, path: str | os.PathLike) -> None:
    """Write ``config.json`` and ``model.safetensors`` that ``transformers`` ``from_pretrained`` loads.

    The masked-LM decoder is tied to the word embeddings (``tie_word_embeddings``), so, as HuggingFace itself does,
    only ``cls.predictions.bias`` is written for it.

    Args:
      model: a ``BertModel``, ``BertForPreTraining`` or ``BertForQuestionAnswering``.
      path: output directory (created if needed).
    """
    arch = _architecture(model)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_NAME), "w", encoding="utf-8") as f:
        json.dump(model.config.to_hf_dict(architectures=[arch]), f, indent=2, sort_keys=True)
    _safetensors_numpy().save_file(hf_state_dict(model), os.path.join(path, WEIGHTS_NAME), metadata={"format": "pt"})


def position_embedding_mask(model_or_state: nnx.Module | nnx.State, seq_len: int) -> nnx.State:
    """``exp_avg_mask`` for 1-bit Adam: 1 everywhere except position-embedding rows ``>= seq_len``.

    Training at sequence length ``seq_len`` never touches the later rows, so their gradient is 0 and their momentum
    must not be moved by the compressed (sign) update of the others; the mask keeps it at 0.

    Only the position embedding is masked, and only by row: its mask is a ``(max_position_embeddings, 1)`` column
    and every other leaf is None (not masked), so the mask costs a few KB instead of a float32 copy of the params.

    Args:
      model_or_state: a BERT model, or its ``nnx.state(model, nnx.Param)`` (arrays or ``ShapeDtypeStruct``).
      seq_len: the training sequence length, ``1 <= seq_len <= max_position_embeddings``.

    Returns:
      an ``nnx.State`` with the structure of ``nnx.state(model, nnx.Param)`` whose leaves are None except the
      position embedding's: a float32 0/1 array of shape ``(max_position_embeddings, 1)``.
    """
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state, nnx.Param)
    found = []

    def leaf(keypath, x):
        names = _key_names(keypath)
        if names[-3:] != ("embeddings", "position_embeddings", "embedding"):
            return None
        if not 1 <= seq_len <= x.shape[0]:
            raise ValueError(f"seq_len must be in [1, {x.shape[0]}] (max_position_embeddings), got {seq_len}")
        found.append(names)
        mask = np.ones((x.shape[0],) + (1,) * (len(x.shape) - 1), np.float32)
        mask[seq_len:] = 0.0
        return jnp.asarray(mask)

    out = jax.tree_util.tree_map_with_path(leaf, state)
    if len(found) != 1:
        raise ValueError(f"expected one embeddings.position_embeddings.embedding parameter, found {len(found)}")
    return out
