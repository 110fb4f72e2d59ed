"""Helpers for other projects' test suites: is my BERT still the BERT it should be?

    from minibert.testing import assert_bert_close

    def test_converted_model_matches_original():
        assert_bert_close("checkpoints/original", "checkpoints/converted", atol=1e-4)

Each side may be a checkpoint path or hub id (run by minibert), a ``minibert.BertModel``, or a
transformers ``BertModel`` object. On failure the AssertionError message is the per-layer table of
``minibert parity``, so the CI log says where the models part ways, not just that they do.

``assert_runtime_close(model, deployed)`` holds a deployed model -- an ONNX graph (ONNX Runtime, or OpenVINO with
``runtime="openvino"``), an OpenVINO IR, a CTranslate2 folder -- to the exact reference, layer by layer where
the runtime exposes the hidden states (``minibert export onnx --hidden-states``):

    def test_deployed_graph_matches_reference():
        assert_runtime_close("checkpoints/model", "deploy/model.onnx")             # fp32: 1e-4
        assert_runtime_close("checkpoints/model", "deploy/model_int8.onnx")        # int8: cosine >= 0.99

``fp32_noise_floor(model, batch)`` measures how far two correct fp32 computations of the same model on
the same inputs already are from each other on *this* CPU. Use it instead of a fixed 1e-5 when a
tolerance must hold on every CPU (see README, "Speed").
"""

from __future__ import annotations

import copy

import torch

from ..analysis.parity import ParityReport, compare, make_batches, minibert_runner, transformers_runner
from ..errors import InputError


def _runner(side, dtype):
    from ..model import BertModel as AnyBertModel  # the textbook class: every minibert model is one
    from ..models import BertModel

    if isinstance(side, AnyBertModel):
        return minibert_runner(side), getattr(side, "source", "minibert model"), side
    if isinstance(side, torch.nn.Module):  # transformers' BertModel (or anything with its call convention)
        return transformers_runner(side), type(side).__name__, side
    model = BertModel.from_pretrained(side, dtype=dtype)
    return minibert_runner(model), str(side), model


def bert_parity(a, b, *, texts=None, pairs=None, batches=None, tokenizer=None, atol: float = 1e-5,
                dtype=None) -> ParityReport:
    """The per-layer report for ``a`` vs ``b`` (see ``assert_bert_close``)."""
    from ..tokenizer import BertTokenizer

    run_a, name_a, _ = _runner(a, dtype)
    run_b, name_b, _ = _runner(b, dtype)
    if batches is None:
        if tokenizer is None:
            source = next((s for s in (a, b) if isinstance(s, (str, bytes)) or hasattr(s, "__fspath__")), None)
            source = source or getattr(a, "source", None) or getattr(b, "source", None)
            if source is None:
                raise InputError("no tokenizer: pass tokenizer= (or batches=) when neither side is a path")
            tokenizer = BertTokenizer.from_pretrained(source)
        batches = make_batches(tokenizer, texts=texts, pairs=pairs)
    label = str(dtype).replace("torch.", "") if dtype is not None else "as loaded"
    return compare(run_a, run_b, batches, atol=atol, name_a=name_a, name_b=name_b, dtype=label)


def assert_bert_close(a, b, *, texts=None, pairs=None, batches=None, tokenizer=None, atol: float = 1e-5,
                      dtype=None) -> ParityReport:
    """Assert that two BERT encoders agree within ``atol`` on every layer's hidden states (real tokens),
    attention probabilities and pooler output. Inputs: ``texts`` (and/or ``pairs``), ready ``batches`` of
    tokenizer output, or minibert's built-in varied set. Returns the report when they agree."""
    report = bert_parity(a, b, texts=texts, pairs=pairs, batches=batches, tokenizer=tokenizer, atol=atol,
                         dtype=dtype)
    if not report.ok:
        raise AssertionError("BERT models differ\n" + report.table())
    return report


