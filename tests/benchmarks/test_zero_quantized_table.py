"""The quantized-gather table of benchmarks/BENCHMARKS.md and the figure in docs/zero.md are the result file's."""

import json
import pathlib
import statistics

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULT = ROOT / "benchmarks" / "results" / "zero_quantized" / "zero_quantized.json"


def test_the_docs_are_the_result_file():
    r = json.loads(RESULT.read_text())
    assert len(r["seeds"]) >= 3  # the evidence standard: three seeds, both arms in one invocation
    by = {(x["seed"], x["arm"]): x["heldout_mlm_loss"] for x in r["rows"]}
    text = (ROOT / "benchmarks" / "BENCHMARKS.md").read_text()
    for seed, gap in zip(r["seeds"], r["gaps_percent"], strict=True):
        e, q = by[seed, "exact"], by[seed, "quantized"]
        assert abs(gap - 100 * (q - e) / e) < 1e-9
        assert f"| {seed} | {e:.4f} | {q:.4f} | {gap:+.2f}% |" in text
    mean = statistics.fmean(r["gaps_percent"])
    lo, hi = min(r["gaps_percent"]), max(r["gaps_percent"])
    assert f"**the quantized gather ends {mean:+.2f}% from the exact one on average\n({lo:+.2f}% to {hi:+.2f}%)**" \
        in text
    zero = " ".join((ROOT / "docs" / "zero.md").read_text().split())
    assert f"ends {mean:+.2f}% ({lo:+.2f}% to {hi:+.2f}%) from the exact gather" in zero
