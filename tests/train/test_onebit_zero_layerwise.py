"""1-bit Adam at ZeRO stage 3 with stacked layers (:mod:`jonebit.sharding.layerwise`), 8 simulated CPU devices.

Each layer of a stack is a flat buffer of its own (its own compression scales and chunks), the stack's buffers one
array with a layer axis, gathered inside the scan where the layer runs; its local gradient comes out whole (1-bit
compression needs it). The reference is the same model with its layers as a list, whose buffers are the same
per-layer buffers, all gathered at the step's start:

* the two train alike, under the invariants a 1-bit step between two programs keeps (see ``_assert_same_update``);
* the compiled step gathers each stacked layer's chunks inside the loop, never a whole stack;
* its compiled peak is below the whole-tree gather's by at least the stack's parameters less two layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jonebit
from jonebit.comm.accounting import comm_report
from jonebit.models.bert import BertConfig, BertForPreTraining, pretraining_loss
from jonebit.sharding.layerwise import STACKED_KEY
from jonebit.train.zero import abstract_zero, init_zero, make_zero_step
from jonebit.transforms.onebit_adam_zero import FlatLayout, OneBitAdamZeroState
from tests.train.test_onebit_zero import mirrored_steps
from tests.train.test_zero_layerwise import CONFIG, N, S, batch, mesh

FREEZE = 3
LR, WEIGHT_DECAY = 1e-3, 0.01
LAYERS = CONFIG.num_hidden_layers


def _model_parts(config: BertConfig, scan: bool):
    """``(loss_fn, params)``; the list-of-layers model gets the stacked model's values, layer by layer."""
    model = BertForPreTraining(config, scan_layers=scan, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(p, b):
        m = nnx.merge(graphdef, p, jax.tree.map(lambda x: x, rest))  # fresh Variables in this trace
        return pretraining_loss(m(b["input_ids"], b["attention_mask"], deterministic=True), b)

    return loss_fn, nnx.to_pure_dict(params)


def unstack(pure: dict, layers: int) -> dict:
    stack = pure["bert"]["encoder"][STACKED_KEY]
    return {**pure, "bert": {**pure["bert"], "encoder": {
        "layer": {i: jax.tree.map(lambda x, i=i: _layer(x, i), stack) for i in range(layers)}}}}


def _layer(x, i: int):
    return jax.ShapeDtypeStruct(x.shape[1:], x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x[i]


def restack(pure: dict, layers: int) -> dict:
    per_layer = pure["bert"]["encoder"]["layer"]
    return {**pure, "bert": {**pure["bert"], "encoder": {
        STACKED_KEY: jax.tree.map(lambda *xs: np.stack(xs), *[per_layer[i] for i in range(layers)])}}}


def tx():
    return jonebit.onebit_adam_zero(LR, freeze_step=FREEZE, stage=3, weight_decay=WEIGHT_DECAY)


def run(scan: bool, steps: int = FREEZE + 2):
    """Parameters (stacked form, float64 leaves) after every step, the losses, and the step and its inputs."""
    loss_fn, stacked = _model_parts(CONFIG, scan=True)
    if not scan:
        loss_fn, _ = _model_parts(CONFIG, scan=False)
    params = jax.device_get(stacked if scan else unstack(stacked, LAYERS))
    p, s, sh = init_zero(tx(), params, mesh(), stage=3)
    step = make_zero_step(loss_fn, tx(), mesh(), sh)
    first = (p, s)
    trees, losses = [], []
    for i in range(steps):
        p, s, loss = step(p, s, batch(i))
        losses.append(float(loss))
        tree = jax.device_get(p.tree())
        tree = tree if scan else restack(tree, LAYERS)
        trees.append([np.asarray(x, np.float64) for x in jax.tree.leaves(tree)])
    return trees, losses, step, first, sh


@pytest.fixture(scope="module")
def stacked_run():
    """The stacked model's run (its step is also the one whose program the gather test reads)."""
    return run(True)


@pytest.fixture(scope="module")
def list_run():
    """The reference: the same model with its layers as a list, the same per-layer buffers."""
    return run(False)


def test_each_stacked_leaf_is_a_stack_of_per_layer_buffers():
    """A stacked leaf keeps one array (a leading layer axis) whose rows are the buffers the list-of-layers model
    has: the same sizes, and chunks that round-trip."""
    _, stacked = _model_parts(CONFIG, scan=True)
    layout = FlatLayout.of(stacked, N, fused=False)
    flat = jax.tree_util.tree_leaves_with_path(stacked)
    assert len(layout.groups) == len(flat)
    n_stacked = sum(STACKED_KEY in jax.tree_util.keystr(path) for path, _ in flat)
    assert len(layout.stacked_leaves()) == n_stacked > 0
    per_layer = sorted(s for g in range(len(layout.groups)) for s in [layout.size(g)] * (layout.layers[g] or 1))
    unstacked = FlatLayout.of(unstack(stacked, LAYERS), N, fused=False)
    assert not unstacked.stacked_leaves()
    assert per_layer == sorted(unstacked.size(g) for g in range(len(unstacked.groups)))
    chunks = layout.to_chunks(stacked)
    for g in (g for g in range(len(layout.groups)) if layout.stacked(g)):
        assert chunks[g].shape == (N, LAYERS, layout.chunk(g))
    back = layout.from_chunks(chunks)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(stacked), strict=True):
        np.testing.assert_array_equal(a, b)


# Before the trajectory test in file order: it sets up the stacked run, so that (run in that order) no one test's
# set-up holds both runs.
def test_each_layer_is_gathered_inside_the_loop_never_a_whole_stack(stacked_run):
    _, _, step, (p, s), _ = stacked_run
    hlo = step.lower(p, s, batch(0), phases=((OneBitAdamZeroState, "compression"),)).compile().as_text()
    gathers = [c for c in comm_report(hlo, N).always if c.op == "all-gather"]
    layout = p.layout
    stacks = [g for g in range(len(layout.groups)) if layout.stacked(g)]
    layer_bytes = {4 * layout.padded(g) for g in stacks}
    stack_bytes = {LAYERS * b for b in layer_bytes}
    assert not {c.result_bytes for c in gathers} & stack_bytes  # never a whole stack
    in_loop = [c for c in gathers if c.result_bytes in layer_bytes and (c.trips or 0) >= LAYERS]
    outside = [c for c in gathers if c.result_bytes in layer_bytes and (c.trips or 0) < LAYERS]
    # Every stacked leaf's layer chunks are gathered in the forward loop and again in the backward loop; a
    # non-stacked buffer of the same size would be gathered once, outside.
    assert len(in_loop) >= 2 * len(stacks) - len(outside), (len(in_loop), len(outside))
    assert {c.result_bytes for c in in_loop} == layer_bytes


# The stacked model's leaf paths, in the order of the trees the tests compare.
PATHS = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(_model_parts(CONFIG, scan=True)[1])]

