"""A deployed model -- an ONNX graph run by ONNX Runtime or OpenVINO, an OpenVINO IR, a CTranslate2 folder --
as minibert runs it: ``RuntimeModel(path).run(batch) -> {output name: array}``. What reads the runtime's files
(``detect``), refuses what it cannot feed or what an export never finished (``export_record``), and says a
damaged file in one line. ``compat/export.py`` checks what it writes with it; ``compat/runtimes.py`` compares
it with the reference.

OpenVINO runs fp32 here (``INFERENCE_PRECISION_HINT`` f32): on CPUs with bf16 or AMX it otherwise infers in
bf16 by default, which is 1e-2 away, not 1e-6. A second OpenVINO trap: ``ov.save_model`` stores the weights
in fp16 unless ``compress_to_fp16=False``; the model's name says so when the IR holds fp16 constants.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..analysis.parity import DEFAULT_ATOL
from ..errors import CheckpointError, InputError, MissingExtra

ONNX_EXTRA = "pip install -e \".[onnx]\" in the minibert checkout (or pip install onnx onnxruntime)"
CT2_EXTRA = "pip install -e \".[ct2]\" in the minibert checkout (or pip install ctranslate2 transformers)"
#: what an export writes beside the deployed model: what was exported, from what, and its checks
RECORD = "export.json"
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


def export_record(file: Path) -> dict | None:
    """The ``export.json`` minibert wrote beside a deployed model (its folder's), or None. An export that
    did not finish -- its run record not "finished": killed, stopped, still running -- is refused: its files
    may be whole, but no check of them ever completed."""
    from ..config import read_json_object
    from ..outputs import RECORD_FILE, describe, read_record

    folder = file if file.is_dir() else file.parent
    run = read_record(folder)
    if run is not None and run.get("command") == "export" and run.get("status") != "finished":
        held, _ = describe(folder)
        raise CheckpointError(f"{folder} holds {held.replace('a `minibert export` run', 'an export')}, which never "
                              f"finished ({RECORD_FILE} status {run.get('status')!r}): its files were never checked; "
                              "export again (minibert export ... --overwrite replaces it)")
    return read_json_object(folder / RECORD) if (folder / RECORD).is_file() else None


class RuntimeModel:
    """A deployed model, run on a batch of tokenizer output: ``run(batch) -> {output name: array}``.
    ``unfinished_ok``: the export writing it may still be running (the export's own check)."""

    def __init__(self, path, runtime: str = "auto", dtype: str | None = None, threads: int | None = None,
                 unfinished_ok: bool = False):
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
        self.record = None if unfinished_ok else export_record(file)
        self.quantised = _onnx_quantised(file) if file.suffix == ".onnx" else dtype == "int8"
        recorded = ((self.record or {}).get("checks") or {}).get(file.name, {}).get("dtype")
        if recorded == "fp32" and self.quantised:
            raise CheckpointError(f"{file} has quantised operators, but {file.parent / 'export.json'} records it as "
                                  "the fp32 graph: it is not the file that was exported")
        self.dtype = dtype or ("int8" if self.quantised else "fp32")
        if self.dtype not in RUNTIME_ATOL:
            raise InputError(f"dtype {self.dtype!r}: a runtime is judged as fp32 or int8")
        opener = {"onnxruntime": _ort, "openvino": _openvino, "ctranslate2": _ct2}[kind]
        try:
            self._run = opener(file, self.dtype, threads)
        except (InputError, MissingExtra):
            raise
        except Exception as e:  # the runtime could not read it: a damaged or foreign file, said in one line
            raise CheckpointError(f"{file}: {kind} cannot load it ({_first_line(e)})") from None
        if kind == "openvino" and file.suffix == ".xml" and _fp16_weights(file):
            self.name += " (weights stored in fp16: ov.save_model's default; save with compress_to_fp16=False)"

    def run(self, batch: dict) -> dict[str, np.ndarray]:
        try:
            return self._run(batch)
        except (InputError, MissingExtra):
            raise
        except Exception as e:  # a graph that loads but cannot run minibert's inputs
            raise CheckpointError(f"{self.file}: {self.runtime} failed on a batch of shape "
                                  f"{tuple(batch['input_ids'].shape)} ({_first_line(e)})") from None


def _first_line(error: Exception) -> str:
    text = " ".join(str(error).split())
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _onnx_quantised(file: Path) -> bool:
    try:
        import onnx
    except ImportError:
        raise MissingExtra(f"reading an ONNX graph needs the onnx package: {ONNX_EXTRA}") from None
    try:
        model = onnx.load(str(file), load_external_data=False)
    except Exception as e:  # truncated, not protobuf, empty
        raise CheckpointError(f"{file}: not a readable ONNX graph ({file.stat().st_size:,} bytes; "
                              f"{_first_line(e)})") from None
    if not model.graph.node:
        raise CheckpointError(f"{file}: an ONNX file with no graph in it ({file.stat().st_size:,} bytes)")
    return any(node.op_type in QUANTISED_OPS for node in model.graph.node)


def _feed(batch: dict, names) -> dict:
    missing = [n for n in names if n not in batch]
    if missing:
        raise InputError(f"the graph takes inputs {list(names)}; minibert's batches have {list(batch)} "
                         f"(missing {missing})")
    return {n: batch[n].numpy().astype(np.int64) for n in names}


def check_ports(file: Path, ports) -> None:
    """A graph minibert can feed: int64 token inputs of any batch size and length. ``ports``: (name, type,
    shape) of each input, as the runtime reports them (a dimension is an int when fixed)."""
    for name, kind, shape in ports:
        if name not in INPUT_NAMES:
            raise CheckpointError(f"{file}: input {name!r} is not a BERT input (expected {', '.join(INPUT_NAMES)})")
        if "int64" not in str(kind):
            raise CheckpointError(f"{file}: input {name} is {kind}, not int64: minibert's exports and parity feed "
                                  "int64 token ids (export again with minibert export onnx)")
        fixed = [f"{axis} = {dim}" for axis, dim in zip(("batch", "length"), shape) if isinstance(dim, int)]
        if fixed:
            raise CheckpointError(f"{file}: input {name} has a fixed {', '.join(fixed)}; a check runs inputs of every "
                                  "batch size and length (export again with dynamic axes: minibert export onnx)")


def _ort(file: Path, dtype: str, threads):
    session = ort_session(file, threads)
    check_ports(file, [(i.name, i.type, i.shape) for i in session.get_inputs()])
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
    model = core.read_model(str(file))
    check_ports(file, [(_port_name(i, INPUT_NAMES), str(i.get_element_type()),
                        [d.get_length() if d.is_static else None for d in i.get_partial_shape()])
                       for i in model.inputs])
    compiled = core.compile_model(model, "CPU", config)
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


def ort_session(path, threads: int | None = None):
    try:
        import onnxruntime as ort
    except ImportError:
        raise MissingExtra(f"running an ONNX graph needs ONNX Runtime: {ONNX_EXTRA}") from None
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    options.log_severity_level = 3  # its warnings about unused initialisers are not the user's business
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
