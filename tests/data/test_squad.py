"""SQuAD features and post-processing against a literal re-implementation of Google's ``run_squad.py``.

The reference below (``RefTokenizer``, ``ref_get_final_text``, ``ref_nbest``) is a plain-Python transcription
of BERT's ``tokenization.py`` and ``run_squad.py``: per-character clean-up, lower-casing, accent stripping and
punctuation splitting, greedy longest-match WordPiece, and the original n-best loop over Python lists. The module
under test uses the ``tokenizers`` library and numpy instead, so the two share no code.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import unicodedata

import numpy as np
import pytest

from jonebit.data.squad import (
    SquadExample,
    basic_tokenize,
    convert_examples_to_features,
    detokenize,
    doc_windows,
    get_final_text,
    load_squad,
    postprocess_predictions,
    span_text,
    split_words,
    write_predictions,
)
from jonebit.data.squad_metric import evaluate, normalize_answer
from jonebit.data.tokenization import load_wordpiece

# ---------------------------------------------------------------------------------------------------------------
# Reference: Google's tokenization.py


def _is_whitespace(c):
    return c in " \t\n\r" or unicodedata.category(c) == "Zs"


def _is_control(c):
    return c not in "\t\n\r" and unicodedata.category(c) in ("Cc", "Cf")


def _is_punctuation(c):
    cp = ord(c)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(c).startswith("P")


def _is_chinese(cp):
    return any(a <= cp <= b for a, b in ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
                                         (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F)))


def ref_basic_tokenize(text):
    chars = []
    for c in text:
        if ord(c) in (0, 0xFFFD) or _is_control(c):
            continue
        c = " " if _is_whitespace(c) else c
        chars.append(f" {c} " if _is_chinese(ord(c)) else c)
    out = []
    for token in "".join(chars).split():
        token = "".join(c for c in unicodedata.normalize("NFD", token.lower()) if unicodedata.category(c) != "Mn")
        piece = []
        for c in token:
            if _is_punctuation(c):
                out.extend(["".join(piece)] if piece else [])
                out.append(c)
                piece = []
            else:
                piece.append(c)
        out.extend(["".join(piece)] if piece else [])
    return out


class RefTokenizer:
    def __init__(self, vocab):
        self.vocab = {t: i for i, t in enumerate(vocab)}

    def wordpiece(self, token):
        if len(token) > 100:  # the tokenizers library's limit (Google's is 200)
            return ["[UNK]"]
        out, start = [], 0
        while start < len(token):
            end = len(token)
            while start < end:
                sub = ("##" if start else "") + token[start:end]
                if sub in self.vocab:
                    break
                end -= 1
            else:
                return ["[UNK]"]
            out.append(sub)
            start = end
        return out

    def tokenize(self, text):
        return [p for t in ref_basic_tokenize(text) for p in self.wordpiece(t)]

    def ids(self, tokens):
        return [self.vocab[t] for t in tokens]


def ref_get_final_text(pred_text, orig_text):
    def strip_spaces(text):
        ns_chars, ns_to_s = [], collections.OrderedDict()
        for i, c in enumerate(text):
            if c == " ":
                continue
            ns_to_s[len(ns_chars)] = i
            ns_chars.append(c)
        return "".join(ns_chars), ns_to_s

    tok_text = " ".join(ref_basic_tokenize(orig_text))
    start_position = tok_text.find(pred_text)
    if start_position == -1:
        return orig_text
    end_position = start_position + len(pred_text) - 1
    orig_ns_text, orig_ns_to_s_map = strip_spaces(orig_text)
    tok_ns_text, tok_ns_to_s_map = strip_spaces(tok_text)
    if len(orig_ns_text) != len(tok_ns_text):
        return orig_text
    tok_s_to_ns_map = {v: k for k, v in tok_ns_to_s_map.items()}
    orig_start = orig_ns_to_s_map.get(tok_s_to_ns_map.get(start_position))
    orig_end = orig_ns_to_s_map.get(tok_s_to_ns_map.get(end_position))
    if orig_start is None or orig_end is None:
        return orig_text
    return orig_text[orig_start:orig_end + 1]


def ref_nbest(example, rows, feats, start_logits, end_logits, vocab, n_best_size, max_answer_length):
    """run_squad's write_predictions for one example, on lists and dicts."""
    prelim = []
    for row in rows:
        tokens = [vocab[t] for t in feats.input_ids[row]]
        n_tokens = int(feats.attention_mask[row].sum())
        token_to_orig = {j: int(w) for j, w in enumerate(feats.token_to_word[row]) if w >= 0}
        is_max = {j: bool(feats.token_is_max_context[row, j]) for j in token_to_orig}
        sl, el = list(start_logits[row]), list(end_logits[row])
        best = lambda logits: [i for i, _ in sorted(enumerate(logits), key=lambda x: x[1], reverse=True)[:n_best_size]]
        for s in best(sl):
            for e in best(el):
                if s >= n_tokens or e >= n_tokens or s not in token_to_orig or e not in token_to_orig:
                    continue
                if not is_max.get(s, False) or e < s or e - s + 1 > max_answer_length:
                    continue
                prelim.append((row, s, e, sl[s], el[e], tokens, token_to_orig))
    prelim = sorted(prelim, key=lambda p: p[3] + p[4], reverse=True)
    nbest, seen = [], set()
    for _row, s, e, sls, els, tokens, token_to_orig in prelim:
        if len(nbest) >= n_best_size:
            break
        tok_text = " ".join(tokens[s:e + 1]).replace(" ##", "").replace("##", "")
        tok_text = " ".join(tok_text.strip().split())
        orig_text = " ".join(example.paragraph.words[token_to_orig[s]:token_to_orig[e] + 1])
        text = ref_get_final_text(tok_text, orig_text)
        if text in seen:
            continue
        seen.add(text)
        nbest.append((text, float(sls), float(els)))
    return nbest or [("empty", 0.0, 0.0)]


