import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jonebit import OneBitAdamState, onebit_adam
from jonebit.comm import compressed_bytes_per_rank
from jonebit.comm.accounting import comm_report
from jonebit.train.data_parallel import data_mesh, init_optimizer, make_update, replicate, shard_batch
from tests.reference import np_padded


def compiled_text(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def test_psum_and_all_gather_bytes_follow_ring_formulas():
    mesh = data_mesh(8)
    x = shard_batch(jnp.ones(8000), mesh)

    def f(x):
        return lax.psum(x, "data"), lax.all_gather(x, "data", tiled=True)

    body = jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=(P("data"), P("data")))
    report = comm_report(compiled_text(body, x), 8)
    ops = sorted((c.op, c.result_bytes, c.group_size) for c in report.always)
    assert ops == [("all-gather", 32000, 8), ("all-reduce", 4000, 8)]
    assert report.always_bytes == 2 * 7 / 8 * 4000 + 7 / 8 * 32000


def test_group_size_from_a_sub_axis():
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    x = jax.device_put(jnp.ones((2, 4, 100)), jax.NamedSharding(mesh, P("a", "b")))
    body = jax.shard_map(lambda x: lax.psum(x, "b"), mesh=mesh, in_specs=P("a", "b"), out_specs=P("a", "b"))
    (c,) = comm_report(compiled_text(body, x), 8).always
    assert (c.op, c.group_size, c.result_bytes) == ("all-reduce", 4, 400)
    assert c.bytes_sent == 2 * 3 / 4 * 400


def test_onebit_adam_stage_bytes_match_the_spec_formula():
    mesh = data_mesh(8)
    params = replicate({"w": np.zeros((37, 29), np.float32), "b": np.zeros(11, np.float32)}, mesh)
    n = 37 * 29 + 11
    tx = onebit_adam(1e-3, freeze_step=5, fused=True)  # one buffer: the spec's formula for one allreduce
    state, specs = init_optimizer(tx, params, mesh)
    grads = shard_batch({"w": np.zeros((8, 37, 29), np.float32), "b": np.zeros((8, 11), np.float32)}, mesh)
    hlo = make_update(tx, mesh, specs).lower(params, state, grads).compile().as_text()
    report = comm_report(hlo, 8)
    # Nothing outside the phases' branches.
    assert report.always == ()
    warmup, compression = report.branches[0]
    assert sorted(c.op for c in compression) == ["all-gather", "all-to-all"]  # no full-precision all-reduce
    assert all(c.op == "all-reduce" for c in warmup)
    sent = report.phase_bytes(OneBitAdamState.PHASES)
    assert sent["compression"] == compressed_bytes_per_rank(n, 8)
    # The spec's count written out: each rank holds P rows of C/8 sign bytes + a 4-byte float32 scale
    # (C = N_pad / P) and sends P - 1 of them in the all-to-all, then its own row to P - 1 ranks in the all-gather.
    p, row = 8, np_padded(n, 8) // 8 // 8 + 4
    assert sent["compression"] == 2 * (p - 1) * row
    # Only bytes cross the wire: both collectives move uint8 rows (P, C/8 + 4), read from the HLO (the CPU
    # all-to-all is variadic, one u8[1, C/8 + 4] operand per rank).
    for c in compression:
        assert c.dtypes and set(c.dtypes) == {"u8"}, c
        assert c.result_bytes == p * row
    assert sent["warmup"] == 2 * 7 / 8 * 4 * n
    assert all(c.dtypes and set(c.dtypes) == {"f32"} for c in warmup)  # full-precision gradients


def test_adamw_with_mean_allreduce():
    mesh = data_mesh(4)
    params = replicate({"w": np.zeros(1000, np.float32)}, mesh)
    tx = optax.adamw(1e-3)
    state, specs = init_optimizer(tx, params, mesh)
    grads = shard_batch({"w": np.zeros((4, 1000), np.float32)}, mesh)
    hlo = make_update(tx, mesh, specs, grad_reduce="mean").lower(params, state, grads).compile().as_text()
    assert comm_report(hlo, 4).always_bytes == 2 * 3 / 4 * 4000


