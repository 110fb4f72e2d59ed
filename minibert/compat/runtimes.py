"""Check a deployed model -- an ONNX graph run by ONNX Runtime or OpenVINO, an OpenVINO IR, a CTranslate2
folder -- against minibert's exact reference, layer by layer: ``minibert parity --model M --against
PATH`` and ``minibert.testing.assert_runtime_close``.

The report is ``minibert parity``'s: one row a layer where the runtime exposes hidden states (a graph
exported with ``minibert export onnx --hidden-states`` names them ``hidden_state_0`` ... ``hidden_state_L``),
else the final state (``last_hidden_state``, or sentence-transformers' ``token_embeddings``); then the
pooler, the task head's outputs and the sentence vector where the runtime has them. Differences are over
real tokens. The first row over the tolerance is where the runtime parts from the reference.

Tolerance by dtype: fp32 ``RUNTIME_ATOL["fp32"]`` = 1e-4 -- fused kernels sum in other orders than
PyTorch (measured 2e-6 to 6e-6 from the reference on MiniLM and BERT-base; results page "runtime parity"),
and a changed weight, a lost LayerNorm epsilon or an approximated GELU shows far above it; int8 by the
cosine of the sentence vectors (mean of the last layer over real tokens), at least ``MIN_COSINE["int8"]``
= 0.99, the hidden-state differences reported, not judged. An ONNX graph with quantised operators is
judged as int8 unless told otherwise; CTranslate2 runs in the compute type asked (``dtype="int8"``: int8).

OpenVINO runs fp32 here (``INFERENCE_PRECISION_HINT`` f32): on CPUs with bf16 or AMX it otherwise infers in
bf16 by default, which is 1e-2 away, not 1e-6. A second OpenVINO trap: ``ov.save_model`` stores the weights
in fp16 unless ``compress_to_fp16=False`` -- 2e-3 from the reference at the embeddings already (measured on
a tiny random model); the report names it when the IR holds fp16 constants.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..analysis.parity import DEFAULT_ATOL, MIN_COSINE, ParityReport, Row, make_batches
from ..errors import InputError, MissingExtra
from .export import (CT2_EXTRA, ONNX_EXTRA, ExportGraph, encoder_config, load_for_export, real_differences,
                     reference_outputs, sentence_cosines)

RUNTIMES = ("auto", "onnxruntime", "openvino", "ctranslate2")
RUNTIME_ATOL = {"fp32": 1e-4, "int8": DEFAULT_ATOL["int8"]}
#: ONNX operators that mean a quantised graph
QUANTISED_OPS = ("DynamicQuantizeLinear", "MatMulInteger", "QuantizeLinear", "DequantizeLinear", "QLinearMatMul",
                 "DynamicQuantizeMatMul", "QAttention", "MatMulIntegerToFloat", "MatMulNBits", "QEmbedLayerNormalization")
#: what a runtime's ports are called in minibert's exports and in those of optimum and sentence-transformers
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
OUTPUT_NAMES = ("last_hidden_state", "pooler_output", "token_embeddings", "sentence_embedding", "logits",
                "start_logits", "end_logits")
#: the report's row for each output that is not a hidden state
ROW_LABELS = {"pooler_output": "pooler", "sentence_embedding": "sentence", "logits": "logits", "start_logits": "start",
              "end_logits": "end"}
OPENVINO_EXTRA = "pip install -e \".[openvino]\" in the minibert checkout (or pip install openvino)"


def detect(path) -> tuple[str, Path]:
    """Which runtime reads ``path``, and the file (or folder) it opens: an ``.onnx`` file (or a folder with
    ``model.onnx``) ONNX Runtime, an ``.xml`` OpenVINO IR (or a folder with ``model.xml``) OpenVINO, a folder
    with CTranslate2's ``model.bin`` (and no PyTorch checkpoint) CTranslate2."""
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix == ".onnx":
            return "onnxruntime", p
        if p.suffix == ".xml":
            return "openvino", p
        raise InputError(f"{path}: not a runtime's model (an .onnx graph, an OpenVINO .xml, or a CTranslate2 folder)")
    if p.is_dir():
        if (p / "model.onnx").is_file():
            return "onnxruntime", p / "model.onnx"
        if (p / "model.xml").is_file():
            return "openvino", p / "model.xml"
        if (p / "model.bin").is_file() and not (p / "pytorch_model.bin").exists():
            return "ctranslate2", p
    raise InputError(f"{path}: no runtime's model there (an .onnx graph or a folder with model.onnx, an OpenVINO "
                     ".xml or a folder with model.xml, a CTranslate2 folder with model.bin)")


def is_runtime_model(path) -> bool:
    try:
        detect(path)
    except InputError:
        return False
    return True


