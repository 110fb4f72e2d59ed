"""minibert: a readable, exact BERT encoder in PyTorch.

The package is layered (see ARCHITECTURE.md): the core (config, model, loading, tokenizer, inputs,
hook points) knows nothing of ``minibert.tools`` (hooks and interventions, the fast path, surgery,
accounting) or ``minibert.analysis`` (layers, probing, lens, plots, parity), which build on it.

Names are imported on first use, so that ``import minibert.cli`` (and ``minibert --help``) does not pay
for importing torch. ``from minibert import layers`` (or hooks, fast, ...) still finds the modules that
moved into those sub-packages; ``import minibert.layers`` says where they are now.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys

from .errors import CheckpointError, InputError, MissingExtra

_LAZY = {"BertConfig": ".config", "BertModel": ".model", "BertOutput": ".model", "BertTokenizer": ".tokenizer"}

#: modules that moved into the sub-packages: old name -> new place
MOVED = {"layers": "analysis.layers", "probing": "analysis.probing", "plots": "analysis.plots",
         "lens": "analysis.lens", "parity": "analysis.parity", "hooks": "tools.hooks", "fast": "tools.fast",
         "surgery": "tools.surgery", "accounting": "tools.accounting"}

__all__ = ["BertConfig", "BertModel", "BertOutput", "BertTokenizer", "CheckpointError", "InputError",
           "MissingExtra"]
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


class _MovedModules(importlib.abc.MetaPathFinder):
    """``import minibert.layers`` (an old path) fails with a message that names the new one."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.partition(".")
        if package == __name__ and name in MOVED:
            raise ModuleNotFoundError(
                f"{fullname} moved to {__name__}.{MOVED[name]}: write `from {__name__}.{MOVED[name].split('.')[0]} "
                f"import {name}` (or `from {__name__} import {name}`, which still works)", name=fullname)
        return None


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())
