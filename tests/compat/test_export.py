"""minibert/compat/export.py: any model minibert makes to an ONNX graph (checked against the model by ONNX
Runtime as it is written) and to a CTranslate2 folder; the output-folder rule; what cannot be exported."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import cli_in_process
from minibert import (BertForSequenceClassification, BertForTokenClassification, BertModel, BertTokenizer, InputError,
                      MissingExtra)
from minibert.compat import SentenceEncoder
from minibert.config import BertConfig

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")
from minibert.compat import export  # noqa: E402  (after the skip: ONNX Runtime runs every check here)
from minibert.compat.export import to_onnx  # noqa: E402


def run_graph(path, batch) -> dict:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    feed = {i.name: batch[i.name].numpy() for i in session.get_inputs()}
    return dict(zip(names, session.run(None, feed)))


def batch_of(tokenizer, texts, pairs=None):
    return dict(tokenizer(texts, pairs, padding=True, return_tensors="pt"))


TEXTS = ["a", "the bank approved the loan for the house by the river", "no way", "x y z " * 20]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_encoder_dir):
    out = tmp_path_factory.mktemp("export") / "graph"
    result = to_onnx(tiny_encoder_dir, out, hidden_states=True, say=None)
    return result, out


def test_encoder_graph_matches_the_model_at_other_batch_sizes_and_lengths(exported, tiny_encoder_dir):
    result, out = exported
    model = BertModel.from_pretrained(tiny_encoder_dir).eval()
    tok = BertTokenizer.from_pretrained(tiny_encoder_dir)
    assert result.outputs == ["last_hidden_state", "pooler_output", *(f"hidden_state_{i}" for i in range(5))]
    assert result.checks["model.onnx"]["largest_difference"] < 1e-5
    for batch in (batch_of(tok, TEXTS[:1]), batch_of(tok, TEXTS), batch_of(tok, TEXTS[:3], ["yes", "b", "c d e"])):
        got = run_graph(out / "model.onnx", batch)
        with torch.no_grad():
            want = model(**batch)
        real = batch["attention_mask"].bool().numpy()
        for i, h in enumerate(want.hidden_states):
            assert np.abs(got[f"hidden_state_{i}"] - h.numpy())[real].max() < 1e-5, i
        assert np.abs(got["last_hidden_state"] - want.last_hidden_state.numpy())[real].max() < 1e-5
        assert np.abs(got["pooler_output"] - want.pooler_output.numpy()).max() < 1e-5


def test_folder_holds_the_tokenizer_config_and_the_record(exported, tiny_encoder_dir):
    result, out = exported
    assert (out / "vocab.txt").read_bytes() == (tiny_encoder_dir / "vocab.txt").read_bytes()
    assert BertConfig.from_json_file(out / "config.json").hidden_size == 32
    record = json.loads((out / "export.json").read_text())
    assert record["inputs"] == ["input_ids", "attention_mask", "token_type_ids"]
    assert record["outputs"] == result.outputs and record["hidden_states"] is True
    assert record["checks"]["model.onnx"]["largest_difference"] == result.checks["model.onnx"]["largest_difference"]


def test_task_heads_export_their_outputs(tmp_path, tiny_dir, tiny_encoder_dir):
    tok = BertTokenizer.from_pretrained(tiny_dir)
    result = to_onnx(tiny_dir, tmp_path / "seq", say=None)  # a fine-tuned checkpoint: its head, by its config
    assert result.outputs == ["logits"]
    batch = batch_of(tok, TEXTS)
    want = BertForSequenceClassification.from_pretrained(tiny_dir).eval()(**batch).logits.detach().numpy()
    assert np.abs(run_graph(tmp_path / "seq" / "model.onnx", batch)["logits"] - want).max() < 1e-5
    # a model object: a token tagger with 3 labels (as many as a batch may have tokens: the axes are traced)
    tagger = BertForTokenClassification.from_encoder(tiny_encoder_dir, labels=3, seed=1).eval()
    result = to_onnx(tagger, tmp_path / "tok", tokenizer=tok, hidden_states=True, say=None)
    assert result.outputs[0] == "logits" and len(result.outputs) == 6
    got = run_graph(tmp_path / "tok" / "model.onnx", batch)["logits"]
    with torch.no_grad():
        want = tagger(**batch).logits.numpy()
    real = batch["attention_mask"].bool().numpy()
    assert got.shape == want.shape and np.abs(got - want)[real].max() < 1e-5


def test_sentence_folder_exports_its_pooling_and_normalisation(tmp_path, tiny_encoder_dir):
    folder = tmp_path / "st"
    shutil.copytree(tiny_encoder_dir, folder)
    encoder = SentenceEncoder(BertModel.from_pretrained(folder), BertTokenizer.from_pretrained(folder),
                              pooling=["mean", "max"], normalize=True)
    encoder.save_settings(folder)
    result = to_onnx(folder, tmp_path / "graph", say=None)
    assert result.outputs == ["token_embeddings", "sentence_embedding"]
    texts = ["the river bank", "a loan", "hello there my friend"]
    got = run_graph(tmp_path / "graph" / "model.onnx", batch_of(encoder.tokenizer, texts))["sentence_embedding"]
    want = SentenceEncoder.from_pretrained(folder).encode(texts)
    assert got.shape == (3, 64) and np.abs(got - np.asarray(want)).max() < 1e-5


@pytest.mark.parametrize("placement", ["pre", "deepnorm"])
def test_norm_placements_export(tmp_path, tiny_encoder_dir, placement):
    config = BertConfig.from_json_file(tiny_encoder_dir / "config.json")
    config.norm_placement = placement
    if placement == "deepnorm":
        config.residual_scale = 2.0
    torch.manual_seed(0)
    model = BertModel(config).eval()
    result = to_onnx(model, tmp_path / placement, tokenizer=BertTokenizer.from_pretrained(tiny_encoder_dir),
                     hidden_states=True, say=None)
    assert result.checks["model.onnx"]["largest_difference"] < 1e-5


def test_the_model_given_is_left_as_it_was(tmp_path, tiny_encoder_dir):
    model = BertModel.from_pretrained(tiny_encoder_dir).train()  # dropout on: the export must not turn it off
    before = {k: v.clone() for k, v in model.state_dict().items()}
    to_onnx(model, tmp_path / "g", tokenizer=BertTokenizer.from_pretrained(tiny_encoder_dir), say=None)
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_refused_before_anything_is_written(tmp_path, tiny_encoder_dir):
    tok = BertTokenizer.from_pretrained(tiny_encoder_dir)
    with pytest.raises(InputError, match="int8-quantised.*export the fp32 model"):
        to_onnx(BertModel.from_pretrained(tiny_encoder_dir, dtype="int8"), tmp_path / "a", tokenizer=tok, say=None)
    with pytest.raises(InputError, match="bfloat16: the ONNX export is fp32"):
        to_onnx(BertModel.from_pretrained(tiny_encoder_dir, dtype="bf16"), tmp_path / "b", tokenizer=tok, say=None)
    with pytest.raises(InputError, match="opset 12"):
        to_onnx(tiny_encoder_dir, tmp_path / "c", opset=12, say=None)
    with pytest.raises(InputError, match="--out"):  # the folder the model is read from
        to_onnx(tiny_encoder_dir, tiny_encoder_dir, say=None)
    module = tmp_path / "module"  # a task module saved beside nothing: the path alone would lose it
    module.mkdir()
    for name in ("adapter.json", "adapter.safetensors"):
        (module / name).write_text("{}")
    with pytest.raises(InputError, match="task module.*pass the object"):
        export.load_for_export(module)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    with pytest.raises(InputError, match="holds"):
        to_onnx(tiny_encoder_dir, mine, say=None)
    assert (mine / "notes.txt").read_text() == "my notes"
    assert not any((tmp_path / n).exists() for n in "abc")


def test_optimize_and_int8_are_checked(tmp_path, tiny_encoder_dir):
    result = to_onnx(tiny_encoder_dir, tmp_path / "g", optimize=True, int8=True, say=None)
    assert set(result.checks) == {"model.onnx", "model_optimized.onnx", "model_int8.onnx"}
    assert result.checks["model_optimized.onnx"]["largest_difference"] < 1e-5
    assert result.fusions.get("SkipLayerNormalization", 0) > 0  # the optimiser did fuse
    int8 = result.checks["model_int8.onnx"]
    assert 1e-4 < int8["largest_difference"] and 0.5 < int8["cosine_min"] < 1.0  # drift said, not hidden
    assert "model_int8.onnx" in result.summary() and "cosine min" in result.summary()


def test_missing_runtime_names_the_extra(tmp_path, tiny_encoder_dir, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(MissingExtra, match=r"\.\[onnx\]"):
        to_onnx(tiny_encoder_dir, tmp_path / "g", say=None)
    assert not (tmp_path / "g").exists()  # a failed export leaves no folder behind


def test_cli_export(tmp_path, capsys, tiny_encoder_dir):
    done = cli_in_process(capsys, "export", "onnx", "--model", str(tiny_encoder_dir), "--out", str(tmp_path / "g"),
                          "--hidden-states")
    assert done.returncode == 0 and "largest difference from the model" in done.stdout
    assert (tmp_path / "g" / "model.onnx").is_file()
    done = cli_in_process(capsys, "export", "ct2", "--model", str(tiny_encoder_dir), "--out", str(tmp_path / "c"),
                          "--hidden-states")
    assert done.returncode == 2 and "--hidden-states" in done.stderr


# ------------------------------------------------------------------------------------------- CTranslate2
def test_ct2_conversion_of_a_transformers_5_checkpoint(tmp_path, tiny_encoder_dir):
    """transformers 5 writes no position_embedding_type, which CTranslate2's converter reads: the conversion
    works all the same, from a copy -- the checkpoint's own config is left as it was."""
    pytest.importorskip("ctranslate2")
    before = (tiny_encoder_dir / "config.json").read_bytes()
    out = export.to_ct2(tiny_encoder_dir, tmp_path / "ct2", say=None)
    assert (out / "model.bin").is_file() and (out / "config.json").is_file()
    assert (tiny_encoder_dir / "config.json").read_bytes() == before


