"""The deterministic WordPiece trainer against a brute-force reference, and across processes."""

import itertools
import os
import subprocess
import sys

import pytest

from jonebit.data.tokenization import SPECIAL_TOKENS, train_wordpiece
from jonebit.data.wordpiece_training import count_words, learn_vocabulary


def _reference(word_counts, vocab_size, min_frequency):
    """The procedure stated plainly: recount every pair after every merge, take the most frequent, ties to the
    smallest symbol ids (specials, start characters by code point, ## continuations by code point, merges in
    order)."""
    words = {w: [w[0], *("##" + c for c in w[1:])] for w in word_counts}
    vocab = list(SPECIAL_TOKENS)
    symbols = {s for w in words.values() for s in w}
    vocab += sorted(s for s in symbols if not s.startswith("##"))
    vocab += sorted(s for s in symbols if s.startswith("##"))
    while len(vocab) < vocab_size:
        counts = {}
        for w, parts in words.items():
            for pair in itertools.pairwise(parts):
                counts[pair] = counts.get(pair, 0) + word_counts[w]
        if not counts:
            break
        pair = min(counts, key=lambda p: (-counts[p], vocab.index(p[0]), vocab.index(p[1])))
        if counts[pair] < min_frequency:
            break
        new = pair[0] + pair[1][2:]
        if new not in vocab:
            vocab.append(new)
        for w, parts in words.items():
            out, i = [], 0
            while i < len(parts):
                if parts[i:i + 2] == list(pair):
                    out.append(new)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            words[w] = out
    return vocab


TEXT = ("The lowest and the newest widths were lower than the widest; low, lower, lowest. "
        "A banana and an ananas: bandana bands. Aaaa aaaa aa a! Tokens tokenize tokenized tokenizers.")


@pytest.mark.parametrize("vocab_size,min_frequency", [(40, 1), (60, 2), (500, 1)])
def test_matches_the_brute_force_procedure(vocab_size, min_frequency):
    counts = count_words([TEXT] * 3 + ["banana split"])
    got = learn_vocabulary(counts, vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=min_frequency)
    assert got == _reference(counts, vocab_size, min_frequency)
    assert len(got) == len(set(got)) and len(got) <= max(vocab_size, len(_reference(counts, 0, 1)))


def test_words_are_normalised_and_split_as_bert_uncased():
    assert count_words(["Café, CAFÉ!  café"]) == {"cafe": 3, ",": 1, "!": 1}


def test_a_classic_example_by_hand():
    # low x5, lower x2, newest x6, widest x3: the alphabet is l n w and ##o ##w ##e ##r ##s ##t ##i ##d (11).
    # Pair counts: (##e, ##s) 9 (newest 6 + widest 3), (##s, ##t) 9, (##w, ##e) 8, (l, ##o) 7, (##o, ##w) 7, ...
    # The tie at 9 goes to the smaller ids, ##e before ##s: (##e, ##s) -> ##es; then (##es, ##t) 9 -> ##est;
    # then (##w, ##e) has lost newest's ##e and counts 2, so (l, ##o) 7 -> lo (l's id is smaller than ##o's).
    counts = {"low": 5, "lower": 2, "newest": 6, "widest": 3}
    vocab = learn_vocabulary(counts, len(SPECIAL_TOKENS) + 11 + 3, special_tokens=SPECIAL_TOKENS, min_frequency=1)
    assert vocab[len(SPECIAL_TOKENS):] == ["l", "n", "w", "##d", "##e", "##i", "##o", "##r", "##s", "##t", "##w",
                                           "##es", "##est", "lo"]


def test_identical_runs_train_identical_vocabularies(tmp_path):
    """Two processes with different hash seeds (set and dict iteration orders) train the same vocabulary."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXT.split(". ") * 20))
    code = ("import sys; from jonebit.data.tokenization import train_wordpiece; "
            "print(train_wordpiece(open(sys.argv[1]).read().splitlines(), 120).fingerprint())")
    prints = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code, str(corpus)], env=env, capture_output=True, text=True,
                             check=True)
        prints.append(out.stdout.strip())
    assert prints[0] == prints[1] == train_wordpiece(corpus.read_text().splitlines(), 120).fingerprint()


def test_a_word_outside_the_alphabet_limit_is_left_out():
    counts = {"ab": 10, "aq": 1}
    vocab = learn_vocabulary(counts, 100, special_tokens=SPECIAL_TOKENS, min_frequency=1, limit_alphabet=2)
    assert "##q" not in vocab and "aq" not in vocab and "ab" in vocab
