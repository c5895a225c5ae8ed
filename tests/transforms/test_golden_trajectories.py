"""Every optimizer of the 1-bit family computes exactly what it computed when the recording was made.

The recording (``golden_trajectories.npz``, see :mod:`tests.transforms.golden_trajectories`) holds each case's
parameters after each of 12 steps and its final state. A replay runs the same program on the same inputs, so it
must match bit for bit: there is no tolerance to derive, any difference is a change of arithmetic. The trajectories
cross the freeze (step 4), a variance refresh, the automatic freeze rule, a NaN skipped on one rank, 0/1 Adam's
local steps and every ZeRO stage of the 1-bit Adam variant.
"""

import numpy as np
import pytest

from tests.transforms.golden_trajectories import CASES, FREEZE, NAN_STEP, STEPS, recorded, run


@pytest.mark.parametrize("name", list(CASES))
def test_replay_is_bit_identical(name):
    want = recorded(name)
    got = run(name)
    assert sorted(got) == sorted(want), f"{name}: the state's fields changed: {sorted(set(got) ^ set(want))}"
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=f"{name}: {key}")


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
