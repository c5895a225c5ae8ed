"""Every ```python block of README.md and of the guides in docs/*.md runs, in order, as written.

Each file runs in its own namespace, which its blocks share, like a reader who types one page's blocks into one
session. What a page leaves to the reader (a model's ``params``, its ``loss_fn``, the ``batches``) comes from a
small prelude defined here, chosen by what the block uses:

* the data-parallel and ZeRO blocks get a linear regression: ``params`` (a dict of two arrays), ``loss_fn``
  (mean squared error of the local batch) and ``batches`` (3 global batches of 16 rows);
* the BERT block (the one calling ``load_hf_checkpoint``) runs in a directory holding a tiny HuggingFace
  checkpoint at ``path/to/bert`` (written by ``save_hf_checkpoint``) and gets ``batches`` of SQuAD-shaped
  features (``input_ids``, ``attention_mask``, ``token_type_ids``, ``start_positions``, ``end_positions``);
* blocks that use MPI (``mpi4py``) run under ``mpirun -np 2`` in their own processes and then take a few
  1-bit Adam steps with the optimizer the block built (skipped when the MPI stack is missing).

Blocks that are not meant to run (signatures, directory listings, shell commands) use another fence language.
A block that raises fails the test. After a block that loops ``step`` over ``batches`` the loss must be finite and
the parameters must have moved; a block that only builds ``step = ...`` gets the same check after running it over
``batches``; a block that defines its own ``def step`` is run once and must give exactly what
``jonebit.train.data_parallel.make_step`` gives.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.mpi_util import ROOT, run_mpi

README = ROOT / "README.md"
GUIDES = sorted((ROOT / "docs").glob("*.md"))  # the guides; docs/benchmarks/ only includes benchmarks/*.md
PAGES = [README, *GUIDES]
FENCE = re.compile(r"^```(\{[\w-]+\}|\w*)[^\n]*\n(.*?)^```", re.S | re.M)  # ```lang or a MyST ```{directive}


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line number, code)`` of every ```python block, in order."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE.finditer(text) if m.group(1) == "python"]


def uses_mpi(code: str) -> bool:
    return "mpi4py" in code


def regression_prelude(ns: dict) -> None:
    """A linear model y = x @ w + b with its loss and 3 global batches (16 rows: 2 per simulated device)."""
    rng = np.random.default_rng(0)
    w_true = rng.normal(size=(4, 1)).astype(np.float32)

    def loss_fn(params, batch):
        pred = batch["x"] @ params["w"] + params["b"]
        return jnp.mean((pred - batch["y"]) ** 2)

    def batch():
        x = rng.normal(size=(16, 4)).astype(np.float32)
        return {"x": x, "y": x @ w_true + 0.5}

    ns.update(params={"w": jnp.zeros((4, 1)), "b": jnp.zeros((1,))}, loss_fn=loss_fn,
              batches=[batch() for _ in range(3)])


def bert_prelude(ns: dict, where: pathlib.Path):
    """A tiny QA checkpoint at ``where/path/to/bert`` and 2 global batches of 8 sequences of 32 tokens.

    Returns the checkpoint's parameters (an ``nnx.State``).
    """
    from flax import nnx

    from jonebit.models.bert import BertConfig, BertForQuestionAnswering, save_hf_checkpoint

    config = BertConfig.preset("tiny", vocab_size=512)
    model = BertForQuestionAnswering(config, rngs=nnx.Rngs(0))
    save_hf_checkpoint(model, where / "path" / "to" / "bert")
    rng = np.random.default_rng(1)

    def batch(b=8, s=32):
        starts = rng.integers(1, s - 4, b)
        return {
            "input_ids": rng.integers(5, config.vocab_size, (b, s)).astype(np.int32),
            "attention_mask": np.ones((b, s), np.int32),
            "token_type_ids": (np.arange(s)[None] >= s // 2).repeat(b, 0).astype(np.int32),
            "start_positions": starts.astype(np.int32),
            "end_positions": (starts + 3).astype(np.int32),
        }

    ns["batches"] = [batch() for _ in range(2)]
    return nnx.split(model, nnx.Param, ...)[1]  # the parameters the BERT block starts from


def check_trained(ns: dict, before, line: int) -> None:
    """After a block that loops ``step`` over ``batches``: finite loss, parameters moved."""
    assert np.isfinite(float(ns["loss"])), f"block at line {line}: loss {ns['loss']}"
    moved = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - b))), ns["params"], before)
    assert max(jax.tree.leaves(moved)) > 0, f"block at line {line} did not change the parameters"


def run_built_step(ns: dict, before, line: int) -> None:
    """A block that builds ``step`` without running it: run it over the prelude's ``batches``."""
    from jonebit.train.data_parallel import shard_batch

    for batch in ns["batches"]:
        ns["params"], ns["opt_state"], ns["loss"] = ns["step"](ns["params"], ns["opt_state"],
                                                               shard_batch(batch, ns["mesh"]))
    check_trained(ns, before, line)