class RuntimeModel:
    """A deployed model, run on a batch of tokenizer output: ``run(batch) -> {output name: array}``."""

    def __init__(self, path, runtime: str = "auto", dtype: str | None = None, threads: int | None = None):
        if runtime not in RUNTIMES:
            raise InputError(f"runtime {runtime!r}: use one of {', '.join(RUNTIMES)}")
        kind, file = detect(path)
        if runtime != "auto":
            if runtime == "openvino" and kind == "onnxruntime":
                kind = "openvino"  # OpenVINO reads ONNX too
            elif runtime != kind:
                raise InputError(f"{path} is a {kind} model; --runtime {runtime} cannot read it")
        self.runtime, self.file = kind, file
        self.name = f"{kind} {file}"
        self.quantised = _onnx_quantised(file) if file.suffix == ".onnx" else dtype == "int8"
        self.dtype = dtype or ("int8" if self.quantised else "fp32")
        if self.dtype not in RUNTIME_ATOL:
            raise InputError(f"dtype {self.dtype!r}: a runtime is judged as fp32 or int8")
        self._run = {"onnxruntime": _ort, "openvino": _openvino, "ctranslate2": _ct2}[kind](file, self.dtype, threads)
        if kind == "openvino" and file.suffix == ".xml" and _fp16_weights(file):
            self.name += " (weights stored in fp16: ov.save_model's default; save with compress_to_fp16=False)"

    def run(self, batch: dict) -> dict[str, np.ndarray]:
        return self._run(batch)


def _onnx_quantised(file: Path) -> bool:
    try:
        import onnx
    except ImportError:
        raise MissingExtra(f"reading an ONNX graph needs the onnx package: {ONNX_EXTRA}") from None
    model = onnx.load(str(file), load_external_data=False)
    return any(node.op_type in QUANTISED_OPS for node in model.graph.node)


def _feed(batch: dict, names) -> dict:
    missing = [n for n in names if n not in batch]
    if missing:
        raise InputError(f"the graph takes inputs {list(names)}; minibert's batches have {list(batch)} "
                         f"(missing {missing})")
    return {n: batch[n].numpy().astype(np.int64) for n in names}


def _ort(file: Path, dtype: str, threads):
    from .export import ort_session

    session = ort_session(file, threads)
    inputs = [i.name for i in session.get_inputs()]
    outputs = [o.name for o in session.get_outputs()]
    return lambda batch: dict(zip(outputs, session.run(None, _feed(batch, inputs))))


def _openvino(file: Path, dtype: str, threads):
    try:
        import openvino as ov
    except ImportError:
        raise MissingExtra(f"running an OpenVINO model needs it: {OPENVINO_EXTRA}") from None
    core = ov.Core()
    config = {"INFERENCE_PRECISION_HINT": "f32"}  # not bf16, its default on CPUs with bf16 / AMX
    if threads:
        config["INFERENCE_NUM_THREADS"] = threads
    compiled = core.compile_model(core.read_model(str(file)), "CPU", config)
    inputs = [_port_name(i, INPUT_NAMES) for i in compiled.inputs]
    outputs = [_port_name(o, OUTPUT_NAMES) for o in compiled.outputs]
    request = compiled.create_infer_request()

    def run(batch):
        request.infer(_feed(batch, inputs))
        return {name: request.get_output_tensor(i).data.copy() for i, name in enumerate(outputs)}
    return run


def _fp16_weights(file: Path) -> bool:
    """Whether an OpenVINO IR keeps its weights in fp16 (``ov.save_model`` compresses them unless told not
    to): such a model is ~1e-3 from fp32, which the report should explain rather than just show."""
    import openvino as ov

    model = ov.Core().read_model(str(file))
    return any(op.get_type_name() == "Constant" and op.get_output_element_type(0) == ov.Type.f16
               for op in model.get_ops())


def _port_name(port, known) -> str:
    """A port's name as the graph's author gave it (OpenVINO keeps several per port: the ONNX name among them)."""
    names = port.get_names()
    return next((n for n in known if n in names), None) or next((n for n in names if n.startswith("hidden_state_")),
                                                                port.get_any_name())


def _ct2(folder: Path, dtype: str, threads):
    try:
        import ctranslate2
    except ImportError:
        raise MissingExtra(f"running a CTranslate2 model needs it: {CT2_EXTRA}") from None
    compute = "int8" if dtype == "int8" else "float32"
    encoder = ctranslate2.Encoder(str(folder), device="cpu", compute_type=compute, intra_threads=threads or 0)

    def run(batch):
        lengths = batch["attention_mask"].sum(1).tolist()
        if any(not bool(row[:n].all()) or bool(row[n:].any()) for row, n in zip(batch["attention_mask"], lengths)):
            raise InputError("CTranslate2 takes each sequence's real tokens first (right padding); this batch "
                             "has padding elsewhere")
        ids = [row[:n].tolist() for row, n in zip(batch["input_ids"], lengths)]
        types = [row[:n].tolist() for row, n in zip(batch["token_type_ids"], lengths)]
        out = encoder.forward_batch(ids, token_type_ids=types)
        T = batch["input_ids"].shape[1]
        last = np.array(out.last_hidden_state)  # (B, longest, H)
        got = {"last_hidden_state": np.pad(last, ((0, 0), (0, T - last.shape[1]), (0, 0)))}
        if out.pooler_output is not None:
            got["pooler_output"] = np.array(out.pooler_output)
        return got
    return run


