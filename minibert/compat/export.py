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
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..checks import check_parts
from ..errors import CheckpointError, InputError, MissingExtra
from ..loading import TOKENIZER_FILES
from ..textfiles import write_text_atomic
from .deployed import CT2_EXTRA, ONNX_EXTRA, RECORD, RUNTIME_ATOL, RuntimeModel, ort_session

#: parts (``minibert.parts``) a folder may hold that the graph of its checkpoint alone would not have
PARTS = {"adapter": "a task module: adapters, prefixes or LoRA, trained on a base",
         "scalarmix_head": "a ScalarMix classifier's mix and head", "early_exits": "early-exit ramps"}
#: the graph's inputs, in this order
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
#: the ONNX operator set: 17 has LayerNormalization, which every runtime here reads
OPSET = 17


@dataclasses.dataclass
class ExportResult:
    folder: Path
    outputs: list[str]  # the graph's output names, in order
    checks: dict[str, dict]  # file name -> {"largest_difference": ..., "cosine_min": ..., ...}
    fusions: dict[str, int] = dataclasses.field(default_factory=dict)  # ORT's optimiser, with optimize

    def summary(self) -> str:
        lines = [f"wrote {self.folder} (outputs: {', '.join(self.outputs)})"]
        for name, check in self.checks.items():
            cosine, agreement = check.get("cosine_min"), check.get("argmax_agreement")
            lines.append(f"  {name}: largest difference from the model {check['largest_difference']:.2e}"
                         + (f", sentence-vector cosine min {cosine:.4f}" if cosine is not None else "")
                         + (f", head's argmax agreement {agreement:.4f}" if agreement is not None else "")
                         + (f"; minibert parity: {check['parity'].upper()}" if "parity" in check else "")
                         + (f" ({'; '.join(check['reasons'])})" if check.get("reasons") else ""))
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
    # the file named is the file read: a .safetensors file inside a folder loads that file, the folder's other
    # files (config, tokenizer, modules.json) beside it
    if is_sentence_folder(folder):
        return SentenceEncoder.from_pretrained(path), str(folder)
    config = read_json_object(folder / "config.json") if (folder / "config.json").exists() else {}
    kind = next((a for a in config.get("architectures") or [] if a in TASK_CLASSES), None)
    if kind is not None:
        return TASK_CLASSES[kind].from_pretrained(path).eval(), str(folder)
    return BertModel.from_pretrained(path, mlm_head=False).eval(), str(folder)


def read_fingerprints(source) -> dict[str, str]:
    """{file: sha256} of what loading ``source`` reads: its config.json and weight files (the named file,
    not its folder's ``model.safetensors``). {} for a model object or a source without a local checkpoint."""
    from ..loading import find_checkpoint, resolve_source
    from ..textfiles import file_sha256

    if not isinstance(source, (str, Path)):
        return {}
    path = resolve_source(source)
    try:
        config, weights = find_checkpoint(path)
    except CheckpointError:  # a sentence-transformers folder whose BERT sits in a sub-folder
        from .sentence import is_sentence_folder

        if not (path.is_dir() and is_sentence_folder(path)):
            raise
        return {}
    return {str(f): file_sha256(f) for f in [config, *weights]}


def model_fingerprint(model) -> str:
    """sha256 of the weights a model object holds (``tools.fingerprint``): the same for the same values,
    however they were saved."""
    from ..tools.fingerprint import weights_fingerprint

    return weights_fingerprint(_module(model))


def head_of(model) -> str | None:
    """The task head's class name (``BertForSequenceClassification``, ...) or None for an encoder."""
    from ..models.heads import TASK_CLASSES

    module = _module(model)
    return type(module).__name__ if type(module).__name__ in TASK_CLASSES else None


def describe_model(model) -> dict:
    """What a deployed form must have to be this model: its geometry, its head and labels, its pooler."""
    from ..analysis.parity import geometry

    config = encoder_config(model)
    encoder = getattr(_module(model), "bert", _module(model))
    head = head_of(model)
    return {**geometry(config), "head": head, "num_labels": getattr(config, "num_labels", None) if head else None,
            "pooler": getattr(encoder, "pooler", None) is not None}


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
    """minibert's parity inputs (varied lengths, padding, pairs), reaching the model's last position."""
    from ..analysis.parity import make_batches

    return make_batches(tokenizer, max_length=config.max_position_embeddings)