# ---------------------------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def tokenizer(shared_data):
    path = shared_data / "vocab" / "bert-base-uncased-vocab.txt"
    if not path.is_file():
        pytest.skip("bert-base-uncased-vocab.txt not present")
    return load_wordpiece(path)


@pytest.fixture(scope="module")
def ref(tokenizer):
    return RefTokenizer(tokenizer.vocab)


@pytest.fixture(scope="module")
def dev_path(shared_data):
    path = shared_data / "squad" / "dev-v1.1.json"
    if not path.is_file():
        pytest.skip("dev-v1.1.json not present")
    return path


@pytest.fixture(scope="module")
def dev(dev_path):
    return load_squad(dev_path)


@pytest.fixture(scope="module")
def sample(dev):
    """500 dev questions drawn at random (fixed seed), in file order."""
    idx = np.sort(np.random.default_rng(0).choice(len(dev.examples), 500, replace=False))
    return [dev.examples[i] for i in idx]


def _ref_doc_tokens(example, ref):
    """run_squad's all_doc_tokens and tok_to_orig_index of the example's context."""
    tokens, tok_to_word = [], []
    for w, word in enumerate(example.paragraph.words):
        for t in ref.tokenize(word):
            tokens.append(t)
            tok_to_word.append(w)
    return ref.ids(tokens), tok_to_word


# ---------------------------------------------------------------------------------------------------------------
# Words and tokens


