"""SQuAD v1.1: reading the JSON, building BERT input features and turning start/end logits into answers.

Everything follows Google's original BERT ``run_squad.py`` so that a model scores as it would there:

* **Words.** The context is split on whitespace (space, tab, CR, LF and U+202F) into words; ``char_to_word``
  maps each character to its word. A gold answer's character span gives its first and last word.
* **Tokens.** Each word is tokenized on its own with the basic tokenizer (clean-up, lower-case, strip accents,
  split punctuation and CJK characters) and WordPiece, so every token knows its word (``tok_to_word``) and every
  word its first token (``word_to_tok``). The answer's token span is then narrowed to the tokens of the
  tokenized answer text where they occur inside it (``_improve_answer_span``: "1895" in "(1895-1943)").
* **Windows.** ``[CLS] question [SEP] context-window [SEP]`` with the question cut to ``max_query_length``
  tokens and windows of ``max_seq_length - len(question) - 3`` context tokens, each starting
  ``min(window length, doc_stride)`` tokens after the previous one, until the last reaches the end.
* **Max context.** A token seen by several windows is scored only in the window where
  ``min(left context, right context) + 0.01 * window length`` is largest (the earlier window on a tie).
* **Training targets.** ``start_positions``/``end_positions`` index the answer's first and last token in the
  window, or ``[CLS]`` (0) when the window does not hold the whole answer.
* **Post-processing.** Per feature the ``n_best_size`` highest start and end logits are paired; pairs outside
  the context, with ``end < start``, longer than ``max_answer_length`` tokens or starting at a token that is not
  max-context are dropped; the rest, over all windows of a question, are ranked by ``start + end`` logit. The
  text of a pair is the de-tokenized WordPiece span aligned back onto the original words (``get_final_text``),
  which keeps the context's case, accents and punctuation.

Differences from the original, all deliberate: a paragraph is tokenized once for all of its questions (the same
tokens as per question); when a file's ``answer_start`` does not point at the answer text (files rebuilt from
other sources can have shifted offsets) the nearest occurrence of the text is used, and answers whose text is
nowhere in the context are counted, logged and left out. An offset that points at another occurrence of the
same text cannot be told apart and is used as given. The tokenizer is the
``tokenizers`` implementation wrapped by :class:`~jonebit.data.tokenization.WordPiece`; it gives ``[UNK]`` for a
word over 100 characters (the original: 200) and keeps a literal ``[SEP]``/``[CLS]`` in a text as that token.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
import pathlib
from collections.abc import Mapping, Sequence

import numpy as np

from jonebit.data.tokenization import WordPiece

log = logging.getLogger(__name__)

_WHITESPACE = frozenset(" \t\r\n\u202f")  # run_squad's is_whitespace


# ----------------------------------------------------------------------------------------------------------------
# Reading


@dataclasses.dataclass(frozen=True, eq=False)
class Paragraph:
    """A context split into words, shared by all of its questions.

    Attributes:
      context: the original text.
      words: the whitespace-separated words.
      char_to_word: ``(len(context),)`` int32, the word of each character (of the previous word for whitespace,
        -1 before the first word).
      word_to_char: ``(len(words),)`` int32, the first character of each word.
    """

    context: str
    words: tuple[str, ...]
    char_to_word: np.ndarray
    word_to_char: np.ndarray


def split_words(context: str) -> Paragraph:
    """Splits ``context`` on whitespace as ``run_squad.read_squad_examples`` does."""
    words, char_to_word, word_to_char = [], np.empty(len(context), np.int32), []
    prev_is_whitespace = True
    for i, c in enumerate(context):
        if c in _WHITESPACE:
            prev_is_whitespace = True
        else:
            if prev_is_whitespace:
                words.append(c)
                word_to_char.append(i)
            else:
                words[-1] += c
            prev_is_whitespace = False
        char_to_word[i] = len(words) - 1
    return Paragraph(context, tuple(words), char_to_word, np.asarray(word_to_char, np.int32))


@dataclasses.dataclass(frozen=True)
class SquadExample:
    """One question about a paragraph.

    Attributes:
      qas_id: the question id (the key of ``predictions.json``).
      question: the question text.
      paragraph: the context, shared with the paragraph's other questions.
      answers: every gold answer text (the metric takes the best match).
      answer_text: the answer used for training targets: the first one found in the context, or ``None``.
      start_word, end_word: its first and last word in ``paragraph.words`` (``None`` without one).
    """

    qas_id: str
    question: str
    paragraph: Paragraph
    answers: tuple[str, ...]
    answer_text: str | None = None
    start_word: int | None = None
    end_word: int | None = None


@dataclasses.dataclass(frozen=True)
class SquadData:
    """The examples of a SQuAD file and how their answers were located.

    Attributes:
      examples: the questions in file order.
      version: the file's ``version`` field (``None`` when absent).
      stats: answer counts: ``exact`` (at ``answer_start``), ``moved`` (text found at another offset: the
        nearest occurrence is used), ``not_found`` (the text is nowhere in the context: left out),
        ``unaligned`` (found, but not on word boundaries run_squad can represent: left out) and
        ``dropped_examples`` (training questions left out because none of their answers could be used).
    """

    examples: list[SquadExample]
    version: str | None
    stats: dict[str, int]

    def __len__(self) -> int:
        return len(self.examples)


def split_articles(data: dict, validation_questions: int) -> tuple[dict, dict]:
    """Splits a SQuAD JSON into training and validation parts by whole articles.

    The last articles of ``data`` that together hold at least ``validation_questions`` questions become the
    validation part, the others the training part: no article, so no paragraph, is in both. Options chosen on the
    validation part are then chosen on text the model never trained on, and the official dev set stays untouched
    for the report.

    Returns:
      ``(train, validation)``, each a SQuAD JSON dict with the other top-level fields of ``data``.
    """
    articles = data.get("data") if isinstance(data, dict) else None
    _expect(isinstance(articles, list), "the top level", "an object with a 'data' list")
    if isinstance(validation_questions, bool) or not isinstance(validation_questions, int) or \
            validation_questions < 1:
        raise ValueError(f"validation_questions must be a positive number of questions, got {validation_questions!r}")
    held, count = len(articles), 0
    while held > 0 and count < validation_questions:
        held -= 1
        count += sum(len(p.get("qas", [])) for p in articles[held].get("paragraphs", []))
    if count < validation_questions or held == 0:
        raise ValueError(f"cannot hold out {validation_questions} questions by whole articles: the file has "
                         f"{sum(len(p.get('qas', [])) for a in articles for p in a.get('paragraphs', []))} questions "
                         f"in {len(articles)} articles and at least one article must stay for training")
    return dict(data, data=articles[:held]), dict(data, data=articles[held:])


def _expect(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise ValueError(f"not SQuAD v1.1 JSON: {where} should be {what}. A SQuAD file is "
                         '{"data": [{"paragraphs": [{"context": str, "qas": [{"id": str, "question": str, '
                         '"answers": [{"text": str, "answer_start": int}]}]}]}]}')


def _read_json(source):
    if not isinstance(source, str | os.PathLike):
        return source  # already parsed; checked by the caller
    path = pathlib.Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"no SQuAD file at {path}; get the official files with `jonebit squad-download DIR`")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"not SQuAD v1.1 JSON: {path} does not parse as JSON ({e})") from None


def _locate(context: str, text: str, start: int) -> int | None:
    """Offset of ``text`` in ``context``: ``start`` if it is there, else the nearest occurrence (earlier on a tie)."""
    if 0 <= start and context.startswith(text, start):
        return start
    best, pos = None, context.find(text)
    while pos != -1:
        if best is None or abs(pos - start) < abs(best - start):
            best = pos
        pos = context.find(text, pos + 1)
    return best


def _answer_words(paragraph: Paragraph, text: str, offset: int) -> tuple[int, int] | None:
    """First and last word of the answer at ``offset``, or ``None`` when run_squad would reject it."""
    start_word = int(paragraph.char_to_word[offset])
    end_word = int(paragraph.char_to_word[offset + len(text) - 1])
    actual = " ".join(paragraph.words[max(start_word, 0):end_word + 1])
    if start_word < 0 or actual.find(" ".join(text.split())) == -1:
        return None
    return start_word, end_word


def load_squad(source, *, is_training: bool = False) -> SquadData:
    """Reads a SQuAD v1.1 file (or its parsed JSON).

    Args:
      source: a path to the JSON file, or the parsed object.
      is_training: drop questions none of whose answers can be located (they would have no target), as
        run_squad does for training. For evaluation every question is kept: the metric only needs the texts.

    Returns:
      A :class:`SquadData`; a summary of the located answers is logged.
    """
    data = _read_json(source)
    _expect(isinstance(data, Mapping) and isinstance(data.get("data"), list), "the top level",
            "an object with a 'data' list of articles")
    version = data.get("version")
    if version is not None and version != "1.1":
        log.warning("expected a SQuAD v1.1 file, got version %r", version)
    stats = dict(exact=0, moved=0, not_found=0, unaligned=0, dropped_examples=0)
    examples, seen = [], set()
    for i, article in enumerate(data["data"]):
        _expect(isinstance(article, Mapping) and isinstance(article.get("paragraphs"), list), f"data[{i}]",
                "an article object with a 'paragraphs' list")
        for j, par in enumerate(article["paragraphs"]):
            where = f"data[{i}].paragraphs[{j}]"
            _expect(isinstance(par, Mapping) and isinstance(par.get("context"), str)
                    and isinstance(par.get("qas"), list), where, "an object with a 'context' string and a 'qas' list")
            paragraph = split_words(par["context"])
            _expect(len(paragraph.words) > 0, f"{where}.context", "a non-empty text")
            for k, qa in enumerate(par["qas"]):
                example = _read_question(qa, f"{where}.qas[{k}]", paragraph, is_training, stats)
                if example is None:
                    continue
                if example.qas_id in seen:
                    raise ValueError(f"{where}.qas[{k}]: question id {example.qas_id!r} appears twice; ids must be "
                                     "unique (they are the keys of predictions.json)")
                seen.add(example.qas_id)
                examples.append(example)
    bad = stats["not_found"] + stats["unaligned"]
    log_fn = log.warning if bad else log.info
    log_fn("SQuAD: %d questions; answers: %d at answer_start, %d moved to the nearest occurrence of their text, "
           "%d not in the context, %d not on word boundaries%s", len(examples), stats["exact"], stats["moved"],
           stats["not_found"], stats["unaligned"],
           f"; {stats['dropped_examples']} training questions without a usable answer dropped" if is_training else "")
    return SquadData(examples, version, stats)


def _read_question(qa, where: str, paragraph: Paragraph, is_training: bool, stats: dict) -> SquadExample | None:
    _expect(isinstance(qa, Mapping) and isinstance(qa.get("id"), str) and isinstance(qa.get("question"), str),
            where, "a question object with string 'id' and 'question'")
    if qa.get("is_impossible"):
        raise ValueError(f"{where}: unanswerable questions (is_impossible, SQuAD v2.0) are not supported; use a "
                         "SQuAD v1.1 file")
    answers = qa.get("answers")
    _expect(isinstance(answers, list), f"{where}.answers", "a list")
    texts, located = [], None
    for n, ans in enumerate(answers):
        _expect(isinstance(ans, Mapping) and isinstance(ans.get("text"), str) and ans["text"]
                and isinstance(ans.get("answer_start"), int) and not isinstance(ans["answer_start"], bool),
                f"{where}.answers[{n}]", "an object with a non-empty 'text' and an integer 'answer_start'")
        texts.append(ans["text"])
        offset = _locate(paragraph.context, ans["text"], ans["answer_start"])
        if offset is None:
            stats["not_found"] += 1
            continue
        span = _answer_words(paragraph, ans["text"], offset)
        if span is None:
            stats["unaligned"] += 1
            continue
        stats["exact" if offset == ans["answer_start"] else "moved"] += 1
        if located is None:
            located = (ans["text"], *span)
    if is_training and located is None:
        stats["dropped_examples"] += 1
        return None
    return SquadExample(qa["id"], qa["question"], paragraph, tuple(texts), *(located or (None, None, None)))


# ----------------------------------------------------------------------------------------------------------------
# Features


@dataclasses.dataclass(frozen=True)
class SquadFeatures:
    """Model inputs (one row per window) and what post-processing needs to map logits back to text.

    Attributes:
      input_ids, attention_mask, token_type_ids: ``(N, max_seq_length)`` int32 model inputs.
      start_positions, end_positions: ``(N,)`` int32 training targets: the answer's first and last token, or 0
        (``[CLS]``) when the window does not hold the whole answer or the example has none.
      example_index: ``(N,)`` int32, the example of each window.
      window_index: ``(N,)`` int32, the window's number within its example.
      token_to_word: ``(N, max_seq_length)`` int32, the context word of each token; -1 for ``[CLS]``, the
        question, ``[SEP]`` and padding.
      token_is_max_context: ``(N, max_seq_length)`` bool, whether the window is the one that scores the token.
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    token_type_ids: np.ndarray
    start_positions: np.ndarray
    end_positions: np.ndarray
    example_index: np.ndarray
    window_index: np.ndarray
    token_to_word: np.ndarray
    token_is_max_context: np.ndarray

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def model_inputs(self) -> dict[str, np.ndarray]:
        """``input_ids``, ``attention_mask`` and ``token_type_ids``."""
        return dict(input_ids=self.input_ids, attention_mask=self.attention_mask, token_type_ids=self.token_type_ids)

    def training_arrays(self) -> dict[str, np.ndarray]:
        """The model inputs plus ``start_positions`` and ``end_positions``."""
        return dict(self.model_inputs(), start_positions=self.start_positions, end_positions=self.end_positions)


