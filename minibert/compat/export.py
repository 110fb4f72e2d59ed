"""Export any model minibert makes to the forms teams deploy: an ONNX graph (``to_onnx``) and a CTranslate2
folder (``to_ct2``). ``minibert export onnx|ct2`` is this module on the command line.

    from minibert.export import to_onnx
    result = to_onnx("weights/all-MiniLM-L6-v2", "deploy/minilm", hidden_states=True)
    result.checks["model.onnx"]["largest_difference"]          # ~1e-6: the graph against the model

What is exported is the readable model's own forward pass, traced by PyTorch's TorchScript exporter
(``torch.onnx.export(..., dynamo=False)``), in fp32, with dynamic batch and length:

* inputs ``input_ids``, ``attention_mask``, ``token_type_ids`` (B, T) int64;
* outputs by kind of model: an encoder ``last_hidden_state`` (B, T, H) and ``pooler_output`` (B, H) when it
  has a pooler; a sentence-transformers folder ``token_embeddings`` and ``sentence_embedding`` (its pooling
  and normalisation inside the graph); a task head its own outputs (``logits``; ``start_logits`` and
  ``end_logits``); with ``hidden_states`` also ``hidden_state_0`` (the embeddings) ... ``hidden_state_L``,
  which ``minibert parity --against`` reads to say at which layer a runtime parts from the reference.

The folder gets ``model.onnx``, the tokenizer files, ``config.json`` and ``export.json`` (what was
exported, from what, and how far each written graph is from the model). Every graph written is run at once
by ONNX Runtime on minibert's varied parity inputs (padding, pairs, long and short texts) and its largest
difference from the model printed. ``optimize`` adds ORT's transformer optimiser's graph
(``model_optimized.onnx``, the fusions it made listed); ``int8`` ORT's dynamic int8 quantisation
(``model_int8.onnx``), judged by the cosine of its sentence vectors to the fp32 model's.

The folder is written under the output-folder rule (``outputs.RunFolder``): never a folder the model is
read from, never over another run or a user's files unless ``overwrite``.

Traps met on the way, handled here: the exporter restores the train/eval mode of the module it traces --
of the wrapper, recursively -- so a wrapper in training mode would leave the model with dropout on
(the wrapper is put in eval mode, the model's own mode restored); the trace must see a padded batch, or
the mask (dropped when it masks nothing) is not in the graph; ORT's int8 quantiser cannot type the fused
operators' outputs without ``DefaultTensorType``; CTranslate2's converter reads ``position_embedding_type``,
which transformers 5 no longer writes (``to_ct2`` writes it into a copy of the config).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..checks import check_parts
from ..errors import CheckpointError, InputError, MissingExtra

#: parts (``minibert.parts``) a folder may hold that the graph of its checkpoint alone would not have
PARTS = {"adapter": "a task module: adapters, prefixes or LoRA, trained on a base",
         "scalarmix_head": "a ScalarMix classifier's mix and head", "early_exits": "early-exit ramps"}
#: the graph's inputs, in this order
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
#: the ONNX operator set: 17 has LayerNormalization, which every runtime here reads
OPSET = 17
#: what ``to_onnx`` writes besides the graphs
RECORD = "export.json"
ONNX_EXTRA = "pip install -e \".[onnx]\" in the minibert checkout (or pip install onnx onnxruntime)"
CT2_EXTRA = "pip install -e \".[ct2]\" in the minibert checkout (or pip install ctranslate2 transformers)"


@dataclasses.dataclass
class ExportResult:
    folder: Path
    outputs: list[str]  # the graph's output names, in order
    checks: dict[str, dict]  # file name -> {"largest_difference": ..., "cosine_min": ..., ...}
    fusions: dict[str, int] = dataclasses.field(default_factory=dict)  # ORT's optimiser, with optimize

    def summary(self) -> str:
        lines = [f"wrote {self.folder} (outputs: {', '.join(self.outputs)})"]
        for name, check in self.checks.items():
            cosine = check.get("cosine_min")
            lines.append(f"  {name}: largest difference from the model {check['largest_difference']:.2e}"
                         + (f", sentence-vector cosine min {cosine:.4f}" if cosine is not None else ""))
        if self.fusions:
            lines.append("  ORT optimiser fused: " + ", ".join(f"{k} {v}" for k, v in self.fusions.items()))
        return "\n".join(lines)


# ------------------------------------------------------------------------------------- what to export
def load_for_export(source):
    """The model a path holds, as minibert loads it: a sentence-transformers folder (``modules.json``) as a
    ``SentenceEncoder``, a fine-tuned task checkpoint (config ``architectures``) as its head, any other
    checkpoint as the encoder (its masked-LM head left out). Returns (model, tokenizer source)."""
    from ..config import read_json_object
    from ..loading import resolve_source
    from ..models import BertModel
    from ..models.heads import TASK_CLASSES
    from ..parts import has_part
    from .sentence import SentenceEncoder, is_sentence_folder

    path = resolve_source(source)
    folder = path if path.is_dir() else path.parent
    extra = [name for name in PARTS if has_part(folder, name)]
    if extra:  # what a checkpoint path alone would leave out of the graph, silently
        raise InputError(f"{source} holds {', '.join(extra)} beside (or instead of) a checkpoint ({PARTS[extra[0]]}): "
                         "load the model in Python as its command does and pass the object to "
                         "minibert.export.to_onnx(model, out, tokenizer=...)")
    if is_sentence_folder(folder):
        return SentenceEncoder.from_pretrained(folder), str(folder)
    config = read_json_object(folder / "config.json") if (folder / "config.json").exists() else {}
    kind = next((a for a in config.get("architectures") or [] if a in TASK_CLASSES), None)
    if kind is not None:
        return TASK_CLASSES[kind].from_pretrained(folder).eval(), str(folder)
    return BertModel.from_pretrained(source, mlm_head=False).eval(), str(folder)


def encoder_config(model):
    """The BertConfig of the encoder inside ``model`` (an encoder, a task head, a SentenceEncoder)."""
    inner = getattr(model, "model", model)  # SentenceEncoder.model
    return getattr(getattr(inner, "bert", inner), "config")


def _module(model) -> nn.Module:
    return model.model if not isinstance(model, nn.Module) and hasattr(model, "model") else model


def check_exportable(model) -> None:
    """Refuse, before anything is written, what the graph could not hold: an int8 model (its products are
    torch's quantised operators: export fp32 and pass ``int8``), a model not in fp32, one not on the CPU."""
    module = _module(model)
    if not isinstance(module, nn.Module):
        raise InputError(f"to_onnx takes a minibert model or a checkpoint path, got {type(model).__name__}")
    check_parts(module, "export")
    parameter = next(module.parameters(), None)
    if parameter is not None and parameter.dtype != torch.float32:
        raise InputError(f"this model is {str(parameter.dtype).replace('torch.', '')}: the ONNX export is fp32 (load "
                         "it without dtype=; --int8 quantises the exported graph)")
    if parameter is not None and parameter.device.type != "cpu":
        raise InputError(f"this model is on {parameter.device}: export runs on the CPU (model.to('cpu') first)")


class ExportGraph(nn.Module):
    """What the ONNX graph computes: ``model`` on (input_ids, attention_mask, token_type_ids), its outputs
    as a flat tuple in ``names`` order (see the module docstring)."""

    def __init__(self, model, hidden_states: bool = False):
        super().__init__()
        self.sentence = None if isinstance(model, nn.Module) else model  # a SentenceEncoder keeps its settings
        self.inner = _module(model)
        self.hidden_states = hidden_states
        self.names: list[str] = []

    def forward(self, input_ids, attention_mask, token_type_ids):
        out = self.inner(input_ids, attention_mask, token_type_ids, output_hidden_states=self.hidden_states)
        named = []
        if self.sentence is not None:
            from ..tools.pooling import pool

            vectors = torch.cat([pool(out.last_hidden_state, attention_mask, m) for m in self.sentence.pooling],
                                -1)  # (B, H x modes), as sentence-transformers concatenates them
            if self.sentence.normalize:
                vectors = nn.functional.normalize(vectors, dim=-1)
            named += [("token_embeddings", out.last_hidden_state), ("sentence_embedding", vectors)]
        else:  # the output's tensors by name: a dataclass (ours), or a mapping (transformers' ModelOutput)
            items = out.items() if hasattr(out, "items") else ((f.name, getattr(out, f.name))
                                                              for f in dataclasses.fields(out))
            named += [(name, value) for name, value in items
                      if name not in ("loss", "hidden_states", "attentions") and isinstance(value, torch.Tensor)]
        if self.hidden_states:
            named += [(f"hidden_state_{i}", h) for i, h in enumerate(out.hidden_states)]
        self.names = [n for n, _ in named]
        return tuple(v for _, v in named)


# ------------------------------------------------------------------------------------------- checking
def check_batches(tokenizer, config) -> list[dict]:
    """minibert's parity inputs (varied lengths, padding, pairs), truncated to what the model takes."""
    from ..analysis.parity import make_batches

    limit = min(config.max_position_embeddings, getattr(tokenizer, "model_max_length", 512) or 512)
    return make_batches(tokenizer, max_length=limit)


def reference_outputs(graph: ExportGraph, batch: dict) -> dict[str, np.ndarray]:
    with torch.inference_mode():
        values = graph(*(batch[n] for n in INPUTS))
    return {n: v.float().numpy() for n, v in zip(graph.names, values)}


def real_differences(name: str, got, want: np.ndarray, mask: np.ndarray, where: str = "the runtime") -> np.ndarray:
    """The absolute differences of one output, in float64: at real tokens only for a per-token (B, T, ...) output."""
    got = np.asarray(got, dtype=np.float64)
    if got.shape != want.shape:
        raise CheckpointError(f"{where}: output {name} has shape {got.shape}, the reference {want.shape}")
    diff = np.abs(got - want.astype(np.float64))
    return diff[mask.astype(bool)] if diff.ndim >= 2 and diff.shape[:2] == mask.shape else diff


def difference(name: str, got: np.ndarray, want: np.ndarray, mask: np.ndarray) -> float:
    """The largest absolute difference, over real tokens for a per-token output."""
    diff = real_differences(name, got, want, mask)
    return float(diff.max()) if diff.size else 0.0


def sentence_cosines(got: np.ndarray, want: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Cosine of mean-pooled (B, T, H) states over real tokens (or of (B, H) vectors), per row."""
    if got.ndim == 3:
        w = mask.astype(np.float64)[..., None]
        got, want = (got * w).sum(1) / w.sum(1), (want * w).sum(1) / w.sum(1)
    got, want = got.astype(np.float64), want.astype(np.float64)
    return (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))


def check_graph(path: Path, graph: ExportGraph, batches: list[dict], references: list[dict] | None = None) -> dict:
    """Run the written graph with ONNX Runtime on ``batches`` against the model: the largest difference over
    every output, per output, and the lowest cosine of the sentence vectors. ``references``: the model's
    outputs on the batches (``reference_outputs``), when already computed for another graph."""
    session = ort_session(path)
    worst: dict[str, float] = {}
    cosines = []
    references = references or [reference_outputs(graph, batch) for batch in batches]
    for batch, want in zip(batches, references):
        got = dict(zip([o.name for o in session.get_outputs()],
                       session.run(None, {n: batch[n].numpy() for n in INPUTS})))
        mask = batch["attention_mask"].numpy()
        for name, value in want.items():
            worst[name] = max(worst.get(name, 0.0), difference(name, got[name], value, mask))
        vector = "sentence_embedding" if "sentence_embedding" in want else graph.names[0]
        if want[vector].ndim in (2, 3) and want[vector].shape[0] == mask.shape[0]:
            cosines.append(sentence_cosines(got[vector], want[vector], mask))
    return {"largest_difference": max(worst.values()), "per_output": worst,
            "cosine_min": float(np.concatenate(cosines).min()) if cosines else None}


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


# -------------------------------------------------------------------------------------------- writing
def _trace(graph: ExportGraph, batch: dict, path: Path, opset: int) -> None:
    module = graph.inner
    training = module.training
    graph.eval()  # the exporter restores the wrapper's mode recursively afterwards: it must be eval
    example = tuple(batch[n] for n in INPUTS)
    shorter = tuple(batch[n][:, :-1] for n in INPUTS)
    with torch.inference_mode():
        shorter_values, values = graph(*shorter), graph(*example)  # graph.names: the last call's
    axes = {n: {0: "batch", 1: "length"} for n in INPUTS}
    for name, a, b in zip(graph.names, values, shorter_values):  # an axis that follows T is "length"
        axes[name] = {0: "batch", 1: "length"} if a.dim() > 1 and a.shape[1] != b.shape[1] else {0: "batch"}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tracer's notes on Python values (the input checks' constants)
            torch.onnx.export(graph, example, str(path), input_names=list(INPUTS), output_names=list(graph.names),
                              dynamic_axes=axes, opset_version=opset, dynamo=False)
    except ImportError as e:
        raise MissingExtra(f"the ONNX export needs the onnx package ({e.name} is missing): {ONNX_EXTRA}") from None
    finally:
        module.train(training)


def _tracing_batch(batches: list[dict]) -> dict:
    """A batch with padding in it (the trace keeps the mask only if it masks something)."""
    for batch in batches:
        if batch["input_ids"].shape[0] > 1 and not bool(batch["attention_mask"].all()):
            return batch
    raise InputError("the parity inputs made no padded batch to trace with (every text as long as the others)")


def _tokenizer_of(model, source, tokenizer):
    from ..tokenizer import BertTokenizer

    if tokenizer is not None:
        return tokenizer, source
    source = source or getattr(model, "source", None) or getattr(_module(model), "source", None)
    if source is None:
        raise InputError("no tokenizer: pass tokenizer= (or a checkpoint path as the model)")
    return BertTokenizer.from_pretrained(source), source


def to_onnx(model, out, *, hidden_states: bool = False, optimize: bool = False, int8: bool = False,
            opset: int = OPSET, tokenizer=None, overwrite: bool = False, say=print) -> ExportResult:
    """Export ``model`` (a minibert model object, or a path / hub id: see ``load_for_export``) to
    ``out/model.onnx`` with its tokenizer files, each graph checked against the model (module docstring).
    ``say``: where the summary goes (None: nowhere)."""
    from ..loading import copy_tokenizer
    from ..outputs import RunFolder

    _check_installed(optimize, int8)  # before anything is loaded or written
    source = None
    if isinstance(model, (str, Path)):
        source = str(model)
        model, _ = load_for_export(source)
    check_exportable(model)
    tokenizer, source = _tokenizer_of(model, source, tokenizer)
    if opset < 14:
        raise InputError(f"opset {opset}: the export needs opset 14 or later (17 has LayerNormalization)")
    config = encoder_config(model)
    folder = RunFolder(out, command="export", reads={"--model": source} if source else {}, overwrite=overwrite,
                       resumable=False)
    graph = ExportGraph(model, hidden_states=hidden_states)
    batches = check_batches(tokenizer, config)
    settings = {"format": "onnx", "model": source, "hidden_states": hidden_states, "optimize": optimize,
                "int8": int8, "opset": opset}
    with folder.claim(settings):
        path = folder.path / "model.onnx"
        _trace(graph, _tracing_batch(batches), path, opset)
        references = [reference_outputs(graph, batch) for batch in batches]  # the model's, once for every graph
        checks = {path.name: check_graph(path, graph, batches, references)}
        fusions = {}
        if optimize:
            path, fusions = optimize_graph(path, config)
            checks[path.name] = check_graph(path, graph, batches, references)
        if int8:
            quantised = quantize_graph(path)
            checks[quantised.name] = check_graph(quantised, graph, batches, references)
        if source is not None:
            copy_tokenizer(source, folder.path)
        config.to_json_file(folder.path / "config.json")
        result = ExportResult(folder.path, list(graph.names), checks, fusions)
        record = {**settings, "inputs": list(INPUTS), "outputs": result.outputs, "checks": checks,
                  "fusions": fusions, "torch": torch.__version__}
        (folder.path / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    if say:
        say(result.summary())
    return result


def _check_installed(optimize: bool, int8: bool) -> None:
    import importlib.util

    needed = ["onnx", "onnxruntime"]  # the exporter writes with onnx; every graph is checked with ONNX Runtime
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        what = " and ".join(missing)
        uses = "--optimize and --int8 use ONNX Runtime's tools; " if optimize or int8 else ""
        raise MissingExtra(f"exporting to ONNX needs {what} (the graph is checked by ONNX Runtime as it is written; "
                           f"{uses}{ONNX_EXTRA})")


def optimize_graph(path: Path, config) -> tuple[Path, dict]:
    """ORT's transformer optimiser on ``path`` (BERT's fusions: LayerNorm, SkipLayerNorm, BiasGelu,
    attention where its pattern matches): ``model_optimized.onnx`` beside it, and the fusions made."""
    try:
        from onnxruntime.transformers import optimizer
    except ImportError:
        raise MissingExtra(f"--optimize runs ONNX Runtime's transformer optimiser: {ONNX_EXTRA}") from None
    graph = optimizer.optimize_model(str(path), model_type="bert", num_heads=config.num_attention_heads,
                                     hidden_size=config.hidden_size)
    optimised = path.with_name("model_optimized.onnx")
    graph.save_model_to_file(str(optimised))
    return optimised, {k: v for k, v in graph.get_fused_operator_statistics().items() if v}


def quantize_graph(path: Path) -> Path:
    """ORT's dynamic int8 quantisation of ``path`` (int8 weights, per-tensor activations quantised on each
    call): ``model_int8.onnx`` beside it."""
    try:
        import onnx
        from onnxruntime.quantization import QuantType, quantize_dynamic
    except ImportError:
        raise MissingExtra(f"--int8 runs ONNX Runtime's quantiser: {ONNX_EXTRA}") from None
    quantised = path.parent / "model_int8.onnx"
    with warnings.catch_warnings(), _quiet_root_logger():
        warnings.simplefilter("ignore")  # its advice to run pre-processing first (a root-logger warning, too)
        # ORT's fused operators carry no output type for the quantiser's shape inference: they are fp32
        quantize_dynamic(str(path), str(quantised), weight_type=QuantType.QInt8,
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    return quantised


@contextlib.contextmanager
def _quiet_root_logger():
    """ORT's quantiser logs advice through the root logger; the export says what matters itself."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