# Leaves whose gradient is zero by construction: a key bias adds the same amount to every score of a query
# (``q . b_k``), which the softmax removes. Their updates are rounding noise in both programs.
ZERO_GRADIENT = frozenset(i for i, p in enumerate(PATHS) if "['key']['bias']" in p)

# The rows of the leaves with rows no gradient reaches: positions past the batches' length, the token-type
# embedding's second row (they pass no token types). ``mask_unseen`` leaves the others to weight decay in both
# programs: there is no sign part to compare.
_ROWS = {"position_embeddings": slice(0, S), "token_type_embeddings": slice(0, 1)}
SEEN_ROWS = {i: _ROWS[k] for i, p in enumerate(PATHS) for k in _ROWS if k in p}


def _assert_same_update(before_want, after_want, before_got, after_got, what: str) -> tuple[int, int]:
    """A compression step's update in two programs, by what a sign flip cannot change (as in test_onebit_zero):
    u = step + lr wd p is -lr sign * s / (sqrt(v) + eps) per coordinate, s one scale per layer and chunk. Per leaf
    the median ratio |u_got| / |u_want| is 1 to 1e-3 (the two scales, norms over a whole buffer, differ by the
    gradients' rounding); every coordinate takes the same step or the mirrored one, to 1% of its size (1 / sqrt(v)
    carries the frozen variance's rounding, amplified where the gradient cancels); returns (mirrored, total)."""
    flipped = total = 0
    for leaf, (w0, w1, g0, g1) in enumerate(zip(before_want, after_want, before_got, after_got, strict=True)):
        if leaf in ZERO_GRADIENT:
            continue
        if leaf in SEEN_ROWS:
            w0, w1, g0, g1 = (x[SEEN_ROWS[leaf]] for x in (w0, w1, g0, g1))
        u_want, u_got = w1 - w0 + LR * WEIGHT_DECAY * w0, g1 - g0 + LR * WEIGHT_DECAY * g0
        flipped += mirrored_steps(u_want, u_got, floor=2e-6, what=f"{what}, leaf {leaf}")
        total += u_want.size
    return flipped, total


