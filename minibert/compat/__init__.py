"""Compatibility layers: code written for transformers or sentence-transformers runs on minibert.

``TransformersBertModel`` (``compat.hf``): transformers' BertModel calling convention on minibert's model.
``SentenceEncoder`` (``compat.sentence``): sentence-transformers model folders, ``encode`` with their settings.
"""

from __future__ import annotations

import importlib

_LAZY = {"TransformersBertModel": ".hf", "ModelOutput": ".hf", "SentenceEncoder": ".sentence"}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'minibert.compat' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value
