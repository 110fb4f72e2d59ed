"""Issue 71, one test a row: the file named is the file read, every export checked and complete (CTranslate2
too), a head judged by its decisions, an unfinished export refused and replaced, links that cannot delete a
model, damaged inputs in one line, the built-in inputs reaching the last position. The mutation suite is
tests/compat/test_runtimes_mutants.py."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
import pytest
import torch

from conftest import cli_error, cli_in_process
from minibert import BertModel, BertTokenizer, InputError
from minibert.errors import CheckpointError

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from minibert.compat import export  # noqa: E402
from minibert.compat.export import to_onnx  # noqa: E402
from minibert.compat.runtimes import runtime_parity  # noqa: E402


def _with_other_weights(folder, name="pert.safetensors", by=0.1):
    """``folder/name``: the folder's own checkpoint with one bias of block 1 moved by ``by``."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    key = next(k for k in state if k.endswith("layer.1.attention.self.query.bias"))
    state[key] = state[key] + by
    save_file(state, str(folder / name), metadata={"format": "pt"})
    return folder / name


# ------------------------------------------------------------------------------ the file named is the file read
def test_a_named_safetensors_file_is_the_file_read(tmp_path, tiny_encoder_dir):
    folder = tmp_path / "m"
    shutil.copytree(tiny_encoder_dir, folder)
    pert = _with_other_weights(folder)
    result = to_onnx(pert, tmp_path / "g", say=None)
    record = json.loads((tmp_path / "g" / "export.json").read_text())
    assert [os.path.basename(f) for f in record["read"]] == ["config.json", "pert.safetensors"]
    assert record["weights_sha256"] == export.model_fingerprint(BertModel.from_pretrained(pert, mlm_head=False))
    assert result.checks["model.onnx"]["parity"] == "pass"
    # the graph is pert's: the original fails against it, pert passes, and the report says both fingerprints
    assert runtime_parity(pert, tmp_path / "g").ok
    report = runtime_parity(folder, tmp_path / "g")
    assert not report.ok and "pert.safetensors" not in report.fingerprints["reference"]
    assert any("exported from other weights" in note for note in report.notes)


def test_a_named_file_in_a_sentence_transformers_folder(tmp_path, tiny_encoder_dir):
    from minibert.compat import SentenceEncoder

    folder = tmp_path / "st"
    shutil.copytree(tiny_encoder_dir, folder)
    SentenceEncoder(BertModel.from_pretrained(folder), BertTokenizer.from_pretrained(folder)).save_settings(folder)
    pert = _with_other_weights(folder, by=0.5)
    assert SentenceEncoder.from_pretrained(pert).model.encoder.blocks[1].attn.query.bias[0] != \
        SentenceEncoder.from_pretrained(folder).model.encoder.blocks[1].attn.query.bias[0]
    graph = to_onnx(folder, tmp_path / "g", say=None).folder  # the original
    done = runtime_parity(pert, graph)
    assert not done.ok and "pert.safetensors" in done.fingerprints["reference"]