# Hand-written HLO in the syntax XLA prints for GPU programs (async pairs, tuple results, wrapped async ops,
# loops with and without a known trip count). Each module is complete: ENTRY plus the computations it calls.
_ADD = """\
%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(f32[] %x, f32[] %y)
}
"""


def _module(entry_body: str, *computations: str) -> str:
    return "HloModule m, is_scheduled=true\n\n" + _ADD + "\n".join(computations) + (
        "\nENTRY %main (p: f32[8]) -> f32[64] {\n" + entry_body + "}\n")


def test_async_all_gather_counts_the_result_once():
    hlo = _module("""\
  %p = f32[8]{0} parameter(0)
  %all-gather-start = (f32[8]{0}, f32[64]{0}) all-gather-start(f32[8]{0} %p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  ROOT %all-gather-done = f32[64]{0} all-gather-done((f32[8]{0}, f32[64]{0}) %all-gather-start)
""")  # noqa: E501
    (c,) = comm_report(hlo, 8).always
    # The start's tuple is (operand, result): 32 + 256 bytes, of which only the 256-byte result is gathered.
    assert (c.op, c.result_bytes, c.group_size, c.dtypes) == ("all-gather", 256, 8, ("f32",))
    assert comm_report(hlo, 8).always_bytes == 7 / 8 * 256


def test_async_all_reduce_and_variadic_start():
    hlo = _module("""\
  %p = f32[8]{0} parameter(0)
  %b = bf16[6]{0} parameter(1)
  %all-reduce-start = f32[1000]{0} all-reduce-start(f32[1000]{0} %q), channel_id=2, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add, backend_config={"collective_backend_config":{"is_sync":false}}
  %all-reduce-done = f32[1000]{0} all-reduce-done(f32[1000]{0} %all-reduce-start)
  %all-reduce-start.1 = (f32[10]{0}, bf16[6]{0}) all-reduce-start(f32[10]{0} %r, bf16[6]{0} %b), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %all-reduce-done.1 = (f32[10]{0}, bf16[6]{0}) all-reduce-done((f32[10]{0}, bf16[6]{0}) %all-reduce-start.1)
  ROOT %out = f32[64]{0} broadcast(f32[] %s), dimensions={}
""")  # noqa: E501
    a, b = comm_report(hlo, 8).always
    assert (a.op, a.result_bytes, a.group_size) == ("all-reduce", 4000, 4)
    assert (b.op, b.result_bytes, b.group_size, b.dtypes) == ("all-reduce", 40 + 12, 8, ("f32", "bf16"))
    assert comm_report(hlo, 8).always_bytes == 2 * 3 / 4 * 4000 + 2 * 7 / 8 * 52


