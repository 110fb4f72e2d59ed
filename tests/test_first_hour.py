"""A newcomer's first hour (issue 11): no traceback for a user's mistake, no silent wrong result.

Errors about what the user gave are one line from the CLI (exit 2) and an ``InputError`` (a ValueError)
or ``CheckpointError`` from the library, naming the file, line or argument; a bug keeps its traceback.
Outputs are checked before the work; truncation is said; plots are fit to print.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import minibert.cli
from conftest import ROOT, SENTENCES
from minibert import BertConfig, BertModel, BertTokenizer, CheckpointError, InputError
from minibert.cli import main

POS_SAMPLE = ROOT / "tests" / "data" / "pos_sample.conllu"


def run_cli(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "minibert", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=600, **kwargs)


def cli_error(capsys, *args) -> str:
    """Run the CLI in-process; it must exit 2 with one 'minibert: error: ...' line. Returns that line."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("minibert: error: "), err
    return err[0]


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


# ------------------------------------------------------------------------- 2. errors, not tracebacks
def copy_checkpoint(src: Path, dst: Path, weights: bytes | None = None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".whl":
            shutil.copy(f, dst / f.name)
    if weights is not None:
        (dst / "model.safetensors").write_bytes(weights)
    return dst


@pytest.mark.parametrize("damage", ["empty", "7 bytes", "header cut", "half", "last byte", "garbled header",
                                    "huge header length", "plain text"])
def test_truncated_or_corrupt_safetensors_is_a_checkpoint_error_naming_the_file(minilm_dir, tmp_path, capsys,
                                                                                   damage):
    data = (minilm_dir / "model.safetensors").read_bytes()
    broken = {
        "empty": b"",
        "7 bytes": data[:7],
        "header cut": data[:500],
        "half": data[: len(data) // 2],
        "last byte": data[:-1],
        "garbled header": data[:8] + b"{not json" + data[17:],
        "huge header length": (10**12).to_bytes(8, "little") + data[8:],
        "plain text": b"this is not a checkpoint\n" * 20,
    }[damage]
    directory = copy_checkpoint(minilm_dir, tmp_path / "broken", broken)
    with pytest.raises(CheckpointError, match="truncated or corrupt") as info:
        BertModel.from_pretrained(directory)
    assert str(directory / "model.safetensors") in str(info.value)
    line = cli_error(capsys, "encode", "hello", "--model", str(directory))
    assert "model.safetensors is truncated or corrupt" in line


@pytest.mark.parametrize("name,content", [("config.json", b"{\"hidden_size\": 3"), ("config.json", b"\xff\xfe\x00"),
                                          ("config.json", b"[1, 2]")])
def test_corrupt_config_is_one_line_naming_the_file(minilm_dir, tmp_path, capsys, name, content):
    directory = copy_checkpoint(minilm_dir, tmp_path / "broken")
    (directory / name).write_bytes(content)
    with pytest.raises(InputError, match="config.json"):
        BertModel.from_pretrained(directory)
    assert "config.json" in cli_error(capsys, "encode", "hello", "--model", str(directory))


def test_corrupt_shard_index_is_a_checkpoint_error(minilm_dir, tmp_path):
    directory = copy_checkpoint(minilm_dir, tmp_path / "sharded")
    (directory / "model.safetensors").unlink()
    (directory / "model.safetensors.index.json").write_text('{"weight_map": [1, 2]}')
    with pytest.raises(CheckpointError, match="weight_map"):
        BertModel.from_pretrained(directory)


@pytest.mark.parametrize("content,line,what", [
    ("# sent_id = 1\n1\tThe\tthe\tDET\t_\t_\t_\t_\t_\t_\n2  dog  dog  NOUN  _  _  _  _  _  _\n\n", 3, "tab"),
    ("1\tThe\tthe\tDET\t_\t_\t_\t_\t_\t_\n\n1\tA\ta\tDET\t_\t_\t_\t_\t_\t_\nx\tdog\tdog\tNOUN\t_\t_\t_\t_\t_\t_\n",
     4, "not a CoNLL-U word ID"),
    ("Just a plain text file.\nWith two lines.\n", 1, "10 tab-separated columns"),
    ("1\tThe\tthe\tDET\t_\t_\t_\t_\t_\n\n", 1, "has 9"),
])
def test_malformed_conllu_is_one_line_with_file_and_line(tmp_path, capsys, content, line, what):
    pytest.importorskip("conllu")
    from minibert.analysis.probing import read_conllu

    path = tmp_path / "bad.conllu"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(InputError, match=what) as info:
        read_conllu(path)
    assert str(info.value).startswith(f"{path}:{line}: ")
    # the CLI reads the data before loading any model: a bogus model name is never reached
    err = cli_error(capsys, "probe", str(path), "--model", str(tmp_path / "no-model"))
    assert f"{path}:{line}: " in err


def test_conllu_that_is_not_utf8_is_one_line(tmp_path, capsys):
    pytest.importorskip("conllu")
    path = tmp_path / "latin1.conllu"
    path.write_bytes("1\tcaf\xe9\t_\tNOUN\t_\t_\t_\t_\t_\t_\n\n".encode("latin-1"))
    assert "not UTF-8" in cli_error(capsys, "probe", str(path))


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
    process = subprocess.Popen([sys.executable, "-m", "minibert", "encode", *texts, "--json", "--model",
                                str(minilm_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    process.stdout.read(100)
    process.stdout.close()
    err = process.stderr.read().decode()
    code = process.wait(timeout=600)
    assert err == "", err
    assert code == 141


# ------------------------------------------------------------------------ 3. silent wrong results
def test_truncation_is_said_and_max_length_sets_it(minilm_dir, tmp_path):
    long_text = " ".join(["word"] * 600)
    r = run_cli("encode", long_text, "short", "--model", str(minilm_dir))
    assert r.returncode == 0, r.stderr
    assert "1 of 2 texts had more than 512 tokens and were truncated" in r.stderr
    r = run_cli("encode", "one two three four five six", "short", "--model", str(minilm_dir), "--max-length", "5")
    assert "1 of 2 texts had more than 5 tokens" in r.stderr and "texts 1)" in r.stderr
    r = run_cli("encode", "x", "--model", str(minilm_dir), "--max-length", "513")
    assert r.returncode == 2 and "--max-length 513 is out of range: it must be in [2, 512]" in r.stderr
    r = run_cli("layers", long_text, "--model", str(minilm_dir))
    assert r.returncode == 0 and "1 of 1 texts had more than 512 tokens" in r.stderr
    lines = tmp_path / "texts.txt"
    lines.write_text(f"short\n{long_text}\nalso short\n{long_text}\n", encoding="utf-8")
    r = run_cli("embed", str(lines), "--out", str(tmp_path / "v.npy"), "--model", str(minilm_dir), "--quiet")
    assert r.returncode == 0, r.stderr
    # MiniLM's folder says max_seq_length 256 (sentence_bert_config.json), which embed follows (issue 15)
    assert "2 of 4 lines had more than 256 tokens" in r.stderr and "lines 2, 4)" in r.stderr
    r = run_cli("embed", str(lines), "--out", str(tmp_path / "v.npy"), "--model", str(minilm_dir), "--quiet",
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


def test_embed_rows_are_lines_split_on_newline_only(minilm_dir, tmp_path):
    from minibert.analysis import layers as L

    texts = ["first line with a\u2028line separator inside", "second\x0cwith a form feed",
             "third\x1cwith a file separator and\x85next line", "fourth, CRLF ended", "fifth"]
    path = tmp_path / "texts.txt"
    path.write_bytes(("\n".join(texts[:3]) + "\n" + texts[3] + "\r\n" + texts[4] + "\n").encode("utf-8"))
    assert minibert.cli.read_lines(path) == texts
    out = tmp_path / "vectors"  # no suffix: .npy is added, and the printed path says so
    r = run_cli("embed", str(path), "--out", str(out), "--model", str(minilm_dir), "--quiet", "--pool", "mean")
    assert r.returncode == 0, r.stderr
    assert f"wrote {out}.npy: 5 texts" in r.stdout
    vectors = np.load(f"{out}.npy")
    model, tok = BertModel.from_pretrained(minilm_dir), BertTokenizer.from_pretrained(minilm_dir)
    for i in (0, 2, 4):  # row i is line i
        batch = tok([texts[i]], return_tensors="pt")
        with torch.inference_mode():
            expected = L.pool(model(**batch).last_hidden_state, batch["attention_mask"], "mean")[0]
        assert np.allclose(vectors[i], expected.numpy(), atol=1e-4)


def test_embed_blank_lines_are_an_error_or_rows_of_zeros(minilm_dir, tmp_path):
    path = tmp_path / "texts.txt"
    path.write_text("one\n\nthree\n   \nfive\n\x01\x02\n", encoding="utf-8")  # line 6: no token at all
    r = run_cli("embed", str(path), "--out", str(tmp_path / "v.npy"), "--model", str(minilm_dir))
    assert r.returncode == 2 and "line 2 is blank (and 1 more)" in r.stderr and "--blank zeros" in r.stderr
    assert not (tmp_path / "v.npy").exists()
    r = run_cli("embed", str(path), "--out", str(tmp_path / "v.npy"), "--model", str(minilm_dir), "--blank",
                "zeros", "--quiet")
    assert r.returncode == 0, r.stderr
    v = np.load(tmp_path / "v.npy")
    assert v.shape == (6, 384) and not v[[1, 3, 5]].any() and v[[0, 2, 4]].any(axis=1).all()
    path.write_text("one\n\x01\x02\nthree\n", encoding="utf-8")
    r = run_cli("embed", str(path), "--out", str(tmp_path / "w.npy"), "--model", str(minilm_dir), "--quiet")
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


def test_half_precision_on_a_cpu_without_it_warns_once(minilm_dir, monkeypatch):
    from minibert import hardware

    monkeypatch.setattr(hardware, "_warned", set())
    monkeypatch.setattr(hardware, "cpu_info", lambda: ("Some CPU", frozenset({"avx2", "avx512f"})))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        BertModel.from_pretrained(minilm_dir, dtype="bf16")
        BertModel.from_pretrained(minilm_dir, dtype="bf16")
        BertModel.from_pretrained(minilm_dir, dtype="fp16")
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 2, messages
    assert "bf16 on this CPU (Some CPU)" in messages[0] and "avx512_bf16 or amx_bf16" in messages[0]
    assert "fp16" in messages[1]
    monkeypatch.setattr(hardware, "_warned", set())
    monkeypatch.setattr(hardware, "cpu_info", lambda: ("Xeon", frozenset({"avx512f", "avx512_bf16", "amx_bf16"})))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        BertModel.from_pretrained(minilm_dir, dtype="bf16")
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]


# ------------------------------------------------------------------------------------------ 4. plots
def _captured_figure(monkeypatch, draw):
    """Run a plot function, keeping its matplotlib figure for inspection."""
    from minibert.analysis import plots

    kept = {}
    real_save = plots._save

    def keep(fig, path):
        fig.canvas.draw()
        kept["fig"] = copy.copy(fig)
        kept["renderer"] = fig.canvas.get_renderer()
        return real_save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    path = draw()
    return kept["fig"], path


def test_cka_heatmap_title_scale_and_numbers(minilm_dir, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from minibert.analysis import layers as L
    from minibert.analysis import plots

    model, tok = BertModel.from_pretrained(minilm_dir), BertTokenizer.from_pretrained(minilm_dir)
    batch = tok([SENTENCES[1]], return_tensors="pt")
    with torch.inference_mode():
        cka = L.cka_matrix(model(**batch).hidden_states, batch["attention_mask"])
    title = "Linear CKA between layers: " + SENTENCES[1] * 3
    fig, path = _captured_figure(monkeypatch, lambda: plots.similarity_heatmap(cka, tmp_path / "cka.png", title=title))
    ax = fig.axes[0]
    assert all(len(line) <= 48 for line in ax.get_title().splitlines()) and len(ax.get_title().splitlines()) <= 3
    low, high = ax.images[0].get_clim()
    assert low == pytest.approx(float(cka.min())) and high == pytest.approx(float(cka.max()))
    assert "fitted to the data" in fig.axes[1].get_ylabel()
    title_box = ax.title.get_window_extent()
    bar_box = fig.axes[1].get_window_extent()
    assert title_box.x1 <= bar_box.x0 or title_box.y0 >= bar_box.y1  # the colour bar does not cover the title
    assert len(ax.texts) == cka.numel()


def test_cka_needs_enough_tokens(minilm_dir, capsys):
    from minibert.analysis import layers as L

    h = [torch.randn(1, 4, 8) for _ in range(3)]
    mask = torch.ones(1, 4)
    with pytest.raises(InputError, match="at least 3 tokens, got 2"):
        L.cka_matrix(h, mask, torch.tensor([[101, 5, 6, 102]]), exclude_ids=[101, 102])
    with pytest.warns(UserWarning, match="CKA over only 4 tokens"):
        L.cka_matrix(h, mask)
    line = cli_error(capsys, "layers", "Hi there", "--model", str(minilm_dir), "--exclude-special")
    assert "CKA needs at least 3 tokens, got 2" in line


def test_logit_lens_plot_legend_and_rank_axis(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from minibert.analysis import plots
    from minibert.analysis.lens import LensResult, LensRow

    rows = [LensRow(i, "x", 0.1, rank, 0.1) for i, rank in enumerate([2500, 300, 40, 7, 2, 1])]
    fig, _ = _captured_figure(monkeypatch, lambda: plots.logit_lens(LensResult("t", 3, "capital", rows),
                                                                    tmp_path / "lens.png"))
    ax, rank_ax = fig.axes
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(legend) == 3 and any("rank" in t for t in legend)
    labels = [t.get_text() for t in rank_ax.get_yticklabels() if t.get_text()]
    assert labels == ["1", "10", "100", "1,000", "10,000"]
    assert not [t.get_text() for t in rank_ax.get_yticklabels(minor=True) if t.get_text()]
    low, high = rank_ax.get_ylim()
    assert low > high  # rank 1 at the top


def test_attention_map_size_is_bounded_and_colour_bar_fits(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from minibert.analysis import plots

    n = 41
    probs = torch.softmax(torch.randn(n, n), -1)
    fig, path = _captured_figure(monkeypatch, lambda: plots.attention_map(probs, [f"tok{i}" for i in range(n)],
                                                                          tmp_path / "a.png", 0, 0))
    width, height = fig.get_size_inches() * plots.DPI
    assert width <= 1300 and height <= 1300
    map_box, bar_box = fig.axes[0].get_window_extent(), fig.axes[1].get_window_extent()
    assert bar_box.height <= map_box.height * 1.02


@pytest.mark.parametrize("name,magic", [("p.png", b"\x89PNG"), ("p.svg", b"<?xml"), ("p.pdf", b"%PDF"),
                                        ("p", b"\x89PNG")])
def test_plots_are_150_dpi_or_vector_as_the_name_asks(tmp_path, name, magic):
    pytest.importorskip("matplotlib")
    from PIL import Image

    from minibert.analysis import plots
    from minibert.analysis.probing import ProbeResult

    path = plots.probe_curve(ProbeResult([0, 1], [0.5, 0.9], [0.4, 0.5], 0.3, 10, 5, ["a", "b"]), tmp_path / name)
    assert path.suffix in (".png", ".svg", ".pdf") and path.read_bytes()[: len(magic)] == magic
    if path.suffix == ".png":
        assert Image.open(path).info["dpi"][0] >= 149.9


def test_plot_to_a_missing_directory_is_an_error_and_creates_nothing(tmp_path):
    pytest.importorskip("matplotlib")
    from minibert.analysis import plots
    from minibert.analysis.probing import ProbeResult

    with pytest.raises(InputError, match="does not exist"):
        plots.probe_curve(ProbeResult([0, 1], [0.5, 0.9], [0.4, 0.5], 0.3, 10, 5, ["a", "b"]),
                          tmp_path / "missing" / "p.png")
    assert not (tmp_path / "missing").exists()


def test_cli_prints_the_real_plot_path(minilm_dir, tmp_path):
    pytest.importorskip("matplotlib")
    r = run_cli("layers", "The bank approved the loan application after a long review.", "--model",
                str(minilm_dir), "--plot", str(tmp_path / "heat"))
    assert r.returncode == 0, r.stderr
    assert f"wrote {tmp_path / 'heat.png'}" in r.stdout and (tmp_path / "heat.png").exists()


# --------------------------------------------------------------------------------------- 5. CLI speed
def test_help_and_argument_errors_do_not_import_torch():
    """`minibert --help` used to take 4-5 s importing torch first; now only argparse is imported."""
    code = ("import sys\nfrom minibert.cli import main\n"
            "for argv in (['--help'], ['encode', '--help'], ['encode'], ['nonsense']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('torch imported:', 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.stdout.strip().endswith("torch imported: False"), r.stdout + r.stderr
