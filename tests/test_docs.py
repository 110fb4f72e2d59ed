"""The documentation runs and stays true (issue 30).

* Every ```python block of README.md and of each page under docs/ runs as written, on the MiniLM weights,
  one namespace per page (a reader pasting a page's blocks into one session), with no DeprecationWarning
  of ours. A block that cannot run here (it needs the hub) is preceded by a line starting with
  ``<!-- not run``, which says why.
* Every ```bash block preceded by ``<!-- run -->`` runs (in a temporary folder, with the checkout's
  ``weights/`` and the venv's ``minibert`` on PATH) and exits 0.
* The pages made from the code (hook points, command line, errors, results) equal what
  ``tools/gen_docs.py`` makes now, and every results page names its machine.
* README.md stays short and starts with the two set-up commands.

The tutorials (docs/tutorials/*.py) are executed by the site build (``mkdocs build --strict``, which CI
runs), not here: together they take minutes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from conftest import ROOT

FENCE = re.compile(r"(?P<before>[^\n]*)\n```(?P<lang>python|bash)\n(?P<code>.*?)\n```", re.S)
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def blocks(page: Path, lang: str) -> list[tuple[int, str, str]]:
    """(line number, code, the line before) for every ```lang block of a page."""
    text = page.read_text(encoding="utf-8")
    return [(text[: m.start("code")].count("\n") + 1, m.group("code"), m.group("before"))
            for m in FENCE.finditer(text) if m.group("lang") == lang]


def _workdir(tmp_path: Path) -> Path:
    (tmp_path / "weights").symlink_to(ROOT / "weights")
    (tmp_path / "tests").symlink_to(ROOT / "tests")  # some examples read tests/data/
    return tmp_path


def test_every_page_has_its_blocks_marked_where_they_cannot_run():
    skipped = [(page.name, line) for page in PAGES for line, _, before in blocks(page, "python")
               if before.startswith("<!-- not run")]
    assert len(skipped) <= 3, skipped  # only the hub ones
    assert sum(len(blocks(page, "python")) for page in PAGES) >= 15


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, "python")], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_of_a_page_runs(page, minilm_dir, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    assert minilm_dir == ROOT / "weights" / "all-MiniLM-L6-v2"
    monkeypatch.chdir(_workdir(tmp_path))
    namespace: dict = {}
    where = page.relative_to(ROOT)
    for line, code, before in blocks(page, "python"):
        if before.startswith("<!-- not run"):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the bf16 block on a CPU without bf16 units
            # the docs teach the current names only: our own deprecations are errors here
            warnings.filterwarnings("error", category=DeprecationWarning, module="minibert")
            warnings.filterwarnings("error", message=".*minibert.*(has moved|will go)", category=DeprecationWarning)
            try:
                exec(compile(code, f"{where}:{line}", "exec"), namespace)
            except Exception as e:
                pytest.fail(f"{where} block at line {line} fails: {type(e).__name__}: {e}")
    if page.name == "README.md":
        assert (tmp_path / "my-copy" / "model.safetensors").exists()  # save_pretrained in the quick start


def test_bash_blocks_marked_runnable_run(minilm_dir, tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    ran = 0
    for page in PAGES:
        for line, code, before in blocks(page, "bash"):
            if before.strip() != "<!-- run -->":
                continue
            folder = tmp_path / f"{page.stem}{line}"
            folder.mkdir()
            out = subprocess.run(["bash", "-ec", code], cwd=_workdir(folder), env=env, capture_output=True,
                                 text=True, timeout=300)
            assert out.returncode == 0, f"{page.relative_to(ROOT)}:{line}: {out.stderr[-2000:]}"
            ran += 1
    assert ran >= 3


def test_generated_pages_equal_what_the_code_makes():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_docs.py"), "--check"], capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def test_generated_pages_cover_the_code():
    sys.path.insert(0, str(ROOT / "tools"))
    import gen_docs

    from minibert import errors
    from minibert.cli import build_parser
    from minibert.tools.hooks import markdown_table

    assert markdown_table() in gen_docs.hooks_page()
    cli = gen_docs.cli_page()
    parser = build_parser()
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    for name, command in commands.items():
        assert f"## minibert {name}" in cli
        for action in command._actions:
            for flag in action.option_strings if action.dest != "help" else ():
                assert f"`{flag}`" in cli, (name, flag)
    import inspect

    page = gen_docs.errors_page()
    for name in ("InputError", "CheckpointError", "MissingExtra"):
        assert f"## {name}" in page and inspect.getdoc(getattr(errors, name)) in page


def test_every_results_page_names_its_machine():
    provenance = json.loads((ROOT / "benchmarks" / "results" / "provenance.json").read_text())
    sources = [p.name for p in (ROOT / "benchmarks" / "results").glob("*.md") if not p.name.endswith("_quick.md")]
    assert sorted(provenance) == sorted(sources)
    for name, meta in provenance.items():
        assert all(str(meta.get(k, "")).strip() for k in ("cpu", "threads", "software", "date", "command")), name
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", meta["date"]), name
        page = (ROOT / "docs" / "results" / (Path(name).stem.replace("_", "-") + ".md")).read_text()
        assert f"| CPU | {meta['cpu']} |" in page and f"| date | {meta['date']} |" in page


def test_readme_is_short_and_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    first_two = [code for _, code, _ in blocks(ROOT / "README.md", "bash")][:2]
    assert "weights/fetch_minilm.py" in first_two[0] and "minibert encode" in first_two[0]
    assert "pytest" in first_two[1]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert first_two[1] in ci  # CI runs the test command README gives


def test_every_tutorial_is_in_the_site_and_its_index():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    index = (ROOT / "docs" / "tutorials" / "index.md").read_text(encoding="utf-8")
    tutorials = sorted((ROOT / "docs" / "tutorials").glob("*.py"))
    assert len(tutorials) >= 5
    for tutorial in tutorials:
        assert f"tutorials/{tutorial.name}" in nav and f"({tutorial.name})" in index, tutorial.name
        assert tutorial.read_text(encoding="utf-8").startswith("# %% [markdown]\n# # "), tutorial.name
