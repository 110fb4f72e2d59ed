"""minibert: a readable, exact BERT encoder in PyTorch.

The package is layered, one folder a layer (see ARCHITECTURE.md): the core (the files beside this one:
config, model, loading, tokenizer, inputs, hook points, quantize) knows nothing of the folders above it --
``tools`` (hooks, the fast path, surgery, accounting, batching, encoding texts), ``models`` (the public
``BertModel`` with the tools as methods, the task heads), ``analysis``, ``training``, ``compat`` and the
fronts ``cli`` and ``testing``.

Names are imported on first use, so that ``import minibert.cli`` (and ``minibert --help``) does not pay
for importing torch. Modules that moved keep their old names for now, with a DeprecationWarning naming
the new place: ``import minibert.fast`` is ``minibert.tools.fast``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from .errors import CheckpointError, InputError, MissingExtra

_LAZY = {"BertConfig": ".config", "BertModel": ".models.bert", "BertOutput": ".model", "BertTokenizer": ".tokenizer",
         "BertForSequenceClassification": ".models.heads", "BertForTokenClassification": ".models.heads",
         "BertForQuestionAnswering": ".models.heads", "BertForMaskedLM": ".models.pretraining",
         "BertForPreTraining": ".models.pretraining"}

#: modules that moved: old name -> new place. Importing an old name warns (DeprecationWarning) and gives
#: the module at its new place (the same object).
MOVED = {"layers": "analysis.layers", "probing": "analysis.probing", "plots": "analysis.plots",
         "lens": "analysis.lens", "parity": "analysis.parity", "hooks": "tools.hooks", "fast": "tools.fast",
         "surgery": "tools.surgery", "accounting": "tools.accounting", "distill": "training.distill",
         "api": "models.bert", "heads": "models.heads", "distributed": "compat.ray",
         "training.tasks": "training.pipelines.finetune"}


def _moved(name: str) -> str:
    """The new full name of the old module ``minibert.<name>``, after a DeprecationWarning naming it."""
    return moved(f"minibert.{name}", f"{__name__}.{MOVED[name]}", stacklevel=4)


def moved(old: str, new: str, stacklevel: int = 3) -> str:
    """``new``, after a DeprecationWarning that ``old`` moved there (the one wording of every such warning)."""
    warnings.warn(f"{old} has moved to {new}; import it from there (the old name will go)", DeprecationWarning,
                  stacklevel=stacklevel)
    return new

__all__ = ["BertConfig", "BertModel", "BertOutput", "BertTokenizer", "BertForSequenceClassification",
           "BertForTokenClassification", "BertForQuestionAnswering", "BertForMaskedLM", "BertForPreTraining",
           "CheckpointError", "InputError", "MissingExtra"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    elif name in MOVED:
        value = importlib.import_module(_moved(name))
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
            return importlib.util.spec_from_loader(fullname, _Alias(_moved(name)))
        return None


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())