@dataclasses.dataclass(frozen=True)
class _TokenizedParagraph:
    ids: np.ndarray  # (T,) int32 WordPiece ids of the whole context
    tok_to_word: np.ndarray  # (T,) int32
    word_to_tok: np.ndarray  # (W,) int32: first token of each word (the next word's, for a word without tokens)


def _check_tokenizer(tokenizer) -> None:
    if not isinstance(tokenizer, WordPiece):
        raise TypeError(f"tokenizer: expected a jonebit.data.tokenization.WordPiece (load_wordpiece(vocab.txt)), "
                        f"got {type(tokenizer).__name__}")
    tok = tokenizer.tokenizer
    if getattr(tok, "truncation", None) or getattr(tok, "padding", None):
        raise ValueError("tokenizer: truncation or padding is enabled on the wrapped tokenizers object; call "
                         "no_truncation() and no_padding() first (features do their own windowing and padding)")


def _tokenize_paragraphs(tokenizer: WordPiece, paragraphs: Sequence[Paragraph]) -> list[_TokenizedParagraph]:
    # Pre-tokenized input runs the normaliser and pre-tokenizer on each word on its own: run_squad's
    # tokenizer.tokenize(word) per word, in one batched call.
    encodings = tokenizer.tokenizer.encode_batch([list(p.words) for p in paragraphs], is_pretokenized=True,
                                                 add_special_tokens=False)
    out = []
    for p, enc in zip(paragraphs, encodings, strict=True):
        ids = np.asarray(enc.ids, np.int32)
        tok_to_word = np.asarray(enc.word_ids, np.int32)
        counts = np.bincount(tok_to_word, minlength=len(p.words))
        word_to_tok = (np.cumsum(counts) - counts).astype(np.int32)
        out.append(_TokenizedParagraph(ids, tok_to_word, word_to_tok))
    return out


