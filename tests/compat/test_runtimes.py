"""minibert/compat/runtimes.py: a deployed model (ONNX Runtime, OpenVINO, CTranslate2) against the exact
reference, layer by layer: a perturbed weight in block k is found at block k; int8 judged by cosine;
``minibert parity --against`` and ``minibert.testing.assert_runtime_close``."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from conftest import cli_in_process
from minibert import BertModel, BertTokenizer, InputError

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from minibert.compat.export import to_onnx  # noqa: E402
from minibert.compat.runtimes import RuntimeModel, detect, runtime_parity  # noqa: E402
from minibert.testing import assert_runtime_close  # noqa: E402


@pytest.fixture(scope="module")
def graph_dir(tmp_path_factory, tiny_encoder_dir):
    out = tmp_path_factory.mktemp("runtime") / "graph"
    to_onnx(tiny_encoder_dir, out, hidden_states=True, say=None)
    return out


def perturbed(graph_dir, tmp_path, block: int, name: str = "ffn.dense_out.bias", by: float = 0.01):
    """A copy of the graph with one weight of block ``block`` changed (found by its parameter name)."""
    model = onnx.load(str(graph_dir / "model.onnx"))
    wanted = f"encoder.blocks.{block}.{name}"
    [init] = [i for i in model.graph.initializer if i.name.endswith(wanted)]
    values = onnx.numpy_helper.to_array(init).copy()
    values[0] += by
    init.CopyFrom(onnx.numpy_helper.from_array(values, init.name))
    out = tmp_path / f"perturbed_{block}" / "model.onnx"
    out.parent.mkdir()
    onnx.save(model, str(out))
    return out


def test_exported_graph_passes_every_layer(graph_dir, tiny_encoder_dir):
    report = runtime_parity(tiny_encoder_dir, graph_dir)
    assert report.ok and report.dtype == "fp32" and report.atol == 1e-4
    assert [r.layer for r in report.rows] == ["embeddings", "block 0", "block 1", "block 2", "block 3",
                                             "output (last layer)", "pooler"]
    assert max(r.hidden_max for r in report.rows) < 1e-5
    assert report.cosine_min > 0.99999


@pytest.mark.parametrize("block", [0, 2, 3])
def test_a_changed_weight_in_block_k_is_first_found_at_block_k(graph_dir, tmp_path, tiny_encoder_dir, block):
    report = runtime_parity(tiny_encoder_dir, perturbed(graph_dir, tmp_path, block))
    assert not report.ok and report.first_divergent == f"block {block}"
    assert "<- first divergent" in report.table()


def test_a_changed_matrix_is_found_too(graph_dir, tmp_path, tiny_encoder_dir):
    """The products' weights are stored transposed under the exporter's own names: found by shape and place."""
    model = onnx.load(str(graph_dir / "model.onnx"))
    matmuls = [n for n in model.graph.node if n.op_type == "MatMul"
               and any(i.name == n.input[1] for i in model.graph.initializer)]
    # per block: query, key, value, output, dense_in, dense_out (the exporter's order); block 1's query
    target = matmuls[6].input[1]
    [init] = [i for i in model.graph.initializer if i.name == target]
    values = onnx.numpy_helper.to_array(init).copy()
    values[0, 0] += 0.5
    init.CopyFrom(onnx.numpy_helper.from_array(values, init.name))
    onnx.save(model, str(tmp_path / "m.onnx"))
    assert runtime_parity(tiny_encoder_dir, tmp_path / "m.onnx").first_divergent == "block 1"


def test_a_graph_without_hidden_states_is_judged_on_what_it_has(tmp_path, tiny_encoder_dir):
    to_onnx(tiny_encoder_dir, tmp_path / "g", say=None)
    report = runtime_parity(tiny_encoder_dir, tmp_path / "g" / "model.onnx")
    assert report.ok and [r.layer for r in report.rows] == ["output (last layer)", "pooler"]
    assert "final output only" in report.table() and "block up to 3" in report.table()


def test_int8_graph_is_judged_by_sentence_cosine(tmp_path, tiny_encoder_dir):
    to_onnx(tiny_encoder_dir, tmp_path / "g", int8=True, hidden_states=True, say=None)
    report = runtime_parity(tiny_encoder_dir, tmp_path / "g" / "model_int8.onnx")
    assert report.dtype == "int8" and report.min_cosine == 0.99  # detected from its quantised operators
    assert report.first_divergent is None  # hidden differences judged at 2.0 only: a guard against a broken graph
    assert report.ok == (report.cosine_min >= 0.99)
    strict = runtime_parity(tiny_encoder_dir, tmp_path / "g" / "model_int8.onnx", min_cosine=0.999999)
    assert not strict.ok and "sentence cosine too low" in strict.table()
    as_fp32 = runtime_parity(tiny_encoder_dir, tmp_path / "g" / "model_int8.onnx", dtype="fp32")
    assert not as_fp32.ok and as_fp32.first_divergent is not None  # judged as fp32 on request: it fails


def test_the_reference_model_given_is_left_as_it_was(graph_dir, tiny_encoder_dir):
    model = BertModel.from_pretrained(tiny_encoder_dir).train()
    report = runtime_parity(model, graph_dir, tokenizer=BertTokenizer.from_pretrained(tiny_encoder_dir))
    assert report.ok and model.training


def test_assert_runtime_close(graph_dir, tmp_path, tiny_encoder_dir):
    assert assert_runtime_close(tiny_encoder_dir, graph_dir / "model.onnx").ok
    with pytest.raises(AssertionError, match="(?s)differs from the reference.*first divergent"):
        assert_runtime_close(tiny_encoder_dir, perturbed(graph_dir, tmp_path, 1))


def test_what_is_not_a_deployed_model_is_named(tmp_path, tiny_encoder_dir):
    with pytest.raises(InputError, match="no runtime's model there"):
        detect(tiny_encoder_dir)  # a PyTorch checkpoint is compared by minibert parity --against as a checkpoint
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(InputError, match="not a runtime's model"):
        detect(tmp_path / "notes.txt")
    with pytest.raises(InputError, match="runtime 'tensorrt'"):
        RuntimeModel(tmp_path, runtime="tensorrt")


def test_cli_parity_against_a_graph(graph_dir, tmp_path, capsys, tiny_encoder_dir):
    done = cli_in_process(capsys, "parity", "--model", str(tiny_encoder_dir), "--against", str(graph_dir))
    assert done.returncode == 0 and "PASS" in done.stdout and "block 3" in done.stdout
    bad = perturbed(graph_dir, tmp_path, 2)
    (tmp_path / "out").mkdir()  # not in the graph's folder: the folder of a model read is never written into
    done = cli_in_process(capsys, "parity", "--model", str(tiny_encoder_dir), "--against", str(bad), "--json",
                          str(tmp_path / "out" / "r.json"))
    assert done.returncode == 1 and "first layer over 0.0001: block 2" in done.stdout
    assert '"first_divergent": "block 2"' in (tmp_path / "out" / "r.json").read_text()
    done = cli_in_process(capsys, "parity", "--model", str(tiny_encoder_dir), "--runtime", "openvino")
    assert done.returncode == 2 and "--runtime openvino" in done.stderr


# ----------------------------------------------------------------------------------------------- OpenVINO
def test_openvino_reads_the_graph_and_its_ir(graph_dir, tmp_path, tiny_encoder_dir):
    ov = pytest.importorskip("openvino")
    report = runtime_parity(tiny_encoder_dir, graph_dir / "model.onnx", runtime="openvino")
    assert report.ok and report.b.startswith("openvino") and len(report.rows) == 7
    # ov.save_model stores fp16 weights by default: off by ~1e-3 from the embeddings on, and said so
    ov.save_model(ov.convert_model(str(graph_dir / "model.onnx")), str(tmp_path / "model.xml"))
    assert detect(tmp_path)[0] == "openvino"
    report = runtime_parity(tiny_encoder_dir, tmp_path)
    assert not report.ok and report.first_divergent == "embeddings" and "compress_to_fp16=False" in report.b
    ov.save_model(ov.convert_model(str(graph_dir / "model.onnx")), str(tmp_path / "model.xml"), compress_to_fp16=False)
    report = runtime_parity(tiny_encoder_dir, tmp_path)
    assert report.ok and [r.layer for r in report.rows][:2] == ["embeddings", "block 0"] and "fp16" not in report.b


# -------------------------------------------------------------------------------------------- CTranslate2
def test_ctranslate2_fp32_and_int8(tmp_path, tiny_encoder_dir):
    pytest.importorskip("ctranslate2")
    from minibert.compat.export import to_ct2

    folder = to_ct2(tiny_encoder_dir, tmp_path / "ct2", say=None)
    report = runtime_parity(tiny_encoder_dir, folder)
    assert report.ok and [r.layer for r in report.rows] == ["output (last layer)", "pooler"]
    int8 = runtime_parity(tiny_encoder_dir, folder, dtype="int8")
    assert int8.dtype == "int8" and int8.rows[0].hidden_max > report.rows[0].hidden_max


def test_real_minilm_through_every_runtime(tmp_path, minilm_dir):
    """The real checkpoint (a sentence-transformers folder): its graph within 1e-5 on every layer."""
    to_onnx(minilm_dir, tmp_path / "g", hidden_states=True, say=None)
    report = runtime_parity(minilm_dir, tmp_path / "g")
    assert report.ok and max(r.hidden_max for r in report.rows) < 2e-5
    assert [r.layer for r in report.rows][-1] == "sentence"
    texts = ["Where is the bank?", "Café au lait costs €3.50 in Zürich."]
    got = runtime_parity(minilm_dir, tmp_path / "g", texts=texts)
    assert got.inputs == 2 and got.ok


def test_padding_on_the_left_is_refused_by_ctranslate2(tmp_path, tiny_encoder_dir):
    pytest.importorskip("ctranslate2")
    from minibert.compat.export import to_ct2

    model = RuntimeModel(to_ct2(tiny_encoder_dir, tmp_path / "c", say=None))
    batch = {"input_ids": torch.tensor([[0, 101, 7, 102]]), "attention_mask": torch.tensor([[0, 1, 1, 1]]),
             "token_type_ids": torch.zeros(1, 4, dtype=torch.long)}
    with pytest.raises(InputError, match="right padding"):
        model.run(batch)
    batch["attention_mask"] = torch.tensor([[1, 1, 1, 0]])
    assert np.asarray(model.run(batch)["last_hidden_state"]).shape == (1, 4, 32)
    shutil.rmtree(tmp_path / "c")


@pytest.mark.parametrize("package,extra", [("openvino", "openvino"), ("ctranslate2", "ct2")])
def test_a_missing_runtime_names_its_extra(graph_dir, tmp_path, monkeypatch, package, extra):
    import sys

    from minibert.errors import MissingExtra

    monkeypatch.setitem(sys.modules, package, None)
    if package == "openvino":
        with pytest.raises(MissingExtra, match=rf"\.\[{extra}\]"):
            RuntimeModel(graph_dir / "model.onnx", runtime="openvino")
    else:
        (tmp_path / "model.bin").write_bytes(b"")  # a CTranslate2 folder, by its files
        with pytest.raises(MissingExtra, match=rf"\.\[{extra}\]"):
            RuntimeModel(tmp_path)
        from minibert.compat.export import to_ct2

        with pytest.raises(MissingExtra, match=rf"\.\[{extra}\]"):
            to_ct2(graph_dir, tmp_path / "out", say=None)


def test_the_command_lines_choices_are_the_librarys():
    """cli/settings.py repeats the runtimes and formats (it imports no library module: --help is instant)."""
    from minibert.cli import settings as cli_settings
    from minibert.compat import runtimes

    assert cli_settings.RUNTIMES == runtimes.RUNTIMES and cli_settings.EXPORT_FORMATS == ("onnx", "ct2")


def test_min_cosine_goes_with_a_runtime_or_int8(capsys, tiny_encoder_dir):
    done = cli_in_process(capsys, "parity", "--model", str(tiny_encoder_dir), "--min-cosine", "0.9")
    assert done.returncode == 2 and "--min-cosine" in done.stderr
    done = cli_in_process(capsys, "parity", "--model", str(tiny_encoder_dir), "--dtype", "int8", "--min-cosine",
                          "0.999999999")
    assert done.returncode == 1 and "needs >= 1" in done.stdout
