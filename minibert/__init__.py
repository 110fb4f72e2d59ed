"""minibert: a readable, exact BERT encoder in PyTorch.

The package is layered, one folder a layer (see ARCHITECTURE.md): the core (the files beside this one:
config, model, loading, tokenizer, inputs, hook points, quantize) knows nothing of the folders above it --
``tools`` (hooks, the fast path, surgery, accounting, batching, encoding texts), ``models`` (the public
``BertModel`` with the tools as methods, the task heads), ``analysis``, ``training``, ``compat`` and the
fronts ``cli`` and ``testing``.

Names are imported on first use, so that ``import minibert.cli`` (and ``minibert --help``) does not pay
for importing torch.
"""

from __future__ import annotations

import importlib

from .errors import CheckpointError, InputError, MissingExtra

_LAZY = {"BertConfig": ".config", "BertModel": ".models.bert", "BertOutput": ".model", "BertTokenizer": ".tokenizer",
         "BertForSequenceClassification": ".models.heads", "BertForTokenClassification": ".models.heads",
         "BertForQuestionAnswering": ".models.heads", "BertForMaskedLM": ".models.pretraining",
         "BertForPreTraining": ".models.pretraining"}

__all__ = ["BertConfig", "BertModel", "BertOutput", "BertTokenizer", "BertForSequenceClassification",
           "BertForTokenClassification", "BertForQuestionAnswering", "BertForMaskedLM", "BertForPreTraining",
           "CheckpointError", "InputError", "MissingExtra"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    else:
        raise AttributeError(f"module 'minibert' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))

