"""Training a WordPiece vocabulary deterministically.

The vocabulary is learned as BERT's WordPiece trainers learn it (the ``tokenizers`` library's ``WordPieceTrainer``
is the same procedure): every word starts as its characters, all but the first carrying the ``##`` prefix; the
most frequent adjacent pair of symbols is merged into a new token, again and again, until the vocabulary is full
or no pair occurs ``min_frequency`` times.

What differs is the tie. When two pairs are equally frequent, both pick the pair whose symbols have the smallest
ids, and ids are given in order of appearance: the special tokens, the alphabet's characters (by code point), the
``##`` continuations, then each merged token as it is made. ``tokenizers`` numbers the ``##`` continuations in
hash-map order, which changes from process to process, so two identical runs trained different vocabularies (a few
tokens at the size cutoff, and the merges that follow them). Here they are numbered by code point, and nothing depends
on the iteration order of a hash, so a corpus always gives the same vocabulary.

Merging is incremental: each merge visits only the words that contain the pair and updates the pair counts of those
words; a heap with lazy deletion finds the next pair.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Iterable, Sequence

PREFIX = "##"


def count_words(texts: Iterable[str]) -> dict[str, int]:
    """How often each word occurs, after BERT uncased normalisation and pre-tokenisation.

    The normaliser cleans control characters, spaces CJK characters, strips accents and lower-cases; the
    pre-tokeniser splits on whitespace and punctuation (both from ``tokenizers``, as encoding does).
    """
    from tokenizers import normalizers, pre_tokenizers

    normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=True,
                                            lowercase=True)
    pre = pre_tokenizers.BertPreTokenizer()
    counts: collections.Counter[str] = collections.Counter()
    for text in texts:
        counts.update(word for word, _ in pre.pre_tokenize_str(normalizer.normalize_str(text)))
    return dict(counts)


def _merge(word: list[str], a: str, b: str, new: str) -> list[str]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def learn_vocabulary(word_counts: dict[str, int], vocab_size: int, *, special_tokens: Sequence[str],
                     min_frequency: int = 2, limit_alphabet: int = 1000, progress: bool = False) -> list[str]:
    """The WordPiece vocabulary of ``word_counts``: the special tokens, the alphabet, then the merges in order.

    Args:
      word_counts: word -> occurrences (:func:`count_words`).
      vocab_size: the most tokens to return (special tokens and alphabet included; an alphabet larger than that
        is kept whole).
      special_tokens: tokens placed first.
      min_frequency: merging stops when the most frequent pair occurs fewer times than this.
      limit_alphabet: the most characters kept (the most frequent, ties by character); a word with any other
        character is left out of the merges (it tokenizes to ``[UNK]``).
      progress: show a progress bar over the merges.
    """
    chars: collections.Counter[str] = collections.Counter()
    for word, n in word_counts.items():
        for c in word:
            chars[c] += n
    alphabet = set(sorted(chars, key=lambda c: (-chars[c], c))[:limit_alphabet])
    words, counts = [], []
    for word in sorted(word_counts):
        if word and all(c in alphabet for c in word):
            words.append([word[0], *(PREFIX + c for c in word[1:])])
            counts.append(word_counts[word])

    vocab = list(special_tokens)
    symbols = {s for w in words for s in w}
    starts = sorted(s for s in symbols if not s.startswith(PREFIX))
    vocab += [s for s in starts if s not in vocab]
    vocab += sorted(s for s in symbols if s.startswith(PREFIX) and s not in vocab)
    ids = {s: i for i, s in enumerate(vocab)}  # the tie-break: smaller ids first

    pair_count: collections.defaultdict[tuple[str, str], int] = collections.defaultdict(int)
    where: collections.defaultdict[tuple[str, str], set[int]] = collections.defaultdict(set)
    for i, w in enumerate(words):
        for pair in itertools.pairwise(w):
            pair_count[pair] += counts[i]
            where[pair].add(i)
    heap = [(-n, ids[a], ids[b], (a, b)) for (a, b), n in pair_count.items()]
    heapq.heapify(heap)

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=max(0, vocab_size - len(vocab)), desc="WordPiece merges", unit="token")
    while len(vocab) < vocab_size and heap:
        neg, id_a, id_b, pair = heapq.heappop(heap)
        n = pair_count.get(pair, 0)
        if -neg != n:  # stale entry: its count changed since it was pushed
            if n > 0:
                heapq.heappush(heap, (-n, id_a, id_b, pair))
            continue
        if n < min_frequency:
            break
        a, b = pair
        new = a + b[len(PREFIX):]
        if new not in ids:  # two merge paths can spell the same token: it is counted once
            ids[new] = len(vocab)
            vocab.append(new)
            if bar is not None:
                bar.update(1)
        changed = set()
        for i in sorted(where.pop(pair)):
            old, c = words[i], counts[i]
            merged = _merge(old, a, b, new)
            if len(merged) == len(old):
                continue  # an index left behind by an earlier merge of this word
            for q in itertools.pairwise(old):
                pair_count[q] -= c
            for q in itertools.pairwise(merged):
                pair_count[q] += c
                where[q].add(i)
                changed.add(q)
            words[i] = merged
        pair_count.pop(pair, None)
        for q in sorted(changed):
            if pair_count[q] > 0:
                heapq.heappush(heap, (-pair_count[q], ids[q[0]], ids[q[1]], q))
    if bar is not None:
        bar.close()
    return vocab