#: the outputs that hold a task head's decisions, judged in int8 by argmax agreement
HEAD_OUTPUTS = ("logits", "start_logits", "end_logits")
#: where the sentence vector is read from, in order of preference
VECTOR_OUTPUTS = ("sentence_embedding", "last_hidden_state", "token_embeddings")


def argmax_agreement(name: str, got, want: np.ndarray, mask: np.ndarray) -> tuple[int, int]:
    """(decisions that agree, decisions) of a head's output: a label per input ((B, labels) logits), per real
    token ((B, T, labels): a tagger), or a position per input ((B, T) start / end logits, over real tokens)."""
    got, want, real = np.asarray(got, dtype=np.float64), want.astype(np.float64), mask.astype(bool)
    if got.shape != want.shape:
        raise CheckpointError(f"output {name} has shape {got.shape}, the reference {want.shape}: another head")
    if want.ndim == 3:  # (B, T, labels): a label per real token
        same = got.argmax(-1) == want.argmax(-1)
        return int(same[real].sum()), int(real.sum())
    if want.ndim == 2 and want.shape == real.shape and name != "logits":  # (B, T): a position per input
        got, want = np.where(real, got, -np.inf), np.where(real, want, -np.inf)
    same = got.argmax(-1) == want.argmax(-1)
    return int(same.sum()), int(same.size)


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
    names = [o.name for o in session.get_outputs()]
    return check_outputs(lambda batch: dict(zip(names, session.run(None, {n: batch[n].numpy() for n in INPUTS}))),
                         graph, batches, references)


def check_outputs(run, graph: ExportGraph, batches: list[dict], references: list[dict] | None = None,
                  compared=None) -> dict:
    """A deployed form's outputs (``run(batch) -> {name: array}``) against the model's on ``batches``: the
    largest difference per output (``compared``: the output names to compare; default every output of the
    graph), the lowest cosine of the sentence vectors (``VECTOR_OUTPUTS``), a head's argmax agreement."""
    worst: dict[str, float] = {}
    cosines, agree, decisions = [], 0, 0
    references = references or [reference_outputs(graph, batch) for batch in batches]
    for batch, want in zip(batches, references):
        got = run(batch)
        mask = batch["attention_mask"].numpy()
        for name, value in want.items():
            if compared is not None and name not in compared:
                continue
            worst[name] = max(worst.get(name, 0.0), difference(name, got[name], value, mask))
            if name in HEAD_OUTPUTS:
                a, n = argmax_agreement(name, got[name], value, mask)
                agree, decisions = agree + a, decisions + n
        vector = next((n for n in VECTOR_OUTPUTS if n in want and n in got), None)
        if vector is not None:
            cosines.append(sentence_cosines(np.asarray(got[vector]), want[vector], mask))
    return {"largest_difference": max(worst.values()), "per_output": worst,
            "cosine_min": float(np.concatenate(cosines).min()) if cosines else None,
            "argmax_agreement": agree / decisions if decisions else None}


def judge(check: dict, dtype: str) -> list[str]:
    """What ``minibert parity --against`` would fail a written form for, by its own bounds ([]: it passes):
    fp32 every output within ``RUNTIME_ATOL["fp32"]``; int8 the sentence-vector cosine and a head's argmax
    agreement."""
    from ..analysis.parity import MIN_AGREEMENT, MIN_COSINE

    out = []
    if dtype == "fp32" and not check["largest_difference"] <= RUNTIME_ATOL["fp32"]:
        out.append(f"largest difference {check['largest_difference']:.2e} > {RUNTIME_ATOL['fp32']:g}")
    if dtype == "int8":
        cosine, agreement = check.get("cosine_min"), check.get("argmax_agreement")
        if cosine is not None and not cosine >= MIN_COSINE["int8"]:
            out.append(f"sentence-vector cosine min {cosine:.4f} < {MIN_COSINE['int8']:g}")
        if agreement is not None and not agreement >= MIN_AGREEMENT["int8"]:
            out.append(f"head's argmax agreement {agreement:.4f} < {MIN_AGREEMENT['int8']:g}")
    return out


