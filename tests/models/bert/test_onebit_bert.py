"""BERT trained data-parallel with 1-bit Adam and the position-embedding mask, on 4 devices."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jonebit import onebit_adam
from jonebit.models.bert import BertConfig, BertForPreTraining, position_embedding_mask
from jonebit.train.data_parallel import data_mesh, init_optimizer, make_step, replicate, shard_batch

SEQ = 16


def test_masked_position_rows_keep_zero_momentum_and_loss_keeps_falling():
    cfg = BertConfig.preset("tiny", vocab_size=64, max_position_embeddings=32)
    model = BertForPreTraining(cfg, rngs=nnx.Rngs(0))
    model.eval()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    # Every parameter must get a gradient (MLM + NSP, both segments): a coordinate whose gradient is zero
    # forever has v = 0, and its sign-compressed momentum would then move it by lr * scale / eps. The mask
    # covers the one such block pre-training has, the position rows beyond the sequence length.
    def loss_fn(params, batch):
        out = nnx.merge(graphdef, params, rest)(batch["ids"], token_type_ids=batch["types"])
        logp = jax.nn.log_softmax(out.prediction_logits)
        mlm = -jnp.mean(jnp.take_along_axis(logp, batch["ids"][..., None], axis=-1))  # reconstruct the input
        nsp = -jnp.mean(jax.nn.log_softmax(out.seq_relationship_logits)[:, 0])
        return mlm + nsp

    mask = position_embedding_mask(params, SEQ)
    # Few warmup steps: bias correction keeps the frozen variance at its proper scale.
    # Per-leaf compression: one scale per tensor. With a single scale for the whole model (fused=True)
    # this tiny BERT stalls after freeze_step (embeddings and LayerNorms have very different magnitudes).
    tx = onebit_adam(1e-3, freeze_step=10, exp_avg_mask=mask, bias_correction=True, fused=False)
    mesh = data_mesh(4)
    params = replicate(params, mesh)
    opt_state, specs = init_optimizer(tx, params, mesh)
    step = make_step(loss_fn, tx, mesh, specs)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(25):
        ids = rng.integers(0, 64, (8, SEQ)).astype(np.int32)
        types = (np.arange(SEQ) >= SEQ // 2).astype(np.int32)[None].repeat(8, 0)
        batch = shard_batch({"ids": ids, "types": types}, mesh)
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    pos_m = np.asarray(opt_state.mu["bert"]["embeddings"]["position_embeddings"]["embedding"])
    assert np.all(pos_m[SEQ:] == 0.0)
    assert np.any(pos_m[:SEQ] != 0.0)
    assert losses[-1] < losses[0] - 0.5, losses
