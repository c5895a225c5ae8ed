"""The SQuAD protocol's selection table in benchmarks/BENCHMARKS.md is its result file's, the selected candidate is
the one with the highest validation F1, and `jonebit squad`'s built-in config is that candidate."""

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULT = ROOT / "benchmarks" / "results" / "squad_protocol" / "squad_protocol.json"


def _rows(d) -> list[str]:
    out = []
    for name, v in d["selection"].items():
        on = ", ".join(f"{k}={x}" for k, x in v["options"].items() if x not in (False, None)) or "none"
        out.append(f"| {name}{' (selected)' if name == d['selected'] else ''} | {on} | {v['exact_match']:.2f} | "
                   f"{v['f1']:.2f} |")
    return out


def test_the_selection_table_is_the_result_file():
    d = json.loads(RESULT.read_text())
    text = (ROOT / "benchmarks" / "BENCHMARKS.md").read_text()
    for row in _rows(d):
        assert row in text, row


def test_the_selection_follows_the_rule_and_the_recipe_is_the_winner():
    from jonebit.apps.squad import recipe_params

    d = json.loads(RESULT.read_text())
    assert d["split"]["shared_paragraphs"] == 0
    assert d["selected"] == max(d["selection"], key=lambda k: d["selection"][k]["f1"])
    params = recipe_params()
    for key, value in d["selection"][d["selected"]]["options"].items():
        assert params.get(key, None if value is None else False) == value, (key, params.get(key), value)
