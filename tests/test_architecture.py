"""The layering of ARCHITECTURE.md, checked on the source: core < tools < models < analysis < compat | training
< runs < fronts (compat and training side by side: neither imports the other), one folder a layer, no cycles,
and model.py is BERT only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import ROOT

PACKAGE = ROOT / "minibert"
#: one folder a layer (ARCHITECTURE.md); the files beside minibert/__init__.py are the core
RANK = {"core": 0, "tools": 1, "models": 2, "analysis": 3, "compat": 4, "training": 4, "runs": 5, "front": 6}
FOLDERS = {"tools": "tools", "models": "models", "analysis": "analysis", "compat": "compat", "training": "training",
           "runs": "runs", "cli": "front", "testing": "front"}
ENTRY_POINTS = {"minibert.__main__": "front",  # `python -m minibert` runs the CLI
                "minibert.export": "front"}  # minibert.export.to_onnx: compat.export under the name users look for


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    """A module's layer is its folder: minibert/<folder>/...; a file directly in minibert/ is core."""
    if module in ENTRY_POINTS:
        return ENTRY_POINTS[module]
    parts = module.split(".")
    return FOLDERS[parts[1]] if len(parts) > 1 and parts[1] in FOLDERS else "core"


def test_every_folder_is_a_layer():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(FOLDERS), f"a package folder without a layer (or a layer without a folder): {folders ^ set(FOLDERS)}"


def imports_of(path: Path) -> set[str]:
    """minibert modules imported anywhere in the file (top level or inside functions)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("minibert")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("minibert"):
                continue
            for alias in node.names:  # `from . import x` / `from .tools import fast` name modules too
                candidate = f"{target}.{alias.name}"
                found.add(candidate if (ROOT / Path(*candidate.split("."))).with_suffix(".py").exists()
                          or (ROOT / Path(*candidate.split("."))).is_dir() else target)
    return {m for m in found if m != name}


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}


def wrong_imports(imports: dict[str, set[str]]) -> list[str]:
    """Imports that break the layering: a module may import its own layer or one ranked below it; a layer
    above, or another layer of the same rank (training and compat), is refused. The two fronts (cli,
    testing) are one layer by rank but separate folders: they must not import each other either."""
    bad = []
    for m, deps in imports.items():
        for d in deps:
            mine, theirs = layer(m), layer(d)
            if mine == theirs and (mine != "front" or m.split(".")[:2] == d.split(".")[:2] or "__main__" in m):
                continue
            if RANK[theirs] >= RANK[mine]:
                bad.append(f"{m} ({mine}) imports {d} ({theirs})")
    return bad


def test_no_module_imports_a_layer_above_its_own_or_beside_it():
    bad = wrong_imports(graph())
    assert not bad, bad


def test_the_layer_rule_catches_sideways_and_upward_imports():
    """The import the earlier rule missed (training -> compat, same rank), its mirror, an upward one and a
    front importing the other front are each caught; downward and same-layer imports are not."""
    assert len(wrong_imports({"minibert.training.distill": {"minibert.compat.sentence"},
                              "minibert.compat.ray": {"minibert.training.loop"},
                              "minibert.training.loop": {"minibert.runs.finetune"},
                              "minibert.testing": {"minibert.cli.common"}})) == 4
    assert not wrong_imports({"minibert.runs.distill": {"minibert.compat.sentence", "minibert.training.loop",
                                                        "minibert.runs.skeleton", "minibert.checks"},
                              "minibert.cli.training": {"minibert.cli.common", "minibert.runs.finetune"},
                              "minibert.__main__": {"minibert.cli"}})


def test_the_core_never_imports_transformers():
    for path in PACKAGE.glob("*.py"):
        if layer(module_name(path)) == "front":
            continue
        assert "transformers" not in {a.split(".")[0] for a in _all_imports(path)}, path


def _all_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module)
    return out


def test_no_import_cycles():
    full = graph()
    g = {m: {d for d in deps if d in full} for m, deps in full.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        for d in g.get(m, ()):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d] if d in stack else [m, d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in g:
        if m not in state:
            visit(m, [m])
    # the package __init__ only re-exports lazily: leave it out of the cycles that matter
    cycles = [c for c in cycles if "minibert" not in c]
    assert not cycles, cycles


def test_model_py_is_bert_only():
    """model.py defines BERT's parts and nothing else, and imports only the core pieces they need."""
    tree = ast.parse((PACKAGE / "model.py").read_text(encoding="utf-8"))
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert classes == {"BertOutput", "Embeddings", "MultiHeadSelfAttention", "FeedForward", "Block", "Encoder",
                       "Pooler", "MaskedLMHead", "BertModel"}, classes
    assert functions <= {"embedding"}, functions
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
    assert imported <= {"activations", "config", "errors", "hookpoints", "inputs", "loading"}, imported
    source = (PACKAGE / "model.py").read_text(encoding="utf-8")
    for word in ("is_compiling", "fast=", "fast_forward", "import_module", "lora", "quantiz", "LayerDrop"):
        assert word not in source, word


