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


def test_compare_reads_both_targets():
    """Adam ends at 6.0 after 400 s; 1-bit Adam ends at 6.2 after 200 s, so it never reaches 6.0; both reach 6.2:
    Adam halfway between its evaluations at 100 s (6.4) and 300 s (6.0), i.e. at 200 s; 1-bit Adam at its end."""
    from benchmarks.cluster.time_to_loss import compare

    adam = {"heldout_mlm_loss": 6.0, "wall_s": 400.0, "curve": [(1, 100.0, 6.4), (2, 300.0, 6.0), (3, 400.0, 6.0)]}
    onebit = {"heldout_mlm_loss": 6.2, "wall_s": 200.0, "curve": [(1, 100.0, 6.5), (2, 200.0, 6.2)]}
    got = compare(adam, onebit)
    assert got["onebit_time_to_target_s"] is None and got["speedup_to_target"] is None
    assert got["common_loss"] == 6.2
    assert got["adam_time_to_common_s"] == pytest.approx(200.0)
    assert got["onebit_time_to_common_s"] == pytest.approx(200.0)
    assert got["speedup_to_common"] == pytest.approx(1.0)
    assert got["final_loss_gap"] == pytest.approx(0.2 / 6.0)
    assert got["wall_ratio"] == pytest.approx(2.0)


def _table_rows(d: dict) -> list[str]:
    out = []
    for name, arm in d["arms"].items():
        qdisc = sum(arm["qdisc_bytes_up"]) / len(arm["qdisc_bytes_up"])
        out.append(f"| {d['rate']} | {name} | {arm['steps']} | {arm['wall_s']:,.0f} | {arm['heldout_mlm_loss']:.3f} | "
                   f"{arm['bytes_sent_per_rank'] / 1e9:.2f} | {qdisc / 1e9:.2f} |")
    return out


def _summary(d: dict) -> str:
    return (f"both reach {d['common_loss']:.3f}: Adam after {d['adam_time_to_common_s']:,.0f} s, 1-bit Adam after "
            f"{d['onebit_time_to_common_s']:,.0f} s ({d['speedup_to_common']:.2f}x)")


def test_the_docs_tables_are_the_result_files():
    import json
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    text = (root / "benchmarks" / "BENCHMARKS.md").read_text()
    files = sorted((root / "benchmarks" / "results" / "time_to_loss").glob("*.json"))
    for path in files:
        d = json.loads(path.read_text())
        for row in _table_rows(d):
            assert row in text, row
        assert _summary(d) in text, _summary(d)
        # The result's own arithmetic: the common target is the higher final loss, and both curves reach it.
        assert d["common_loss"] == max(a["heldout_mlm_loss"] for a in d["arms"].values())
        assert d["speedup_to_common"] == pytest.approx(d["adam_time_to_common_s"] / d["onebit_time_to_common_s"])
