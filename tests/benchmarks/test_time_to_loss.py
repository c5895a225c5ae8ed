"""The time-to-loss study's arithmetic: the arms' configs differ only in the optimizer, and the time at which a
curve reaches a loss is read by linear interpolation between evaluations (by hand-computed cases)."""

import pytest

from benchmarks.cluster.time_to_loss import arm_configs, time_to_loss


def test_arms_share_everything_but_the_optimizer():
    cfgs = arm_configs(600, 64, 1e-3, 0.2)
    adam, onebit = cfgs["adam"], cfgs["onebit_adam"]
    assert {k: v for k, v in adam.items() if k != "optimizer"} == {k: v for k, v in onebit.items() if k != "optimizer"}
    assert onebit["optimizer"]["params"]["freeze_step"] == 121  # 120 Adam updates: 20% of 600 (DeepSpeed's F - 1)
    assert adam["steps_per_print"] == 1


@pytest.mark.parametrize("curve, target, expected", [
    ([(10, 100.0, 7.0), (20, 200.0, 6.0)], 6.5, 150.0),  # halfway between the evaluations
    ([(10, 100.0, 7.0), (20, 200.0, 6.0)], 7.0, 100.0),  # reached at an evaluation
    ([(10, 100.0, 5.0)], 6.0, 100.0),                   # already below at the first evaluation
    ([(10, 100.0, 7.0), (20, 200.0, 6.5)], 6.0, None),  # never
    ([(10, 100.0, 7.0), (20, 150.0, 7.5), (30, 250.0, 6.5)], 7.0, 100.0),  # the first time counts
])
def test_time_to_loss(curve, target, expected):
    got = time_to_loss(curve, target)
    assert got == pytest.approx(expected) if expected is not None else got is None
