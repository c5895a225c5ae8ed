"""benchmarks/cluster/extrapolate.py: the per-node NIC bytes of each scheme against formulas written out here,
and the script end to end on a given parameter count."""

from __future__ import annotations

import json

import pytest

from benchmarks.cluster import extrapolate
from jonebit.comm import compressed_bytes_per_rank
from jonebit.comm.compressed import padded_size


@pytest.mark.parametrize("nodes,per_node", [(2, 8), (4, 8), (16, 8), (4, 4), (3, 1)])
def test_node_traffic_against_formulas(nodes, per_node):
    n = 1_000_003
    p = nodes * per_node
    adam, adam_rounds = extrapolate.node_traffic("adam", n, nodes, per_node)
    # fp16 ring all-reduce over all GPUs in node order: each node's boundary is crossed by one member's stream
    assert adam == pytest.approx(2 * (p - 1) / p * 2 * n)
    assert adam_rounds == 2 * (p - 1)
    flat, _ = extrapolate.node_traffic("onebit_flat", n, nodes, per_node)
    row = padded_size(n, p) // p // 8 + 4
    a2a = (p - 1) * row  # one GPU's all-to-all bytes; (p - per_node) of its p - 1 peers are on other nodes
    gather = (p - 1) * row  # ring all-gather: one member's stream leaves the node
    assert flat == pytest.approx(per_node * a2a * (p - per_node) / (p - 1) + gather)
    hier, hier_rounds = extrapolate.node_traffic("onebit_hier", n, nodes, per_node)
    s = -(-n // per_node)
    assert hier == pytest.approx(per_node * compressed_bytes_per_rank(s, nodes))
    assert hier_rounds == 2 * (nodes - 1)
    if per_node > 1:
        assert hier < flat < adam
    else:  # one GPU per node: hierarchical is flat
        assert hier == pytest.approx(flat)


def test_extrapolate_script_writes_report(tmp_path):
    out = tmp_path / "x.json"
    assert extrapolate.main(["--params", "336000000", "--nodes", "16", "64", "--gpus", "V100", "H100",
                             "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["gpu"], r["nodes"]) for r in report["rows"]] == [("V100", 16), ("V100", 64), ("H100", 16),
                                                               ("H100", 64)]
    for r in report["rows"]:
        s = r["schemes"]
        # step = compute + communication, and the whole run mixes 15% of Adam's step with the compressed one
        assert s["adam"]["step_s"] == pytest.approx(r["compute_s"] + s["adam"]["comm_s"])
        comp = s["onebit_hier"]["step_s"]
        assert r["onebit_hier_run_speedup"] == pytest.approx(s["adam"]["step_s"] / (0.15 * s["adam"]["step_s"]
                                                                                    + 0.85 * comp))
        # faster GPUs leave more of the step to the network, so compression gains more
    v100, h100 = report["rows"][0], report["rows"][2]
    assert h100["onebit_hier_stage_speedup"] > v100["onebit_hier_stage_speedup"]


@pytest.mark.parametrize("argv,match", [
    (["--mfu", "0"], "--mfu must be > 0"),
    (["--efficiency", "1.5"], "at most 1"),
    (["--nodes", "1"], "--nodes >= 2"),
    (["--warmup-fraction", "2"], "--warmup-fraction"),
])
def test_extrapolate_rejects_bad_arguments(argv, match, capsys):
    with pytest.raises(SystemExit):
        extrapolate.parse_args(argv)
    assert match in capsys.readouterr().err
