"""Run settings declared once (minibert/settings.py, minibert/runs/settings.py): the checks, the command
line, the CLI reference page and the Python API all come from one dataclass per command, and the
recipes carry the defaults they were measured with."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from pathlib import Path

import pytest

from conftest import ROOT, usage_error
from minibert import InputError, settings
from minibert.cli import settings as commands
from minibert.runs.settings import RECIPES, DepthStudyRun, DistillRun, ExitsRun, FinetuneRun, PretrainRun
from minibert.settings import setting
from minibert.training.settings import FitConfig

#: every command whose options come from a run dataclass, and the library function that takes it
RUNS = {"finetune": (FinetuneRun, "minibert.runs.finetune", "finetune"),
        "pretrain": (PretrainRun, "minibert.runs.pretrain", "run_pretraining"),
        "exits": (ExitsRun, "minibert.runs.exits", "train_exits"),
        "distill": (DistillRun, "minibert.runs.distill", "distill_corpus"),
        "depth-study": (DepthStudyRun, "minibert.runs.depth_study", "study")}
#: the commands that do not train, each declared by a dataclass of ``minibert/cli/settings.py``
INFERENCE = {"encode": commands.EncodeCommand, "embed": commands.EmbedCommand, "search": commands.SearchCommand,
             "layers": commands.LayersCommand, "probe": commands.ProbeCommand,
             "probe-over-time": commands.ProbeOverTimeCommand, "map": commands.MapCommand,
             "fill": commands.FillCommand, "parity": commands.ParityCommand, "inspect": commands.InspectCommand,
             "predict": commands.PredictCommand, "export": commands.ExportCommand}


@dataclasses.dataclass(kw_only=True)
class Example:
    path: str = setting(help="a file", required=True)
    count: int = setting(2, "how many", low=1, high=10)
    rate: float | None = setting(None, "a rate", low=0.0, strict=True, default_text="chosen later")
    share: float = setting(0.0, "a share", low=0.0, below=1.0)
    kind: str = setting("a", "a kind", choices=("a", "b"))
    names: tuple[str, ...] = setting(("x",), "some names")
    quiet: bool = setting(True, "keep quiet", flag="--loud", negate=True)
    hook: object = setting(None, "Python only", cli=False)


def test_check_names_the_field_its_flag_and_the_limit():
    settings.check(Example(path=Path("/tmp/x"), count=3, rate=1, names=["y"]))  # a path, an int, a list: accepted
    run = Example(path=Path("/tmp/x"), rate=1, names=["y"])
    settings.check(run)
    assert run.path == "/tmp/x" and isinstance(run.rate, float) and run.names == ("y",)  # normalised
    for bad, words in [({"count": 0}, r"--count=0 is out of range: it must be in \[1, 10\]"),
                       ({"count": True}, r"--count=True must be an int"),
                       ({"rate": 0.0}, r"--rate=0.0 is out of range: it must be > 0"),
                       ({"share": 1.0}, r"it must be in \[0, 1\)"),
                       ({"kind": "c"}, r"--kind='c': use one of a, b"),
                       ({"path": 3}, r"--path=3 must be a string")]:
        with pytest.raises(InputError, match=words):
            settings.check(Example(**{"path": "p", **bad}))


def test_the_parser_comes_from_the_dataclass():
    parser = settings.add_arguments(argparse.ArgumentParser(prog="example"), Example)
    flags = {a.dest: a.option_strings for a in parser._actions if a.dest != "help"}
    assert flags == {"path": ["--path"], "count": ["--count"], "rate": ["--rate"], "share": ["--share"],
                     "kind": ["--kind"], "names": ["--names"], "quiet": ["--loud"]}  # hook: Python only
    args = parser.parse_args(["--path", "p", "--count", "4", "--names", "a, b", "--loud"])
    run = settings.from_args(Example, args)
    assert (run.count, run.names, run.quiet, run.rate, run.share) == (4, ("a", "b"), False, None, 0.0)
    assert "(default chosen later)" in parser.format_help() and "(default 2)" in parser.format_help()
    for argv, words in [(["--count", "11"], "must be in [1, 10], got 11"), (["--count", "x"], "'x' is not an integer"),
                        (["--rate", "0"], "must be > 0, got 0"), (["--share", "1"], "must be in [0, 1), got 1")]:
        with pytest.raises(SystemExit):
            parser.parse_args(["--path", "p", *argv])
        # the same words as every other command's options (one rule: ``settings.number_type``)
    with pytest.raises(argparse.ArgumentTypeError, match=r"must be >= 1, got 0"):
        settings.number_type(int, low=1)("0")
    with pytest.raises(argparse.ArgumentTypeError, match=r"must be in \[0, 1\), got 1.5"):
        settings.number_type(float, low=0, below=1)("1.5")
    for text in ("nan", "inf", "-inf"):  # never a number a float option takes, unless said (finite=False)
        with pytest.raises(argparse.ArgumentTypeError, match="must be a finite number"):
            settings.number_type(float, low=0)(text)
    assert settings.number_type(float, finite=False)("inf") == float("inf")
    for value in (float("nan"), float("inf")):
        with pytest.raises(InputError, match="--rate=.* must be a finite number"):
            settings.check(Example(path="p", rate=value))


def test_every_command_is_declared_by_a_dataclass():
    from minibert.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(RUNS) | set(INFERENCE)
    assert len(sub.choices) == 17


def _declared_as_documented(command, cls):
    """The command's options are exactly the dataclass's command-line fields (flags, defaults, choices,
    positions), and the CLI reference page lists each."""
    from minibert.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    options = {a.dest: a for a in sub._actions if a.dest != "help"}
    fields = {f.name: (f, about) for f, about, _ in settings.described(cls) if about.cli}
    assert set(options) == set(fields)
    reference = (ROOT / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    section = reference.split(f"## minibert {command}\n")[1].split("\n## ")[0]
    for name, (field, about) in fields.items():
        action = options[name]
        expected = [] if about.positional else [settings.flag_of(field, about)]
        assert action.option_strings == expected, name
        if field.default is not dataclasses.MISSING and not isinstance(field.default, bool):
            assert action.default == field.default, name
        assert (tuple(action.choices) if action.choices else None) == about.choices, name
        assert f"`{settings.flag_of(field, about)}" in section, name


@pytest.mark.parametrize("command", sorted(INFERENCE))
def test_the_inference_commands_are_declared_once(command):
    _declared_as_documented(command, INFERENCE[command])


@pytest.mark.parametrize("command", sorted(RUNS))
def test_cli_docs_and_python_api_are_one_declaration(command):
    """As above, and the library function takes the dataclass."""
    import importlib

    cls, module, function = RUNS[command]
    _declared_as_documented(command, cls)
    signature = inspect.signature(getattr(importlib.import_module(module), function))
    assert list(signature.parameters)[0] == "run" and signature.parameters["run"].annotation in (cls, cls.__name__)


def test_fitconfig_is_declared_once_and_checked():
    FitConfig().check()
    with pytest.raises(InputError, match=r"layer_decay=1.5 is out of range: it must be in \(0, 1\]"):
        FitConfig(layer_decay=1.5).check()
    with pytest.raises(InputError, match="bf16 and fp16 exclude each other"):
        FitConfig(bf16=True, fp16=True).check()
    assert issubclass(FinetuneRun, FitConfig)  # the loop's settings are the run's own, not repeated


def test_recipes_carry_their_defaults_and_say_so():
    assert set(RECIPES) == {"full", "gradual", "llrd", "lora", "scalarmix", "adapter", "prefix"}
    for name, recipe in RECIPES.items():
        run, said = FinetuneRun(train="t", eval="e", out="o", recipe=name).with_recipe_defaults()
        assert (run.lr, run.epochs) == (recipe.lr, recipe.epochs) and said == [f"lr {recipe.lr:g}", f"epochs {recipe.epochs}"]
        assert recipe.measured.startswith("accuracy 0.")  # the measurement it comes from
        assert recipe.min_steps > 0 and recipe.max_epochs >= recipe.epochs  # a schedule in steps, bounded
    assert RECIPES["adapter"].lr > RECIPES["full"].lr  # full fine-tuning's rate left adapters at the majority class
    run, said = FinetuneRun(train="t", eval="e", out="o", recipe="adapter", lr=3e-4).with_recipe_defaults()
    assert run.lr == 3e-4 and said == ["epochs 3"]  # what the user gave is kept
    with pytest.raises(InputError, match=r"--lora-rank belongs to the lora recipe"):
        FinetuneRun(train="t", eval="e", out="o", recipe="adapter", lora_rank=4).recipe_options()
    assert FinetuneRun(train="t", eval="e", out="o", recipe="lora").recipe_options() == \
        {"lora_rank": 8, "lora_targets": ("query", "value"), "merge_lora": False}


def test_small_data_takes_more_epochs_up_to_the_recipes_most():
    """The schedule rule: the recipe's epochs, or as many more as its min_steps optimiser steps need; the
    last short batch counts as a step; never past max_epochs; the words say which and why."""
    from minibert.runs.settings import Recipe, recipe_epochs

    recipe = Recipe("x", 1e-3, 3, min_steps=600, max_epochs=20)
    assert recipe_epochs(recipe, 5452, 16)[0] == 3  # 341 steps an epoch: 3 epochs are 1,023 steps
    epochs, why = recipe_epochs(recipe, 1211, 16)  # 76 steps an epoch (the last has 11 rows)
    assert epochs == 8 and why == ("1,211 rows at batch 16: 76 steps an epoch; 8 epochs rather than 3, for at least "
                                   "600 steps (608)")
    assert recipe_epochs(recipe, 1200, 16)[0] == 8  # 75 steps: 600 exactly
    assert recipe_epochs(recipe, 1201, 16)[0] == 8  # 76 steps
    assert recipe_epochs(recipe, 600, 16)[0] == 16  # 38 steps: 608
    epochs, why = recipe_epochs(recipe, 40, 16)  # 3 steps an epoch would need 200 epochs
    assert epochs == 20 and "20 epochs (its most) rather than 3" in why
    assert recipe_epochs(Recipe("x", 1e-3, 3), 40, 16)[0] == 3  # no min_steps: the recipe's epochs
    run, said = FinetuneRun(train="t", eval="e", out="o", recipe="adapter").with_recipe_defaults(rows=600)
    want = recipe_epochs(RECIPES["adapter"], 600, 16)
    assert run.epochs == want[0] and said[1] == f"epochs {want[0]} ({want[1]})"
    run, said = FinetuneRun(train="t", eval="e", out="o", recipe="adapter", epochs=2).with_recipe_defaults(rows=600)
    assert run.epochs == 2 and len(said) == 1  # what the user gave is kept
    run, _ = FinetuneRun(train="t", eval="e", out="o", recipe="full", batch_size=64).with_recipe_defaults(rows=1200)
    assert run.epochs == recipe_epochs(RECIPES["full"], 1200, 64)[0]  # the run's own batch size


def _toy_run_files(tmp_path):
    """A training file of 8 toy rows and a tiny base (3 blocks of 32) with a vocabulary of its words."""
    import shutil

    from conftest import DATA, toy_rows, write_csv

    train = write_csv(tmp_path / "train.csv", toy_rows(8, 0))
    model = tmp_path / "base"
    shutil.copytree(DATA / "adapters" / "base", model)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(5, 120)]
    (model / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return train, model


def _adapter_finetune(train, model, out, *options) -> list[str]:
    """The command line of a small adapter run on ``_toy_run_files``' file and base, with ``options``."""
    return ["finetune", "--train", str(train), "--eval", str(train), "--model", str(model), "--out", str(out),
            "--recipe", "adapter", "--adapter-size", "4", "--max-length", "16", "--quiet", *options]


