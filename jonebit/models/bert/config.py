"""BERT hyper-parameters, the standard size presets and HuggingFace ``config.json`` interchange."""

from __future__ import annotations

import dataclasses
import json
import logging
import numbers
import os
from typing import Any

logger = logging.getLogger(__name__)

# HuggingFace activation names -> whether GELU uses the tanh approximation.
_ACTIVATIONS = {
    "gelu": False,
    "gelu_python": False,
    "gelu_new": True,
    "gelu_pytorch_tanh": True,
    "gelu_fast": True,
}

# (layers, hidden); heads = hidden / 64 and intermediate = 4 * hidden (Turc et al. 2019 and the original BERT).
_PRESETS = {
    "tiny": (2, 128),
    "mini": (4, 256),
    "small": (4, 512),
    "medium": (8, 512),
    "base": (12, 768),
    "large": (24, 1024),
}

# config.json keys that describe HuggingFace bookkeeping, not the network; read and dropped.
_HF_IGNORED = {
    "architectures",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "gradient_checkpointing",
    "use_cache",
    "classifier_dropout",
    "_name_or_path",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "id2label",
    "label2id",
    "output_past",
    "is_decoder",
    "add_cross_attention",
    "chunk_size_feed_forward",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "problem_type",
    "finetuning_task",
    "tokenizer_class",
    "directionality",
    "pooler_fc_size",
    "pooler_num_attention_heads",
    "pooler_num_fc_layers",
    "pooler_size_per_head",
    "pooler_type",
}


# Keys a config.json must give: the shapes of the network. Without them the defaults (BERT-base) would build a
# model whose tensors do not match the checkpoint next to the file.
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
_STR_FIELDS = {"hidden_act"}
_FLOAT_FIELDS = {"hidden_dropout_prob", "attention_probs_dropout_prob", "initializer_range", "layer_norm_eps"}
_OPTIONAL_FIELDS = {"pad_token_id"}  # HuggingFace writes null for models without padding


