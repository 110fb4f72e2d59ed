"""Where a run's lines go: the standard ``logging`` module, under the logger ``"minibert"``.

Every module that tells its user something while it works (an epoch's line, a resumed run, a reused token
store, the recipe's defaults) writes it to ``logging.getLogger(__name__)`` at INFO. Nothing is shown
unless someone listens: the command line does (``lines_to``: stdout or stderr, per command; ``--quiet``
silences the commands that say so), and in Python either of

    import logging; logging.basicConfig(level=logging.INFO, format="%(message)s")  # every library's lines

    from minibert.logs import lines_to
    with lines_to(sys.stderr):                                                     # minibert's alone
        finetune(run)

Under torchrun the first process alone speaks (``lines_to`` listens on rank 0 only).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

ROOT = logging.getLogger("minibert")
ROOT.addHandler(logging.NullHandler())  # a library's manners: silent until its user configures logging


@contextlib.contextmanager
def lines_to(stream=None, enabled: bool = True, prefix: str = ""):
    """While the block runs, minibert's INFO lines go to ``stream`` (default: sys.stderr as it is then), each
    as it is (no level or logger name; ``prefix`` before each); ``enabled=False`` leaves logging as it was, and so does a torchrun
    process other than the first (``RANK`` set and not 0)."""
    if not enabled or os.environ.get("RANK", "0") != "0":
        yield
        return
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(prefix.replace("%", "%%") + "%(message)s"))
    level = ROOT.level
    ROOT.addHandler(handler)
    ROOT.setLevel(logging.INFO)
    try:
        yield
    finally:
        ROOT.removeHandler(handler)
        ROOT.setLevel(level)
