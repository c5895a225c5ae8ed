"""Bytes per rank of each phase of 0/1 Adam and 1-bit LAMB, read from the compiled step (jonebit.comm.accounting).

Expected values are the spec's formulas: a ring allreduce of N float32 sends ``2 (P-1)/P 4 N`` bytes per rank, a
compressed allreduce ``2 (P-1)/P N_pad/8 + 8 (P-1)`` (two sign exchanges plus the scales).
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jonebit
from jonebit.comm.accounting import comm_report
from tests.reference import np_padded
from tests.transforms.family_util import mesh_of, per_rank_stepper, replicated_stepper

PARAMS = {"w": jnp.zeros((300, 100)), "b": jnp.zeros(1000)}  # N = 31000


def fp32_allreduce(n, p):
    return 2 * (p - 1) / p * 4 * n


def onebit(n, p):
    return 2 * (p - 1) / p * np_padded(n, p) / 8 + 8 * (p - 1)


def report(tx, p, per_rank_params):
    mesh = mesh_of(p)
    state, specs = jonebit.sharded_init(tx, PARAMS, mesh)
    step = (per_rank_stepper if per_rank_params else replicated_stepper)(tx, mesh, specs)

    def abstract(tree, spec, rows):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(((p,) if rows else ()) + x.shape, x.dtype,
                                                           sharding=jax.NamedSharding(mesh, spec)), tree)

    params = abstract(PARAMS, P("data"), True) if per_rank_params else abstract(PARAMS, P(), False)
    hlo = step.lower(params, state, abstract(PARAMS, P("data"), True)).compile().as_text()
    r = comm_report(hlo, p)
    assert not r.always and len(r.branches) == 1  # everything sits in the one stage switch
    return r


def by_op(collectives):
    out = {}
    for c in collectives:
        out[c.op] = out.get(c.op, 0.0) + c.total_bytes_sent
    return out


@pytest.mark.parametrize("p", [2, 8])
@pytest.mark.parametrize("fused", [True, False])
def test_zero_one_adam_bytes_per_phase(p, fused):
    n = 31000
    r = report(jonebit.zero_one_adam(1e-3, fused=fused), p, True)
    assert jonebit.ZeroOneAdamState.PHASES == ("variance_freezing", "local_steps")  # the branches, in order
    variance_phase, local_phase = (by_op(b) for b in r.branches[0])
    onebit_bytes = onebit(n, p) if fused else onebit(30000, p) + onebit(1000, p)
    # First phase: a variance step is one float32 allreduce; any other step one compressed allreduce.
    assert variance_phase.pop("all-reduce") == pytest.approx(fp32_allreduce(n, p))
    assert sum(variance_phase.values()) == pytest.approx(onebit_bytes)
    # Local phase: a sync step is one compressed allreduce of u; a local step sends nothing (no other collective).
    assert set(local_phase) == {"all-to-all", "all-gather"}
    assert sum(local_phase.values()) == pytest.approx(onebit_bytes)


@pytest.mark.parametrize("p", [2, 8])
def test_onebit_lamb_bytes_per_phase(p):
    r = report(jonebit.onebit_lamb(1e-3, freeze_step=3), p, False)
    assert jonebit.OneBitLambState.PHASES == ("warmup", "compression")  # the branches, in order
    warmup, compression = (by_op(b) for b in r.branches[0])
    assert warmup == {"all-reduce": pytest.approx(fp32_allreduce(31000, p))}
    # One compressed allreduce of the fused buffer (momenta plus tail) for the whole model.
    assert sum(compression.values()) == pytest.approx(onebit(31000, p))
    assert onebit(31000, p) < fp32_allreduce(31000, p) / 25