# ------------------------------------------------------------------------------------------ inputs that reach
def test_the_built_in_inputs_reach_the_last_position(tmp_path, tiny_encoder_dir, capsys):
    to_onnx(tiny_encoder_dir, tmp_path / "g", say=None)
    report = runtime_parity(tiny_encoder_dir, tmp_path / "g")
    assert report.longest == report.positions == 512 and report.ok
    assert "longest 512 tokens of 512 positions" in report.table()
    done = cli_in_process(capsys, "parity", "--model", tiny_encoder_dir, "--against", tmp_path / "g", "--json",
                          tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["longest"] == 512 and done.returncode == 0


# ------------------------------------------------------------------------------- a head judged by its decisions
def test_an_int8_classifier_is_judged_by_its_logits(tmp_path, tiny_dir, capsys):
    result = to_onnx(tiny_dir, tmp_path / "g", int8=True, say=None)
    check = result.checks["model_int8.onnx"]
    assert check["cosine_min"] is None  # no sentence vector: logits are not one
    assert 0.0 <= check["argmax_agreement"] <= 1.0 and check["dtype"] == "int8"
    report = runtime_parity(tiny_dir, tmp_path / "g" / "model_int8.onnx")
    assert report.agreement is not None and report.min_agreement == 0.9 and report.cosine_min is None
    assert report.ok == (report.agreement >= 0.9 and report.first_divergent is None)
    assert "argmax agreement" in report.table()
    done = cli_in_process(capsys, "parity", "--model", tiny_dir, "--against", tmp_path / "g" / "model_int8.onnx",
                          "--min-cosine", "0")
    assert done.returncode == 2 and "no hidden state to make a sentence vector" in done.stderr
    config = json.loads((tmp_path / "g" / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"]


def test_a_fail_always_says_the_number():
    from minibert.analysis.parity import ParityReport, Row

    report = ParityReport(a="a", b="b", dtype="int8", atol=2.0, inputs=3, min_cosine=0.99, agreement=0.5,
                          min_agreement=0.9, rows=[Row("logits", 0.3, 0.1)])
    table = report.table()
    assert "sentence cosine too low: not measured" in table and "argmax agreement too low: 0.5000 < 0.9" in table
    assert report.to_json()["reasons"] == report.reasons() and len(report.reasons()) == 2


# -------------------------------------------------------------------------------------- unfinished exports
def test_an_unfinished_export_is_refused_then_replaced(tmp_path, tiny_encoder_dir, capsys):
    out = tmp_path / "g"
    to_onnx(tiny_encoder_dir, out, say=None)
    record = json.loads((out / ".minibert-run.json").read_text())
    # as a kill -9 between the graph and its check leaves it: status running, the process gone, files undeclared
    record.update(status="running", pid=2 ** 22 + 17, process_start=None, files=[])
    assert {"model.onnx", "config.json", "vocab.txt", ".minibert-work"} <= set(record["declared"])
    (out / ".minibert-run.json").write_text(json.dumps(record))
    (out / "export.json").unlink()
    (out / ".minibert-work").mkdir()
    (out / ".minibert-work" / "ort.quant.tmp").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="never finished"):
        runtime_parity(tiny_encoder_dir, out)
    assert "never finished" in cli_error(capsys, "parity", "--model", tiny_encoder_dir, "--against", out)
    done = cli_in_process(capsys, "export", "onnx", "--model", tiny_encoder_dir, "--out", out, "--overwrite")
    assert done.returncode == 0, done.stderr
    assert runtime_parity(tiny_encoder_dir, out).ok and not (out / ".minibert-work").exists()


def test_an_export_declares_what_it_writes_before_writing(tmp_path, tiny_encoder_dir, monkeypatch):
    seen = {}

    def killed(path, *a, **k):  # the moment a kill would land: the graph half-written
        record = json.loads((path.parent / ".minibert-run.json").read_text())
        seen.update(declared=record.get("declared"), tempdir=tempfile.gettempdir())
        raise KeyboardInterrupt
    monkeypatch.setattr(export, "quantize_graph", killed)
    with pytest.raises(KeyboardInterrupt):
        to_onnx(tiny_encoder_dir, tmp_path / "g", int8=True, say=None)
    assert {"model.onnx", "model_int8.onnx", "export.json", ".minibert-work"} <= set(seen["declared"])
    from minibert.outputs import unaccounted

    assert unaccounted(tmp_path / "g") == []  # --overwrite may replace all of it


# ---------------------------------------------------------------------------------------------- CTranslate2
@pytest.fixture
def ct2():
    return pytest.importorskip("ctranslate2")


def test_ct2_export_is_checked_and_complete(tmp_path, tiny_encoder_dir, ct2, monkeypatch):
    where = {}
    convert = ct2.converters.TransformersConverter.convert

    def spy(self, *a, **k):
        where["tempdir"] = tempfile.gettempdir()
        return convert(self, *a, **k)
    monkeypatch.setattr(ct2.converters.TransformersConverter, "convert", spy)
    out = export.to_ct2(tiny_encoder_dir, tmp_path / "c", say=None)
    assert where["tempdir"].startswith(str(out))  # the converter's temporary files: inside --out, then gone
    assert {"model.bin", "vocab.txt", "export.json", ".minibert-run.json"} <= {p.name for p in out.iterdir()}
    assert not (out / ".minibert-work").exists()
    record = json.loads((out / "export.json").read_text())
    assert record["checks"]["model.bin"]["parity"] == "pass"
    assert record["checks"]["model.bin"]["largest_difference"] < 1e-4
    assert record["model_described"]["num_hidden_layers"] == 4
    int8 = export.to_ct2(tiny_encoder_dir, tmp_path / "i", quantization="int8", say=None)
    check = json.loads((int8 / "export.json").read_text())["checks"]["model.bin"]
    assert check["dtype"] == "int8" and check["cosine_min"] is not None


def test_ct2_refuses_what_it_would_initialise_or_drop(tmp_path, tiny_encoder_dir, tiny_dir, ct2):
    lying = tmp_path / "lying"  # config.json says 6 blocks over 4 blocks of weights
    shutil.copytree(tiny_encoder_dir, lying)
    config = json.loads((lying / "config.json").read_text())
    config["num_hidden_layers"] = 6
    (lying / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError):
        export.to_ct2(lying, tmp_path / "a", say=None)
    with pytest.raises(InputError, match="BertForSequenceClassification.*export onnx"):
        export.to_ct2(tiny_dir, tmp_path / "b", say=None)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_ct2_without_a_pooler_exports_zeros_not_random(tmp_path, tiny_encoder_dir, ct2):
    from safetensors.torch import load_file, save_file

    bare = tmp_path / "bare"
    shutil.copytree(tiny_encoder_dir, bare)
    state = {k: v for k, v in load_file(str(bare / "model.safetensors")).items() if "pooler" not in k}
    save_file(state, str(bare / "model.safetensors"), metadata={"format": "pt"})
    outs = [export.to_ct2(bare, tmp_path / f"c{i}", say=None) for i in range(2)]
    from minibert.compat.deployed import RuntimeModel

    tok = BertTokenizer.from_pretrained(bare)
    batch = dict(tok(["a river bank", "hi"], padding=True, return_tensors="pt"))
    for out in outs:
        assert np.all(RuntimeModel(out).run(batch)["pooler_output"] == 0.0)
        assert "zeros" in json.loads((out / "export.json").read_text())["pooler_output"]
    report = runtime_parity(bare, outs[0])
    assert report.ok and any("reference has none" in note for note in report.notes)


# -------------------------------------------------------------------------------------------- links and files
def test_links_cannot_delete_the_model_they_point_to(tmp_path, tiny_encoder_dir, capsys):
    victim = tmp_path / "victim"
    to_onnx(tiny_encoder_dir, victim, say=None)
    shutil.copy(tiny_encoder_dir / "model.safetensors", victim / "model.safetensors")
    links = tmp_path / "links"
    links.mkdir()
    for item in victim.iterdir():
        (links / item.name).symlink_to(item)
    before = sorted(p.name for p in victim.iterdir())
    line = cli_error(capsys, "export", "onnx", "--model", links, "--out", victim, "--overwrite")
    assert "a link in the folder --model reads points to" in line
    assert sorted(p.name for p in victim.iterdir()) == before


def test_a_tokenizer_copy_that_would_be_incomplete_is_an_error(tmp_path, tiny_encoder_dir):
    from minibert.loading import copy_tokenizer

    links = tmp_path / "links"
    links.mkdir()
    (links / "vocab.txt").symlink_to(tmp_path / "gone.txt")
    with pytest.raises(CheckpointError, match="link to a file that is gone"):
        copy_tokenizer(links, tmp_path / "out")
    (links / "vocab.txt").unlink()
    with pytest.raises(CheckpointError, match="no vocab.txt or tokenizer.json"):
        copy_tokenizer(links, tmp_path / "out")


def test_an_opset_out_of_range_is_one_line(tmp_path, capsys, tiny_encoder_dir):
    line = cli_error(capsys, "export", "onnx", "--model", tiny_encoder_dir, "--out", tmp_path / "g", "--opset", "99")
    assert "opset 99" in line and "14" in line
    assert not (tmp_path / "g").exists()


def test_an_export_folder_opens_as_a_plain_folder_does(tmp_path, tiny_encoder_dir):
    """Under umask 022 a folder written in one step (a checkpoint, an --overwrite) is 0755, as mkdir makes it."""
    old = os.umask(0o022)
    try:
        BertModel.from_pretrained(tiny_encoder_dir).save_pretrained(tmp_path / "m")
        to_onnx(tiny_encoder_dir, tmp_path / "g", say=None)
        to_onnx(tiny_encoder_dir, tmp_path / "g", overwrite=True, say=None)
    finally:
        os.umask(old)
    for path in (tmp_path / "m", tmp_path / "g"):
        assert (path.stat().st_mode & 0o777) == 0o755, oct(path.stat().st_mode)
    assert ((tmp_path / "m" / "model.safetensors").stat().st_mode & 0o777) == 0o644


def test_the_reference_given_as_an_object_is_compared_with_its_fingerprint(tmp_path, tiny_encoder_dir):
    model = BertModel.from_pretrained(tiny_encoder_dir)
    to_onnx(model, tmp_path / "g", tokenizer=BertTokenizer.from_pretrained(tiny_encoder_dir), say=None)
    with torch.no_grad():
        model.encoder.blocks[0].ffn.dense_out.bias[0] += 1.0
    report = runtime_parity(model, tmp_path / "g", tokenizer=BertTokenizer.from_pretrained(tiny_encoder_dir))
    assert not report.ok and report.first_divergent == "output (last layer)"


def test_parity_against_transformers_reads_the_named_file_too(tmp_path, tiny_encoder_dir):
    pytest.importorskip("transformers")
    from minibert.analysis.parity import load_transformers

    folder = tmp_path / "m"
    shutil.copytree(tiny_encoder_dir, folder)
    pert = _with_other_weights(folder)
    theirs = load_transformers(str(pert), torch.float32).state_dict()
    ours = load_transformers(str(folder), torch.float32).state_dict()
    key = next(k for k in theirs if k.endswith("layer.1.attention.self.query.bias"))
    assert torch.allclose(theirs[key], ours[key] + 0.1)


def test_ct2_of_a_sentence_transformers_folder_is_checked_on_its_encoder(tmp_path, tiny_encoder_dir, ct2):
    from minibert.compat import SentenceEncoder

    folder = tmp_path / "st"
    shutil.copytree(tiny_encoder_dir, folder)
    SentenceEncoder(BertModel.from_pretrained(folder), BertTokenizer.from_pretrained(folder)).save_settings(folder)
    out = export.to_ct2(folder, tmp_path / "c", say=None)
    check = json.loads((out / "export.json").read_text())["checks"]["model.bin"]
    assert check["parity"] == "pass" and set(check["per_output"]) == {"last_hidden_state", "pooler_output"}
    assert runtime_parity(folder, out).ok
