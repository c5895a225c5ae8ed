"""BERT WordPiece tokenization (uncased) with the ``tokenizers`` library.

A tokenizer comes from a ``vocab.txt`` (:func:`load_wordpiece`) or is trained on a corpus
(:func:`train_wordpiece`, used by the embedded default so that no download is needed). Both lower-case, strip
accents and split punctuation as BERT uncased does; ``[PAD]``, ``[UNK]``, ``[CLS]``, ``[SEP]``, ``[MASK]``
must be in the vocabulary.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
from collections.abc import Iterable

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


@dataclasses.dataclass(frozen=True)
class WordPiece:
    """A WordPiece tokenizer and the ids of its special tokens.

    Attributes:
      tokenizer: a ``tokenizers.BertWordPieceTokenizer``.
      vocab: the tokens in id order.
    """

    tokenizer: object
    vocab: tuple[str, ...]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def id(self, token: str) -> int:
        return self.tokenizer.token_to_id(token)

    @property
    def pad_id(self) -> int:
        return self.id("[PAD]")

    @property
    def cls_id(self) -> int:
        return self.id("[CLS]")

    @property
    def sep_id(self) -> int:
        return self.id("[SEP]")

    @property
    def mask_id(self) -> int:
        return self.id("[MASK]")

    @property
    def unk_id(self) -> int:
        return self.id("[UNK]")

    def fingerprint(self) -> str:
        """sha256 of the vocabulary (in id order) and the normalisation settings: names a tokenization."""
        h = hashlib.sha256("\n".join(self.vocab).encode())
        h.update(b"|uncased|strip_accents")
        return h.hexdigest()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens."""
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def is_continuation(self) -> list[bool]:
        """Per id: whether the token continues a word (``##`` prefix), for whole-word masking."""
        return [t.startswith("##") for t in self.vocab]

    def save_vocab(self, path: str | os.PathLike) -> pathlib.Path:
        path = pathlib.Path(path)
        path.write_text("".join(t + "\n" for t in self.vocab), encoding="utf-8")
        return path


def _wrap(tokenizer) -> WordPiece:
    vocab = tokenizer.get_vocab()
    ordered = [None] * len(vocab)
    for token, i in vocab.items():
        ordered[i] = token
    if any(t is None for t in ordered):
        raise ValueError("the vocabulary's ids are not contiguous from 0")
    missing = [t for t in SPECIAL_TOKENS if t not in vocab]
    if missing:
        raise ValueError(f"the vocabulary lacks the special tokens {missing}; a BERT vocabulary needs "
                         f"{list(SPECIAL_TOKENS)}")
    return WordPiece(tokenizer, tuple(ordered))


def load_wordpiece(vocab_file: str | os.PathLike) -> WordPiece:
    """The uncased BERT tokenizer of a ``vocab.txt`` (one token per line, line number = id)."""
    from tokenizers import BertWordPieceTokenizer

    path = pathlib.Path(vocab_file)
    if not path.is_file():
        raise FileNotFoundError(f"no vocabulary file at {path} (a BERT vocab.txt: one token per line)")
    lines = path.read_text(encoding="utf-8").splitlines()
    if len(set(lines)) != len(lines):
        dup = next(t for i, t in enumerate(lines) if t in lines[:i])
        raise ValueError(f"{path}: token {dup!r} appears twice; ids would be ambiguous")
    missing = [t for t in SPECIAL_TOKENS if t not in set(lines)]
    if missing:
        raise ValueError(f"{path}: the vocabulary lacks the special tokens {missing}; a BERT vocabulary needs "
                         f"{list(SPECIAL_TOKENS)}")
    tok = BertWordPieceTokenizer(str(path), lowercase=True, strip_accents=True, clean_text=True,
                                 handle_chinese_chars=True)
    return _wrap(tok)


def train_wordpiece(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2,
                    progress: bool = False) -> WordPiece:
    """Trains an uncased WordPiece vocabulary of at most ``vocab_size`` tokens on ``texts``, deterministically.

    The same texts always give the same vocabulary in the same order (special tokens first, the rest sorted):
    see :mod:`jonebit.data.wordpiece_training` for the procedure and why ``tokenizers``' own trainer is not used.
    """
    from tokenizers import BertWordPieceTokenizer

    from jonebit.data.wordpiece_training import count_words, learn_vocabulary

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 100:
        raise ValueError(f"vocab_size must be an int >= 100, got {vocab_size!r}")
    learned = learn_vocabulary(count_words(texts), vocab_size, special_tokens=SPECIAL_TOKENS,
                               min_frequency=min_frequency, progress=progress)
    # WordPiece tokenizes by the longest match whatever the ids, so a sorted order loses nothing and names the set.
    rest = sorted(t for t in learned if t not in SPECIAL_TOKENS)
    return _wrap(BertWordPieceTokenizer({t: i for i, t in enumerate([*SPECIAL_TOKENS, *rest])}, lowercase=True,
                                        strip_accents=True, clean_text=True, handle_chinese_chars=True))