def test_split_words_on_run_squad_whitespace():
    p = split_words("  Hi there\u202fyou\tx\u00a0y ")
    assert p.words == ("Hi", "there", "you", "x\u00a0y")  # no-break space is not a word separator in run_squad
    assert p.char_to_word.tolist() == [-1, -1, 0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    assert p.word_to_char.tolist() == [2, 5, 11, 15]


def test_tokens_match_reference_tokenizer(sample, tokenizer, ref):
    feats = convert_examples_to_features(sample[:150], tokenizer)
    for i, ex in enumerate(sample[:150]):
        ids, tok_to_word = _ref_doc_tokens(ex, ref)
        q = ref.ids(ref.tokenize(ex.question))[:64]
        row = int(np.flatnonzero(feats.example_index == i)[0])
        assert feats.input_ids[row, 1:len(q) + 1].tolist() == q, ex.qas_id
        ctx = feats.token_type_ids[row].astype(bool) & (feats.token_to_word[row] >= 0)
        n = int(ctx.sum())
        assert feats.input_ids[row, ctx].tolist() == ids[:n], ex.qas_id
        assert feats.token_to_word[row, ctx].tolist() == tok_to_word[:n], ex.qas_id


def test_basic_tokenize_matches_reference(sample, tokenizer):
    for ex in sample[:100]:
        assert basic_tokenize(ex.paragraph.context, tokenizer) == ref_basic_tokenize(ex.paragraph.context)


# ---------------------------------------------------------------------------------------------------------------
# Windows, targets and max context


def _expected_windows(n_tokens, max_doc, stride):
    if n_tokens <= max_doc:
        return [(0, n_tokens)]
    count = 1 + math.ceil((n_tokens - max_doc) / stride)
    starts = [k * stride for k in range(count)]
    return [(s, min(max_doc, n_tokens - s)) for s in starts]


@pytest.mark.parametrize("max_seq_length, doc_stride, max_query_length", [(384, 128, 64), (96, 24, 16),
                                                                           (64, 50, 20)])
def test_windows_targets_and_max_context(sample, tokenizer, ref, max_seq_length, doc_stride, max_query_length):
    examples = sample[:200]
    feats = convert_examples_to_features(examples, tokenizer, max_seq_length=max_seq_length, doc_stride=doc_stride,
                                         max_query_length=max_query_length)
    assert feats.input_ids.dtype == feats.attention_mask.dtype == feats.token_type_ids.dtype == np.int32
    assert feats.start_positions.shape == feats.end_positions.shape == (len(feats),)
    multi = 0
    for i, ex in enumerate(examples):
        rows = np.flatnonzero(feats.example_index == i)
        ids, _ = _ref_doc_tokens(ex, ref)
        q_len = min(len(ref.tokenize(ex.question)), max_query_length)
        max_doc = max_seq_length - q_len - 3
        windows = _expected_windows(len(ids), max_doc, min(doc_stride, max_doc))
        assert len(rows) == len(windows), ex.qas_id
        assert feats.window_index[rows].tolist() == list(range(len(rows)))
        multi += len(rows) > 1
        # the answer's token span, from the reference tokenizer: the tokenized answer inside the word span
        first, last = ex.start_word, ex.end_word
        words = ex.paragraph.words
        t0 = sum(len(ref.tokenize(w)) for w in words[:first])
        t1 = sum(len(ref.tokenize(w)) for w in words[:last + 1]) - 1
        ans = ref.ids(ref.tokenize(ex.answer_text))
        for s in range(t0, t1 - len(ans) + 2):
            if ids[s:s + len(ans)] == ans:
                t0, t1 = s, s + len(ans) - 1
                break
        scored = np.zeros(len(ids), int)
        for w, (row, (start, length)) in enumerate(zip(rows, windows, strict=True)):
            off = q_len + 2
            expect = ([tokenizer.cls_id] + [0] * q_len + [tokenizer.sep_id] + ids[start:start + length]
                      + [tokenizer.sep_id])
            got = feats.input_ids[row, :len(expect)].tolist()
            assert got[off:] == expect[off:] and got[0] == expect[0] and got[off - 1] == expect[off - 1]
            assert (feats.input_ids[row, len(expect):] == tokenizer.pad_id).all()
            assert feats.attention_mask[row].tolist() == [1] * len(expect) + [0] * (max_seq_length - len(expect))
            assert feats.token_type_ids[row].tolist() == ([0] * off + [1] * (length + 1)
                                                          + [0] * (max_seq_length - len(expect)))
            inside = start <= t0 and t1 <= start + length - 1
            target = (t0 - start + off, t1 - start + off) if inside else (0, 0)
            assert (feats.start_positions[row], feats.end_positions[row]) == target, (ex.qas_id, w)
            for j in range(length):
                p = start + j
                # run_squad's score, and the earlier window on a tie
                best, best_w = None, None
                for k, (s2, n2) in enumerate(windows):
                    if s2 <= p <= s2 + n2 - 1:
                        score = min(p - s2, s2 + n2 - 1 - p) + 0.01 * n2
                        if best is None or score > best:
                            best, best_w = score, k
                assert bool(feats.token_is_max_context[row, off + j]) == (best_w == w), (ex.qas_id, w, p)
                scored[p] += feats.token_is_max_context[row, off + j]
            assert not feats.token_is_max_context[row, :off].any()
            assert not feats.token_is_max_context[row, off + length:].any()
        assert (scored == 1).all(), ex.qas_id  # every context token is scored in exactly one window
    if max_seq_length < 384:
        assert multi > 50  # the small settings do exercise several windows


def test_doc_windows_edge_cases():
    assert doc_windows(10, 10, 3) == [(0, 10)]
    assert doc_windows(11, 10, 3) == [(0, 10), (3, 8)]
    assert doc_windows(25, 10, 20) == [(0, 10), (10, 10), (20, 5)]  # a step is never longer than the window
    assert doc_windows(0, 10, 3) == []


# ---------------------------------------------------------------------------------------------------------------
# Round trip of every answer through tokenization and get_final_text


def _irreducible(example, text, offset, feats_row_ids, tokenizer):
    """Why ``text`` cannot come back exactly from whole tokens, or None.

    Either the answer starts or ends inside a run of letters/digits (a WordPiece token cannot be cut: "Israel" in
    "Israelis"), or its words change length under normalisation or hold [UNK] (then get_final_text returns the
    whole words, as in run_squad).
    """
    ctx = example.paragraph.context
    end = offset + len(text)
    if (offset > 0 and ctx[offset - 1].isalnum() and ctx[offset].isalnum()) or (
            end < len(ctx) and ctx[end - 1].isalnum() and ctx[end].isalnum()):
        return "sub-word"
    first, last = example.paragraph.char_to_word[offset], example.paragraph.char_to_word[end - 1]
    orig = " ".join(example.paragraph.words[first:last + 1])
    if len(orig.replace(" ", "")) != len("".join(basic_tokenize(orig, tokenizer))) or tokenizer.unk_id in feats_row_ids:
        return "normalisation"
    return None


def _per_answer_examples(examples):
    out, where = [], []
    for ex in examples:
        seen = set()
        for text in ex.answers:
            if text in seen:
                continue
            seen.add(text)
            offset = ex.paragraph.context.find(text)
            w = ex.paragraph.char_to_word
            out.append(dataclasses.replace(ex, answer_text=text, start_word=int(w[offset]),
                                           end_word=int(w[offset + len(text) - 1])))
            where.append(offset)
    return out, where


def test_every_answer_round_trips(sample, tokenizer):
    examples, offsets = _per_answer_examples(sample)
    assert len(examples) > 800
    feats = convert_examples_to_features(examples, tokenizer)
    failures, explained = [], collections.Counter()
    for i, (ex, offset) in enumerate(zip(examples, offsets, strict=True)):
        rows = [r for r in np.flatnonzero(feats.example_index == i) if feats.start_positions[r] > 0]
        assert rows, ex.qas_id  # every answer fits some window
        for row in rows:
            s, e = int(feats.start_positions[row]), int(feats.end_positions[row])
            text = span_text(ex, feats, row, s, e, tokenizer)
            if normalize_answer(text) != normalize_answer(ex.answer_text):
                why = _irreducible(ex, ex.answer_text, offset, feats.input_ids[row, s:e + 1], tokenizer)
                if why is None:
                    failures.append((ex.qas_id, ex.answer_text, text))
                explained[why] += 1
                break
    assert failures == []
    assert sum(explained.values()) < 0.02 * len(examples), explained


def test_get_final_text_matches_reference(sample, tokenizer):
    rng = np.random.default_rng(3)
    for ex in sample[:200]:
        words = ex.paragraph.words
        a = int(rng.integers(len(words)))
        b = min(len(words) - 1, a + int(rng.integers(4)))
        orig = " ".join(words[a:b + 1])
        basic = ref_basic_tokenize(orig)
        if not basic:
            continue
        # a prediction made of some of the basic tokens, cut at random
        i = int(rng.integers(len(basic)))
        j = min(len(basic), i + 1 + int(rng.integers(3)))
        pred = " ".join(basic[i:j])
        pred = pred[int(rng.integers(2)):] if len(pred) > 2 else pred
        assert get_final_text(pred, orig, tokenizer) == ref_get_final_text(pred, orig)
    for pred, orig in [("broncos", "Denver Broncos."), ("1895", "(1895-1943)"), ("x", "Denver"), ("", "Denver"),
                       ("ecole", "École"), ("model", "model—\u200b\u200bmany")]:
        assert get_final_text(pred, orig, tokenizer) == ref_get_final_text(pred, orig)


def test_detokenize():
    assert detokenize(["the", "hu", "##gging", "face", "##s", "##!"]) == "the hugging faces!"


# ---------------------------------------------------------------------------------------------------------------
# Post-processing


def _peak_logits(feats, low=-10.0, high=10.0):
    start, end = np.full(feats.input_ids.shape, low), np.full(feats.input_ids.shape, low)
    rows = np.arange(len(feats))
    start[rows, feats.start_positions] = high
    end[rows, feats.end_positions] = high
    return start, end


def test_peak_logits_on_gold_span_give_gold_answers(sample, tokenizer, dev_path):
    feats = convert_examples_to_features(sample, tokenizer)
    predictions, nbest = postprocess_predictions(sample, feats, *_peak_logits(feats), tokenizer)
    assert set(predictions) == {ex.qas_id for ex in sample}
    ok, wrong = [], []
    for ex in sample:
        offset = ex.paragraph.context.find(ex.answer_text)
        n_tok = len(tokenizer.encode_batch([ex.answer_text])[0])
        reducible = _irreducible(ex, ex.answer_text, offset, [], tokenizer) is None and n_tok <= 30
        (ok if reducible else wrong).append(ex)
        assert nbest[ex.qas_id][0]["text"] == predictions[ex.qas_id]
    data = json.loads(dev_path.read_text(encoding="utf-8"))
    pick = lambda exs: {ex.qas_id: predictions[ex.qas_id] for ex in exs}
    on_ok = _evaluate_on(data, pick(ok))
    assert on_ok == {"exact_match": 100.0, "f1": 100.0}
    assert len(wrong) < 0.02 * len(sample)
    assert _evaluate_on(data, predictions)["exact_match"] > 98.0


def _evaluate_on(data, predictions):
    """The metric restricted to the questions in ``predictions``."""
    keep = {"data": [{"paragraphs": [{"context": p["context"], "qas": [q for q in p["qas"] if q["id"] in predictions]}
                                     for p in a["paragraphs"]]} for a in data["data"]]}
    return evaluate(keep, predictions)


@pytest.mark.parametrize("seed", [0, 1])
def test_postprocess_matches_reference_on_random_logits(sample, tokenizer, seed):
    examples = sample[:60]
    feats = convert_examples_to_features(examples, tokenizer, max_seq_length=128, doc_stride=48)
    rng = np.random.default_rng(seed)
    start = rng.normal(size=feats.input_ids.shape).round(1)  # rounding makes ties, which must keep run_squad's order
    end = rng.normal(size=feats.input_ids.shape).round(1)
    preds, nbest = postprocess_predictions(examples, feats, start, end, tokenizer, n_best_size=10,
                                           max_answer_length=12)
    for i, ex in enumerate(examples):
        rows = np.flatnonzero(feats.example_index == i)
        want = ref_nbest(ex, rows, feats, start, end, tokenizer.vocab, 10, 12)
        got = [(p["text"], p["start_logit"], p["end_logit"]) for p in nbest[ex.qas_id]]
        assert got == want, ex.qas_id
        probs = [p["probability"] for p in nbest[ex.qas_id]]
        scores = np.array([s + e for _, s, e in want])
        np.testing.assert_allclose(probs, np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum())
        assert preds[ex.qas_id] == want[0][0]


def _one_window(tokenizer, context="One two three four five six seven eight nine ten eleven twelve thirteen.",
                question="Which number?"):
    ex = SquadExample("q0", question, split_words(context), ("three",))
    feats = convert_examples_to_features([ex], tokenizer, max_seq_length=64, max_query_length=16)
    return ex, feats


def test_nbest_order_length_and_invalid_spans(tokenizer):
    ex, feats = _one_window(tokenizer)
    off = int(np.flatnonzero(feats.token_type_ids[0])[0])
    last_sep = int(feats.attention_mask[0].sum()) - 1
    assert feats.token_to_word[0, off:off + 10].tolist() == list(range(10))  # one token per word
    start, end = np.full((1, 64), -1000.0), np.full((1, 64), -1000.0)
    # the highest logits sit on [CLS], a question token, the last [SEP] and padding: never chosen
    for col in (0, 1, last_sep, 63):
        start[0, col] = end[0, col] = 100.0
    # the best start lies behind the best end: (9, 1) is not a span
    start[0, off + 9], end[0, off + 1] = 50.0, 50.0
    # valid spans: (2, 6) scores 20 + 12, (2, 3) 20 + 10, (4, 6) 15 + 12
    start[0, off + 2], start[0, off + 4] = 20.0, 15.0
    end[0, off + 3], end[0, off + 6] = 10.0, 12.0
    words = ex.paragraph.words
    preds, nbest = postprocess_predictions([ex], feats, start, end, tokenizer, n_best_size=20, max_answer_length=30)
    texts = [p["text"] for p in nbest["q0"]]
    assert texts[:3] == [" ".join(words[2:7]), " ".join(words[2:4]), " ".join(words[4:7])]
    scores = [p["start_logit"] + p["end_logit"] for p in nbest["q0"]]
    assert scores[:3] == [32.0, 30.0, 27.0] and scores == sorted(scores, reverse=True)
    assert all(s < -900 for s in scores[3:])
    assert len(texts) == len(set(texts)) <= 20
    assert preds["q0"] == " ".join(words[2:7])
    assert sum(p["probability"] for p in nbest["q0"]) == pytest.approx(1.0)
    # at most 4 tokens: (2, 6) is too long
    _, nbest = postprocess_predictions([ex], feats, start, end, tokenizer, max_answer_length=4)
    assert [p["text"] for p in nbest["q0"][:2]] == [" ".join(words[2:4]), " ".join(words[4:7])]
    # n_best_size bounds the list; candidates are the top logits over all positions, as in run_squad, so two
    # candidates that are both invalid leave nothing
    _, nbest = postprocess_predictions([ex], feats, start, end, tokenizer, n_best_size=2)
    assert [p["text"] for p in nbest["q0"]] == ["empty"]
    for col in (0, 1, last_sep, 63):
        start[0, col] = end[0, col] = -1000.0
    # top-2 starts (9, 2) and ends (1, 6): only (2, 6) is a span
    _, nbest = postprocess_predictions([ex], feats, start, end, tokenizer, n_best_size=2)
    assert [p["text"] for p in nbest["q0"]] == [" ".join(words[2:7])]
    _, nbest = postprocess_predictions([ex], feats, start, end, tokenizer, n_best_size=3)
    assert [p["text"] for p in nbest["q0"]] == [" ".join(words[2:7]), " ".join(words[2:4]), " ".join(words[4:7])]


def test_start_outside_max_context_is_never_chosen(tokenizer):
    context = " ".join(f"w{i}" for i in range(60))
    ex = SquadExample("q0", "Which?", split_words(context), ("w5",))
    feats = convert_examples_to_features([ex], tokenizer, max_seq_length=64, doc_stride=20, max_query_length=16)
    assert len(feats) > 1
    row = 1
    cols = np.flatnonzero((feats.token_to_word[row] >= 0) & ~feats.token_is_max_context[row])
    assert len(cols) > 0
    start, end = np.zeros(feats.input_ids.shape), np.zeros(feats.input_ids.shape)
    start[row, cols[0]] = end[row, cols[0]] = 100.0  # a token this window does not score
    _, nbest = postprocess_predictions([ex], feats, start, end, tokenizer)
    assert all(p["start_logit"] < 100.0 for p in nbest["q0"])


def test_no_valid_span_gives_empty(tokenizer):
    ex, feats = _one_window(tokenizer)
    start = np.zeros(feats.input_ids.shape)
    start[0, -1] = 100.0  # a single start candidate, in the padding
    preds, nbest = postprocess_predictions([ex], feats, start, np.zeros_like(start), tokenizer, n_best_size=1)
    assert preds == {"q0": "empty"} and nbest["q0"][0]["probability"] == 1.0


def test_write_predictions_feeds_squad_eval(tmp_path, tokenizer):
    ex, feats = _one_window(tokenizer)
    start, end = np.zeros((1, 64)), np.zeros((1, 64))
    off = int(np.flatnonzero(feats.token_type_ids[0])[0])
    start[0, off + 2] = end[0, off + 2] = 10.0
    preds, nbest = postprocess_predictions([ex], feats, start, end, tokenizer)
    paths = write_predictions(tmp_path / "out", preds, nbest)
    assert json.loads(paths["predictions"].read_text()) == {"q0": "three"}
    assert json.loads(paths["nbest"].read_text())["q0"][0]["text"] == "three"
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="output_dir"):
        write_predictions(tmp_path / "f", preds)


