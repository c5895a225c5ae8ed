"""Numerics of the NNX BERT against HuggingFace transformers (PyTorch) on a real checkpoint, and model options."""

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
    save_hf_checkpoint,
)


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    model = load_hf_checkpoint(minilm_dir)
    model.eval()
    return model


@pytest.fixture(scope="module")
def torch_reference(minilm_dir, minilm_batch, require):
    """transformers' outputs in float32 and in float64 (the reference both float32 programs are measured from)."""
    torch = require("torch")
    transformers = require("transformers")
    model = transformers.BertModel.from_pretrained(str(minilm_dir), attn_implementation="eager").eval()
    ids, mask, types = (torch.tensor(a, dtype=torch.long) for a in minilm_batch)
    outs = {}
    with torch.no_grad():
        for name, dtype in (("float32", torch.float32), ("float64", torch.float64)):
            out = model.to(dtype)(input_ids=ids, attention_mask=mask, token_type_ids=types)
            outs[name] = tuple(x.numpy().astype(np.float64) for x in (out.last_hidden_state, out.pooler_output))
    return outs


def _run(model, batch):
    ids, mask, types = (jnp.asarray(a) for a in batch)
    return model(ids, mask, types)


def test_minilm_matches_transformers(minilm, minilm_batch, torch_reference):
    """jonebit's float32 BERT is as close to the exact (float64) transformers output as transformers' own float32.

    Both float32 programs evaluate the same formulas; they differ only in the order and blocking of their sums
    (matmuls with inner size 384 and 1,536, softmax, layer norm). Rounding analysis bounds both by the same
    gamma_K * |A||B| per product, and under the usual random-rounding model each output's error has the same
    scale, sqrt(K) * u * |x| with u = 2**-24, whatever the order. The largest of ~30,000 such errors is a few of
    those scales, and the ratio of two such maxima stays within about 2x; the bound below allows 4x torch's
    measured float32 error, with a floor of 16 u |ref| for where torch happens to be nearly exact. A modelling
    error is far outside it: the tanh form of GELU moves real tokens' hidden states by 2.6e-3, a layer-norm eps of
    1e-5 instead of 1e-12 by 1.1e-3 (against float32 errors of ~2e-6). Padding rows (queries at [PAD] tokens,
    which still attend to the real keys) carry larger float32 errors than real tokens on both sides (~4e-5).
    """
    out = _run(minilm, minilm_batch)
    hidden, pooled = (np.asarray(x, np.float64) for x in (out.last_hidden_state, out.pooler_output))
    keep = minilm_batch[1].astype(bool)
    (ref_hidden, ref_pooled), (t32_hidden, t32_pooled) = torch_reference["float64"], torch_reference["float32"]
    groups = {
        "real tokens": (hidden[keep], t32_hidden[keep], ref_hidden[keep]),
        "padding rows": (hidden[~keep], t32_hidden[~keep], ref_hidden[~keep]),
        "pooled": (pooled, t32_pooled, ref_pooled),
    }
    u = 2.0**-24
    for name, (got, torch32, ref) in groups.items():
        ours_err, torch_err = np.abs(got - ref).max(), np.abs(torch32 - ref).max()
        bound = max(4 * torch_err, 16 * u * np.abs(ref).max())
        assert ours_err <= bound, f"{name}: float32 error {ours_err:.3g} > {bound:.3g} (torch's {torch_err:.3g})"
    # The checkpoint is real: hidden states are far from a random model's.
    assert np.abs(ref_hidden).max() > 1.0


def test_padding_does_not_change_tokens(minilm, minilm_batch):
    ids, mask, types = minilm_batch
    padded = np.asarray(_run(minilm, minilm_batch).last_hidden_state)
    for i in range(len(ids)):
        n = int(mask[i].sum())
        alone = minilm(jnp.asarray(ids[i : i + 1, :n])).last_hidden_state
        np.testing.assert_allclose(np.asarray(alone)[0], padded[i, :n], atol=2e-5)