def _check_type(name: str, value) -> None:
    if name in _OPTIONAL_FIELDS and value is None:
        return
    if name in _STR_FIELDS:
        ok, expected = isinstance(value, str), "a string"
    elif name in _FLOAT_FIELDS:
        ok, expected = isinstance(value, numbers.Real) and not isinstance(value, bool), "a number"
    else:
        ok, expected = isinstance(value, numbers.Integral) and not isinstance(value, bool), "an integer"
    if not ok:
        raise TypeError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Shape and regularisation of a BERT encoder; field names follow HuggingFace's ``BertConfig``.

    Args:
      vocab_size: WordPiece vocabulary size.
      hidden_size: width of the residual stream.
      num_hidden_layers: number of transformer layers.
      num_attention_heads: attention heads per layer; must divide ``hidden_size``.
      intermediate_size: width of the feed-forward layer.
      hidden_act: ``"gelu"`` (exact, erf) or ``"gelu_new"`` / ``"gelu_pytorch_tanh"`` (tanh approximation).
      hidden_dropout_prob: dropout on embeddings and on every residual branch.
      attention_probs_dropout_prob: dropout on the attention probabilities.
      max_position_embeddings: number of learned absolute positions.
      type_vocab_size: number of token types (segments).
      initializer_range: standard deviation of the normal initialiser for weights and embeddings.
      layer_norm_eps: LayerNorm epsilon.
      pad_token_id: id of ``[PAD]`` (kept for HuggingFace round trips).
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name))
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {self.hidden_act!r}; expected one of {sorted(_ACTIVATIONS)}"
            )
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                     "max_position_embeddings", "type_vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
            )
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        for name in ("initializer_range", "layer_norm_eps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def gelu_approximate(self) -> bool:
        """True when ``hidden_act`` is the tanh approximation of GELU."""
        return _ACTIVATIONS[self.hidden_act]

    # ---------------------------------------------------------------- presets
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> BertConfig:
        """One of the standard sizes: tiny (2x128), mini (4x256), small (4x512), medium (8x512), base (12x768),
        large (24x1024); heads = hidden / 64, intermediate = 4 * hidden.

        Args:
          name: preset name.
          **overrides: any other field, e.g. ``hidden_dropout_prob=0.0``.
        """
        if name not in _PRESETS:
            raise ValueError(f"unknown BERT preset {name!r}; expected one of {list(_PRESETS)}")
        layers, hidden = _PRESETS[name]
        fields = dict(
            num_hidden_layers=layers,
            hidden_size=hidden,
            num_attention_heads=hidden // 64,
            intermediate_size=4 * hidden,
        )
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def tiny(cls, **overrides: Any) -> BertConfig:
        return cls.preset("tiny", **overrides)

    @classmethod
    def mini(cls, **overrides: Any) -> BertConfig:
        return cls.preset("mini", **overrides)

    @classmethod
    def small(cls, **overrides: Any) -> BertConfig:
        return cls.preset("small", **overrides)

    @classmethod
    def medium(cls, **overrides: Any) -> BertConfig:
        return cls.preset("medium", **overrides)

    @classmethod
    def base(cls, **overrides: Any) -> BertConfig:
        return cls.preset("base", **overrides)

    @classmethod
    def large(cls, **overrides: Any) -> BertConfig:
        return cls.preset("large", **overrides)

    # ---------------------------------------------------------- HuggingFace
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BertConfig:
        """Build from a HuggingFace ``config.json`` dictionary.

        Keys that only matter to HuggingFace (``architectures``, ``torch_dtype``, ...) are dropped; keys that would
        change the network in a way this implementation does not support are an error.
        """
        if not isinstance(d, dict):
            raise TypeError(f"a BERT config must be a dict (a JSON object), got {type(d).__name__}")
        d = dict(d)
        model_type = d.get("model_type", "bert")
        if model_type != "bert":
            raise ValueError(f"config has model_type {model_type!r}; only 'bert' is supported")
        pos_type = d.pop("position_embedding_type", "absolute")
        if pos_type != "absolute":
            raise ValueError(f"position_embedding_type {pos_type!r} is not supported (only 'absolute')")
        if d.get("is_decoder") or d.get("add_cross_attention"):
            raise ValueError("decoder / cross-attention BERT configs are not supported")
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in d.items() if k in names}
        unknown = sorted(k for k in d if k not in names and k not in _HF_IGNORED)
        if unknown:
            # Newer HuggingFace versions add bookkeeping keys; they do not change the network, so only report them.
            logger.warning("ignoring unknown BERT config keys: %s", unknown)
        return cls(**fields)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> BertConfig:
        """Read a HuggingFace ``config.json`` (a file, or a directory that contains one).

        The file must be a JSON object with at least the shape keys (``vocab_size``, ``hidden_size``,
        ``num_hidden_layers``, ``num_attention_heads``, ``intermediate_size``); every error names the file.
        """
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"BERT config file not found: {path}")
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"BERT config {path} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"BERT config {path} must hold a JSON object, got a JSON {type(d).__name__}")
        missing = [k for k in _REQUIRED_KEYS if k not in d]
        if missing:
            raise ValueError(f"BERT config {path} lacks the required key(s) {missing}; a HuggingFace BERT "
                             f"config.json gives all of {list(_REQUIRED_KEYS)}")
        try:
            return cls.from_dict(d)
        except (TypeError, ValueError) as e:
            raise type(e)(f"BERT config {path}: {e}") from None

    def to_hf_dict(self, architectures: list[str] | None = None) -> dict[str, Any]:
        """The HuggingFace ``config.json`` dictionary of this configuration."""
        d: dict[str, Any] = dataclasses.asdict(self)
        d.update(model_type="bert", position_embedding_type="absolute", tie_word_embeddings=True)
        if architectures:
            d["architectures"] = list(architectures)
        return d