# ------------------------------------------------------------------------------------------ comparing
def _layer(name: str, blocks: int) -> str | None:
    if name.startswith("hidden_state_"):
        i = int(name.rsplit("_", 1)[1])
        return "embeddings" if i == 0 else f"block {i - 1}"
    return None


def _rows_to_compare(got: dict, want: dict, blocks: int) -> list[tuple[str, str, str]]:
    """(row label, runtime output, reference output) in layer order."""
    rows = [(_layer(n, blocks), n, n) for n in want if _layer(n, blocks) and n in got]
    if not rows:  # the final state only
        final = next((n for n in ("last_hidden_state", "token_embeddings") if n in got), None)
        if final is not None:
            rows.append((f"block {blocks - 1} (last)", final, f"hidden_state_{blocks}"))
    for name, label in ROW_LABELS.items():
        if name in got and name in want:
            rows.append((label, name, name))
    if not rows:
        raise InputError(f"the runtime's outputs {sorted(got)} hold nothing to compare: it needs hidden_state_i, "
                         "last_hidden_state, token_embeddings, pooler_output or the task head's outputs (export "
                         "with minibert export onnx --hidden-states for a per-layer report)")
    return rows


def runtime_parity(model, against, *, runtime: str = "auto", dtype: str | None = None, texts=None, pairs=None,
                   atol: float | None = None, min_cosine: float | None = None, tokenizer=None,
                   threads: int | None = None) -> ParityReport:
    """The per-layer report of a deployed model ``against`` (a path: see ``detect``) beside the reference
    ``model`` (a path or a minibert model), on ``texts`` / ``pairs`` or minibert's varied parity set."""
    from ..tokenizer import BertTokenizer

    deployed = RuntimeModel(against, runtime, dtype, threads)
    source = str(model) if isinstance(model, (str, Path)) else getattr(model, "source", None)
    if isinstance(model, (str, Path)):
        model, _ = load_for_export(model)
    if tokenizer is None:
        if source is None:
            raise InputError("no tokenizer: pass tokenizer= when the model is not a path")
        tokenizer = BertTokenizer.from_pretrained(source)
    config = encoder_config(model)
    limit = min(config.max_position_embeddings, getattr(tokenizer, "model_max_length", 512) or 512)
    batches = make_batches(tokenizer, texts=texts, pairs=pairs, max_length=limit) if (texts or pairs) else \
        make_batches(tokenizer, max_length=limit)
    graph = ExportGraph(model, hidden_states=True)  # the reference: every output, every hidden state
    atol = RUNTIME_ATOL[deployed.dtype] if atol is None else float(atol)
    need = MIN_COSINE.get(deployed.dtype) if min_cosine is None else float(min_cosine)
    training = graph.inner.training
    graph.eval()
    try:
        return _compare(deployed, graph, batches, config.num_hidden_layers, atol, need, source or "minibert model")
    finally:
        graph.inner.train(training)  # the model as it was given


def _compare(deployed: RuntimeModel, graph, batches, blocks: int, atol: float, need, name: str) -> ParityReport:
    stats: dict[str, list] = {}  # row -> [max, sum, count]
    cosines, count, order = [], 0, []
    for batch in batches:
        want, got = reference_outputs(graph, batch), deployed.run(batch)
        mask = batch["attention_mask"].numpy().astype(bool)
        count += mask.shape[0]
        for label, g, w in _rows_to_compare(got, want, blocks):
            diff = real_differences(g, got[g], want[w], mask, deployed.name)
            if label not in stats:
                order.append(label)
            entry = stats.setdefault(label, [0.0, 0.0, 0])
            top = float(diff.max()) if diff.size else 0.0
            entry[0] = float("nan") if np.isnan(diff).any() or entry[0] != entry[0] else max(entry[0], top)
            entry[1], entry[2] = entry[1] + float(diff.sum()), entry[2] + diff.size
        last_got = next((got[n] for n in (f"hidden_state_{blocks}", "last_hidden_state", "token_embeddings")
                         if n in got), None)
        if last_got is not None:
            cosines.append(sentence_cosines(np.asarray(last_got), want[f"hidden_state_{blocks}"], mask))
    every = np.concatenate(cosines) if cosines else np.zeros(0)
    report = ParityReport(a=name, b=deployed.name, dtype=deployed.dtype, atol=atol, inputs=count,
                          cosine_min=float(every.min()) if every.size else None,
                          cosine_mean=float(every.mean()) if every.size else None, min_cosine=need)
    report.rows = [Row(label, stats[label][0], stats[label][1] / max(stats[label][2], 1)) for label in order]
    return report


