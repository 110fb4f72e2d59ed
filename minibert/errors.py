"""The errors minibert raises on purpose.

A ``InputError`` is about something the caller gave: an input tensor, an option, a file, a checkpoint.
Its message names the bad argument and the limit, and it is meant to be read by a person: the command
line prints it as one line (``minibert: error: ...``, exit code 2). Any other exception is a bug and keeps
its traceback. ``InputError`` is a ``ValueError``, so ``except ValueError`` catches it as before.

A ``MissingExtra`` is an optional package that a feature needs (matplotlib for plots, conllu for CoNLL-U,
transformers for parity against transformers); its message says which extra to install.
"""

from __future__ import annotations


class InputError(ValueError):
    """Something the caller gave is wrong: the message says what, and what would be right."""


class CheckpointError(InputError):
    """A checkpoint that does not fit its config, is truncated or corrupt, or a source that holds no
    usable checkpoint."""


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""
