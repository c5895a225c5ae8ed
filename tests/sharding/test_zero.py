"""jonebit.sharding.zero: the per-leaf rule, every stage's layout for Adam and non-Adam states, offload, errors,
bytes per device. Expected layouts are written out by hand or computed with plain numpy arithmetic here."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jonebit.sharding import zero as zero_mod
from jonebit.sharding.mesh import data_mesh
from jonebit.sharding.zero import STAGES, bytes_per_device, leaf_spec, shard_dim, zero_shardings

N = 8


@pytest.fixture(scope="module")
def mesh():
    return data_mesh(N)


@pytest.fixture(scope="module")
def mesh2d():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def norm(spec) -> tuple:
    """A spec as a tuple without trailing ``None`` (``P('data', None)`` and ``P('data')`` mean the same)."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


def expected_spec(shape, n=N) -> tuple:
    """Independent statement of the rule: among the dims with size % n == 0 (and size >= n) take the largest,
    the first on ties; none -> replicated."""
    sizes = np.asarray(shape, dtype=np.int64)
    ok = (sizes % n == 0) & (sizes >= n) if sizes.size else np.zeros(0, bool)
    if not ok.any():
        return ()
    d = int(np.argmax(np.where(ok, sizes, -1)))  # argmax returns the first maximum
    return norm(P(*[("data" if i == d else None) for i in range(len(shape))]))


# ----------------------------------------------------------------------------------------------------------------
# The per-leaf rule.

@pytest.mark.parametrize(
    "shape,spec",
    [
        ((24, 16), ("data",)),              # largest divisible dim first
        ((16, 24), (None, "data")),         # ... or last
        ((16, 16), ("data",)),              # tie: the first
        ((12, 16), (None, "data")),         # 12 % 8 != 0 although it is not the smallest
        ((40, 7, 8), ("data",)),
        ((3, 8, 5), (None, "data")),
        ((8,), ("data",)),                  # exactly one element per device
        ((4,), ()),                         # smaller than the axis
        ((3, 5), ()),                       # nothing divisible
        ((0, 4), ()),                       # empty leaf
        ((), ()),                           # scalar
        ((1,), ()),
        ((2, 64, 128), (None, None, "data")),
    ],
)
def test_leaf_rule(mesh, shape, spec):
    assert norm(leaf_spec(shape, mesh, "data")) == spec
    assert expected_spec(shape) == spec  # the test's own statement of the rule agrees with the table


def test_shard_dim_values(mesh):
    assert shard_dim((24, 16), mesh, "data") == 0
    assert shard_dim((16, 24), mesh, "data") == 1
    assert shard_dim((3, 5), mesh, "data") is None
    assert shard_dim((), mesh, "data") is None
    # Already on the data axis: nothing more to add.
    assert shard_dim((16, 16), mesh, "data", P(None, "data")) is None


def test_unsplittable_leaf_is_logged(mesh, caplog):
    with caplog.at_level(logging.DEBUG, logger="jonebit.sharding.zero"):
        sh = zero_shardings(mesh, {"odd": jnp.zeros((3, 5)), "ok": jnp.zeros((16, 3)), "s": jnp.zeros(())},
                            {}, stage=3)
    assert norm(sh.params["odd"].spec) == ()
    assert norm(sh.params["ok"].spec) == ("data",)
    records = [r.getMessage() for r in caplog.records if r.name == "jonebit.sharding.zero"]
    odd = [m for m in records if "(3, 5)" in m]
    assert odd and "params['odd']" in odd[0] and "replicated" in odd[0] and "data=8" in odd[0]
    assert not any("(16, 3)" in m for m in records)  # partitioned leaves are not logged
    assert not any("['s']" in m for m in records)    # scalars are expected to be replicated: no log


