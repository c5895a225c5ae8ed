"""Bad input at the public entry points gets a clear error (argument, expected, given), and never loses data.

The table lists one bad call per row: ``(id, call, exception type, message regex)``; ``call(tmp_path)`` makes the
bad call. Each regex matches the specific message, not just a word of it. The other tests check what the table
cannot: the caller's arrays survive donating steps, good inputs still pass the checks, and what happens to
out-of-range ids inside ``jit`` where they cannot be checked.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jonebit
from jonebit.models.bert import BertConfig, BertModel, load_hf_checkpoint, save_hf_checkpoint
from jonebit.sharding import zero_shardings
from jonebit.sharding.mesh import data_mesh
from jonebit.train import schedules
from jonebit.train.data_parallel import init_optimizer, make_step, make_update, replicate, shard_batch
from jonebit.train.zero import init_zero, make_zero_step
from jonebit.transforms.onebit_adam import leaf_errors

N = 8
CONFIG = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=32, max_position_embeddings=12, type_vocab_size=2,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@functools.cache
def mesh():
    return data_mesh(N)


def params0():
    return {"w": np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(4, 3), "b": np.arange(3, dtype=np.float32)}


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def batch(n: int = 16):
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(n, 4)).astype(np.float32), "y": rng.normal(size=(n, 3)).astype(np.float32)}


@functools.cache
def dp_step():
    tx = optax.sgd(0.1)
    state, specs = init_optimizer(tx, replicate(params0(), mesh()), mesh())
    return tx, specs, make_step(loss_fn, tx, mesh(), specs, grad_reduce="mean", donate=False)


def call_dp_step(b):
    tx, specs, step = dp_step()
    params = replicate(params0(), mesh())
    state, _ = init_optimizer(tx, params, mesh())
    return step(params, state, b)


def call_make_update(grads):
    tx, specs, _ = dp_step()
    params = replicate(params0(), mesh())
    state, _ = init_optimizer(tx, params, mesh())
    return make_update(tx, mesh(), specs, grad_reduce="mean")(params, state, grads)


def call_zero_step(b, stage=1, onebit=False):
    tx = jonebit.onebit_adam_zero(1e-2, freeze_step=2, stage=stage) if onebit else optax.adam(1e-2)
    params, state, sh = init_zero(tx, params0(), mesh(), stage=stage)
    return make_zero_step(loss_fn, tx, mesh(), sh, donate=False)(params, state, b)


@functools.cache
def bert():
    model = BertModel(CONFIG, rngs=nnx.Rngs(0))
    model.eval()
    return model


def ids(*, bad=None, shape=(2, 6)):
    out = np.arange(np.prod(shape), dtype=np.int32).reshape(shape) % CONFIG.vocab_size
    if bad is not None:
        out[bad[0]] = bad[1]
    return out


def write_config(tmp_path, text: str | None = None, **changes):
    d = CONFIG.to_hf_dict()
    d.update(changes)
    for k in [k for k, v in changes.items() if v is _DROP]:
        del d[k]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d) if text is None else text)
    return path


_DROP = object()


def checkpoint(tmp_path, edit=None):
    """A saved BERT checkpoint directory, its tensors changed by ``edit(dict) -> dict``."""
    st = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "ckpt"
    save_hf_checkpoint(bert(), path)
    if edit is not None:
        st.save_file(edit(st.load_file(path / "model.safetensors")), path / "model.safetensors")
    return path


def without(prefix):
    return lambda t: {k: v for k, v in t.items() if not k.startswith(prefix)}


def reshaped(name, shape):
    return lambda t: {**t, name: np.zeros(shape, np.float32)}


def corrupt_weights(tmp_path):
    path = checkpoint(tmp_path)
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    return load_hf_checkpoint(path)


def bad_config_checkpoint(tmp_path):
    path = checkpoint(tmp_path)
    write_config(path, num_attention_heads="2")
    return load_hf_checkpoint(path)


def nnx_step_after_an_update():
    import jonebit.nnx

    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    optimizer.update(model, nnx.grad(lambda m: jnp.mean(m(jnp.ones((2, 4))) ** 2))(model))
    return jonebit.nnx.make_train_step(model, optimizer, lambda m, b: jnp.mean(m(b) ** 2), mesh())


def nnx_step_without_an_optimizer():
    import jonebit.nnx

    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    return jonebit.nnx.make_train_step(model, optax.sgd(0.1), lambda m, b: jnp.mean(m(b) ** 2), mesh())


def onebit_in_a_shard_map_without_its_axis():
    other = jax.make_mesh((2,), ("model",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:2])
    tx = jonebit.onebit_adam(1e-3, freeze_step=2)
    return jax.shard_map(tx.init, mesh=other, in_specs=P(), out_specs=P(), check_vma=False)({"w": jnp.ones(4)})


def weights_as_directory(tmp_path):
    path = checkpoint(tmp_path)
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").mkdir()
    return load_hf_checkpoint(path)


def restore_as_bf16(tmp_path):
    from jonebit.train import checkpoint as ckpt

    ckpt.save(tmp_path / "run", {"w": jnp.ones((4, 3), jnp.float32)}, step=1)
    return ckpt.restore(tmp_path / "run", {"w": jnp.ones((4, 3), jnp.bfloat16)})


def onebit_stage3_loss_that_rebuilds_the_stack():
    """1-bit Adam at stage 3 on a stacked BERT whose loss rebuilds the stacked parameters before the model."""
    from tests.train.test_onebit_zero_layerwise import CONFIG, _model_parts, tx
    from tests.train.test_zero_layerwise import batch as bert_batch
    from tests.train.test_zero_layerwise import mesh as bert_mesh

    loss, params = _model_parts(CONFIG, scan=True)
    p, s, sh = init_zero(tx(), jax.device_get(params), bert_mesh(), stage=3)
    step = make_zero_step(lambda q, b: loss(jax.tree.map(lambda x: x * 1.0, q), b), tx(), bert_mesh(), sh)
    return step(p, s, bert_batch(0))


def config_with_schedule(**params):
    from jonebit.train.config import load_config

    return load_config({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                        "scheduler": {"type": "WarmupLinearDecayExp",
                                      "params": {"total_training_steps": 100, **params}}})


CASES = [
    # --- learning-rate schedules: a NaN or negative rate would be applied silently (negative: gradient ascent)
    ("schedule-negative-min", lambda _: schedules.warmup_lr(-1e-4, 1e-3, 10),
     ValueError, r"^WarmupLR: the learning rate of update 0 \(optax count 0; step 1 when no step was skipped\) is "
                 r"-0\.0001, negative: the update would ascend the gradient; check warmup_min_lr and warmup_max_lr$"),
    ("schedule-range-test-falls", lambda _: schedules.lr_range_test(1e-3, 10, -0.5),
     ValueError, r"^LRRangeTest: the learning rate of update 22 .* is -5\.0+\d*e-05, negative"),
    ("schedule-nan-lr", lambda _: schedules.warmup_cosine_lr(float("nan"), 100),
     ValueError, r"^WarmupCosineLR: the learning rate of update 0 .* is nan, not a finite number; check the "
                 r"optimizer's lr"),
    ("schedule-config-overflow", lambda _: config_with_schedule(decay_rate=1e30, decay_step=1),
     ValueError, r"scheduler\.params: WarmupLinearDecayExp: the learning rate of update 2 \(optax count 2; step 3 "
                 r"when no step was skipped\) is inf, not a finite number; check learning_rate, warmup_proportion "
                 r"and decay_rate"),
    # --- compression sizes and packing
    ("leaf_errors-other-params", lambda _: leaf_errors(
        jonebit.onebit_adam(1e-3, freeze_step=2).init({"w": jnp.ones(4), "b": jnp.ones(3)}).worker_error,
        {"w": jnp.ones(4)}),
     ValueError, r"^leaf_errors: the params make 1 groups of equal-size leaves but the state holds 2 error arrays; "
                 r"pass the params \(and row_scales\) the optimizer was initialised with$"),
    ("padded_size-float", lambda _: jonebit.comm.padded_size(10.7, 8),
     TypeError, r"^padded_size: n must be an int \(a number of elements or ranks\), got 10\.7 \(float\)$"),
    ("padded_size-float-world", lambda _: jonebit.comm.padded_size(16, 8.0),
     TypeError, r"^padded_size: world_size must be an int .*got 8\.0 \(float\)$"),
    ("unpack_signs-traced-n", lambda _: jax.jit(jonebit.comm.unpack_signs)(np.zeros(2, np.uint8), 16),
     TypeError, r"^unpack_signs: n must be a static Python int \(it sets the output's length\), got a traced value; "
                r"pass it from a shape or mark it static \(jax\.jit's static_argnums\)"),
    ("unpack_signs-float-n", lambda _: jonebit.comm.unpack_signs(np.zeros(2, np.uint8), 8.5),
     TypeError, r"^unpack_signs: n must be an int \(the number of signs\), got 8\.5 \(float\)$"),
    # --- training checkpoints
    ("restore-float32-into-bf16", restore_as_bf16,
     ValueError, r"state leaf 'w' was saved as float32, the target has dtype bfloat16; restore into a target of "
                 r"the saved dtype \(float32\) and cast afterwards"),
    # --- Flax NNX entry point, and the 1-bit optimizers' axis
    ("nnx-step-after-update", lambda _: nnx_step_after_an_update(),
     ValueError, r"make_train_step: the optimizer has already taken 1 steps; make the train step before the first "
                 r"update \(it creates the optimizer's state for the mesh\)"),
    ("nnx-step-not-an-optimizer", lambda _: nnx_step_without_an_optimizer(),
     TypeError, r"make_train_step: optimizer must be an nnx.Optimizer, got GradientTransformationExtraArgs"),
    ("onebit-axis-not-bound", lambda _: onebit_in_a_shard_map_without_its_axis(),
     ValueError, r"jonebit: mesh axis 'data' is not bound here \(the enclosing shard_map binds \['model'\]\)\. "
                 r"The compressed allreduce and the 1-bit optimizers must run inside `jax\.shard_map`"),
    # --- data-parallel entry points
    ("shard_batch-scalar-leaf", lambda _: shard_batch({"x": np.ones((16, 2)), "step": np.float32(3)}, mesh()),
     ValueError, r"shard_batch: tree\['step'\] has shape \(\) but the batch layout P\('data',\) "
                 r"splits 1 dimension\(s\); give every batch leaf a leading batch dimension"),
    ("shard_batch-not-divisible", lambda _: shard_batch({"x": np.ones((12, 2))}, mesh()),
     ValueError, r"shard_batch: tree\['x'\] has shape \(12, 2\); its dimension 0 \(12\) must be divisible by "
                 r"the 8 devices of mesh axis 'data'"),
    ("shard_batch-unknown-axis", lambda _: shard_batch(np.ones(16), mesh(), axis="batch"),
     ValueError, r"shard_batch: mesh has no axis 'batch' \(axes: \('data',\)\)"),
    ("make_step-not-divisible", lambda _: call_dp_step(batch(12)),
     ValueError, r"make_step's step: batch\['x'\] has shape \(12, 4\); its dimension 0 \(12\) must be divisible "
                 r"by the 8 devices of mesh axis 'data'"),
    ("make_step-scalar-leaf", lambda _: call_dp_step({**batch(), "y": np.float32(0.0)}),
     ValueError, r"make_step's step: batch\['y'\] has shape \(\) but the batch layout"),
    ("make_update-tree-mismatch", lambda _: call_make_update({"w": np.zeros((N, 4, 3), np.float32)}),
     ValueError, r"make_update: local_grads must have the tree structure of params; got PyTreeDef\(\{'w': \*\}\), "
                 r"params have PyTreeDef\(\{'b': \*, 'w': \*\}\)"),
    ("make_update-not-stacked", lambda _: call_make_update({"w": np.zeros((4, 3), np.float32),
                                                            "b": np.zeros((N, 3), np.float32)}),
     ValueError, r"make_update: local_grads\['w'\] has shape \(4, 3\), expected \(8, 4, 3\) \(one row per rank"),
    ("make_update-optax-without-reduce", lambda _: make_update(
        dp_step()[0], mesh(), dp_step()[1])(replicate(params0(), mesh()),
                                            init_optimizer(dp_step()[0], replicate(params0(), mesh()), mesh())[0],
                                            shard_batch({"w": np.ones((N, 4, 3), np.float32),
                                                         "b": np.ones((N, 3), np.float32)}, mesh())),
     ValueError, r"make_update: with grad_reduce=None each rank's own gradient goes to the optimizer.*For an optax "
                 r"optimizer pass grad_reduce='mean'"),
    ("data_mesh-too-many", lambda _: data_mesh(N + 1),
     ValueError, r"data_mesh: num_devices=9 but there are 8 devices"),
    ("data_mesh-float", lambda _: data_mesh(2.5),
     TypeError, r"data_mesh: num_devices must be an int or None, got 2\.5"),
    ("data_mesh-axis", lambda _: data_mesh(2, axis=""),
     ValueError, r"data_mesh: axis must be a non-empty string \(the mesh axis name\), got ''"),
    # --- ZeRO
    ("zero-step-not-divisible", lambda _: call_zero_step(batch(20)),
     ValueError, r"make_zero_step's step: batch\['x'\] has shape \(20, 4\); its dimension 0 \(20\) must be "
                 r"divisible by the 8 devices of mesh axis 'data'"),
    ("zero-onebit-step-not-divisible", lambda _: call_zero_step(batch(12), stage=2, onebit=True),
     ValueError, r"make_zero_step's step: batch\['x'\] has shape \(12, 4\); its dimension 0 \(12\) must be "
                 r"divisible by the 8 devices of mesh axis 'data'"),
    ("zero-step-scalar-leaf", lambda _: call_zero_step({**batch(), "y": np.float32(0.0)}, stage=3),
     ValueError, r"make_zero_step's step: batch\['y'\] has shape \(\) but the batch layout"),
    ("zero-onebit-stage3-stack-rebuilt", lambda _: onebit_stage3_loss_that_rebuilds_the_stack(),
     ValueError, r"scan_layers under 1-bit Adam at ZeRO stage 3: a stacked parameter reached the model as another "
                 r"array than the step passed to the loss .* Pass the parameters to the model unchanged"),
    ("zero_shardings-stage", lambda _: zero_shardings(mesh(), params0(), None, stage=4),
     ValueError, r"ZeRO stage must be one of \[0, 1, 2, 3\], got 4"),
    ("zero_shardings-axis", lambda _: zero_shardings(mesh(), params0(), None, stage=1, axis="dp"),
     ValueError, r"ZeRO: mesh has no axis 'dp' \(axes: \('data',\)\)"),
    # --- BERT inputs (eager: concrete ids are checked)
    ("bert-id-too-large", lambda _: bert()(ids(bad=((1, 4), 50))),
     ValueError, r"input_ids\[1, 4\] = 50 is outside \[0, vocab_size=50\) \(1 such entries\); map unknown "
                 r"tokens to a valid id"),
    ("bert-id-negative", lambda _: bert()(ids(bad=((0, 0), -1))),
     ValueError, r"input_ids\[0, 0\] = -1 is outside \[0, vocab_size=50\)"),
    ("bert-token-type", lambda _: bert()(ids(), token_type_ids=np.full((2, 6), 2, np.int32)),
     ValueError, r"token_type_ids\[0, 0\] = 2 is outside \[0, type_vocab_size=2\) \(12 such entries\)"),
    ("bert-mask-4d", lambda _: bert()(ids(), attention_mask=np.ones((2, 1, 1, 6), np.int32)),
     ValueError, r"attention_mask must have the shape of input_ids \(2, 6\) \(\[batch, seq\]\), got \(2, 1, 1, 6\)"),
    ("bert-mask-transposed", lambda _: bert()(ids(), attention_mask=np.ones((6, 2), np.int32)),
     ValueError, r"attention_mask must have the shape of input_ids \(2, 6\) \(\[batch, seq\]\), got \(6, 2\)"),
    ("bert-token-type-shape", lambda _: bert()(ids(), token_type_ids=np.zeros((2, 5), np.int32)),
     ValueError, r"token_type_ids must have the shape of input_ids \(2, 6\) \(\[batch, seq\]\), got \(2, 5\)"),
    ("bert-ids-rank", lambda _: bert()(ids()[0]),
     ValueError, r"input_ids must be \[batch, seq\], got shape \(6,\)"),
    ("bert-ids-float", lambda _: bert()(ids().astype(np.float32)),
     TypeError, r"input_ids must have an integer dtype \(token ids\), got float32"),
    ("bert-ids-list", lambda _: bert()([[1, 2, 3]]),
     TypeError, r"input_ids must be an integer array \[batch, seq\], got list"),
    ("bert-ids-traced-shape", lambda _: jax.jit(lambda x: bert()(x).last_hidden_state)(ids()[None]),
     ValueError, r"input_ids must be \[batch, seq\], got shape \(1, 2, 6\)"),
    ("bert-too-long", lambda _: bert()(np.zeros((1, 13), np.int32)),
     ValueError, r"sequence length 13 exceeds max_position_embeddings 12"),
    # --- BERT config.json
    ("config-missing-file", lambda p: BertConfig.from_json(p / "nope.json"),
     FileNotFoundError, r"BERT config file not found: .*nope\.json"),
    ("config-invalid-json", lambda p: BertConfig.from_json(write_config(p, '{"vocab_size": 30522,')),
     ValueError, r"BERT config .*config\.json is not valid JSON: Expecting property name"),
    ("config-not-object", lambda p: BertConfig.from_json(write_config(p, "[1, 2]")),
     ValueError, r"BERT config .*config\.json must hold a JSON object, got a JSON list"),
    ("config-missing-keys", lambda p: BertConfig.from_json(write_config(p, hidden_size=_DROP, vocab_size=_DROP)),
     ValueError, r"BERT config .*config\.json lacks the required key\(s\) \['vocab_size', 'hidden_size'\]"),
    ("config-wrong-type", lambda p: BertConfig.from_json(write_config(p, hidden_size="16")),
     TypeError, r"BERT config .*config\.json: hidden_size must be an integer, got '16' \(str\)"),
    ("config-float-size", lambda p: BertConfig.from_json(write_config(p, vocab_size=50.0)),
     TypeError, r"BERT config .*config\.json: vocab_size must be an integer, got 50\.0 \(float\)"),
    ("config-activation", lambda p: BertConfig.from_json(write_config(p, hidden_act="swish")),
     ValueError, r"BERT config .*config\.json: unsupported hidden_act 'swish'; expected one of \['gelu', "),
    ("config-zero-heads", lambda p: BertConfig.from_json(write_config(p, num_attention_heads=0)),
     ValueError, r"BERT config .*config\.json: num_attention_heads must be positive, got 0"),
    ("config-dropout", lambda p: BertConfig.from_json(write_config(p, hidden_dropout_prob=1.5)),
     ValueError, r"BERT config .*config\.json: hidden_dropout_prob must be in \[0, 1\), got 1\.5"),
    ("config-bool-size", lambda _: BertConfig.tiny(vocab_size=True),
     TypeError, r"^vocab_size must be an integer, got True \(bool\)$"),
    ("config-dict-type", lambda _: BertConfig.from_dict([("vocab_size", 3)]),
     TypeError, r"a BERT config must be a dict \(a JSON object\), got list"),
    # --- HuggingFace checkpoint directories
    ("ckpt-bad-config", bad_config_checkpoint,
     TypeError, r"BERT config .*ckpt/config\.json: num_attention_heads must be an integer, got '2' \(str\)"),
    ("ckpt-weights-a-directory", weights_as_directory,
     IsADirectoryError, r"ckpt/model\.safetensors is a directory, not a file; the checkpoint directory .*ckpt must "
                        r"hold model\.safetensors as a file"),
    ("ckpt-path-a-file", lambda p: load_hf_checkpoint(checkpoint(p) / "config.json"),
     NotADirectoryError, r"HuggingFace checkpoint path .*ckpt/config\.json is a file; pass the directory that holds "
                         r"config\.json and model\.safetensors"),
    ("ckpt-corrupt-weights", corrupt_weights,
     ValueError, r"cannot read .*ckpt/model\.safetensors as a safetensors file \(\w+: .*\); re-download"),
    ("ckpt-missing-tensors", lambda p: load_hf_checkpoint(checkpoint(p, without("encoder.layer.0.output."))),
     ValueError, r"ckpt lacks encoder tensors BertModel needs \(PyTorch name and shape\): "
                 r"encoder\.layer\.0\.output\.LayerNorm\.bias \(16,\), encoder\.layer\.0\.output\.LayerNorm\.weight "
                 r"\(16,\), encoder\.layer\.0\.output\.dense\.bias \(16,\), encoder\.layer\.0\.output\.dense\.weight "
                 r"\(16, 32\); \d+ tensors present"),
    ("ckpt-no-encoder", lambda p: load_hf_checkpoint(checkpoint(p, without("encoder."))),
     ValueError, r"lacks encoder tensors .*: encoder\.layer\.0\.attention\.output\.LayerNorm\.bias \(16,\), .* and "
                 r"11 more"),
    ("ckpt-shape-mismatch", lambda p: load_hf_checkpoint(checkpoint(
        p, reshaped("embeddings.word_embeddings.weight", (49, 16)))),
     ValueError, r"shape mismatch for tensor 'embeddings\.word_embeddings\.weight': checkpoint has \(49, 16\), "
                 r"the model expects \(50, 16\)"),
]


@pytest.mark.parametrize(("call", "exc", "regex"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_clear_error(call, exc, regex, tmp_path):
    with pytest.raises(exc, match=regex):
        call(tmp_path)


def test_case_ids_are_unique():
    assert len({c[0] for c in CASES}) == len(CASES)


# ----------------------------------------------------------------------------------------------------------------
# No data loss: the caller's arrays survive donating steps.

def _snapshot(tree):
    return jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(tree))


@pytest.mark.parametrize("source", ["host", "device0", "replicated"])
def test_replicate_then_donating_steps_keep_callers_params(source):
    """jax.device_put to a replicated sharding reuses the source buffer (jax 0.10), so without replicate's copy
    the first donating step deletes the caller's arrays."""
    mine = params0()
    if source == "device0":
        mine = jax.device_put(mine, jax.devices()[0])
    elif source == "replicated":
        mine = jax.device_put(mine, jax.NamedSharding(mesh(), P()))
    before = _snapshot(mine)
    tx = optax.sgd(0.1)
    params = replicate(mine, mesh())
    state, specs = init_optimizer(tx, params, mesh())
    step = make_step(loss_fn, tx, mesh(), specs, grad_reduce="mean")
    first = params
    for _ in range(2):
        params, state, _ = step(params, state, shard_batch(batch(), mesh()))
    assert all(x.is_deleted() for x in jax.tree.leaves(first))  # the step does donate
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)  # readable and unchanged
    # ... and the steps did move the parameters: the reference is plain numpy gradient descent on the mean loss.
    ref = {k: v.copy() for k, v in before.items()}
    for _ in range(2):
        b = batch()
        r = b["x"] @ ref["w"] + ref["b"] - b["y"]
        gw, gb = 2 * b["x"].T @ r / r.size, 2 * r.sum(0) / r.size
        ref = {"w": ref["w"] - 0.1 * gw, "b": ref["b"] - 0.1 * gb}
    for k in ref:
        np.testing.assert_allclose(np.asarray(params[k]), ref[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("devices", [1, N])
def test_shard_batch_result_does_not_alias_callers_batch(devices):
    """Already laid out (or on a one-device mesh) jax.device_put hands back the caller's buffers; donating the
    result of shard_batch must not delete them."""
    m = data_mesh(devices)
    mine = jax.device_put(batch()["x"], jax.NamedSharding(m, P("data")))
    before = np.array(mine)
    placed = shard_batch(mine, m)
    assert placed.sharding == mine.sharding
    jax.jit(lambda x: x * 2, donate_argnums=0)(placed)
    assert placed.is_deleted() and not mine.is_deleted()
    np.testing.assert_array_equal(np.asarray(mine), before)


def test_make_update_still_takes_stacked_grads():
    """The shape check lets the documented layout through: rank r's gradient in row r, averaged by 'mean'."""
    tx, specs, _ = dp_step()
    grads = {"w": np.arange(N * 12, dtype=np.float32).reshape(N, 4, 3), "b": np.ones((N, 3), np.float32)}
    new, _ = call_make_update(shard_batch(grads, mesh()))
    np.testing.assert_allclose(np.asarray(new["w"]), params0()["w"] - 0.1 * grads["w"].mean(0), rtol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# BERT ids: the edges pass, and inside jit (unchecked) the documented behaviour.

def test_bert_accepts_ids_at_the_edges_and_matches_under_jit():
    edge = ids(bad=((0, 0), 0))
    edge[1, -1] = CONFIG.vocab_size - 1
    types = np.zeros((2, 6), np.int32)
    types[:, 3:] = CONFIG.type_vocab_size - 1
    mask = np.ones((2, 6), bool)
    mask[1, 4:] = False
    eager = bert()(edge, attention_mask=mask, token_type_ids=types).last_hidden_state
    jitted = jax.jit(lambda i, m, t: bert()(i, attention_mask=m, token_type_ids=t).last_hidden_state)(
        edge, mask, types)
    assert np.all(np.isfinite(eager))
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-5, atol=1e-5)


def test_bert_out_of_range_ids_under_jit_are_unchecked_as_documented():
    """What BertModel's docstring says happens where ids are traced: an id >= vocab_size turns its whole sequence
    into NaN (and only that sequence); -1 reads the last row of the embedding table."""
    run = jax.jit(lambda i: bert()(i).last_hidden_state)
    good = ids()
    out = np.asarray(run(ids(bad=((1, 2), CONFIG.vocab_size))))
    assert np.isnan(out[1]).all()
    np.testing.assert_allclose(out[0], np.asarray(run(good))[0], rtol=1e-6)
    last = ids(bad=((0, 2), CONFIG.vocab_size - 1))
    np.testing.assert_array_equal(np.asarray(run(ids(bad=((0, 2), -1)))), np.asarray(run(last)))


def test_config_json_with_null_pad_token_loads(tmp_path):
    """HuggingFace writes pad_token_id null for some models; the type check lets it through."""
    c = BertConfig.from_json(write_config(tmp_path, pad_token_id=None))
    assert c.pad_token_id is None and c.hidden_size == CONFIG.hidden_size


def test_config_accepts_numpy_scalars():
    c = BertConfig.tiny(vocab_size=np.int64(100), hidden_dropout_prob=np.float32(0.25))
    assert c.vocab_size == 100 and c.hidden_dropout_prob == 0.25


def test_checkpoint_round_trip_still_loads(tmp_path):
    model = load_hf_checkpoint(checkpoint(tmp_path), BertModel, strict=True)
    np.testing.assert_array_equal(np.asarray(model.embeddings.word_embeddings.embedding[...]),
                                  np.asarray(bert().embeddings.word_embeddings.embedding[...]))


