"""Evaluation metrics for fine-tuning: accuracy and macro-F1 (classification), Pearson and Spearman
(regression), entity-level F1 over BIO tags (tagging, the seqeval convention).

Entity F1 counts an entity as right only when its type and both boundaries match. Chunks are read as
seqeval does by default: an entity starts at ``B-X``, or at ``I-X`` after ``O`` or after an entity of
another type, and continues over ``I-X``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import InputError


def _same_length(a: Sequence, b: Sequence) -> None:
    if len(a) != len(b):
        raise InputError(f"predictions ({len(a)}) and gold labels ({len(b)}) differ in length")
    if len(a) == 0:
        raise InputError("no examples to evaluate")


def accuracy(predicted: Sequence, gold: Sequence) -> float:
    _same_length(predicted, gold)
    return sum(p == g for p, g in zip(predicted, gold)) / len(gold)


def macro_f1(predicted: Sequence, gold: Sequence) -> float:
    """The unweighted mean of each gold class's F1 (a class never predicted nor present is left out)."""
    _same_length(predicted, gold)
    scores = []
    for label in sorted(set(gold) | set(predicted), key=str):
        tp = sum(p == label and g == label for p, g in zip(predicted, gold))
        fp = sum(p == label and g != label for p, g in zip(predicted, gold))
        fn = sum(p != label and g == label for p, g in zip(predicted, gold))
        scores.append(0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn))
    return sum(scores) / len(scores)


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """The linear correlation of ``x`` and ``y`` (sequences or tensors), in float64; NaN when either is
    constant."""
    _same_length(x, y)
    a, b = (torch.as_tensor(v, dtype=torch.float64).flatten() for v in (x, y))
    a, b = a - a.mean(), b - b.mean()
    sx, sy = float(a.norm()), float(b.norm())
    return float("nan") if sx == 0 or sy == 0 else float((a @ b) / (sx * sy))


def ranks(values: Sequence[float]) -> torch.Tensor:
    """Ranks from 1 (float64), ties getting the mean of the ranks they span (scipy's ``rankdata``)."""
    x = torch.as_tensor(values, dtype=torch.float64).flatten()
    ordered, order = x.sort(stable=True)
    _, group, counts = torch.unique_consecutive(ordered, return_inverse=True, return_counts=True)
    last = counts.cumsum(0).to(torch.float64)  # the last rank of each run of equal values
    mean = last - (counts.to(torch.float64) - 1) / 2
    out = torch.empty_like(x)
    out[order] = mean[group]
    return out


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """The rank correlation: Pearson's of the ranks, ties averaged (scipy's ``spearmanr``)."""
    _same_length(x, y)
    return pearson(ranks(x), ranks(y))


def entities(tags: Sequence[str]) -> set[tuple[str, int, int]]:
    """(type, first, last) of every entity in one BIO-tagged sequence."""
    found, start, kind = set(), None, None
    for i, tag in enumerate(list(tags) + ["O"]):
        prefix, _, label = tag.partition("-")
        begins = prefix == "B" or (prefix == "I" and label != kind)
        if kind is not None and (prefix == "O" or begins):
            found.add((kind, start, i - 1))
            kind = None
        if begins:
            start, kind = i, label
    return found


def entity_f1(predicted: Sequence[Sequence[str]], gold: Sequence[Sequence[str]]) -> dict:
    """Micro precision, recall and F1 over entities of all sentences."""
    _same_length(predicted, gold)
    tp = fp = fn = 0
    for p, g in zip(predicted, gold):
        if len(p) != len(g):
            raise InputError(f"a predicted tag sequence has {len(p)} tags, its gold one {len(g)}")
        ep, eg = entities(p), entities(g)
        tp, fp, fn = tp + len(ep & eg), fp + len(ep - eg), fn + len(eg - ep)
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}
