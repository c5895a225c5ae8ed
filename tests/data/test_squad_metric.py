"""The official SQuAD v1.1 metric: hand-made cases per rule and a second, independently written implementation."""

from __future__ import annotations

import copy
import json
import string

import numpy as np
import pytest

from jonebit.cli import main
from jonebit.data.squad_metric import (
    evaluate,
    evaluate_files,
    exact_match_score,
    f1_score,
    max_over_ground_truths,
    normalize_answer,
)

# ---------------------------------------------------------------------------------------------------------------
# A second implementation written from the definition without regular expressions or Counter: punctuation dropped
# character by character, articles removed as maximal runs of word characters (what the official ``\b`` regex
# means for ``str``), the bag-of-words overlap by merging sorted token lists.


def _is_word_char(c: str) -> bool:
    return c.isalnum() or c == "_"


def ref_normalize(s: str) -> str:
    s = "".join(c for c in s.lower() if c not in string.punctuation)
    out, i = [], 0
    while i < len(s):
        j = i
        while j < len(s) and _is_word_char(s[j]):
            j += 1
        if j > i:
            out.append(" " if s[i:j] in ("a", "an", "the") else s[i:j])
            i = j
        else:
            out.append(s[i])
            i += 1
    return " ".join("".join(out).split())


def ref_f1(pred: str, gold: str) -> float:
    p, g = sorted(ref_normalize(pred).split()), sorted(ref_normalize(gold).split())
    i = j = same = 0
    while i < len(p) and j < len(g):
        if p[i] == g[j]:
            same, i, j = same + 1, i + 1, j + 1
        elif p[i] < g[j]:
            i += 1
        else:
            j += 1
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def ref_evaluate(articles, predictions) -> tuple[float, float]:
    em = f1 = 0.0
    n = 0
    for art in articles:
        for par in art["paragraphs"]:
            for qa in par["qas"]:
                n += 1
                if qa["id"] in predictions:
                    golds = [a["text"] for a in qa["answers"]]
                    pred = predictions[qa["id"]]
                    em += max(1.0 if ref_normalize(pred) == ref_normalize(g) else 0.0 for g in golds)
                    f1 += max(ref_f1(pred, g) for g in golds)
    return 100 * em / n, 100 * f1 / n


# ---------------------------------------------------------------------------------------------------------------
# Hand-made cases, one rule at a time


@pytest.mark.parametrize("text, expected", [
    # lower-case
    ("Denver BRONCOS", "denver broncos"),
    ("ÉCOLE", "école"),  # accents are kept: only case changes
    # punctuation: exactly string.punctuation, removed without leaving a space
    ("Denver, Broncos!", "denver broncos"),
    ("U.S.A.", "usa"),
    ("don't", "dont"),
    ("1,000,000", "1000000"),
    ("x_y", "xy"),
    (string.punctuation, ""),
    ("“Denver” — Broncos", "“denver” — broncos"),  # curly quotes and dashes are not ASCII punctuation
    # articles a / an / the as whole words only
    ("The Broncos", "broncos"),
    ("a an the A AN THE", ""),
    ("theater anthem banana", "theater anthem banana"),
    ("the-end", "theend"),  # punctuation goes first, so "the" is no longer a word here
    ("A. Lincoln", "lincoln"),
    ("the’s", "’s"),  # ’ is not a word character: "the" stands alone
    ("élan the", "élan"),
    # whitespace
    ("  Denver \t\n Broncos  ", "denver broncos"),
    ("Denver\u00a0Broncos", "denver broncos"),
    ("the  cat", "cat"),
    ("", ""),
])
def test_normalize_answer_rules(text, expected):
    assert normalize_answer(text) == expected
    assert ref_normalize(text) == expected


