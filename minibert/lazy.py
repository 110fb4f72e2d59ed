"""Names a package exports without importing them until first use (so that ``import minibert.cli`` and
``minibert --help`` never wait for torch): ``__getattr__ = lazy_exports(__name__, {name: ".module"}, globals())``."""

from __future__ import annotations

import importlib


def lazy_exports(package: str, table: dict[str, str], namespace: dict):
    """A module ``__getattr__`` that imports ``table[name]`` (a module path relative to ``package``) on first
    access, takes ``name`` from it and keeps it in ``namespace``."""
    def __getattr__(name: str):
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(table[name], package), name)
        namespace[name] = value
        return value
    return __getattr__
