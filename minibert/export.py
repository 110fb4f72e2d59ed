"""``minibert.export``: the export functions under the name users look for (``minibert.compat.export`` is
where they live, above the models they take; this module is an entry point outside the layers, as
``__main__`` is, and re-exports lazily: importing it loads nothing until a name is used)."""

from __future__ import annotations

from .lazy import lazy_exports

_LAZY = {"to_onnx": "minibert.compat.export", "to_ct2": "minibert.compat.export",
         "ExportResult": "minibert.compat.export", "load_for_export": "minibert.compat.export"}
__all__ = sorted(_LAZY)

__getattr__ = lazy_exports(__name__, _LAZY, globals())