def test_model_axis_is_kept_on_2d_mesh(mesh2d):
    """Leaves that already use 'model' keep it; 'data' (size 4) goes on the largest dim still divisible after
    the model split."""
    model = lambda spec: NamedSharding(mesh2d, spec)  # noqa: E731
    params = {
        "col": jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=model(P(None, "model"))),   # 8 vs 16/2=8: tie
        "row": jax.ShapeDtypeStruct((64, 12), jnp.float32, sharding=model(P("model", None))),  # 64/2=32 vs 12
        "wide": jax.ShapeDtypeStruct((4, 64), jnp.float32, sharding=model(P(None, "model"))),  # 4 vs 32 -> dim 1
        "odd": jax.ShapeDtypeStruct((6, 10), jnp.float32, sharding=model(P("model", None))),   # 3, 10: none
        "plain": jax.ShapeDtypeStruct((12, 8), jnp.float32),                                     # no model axis
    }
    sh = zero_shardings(mesh2d, params, {}, stage=3)
    assert norm(sh.params["col"].spec) == ("data", "model")
    assert norm(sh.params["row"].spec) == (("model", "data"),)
    assert norm(sh.params["wide"].spec) == (None, ("model", "data"))
    assert norm(sh.params["odd"].spec) == ("model",)
    assert norm(sh.params["plain"].spec) == ("data",)  # 12 % 4 == 0 and 12 > 8
    # Shard shapes: the data axis (4) and the model axis (2) both divide their dims.
    assert sh.params["col"].shard_shape((8, 16)) == (2, 8)
    assert sh.params["row"].shard_shape((64, 12)) == (8, 12)
    assert sh.params["wide"].shard_shape((4, 64)) == (4, 8)
    # Stage 1 keeps the params' model axis and adds nothing.
    sh1 = zero_shardings(mesh2d, params, {}, stage=1)
    assert norm(sh1.params["col"].spec) == (None, "model")
    assert norm(sh1.params["plain"].spec) == ()


def test_existing_data_axis_is_the_stages_decision(mesh):
    """A tree already laid out for stage 3 (data axis in its shardings) planned again for stage 1 gets replicated
    params: the stage, not the input layout, decides the data axis."""
    x = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("data")))
    y = jax.ShapeDtypeStruct((8, 24), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))
    for stage in range(4):
        sh = zero_shardings(mesh, {"x": x, "y": y}, {}, stage=stage)
        if stage == 3:
            assert norm(sh.params["x"].spec) == ("data",)
            assert norm(sh.params["y"].spec) == (None, "data")  # re-decided: 24 is the largest
        else:
            assert norm(sh.params["x"].spec) == ()
            assert norm(sh.params["y"].spec) == ()


# ----------------------------------------------------------------------------------------------------------------
# Stages over whole trees, for several optimizers.

PARAM_SHAPES = {
    "embed": (64, 32),
    "dense": {"kernel": (24, 40), "bias": (40,)},
    "norm": (12,),          # not divisible: replicated at every stage
    "big": (256, 128),      # adafactor factors this one
    "scalar": (),
}


def make_params(abstract: bool):
    if abstract:
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), PARAM_SHAPES,
                            is_leaf=lambda x: isinstance(x, tuple))
    return jax.tree.map(lambda s: jnp.zeros(s, jnp.float32), PARAM_SHAPES, is_leaf=lambda x: isinstance(x, tuple))


OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-3),
    "lion": lambda: optax.lion(1e-4),
    "adafactor": lambda: optax.adafactor(1e-2),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("abstract", [False, True], ids=["arrays", "shapedtypestructs"])
def test_stage_layouts(mesh, name, stage, abstract):
    tx = OPTIMIZERS[name]()
    params = make_params(abstract)
    state = jax.eval_shape(tx.init, params)
    sh = zero_shardings(mesh, params, state, stage=stage)
    assert (sh.stage, sh.axis, sh.offload_optimizer) == (stage, "data", False)

    def check(tree, shardings, partitioned):
        leaves, structure = jax.tree.flatten(tree)
        shard_leaves, shard_structure = jax.tree.flatten(shardings)
        assert shard_structure == structure
        for leaf, s in zip(leaves, shard_leaves, strict=True):
            assert isinstance(s, NamedSharding) and s.mesh.shape_tuple == mesh.shape_tuple
            assert s.memory_kind == "device"
            want = expected_spec(leaf.shape) if partitioned else ()
            assert norm(s.spec) == want, (leaf.shape, s.spec)

    check(params, sh.params, stage >= 3)
    check(params, sh.grads, stage >= 2)
    check(state, sh.opt_state, stage >= 1)