def assert_runtime_close(model, deployed, *, runtime: str = "auto", dtype: str | None = None, texts=None,
                         pairs=None, atol: float | None = None, min_cosine: float | None = None,
                         tokenizer=None) -> ParityReport:
    """Assert that a deployed model (a path: an .onnx graph or a folder with model.onnx, an OpenVINO .xml, a
    CTranslate2 folder) agrees with ``model`` (a checkpoint path or a minibert model, run by minibert) within
    the runtime's tolerance: fp32 every layer within ``atol`` (1e-4), the final output always; int8 (a quantised
    graph, or ``dtype="int8"``) sentence vectors at cosine >= ``min_cosine`` (0.99), a task head's argmax labels
    agreeing at >= 0.9. The AssertionError carries the per-layer table and the numbers that failed; a deployed
    model that is not the reference's (another geometry, depth or head, an unfinished export, a damaged file)
    raises ``InputError`` naming what differs. The report is returned when they agree
    (``minibert.compat.runtimes``)."""
    from ..compat.runtimes import runtime_parity

    report = runtime_parity(model, deployed, runtime=runtime, dtype=dtype, texts=texts, pairs=pairs, atol=atol,
                            min_cosine=min_cosine, tokenizer=tokenizer)
    if not report.ok:
        raise AssertionError("the deployed model differs from the reference\n" + report.table())
    return report


def _real_tokens(out, attention_mask) -> torch.Tensor:
    shape = out.hidden_states[0].shape[:2]  # (B, T)
    if attention_mask is None:
        return torch.ones(shape, dtype=torch.bool)
    return torch.as_tensor(attention_mask).bool().reshape(shape)


def largest_difference(a, b, attention_mask=None, pooler: bool = True) -> float:
    """The largest absolute difference between two ``BertOutput``s: every hidden state at real tokens
    (``attention_mask`` != 0; all tokens when None) and, with ``pooler``, the pooler output of the rows
    whose first token ([CLS]) is real."""
    valid = _real_tokens(a, attention_mask)
    diffs = [(x.double() - y.double())[valid].abs().max().item() if valid.any() else 0.0
             for x, y in zip(a.hidden_states, b.hidden_states, strict=True)]
    cls_valid = valid[:, 0]
    if pooler and a.pooler_output is not None and cls_valid.any():
        diffs.append((a.pooler_output.double() - b.pooler_output.double())[cls_valid].abs().max().item())
    return max(diffs)


def fp32_noise_floor(model, batch) -> float:
    """The fp32 rounding noise of ``model`` on ``batch`` on this CPU: the largest absolute difference,
    over every hidden state at real tokens and the pooler output (where [CLS] is real), between three
    computations that are all correct --

    * the explicit attention formula (what transformers' eager attention computes, bit for bit),
    * PyTorch's fused attention kernel (what transformers' default SDPA attention computes, bit for bit),
    * the explicit formula in float64 (the "true" value, to fp32 precision)

    -- and never less than one fp32 ulp of the largest hidden value. Matrix products on different CPUs
    (Intel or AMD, AVX2, AVX-512, AMX) sum in different orders, so any other fp32 implementation, like
    ``minibert.tools.fast``, can only be held to a multiple of this, measured on the same CPU and inputs."""
    from ..model import BertModel

    if not isinstance(model, BertModel):
        raise TypeError(f"fp32_noise_floor takes a minibert BertModel, got {type(model).__name__}")
    if model.dtype != torch.float32:
        raise InputError(f"fp32_noise_floor measures fp32 models; this one is {model.dtype}")
    batch = dict(batch)
    mask = batch.get("attention_mask")
    exact = copy.deepcopy(model).double().eval()
    was_training = model.training
    model.eval()  # dropout off: the floor is about rounding
    try:
        with torch.inference_mode():
            fused = model(**batch)
            explicit = model(**batch, output_attentions=True)
            truth = exact(**batch, output_attentions=True)
    finally:
        model.train(was_training)
    floor = max(largest_difference(fused, explicit, mask), largest_difference(fused, truth, mask),
                largest_difference(explicit, truth, mask))
    valid = _real_tokens(truth, mask)
    scale = max(h.double()[valid].abs().max().item() if valid.any() else 0.0 for h in truth.hidden_states)
    return max(floor, torch.finfo(torch.float32).eps * scale)