def test_ct2_refusals_say_what_fails(tmp_path, tiny_encoder_dir, monkeypatch):
    ct2 = pytest.importorskip("ctranslate2")
    pre = tmp_path / "pre"
    config = BertConfig.from_json_file(tiny_encoder_dir / "config.json")
    config.norm_placement = "pre"
    BertModel(config).save_pretrained(pre)
    with pytest.raises(InputError, match="post-LN only"):
        export.to_ct2(pre, tmp_path / "a", say=None)

    def broken(self, *a, **k):
        raise KeyError("encoder.layer.0.attention")
    monkeypatch.setattr(ct2.converters.TransformersConverter, "convert", broken)
    from minibert.errors import CheckpointError

    with pytest.raises(CheckpointError, match="CTranslate2's converter .* could not convert .*KeyError"):
        export.to_ct2(tiny_encoder_dir, tmp_path / "b", say=None)
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())


def test_the_public_name_is_minibert_export():
    import minibert.export as public

    assert public.to_onnx is to_onnx and public.to_ct2 is export.to_ct2
    with pytest.raises(AttributeError, match="to_tflite"):
        public.to_tflite


def test_a_scalarmix_classifier_object_exports(tmp_path, tiny_encoder_dir):
    """What a path alone would lose (the mix and head are a part beside the checkpoint) exports from the object."""
    from minibert.training.recipes import ScalarMixClassifier

    tok = BertTokenizer.from_pretrained(tiny_encoder_dir)
    model = ScalarMixClassifier(BertModel.from_pretrained(tiny_encoder_dir), labels=3, seed=2).eval()
    with torch.no_grad():
        model.mix.scalar_parameters.normal_()  # a mix that is not uniform
    result = to_onnx(model, tmp_path / "g", tokenizer=tok, say=None)
    assert result.outputs == ["logits"] and result.checks["model.onnx"]["largest_difference"] < 1e-5