def test_bf16_compute_close_to_fp32(minilm_dir, minilm, minilm_batch):
    model = load_hf_checkpoint(minilm_dir, dtype=jnp.bfloat16)
    model.eval()
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(p.dtype == jnp.float32 for p in params)
    out = _run(model, minilm_batch)
    assert out.last_hidden_state.dtype == jnp.bfloat16
    keep = minilm_batch[1].astype(bool)
    ref = np.asarray(_run(minilm, minilm_batch).last_hidden_state)[keep]
    got = np.asarray(out.last_hidden_state.astype(jnp.float32))[keep]
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    # Measured 1.2e-2 (bf16 has an 8-bit mantissa: 2**-8 ~ 4e-3 per rounding, six layers of them).
    assert rel < 3e-2, rel
    cos = np.sum(got * ref, -1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert cos.min() > 0.999, cos.min()


def _tiny(**kw):
    return BertConfig.tiny(vocab_size=97, max_position_embeddings=32, **kw)


def _batch(rng, b=2, s=12, vocab=97):
    ids = rng.integers(1, vocab, (b, s), dtype=np.int32)
    mask = np.ones((b, s), np.int32)
    mask[1, s // 2 :] = 0
    return jnp.asarray(ids), jnp.asarray(mask)


def test_remat_same_values_and_gradients():
    ids, mask = _batch(np.random.default_rng(0))

    def loss(model):
        out = model(ids, mask, deterministic=True)
        return jnp.mean(out.prediction_logits**2) + jnp.mean(out.seq_relationship_logits**2)

    grads = []
    for remat in (False, True):
        model = BertForPreTraining(_tiny(), remat=remat, rngs=nnx.Rngs(3))
        value, g = nnx.jit(nnx.value_and_grad(loss))(model)
        grads.append((value, jax.tree.leaves(g)))
    np.testing.assert_allclose(grads[0][0], grads[1][0], rtol=1e-6)
    for a, b in zip(grads[0][1], grads[1][1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_dropout_train_and_eval():
    ids, mask = _batch(np.random.default_rng(1))
    model = BertForQuestionAnswering(_tiny(), rngs=nnx.Rngs(params=0, dropout=1))
    train1 = model(ids, mask).start_logits
    train2 = model(ids, mask).start_logits  # the dropout stream advanced: a different mask
    assert not np.allclose(train1, train2)
    det = model(ids, mask, deterministic=True).start_logits
    model.eval()
    np.testing.assert_array_equal(model(ids, mask).start_logits, det)
    np.testing.assert_array_equal(model(ids, mask).start_logits, det)
    model.train()
    assert not np.allclose(model(ids, mask).start_logits, det)
    # No dropout at all when the probabilities are 0, whatever the mode.
    plain = BertModel(_tiny(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(
        plain(ids, mask).last_hidden_state, plain(ids, mask, deterministic=True).last_hidden_state
    )


def test_rowwise_attention_matches_batched(monkeypatch):
    """CPU evaluation with large score tensors attends one example at a time: the same outputs and gradients as
    the batched form, padding included; with dropout active the batched form (and its dropout) is kept."""
    from jonebit.models.bert import modeling

    ids, mask = _batch(np.random.default_rng(2))
    model = BertForQuestionAnswering(_tiny(), rngs=nnx.Rngs(params=0, dropout=1))

    def loss(m):
        out = m(ids, mask, deterministic=True)
        return jnp.mean(out.start_logits ** 2 + out.end_logits)

    graphdef, state = nnx.split(model)
    # float32 scores [examples, heads, seq, seq]: of the whole batch, or of one example
    batched, one_example = (f"tensor<{n}x2x{ids.shape[1]}x{ids.shape[1]}xf32>" for n in (ids.shape[0], 1))

    def hlo(deterministic):
        fwd = lambda st, i, m_: nnx.merge(graphdef, st)(i, m_, deterministic=deterministic).start_logits  # noqa: E731
        return jax.jit(fwd).lower(state, ids, mask).as_text()

    results = {}
    for threshold in (1 << 62, 0):  # never, always
        monkeypatch.setattr(modeling, "ROWWISE_SCORE_BYTES", threshold)
        assert modeling._rowwise_attention(ids.shape[0], 2, ids.shape[1]) == (threshold == 0)
        value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
        results[threshold] = value, jax.tree.leaves(grads), one_example in hlo(True)
    (v0, g0, loop0), (v1, g1, loop1) = results[1 << 62], results[0]
    assert not loop0 and loop1  # the row-wise form really ran (scores of one example at a time)
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    for a, b in zip(g0, g1, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
    # Training mode with dropout: batched, and dropout still applies.
    assert one_example not in hlo(False) and batched in hlo(False)
    assert not np.allclose(model(ids, mask).start_logits, model(ids, mask, deterministic=True).start_logits)


def test_input_errors():
    model = BertModel(_tiny(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="exceeds max_position_embeddings 32"):
        model(jnp.ones((1, 33), jnp.int32))
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        model(jnp.ones((33,), jnp.int32))


def test_pretraining_loss_matches_torch_cross_entropy():
    import torch

    from jonebit.models.bert import BertForPreTrainingOutput, pretraining_loss

    rng = np.random.default_rng(0)
    pl = rng.standard_normal((2, 5, 11)).astype(np.float32)
    sl = rng.standard_normal((2, 2)).astype(np.float32)
    labels = np.full((2, 5), -100)
    labels[0, 1], labels[1, 4], labels[1, 0] = 3, 7, 2
    nsp = np.array([0, 1])
    out = BertForPreTrainingOutput(prediction_logits=jnp.asarray(pl), seq_relationship_logits=jnp.asarray(sl),
                                   last_hidden_state=None)
    got = float(pretraining_loss(out, {"labels": labels, "next_sentence_label": nsp}))
    ce = torch.nn.CrossEntropyLoss()  # ignore_index=-100, mean over the counted positions
    want = ce(torch.tensor(pl).view(-1, 11), torch.tensor(labels).view(-1)) + ce(torch.tensor(sl), torch.tensor(nsp))
    assert abs(got - float(want)) < 1e-5


def test_masked_positions_give_the_full_heads_logits_and_loss():
    """The MLM head at ``masked_positions`` is the full head's logits gathered, and the loss from the gather form
    (masked_lm_ids / masked_lm_weights) equals the loss from ``labels``, value and gradient."""
    from jonebit.data.pretraining import collate
    from jonebit.models.bert import pretraining_loss

    cfg = BertConfig.preset("tiny", vocab_size=50, max_position_embeddings=16)
    model = BertForPreTraining(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    n, L, P = 3, 12, 4
    counts = np.array([4, 2, 1])
    positions = np.zeros((n, P), np.int16)
    ids = np.zeros((n, P), np.int32)
    for r, c in enumerate(counts):
        positions[r, :c] = np.sort(rng.choice(np.arange(1, L - 1), c, replace=False))
        ids[r, :c] = rng.integers(5, 50, c)
    batch = collate({"input_ids": rng.integers(5, 50, (n, L)), "token_type_ids": np.zeros((n, L), np.uint8),
                     "lengths": np.array([12, 10, 7]), "masked_lm_positions": positions, "masked_lm_ids": ids,
                     "masked_lm_count": counts, "next_sentence_labels": np.array([0, 1, 0])})
    full = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], deterministic=True)
    part = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"],
                 masked_positions=batch["masked_lm_positions"], deterministic=True)
    assert part.prediction_logits.shape == (n, P, 50)
    want = np.take_along_axis(np.asarray(full.prediction_logits), batch["masked_lm_positions"][..., None], axis=1)
    np.testing.assert_allclose(np.asarray(part.prediction_logits), want, rtol=1e-5, atol=1e-5)

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, gathered):
        m = nnx.merge(graphdef, params, rest)
        kw = {"masked_positions": batch["masked_lm_positions"]} if gathered else {}
        return pretraining_loss(m(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"],
                                  deterministic=True, **kw), batch)

    (lf, gf), (lp, gp) = (jax.value_and_grad(loss)(params, g) for g in (False, True))
    assert abs(float(lf) - float(lp)) < 1e-5 and float(lf) > 1.0
    for a, b in zip(jax.tree.leaves(gf), jax.tree.leaves(gp), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="masked_lm_ids"):
        pretraining_loss(part, {"labels": batch["labels"], "next_sentence_label": batch["next_sentence_label"]})
    with pytest.raises(ValueError, match=r"\[batch, P\]"):
        model(batch["input_ids"], masked_positions=np.zeros((P,), np.int32))


def test_scanned_layers_give_the_list_forms_values_and_gradients(tmp_path):
    """The stacked encoder (``scan_layers=True``) is the same function as the list of layers: the list model's
    weights, moved into the stacked form through a HuggingFace directory, give its loss and gradients.

    The per-layer arithmetic is the same; the two programs differ in how XLA fuses a loop body against unrolled
    layers, so float32 rounding differs: a few ulps of each value, well under 1e-5 of the gradients' scale. The
    attention key bias has an exactly zero gradient (softmax is invariant to a shift along the keys), so both
    sides hold rounding noise there, compared on the same absolute scale.
    """
    from jonebit.models.bert.params import hf_state_dict

    ids, mask = _batch(np.random.default_rng(2))

    def loss(model):
        out = model(ids, mask, deterministic=True)
        return jnp.mean(out.prediction_logits**2) + jnp.mean(out.seq_relationship_logits**2)

    listed = BertForPreTraining(_tiny(), rngs=nnx.Rngs(5))
    save_hf_checkpoint(listed, tmp_path)
    value, grads = nnx.jit(nnx.value_and_grad(loss))(listed)
    want = hf_state_dict(_with(BertForPreTraining(_tiny(), rngs=nnx.Rngs(0)), grads))
    scale = max(float(np.abs(g).max()) for g in want.values())
    for remat in (False, True):
        scanned = load_hf_checkpoint(tmp_path, BertForPreTraining, scan_layers=True, remat=remat)
        leaves = jax.tree.leaves(nnx.state(scanned, nnx.Param))
        assert any(x.shape[0] == _tiny().num_hidden_layers and x.ndim == 3 for x in leaves)  # really stacked
        v, g = nnx.jit(nnx.value_and_grad(loss))(scanned)
        np.testing.assert_allclose(v, value, rtol=1e-6)
        got = hf_state_dict(_with(BertForPreTraining(_tiny(), scan_layers=True, rngs=nnx.Rngs(0)), g))
        assert got.keys() == want.keys()
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-5 * scale, err_msg=name)


def _with(model, state):
    nnx.update(model, state)
    return model


def test_scanned_layers_draw_their_own_dropout_masks():
    """``jonebit.nnx.reseed`` gives every dropout stream, and every layer of a stacked stream, its own key derived
    from the step's key: reproducible from that key, different for another."""
    from jonebit.nnx import reseed

    model = BertModel(_tiny(), scan_layers=True, rngs=nnx.Rngs(params=0, dropout=1))
    graphdef, params, keys, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
    stacked = [x for x in jax.tree.leaves(keys) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) and x.shape]
    assert stacked and all(x.shape == (_tiny().num_hidden_layers,) for x in stacked)
    fresh = reseed(keys, jax.random.key(7))
    new_keys = [jax.random.key_data(x) for x in jax.tree.leaves(fresh)
                if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]
    flat = np.concatenate([np.asarray(k).reshape(-1, np.asarray(k).shape[-1]) for k in new_keys])
    assert len({tuple(r) for r in flat}) == len(flat)  # every stream, every layer: its own key
    ids, mask = _batch(np.random.default_rng(3))
    a = nnx.merge(graphdef, params, reseed(keys, jax.random.key(7)), rest)(ids, mask).last_hidden_state
    b = nnx.merge(graphdef, params, reseed(keys, jax.random.key(7)), rest)(ids, mask).last_hidden_state
    c = nnx.merge(graphdef, params, reseed(keys, jax.random.key(8)), rest)(ids, mask).last_hidden_state
    np.testing.assert_array_equal(a, b)  # reproducible from the key
    assert not np.allclose(a, c)
