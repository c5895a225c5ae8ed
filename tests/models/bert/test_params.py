"""HuggingFace checkpoint interchange (both directions, checked with transformers) and the 1-bit Adam mask."""

import json
import logging
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jonebit.models.bert import (
    BertConfig,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertModel,
    load_hf_checkpoint,
    position_embedding_mask,
    save_hf_checkpoint,
)

st = pytest.importorskip("safetensors.numpy")

CONFIG = BertConfig.tiny(vocab_size=211, max_position_embeddings=64, hidden_act="gelu_new")


def _randomised(model_cls, seed):
    """A tiny model whose every parameter (LayerNorm scales and biases included) is random, so no swap hides."""
    model = model_cls(CONFIG, rngs=nnx.Rngs(seed))
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)]
    nnx.update(model, jax.tree.unflatten(treedef, leaves))
    model.eval()
    return model


def _inputs():
    rng = np.random.default_rng(0)
    ids = rng.integers(1, CONFIG.vocab_size, (3, 20), dtype=np.int32)
    mask = np.ones_like(ids)
    mask[1, 13:] = 0
    mask[2, 5:] = 0
    types = np.zeros_like(ids)
    types[:, 8:] = 1
    return ids, mask, types


def _params(model):
    return jax.tree.leaves(nnx.state(model, nnx.Param))