def finish_check(check: dict, name: str, dtype: str, warn) -> dict:
    """A written form's check with its dtype and verdict. An fp32 form that is not the model is an error (the
    export is wrong: nothing to deploy); an int8 form that parity would fail is said (``warn``) and recorded."""
    failed = judge(check, dtype)
    check.update(dtype=dtype, parity="fail" if failed else "pass", reasons=failed)
    if failed and dtype == "fp32":
        raise CheckpointError(f"{name} does not compute what the model computes ({'; '.join(failed)}): not exported")
    if failed and warn:
        warnings.warn(f"{name} ({dtype}) would FAIL minibert parity --against: {'; '.join(failed)}", stacklevel=3)
    return check


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
    check_opset(opset)
    source = None
    if isinstance(model, (str, Path)):
        source = str(model)
        model, _ = load_for_export(source)
    check_exportable(model)
    tokenizer, tokenizer_source = _tokenizer_of(model, source, tokenizer)
    config = encoder_config(model)
    reads = {"--model": source} if source else {}
    folder = RunFolder(out, command="export", reads=reads, overwrite=overwrite, resumable=False)
    graph = ExportGraph(model, hidden_states=hidden_states)
    batches = check_batches(tokenizer, config)
    settings = {"format": "onnx", "model": source, "hidden_states": hidden_states, "optimize": optimize,
                "int8": int8, "opset": opset}
    head = head_of(model)
    with folder.claim(settings):
        # every name this export may write, declared before it is written: a process killed mid-write leaves
        # files its run record accounts for, which --overwrite then replaces
        folder.will_write("model.onnx", "model_optimized.onnx", "model_int8.onnx", "config.json", RECORD, WORK,
                          *TOKENIZER_FILES)
        with _work_under(folder.path) as work:
            path = folder.path / "model.onnx"
            _trace(graph, _tracing_batch(batches), path, opset)
            references = [reference_outputs(graph, batch) for batch in batches]  # the model's, once for every graph
            checks = {path.name: finish_check(check_graph(path, graph, batches, references), path.name, "fp32", say)}
            fusions = {}
            if optimize:
                path, fusions = optimize_graph(path, config)
                checks[path.name] = finish_check(check_graph(path, graph, batches, references), path.name, "fp32",
                                                 say)
            if int8:
                quantised = quantize_graph(path, work)
                checks[quantised.name] = finish_check(check_graph(quantised, graph, batches, references),
                                                      quantised.name, "int8", say)
        if tokenizer_source is not None:
            copy_tokenizer(tokenizer_source, folder.path)
        config.to_json_file(folder.path / "config.json", architectures=(head or "BertModel",))
        result = ExportResult(folder.path, list(graph.names), checks, fusions)
        record = {**settings, "inputs": list(INPUTS), "outputs": result.outputs, "checks": checks,
                  "fusions": fusions, **provenance(model, source, folder.path, checks), "torch": torch.__version__}
        write_text_atomic(folder.path / RECORD, json.dumps(record, indent=2) + "\n")
    if say:
        say(result.summary())
    return result


#: a folder inside ``--out`` where an export's helpers write their temporary files (ORT's quantiser,
#: CTranslate2's converter): a killed export leaves them there, declared, never in the system's temp folder
WORK = ".minibert-work"


@contextlib.contextmanager
def _work_under(folder: Path):
    """``folder/WORK``, made the temporary folder of this process (``tempfile.tempdir``) while inside: what a
    converter or quantiser writes for itself lands in ``--out`` and is removed with it at the end."""
    work = folder / WORK
    work.mkdir(exist_ok=True)
    before = tempfile.tempdir
    tempfile.tempdir = str(work)
    try:
        yield work
    finally:
        tempfile.tempdir = before
        shutil.rmtree(work, ignore_errors=True)