@contextlib.contextmanager
def _quiet_transformers():
    """CTranslate2's converter loads the checkpoint through transformers: its progress bar and notices off."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.logging.enable_progress_bar()


# -------------------------------------------------------------------------------------- CTranslate2
def to_ct2(source, out, *, quantization: str | None = None, overwrite: bool = False, say=print) -> Path:
    """Convert a BERT checkpoint with CTranslate2's converter into ``out`` (``model.bin``, its config and
    vocabulary), fixing what the converter cannot read (module docstring) in a copy of the checkpoint;
    ``quantization``: None (fp32 weights) or one of CTranslate2's ("int8", "int8_float32", ...)."""
    from ..loading import read_config, resolve_source
    from ..outputs import RunFolder

    try:
        import ctranslate2
        import transformers  # noqa: F401 -- CTranslate2's converter loads the checkpoint with it
    except ImportError as e:
        raise MissingExtra(f"converting to CTranslate2 needs {e.name}: {CT2_EXTRA}") from None
    path = resolve_source(source)
    folder_in = path if path.is_dir() else path.parent
    config = read_config(source)
    if config.norm_placement != "post":
        raise InputError(f"{source} is a {config.norm_placement} model: CTranslate2's BERT is post-LN only (it loads "
                         "checkpoints through transformers, whose BertModel is post-LN)")
    folder = RunFolder(out, command="export", reads={"--model": str(source)}, overwrite=overwrite, resumable=False)
    with folder.claim({"format": "ct2", "model": str(source), "quantization": quantization}), \
            tempfile.TemporaryDirectory() as work:
        copy = Path(work) / "checkpoint"
        shutil.copytree(folder_in, copy, ignore=shutil.ignore_patterns(".minibert-*", "*.onnx"))
        data = json.loads((copy / "config.json").read_text())
        data.setdefault("position_embedding_type", "absolute")  # read by the converter; gone from transformers 5
        data["architectures"] = ["BertModel"]
        (copy / "config.json").write_text(json.dumps(data, indent=2))
        converted = Path(work) / "ct2"
        try:
            with _quiet_transformers():
                ctranslate2.converters.TransformersConverter(str(copy)).convert(str(converted),
                                                                                quantization=quantization)
        except Exception as e:  # the converter's own failure, said in one line rather than its traceback
            raise CheckpointError(f"CTranslate2's converter (ctranslate2 {ctranslate2.__version__}) could not convert "
                                  f"{source}: {type(e).__name__}: {e}") from None
        for item in converted.iterdir():
            shutil.move(str(item), folder.path / item.name)
    if say:
        say(f"wrote {folder.path} (CTranslate2, {quantization or 'fp32 weights'})")
    return folder.path