# ---------------------------------------------------------------------------------------------------------------
# Reading and bad inputs


def _squad(context="The Denver Broncos won Super Bowl 50.", answers=(("Denver Broncos", 4),), qid="q1", **qa_extra):
    qa = {"id": qid, "question": "Who won?", "answers": [{"text": t, "answer_start": s} for t, s in answers]}
    qa.update(qa_extra)
    return {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": context, "qas": [qa]}]}]}


def test_answer_offsets_exact_moved_and_missing(caplog):
    data = load_squad(_squad())
    ex = data.examples[0]
    assert (ex.answer_text, ex.start_word, ex.end_word) == ("Denver Broncos", 1, 2) and data.stats["exact"] == 1
    # a wrong offset: the nearest occurrence of the text is used (here the second "Broncos", nearer to 30)
    ctx = "Broncos fans saw the Broncos win."
    data = load_squad(_squad(ctx, (("Broncos", 30),)))
    assert (data.examples[0].start_word, data.stats["moved"]) == (4, 1)
    data = load_squad(_squad(ctx, (("Broncos", 10),)))  # equally far from both: the earlier one
    assert data.examples[0].start_word == 0
    # a text that is not in the context: counted, logged, question kept for evaluation, dropped for training
    with caplog.at_level(logging.WARNING, logger="jonebit.data.squad"):
        data = load_squad(_squad(answers=(("Patriots", 0), ("Broncos", 11))))
    assert data.stats["not_found"] == 1 and data.examples[0].answer_text == "Broncos"
    assert "1 not in the context" in caplog.text
    data = load_squad(_squad(answers=(("Patriots", 0),)))
    assert data.examples[0].answer_text is None and data.examples[0].answers == ("Patriots",)
    data = load_squad(_squad(answers=(("Patriots", 0),)), is_training=True)
    assert data.examples == [] and data.stats["dropped_examples"] == 1
    # found, but run_squad's whitespace-cleaned answer ("10 km") is not in its words ("10\u00a0km")
    data = load_squad(_squad("It is 10\u00a0km long.", (("10\u00a0km", 6),)), is_training=True)
    assert (data.stats["unaligned"], data.stats["dropped_examples"]) == (1, 1)
    # a training question without a target gets [CLS] targets in evaluation features
    feats = convert_examples_to_features(load_squad(_squad(answers=(("Patriots", 0),))).examples, _toy_tokenizer())
    assert (feats.start_positions == 0).all() and (feats.end_positions == 0).all()


def _toy_tokenizer():
    from tokenizers import BertWordPieceTokenizer

    from jonebit.data.tokenization import SPECIAL_TOKENS, WordPiece

    vocab = list(SPECIAL_TOKENS) + ["the", "denver", "broncos", "won", "super", "bowl", "50", ".", "who", "?"]
    return WordPiece(BertWordPieceTokenizer({t: i for i, t in enumerate(vocab)}), tuple(vocab))


@pytest.mark.parametrize("data, error, match", [
    ([1, 2], ValueError, "the top level should be an object with a 'data' list"),
    ({"version": "1.1"}, ValueError, "the top level should be an object with a 'data' list"),
    ({"data": [{"title": "x"}]}, ValueError, r"data\[0\] should be an article object with a 'paragraphs' list"),
    ({"data": [{"paragraphs": [{"qas": []}]}]}, ValueError, r"paragraphs\[0\] should be an object with a 'context'"),
    ({"data": [{"paragraphs": [{"context": " \n", "qas": []}]}]}, ValueError, r"context should be a non-empty text"),
    ({"data": [{"paragraphs": [{"context": "x", "qas": [{"question": "?", "answers": []}]}]}]}, ValueError,
     r"qas\[0\] should be a question object with string 'id'"),
    ({"data": [{"paragraphs": [{"context": "x", "qas": [{"id": "q", "question": "?"}]}]}]}, ValueError,
     r"qas\[0\]\.answers should be a list"),
    (_squad(answers=(("Denver", None),)), ValueError, r"answers\[0\] should be an object with a non-empty 'text' and"),
    (_squad(answers=(("Denver", True),)), ValueError, r"answers\[0\] should be .* integer 'answer_start'"),
    (_squad(answers=(("", 0),)), ValueError, r"answers\[0\] should be an object with a non-empty 'text'"),
    (_squad(is_impossible=True), ValueError, "is_impossible, SQuAD v2.0"),
])
def test_bad_squad_json(data, error, match):
    with pytest.raises(error, match=match):
        load_squad(data)


def test_bad_files_and_duplicates(tmp_path):
    with pytest.raises(FileNotFoundError, match="no SQuAD file at .*squad-download"):
        load_squad(tmp_path / "absent.json")
    (tmp_path / "x.json").write_text("hello")
    with pytest.raises(ValueError, match="does not parse as JSON"):
        load_squad(tmp_path / "x.json")
    data = _squad()
    data["data"].append(_squad()["data"][0])
    with pytest.raises(ValueError, match="question id 'q1' appears twice"):
        load_squad(data)


def test_bad_feature_and_postprocess_arguments(tokenizer):
    ex, feats = _one_window(tokenizer)
    with pytest.raises(ValueError, match=r"max_seq_length \(20\) must be at least max_query_length \+ 4"):
        convert_examples_to_features([ex], tokenizer, max_seq_length=20, max_query_length=64)
    with pytest.raises(ValueError, match="doc_stride must be a positive int"):
        convert_examples_to_features([ex], tokenizer, doc_stride=0)
    with pytest.raises(TypeError, match="tokenizer: expected a jonebit.data.tokenization.WordPiece"):
        convert_examples_to_features([ex], tokenizer.tokenizer)
    with pytest.raises(ValueError, match=r"must have the features' shape \(1, 64\)"):
        postprocess_predictions([ex], feats, np.zeros((1, 63)), np.zeros((1, 64)), tokenizer)
    with pytest.raises(ValueError, match="n_best_size must be a positive int"):
        postprocess_predictions([ex], feats, np.zeros((1, 64)), np.zeros((1, 64)), tokenizer, n_best_size=0)
    with pytest.raises(ValueError, match="only 0 examples were given"):
        postprocess_predictions([], feats, np.zeros((1, 64)), np.zeros((1, 64)), tokenizer)


def test_shared_train_file_offsets(shared_data, caplog):
    path = shared_data / "squad" / "train-v1.1.json"
    if not path.is_file():
        pytest.skip("train-v1.1.json not present")
    with caplog.at_level(logging.INFO, logger="jonebit.data.squad"):
        data = load_squad(path, is_training=True)
    s = data.stats
    total = s["exact"] + s["moved"] + s["not_found"] + s["unaligned"]
    assert total >= 87_000 and len(data) + s["dropped_examples"] == 87_599
    assert s["dropped_examples"] < 0.005 * 87_599
    assert "SQuAD: " in caplog.text
    for ex in data.examples[::997]:  # the located answer lies in its words
        span = " ".join(ex.paragraph.words[ex.start_word:ex.end_word + 1])
        assert " ".join(ex.answer_text.split()) in span