def test_async_collective_permute_reduce_scatter_and_all_to_all():
    wrapped = """\
%wrapped_all_to_all (param: u8[8,12]) -> u8[8,12] {
  %param = u8[8,12]{1,0} parameter(0)
  ROOT %all-to-all.1 = u8[8,12]{1,0} all-to-all(u8[8,12]{1,0} %param), channel_id=7, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}
"""  # noqa: E501
    hlo = _module("""\
  %p = f32[8]{0} parameter(0)
  %collective-permute-start = (f32[16]{0}, f32[16]{0}, u32[], u32[]) collective-permute-start(f32[16]{0} %x), channel_id=4, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %collective-permute-done = f32[16]{0} collective-permute-done((f32[16]{0}, f32[16]{0}, u32[], u32[]) %collective-permute-start)
  %reduce-scatter-start = ((f32[64]{0}), f32[8]{0}) reduce-scatter-start(f32[64]{0} %y), channel_id=5, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
  %reduce-scatter-done = f32[8]{0} reduce-scatter-done(((f32[64]{0}), f32[8]{0}) %reduce-scatter-start)
  %all-to-all-start = ((u8[8,12]{1,0}, u8[8,12]{1,0}), (u8[8,12]{1,0}, u8[8,12]{1,0})) all-to-all-start(u8[8,12]{1,0} %z, u8[8,12]{1,0} %w), channel_id=6, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %all-to-all-done = (u8[8,12]{1,0}, u8[8,12]{1,0}) all-to-all-done(((u8[8,12]{1,0}, u8[8,12]{1,0}), (u8[8,12]{1,0}, u8[8,12]{1,0})) %all-to-all-start)
  %async-start = ((u8[8,12]{1,0}), u8[8,12]{1,0}, s32[]) async-start(u8[8,12]{1,0} %v), calls=%wrapped_all_to_all
  %async-update = ((u8[8,12]{1,0}), u8[8,12]{1,0}, s32[]) async-update(((u8[8,12]{1,0}), u8[8,12]{1,0}, s32[]) %async-start), calls=%wrapped_all_to_all
  %async-done = u8[8,12]{1,0} async-done(((u8[8,12]{1,0}), u8[8,12]{1,0}, s32[]) %async-update), calls=%wrapped_all_to_all
  ROOT %out = f32[64]{0} broadcast(f32[] %s), dimensions={}
""", wrapped)  # noqa: E501
    got = [(c.op, c.result_bytes, c.group_size, c.dtypes) for c in comm_report(hlo, 8).always]
    assert got == [
        ("collective-permute", 64, 8, ("f32",)),  # the second tuple element; the u32[] contexts are no traffic
        ("reduce-scatter", 32, 8, ("f32",)),
        ("all-to-all", 2 * 96, 8, ("u8", "u8")),  # variadic: both results
        ("all-to-all", 96, 8, ("u8",)),  # generic async wrapper: once, not once per start/update/done
    ]
    assert comm_report(hlo, 8).always_bytes == 64 + 7 * 32 + 7 / 8 * 192 + 7 / 8 * 96


def test_sync_tuple_result_is_summed():
    hlo = _module("""\
  %p = f32[8]{0} parameter(0)
  %all-to-all = (u8[12]{0}, u8[12]{0}, u8[12]{0}, u8[12]{0}) all-to-all(u8[12]{0} %a, u8[12]{0} %b, u8[12]{0} %c, u8[12]{0} %d), channel_id=1, replica_groups={{0,1,2,3}}
  ROOT %all-reduce = (f32[64]{0}, s32[3]{0}) all-reduce(f32[64]{0} %p2, s32[3]{0} %i), channel_id=2, replica_groups={{0,1,2,3}}, to_apply=%add
""")  # noqa: E501
    a, b = comm_report(hlo, 4).always
    assert (a.result_bytes, a.dtypes) == (48, ("u8",) * 4)
    assert (b.result_bytes, b.dtypes) == (256 + 12, ("f32", "s32"))


_LOOP = """\
%cond{n} (c: (s32[], f32[100])) -> pred[] {{
  %c = (s32[], f32[100]{{0}}) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[100]{{0}}) %c), index=0
  %k = s32[] constant(5)
  ROOT %lt = pred[] compare(s32[] %i, s32[] %k), direction=LT
}}
%body{n} (b: (s32[], f32[100])) -> (s32[], f32[100]) {{
  %b = (s32[], f32[100]{{0}}) parameter(0)
  %v = f32[100]{{0}} get-tuple-element((s32[], f32[100]{{0}}) %b), index=1
  %j = s32[] get-tuple-element((s32[], f32[100]{{0}}) %b), index=0
  %all-reduce-start = f32[100]{{0}} all-reduce-start(f32[100]{{0}} %v), channel_id=1, replica_groups={{{{0,1,2,3,4,5,6,7}}}}, to_apply=%add
  %all-reduce-done = f32[100]{{0}} all-reduce-done(f32[100]{{0}} %all-reduce-start)
  {inner}
  ROOT %t = (s32[], f32[100]{{0}}) tuple(s32[] %j, f32[100]{{0}} %all-reduce-done)
}}
"""  # noqa: E501


