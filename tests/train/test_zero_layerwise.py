"""ZeRO stage 3 with stacked layers (:mod:`jonebit.sharding.layerwise`) on 8 simulated CPU devices.

* the parameters after 20 AdamW steps are stage 0's (float32, ``make_zero_step``), and in bf16 compute through the
  engine as close to stage 0's as two float-order variants of stage 0 itself are;
* the compiled step gathers stacked leaves one layer at a time (no all-gather of a whole stacked leaf), inside
  the scan, and each layer's gather reads only the stacked shards and the loop index, never the previous
  layer's output (so it can be issued ahead of that layer's compute);
* a stack's layer axis is never partitioned.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.extend.core import Literal

from jonebit.comm.accounting import comm_report
from jonebit.models.bert import BertConfig, BertForPreTraining, pretraining_loss
from jonebit.sharding.layerwise import STACKED_KEY
from jonebit.sharding.mesh import data_mesh
from jonebit.sharding.zero import zero_specs
from jonebit.train.data_parallel import shard_batch
from jonebit.train.engine import init_train_state, make_train_step
from jonebit.train.initialize import initialize
from jonebit.train.zero import init_zero, make_zero_grads, make_zero_step

N = 8
STEPS = 20
BF16_STEPS = 10  # the bf16 comparison is against a measured floor, which needs no long run
CONFIG = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
                    max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
B, S = 16, 12
LR = 1e-3


@functools.cache
def mesh():
    return data_mesh(N)


def _parts(dtype=jnp.float32, remat=False):
    model = BertForPreTraining(CONFIG, scan_layers=True, remat=remat, dtype=dtype, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(p, batch):
        m = nnx.merge(graphdef, p, jax.tree.map(lambda x: x, rest))  # fresh Variables in this trace
        return pretraining_loss(m(batch["input_ids"], batch["attention_mask"], deterministic=True), batch)

    return loss_fn, jax.device_get(nnx.to_pure_dict(params))


def batch(i: int) -> dict:
    r = np.random.default_rng(i)
    ids = r.integers(1, CONFIG.vocab_size, (B, S)).astype(np.int32)
    mask = np.ones((B, S), np.int32)
    mask[::3, 9:] = 0
    labels = np.where(r.random((B, S)) < 0.2, ids, -100).astype(np.int32)
    return dict(input_ids=ids, attention_mask=mask, labels=labels,
                next_sentence_label=r.integers(0, 2, (B,)).astype(np.int32))


def tx():
    return optax.adamw(LR, weight_decay=0.01)


@functools.cache
def zero_run(stage: int):
    loss_fn, params = _parts()
    p, s, sh = init_zero(tx(), params, mesh(), stage=stage)
    step = make_zero_step(loss_fn, tx(), mesh(), sh)
    losses = []
    for i in range(STEPS):
        p, s, loss = step(p, s, batch(i))
        losses.append(float(loss))
    return jax.device_get(p), step, (p, s), losses


@functools.cache
def quantized_run():
    loss_fn, params = _parts()
    p, s, sh = init_zero(tx(), params, mesh(), stage=3)
    step = make_zero_step(loss_fn, tx(), mesh(), sh, quantized_weights=True)
    losses = []
    for i in range(STEPS):
        p, s, loss = step(p, s, batch(i))
        losses.append(float(loss))
    return jax.device_get(p), step, losses, sh


@functools.cache
def engine_run(stage: int, remat: bool):
    loss_fn, params = _parts(jnp.bfloat16, remat)
    state, specs = init_train_state(tx(), params, mesh(), zero_stage=stage)
    step = make_train_step(loss_fn, tx(), mesh(), specs, compute_dtype=jnp.bfloat16, grad_reduce="mean",
                           zero_stage=stage)
    for i in range(BF16_STEPS):
        state, _ = step(state, batch(i))
    return jax.device_get(state.params)


def diffs(a, b) -> np.ndarray:
    return np.concatenate([np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).ravel()
                           for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)])


def test_float32_parameters_are_stage_0s():
    """Stage 3 gathers and reduce-scatters each layer inside the scan; stage 0 all-reduces whole gradients. Both
    sum the same float32 local gradients, in another order: the gradients differ by a few ulps, and Adam's
    division by sqrt(v) turns rounding in near-zero gradient entries into update differences of at most a few
    1e-6 at lr 1e-3 over 20 steps (the bound of tests/train/test_zero.py's stages against a reference)."""
    stage3 = zero_run(3)[0]
    stage0 = zero_run(0)[0]
    _, init = _parts()
    assert diffs(stage3, stage0).max() < 2e-5
    assert diffs(stage0, init).max() > 1000 * 2e-5  # the run moved the parameters far beyond the tolerance


def test_reduced_gradients_are_stage_0s_mean():
    """The gradients themselves, before any optimizer (which could hide a uniform scale error: Adam divides by
    sqrt(v)): stage 3's, reduce-scattered layer by layer inside the scan and divided by the ranks, equal stage 0's
    all-reduced mean within float32 summation order (a few ulps of the largest entry: 1e-6 of it)."""
    loss_fn, params = _parts()
    grads = {}
    for stage in (0, 3):
        p, _, sh = init_zero(tx(), params, mesh(), stage=stage)
        g, _ = jax.jit(make_zero_grads(loss_fn, mesh(), sh))(p, shard_batch(batch(0), mesh()))
        grads[stage] = jax.device_get(g)
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(grads[0]))
    assert diffs(grads[3], grads[0]).max() <= 1e-6 * scale
    # The stacked leaves' gradients are not zero (a gather that dropped them would leave zeros).
    stacked = grads[3]["bert"]["encoder"][STACKED_KEY]["intermediate"]["dense"]["kernel"]
    assert float(np.abs(stacked).max()) > 1e-3 * scale


