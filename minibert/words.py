"""Words and their word pieces: a sentence given as words becomes one text with each word's character span
(``word_spans``), and a tokenizer's character offsets say which pieces make up each span
(``assign_pieces``). Probing, tagging and maps align sub-words to words through these two."""

from __future__ import annotations


def word_spans(words: list[str]) -> tuple[str, list[tuple[int, int]]]:
    """The words joined by single spaces, and each word's character span in that text."""
    spans, pos = [], 0
    for w in words:
        spans.append((pos, pos + len(w)))
        pos += len(w) + 1
    return " ".join(words), spans


def assign_pieces(offsets, mask, spans):
    """Token positions of each word: a token belongs to the word whose span contains its start.
    ``offsets`` (T, 2) and ``mask`` (T,): tensors or lists."""
    pieces = [[] for _ in spans]
    w = 0
    offsets, mask = (x.tolist() if hasattr(x, "tolist") else x for x in (offsets, mask))
    for t, ((a, b), m) in enumerate(zip(offsets, mask)):
        if not m or a == b:  # padding and special tokens
            continue
        while w < len(spans) and a >= spans[w][1]:
            w += 1
        if w < len(spans) and spans[w][0] <= a < spans[w][1]:
            pieces[w].append(t)
    return pieces
