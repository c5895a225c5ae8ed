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


ARMS = ("adam", "onebit_adam", "onebit_deepspeed")


def report_rows(d) -> list[str]:
    """The report table: per seed each arm's dev EM / F1 and the two 1-bit arms' F1 gap to Adam's; then the means
    with the range over seeds."""
    runs = {(r["seed"], r["arm"]): r for r in d["runs"]}
    out, gaps = [], {arm: [] for arm in ARMS[1:]}
    for seed in d["seeds"]:
        cells = [f"{runs[seed, a]['exact_match']:.2f} / {runs[seed, a]['f1']:.2f}" for a in ARMS]
        for arm in ARMS[1:]:
            gaps[arm].append(runs[seed, arm]["f1"] - runs[seed, "adam"]["f1"])
        out.append(f"| {seed} | {' | '.join(cells)} | {gaps['onebit_adam'][-1]:+.2f} | "
                   f"{gaps['onebit_deepspeed'][-1]:+.2f} |")

    def spread(xs, fmt="{:.2f}"):
        return f"{fmt.format(sum(xs) / len(xs))} ({fmt.format(min(xs))} to {fmt.format(max(xs))})"

    means = [f"{d['arms'][a]['exact_match_spread']['mean']:.2f} / {d['arms'][a]['f1_spread']['mean']:.2f}"
             for a in ARMS]
    out.append(f"| mean (range) | {' | '.join(means)} | {spread(gaps['onebit_adam'], '{:+.2f}')} | "
               f"{spread(gaps['onebit_deepspeed'], '{:+.2f}')} |")
    return out


def test_the_report_table_is_the_result_file():
    d = json.loads(RESULT.read_text())
    assert d["complete"] and d["dev_questions"] == 10570 and sorted(d["seeds"]) == [0, 1, 2]
    text = (ROOT / "benchmarks" / "BENCHMARKS.md").read_text()
    for row in report_rows(d):
        assert row in text, row


def test_the_report_text_is_the_result_file():
    d = json.loads(RESULT.read_text())
    text = " ".join((ROOT / "benchmarks" / "BENCHMARKS.md").read_text().split())
    runs = {(r["seed"], r["arm"]): r for r in d["runs"]}
    gaps = {arm: [runs[s, arm]["f1"] - runs[s, "adam"]["f1"] for s in d["seeds"]] for arm in ARMS[1:]}
    ours, ds = gaps["onebit_adam"], gaps["onebit_deepspeed"]
    assert min(ours) > 0  # "above Adam in every seed"
    adam_f1 = d["arms"]["adam"]["f1"]
    sent = d["arms"]["onebit_adam"]["mb_sent_per_rank"][0] / d["arms"]["adam"]["mb_sent_per_rank"][0]
    for claim in (f"by {sum(ours) / 3:.2f} F1 on average ({min(ours):.2f} to {max(ours):.2f})",
                  f"at {100 * sent:.1f}% of Adam's bytes",
                  f"the {max(adam_f1) - min(adam_f1):.2f} F1 that separates the seeds' Adam runs",
                  f"ends {-sum(ds) / 3:.2f} F1 below Adam ({-max(ds):.2f} to {-min(ds):.2f})"):
        assert claim in text, claim
