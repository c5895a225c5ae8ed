"""BERT in Flax NNX: encoder, pre-training heads (masked LM + next sentence) and extractive question answering.

Module and parameter names follow the HuggingFace Flax BERT tree (``embeddings.word_embeddings.embedding``,
``encoder.layer.0.attention.self.query.kernel``, ``...LayerNorm.scale``), so converting a PyTorch checkpoint is a
renaming plus a transpose of the dense kernels (see ``params.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jonebit.models.bert.config import BertConfig
from jonebit.sharding.layerwise import STACKED_KEY, scan_layers

Array = jax.Array


@struct.dataclass
class BertModelOutput:
    """Args:
    last_hidden_state: ``[batch, seq, hidden]`` output of the last layer.
    pooler_output: ``[batch, hidden]`` tanh(dense(first token)), or None for a model built without a pooler.
    """

    last_hidden_state: Array
    pooler_output: Array | None = None


@struct.dataclass
class BertForPreTrainingOutput:
    """What :class:`BertForPreTraining` returns.

    Attributes:
      prediction_logits: ``[batch, seq, vocab]`` masked-LM logits (float32), or ``[batch, P, vocab]`` at the
        ``masked_positions`` the model was called with.
      seq_relationship_logits: ``[batch, 2]`` next-sentence logits (float32; 0 = is next).
      last_hidden_state: the encoder output the heads were applied to.
      masked_positions: ``[batch, P]`` the positions ``prediction_logits`` are at, or None for every position.
    """

    prediction_logits: Array
    seq_relationship_logits: Array
    last_hidden_state: Array
    masked_positions: Array | None = None


@struct.dataclass
class QuestionAnsweringOutput:
    """Args:
    start_logits: ``[batch, seq]`` answer-start logits (float32).
    end_logits: ``[batch, seq]`` answer-end logits (float32).
    """

    start_logits: Array
    end_logits: Array


def _dense(config: BertConfig, din: int, dout: int, dtype, param_dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        din,
        dout,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=nnx.initializers.normal(config.initializer_range),
        rngs=rngs,
    )


def _layer_norm(config: BertConfig, dtype, param_dtype, rngs: nnx.Rngs) -> nnx.LayerNorm:
    # Flax computes the statistics in float32 even for bf16 inputs, so only the output is in `dtype`.
    return nnx.LayerNorm(
        config.hidden_size, epsilon=config.layer_norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs
    )


def _embed(config: BertConfig, n: int, param_dtype, rngs: nnx.Rngs) -> nnx.Embed:
    # Looked up in the parameter dtype; the sum of the three embeddings is cast by the LayerNorm that follows.
    return nnx.Embed(
        n,
        config.hidden_size,
        param_dtype=param_dtype,
        embedding_init=nnx.initializers.normal(config.initializer_range),
        rngs=rngs,
    )


def attention_bias(attention_mask: Array | None) -> Array | None:
    """Additive float32 bias ``[batch, 1, 1, seq]``: 0 where ``attention_mask`` is 1, the float32 minimum where 0."""
    if attention_mask is None:
        return None
    keep = attention_mask[:, None, None, :].astype(bool)
    return jnp.where(keep, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)


def _check_ids(name: str, ids, limit: int, limit_name: str) -> None:
    """Out-of-range ids, when they can be seen: concrete arrays only (under ``jit`` the values are traced)."""
    if isinstance(ids, jax.core.Tracer) or (isinstance(ids, jax.Array) and not ids.is_fully_addressable):
        return  # traced, or spread over other processes: nothing to look at here
    arr = np.asarray(ids)
    bad = (arr < 0) | (arr >= limit)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name}{list(first)} = {arr[first]} is outside [0, {limit_name}={limit}) ({int(bad.sum())} such "
            f"entries); map unknown tokens to a valid id (e.g. [UNK]) or raise {limit_name} in the config"
        )


def check_inputs(config: BertConfig, input_ids, attention_mask=None, token_type_ids=None) -> None:
    """Validates the arguments of :class:`BertModel`: shapes and dtypes always, id ranges where concrete.

    Raises ``TypeError``/``ValueError`` naming the argument, what was expected and what was given.
    """
    if not hasattr(input_ids, "shape") or not hasattr(input_ids, "dtype"):
        raise TypeError(f"input_ids must be an integer array [batch, seq], got {type(input_ids).__name__}")
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    if not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise TypeError(f"input_ids must have an integer dtype (token ids), got {input_ids.dtype}")
    for name, x in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
        if x is None:
            continue
        if tuple(getattr(x, "shape", ())) != tuple(input_ids.shape):
            raise ValueError(f"{name} must have the shape of input_ids {tuple(input_ids.shape)} ([batch, seq]), "
                             f"got {tuple(getattr(x, 'shape', ()))}")
    if token_type_ids is not None and not jnp.issubdtype(token_type_ids.dtype, jnp.integer):
        raise TypeError(f"token_type_ids must have an integer dtype, got {token_type_ids.dtype}")
    _check_ids("input_ids", input_ids, config.vocab_size, "vocab_size")
    if token_type_ids is not None:
        _check_ids("token_type_ids", token_type_ids, config.type_vocab_size, "type_vocab_size")


class BertEmbeddings(nnx.Module):
    """Word + absolute position + token type embeddings, then LayerNorm and dropout."""

    def __init__(self, config: BertConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.config = config
        self.word_embeddings = _embed(config, config.vocab_size, param_dtype, rngs)
        self.position_embeddings = _embed(config, config.max_position_embeddings, param_dtype, rngs)
        self.token_type_embeddings = _embed(config, config.type_vocab_size, param_dtype, rngs)
        self.LayerNorm = _layer_norm(config, dtype, param_dtype, rngs)
        self.dropout = nnx.Dropout(config.hidden_dropout_prob, rngs=rngs)

    def __call__(self, input_ids: Array, token_type_ids: Array, deterministic: bool | None = None) -> Array:
        seq = input_ids.shape[-1]
        if seq > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {seq} exceeds max_position_embeddings {self.config.max_position_embeddings}"
            )
        x = self.word_embeddings(input_ids)
        x = x + self.position_embeddings.embedding[...][:seq]
        x = x + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(x), deterministic=deterministic)


class BertSelfAttention(nnx.Module):
    """Multi-head scaled dot-product attention; logits and softmax in float32 whatever the compute dtype."""

    def __init__(self, config: BertConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.dtype = dtype
        self.query = _dense(config, h, h, dtype, param_dtype, rngs)
        self.key = _dense(config, h, h, dtype, param_dtype, rngs)
        self.value = _dense(config, h, h, dtype, param_dtype, rngs)
        self.dropout = nnx.Dropout(config.attention_probs_dropout_prob, rngs=rngs)

    def __call__(self, x: Array, bias: Array | None, deterministic: bool | None = None) -> Array:
        b, s, _ = x.shape
        shape = (b, s, self.num_heads, self.head_dim)
        # Scaling q before the product costs s*d instead of s*s multiplications.
        q = (self.query(x) * (self.head_dim**-0.5)).reshape(shape)
        k = self.key(x).reshape(shape)
        v = self.value(x).reshape(shape)
        dropout = not (self.dropout.deterministic if deterministic is None else deterministic) and self.dropout.rate > 0
        if not dropout and _rowwise_attention(b, self.num_heads, s):
            # One example at a time: see _rowwise_attention.
            rows = (q, k, v) if bias is None else (q, k, v, jnp.broadcast_to(bias, (b, *bias.shape[1:])))
            ctx = jax.lax.map(lambda r: _attend(*(x[None] for x in r), None)[0], rows)
        else:
            ctx = _attend(q, k, v, bias, lambda p: self.dropout(p, deterministic=deterministic))
        return ctx.reshape(b, s, self.num_heads * self.head_dim)


def _attend(q, k, v, bias, dropout=None):
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    if bias is not None:
        logits = logits + bias
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    if dropout is not None:
        probs = dropout(probs)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


# Bytes of float32 scores above which CPU evaluation attends one example at a time.
ROWWISE_SCORE_BYTES = 16 << 20


def _rowwise_attention(batch: int, heads: int, seq: int) -> bool:
    """Whether to run attention example by example: on CPU, without dropout, when the batch's float32 scores
    (``batch x heads x seq x seq``) exceed ``ROWWISE_SCORE_BYTES``.

    There the softmax over scores that do not fit in the caches is bound by memory bandwidth: at seq 384 a batch
    of 8 costs about 2.5x per example what a batch of 1 does (MiniLM-L6, one core); one example's scores
    (12 x 384 x 384 float32: 7 MB) stay in cache. Accelerators keep the batched form.
    """
    return batch > 1 and 4 * batch * heads * seq * seq > ROWWISE_SCORE_BYTES and jax.default_backend() == "cpu"


class BertSelfOutput(nnx.Module):
    """Output projection of attention, dropout, residual and LayerNorm."""

    def __init__(self, config: BertConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.dense = _dense(config, config.hidden_size, config.hidden_size, dtype, param_dtype, rngs)
        self.LayerNorm = _layer_norm(config, dtype, param_dtype, rngs)
        self.dropout = nnx.Dropout(config.hidden_dropout_prob, rngs=rngs)

    def __call__(self, x: Array, residual: Array, deterministic: bool | None = None) -> Array:
        return self.LayerNorm(self.dropout(self.dense(x), deterministic=deterministic) + residual)


class BertAttention(nnx.Module):
    def __init__(self, config: BertConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        # Named `self` to match the HuggingFace tree (attention.self.query ...).
        self.self = BertSelfAttention(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.output = BertSelfOutput(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: Array, bias: Array | None, deterministic: bool | None = None) -> Array:
        return self.output(self.self(x, bias, deterministic), x, deterministic)


class BertIntermediate(nnx.Module):
    def __init__(self, config: BertConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.approximate = config.gelu_approximate
        self.dense = _dense(config, config.hidden_size, config.intermediate_size, dtype, param_dtype, rngs)

    def __call__(self, x: Array) -> Array:
        return jax.nn.gelu(self.dense(x), approximate=self.approximate)


class BertOutput(nnx.Module):
    def __init__(self, config: BertConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.dense = _dense(config, config.intermediate_size, config.hidden_size, dtype, param_dtype, rngs)
        self.LayerNorm = _layer_norm(config, dtype, param_dtype, rngs)
        self.dropout = nnx.Dropout(config.hidden_dropout_prob, rngs=rngs)

    def __call__(self, x: Array, residual: Array, deterministic: bool | None = None) -> Array:
        return self.LayerNorm(self.dropout(self.dense(x), deterministic=deterministic) + residual)


class BertLayer(nnx.Module):
    """One post-LayerNorm transformer layer: attention block, then feed-forward block."""

    def __init__(self, config: BertConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.attention = BertAttention(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.intermediate = BertIntermediate(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.output = BertOutput(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: Array, bias: Array | None, deterministic: bool | None = None) -> Array:
        h = self.attention(x, bias, deterministic)
        return self.output(self.intermediate(h), h, deterministic)


class BertEncoder(nnx.Module):
    """The stack of layers; with ``remat`` each layer's activations are recomputed in the backward pass.

    With ``scan_layers`` the layers are one stacked module (:data:`jonebit.sharding.layerwise.STACKED_KEY`, every
    parameter with a leading layer axis) applied by :func:`jonebit.sharding.layerwise.scan_layers`: one layer's
    program instead of ``num_hidden_layers`` copies, and the form in which ZeRO stage 3 gathers the parameters
    layer by layer. Otherwise ``layer`` is a list of layers (HuggingFace's tree).
    """

    def __init__(self, config: BertConfig, *, dtype, param_dtype, remat: bool, scan_layers: bool = False,
                 rngs: nnx.Rngs):
        self.config = config
        self.remat = remat
        self.scan_layers = scan_layers
        self.dtypes = (dtype, param_dtype)
        if scan_layers:
            make = nnx.split_rngs(splits=config.num_hidden_layers)(nnx.vmap(lambda r: self._layer(r)))
            setattr(self, STACKED_KEY, make(rngs))
        else:
            self.layer = nnx.List([self._layer(rngs) for _ in range(config.num_hidden_layers)])

    def _layer(self, rngs: nnx.Rngs) -> BertLayer:
        dtype, param_dtype = self.dtypes
        return BertLayer(self.config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: Array, bias: Array | None, deterministic: bool | None = None) -> Array:
        def apply(layer: BertLayer, h: Array, b: Array | None) -> Array:
            return layer(h, b, deterministic)

        if self.scan_layers:
            return scan_layers(getattr(self, STACKED_KEY), x, lambda layer, h: apply(layer, h, bias),
                               layer_shapes=nnx.state(nnx.eval_shape(lambda: self._layer(nnx.Rngs(0))), nnx.Param),
                               remat=self.remat)
        if self.remat:
            apply = nnx.remat(apply)
        for layer in self.layer:
            x = apply(layer, x, bias)
        return x


class BertPooler(nnx.Module):
    def __init__(self, config: BertConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.dense = _dense(config, config.hidden_size, config.hidden_size, dtype, param_dtype, rngs)

    def __call__(self, x: Array) -> Array:
        return jnp.tanh(self.dense(x[:, 0]))


class BertModel(nnx.Module):
    """The BERT encoder with its pooler.

    Args:
      config: the hyper-parameters.
      dtype: compute dtype (e.g. ``jnp.bfloat16``); parameters stay in ``param_dtype``. Attention logits and
        softmax, LayerNorm statistics and head logits are always float32.
      param_dtype: dtype of the parameters.
      remat: recompute each layer's activations in the backward pass (``nnx.remat``) to save memory.
      scan_layers: stack the layers and scan over them (:class:`BertEncoder`): one layer's program to compile, and
        ZeRO stage 3 gathers the parameters layer by layer. The parameter tree then holds
        ``encoder.stacked_layers.*`` leaves with a leading layer axis; HuggingFace import and export map them to
        and from ``encoder.layer.{i}.*`` either way.
      add_pooling_layer: build the pooler (HuggingFace's question-answering model has none).
      rngs: ``params`` (or default) stream for initialisation, ``dropout`` (or default) stream for dropout.

    Call with ``input_ids`` ``[batch, seq]`` int, optional ``attention_mask`` (1 = token, 0 = padding) and
    ``token_type_ids`` (default all 0), both ``[batch, seq]`` like ``input_ids``; ``deterministic`` overrides the
    train/eval mode set by ``model.train()`` / ``model.eval()``. Returns a :class:`BertModelOutput`.

    Shapes and dtypes are checked on every call. Id ranges (``0 <= input_ids < vocab_size``,
    ``0 <= token_type_ids < type_vocab_size``) are checked only on concrete arrays (eager calls): under
    ``jax.jit`` / ``nnx.jit`` / ``jax.grad`` the values are traced and cannot be. There, an id ``>= vocab_size``
    (or ``< -vocab_size``) embeds as a row of NaN (``jnp.take``'s fill mode), which attention spreads to every
    position of that sequence, and a negative id ``-k`` silently reads row ``vocab_size - k``. Validate the
    data once outside the step (a single eager call does it) when it does not come from a trusted tokenizer.
    """

    def __init__(
        self,
        config: BertConfig,
        *,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        remat: bool = False,
        scan_layers: bool = False,
        add_pooling_layer: bool = True,
        rngs: nnx.Rngs,
    ):
        self.config = config
        self.embeddings = BertEmbeddings(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.encoder = BertEncoder(config, dtype=dtype, param_dtype=param_dtype, remat=remat, scan_layers=scan_layers,
                                   rngs=rngs)
        self.pooler = (
            BertPooler(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs) if add_pooling_layer else None
        )

    def __call__(
        self,
        input_ids: Array,
        attention_mask: Array | None = None,
        token_type_ids: Array | None = None,
        *,
        deterministic: bool | None = None,
    ) -> BertModelOutput:
        check_inputs(self.config, input_ids, attention_mask, token_type_ids)
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        x = self.embeddings(input_ids, token_type_ids, deterministic)
        x = self.encoder(x, attention_bias(attention_mask), deterministic)
        pooled = self.pooler(x) if self.pooler is not None else None
        return BertModelOutput(last_hidden_state=x, pooler_output=pooled)


class BertPredictionHeadTransform(nnx.Module):
    def __init__(self, config: BertConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.approximate = config.gelu_approximate
        self.dense = _dense(config, config.hidden_size, config.hidden_size, dtype, param_dtype, rngs)
        self.LayerNorm = _layer_norm(config, dtype, param_dtype, rngs)

    def __call__(self, x: Array) -> Array:
        return self.LayerNorm(jax.nn.gelu(self.dense(x), approximate=self.approximate))


class BertLMPredictionHead(nnx.Module):
    """Masked-LM head; the decoder matrix is the (tied) word embedding, only its bias is owned here."""

    def __init__(self, config: BertConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.dtype = dtype
        self.transform = BertPredictionHeadTransform(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.bias = nnx.Param(jnp.zeros((config.vocab_size,), param_dtype))

    def __call__(self, x: Array, word_embeddings: Array) -> Array:
        h = self.transform(x)
        logits = jnp.einsum(
            "bsh,vh->bsv", h, word_embeddings.astype(self.dtype), preferred_element_type=jnp.float32
        )
        return logits + self.bias[...].astype(jnp.float32)


class BertPreTrainingHeads(nnx.Module):
    def __init__(self, config: BertConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.predictions = BertLMPredictionHead(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.seq_relationship = _dense(config, config.hidden_size, 2, dtype, param_dtype, rngs)


class BertForPreTraining(nnx.Module):
    """BERT with the masked-LM and next-sentence heads (``bert.*`` and ``cls.*`` parameters).

    Args: as :class:`BertModel`. Returns a :class:`BertForPreTrainingOutput`.
    """

    def __init__(
        self, config: BertConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, remat: bool = False,
        scan_layers: bool = False, rngs: nnx.Rngs,
    ):
        self.config = config
        self.bert = BertModel(config, dtype=dtype, param_dtype=param_dtype, remat=remat, scan_layers=scan_layers,
                              rngs=rngs)
        self.cls = BertPreTrainingHeads(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(
        self,
        input_ids: Array,
        attention_mask: Array | None = None,
        token_type_ids: Array | None = None,
        *,
        masked_positions: Array | None = None,
        deterministic: bool | None = None,
    ) -> BertForPreTrainingOutput:
        """``masked_positions`` (``[batch, P]`` ints): apply the masked-LM head at these positions only, as Google's
        and DeepSpeed's BERT pre-training do. With a large vocabulary the head over every position is most of the
        step's work; the masked ones are 15% of the tokens."""
        out = self.bert(input_ids, attention_mask, token_type_ids, deterministic=deterministic)
        word = self.bert.embeddings.word_embeddings.embedding[...]
        hidden = out.last_hidden_state
        if masked_positions is not None:
            masked_positions = jnp.asarray(masked_positions, jnp.int32)
            if masked_positions.ndim != 2 or masked_positions.shape[0] != hidden.shape[0]:
                raise ValueError(f"masked_positions must be [batch, P] = [{hidden.shape[0]}, P], got "
                                 f"{masked_positions.shape}")
            hidden = jnp.take_along_axis(hidden, masked_positions[..., None], axis=1)
        mlm = self.cls.predictions(hidden, word)
        nsp = self.cls.seq_relationship(out.pooler_output).astype(jnp.float32)
        return BertForPreTrainingOutput(
            prediction_logits=mlm, seq_relationship_logits=nsp, last_hidden_state=out.last_hidden_state,
            masked_positions=masked_positions,
        )


class BertForQuestionAnswering(nnx.Module):
    """BERT (without pooler, as in HuggingFace) and a span head ``qa_outputs`` giving start and end logits.

    Args: as :class:`BertModel`. Returns a :class:`QuestionAnsweringOutput`.
    """

    def __init__(
        self, config: BertConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, remat: bool = False,
        scan_layers: bool = False, rngs: nnx.Rngs,
    ):
        self.config = config
        self.bert = BertModel(
            config, dtype=dtype, param_dtype=param_dtype, remat=remat, scan_layers=scan_layers,
            add_pooling_layer=False, rngs=rngs,
        )
        self.qa_outputs = _dense(config, config.hidden_size, 2, dtype, param_dtype, rngs)

    def __call__(
        self,
        input_ids: Array,
        attention_mask: Array | None = None,
        token_type_ids: Array | None = None,
        *,
        deterministic: bool | None = None,
    ) -> QuestionAnsweringOutput:
        out = self.bert(input_ids, attention_mask, token_type_ids, deterministic=deterministic)
        logits = self.qa_outputs(out.last_hidden_state).astype(jnp.float32)
        return QuestionAnsweringOutput(start_logits=logits[..., 0], end_logits=logits[..., 1])


def pretraining_loss(out: BertForPreTrainingOutput, batch) -> jax.Array:
    """Masked-LM + next-sentence loss of a :class:`BertForPreTraining` output (transformers' definition).

    ``batch["labels"]``: ``(B, T)`` token ids at masked positions and ``-100`` (any negative value) elsewhere; the MLM
    term is the mean cross-entropy over the masked positions. ``batch["next_sentence_label"]``: ``(B,)`` 0 (B follows
    A) or 1 (random B); the NSP term is the mean over the batch.

    An output computed at ``masked_positions`` reads the gather form instead: ``batch["masked_lm_ids"]`` ``(B, P)``,
    the token ids at those positions, and ``batch["masked_lm_weights"]`` ``(B, P)``, 1 for a masked position and 0
    for padding (what :func:`jonebit.data.pretraining.collate` gives). The loss is the same number either way.
    """
    import optax

    if out.masked_positions is not None:
        if "masked_lm_ids" not in batch or "masked_lm_weights" not in batch:
            raise ValueError("an output at masked_positions needs batch['masked_lm_ids'] and "
                             "batch['masked_lm_weights'] (the gather form of jonebit.data.pretraining.collate)")
        labels = jnp.asarray(batch["masked_lm_ids"])
        valid = jnp.asarray(batch["masked_lm_weights"]) > 0
    else:
        labels = batch["labels"]
        valid = labels >= 0
    mlm = optax.softmax_cross_entropy_with_integer_labels(
        out.prediction_logits.astype(jnp.float32), jnp.where(valid, labels, 0))
    mlm = jnp.sum(jnp.where(valid, mlm, 0.0)) / jnp.maximum(jnp.sum(valid), 1)
    nsp = optax.softmax_cross_entropy_with_integer_labels(
        out.seq_relationship_logits.astype(jnp.float32), batch["next_sentence_label"])
    return mlm + jnp.mean(nsp)
