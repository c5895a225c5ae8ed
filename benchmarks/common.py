"""Shared pieces of the benchmark scripts: parameter-tree shapes, abstract optimizer states, output."""

from __future__ import annotations

import json
import os
import pathlib
import platform

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from report import RESULTS, result_path, run_meta, table  # noqa: E402, F401  (re-exported for the scripts)

from jonebit.transforms.onebit_adam import state_specs  # noqa: E402


def bert_base_shapes(vocab: int = 30522, hidden: int = 768, layers: int = 12, positions: int = 512) -> dict:
    """Parameter shapes of BERT-base (encoder + pooler, ~110M parameters)."""
    ff = 4 * hidden
    tree = {
        "embeddings": {"word": (vocab, hidden), "position": (positions, hidden), "type": (2, hidden),
                       "ln_scale": (hidden,), "ln_bias": (hidden,)},
        "pooler": {"kernel": (hidden, hidden), "bias": (hidden,)},
    }
    for i in range(layers):
        tree[f"layer_{i:02d}"] = {
            **{f"{n}_kernel": (hidden, hidden) for n in "qkvo"},
            **{f"{n}_bias": (hidden,) for n in "qkvo"},
            "ln1_scale": (hidden,), "ln1_bias": (hidden,), "ln2_scale": (hidden,), "ln2_bias": (hidden,),
            "ff1_kernel": (hidden, ff), "ff1_bias": (ff,), "ff2_kernel": (ff, hidden), "ff2_bias": (hidden,),
        }
    return tree


def mlp_shapes(total: int, width: int = 1000) -> dict:
    """A stack of square-ish layers with about ``total`` parameters."""
    layers = max(1, total // (width * width + width))
    return {f"layer_{i:02d}": {"kernel": (width, width), "bias": (width,)} for i in range(layers)}


def count(shapes) -> int:
    return sum(int(np.prod(s)) for s in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple)))


def abstract(shapes, mesh, spec=None, lead: int | None = None):
    """ShapeDtypeStructs (float32) with a NamedSharding (default replicated); ``lead`` prepends a per-rank axis."""
    sharding = jax.NamedSharding(mesh, P() if spec is None else spec)
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(((lead,) if lead else ()) + tuple(s), np.float32, sharding=sharding),
        shapes, is_leaf=lambda x: isinstance(x, tuple),
    )


def abstract_state(tx, params, mesh, axis: str = "data"):
    """(global optimizer-state structs, specs) without allocating anything."""
    local = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False), params)
    specs = state_specs(local, axis)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
    return jax.eval_shape(init, params), specs


def write_json(script: str, payload: dict, tag: str = "") -> pathlib.Path:
    """Writes ``payload`` to ``results/<script>/<tag or script>.json`` with a ``meta`` block (command line, git
    commit, UTC date; see ``report.run_meta``) and a ``machine`` block in front; returns the path."""
    path = result_path(script, tag)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"meta": run_meta(), "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                               "jax": jax.__version__, "backend": jax.default_backend(),
                                               "devices": jax.device_count()}, **payload}
    path.write_text(json.dumps(payload, indent=2))
    return path
