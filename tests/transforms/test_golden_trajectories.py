"""Every optimizer of the 1-bit family computes exactly what it computed when the recording was made.

The recording (``golden_trajectories.npz``, see :mod:`tests.transforms.golden_trajectories`) holds each case's
parameters after each of 12 steps and its final state. The replay runs in its own process with the recording's
XLA flags (code generation capped at SSE4.2, where no fused multiply-add can round differently between two ways of
writing the same arithmetic), so it must match bit for bit: there is no tolerance to derive, any difference is a
change of arithmetic. The trajectories cross the freeze (step 4), a variance refresh, the automatic freeze rule, a
NaN skipped on one rank, 0/1 Adam's local steps and every ZeRO stage of the 1-bit Adam variant.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.mpi_util import ROOT
from tests.transforms.golden_trajectories import CASES, FREEZE, NAN_STEP, STEPS, XLA_FLAGS, recorded, share

SHARES = 2  # each form's cases in two processes, so that no one test holds the whole replay


@pytest.mark.parametrize("part", range(SHARES), ids=lambda k: f"{k + 1}of{SHARES}")
@pytest.mark.parametrize("form", ["one_program", "per_phase"])
def test_replay_is_bit_identical(form, part):
    """Both forms of every optimizer: the transformation's one program with every phase (a user's own jit), and a
    program per phase picked on the host (jonebit's step builders) replay the recording bit for bit."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": XLA_FLAGS}
    argv = ["check", f"{part}/{SHARES}"] if form == "one_program" else ["check", "per_phase", f"{part}/{SHARES}"]
    out = subprocess.run([sys.executable, "-m", "tests.transforms.golden_trajectories", *argv], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["cases"] == share(part, SHARES)
    assert result["mismatches"] == [], "(case, array, elements that differ; -1: only on one side)"


def test_the_shares_hold_every_case_once():
    assert sorted(c for k in range(SHARES) for c in share(k, SHARES)) == sorted(CASES)
    with pytest.raises(ValueError, match=r"share 2/2: the share must be 0 to 1"):
        share(SHARES, SHARES)


def test_recording_exercises_what_it_claims():
    """The options and events of the recording change the trajectory where they should, so a replay that matched
    would fail if an option stopped having an effect."""
    default = recorded("onebit_adam/default")["params"]
    assert default.shape[0] == STEPS and np.all(np.isfinite(default))

    def first_difference(name):
        other = recorded(name)["params"]
        differs = np.any(other != default, axis=1)
        return int(np.argmax(differs)) if differs.any() else None

    # Options that act only from the first compression step (update FREEZE + 1, row FREEZE) on.
    for name in ("hierarchical", "row_scales", "preconditioned_clip_ratio"):
        assert first_difference(f"onebit_adam/{name}") == FREEZE, name
    assert first_difference("onebit_adam/no_error_feedback") == FREEZE + 1  # errors are first used on the 2nd
    assert first_difference("onebit_adam/nonfinite_skip") == NAN_STEP
    skipped = recorded("onebit_adam/nonfinite_skip")
    assert int(skipped["state/count"]) == STEPS - 1
    np.testing.assert_array_equal(skipped["params"][NAN_STEP], skipped["params"][NAN_STEP - 1])
    assert int(recorded("onebit_adam/auto_freeze")["state/freeze_at"]) < FREEZE  # the rule fired early