def test_the_public_model_methods_and_no_old_paths(minilm_dir):
    """The tools as methods on the public model, fast=True; the module paths of before the reshaping are
    gone (0.1.0 was never released: no alias protects anyone), and nothing in the package warns that a
    name moved."""
    import importlib

    import torch

    from minibert import BertModel, BertTokenizer
    from minibert.model import BertModel as TextbookBertModel

    for old in ("fast", "hooks", "layers", "distill", "heads", "api", "distributed", "training.tasks"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"minibert.{old}")
    for path in PACKAGE.rglob("*.py"):
        assert "DeprecationWarning" not in path.read_text(encoding="utf-8"), path
    model, tok = BertModel.from_pretrained(minilm_dir), BertTokenizer.from_pretrained(minilm_dir)
    assert isinstance(model, TextbookBertModel)
    batch = dict(tok(["Where is the bank?", "Hi!"], padding=True, return_tensors="pt"))
    with torch.inference_mode():
        plain = model(**batch)
        quick = model(**batch, fast=True)
        assert (plain.last_hidden_state - quick.last_hidden_state)[batch["attention_mask"].bool()].abs().max() < 1e-4
        out, cache = model.run_with_cache(**batch, names="blocks.0.output")
        assert torch.equal(cache["blocks.0.output"], out.hidden_states[1])
        with model.ablate_heads({0: [1]}):
            assert not torch.equal(model(**batch).last_hidden_state, plain.last_hidden_state)
    assert model.keep_blocks([0, 2]).config.num_hidden_layers == 2
    assert model.parameter_counts()["total"] == sum(p.numel() for p in model.parameters())
    assert len(model.hook_point_names()) == 96 and not model.has_hooks()


def test_a_folder_named_minibert_in_the_working_directory_does_not_shadow_the_package(tmp_path):
    """Python started in the folder that holds a clone named ``minibert`` (the repository root, which has no
    __init__.py) must still import the package, not an empty namespace package of that name."""
    import subprocess
    import sys

    (tmp_path / "minibert").symlink_to(ROOT, target_is_directory=True)
    code = "import minibert; from minibert import BertTokenizer; print(minibert.__file__)"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("__init__.py")


def test_architecture_md_names_every_module_and_test_file():
    """ARCHITECTURE.md stays the map: every module of the package (by its name in its folder) and every
    test file appear in it."""
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    import re

    missing = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.stem not in ("__init__", "__main__")
               and not re.search(rf"(?<![\w.]){re.escape(p.stem)}\b", text)]
    assert not missing, f"modules ARCHITECTURE.md does not name: {missing}"
    tests = [p.name for p in (ROOT / "tests").glob("test_*.py") if f"tests/{p.name}" not in text]
    assert not tests, f"test files ARCHITECTURE.md's table does not list: {tests}"


def test_tests_mirror_the_package():
    """The test of minibert/<layer>/<module>.py is tests/<layer>/test_<module>.py (core: tests/core/), a
    second file of one module a suffix (test_fast_cuda.py): a test file named for no module of its layer,
    or in a folder that is no layer, is refused."""
    wrong = []
    for path in sorted((ROOT / "tests").glob("*/test_*.py")):
        folder = path.parent.name
        source = PACKAGE if folder == "core" else PACKAGE / folder
        if folder == "front" or folder not in {*RANK, "cli", "testing"} or not source.is_dir():
            wrong.append(f"{path.relative_to(ROOT)}: tests/{folder}/ is not a layer")
            continue
        modules = {p.stem for p in source.glob("*.py") if p.stem not in ("__init__", "__main__")} | {folder}
        stem = path.stem[len("test_"):]
        if not any(stem == m or stem.startswith(m + "_") for m in modules):
            wrong.append(f"{path.relative_to(ROOT)}: no module {stem!r} in {source.relative_to(ROOT)}")
    assert not wrong, "; ".join(wrong)


def test_one_training_loop():
    """Every run trains through ``training.loop.train``: no other module calls ``backward`` or steps an
    optimiser (a linear probe's L-BFGS fit in analysis/probing is a measurement, not a run)."""
    allowed = {"minibert.training.loop", "minibert.analysis.probing"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if module_name(path) in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", None))
            if name in ("backward", "step", "zero_grad", "optimizer_step"):
                found.append(f"{module_name(path)}:{node.lineno} {name}()")
    assert not found, "a second training loop: " + ", ".join(found)


def test_functions_stay_short_and_narrow():
    """No function of the package is over 80 lines or takes over 12 parameters (self not counted; a run's
    settings dataclass is one): a longer one is cut into named steps, a wider one takes a settings value."""
    long, wide = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs] + [x.arg for x in (a.vararg, a.kwarg) if x]
            params = len(names) - (names[:1] in (["self"], ["cls"]))
            where = f"{module_name(path)}.{node.name} (line {node.lineno})"
            if node.end_lineno - node.lineno + 1 > 80:
                long.append(f"{where}: {node.end_lineno - node.lineno + 1} lines")
            if params > 12:
                wide.append(f"{where}: {params} parameters")
    assert not long and not wide, "; ".join(long + wide)


def test_the_package_speaks_through_logging():
    """A run tells its user what it does through ``logging`` (``minibert.logs``): no ``print`` outside the
    command line, and no ``log`` callback threaded through functions."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
                    and not name.startswith("minibert.cli")):
                found.append(f"{name}:{node.lineno} print()")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                if "log" in [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]:
                    found.append(f"{name}.{node.name}: a log parameter")
    assert not found, ", ".join(found)