def test_adam_state_layout_by_name(mesh):
    """Spelled out for adamw at stage 1: moments like the rule, count replicated, params and grads replicated."""
    params = make_params(abstract=True)
    state = jax.eval_shape(optax.adamw(1e-3).init, params)
    sh = zero_shardings(mesh, params, state, stage=1)
    adam = sh.opt_state[0]
    for moments in (adam.mu, adam.nu):
        assert norm(moments["embed"].spec) == ("data",)
        assert norm(moments["dense"]["kernel"].spec) == (None, "data")
        assert norm(moments["dense"]["bias"].spec) == ("data",)
        assert norm(moments["norm"].spec) == ()
        assert norm(moments["big"].spec) == ("data",)
        assert norm(moments["scalar"].spec) == ()
    assert norm(adam.count.spec) == ()
    assert all(norm(s.spec) == () for s in jax.tree.leaves(sh.params))
    assert all(norm(s.spec) == () for s in jax.tree.leaves(sh.grads))


def test_adafactor_factored_state(mesh):
    """Adafactor's factored row/column statistics ((128,), (256,)) are partitioned; its (1,) placeholders are
    replicated."""
    params = make_params(abstract=True)
    state = jax.eval_shape(optax.adafactor(1e-2).init, params)
    sh = zero_shardings(mesh, params, state, stage=1)
    factored = next(s for s in sh.opt_state if hasattr(s, "v_row"))
    factored_shapes = next(s for s in state if hasattr(s, "v_row"))
    # optax drops the largest dim for v_row and the other one for v_col.
    assert {factored_shapes.v_row["big"].shape, factored_shapes.v_col["big"].shape} == {(256,), (128,)}
    assert norm(factored.v_row["big"].spec) == ("data",)
    assert norm(factored.v_col["big"].spec) == ("data",)
    assert factored_shapes.v["big"].shape == (1,) and norm(factored.v["big"].spec) == ()
    assert factored_shapes.v["embed"].shape == (64, 32) and norm(factored.v["embed"].spec) == ("data",)


def test_real_init_follows_the_shardings(mesh):
    """jit(tx.init, out_shardings=...) places every state leaf as planned, on arrays of the right shard shape."""
    tx = optax.adamw(1e-3)
    params = make_params(abstract=False)
    sh = zero_shardings(mesh, params, jax.eval_shape(tx.init, params), stage=2)
    state = jax.jit(tx.init, out_shardings=sh.opt_state)(params)
    mu = state[0].mu
    assert mu["embed"].addressable_shards[0].data.shape == (8, 32)
    assert mu["dense"]["kernel"].addressable_shards[0].data.shape == (24, 5)
    assert mu["norm"].addressable_shards[0].data.shape == (12,)
    assert len({s.device for s in mu["embed"].addressable_shards}) == N


# ----------------------------------------------------------------------------------------------------------------
# Offload and errors.

def test_offload_puts_optimizer_state_in_pinned_host(mesh):
    tx = optax.adamw(1e-3)
    params = make_params(abstract=True)
    state = jax.eval_shape(tx.init, params)
    sh = zero_shardings(mesh, params, state, stage=1, offload_optimizer=True)
    assert sh.offload_optimizer
    assert {s.memory_kind for s in jax.tree.leaves(sh.opt_state)} == {"pinned_host"}
    assert {s.memory_kind for s in jax.tree.leaves(sh.params)} == {"device"}
    assert {s.memory_kind for s in jax.tree.leaves(sh.grads)} == {"device"}
    # Same partitioning as without offload.
    plain = zero_shardings(mesh, params, state, stage=1)
    assert [norm(s.spec) for s in jax.tree.leaves(sh.opt_state)] == [norm(s.spec) for s in jax.tree.leaves(
        plain.opt_state)]
    # And the memory kind is real: a state placed with these shardings lives in pinned_host.
    placed = jax.jit(tx.init, out_shardings=sh.opt_state)(make_params(abstract=False))
    assert {x.sharding.memory_kind for x in jax.tree.leaves(placed)} == {"pinned_host"}


class _Memory:
    def __init__(self, kind):
        self.kind = kind


def test_offload_error_when_backend_lacks_pinned_host(mesh, monkeypatch):
    """A backend whose devices expose no pinned_host memory: a clear error naming what there is."""
    device_type = type(mesh.devices.flat[0])
    monkeypatch.setattr(device_type, "addressable_memories", lambda self: [_Memory("device")])
    params = make_params(abstract=True)
    with pytest.raises(ValueError, match=r"pinned_host.*offer only \['device'\].*without offload"):
        zero_shardings(mesh, params, {}, stage=1, offload_optimizer=True)
    zero_shardings(mesh, params, {}, stage=1)  # without offload the same backend is fine