def test_bf16_parameters_are_as_close_to_stage_0s_as_stage_0_is_to_itself():
    """In bf16 compute no bound of a few ulps holds between two programs: XLA rounds bf16 intermediates where its
    fusions end, so two programs of the same arithmetic (here stage 0 with and without rematerialisation) give
    gradients that differ by bf16 ulps (2**-8 relative), and Adam turns those in near-zero entries into update
    differences of up to 2 lr per step. Stage 3 must stay within twice that measured floor of stage 0, and the
    floor itself must be small against how far the parameters moved."""
    stage0 = engine_run(0, False)
    floor = diffs(engine_run(0, True), stage0).max()
    gap = diffs(engine_run(3, False), stage0).max()
    _, init = _parts()
    moved = diffs(stage0, init).max()
    assert floor < 0.1 * moved
    # Where the two stage-0 programs happen to round alike, the float32 bound of the test above applies instead.
    assert gap <= max(2 * floor, 2e-5), (gap, floor)


_ALL_GATHER = re.compile(r"=\s*(?P<type>[a-z0-9]+)\[(?P<shape>[\d,]*)\][^=]*?\sall-gather(?:-start)?\(")


def test_each_layer_is_gathered_inside_the_scan_and_independently_of_the_previous_layer():
    _, step, (p, s), _ = zero_run(3)
    b = batch(0)
    hlo = step.lower(p, s, b).compile().as_text()
    gathered = [tuple(int(d) for d in m["shape"].split(",") if d) for m in _ALL_GATHER.finditer(hlo)]
    stacked = {tuple(x.shape) for x in jax.tree.leaves(p["bert"]["encoder"][STACKED_KEY])}
    one_layer = {shape[1:] for shape in stacked}
    assert gathered and not set(gathered) & stacked  # never a whole stack
    assert set(gathered) & one_layer  # one layer's leaves, whole

    # In the traced step, every all_gather inside a scan body depends on the scanned inputs (the stacked shards,
    # sliced by the loop) and loop constants only, never on the carry (the previous layer's activations).
    jaxpr = jax.make_jaxpr(step._jitted)(p, s, b).jaxpr
    scans = list(_equations(jaxpr, "scan"))
    assert scans
    found = 0
    for eqn in scans:
        body = eqn.params["jaxpr"].jaxpr
        first, last = eqn.params["num_consts"], eqn.params["num_consts"] + eqn.params["num_carry"]
        for _, deps in _gathers(body, [{i} for i in range(len(body.invars))]):
            found += 1
            assert not deps & set(range(first, last)), "a layer's gather waits for the previous layer's output"
    assert found >= len(stacked)