def _assert_same_params(a, b):
    pa, pb = nnx.state(a, nnx.Param), nnx.state(b, nnx.Param)
    assert jax.tree.structure(pa) == jax.tree.structure(pb)
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _hf_load(transformers, cls_name, path):
    model, info = getattr(transformers, cls_name).from_pretrained(
        str(path), output_loading_info=True, attn_implementation="eager"
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


@pytest.mark.parametrize(
    "model_cls, outputs",
    [
        (BertForPreTraining, ("prediction_logits", "seq_relationship_logits")),
        (BertForQuestionAnswering, ("start_logits", "end_logits")),
        (BertModel, ("last_hidden_state", "pooler_output")),
    ],
)
def test_round_trip_with_transformers(tmp_path, model_cls, outputs):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = _randomised(model_cls, seed=1)
    save_hf_checkpoint(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [model_cls.__name__]

    ids, mask, types = _inputs()
    ours = model(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types))
    hf = _hf_load(transformers, model_cls.__name__, tmp_path)
    with torch.no_grad():
        theirs = hf(*(torch.tensor(a, dtype=torch.long) for a in (ids, mask, types)))
    for name in outputs:
        a, b = np.asarray(getattr(ours, name)), getattr(theirs, name).numpy()
        assert a.shape == b.shape, name
        assert np.abs(a - b).max() <= 1e-4, (name, np.abs(a - b).max())

    back = load_hf_checkpoint(tmp_path, model_cls, rngs=nnx.Rngs(99))
    _assert_same_params(model, back)


def test_transformers_checkpoint_loads(tmp_path):
    """A directory written by transformers' own save_pretrained (tied decoder, its naming) loads identically."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.BertForPreTraining(transformers.BertConfig(**CONFIG.to_hf_dict())).eval()
    hf.save_pretrained(str(tmp_path))
    ours = load_hf_checkpoint(tmp_path, BertForPreTraining)
    ours.eval()
    ids, mask, types = _inputs()
    with torch.no_grad():
        theirs = hf(*(torch.tensor(a, dtype=torch.long) for a in (ids, mask, types)))
    out = ours(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types))
    assert np.abs(np.asarray(out.prediction_logits) - theirs.prediction_logits.numpy()).max() <= 1e-4
    assert np.abs(np.asarray(out.seq_relationship_logits) - theirs.seq_relationship_logits.numpy()).max() <= 1e-4


def test_prefix_and_heads(tmp_path, caplog):
    pre = _randomised(BertForPreTraining, seed=2)
    save_hf_checkpoint(pre, tmp_path)  # names with the bert. prefix and cls.* heads

    with caplog.at_level(logging.WARNING):
        base = load_hf_checkpoint(tmp_path, BertModel)
    assert "cls.predictions.bias" in caplog.text and "does not use" in caplog.text
    _assert_same_params(pre.bert, base)
    with pytest.raises(ValueError, match="cls.seq_relationship.weight"):
        load_hf_checkpoint(tmp_path, BertModel, strict=True)

    # A BertModel directory (no prefix, no heads) into the heads models: encoder loaded, heads fresh and logged.
    base_dir = tmp_path / "base"
    save_hf_checkpoint(base, base_dir)
    assert not any(k.startswith("bert.") for k in st.load_file(base_dir / "model.safetensors"))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        qa = load_hf_checkpoint(base_dir, BertForQuestionAnswering)
    assert "qa_outputs.weight" in caplog.text and "freshly initialised" in caplog.text
    assert "pooler.dense.weight" in caplog.text  # HuggingFace's QA model has no pooler: reported as unused
    np.testing.assert_array_equal(qa.bert.embeddings.word_embeddings.embedding[...],
                                  base.embeddings.word_embeddings.embedding[...])
    np.testing.assert_array_equal(qa.bert.encoder.layer[1].output.dense.kernel[...],
                                  base.encoder.layer[1].output.dense.kernel[...])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_hf_checkpoint(base_dir, BertForPreTraining)
    assert "cls.predictions.transform.dense.weight" in caplog.text


def test_legacy_layer_norm_names(tmp_path):
    model = _randomised(BertModel, seed=3)
    save_hf_checkpoint(model, tmp_path)
    tensors = st.load_file(tmp_path / "model.safetensors")
    renamed = {}
    for k, v in tensors.items():
        if ".LayerNorm." in k:
            k = k.replace(".weight", ".gamma").replace(".bias", ".beta")
        renamed[k] = v
    renamed["embeddings.position_ids"] = np.arange(CONFIG.max_position_embeddings)[None]
    st.save_file(renamed, tmp_path / "model.safetensors")
    _assert_same_params(model, load_hf_checkpoint(tmp_path, BertModel, strict=True))


def test_checkpoint_errors(tmp_path):
    model = _randomised(BertModel, seed=4)
    save_hf_checkpoint(model, tmp_path / "ok")

    with pytest.raises(FileNotFoundError, match="directory not found"):
        load_hf_checkpoint(tmp_path / "nowhere")
    no_config = tmp_path / "no_config"
    shutil.copytree(tmp_path / "ok", no_config)
    (no_config / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(no_config)
    no_weights = tmp_path / "no_weights"
    shutil.copytree(tmp_path / "ok", no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_checkpoint(no_weights)

    tensors = st.load_file(tmp_path / "ok" / "model.safetensors")
    bad = dict(tensors)
    bad["encoder.layer.1.intermediate.dense.weight"] = np.zeros((7, 128), np.float32)
    st.save_file(bad, tmp_path / "ok" / "model.safetensors")
    with pytest.raises(ValueError, match=r"encoder.layer.1.intermediate.dense.weight.*\(7, 128\).*\(512, 128\)"):
        load_hf_checkpoint(tmp_path / "ok")

    missing = {k: v for k, v in tensors.items() if not k.startswith("encoder.layer.0.attention.self.")}
    st.save_file(missing, tmp_path / "ok" / "model.safetensors")
    with pytest.raises(ValueError, match="lacks encoder tensors.*encoder.layer.0.attention.self.key.bias"):
        load_hf_checkpoint(tmp_path / "ok")


@pytest.mark.parametrize("seq_len", [1, 20, 64])
def test_position_embedding_mask(seq_len):
    model = BertModel(CONFIG, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    mask = position_embedding_mask(model, seq_len)
    # Sparse: one leaf per param, None (not masked) except the position embedding's row mask.
    mask_leaves = jax.tree.structure(params).flatten_up_to(mask)
    assert len(mask_leaves) == len(jax.tree.leaves(params))
    assert sum(m is not None for m in mask_leaves) == 1
    assert len(jax.tree.structure(params).flatten_up_to(position_embedding_mask(params, seq_len))) == len(mask_leaves)

    # Independent reference: the rows a batch of length seq_len gives a non-zero gradient to.
    ids = jnp.asarray(np.random.default_rng(0).integers(1, CONFIG.vocab_size, (2, seq_len), dtype=np.int32))
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(ids, deterministic=True).pooler_output ** 2)))(model)
    pos_grad = np.asarray(grads["embeddings"]["position_embeddings"]["embedding"][...])
    used = np.any(pos_grad != 0, axis=1).astype(np.float32)
    assert used.sum() == seq_len
    pos_mask = np.asarray(mask["embeddings"]["position_embeddings"]["embedding"][...])
    assert pos_mask.dtype == np.float32 and pos_mask.shape == (CONFIG.max_position_embeddings, 1)
    np.testing.assert_array_equal(pos_mask, used[:, None])

    # Leaf-wise, None meaning ones, the mask keeps exactly the gradient's non-zero entries.
    for m, g in zip(mask_leaves, jax.tree.leaves(nnx.state(grads, nnx.Param)), strict=True):
        full = np.ones(np.shape(g), np.float32) if m is None else np.broadcast_to(np.asarray(m), np.shape(g))
        np.testing.assert_array_equal(np.asarray(g) * full, np.asarray(g))
        assert m is None or np.all(np.asarray(g)[np.broadcast_to(np.asarray(m), np.shape(g)) == 0] == 0)


def test_position_embedding_mask_errors():
    model = BertModel(CONFIG, rngs=nnx.Rngs(0))
    for bad in (0, 65):
        with pytest.raises(ValueError, match=r"seq_len must be in \[1, 64\]"):
            position_embedding_mask(model, bad)


def test_scanned_model_round_trip_with_transformers(tmp_path):
    """A stacked encoder exports per-layer tensors that transformers loads and evaluates alike, and imports back
    into the same stacked leaves; a list-form checkpoint loads into the stacked form layer by layer."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    listed = _randomised(BertForPreTraining, seed=4)
    save_hf_checkpoint(listed, tmp_path / "list")
    scanned = load_hf_checkpoint(tmp_path / "list", BertForPreTraining, scan_layers=True)
    stacked = nnx.state(scanned, nnx.Param)["bert"]["encoder"]["stacked_layers"]
    for i in range(CONFIG.num_hidden_layers):
        np.testing.assert_array_equal(stacked["output"]["dense"]["kernel"][...][i],
                                      listed.bert.encoder.layer[i].output.dense.kernel[...])
    scanned.eval()
    save_hf_checkpoint(scanned, tmp_path / "scan")
    a = st.load_file(tmp_path / "list" / "model.safetensors")
    b = st.load_file(tmp_path / "scan" / "model.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    hf = _hf_load(transformers, "BertForPreTraining", tmp_path / "scan")
    ids, mask, types = _inputs()
    with torch.no_grad():
        theirs = hf(*(torch.tensor(x, dtype=torch.long) for x in (ids, mask, types)))
    ours = scanned(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types))
    # Two float32 programs of the same formulas differ by summation order only: per matmul (inner size <= 512) a
    # few sqrt(K) u |x| (u = 2**-24, |x| ~ 1-10 for these random weights), ~1e-6 per layer; through 2 layers, the
    # head's 128-wide transform and the 211-way logits (|logit| < 30) a few 1e-5 at most. 1e-4 leaves room; a
    # swapped or mis-sliced layer moves the logits by O(1).
    assert np.abs(np.asarray(ours.prediction_logits) - theirs.prediction_logits.numpy()).max() <= 1e-4
    _assert_same_params(scanned, load_hf_checkpoint(tmp_path / "scan", BertForPreTraining, scan_layers=True))