def doc_windows(num_tokens: int, max_tokens_for_doc: int, doc_stride: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each context window, as run_squad's ``doc_spans``."""
    spans, start = [], 0
    while start < num_tokens:
        length = min(num_tokens - start, max_tokens_for_doc)
        spans.append((start, length))
        if start + length == num_tokens:
            break
        start += min(length, doc_stride)
    return spans


def max_context_windows(spans: Sequence[tuple[int, int]], num_tokens: int) -> np.ndarray:
    """``(num_tokens,)`` index of the window that scores each token (run_squad's ``_check_is_max_context``)."""
    starts = np.asarray([s for s, _ in spans])[:, None]
    lengths = np.asarray([n for _, n in spans])[:, None]
    pos = np.arange(num_tokens)[None, :]
    ends = starts + lengths - 1
    score = np.minimum(pos - starts, ends - pos) + 0.01 * lengths
    score = np.where((pos >= starts) & (pos <= ends), score, -np.inf)
    return np.argmax(score, axis=0)  # the first maximum: the earlier window wins a tie


def _improve_answer_span(doc_ids: np.ndarray, start: int, end: int, answer_ids: Sequence[int]) -> tuple[int, int]:
    """The first sub-span of ``[start, end]`` whose tokens are the tokenized answer text, else ``(start, end)``."""
    n = len(answer_ids)
    if n == 0:
        return start, end
    answer = np.asarray(answer_ids, doc_ids.dtype)
    for s in range(start, end - n + 2):
        if np.array_equal(doc_ids[s:s + n], answer):
            return s, s + n - 1
    return start, end


def _check_lengths(max_seq_length, doc_stride, max_query_length) -> None:
    for name, value in (("max_seq_length", max_seq_length), ("doc_stride", doc_stride),
                        ("max_query_length", max_query_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if max_seq_length < max_query_length + 4:
        raise ValueError(f"max_seq_length ({max_seq_length}) must be at least max_query_length + 4 "
                         f"({max_query_length + 4}): [CLS], two [SEP] and one context token besides the question")


def convert_examples_to_features(
    examples: Sequence[SquadExample],
    tokenizer: WordPiece,
    *,
    max_seq_length: int = 384,
    doc_stride: int = 128,
    max_query_length: int = 64,
) -> SquadFeatures:
    """BERT input windows of ``examples`` (see the module docstring for the rules).

    Args:
      examples: from :func:`load_squad`.
      tokenizer: an uncased BERT WordPiece (``load_wordpiece(vocab.txt)``).
      max_seq_length: tokens per window, ``[CLS]`` and ``[SEP]`` included.
      doc_stride: step between window starts, in context tokens.
      max_query_length: question tokens kept (the rest are cut).

    Returns:
      A :class:`SquadFeatures` of all windows, grouped by example in order. Targets are set for every example
      with a located answer (its first usable one); for the others they point at ``[CLS]``.
    """
    _check_tokenizer(tokenizer)
    _check_lengths(max_seq_length, doc_stride, max_query_length)
    unique, par_index = {}, []
    for ex in examples:
        par_index.append(unique.setdefault(id(ex.paragraph), (len(unique), ex.paragraph))[0])
    tokenized = _tokenize_paragraphs(tokenizer, [p for _, p in unique.values()])
    questions = tokenizer.encode_batch([ex.question for ex in examples])
    answered = [i for i, ex in enumerate(examples) if ex.answer_text is not None]
    answer_ids = dict(zip(answered, tokenizer.encode_batch([examples[i].answer_text for i in answered]),
                          strict=True))

    plans = []
    for i in range(len(examples)):
        tp = tokenized[par_index[i]]
        query = questions[i][:max_query_length]
        spans = doc_windows(len(tp.ids), max_seq_length - len(query) - 3, doc_stride)
        plans.append((tp, query, spans))
    n = sum(len(spans) for _, _, spans in plans)
    shape = (n, max_seq_length)
    input_ids = np.full(shape, tokenizer.pad_id, np.int32)
    attention_mask = np.zeros(shape, np.int32)
    token_type_ids = np.zeros(shape, np.int32)
    token_to_word = np.full(shape, -1, np.int32)
    is_max = np.zeros(shape, bool)
    start_positions = np.zeros(n, np.int32)
    end_positions = np.zeros(n, np.int32)
    example_index = np.zeros(n, np.int32)
    window_index = np.zeros(n, np.int32)

    row = 0
    for i, (ex, (tp, query, spans)) in enumerate(zip(examples, plans, strict=True)):
        target = _token_target(ex, tp, answer_ids.get(i))
        best = max_context_windows(spans, len(tp.ids))
        offset = len(query) + 2
        for w, (start, length) in enumerate(spans):
            stop = offset + length
            input_ids[row, 0] = tokenizer.cls_id
            input_ids[row, 1:offset - 1] = query
            input_ids[row, offset - 1] = tokenizer.sep_id
            input_ids[row, offset:stop] = tp.ids[start:start + length]
            input_ids[row, stop] = tokenizer.sep_id
            attention_mask[row, :stop + 1] = 1
            token_type_ids[row, offset:stop + 1] = 1
            token_to_word[row, offset:stop] = tp.tok_to_word[start:start + length]
            is_max[row, offset:stop] = best[start:start + length] == w
            if target is not None and start <= target[0] and target[1] <= start + length - 1:
                start_positions[row] = target[0] - start + offset
                end_positions[row] = target[1] - start + offset
            example_index[row], window_index[row] = i, w
            row += 1
    return SquadFeatures(input_ids, attention_mask, token_type_ids, start_positions, end_positions, example_index,
                         window_index, token_to_word, is_max)


def _token_target(ex: SquadExample, tp: _TokenizedParagraph, answer_ids) -> tuple[int, int] | None:
    if ex.start_word is None:
        return None
    start = int(tp.word_to_tok[ex.start_word])
    if ex.end_word < len(ex.paragraph.words) - 1:
        end = int(tp.word_to_tok[ex.end_word + 1]) - 1
    else:
        end = len(tp.ids) - 1
    return _improve_answer_span(tp.ids, start, end, answer_ids)


# ----------------------------------------------------------------------------------------------------------------
# Post-processing


def basic_tokenize(text: str, tokenizer: WordPiece) -> list[str]:
    """The basic (pre-WordPiece) tokens of ``text``: cleaned, lower-cased, accents stripped, punctuation split."""
    tok = tokenizer.tokenizer
    return [piece for piece, _ in tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(text))]


def _nonspace_to_index(text: str, k: int) -> int:
    """Index in ``text`` of its ``k``-th character that is not a space."""
    pos = 0
    for piece in text.split(" "):
        if k < len(piece):
            return pos + k
        k -= len(piece)
        pos += len(piece) + 1
    raise IndexError(k)


def _align(pred_text: str, orig_text: str, tok_text: str) -> str:
    """run_squad's ``get_final_text`` given ``tok_text``, the basic tokens of ``orig_text`` joined by spaces."""
    start = tok_text.find(pred_text)
    end = start + len(pred_text) - 1
    if start == -1 or end < start:
        return orig_text
    # Characters correspond one to one once spaces are dropped, if normalisation kept the length.
    if len(orig_text) - orig_text.count(" ") != len(tok_text) - tok_text.count(" "):
        return orig_text
    if tok_text[start] == " " or tok_text[end] == " ":
        return orig_text
    ns_start = start - tok_text.count(" ", 0, start)
    ns_end = end - tok_text.count(" ", 0, end)
    return orig_text[_nonspace_to_index(orig_text, ns_start):_nonspace_to_index(orig_text, ns_end) + 1]


def get_final_text(pred_text: str, orig_text: str, tokenizer: WordPiece) -> str:
    """Projects the de-tokenized prediction ``pred_text`` onto ``orig_text``, the original words it came from.

    ``orig_text`` is basic-tokenized; where ``pred_text`` occurs in that, the characters are aligned with the
    original by dropping spaces on both sides (which works when normalisation kept the length of the text). When
    either step fails the whole ``orig_text`` is returned, as in run_squad.
    """
    return _align(pred_text, orig_text, " ".join(basic_tokenize(orig_text, tokenizer)))


def detokenize(tokens: Sequence[str]) -> str:
    """Joins WordPiece tokens into text as run_squad does (``##`` pieces glued to the previous token)."""
    text = " ".join(tokens).replace(" ##", "").replace("##", "")
    return " ".join(text.strip().split())


class _SpanTexts:
    """Answer texts of token spans; caches the basic tokens of each word (a span's are those of its words)."""

    def __init__(self, features: SquadFeatures, tokenizer: WordPiece):
        self.features, self.tokenizer = features, tokenizer
        self.vocab = tokenizer.vocab
        self.word_tokens: dict[str, str] = {}

    def _basic(self, word: str) -> str:
        text = self.word_tokens.get(word)
        if text is None:
            text = self.word_tokens[word] = " ".join(basic_tokenize(word, self.tokenizer))
        return text

    def __call__(self, example: SquadExample, row: int, start: int, end: int) -> str:
        tok_text = detokenize([self.vocab[t] for t in self.features.input_ids[row, start:end + 1]])
        first, last = self.features.token_to_word[row, start], self.features.token_to_word[row, end]
        words = example.paragraph.words[first:last + 1]
        basic = " ".join(b for b in map(self._basic, words) if b)
        return _align(tok_text, " ".join(words), basic)


def span_text(example: SquadExample, features: SquadFeatures, row: int, start: int, end: int,
              tokenizer: WordPiece) -> str:
    """The answer text of tokens ``start..end`` (inclusive) of feature ``row``, in the original context."""
    return _SpanTexts(features, tokenizer)(example, row, start, end)


def _best_indexes(logits: np.ndarray, n: int) -> np.ndarray:
    # Highest first; equal logits keep index order (Python's stable sorted(..., reverse=True)).
    return np.argsort(-logits, kind="stable")[:n]


def _softmax(scores: Sequence[float]) -> list[float]:
    if not scores:
        return []
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    total = sum(exps)
    return [e / total for e in exps]


def postprocess_predictions(
    examples: Sequence[SquadExample],
    features: SquadFeatures,
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    tokenizer: WordPiece,
    *,
    n_best_size: int = 20,
    max_answer_length: int = 30,
) -> tuple[dict[str, str], dict[str, list[dict]]]:
    """Answers from the model's start/end logits (run_squad's ``write_predictions`` without the file writing).

    Args:
      examples: the examples the features were built from.
      features: from :func:`convert_examples_to_features`.
      start_logits, end_logits: ``(len(features), max_seq_length)`` logits.
      tokenizer: the tokenizer of the features.
      n_best_size: start and end candidates per window, and answers kept per question.
      max_answer_length: longest answer, in tokens.

    Returns:
      ``(predictions, nbest)``: question id -> best answer text, and question id -> up to ``n_best_size``
      ``{"text", "probability", "start_logit", "end_logit"}`` ranked by ``start_logit + end_logit`` (a question
      without any valid span gets the single answer ``"empty"``, as in run_squad).
    """
    start_logits = np.asarray(start_logits, np.float64)
    end_logits = np.asarray(end_logits, np.float64)
    if start_logits.shape != features.input_ids.shape or end_logits.shape != features.input_ids.shape:
        raise ValueError(f"start_logits and end_logits must have the features' shape {features.input_ids.shape} "
                         f"(windows, max_seq_length); got {start_logits.shape} and {end_logits.shape}")
    for name, value in (("n_best_size", n_best_size), ("max_answer_length", max_answer_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if len(features) and int(features.example_index.max()) >= len(examples):
        raise ValueError(f"features refer to example {int(features.example_index.max())} but only "
                         f"{len(examples)} examples were given; pass the examples the features were built from")

    rows_of = collections.defaultdict(list)
    for row, ex in enumerate(features.example_index):
        rows_of[int(ex)].append(row)
    span_texts = _SpanTexts(features, tokenizer)
    predictions, nbest_all = {}, {}
    for i, example in enumerate(examples):
        candidates = []  # (score, row, start, end, start_logit, end_logit), in run_squad's generation order
        for row in rows_of.get(i, ()):
            starts = _best_indexes(start_logits[row], n_best_size)
            ends = _best_indexes(end_logits[row], n_best_size)
            s, e = np.meshgrid(starts, ends, indexing="ij")
            s, e = s.ravel(), e.ravel()
            ok = ((features.token_to_word[row, s] >= 0) & (features.token_to_word[row, e] >= 0)
                  & features.token_is_max_context[row, s] & (e >= s) & (e - s + 1 <= max_answer_length))
            for a, b in zip(s[ok], e[ok], strict=True):
                sl, el = start_logits[row, a], end_logits[row, b]
                candidates.append((sl + el, row, int(a), int(b), float(sl), float(el)))
        candidates.sort(key=lambda c: c[0], reverse=True)  # stable, as run_squad's sorted()
        nbest, seen = [], set()
        for _, row, a, b, sl, el in candidates:
            if len(nbest) >= n_best_size:
                break
            text = span_texts(example, row, a, b)
            if text in seen:
                continue
            seen.add(text)
            nbest.append({"text": text, "start_logit": sl, "end_logit": el})
        if not nbest:
            nbest.append({"text": "empty", "start_logit": 0.0, "end_logit": 0.0})
        probs = _softmax([p["start_logit"] + p["end_logit"] for p in nbest])
        nbest = [{"text": p["text"], "probability": prob, "start_logit": p["start_logit"],
                  "end_logit": p["end_logit"]} for p, prob in zip(nbest, probs, strict=True)]
        predictions[example.qas_id] = nbest[0]["text"]
        nbest_all[example.qas_id] = nbest
    return predictions, nbest_all


def write_predictions(output_dir: str | os.PathLike, predictions: Mapping[str, str],
                      nbest: Mapping[str, list] | None = None) -> dict[str, pathlib.Path]:
    """Writes ``predictions.json`` (id -> answer, the official evaluation's input) and ``nbest_predictions.json``.

    Returns:
      The written paths by name (``predictions``, ``nbest``).
    """
    out = pathlib.Path(output_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"output_dir: {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    paths = {"predictions": out / "predictions.json"}
    paths["predictions"].write_text(json.dumps(predictions, indent=4, ensure_ascii=False) + "\n", encoding="utf-8")
    if nbest is not None:
        paths["nbest"] = out / "nbest_predictions.json"
        paths["nbest"].write_text(json.dumps(nbest, indent=4, ensure_ascii=False) + "\n", encoding="utf-8")
    return paths