def test_finetune_logs_the_schedule_it_took(tmp_path, capsys, monkeypatch):
    import dataclasses

    from conftest import toy_rows

    from minibert.cli import main
    from minibert.runs import settings as run_settings

    monkeypatch.setitem(run_settings.RECIPES, "adapter",
                        dataclasses.replace(RECIPES["adapter"], epochs=1, min_steps=3, max_epochs=2))
    train, model = _toy_run_files(tmp_path)
    capsys.readouterr()
    assert main(_adapter_finetune(train, model, tmp_path / "a", "--batch-size", "4")) == 0
    out = capsys.readouterr().out
    rows = len(toy_rows(8, 0))
    assert f"epochs 2 ({rows} rows at batch 4: {-(-rows // 4)} steps an epoch; 2 epochs" in out
    assert "epoch 2/2" in out


def test_finetune_says_which_defaults_it_chose(tmp_path, capsys):
    from minibert.cli import main

    train, model = _toy_run_files(tmp_path)
    capsys.readouterr()
    assert main(_adapter_finetune(train, model, tmp_path / "a", "--epochs", "1")) == 0
    out = capsys.readouterr().out
    assert f"recipe adapter: lr {RECIPES['adapter'].lr:g} (its defaults, measured on TREC-6 classification: {RECIPES['adapter'].measured})" in out
    assert "--batch-size: must be >= 1, got 0" in usage_error(capsys, "finetune", "--train", train, "--eval", train,
                                                              "--out", tmp_path / "b", "--batch-size", "0")


def test_a_tuple_settings_bounds_hold_for_each_item():
    """--seeds / --depths: each item is held to the setting's bounds, by argparse and by the check alike."""
    from minibert.runs.settings import DepthStudyConfig

    with pytest.raises(InputError, match=r"^--seeds=\(0, -1\): every value must be >= 0$"):
        DepthStudyConfig(seeds=(0, -1)).check()
    with pytest.raises(InputError, match=r"^--depths=\(2, 0\): every value must be >= 1$"):
        DepthStudyConfig(depths=(2, 0)).check()
    DepthStudyConfig(depths=[1, 3], seeds=[4]).check()  # lists are taken, as tuples
