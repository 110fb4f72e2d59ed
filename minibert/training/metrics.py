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


def tag_scheme(tags) -> str:
    """How a set of tags is read: ``"IOBES"`` (O, and B-/I-/E-/S- prefixes, an S- or E- among them), ``"BIO"``
    (O, B- and I- prefixes: IOB2, or IOB1 where I- may begin an entity -- read alike, as seqeval's default
    mode reads them), or ``"plain"`` (anything else: parts of speech, dependency relations, ...), which has
    no entities and is scored word by word. None (a word without a label) is left out."""
    found = {t for t in tags if t is not None}
    prefixed = all(t == "O" or (len(t) > 2 and t[1] == "-" and t[0] in "BIES") for t in found)
    if not found or not prefixed:
        return "plain"
    return "IOBES" if any(t[0] in "ES" and t != "O" for t in found) else "BIO"


def _split_tag(tag: str) -> tuple[str, str]:
    return ("O", "") if tag == "O" else (tag[0], tag[2:])


def entities(tags: Sequence[str]) -> set[tuple[str, int, int]]:
    """(type, first, last) of every entity in one BIO / IOB1 / IOBES sequence, chunked as seqeval's default
    (non-strict) mode chunks: an entity ends at O, at a B- or S-, after an E- or S-, or where the type
    changes; it begins at B- or S-, at an I- or E- after O / E- / S-, or where the type changes."""
    found, start = set(), 0
    prev, prev_type = "O", ""
    for i, tag in enumerate(list(tags) + ["O"]):
        kind, type_ = _split_tag(tag)
        ends = (prev in "ES" and prev != "O") or (prev in "BI" and kind in "BSO") \
            or (prev != "O" and prev_type != type_)
        if ends:
            found.add((prev_type, start, i - 1))
        begins = kind in "BS" or (prev in "ESO" and kind in "IE") or (kind != "O" and prev_type != type_)
        if begins:
            start = i
        prev, prev_type = kind, type_
    return found


def tag_scores(predicted: Sequence[Sequence[str]], gold: Sequence[Sequence[str | None]], scheme: str) -> dict:
    """What ``minibert finetune --task tag`` reports for a tag scheme (``tag_scheme``): entity F1 (micro,
    seqeval's convention) with precision and recall for BIO / IOBES tags; word accuracy and macro-F1 over
    the tags for plain tags. Words whose gold tag is None are left out of both."""
    _same_length(predicted, gold)
    for p, g in zip(predicted, gold):
        if len(p) != len(g):
            raise InputError(f"a predicted tag sequence has {len(p)} tags, its gold one {len(g)}")
    if scheme == "plain":
        pairs = [(p, g) for ps, gs in zip(predicted, gold) for p, g in zip(ps, gs) if g is not None]
        if not pairs:
            raise InputError("no word of the evaluation data has a tag to score")
        ps, gs = zip(*pairs)
        return {"accuracy": accuracy(ps, gs), "macro_f1": macro_f1(ps, gs)}
    if scheme not in ("BIO", "IOBES"):
        raise InputError(f"tag scheme {scheme!r}: use 'BIO', 'IOBES' or 'plain'")
    gold = [[g if g is not None else "O" for g in gs] for gs in gold]
    scores = entity_f1(predicted, gold)
    return {"entity_f1": scores["f1"], "precision": scores["precision"], "recall": scores["recall"]}


#: the metric the best epoch is chosen by, per tag scheme
SCHEME_METRIC = {"BIO": "entity_f1", "IOBES": "entity_f1", "plain": "accuracy"}


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