def test_exact_match_and_f1_hand_cases():
    assert exact_match_score("The Denver Broncos!", "denver broncos") == 1.0
    assert exact_match_score("Denver Broncos team", "Denver Broncos") == 0.0
    assert exact_match_score("the", "a") == 1.0  # both normalise to ""
    # precision 2/2, recall 2/4
    assert f1_score("the cat sat", "cat sat on mat") == pytest.approx(2 * 1 * 0.5 / 1.5)
    # overlap counts multiplicity: one "cat" in common, precision 1/3, recall 1
    assert f1_score("cat cat cat", "cat") == pytest.approx(0.5)
    assert f1_score("cat cat", "cat cat dog") == pytest.approx(2 * 1 * (2 / 3) / (1 + 2 / 3))
    # v1.1: nothing in common (even two empty answers) scores 0
    assert f1_score("", "") == 0.0
    assert f1_score("the", "a") == 0.0
    assert f1_score("Denver", "Broncos") == 0.0
    assert max_over_ground_truths(f1_score, "cat", ["dog", "cat sat", "cat"]) == 1.0
    assert max_over_ground_truths(f1_score, "cat", ["dog", "cat sat"]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="at least one gold answer"):
        max_over_ground_truths(f1_score, "cat", [])


def test_evaluate_averages_over_all_questions_times_100():
    data = {"version": "1.1", "data": [{"paragraphs": [{"context": "unused", "qas": [
        {"id": "q1", "question": "?", "answers": [{"text": "Denver Broncos", "answer_start": 0},
                                                  {"text": "Broncos", "answer_start": 0}]},
        {"id": "q2", "question": "?", "answers": [{"text": "cat sat on mat", "answer_start": 0}]},
        {"id": "q3", "question": "?", "answers": [{"text": "x", "answer_start": 0}]},
    ]}]}]}
    # q1 exact via the second answer; q2 F1 2/3 and no EM; q3 has no prediction and scores 0
    preds = {"q1": "the broncos", "q2": "the cat sat", "unknown": "ignored"}
    result = evaluate(data, preds)
    assert result["exact_match"] == pytest.approx(100 / 3)
    assert result["f1"] == pytest.approx(100 * (1 + 2 / 3) / 3)
    assert evaluate(data["data"], preds) == result  # the 'data' list works too


def _random_text(rng) -> str:
    words = ["a", "an", "the", "A", "The", "THE", "an.", "the,", "theater", "ant", "cat", "Cat", "dog", "é",
             "the’s", "x_y", "_the_", "a-b", "(the)", "10,000", "", "naïve", "“quote”", "AN", "Ångström"]
    seps = [" ", "  ", "\t", "\n", "", "-", ".", "\u00a0", ", "]
    n = int(rng.integers(0, 8))
    return "".join(words[rng.integers(len(words))] + seps[rng.integers(len(seps))] for _ in range(n))


def test_metric_matches_independent_implementation_on_random_strings():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        pred, gold = _random_text(rng), _random_text(rng)
        assert normalize_answer(pred) == ref_normalize(pred), pred
        assert f1_score(pred, gold) == pytest.approx(ref_f1(pred, gold), abs=1e-12), (pred, gold)
        assert exact_match_score(pred, gold) == float(ref_normalize(pred) == ref_normalize(gold))


def _perturb(text: str, rng, context: str) -> str:
    words = text.split()
    kind = int(rng.integers(7))
    if kind == 0 and len(words) > 1:  # drop a word
        del words[int(rng.integers(len(words)))]
    elif kind == 1:  # an extra article and punctuation: same normalised answer
        words = ["The"] + words + ["."]
    elif kind == 2:  # an extra word from the context
        ctx = context.split()
        words.append(ctx[int(rng.integers(len(ctx)))])
    elif kind == 3:
        return text.upper()
    elif kind == 4:
        return ""
    elif kind == 5:  # repeat a word: tests the multiplicity of the overlap
        words = words + words[:1]
    return " ".join(words)


@pytest.fixture(scope="module")
def dev(shared_data):
    path = shared_data / "squad" / "dev-v1.1.json"
    if not path.is_file():
        pytest.skip("dev-v1.1.json not present")
    return json.loads(path.read_text(encoding="utf-8"))


def _predictions(articles, rng=None, perturb=False):
    preds = {}
    for art in articles:
        for par in art["paragraphs"]:
            for qa in par["qas"]:
                gold = qa["answers"][int(rng.integers(len(qa["answers"])))]["text"] if rng else qa["answers"][0]["text"]
                preds[qa["id"]] = _perturb(gold, rng, par["context"]) if perturb else gold
    return preds


