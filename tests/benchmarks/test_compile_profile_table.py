"""The compile-profile table of benchmarks/BENCHMARKS.md is its result file's, and the file holds what the section
concludes from it: the per-leaf update compiles slower than the fused one, and an empty shard_map's compile time
grows faster than the number of arrays it takes while one array of the same elements stays cheap."""

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULT = ROOT / "benchmarks" / "results" / "compile_profile" / "compile_profile.json"


def _row(r) -> str:
    top = ", ".join(f"{k} {v:.1f}" for k, v in list(r["top_passes_s"].items())[:3])
    return (f"| {r['kind']} | {r['size']:,} | {r['form']} | {r['compile_s']:.1f} | {r['passes_s']:.1f} | {top} | "
            f"{r['codegen_s']:.1f} |")


def test_the_docs_table_is_the_result_file():
    text = (ROOT / "benchmarks" / "BENCHMARKS.md").read_text()
    for r in json.loads(RESULT.read_text())["rows"]:
        assert _row(r) in text, _row(r)


def test_the_result_file_holds_the_conclusion():
    rows = {(r["kind"], r["size"], r["form"]): r for r in json.loads(RESULT.read_text())["rows"]}
    assert rows["update", 200, "perleaf"]["compile_s"] > rows["update", 200, "fused"]["compile_s"]
    small, large = rows["boundary", 400, "shard_map"], rows["boundary", 1600, "shard_map"]
    assert large["compile_s"] > 4 * small["compile_s"]  # 4x the arrays, more than 4x the time
    assert rows["boundary", 1600, "flat"]["compile_s"] < 0.1 * large["compile_s"]
