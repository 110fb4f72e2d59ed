"""The benchmark harness must compare like with like: its padded batches have the stated share of real
tokens, and its torch nn.TransformerEncoder peer computes the same function as minibert."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from conftest import ROOT, random_batch_for
from minibert import BertConfig, BertModel


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_model", ROOT / "benchmarks" / "bench_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("B,T,fraction", [(16, 128, 0.38), (32, 128, 0.5), (8, 512, 0.4), (4, 16, 1.0)])
def test_padded_batches_have_the_stated_real_fraction(bench, B, T, fraction):
    lengths = bench.lengths_for(B, T, fraction)
    assert len(lengths) == B and max(lengths) == T and min(lengths) >= min(T, round(0.1 * T))
    assert abs(sum(lengths) / (B * T) - fraction) <= 1 / (B * T)
    batch = bench.make_batch(B, T, fraction, vocab=30522)
    assert batch["attention_mask"].sum(1).tolist() == lengths


def test_torch_encoder_peer_computes_the_same_function(bench):
    config = BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128)
    torch.manual_seed(0)
    model = BertModel(config).eval()
    encoder = bench.torch_encoder_from(model)
    batch = random_batch_for(dict(vocab_size=300), lengths=(9, 4, 6))
    with torch.inference_mode():
        ours = model(**batch).last_hidden_state
        x = model.embeddings(batch["input_ids"], torch.zeros_like(batch["input_ids"]),
                             torch.arange(9).expand(3, 9))
        theirs = encoder(x, src_key_padding_mask=~batch["attention_mask"].bool())
    valid = batch["attention_mask"].bool()
    assert (ours - theirs)[valid].abs().max() <= 1e-5


def test_the_gpu_bench_runs_end_to_end_in_its_dry_mode(tmp_path, minilm_dir, sentences_dir):
    """benchmarks/bench_gpu.py --dry: the GPU bench's every step but the CUDA tests, on this CPU with a tiny
    model (what CI can run; the GPU figures come from a lent GPU). It writes a page naming the machine."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--dry", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_dry.json").read_text())
    assert len(result["batches"]) == 5 and all(set(b["ratio"]) >= {"readable", "fast", "fast, all states"}
                                               for b in result["batches"])
    assert result["routes"]["fp32"]["attention"] == "loop" and result["skipped"] == []
    assert [row["texts"] for row in result["embed"]] == [64]
    text = (tmp_path / "gpu_dry.md").read_text()
    assert "a dry run: a tiny model on a CPU, no GPU figure" in text and "torch " in text
    refused = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--steps", "nope", "--dry"],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert refused.returncode == 2 and "unknown ['nope']" in refused.stderr
