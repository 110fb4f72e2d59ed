"""Issue 16, part 2: int8 dynamic quantisation (dtype="int8") -- what is quantised, the fast path equal to
the readable one, batch invariance, and the error bounds against fp32 that hold on every x86 CPU (integer
products are exact; only the fp32 rescaling rounds)."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from minibert import BertForSequenceClassification, BertModel, BertTokenizer, InputError
from minibert.analysis.parity import DEFAULT_TEXTS, run_parity
from minibert.cli import main
from minibert.quantize import Int8Linear
from minibert.tools import fast


@pytest.fixture(scope="module")
def int8_minilm(minilm_dir):
    return BertModel.from_pretrained(minilm_dir, dtype="int8"), BertTokenizer.from_pretrained(minilm_dir)


def test_what_int8_quantises(int8_minilm, minilm_dir):
    model, _ = int8_minilm
    block = model.encoder.blocks[0]
    for layer in (block.attn.query, block.attn.key, block.attn.value, block.attn.output, block.ffn.dense_in,
                  block.ffn.dense_out):
        assert isinstance(layer, Int8Linear) and layer.qweight.dtype == torch.qint8
        assert layer.qweight.qscheme() == torch.per_channel_affine and layer.bias.dtype == torch.float32
        assert not layer.qweight.q_per_channel_zero_points().any()  # symmetric: zero point 0 on every row
    assert model.embeddings.word.weight.dtype == torch.float32 and isinstance(model.pooler.dense, nn.Linear)
    assert isinstance(block.attn_norm, nn.LayerNorm) and model.quantized == "int8"
    fp32 = BertModel.from_pretrained(minilm_dir)
    w = fp32.encoder.blocks[0].attn.query.weight
    step = w.abs().amax(1, keepdim=True) / 127  # per output channel: the error is at most half a step
    assert ((block.attn.query.dequantized_weight() - w).abs() <= step / 2 + 1e-7).all()
    with pytest.raises(InputError, match="int8-quantised.*inference only"):
        model.save_pretrained("never-written")
    with pytest.raises(InputError, match="runs on the CPU"):
        BertModel.from_pretrained(minilm_dir, dtype="int8", device="meta")


def test_fast_path_equals_readable_and_rows_are_independent(int8_minilm):
    model, tok = int8_minilm
    run = fast.prepare(model)
    batch = tok(DEFAULT_TEXTS[:5], padding=True, return_tensors="pt")
    with torch.inference_mode():
        together = run(**batch).last_hidden_state
        for i, text in enumerate(DEFAULT_TEXTS[:5]):
            one = tok([text], return_tensors="pt")
            alone = run(**one).last_hidden_state[0]
            n = alone.shape[0]
            assert torch.equal(alone, together[i, :n])  # activation scales are per sequence: no neighbour effect
            readable = model(**one).last_hidden_state[0]  # unpadded: the same quantised products
            assert (readable - alone).abs().max() <= 1e-5


def test_int8_error_bounds_against_fp32(minilm_dir, base_random_dir, tmp_path):
    """Measured here (AMD EPYC, AVX2; fbgemm): MiniLM cosine min 0.947 / mean 0.976,
    BERT-base geometry (random weights) 0.995 / 0.997; the bounds leave room for other x86 CPUs."""
    report = run_parity(str(minilm_dir), dtype="int8")
    assert report.rows[0].hidden_max == 0  # embeddings are not quantised
    assert max(r.hidden_max for r in report.rows) < 2.0
    assert report.cosine_mean > 0.96 and report.cosine_min > 0.93
    assert not report.ok  # MiniLM misses the 0.99 sentence-cosine goal (README, benchmarks/results/int8.md)
    base = tmp_path / "base"
    shutil.copytree(base_random_dir, base)
    shutil.copy(minilm_dir / "vocab.txt", base / "vocab.txt")
    report = run_parity(str(base), dtype="int8")
    assert report.ok and report.cosine_min >= 0.99 and len(report.rows) == 14


def test_parity_cli_int8(minilm_dir, capsys):
    assert main(["parity", "--model", str(minilm_dir), "--dtype", "int8"]) == 1
    out = capsys.readouterr().out
    assert "minibert int8" in out and "sentence vectors (mean of the last layer): cosine min 0.9" in out
    assert "needs >= 0.99" in out and "FAIL" in out
    with pytest.raises(SystemExit):
        main(["parity", "--model", str(minilm_dir), "--dtype", "int8", "--against", str(minilm_dir)])


def test_task_model_in_int8(tmp_path, minilm_dir):
    model = BertForSequenceClassification.from_encoder(minilm_dir, labels=["a", "b"], seed=0)
    model.save_pretrained(tmp_path)
    shutil.copy(minilm_dir / "vocab.txt", tmp_path / "vocab.txt")
    q = BertForSequenceClassification.from_pretrained(tmp_path, dtype="int8")
    assert isinstance(q.bert.encoder.blocks[0].ffn.dense_in, Int8Linear) and isinstance(q.classifier, nn.Linear)
    fp32 = q.__class__.from_pretrained(tmp_path)
    texts = ["a river bank", "the bank raised its rates"]
    got, want = q.predict(texts), fp32.predict(texts)
    for g, w in zip(got, want):
        assert abs(g["scores"]["a"] - w["scores"]["a"]) < 0.1
