"""A small decoder-only transformer language model in plain JAX (params as a dict).

Used by the demo job and by tests that need a real model that trains in seconds on CPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class TinyLMConfig:
    vocab_size: int
    seq_len: int = 64
    dim: int = 128
    heads: int = 4
    layers: int = 2


def init_params(cfg: TinyLMConfig, key: jax.Array) -> dict:
    keys = iter(jax.random.split(key, 4 + 4 * cfg.layers))

    def dense(k, fan_in, fan_out):
        return jax.random.normal(k, (fan_in, fan_out), jnp.float32) / np.sqrt(fan_in)

    params = {
        "embed": jax.random.normal(next(keys), (cfg.vocab_size, cfg.dim), jnp.float32) * 0.02,
        "pos": jax.random.normal(next(keys), (cfg.seq_len, cfg.dim), jnp.float32) * 0.02,
        "ln_f": jnp.ones(cfg.dim),
        "layers": [],
    }
    for _ in range(cfg.layers):
        params["layers"].append({
            "ln1": jnp.ones(cfg.dim), "ln2": jnp.ones(cfg.dim),
            "qkv": dense(next(keys), cfg.dim, 3 * cfg.dim), "out": dense(next(keys), cfg.dim, cfg.dim) * 0.5,
            "ff1": dense(next(keys), cfg.dim, 4 * cfg.dim), "ff2": dense(next(keys), 4 * cfg.dim, cfg.dim) * 0.5,
        })
    return params


def _rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def forward(params: dict, tokens: jax.Array, cfg: TinyLMConfig) -> jax.Array:
    """Logits ``(batch, seq, vocab)`` for ``tokens`` of shape ``(batch, seq)``."""
    b, t = tokens.shape
    x = params["embed"][tokens] + params["pos"][:t]
    mask = jnp.tril(jnp.ones((t, t), bool))
    for layer in params["layers"]:
        h = _rms_norm(x, layer["ln1"])
        q, k, v = jnp.split(h @ layer["qkv"], 3, axis=-1)
        split = lambda a: a.reshape(b, t, cfg.heads, cfg.dim // cfg.heads)  # noqa: E731
        att = jax.nn.dot_product_attention(split(q), split(k), split(v), mask=mask[None, None])
        x = x + att.reshape(b, t, cfg.dim) @ layer["out"]
        h = _rms_norm(x, layer["ln2"])
        x = x + jax.nn.gelu(h @ layer["ff1"]) @ layer["ff2"]
    return _rms_norm(x, params["ln_f"]) @ params["embed"].T


def loss_fn(params: dict, batch: jax.Array, cfg: TinyLMConfig) -> jax.Array:
    """Mean next-token cross-entropy of ``batch`` ``(batch, seq + 1)`` token ids."""
    logits = forward(params, batch[:, :-1], cfg)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1))
