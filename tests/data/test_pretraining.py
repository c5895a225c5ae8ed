"""Pre-training instances against hand-checkable structure.

Documents are built so that every token id tells its document and position: document d uses the ids
``BASE + 40 d .. BASE + 40 d + 39`` in increasing order, so the original text of any instance shows whether an
"is next" pair stays inside one document and follows on, and whether a "random next" B comes from elsewhere.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from jonebit.data.pretraining import (
    PretrainingData,
    PretrainingOptions,
    build_pretraining_data,
    collate,
    create_instances,
    split_sentences,
)
from jonebit.data.tokenization import SPECIAL_TOKENS, WordPiece, load_wordpiece, train_wordpiece

BASE, PER_DOC, DOCS = 5, 40, 12
SHARED_VOCAB = pathlib.Path(__file__).resolve().parents[2].parent / "shared/data/vocab/bert-base-uncased-vocab.txt"


def _tokenizer(vocab_size=BASE + PER_DOC * DOCS, continuation=()) -> WordPiece:
    from tokenizers import BertWordPieceTokenizer

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for i in range(BASE, vocab_size):
        vocab[("##" if i in continuation else "") + f"w{i}"] = i
    return WordPiece(BertWordPieceTokenizer(vocab), tuple(sorted(vocab, key=vocab.get)))


def _documents(rng, sentence_lengths=(3, 9)):
    docs = []
    for d in range(DOCS):
        ids = np.arange(BASE + PER_DOC * d, BASE + PER_DOC * (d + 1))
        cuts = []
        pos = 0
        while pos < PER_DOC:
            step = int(rng.integers(*sentence_lengths))
            cuts.append(ids[pos:pos + step])
            pos += step
        docs.append([c for c in cuts if len(c)])
    return docs


def _original(inst_ids, positions, labels, count):
    ids = inst_ids.astype(np.int64).copy()
    ids[positions[:count]] = labels[:count]
    return ids


def _doc_of(ids):
    return (np.asarray(ids) - BASE) // PER_DOC


OPTS = PretrainingOptions(max_seq_length=24, max_predictions_per_seq=5, dupe_factor=40, seed=1)


@pytest.fixture(scope="module")
def instances():
    tok = _tokenizer()
    return tok, create_instances(_documents(np.random.default_rng(0)), tok, OPTS, progress=False)


def test_layout_special_tokens_types_and_padding(instances):
    tok, out = instances
    n = len(out["input_ids"])
    assert n > 500
    for i in range(n):
        L = int(out["lengths"][i])
        ids, types = out["input_ids"][i], out["token_type_ids"][i]
        assert 5 <= L <= OPTS.max_seq_length
        assert ids[0] == tok.cls_id and ids[L - 1] == tok.sep_id
        seps = np.flatnonzero(ids[:L] == tok.sep_id)
        assert len(seps) == 2, ids[:L]
        assert np.all(types[:seps[0] + 1] == 0) and np.all(types[seps[0] + 1:L] == 1)
        assert np.all(ids[L:] == 0) and np.all(types[L:] == 0)


def test_masking_counts_positions_and_80_10_10(instances):
    tok, out = instances
    replaced = kept = random = 0
    for i in range(len(out["input_ids"])):
        L, c = int(out["lengths"][i]), int(out["masked_lm_count"][i])
        assert c == min(OPTS.max_predictions_per_seq, max(1, round(L * OPTS.masked_lm_prob)))
        pos = out["masked_lm_positions"][i, :c]
        assert np.all(np.diff(pos) > 0)  # sorted, no duplicates
        labels = out["masked_lm_ids"][i, :c]
        assert not np.any(np.isin(labels, [tok.cls_id, tok.sep_id]))  # never [CLS]/[SEP]
        seen = out["input_ids"][i, pos]
        replaced += int(np.sum(seen == tok.mask_id))
        kept += int(np.sum(seen == labels))
        random += int(np.sum((seen != tok.mask_id) & (seen != labels)))
    total = replaced + kept + random
    for got, p in ((replaced, 0.8), (kept, 0.1), (random, 0.1)):
        # 5 standard deviations of a binomial(total, p); a random replacement equal to the original counts as
        # "kept" (probability 1/vocab), well inside the bound.
        assert abs(got - p * total) < 5 * np.sqrt(total * p * (1 - p)) + total / tok.vocab_size, (got, p, total)


def test_next_sentence_pairs_balance_and_no_leakage(instances):
    tok, out = instances
    labels = out["next_sentence_labels"]
    n = len(labels)
    frac = labels.mean()
    # A chunk of a single sentence always takes a random B (as in Google's script); with these short documents
    # (about 2 chunks each, the last often a single sentence) that lifts the rate above one half.
    assert 0.5 - 5 * np.sqrt(0.25 / n) < frac < 0.66, frac
    for i in range(n):
        L, c = int(out["lengths"][i]), int(out["masked_lm_count"][i])
        orig = _original(out["input_ids"][i, :L], out["masked_lm_positions"][i], out["masked_lm_ids"][i], c)
        sep = int(np.flatnonzero(orig == tok.sep_id)[0])
        a, b = orig[1:sep], orig[sep + 1:L - 1]
        assert len(a) and len(b)
        assert np.all(np.diff(a) == 1), a  # A is a contiguous run of one document (trimming only cuts its ends)
        assert np.all(np.diff(b) == 1), b
        assert len(set(_doc_of(a))) == 1 and len(set(_doc_of(b))) == 1
        if labels[i] == 0:  # is next: same document, B after A
            assert _doc_of(a)[0] == _doc_of(b)[0] and a[-1] < b[0]
        else:
            assert _doc_of(a)[0] != _doc_of(b)[0]


def test_short_sequences_appear_at_the_short_seq_rate(instances):
    _, out = instances
    long_target = OPTS.max_seq_length - 3
    short = np.mean(out["lengths"] - 3 < long_target * 0.5)
    assert 0.02 < short < 0.5


def test_whole_word_masking_masks_all_pieces():
    cont = set(range(BASE + 1, BASE + PER_DOC * DOCS, 3))  # every third id continues the word before it
    tok = _tokenizer(continuation=cont)
    opts = PretrainingOptions(max_seq_length=24, max_predictions_per_seq=6, dupe_factor=10, whole_word_mask=True)
    out = create_instances(_documents(np.random.default_rng(1)), tok, opts, progress=False)
    is_cont = np.asarray(tok.is_continuation())
    checked = 0
    for i in range(len(out["input_ids"])):
        L, c = int(out["lengths"][i]), int(out["masked_lm_count"][i])
        orig = _original(out["input_ids"][i, :L], out["masked_lm_positions"][i], out["masked_lm_ids"][i], c)
        masked = set(out["masked_lm_positions"][i, :c].tolist())
        for p in masked:
            if p + 1 < L and is_cont[orig[p + 1]] and orig[p + 1] != tok.sep_id:
                assert p + 1 in masked, (orig, masked)
                checked += 1
            if is_cont[orig[p]]:
                assert p - 1 in masked or orig[p - 1] in (tok.cls_id, tok.sep_id)
    assert checked > 50


def test_deterministic_for_a_seed():
    tok = _tokenizer()
    docs = _documents(np.random.default_rng(0))
    opts = PretrainingOptions(max_seq_length=24, dupe_factor=2, seed=7)
    a = create_instances(docs, tok, opts, progress=False)
    b = create_instances(docs, tok, opts, progress=False)
    c = create_instances(docs, tok, PretrainingOptions(max_seq_length=24, dupe_factor=2, seed=8), progress=False)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["input_ids"], c["input_ids"])


def test_collate_labels_match_positions(instances):
    tok, out = instances
    rows = {k: v[:16] for k, v in out.items()}
    batch = collate(rows)
    for i in range(16):
        c = int(rows["masked_lm_count"][i])
        pos = rows["masked_lm_positions"][i, :c]
        assert np.array_equal(np.flatnonzero(batch["labels"][i] >= 0), pos)
        assert np.array_equal(batch["labels"][i, pos], rows["masked_lm_ids"][i, :c])
        assert batch["attention_mask"][i].sum() == rows["lengths"][i]
        assert batch["masked_lm_weights"][i].sum() == c
    assert batch["input_ids"].dtype == np.int32


def test_split_sentences():
    assert split_sentences("It rained. Then it stopped! Did it? Yes.") == ["It rained.", "Then it stopped!",
                                                                           "Did it?", "Yes."]
    assert split_sentences('He said "go." 3 men went.') == ['He said "go."', "3 men went."]
    assert split_sentences("pi is 3.14 and e is 2.72.") == ["pi is 3.14 and e is 2.72."]
    assert split_sentences("   ") == []


def _corpus(tmp_path):
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda"]
    lines = []
    for _ in range(30):
        for _ in range(3):
            lines.append(" ".join(" ".join(rng.choice(words, 6)).capitalize() + "." for _ in range(4)))
        lines.append("")
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines))
    return path


def test_build_reuse_refuse_and_load(tmp_path):
    corpus = _corpus(tmp_path)
    tok = train_wordpiece(open(corpus).read().splitlines(), vocab_size=120)
    opts = PretrainingOptions(max_seq_length=32, dupe_factor=2, heldout_documents=3)
    out = build_pretraining_data([corpus], tok, tmp_path / "data", opts, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["instances"]["train"] > 0 and manifest["instances"]["heldout"] > 0
    assert manifest["stats"]["instances_per_second"] > 0
    stamp = (out / "train" / "input_ids.npy").stat().st_mtime_ns
    assert build_pretraining_data([corpus], tok, tmp_path / "data", opts, progress=False) == out
    assert (out / "train" / "input_ids.npy").stat().st_mtime_ns == stamp  # reused, not rebuilt
    with pytest.raises(ValueError, match=r"built differently \(option dupe_factor: cached 2, requested 3\)"):
        build_pretraining_data([corpus], tok, tmp_path / "data",
                               PretrainingOptions(max_seq_length=32, dupe_factor=3, heldout_documents=3),
                               progress=False)
    data = PretrainingData(out)
    assert isinstance(data.arrays["input_ids"], np.memmap)
    assert len(data) == manifest["instances"]["train"]
    it = data.batches(8, seed=3)
    first = next(it)
    assert first["input_ids"].shape == (8, 32)
    state = it.get_state()
    second = next(it)
    again = data.batches(8, seed=3)
    again.set_state(state)
    assert np.array_equal(next(again)["input_ids"], second["input_ids"])
    # Two processes each read their half of the same global batch.
    halves = [next(data.batches(8, seed=3, shard=(p, 2)))["input_ids"] for p in range(2)]
    assert np.array_equal(np.concatenate(halves), first["input_ids"])
    held = PretrainingData(out, "heldout")
    assert len(held) == manifest["instances"]["heldout"]


def test_evaluation_splits_leave_out_training_sentences(tmp_path):
    """The validation and held-out splits are the last documents, and no sentence of theirs occurs in training.

    Documents 0-7 are distinct random sentences; documents 8-9 (validation) and 10-11 (held-out) each copy two
    sentences of document 0 beside their own. The evaluation instances must hold every own sentence and none of
    the copies (their ids are looked for in the instances' token rows), and the manifest counts the copies.
    """
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(BASE, BASE + PER_DOC * DOCS)]
    sentence = lambda: " ".join(rng.choice(words, 7)) + "."  # noqa: E731
    docs = [[sentence() for _ in range(4)] for _ in range(12)]
    copies = docs[0][:2]
    for d in docs[8:]:
        d[1:1] = copies
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join("\n".join(d) for d in docs) + "\n")
    tok = _tokenizer()
    opts = PretrainingOptions(max_seq_length=128, dupe_factor=1, heldout_documents=2, validation_documents=2,
                              heldout_dupe_factor=3, masked_lm_prob=0.01, max_predictions_per_seq=1)
    out = build_pretraining_data([corpus], tok, tmp_path / "data", opts, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["deduplicated_sentences"] == {"validation": 4, "heldout": 4}

    def text_of(split):  # each instance's ids with the masked positions restored, as one string per instance
        data = PretrainingData(out, split)
        rows = []
        for i in range(len(data)):
            ids = np.array(data.arrays["input_ids"][i][:data.arrays["lengths"][i]], np.int64)
            n = data.arrays["masked_lm_count"][i]
            ids[data.arrays["masked_lm_positions"][i][:n]] = data.arrays["masked_lm_ids"][i][:n]
            rows.append(" " + " ".join(map(str, ids)) + " ")
        return rows

    def ids(s):
        return " " + " ".join(str(t) for t in tok.encode_batch([s])[0]) + " "

    for split, own in (("validation", docs[8:10]), ("heldout", docs[10:12])):
        rows = text_of(split)
        assert manifest["instances"][split] == len(rows)
        for s in copies:
            assert not any(ids(s) in r for r in rows), f"a training sentence is in the {split} split"
        for d in own:
            for s in (d[0], d[-1]):  # the documents' own sentences are kept, once per masking pass at least
                assert sum(ids(s) in r for r in rows) >= 3
    train = text_of("train")
    assert all(ids(s) in "".join(train) for s in copies)  # the copies' originals are still trained on


def test_bad_inputs(tmp_path):
    corpus = _corpus(tmp_path)
    tok = _tokenizer()
    table = [
        (lambda: PretrainingOptions(max_seq_length=4), ValueError, r"max_seq_length must be an int >= 8"),
        (lambda: PretrainingOptions(masked_lm_prob=1.5), ValueError, r"masked_lm_prob must be a probability"),
        (lambda: PretrainingOptions(masked_lm_prob=0), ValueError, r"masked_lm_prob must be > 0"),
        (lambda: PretrainingOptions(whole_word_mask="yes"), TypeError, r"whole_word_mask must be a bool"),
        (lambda: create_instances([[np.arange(5, 9)]], tok, OPTS, progress=False), ValueError,
         r"at least 2 documents"),
        (lambda: build_pretraining_data([tmp_path / "missing.txt"], tok, tmp_path / "d"), FileNotFoundError,
         r"no corpus file at .*missing.txt"),
        (lambda: build_pretraining_data([corpus], tok, tmp_path / "d2", PretrainingOptions(heldout_documents=29)),
         ValueError, r"heldout_documents=29 and validation_documents=0 leave fewer than 2"),
        (lambda: PretrainingData(tmp_path), FileNotFoundError, r"not a pre-training data directory"),
        (lambda: load_wordpiece(tmp_path / "vocab.txt"), FileNotFoundError, r"no vocabulary file"),
        (lambda: train_wordpiece(["a b"], vocab_size=10), ValueError, r"vocab_size must be an int >= 100"),
    ]
    (tmp_path / "notdata").mkdir()
    (tmp_path / "notdata" / "x").write_text("x")
    table.append((lambda: build_pretraining_data([corpus], tok, tmp_path / "notdata"), FileExistsError,
                  r"is not empty and has no manifest.json"))
    vocab = tmp_path / "nospecial.txt"
    vocab.write_text("a\nb\n")
    table.append((lambda: load_wordpiece(vocab), ValueError, r"lacks the special tokens"))
    for call, exc, pattern in table:
        with pytest.raises(exc, match=pattern):
            call()


@pytest.mark.skipif(not SHARED_VOCAB.is_file(), reason="../shared/data/vocab not present")
def test_bert_uncased_vocab_ids():
    tok = load_wordpiece(SHARED_VOCAB)
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 100, 101, 102, 103)
    assert tok.vocab_size == 30522
    assert tok.encode_batch(["Hello, World!"])[0] == [7592, 1010, 2088, 999]
    assert tok.encode_batch(["CAFÉ"])[0] == tok.encode_batch(["cafe"])[0]  # lower-cased, accents stripped


def test_trained_vocabulary_has_a_canonical_order(tmp_path):
    """The ids follow a canonical order (special tokens, then the rest sorted), and encoding agrees with the
    ``tokenizers`` tokenizer built on them."""
    from jonebit.apps.pretrain import embedded_corpus
    from jonebit.data.pretraining import iter_texts

    corpus = embedded_corpus(tmp_path / "corpus.txt")
    tok = train_wordpiece(iter_texts([corpus]), 2000)
    assert tok.vocab[: len(SPECIAL_TOKENS)] == SPECIAL_TOKENS
    assert list(tok.vocab[len(SPECIAL_TOKENS):]) == sorted(tok.vocab[len(SPECIAL_TOKENS):])
    sentence = "Return the number of items in a container."
    ids = tok.encode_batch([sentence])[0]
    assert [tok.vocab[i] for i in ids] == tok.tokenizer.encode(sentence, add_special_tokens=False).tokens
    assert len(ids) < len(sentence.split()) * 2  # real subwords, not characters
