"""The command line (minibert/cli): a user's mistake is one line and exit 2, a bug keeps its traceback, a
closed pipe ends quietly, truncation is said, outputs are checked before any work, --help is instant."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import minibert.cli
from conftest import POS_SAMPLE, ROOT, cli_error, cli_in_process
from minibert import BertConfig, BertModel, BertTokenizer, InputError
from minibert.cli import main


@pytest.fixture(scope="module")
def mlm_dir(tmp_path_factory, minilm_dir):
    """A tiny random checkpoint with a masked-LM head (MiniLM's vocabulary), made and saved by minibert."""
    directory = tmp_path_factory.mktemp("tiny_mlm")
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    BertModel(config, add_mlm_head=True).eval().save_pretrained(directory)
    shutil.copy(minilm_dir / "vocab.txt", directory / "vocab.txt")
    return directory


def test_a_bug_keeps_its_traceback(monkeypatch, capsys):
    """Only user errors become one line: an internal ValueError (or anything else) propagates."""
    def broken(args):
        raise ValueError("an internal bug, e.g. a bad unpacking")

    parser = minibert.cli.build_parser()
    monkeypatch.setattr(minibert.cli, "build_parser", lambda: parser)
    for action in parser._subparsers._group_actions[0].choices.values():
        action.set_defaults(func=broken)
    with pytest.raises(ValueError, match="internal bug"):
        main(["encode", "hello"])
    assert "minibert: error" not in capsys.readouterr().err


def test_user_errors_are_input_errors_and_still_value_errors(minilm_dir):
    model = BertModel.from_pretrained(minilm_dir)
    with pytest.raises(InputError):
        model(torch.tensor([[101, 10**6, 102]]))
    with pytest.raises(ValueError):  # InputError is a ValueError: old `except ValueError` keeps working
        model(torch.tensor([[101, 10**6, 102]]))


def test_broken_pipe_ends_quietly(minilm_dir):
    """`minibert encode ... | head`: the reader closes the pipe; no 'Broken pipe' message, no traceback."""
    texts = [f"sentence number {i} about banks and rivers" for i in range(60)]  # ~300 KB of JSON: > a pipe
    process = subprocess.Popen([sys.executable, "-m", "minibert", "encode", *texts, "--format", "json", "--model",
                                str(minilm_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    process.stdout.read(100)
    process.stdout.close()
    err = process.stderr.read().decode()
    code = process.wait(timeout=600)
    assert err == "", err
    assert code == 141


def test_truncation_is_said_and_max_length_sets_it(minilm_dir, tmp_path, capsys):
    long_text = " ".join(["word"] * 600)
    r = cli_in_process(capsys, "encode", long_text, "short", "--model", str(minilm_dir))
    assert r.returncode == 0, r.stderr
    assert "1 of 2 texts had more than 512 tokens and were truncated" in r.stderr
    r = cli_in_process(capsys, "encode", "one two three four five six", "short", "--model", str(minilm_dir), "--max-length", "5")
    assert "1 of 2 texts had more than 5 tokens" in r.stderr and "texts 1)" in r.stderr
    r = cli_in_process(capsys, "encode", "x", "--model", str(minilm_dir), "--max-length", "513")
    assert r.returncode == 2 and "--max-length=513 is out of range: it must be an int in [3, 512]" in r.stderr
    r = cli_in_process(capsys, "layers", long_text, "--model", str(minilm_dir))
    assert r.returncode == 0 and "1 of 1 texts had more than 512 tokens" in r.stderr
    lines = tmp_path / "texts.txt"
    lines.write_text(f"short\n{long_text}\nalso short\n{long_text}\n", encoding="utf-8")
    r = cli_in_process(capsys, "embed", str(lines), "--out", str(tmp_path / "v.npy"), "--model", str(minilm_dir), "--quiet")
    assert r.returncode == 0, r.stderr
    # MiniLM's folder says max_seq_length 256 (sentence_bert_config.json), which embed follows (issue 15)
    assert "2 of 4 lines had more than 256 tokens" in r.stderr and "lines 2, 4)" in r.stderr
    r = cli_in_process(capsys, "embed", str(lines), "--out", str(tmp_path / "v.npy"), "--model", str(minilm_dir), "--quiet",
                "--ignore-folder-settings")
    assert r.returncode == 0 and "2 of 4 lines had more than 512 tokens" in r.stderr


def test_fill_says_the_mask_was_truncated(mlm_dir, capsys):
    from minibert.analysis.lens import fill_mask, logit_lens

    model, tok = BertModel.from_pretrained(mlm_dir), BertTokenizer.from_pretrained(mlm_dir)
    text = "word " * 80 + "[MASK] ."
    with pytest.raises(InputError, match=r"past the 64-token limit, so truncation cut it off"):
        fill_mask(model, tok, [text])
    with pytest.raises(InputError, match="truncation cut it off"):
        logit_lens(model, tok, text)
    with pytest.raises(InputError, match="no \\[MASK\\] token"):
        fill_mask(model, tok, ["no mask here"])
    assert "truncation cut it off" in cli_error(capsys, "fill", text, "--model", str(mlm_dir))
    assert len(fill_mask(model, tok, ["a [MASK] b"], top_k=3)[0][0]) == 3


def test_fill_top_k_is_bounded_by_the_vocabulary(mlm_dir, capsys):
    from minibert.analysis.lens import fill_mask

    model, tok = BertModel.from_pretrained(mlm_dir), BertTokenizer.from_pretrained(mlm_dir)
    with pytest.raises(InputError, match=r"top_k=30523 is out of range.*\[1, 30522\]"):
        fill_mask(model, tok, ["a [MASK] b"], top_k=30523)
    assert len(fill_mask(model, tok, ["a [MASK] b"], top_k=30522)[0][0]) == 30522
    line = cli_error(capsys, "fill", "a [MASK] b", "--model", str(mlm_dir), "--top-k", "100000")
    assert "--top-k 100000 is larger than the vocabulary (30522 tokens)" in line


def test_embed_blank_lines_are_an_error_or_rows_of_zeros(minilm_dir, tmp_path, capsys):
    path = tmp_path / "texts.txt"
    path.write_text("one\n\nthree\n   \nfive\n\x01\x02\n", encoding="utf-8")  # line 6: no token at all
    r = cli_in_process(capsys, "embed", str(path), "--out", str(tmp_path / "v.npy"), "--model", str(minilm_dir))
    assert r.returncode == 2 and "line 2 is blank (and 1 more)" in r.stderr and "--blank zeros" in r.stderr
    assert not (tmp_path / "v.npy").exists()
    r = cli_in_process(capsys, "embed", str(path), "--out", str(tmp_path / "v.npy"), "--model", str(minilm_dir), "--blank",
                "zeros", "--quiet")
    assert r.returncode == 0, r.stderr
    v = np.load(tmp_path / "v.npy")
    assert v.shape == (6, 384) and not v[[1, 3, 5]].any() and v[[0, 2, 4]].any(axis=1).all()
    path.write_text("one\n\x01\x02\nthree\n", encoding="utf-8")
    r = cli_in_process(capsys, "embed", str(path), "--out", str(tmp_path / "w.npy"), "--model", str(minilm_dir), "--quiet")
    assert r.returncode == 2 and "line 2 has no token" in r.stderr


def test_outputs_are_checked_before_any_work(tmp_path, capsys):
    texts = tmp_path / "texts.txt"
    texts.write_text("hello\n", encoding="utf-8")
    missing = tmp_path / "missing" / "dir"
    # the model does not exist either: the output is checked first, so the error is about the output
    line = cli_error(capsys, "embed", str(texts), "--out", str(missing / "v.npy"), "--model", str(tmp_path / "nope"))
    assert "--out" in line and "does not exist" in line
    for command in (["layers", "some text"], ["probe", str(POS_SAMPLE)], ["fill", "a [MASK]"]):
        line = cli_error(capsys, *command, "--plot", str(missing / "x.png"), "--model", str(tmp_path / "nope"))
        assert "does not exist (create it first)" in line
        line = cli_error(capsys, *command, "--plot", str(tmp_path / "x.jpg"), "--model", str(tmp_path / "nope"))
        assert "'.jpg' is not a supported format" in line
    assert not missing.parent.exists()  # never created
    line = cli_error(capsys, "parity", "--model", str(tmp_path / "nope"), "--json", str(missing / "p.json"))
    assert "--json" in line


def test_duplicate_layers_are_an_error(minilm_dir, tmp_path, capsys):
    from minibert.analysis import layers as L

    with pytest.raises(InputError, match=r"layers '0,6,-1' selects hidden state 6 twice \(6 and -1"):
        L.parse_layers("0,6,-1", 7)
    assert L.parse_layers("0,5,-1", 7) == [0, 5, 6]
    texts = tmp_path / "t.txt"
    texts.write_text("hello\n", encoding="utf-8")
    line = cli_error(capsys, "embed", str(texts), "--layers", "0,6,-1", "--out", str(tmp_path / "v"),
                     "--model", str(minilm_dir), "--quiet")
    assert "selects hidden state 6 twice" in line


def test_underscore_is_no_label_and_one_class_is_an_error(minilm_dir, tmp_path, capsys):
    pytest.importorskip("conllu")
    from minibert.analysis.probing import probe_model, read_conllu

    line = cli_error(capsys, "probe", str(POS_SAMPLE), "--column", "xpos", "--model", str(minilm_dir))
    assert "every word's 'xpos' is '_'" in line
    # some words labelled, some '_': the '_' words are context only, never a class
    text = POS_SAMPLE.read_text(encoding="utf-8").splitlines()
    mixed = []
    for ln in text:
        fields = ln.split("\t")
        if len(fields) == 10 and fields[3] not in ("NOUN", "VERB"):
            fields[3] = "_"
        mixed.append("\t".join(fields))
    path = tmp_path / "mixed.conllu"
    path.write_text("\n".join(mixed) + "\n", encoding="utf-8")
    data = read_conllu(path)
    assert {label for _, labels in data for label in labels} == {"NOUN", "VERB", None}
    model, tok = BertModel.from_pretrained(minilm_dir), BertTokenizer.from_pretrained(minilm_dir)
    result = probe_model(model, tok, data[:40], progress=False)
    assert result.labels == ["NOUN", "VERB"]
    one_class = [(words, [label if label == "NOUN" else None for label in labels]) for words, labels in data]
    with pytest.raises(InputError, match="at least 2 different labels"):
        probe_model(model, tok, one_class, progress=False)


def test_help_and_argument_errors_do_not_import_torch():
    """`minibert --help` used to take 4-5 s importing torch first; now only argparse is imported."""
    code = ("import sys\nfrom minibert.cli import main\n"
            "for argv in (['--help'], ['encode', '--help'], ['encode'], ['nonsense']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('torch imported:', 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.stdout.strip().endswith("torch imported: False"), r.stdout + r.stderr


# ------------------------------------------------------ what a new user found (silent results, outputs, messages)
def _argparse_error(capsys, *args) -> str:
    """Run the CLI in-process on arguments argparse refuses: exit 2; returns the error's text after the
    command's name (the usage lines differ from command to command, the message must not)."""
    from minibert.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    return last.split(": error: ", 1)[1]


def test_shared_options_accept_and_refuse_the_same_values(tmp_path, capsys):
    """--batch-size and --max-length are one option each, with one rule, in every command that has them
    (search had no --batch-size; --max-length was checked three ways)."""
    texts, data = tmp_path / "t.txt", tmp_path / "d.csv"
    texts.write_text("hello\n", encoding="utf-8")
    data.write_text("text,label\nhi,a\n", encoding="utf-8")
    commands = {"embed": ["embed", texts, "--out", tmp_path / "v.npy"], "search": ["search", texts, "hello"],
                "probe": ["probe", POS_SAMPLE], "predict": ["predict", tmp_path, texts],
                "finetune": ["finetune", "--train", data, "--eval", data, "--out", tmp_path / "o"],
                "distill": ["distill", "--teacher", tmp_path, "--train", data, "--eval", data, "--out", tmp_path / "o"],
                "exits": ["exits", "--model", tmp_path, "--train", data, "--eval", data, "--out", tmp_path / "o"]}
    for value in ("0", "-3", "x"):
        refusals = {name: _argparse_error(capsys, *argv, "--batch-size", value) for name, argv in commands.items()}
        assert len(set(refusals.values())) == 1 and "--batch-size" in refusals["search"], refusals
    from minibert.checks import check_max_length

    for value in (2, 513, 5000):
        with pytest.raises(InputError, match=rf"--max-length={value} is out of range: it must be an int in \[3, 512\]"):
            check_max_length("--max-length", value, 512)
    assert check_max_length("--max-length", 3, 512) == 3


def test_missing_model_and_files_are_one_line_saying_where(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    line = cli_error(capsys, "encode", "hello", "--model", "nomodel")
    assert f"model 'nomodel' not found: no file or folder {tmp_path / 'nomodel'}" in line
    assert "(HF_HUB_OFFLINE=1: the hub itself is not asked)" in line
    line = cli_error(capsys, "embed", "nofile.txt", "--out", "v.npy", "--model", "nomodel")
    assert line == f"minibert: error: 'nofile.txt' not found (looked for {tmp_path / 'nofile.txt'})"
    line = cli_error(capsys, "probe", "nofile.conllu", "--model", "nomodel")
    assert line == f"minibert: error: CoNLL-U file 'nofile.conllu' not found (looked for {tmp_path / 'nofile.conllu'})"
    line = cli_error(capsys, "predict", "nodir", "nofile.txt")
    assert line == f"minibert: error: checkpoint folder 'nodir' not found (looked for {tmp_path / 'nodir'})"


def test_a_missing_extra_is_said_before_any_work_with_the_checkout_install(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec

    def without(package):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: None if name.split(".")[0] == package else real(name, *a))
    without("matplotlib")
    # the model does not exist: had the work started, the error would be about the model
    line = cli_error(capsys, "layers", "some text", "--plot", tmp_path / "x.png", "--model", tmp_path / "nope")
    assert line == 'minibert: error: plots need matplotlib: pip install -e ".[plots]" in the minibert checkout'
    without("sklearn")
    line = cli_error(capsys, "map", POS_SAMPLE, "--method", "tsne", "--out", tmp_path / "m.png",
                     "--model", tmp_path / "nope")
    assert 'scikit-learn: pip install -e ".[maps]"' in line
    from minibert.errors import missing_extra

    assert "minibert[" not in str(missing_extra("the Ray engine", "Ray Data", "ray"))  # minibert on PyPI is another project


def test_output_folders_follow_one_rule_checked_before_any_work(tmp_path, capsys):
    """finetune, distill, exits and embed --engine ray write folders: an existing folder, or a new last
    level under an existing parent -- never a whole tree (a typo such as /nope/run), and that is checked
    before the model is loaded (the model here does not exist)."""
    data, texts = tmp_path / "d.csv", tmp_path / "t.txt"
    data.write_text("text,label\nhi,a\nho,b\n", encoding="utf-8")
    texts.write_text("hello\n", encoding="utf-8")
    nope, a_file = tmp_path / "nope" / "run", tmp_path / "file"
    a_file.write_text("x", encoding="utf-8")
    model = tmp_path / "nomodel"
    commands = [["finetune", "--train", data, "--eval", data, "--model", model],
                ["distill", "--teacher", model, "--texts", texts],
                ["distill", "--teacher", model, "--train", data, "--eval", data],
                ["exits", "--model", model, "--train", data, "--eval", data]]
    for argv in commands:
        line = cli_error(capsys, *argv, "--out", nope)
        assert f"its parent folder '{nope.parent}' does not exist; only the last level" in line, (argv, line)
        line = cli_error(capsys, *argv, "--out", a_file)
        assert f"--out '{a_file}' is a file; give a folder" in line, (argv, line)
    assert not nope.parent.exists()
    from minibert.compat.ray import RayEmbed, embed_dataset

    with pytest.raises(InputError, match="its parent folder .* does not exist"):
        embed_dataset([str(texts)], str(nope), RayEmbed(model=str(model)))
    assert not nope.parent.exists()


def test_embed_out_naming_a_folder_is_refused(tmp_path, capsys):
    texts = tmp_path / "t.txt"
    texts.write_text("hello\n", encoding="utf-8")
    folder = tmp_path / "vectors"
    folder.mkdir()
    for out in (f"{folder}/", str(folder)):
        line = cli_error(capsys, "embed", texts, "--out", out, "--model", tmp_path / "nope")
        assert "is a directory; give a file name" in line
    assert not (tmp_path / "vectors.npy").exists() and not any(folder.iterdir())


# ------------------------------------------------------------------- issue 61: each line of the trial
def test_the_lines_of_the_issue_61_trial(tmp_path, capsys):
    import json
    import math

    from conftest import usage_error

    base = ROOT / "tests" / "data" / "adapters" / "base"
    texts = tmp_path / "t.txt"
    texts.write_text("the day\n", encoding="utf-8")
    for value in ("nan", "inf"):  # was a 74-line Ray traceback (nan) and accepted (inf)
        line = usage_error(capsys, "embed", texts, "--engine", "ray", "--gpus-per-worker", value, "--out", tmp_path / "r")
        assert "--gpus-per-worker: must be a finite number" in line
    corpus = ["--corpus", texts, "--out", tmp_path / "p", "--vocab", base, "--blocks", "1", "--hidden", "32",
              "--heads", "2", "--steps", "2"]
    assert "--plateau-step reads the held-out masked accuracy" in cli_error(capsys, "pretrain", *corpus,
                                                                               "--plateau-step", "1")
    assert "--eval-texts needs --eval-every" in cli_error(capsys, "pretrain", *corpus, "--eval-texts", texts)
    line = cli_error(capsys, "encode", "x", "--model", base, "--device", "meta", "--dtype", "int8")
    assert "GPU" not in line and "cpu or cuda" in line  # meta is no GPU
    for device in ("cpu:1", "cpu:99"):
        assert "one CPU device" in cli_error(capsys, "encode", "x", "--model", base, "--device", device)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        minibert.cli.main(["encode", "x", "--bogus"])
    assert "minibert encode: error: unrecognized arguments: --bogus" in capsys.readouterr().err
    line = cli_error(capsys, "embed", texts, "--model", base, "--out", base)
    assert "is a directory" in line and str(base / "") + "out.npy" not in line and "base.npy" in line
    assert "--out is empty" in cli_error(capsys, "embed", texts, "--model", base, "--out", "")
    assert "--out is empty" in cli_error(capsys, "finetune", "--train", texts, "--eval", texts, "--out", "")
    run = tmp_path / "run"
    (run / ".minibert.lock").mkdir(parents=True)
    line = cli_error(capsys, "pretrain", *corpus[:2], "--out", run, *corpus[4:])
    assert "is not a file, so it is not minibert's lock" in line and "Errno" not in line
    page = (ROOT / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    assert "| `--quiet` | on |" not in page and "| `--quiet` | off |" in page


def test_inspect_shows_the_norm_placement_and_pre_ln_s_final_layernorm(tmp_path, capsys):
    import warnings

    from minibert import BertConfig, BertModel
    from minibert.models.norms import norm_config

    config = norm_config(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=32), "pre")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        BertModel(config).save_pretrained(tmp_path)
    out = cli_in_process(capsys, "inspect", "--model", tmp_path, "--lengths", "8").stdout
    assert "pre norm placement" in out and "final LayerNorm (pre-LN)" in out
    rows = {line[:28].strip(): int(line[28:42].replace(",", "")) for line in out.splitlines()
            if line[28:42].strip().replace(",", "").isdigit()}
    assert rows["final LayerNorm (pre-LN)"] == 32 and rows["total"] == rows["embeddings"] + rows["blocks (x2)"] + 32 + \
        rows["pooler"]


def test_stop_and_plateau_messages_say_what_happened():
    from minibert.errors import TrainingStopped
    from minibert.training.diagnostics import PlateauWatch
    from minibert.training.loop import check_finite

    said = PlateauWatch(0.055, 7, after=1).check(400, 0.0)
    assert "0.000 is below even the unigram rate 0.055" in said and "still" not in said
    assert "is still the unigram rate 0.055" in PlateauWatch(0.055, 7, after=1).check(400, 0.056)
    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()  # finite gradients whose norm overflowed
    with pytest.raises(TrainingStopped) as stopped:
        check_finite(model, 3, 1.0, float("inf"), lr=1e-3, kept="nothing kept")
    assert "None" not in str(stopped.value) and "every gradient finite" in str(stopped.value)
