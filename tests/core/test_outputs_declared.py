"""Nothing a user has is overwritten (issue 61): a test generated from the declared commands. For every path
every command declares it writes (a file: ``--json``, ``--index``, ``--plot``, ``--out``; a run folder), it
tries the paths every read field of that command points to (a model folder, a data file), and an existing
file minibert did not write; each is refused in one line before any work, and every file is left
byte-identical. Then the five data-loss rows of the issue, as a user typed them."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from conftest import ROOT, cli_error
from minibert import settings
from minibert.cli import build_parser

DATA = ROOT / "tests" / "data" / "adapters"  # a 3-block, 32-wide BERT (with vocab.txt)


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def declared():
    """(command, its settings dataclass) for each of the seventeen commands, as the parser has them."""
    import argparse

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [(name, parser.get_default("settings")) for name, parser in sub.choices.items()]


def paths_of(cls, kinds):
    return [(f, about) for f, about, _ in settings.described(cls) if about.cli and about.path in kinds]


def argv_for(command, cls, tmp, target_field, target, overwrite=False):
    """A command line giving every read field a path on disk (``tmp/reads/<field>/...``), every other
    required field a plain value, and ``target_field`` the path ``target``."""
    argv = [command]
    for field, about, _ in settings.described(cls):
        if not about.cli:
            continue
        value = None
        if field.name == target_field.name:
            value = str(target)
        elif about.path == "model":
            value = str(tmp / "reads" / field.name)
        elif about.path == "read":
            value = str(next((tmp / "reads" / field.name).iterdir()))
        elif about.required:
            value = str(tmp / "elsewhere" / field.name) if about.path else (about.choices[0] if about.choices else "x")
        if value is None:
            continue
        if about.positional:
            argv.append(value)
        else:
            argv += [settings.flag_of(field, about), value]
    if overwrite and any(f.name == "overwrite" for f in dataclasses.fields(cls)):
        argv.append("--overwrite")
    return argv


def lay_out_reads(cls, tmp, suffix):
    """A tiny model folder for each model read, a data file named ``data<suffix>`` for each data read."""
    for field, about in paths_of(cls, ("model", "read")):
        where = tmp / "reads" / field.name
        if about.path == "model":
            shutil.copytree(DATA / "base", where)
        else:
            where.mkdir(parents=True)
            (where / f"data{suffix}").write_text("the day was good\n", encoding="utf-8")
    (tmp / "elsewhere").mkdir(exist_ok=True)


CASES = [(command, cls, field.name) for command, cls in declared() for field, _ in paths_of(cls, ("file", "run"))]


def test_every_command_declares_what_it_writes():
    assert len(declared()) == 17
    writers = {command for command, _, _ in CASES}
    assert writers == {"embed", "search", "layers", "probe", "probe-over-time", "map", "fill", "parity", "finetune",
                       "distill", "exits", "pretrain", "depth-study", "export"}
    for command, cls in declared():  # every path-like field says what it is
        for field, about, _ in settings.described(cls):
            if field.name in ("out", "model", "teacher", "vocab", "index", "plot", "json", "corpus", "train", "eval",
                              "texts", "eval_texts", "data", "run", "checkpoint"):
                assert about.path is not None or (command in ("encode", "fill") and field.name == "texts"), \
                    (command, field.name)


@pytest.mark.parametrize("command,cls,name", CASES, ids=[f"{c}-{n}" for c, _, n in CASES])
def test_no_written_path_is_a_read_one_or_a_foreign_file(command, cls, name, tmp_path, capsys):
    field, about = next((f, a) for f, a in paths_of(cls, ("file", "run")) if f.name == name)
    kind = about.path
    suffix = about.suffix or ".txt"
    lay_out_reads(cls, tmp_path, suffix)
    flag = settings.flag_of(field, about)
    targets = []
    for read, read_about in paths_of(cls, ("model", "read")):
        folder = tmp_path / "reads" / read.name
        if read_about.path == "model":  # the model's own file, or its folder
            targets.append(folder / "config.json" if kind == "file" else folder)
        else:  # the data file itself (named as the output would be), or the folder holding it
            targets.append(next(folder.iterdir()) if kind == "file" else folder)
    assert targets, f"{command} {flag}: no read path to try"
    for target in targets:
        for overwrite in (False, True):  # --overwrite never makes a read path writable
            before = snapshot(tmp_path)
            line = cli_error(capsys, *argv_for(command, cls, tmp_path, field, target, overwrite))
            assert flag in line and ("reads" in line), (target, line)
            assert snapshot(tmp_path) == before, (command, flag, target)
    # an existing file (or a folder of files) minibert did not write
    mine = tmp_path / "mine"
    mine.mkdir()
    if kind == "file":
        real = mine / f"out{suffix}"
        for companion in ("", *about.companions):
            each = real.with_name(real.stem + companion) if companion else real
            each.write_text("years of work", encoding="utf-8")
            before = snapshot(tmp_path)
            line = cli_error(capsys, *argv_for(command, cls, tmp_path, field, real))
            assert "minibert did not write it" in line and "--overwrite" in line, line
            assert snapshot(tmp_path) == before
            each.unlink()
    else:
        (mine / "thesis.txt").write_text("years of work", encoding="utf-8")
        (mine / "config.json").write_text("{}", encoding="utf-8")
        before = snapshot(tmp_path)
        line = cli_error(capsys, *argv_for(command, cls, tmp_path, field, mine, overwrite=True))
        assert "replaces only what minibert wrote" in line and "thesis.txt" in line, line
        assert snapshot(tmp_path) == before


# ------------------------------------------------------------------------ the rows, as typed
@pytest.fixture()
def model(tmp_path):
    """The tiny base, with a vocabulary of the words the tests use (120 entries, as the model has)."""
    shutil.copytree(DATA / "base", tmp_path / "model")
    words = ["the", "day", "was", "good", "bad"]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words] + [f"w{i}" for i in range(10, 120)]
    (tmp_path / "model" / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return tmp_path / "model"


def test_row_1_json_into_a_models_config_is_refused(model, tmp_path, capsys):
    before = snapshot(model)
    line = cli_error(capsys, "parity", "--model", model, "--against", model, "--json", model / "config.json")
    assert "--json" in line and "model folder" in line
    (tmp_path / "pos.conllu").write_text("1\tthe\t_\tDET\t_\t_\t0\t_\t_\t_\n\n", encoding="utf-8")
    line = cli_error(capsys, "map", tmp_path / "pos.conllu", "--out", tmp_path / "m.png", "--json",
                     model / "config.json", "--model", model)
    assert "--json" in line
    line = cli_error(capsys, "layers", "a text", "--model", model, "--plot", model / "cka.png")
    assert "--plot" in line and "model folder --model reads" in line
    assert snapshot(model) == before


def test_row_2_a_search_index_never_replaces_what_is_not_its_own(model, tmp_path, capsys):
    corpus = tmp_path / "texts.txt"
    corpus.write_text("the day was good\nthe day was bad\n", encoding="utf-8")
    other = tmp_path / "other"
    shutil.copytree(model, other)
    before = snapshot(tmp_path)
    line = cli_error(capsys, "search", corpus, "good", "--model", model, "--index", other / "config")
    assert "config.json" in line and "minibert did not write it" in line
    (tmp_path / "settings.json").write_text('{"mine": 1}')
    (tmp_path / "userarr.npy").write_bytes(b"\x93NUMPY mine")
    for name in ("settings", "userarr.npy"):
        assert "minibert did not write it" in cli_error(capsys, "search", corpus, "good", "--model", model, "--index",
                                                        tmp_path / name)
    # --overwrite replaces the file named (settings.npy), never the user's settings.json beside it
    line = cli_error(capsys, "search", corpus, "good", "--model", model, "--index", tmp_path / "settings", "--overwrite")
    assert "settings.json' exists and minibert did not write it" in line
    assert "--overwrite replaces the file you named, never one beside it" in line and "pass --overwrite" not in line
    corp = tmp_path / "corp.npy"  # a corpus whose name is the index's: never the index
    shutil.copy(corpus, corp)
    assert "which CORPUS reads" in cli_error(capsys, "search", corp, "good", "--model", model, "--index", corp)
    assert snapshot(tmp_path) == {**before, "settings.json": b'{"mine": 1}', "userarr.npy": b"\x93NUMPY mine",
                                  "corp.npy": corpus.read_bytes()}
    from minibert.cli import main  # an int8 index says so (it recorded "float32"), and is rebuilt for fp32

    index = tmp_path / "idx"
    assert main(["search", str(corpus), "good", "--model", str(model), "--index", str(index), "--dtype", "int8",
                 "--quiet"]) == 0
    assert json.loads((tmp_path / "idx.json").read_text())["dtype"] == "int8"
    capsys.readouterr()
    assert main(["search", str(corpus), "good", "--model", str(model), "--index", str(index), "--quiet"]) == 0
    assert "dtype was 'int8', now 'float32'" in capsys.readouterr().err  # its own files: replaced unasked


def test_row_5_embed_never_writes_over_its_input_or_a_users_file(model, tmp_path, capsys):
    from minibert.cli import main

    texts = tmp_path / "in.npy"
    texts.write_text("the day was good\n", encoding="utf-8")
    (tmp_path / "mine.npy").write_bytes(b"mine")
    before = snapshot(tmp_path)
    assert "is " in cli_error(capsys, "embed", texts, "--model", model, "--out", texts)
    assert "minibert did not write it" in cli_error(capsys, "embed", texts, "--model", model, "--out",
                                                     tmp_path / "mine.npy")
    assert snapshot(tmp_path) == before
    out = tmp_path / "vectors.npy"
    assert main(["embed", str(texts), "--model", str(model), "--out", str(out), "--quiet"]) == 0
    record = json.loads((tmp_path / ".minibert-files.json").read_text())["files"]
    assert record["vectors.npy"]["command"] == "embed"
    assert main(["embed", str(texts), "--model", str(model), "--out", str(out), "--quiet"]) == 0  # its own: replaced
    out.write_bytes(out.read_bytes() + b" ")  # edited by the user since: theirs now
    assert "minibert did not write it" in cli_error(capsys, "embed", texts, "--model", model, "--out", out)
    assert main(["embed", str(texts), "--model", str(model), "--out", str(out), "--quiet", "--overwrite"]) == 0


def test_row_4_a_run_folder_never_holds_its_own_training_data(model, tmp_path, capsys):
    run = tmp_path / "runC"
    run.mkdir()
    (run / "train.csv").write_text("text,label\nthe day was good,pos\nthe day was bad,neg\n", encoding="utf-8")
    (run / "eval.csv").write_text("text,label\nthe day was good,pos\nthe day was bad,neg\n", encoding="utf-8")
    before = snapshot(run)
    line = cli_error(capsys, "finetune", "--train", run / "train.csv", "--eval", run / "eval.csv", "--model", model,
                     "--out", run, "--overwrite")
    assert "--train reads" in line and "contains" in line
    assert snapshot(run) == before