def provenance(model, source, folder: Path, checks: dict) -> dict:
    """What an export records of where it came from and what it wrote: the model's geometry and head, the
    sha256 of every file read (``read_fingerprints``: the named file, not its folder's), of the weights as
    loaded, and of each written form (``minibert parity`` reports them)."""
    from ..textfiles import file_sha256

    written = {name: file_sha256(folder / name) for name in checks if (folder / name).is_file()}
    return {"model_described": describe_model(model), "read": read_fingerprints(source) if source else {},
            "weights_sha256": model_fingerprint(model), "written": written}


def check_opset(opset: int) -> None:
    """The opsets torch's TorchScript exporter writes, from 14 (BERT's operators) to its most."""
    from torch.onnx import _constants

    most = getattr(_constants, "ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET", _constants.ONNX_MAX_OPSET)
    if not 14 <= opset <= most:
        raise InputError(f"opset {opset}: the export writes opsets 14 (BERT's operators) to {most} (torch "
                         f"{torch.__version__}'s exporter; 17 has LayerNormalization)")


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


def quantize_graph(path: Path, work: Path | None = None) -> Path:
    """ORT's dynamic int8 quantisation of ``path`` (int8 weights, per-tensor activations quantised on each
    call): ``model_int8.onnx`` beside it."""
    try:
        import onnx
        from onnxruntime.quantization import QuantType, quantize_dynamic
    except ImportError:
        raise MissingExtra(f"--int8 runs ONNX Runtime's quantiser: {ONNX_EXTRA}") from None
    quantised = path.parent / "model_int8.onnx"
    if work is None:  # a call of its own (not to_onnx's): its temporary files beside the graph, removed after
        with _work_under(path.parent) as work:
            return quantize_graph(path, work)
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
    vocabulary, the tokenizer files, ``export.json``), checked against the model as ``to_onnx``'s graphs are;
    ``quantization``: None (fp32 weights) or one of CTranslate2's ("int8", "int8_float32", ...).

    What is converted is exactly what minibert loads from ``source`` (the file named, strictly: a config that
    does not fit its weights is refused rather than left to the converter's random initialisation). A model
    without a pooler is converted with a zero pooler (CTranslate2's BERT always computes one: its
    ``pooler_output`` is then zeros, never random, and export.json says so). A task head, a ScalarMix head,
    task modules or early exits are refused: CTranslate2's Encoder carries the encoder only."""
    from ..loading import copy_tokenizer
    from ..outputs import RunFolder

    try:
        import ctranslate2
        import transformers  # noqa: F401 -- CTranslate2's converter loads the checkpoint with it
    except ImportError as e:
        raise MissingExtra(f"converting to CTranslate2 needs {e.name}: {CT2_EXTRA}") from None
    if quantization is not None and not str(quantization).startswith("int8"):
        raise InputError(f"quantization={quantization!r}: the export is checked against the model as fp32 (None) or "
                         "int8 (\"int8\", \"int8_float32\", ...), the forms minibert parity judges")
    model, encoder, tokenizer_source = _ct2_encoder(source)
    config = encoder_config(model)
    folder = RunFolder(out, command="export", reads={"--model": str(source)}, overwrite=overwrite, resumable=False)
    settings = {"format": "ct2", "model": str(source), "quantization": quantization}
    dtype = "int8" if quantization else "fp32"
    with folder.claim(settings):
        folder.will_write("model.bin", "config.json", "vocabulary.json", "vocabulary.txt", "shared_vocabulary.json",
                          "shared_vocabulary.txt", RECORD, WORK, *TOKENIZER_FILES)
        with _work_under(folder.path) as work:
            for item in _convert_ct2(encoder, work, quantization, source).iterdir():
                shutil.move(str(item), folder.path / item.name)
        copy_tokenizer(tokenizer_source, folder.path)
        graph = ExportGraph(encoder, hidden_states=False)  # what CTranslate2 computes: the encoder's states
        graph.eval()
        tokenizer, _ = _tokenizer_of(model, tokenizer_source, None)
        deployed = RuntimeModel(folder.path, dtype=dtype, unfinished_ok=True)
        compared = ["last_hidden_state"] + (["pooler_output"] if encoder.pooler is not None else [])
        check = finish_check(check_outputs(deployed.run, graph, check_batches(tokenizer, config), compared=compared),
                             "model.bin", dtype, say)
        checks = {"model.bin": check}
        record = {**settings, "inputs": list(INPUTS), "outputs": ["last_hidden_state", "pooler_output"],
                  "pooler_output": "the model's" if encoder.pooler is not None else
                  "zeros: the checkpoint has no pooler (CTranslate2's BERT computes one; not the model's output)",
                  "checks": checks, **provenance(model, str(source), folder.path, checks),
                  "ctranslate2": ctranslate2.__version__, "torch": torch.__version__}
        write_text_atomic(folder.path / RECORD, json.dumps(record, indent=2) + "\n")
    if say:
        say(ExportResult(folder.path, record["outputs"], checks).summary()
            .replace(f"wrote {folder.path}", f"wrote {folder.path} (CTranslate2, {quantization or 'fp32 weights'})")
            + ("" if encoder.pooler is not None else
               "\n  no pooler in the checkpoint: pooler_output is zeros (CTranslate2 always computes one); use "
               "last_hidden_state"))
    return folder.path


def _ct2_encoder(source):
    """(the model minibert loads from ``source``, its encoder, its tokenizer's source) -- or the refusal of what
    CTranslate2's BERT cannot carry: a model object, a pre-LN or DeepNorm model, a task head."""
    from ..loading import read_config

    if not isinstance(source, (str, Path)):
        raise InputError(f"to_ct2 converts a checkpoint path, got {type(source).__name__}: save the model "
                         "(model.save_pretrained(dir)) and convert that folder")
    placement = read_config(source).norm_placement
    if placement != "post":
        raise InputError(f"{source} is a {placement} model: CTranslate2's BERT is post-LN only (it loads "
                         "checkpoints through transformers, whose BertModel is post-LN)")
    model, tokenizer_source = load_for_export(source)  # strict: refuses a config that does not fit the weights
    head = head_of(model)
    if head is not None:
        raise InputError(f"{source} is a {head}: CTranslate2's Encoder carries the encoder only, so its head would "
                         "be dropped; export it with minibert export onnx (the graph carries the head), or convert "
                         "the encoder alone (save model.bert with save_pretrained and convert that)")
    return model, getattr(_module(model), "bert", _module(model)), tokenizer_source


def _convert_ct2(encoder, work: Path, quantization: str | None, source) -> Path:
    """CTranslate2's converter run on ``encoder`` as minibert loaded it (``work/checkpoint``: its config, with the
    ``position_embedding_type`` the converter reads, and its weights); the converted folder, ``work/ct2``."""
    import ctranslate2

    copy = work / "checkpoint"
    copy.mkdir()
    encoder.config.to_json_file(copy / "config.json")
    data = json.loads((copy / "config.json").read_text())
    data.setdefault("position_embedding_type", "absolute")  # read by the converter; gone from transformers 5
    (copy / "config.json").write_text(json.dumps(data, indent=2))
    _write_encoder_weights(encoder, copy)
    converted = work / "ct2"
    try:
        with _quiet_transformers():
            ctranslate2.converters.TransformersConverter(str(copy)).convert(str(converted), quantization=quantization)
    except Exception as e:  # the converter's own failure, said in one line rather than its traceback
        raise CheckpointError(f"CTranslate2's converter (ctranslate2 {ctranslate2.__version__}) could not convert "
                              f"{source}: {type(e).__name__}: {e}") from None
    return converted


def _write_encoder_weights(encoder, folder: Path) -> None:
    """The weights the converter reads: the encoder exactly as minibert loaded it (so the file named is the
    file converted), under transformers' names (``loading.tensor_map``); a checkpoint without a pooler gets a
    zero one, so that the converter initialises nothing at random."""
    from safetensors.torch import save_file

    from ..loading import tensor_map

    ours = encoder.state_dict()
    H = encoder.config.hidden_size
    zero = {"pooler.dense.weight": torch.zeros(H, H), "pooler.dense.bias": torch.zeros(H)}
    state = {theirs: (ours[name] if name in ours else zero[theirs]).detach().float().contiguous()
             for theirs, name, _ in tensor_map(encoder.config, with_pooler=True)}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
