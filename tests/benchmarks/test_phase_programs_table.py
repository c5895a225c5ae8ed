"""The BERT-mini table of benchmarks/BENCHMARKS.md is the one its result file holds (regenerated, not retyped)."""

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULT = ROOT / "benchmarks" / "results" / "phase_programs" / "phase_programs.json"
ROWS = {  # the table's row label -> the result file's arm
    "defaults (per tensor), per phase": "1-bit Adam, per phase",
    "defaults (per tensor), one program": "1-bit Adam, one program",
    "fused, per phase": "1-bit Adam fused, per phase",
    "fused, one program": "1-bit Adam fused, one program",
}


def test_the_docs_table_is_the_result_file():
    result = json.loads(RESULT.read_text())
    ratios = {kind: {r["step"]: r["ratio"] for r in result[kind]} for kind in ("optimizer_step", "train_step")}
    text = (ROOT / "benchmarks" / "BENCHMARKS.md").read_text()
    for label, arm in ROWS.items():
        opt, train = ratios["optimizer_step"][arm], ratios["train_step"][arm]
        cells = [f"{opt:.2f}", f"{train:.2f}"]
        if label.endswith("defaults (per tensor), per phase"):
            cells = [f"**{c}**" for c in cells]
        assert f"| {label} | {cells[0]} | {cells[1]} |" in text, (label, cells)
    assert f"{result['params']:,} parameters in {result['leaves']} leaves" in text
