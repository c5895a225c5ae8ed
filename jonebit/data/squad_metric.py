"""The official SQuAD v1.1 evaluation: exact match and token F1, as ``evaluate-v1.1.py`` computes them.

Both scores compare *normalised* answers: lower-cased, ASCII punctuation (``string.punctuation``) removed, the
articles "a", "an" and "the" removed as whole words, and runs of whitespace collapsed to one space. A question
scores the maximum over its gold answers; the totals are averaged over every question of the data set (a
question without a prediction scores 0) and multiplied by 100. Two quirks of v1.1 are kept on purpose: an answer
that normalises to nothing has F1 0 even against an empty gold answer, and non-ASCII punctuation (curly quotes,
dashes) is not removed.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import string
from collections.abc import Iterable, Mapping

log = logging.getLogger(__name__)

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """Lower-cases, removes punctuation, removes the articles a/an/the and collapses whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def exact_match_score(prediction: str, ground_truth: str) -> float:
    """1.0 when the normalised strings are equal, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def f1_score(prediction: str, ground_truth: str) -> float:
    """Harmonic mean of token precision and recall, tokens counted with multiplicity (a bag of words)."""
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(ground_truth).split()
    common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def max_over_ground_truths(metric_fn, prediction: str, ground_truths: Iterable[str]) -> float:
    """The best score of ``prediction`` against any of the gold answers."""
    ground_truths = list(ground_truths)
    if not ground_truths:
        raise ValueError("a question needs at least one gold answer to be scored; got none")
    return max(metric_fn(prediction, gt) for gt in ground_truths)


def _check_dataset(dataset) -> list:
    if isinstance(dataset, Mapping):
        if "data" not in dataset:
            raise ValueError("dataset: expected SQuAD JSON (an object with a 'data' list of articles), got an object "
                             f"with keys {sorted(dataset)[:5]}")
        dataset = dataset["data"]
    if not isinstance(dataset, list):
        raise ValueError(f"dataset: expected the SQuAD 'data' list of articles, got {type(dataset).__name__}")
    return dataset


def _iter_qas(articles: list):
    """Yields each question dict, checking the fields the metric reads and naming the first bad one."""
    for i, article in enumerate(articles):
        paragraphs = article.get("paragraphs") if isinstance(article, Mapping) else None
        if not isinstance(paragraphs, list):
            raise ValueError(f"dataset: data[{i}] should be an article object with a 'paragraphs' list")
        for j, paragraph in enumerate(paragraphs):
            qas = paragraph.get("qas") if isinstance(paragraph, Mapping) else None
            if not isinstance(qas, list):
                raise ValueError(f"dataset: data[{i}].paragraphs[{j}] should be an object with a 'qas' list")
            for k, qa in enumerate(qas):
                where = f"data[{i}].paragraphs[{j}].qas[{k}]"
                if not isinstance(qa, Mapping) or not isinstance(qa.get("id"), str):
                    raise ValueError(f"dataset: {where} should be an object with a string 'id'")
                answers = qa.get("answers")
                if not isinstance(answers, list) or not all(
                        isinstance(a, Mapping) and isinstance(a.get("text"), str) for a in answers):
                    raise ValueError(f"dataset: {where}.answers should be a list of objects with a string 'text'")
                yield qa


def evaluate(dataset, predictions: Mapping[str, str]) -> dict[str, float]:
    """Exact match and F1 (both in percent) of ``predictions`` on a SQuAD v1.1 data set.

    Args:
      dataset: the parsed SQuAD JSON, either the whole object or its ``data`` list.
      predictions: question id -> predicted answer text. Questions without a prediction score 0 (and are
        logged); predictions for ids not in the data set are ignored, as in the official script.

    Returns:
      ``{"exact_match": ..., "f1": ...}``.
    """
    if not isinstance(predictions, Mapping):
        raise ValueError(f"predictions: expected a mapping of question id -> answer text, got "
                         f"{type(predictions).__name__}")
    articles = _check_dataset(dataset)
    f1 = exact_match = 0.0
    total = missing = 0
    for qa in _iter_qas(articles):
        total += 1
        if qa["id"] not in predictions:
            missing += 1
            continue
        prediction = predictions[qa["id"]]
        if not isinstance(prediction, str):
            raise ValueError(f"predictions[{qa['id']!r}]: expected the answer text (a string), got "
                             f"{type(prediction).__name__}")
        ground_truths = [a["text"] for a in qa["answers"]]
        if not ground_truths:
            raise ValueError(f"dataset: question {qa['id']!r} has no gold answers; every SQuAD v1.1 question has one")
        exact_match += max_over_ground_truths(exact_match_score, prediction, ground_truths)
        f1 += max_over_ground_truths(f1_score, prediction, ground_truths)
    if total == 0:
        raise ValueError("dataset: it has no questions to evaluate")
    if missing:
        log.warning("%d of %d questions have no prediction and score 0", missing, total)
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1 / total}


def evaluate_files(dataset_file: str | os.PathLike, prediction_file: str | os.PathLike) -> dict[str, float]:
    """:func:`evaluate` on a SQuAD JSON file and a ``predictions.json`` (id -> answer text)."""
    dataset = _load_json(dataset_file, "DATA.json", "a SQuAD v1.1 data set")
    if isinstance(dataset, Mapping) and dataset.get("version", "1.1") != "1.1":
        log.warning("evaluation expects v-1.1, but got a data set with v-%s", dataset["version"])
    predictions = _load_json(prediction_file, "PREDICTIONS.json", "a predictions.json (question id -> answer)")
    return evaluate(dataset, predictions)


def _load_json(path, what: str, expected: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what}: no file at {path} (expected {expected})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{what}: {path} is not valid JSON ({e}); expected {expected}") from None
