"""Every test process sees 8 simulated CPU devices; set before jax is imported anywhere."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import pathlib  # noqa: E402

import pytest  # noqa: E402

SHARED = pathlib.Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture(scope="session")
def shared_data():
    """Path of ../shared/data (SQuAD, vocab, corpora); tests that need it skip cleanly when it is absent."""
    path = SHARED / "data"
    if not path.is_dir():
        pytest.skip("../shared/data not present")
    return path
