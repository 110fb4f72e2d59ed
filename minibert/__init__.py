"""minibert: a readable, exact BERT encoder in PyTorch.

The names below are imported on first use, so that ``import minibert.cli`` (and ``minibert --help``)
does not pay for importing torch."""

from __future__ import annotations

import importlib

from .errors import CheckpointError, InputError, MissingExtra

_LAZY = {"BertConfig": ".config", "BertModel": ".model", "BertOutput": ".model", "BertTokenizer": ".tokenizer"}

__all__ = ["BertConfig", "BertModel", "BertOutput", "BertTokenizer", "CheckpointError", "InputError",
           "MissingExtra"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'minibert' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
