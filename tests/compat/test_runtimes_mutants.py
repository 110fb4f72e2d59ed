"""The mutation suite of ``minibert parity --against`` (issue 71): deployed models that compute something else
than the reference -- another depth, a perturbed block, lost late positions, a dropped or random head, a random
pooler, another file, an unfinished export, an int8 graph judged as fp32, damaged files -- each of which must
FAIL (exit 1) or be refused (exit 2), never PASS. Run through the command line, as a team's CI runs it, against
ONNX Runtime (and CTranslate2 / OpenVINO where their wheels install). The list is on the how-to page
docs/how-to/deployment-parity.md ("What it catches"); ``MUTANTS`` below is that list, tested equal to it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import cli_in_process
from minibert import BertForSequenceClassification, BertModel

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from minibert.compat.export import to_onnx  # noqa: E402

#: mutant -> what it is (the how-to page lists these names and words)
MUTANTS = {
    "deeper-reference": "a 2-block graph checked against the 4-block model it was cut from",
    "shallower-reference": "a 4-block graph checked against a 2-block cut of its model",
    "depth-no-record": "a 2-block graph with its hidden states, its export.json gone",
    "depth-final-only": "a 2-block graph without hidden states or export.json",
    "perturbed-block": "one bias of block 2 changed by 0.01",
    "late-positions": "position embeddings 200-511 zeroed",
    "random-pooler": "the pooler's weights replaced by random ones",
    "random-head": "a classifier's head replaced by a random one",
    "dropped-head": "a classifier checked against the graph of its encoder alone",
    "head-on-encoder": "an encoder checked against a classifier's graph",
    "other-labels": "a classifier with 3 labels against a graph of one with 2",
    "other-file": "a .safetensors file beside model.safetensors, checked against the original's graph",
    "unfinished-export": "an export killed before its check finished",
    "int8-as-fp32": "an int8 graph judged as fp32",
    "int8-renamed": "an int8 graph copied over the fp32 model.onnx its export.json describes",
    "truncated-graph": "model.onnx cut to half its bytes",
    "text-as-graph": "a text file named model.onnx",
    "empty-graph": "an empty model.onnx",
    "static-shape": "a graph whose inputs are fixed at [1, 16]",
    "int32-inputs": "a graph whose token inputs are int32",
    "ct2-shallower": "a CTranslate2 folder of a 2-block cut, against the 4-block model",
    "ct2-truncated": "a CTranslate2 model.bin cut to half its bytes",
    "openvino-perturbed": "the perturbed graph run by OpenVINO",
    "openvino-truncated": "an OpenVINO IR whose .bin is cut to half its bytes",
}


def _save_graph(model, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def _initializer(model, suffix: str):
    [init] = [i for i in model.graph.initializer if i.name.endswith(suffix)]
    return init


def _edit(source: Path, target: Path, suffix: str, change) -> Path:
    """A copy of the graph at ``source`` with the initializer named ``...suffix`` changed by ``change``."""
    model = onnx.load(str(source))
    init = _initializer(model, suffix)
    values = onnx.numpy_helper.to_array(init).copy()
    change(values)
    init.CopyFrom(onnx.numpy_helper.from_array(values, init.name))
    return _save_graph(model, target)


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_encoder_dir, tiny_dir):
    """Every mutant as (reference model path, deployed path, extra arguments)."""
    root = tmp_path_factory.mktemp("mutants")
    full = to_onnx(tiny_encoder_dir, root / "full", hidden_states=True, int8=True, say=None).folder
    plain = to_onnx(tiny_encoder_dir, root / "plain", say=None).folder
    cut = BertModel.from_pretrained(tiny_encoder_dir).keep_blocks([0, 1])
    cut.save_pretrained(root / "cut")
    shutil.copy(tiny_encoder_dir / "vocab.txt", root / "cut" / "vocab.txt")
    shallow = to_onnx(root / "cut", root / "shallow", hidden_states=True, say=None).folder
    shallow_plain = to_onnx(root / "cut", root / "shallow_plain", say=None).folder
    m: dict[str, tuple] = {}
    m["deeper-reference"] = (tiny_encoder_dir, shallow)
    m["shallower-reference"] = (root / "cut", full)
    alone = root / "alone" / "model.onnx"
    alone.parent.mkdir()
    shutil.copy(shallow / "model.onnx", alone)
    m["depth-no-record"] = (tiny_encoder_dir, alone)
    alone_plain = root / "alone_plain" / "model.onnx"
    alone_plain.parent.mkdir()
    shutil.copy(shallow_plain / "model.onnx", alone_plain)
    m["depth-final-only"] = (tiny_encoder_dir, alone_plain)

    def add(values, by=0.01):
        values.flat[0] += by

    m["perturbed-block"] = (tiny_encoder_dir, _edit(full / "model.onnx", root / "pert" / "model.onnx",
                                                    "encoder.blocks.2.ffn.dense_out.bias", add))

    def zero_late(values):
        values[200:] = 0.0

    m["late-positions"] = (tiny_encoder_dir, _edit(plain / "model.onnx", root / "late" / "model.onnx",
                                                   "embeddings.position.weight", zero_late))
    generator = torch.Generator().manual_seed(0)

    def randomise(values):
        values[...] = torch.randn(values.shape, generator=generator).numpy() * 0.05

    m["random-pooler"] = (tiny_encoder_dir, _edit(plain / "model.onnx", root / "pooler" / "model.onnx",
                                                  "pooler.dense.weight", randomise))
    head = to_onnx(tiny_dir, root / "head", say=None).folder
    m["random-head"] = (tiny_dir, _edit(head / "model.onnx", root / "randhead" / "model.onnx", "classifier.weight",
                                        randomise))
    encoder_of_head = root / "enc_of_head"
    BertForSequenceClassification.from_pretrained(tiny_dir).bert.save_pretrained(encoder_of_head)
    shutil.copy(tiny_dir / "vocab.txt", encoder_of_head / "vocab.txt")
    m["dropped-head"] = (tiny_dir, to_onnx(encoder_of_head, root / "dropped", say=None).folder)
    m["head-on-encoder"] = (encoder_of_head, head)
    two = BertForSequenceClassification.from_encoder(encoder_of_head, labels=2)
    two.save_pretrained(root / "two_labels")
    shutil.copy(tiny_dir / "vocab.txt", root / "two_labels" / "vocab.txt")
    m["other-labels"] = (tiny_dir, to_onnx(root / "two_labels", root / "two_graph", say=None).folder)
    other = root / "other"
    shutil.copytree(tiny_encoder_dir, other)
    state = BertModel.from_pretrained(tiny_encoder_dir).state_dict()
    from safetensors.torch import save_file

    from minibert.loading import tensor_map

    names = {ours: theirs for theirs, ours, _ in tensor_map(BertModel.from_pretrained(tiny_encoder_dir).config)}
    changed = {names[k]: (v + 0.1 if k.endswith("blocks.1.attn.query.bias") else v).contiguous()
               for k, v in state.items() if k in names}
    save_file(changed, str(other / "pert.safetensors"))
    m["other-file"] = (other / "pert.safetensors", plain)
    unfinished = root / "unfinished"
    shutil.copytree(full, unfinished)
    record = json.loads((unfinished / ".minibert-run.json").read_text())
    record.update(status="running", pid=2 ** 22 + 17, process_start=None)  # a process that is gone
    (unfinished / ".minibert-run.json").write_text(json.dumps(record))
    m["unfinished-export"] = (tiny_encoder_dir, unfinished)
    m["int8-as-fp32"] = (tiny_encoder_dir, full / "model_int8.onnx", "--dtype", "fp32")
    renamed = root / "renamed"
    shutil.copytree(full, renamed)
    shutil.copy(full / "model_int8.onnx", renamed / "model.onnx")
    m["int8-renamed"] = (tiny_encoder_dir, renamed)
    data = (plain / "model.onnx").read_bytes()
    for name, content in (("truncated-graph", data[:len(data) // 2]), ("text-as-graph", b"not a graph\n" * 10),
                          ("empty-graph", b"")):
        (root / name).mkdir()
        (root / name / "model.onnx").write_bytes(content)
        m[name] = (tiny_encoder_dir, root / name / "model.onnx")
    static = onnx.load(str(plain / "model.onnx"))
    for port in static.graph.input:
        for dim, size in zip(port.type.tensor_type.shape.dim, (1, 16)):
            dim.ClearField("dim_param")
            dim.dim_value = size
    m["static-shape"] = (tiny_encoder_dir, _save_graph(static, root / "static" / "model.onnx"))
    narrow = onnx.load(str(plain / "model.onnx"))
    for port in narrow.graph.input:
        port.type.tensor_type.elem_type = onnx.TensorProto.INT32
    m["int32-inputs"] = (tiny_encoder_dir, _save_graph(narrow, root / "int32" / "model.onnx"))
    return m, root


def _ct2_mutants(root: Path, tiny_encoder_dir) -> dict:
    pytest.importorskip("ctranslate2")
    from minibert.compat.export import to_ct2

    shallow = to_ct2(root / "cut", root / f"ct2_cut", say=None)
    full = to_ct2(tiny_encoder_dir, root / "ct2_full", say=None)
    truncated = root / "ct2_truncated"
    shutil.copytree(full, truncated)
    data = (truncated / "model.bin").read_bytes()
    (truncated / "model.bin").write_bytes(data[:len(data) // 2])
    return {"ct2-shallower": (tiny_encoder_dir, shallow), "ct2-truncated": (tiny_encoder_dir, truncated)}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_every_mutant_fails_or_is_refused(built, name, capsys, tiny_encoder_dir):
    mutants, root = built
    if name.startswith("ct2-"):
        if not (root / "ct2_full").exists():
            mutants.update(_ct2_mutants(root, tiny_encoder_dir))
        reference, deployed, *extra = mutants[name]
    elif name == "openvino-perturbed":
        pytest.importorskip("openvino")
        reference, deployed = mutants["perturbed-block"]
        extra = ["--runtime", "openvino"]
    elif name == "openvino-truncated":
        ov = pytest.importorskip("openvino")
        ir = root / "ir"
        ir.mkdir(exist_ok=True)
        ov.save_model(ov.convert_model(str(root / "plain" / "model.onnx")), str(ir / "model.xml"),
                      compress_to_fp16=False)
        data = (ir / "model.bin").read_bytes()
        (ir / "model.bin").write_bytes(data[:len(data) // 2])
        reference, deployed, extra = tiny_encoder_dir, ir / "model.xml", []
    else:
        reference, deployed, *extra = mutants[name]
    done = cli_in_process(capsys, "parity", "--model", reference, "--against", deployed, *extra)
    assert done.returncode in (1, 2), (name, done.stdout, done.stderr)
    if done.returncode == 1:  # a FAIL says why, in numbers
        result = [line for line in done.stdout.splitlines() if line.startswith("result: FAIL")]
        assert result and any(c.isdigit() for c in result[0].split(";", 1)[-1]), done.stdout
    else:  # a refusal is one line, naming what
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("minibert: error: "), done.stderr


def test_the_unmutated_forms_pass(built, capsys, tiny_encoder_dir, tiny_dir):
    """The suite is not vacuous: the forms the mutants were made from pass the same check."""
    _, root = built
    for reference, deployed in ((tiny_encoder_dir, root / "full"), (tiny_encoder_dir, root / "plain"),
                                (root / "cut", root / "shallow"), (tiny_dir, root / "head")):
        done = cli_in_process(capsys, "parity", "--model", reference, "--against", deployed)
        assert done.returncode == 0 and "result: PASS" in done.stdout, (deployed, done.stdout, done.stderr)


def test_the_how_to_page_lists_the_mutants():
    page = (Path(__file__).resolve().parents[2] / "docs" / "how-to" / "deployment-parity.md").read_text()
    for name, what in MUTANTS.items():
        assert f"`{name}`" in page and what in page, name