def _while(name: str, n: int | None, body: str = "body", cond: str = "cond") -> str:
    config = ("" if n is None else
              f', backend_config={{"known_trip_count":{{"n":"{n}"}},"known_init_step":{{"init":"0","step":"1"}}}}')
    return (f"%{name} = (s32[], f32[100]{{0}}) while((s32[], f32[100]{{0}}) %init), "
            f"condition=%{cond}, body=%{body}{config}")


def test_while_body_multiplied_by_known_trip_count():
    hlo = _module(f"  %p = f32[8]{{0}} parameter(0)\n  {_while('while', 5)}\n", _LOOP.format(n="", inner=""))
    (c,) = comm_report(hlo, 8).always
    assert (c.op, c.trips, c.computation) == ("all-reduce", 5, "body")
    assert comm_report(hlo, 8).always_bytes == 5 * 2 * 7 / 8 * 400


def test_nested_loops_multiply():
    outer = _LOOP.format(n="_outer", inner=_while("inner", 3, body="body", cond="cond"))
    hlo = _module(f"  %p = f32[8]{{0}} parameter(0)\n  {_while('w', 4, body='body_outer', cond='cond_outer')}\n",
                  _LOOP.format(n="", inner=""), outer)
    trips = sorted((c.computation, c.trips) for c in comm_report(hlo, 8).always)
    assert trips == [("body", 12), ("body_outer", 4)]
    assert comm_report(hlo, 8).always_bytes == (12 + 4) * 2 * 7 / 8 * 400


def test_unknown_trip_count_is_an_error_not_a_guess():
    hlo = _module(f"  %p = f32[8]{{0}} parameter(0)\n  {_while('while', None)}\n", _LOOP.format(n="", inner=""))
    report = comm_report(hlo, 8)
    (c,) = report.always
    assert c.trips is None and c.bytes_sent == 2 * 7 / 8 * 400
    with pytest.raises(ValueError, match=r"all-reduce in computation 'body' is inside a while loop whose trip count"):
        _ = report.always_bytes


def test_predicate_conditional_branches_are_kept_apart():
    branch = """\
%{name} (a: f32[8]) -> f32[64] {{
  %a = f32[8]{{0}} parameter(0)
  ROOT %g = f32[64]{{0}} all-gather(f32[8]{{0}} %a), channel_id=1, replica_groups={{{{0,1,2,3,4,5,6,7}}}}, dimensions={{0}}
}}
"""  # noqa: E501
    hlo = _module("""\
  %p = f32[8]{0} parameter(0)
  %pred = pred[] parameter(1)
  ROOT %conditional = f32[64]{0} conditional(pred[] %pred, f32[8]{0} %p, f32[8]{0} %p), true_computation=%on_true, false_computation=%on_false
""", branch.format(name="on_true"),  # noqa: E501
                  branch.format(name="on_false").replace("f32[64]{0} all-gather", "f32[64]{0} copy"))
    report = comm_report(hlo, 8)
    assert report.always == ()
    assert [len(b) for b in report.branches[0]] == [1, 0]
    assert report.branch_bytes(0) == 7 / 8 * 256 and report.branch_bytes(1) == 0


def test_compiled_fori_loop_counts_every_iteration():
    """On a real compiled program (CPU): XLA records the trip count of a fori_loop and each psum is counted."""
    mesh = data_mesh(8)
    x = shard_batch(jnp.ones(800), mesh)

    def body(x, n):
        return lax.fori_loop(0, n, lambda i, c: c + lax.psum(c, "data"), x)

    fixed = jax.shard_map(lambda x: body(x, 5), mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    report = comm_report(compiled_text(fixed, x), 8)
    assert [(c.op, c.trips) for c in report.always] == [("all-reduce", 5)]
    assert report.always_bytes == 5 * 2 * 7 / 8 * 400
    n = shard_batch(jnp.full(8, 3, jnp.int32), mesh)
    dynamic = jax.shard_map(lambda x, n: body(x, n[0]), mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    with pytest.raises(ValueError, match="trip count"):
        _ = comm_report(compiled_text(dynamic, x, n), 8).always_bytes
