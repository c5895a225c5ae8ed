import json

import jax
import numpy as np
import pytest
from flax import nnx

from jonebit.models.bert import BertConfig, BertForPreTraining, BertForQuestionAnswering, BertModel

PRESETS = {"tiny": (2, 128), "mini": (4, 256), "small": (4, 512), "medium": (8, 512), "base": (12, 768),
           "large": (24, 1024)}


def _num_params(model_cls, config) -> int:
    abstract = nnx.eval_shape(lambda: model_cls(config, rngs=nnx.Rngs(0)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_shapes(name):
    layers, hidden = PRESETS[name]
    c = BertConfig.preset(name)
    assert (c.num_hidden_layers, c.hidden_size) == (layers, hidden)
    assert c.num_attention_heads == hidden // 64 and c.intermediate_size == 4 * hidden
    assert (c.vocab_size, c.max_position_embeddings, c.type_vocab_size) == (30522, 512, 2)
    assert getattr(BertConfig, name)() == c
    assert BertConfig.preset(name, hidden_dropout_prob=0.0).hidden_dropout_prob == 0.0


def _torch_count(require, model_cls_name, config):
    torch, transformers = require("torch"), require("transformers")
    hf_config = transformers.BertConfig(**config.to_hf_dict())
    with torch.device("meta"):
        model = getattr(transformers, model_cls_name)(hf_config)
    # parameters() yields tied tensors once (decoder weight = word embeddings, decoder bias = predictions bias).
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(PRESETS))
def test_parameter_count_matches_transformers(name, require):
    c = BertConfig.preset(name)
    assert _num_params(BertForPreTraining, c) == _torch_count(require, "BertForPreTraining", c)
    if name == "base":
        assert _num_params(BertModel, c) == _torch_count(require, "BertModel", c)
        assert _num_params(BertForQuestionAnswering, c) == _torch_count(require, "BertForQuestionAnswering", c)
        # The published figure for BERT-base: about 110M parameters.
        assert 108e6 < _num_params(BertForPreTraining, c) < 111e6


def test_from_json_minilm(minilm_dir):
    c = BertConfig.from_json(minilm_dir / "config.json")
    assert c == BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
    assert BertConfig.from_json(minilm_dir) == c
    assert not c.gelu_approximate


def test_hf_dict_round_trip(tmp_path, require):
    c = BertConfig.preset("mini", hidden_act="gelu_new", layer_norm_eps=1e-7, type_vocab_size=3,
                          max_position_embeddings=256)
    (tmp_path / "config.json").write_text(json.dumps(c.to_hf_dict()))
    back = BertConfig.from_json(tmp_path / "config.json")
    assert back == c and back.gelu_approximate
    transformers = require("transformers")
    hf = transformers.BertConfig(**c.to_hf_dict())
    assert (hf.hidden_act, hf.layer_norm_eps, hf.type_vocab_size, hf.max_position_embeddings) == (
        "gelu_new", 1e-7, 3, 256)


def test_bad_config_errors(tmp_path):
    with pytest.raises(ValueError, match="hidden_act 'relu'"):
        BertConfig.from_dict({"hidden_act": "relu"})
    with pytest.raises(ValueError, match="position_embedding_type 'relative_key'"):
        BertConfig.from_dict({"position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="model_type 'roberta'"):
        BertConfig.from_dict({"model_type": "roberta"})
    with pytest.raises(ValueError, match="not a multiple of num_attention_heads"):
        BertConfig(hidden_size=100, num_attention_heads=12)
    with pytest.raises(ValueError, match="unknown BERT preset 'huge'"):
        BertConfig.preset("huge")
    with pytest.raises(FileNotFoundError, match="config.json"):
        BertConfig.from_json(tmp_path)