def _subjaxprs(eqn):
    for v in eqn.params.values():
        for x in v if isinstance(v, tuple | list) else (v,):
            if hasattr(x, "eqns"):
                yield x
            elif hasattr(getattr(x, "jaxpr", None), "eqns"):
                yield x.jaxpr


def _equations(jaxpr, name):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            yield eqn
        for sub in _subjaxprs(eqn):
            yield from _equations(sub, name)


def _gathers(jaxpr, in_deps):
    """``(all_gather equation, the indices of the inputs it depends on)`` in ``jaxpr`` and the calls inside it,
    given the dependencies of ``jaxpr``'s inputs. A nested call's inputs map by position where their counts agree
    (pjit, remat, custom_vjp, scan), else each depends on all of the call's inputs."""
    deps = dict(zip(jaxpr.invars, in_deps, strict=True))
    for eqn in jaxpr.eqns:
        ins = [set() if isinstance(v, Literal) else deps.get(v, set()) for v in eqn.invars]
        d = set().union(*ins)
        if eqn.primitive.name == "all_gather":
            yield eqn, d
        for sub in _subjaxprs(eqn):
            inner = ins if len(sub.invars) == len(ins) else [d] * len(sub.invars)
            yield from _gathers(sub, inner)
        for v in eqn.outvars:
            deps[v] = d


def _compiled_gathers(step, p, s):
    """The compiled step's all-gathers: ``(element type, result bytes, executions per step)``."""
    hlo = step.lower(p, s, batch(0)).compile().as_text()
    return [(c.dtypes, c.result_bytes, c.trips) for c in comm_report(hlo, N).always if c.op == "all-gather"]