def test_metric_matches_independent_implementation_on_dev_with_perturbed_predictions(dev):
    rng = np.random.default_rng(1)
    preds = _predictions(dev["data"], rng, perturb=True)
    for qid in list(preds)[::7]:  # some questions unanswered
        del preds[qid]
    result = evaluate(dev, preds)
    em, f1 = ref_evaluate(dev["data"], preds)
    assert result["exact_match"] == pytest.approx(em, abs=1e-9)
    assert result["f1"] == pytest.approx(f1, abs=1e-9)
    assert 10 < result["exact_match"] < 90  # the perturbations hit both sides


def _subset(dev, articles=3) -> dict:
    return {"version": dev["version"], "data": copy.deepcopy(dev["data"][:articles])}


def test_squad_eval_command_on_dev_subset(dev, tmp_path, capsys):
    data = _subset(dev)
    (tmp_path / "data.json").write_text(json.dumps(data), encoding="utf-8")
    (tmp_path / "gold.json").write_text(json.dumps(_predictions(data["data"])), encoding="utf-8")
    assert main(["squad-eval", str(tmp_path / "data.json"), str(tmp_path / "gold.json")]) == 0
    assert json.loads(capsys.readouterr().out) == {"exact_match": 100.0, "f1": 100.0}

    preds = _predictions(data["data"], np.random.default_rng(2), perturb=True)
    (tmp_path / "pert.json").write_text(json.dumps(preds), encoding="utf-8")
    assert main(["squad-eval", str(tmp_path / "data.json"), str(tmp_path / "pert.json")]) == 0
    out = json.loads(capsys.readouterr().out)
    em, f1 = ref_evaluate(data["data"], preds)
    assert out["exact_match"] == pytest.approx(em, abs=1e-9) and out["f1"] == pytest.approx(f1, abs=1e-9)
    assert out["exact_match"] < 100


@pytest.mark.parametrize("data, preds, match", [
    ("not json", "{}", "DATA.json: .* is not valid JSON"),
    ('{"version": "1.1"}', "{}", "expected SQuAD JSON .* 'data' list"),
    ('{"data": [{"title": "x"}]}', "{}", r"data\[0\] should be an article object with a 'paragraphs' list"),
    ('{"data": [{"paragraphs": [{"qas": [{"id": "q", "answers": [{"answer_start": 0}]}]}]}]}', "{}",
     r"qas\[0\]\.answers should be a list of objects with a string 'text'"),
    ('{"data": [{"paragraphs": [{"qas": [{"id": "q", "answers": []}]}]}]}', '{"q": "x"}', "'q' has no gold answers"),
    ('{"data": [{"paragraphs": [{"qas": [{"id": "q", "answers": [{"text": "x"}]}]}]}]}', '["x"]',
     "predictions: expected a mapping"),
    ('{"data": [{"paragraphs": [{"qas": [{"id": "q", "answers": [{"text": "x"}]}]}]}]}', '{"q": 3}',
     r"predictions\['q'\]: expected the answer text"),
    ('{"data": []}', "{}", "no questions"),
])
def test_squad_eval_bad_inputs(tmp_path, capsys, data, preds, match):
    (tmp_path / "d.json").write_text(data, encoding="utf-8")
    (tmp_path / "p.json").write_text(preds, encoding="utf-8")
    with pytest.raises(ValueError, match=match):
        evaluate_files(tmp_path / "d.json", tmp_path / "p.json")
    assert main(["squad-eval", str(tmp_path / "d.json"), str(tmp_path / "p.json")]) == 2
    assert "jonebit squad-eval:" in capsys.readouterr().err


def test_squad_eval_missing_file(tmp_path, capsys):
    (tmp_path / "p.json").write_text("{}", encoding="utf-8")
    with pytest.raises(FileNotFoundError, match="DATA.json: no file at"):
        evaluate_files(tmp_path / "absent.json", tmp_path / "p.json")
    assert main(["squad-eval", str(tmp_path / "absent.json"), str(tmp_path / "p.json")]) == 2
    assert "no file at" in capsys.readouterr().err
