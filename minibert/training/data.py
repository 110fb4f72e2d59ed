"""Labelled examples into shuffled, padded batches for ``loop.fit``."""

from __future__ import annotations

import random
from typing import Callable, Iterator, Sequence

import torch

from ..errors import InputError


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
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size={batch_size!r} must be a positive int")
    target = torch.as_tensor(list(labels))

    def batches(epoch: int) -> Iterator[dict]:
        order = list(range(len(texts)))
        if shuffle:
            random.Random(seed + epoch).shuffle(order)
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            batch = dict(tokenizer([texts[i] for i in rows], None if pairs is None else [pairs[i] for i in rows],
                                   padding=True, truncation=True, max_length=max_length, return_tensors="pt"))
            batch["labels"] = target[rows]
            yield batch

    return batches