def run_defined_step(ns: dict, line: int) -> None:
    """A block that only defines ``step``: run it on the first batch; it must match ``make_step``'s step."""
    from jonebit.train.data_parallel import make_step, shard_batch

    mesh, tx, specs = ns["mesh"], ns["tx"], ns["specs"]
    params = ns["params"]
    opt_state = ns["opt_state"]
    batch = shard_batch(ns["batches"][0], mesh)
    library = make_step(ns["loss_fn"], tx, mesh, specs, donate=False)
    want_params, _, want_loss = library(params, opt_state, batch)
    got_params, _, got_loss = ns["step"](params, opt_state, batch)
    np.testing.assert_array_equal(np.asarray(got_loss), np.asarray(want_loss), err_msg=f"line {line}")
    for got, want in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"line {line}")


def name(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


def test_readme_has_python_blocks():
    assert len(python_blocks(README.read_text())) >= 3
    assert sum(len(python_blocks(p.read_text())) for p in GUIDES) >= 5, "the guides' examples moved out of docs/?"


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_every_fence_has_a_language(page):
    # An unlabelled fence would silently escape the tests below.
    labels = [m.group(1) for m in FENCE.finditer(page.read_text())]
    assert "" not in labels, f"{name(page)} has a ``` block without a language; use ```python, ```bash or ```text"


def run_page(page: pathlib.Path, tmp_path: pathlib.Path) -> int:
    """Runs the page's non-MPI python blocks in one namespace; returns how many ran."""
    ns: dict = {"__name__": "readme"}
    where = name(page)
    ran = 0
    for line, code in python_blocks(page.read_text()):
        if uses_mpi(code):
            continue  # test_mpi_blocks_run
        if "load_hf_checkpoint" in code:
            before = bert_prelude(ns, tmp_path)
        else:
            if "params" in code and "params" not in ns:
                regression_prelude(ns)
            before = ns.get("params")
        before = jax.tree.map(np.array, before)  # a copy: the blocks' steps donate their inputs
        try:
            exec(compile(code, f"{where}:{line}", "exec"), ns)  # noqa: S102 - executing the docs is the test
        except Exception as e:
            raise AssertionError(f"{where} python block at line {line} raised {type(e).__name__}: {e}") from e
        ran += 1
        if re.search(r"^for batch in batches:", code, re.M):
            check_trained(ns, before, line)
        elif re.search(r"^def step\(", code, re.M):
            run_defined_step(ns, line)
        elif re.search(r"^step = ", code, re.M):
            run_built_step(ns, before, line)
        elif "jonebit.nnx.make_train_step(" in code:
            # y = sum of 8 standard normals: an untrained model's loss is about 8-10.
            assert float(ns["loss"]) < 1.0, f"{where}:{line}: the NNX block did not train (loss {ns['loss']})"
    return ran


RUNNABLE = [p for p in PAGES if any(not uses_mpi(code) for _, code in python_blocks(p.read_text()))]


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE, ids=name)
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the BERT block reads "path/to/bert" relative to here
    assert run_page(page, tmp_path) >= 1


MPI_EPILOGUE = textwrap.dedent(
    """
    # Appended by tests/test_readme.py: three steps with the optimizer the block built.
    import json, sys
    import jax, jax.numpy as jnp, numpy as np, optax
    rank = MPI.COMM_WORLD.Get_rank()
    params = {"w": jnp.zeros((64,)), "b": jnp.zeros((3,))}
    state = tx.init(params)
    rng = np.random.default_rng(rank)
    for _ in range(3):
        grads = {"w": jnp.asarray(rng.normal(size=64), jnp.float32), "b": jnp.asarray(rng.normal(size=3), jnp.float32)}
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    out = {k: np.asarray(v).tolist() for k, v in params.items()}
    pathlib.Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(out))
    """
)


@pytest.mark.mpi
@pytest.mark.slow
def test_mpi_blocks_run(tmp_path):
    blocks = [(name(page), line, code) for page in PAGES for line, code in python_blocks(page.read_text())
              if uses_mpi(code)]
    assert blocks, "the docs show the MPI path: its block should be tested"
    for where, line, code in blocks:
        script = tmp_path / f"block_{line}.py"
        script.write_text("import pathlib\n" + code + MPI_EPILOGUE)
        run_mpi(2, script, str(tmp_path), timeout=300)
        ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
        # Each rank fed different gradients; the optimizer keeps the parameters identical on both.
        assert ranks[0] == ranks[1], f"{where}:{line}: ranks disagree"
        assert any(v != 0 for v in ranks[0]["w"]), f"{where}:{line}: parameters did not move"
        os.remove(tmp_path / "rank0.json")
        os.remove(tmp_path / "rank1.json")
