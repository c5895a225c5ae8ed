import jax
import jax.numpy as jnp
import numpy as np

from jonebit.models import tiny_lm


def test_causal_and_loss_at_init_is_log_vocab():
    cfg = tiny_lm.TinyLMConfig(vocab_size=50, seq_len=16, dim=32, heads=2, layers=1)
    params = tiny_lm.init_params(cfg, jax.random.key(0))
    tokens = jnp.array(np.random.default_rng(0).integers(0, 50, (2, 17)), jnp.int32)
    logits = tiny_lm.forward(params, tokens[:, :16], cfg)
    changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % 50)
    logits2 = tiny_lm.forward(params, changed[:, :16], cfg)
    np.testing.assert_allclose(logits[:, :10], logits2[:, :10], atol=1e-5)  # the future does not leak back
    assert not np.allclose(logits[:, 10:], logits2[:, 10:])
    assert abs(float(tiny_lm.loss_fn(params, tokens, cfg)) - np.log(50)) < 0.5
