"""minibert/logs.py: a run's lines go through ``logging``; the command line (and a Python user) listens with
``lines_to``."""

from __future__ import annotations

import io
import logging

from minibert.logs import ROOT, lines_to


def test_lines_reach_the_stream_only_while_listened_to(monkeypatch):
    said = logging.getLogger("minibert.training.loop")
    quiet = io.StringIO()
    said.info("before anyone listens")  # the library's NullHandler: nothing, and no "no handler" warning
    stream = io.StringIO()
    with lines_to(stream, prefix="  trec 50%: "):
        said.info("epoch 1/3: train loss 0.5")
        logging.getLogger("minibert.runs.finetune").debug("not at INFO: not shown")
        logging.getLogger("other.library").info("another library's line: not ours")
    said.info("after: not shown")
    assert stream.getvalue() == "  trec 50%: epoch 1/3: train loss 0.5\n"
    assert ROOT.level == logging.NOTSET and all(isinstance(h, logging.NullHandler) for h in ROOT.handlers)
    with lines_to(quiet, enabled=False):  # --quiet
        said.info("silenced")
    monkeypatch.setenv("RANK", "1")  # a torchrun process other than the first
    with lines_to(quiet):
        said.info("rank 1 says nothing")
    assert quiet.getvalue() == ""