def test_quantized_gather_sends_int8_and_block_scales_and_trains_like_the_exact_gather():
    """``quantized_weights``: each float32 gather of the exact stage-3 step (m elements per rank, N ranks) becomes
    an int8 gather of N b s bytes (b = ceil(m / 256) blocks of s = ceil(m / b) elements) and a float32 gather of
    its N b block scales, executed as often; the parameters stay float32 and the run learns as the exact one
    does."""
    _, exact_step, (p, s), exact_losses = zero_run(3)
    q_params, q_step, q_losses, _ = quantized_run()
    exact, quant = _compiled_gathers(exact_step, p, s), _compiled_gathers(q_step, p, s)
    assert exact and {d for d, _, _ in exact} == {("f32",)}
    want = {"s8": 0, "f32": 0}
    for _, nbytes, trips in exact:
        m = nbytes // 4 // N
        blocks = -(-m // 256)
        want["s8"] += N * blocks * -(-m // blocks) * trips
        want["f32"] += N * blocks * 4 * trips
    got = {"s8": 0, "f32": 0}
    for (dtype,), nbytes, trips in quant:
        got[dtype] += nbytes * trips
    assert got == want
    float32_bytes = sum(nbytes * trips for _, nbytes, trips in exact)
    # int8 + a scale per block: a quarter of the float32 bytes, and for this model's small shards (4-32 elements
    # per rank) one scale per shard, 4 bytes on 4-32.
    assert (got["s8"] + got["f32"]) / float32_bytes < 0.5
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(q_params))

    # Training: the quantized forward sees each weight within half a step (max |block| / 254, 0.4% of the block's
    # largest) of its value, a perturbation of the loss far below what 20 steps of training move it: every step's
    # loss stays within 5% of the exact run's total decrease of it, and the parameters within 10% (L2) of how far
    # the exact run moved them. An untrained or diverging run fails both.
    drop = exact_losses[0] - exact_losses[-1]
    assert drop > 0.1
    assert np.abs(np.array(q_losses) - np.array(exact_losses)).max() <= 0.05 * drop
    exact_params = zero_run(3)[0]
    moved = np.linalg.norm(diffs(exact_params, _parts()[1]))
    assert np.linalg.norm(diffs(q_params, exact_params)) <= 0.1 * moved


def test_quantized_weights_errors():
    loss_fn, params = _parts()
    _, _, sh = init_zero(tx(), params, mesh(), stage=2)
    with pytest.raises(ValueError, match="quantized_weights.*needs stage 3"):
        make_zero_step(loss_fn, tx(), mesh(), sh, quantized_weights=True)


def test_initialize_at_stage_3_resumes_exactly(tmp_path):
    """``zero_optimization.stage: 3`` through :func:`jonebit.train.initialize.initialize` with the stacked model:
    resumed in a new engine from the step-2 checkpoint of an uninterrupted run, it ends bit-identical to that run,
    every leaf in its partitioned layout."""
    cfg = {"train_batch_size": B, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3}}
    loss_fn, params = _parts()

    straight, resumed = straight_and_resumed(cfg, loss_fn, params, tmp_path)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding == b.sharding
    kernel = resumed.params["bert"]["encoder"][STACKED_KEY]["intermediate"]["dense"]["kernel"]
    assert tuple(kernel.sharding.spec) == (None, None, "data")


def straight_and_resumed(cfg: dict, loss_fn, params, tmp_path):
    """The engine's final states of a 4-step run straight through, and of a new engine, built from other initial
    parameters, that resumes from the straight run's step-2 checkpoint (a copy of it, alone in its own run
    directory: what a run stopped after step 2 leaves); only the restored checkpoint can make it end like the
    straight one."""
    import shutil

    def train(out, seed):
        start = params if seed == 0 else jax.tree.map(lambda x: x + 0.01, params)
        engine = initialize(cfg, loss_fn, start, mesh=mesh())
        loop = engine.loop_config(out, max_steps=4, progress_bar=False, tensorboard=False, checkpoint_every=2,
                                  keep_checkpoints=2)  # step 2's too, whatever the default
        return engine.train(_Batches(), loop)

    straight = train(tmp_path / "straight", seed=0)
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "2", tmp_path / "resumed" / "checkpoints" / "2")
    return straight, train(tmp_path / "resumed", seed=1)


class _Batches:
    """:func:`batch` in order; its position is its state."""

    def __init__(self):
        self.n = 0

    def __next__(self):
        self.n += 1
        return batch(self.n - 1)

    def get_state(self):
        return {"n": self.n}

    def set_state(self, state):
        self.n = state["n"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_layer_axis_of_a_stack_is_never_partitioned(stage):
    """Even where the layer axis is the largest dimension divisible by the devices (16 layers of 8 wide)."""
    params = {STACKED_KEY: {"w": jnp.zeros((16, 8)), "v": jnp.zeros((16, 3))}, "layers": {"w": jnp.zeros((16, 8))}}
    param_specs, grad_specs, state_specs = zero_specs(mesh(), params, optax.adam(1e-3).init(params), stage=stage)
    specs = {1: state_specs[0].mu, 2: grad_specs, 3: param_specs}[stage]
    assert tuple(specs[STACKED_KEY]["w"]) == (None, "data")
    assert tuple(specs[STACKED_KEY]["v"]) in ((), (None, None))  # nothing divisible but the layer axis: replicated
    assert tuple(specs["layers"]["w"])[:1] == ("data",)  # an ordinary leaf: its largest divisible dimension
