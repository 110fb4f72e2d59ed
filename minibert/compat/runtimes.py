"""Check a deployed model -- an ONNX graph run by ONNX Runtime or OpenVINO, an OpenVINO IR, a CTranslate2
folder (``compat/deployed.py`` runs them) -- against minibert's exact reference, layer by layer: ``minibert
parity --model M --against PATH`` and ``minibert.testing.assert_runtime_close``.

A comparison covers the whole model or refuses. A deployed model of another geometry (export.json's record:
layers, hidden size, heads, vocabulary, positions), another depth (the hidden states it outputs) or another
head (logits where the reference has none, a head dropped) is refused in one line, before any number is
read. The final output is always compared, whatever hidden states the runtime also exposes; the built-in
inputs reach the model's last position (``analysis.parity.reaching_batches``). An export that never finished
is refused (``deployed.export_record``).

The report is ``minibert parity``'s: one row a layer where the runtime exposes hidden states (a graph
exported with ``minibert export onnx --hidden-states`` names them ``hidden_state_0`` ... ``hidden_state_L``),
then its final state (``last_hidden_state``, or sentence-transformers' ``token_embeddings``: the row
"output (last layer)"), the pooler, the task head's outputs and the sentence vector where the runtime has them.
Differences are over real tokens. The first row over the tolerance is where the runtime parts from the
reference; a runtime without hidden states is said to show its final output only (where a difference starts
cannot be seen there).

Tolerance by dtype: fp32 ``RUNTIME_ATOL["fp32"]`` = 1e-4 -- fused kernels sum in other orders than
PyTorch (measured 2e-6 to 6e-6 from the reference on MiniLM and BERT-base; results page "runtime parity"),
and a changed weight, a lost LayerNorm epsilon or an approximated GELU shows far above it. int8: the
hidden-state rows are judged at ``RUNTIME_ATOL["int8"]`` = 2.0 (a guard against a broken graph: int8's own
drift reaches ~1.4 on MiniLM), the sentence vectors (mean of the last layer over real tokens) by their cosine,
at least ``MIN_COSINE["int8"]`` = 0.99, and a task head by its decisions: the share of argmax labels that
agree with fp32's, at least ``MIN_AGREEMENT["int8"]`` = 0.9. An ONNX graph with quantised operators is
judged as int8 unless told otherwise; CTranslate2 runs in the compute type asked (``dtype="int8"``: int8).
Every FAIL says which number failed and its bound (``ParityReport.reasons``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..analysis.parity import MIN_COSINE, ParityReport, Row, make_batches
from ..errors import InputError
from .deployed import (RUNTIME_ATOL, RUNTIMES, ROW_LABELS, RuntimeModel, detect,  # noqa: F401 (public here)
                       is_runtime_model)
from .export import (HEAD_OUTPUTS, VECTOR_OUTPUTS, ExportGraph, argmax_agreement, encoder_config, load_for_export,
                     real_differences, reference_outputs, sentence_cosines)

# ------------------------------------------------------------------------------------------ comparing
FINAL = "output (last layer)"  # the row of the deployed model's final state, always compared


def _layer(name: str) -> str | None:
    if name.startswith("hidden_state_"):
        i = int(name.rsplit("_", 1)[1])
        return "embeddings" if i == 0 else f"block {i - 1}"
    return None


def _hidden_count(names) -> int:
    return sum(1 for n in names if n.startswith("hidden_state_"))


def check_comparable(got: dict, want: dict, described: dict, record: dict | None, deployed: str, reference: str
                     ) -> list[str]:
    """Refuse (one line, naming what differs) a deployed model that is not the reference's: another geometry
    (export.json's record of what was exported), another depth (the hidden states it outputs), a head the
    other has not (logits without a head, a head dropped). Returns notes on what will not be compared."""
    from ..analysis.parity import check_same_geometry

    if record and isinstance(record.get("model_described"), dict):
        theirs = record["model_described"]
        check_same_geometry(described, theirs, reference, f"{deployed} (export.json)")
        if theirs.get("head") != described["head"] or theirs.get("num_labels") != described["num_labels"]:
            raise InputError(f"{reference} is {described['head'] or 'an encoder'}"
                             + (f" with {described['num_labels']} labels" if described["head"] else "")
                             + f", but {deployed} was exported from {theirs.get('head') or 'an encoder'}"
                             + (f" with {theirs.get('num_labels')} labels" if theirs.get("head") else "")
                             + ": not the same model")
    layers = _hidden_count(got)
    if layers and layers != described["num_hidden_layers"] + 1:
        raise InputError(f"{deployed} outputs hidden states 0..{layers - 1} ({layers - 1} blocks); {reference} has "
                         f"{described['num_hidden_layers']} blocks: not the same model (another depth)")
    heads = [n for n in HEAD_OUTPUTS if n in want]
    missing = [n for n in heads if n not in got]
    if missing:
        raise InputError(f"{reference} is a {described['head']}, but {deployed} has no {', '.join(missing)} output: "
                         "its head was dropped (export the task model itself: minibert export onnx --model "
                         "FINE_TUNED_FOLDER)")
    extra = [n for n in HEAD_OUTPUTS if n in got and n not in want]
    if extra:
        raise InputError(f"{deployed} outputs {', '.join(extra)}, a task head {reference} (an encoder) does not "
                         "have: compare it against the fine-tuned checkpoint it was exported from")
    if not any(n in got for n in VECTOR_OUTPUTS) and not heads:
        raise InputError(f"the runtime's outputs {sorted(got)} hold nothing to compare: it needs last_hidden_state, "
                         "token_embeddings, sentence_embedding or the task head's outputs")
    notes = []
    if "pooler_output" in want and "pooler_output" not in got:
        notes.append("the reference has a pooler the deployed model does not output: not compared")
    if "pooler_output" in got and "pooler_output" not in want:
        notes.append("the deployed model outputs a pooler, the reference has none: not compared"
                     + (" (export.json: zeros, CTranslate2 always computes one)" if record and
                        str(record.get("pooler_output", "")).startswith("zeros") else ""))
    return notes


def _rows_to_compare(got: dict, want: dict, blocks: int) -> list[tuple[str, str, str]]:
    """(row label, runtime output, reference output) in layer order: every hidden state the runtime has, then
    its final state whatever hidden states it also has, the pooler, the head's outputs, the sentence vector."""
    rows = [(_layer(n), n, n) for n in want if _layer(n) and n in got]
    final = next((n for n in ("last_hidden_state", "token_embeddings") if n in got), None)
    if final is not None:
        rows.append((FINAL, final, f"hidden_state_{blocks}"))
    for name, label in ROW_LABELS.items():
        if name in got and name in want:
            rows.append((label, name, name))
    return rows


def runtime_parity(model, against, *, runtime: str = "auto", dtype: str | None = None, texts=None, pairs=None,
                   atol: float | None = None, min_cosine: float | None = None, tokenizer=None,
                   threads: int | None = None) -> ParityReport:
    """The per-layer report of a deployed model ``against`` (a path: see ``detect``) beside the reference
    ``model`` (a path or a minibert model), on ``texts`` / ``pairs`` or minibert's varied parity set, which
    reaches the model's last position. A deployed model of another geometry, depth or head is refused
    (``check_comparable``); the final output is compared whatever hidden states the runtime also has."""
    from ..tokenizer import BertTokenizer
    from .export import describe_model, model_fingerprint, read_fingerprints

    deployed = RuntimeModel(against, runtime, dtype, threads)
    source = str(model) if isinstance(model, (str, Path)) else getattr(model, "source", None)
    reads = read_fingerprints(model) if isinstance(model, (str, Path)) else {}
    if isinstance(model, (str, Path)):
        model, _ = load_for_export(model)
    if tokenizer is None:
        if source is None:
            raise InputError("no tokenizer: pass tokenizer= when the model is not a path")
        tokenizer = BertTokenizer.from_pretrained(Path(source).parent if Path(source).is_file() else source)
    config = encoder_config(model)
    batches = make_batches(tokenizer, texts=texts, pairs=pairs) if (texts or pairs) else \
        make_batches(tokenizer, max_length=config.max_position_embeddings)
    graph = ExportGraph(model, hidden_states=True)  # the reference: every output, every hidden state
    atol = RUNTIME_ATOL[deployed.dtype] if atol is None else float(atol)
    training = graph.inner.training
    graph.eval()
    try:
        report = _compare(deployed, graph, batches, describe_model(model), atol, source or "minibert model",
                          min_cosine)
    finally:
        graph.inner.train(training)  # the model as it was given
    report.positions = config.max_position_embeddings
    weights = model_fingerprint(model)
    report.fingerprints = {"reference": f"weights sha256 {weights[:16]}"
                           + "".join(f", {Path(f).name} {h[:16]}" for f, h in reads.items())}
    report.fingerprints["deployed"] = _deployed_fingerprint(deployed)
    exported_from = (deployed.record or {}).get("weights_sha256")
    if exported_from and exported_from != weights:
        report.notes.append(f"the deployed model was exported from other weights (sha256 {exported_from[:16]}) than "
                            f"the reference's ({weights[:16]}): the numbers above say whether they compute the same")
    return report


def _deployed_fingerprint(deployed: RuntimeModel) -> str:
    from ..textfiles import file_sha256

    file = deployed.file / "model.bin" if deployed.file.is_dir() else deployed.file
    files = [file] + ([file.with_suffix(".bin")] if file.suffix == ".xml" and file.with_suffix(".bin").is_file()
                      else [])
    hashes = {f: file_sha256(f) for f in files}  # each file read once: a BERT-base graph is 440 MB
    text = ", ".join(f"{f.name} sha256 {h[:16]}" for f, h in hashes.items())
    written = ((deployed.record or {}).get("written") or {}).get(file.name)
    if written is not None:
        text += " (as exported)" if written == hashes[file] else " (changed since export.json recorded it)"
    return text


def _compare(deployed: RuntimeModel, graph, batches, described: dict, atol: float, name: str,
             min_cosine: float | None) -> ParityReport:
    from ..analysis.parity import MIN_AGREEMENT, longest_input

    blocks = described["num_hidden_layers"]
    stats: dict[str, list] = {}  # row -> [max, sum, count]
    cosines, count, order, notes = [], 0, [], []
    agree = decisions = 0
    for index, batch in enumerate(batches):
        want, got = reference_outputs(graph, batch), deployed.run(batch)
        if index == 0:
            notes = check_comparable(got, want, described, deployed.record, deployed.name, name)
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
        for head in (n for n in HEAD_OUTPUTS if n in want):
            a, n = argmax_agreement(head, got[head], want[head], mask)
            agree, decisions = agree + a, decisions + n
        last_got = next((got[n] for n in (f"hidden_state_{blocks}", "last_hidden_state", "token_embeddings")
                         if n in got), None)
        if last_got is not None:
            cosines.append(sentence_cosines(np.asarray(last_got), want[f"hidden_state_{blocks}"], mask))
    every = np.concatenate(cosines) if cosines else np.zeros(0)
    if min_cosine is not None and not every.size:
        raise InputError(f"--min-cosine {min_cosine:g}: {deployed.name} outputs no hidden state to make a sentence "
                         "vector from (only a task head's outputs), so there is no cosine to judge; its head is "
                         "judged by its decisions (argmax agreement)")
    dtype = deployed.dtype
    need = (MIN_COSINE.get(dtype) if every.size else None) if min_cosine is None else float(min_cosine)
    report = ParityReport(a=name, b=deployed.name, dtype=dtype, atol=atol, inputs=count, longest=longest_input(batches),
                          cosine_min=float(every.min()) if every.size else None,
                          cosine_mean=float(every.mean()) if every.size else None, min_cosine=need,
                          agreement=agree / decisions if decisions else None,
                          min_agreement=MIN_AGREEMENT.get(dtype) if decisions else None)
    report.rows = [Row(label, stats[label][0], stats[label][1] / max(stats[label][2], 1)) for label in order]
    report.notes = notes
    if not any(label.startswith("block") for label in order):
        report.notes.append(f"{deployed.name} exposes its final output only: a difference there may start in any "
                            f"block up to {blocks - 1}; export with minibert export onnx --hidden-states to see "
                            "where it starts")
    return report
