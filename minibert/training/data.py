"""Labelled examples into shuffled, padded batches for ``loop.fit``."""

from __future__ import annotations

import random
from typing import Callable, Iterator, Sequence

import torch

from ..errors import InputError
from ..inputs import check_index


#: with ``lengths``, how many batches' worth of shuffled examples are sorted by length together
LENGTH_POOL = 50


def _epoch_rows(n: int, batch_size: int, shuffle: bool, seed: int,
                lengths: Sequence[int] | None = None) -> Iterator[list[int]]:
    """Example indices 0..n-1, shuffled by ``seed`` when asked, in chunks of ``batch_size``.

    With ``lengths`` (tokens per example), batches hold examples of similar length, so that little of
    each batch is padding: the shuffled order is cut into pools of ``LENGTH_POOL`` batches, each pool is
    sorted by length and cut into batches, and the batches are shuffled (bucketing; every example still
    comes once per epoch, in an order that changes with the epoch)."""
    order = list(range(n))
    rng = random.Random(seed)
    if shuffle:
        rng.shuffle(order)
    if lengths is None:
        for start in range(0, n, batch_size):
            yield order[start:start + batch_size]
        return
    pool = batch_size * LENGTH_POOL
    batches = []
    for start in range(0, n, pool):
        chunk = sorted(order[start:start + pool], key=lambda i: lengths[i])
        batches += [chunk[k:k + batch_size] for k in range(0, len(chunk), batch_size)]
    if shuffle:
        rng.shuffle(batches)
    yield from batches


def classification_batches(tokenizer, texts: Sequence[str], labels: Sequence, *, pairs: Sequence[str] | None = None,
                           batch_size: int = 16, max_length: int | None = 128, shuffle: bool = True,
                           seed: int = 0) -> Callable[[int], Iterator[dict]]:
    """``batches(epoch)``: tokenised batches with ``labels`` (ints: class indices; floats: regression or
    multi-label targets), in an order shuffled by ``seed + epoch`` (the same on every run)."""
    if len(texts) != len(labels) or (pairs is not None and len(pairs) != len(texts)):
        raise InputError(f"texts ({len(texts)}), labels ({len(labels)})"
                         + (f" and pairs ({len(pairs)})" if pairs is not None else "") + " must have the same length")
    if not texts:
        raise InputError("no training examples")
    check_index("batch_size", batch_size, 1, 10**9)
    target = torch.as_tensor(list(labels))

    def batches(epoch: int) -> Iterator[dict]:
        for rows in _epoch_rows(len(texts), batch_size, shuffle, seed + epoch):
            batch = dict(tokenizer([texts[i] for i in rows], None if pairs is None else [pairs[i] for i in rows],
                                   padding=True, truncation=True, max_length=max_length, return_tensors="pt"))
            batch["labels"] = target[rows]
            yield batch

    return batches


def tagging_batches(tokenizer, sentences: Sequence[Sequence[str]], tags: Sequence[Sequence[str]],
                    label2id: dict[str, int], *, batch_size: int = 16, max_length: int | None = 128,
                    shuffle: bool = True, seed: int = 0) -> Callable[[int], Iterator[dict]]:
    """``batches(epoch)`` for token classification: each word's first sub-word carries its tag's id,
    every other position (later pieces, special tokens, padding) -100, which the loss ignores."""
    from ..words import assign_pieces, word_spans

    if len(sentences) != len(tags) or any(len(w) != len(t) for w, t in zip(sentences, tags)):
        raise InputError("sentences and tags must have the same lengths, sentence by sentence")
    unknown = sorted({t for row in tags for t in row if t is not None} - set(label2id))
    if unknown:
        raise InputError(f"tags {unknown[:5]} are not among the model's labels {sorted(label2id)}")
    if not sentences:
        raise InputError("no training sentences")
    check_index("batch_size", batch_size, 1, 10**9)

    def batches(epoch: int) -> Iterator[dict]:
        for rows in _epoch_rows(len(sentences), batch_size, shuffle, seed + epoch):
            texts, spans = zip(*(word_spans(list(sentences[i])) for i in rows))
            batch = dict(tokenizer(list(texts), padding=True, truncation=True, max_length=max_length,
                                   return_offsets_mapping=True, return_tensors="pt"))
            offsets = batch.pop("offset_mapping")
            labels = torch.full(batch["input_ids"].shape, -100, dtype=torch.long)
            for r, (i, span) in enumerate(zip(rows, spans)):
                for w, pieces in enumerate(assign_pieces(offsets[r], batch["attention_mask"][r], span)):
                    if pieces and tags[i][w] is not None:  # None: a word without a tag, not trained on
                        labels[r, pieces[0]] = label2id[tags[i][w]]
            batch["labels"] = labels
            yield batch

    return batches


def tag_words(model, tokenizer, sentences: Sequence[Sequence[str]], *, batch_size: int = 32,
              max_length: int | None = 128) -> list[list[str]]:
    """Each word's predicted tag (from its first sub-word); words cut off by truncation get "O"."""
    from ..tools.batching import text_batches
    from ..words import assign_pieces, word_spans

    names = model.config.id2label
    texts, spans = zip(*(word_spans(list(s)) for s in sentences)) if len(sentences) else ((), ())
    out = [None] * len(texts)
    model.eval()
    device = next(model.parameters()).device  # the model runs where it is; the offsets are read on the CPU
    with torch.inference_mode():
        for rows, batch in text_batches(tokenizer, texts, batch_size=batch_size, max_length=max_length, offsets=True):
            offsets = batch.pop("offset_mapping")
            best = model(**{k: v.to(device) for k, v in batch.items()}).logits.argmax(-1).cpu()  # (B, T)
            for r, i in enumerate(rows):
                pieces = assign_pieces(offsets[r], batch["attention_mask"][r], spans[i])
                out[i] = [names[int(best[r, p[0]])] if p else "O" for p in pieces]
    return out
