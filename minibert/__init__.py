"""minibert: a readable, exact BERT encoder in PyTorch.

The package is layered (see ARCHITECTURE.md): the core (config, model, loading, tokenizer, inputs,
hook points) knows nothing of ``minibert.tools`` (hooks and interventions, the fast path, surgery,
accounting) or ``minibert.analysis`` (layers, probing, lens, plots, parity), which build on it.
``minibert.BertModel`` is the textbook model of ``model.py`` with the tools as methods (``api.py``).

Names are imported on first use, so that ``import minibert.cli`` (and ``minibert --help``) does not pay
for importing torch. The modules that moved into the sub-packages keep their old names too:
``import minibert.fast`` is ``minibert.tools.fast``, ``from minibert import layers`` is
``minibert.analysis.layers``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

from .errors import CheckpointError, InputError, MissingExtra

_LAZY = {"BertConfig": ".config", "BertModel": ".api", "BertOutput": ".model", "BertTokenizer": ".tokenizer",
         "BertForSequenceClassification": ".heads", "BertForTokenClassification": ".heads",
         "BertForQuestionAnswering": ".heads"}

#: modules that moved into the sub-packages: old name -> new place
MOVED = {"layers": "analysis.layers", "probing": "analysis.probing", "plots": "analysis.plots",
         "lens": "analysis.lens", "parity": "analysis.parity", "hooks": "tools.hooks", "fast": "tools.fast",
         "surgery": "tools.surgery", "accounting": "tools.accounting",
         "distill": "training.distill"}  # short name: the issue that asked for it says minibert/distill.py

__all__ = ["BertConfig", "BertModel", "BertOutput", "BertTokenizer", "BertForSequenceClassification",
           "BertForTokenClassification", "BertForQuestionAnswering", "CheckpointError", "InputError", "MissingExtra"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    elif name in MOVED:
        value = importlib.import_module(f".{MOVED[name]}", __name__)
    else:
        raise AttributeError(f"module 'minibert' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(MOVED))


class _Alias(importlib.abc.Loader):
    """Loads an old module name as the module that now holds it (the same object)."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module):
        pass


class _MovedModules(importlib.abc.MetaPathFinder):
    """``import minibert.fast`` (an old path) gives ``minibert.tools.fast``."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.partition(".")
        if package == __name__ and name in MOVED:
            return importlib.util.spec_from_loader(fullname, _Alias(f"{__name__}.{MOVED[name]}"))
        return None


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())