def test_offload_error_when_backend_has_no_memories_api(mesh, monkeypatch):
    def boom(self):
        raise NotImplementedError("no memories")

    monkeypatch.setattr(type(mesh.devices.flat[0]), "addressable_memories", boom)
    with pytest.raises(ValueError, match="does not report memory kinds"):
        zero_shardings(mesh, make_params(abstract=True), {}, stage=0, offload_optimizer=True)


@pytest.mark.parametrize("stage", [-1, 4, "2", 1.0, True, None])
def test_bad_stage(mesh, stage):
    with pytest.raises(ValueError, match="ZeRO stage must be one of"):
        zero_shardings(mesh, make_params(abstract=True), {}, stage=stage)


def test_numpy_integer_stage_is_accepted(mesh):
    assert zero_shardings(mesh, make_params(abstract=True), {}, stage=np.int64(2)).stage == 2


def test_unknown_axis(mesh):
    with pytest.raises(ValueError, match="no axis 'dp'"):
        zero_shardings(mesh, make_params(abstract=True), {}, stage=1, axis="dp")


def test_stage_table_is_cumulative():
    assert [sum(STAGES[s].values()) for s in range(4)] == [0, 1, 2, 3]
    assert [k for k in ("opt_state", "grads", "params") if STAGES[1][k]] == ["opt_state"]
    assert [k for k in ("opt_state", "grads", "params") if STAGES[2][k]] == ["opt_state", "grads"]


# ----------------------------------------------------------------------------------------------------------------
# Bytes per device.

def _np_bytes(shapes_and_dtypes, partitioned, n=N) -> int:
    total = 0
    for shape, dtype in shapes_and_dtypes:
        count = int(np.prod(shape, dtype=np.int64))
        if partitioned and expected_spec(shape, n):
            count //= n
        total += count * np.dtype(dtype).itemsize
    return total


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bytes_per_device_against_numpy(mesh, stage):
    params = {
        "a": jax.ShapeDtypeStruct((64, 32), jnp.bfloat16),
        "b": jax.ShapeDtypeStruct((24, 40), jnp.float32),
        "c": jax.ShapeDtypeStruct((12,), jnp.float32),
        "d": jax.ShapeDtypeStruct((), jnp.float32),
    }
    state = jax.eval_shape(optax.adamw(1e-3, mu_dtype=jnp.float32).init, params)
    sh = zero_shardings(mesh, params, state, stage=stage)
    p = [((64, 32), np.float16), ((24, 40), np.float32), ((12,), np.float32), ((), np.float32)]
    # Hand arithmetic: bf16 a = 4096 B, fp32 b = 3840 B, c = 48 B, d = 4 B.
    assert bytes_per_device(params, sh.params) == (
        4096 // 8 + 3840 // 8 + 48 + 4 if stage >= 3 else 4096 + 3840 + 48 + 4)
    assert bytes_per_device(params, sh.params) == _np_bytes(p, stage >= 3)
    assert bytes_per_device(params, sh.grads) == _np_bytes(p, stage >= 2)
    # adamw state: count (int32 scalar), mu (fp32: mu_dtype), nu (dtype of the params).
    s = [((), np.int32)] + [((64, 32), np.float32), ((24, 40), np.float32), ((12,), np.float32), ((), np.float32)]
    s += p
    assert bytes_per_device(state, sh.opt_state) == _np_bytes(s, stage >= 1)


def test_bytes_per_device_matches_addressable_shards(mesh):
    tx = optax.adamw(1e-3)
    params = make_params(abstract=False)
    sh = zero_shardings(mesh, params, jax.eval_shape(tx.init, params), stage=3)
    placed = jax.device_put(params, sh.params)
    state = jax.jit(tx.init, out_shardings=sh.opt_state)(params)
    for tree, shardings in ((placed, sh.params), (state, sh.opt_state)):
        per_device = {}
        for leaf in jax.tree.leaves(tree):
            for shard in leaf.addressable_shards:
                per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
        assert set(per_device.values()) == {bytes_per_device(tree, shardings)}
        assert len(per_device) == N


def test_module_exports():
    assert zero_mod.OFFLOAD_MEMORY_KIND == "pinned_host"
