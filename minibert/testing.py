"""Helpers for other projects' test suites: is my BERT still the BERT it should be?

    from minibert.testing import assert_bert_close

    def test_converted_model_matches_original():
        assert_bert_close("checkpoints/original", "checkpoints/converted", atol=1e-4)

Each side may be a checkpoint path or hub id (run by minibert), a ``minibert.BertModel``, or a
transformers ``BertModel`` object. On failure the AssertionError message is the per-layer table of
``minibert parity``, so the CI log says where the models part ways, not just that they do.
"""

from __future__ import annotations

import torch

from .parity import ParityReport, compare, make_batches, minibert_runner, transformers_runner


def _runner(side, dtype):
    from .model import BertModel

    if isinstance(side, BertModel):
        return minibert_runner(side), getattr(side, "source", "minibert model"), side
    if isinstance(side, torch.nn.Module):  # transformers' BertModel (or anything with its call convention)
        return transformers_runner(side), type(side).__name__, side
    model = BertModel.from_pretrained(side, dtype=dtype)
    return minibert_runner(model), str(side), model


def bert_parity(a, b, *, texts=None, pairs=None, batches=None, tokenizer=None, atol: float = 1e-5,
                dtype=None) -> ParityReport:
    """The per-layer report for ``a`` vs ``b`` (see ``assert_bert_close``)."""
    from .tokenizer import BertTokenizer

    run_a, name_a, _ = _runner(a, dtype)
    run_b, name_b, _ = _runner(b, dtype)
    if batches is None:
        if tokenizer is None:
            source = next((s for s in (a, b) if isinstance(s, (str, bytes)) or hasattr(s, "__fspath__")), None)
            source = source or getattr(a, "source", None) or getattr(b, "source", None)
            if source is None:
                raise ValueError("no tokenizer: pass tokenizer= (or batches=) when neither side is a path")
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
