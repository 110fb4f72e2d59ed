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
        kind = "GPU" if "GPU" in meta["cpu"] else "CPU"  # a GPU run's row says GPU, not CPU
        assert f"| {kind} | {meta['cpu']} |" in page and f"| date | {meta['date']} |" in page


def test_readme_is_short_and_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    first_two = [code for _, code, _ in blocks(ROOT / "README.md", "bash")][:2]
    assert "weights/fetch_minilm.py" in first_two[0] and "minibert encode" in first_two[0]
    assert "pytest" in first_two[1]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert first_two[1] in ci  # CI runs the test command README gives


TUTORIAL_WIDTH = 88  # what a code cell of the site shows without a scroll bar


def test_tutorial_code_fits_the_page_and_says_nothing_on_stderr():
    """A tutorial's code lines fit the page (its prose is wrapped by the site); and the libraries' noise --
    download bars, tqdm's "IProgress not found" -- is switched off where a tutorial calls transformers."""
    for path in sorted((ROOT / "docs" / "tutorials").glob("*.py")):
        text = path.read_text(encoding="utf-8")
        wide = [n for n, line in enumerate(text.splitlines(), 1)
                if len(line) > TUTORIAL_WIDTH and not line.lstrip().startswith("#")]
        assert not wide, f"{path.name}: code lines over {TUTORIAL_WIDTH} characters: {wide}"
        if "from_pretrained" in text and "import transformers" in text:
            assert "transformers.logging.disable_progress_bar()" in text, path.name


def test_every_page_is_in_the_sites_navigation():
    """mkdocs --strict (CI) refuses a page left out of the nav: say it here, in seconds, by name."""
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    missing = [p for p in pages if p != "index.md" and p not in nav]
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}"


def test_every_tutorial_is_in_the_site_and_its_index():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    index = (ROOT / "docs" / "tutorials" / "index.md").read_text(encoding="utf-8")
    tutorials = sorted((ROOT / "docs" / "tutorials").glob("*.py"))
    assert len(tutorials) >= 5
    for tutorial in tutorials:
        assert f"tutorials/{tutorial.name}" in nav and f"({tutorial.name})" in index, tutorial.name
        assert tutorial.read_text(encoding="utf-8").startswith("# %% [markdown]\n# # "), tutorial.name


# ---------------------------------------------------------------------------- documented commands parse
def _as_minibert(part: str) -> str | None:
    """A shell command as `minibert ...` when it runs minibert (minibert, .venv/bin/minibert, python -m
    minibert, torchrun ... -m minibert); None otherwise."""
    if " -m minibert " in f" {part} ":
        return "minibert " + part.split("-m minibert", 1)[1].strip()
    for program in ("minibert ", ".venv/bin/minibert "):
        if part.startswith(program):
            return "minibert " + part[len(program):]
    return None


def documented_commands() -> list[tuple[str, int, str]]:
    """(where, line, command) for every `minibert ...` command of a ```bash block of README.md and the pages,
    and of the CLI module's own synopsis (continuation lines joined)."""
    import inspect

    import minibert.cli

    sources = [(str(page.relative_to(ROOT)), [(line, code) for line, code, _ in blocks(page, "bash")]) for page in PAGES]
    synopsis = [re.split(r"\s{3,}\(", line)[0] for line in inspect.getdoc(minibert.cli).splitlines()]  # "   (note)"
    sources.append(("minibert/cli/__init__.py", [(1, "\n".join(synopsis))]))
    found = []
    for where, codes in sources:
        for first, code in codes:
            for offset, line in enumerate(code.replace("\\\n", " ").split("\n")):
                for part in line.strip().split("&&"):
                    command = _as_minibert(part.strip())
                    if command is not None:
                        found.append((where, first + offset, command))
    return found


def _synopsis(argv: list[str]) -> bool:
    """A line that shows a command's shape ([optional], a|b, ...) rather than one to run."""
    return any(t.startswith(("[", "(")) or t.endswith(("]", ")")) or "|" in t or t.endswith("...") for t in argv)


def test_every_documented_command_parses_as_the_cli_has_it():
    """Each `minibert` command of README.md, the pages and the CLI's synopsis: a command to run parses with
    the real parser (nothing is run), and every file of data/ it names is fetched by a command its page
    gives; a synopsis (``[--flag X]``, ``a|b``) names only options the command has, and spells out every
    choice of an option it lists choices of. A page cannot drift from the CLI again."""
    import contextlib
    import io
    import shlex

    from minibert.cli import _join_negative_values, build_parser

    sys.path.insert(0, str(ROOT / "data"))
    import fetch_data

    parser = build_parser()
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    found = documented_commands()
    assert len(found) >= 40
    problems = []
    for where, line, text in found:
        try:
            argv = shlex.split(text, comments=True)[1:]
        except ValueError as e:  # an unclosed quote
            problems.append(f"{where}:{line}: {e}: {text}")
            continue
        for cut in ("|", ">", "2>"):  # a pipe or a redirection ends the command
            argv = argv[:argv.index(cut)] if cut in argv else argv
        command = commands.get(argv[0]) if argv else None
        if command is None:
            problems.append(f"{where}:{line}: no command {argv[:1]}: {text}")
            continue
        options = {flag: action for action in command._actions for flag in action.option_strings}
        if _synopsis(argv):
            for i, token in enumerate(argv):
                flag = token.strip("[]()").split("=")[0]
                if not flag.startswith("--"):
                    continue
                if flag not in options:
                    problems.append(f"{where}:{line}: `minibert {argv[0]}` has no {flag}")
                    continue
                value = argv[i + 1].strip("[]()") if i + 1 < len(argv) else ""
                if options[flag].choices and "|" in value and sorted(value.split("|")) != sorted(options[flag].choices):
                    problems.append(f"{where}:{line}: {flag} {value}: its choices are {'|'.join(options[flag].choices)}")
            continue
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parser.parse_args(_join_negative_values(argv))
        except SystemExit:
            problems.append(f"{where}:{line}: {err.getvalue().strip().splitlines()[-1]}: {text}")
            continue
        page = (ROOT / where).read_text(encoding="utf-8")
        fetches = re.findall(r"fetch_data\.py[^`\n]*", page)
        for folder in sorted(set(re.findall(r"\bdata/(\w+)/", text))):
            flag = fetch_data.FOLDERS.get(folder, "?")
            if not fetches or (flag and not any(flag in f for f in fetches)):
                problems.append(f"{where}:{line}: data/{folder}/ is written by `python data/fetch_data.py"
                                f"{' ' + flag if flag else ''}`, which the page does not give")
    assert not problems, "\n".join(problems)


def test_every_command_is_listed_where_the_commands_are_listed():
    """README's command-line bullet and the how-to page's synopsis list every command the CLI has."""
    from minibert.cli import build_parser

    parser = build_parser()
    names = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    readme = next(line for line in (ROOT / "README.md").read_text(encoding="utf-8").split("\n* ")
                  if line.startswith("**The command line**"))
    synopsis = blocks(ROOT / "docs" / "how-to" / "cli.md", "bash")[0][1]
    for name in names:
        assert re.search(rf"[`| ]{re.escape(name)}[ |`]", readme), f"README's command list lacks {name}"
        assert f"minibert {name} " in synopsis, f"docs/how-to/cli.md's synopsis lacks {name}"
