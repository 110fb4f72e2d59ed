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
    """Something the caller gave is wrong: the message says what, and what would be right.

    Where the way out differs between Python and the shell (an argument of a function, a flag of a
    command), the error carries both: ``InputError(message, python="pass check_base=False", shell="pass
    --skip-base-check")``. ``str(error)`` is the message with the Python advice; the command line prints
    ``error.for_shell()``, the message with the shell's."""

    def __init__(self, message: str = "", *, python: str | None = None, shell: str | None = None):
        self.message, self.python, self.shell = message, python, shell
        super().__init__(message + (f": {python}" if python else ""))

    def for_shell(self) -> str:
        """The message as the command line prints it: with the shell's advice (never Python's)."""
        if self.python is None and self.shell is None:
            return str(self)
        return self.message + (f": {self.shell}" if self.shell else "")


class CheckpointError(InputError):
    """A checkpoint that does not fit its config, is truncated or corrupt, or a source that holds no
    usable checkpoint."""


class TrainingStopped(InputError):
    """A training run stopped because it could not go on usefully: its loss or gradients became NaN or
    infinite (beyond the steps fp16's loss scaling skips on purpose). The message names the step, what
    was not finite, the likely cause and the last good checkpoint; nothing non-finite is saved as the
    model."""


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def install_hint(extra: str) -> str:
    """How to install an extra: from the checkout, as README does (``minibert`` on PyPI is another project)."""
    return f'pip install -e ".[{extra}]" in the minibert checkout'


def missing_extra(what: str, package: str, extra: str | None) -> MissingExtra:
    """The error for a missing optional package: what needs it, which package, how to install it."""
    how = install_hint(extra) if extra else f"pip install {package}"
    return MissingExtra(f"{what} need{'s' if not what.endswith('s') else ''} {package}: {how}")


def require_extra(module: str, what: str, package: str | None = None, extra: str | None = None) -> None:
    """Check that an optional module can be imported, before any work (without importing it: cheap)."""
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise missing_extra(what, package or module, extra)


def not_found(path, what: str = "file") -> FileNotFoundError:
    """The one form of "not found": what was looked for and where (the absolute path), in one line."""
    import os

    return FileNotFoundError(f"{what} {str(path)!r} not found (looked for {os.path.abspath(os.path.expanduser(path))})")


def first_line(error: BaseException, limit: int = 300) -> str:
    """A library's failure in one line of ours: its message's first line ("" if none), cut to ``limit`` with "..."."""
    line = (str(error).strip().splitlines() or [""])[0]
    return line if len(line) <= limit else line[:limit - 3] + "..."
