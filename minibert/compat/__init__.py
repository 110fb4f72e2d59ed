"""Compatibility layers: code written for transformers or sentence-transformers runs on minibert.

``TransformersBertModel`` (``compat.hf``): transformers' BertModel calling convention and names on minibert's model.
``SentenceEncoder`` (``compat.sentence``): sentence-transformers model folders, ``encode`` with their settings;
``as_backend`` hands it to KeyBERT or BERTopic.
``embed_dataset`` (``compat.ray``): the Ray Data engine of ``minibert embed --engine ray``.
"""

from __future__ import annotations

from ..lazy import lazy_exports

_LAZY = {"TransformersBertModel": ".hf", "ModelOutput": ".hf", "SentenceEncoder": ".sentence", "embed_dataset": ".ray"}
__all__ = sorted(_LAZY)

__getattr__ = lazy_exports(__name__, _LAZY, globals())
