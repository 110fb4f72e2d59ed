"""Every Python snippet in README.md runs as written, in order, on the MiniLM weights the README loads.

A snippet that cannot run here (it needs the hub) is preceded in README.md by a line starting with
``<!-- not run``, which says why. Snippets share one namespace, as a reader pasting them into one session
would; they run in a temporary directory whose ``weights/`` is the repository's.
"""

from __future__ import annotations

import os
import re
import warnings

import pytest

from conftest import ROOT

FENCE = re.compile(r"(?P<before>[^\n]*)\n```python\n(?P<code>.*?)\n```", re.S)


def python_snippets() -> list[tuple[int, str, bool]]:
    """(line number, code, runnable) for every ```python block of README.md."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    snippets = []
    for match in FENCE.finditer(text):
        line = text[: match.start("code")].count("\n") + 1
        snippets.append((line, match.group("code"), not match.group("before").startswith("<!-- not run")))
    return snippets


def test_readme_has_snippets_and_says_why_one_is_not_run():
    snippets = python_snippets()
    assert len(snippets) >= 6
    assert sum(not runnable for _, _, runnable in snippets) <= 2  # only the hub ones


def test_every_readme_python_snippet_runs(minilm_dir, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    assert minilm_dir == ROOT / "weights" / "all-MiniLM-L6-v2"
    (tmp_path / "weights").symlink_to(ROOT / "weights")
    (tmp_path / "tests").symlink_to(ROOT / "tests")  # the README's examples read tests/data/
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    ran = 0
    for line, code, runnable in python_snippets():
        if not runnable:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the bf16 snippet on a CPU without bf16 units
            # README teaches the current names only: our own deprecations are errors here
            warnings.filterwarnings("error", category=DeprecationWarning, module="minibert")
            warnings.filterwarnings("error", message=".*minibert.*(has moved|will go)", category=DeprecationWarning)
            try:
                exec(compile(code, f"README.md:{line}", "exec"), namespace)
            except Exception as e:
                pytest.fail(f"README.md snippet at line {line} fails: {type(e).__name__}: {e}")
        ran += 1
    assert ran >= 6
    assert os.path.exists(tmp_path / "my-copy" / "model.safetensors")  # save_pretrained in "Using it"


def test_readme_hook_point_table_is_the_code_table():
    from minibert.tools.hooks import markdown_table

    assert markdown_table() in (ROOT / "README.md").read_text(encoding="utf-8")
