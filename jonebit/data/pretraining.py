"""BERT pre-training instances (masked LM + next sentence), built once and memory-mapped.

The instances follow Google's ``create_pretraining_data.py``:

* the input is plain text, one paragraph or sentence per line, a blank line between documents; lines are split
  into sentences (:func:`split_sentences`) and tokenized with WordPiece;
* each document is cut into chunks of sentences up to a target length (``max_seq_length - 3`` tokens; with
  probability ``short_seq_prob`` a shorter random target, so the model also sees short inputs). A chunk is split
  at a random sentence boundary into A and B; with probability 0.5 (always when the chunk has one sentence) B is
  replaced by text from a random *other* document (``is_random_next``, label 1) and the unused sentences go back
  to the document (so short documents give somewhat more than half random pairs); the pair is trimmed to fit,
  one token at a time from the longer side, at its front or its back at random;
* ``[CLS] A [SEP] B [SEP]`` with token types 0 for ``[CLS] A [SEP]`` and 1 for ``B [SEP]``;
* masking: ``min(max_predictions_per_seq, max(1, round(len * masked_lm_prob)))`` positions (never ``[CLS]`` or
  ``[SEP]``), chosen in random order among words (whole-word masking: a word and its ``##`` pieces together) or
  tokens; each chosen token becomes ``[MASK]`` with probability 0.8, stays itself with 0.1, and becomes a
  random vocabulary token with 0.1 (drawn from the non-special tokens: unlike Google's script, never a second
  ``[SEP]``);
* everything is repeated ``dupe_factor`` times with different masks, and the instances are shuffled.

The result is a directory of ``.npy`` arrays (read with ``np.load(mmap_mode="r")``: no pickles, nothing loaded
until used) per split plus ``manifest.json`` recording the options, the seed, the tokenizer's fingerprint and the
corpus files' sizes and sha256. :func:`build_pretraining_data` reuses a directory whose manifest matches and
refuses one that does not (naming what differs).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import re
import shutil
import time
from collections.abc import Iterable, Sequence

import numpy as np

from jonebit.data.tokenization import SPECIAL_TOKENS, WordPiece

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: validation split; held-out sentences that occur in training are left out
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s+[\"'(\[]?[A-Z0-9])")


def split_sentences(line: str) -> list[str]:
    """Splits a paragraph after ``.``, ``!`` or ``?`` (and closing quotes/brackets) followed by a capital or a digit.

    A plain rule, not a trained splitter: abbreviations such as "Dr. Smith" are split too, which only moves a
    sentence boundary (NSP pairs stay within one document either way).
    """
    line = line.strip()
    if not line:
        return []
    out, start = [], 0
    for m in _SENTENCE_END.finditer(line):
        out.append(line[start:m.end()].strip())
        start = m.end()
    out.append(line[start:].strip())
    return [s for s in out if s]


@dataclasses.dataclass(frozen=True)
class PretrainingOptions:
    """Options of :func:`create_instances` (Google's flag names and defaults unless noted).

    Attributes:
      max_seq_length: tokens per instance, ``[CLS]``/``[SEP]`` included.
      max_predictions_per_seq: masked positions per instance at most.
      masked_lm_prob: fraction of tokens to mask.
      short_seq_prob: probability of a shorter random target length.
      dupe_factor: passes over the corpus, each with different masks (Google's default is 10).
      whole_word_mask: mask whole words (all ``##`` pieces of a word together).
      seed: seeds every random choice; the same seed and inputs give the same instances.
      heldout_documents: documents at the end of the corpus kept apart as the held-out split, on which results are
        reported.
      validation_documents: documents just before the held-out ones kept apart as the validation split, on which
        options are chosen.
      heldout_dupe_factor: masking passes over the validation and held-out text (more masked positions of the
        same text: a steadier loss on a small corpus).

    Sentences of the validation and held-out documents that also occur in the training documents (the same
    WordPiece ids) are left out of them, so neither scores text the model trained on.
    """

    max_seq_length: int = 128
    max_predictions_per_seq: int = 20
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    dupe_factor: int = 5
    whole_word_mask: bool = False
    seed: int = 12345
    heldout_documents: int = 0
    validation_documents: int = 0
    heldout_dupe_factor: int = 1

    def __post_init__(self):
        ints = (("max_seq_length", 8), ("max_predictions_per_seq", 1), ("dupe_factor", 1), ("heldout_documents", 0),
                ("validation_documents", 0), ("heldout_dupe_factor", 1))
        for name, low in ints:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"PretrainingOptions.{name} must be an int >= {low}, got {v!r}")
        for name in ("masked_lm_prob", "short_seq_prob"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0.0 <= v <= 1.0:
                raise ValueError(f"PretrainingOptions.{name} must be a probability in [0, 1], got {v!r}")
        if self.masked_lm_prob == 0:
            raise ValueError("PretrainingOptions.masked_lm_prob must be > 0 (nothing to predict otherwise)")
        if not isinstance(self.whole_word_mask, bool):
            raise TypeError(f"PretrainingOptions.whole_word_mask must be a bool, got {self.whole_word_mask!r}")
        if self.max_seq_length > 32767:
            raise ValueError("PretrainingOptions.max_seq_length must be < 32768 (positions are stored as int16)")


def read_documents(paths: Sequence[str | os.PathLike]) -> list[list[str]]:
    """Documents (lists of sentences) of text files: a blank line ends a document."""
    docs: list[list[str]] = []
    for path in paths:
        path = pathlib.Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no corpus file at {path}")
        current: list[str] = []
        with path.open(encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    if current:
                        docs.append(current)
                    current = []
                else:
                    current.extend(split_sentences(line))
        if current:
            docs.append(current)
    return docs


def tokenize_documents(docs: list[list[str]], tokenizer: WordPiece, *, progress: bool = True) -> list[list[np.ndarray]]:
    """WordPiece ids of every sentence (empty sentences dropped, empty documents dropped)."""
    from tqdm.auto import tqdm

    flat = [s for d in docs for s in d]
    ids: list[np.ndarray] = []
    chunk = 4096
    for start in tqdm(range(0, len(flat), chunk), desc="tokenizing", unit="chunk", disable=not progress):
        ids.extend(np.asarray(x, np.int32) for x in tokenizer.encode_batch(flat[start:start + chunk]))
    out, i = [], 0
    for d in docs:
        sentences = [s for s in ids[i:i + len(d)] if len(s)]
        i += len(d)
        if sentences:
            out.append(sentences)
    return out


class _Masker:
    def __init__(self, tokenizer: WordPiece, options: PretrainingOptions):
        self.o = options
        self.mask_id, self.cls_id, self.sep_id = tokenizer.mask_id, tokenizer.cls_id, tokenizer.sep_id
        special = {tokenizer.id(t) for t in SPECIAL_TOKENS}
        # Random replacements come from the ordinary tokens (Google's script may also draw [SEP] or [CLS], which
        # would put a second segment boundary into the input).
        self.ordinary = np.asarray([i for i in range(tokenizer.vocab_size) if i not in special], np.int64)
        self.continuation = np.asarray(tokenizer.is_continuation(), bool)

    def __call__(self, tokens: np.ndarray, rng: np.random.Generator):
        """(masked tokens, sorted positions, original ids at those positions)."""
        o = self.o
        cand = np.flatnonzero((tokens != self.cls_id) & (tokens != self.sep_id))
        if o.whole_word_mask:
            starts = ~self.continuation[tokens[cand]]
            starts[0] = True
            starts[1:] |= np.diff(cand) != 1  # a [SEP] between two pieces also starts a new word
            groups = np.split(cand, np.flatnonzero(starts)[1:])
        else:
            groups = [cand[i:i + 1] for i in range(len(cand))]
        num = min(o.max_predictions_per_seq, max(1, int(round(len(tokens) * o.masked_lm_prob))))
        chosen: list[int] = []
        for g in (groups[i] for i in rng.permutation(len(groups))):
            if len(chosen) >= num:
                break
            if len(chosen) + len(g) > num:
                continue
            chosen.extend(g.tolist())
        positions = np.sort(np.asarray(chosen, np.int64))
        labels = tokens[positions].copy()
        out = tokens.copy()
        draw = rng.random(len(positions))
        random_ids = self.ordinary[rng.integers(0, len(self.ordinary), len(positions))]
        out[positions] = np.where(draw < 0.8, self.mask_id, np.where(draw < 0.9, labels, random_ids))
        return out, positions, labels


def _truncate_pair(a: list, b: list, max_tokens: int, rng: np.random.Generator) -> None:
    while len(a) + len(b) > max_tokens:
        longer = a if len(a) > len(b) else b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def create_instances(
    documents: list[list[np.ndarray]],
    tokenizer: WordPiece,
    options: PretrainingOptions,
    *,
    dupe_factor: int | None = None,
    seed: int | None = None,
    progress: bool = True,
) -> dict[str, np.ndarray]:
    """Pre-training instances of tokenized documents, shuffled, as compact arrays.

    Returns arrays with one row per instance: ``input_ids`` ``(N, L)``, ``token_type_ids`` ``(N, L)`` uint8,
    ``lengths`` ``(N,)`` (tokens before padding), ``masked_lm_positions`` ``(N, P)`` int16 (0-padded),
    ``masked_lm_ids`` ``(N, P)``, ``masked_lm_count`` ``(N,)``, ``next_sentence_labels`` ``(N,)`` uint8
    (1 = B is a random sentence).
    """
    from tqdm.auto import tqdm

    o = options
    dupe_factor = o.dupe_factor if dupe_factor is None else dupe_factor
    rng = np.random.default_rng(o.seed if seed is None else seed)
    masker = _Masker(tokenizer, o)
    max_tokens = o.max_seq_length - 3
    id_dtype = np.uint16 if tokenizer.vocab_size <= 65535 else np.int32
    rows: list[tuple] = []
    n_docs = len(documents)
    if n_docs < 2:
        raise ValueError(f"pre-training needs at least 2 documents (random next sentences come from another "
                         f"document), got {n_docs}; separate documents by blank lines")
    bar = tqdm(total=dupe_factor * n_docs, desc="instances", unit="doc", disable=not progress)
    for _ in range(dupe_factor):
        for d in range(n_docs):
            doc = documents[d]
            target = max_tokens if rng.random() >= o.short_seq_prob else int(rng.integers(2, max_tokens + 1))
            chunk: list[np.ndarray] = []
            length = 0
            i = 0
            while i < len(doc):
                chunk.append(doc[i])
                length += len(doc[i])
                if i == len(doc) - 1 or length >= target:
                    a_end = 1 if len(chunk) < 2 else int(rng.integers(1, len(chunk)))
                    tokens_a = [t for s in chunk[:a_end] for t in s.tolist()]
                    if len(chunk) == 1 or rng.random() < 0.5:
                        random_next = 1
                        want = target - len(tokens_a)
                        other = d
                        for _try in range(10):
                            other = int(rng.integers(0, n_docs))
                            if other != d:
                                break
                        if other == d:  # ten draws of the same document: take the next one
                            other = (d + 1) % n_docs
                        odoc = documents[other]
                        tokens_b = []
                        for j in range(int(rng.integers(0, len(odoc))), len(odoc)):
                            tokens_b.extend(odoc[j].tolist())
                            if len(tokens_b) >= want:
                                break
                        i -= len(chunk) - a_end  # unused sentences go back to the document
                    else:
                        random_next = 0
                        tokens_b = [t for s in chunk[a_end:] for t in s.tolist()]
                    _truncate_pair(tokens_a, tokens_b, max_tokens, rng)
                    if tokens_a and tokens_b:
                        tokens = np.asarray([masker.cls_id, *tokens_a, masker.sep_id, *tokens_b, masker.sep_id],
                                            np.int64)
                        types = np.zeros(len(tokens), np.uint8)
                        types[len(tokens_a) + 2:] = 1
                        masked, positions, labels = masker(tokens, rng)
                        rows.append((masked, types, positions, labels, random_next))
                    chunk, length = [], 0
                i += 1
            bar.update(1)
    bar.close()
    order = rng.permutation(len(rows))
    n, L, P = len(rows), o.max_seq_length, o.max_predictions_per_seq
    out = {
        "input_ids": np.zeros((n, L), id_dtype),
        "token_type_ids": np.zeros((n, L), np.uint8),
        "lengths": np.zeros(n, np.int16),
        "masked_lm_positions": np.zeros((n, P), np.int16),
        "masked_lm_ids": np.zeros((n, P), id_dtype),
        "masked_lm_count": np.zeros(n, np.int16),
        "next_sentence_labels": np.zeros(n, np.uint8),
    }
    for row, k in enumerate(order):
        masked, types, positions, labels, random_next = rows[k]
        out["input_ids"][row, :len(masked)] = masked
        out["token_type_ids"][row, :len(types)] = types
        out["lengths"][row] = len(masked)
        out["masked_lm_positions"][row, :len(positions)] = positions
        out["masked_lm_ids"][row, :len(labels)] = labels
        out["masked_lm_count"][row] = len(positions)
        out["next_sentence_labels"][row] = random_next
    return out


def collate(arrays: dict[str, np.ndarray], pad_id: int = 0) -> dict[str, np.ndarray]:
    """Model inputs of stored rows: ``input_ids``, ``attention_mask``, ``token_type_ids`` (int32), ``labels``
    (``-100`` except at masked positions), ``next_sentence_label``, and the gather form ``masked_lm_positions``,
    ``masked_lm_ids``, ``masked_lm_weights`` (float32, 0 for padding)."""
    ids = np.asarray(arrays["input_ids"], np.int32)
    n, L = ids.shape
    lengths = np.asarray(arrays["lengths"], np.int32)
    attention = (np.arange(L)[None, :] < lengths[:, None]).astype(np.int32)
    positions = np.asarray(arrays["masked_lm_positions"], np.int32)
    mlm_ids = np.asarray(arrays["masked_lm_ids"], np.int32)
    weights = (np.arange(positions.shape[1])[None, :] < np.asarray(arrays["masked_lm_count"])[:, None])
    labels = np.full((n, L), -100, np.int32)
    r, c = np.nonzero(weights)
    labels[r, positions[r, c]] = mlm_ids[r, c]
    return {
        "input_ids": np.where(attention > 0, ids, pad_id).astype(np.int32),
        "attention_mask": attention,
        "token_type_ids": np.asarray(arrays["token_type_ids"], np.int32),
        "labels": labels,
        "next_sentence_label": np.asarray(arrays["next_sentence_labels"], np.int32),
        "masked_lm_positions": positions,
        "masked_lm_ids": mlm_ids,
        "masked_lm_weights": weights.astype(np.float32),
    }


def _file_digest(path: pathlib.Path) -> dict:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"path": str(path.resolve()), "bytes": path.stat().st_size, "sha256": h.hexdigest()}


def _manifest(corpus: Sequence[pathlib.Path], tokenizer: WordPiece, options: PretrainingOptions) -> dict:
    return {
        "format": FORMAT_VERSION,
        "options": dataclasses.asdict(options),
        "tokenizer": {"fingerprint": tokenizer.fingerprint(), "vocab_size": tokenizer.vocab_size},
        "corpus": [_file_digest(p) for p in corpus],
    }


def _differences(saved: dict, wanted: dict) -> list[str]:
    diffs = []
    if saved.get("format") != wanted["format"]:
        diffs.append(f"format {saved.get('format')} != {wanted['format']}")
    for k, v in wanted["options"].items():
        if saved.get("options", {}).get(k) != v:
            diffs.append(f"option {k}: cached {saved.get('options', {}).get(k)!r}, requested {v!r}")
    if saved.get("tokenizer", {}).get("fingerprint") != wanted["tokenizer"]["fingerprint"]:
        diffs.append("tokenizer: another vocabulary")
    old = [(c["sha256"], c["bytes"]) for c in saved.get("corpus", [])]
    new = [(c["sha256"], c["bytes"]) for c in wanted["corpus"]]
    if old != new:
        diffs.append("corpus files differ (sha256)")
    return diffs


SPLIT_SEEDS = {"train": 0, "heldout": 1, "validation": 2}  # added to the options' seed


def split_documents(documents: list, options: PretrainingOptions) -> dict[str, list]:
    """The corpus's documents by split: ``train``, then ``validation`` and ``heldout`` (the last documents) when the
    options hold any out. Raises ValueError when fewer than 2 training documents would be left."""
    n, ho, vd = len(documents), options.heldout_documents, options.validation_documents
    if ho + vd and ho + vd >= n - 1:
        raise ValueError(f"heldout_documents={ho} and validation_documents={vd} leave fewer than 2 of the corpus's "
                         f"{n} documents for training")
    splits = {"train": documents[:n - ho - vd]}
    if vd:
        splits["validation"] = documents[n - ho - vd:n - ho]
    if ho:
        splits["heldout"] = documents[n - ho:]
    return splits


def build_pretraining_data(
    corpus: Sequence[str | os.PathLike],
    tokenizer: WordPiece,
    output_dir: str | os.PathLike,
    options: PretrainingOptions = PretrainingOptions(),
    *,
    overwrite: bool = False,
    progress: bool = True,
) -> pathlib.Path:
    """Builds (or reuses) the instance directory of ``corpus``; returns its path.

    A directory whose ``manifest.json`` matches (options, tokenizer, corpus contents) is reused as is. One that
    does not is refused, naming the differences, unless ``overwrite=True``. The directory is written to a
    temporary sibling and renamed into place, so an interrupted build leaves no half-written cache.
    """
    out = pathlib.Path(output_dir)
    paths = [pathlib.Path(p) for p in corpus]
    if not paths:
        raise ValueError("no corpus files given")
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"no corpus file at {p}")
    wanted = _manifest(paths, tokenizer, options)
    manifest_path = out / "manifest.json"
    if manifest_path.is_file():
        saved = json.loads(manifest_path.read_text())
        diffs = _differences(saved, wanted)
        if not diffs:
            log.info("reusing pre-training data in %s", out)
            return out
        if not overwrite:
            raise ValueError(f"{out} holds pre-training data built differently ({'; '.join(diffs)}); use another "
                             "directory or overwrite=True (--overwrite-data) to rebuild it")
    elif out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists, is not empty and has no manifest.json; it is not a pre-training data "
                              "directory. Choose an empty or new directory")

    t0 = time.perf_counter()
    docs = read_documents(paths)
    tokens = tokenize_documents(docs, tokenizer, progress=progress)
    n_tokens = sum(len(s) for d in tokens for s in d)
    t_tok = time.perf_counter() - t0
    splits = split_documents(tokens, options)
    removed = {}
    seen = {s.tobytes() for d in splits["train"] for s in d}
    for name in ("validation", "heldout"):
        if name in splits:
            kept = [[s for s in d if s.tobytes() not in seen] for d in splits[name]]
            removed[name] = sum(len(d) for d in splits[name]) - sum(len(d) for d in kept)
            splits[name] = [d for d in kept if d]
    tmp = out.with_name(out.name + ".tmp-build")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    counts, masked = {}, {}
    t1 = time.perf_counter()
    for name, docs_ in splits.items():
        held = name != "train"
        if held and len(docs_) < 2:
            raise ValueError(f"the {name} split has {len(docs_)} documents with text not in the training split; it "
                             f"needs >= 2 (random next sentences come from another document): hold out more")
        arrays = create_instances(docs_, tokenizer, options,
                                  dupe_factor=options.heldout_dupe_factor if held else None,
                                  seed=options.seed + SPLIT_SEEDS[name], progress=progress)
        (tmp / name).mkdir()
        for key, value in arrays.items():
            np.save(tmp / name / f"{key}.npy", value, allow_pickle=False)
        counts[name] = int(len(arrays["input_ids"]))
        masked[name] = int(arrays["masked_lm_count"].sum())
    t_inst = time.perf_counter() - t1
    wanted["instances"] = counts
    wanted["masked_tokens"] = masked
    wanted["deduplicated_sentences"] = removed
    wanted["stats"] = {"documents": len(tokens), "tokens": n_tokens, "tokenize_seconds": round(t_tok, 3),
                       "instance_seconds": round(t_inst, 3),
                       "instances_per_second": round(sum(counts.values()) / max(t_inst, 1e-9), 1),
                       "tokens_per_second_tokenizer": round(n_tokens / max(t_tok, 1e-9), 1)}
    (tmp / "manifest.json").write_text(json.dumps(wanted, indent=2))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    log.info("pre-training data: %s instances in %s (%.0f instances/s; tokenizer %.0f tokens/s)", counts, out,
             wanted["stats"]["instances_per_second"], wanted["stats"]["tokens_per_second_tokenizer"])
    return out


class PretrainingData:
    """A built instance directory, memory-mapped.

    Args:
      directory: from :func:`build_pretraining_data`.
      split: ``"train"``, ``"validation"`` or ``"heldout"``.
    """

    def __init__(self, directory: str | os.PathLike, split: str = "train"):
        self.directory = pathlib.Path(directory)
        manifest = self.directory / "manifest.json"
        if not manifest.is_file():
            raise FileNotFoundError(f"{self.directory} is not a pre-training data directory (no manifest.json); "
                                    "build it with build_pretraining_data / jonebit pretrain")
        self.manifest = json.loads(manifest.read_text())
        if self.manifest.get("format") != FORMAT_VERSION:
            raise ValueError(f"{manifest}: format {self.manifest.get('format')}, this version reads {FORMAT_VERSION}")
        if split not in self.manifest.get("instances", {}):
            raise ValueError(f"{self.directory} has no {split!r} split; it has {sorted(self.manifest['instances'])}")
        self.arrays = {p.stem: np.load(p, mmap_mode="r", allow_pickle=False)
                       for p in sorted((self.directory / split).glob("*.npy"))}
        n = self.manifest["instances"][split]
        bad = {k: len(v) for k, v in self.arrays.items() if len(v) != n}
        if bad or not self.arrays:
            raise ValueError(f"{self.directory / split}: arrays do not match the manifest's {n} instances: {bad}")

    def __len__(self) -> int:
        return len(self.arrays["input_ids"])

    def rows(self, index) -> dict[str, np.ndarray]:
        return collate({k: v[index] for k, v in self.arrays.items()})

    def batches(self, batch_size: int, *, seed: int = 0, shuffle: bool = True, shard: tuple[int, int] = (0, 1)):
        """A resumable iterator (:class:`jonebit.train.loop.ArrayBatches`) of collated global batches."""
        from jonebit.train.loop import ArrayBatches

        return ArrayBatches(self.arrays, batch_size, seed=seed, shuffle=shuffle, collate=collate, shard=shard)


def iter_texts(paths: Iterable[str | os.PathLike]) -> Iterable[str]:
    """The non-empty lines of text files (for training a vocabulary)."""
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield line
