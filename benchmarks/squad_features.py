"""Throughput of SQuAD feature building and post-processing on one CPU core.

Reads ``dev-v1.1.json``, builds run_squad features (384 / 128 / 64) and post-processes random logits (the slowest
case: long, scattered candidate spans); for scale, also times HuggingFace ``run_qa.py``'s feature step (a fast
tokenizer call with overflowing windows and offsets) on the same questions when transformers is installed.

    python benchmarks/squad_features.py --data ../shared/data/squad/dev-v1.1.json \
        --vocab ../shared/data/vocab/bert-base-uncased-vocab.txt
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from jonebit.data.squad import convert_examples_to_features, load_squad, postprocess_predictions
from jonebit.data.tokenization import load_wordpiece


def _hf_features(examples, vocab: str) -> tuple[int, float]:
    from transformers import BertTokenizerFast

    tok = BertTokenizerFast(vocab_file=vocab, do_lower_case=True)
    t = time.perf_counter()
    enc = tok([ex.question.lstrip() for ex in examples], [ex.paragraph.context for ex in examples],
              truncation="only_second", max_length=384, stride=128, return_overflowing_tokens=True,
              return_offsets_mapping=True, padding="max_length")
    return len(enc["input_ids"]), time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="../shared/data/squad/dev-v1.1.json")
    parser.add_argument("--vocab", default="../shared/data/vocab/bert-base-uncased-vocab.txt")
    parser.add_argument("--core", type=int, default=0, help="the CPU core to pin to")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions; the fastest is reported")
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.core})
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"

    tokenizer = load_wordpiece(args.vocab)
    t = time.perf_counter()
    data = load_squad(args.data)
    load_s = time.perf_counter() - t
    feat_s, post_s = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        feats = convert_examples_to_features(data.examples, tokenizer)
        feat_s.append(time.perf_counter() - t)
    rng = np.random.default_rng(0)
    start, end = rng.normal(size=feats.input_ids.shape), rng.normal(size=feats.input_ids.shape)
    for _ in range(args.repeats):
        t = time.perf_counter()
        postprocess_predictions(data.examples, feats, start, end, tokenizer)
        post_s.append(time.perf_counter() - t)
    result = {
        "questions": len(data), "features": len(feats), "load_s": round(load_s, 2),
        "features_s": round(min(feat_s), 2), "features_per_s": round(len(feats) / min(feat_s)),
        "postprocess_s": round(min(post_s), 2), "questions_per_s_postprocess": round(len(data) / min(post_s)),
        "load_average": os.getloadavg()[0],
    }
    try:
        n, s = min((_hf_features(data.examples, args.vocab) for _ in range(args.repeats)), key=lambda r: r[1])
        result.update(hf_run_qa_features=n, hf_run_qa_features_s=round(s, 2), hf_run_qa_features_per_s=round(n / s))
    except ImportError:
        pass
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