def test_stacked_layers_train_as_the_list_of_layers(stacked_run, list_run):
    """Warmup is Adam, smooth in the gradient: the parameters agree elementwise to 1e-4 relative + 2e-6 absolute
    (steps of lr = 1e-3; the two programs sum the gradients in different orders, a few float32 ulps per step). The
    two compression steps (the first gathers the float32 momentum, the second decodes the packed one) are compared
    by their invariants; mirrored coordinates are few (<= 2%: a handful of sign patterns tie at the server)."""
    want, want_losses, *_ = list_run
    got, losses, *_ = stacked_run
    np.testing.assert_allclose(losses[:FREEZE + 1], want_losses[:FREEZE + 1], rtol=1e-5)  # from warmup params
    warm = FREEZE - 1
    for leaf, (w, g) in enumerate(zip(want[warm], got[warm], strict=True)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-6, err_msg=f"leaf {leaf} after warmup")
    for t in (warm, warm + 1):
        flipped, total = _assert_same_update(want[t], want[t + 1], got[t], got[t + 1], f"step {t + 2}")
        assert flipped <= 0.02 * total, f"step {t + 2}: {flipped} of {total} coordinates took the mirrored step"


def test_compiled_peak_is_below_the_whole_tree_gather():
    """The whole-tree step holds every gathered parameter (4 Psi_stack bytes) from the forward pass into the
    backward one, the layer-wise step at most two layers' (the one running and the next one's gather): its
    compiled peak must be lower by at least 4 Psi_stack (1 - 2 / L). Everything else (the model states, the
    compression's buffers, the layers outside the stack) is the same in both."""
    config = BertConfig(vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=512, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    layers = config.num_hidden_layers
    b = {k: jax.ShapeDtypeStruct((16, 64), jnp.int32) for k in ("input_ids", "attention_mask", "labels")}
    b["next_sentence_label"] = jax.ShapeDtypeStruct((16,), jnp.int32)
    peaks = {}
    stacked = jax.eval_shape(lambda: _model_parts(config, scan=True)[1])
    psi_stack = sum(x.size for x in jax.tree.leaves(stacked["bert"]["encoder"]))
    for scan in (True, False):
        loss_fn, _ = _model_parts(config, scan=scan)
        params = stacked if scan else unstack(stacked, layers)
        a_params, a_state, sh = abstract_zero(tx(), params, mesh(), stage=3)
        step = make_zero_step(loss_fn, tx(), mesh(), sh)
        m = step.lower(a_params, a_state, b, phases=((OneBitAdamZeroState, "compression"),)).compile() \
            .memory_analysis()
        peaks[scan] = (m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
                       - m.alias_size_in_bytes)
    assert peaks[True] + 4 * psi_stack * (1 - 2 / layers) <= peaks[False], (peaks, psi_stack)


def test_engine_at_stage_3_with_bf16_resumes_exactly(tmp_path):
    """``OneBitAdam`` with ``zero_optimization.stage: 3`` and bf16 compute through
    :func:`jonebit.train.initialize.initialize` on the stacked model: the stacks stay per-layer chunks with a layer
    axis; a new engine (other initial parameters, so only the checkpoint can make it end alike) resumed from the
    checkpoint at the freeze ends its compression steps bit-identical to the uninterrupted run that wrote it."""
    from jonebit.train.onebit_zero import FlatParams
    from tests.train.test_zero_layerwise import B, _parts, straight_and_resumed

    cfg = {"train_batch_size": B, "bf16": {"enabled": True},
           "optimizer": {"type": "OneBitAdam", "params": {"lr": LR, "freeze_step": 2}},
           "zero_optimization": {"stage": 3}}
    loss_fn, params = _parts()

    straight, resumed = straight_and_resumed(cfg, loss_fn, params, tmp_path)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert isinstance(resumed.params, FlatParams)
    layout = resumed.params.layout
    stacks = [g for g in range(len(layout.groups)) if layout.stacked(g)]
    assert stacks and all(resumed.params.chunks[g].shape == (N, LAYERS, layout.chunk(g)) for g in stacks)
    # The compression steps moved the parameters (not a run that stood still after the freeze).
    assert not np.array_equal(np.asarray(resumed.params.chunks[stacks[0]]),
                              np.asarray(layout.to_chunks(params)[stacks[0]]))
