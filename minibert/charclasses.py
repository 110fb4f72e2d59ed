"""The character classes of BERT's normaliser and pre-tokeniser: whitespace, control, punctuation, mark, CJK.

The Rust tokenizers library classifies characters with Unicode tables older than Python's unicodedata
(characters added since count as letters there), so the classes below are the reference's own, probed
code point by code point by tools/gen_unicode_tables.py and stored as sorted (first, last) ranges in
``_unicode_tables.py`` (generated; do not edit). ``tokenizer.py`` reads them through these predicates.
"""

from __future__ import annotations

import bisect

from . import _unicode_tables as _tables

WHITESPACE = frozenset(_tables.WHITESPACE + " ")  # becomes a space, then separates words
_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
               (0x2B740, 0x2B81F), (0x2B920, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def _in(ranges: list, starts: list, ch: str) -> bool:
    k = bisect.bisect_right(starts, ord(ch)) - 1
    return k >= 0 and ord(ch) <= ranges[k][1]


_CONTROL_STARTS = [lo for lo, _ in _tables.CONTROL]
_PUNCT_STARTS = [lo for lo, _ in _tables.PUNCTUATION]
_MARK_STARTS = [lo for lo, _ in _tables.MARK]


def is_cjk(ch: str) -> bool:
    """CJK Unified Ideographs (and extensions, compatibility ideographs): each becomes its own word.
    Hangul, kana and Thai are not in these blocks and are tokenised like any other letters."""
    cp = ord(ch)
    return any(lo <= cp <= hi for lo, hi in _CJK_RANGES)


def is_control(ch: str) -> bool:
    """Removed by text cleaning: NUL, U+FFFD, control, format and private-use characters."""
    return _in(_tables.CONTROL, _CONTROL_STARTS, ch)


def is_punctuation(ch: str) -> bool:
    """Unicode punctuation plus every ASCII symbol ($, +, <, ^, `, |, ~ are symbols in Unicode)."""
    return _in(_tables.PUNCTUATION, _PUNCT_STARTS, ch)


def is_mark(ch: str) -> bool:
    """A non-spacing combining mark (an accent once NFD has split it off its letter)."""
    return _in(_tables.MARK, _MARK_STARTS, ch)
